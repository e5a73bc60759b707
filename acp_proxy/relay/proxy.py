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

import collections
import logging
import math
import signal
import sqlite3
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import suppress
from typing import Any, Final

import anyio
import anyio.abc
import msgspec
from msgspec import UNSET, Raw, UnsetType

from acp_proxy import __version__
from acp_proxy.config import Config
from acp_proxy.early_signals import EARLY_SIGNALS
from acp_proxy.operator.operations import Operations
from acp_proxy.ownership.owner import Owner
from acp_proxy.ownership.supervised import SupervisedProcess
from acp_proxy.pool.adapter import Adapter, AdapterGone, AgentCapabilities, PendingCall, describe_exit
from acp_proxy.protocol import jsonrpc
from acp_proxy.protocol.jsonrpc import (
    BadLine,
    Batch,
    Kind,
    LineReader,
    LineWriter,
    Message,
    RequestId,
)
from acp_proxy.sessions.lifecycle import RestoreFailed, Session, SessionLifecycle, rewrite_session_id, session_of
from acp_proxy.sessions.registry import SessionRegistry
from acp_proxy.tasks.records import TaskRegistry, TaskStatus, Turn
from acp_proxy.tasks.turns import TaskKeeping

log = logging.getLogger("acp_proxy.proxy")

CANCEL_REQUEST: Final = "$/cancel_request"
SESSION_SCOPED: Final = frozenset(
    {
        "session/prompt",
        "session/cancel",
        "session/load",
        "session/resume",
        "session/close",
        "session/delete",
        "session/set_mode",
        "session/set_config_option",
        "session/set_model",
    }
)
"""ACP methods whose params must name their session: without a string ``sessionId`` the
proxy has no session to route them to, and handing one to an arbitrary adapter could act
on the wrong session."""
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
    """The adapter's ``initialize`` result, adjusted for what the proxy itself provides.

    ``session/close`` and ``session/list`` are always served (by the proxy);
    ``session/resume`` is, when the adapter can load or resume (the proxy restores
    the session on a fresh process either way). ``_meta["acp-proxy"]`` says who we are.
    """
    obj = jsonrpc.decode_object(result)
    if obj is None:
        return result
    caps = AgentCapabilities.from_initialize(result)
    agent = obj.get("agentCapabilities")
    agent = dict(agent) if isinstance(agent, dict) else {}
    sessions = agent.get("sessionCapabilities")
    sessions = dict(sessions) if isinstance(sessions, dict) else {}
    sessions.setdefault("close", {})
    sessions.setdefault("list", {})
    sessions.pop("fork", None)  # a forked session would be one the proxy cannot route yet
    if caps.load or caps.resume:
        sessions.setdefault("resume", {})
    agent["sessionCapabilities"] = sessions
    obj["agentCapabilities"] = agent
    meta = obj.get("_meta")
    meta = dict(meta) if isinstance(meta, dict) else {}
    meta["acp-proxy"] = {"version": __version__, "backend": backend}
    obj["_meta"] = meta
    return Raw(jsonrpc.encode_json(obj))


def permission_subject(msg: Message) -> str:
    """What a ``session/request_permission`` asks about: its tool call's title, if any."""
    params = jsonrpc.decode_object(msg.params) or {}
    tool_call = params.get("toolCall")
    title = tool_call.get("title") if isinstance(tool_call, dict) else None
    return title[:200] if isinstance(title, str) else ""


def permission_choice(msg: Message) -> str:
    """What the gateway answered a permission request: the option chosen, or ``cancelled``."""
    if msg.error is not UNSET:
        return f"error {msg.error.code}"
    result = jsonrpc.decode_object(msg.result) or {}
    outcome = result.get("outcome")
    if isinstance(outcome, dict):
        option = outcome.get("optionId")
        return (
            str(option) if outcome.get("outcome") == "selected" and option is not None else str(outcome.get("outcome"))
        )
    return ""


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


class Proxy(SessionLifecycle, TaskKeeping):
    """Serves one gateway connection in front of a pool of adapter processes, one per session."""

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
        owner.db.defer_checkpoints()  # the checkpoints' fsyncs run in a worker thread (watch_turns)
        self.registry = SessionRegistry(owner.db, owner.instance_id)
        self.tasks = TaskRegistry(owner.db, owner.instance_id)
        self.turns: dict[str, Turn] = {}
        self.unwritten: dict[str, Turn] = {}
        self.settled_unwritten: list[Turn] = []
        self.started_at = time.time()
        self.sessions: dict[str, Session] = {}
        self.running: set[Adapter] = set()
        """Every adapter process started and not yet stopped."""
        self._reserved: dict[str, int] = {}
        self._evicting: set[Adapter] = set()
        self._pool_changed = anyio.Event()
        self._slot_queues: dict[str, collections.deque[object]] = {}
        """Per backend, who waits for a process slot, oldest first."""
        self._client_init: Raw | UnsetType = UNSET
        self._auth_params: Raw | UnsetType = UNSET
        self._gateway = LineWriter(gateway_out)
        self._gateway_broken = False
        self._upstream: dict[int, tuple[Adapter, RequestId, str]] = {}
        """Agent->client requests awaiting the gateway's answer: the adapter, its id, the method."""
        self._next_upstream_id = 0
        self._reading = anyio.CancelScope()
        self._stop_reason: str | None = None
        self._shutting_down = False
        self._refusing = False
        """Requests still being handled fail fast (``proxy_shutdown``) instead of starting processes."""
        self._tasks: anyio.abc.TaskGroup | None = None
        self._handlers = 0
        """Background request handlers running (shutdown waits for them to answer)."""
        self._queued_ids: set[RequestId] = set()
        self._withdrawn: set[RequestId] = set()
        """Queued requests the gateway withdrew with ``$/cancel_request`` before they were sent."""
        for session_id in self.registry.adopt_orphans():
            log.info("session %s: left live by a proxy that is gone; suspended, resumable", session_id)
        self.maintain_tasks()
        self.operations = Operations(self)

    # --- lifecycle ------------------------------------------------------------

    async def run(self, gateway_in: anyio.abc.ByteReceiveStream) -> None:
        """Serve until the gateway closes its end or ``stop`` is called, then shut down."""
        reader = LineReader(gateway_in, self.config.max_line_bytes)
        async with anyio.create_task_group() as tasks:
            self._tasks = tasks
            tasks.start_soon(self._suspend_idle_sessions)
            tasks.start_soon(self.watch_turns)
            tasks.start_soon(self.operations.serve)
            with self._reading:
                await self._relay_from_gateway(reader)
            if self._stop_reason is None:
                log.info("gateway closed its input: shutting down")
            await self._shutdown()
            tasks.cancel_scope.cancel()

    def stop(self, reason: str) -> None:
        """Stop reading from the gateway and shut down (signal handlers call this)."""
        self._shutting_down = True
        self._refusing = True
        self._notify_pool()
        if self._stop_reason is None:
            self._stop_reason = reason
            log.info("%s: shutting down", reason)
        self._reading.cancel()

    async def _shutdown(self) -> None:
        """Answer what is in flight, then suspend every session (state kept, processes reaped).

        On gateway EOF each adapter gets its stdin grace to answer on its own, and
        those answers are still relayed. On a signal the gateway is waiting, so
        in-flight requests are answered at once.
        """
        self._shutting_down = True
        with anyio.CancelScope(shield=True):
            if not self._refusing:
                # Gateway EOF: what it sent before leaving is still served, for a while (a client
                # may pipe in its requests and read the answers after closing its end).
                with anyio.move_on_after(self.config.shutdown.stdin_grace + SHUTDOWN_WRITE_GRACE):
                    while self._handlers:
                        await anyio.sleep(0.01)
            self._refusing = True
            self._notify_pool()  # requests still waiting for a process slot give up (proxy_shutdown)
            if self._warm is not None:  # launched at startup, never asked for
                await self._warm.stop(
                    stdin_grace=self.config.shutdown.stdin_grace, term_grace=self.config.shutdown.term_grace
                )
            if self._stop_reason is not None:
                for adapter in list(self.running):
                    await self._fail_calls(
                        adapter.take_gateway_calls(),
                        jsonrpc.REQUEST_CANCELLED,
                        "acp-proxy is shutting down",
                        {"reason": "proxy_shutdown"},
                    )
            await self._stop_all()
            # Requests still being handled (waiting for a slot, a resume in progress) now fail
            # fast and are answered; anything they started meanwhile is stopped too.
            with anyio.move_on_after(SHUTDOWN_WRITE_GRACE + self.config.shutdown.term_grace):
                while self._handlers:
                    await anyio.sleep(0.01)
            await self._stop_all()
            self.settle_leftovers("acp-proxy shut down before the turn was answered")
            self.write_settled()
            if self.unwritten:
                self.retry_unwritten()  # a last try; what still fails is swept "lost" by the next start
            suspended = self.registry.suspend_all_of_this_instance()
            if suspended:
                log.info("suspended %d session(s); the next proxy resumes them on demand", suspended)

    async def _stop_all(self) -> None:
        async with anyio.create_task_group() as tasks:
            for adapter in list(self.running):
                tasks.start_soon(self._stop_adapter, adapter)

    def _shutdown_error(self) -> RestoreFailed:
        return RestoreFailed(jsonrpc.REQUEST_CANCELLED, "acp-proxy is shutting down", {"reason": "proxy_shutdown"})

    async def _stop_adapter(self, adapter: Adapter, *, drain: bool = True) -> None:
        """End one adapter process and its tree, and let the pool know.

        ``drain``: keep relaying what it wrote last (briefly) before closing its stdout.
        """
        await adapter.stop(self.config.shutdown)
        if drain:
            with anyio.move_on_after(DRAIN_TIMEOUT):
                await adapter.drained.wait()
            await adapter.close_output()
        self.running.discard(adapter)
        self._notify_pool()

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
                if kind is not Kind.RESPONSE and not jsonrpc.params_structured(msg.params):
                    log.warning("gateway sent params that are neither an object nor an array: %s", _preview(line))
                    await self._fail(
                        msg.id,
                        jsonrpc.INVALID_REQUEST,
                        "Invalid request: params must be an object or an array",
                        {"reason": "invalid_request"},
                    )
                    continue
                try:
                    if kind is Kind.REQUEST:
                        await self._route_request(msg)
                    elif kind is Kind.NOTIFICATION:
                        await self._route_notification(msg, line)
                    else:
                        await self._forward_answer(msg)
                except sqlite3.Error as exc:
                    await self._state_failed(exc, msg.id if kind is Kind.REQUEST else None)

    def _overlong_error(self) -> bytes:
        limit = self.config.max_line_bytes
        return jsonrpc.error_response(
            None,
            jsonrpc.INVALID_REQUEST,
            f"Message too large: a line exceeded {limit} bytes and was discarded",
            {"reason": "line_too_long", "maxLineBytes": limit},
        )

    def _background(self, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run request handling that may wait (a spawn, a resume) without holding up the gateway."""
        assert self._tasks is not None

        async def handle() -> None:
            try:
                await work()
            except sqlite3.Error as exc:
                await self._state_failed(exc, None)
            finally:
                self._handlers -= 1

        self._handlers += 1  # counted from now: shutdown waits for work not yet begun, too
        self._tasks.start_soon(handle)

    async def _state_failed(self, exc: sqlite3.Error, request_id: RequestId | UnsetType) -> None:
        """The state database failed under a request: it gets an error, the proxy keeps serving."""
        log.error(
            "the state database %s failed: %s; the proxy keeps serving (acp-proxy status says more)",
            self.owner.db.path,
            exc,
        )
        if request_id is not UNSET and request_id is not None:
            await self._fail(
                request_id,
                jsonrpc.INTERNAL_ERROR,
                f"acp-proxy's state database failed: {exc}",
                {"reason": "state_error"},
            )

    async def _route_request(self, msg: Message) -> None:
        assert isinstance(msg.method, str)
        method = msg.method
        if method == "initialize":
            self._client_init = msg.params
            self._background(lambda: self._forward_to_spare(msg, self.backend))
        elif method == "authenticate":
            self._background(lambda: self._forward_to_spare(msg, self.backend))
        elif method == "session/new":
            self._background(lambda: self._new_session(msg))
        elif method == "session/list":
            await self._list_sessions(msg)
        else:
            session_id = session_of(msg.params)
            if session_id is None and method in SESSION_SCOPED:
                await self._fail(
                    msg.id,
                    jsonrpc.INVALID_PARAMS,
                    f"Invalid params: {method} needs params.sessionId, a string",
                    {"reason": "invalid_params"},
                )
            elif session_id is None:
                self._background(lambda: self._forward_to_any(msg))
            elif method == "session/close":
                await self.close_session(session_id, msg.id)  # ordered now; the work queues behind the session's
            elif method in ("session/load", "session/resume"):
                await self._restore_for_gateway(msg, session_id)
            else:
                await self._forward_to_session(msg, session_id)

    async def _route_notification(self, msg: Message, line: bytes) -> None:
        if msg.method == CANCEL_REQUEST:
            await self._forward_cancel_request(msg, line)
            return
        session_id = session_of(msg.params)
        if session_id is None and msg.method in SESSION_SCOPED:
            log.info("dropped %s: its params name no session", msg.method)
            return
        session = self.sessions.get(session_id) if session_id is not None else None
        if msg.method == "session/cancel" and session is not None:
            self.cancel_turn(session)
            self.note_cancel(session, "the gateway")
        adapter: Adapter | None
        if session is not None and session.adapter is not None and not session.adapter.gone:
            adapter = session.adapter
        elif session_id is None:
            adapter = self._any_adapter()
        else:
            log.info("dropped %s for session %s: it has no live process", msg.method, session_id)
            return
        if adapter is None or adapter.gone:
            log.info("dropped %s: no adapter is running", msg.method)
            return
        data = line + b"\n"
        if adapter.rewrites_session and adapter.gateway_session is not None and adapter.adapter_session is not None:
            msg.params = rewrite_session_id(msg.params, adapter.gateway_session, adapter.adapter_session)
            data = jsonrpc.encode(msg)
        try:
            await adapter.send(data)
        except AdapterGone:
            log.info("dropped %s: the adapter has exited", msg.method)

    def cancel_turn(self, session: Session) -> None:
        """``session/cancel``: prompts still queued for the session end ``cancelled``; the turn in flight
        is cancelled by the adapter (the notification is forwarded). Nothing is ever reaped."""
        session.cancel_epoch += 1

    async def _forward_cancel_request(self, msg: Message, line: bytes) -> None:
        ok, target = cancel_target(msg.params)
        if not ok:
            return
        for adapter in list(self.running):
            call_id = adapter.find_gateway_call(target)
            if call_id is not None:
                data = jsonrpc.notification(CANCEL_REQUEST, remap_cancel_request(msg.params, call_id))
                with suppress(AdapterGone):
                    await adapter.send(data)
                return
        if target in self._queued_ids:
            self._withdrawn.add(target)  # answered -32800 when its turn comes, never sent
            return
        log.debug("$/cancel_request for an unknown request: %s", _preview(line))

    async def _forward(
        self,
        adapter: Adapter,
        msg: Message,
        on_answer: Callable[[Message], Message | None] | None = None,
        *,
        turn: Turn | None = None,
    ) -> None:
        """Send a gateway request to ``adapter`` under a fresh id (``sessionId`` rewritten if needed)."""
        assert isinstance(msg.method, str)
        assert msg.id is not UNSET
        call_id = adapter.register(msg.method, msg.id, msg.params)
        call = adapter.pending[call_id]
        call.on_answer = on_answer
        if turn is not None:
            call.turn = adapter.turn = turn
        adapter.last_active = time.monotonic()
        params = msg.params
        if adapter.rewrites_session and adapter.gateway_session is not None and adapter.adapter_session is not None:
            params = rewrite_session_id(params, adapter.gateway_session, adapter.adapter_session)
        out = Message(jsonrpc="2.0", id=call_id, method=msg.method, params=params)
        try:
            await adapter.send(jsonrpc.encode(out))
        except AdapterGone:
            return  # the relay task answers every pending call once the adapter is gone

    async def _answer(self, request_id: RequestId | UnsetType, result: object) -> None:
        await self._send_gateway(jsonrpc.result_response(None if request_id is UNSET else request_id, result))

    async def _fail(
        self, request_id: RequestId | UnsetType, code: int, message: str, data: dict[str, Any] | None = None
    ) -> None:
        rid = None if request_id is UNSET else request_id
        await self._send_gateway(jsonrpc.error_response(rid, code, message, UNSET if data is None else data))

    async def _forward_answer(self, msg: Message) -> None:
        """The gateway answered an agent->client request: hand it to the adapter that asked."""
        key = msg.id
        route = self._upstream.pop(key, None) if isinstance(key, int) else None
        if route is None:
            log.warning("gateway answered an unknown request id %r: dropped", key)
            return
        adapter, adapter_id, method = route
        if method == "session/request_permission":
            self.note_permission(adapter, "permission_answered", permission_choice(msg))
        adapter.upstream_pending -= 1
        if not adapter.busy:
            self._notify_pool()
        try:
            await adapter.send(jsonrpc.with_id(msg, adapter_id))
        except AdapterGone:
            log.info("answer to request %r dropped: the adapter has exited", adapter_id)

    # --- adapter -> gateway ---------------------------------------------------------

    async def _watch_adapter_exit(self, adapter: Adapter) -> None:
        """When the wrapper exits, make sure its whole tree is gone and its lease settled.

        A wrapper exits on its own only after tearing its tree down; if it was
        killed instead, this is what finds the orphans (by marker) and ends them.
        """
        await adapter.wait_exit(math.inf)
        self._notify_pool()  # its slot is free: the whole tree is gone
        await self._stop_adapter(adapter)

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
                if not adapter.swallow_updates and not adapter.rewrites_session and is_plain_notification_block(batch):
                    turn = adapter.turn
                    if turn is not None and turn.status is TaskStatus.RUNNING:
                        turn.observe(batch.block, batch.count)
                    await self._send_gateway(batch.block)
                    continue
                out: list[bytes] = []
                for line, decoded in decoded_lines(batch):
                    data = self._translate_from_adapter(adapter, line, decoded)
                    if data is not None:
                        out.append(data)
                if out:
                    await self._send_gateway(b"".join(out))
                if self.settled_unwritten:
                    self.write_settled()  # the gateway has its answers: now their records
        finally:
            with anyio.CancelScope(shield=True):
                await self._adapter_gone(adapter)
                adapter.drained.set()

    def _translate_from_adapter(
        self, adapter: Adapter, line: bytes, decoded: tuple[Message, Kind] | BadLine
    ) -> bytes | None:
        """What to send the gateway for one adapter line (``None``: nothing)."""
        if isinstance(decoded, BadLine):
            log.warning("adapter pid=%d wrote non-JSON-RPC to stdout, skipped: %s", adapter.pid, _preview(line))
            return None
        msg, kind = decoded
        if kind is not Kind.RESPONSE and adapter.rewrites_session:
            assert adapter.adapter_session is not None
            assert adapter.gateway_session is not None
            rewritten = rewrite_session_id(msg.params, adapter.adapter_session, adapter.gateway_session)
            if rewritten is not msg.params:
                msg.params = rewritten
                line = jsonrpc.encode(msg).rstrip(b"\n")
        if kind is Kind.NOTIFICATION:
            if msg.method == "session/update":
                if adapter.swallow_updates:
                    return None
                turn = adapter.turn
                if turn is not None and turn.status is TaskStatus.RUNNING:
                    turn.observe(line, 1)
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
            self._upstream[upstream_id] = (adapter, msg.id, str(msg.method))  # type: ignore[assignment]
            adapter.upstream_pending += 1
            if msg.method == "session/request_permission":
                self.note_permission(adapter, "permission_asked", permission_subject(msg))
            return jsonrpc.with_id(msg, upstream_id)
        call = adapter.take_pending(msg.id)
        if call is None:
            log.warning("adapter pid=%d answered unknown request id %r: dropped", adapter.pid, msg.id)
            return None
        if call.internal is not None:
            # In stream order, so that what the adapter writes right after an answer is seen right:
            if call.method == "session/load":
                adapter.swallow_updates = False  # what follows the answer is not replay
            elif call.method == "session/new" and adapter.gateway_session is not None:
                fresh = session_of(msg.result)  # a fallback: from now on its id is rewritten
                adapter.adapter_session = fresh or adapter.adapter_session
            call.internal.response = msg
            call.internal.done.set()
            return None
        if adapter.rewrites_session and msg.result is not UNSET:
            assert adapter.adapter_session is not None
            assert adapter.gateway_session is not None
            rewritten = rewrite_session_id(msg.result, adapter.adapter_session, adapter.gateway_session)
            if isinstance(rewritten, Raw):
                msg.result = rewritten
        adapter.note_answer(call, msg)
        if call.on_answer is not None:
            try:
                msg = call.on_answer(msg) or msg
            except sqlite3.Error as exc:  # the state database failed: the answer is still relayed
                log.error("could not record the answer to %s in the state database: %s", call.method, exc)
        if call.turn is not None:
            self.settle_answer(call.turn, msg, write_later=True)
            if adapter.turn is call.turn:
                adapter.turn = None
        if not adapter.busy:
            self._notify_pool()  # a waiter for a slot may now suspend this one
        if call.method == "initialize" and msg.result is not UNSET:
            msg.result = annotate_initialize(msg.result, adapter.backend.name)
        return jsonrpc.with_id(msg, call.gateway_id)

    def _find_upstream(self, adapter: Adapter, adapter_id: RequestId) -> int | None:
        for upstream_id, (owner, their_id, _) in self._upstream.items():
            if owner is adapter and their_id == adapter_id:
                return upstream_id
        return None

    async def _adapter_gone(self, adapter: Adapter) -> None:
        """The adapter's stdout closed: answer everything it still owed, with its exit status.

        A session whose process died this way is not lost: it is suspended, and
        the next request for it resumes it.
        """
        returncode = await adapter.wait_exit(1.0)
        failed = adapter.mark_gone()
        if self._stop_reason is None and failed:
            log.error(
                "adapter pid=%d %s with %d request(s) unanswered",
                adapter.pid,
                describe_exit(returncode),
                len(failed),
            )
        if self._shutting_down and adapter.stopping:
            # We ended it (its stdin closed, or a signal): the requests end with the shutdown.
            await self._fail_calls(
                failed,
                jsonrpc.REQUEST_CANCELLED,
                "acp-proxy is shutting down",
                {"reason": "proxy_shutdown", "exitStatus": returncode, "backend": adapter.backend.name},
            )
        else:
            await self._fail_calls(
                failed,
                jsonrpc.INTERNAL_ERROR,
                f"The agent process exited before answering ({describe_exit(returncode)})",
                {"reason": "adapter_exited", "exitStatus": returncode, "backend": adapter.backend.name},
            )
        orphaned = [uid for uid, (owner, _, _) in self._upstream.items() if owner is adapter]
        for upstream_id in orphaned:
            del self._upstream[upstream_id]
            await self._send_gateway(jsonrpc.notification(CANCEL_REQUEST, {"requestId": upstream_id}))
        adapter.upstream_pending = 0
        session = self.sessions.get(adapter.gateway_session) if adapter.gateway_session else None
        if session is not None and session.adapter is adapter:
            session.adapter = None
            if not self._shutting_down and not session.closed:
                why = describe_exit(returncode)
                log.warning("session %s: its process ended (%s); suspended, resumable", session.session_id, why)
                self.registry.mark_suspended(session.session_id)
        await self._stop_adapter(adapter, drain=False)

    async def _fail_calls(self, calls: list[PendingCall], code: int, message: str, data: dict[str, object]) -> None:
        self.settle_calls(calls, code, message)
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
