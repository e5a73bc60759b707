"""The lifecycle intents: one public coroutine each, the only way a session changes.

    new            session/new on a prepared process; the id it answers is the stable id
    forward        a request for a session, sent now or queued behind its resume
    cancel         session/cancel: queued prompts end cancelled, the running turn is asked to end (within
                   cancel_timeout, else the proxy answers it and suspends the session); nothing else is reaped
    close          session/close: end the turn in flight, reap the tree, mark it closed (still listed)
    delete         session/delete: as close, then delete it on the backend too and leave a tombstone
    fork           session/fork: on the parent's process, which the fork then keeps (the parent is suspended)
    suspend        stop an idle session's process; it keeps its mapping and is resumable
    resume         the gateway's session/load or session/resume: restore a suspended or closed session
    list_sessions  session/list from the registry (all but the deleted), filtered by who asks
    process_ended  the process of a session exited by itself: the session is suspended
    expire_turn    a turn ran past turn_timeout or was quiet past turn_idle_timeout: cut_turn
    cut_turn       a turn past a limit: cancel, then answer it ourselves and suspend

Timeouts, crashes, the pool and operator commands call these; none carries its own
copy. The decisions inside them (the fate of a queued request, the stable id of a
new session, why a session is unknown) are pure functions at the top of this module.
Every state a session's row goes through, and the code that moves it (these intents,
``Restorer.restore``, and the registry's claims at shutdown and on sessions of dead
proxies): docs/architecture.md, "The states of a session".
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, Final

import anyio
import msgspec
from msgspec import UNSET, Raw, UnsetType

from acp_proxy.concurrency import Background, Stopping
from acp_proxy.config import BackendConfig, Config
from acp_proxy.journal import Kind, SuspendReason
from acp_proxy.logs import ids
from acp_proxy.pool.adapter import Adapter, AdapterGone
from acp_proxy.pool.processes import ProcessPool
from acp_proxy.protocol import jsonrpc
from acp_proxy.protocol.acp import proxy_meta, session_of
from acp_proxy.protocol.errors import ProxyError, describe_exit
from acp_proxy.protocol.jsonrpc import Message, RequestId
from acp_proxy.protocol.methods import Method, is_setting
from acp_proxy.sessions.lifecycle import Action, Event
from acp_proxy.sessions.listing import session_info, title_changes, titles_listed
from acp_proxy.sessions.machine import Fate, Work
from acp_proxy.sessions.registry import (
    LIST_PAGE_SIZE,
    Ownership,
    SessionRecord,
    SessionRegistry,
    SessionState,
    decode_cursor,
    encode_cursor,
)
from acp_proxy.sessions.restore import GatewayPort, Restorer
from acp_proxy.sessions.table import Session, SessionTable
from acp_proxy.sessions.visibility import SessionRow, parse_requester, visible_rows
from acp_proxy.tasks.status import TERMINAL, TaskStatus
from acp_proxy.tasks.turn import Limit, Turn
from acp_proxy.tasks.turns import TurnBook, turn_ids
from acp_proxy.timings import Timing

log = logging.getLogger("acp_proxy.lifecycle")

Answer = Callable[[Message], Message | None]


# --- decisions ------------------------------------------------------------------------------------


def unknown_session_error(session_id: str, record: SessionRecord | None) -> ProxyError:
    """Why this proxy cannot serve a session, from its row (if any)."""
    if record is not None and record.state is SessionState.CLOSED:
        return ProxyError.session_closed(session_id)
    if record is not None and record.state is SessionState.DELETED:
        return ProxyError.session_deleted(session_id)
    if record is not None:
        return ProxyError.session_in_use(session_id, record.instance_id)
    return ProxyError.unknown_session(session_id)


def stable_id(issued: str, *, taken_here: bool, live_elsewhere: bool) -> str:
    """The id the gateway will know a new session by: the adapter's, unless another session holds it.

    Adapters that number sessions per process give every process's first session the same
    id; a second session with an id already served (here, or live in another proxy) gets a
    proxy-side id, and ``sessionId`` is rewritten on its connection.
    """
    if taken_here or live_elsewhere:
        return f"{issued}~{uuid.uuid4().hex[:8]}"
    return issued


def answered_as(answer: Message, issued: str, stable: str) -> Message | None:
    """The answer that opened a session, under its stable id if that differs from the one the adapter issued."""
    if stable == issued:
        return None
    result = jsonrpc.decode_object(answer.result) or {}
    return Message(jsonrpc="2.0", id=answer.id, result=Raw(jsonrpc.encode_json({**result, "sessionId": stable})))


def ownership_from(meta: dict[str, Any]) -> Ownership:
    def text(key: str) -> str | None:
        value = meta.get(key)
        return value if isinstance(value, str) else None

    return Ownership(
        session_key=text("sessionKey"),
        owner_session_key=text("ownerSessionKey"),
        spawned_by=text("spawnedBy"),
        parent_session_key=text("parentSessionKey"),
        agent_id=text("agentId"),
    )


def visibility_row(record: SessionRecord) -> SessionRow:
    owner = record.ownership
    return SessionRow(
        session_id=record.session_id,
        session_key=owner.session_key,
        owner_session_key=owner.owner_session_key,
        spawned_by=owner.spawned_by,
        parent_session_key=owner.parent_session_key,
        agent_id=owner.agent_id,
        lineage=frozenset(),
    )


CANCELLED: Final = {"stopReason": "cancelled"}
FATE_ERRORS: Final[dict[Fate, Callable[[str], ProxyError]]] = {
    Fate.WITHDRAWN: lambda session_id: ProxyError.cancelled(),
    Fate.SHUTDOWN: lambda session_id: ProxyError.proxy_shutdown(),
    Fate.CLOSED: ProxyError.session_closed,
    Fate.DELETED: ProxyError.session_deleted,
}
"""The error a queued request is answered with, by its fate (``machine.fate_of``), when it is not sent."""
RECYCLES: Final = frozenset(
    {
        SuspendReason.SESSION_MAX_MEMORY,
        SuspendReason.SESSION_KILL_MEMORY,
        SuspendReason.TURN_IDLE_TIMEOUT,
        SuspendReason.BROKEN,
    }
)
"""Suspensions that recycle a process found unfit (too large, hung, broken), told to the notify command."""
_CUT_EVENTS: Final = {
    Limit.TURN_TIMEOUT: "timed_out",
    Limit.TURN_IDLE_TIMEOUT: "idle_timeout",
    Limit.SESSION_KILL_MEMORY: "memory_limit",
}
"""The task event each limit records when it cuts a turn."""
_CUT_META: Final = {
    Limit.TURN_TIMEOUT: {"timedOut": True},
    Limit.TURN_IDLE_TIMEOUT: {"timedOut": True, "idle": True},
    Limit.SESSION_KILL_MEMORY: {"memoryLimit": True},
}
"""What the proxy's own answer to a cut turn says, in ``_meta["acp-proxy"]``."""
_CUT_REASONS: Final = {
    Limit.TURN_TIMEOUT: SuspendReason.TURN_TIMEOUT,
    Limit.TURN_IDLE_TIMEOUT: SuspendReason.TURN_IDLE_TIMEOUT,
    Limit.SESSION_KILL_MEMORY: SuspendReason.SESSION_KILL_MEMORY,
}
LIST_TIMEOUT: Final = 2.0
"""How long ``session/list`` waits for the backends' own lists (their titles) before answering without them."""
LISTED_PAGES: Final = 10
"""Pages of a backend's own list read at most, per working directory."""


class SessionIntents:
    """What can happen to a session, each intent one coroutine; the rest of the proxy calls these."""

    def __init__(
        self,
        config: Config,
        registry: SessionRegistry,
        table: SessionTable,
        pool: ProcessPool,
        turns: TurnBook,
        gateway: GatewayPort,
        background: Background,
        stopping: Stopping,
    ) -> None:
        self.config = config
        self.registry = registry
        self.table = table
        self.pool = pool
        self.turns = turns
        self.gateway = gateway
        self.background = background
        self.stopping = stopping
        self.restorer = Restorer(config, registry, table, pool, gateway)
        self._queued_ids: set[RequestId] = set()
        self._withdrawn: set[RequestId] = set()
        """Queued requests the gateway withdrew with ``$/cancel_request`` before they were sent."""

    # --- new ----------------------------------------------------------------------------------

    def backend_named(self, meta: dict[str, Any]) -> BackendConfig:
        """The backend ``_meta["acp-proxy"].backend`` names, else the proxy's default."""
        name = meta.get("backend")
        if name is None:
            return self.pool.default_backend
        if not isinstance(name, str) or name not in self.config.backends:
            raise ProxyError.unknown_backend(name, self.config.backends)
        return self.config.backends[name]

    async def _prepared_for(self, msg: Message) -> Adapter | None:
        """A prepared process of the backend the request names; ``None`` (the request answered) if none."""
        try:
            return await self.pool.take(self.backend_named(proxy_meta(msg.params)))
        except ProxyError as exc:
            await self.gateway.fail(msg.id, exc)
            return None

    async def _send_first(self, adapter: Adapter, msg: Message, on_answer: Answer) -> None:
        """The request a process was taken for, under its start deadline (past it, ``start_timeout`` answered)."""
        try:
            await self.pool.forward_first(adapter, msg, on_answer)
        except ProxyError as exc:
            await self.gateway.fail(msg.id, exc)

    async def new(self, msg: Message) -> None:
        """``session/new``: on a prepared adapter; the id it answers becomes the stable id."""
        received = time.monotonic()
        await self.registry.caught_up()  # the answer's stable id is decided from the rows, in a callback
        adapter = await self._prepared_for(msg)
        if adapter is None:
            return
        backend = adapter.backend

        def created(answer: Message) -> Message | None:
            adapter.unclaim()
            session_id = session_of(answer.result) if answer.error is UNSET else None
            if session_id is None:
                return None  # the error goes to the gateway; the process stays as a spare
            self.pool.timings.observe(Timing.SESSION_NEW, backend.name, time.monotonic() - received)
            return answered_as(answer, session_id, self._register(session_id, backend, adapter, msg.params))

        await self._send_first(adapter, msg, created)

    def _register(self, session_id: str, backend: BackendConfig, adapter: Adapter, params: Raw | UnsetType) -> str:
        """A session the adapter just opened (``session/new``, or a load of one the registry did not know).

        A suspended row of an earlier proxy with the same id is replaced: the adapter has
        issued that id afresh, so the old session is not one it could restore.
        """
        stable = self._stable_for(session_id)
        given = jsonrpc.decode_object(params) or {}
        directories = given.get("additionalDirectories")
        record = SessionRecord(
            session_id=stable,
            adapter_session_id=session_id,
            backend=backend.name,
            cwd=str(given.get("cwd", "")),
            mcp_servers=jsonrpc.encode_json(given.get("mcpServers", [])).decode(),
            additional_directories=None if directories is None else jsonrpc.encode_json(directories).decode(),
            lease_id=adapter.supervised.lease.lease_id,
            auth_method=self._auth_method(),
            ownership=ownership_from(proxy_meta(params)),
        )
        self.table.open(self.registry.create(record), adapter, session_id)
        return stable

    def _stable_for(self, issued: str) -> str:
        """The stable id of a session the adapter just opened under ``issued`` (``stable_id``, from the rows)."""
        taken = self.registry.get(issued)  # up to date: the request waited for the queued writes
        live_elsewhere = (
            taken is not None
            and taken.state in (SessionState.LIVE, SessionState.RESUMING)
            and taken.instance_id != self.registry.instance_id
            and not self.registry.take_over_if_orphaned(issued)
        )
        stable = stable_id(issued, taken_here=self.table.get(issued) is not None, live_elsewhere=live_elsewhere)
        if stable != issued:
            log.info("session %s: the adapter's id is taken by another session; known as %s", issued, stable)
        elif taken is not None and taken.state is not SessionState.CLOSED:
            log.info("session %s: issued again by the adapter; the older session of that id is replaced", issued)
        return stable

    def _auth_method(self) -> str | None:
        obj = jsonrpc.decode_object(self.pool.auth_params) or {}
        method = obj.get("methodId")
        return method if isinstance(method, str) else None

    # --- forward ------------------------------------------------------------------------------

    async def forward(self, msg: Message, session_id: str) -> None:
        """A request for a session: to its process now, or queued behind what the session waits for."""
        session = await self.table.find(session_id)
        if session is None:
            await self._fail_unknown(msg.id, session_id)
            return
        is_prompt = msg.method == Method.PROMPT
        adapter = session.live_adapter
        queued = self.table.request(session, prompt=is_prompt, process_up=adapter is not None)
        if queued is None and adapter is not None:  # else behind what the session waits for
            lease = adapter.supervised.lease.lease_id
            turn = self._open_turn(session, msg, lease) if is_prompt else None
            await adapter.forward(msg, self._bookkeeping(session, msg), turn=turn)
            return
        queued_turn = self._open_turn(session, msg, None) if is_prompt else None
        self._queued_ids.add(msg.id)  # type: ignore[arg-type]
        self.table.wait_in_queue(session, queued, lambda: self._forward_when_live(session, msg, queued_turn))

    def _open_turn(self, session: Session, msg: Message, lease: str | None) -> Turn:
        """The prompt's task, its row queued for writing, and the session's last activity after it."""
        turn = self.turns.open_turn(session.session_id, session.record.backend, msg, lease)
        self.registry.note_prompt(session.session_id, turn.created_at)
        return turn

    def withdraw(self, request_id: RequestId) -> bool:
        """``$/cancel_request`` for a request still queued: it is answered -32800 when its turn comes."""
        if request_id not in self._queued_ids:
            return False
        self._withdrawn.add(request_id)
        return True

    def _bookkeeping(self, session: Session, msg: Message) -> Answer | None:
        """What to record when the adapter answers a request of this session."""
        method = msg.method
        if isinstance(method, str) and is_setting(method):

            def remember(answer: Message) -> None:
                params = jsonrpc.decode_object(msg.params)
                if answer.error is UNSET and params is not None:
                    self.registry.record_setting(session.session_id, method, params)

            return remember
        return None

    async def _forward_when_live(self, session: Session, msg: Message, turn: Turn | None) -> None:
        """A request that waited for its session: bring the session back if need be, then forward."""
        try:
            if await self._answered_while_queued(session, msg, turn):
                return
            resumed = session.live_adapter is None
            try:
                adapter = await self._ensure_live(session)
            except ProxyError as exc:
                if turn is not None:
                    self.turns.settle(turn, error=(exc.code, exc.message))
                await self.gateway.fail(msg.id, exc)
                return
            if adapter is None and session.closed:  # a close cut the resume short
                await self._answered_while_queued(session, msg, turn)
                return
            if adapter is None:  # its new process died as it came up: the session stays suspended
                if self.stopping.begun:  # the shutdown stopped it: what waited ends with the proxy
                    exited = ProxyError.proxy_shutdown(backend=session.record.backend)
                else:
                    exited = ProxyError.adapter_exited(None, session.record.backend, during=Method.RESUME)
                if turn is not None:
                    self.turns.settle(turn, error=(exited.code, exited.message))
                await self.gateway.fail(msg.id, exited)
                return
            if await self._answered_while_queued(session, msg, turn):
                return
            if turn is not None:
                self.turns.start_turn(turn, adapter.supervised.lease.lease_id, adapter.pid, resumed=resumed)
            call_id = await adapter.forward(msg, self._bookkeeping(session, msg), turn=turn)
            if resumed and turn is None and not str(msg.method).startswith("_"):
                self.background.start(functools.partial(self._expect_answer, session, adapter, call_id, msg))
        finally:
            self._queued_ids.discard(msg.id)
            if turn is not None and turn.status is TaskStatus.QUEUED:  # cancelled while it waited
                self.turns.settle(turn, error=(jsonrpc.REQUEST_CANCELLED, "the proxy stopped before sending it"))

    async def _expect_answer(self, session: Session, adapter: Adapter, call_id: int, msg: Message) -> None:
        """The request a restore was for must be answered within ``start_timeout``, as it would be by a
        process started for it: a restored process that does not answer it is broken (a dead or stuck
        connection), and is recycled rather than reused. A prompt is not held to this (a turn's limits
        are ``turn_timeout`` and ``turn_idle_timeout``), nor an extension method (``_vendor/...``:
        its time is its own), nor a process that runs a turn meanwhile."""
        timeout = self.pool.start_timeout(adapter.backend)
        if timeout == float("inf"):
            return
        with anyio.move_on_after(timeout):
            await adapter.until_call_answered(call_id)
        if adapter.gone or call_id not in adapter.pending or session.live_adapter is not adapter:
            return
        if adapter.turn is not None:  # a turn runs there: its own limits judge the process
            log.warning(
                "session %s: pid %s has not answered %s within start_timeout (%gs) after a restore; "
                "a turn runs there, so it is kept",
                session.session_id,
                adapter.pid,
                msg.method,
                timeout,
                extra=ids(session=session.session_id),
            )
            return
        call = adapter.take_pending(call_id)
        assert call is not None
        why = f"pid {adapter.pid} did not answer {msg.method} within start_timeout ({timeout:g}s) after a restore"
        log.warning(
            "session %s: %s: a broken process, recycled", session.session_id, why, extra=ids(session=session.session_id)
        )
        adapter.mute()
        self.suspend(session.session_id, why, SuspendReason.BROKEN, even_if_busy=True)
        await self.gateway.fail(
            call.gateway_id, ProxyError.start_timeout(str(msg.method), adapter.backend.name, timeout)
        )

    async def _answered_while_queued(self, session: Session, msg: Message, turn: Turn | None) -> bool:
        """Answer a queued request that must not be sent any more (withdrawn, cancelled, closed, shutdown),
        as the session machine's ``fate_of`` says."""
        withdrawn = msg.id in self._withdrawn
        self._withdrawn.discard(msg.id)
        fate = self.table.fate(
            session,
            withdrawn=withdrawn,
            refusing=self.stopping.refusing,
            task_cancelled=turn is not None and turn.cancel_requested,
        )
        if fate is Fate.SEND:
            if not session.forgotten.is_set():
                return False
            fate = Fate.DELETED if session.deleted else Fate.CLOSED  # done with here: closed, or deleted
        if fate is Fate.CANCELLED:  # session/cancel or close meanwhile, or an operator cancelled this task
            if turn is not None:
                self.turns.settle(turn, stop_reason="cancelled")
            await self.gateway.answer(msg.id, CANCELLED)
            return True
        error = FATE_ERRORS[fate](session.session_id)
        if turn is not None:
            self.turns.settle(turn, error=(error.code, error.message))
        await self.gateway.fail(msg.id, error)
        return True

    async def _ensure_live(self, session: Session) -> Adapter | None:
        """The session's process, restoring it first if it has none; ``None`` if a close cut that short.

        Runs from the session's queue, so nothing else of the session runs meanwhile.
        """
        if session.live_adapter is None:
            record = await self.registry.current(session.session_id)
            if record is not None and record.state is SessionState.CLOSED:
                # Held in memory since a load of it failed: only the gateway's load or resume reopens it.
                raise ProxyError.session_closed(session.session_id)
            await self.restorer.restore_cancellable(session, gateway_asked=None)
        return session.live_adapter

    async def _fail_unknown(self, request_id: RequestId | UnsetType, session_id: str) -> None:
        held = self.table.get(session_id)
        if held is not None and held.deleted:  # being deleted here: its row says so once it is done
            await self.gateway.fail(request_id, ProxyError.session_deleted(session_id))
            return
        if held is not None and held.closed:  # being closed here: its row says so only once it is reaped
            await self.gateway.fail(request_id, ProxyError.session_closed(session_id))
            return
        await self.gateway.fail(request_id, unknown_session_error(session_id, await self.registry.current(session_id)))

    # --- cancel -------------------------------------------------------------------------------

    async def cancel(
        self,
        session: Session,
        *,
        by: str | None,
        task: Turn | None = None,
        notification: tuple[Message, bytes] | None = None,
        bounded: bool = True,
    ) -> None:
        """Cancel a session's prompt turns; nothing is reaped while the adapter ends them in time.

        Without ``task`` this is ACP's ``session/cancel``: every prompt queued for the session
        ends ``cancelled``, and the running turn is asked to end (the gateway's own
        ``notification`` is forwarded, else the proxy sends one). With ``task``, only that
        turn: answered ``cancelled`` when its turn to be sent comes, or asked to end if it
        runs. ``by`` is who asked, for the task's events (``None``: the event is already noted).
        ``bounded``: a running turn still unanswered ``cancel_timeout`` after the first
        cancel is answered by the proxy (``_cut_short_after``).
        """
        if task is None:
            if not self.table.accepts(session, Event.CANCEL):
                log.info("dropped session/cancel for session %s: nothing of it runs or waits", session.session_id)
                return
            self.table.advance(session, Event.CANCEL)  # a new epoch: its queued prompts end cancelled
        elif task.status is TaskStatus.QUEUED:
            task.cancel_requested = True
            task.event("cancel_requested", f"by {by} (while queued)")
            return
        adapter = session.live_adapter
        if adapter is None:
            log.info("dropped session/cancel for session %s: it has no live process", session.session_id)
            return
        if by is not None:
            self.turns.note(adapter.turn, "cancel_requested", f"by {by}")
        await self._ask_to_end_turn(session, adapter, notification)
        turn = adapter.turn if task is None else task
        if bounded and turn is not None and turn.status is TaskStatus.RUNNING and not turn.cancel_bounded:
            limit = self.config.cancel_timeout(session.record.backend)
            if limit > 0:
                turn.cancel_bounded = True
                self.background.start(lambda: self._cut_short_after(limit, session, adapter, turn))

    async def _cut_short_after(self, limit: float, session: Session, adapter: Adapter, turn: Turn) -> None:
        """A cancelled turn its adapter has not ended ``limit`` seconds later (gemini-cli ends its
        network retries first, for a minute or so): the proxy answers it and stops the process."""
        if await self.turns.wait_settled(turn, limit) or adapter.gone or self.stopping.begun:
            return
        turn.event("cancel_timeout", f"still running {limit:g}s after session/cancel")
        log.warning(
            "task %s: still running %gs after session/cancel (cancel_timeout): answered cancelled",
            turn.task_id,
            limit,
            extra=turn_ids(turn),
        )
        await self._answer_for_adapter(
            session,
            adapter,
            turn,
            CANCELLED,
            why=f"still running {limit:g}s after session/cancel",
            reason=SuspendReason.CANCEL_TIMEOUT,
            ended_by=f"cancel_timeout: not ended by the agent {limit:g}s after session/cancel",
        )

    async def _ask_to_end_turn(
        self, session: Session, adapter: Adapter, notification: tuple[Message, bytes] | None = None
    ) -> None:
        """``session/cancel`` to the adapter: the gateway's own, else one under the id the adapter knows."""
        try:
            if notification is not None:
                await adapter.pass_on(*notification)
            else:
                cancel = {"sessionId": adapter.adapter_session or session.session_id}
                await adapter.send(jsonrpc.notification(Method.CANCEL, cancel))
        except AdapterGone:
            log.info("dropped session/cancel: the adapter has exited")

    # --- close --------------------------------------------------------------------------------

    async def close(self, session_id: str, request: Message | None) -> Session | None:
        """``session/close``: end the turn in flight (answered ``cancelled``), reap the tree, mark it closed.

        A resume in progress is cut short, and requests queued for the session are answered
        (prompts ``cancelled``) rather than sent. The session stays listed; only the gateway's
        own load or resume brings it back. ``request`` is the gateway's, answered ``{}`` once
        the session is gone (``None``: an operator's close); closing a closed session is ``{}``
        too. The session being closed, or ``None`` if there is none to close.
        """
        session = await self.table.find(session_id)
        if session is not None and session.closed and not session.deleted:
            if request is not None:  # being closed already: answered once that is done
                self.table.enqueue(session, Work.ANSWER, lambda: self.gateway.answer(request.id, {}))
            return None
        if session is None or session.closed:
            if request is not None:
                record = await self.registry.current(session_id)
                if record is not None and record.state is SessionState.CLOSED:
                    await self.gateway.answer(request.id, {})
                else:
                    await self._fail_unknown(request.id, session_id)
            return None
        self._ending(session)
        self.table.enqueue(session, Work.REAP, lambda: self._reap_closed(session, request))
        return session

    def _ending(self, session: Session, *, deleted: bool = False) -> None:
        """From now on nothing more is sent to the session: queued requests are answered, a resume is cut short
        (the table's step does both: ``NEW_EPOCH``, ``CUT_SHORT``)."""
        self.table.advance(session, Event.DELETE if deleted else Event.CLOSE)

    async def _reap_closed(self, session: Session, request: Message | None) -> None:
        if session.deleted:  # a delete came after the close: its reap, queued behind this, does the work
            if request is not None:
                self.table.enqueue(session, Work.ANSWER, lambda: self.gateway.answer(request.id, {}))
            return
        adapter = self.table.advance(session, Event.REAP).released
        if adapter is not None:
            await self._end_turns(session, adapter)
            await self.pool.stop(adapter)
        if session.stopping is not None:
            await session.stopping.wait()
        self.table.advance(session, Event.REAPED)
        self.registry.mark_closed(session.session_id)
        self.table.forget(session)
        log.info("session %s closed", session.session_id, extra=ids(session=session.session_id))
        by = "gateway" if request is not None else "operator"
        self.pool.journal.record(Kind.CLOSED, backend=session.record.backend, label=by, session_id=session.session_id)
        if request is not None:
            await self.registry.caught_up()  # the gateway is told once the row says so
            await self.gateway.answer(request.id, {})

    async def _end_turns(self, session: Session, adapter: Adapter) -> None:
        """Cancel the turn in flight, give the adapter ``close_timeout`` to end it, answer the rest ourselves."""
        if adapter.turn_in_flight:
            await self._ask_to_end_turn(session, adapter)
            with anyio.move_on_after(self.config.shutdown.close_timeout):
                await adapter.until_answered()
        for call in adapter.take_gateway_calls():
            if call.method == Method.PROMPT:
                if call.turn is not None:
                    self.turns.settle(call.turn, stop_reason="cancelled")
                await self.gateway.answer(call.gateway_id, CANCELLED)
            else:
                await self.gateway.reply(
                    call.gateway_id, ProxyError.closed_in_flight().response(call.gateway_id, method=call.method)
                )

    # --- delete -------------------------------------------------------------------------------

    async def delete(self, msg: Message, session_id: str) -> None:
        """``session/delete``: end the session as a close does, delete it on the backend, leave a tombstone.

        Served for every backend. It is gone from ``session/list`` at once and for good; an
        unknown or already deleted id is ``{}``. The backend's own ``session/delete`` (when it
        advertises one) goes to the live process, else to a short-lived one, within
        ``resume_timeout``; if that fails it is logged and the delete stands.
        """
        session = await self.table.find(session_id, reopen=True)
        if session is None:
            record = await self.registry.current(session_id)
            if record is None or record.state is SessionState.DELETED:
                await self.gateway.answer(msg.id, {})
            else:
                await self._fail_unknown(msg.id, session_id)  # live in another proxy
            return
        if session.deleted:  # being deleted already: answered once that is done
            self.table.enqueue(session, Work.ANSWER, lambda: self.gateway.answer(msg.id, {}))
            return
        self._ending(session, deleted=True)
        self.table.enqueue(session, Work.REAP, lambda: self._reap_deleted(session, msg))

    async def _reap_deleted(self, session: Session, request: Message) -> None:
        adapter = self.table.advance(session, Event.REAP).released
        record = await self.registry.current(session.session_id) or session.record
        self.registry.mark_deleted(session.session_id)  # first: no list shows it from now on
        if adapter is not None:
            await self._end_turns(session, adapter)
            await self._delete_on_backend(adapter, record.adapter_session_id)
            await self.pool.stop(adapter)
        else:
            if session.stopping is not None:
                await session.stopping.wait()
            await self._delete_on_a_process_of(record)
        self.table.advance(session, Event.REAPED)
        self.table.forget(session)
        log.info("session %s deleted", session.session_id, extra=ids(session=session.session_id))
        self.pool.journal.record(Kind.DELETED, backend=record.backend, session_id=session.session_id)
        await self.registry.caught_up()  # the gateway is told once the tombstone is on record
        await self.gateway.answer(request.id, {})

    async def _delete_on_backend(self, adapter: Adapter, adapter_session_id: str) -> None:
        """The backend's own ``session/delete``, if it advertises one; a failure is logged, not raised."""
        if not adapter.capabilities.delete:
            return
        try:
            answer = await self.pool.call_answer(adapter, Method.DELETE, {"sessionId": adapter_session_id})
        except ProxyError as exc:
            log.warning("session %s: the backend's session/delete failed: %s", adapter_session_id, exc.message)
            return
        adapter.open_sessions.discard(adapter_session_id)
        if answer.error is not UNSET:
            log.warning("session %s: the backend refused session/delete: %s", adapter_session_id, answer.error.message)

    async def _delete_on_a_process_of(self, record: SessionRecord) -> None:
        """Delete a session with no process on its backend: on a spare, else on a short-lived process."""
        backend = self.config.backends.get(record.backend)
        known = self.pool.known_capabilities.get(record.backend)
        if backend is None or (known is not None and not known.delete):
            return
        spare = self.pool.spare(backend)
        try:
            with anyio.fail_after(self.config.pool.resume_timeout):
                adapter = await self.pool.take(backend)
        except (ProxyError, TimeoutError) as exc:
            log.warning(
                "session %s: no %s process to delete it on (%s); deleted here only",
                record.session_id,
                backend.name,
                exc.message if isinstance(exc, ProxyError) else "resume_timeout",
            )
            return
        try:
            await self._delete_on_backend(adapter, record.adapter_session_id)
        finally:
            if adapter is spare:
                adapter.release_to_spare()
            else:
                await self.pool.stop(adapter)

    # --- fork ---------------------------------------------------------------------------------

    async def fork(self, msg: Message, session_id: str) -> None:
        """``session/fork``: made on the parent's process (only it is sure to hold all of the parent),
        which then serves the fork; the parent is suspended, and comes back on a process of its
        own when next used, as any suspended session. In the parent's queue, after its turn."""
        parent = await self.table.find(session_id)
        if parent is None:
            await self._fail_unknown(msg.id, session_id)
            return
        self.table.enqueue(parent, Work.FORK, lambda: self._fork_when_ready(parent, msg))

    async def _fork_when_ready(self, parent: Session, msg: Message) -> None:
        if parent.closed:
            await self._fail_unknown(msg.id, parent.session_id)
            return
        known = self.pool.known_capabilities.get(parent.record.backend)
        if parent.live_adapter is None and known is not None and not known.fork:
            # Not worth a restore: the backend would only answer that it does not fork.
            await self.gateway.fail(msg.id, ProxyError.fork_unsupported(parent.session_id, parent.record.backend))
            return
        try:
            adapter = await self._ensure_live(parent)
        except ProxyError as exc:
            await self.gateway.fail(msg.id, exc)
            return
        if adapter is None or parent.closed:
            await self._fail_unknown(msg.id, parent.session_id)
            return
        await self.registry.caught_up()  # the fork's row is made from the parent's, in a callback
        answered = anyio.Event()

        def forked(answer: Message) -> Message | None:
            answered.set()
            fork_id = session_of(answer.result) if answer.error is UNSET else None
            if fork_id is None:
                return None
            return answered_as(answer, fork_id, self._take_over_for_fork(parent, adapter, fork_id, msg.params))

        call_id: int | None = None
        with anyio.CancelScope() as scope:
            self.table.restoring(parent, scope)  # a close or delete of the parent cuts the fork short
            try:
                await adapter.until_answered()  # the parent's turn ends before its process changes hands
                if not (adapter.gone or parent.closed or parent.adapter is not adapter):
                    call_id = await adapter.forward(msg, forked)
                    await adapter.answered.until(
                        lambda: answered.is_set() or adapter.gone or call_id not in adapter.pending
                    )
            finally:
                self.table.restoring(parent, None)
        if answered.is_set():
            return
        if call_id is not None and adapter.take_pending(call_id) is None:
            return  # answered for: the relay failed what the process owed when it exited
        # Never sent, or sent and given up: the process exited, or the parent was closed meanwhile.
        if parent.closed:
            await self._fail_unknown(msg.id, parent.session_id)
        else:
            await self.gateway.fail(msg.id, self.pool.gone_error(adapter))

    def _take_over_for_fork(self, parent: Session, adapter: Adapter, fork_id: str, params: Raw | UnsetType) -> str:
        """The fork's row (parent recorded, ownership inherited unless given) and its process: the parent's."""
        record = self.registry.get(parent.session_id) or parent.record  # up to date: see ``_fork_when_ready``
        given = jsonrpc.decode_object(params) or {}
        meta = proxy_meta(params)
        inherited = record.ownership
        ownership = (
            ownership_from(meta)
            if any(key in meta for key in ("sessionKey", "ownerSessionKey", "spawnedBy", "parentSessionKey"))
            else Ownership(
                owner_session_key=inherited.owner_session_key,
                spawned_by=inherited.session_key,
                parent_session_key=inherited.session_key,
                agent_id=inherited.agent_id,
            )
        )
        stable = self._stable_for(fork_id)
        directories = given.get("additionalDirectories")
        fork = SessionRecord(
            session_id=stable,
            adapter_session_id=fork_id,
            backend=record.backend,
            cwd=str(given.get("cwd", record.cwd)),
            mcp_servers=jsonrpc.encode_json(given["mcpServers"]).decode()
            if "mcpServers" in given
            else record.mcp_servers,
            additional_directories=record.additional_directories
            if directories is None
            else jsonrpc.encode_json(directories).decode(),
            lease_id=adapter.supervised.lease.lease_id,
            settings=record.settings,
            auth_method=record.auth_method,
            ownership=ownership,
            parent_session_id=parent.session_id,
        )
        created = self.registry.create(fork)
        if parent.adapter is not adapter or adapter.gone:  # its process is going: the fork starts suspended
            self.registry.mark_suspended(created.session_id)
            return stable
        if not self.table.accepts(parent, Event.HANDED_OVER):
            # The parent is being closed or deleted: its reap ends this process, so the fork starts suspended.
            self.registry.mark_suspended(created.session_id)
            return stable
        self.table.advance(parent, Event.HANDED_OVER)
        self.registry.mark_suspended(parent.session_id)
        self.table.open(created, adapter, fork_id)
        log.info(
            "session %s forked as %s on pid %s, which serves the fork from now on; %s suspended, resumable",
            parent.session_id,
            stable,
            adapter.pid,
            parent.session_id,
            extra=ids(session=stable, lease=adapter.supervised.lease.lease_id),
        )
        return stable

    # --- suspend ------------------------------------------------------------------------------

    def suspend(self, session_id: str, why: str, reason: SuspendReason, *, even_if_busy: bool = False) -> bool:
        """Suspend a session: it keeps its mapping and is resumable; its process is stopped in the background.

        Only an idle session (nothing in flight, nothing queued), unless ``even_if_busy``
        (a turn the proxy has answered itself). False if it was not suspended. Not a coroutine
        on purpose: the pool decides whom to suspend and this bookkeeping follows in the same
        step, with no point in between where another task could take the session.
        """
        session = self.table.get(session_id)
        if session is None:
            return False
        adapter = session.live_adapter
        if adapter is None or not (even_if_busy or session.idle):
            return False
        if not self.table.accepts(session, Event.SUSPEND):
            return False
        self.table.advance(session, Event.SUSPEND)
        self.registry.mark_suspended(session_id)
        log.info(
            "session %s suspended (%s): stopping pid %s",
            session_id,
            why,
            adapter.pid,
            extra=ids(session=session_id, lease=adapter.supervised.lease.lease_id),
        )
        self.pool.journal.record(
            Kind.SUSPENDED, backend=session.record.backend, label=reason, session_id=session_id, detail=why
        )
        if reason in RECYCLES and self.turns.notifier is not None:
            self.turns.notifier.recycled(session_id, session.record.backend, reason, why)
        self.table.stopping(session, self.pool.stop_in_background(adapter))
        return True

    def recycle_due(self, adapter: Adapter) -> None:
        """A turn of ``adapter`` has just ended: if its session is to be recycled (``Adapter.recycle``), now."""
        if adapter.recycle is not None and adapter.gateway_session is not None:
            why, reason = adapter.recycle
            self.suspend(adapter.gateway_session, why, reason)

    def process_ended(self, adapter: Adapter, returncode: int | None) -> None:
        """The process of a session exited (a crash, or its stop): the session is suspended, resumable."""
        session = self.table.get(adapter.gateway_session) if adapter.gateway_session else None
        if session is None or session.adapter is not adapter:
            return
        done = self.table.advance(session, Event.PROCESS_ENDED).effects
        if Action.JOURNAL in done and not self.stopping.begun:  # a shutdown suspends every session itself
            how = describe_exit(returncode)
            suspended = Action.WRITE_SUSPENDED in done  # else a restore is under way, and decides
            log.warning(
                "session %s: its process ended (%s)%s", session.session_id, how, "; suspended, resumable" * suspended
            )
            if suspended:
                self.registry.mark_suspended(session.session_id)
            self.pool.journal.record(
                Kind.CRASHED,
                backend=session.record.backend,
                label="killed" if returncode is not None and returncode < 0 else "exited",
                session_id=session.session_id,
                detail=how,
            )

    async def expire_turn(self, turn: Turn, limit: Limit = Limit.TURN_TIMEOUT) -> None:
        """A turn went past ``turn_timeout`` or ``turn_idle_timeout`` (``TurnBook.watch``): cut it."""
        if limit is Limit.TURN_TIMEOUT:
            seconds = self.turns.turn_timeout(turn)
            await self.cut_turn(turn, limit, f"running longer than turn_timeout ({seconds:g}s)")
        else:
            await self.cut_turn(turn, limit, f"nothing heard from it for {turn.idle_limit:g}s (turn_idle_timeout)")

    async def cut_turn(self, turn: Turn, limit: Limit, why: str) -> None:
        """A running turn went past ``limit`` (``why`` says how): ``session/cancel``; if the adapter
        ignores that for ``close_timeout``, the proxy answers the prompt ``cancelled`` itself and
        suspends the session (a stuck process is not worth keeping): its next request restores it."""
        session = self.table.get(turn.session_id)
        adapter = session.live_adapter if session is not None else None
        turn.event(_CUT_EVENTS[limit], f"{why}: session/cancel sent")
        log.warning("task %s: %s: cancelling it", turn.task_id, why, extra=turn_ids(turn))
        if session is None or adapter is None:
            return  # the process is gone: the turn is being answered with its exit already
        await self.cancel(session, by=None, task=turn, bounded=False)
        close_timeout = self.config.shutdown.close_timeout
        await self.turns.wait_settled(turn, close_timeout)
        if turn.status in TERMINAL or adapter.gone:
            return
        await self._answer_for_adapter(
            session,
            adapter,
            turn,
            {**CANCELLED, "_meta": {"acp-proxy": _CUT_META[limit]}},
            why=f"{limit}: {why}; the turn not ended {close_timeout:g}s after session/cancel",
            reason=_CUT_REASONS[limit],
        )

    async def _answer_for_adapter(
        self,
        session: Session,
        adapter: Adapter,
        turn: Turn,
        result: dict[str, Any],
        *,
        why: str,
        reason: SuspendReason,
        ended_by: str | None = None,
    ) -> None:
        """The proxy answers a cancelled turn its adapter does not end, and retires the process.

        The session is suspended (the tree reaped, the session resumable) before the gateway
        has the answer, so that its next request waits for a new process instead of going to
        this one; from now on nothing the old process writes reaches the gateway.
        """
        call = adapter.take_call_of(turn)
        self.turns.settle(turn, stop_reason="cancelled", ended_by=ended_by)
        if session.adapter is adapter and not session.closed:
            adapter.mute()
            log.warning(
                "session %s: pid %s did not end its cancelled turn (%s); stopping it (session suspended)",
                session.session_id,
                adapter.pid,
                why,
                extra=turn_ids(turn),
            )
            self.suspend(session.session_id, why, reason, even_if_busy=True)
        if call is not None:
            await self.gateway.answer(call.gateway_id, result)

    # --- resume -------------------------------------------------------------------------------

    async def resume(self, msg: Message, session_id: str) -> None:
        """The gateway's ``session/load`` or ``session/resume``: restore the session (in its queue's order)."""
        session = await self.table.find(session_id, reopen=True)
        if session is None:
            if await self.registry.current(session_id) is not None:
                await self._fail_unknown(msg.id, session_id)  # deleted, or live in another proxy
            else:
                self.background.start(lambda: self._adopt(msg, session_id))
            return
        closed_before = session.closed
        self.table.enqueue(session, Work.RESUME, lambda: self._resume_when_ready(session, msg, closed_before))

    async def _resume_when_ready(self, session: Session, msg: Message, closed_before: bool = False) -> None:
        if session.closed and closed_before:  # it came after a close (or delete): now from its row
            await self.resume(msg, session.session_id)
            return
        if session.closed:  # a close (or delete) came after it: the gateway's last word stands
            await self._fail_unknown(msg.id, session.session_id)
            return
        if self.stopping.refusing:
            await self.gateway.fail(msg.id, ProxyError.proxy_shutdown())
            return
        adapter = session.live_adapter
        if adapter is not None:
            if msg.method == Method.RESUME and not adapter.capabilities.resume:
                await self.gateway.answer(msg.id, {})  # live already; the proxy advertised resume, so it serves it
            else:
                await adapter.forward(msg)
            return
        try:
            answer = await self.restorer.restore_cancellable(session, gateway_asked=str(msg.method))
        except ProxyError as exc:
            await self.gateway.fail(msg.id, exc)  # a closed session stays closed (``_ensure_live``)
            return
        if answer is None:
            await self._fail_unknown(msg.id, session.session_id)
            return
        await self.gateway.answer(msg.id, answer.result if answer.result is not UNSET else {})

    async def _adopt(self, msg: Message, session_id: str) -> None:
        """A load/resume of a session the registry does not know (or closed): the adapter may have it."""
        await self.registry.caught_up()  # as for ``new``
        adapter = await self._prepared_for(msg)
        if adapter is None:
            return
        backend = adapter.backend
        adapter.assign(session_id)
        caps = adapter.capabilities
        if msg.method == Method.RESUME and not caps.resume and caps.load:
            # The proxy advertised resume on the strength of load: load it, without the replay.
            adapter.swallow(True)
            try:
                answer = await self.pool.call_answer(adapter, Method.LOAD, msg.params)
            except ProxyError as exc:
                adapter.release_to_spare()  # also ends the swallowing if no answer ever came
                await self.gateway.fail(msg.id, exc)
                return
            if answer.error is not UNSET:
                adapter.release_to_spare()
                await self.gateway.send(jsonrpc.with_id(answer, msg.id))  # type: ignore[arg-type]
                return
            self._register(session_id, backend, adapter, msg.params)
            await self.gateway.answer(msg.id, answer.result if answer.result is not UNSET else {})
            return

        def adopted(answer: Message) -> None:
            if answer.error is not UNSET:
                adapter.release_to_spare()
                return
            self._register(session_id, backend, adapter, msg.params)

        await self._send_first(adapter, msg, adopted)

    # --- list ---------------------------------------------------------------------------------

    async def list_sessions(self, msg: Message) -> None:
        """``session/list`` from the registry: suspended sessions included, filtered by who asks."""
        params = jsonrpc.decode_object(msg.params) or {}
        try:
            requester = parse_requester(params.get("_meta"))
            cursor = params.get("cursor")
            after = decode_cursor(cursor) if isinstance(cursor, str) else None
        except ValueError as exc:
            await self.gateway.fail(msg.id, ProxyError.invalid_params(str(exc)))
            return
        cwd = params.get("cwd") if isinstance(params.get("cwd"), str) else None
        await self.registry.caught_up()  # the list shows what this proxy has just written
        records = self.registry.page(cwd=cwd, limit=None)
        if requester is not None:
            visible = {row.session_id for row in visible_rows([visibility_row(r) for r in records], requester)}
            records = [r for r in records if r.session_id in visible]
        if after is not None:
            records = [r for r in records if (r.created_at, r.session_id) > (after.created_at, after.session_id)]
        page = await self._with_adapter_titles(records[:LIST_PAGE_SIZE])
        result: dict[str, Any] = {"sessions": [session_info(r) for r in page]}
        if len(records) > len(page):
            result["nextCursor"] = encode_cursor(page[-1])
        await self.gateway.answer(msg.id, result)

    async def _with_adapter_titles(self, page: list[SessionRecord]) -> list[SessionRecord]:
        """``page`` with the titles the backends' own lists report (kept in the registry too).

        One live process of each backend on the page that serves ``session/list`` is asked, once per
        working directory, within ``LIST_TIMEOUT``; a backend that fails or is slow is left out.
        """
        listed: dict[str, dict[str, dict[str, str]]] = {}

        async def ask(adapter: Adapter, cwd: str) -> None:
            cursor: object = None
            for _ in range(LISTED_PAGES):
                params: dict[str, Any] = {"cwd": cwd} if cursor is None else {"cwd": cwd, "cursor": cursor}
                try:
                    answer = await self.pool.call_answer(adapter, Method.LIST, params)
                except ProxyError:
                    return
                result = jsonrpc.decode_object(answer.result) if answer.error is UNSET else None
                if result is None:
                    return
                sessions = result.get("sessions")
                listed.setdefault(adapter.backend.name, {}).update(titles_listed(sessions or ()))
                cursor = result.get("nextCursor")
                if not isinstance(cursor, str) or not cursor:
                    return

        with anyio.move_on_after(LIST_TIMEOUT):
            async with anyio.create_task_group() as group:
                for backend, cwd in sorted({(record.backend, record.cwd) for record in page}):
                    adapter = self._lister(backend)
                    if adapter is not None:
                        group.start_soon(ask, adapter, cwd)
        merged = []
        for record in page:
            changes = title_changes(record, listed.get(record.backend, {}))
            if changes:
                self.registry.record_title(record.session_id, changes)
                record = msgspec.structs.replace(
                    record,
                    title=changes.get("title", record.title),
                    title_updated_at=changes.get("updatedAt", record.title_updated_at),
                )
            merged.append(record)
        return merged

    def _lister(self, backend_name: str) -> Adapter | None:
        """A live process of the backend that serves ``session/list``, if this proxy has one."""
        backend = self.config.backends.get(backend_name)
        if backend is None:
            return None
        return next((adapter for adapter in self.pool.serving(backend) if adapter.capabilities.list), None)
