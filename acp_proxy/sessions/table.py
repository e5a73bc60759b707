"""The sessions this proxy serves, each with its process (if any) and its queue.

Work that must wait for a session (a resume, a close, a request behind them)
runs from that session's queue, in the order the gateway sent it, one item at a
time. A session is found in memory, else in the registry (suspended, or left
live by a proxy that has died since).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import msgspec

from acp_proxy.concurrency import Background, Changes
from acp_proxy.logs import ids
from acp_proxy.pool.adapter import Adapter
from acp_proxy.pool.tenancy import busy
from acp_proxy.sessions import machine
from acp_proxy.sessions.lifecycle import Action, Event, Phase
from acp_proxy.sessions.machine import (
    AnyEvent,
    Begin,
    Effect,
    Enqueue,
    Fate,
    Finish,
    Request,
    Restoring,
    Send,
    Standing,
    Waiting,
    describe,
    fate_of,
)
from acp_proxy.sessions.registry import SessionRecord, SessionRegistry, SessionState

log = logging.getLogger("acp_proxy.lifecycle")

Work = Callable[[], Coroutine[Any, Any, None]]


class Session(msgspec.Struct, eq=False):
    """A session this proxy has served, with the process (if any) behind it now.

    ``state`` is the session machine's value (sessions/machine.py): every field here is assigned
    by ``SessionTable`` alone (``tests/test_layers.py``), and ``state`` only from what the
    machine's ``advance`` returns.
    """

    record: SessionRecord
    state: Standing
    adapter: Adapter | None = None
    work: dict[int, Work] = msgspec.field(default_factory=dict)
    """What each piece of work in the machine's queue does when its turn comes, by its key."""
    drainer: bool = False
    """A task works through the queue (a failed piece of work ends it; the next enqueue starts another)."""
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
    def phase(self) -> Phase:
        return self.state.phase

    @property
    def cancel_epoch(self) -> int:
        """Bumped by ``session/cancel`` and ``session/close``: a queued prompt that sees it changed is
        answered ``cancelled``."""
        return self.state.epoch

    @property
    def queue(self) -> tuple[Waiting, ...]:
        """Work that must wait for the session (a resume, a close), in the order the gateway sent it."""
        return self.state.queue

    @property
    def draining(self) -> bool:
        """Work from its queue runs, or is about to; requests that arrive meanwhile queue behind."""
        return self.state.running is not None or bool(self.state.queue)

    @property
    def closed(self) -> bool:
        """Being closed or deleted here, or done with: nothing more is sent to it from this object.

        Not a session held as ``closed`` (found so in the registry, or whose reopening failed): the
        gateway's own load or resume reopens that one.
        """
        return self.state.ending or self.forgotten.is_set()

    @property
    def deleted(self) -> bool:
        return self.state.deleted

    @property
    def live_adapter(self) -> Adapter | None:
        """Its process, if it has one that has not exited."""
        adapter = self.adapter
        return adapter if adapter is not None and not adapter.gone else None

    @property
    def ready(self) -> bool:
        """Requests can go straight to the process, in order, without waiting."""
        return self.live_adapter is not None and self.state.ready

    @property
    def idle(self) -> bool:
        """It has a process with nothing in flight and nothing waiting: it may be suspended."""
        adapter = self.live_adapter
        return adapter is not None and not busy(adapter) and not self.draining


class Moved(msgspec.Struct, frozen=True):
    """What ``SessionTable.advance`` did: the machine's effects, and the process it unbound (if any)."""

    effects: tuple[Effect, ...]
    released: Adapter | None = None
    """The process that served the session until this step (``UNBIND``), if it had one that still runs."""

    def has(self, effect: Effect) -> bool:
        return effect in self.effects


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
        self._keys = itertools.count(1)
        """Keys of the work waiting in sessions' queues (the machine knows work by key)."""

    def advance(self, session: Session, event: AnyEvent) -> Moved:
        """Feed ``event`` to the session's machine and carry out the effects that are memory alone.

        Those happen here, in the same step: the restore in progress cut short (``CUT_SHORT``),
        the process unbound (``UNBIND``: handed back in ``Moved.released``). The caller performs
        the rest of ``Moved.effects`` (the writes, the answers, stopping the process). An event
        that does not apply raises ``IllegalEvent`` and changes nothing (``accepts`` asks first).
        """
        before = session.state
        session.state, effects = machine.advance(before, event, time.monotonic())
        if session.state.phase is not before.phase:
            log.debug(
                "session %s: %s on %s: now %s", session.session_id, describe(event), before.phase, session.state.phase
            )
        if Action.CUT_SHORT in effects and session.resume_scope is not None:
            session.resume_scope.cancel()
        released = None
        if Action.UNBIND in effects:
            released, session.adapter = session.live_adapter, None
        return Moved(effects, released)

    def accepts(self, session: Session, event: AnyEvent) -> bool:
        """Whether ``event`` applies to the session as it stands (``advance`` would not raise)."""
        return machine.accepts(session.state, event)

    def refresh(self, session: Session, record: SessionRecord) -> None:
        """The session's row as just read."""
        session.record = record

    def restoring(self, session: Session, scope: anyio.CancelScope | None) -> None:
        """The restore (or fork) in progress (``None``: over), which a close or delete cuts short (``CUT_SHORT``)."""
        session.resume_scope = scope
        self.advance(session, Restoring(scope is not None))

    def stopping(self, session: Session, stopped: anyio.Event) -> None:
        """Its last process is being stopped; ``stopped`` is set once it is gone (a restore waits for it)."""
        session.stopping = stopped

    def open(self, record: SessionRecord, adapter: Adapter, adapter_session_id: str) -> Session:
        """A session a process has just opened (new, adopted or forked): live on it from the start."""
        session = Session(record, Standing(Phase.LIVE, process=True, served=True, since=time.monotonic()))
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
        a deleted one never; one another live proxy holds as ``elsewhere`` (taken over when it is
        needed here). One held in memory is found without waiting for anything.
        """
        session = self.sessions.get(session_id)
        if session is not None:
            return session
        record = await self.registry.current(session_id)
        if record is None or record.state is SessionState.DELETED:
            return None
        if record.state is SessionState.CLOSED and not reopen:
            return None
        holder = None
        if (
            record.state in (SessionState.LIVE, SessionState.RESUMING)
            and record.instance_id != self.registry.instance_id
        ):
            # Live in another proxy: held there, and handed over when this one needs it; unless that proxy
            # has died since (its tree was reaped by then, or will be by the next start).
            if await self.registry.claim_orphaned(session_id):
                log.info(
                    "session %s: left live by a proxy that is gone; suspended, resumable",
                    session_id,
                    extra=ids(session=session_id),
                )
                record = await self.registry.current(session_id) or record
            else:
                holder = record.instance_id
        session = self.sessions.get(session_id)  # found by another request while this one waited
        if session is None:
            if holder is not None:
                standing = Standing(Phase.ELSEWHERE, holder=holder, since=time.monotonic())
            else:
                phase = Phase.CLOSED if record.state is SessionState.CLOSED else Phase.SUSPENDED
                standing = Standing(phase, since=time.monotonic())
            session = Session(record, standing)
            self.sessions[session_id] = session
        return session

    def bind(self, session: Session, adapter: Adapter, adapter_session_id: str) -> None:
        """A restore took: from now on ``adapter`` serves ``session`` (``Event.RESTORED``)."""
        self.advance(session, Event.RESTORED)
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

    def enqueue(self, session: Session, kind: machine.Work, work: Work) -> None:
        """Run ``work`` once everything the gateway sent earlier for this session has run (in order)."""
        key = next(self._keys)
        self.advance(session, Enqueue(key, kind))
        self._waiting(session, key, work)

    def request(self, session: Session, *, prompt: bool, process_up: bool) -> int | None:
        """A request of the gateway's (``Event.REQUEST``): ``None`` if the caller is to send it at once, else
        the key it waits under in the session's queue (``wait_in_queue`` says what runs when its turn comes).

        ``process_up``: the session's process, if bound, has not exited (the machine learns that it
        has from ``process_ended``, a moment later: until then a request waits, as for a restore).
        """
        key = next(self._keys)
        moved = self.advance(session, Request(key, prompt, process_up))
        return None if moved.has(Send(key)) else key

    def wait_in_queue(self, session: Session, key: int | None, work: Work) -> None:
        """What runs when queued request ``key`` (``request``) has its turn: it asks ``fate`` what to do."""
        assert key is not None
        self._waiting(session, key, work)

    def fate(self, session: Session, *, withdrawn: bool, refusing: bool, task_cancelled: bool = False) -> Fate:
        """What becomes of the queued request running now (from the session's queue), as the machine says."""
        running = session.state.running
        assert running is not None, "fate() is asked from the work a session's queue runs"
        return fate_of(session.state, running, withdrawn=withdrawn, refusing=refusing, task_cancelled=task_cancelled)

    def _waiting(self, session: Session, key: int, work: Work) -> None:
        session.work[key] = work
        if not session.drainer:
            session.drainer = True
            self.background.start(lambda: self._drain(session))

    async def _drain(self, session: Session) -> None:
        """Run the session's queue, one piece of work at a time, in order, until it is empty."""
        try:
            while session.state.queue:
                key = session.state.queue[0].key
                self.advance(session, Begin(key))
                try:
                    await session.work.pop(key)()
                finally:
                    self.advance(session, Finish(key))
                    self.pool_changed.notify()  # it may be idle now: a waiter for a slot may suspend it
        finally:
            session.drainer = False
