"""One adapter process and the JSON-RPC connection the proxy holds to it (what the process is to the
sessions is its ``tenancy``, ``pool.tenancy``; the connection decides nothing with it).

The connection owns the id space the adapter sees: requests the gateway sent
and requests the proxy makes itself draw from one counter, so they can never
collide. What an answer means (forward it, or wake an internal caller) is kept
in ``pending`` next to the id it was sent under.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress

import anyio
import anyio.abc
import msgspec
from msgspec import UNSET, Raw, UnsetType

from acp_proxy.concurrency import Changes
from acp_proxy.config import BackendConfig, MissingVariable, ShutdownConfig, expand
from acp_proxy.logs import ids
from acp_proxy.ownership.owner import Owner
from acp_proxy.ownership.proctable import TableUnavailable
from acp_proxy.ownership.supervised import SupervisedProcess, WrapperFailed
from acp_proxy.pool.tenancy import Tenancy
from acp_proxy.pool.usage import Usage
from acp_proxy.protocol import jsonrpc
from acp_proxy.protocol.acp import AgentCapabilities, rewrite_session_id, session_of
from acp_proxy.protocol.errors import describe_exit
from acp_proxy.protocol.jsonrpc import LineReader, Message, RequestId
from acp_proxy.protocol.methods import Effect, Method, facts
from acp_proxy.tasks.turn import Turn
from acp_proxy.trace import Trace

log = logging.getLogger("acp_proxy.adapter")


class SpawnError(Exception):
    """The adapter could not be started; the message says why in a user's terms."""


class AdapterGone(Exception):
    """The adapter exited or closed its stdout before answering."""

    def __init__(self, returncode: int | None) -> None:
        self.returncode = returncode
        super().__init__(f"adapter exited ({describe_exit(returncode)})")


class InternalCall(msgspec.Struct):
    """A request the proxy itself made; the answer is parked here for the caller."""

    done: anyio.Event = msgspec.field(default_factory=anyio.Event)
    response: Message | None = None


class PendingCall(msgspec.Struct):
    """A request sent to the adapter and not yet answered."""

    method: str
    gateway_id: RequestId = None
    internal: InternalCall | None = None
    session_id: str | None = None
    """For a request that names the session it opens or ends on the adapter (load, resume, close)."""
    on_answer: Callable[[Message], Message | None] | None = None
    """Called with the adapter's answer before it is forwarded (the proxy's bookkeeping); what it
    returns, if anything, is forwarded instead."""
    turn: Turn | None = None
    """For a gateway's ``session/prompt``: the task it is."""


def spawn_environment(backend: BackendConfig, base: Mapping[str, str]) -> dict[str, str]:
    """The adapter's environment: ours plus the backend's, ``${VAR}`` expanded from ours."""
    env = dict(base)
    for key, template in backend.env.items():
        env[key] = expand(template, base)
    return env


class Adapter:
    """A running adapter: its supervised process, its stdin, its stdout lines, its pending calls."""

    def __init__(self, backend: BackendConfig, supervised: SupervisedProcess, max_line_bytes: int) -> None:
        self.backend = backend
        self.supervised = supervised
        self.lines = LineReader(supervised.stdout, max_line_bytes)
        self.trace: Trace | None = None
        """Where what is written to it is recorded (``--trace``), if anywhere: set by the pool."""
        self.pending: dict[int, PendingCall] = {}
        self.gone = False
        self.can_close_sessions = False
        self.capabilities = AgentCapabilities()
        self.open_sessions: set[str] = set()
        self.drained = anyio.Event()
        self.answered = Changes()
        """Notified whenever a request in ``pending`` is answered or given up, the gateway answers one of its requests,
        or the adapter is gone."""
        self._stdin = jsonrpc.LineWriter(supervised.stdin)
        self._next_id = 0
        # What the pool and the router need to know about this process.
        self.gateway_session: str | None = None
        """The stable id of the session this process serves (``None``: a spare)."""
        self.adapter_session: str | None = None
        """The id the adapter knows that session under, if it differs from the stable one."""
        self.stopping = False
        """``stop`` has begun: if it exits now, it is because we are ending it."""
        self.usage = Usage()
        """The pool's account of this process (``pool.usage``): only the pool assigns its fields."""
        self.tenancy = Tenancy()
        """What this process is to the proxy's sessions (``pool.tenancy``): the connection decides nothing with it."""

    # The rest of the proxy changes what a process is to it through these methods, never by
    # assigning its fields (tests/test_layers.py holds every module outside pool/ to that).

    def release_to_spare(self) -> None:
        """A session/new, load or restore on this process did not take: it serves no session again."""
        self.assign(None)
        self.tenancy.unclaim()
        self.tenancy.swallow(False)

    def assign(self, gateway_session: str | None, adapter_session: str | None = None) -> None:
        """It is to serve ``gateway_session``, known to it as ``adapter_session`` (default: the same id)."""
        self.gateway_session = gateway_session
        self.adapter_session = gateway_session if adapter_session is None else adapter_session

    def serve(self, gateway_session: str, adapter_session: str) -> None:
        """From now on it serves ``gateway_session`` (its only open session): no longer claimed."""
        self.assign(gateway_session, adapter_session)
        self.open_sessions = {adapter_session}
        self.tenancy.unclaim()

    def renamed(self, adapter_session: str) -> None:
        """The adapter now knows its session under ``adapter_session`` (restored afresh)."""
        self.adapter_session = adapter_session

    @property
    def rewrites_session(self) -> bool:
        """Whether ``sessionId`` must be rewritten on this connection (after a fallback gave a new id)."""
        return self.adapter_session is not None and self.adapter_session != self.gateway_session

    @property
    def turn_in_flight(self) -> bool:
        return any(call.internal is None for call in self.pending.values())

    async def until_call_answered(self, call_id: int) -> None:
        """Until the request sent under ``call_id`` is answered (or given up), or the process is gone."""
        await self.answered.until(lambda: self.gone or call_id not in self.pending)

    async def until_answered(self) -> None:
        """Until the gateway's requests in flight on this process are answered, or it is gone."""
        await self.answered.until(lambda: self.gone or not self.turn_in_flight)

    @property
    def replaying(self) -> bool:
        """A ``session/load`` is in flight: the updates it streams before its answer are history."""
        return any(call.method == Method.LOAD for call in self.pending.values())

    @property
    def working_in_background(self) -> bool:
        return self.usage.working_in_background

    def heard_working(self, quiet_after: float) -> None:
        """It reported work with no turn running: busy until ``quiet_after`` passes without more."""
        self.usage.heard_working(quiet_after)

    @property
    def pid(self) -> int:
        """The adapter's own pid (its wrapper's until the wrapper has reported)."""
        return self.supervised.adapter_pid or self.supervised.process.pid

    @property
    def returncode(self) -> int | None:
        return self.supervised.returncode

    def still_running(self) -> bool:
        """Whether the adapter process itself still runs: its wrapper outlives it by a teardown, so
        the wrapper's exit status alone would count an adapter that already crashed as running."""
        if self.supervised.returncode is not None:
            return False
        lease = self.supervised.lease
        if lease.adapter_pid is None:
            return True
        try:
            info = self.supervised.owner.table.info(lease.adapter_pid)
        except TableUnavailable:
            return True
        ticks = lease.adapter_start_ticks
        return info is not None and not info.zombie and (ticks is None or info.start_ticks == ticks)

    @staticmethod
    def launch(
        backend: BackendConfig,
        *,
        owner: Owner,
        shutdown: ShutdownConfig,
        environ: Mapping[str, str] | None = None,
        session_key: str | None = None,
        hold: Sequence[int] = (),
        memory_limit: int | None = None,
    ) -> SupervisedProcess:
        """Start the backend's command under a wrapper and a lease; needs no event loop.

        ``hold``: the install's slot locks, kept by the wrapper for as long as the tree lives.
        ``memory_limit``: the session's ``session_kill_memory``, for the tree's cgroup (where it has
        the memory controller).

        The argv list is executed directly, never through a shell. The adapter's
        stderr is the proxy's stderr, so its logs reach whoever reads ours.
        """
        base = dict(os.environ if environ is None else environ)
        try:
            argv = [expand(arg, base) for arg in backend.command]
            env = spawn_environment(backend, base)
        except MissingVariable as exc:
            raise SpawnError(f"backend {backend.name!r}: {exc}") from None
        try:
            return SupervisedProcess.launch(
                owner,
                backend=backend.name,
                argv=argv,
                recorded_argv=backend.command,
                env=env,
                cwd=backend.cwd,
                term_grace=shutdown.term_grace,
                session_key=session_key,
                hold=hold,
                memory_limit=memory_limit,
            )
        except WrapperFailed as exc:
            raise SpawnError(f"cannot start backend {backend.name!r} ({argv[0]}): {exc}") from None

    @classmethod
    async def attach(cls, backend: BackendConfig, supervised: SupervisedProcess, max_line_bytes: int) -> Adapter:
        """Wait until a launched adapter is running, and connect to it."""
        try:
            await supervised.ready()
        except WrapperFailed as exc:
            raise SpawnError(f"cannot start backend {backend.name!r} ({supervised.lease.argv[0]}): {exc}") from None
        lease = supervised.lease
        log.info(
            "adapter started: %s pid %s, lease %s: %s",
            backend.name,
            lease.adapter_pid,
            lease.lease_id,
            list(lease.argv),
            extra=ids(lease=lease.lease_id, backend=backend.name, pid=lease.adapter_pid),
        )
        return cls(backend, supervised, max_line_bytes)

    # --- requests ---------------------------------------------------------------

    def register(self, method: str, gateway_id: RequestId = None, params: Raw | UnsetType = UNSET) -> int:
        """Reserve the next adapter-side id for a request and remember what it was."""
        call_id = self._next_id
        self._next_id += 1
        session_id = session_of(params) if facts(method).effect is not Effect.NONE else None
        self.pending[call_id] = PendingCall(method, gateway_id, session_id=session_id)
        return call_id

    async def forward(
        self,
        msg: Message,
        on_answer: Callable[[Message], Message | None] | None = None,
        *,
        turn: Turn | None = None,
    ) -> int:
        """Send a gateway request on under a fresh id (``sessionId`` rewritten if need be); that id.

        An adapter that is gone is not an error here: the relay answers every pending
        call once it sees the adapter's output end.
        """
        assert isinstance(msg.method, str)
        assert msg.id is not UNSET
        call_id = self.register(msg.method, msg.id, msg.params)
        call = self.pending[call_id]
        call.on_answer = on_answer
        call.turn = turn
        self.usage.used()
        if turn is not None:
            self.usage.turn_started()
        out = Message(jsonrpc="2.0", id=call_id, method=msg.method, params=self.to_adapter_ids(msg.params))
        with suppress(AdapterGone):
            await self.send(jsonrpc.encode(out))
        return call_id

    def note_answer(self, call: PendingCall, msg: Message) -> None:
        """Keep track of what the adapter can close and which sessions it has open."""
        if msg.result is UNSET:
            return
        if call.method == Method.INITIALIZE:
            self.capabilities = AgentCapabilities.from_initialize(msg.result)
            self.can_close_sessions = self.capabilities.close
        elif call.method == Method.NEW:
            session_id = session_of(msg.result)
            if session_id is not None:
                self.open_sessions.add(session_id)
        elif call.session_id is not None:
            if facts(call.method).effect is Effect.ENDS:
                self.open_sessions.discard(call.session_id)
            else:
                self.open_sessions.add(call.session_id)

    async def send(self, data: bytes) -> None:
        """Write complete lines to the adapter's stdin; ``AdapterGone`` if it is closed."""
        if self.gone:
            raise AdapterGone(self.returncode)
        if self.trace is not None:
            self.trace.lines("proxy>agent", data, pid=self.pid, backend=self.backend.name)
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

    async def pass_on(self, msg: Message, line: bytes) -> None:
        """Send a gateway notification on: the very line it came as, or with ``sessionId`` rewritten."""
        data = line + b"\n"
        if self.rewrites_session:
            msg.params = self.to_adapter_ids(msg.params)
            data = jsonrpc.encode(msg)
        await self.send(data)

    def to_adapter_ids(self, params: Raw | UnsetType) -> Raw | UnsetType:
        """``params`` with the stable ``sessionId`` replaced by the adapter's own, where they differ."""
        if self.rewrites_session and self.gateway_session is not None and self.adapter_session is not None:
            return rewrite_session_id(params, self.gateway_session, self.adapter_session)
        return params

    def take_call_of(self, turn: Turn) -> PendingCall | None:
        """Forget the prompt request of ``turn`` (to answer it ourselves)."""
        call_id = next((key for key, call in self.pending.items() if call.turn is turn), None)
        return None if call_id is None else self.take_pending(call_id)

    def take_pending(self, call_id: object) -> PendingCall | None:
        if not isinstance(call_id, int) or isinstance(call_id, bool):
            return None
        call = self.pending.pop(call_id, None)
        if call is not None:
            self.answered.notify()
        return call

    def find_gateway_call(self, gateway_id: RequestId) -> int | None:
        """The adapter-side id of an in-flight gateway request (newest if reused)."""
        found = None
        for call_id, call in self.pending.items():
            if call.internal is None and call.gateway_id == gateway_id:
                found = call_id
        return found

    def take_gateway_calls(self) -> list[PendingCall]:
        """Forget the gateway's in-flight requests (to answer them ourselves); keep our own."""
        taken = {call_id: call for call_id, call in self.pending.items() if call.internal is None}
        for call_id in taken:
            del self.pending[call_id]
        self.answered.notify()
        return list(taken.values())

    def mark_gone(self) -> list[PendingCall]:
        """The adapter can answer nothing more: release internal callers, return the rest."""
        self.gone = True
        calls = list(self.pending.values())
        self.pending.clear()
        for call in calls:
            if call.internal is not None:
                call.internal.done.set()
        self.answered.notify()
        return [call for call in calls if call.internal is None]

    # --- process ----------------------------------------------------------------

    async def wait_exit(self, timeout: float) -> int | None:
        """The adapter's exit status, waiting at most ``timeout`` seconds for it."""
        return await self.supervised.wait_exit(timeout)

    async def stop(self, shutdown: ShutdownConfig) -> int | None:
        """End the adapter and its whole tree; idempotent.

        First ``session/close`` for each session it has open, if it advertises
        that (bounded by ``close_timeout``), then ``SupervisedProcess.stop``.
        """
        # Only if it still runs: one that crashed by itself is not being ended by us.
        self.stopping = self.stopping or self.still_running()
        with anyio.CancelScope(shield=True):
            await self.close_sessions(shutdown.close_timeout)
        return await self.supervised.stop(stdin_grace=shutdown.stdin_grace, term_grace=shutdown.term_grace)

    async def close_sessions(self, timeout: float) -> None:
        if self.gone or not self.can_close_sessions or not self.open_sessions:
            return
        with anyio.move_on_after(timeout):
            async with anyio.create_task_group() as tasks:
                for session_id in sorted(self.open_sessions):
                    tasks.start_soon(self._close_session, session_id)

    async def _close_session(self, session_id: str) -> None:
        try:
            answer = await self.call(Method.CLOSE, {"sessionId": session_id})
        except AdapterGone:
            return
        if answer.error is UNSET:
            self.open_sessions.discard(session_id)

    async def close_output(self) -> None:
        """Stop reading the adapter's stdout (a lingering descendant may hold it open)."""
        await self.supervised.close_stdout()
