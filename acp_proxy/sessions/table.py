"""The sessions this proxy serves, each with its process (if any) and its queue.

Work that must wait for a session (a resume, a close, a request behind them)
runs from that session's queue, in the order the gateway sent it, one item at a
time. A session is found in memory, else in the registry (suspended, or left
live by a proxy that has died since).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import msgspec

from acp_proxy.concurrency import Background, Changes
from acp_proxy.logs import ids
from acp_proxy.pool.adapter import Adapter
from acp_proxy.sessions.lifecycle import Action, Event, Phase, Step, step
from acp_proxy.sessions.registry import SessionRecord, SessionRegistry, SessionState

log = logging.getLogger("acp_proxy.lifecycle")

Work = Callable[[], Coroutine[Any, Any, None]]


class Session(msgspec.Struct, eq=False):
    """A session this proxy has served, with the process (if any) behind it now.

    Every field is assigned by ``SessionTable`` alone (``tests/test_layers.py``): ``phase``, the
    epoch and the process by ``advance``, as ``acp_proxy.sessions.lifecycle`` says.
    """

    record: SessionRecord
    phase: Phase
    adapter: Adapter | None = None
    queue: collections.deque[Work] = msgspec.field(default_factory=collections.deque)
    """Work that must wait for the session (a resume, a close), in the order the gateway sent it."""
    draining: bool = False
    """A task is working through ``queue``; requests that arrive meanwhile queue behind."""
    cancel_epoch: int = 0
    """Bumped by ``session/cancel`` and ``session/close``: a queued prompt that sees it changed is
    answered ``cancelled``."""
    stopping: anyio.Event | None = None
    """Set once its last process is gone (a resume waits for that first)."""
    resume_scope: anyio.CancelScope | None = None
    """The resume in progress, which a ``session/close`` cancels."""
    forgotten: anyio.Event = msgspec.field(default_factory=anyio.Event)
    """Set when a close has finished and the table no longer holds the session."""

    @property
    def session_id(self) -> str:
        return self.record.session_id

    @property
    def closed(self) -> bool:
        """Being closed or deleted here, or done with: nothing more is sent to it from this object.

        Not a session held as ``closed`` (found so in the registry, or whose reopening failed): the
        gateway's own load or resume reopens that one.
        """
        return self.phase in (Phase.CLOSING, Phase.DELETING) or self.forgotten.is_set()

    @property
    def deleted(self) -> bool:
        return self.phase in (Phase.DELETING, Phase.DELETED)

    @property
    def live_adapter(self) -> Adapter | None:
        """Its process, if it has one that has not exited."""
        adapter = self.adapter
        return adapter if adapter is not None and not adapter.gone else None

    @property
    def ready(self) -> bool:
        """Requests can go straight to the process, in order, without waiting."""
        return self.live_adapter is not None and not self.queue and not self.draining

    @property
    def idle(self) -> bool:
        """It has a process with nothing in flight and nothing waiting: it may be suspended."""
        adapter = self.live_adapter
        return adapter is not None and not adapter.busy and not self.queue and not self.draining


class Moved(msgspec.Struct, frozen=True):
    """What ``SessionTable.advance`` did: the lifecycle's step, and the process it unbound (if any)."""

    step: Step
    released: Adapter | None = None
    """The process that served the session until this step (``UNBIND``), if it had one that still runs."""

    @property
    def actions(self) -> tuple[Action, ...]:
        return self.step.actions

    @property
    def refused(self) -> str | None:
        return self.step.refused


class SessionTable:
    """The sessions of this proxy by stable id, and the queue each runs its waiting work from."""

    def __init__(
        self,
        registry: SessionRegistry,
        background: Background,
        pool_changed: Changes,
        on_bound: Callable[[Adapter], None],
    ) -> None:
        self.registry = registry
        self.background = background
        self.pool_changed = pool_changed
        self._on_bound = on_bound
        """The pool learns that a session now runs on a process (``Recency.note_bound``, pool/recency.py)."""
        self.sessions: dict[str, Session] = {}

    def advance(self, session: Session, event: Event) -> Moved:
        """Move ``session`` as the lifecycle table says ``event`` does (a refused step leaves it as it is).

        The step's effects in memory happen here, in the same step: a new epoch (``NEW_EPOCH``),
        the restore in progress cut short (``CUT_SHORT``), the process unbound (``UNBIND``: handed
        back in ``Moved.released``). The caller performs the rest of ``Moved.actions`` (the writes,
        the answers, stopping the process).
        """
        result = step(session.phase, event)
        if result.refused is not None:
            return Moved(result)
        if result.phase is not session.phase:
            log.debug("session %s: %s on %s: now %s", session.session_id, event, session.phase, result.phase)
            session.phase = result.phase
        if Action.NEW_EPOCH in result.actions:
            session.cancel_epoch += 1
        if Action.CUT_SHORT in result.actions and session.resume_scope is not None:
            session.resume_scope.cancel()
        released = None
        if Action.UNBIND in result.actions:
            released, session.adapter = session.live_adapter, None
        return Moved(result, released)

    def must_advance(self, session: Session, event: Event) -> Moved:
        """``advance`` for an event the caller has checked applies: a refusal is a fault of the proxy, logged."""
        moved = self.advance(session, event)
        if moved.refused is not None:
            log.error(
                "session %s: %s refused in phase %s (%s)", session.session_id, event, session.phase, moved.refused
            )
        return moved

    def refresh(self, session: Session, record: SessionRecord) -> None:
        """The session's row as just read."""
        session.record = record

    def restoring(self, session: Session, scope: anyio.CancelScope | None) -> None:
        """The restore (or fork) in progress (``None``: over), which a close or delete cuts short (``CUT_SHORT``)."""
        session.resume_scope = scope

    def stopping(self, session: Session, stopped: anyio.Event) -> None:
        """Its last process is being stopped; ``stopped`` is set once it is gone (a restore waits for it)."""
        session.stopping = stopped

    def open(self, record: SessionRecord, adapter: Adapter, adapter_session_id: str) -> Session:
        """A session a process has just opened (new, adopted or forked): live on it from the start."""
        session = Session(record, Phase.LIVE)
        self._attach(session, adapter, adapter_session_id)
        return session

    def get(self, session_id: str) -> Session | None:
        """A session held in memory (live, or suspended since this proxy served it)."""
        return self.sessions.get(session_id)

    def __len__(self) -> int:
        return len(self.sessions)

    def values(self) -> list[Session]:
        return list(self.sessions.values())

    async def find(self, session_id: str, *, reopen: bool = False) -> Session | None:
        """A session this proxy can serve: in memory, or in the registry (suspended, or left by a dead proxy).

        A closed session only with ``reopen`` (the gateway's own load or resume, or a delete);
        a deleted one never. One held in memory is found without waiting for anything.
        """
        session = self.sessions.get(session_id)
        if session is not None:
            return session
        record = await self.registry.current(session_id)
        if record is None or record.state is SessionState.DELETED:
            return None
        if record.state is SessionState.CLOSED and not reopen:
            return None
        held_elsewhere = record.instance_id != self.registry.instance_id
        if record.state in (SessionState.LIVE, SessionState.RESUMING) and held_elsewhere:
            # Live in another proxy: unless that proxy has died since we started (its tree was
            # reaped by then or will be by the next start), it is not ours to serve.
            if not await self.registry.claim_orphaned(session_id):
                return None
            log.info(
                "session %s: left live by a proxy that is gone; suspended, resumable",
                session_id,
                extra=ids(session=session_id),
            )
            record = await self.registry.current(session_id) or record
        session = self.sessions.get(session_id)  # found by another request while this one waited
        if session is None:
            session = Session(record, Phase.CLOSED if record.state is SessionState.CLOSED else Phase.SUSPENDED)
            self.sessions[session_id] = session
        return session

    def bind(self, session: Session, adapter: Adapter, adapter_session_id: str) -> None:
        """A restore took: from now on ``adapter`` serves ``session`` (``Event.RESTORED``)."""
        self.must_advance(session, Event.RESTORED)
        self._attach(session, adapter, adapter_session_id)

    def _attach(self, session: Session, adapter: Adapter, adapter_session_id: str) -> None:
        """``adapter`` serves ``session`` (its own id for it may differ from the stable one)."""
        adapter.serve(session.session_id, adapter_session_id)
        self._on_bound(adapter)
        session.adapter = adapter
        self.sessions[session.session_id] = session
        self.pool_changed.notify()

    def forget(self, session: Session) -> None:
        if self.sessions.get(session.session_id) is session:
            del self.sessions[session.session_id]
        session.forgotten.set()

    def enqueue(self, session: Session, work: Work) -> None:
        """Run ``work`` once everything the gateway sent earlier for this session has run (in order)."""
        session.queue.append(work)
        if not session.draining:
            session.draining = True
            self.background.start(lambda: self._drain(session))

    async def _drain(self, session: Session) -> None:
        try:
            while session.queue:
                work = session.queue.popleft()
                await work()
                self.pool_changed.notify()
        finally:
            session.draining = False
            self.pool_changed.notify()  # it may be idle now: a waiter for a slot may suspend it
