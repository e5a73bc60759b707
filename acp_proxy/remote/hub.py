"""The network connections of one ``serve``, each served by a stdio proxy of the install.

Each ACP connection (a WebSocket, or a streamable HTTP connection named by its
``Acp-Connection-Id``) gets its own ``acp-proxy`` child on a pipe, started with its first
message: the very stdio proxy a local gateway runs, so every guarantee of one (owned trees,
durable turns, the install's pool and budget) holds unchanged, and a fault in one client's
proxy touches no other. The hub adds what the network needs around it: who may touch which
session, bounded queues toward each client, and the hand-over of sessions when a connection
ends (a session touched by a connection that has gone is taken by another only once the
proxy that held it has suspended it).
"""

from __future__ import annotations

import enum
import logging
import math
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any, Final

import anyio
import anyio.abc
import msgspec
from msgspec import UNSET, UnsetType

from acp_proxy.ownership.verify import signal_child, signal_pidfd
from acp_proxy.protocol import jsonrpc
from acp_proxy.protocol.acp import notification_sessions, proxy_meta, session_of
from acp_proxy.protocol.errors import ProxyError
from acp_proxy.protocol.jsonrpc import BadLine, Batch, Kind, LineReader, Message
from acp_proxy.protocol.methods import Method
from acp_proxy.relay.attached import CLIENT_ENV
from acp_proxy.relay.claims import LOCAL, PRINCIPAL_ENV
from acp_proxy.remote.access import Gate, gate, sees_session, visible_sessions
from acp_proxy.remote.launcher import LaunchedProxy, Launcher, LauncherGone
from acp_proxy.remote.outbox import Outbox
from acp_proxy.remote.replay import RESUMABLE_META, TURN_STATE_META, ReplayLimits, TurnStates
from acp_proxy.remote.tokens import Principal, RemoteStore

log = logging.getLogger("acp_proxy.serve")

ProxyProcess = anyio.abc.Process | LaunchedProxy
"""A connection's proxy: forked by the launcher, or exec'd where there is none."""

HANDOVER_TIMEOUT: Final = 30.0
"""How long a message for a session waits for the proxy of a connection that ended to let it go."""

CONNECTION_LEVEL: Final = frozenset({Method.NEW, Method.LOAD, Method.RESUME, Method.FORK, Method.LIST, Method.STATUS})
"""Requests whose answers go to the connection-scoped stream (the RFD: the client cannot have a
session stream for a session it is only now opening, or only asks about)."""
LEAVE_WHERE_HELD: Final = frozenset({Method.ATTACH, Method.DETACH, Method.STATUS})
"""Requests that never take a session from where it is held: an attach joins it there, a detach leaves it,
``session/status`` only asks about it."""


class Ended(enum.Enum):
    """Why a connection ended: said in logs, and as the WebSocket close code and reason."""

    GONE = (1000, "the client went away")
    """Closed or dropped: the server is not told which (hypercorn reports every end of a WebSocket the
    client starts as 1006), so the turns still in flight go on for ``linger`` either way."""
    DELETED = (1000, "connection deleted")
    SLOW_READER = (1008, "not reading: messages have waited too long to be sent")
    REVOKED = (1008, "token revoked")
    IDLE = (1001, "idle connection")
    PROXY_EXITED = (1011, "the connection's proxy exited")
    SHUTDOWN = (1001, "server shutting down")

    @property
    def code(self) -> int:
        return int(self.value[0])

    @property
    def reason(self) -> str:
        return str(self.value[1])


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    """The bounds ``serve`` holds every connection to."""

    max_connections: int = 256
    max_per_principal: int = 64
    max_pending: int = 4096
    """Messages waiting for one client before its connection's proxy waits too."""
    max_message_bytes: int = 64 * 2**20
    resume_grace: float = 300.0
    """How long a connection with no client on it is kept for one that resumes it: a WebSocket that dropped,
    a streamable HTTP connection with no open stream and no request. Its turns run on meanwhile; then it
    ends, as if its client had closed it."""
    linger: float = 600.0
    """How long the proxy of a connection that ended keeps running for its requests in flight."""
    stall_timeout: float = 30.0
    """How long a client may take nothing while ``max_pending`` messages wait for it."""
    replay: ReplayLimits = msgspec.field(default_factory=ReplayLimits)
    """What a connection's streams keep for a client that resumes one (``Last-Event-ID``, ``stream/resume``)."""


def _with_result(answer: bytes, change: Callable[[dict[str, Any]], None]) -> bytes:
    """``answer`` with its result changed by ``change`` (unchanged if it has no result object)."""
    try:
        obj = msgspec.json.decode(answer)
    except msgspec.DecodeError:
        return answer
    result = obj.get("result") if isinstance(obj, dict) else None
    if not isinstance(result, dict):
        return answer
    change(result)
    return jsonrpc.encode_json(obj).rstrip(b"\n")


def _merge(result: dict[str, Any], key: str, entries: dict[str, Any]) -> None:
    existing = result.get(key)
    result[key] = {**(existing if isinstance(existing, dict) else {}), **entries}


class Pending:
    """A client request the connection's proxy has not answered yet."""

    __slots__ = ("answer", "answered", "method", "scope", "session_id")

    def __init__(self, method: str, scope: str | None, session_id: str | None = None) -> None:
        self.method = method
        self.scope = scope
        self.session_id = session_id
        self.answered: anyio.Event | None = None
        """Set once answered, for a caller that takes the answer itself (``answer``) rather than the outbox."""
        self.answer: bytes | None = None


class Connection:
    """One ACP client connection and the stdio proxy serving it."""

    def __init__(self, hub: Hub, principal: Principal, transport: str, peer: str) -> None:
        self.hub = hub
        self.id = secrets.token_urlsafe(18)
        self.principal = principal
        self.transport = transport
        self.peer = peer
        self.opened_at = time.time()
        self.last_active = time.monotonic()
        self.outbox = Outbox(hub.limits.max_pending, hub.limits.stall_timeout, self.stalled, hub.limits.replay)
        self.turns = TurnStates()
        self.attached = True
        """Whether a client is on it: false while a dropped WebSocket's connection waits for a resume."""
        self._reattached = anyio.Event()
        self.stall = anyio.Event()
        """Set when the client of a resumable WebSocket stopped reading: its socket is let go (``stalled``)."""
        self.touched: set[str] = set()
        """Sessions this connection made or named: its proxy may hold them."""
        self.ended: Ended | None = None
        self.closed = anyio.Event()
        self._pending: dict[tuple[type, object], Pending] = {}
        self._process: ProxyProcess | None = None
        self._started: anyio.Event | None = None
        self._writing = anyio.Lock()
        self._nothing_in_flight = anyio.Event()
        self._let_go = False

    # --- client -> proxy ---------------------------------------------------------------------

    async def from_client(self, line: bytes, scope: str | None = None) -> None:
        """One message from the client; an answer the hub gives itself goes to the outbox."""
        self.last_active = time.monotonic()
        decoded = jsonrpc.decode_line(line)
        if isinstance(decoded, BadLine):
            await self.outbox.put(None, jsonrpc.bad_line_response(decoded, line))
            return
        msg, kind = decoded
        if kind is not Kind.RESPONSE:
            assert isinstance(msg.method, str)
            if msg.method == Method.INITIALIZE:
                self.opt_in(msg.params)
            if not await self._admit(msg, kind, scope):
                return
        await self._to_proxy(line)

    def opt_in(self, params: msgspec.Raw | UnsetType) -> None:
        """``initialize`` with ``_meta["acp/resumable"]``: the client keeps cursors to resume with, so every
        message carries its own as ``_meta["acp/cursor"]`` (a WebSocket's only way to learn them)."""
        meta = (jsonrpc.decode_object(params) or {}).get("_meta")
        if isinstance(meta, dict) and meta.get(RESUMABLE_META):
            self.outbox.cursor_meta = True

    async def _admit(self, msg: Message, kind: Kind, scope: str | None) -> bool:
        """Whether the principal may send this; refused requests are answered here."""
        assert isinstance(msg.method, str)
        session_id = session_of(msg.params)
        backend: str | None = None
        if msg.method == Method.NEW:
            named = proxy_meta(msg.params).get("backend")
            backend = named if isinstance(named, str) else self.hub.default_backend
        owner = self.hub.store.owner_of(session_id) if session_id is not None else None
        verdict = gate(self.principal, msg.method, session_id, owner, backend)
        if verdict is not Gate.PASS:
            if kind is Kind.REQUEST:
                error = (
                    ProxyError.unknown_session(session_id or "")
                    if verdict is Gate.UNKNOWN
                    else ProxyError.invalid_params(f"this token may not use backend {backend!r}")
                )
                await self.outbox.put(scope, error.response(msg.id))  # type: ignore[arg-type]
            log.info("%s: refused %s for %s (%s)", self.principal.label, msg.method, session_id, verdict.value)
            return False
        if session_id is not None and msg.method not in LEAVE_WHERE_HELD:
            await self.hub.until_released(session_id, self)
            self.touched.add(session_id)
        if kind is Kind.REQUEST:
            at = None if msg.method in CONNECTION_LEVEL else scope or session_id
            assert msg.id is not UNSET
            self._pending[jsonrpc.id_key(msg.id)] = Pending(msg.method, at, session_id)
            if msg.method == Method.PROMPT and session_id is not None:
                self.turns.started(session_id, msg.id)
            self._nothing_in_flight = anyio.Event()
        return True

    async def _to_proxy(self, line: bytes, *, after_end: bool = False) -> None:
        process = self._process if after_end else await self._proxy()
        if process is None or (after_end and self._let_go):
            return
        assert process.stdin is not None
        async with self._writing:
            try:
                await process.stdin.send(line.rstrip(b"\n") + b"\n")
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                self.end(Ended.PROXY_EXITED)

    async def initialize(self, line: bytes, msg: Message) -> bytes | None:
        """``initialize`` over HTTP (``msg``, ``line`` decoded): its answer is the POST's body, not a stream
        message."""
        self.opt_in(msg.params)
        pending = Pending(Method.INITIALIZE, None)
        pending.answered = anyio.Event()
        self._pending[jsonrpc.id_key(msg.id)] = pending
        await self._to_proxy(line)
        with anyio.move_on_after(self.hub.initialize_timeout):
            await pending.answered.wait()
        return pending.answer if pending.answer is None else self._resumable(pending.answer)

    def _resumable(self, answer: bytes) -> bytes:
        """The answer, with the draft RFD's ``transport.resumable`` in its result (provisional names): what
        this connection's streams keep for a client that resumes one (``Last-Event-ID``, ``stream/resume``)."""
        limits = self.outbox.replay_limits
        if limits is None:
            return answer
        resumable = {"retentionMessages": limits.messages, "retentionSeconds": math.floor(limits.seconds)}
        return _with_result(answer, lambda result: _merge(result, "transport", {"resumable": resumable}))

    def _with_turn_state(self, answer: bytes, session_id: str | None) -> bytes:
        """A ``session/status`` answer with ``_meta["acp/turnState"]``: whether its turn still runs."""
        state = self.turns.of(session_id) if session_id is not None else None
        if state is None:
            return answer
        return _with_result(answer, lambda result: _merge(result, "_meta", {TURN_STATE_META: state}))

    # --- proxy -> client ---------------------------------------------------------------------

    async def _from_proxy(self, line: bytes) -> None:
        decoded = jsonrpc.decode_line(line)
        if isinstance(decoded, BadLine):
            log.warning("connection %s: its proxy wrote a line that is not JSON-RPC: dropped", self.id)
            return
        msg, kind = decoded
        if kind is not Kind.RESPONSE:
            if self.ended is not None and kind is Kind.REQUEST:
                self._no_client_to_ask(msg)
            await self.outbox.put(session_of(msg.params), line)
            return
        pending = self._pending.pop(jsonrpc.id_key(msg.id), None) if msg.id is not None else None
        if not self._pending:
            self._nothing_in_flight.set()
        if pending is None:
            await self.outbox.put(None, line)
            return
        if pending.answered is not None:
            pending.answer = line
            pending.answered.set()
            return
        if pending.method == Method.PROMPT and pending.session_id is not None:
            assert msg.id is not UNSET
            stop = (jsonrpc.decode_object(msg.result) or {}).get("stopReason") if msg.error is UNSET else None
            self.turns.ended(pending.session_id, msg.id, stop if isinstance(stop, str) else None)
        elif pending.method == Method.STATUS and msg.error is UNSET:
            line = self._with_turn_state(line, pending.session_id)
        elif pending.method == Method.INITIALIZE and self.outbox.cursor_meta and self.transport == "websocket":
            line = self._resumable(line)
        if msg.error is UNSET and pending.method in (Method.NEW, Method.FORK):
            made = (jsonrpc.decode_object(msg.result) or {}).get("sessionId")
            if isinstance(made, str):
                self.hub.store.set_owner(made, self.principal.key)  # on record before the client has the id
                self.touched.add(made)
        if msg.error is UNSET and pending.method == Method.LIST and self.principal.sees != "all":
            line = self._visible_list(msg)
        await self.outbox.put(pending.scope, line)

    def _visible_list(self, msg: Message) -> bytes:
        result: dict[str, Any] = jsonrpc.decode_object(msg.result) or {}
        sessions = result.get("sessions")
        if isinstance(sessions, list):
            result["sessions"] = visible_sessions(sessions, self.principal, self.hub.store.owned_by(self.principal.key))
        assert msg.id is not UNSET  # an answer
        return jsonrpc.result_response(msg.id, result).rstrip(b"\n")

    # --- the proxy process -------------------------------------------------------------------

    async def _proxy(self) -> ProxyProcess | None:
        """The connection's proxy, started with the first message that needs it."""
        if self.ended is not None:
            return None
        if self._started is None:
            self._started = anyio.Event()
            self.hub.start_task(self._run_proxy)
        await self._started.wait()
        return self._process

    async def _run_proxy(self) -> None:
        assert self._started is not None
        try:
            process = await self.hub.start_proxy(
                {
                    CLIENT_ENV: f"{self.principal.label} over {self.transport} from {self.peer}",
                    PRINCIPAL_ENV: self.principal.label if self.principal.key.startswith("token:") else LOCAL,
                }
            )
        except OSError as exc:
            log.error("connection %s: could not start its proxy: %s", self.id, exc)
            self._started.set()
            self.end(Ended.PROXY_EXITED)
            return
        self._process = process
        self.hub.proxy_started()
        self._started.set()
        log.info("connection %s (%s, %s): proxy pid %d", self.id, self.principal.label, self.transport, process.pid)
        assert process.stdout is not None
        reader = LineReader(process.stdout, self.hub.limits.max_message_bytes)
        try:
            while True:
                try:
                    batch = await reader.receive_batch()
                except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                    break
                if self.transport == "websocket" and self._plain_notifications(batch):
                    # The streaming path: one stream, nothing to route or note (an object a line: no blank one).
                    await self.outbox.put_all(zip(repeat(None), batch.lines))
                    continue
                targets = None if self.transport == "websocket" else self._notification_targets(batch)
                if targets is not None:  # streamable HTTP's streaming path: each to its session's stream
                    await self.outbox.put_all(zip(targets, batch.lines, strict=True))
                    continue
                for line in batch.lines:
                    if line.strip():
                        await self._from_proxy(line)
        finally:
            with anyio.CancelScope(shield=True):
                await self._reap(process)
                await process.aclose()  # its pipes (an exec'd one's also close with its transport)
                if self.ended is None:
                    self.end(Ended.PROXY_EXITED)
                self.hub.released(self)
                self.hub.proxy_exited()

    @staticmethod
    def _notification_targets(batch: Batch) -> list[str | None] | None:
        """The stream of each line of ``batch`` when every line is a notification (decoded with one call): its
        session's, as ``_from_proxy`` routes one."""
        return notification_sessions(batch.block, batch.count) if batch.block else None

    @staticmethod
    def _plain_notifications(batch: Batch) -> bool:
        """Whether every line of ``batch`` is a notification (decoded with one call)."""
        return bool(batch.block) and jsonrpc.notification_methods(batch.block, batch.count) is not None

    async def _reap(self, process: ProxyProcess) -> None:
        """Wait for the proxy to shut down by itself (stdin closed); a proxy that will not is stopped."""
        with anyio.move_on_after(self.hub.proxy_exit_grace):
            await process.wait()
            return
        log.warning("connection %s: proxy pid %d did not exit in time: terminated", self.id, process.pid)
        _signal(process, signal.SIGTERM)  # it suspends its sessions and exits, as on SIGTERM from anyone
        with anyio.move_on_after(5):
            await process.wait()
            return
        _signal(process, signal.SIGKILL)  # its trees are reaped by the install's next proxy
        await process.wait()

    def _no_client_to_ask(self, msg: Message) -> None:
        """An agent->client request once the client has gone: answered at once, so the turn goes on."""
        assert msg.id is not UNSET
        error = jsonrpc.error_response(msg.id, jsonrpc.INTERNAL_ERROR, "no client is connected to answer this")
        self.hub.start_task(lambda: self._to_proxy(error, after_end=True))

    # --- ending ------------------------------------------------------------------------------

    def end(self, why: Ended) -> None:
        """End the connection: its streams close, its proxy gets EOF and suspends its sessions.

        A connection that dropped with requests in flight keeps its proxy for ``linger`` first,
        until they are answered (their answers go nowhere; the turns are on record as tasks), or
        until another connection asks for one of its sessions.
        """
        if self.ended is not None:
            return
        self.ended = why
        log.info("connection %s (%s): ended: %s", self.id, self.principal.label, why.reason)
        self.outbox.close()
        for pending in self._pending.values():
            if pending.answered is not None:
                pending.answered.set()
        self.hub.forget(self)
        if self._process is not None and self._process.stdin is not None:
            if why is Ended.GONE and self._pending and self.hub.limits.linger > 0:
                self.hub.start_task(self._linger)
            else:
                self.let_go()
        elif self._started is None:
            self.hub.released(self)  # no proxy was ever started: nothing to hand over
        self.closed.set()

    async def _linger(self) -> None:
        log.info(
            "connection %s (%s): %d request(s) in flight: its proxy lingers up to %.0fs for them",
            self.id,
            self.principal.label,
            len(self._pending),
            self.hub.limits.linger,
        )
        with anyio.move_on_after(self.hub.limits.linger):
            await self._nothing_in_flight.wait()
        self.let_go()

    @property
    def resumable(self) -> bool:
        """Whether its client can take it over on a new socket (``stream/resume``): a WebSocket whose client
        asked for cursors, on a ``serve`` that waits for resumes."""
        return self.transport == "websocket" and self.outbox.cursor_meta and self.hub.limits.resume_grace > 0

    def stalled(self) -> bool:
        """Its client took nothing for ``stall_timeout`` while ``max_pending`` messages waited: not reading. A
        WebSocket client that can resume loses its socket, not its connection (it waits for a resume, as after a
        drop: a phone out of coverage looks so); any other connection ends."""
        if self.resumable:
            if self.attached and not self.stall.is_set():
                log.warning("connection %s (%s): not reading: its socket is let go", self.id, self.principal.label)
                self.stall.set()
            return True
        self.end(Ended.SLOW_READER)
        return False

    def detach(self) -> None:
        """Its WebSocket dropped or closed (the server cannot tell which): a connection whose client asked for
        cursors waits ``resume_grace`` for a ``stream/resume`` (its turns run on, their messages wait), then
        ends as if closed; any other ends now."""
        if self.ended is not None or not self.attached:
            return
        if not self.resumable:
            self.end(Ended.GONE)  # a client that never asked for cursors cannot resume: gone, as it always was
            return
        grace = self.hub.limits.resume_grace
        self.attached = False
        self.outbox.patient = True
        self._reattached = reattached = anyio.Event()
        self.hub.on_change()
        log.info("connection %s (%s): dropped: kept %.0fs for a resume", self.id, self.principal.label, grace)

        async def expire() -> None:
            with anyio.move_on_after(grace):
                await reattached.wait()
            if not reattached.is_set():
                self.end(Ended.GONE)

        self.hub.start_task(expire)

    def reattach(self) -> None:
        """A client resumed it."""
        if not self.attached:
            self.attached = True
            self.outbox.patient = False
            self._reattached.set()
            self.hub.on_change()
            log.info("connection %s (%s): resumed", self.id, self.principal.label)

    def let_go(self) -> None:
        """EOF to the proxy: it answers what is left, suspends its sessions and exits."""
        if self._let_go:
            return
        self._let_go = True
        self._nothing_in_flight.set()
        if self._process is not None and self._process.stdin is not None:
            self.hub.start_task(self._process.stdin.aclose)

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "principal": self.principal.label,
            "transport": self.transport,
            "peer": self.peer,
            "openedAt": self.opened_at,
            "proxyPid": self._process.pid if self._process is not None else None,
            "attached": self.attached,
            "sessions": sorted(self.touched),
        }


class Hub:
    """Every connection of one ``serve``: limits, who owns which session, hand-over between proxies."""

    def __init__(
        self,
        store: RemoteStore,
        proxy_argv: Sequence[str],
        limits: Limits,
        *,
        default_backend: str | None,
        proxy_exit_grace: float,
        initialize_timeout: float = 120.0,
        launcher: Launcher | None = None,
    ) -> None:
        self.store = store
        self.proxy_argv = list(proxy_argv)
        self.launcher = launcher
        self.limits = limits
        self.default_backend = default_backend
        self.proxy_exit_grace = proxy_exit_grace
        self.initialize_timeout = initialize_timeout
        self.connections: dict[str, Connection] = {}
        self._releasing: dict[str, tuple[Connection, anyio.Event]] = {}
        self._proxies = 0
        """Connections' proxies running (their tasks are the hub's)."""
        self._proxy_gone = anyio.Event()
        self.all_released = anyio.Event()
        self._running = anyio.CancelScope()
        self._tasks: anyio.abc.TaskGroup | None = None
        self.refused = 0
        self.slow_readers = 0
        self.failed_auth = 0
        self.on_change: Callable[[], None] = lambda: None

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Hold the connections' tasks until cancelled; then end every connection and wait for its proxy."""
        try:
            async with anyio.create_task_group() as tasks:
                self._tasks = tasks
                tasks.start_soon(self._expire_idle)
                task_status.started()
                try:
                    with self._running:
                        await anyio.sleep(math.inf)
                finally:
                    self.end_all()
                    with anyio.CancelScope(shield=True), anyio.move_on_after(self.proxy_exit_grace + 10):
                        while self._proxies:
                            await self._proxy_gone.wait()
                    tasks.cancel_scope.cancel()
        finally:
            self.all_released.set()

    async def start_proxy(self, env: dict[str, str]) -> ProxyProcess:
        """A connection's proxy with ``env`` added to this process's environment: forked by the launcher, or
        exec'd (``proxy_argv``) when there is none or it has gone."""
        if self.launcher is not None and not self.launcher.gone:
            try:
                return await self.launcher.launch(env)
            except LauncherGone as exc:
                log.warning("%s: each connection's proxy is exec'd from now on", exc)
        return await anyio.open_process(
            self.proxy_argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, env={**os.environ, **env}
        )

    def stop(self) -> None:
        """End every connection, wait for their proxies to exit, and return from ``run``."""
        self._running.cancel()

    def end_all(self) -> None:
        """End every connection, and let go of the proxies of dropped ones still lingering for their turns."""
        for connection in list(self.connections.values()):
            connection.end(Ended.SHUTDOWN)
        for holder, _ in list(self._releasing.values()):
            holder.let_go()

    def start_task(self, func: Callable[[], Any]) -> None:
        assert self._tasks is not None
        self._tasks.start_soon(func)

    def open(self, principal: Principal, transport: str, peer: str) -> Connection | Refusal:
        """A new connection, or why not (too many)."""
        if len(self.connections) >= self.limits.max_connections:
            self.refused += 1
            return Refusal(503, f"too many connections ({self.limits.max_connections})")
        mine = sum(1 for c in self.connections.values() if c.principal.key == principal.key)
        if mine >= self.limits.max_per_principal:
            self.refused += 1
            return Refusal(429, f"too many connections for this token ({self.limits.max_per_principal})")
        connection = Connection(self, principal, transport, peer)
        self.connections[connection.id] = connection
        self.on_change()
        return connection

    def find(self, connection_id: str, principal: Principal) -> Connection | None:
        """The principal's connection of that id; another principal's is as unknown as none."""
        connection = self.connections.get(connection_id)
        if connection is None or connection.principal.key != principal.key:
            return None
        return connection

    def withdraw(self, connection: Connection) -> None:
        """Forget a connection nothing was sent on (its socket resumed another)."""
        if connection._started is None and self.connections.get(connection.id) is connection:
            del self.connections[connection.id]
            connection.outbox.close()
            self.on_change()

    async def resume(self, principal: Principal, connection_id: object, cursor: object) -> Resumed | ResumeFailed:
        """Whether a WebSocket may take over the principal's connection ``connection_id`` after ``cursor``."""
        if not isinstance(connection_id, str) or not (cursor is None or isinstance(cursor, str)):
            return ResumeFailed("invalid_params", "stream/resume takes connectionId and cursor (strings)")
        connection = self.find(connection_id, principal)
        if connection is None or connection.ended is not None:
            return ResumeFailed("unknown_connection", f"no connection {connection_id!r} to resume (ended, or never)")
        if connection.transport != "websocket":
            return ResumeFailed("not_a_websocket", "a streamable HTTP connection resumes with Last-Event-ID")
        if not connection.outbox.cursor_meta:
            return ResumeFailed("not_resumable", 'its client did not ask for cursors (initialize "acp/resumable")')
        missed = await connection.outbox.resume(None, cursor)
        if missed is None or connection.ended is not None:
            return ResumeFailed("cursor_not_retained", f"cursor {cursor!r} is not one this connection still keeps")
        return Resumed(connection, missed)

    def forget(self, connection: Connection) -> None:
        if connection.ended is Ended.SLOW_READER:
            self.slow_readers += 1
        self.connections.pop(connection.id, None)
        if connection._started is not None:  # its proxy may hold sessions until it exits
            event = anyio.Event()
            for session_id in connection.touched:
                self._releasing[session_id] = (connection, event)
        self.on_change()

    def proxy_started(self) -> None:
        self._proxies += 1

    def proxy_exited(self) -> None:
        self._proxies -= 1
        self._proxy_gone.set()
        self._proxy_gone = anyio.Event()

    def released(self, connection: Connection) -> None:
        """``connection``'s proxy has exited: the sessions it held are suspended, free to take."""
        for session_id, (holder, event) in list(self._releasing.items()):
            if holder is connection:
                del self._releasing[session_id]
                event.set()

    async def until_released(self, session_id: str, asker: Connection) -> None:
        held = self._releasing.get(session_id)
        if held is None or held[0] is asker:
            return
        log.info("session %s: waiting for the proxy of an ended connection to let it go", session_id)
        held[0].let_go()  # a proxy lingering for its turns: the session is wanted now
        with anyio.move_on_after(HANDOVER_TIMEOUT):
            await held[1].wait()

    def may_see(self, principal: Principal, session_id: str) -> bool:
        return sees_session(principal, self.store.owner_of(session_id))

    def end_revoked(self) -> None:
        """End the connections of tokens revoked since they authenticated."""
        live = {t.principal for t in self.store.tokens() if t.revoked_at is None}
        for connection in list(self.connections.values()):
            key = connection.principal.key
            if key.startswith("token:") and key not in live:
                connection.end(Ended.REVOKED)

    async def _expire_idle(self) -> None:
        """End HTTP connections with nothing open and nothing said for ``resume_grace``; end revoked tokens'."""
        while True:
            await anyio.sleep(min(5.0, self.limits.resume_grace))
            self.end_revoked()
            now = time.monotonic()
            for connection in list(self.connections.values()):
                if connection.transport == "websocket":
                    continue  # held open by its socket, watched by pings; once dropped, by ``detach``
                if connection.outbox.has_stream(None) or now - connection.last_active < self.limits.resume_grace:
                    continue
                connection.end(Ended.IDLE)


class Refusal:
    """An HTTP status and what to tell the client."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        self.message = message


class Resumed(msgspec.Struct, frozen=True):
    """A WebSocket resumes ``connection``: ``missed`` (cursor and line, oldest first) is written first."""

    connection: Connection
    missed: list[tuple[str, bytes]]


class ResumeFailed(msgspec.Struct, frozen=True):
    """Why a ``stream/resume`` cannot be done (``reason``, provisional names), in words."""

    reason: str
    message: str


def _signal(process: ProxyProcess, sig: signal.Signals) -> None:
    """Signal a connection's proxy not yet reaped: through its pidfd where forked, by pid where exec'd (not
    ``Popen.send_signal``, which polls first and could reap the child behind the event loop's back)."""
    if isinstance(process, LaunchedProxy):
        signal_pidfd(process.pidfd, sig)
    else:
        signal_child(process.pid, sig)
