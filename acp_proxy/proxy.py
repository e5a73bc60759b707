"""The upstream agent: what the gateway talks to, and how each message is routed.

Three id spaces meet here. The gateway's ids are its own; each adapter sees ids
from its connection's counter (so the proxy's own requests never collide with
the gateway's); and agent->client requests reach the gateway under ids from the
proxy's counter (so two adapters' requests never collide upstream). Every other
byte passes through unchanged: params, results, ``_meta``, unknown methods and
``_``-extensions. The hot path, a block of ``session/update`` notifications, is
decoded with one call and written back as the very block that was read.
"""

from __future__ import annotations

import logging
import math
import signal
from collections.abc import Iterator
from typing import Final

import anyio
import anyio.abc
import msgspec
from msgspec import UNSET, Raw

from acp_proxy import __version__, jsonrpc
from acp_proxy.adapter import Adapter, AdapterGone, PendingCall, SpawnError, describe_exit
from acp_proxy.config import Config
from acp_proxy.early_signals import EARLY_SIGNALS
from acp_proxy.jsonrpc import (
    BadLine,
    Batch,
    Kind,
    LineReader,
    LineWriter,
    Message,
    RequestId,
)
from acp_proxy.ownership.owner import Owner
from acp_proxy.ownership.supervised import SupervisedProcess

log = logging.getLogger("acp_proxy.proxy")

CANCEL_REQUEST: Final = "$/cancel_request"
_LOGGED_LINE_BYTES: Final = 200
SHUTDOWN_WRITE_GRACE: Final = 2.0
"""How long a write to the gateway may block once the proxy is shutting down."""
DRAIN_TIMEOUT: Final = 1.0
"""How long to keep relaying an exited adapter's last output before closing its stdout."""


def _preview(line: bytes) -> str:
    text = line[:_LOGGED_LINE_BYTES].decode("utf-8", "replace")
    return text + ("..." if len(line) > _LOGGED_LINE_BYTES else "")


def decoded_lines(batch: Batch) -> Iterator[tuple[bytes, tuple[Message, Kind] | BadLine]]:
    """Each line of a batch with its envelope; one decode call when the block allows."""
    msgs = jsonrpc.decode_block(batch.block, batch.count) if batch.block else None
    if msgs is None:
        for line in batch.lines:
            if line.strip():
                yield line, jsonrpc.decode_line(line)
        return
    for line, msg in zip(batch.lines, msgs, strict=True):
        kind = jsonrpc.classify(msg)
        yield line, (msg, kind) if kind is not None else BadLine.INVALID


def is_plain_notification_block(batch: Batch) -> bool:
    """True when every line is a notification the proxy forwards untouched.

    This is the streaming hot path: one decode call for the block, and the block
    is written on as it was read. ``$/cancel_request`` is checked on the decoded
    method names, so no escaping of the raw bytes can slip one past its id mapping.
    """
    if not batch.block:
        return False
    methods = jsonrpc.notification_methods(batch.block, batch.count)
    return methods is not None and CANCEL_REQUEST not in methods


def annotate_initialize(result: Raw, backend: str) -> Raw:
    """Add ``_meta["acp-proxy"]`` to the adapter's ``initialize`` result."""
    obj = jsonrpc.decode_object(result)
    if obj is None:
        return result
    meta = obj.get("_meta")
    meta = dict(meta) if isinstance(meta, dict) else {}
    meta["acp-proxy"] = {"version": __version__, "backend": backend}
    obj["_meta"] = meta
    return Raw(jsonrpc.encode_json(obj))


def remap_cancel_request(params: Raw | msgspec.UnsetType, new_id: RequestId) -> Raw:
    """``$/cancel_request`` params naming ``new_id``, everything else (``_meta``) kept."""
    obj = jsonrpc.decode_object(params) or {}
    obj["requestId"] = new_id
    return Raw(jsonrpc.encode_json(obj))


def cancel_target(params: Raw | msgspec.UnsetType) -> tuple[bool, RequestId]:
    obj = jsonrpc.decode_object(params)
    if obj is None or "requestId" not in obj:
        return False, None
    target = obj["requestId"]
    if isinstance(target, bool) or not isinstance(target, int | str | None):
        return False, None
    return True, target


class Proxy:
    """Serves one gateway connection in front of one backend's adapter."""

    def __init__(
        self,
        config: Config,
        gateway_out: anyio.abc.ByteSendStream,
        *,
        owner: Owner,
        backend: str | None = None,
        warm: SupervisedProcess | None = None,
    ) -> None:
        self.config = config
        self.owner = owner
        self._warm = warm
        self.backend = config.backend(backend)
        self.adapter: Adapter | None = None
        self._gateway = LineWriter(gateway_out)
        self._gateway_broken = False
        self._spawn_lock = anyio.Lock()
        self._upstream: dict[int, tuple[Adapter, RequestId]] = {}
        self._next_upstream_id = 0
        self._reading = anyio.CancelScope()
        self._stop_reason: str | None = None
        self._shutting_down = False
        self._tasks: anyio.abc.TaskGroup | None = None

    # --- lifecycle ------------------------------------------------------------

    async def run(self, gateway_in: anyio.abc.ByteReceiveStream) -> None:
        """Serve until the gateway closes its end or ``stop`` is called, then shut down."""
        reader = LineReader(gateway_in, self.config.max_line_bytes)
        async with anyio.create_task_group() as tasks:
            self._tasks = tasks
            with self._reading:
                await self._relay_from_gateway(reader)
            if self._stop_reason is None:
                log.info("gateway closed its input: shutting down")
            await self._shutdown()
            tasks.cancel_scope.cancel()

    def stop(self, reason: str) -> None:
        """Stop reading from the gateway and shut down (signal handlers call this)."""
        self._shutting_down = True
        if self._stop_reason is None:
            self._stop_reason = reason
            log.info("%s: shutting down", reason)
        self._reading.cancel()

    async def _shutdown(self) -> None:
        """Answer what is in flight, then stop the adapter (stdin EOF, TERM, KILL).

        On gateway EOF the adapter gets its stdin grace to answer on its own, and
        those answers are still relayed. On a signal the gateway is waiting, so
        in-flight requests are answered at once.
        """
        self._shutting_down = True
        with anyio.CancelScope(shield=True):
            if self._warm is not None:  # launched at startup, never asked for
                await self._warm.stop(
                    stdin_grace=self.config.shutdown.stdin_grace, term_grace=self.config.shutdown.term_grace
                )
            adapter = self.adapter
            if adapter is None:
                return
            if self._stop_reason is not None:
                await self._fail_calls(
                    adapter.take_gateway_calls(),
                    jsonrpc.REQUEST_CANCELLED,
                    "acp-proxy is shutting down",
                    {"reason": "proxy_shutdown"},
                )
            await adapter.stop(self.config.shutdown)
            with anyio.move_on_after(DRAIN_TIMEOUT):
                await adapter.drained.wait()
            await adapter.close_output()

    # --- gateway -> adapter ---------------------------------------------------------

    async def _relay_from_gateway(self, reader: LineReader) -> None:
        while True:
            try:
                batch = await reader.receive_batch()
            except anyio.EndOfStream:
                return
            for _ in range(batch.overlong):
                await self._send_gateway(self._overlong_error())
            for line, decoded in decoded_lines(batch):
                if isinstance(decoded, BadLine):
                    log.warning("gateway sent an invalid message: %s", _preview(line))
                    await self._send_gateway(jsonrpc.bad_line_response(decoded, line))
                    continue
                msg, kind = decoded
                if kind is Kind.REQUEST:
                    await self._forward_request(msg)
                elif kind is Kind.NOTIFICATION:
                    await self._forward_notification(msg, line)
                else:
                    await self._forward_answer(msg)

    def _overlong_error(self) -> bytes:
        limit = self.config.max_line_bytes
        return jsonrpc.error_response(
            None,
            jsonrpc.INVALID_REQUEST,
            f"Message too large: a line exceeded {limit} bytes and was discarded",
            {"reason": "line_too_long", "maxLineBytes": limit},
        )

    async def _adapter_for(self, msg: Message) -> Adapter | None:
        """The adapter to send ``msg`` to, starting it on first use or on a new ``initialize``."""
        adapter = self.adapter
        if adapter is not None and (not adapter.gone or msg.method != "initialize"):
            return adapter  # the common case, without a trip through the event loop
        async with self._spawn_lock:
            adapter = self.adapter
            if adapter is not None and (not adapter.gone or msg.method != "initialize"):
                return adapter
            if adapter is not None:
                await adapter.stop(self.config.shutdown)
            warm, self._warm = self._warm, None
            try:
                if warm is None:
                    warm = Adapter.launch(self.backend, owner=self.owner, shutdown=self.config.shutdown)
                adapter = await Adapter.attach(self.backend, warm, self.config.max_line_bytes)
            except Exception as exc:
                # Whatever went wrong (a missing binary, an unusable state database), the
                # gateway gets an answer and the proxy keeps serving.
                if not isinstance(exc, SpawnError):
                    log.exception("starting backend %r failed", self.backend.name)
                    exc = SpawnError(f"cannot start backend {self.backend.name!r}: {exc}")
                log.error("%s", exc)
                if msg.id is not UNSET:
                    await self._send_gateway(
                        jsonrpc.error_response(
                            msg.id,
                            jsonrpc.INTERNAL_ERROR,
                            str(exc),
                            {"reason": "spawn_failed", "backend": self.backend.name},
                        )
                    )
                return None
            self.adapter = adapter
            assert self._tasks is not None
            self._tasks.start_soon(self._relay_from_adapter, adapter)
            self._tasks.start_soon(self._watch_adapter_exit, adapter)
            return adapter

    async def _watch_adapter_exit(self, adapter: Adapter) -> None:
        """When the wrapper exits, make sure its whole tree is gone and its lease settled.

        A wrapper exits on its own only after tearing its tree down; if it was
        killed instead, this is what finds the orphans (by marker) and ends them.
        """
        await adapter.wait_exit(math.inf)
        await adapter.stop(self.config.shutdown)

    async def _forward_request(self, msg: Message) -> None:
        assert isinstance(msg.method, str)
        assert msg.id is not UNSET
        adapter = await self._adapter_for(msg)
        if adapter is None:
            return
        if adapter.gone:
            await self._send_gateway(self._exited_error(msg.id, msg.method, adapter))
            return
        call_id = adapter.register(msg.method, msg.id, msg.params)
        try:
            await adapter.send(jsonrpc.with_id(msg, call_id))
        except AdapterGone:
            # The relay task answers every pending call once the adapter is gone.
            return

    async def _forward_notification(self, msg: Message, line: bytes) -> None:
        adapter = self.adapter
        if adapter is None or adapter.gone:
            log.info("dropped %s: no adapter is running", msg.method)
            return
        data = line + b"\n"
        if msg.method == CANCEL_REQUEST:
            ok, target = cancel_target(msg.params)
            call_id = adapter.find_gateway_call(target) if ok else None
            if call_id is None:
                log.debug("$/cancel_request for an unknown request: %s", _preview(line))
                return
            data = jsonrpc.notification(CANCEL_REQUEST, remap_cancel_request(msg.params, call_id))
        try:
            await adapter.send(data)
        except AdapterGone:
            log.info("dropped %s: the adapter has exited", msg.method)

    async def _forward_answer(self, msg: Message) -> None:
        """The gateway answered an agent->client request: hand it to the adapter that asked."""
        key = msg.id
        route = self._upstream.pop(key, None) if isinstance(key, int) else None
        if route is None:
            log.warning("gateway answered an unknown request id %r: dropped", key)
            return
        adapter, adapter_id = route
        try:
            await adapter.send(jsonrpc.with_id(msg, adapter_id))
        except AdapterGone:
            log.info("answer to request %r dropped: the adapter has exited", adapter_id)

    # --- adapter -> gateway ---------------------------------------------------------

    async def _relay_from_adapter(self, adapter: Adapter) -> None:
        reader = adapter.lines
        try:
            while True:
                try:
                    batch = await reader.receive_batch()
                except anyio.EndOfStream:
                    break
                if batch.overlong:
                    log.warning(
                        "adapter pid=%d wrote %d line(s) over %d bytes: dropped",
                        adapter.pid,
                        batch.overlong,
                        self.config.max_line_bytes,
                    )
                if is_plain_notification_block(batch):
                    await self._send_gateway(batch.block)
                    continue
                out: list[bytes] = []
                for line, decoded in decoded_lines(batch):
                    data = self._translate_from_adapter(adapter, line, decoded)
                    if data is not None:
                        out.append(data)
                if out:
                    await self._send_gateway(b"".join(out))
        finally:
            with anyio.CancelScope(shield=True):
                await self._adapter_gone(adapter)
                adapter.drained.set()

    def _translate_from_adapter(
        self, adapter: Adapter, line: bytes, decoded: tuple[Message, Kind] | BadLine
    ) -> bytes | None:
        """What to send the gateway for one adapter line (``None``: nothing)."""
        if isinstance(decoded, BadLine):
            log.warning(
                "adapter pid=%d wrote non-JSON-RPC to stdout, skipped: %s",
                adapter.pid,
                _preview(line),
            )
            return None
        msg, kind = decoded
        if kind is Kind.NOTIFICATION:
            if msg.method != CANCEL_REQUEST:
                return line + b"\n"
            ok, target = cancel_target(msg.params)
            upstream = self._find_upstream(adapter, target) if ok else None
            if upstream is None:
                return None
            return jsonrpc.notification(CANCEL_REQUEST, remap_cancel_request(msg.params, upstream))
        if kind is Kind.REQUEST:
            upstream_id = self._next_upstream_id
            self._next_upstream_id += 1
            self._upstream[upstream_id] = (adapter, msg.id)  # type: ignore[assignment]
            return jsonrpc.with_id(msg, upstream_id)
        call = adapter.take_pending(msg.id)
        if call is None:
            log.warning("adapter pid=%d answered unknown request id %r: dropped", adapter.pid, msg.id)
            return None
        if call.internal is not None:
            call.internal.response = msg
            call.internal.done.set()
            return None
        adapter.note_answer(call, msg)
        if call.method == "initialize" and msg.result is not UNSET:
            msg.result = annotate_initialize(msg.result, self.backend.name)
        return jsonrpc.with_id(msg, call.gateway_id)

    def _find_upstream(self, adapter: Adapter, adapter_id: RequestId) -> int | None:
        for upstream_id, (owner, their_id) in self._upstream.items():
            if owner is adapter and their_id == adapter_id:
                return upstream_id
        return None

    async def _adapter_gone(self, adapter: Adapter) -> None:
        """The adapter's stdout closed: answer everything it still owed, with its exit status."""
        returncode = await adapter.wait_exit(1.0)
        failed = adapter.mark_gone()
        if self._stop_reason is None and failed:
            log.error(
                "adapter pid=%d %s with %d request(s) unanswered",
                adapter.pid,
                describe_exit(returncode),
                len(failed),
            )
        await self._fail_calls(
            failed,
            jsonrpc.INTERNAL_ERROR,
            f"The agent process exited before answering ({describe_exit(returncode)})",
            {"reason": "adapter_exited", "exitStatus": returncode, "backend": adapter.backend.name},
        )
        orphaned = [uid for uid, (owner, _) in self._upstream.items() if owner is adapter]
        for upstream_id in orphaned:
            del self._upstream[upstream_id]
            await self._send_gateway(jsonrpc.notification(CANCEL_REQUEST, {"requestId": upstream_id}))
        await adapter.stop(self.config.shutdown)

    def _exited_error(self, request_id: RequestId, method: str, adapter: Adapter) -> bytes:
        return jsonrpc.error_response(
            request_id,
            jsonrpc.INTERNAL_ERROR,
            f"The agent process has exited ({describe_exit(adapter.returncode)}); send initialize to start a new one",
            {
                "reason": "adapter_exited",
                "exitStatus": adapter.returncode,
                "backend": adapter.backend.name,
                "method": method,
            },
        )

    async def _fail_calls(self, calls: list[PendingCall], code: int, message: str, data: dict[str, object]) -> None:
        if calls:
            await self._send_gateway(
                b"".join(
                    jsonrpc.error_response(call.gateway_id, code, message, {**data, "method": call.method})
                    for call in calls
                )
            )

    async def _send_gateway(self, data: bytes) -> None:
        if self._gateway_broken:
            return
        # Once shutting down, a gateway that has stopped reading must not hold the
        # teardown hostage: these writes run in shielded scopes, so they get a deadline.
        deadline = SHUTDOWN_WRITE_GRACE if self._shutting_down else math.inf
        try:
            with anyio.move_on_after(deadline) as scope:
                await self._gateway.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            self._gateway_broken = True
            self.stop("gateway closed its output")
            return
        if scope.cancelled_caught:
            log.warning("gateway stopped reading during shutdown: its remaining answers are dropped")
            self._gateway_broken = True


async def stop_on_signals(proxy: Proxy) -> None:
    """SIGTERM, SIGINT and SIGHUP all mean: shut down cleanly and exit 0."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        if EARLY_SIGNALS:  # arrived while the adapter was being launched, before the loop ran
            proxy.stop(f"received {signal.Signals(EARLY_SIGNALS[0]).name}")
        async for signum in signals:
            proxy.stop(f"received {signal.Signals(signum).name}")


async def serve(config: Config, owner: Owner, backend: str | None = None, warm: SupervisedProcess | None = None) -> int:
    """Serve ACP on this process's stdin/stdout until the gateway leaves or a signal.

    ``warm`` is an adapter launched before the event loop started, so that its
    start-up overlapped ours; the first request that needs an adapter adopts it.
    """
    from acp_proxy.stdio import FdReceiveStream, FdSendStream, enlarge_pipe

    gateway_in, gateway_out = FdReceiveStream(0), FdSendStream(1)
    enlarge_pipe(1)  # fewer, larger writes to the gateway while updates stream
    proxy = Proxy(config, gateway_out, owner=owner, backend=backend, warm=warm)
    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(stop_on_signals, proxy)
            await proxy.run(gateway_in)
            tasks.cancel_scope.cancel()
    finally:
        await gateway_in.aclose()
        await gateway_out.aclose()
    return 0
