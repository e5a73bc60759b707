"""One adapter process and the JSON-RPC connection the proxy holds to it.

The connection owns the id space the adapter sees: requests the gateway sent
and requests the proxy makes itself draw from one counter, so they can never
collide. What an answer means (forward it, or wake an internal caller) is kept
in ``pending`` next to the id it was sent under.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field

import anyio
import anyio.abc
from msgspec import UNSET

from acp_proxy import jsonrpc
from acp_proxy.config import BackendConfig, MissingVariable, ShutdownConfig, expand
from acp_proxy.jsonrpc import LineReader, Message, RequestId
from acp_proxy.ownership.signals import OwnedGroup

log = logging.getLogger("acp_proxy.adapter")

MARKER_VARIABLE = "ACP_PROXY_LEASE"
KILL_WAIT = 2.0
"""How long to wait for SIGKILLed processes to disappear before giving up on them."""
GROUP_POLL_INTERVAL = 0.02


def new_marker() -> str:
    """``ACP_PROXY_LEASE=<random>``: put in the adapter's environment, inherited by its tree."""
    return f"{MARKER_VARIABLE}={secrets.token_hex(8)}.{secrets.token_hex(8)}"


class SpawnError(Exception):
    """The adapter could not be started; the message says why in a user's terms."""


class AdapterGone(Exception):
    """The adapter exited or closed its stdout before answering."""

    def __init__(self, returncode: int | None) -> None:
        self.returncode = returncode
        super().__init__(f"adapter exited ({describe_exit(returncode)})")


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "exit status unknown"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


@dataclass(slots=True)
class InternalCall:
    """A request the proxy itself made; the answer is parked here for the caller."""

    done: anyio.Event = field(default_factory=anyio.Event)
    response: Message | None = None


@dataclass(slots=True)
class PendingCall:
    """A request sent to the adapter and not yet answered."""

    method: str
    gateway_id: RequestId = None
    internal: InternalCall | None = None


def spawn_environment(backend: BackendConfig, base: Mapping[str, str]) -> dict[str, str]:
    """The adapter's environment: ours plus the backend's, ``${VAR}`` expanded from ours."""
    env = dict(base)
    for key, template in backend.env.items():
        env[key] = expand(template, base)
    return env


class Adapter:
    """A running adapter: its process, its stdin, its stdout lines, its pending calls."""

    def __init__(
        self,
        backend: BackendConfig,
        process: anyio.abc.Process,
        max_line_bytes: int,
        marker: str,
    ) -> None:
        assert process.stdin is not None
        assert process.stdout is not None
        self.backend = backend
        self.process = process
        self.marker = marker
        self.group = OwnedGroup(process.pid, marker)
        self.lines = LineReader(process.stdout, max_line_bytes)
        self.pending: dict[int, PendingCall] = {}
        self.returncode: int | None = None
        self.gone = False
        self.drained = anyio.Event()
        self._stop_lock = anyio.Lock()
        self._stopped = False
        self._stdin = jsonrpc.LineWriter(process.stdin)
        self._next_id = 0

    @property
    def pid(self) -> int:
        return self.process.pid

    @classmethod
    async def spawn(
        cls,
        backend: BackendConfig,
        *,
        max_line_bytes: int,
        environ: Mapping[str, str] | None = None,
    ) -> Adapter:
        """Start the backend's command in a new session (own process group).

        The argv list is executed directly, never through a shell. The adapter's
        stderr is the proxy's stderr, so its logs reach whoever reads ours.
        """
        base = dict(os.environ if environ is None else environ)
        marker = new_marker()
        try:
            argv = [expand(arg, base) for arg in backend.command]
            env = spawn_environment(backend, base)
            key, _, value = marker.partition("=")
            env[key] = value
        except MissingVariable as exc:
            raise SpawnError(f"backend {backend.name!r}: {exc}") from None
        try:
            process = await anyio.open_process(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=None,
                cwd=backend.cwd,
                env=env,
                start_new_session=True,
            )
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise SpawnError(f"cannot start backend {backend.name!r} ({argv[0]}): {reason}") from exc
        log.info("adapter started: backend=%s pid=%d argv=%s", backend.name, process.pid, argv)
        return cls(backend, process, max_line_bytes, marker)

    # --- requests ---------------------------------------------------------------

    def register(self, method: str, gateway_id: RequestId = None) -> int:
        """Reserve the next adapter-side id for a request and remember what it was."""
        call_id = self._next_id
        self._next_id += 1
        self.pending[call_id] = PendingCall(method, gateway_id)
        return call_id

    async def send(self, data: bytes) -> None:
        """Write complete lines to the adapter's stdin; ``AdapterGone`` if it is closed."""
        if self.gone:
            raise AdapterGone(self.returncode)
        try:
            await self._stdin.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise AdapterGone(self.returncode) from None

    async def call(self, method: str, params: object = UNSET) -> Message:
        """Make a request of the proxy's own and wait for the answer.

        Raises ``AdapterGone`` if the adapter exits first. Callers bound the wait
        with a cancel scope; a cancelled call forgets its id, so a late answer is
        dropped rather than misrouted.
        """
        call_id = self.register(method)
        internal = InternalCall()
        self.pending[call_id].internal = internal
        try:
            await self.send(jsonrpc.request(call_id, method, params))
            await internal.done.wait()
        finally:
            self.pending.pop(call_id, None)
        if internal.response is None:
            raise AdapterGone(self.returncode)
        return internal.response

    def take_pending(self, call_id: object) -> PendingCall | None:
        if not isinstance(call_id, int) or isinstance(call_id, bool):
            return None
        return self.pending.pop(call_id, None)

    def find_gateway_call(self, gateway_id: RequestId) -> int | None:
        """The adapter-side id of an in-flight gateway request (newest if reused)."""
        found = None
        for call_id, call in self.pending.items():
            if call.internal is None and call.gateway_id == gateway_id:
                found = call_id
        return found

    def mark_gone(self) -> list[PendingCall]:
        """The adapter can answer nothing more: release internal callers, return the rest."""
        self.gone = True
        calls = list(self.pending.values())
        self.pending.clear()
        for call in calls:
            if call.internal is not None:
                call.internal.done.set()
        return [call for call in calls if call.internal is None]

    # --- process ----------------------------------------------------------------

    async def wait_exit(self, timeout: float) -> int | None:
        """The exit status, waiting at most ``timeout`` seconds for it."""
        if self.returncode is None:
            with anyio.move_on_after(timeout):
                self.returncode = await self.process.wait()
        return self.returncode

    async def stop(self, shutdown: ShutdownConfig) -> int | None:
        """End the adapter and its process group: stdin EOF, then SIGTERM, then SIGKILL.

        The adapter gets ``stdin_grace`` to exit on EOF; whatever is left of its
        group then (the adapter itself, or children it left behind) gets SIGTERM
        and ``term_grace``, then SIGKILL. Idempotent, and shielded: teardown must
        finish once begun.
        """
        with anyio.CancelScope(shield=True):
            async with self._stop_lock:
                if not self._stopped:
                    await self._close_stdin()
                    await self.wait_exit(shutdown.stdin_grace)
                    await self._terminate_group(shutdown.term_grace)
                    await self.wait_exit(KILL_WAIT)
                    self.group.close()
                    self._stopped = True
                    log.info("adapter pid=%d stopped (%s)", self.pid, describe_exit(self.returncode))
        return self.returncode

    async def _terminate_group(self, term_grace: float) -> None:
        leader_running = self.returncode is None
        if not self.group.signal(signal.SIGTERM):
            return
        self.group.signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        if leader_running:
            log.info("adapter pid=%d still running after stdin EOF: sent SIGTERM", self.pid)
        else:
            log.info("adapter pid=%d left processes in its group: sent SIGTERM", self.pid)
        if await self._group_gone_within(term_grace):
            return
        if self.group.signal(signal.SIGKILL):
            log.warning("adapter pid=%d group ignored SIGTERM: sent SIGKILL", self.pid)
            await self._group_gone_within(KILL_WAIT)

    async def _group_gone_within(self, timeout: float) -> bool:
        with anyio.move_on_after(timeout):
            while self.group.provably_ours():
                await anyio.sleep(GROUP_POLL_INTERVAL)
            return True
        return False

    async def _close_stdin(self) -> None:
        with contextlib.suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            await self._stdin.aclose()

    async def close_output(self) -> None:
        """Stop reading the adapter's stdout (a lingering descendant may hold it open)."""
        if self.process.stdout is not None:
            with contextlib.suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
                await self.process.stdout.aclose()
