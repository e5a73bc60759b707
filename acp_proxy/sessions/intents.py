"""The lifecycle intents: one public coroutine each, the only way a session changes.

    new            session/new on a prepared process; the id it answers is the stable id (``Opener``)
    forward        a request for a session, sent now or queued behind what it waits for (the machine decides)
    cancel         session/cancel: queued prompts end cancelled, the running turn is asked to end (within
                   cancel_timeout, else the proxy answers it and suspends the session); nothing else is
                   reaped (``TurnEnder``)
    close          session/close: end the turn in flight, reap the tree, mark it closed (still listed)
    delete         session/delete: as close, then delete it on the backend too and leave a tombstone
    fork           session/fork: on the parent's process, which the fork then keeps (``Opener``)
    suspend        stop an idle session's process; it keeps its mapping and is resumable
    resume         the gateway's session/load or session/resume: restore a suspended or closed session, taking it
                   over first if another proxy of the install holds it (``Handover``)
    release        another proxy of the install asks for a session this one holds (``Handover``)
    list_sessions  session/list from the registry, filtered by who asks (``SessionCatalog``)
    process_ended  the process of a session exited by itself: the session is suspended
    expire_turn    a turn ran past turn_timeout or was quiet past turn_idle_timeout: cut_turn
    cut_turn       a turn past a limit: cancel, then answer it ourselves and suspend (``TurnEnder``)

Timeouts, crashes, the pool and operator commands call these; none carries its own copy. Each
feeds the session machine (sessions/machine.py, through ``SessionTable.advance``) and carries
out the effects it returns; the decisions besides (the stable id of a new session, why a session
is unknown, what a cut turn is answered) are pure, in sessions/decisions.py. Every state a
session's row goes through, and the code that moves it: docs/architecture.md, "The states of a
session".
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from typing import Any, Final

from msgspec import UNSET, UnsetType

from acp_proxy.concurrency import Background, Stopping
from acp_proxy.config import BackendConfig, Config
from acp_proxy.journal import Kind, SuspendReason
from acp_proxy.logs import ids
from acp_proxy.pool.adapter import Adapter
from acp_proxy.pool.processes import ProcessPool
from acp_proxy.protocol import jsonrpc
from acp_proxy.protocol.errors import ProxyError, describe_exit
from acp_proxy.protocol.jsonrpc import Message, RequestId
from acp_proxy.protocol.methods import Method, is_setting
from acp_proxy.sessions.catalog import SessionCatalog
from acp_proxy.sessions.decisions import (
    CANCELLED,
    FATE_ERRORS,
    RECYCLES,
    unknown_session_error,
)
from acp_proxy.sessions.deleting import BackendDelete
from acp_proxy.sessions.ending import TurnEnder
from acp_proxy.sessions.handover import Handover, Holders
from acp_proxy.sessions.lifecycle import Action, Event, Phase
from acp_proxy.sessions.machine import Fate, Work
from acp_proxy.sessions.opening import Opener
from acp_proxy.sessions.registry import (
    SessionRegistry,
    SessionState,
)
from acp_proxy.sessions.repeats import Repeats
from acp_proxy.sessions.restore import GatewayPort, Restorer
from acp_proxy.sessions.table import Session, SessionTable
from acp_proxy.tasks.status import TaskStatus, operation_of
from acp_proxy.tasks.turn import Limit, Turn
from acp_proxy.tasks.turns import TurnBook

log = logging.getLogger("acp_proxy.lifecycle")
HAS_OPERATION_ID: Final = re.compile(rb'"operationId"')
"""Whether a prompt may carry an operation id: read only then (``tasks.status.operation_of``)."""

_OURS_TO_CLOSE = frozenset({Phase.LIVE, Phase.SUSPENDED, Phase.RESUMING, Phase.REOPENING, Phase.RELEASING})
"""The phases of a session this proxy holds and has not closed: what its gateway's EOF closes under ``on_eof``
(a restore under way is cut short; not a session another proxy holds)."""

Answer = Callable[[Message], Message | None]


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
        holders: Holders | None = None,
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
        self.handover = Handover(config, registry, table, pool, holders)
        self.backend_delete = BackendDelete(config, pool)
        self.opener = Opener(
            config,
            registry,
            table,
            pool,
            gateway,
            background,
            ensure_live=self._ensure_live,
            fail_unknown=self._fail_unknown,
        )
        self.catalog = SessionCatalog(config, registry, pool, gateway)
        self.ender = TurnEnder(config, table, turns, gateway, background, stopping, suspend=self.suspend)
        self.repeats = Repeats(turns, gateway, background, config.tasks.operation_window)
        self._queued_ids: set[RequestId] = set()
        self._withdrawn: set[RequestId] = set()
        """Queued requests the gateway withdrew with ``$/cancel_request`` before they were sent."""

    # --- new, fork, list ----------------------------------------------------------------------

    def backend_named(self, meta: dict[str, Any]) -> BackendConfig:
        """The backend ``_meta["acp-proxy"].backend`` names, else the proxy's default."""
        return self.opener.backend_named(meta)

    async def new(self, msg: Message) -> None:
        """``session/new``: on a prepared adapter; the id it answers becomes the stable id."""
        await self.opener.new(msg)

    async def fork(self, msg: Message, session_id: str) -> None:
        """``session/fork`` (``Opener.fork``): on the parent's process, which then serves the fork."""
        await self.opener.fork(msg, session_id)

    async def list_sessions(self, msg: Message) -> None:
        """``session/list`` from the registry (``SessionCatalog``)."""
        await self.catalog.list_sessions(msg)

    async def status(self, msg: Message, session_id: str) -> None:
        """``session/status``: answered at once from what is known, never queued behind the session."""
        session = self.table.get(session_id)
        await self.catalog.status(msg, session_id, None if session is None else session.state)

    # --- forward ------------------------------------------------------------------------------

    async def forward(self, msg: Message, session_id: str) -> None:
        """A request for a session: to its process now, or queued behind what the session waits for."""
        session = await self.table.find(session_id)
        if session is None:
            await self._fail_unknown(msg.id, session_id)
            return
        is_prompt = msg.method == Method.PROMPT
        if is_prompt and msg.params is not UNSET and HAS_OPERATION_ID.search(msg.params):  # no copy of a long prompt
            try:
                operation = operation_of(jsonrpc.decode_object(msg.params) or {})
            except ValueError as exc:
                await self.gateway.fail(msg.id, ProxyError.invalid_params(str(exc)))
                return
            if operation is not None and await self.repeats.answered(msg, session_id, operation):
                return
        adapter = session.live_adapter
        queued = self.table.request(session, prompt=is_prompt, process_up=adapter is not None)
        if queued is None and adapter is not None:  # else behind what the session waits for
            lease = adapter.supervised.lease.lease_id
            turn = self._open_turn(session, msg, lease) if is_prompt else None
            await self._send(adapter, session, msg, turn)
            return
        queued_turn = self._open_turn(session, msg, None) if is_prompt else None
        self._queued_ids.add(msg.id)  # type: ignore[arg-type]
        self.table.wait_in_queue(session, queued, lambda: self._forward_when_live(session, msg, queued_turn))

    async def _send(self, adapter: Adapter, session: Session, msg: Message, turn: Turn | None) -> int:
        """Forward a request of ``session`` to its process (a prompt: its turn runs there from now on)."""
        if turn is not None:
            adapter.tenancy.begin_turn(turn)
        call_id = await adapter.forward(msg, self._bookkeeping(session, msg), turn=turn)
        if turn is not None and not adapter.gone:
            # Once the prompt is on its way, and only if its turn has not ended meanwhile: its slot record says
            # busy, a hint to the install's other proxies (who ask before they take a slot), not a step between
            # the gateway and the adapter.
            adapter.tenancy.turn_sent(turn)
        return call_id

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
            operation = None if turn is None else turn.operation_id
            if operation is not None and await self.repeats.answered(msg, session.session_id, operation, turn):
                return  # its first attempt ran in the proxy it was taken from
            if turn is not None:
                self.turns.start_turn(turn, adapter.supervised.lease.lease_id, adapter.pid, resumed=resumed)
            call_id = await self._send(adapter, session, msg, turn)
            if resumed and turn is None and not str(msg.method).startswith("_"):
                expect = self.restorer.expect_answer
                self.background.start(functools.partial(expect, session, adapter, call_id, msg, self.suspend))
        finally:
            self._queued_ids.discard(msg.id)
            if turn is not None and turn.status is TaskStatus.QUEUED:  # cancelled while it waited
                self.turns.settle(turn, error=(jsonrpc.REQUEST_CANCELLED, "the proxy stopped before sending it"))

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
        error = FATE_ERRORS[fate](session.session_id, session.state.holder)
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
            await self._restore_here(session, gateway_asked=None)
        return session.live_adapter

    async def _restore_here(self, session: Session, gateway_asked: str | None) -> Message | None:
        """Restore the session on a process of this proxy (``Restorer``), taking it over first if another proxy
        of the install holds it; ``None`` if a close cut that short.

        A session this proxy served and another took since is not pulled back by a request the gateway sent
        here (``session_moved``): only by its own load or resume. Its claim may find that another proxy took
        it meanwhile: it is taken over once more, and then it is ``session_in_use``.
        """
        for _attempt in range(2):
            if session.phase is Phase.ELSEWHERE:
                if gateway_asked is None and session.state.served:
                    raise ProxyError.session_moved(session.session_id, session.state.holder)
                await self.handover.take_over(session)
            try:
                return await self.restorer.restore_cancellable(session, gateway_asked)
            except ProxyError:
                if session.phase is not Phase.ELSEWHERE:  # not a claim that found it held elsewhere
                    raise
        raise ProxyError.session_in_use(session.session_id, session.state.holder)

    async def _fail_unknown(self, request_id: RequestId | UnsetType, session_id: str) -> None:
        held = self.table.get(session_id)
        if held is not None and held.deleted:  # being deleted here: its row says so once it is done
            await self.gateway.fail(request_id, ProxyError.session_deleted(session_id))
            return
        if held is not None and held.closed:  # being closed here: its row says so only once it is reaped
            await self.gateway.fail(request_id, ProxyError.session_closed(session_id))
            return
        await self.gateway.fail(request_id, unknown_session_error(session_id, await self.registry.current(session_id)))

    # --- cancel, cut --------------------------------------------------------------------------

    async def cancel(
        self,
        session: Session,
        *,
        by: str | None,
        task: Turn | None = None,
        notification: tuple[Message, bytes] | None = None,
        bounded: bool = True,
    ) -> None:
        """``session/cancel``, or one task's cancel (``TurnEnder.cancel``): nothing is reaped."""
        await self.ender.cancel(session, by=by, task=task, notification=notification, bounded=bounded)

    async def expire_turn(self, turn: Turn, limit: Limit = Limit.TURN_TIMEOUT) -> None:
        """A turn went past ``turn_timeout`` or ``turn_idle_timeout`` (``TurnBook.watch``): cut it."""
        await self.ender.expire_turn(turn, limit)

    async def cut_turn(self, turn: Turn, limit: Limit, why: str) -> None:
        """A running turn went past ``limit``: cancelled, then answered by the proxy (``TurnEnder.cut_turn``)."""
        await self.ender.cut_turn(turn, limit, why)

    # --- close --------------------------------------------------------------------------------

    async def close(self, session_id: str, request: Message | None, *, by: str | None = None) -> Session | None:
        """``session/close``: end the turn in flight (answered ``cancelled``), reap the tree, mark it closed.

        A resume in progress is cut short, and requests queued for the session are answered
        (prompts ``cancelled``) rather than sent. The session stays listed; only the gateway's
        own load or resume brings it back. ``request`` is the gateway's, answered ``{}`` once
        the session is gone (``None``: an operator's close, or ``by`` another cause, such as the
        gateway's EOF); closing a closed session is ``{}`` too. The session being closed, or
        ``None`` if there is none to close.
        """
        session = await self.table.find(session_id)
        if session is not None and self._held_elsewhere(session):
            if request is not None:
                self._after_taking_over(session, request, lambda: self.close(session_id, request))
            return None
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
        self.table.enqueue(session, Work.REAP, lambda: self._reap_closed(session, request, by))
        return session

    async def close_at_eof(self) -> None:
        """The gateway has left (EOF): its sessions of backends with ``on_eof = "close"`` are closed, not
        suspended (``_OURS_TO_CLOSE``). Until each is done."""
        closing = []
        for session in self.table.values():
            backend = self.config.backends.get(session.record.backend)
            if backend is None or backend.on_eof != "close" or session.phase not in _OURS_TO_CLOSE:
                continue
            closed = await self.close(session.session_id, None, by="eof")
            if closed is not None:
                closing.append(closed)
        for session in closing:
            await session.forgotten.wait()

    def _ending(self, session: Session, *, deleted: bool = False) -> None:
        """From now on nothing more is sent to the session: queued requests are answered, a resume is cut short
        (the table's step does both: ``NEW_EPOCH``, ``CUT_SHORT``)."""
        self.table.advance(session, Event.DELETE if deleted else Event.CLOSE)

    async def _reap_closed(self, session: Session, request: Message | None, by: str | None = None) -> None:
        if session.deleted:  # a delete came after the close: its reap, queued behind this, does the work
            if request is not None:
                self.table.enqueue(session, Work.ANSWER, lambda: self.gateway.answer(request.id, {}))
            return
        adapter = self.table.advance(session, Event.REAP).released
        if adapter is not None:
            await self.ender.end_turns(session, adapter)
            await self.pool.processes.stop(adapter)
        if session.stopping is not None:
            await session.stopping.wait()
        self.table.advance(session, Event.REAPED)
        self.registry.mark_closed(session.session_id)
        self.table.forget(session)
        log.info("session %s closed", session.session_id, extra=ids(session=session.session_id))
        by = by or ("gateway" if request is not None else "operator")
        self.pool.journal.record(Kind.CLOSED, backend=session.record.backend, label=by, session_id=session.session_id)
        if request is not None:
            await self.registry.caught_up()  # the gateway is told once the row says so
            await self.gateway.answer(request.id, {})

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
        if self._held_elsewhere(session):
            self._after_taking_over(session, msg, lambda: self.delete(msg, session_id))
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
            await self.ender.end_turns(session, adapter)
            await self.backend_delete.on(adapter, record.adapter_session_id)
            await self.pool.processes.stop(adapter)
        else:
            if session.stopping is not None:
                await session.stopping.wait()
            await self.backend_delete.on_a_process_of(record)
        self.table.advance(session, Event.REAPED)
        self.table.forget(session)
        log.info("session %s deleted", session.session_id, extra=ids(session=session.session_id))
        self.pool.journal.record(Kind.DELETED, backend=record.backend, session_id=session.session_id)
        await self.registry.caught_up()  # the gateway is told once the tombstone is on record
        await self.gateway.answer(request.id, {})

    # --- handover -----------------------------------------------------------------------------

    @staticmethod
    def _held_elsewhere(session: Session) -> bool:
        """Another proxy of the install holds it, or is being asked for it by this one."""
        return session.phase in (Phase.ELSEWHERE, Phase.TAKING_OVER)

    def _after_taking_over(self, session: Session, msg: Message, then: Callable[[], Any]) -> None:
        """A close or delete of a session another proxy holds: in the session's queue, take it over, then ``then``."""

        async def work() -> None:
            if self._held_elsewhere(session):
                try:
                    await self.handover.take_over(session)
                except ProxyError as exc:
                    await self.gateway.fail(msg.id, exc)
                    return
            await then()

        self.table.enqueue(session, Work.TAKE_OVER, work)

    async def release(self, session_id: str, to: str, timeout: float) -> bool:
        """Another proxy of the install (``to``) asks for a session: ``Handover.release``."""
        return await self.handover.release(session_id, to, timeout)

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
        self.table.stopping(session, self.pool.processes.stop_in_background(adapter))
        return True

    def recycle_due(self, adapter: Adapter) -> None:
        """A turn of ``adapter`` has just ended: if its session is to be recycled (``Tenancy.recycle``), now."""
        if adapter.tenancy.recycle is not None and adapter.gateway_session is not None:
            why, reason = adapter.tenancy.recycle
            self.suspend(adapter.gateway_session, why, reason)

    def process_ended(self, adapter: Adapter, returncode: int | None) -> None:
        """The process of a session exited (a crash, or its stop): the session is suspended, resumable."""
        session = self.table.get(adapter.gateway_session) if adapter.gateway_session else None
        if session is None or session.adapter is not adapter:
            return
        moved = self.table.advance(session, Event.PROCESS_ENDED)
        done = moved.effects
        if Action.WRITE_HANDED in done and session.state.holder is not None:  # it was being released: it is now
            self.handover.handed(session, moved, session.state.holder)
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

    # --- resume -------------------------------------------------------------------------------

    async def resume(self, msg: Message, session_id: str) -> None:
        """The gateway's ``session/load`` or ``session/resume``: restore the session (in its queue's order)."""
        session = await self.table.find(session_id, reopen=True)
        if session is None:
            if await self.registry.current(session_id) is not None:
                await self._fail_unknown(msg.id, session_id)  # deleted, or live in another proxy
            else:
                self.background.start(lambda: self.opener.adopt(msg, session_id))
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
            answer = await self._restore_here(session, gateway_asked=str(msg.method))
        except ProxyError as exc:
            await self.gateway.fail(msg.id, exc)  # a closed session stays closed (``_ensure_live``)
            return
        if answer is None:
            await self._fail_unknown(msg.id, session.session_id)
            return
        await self.gateway.answer(msg.id, answer.result if answer.result is not UNSET else {})
