"""The session machine: a session's whole deciding state as one value, and the one function that moves it.

Every rule that changes a session's state lives here, as h11's ``_state.py`` keeps a connection's:
``advance(state, event, now)`` returns the next state and the effects to carry out, or raises
``IllegalEvent`` naming why the event does not apply. It does no I/O, reads no clock (``now`` is
an argument) and holds no object of the proxy: the process serving a session is a flag here, the
requests waiting for it are keys. ``SessionTable`` (sessions/table.py) keeps
one ``Standing`` per session and is the only code that feeds it events; the intents
(sessions/intents.py) carry out what comes back. An import-linter contract (pyproject.toml) keeps
this module and ``lifecycle`` free of anything that does I/O.

The lifecycle's phases and the (phase, event) table are ``acp_proxy.sessions.lifecycle``; this
module adds what the table alone cannot decide: the session's queue (every piece of work that
waits for the session, in the order it came, and which of it runs), the epoch that ends the
prompts queued before a ``session/cancel``, whether a process serves the session, whether a
restore is under way, and which proxy of the install holds the session when this one does not (a
handover: ``Release`` on the holder's side, ``Event.TAKE_OVER`` on the asker's).
"""

from __future__ import annotations

import enum
from typing import Final

import msgspec

from acp_proxy.sessions.lifecycle import STEPS, Action, Event, Phase


class Work(enum.StrEnum):
    """What a piece of work waiting in a session's queue is."""

    REQUEST = "request"
    """A request of the gateway's (not a prompt) waiting for the session."""
    PROMPT = "prompt"
    """A ``session/prompt`` waiting for the session: ended ``cancelled`` by a new epoch."""
    RESUME = "resume"
    """The gateway's ``session/load`` or ``session/resume``."""
    FORK = "fork"
    """``session/fork``, on the session's process once its turn has ended."""
    REAP = "reap"
    """A close's or delete's reap."""
    ANSWER = "answer"
    """An answer that waits for what was queued before it (a second close, answered when the first is done)."""
    RELEASE = "release"
    """Another proxy of the install asked for the session: handed over once what runs before it is done."""
    TAKE_OVER = "take_over"
    """A close or delete of a session another proxy holds: taken over first."""


class Waiting(msgspec.Struct, frozen=True):
    """A piece of work in a session's queue: its key (the runner's), what it is, and the epoch it came in."""

    key: int
    work: Work
    epoch: int


class Fate(enum.StrEnum):
    """What becomes of a request whose turn in the queue has come (``fate_of``)."""

    SEND = "send"
    """Send it (restoring the session first if it has no process)."""
    WITHDRAWN = "withdrawn"
    """The gateway withdrew it (``$/cancel_request``): answered -32800."""
    SHUTDOWN = "shutdown"
    """The proxy is stopping: answered ``proxy_shutdown``."""
    CANCELLED = "cancelled"
    """A prompt of an earlier epoch (a ``session/cancel`` or close since): answered ``{"stopReason": "cancelled"}``."""
    CLOSED = "closed"
    """Closed since it was queued: answered ``session_closed``."""
    DELETED = "deleted"
    """Deleted since it was queued: answered ``session_deleted``."""
    MOVED = "moved"
    """Handed to another proxy of the install since: answered ``session_moved`` (a load or resume brings it back)."""


class Standing(msgspec.Struct, frozen=True):
    """Everything that decides what an event does to a session."""

    phase: Phase
    epoch: int = 0
    """Bumped by ``session/cancel``, close and delete: a queued prompt of an earlier epoch is answered ``cancelled``."""
    process: bool = False
    """A process serves the session (bound by ``restored``, or since it was opened)."""
    restoring: bool = False
    """A restore (or a fork on its process) is under way, which a close or delete cuts short."""
    queue: tuple[Waiting, ...] = ()
    """The work waiting for the session, in the order it came."""
    running: Waiting | None = None
    """The work taken from the queue and not yet done: what comes after waits for it."""
    since: float = 0.0
    """When the session entered its phase (the ``now`` of that event)."""
    holder: str | None = None
    """The proxy of the install that holds it (``elsewhere``, ``taking_over``), or that it is being handed to
    (``releasing``): its instance id. ``None`` in every other phase: this proxy holds it."""
    served: bool = False
    """A process of this proxy has served it (opened or restored here): its gateway knows it as it was
    here. Once another proxy holds it, that gateway's requests other than a load or resume are answered
    ``session_moved`` rather than pulling it back behind the other gateway's back; a session this proxy
    never served is taken over by the first request that needs it."""

    @property
    def ready(self) -> bool:
        """A request goes straight to the process: live, served, and nothing waits or runs before it."""
        return self.phase is Phase.LIVE and self.process and not self.queue and self.running is None

    @property
    def ending(self) -> bool:
        """Being closed or deleted: nothing more is sent to it."""
        return self.phase in (Phase.CLOSING, Phase.DELETING)

    @property
    def deleted(self) -> bool:
        return self.phase in (Phase.DELETING, Phase.DELETED)


# --- events beyond the lifecycle table --------------------------------------------------------------


class Request(msgspec.Struct, frozen=True):
    """A request of the gateway's for the session (``Event.REQUEST``): sent now if the session is ready, else queued."""

    key: int
    prompt: bool = False
    process_up: bool = True
    """Its process (if one is bound) has not exited, as far as the runner knows: else the request waits."""


class Enqueue(msgspec.Struct, frozen=True):
    """Work that must wait its turn in the session's queue (a resume, a fork, a reap, a deferred answer)."""

    key: int
    work: Work


class Begin(msgspec.Struct, frozen=True):
    """The work at the head of the queue starts (the runner's drain takes it)."""

    key: int


class Finish(msgspec.Struct, frozen=True):
    """The work that was running is done."""

    key: int


class Restoring(msgspec.Struct, frozen=True):
    """A restore (or a fork) started (``True``) or is over, however it went (``False``)."""

    under_way: bool


class Release(msgspec.Struct, frozen=True):
    """Another proxy of the install asks for the session (``Event.RELEASE``): ``to`` is its instance id."""

    to: str


class HeldBy(msgspec.Struct, frozen=True):
    """The session's row names another live proxy of the install as its holder: ``by``, its instance id.

    ``Event.HELD_ELSEWHERE`` when a claim (restoring it here) finds it so; ``Event.KEPT`` when its holder,
    asked to release it, kept it."""

    event: Event
    by: str


AnyEvent = Event | Request | Enqueue | Begin | Finish | Restoring | Release | HeldBy


# --- effects -------------------------------------------------------------------------------------------


class Send(msgspec.Struct, frozen=True):
    """Send request ``key`` to the session's process now."""

    key: int


class Queue(msgspec.Struct, frozen=True):
    """Keep request ``key`` waiting in the session's queue (``Begin`` runs it, ``fate_of`` says what then)."""

    key: int


class Run(msgspec.Struct, frozen=True):
    """Start the work ``key``: its turn in the queue has come."""

    key: int


Effect = Action | Send | Queue | Run


class IllegalEvent(Exception):
    """An event that does not apply to the session as it stands: a fault of the caller, never carried on from."""

    def __init__(self, state: Standing, event: AnyEvent, why: str) -> None:
        super().__init__(f"{describe(event)} in phase {state.phase}: {why}")
        self.state = state
        self.event = event
        self.why = why


# --- the one function ------------------------------------------------------------------------------------


def advance(state: Standing, event: AnyEvent, now: float) -> tuple[Standing, tuple[Effect, ...]]:
    """What ``event`` at ``now`` does to a session in ``state``: its next state and the effects to carry out.

    Raises ``IllegalEvent`` if the event does not apply (``accepts`` asks first, without raising).
    """
    why = refusal(state, event)
    if why is not None:
        raise IllegalEvent(state, event, why)
    match event:
        case Request(key=key, prompt=prompt, process_up=process_up):
            if state.ready and process_up:
                return state, (Send(key),)
            work = Work.PROMPT if prompt else Work.REQUEST
            after = _moved(state, Event.REQUEST, now)
            return _replace(after, queue=(*state.queue, Waiting(key, work, state.epoch))), (Queue(key),)
        case Enqueue(key=key, work=work):
            return _replace(state, queue=(*state.queue, Waiting(key, work, state.epoch))), ()
        case Begin():
            head, *rest = state.queue
            return _replace(state, queue=tuple(rest), running=head), (Run(head.key),)
        case Finish():
            return _replace(state, running=None), ()
        case Restoring(under_way=under_way):
            return _replace(state, restoring=under_way), ()
        case Release(to=to):
            return _step(_replace(state, holder=to), Event.RELEASE, now)
        case HeldBy(event=held, by=by):
            return _step(_replace(state, holder=by), held, now)
        case Event():
            return _step(state, event, now)


_HELD_ELSEWHERE: Final = frozenset({Phase.RELEASING, Phase.ELSEWHERE, Phase.TAKING_OVER})
"""The phases in which ``Standing.holder`` names a proxy: in every other, this one holds the session."""


def _step(state: Standing, event: Event, now: float) -> tuple[Standing, tuple[Effect, ...]]:
    """A lifecycle event: as the table says, with its effects on the rest of the state."""
    actions = STEPS[state.phase, event].actions
    after = _moved(state, event, now)
    changes: dict[str, object] = {}
    if after.phase not in _HELD_ELSEWHERE and state.holder is not None:
        changes["holder"] = None
    if Action.NEW_EPOCH in actions:
        changes["epoch"] = state.epoch + 1
    if Action.UNBIND in actions:
        changes["process"] = False
    if Action.BIND in actions:
        changes["process"] = changes["served"] = True
    if Action.CUT_SHORT in actions:
        changes["restoring"] = False
    return _replace(after, **changes), actions


def _moved(state: Standing, event: Event, now: float) -> Standing:
    phase = STEPS[state.phase, event].phase
    return state if phase is state.phase else _replace(state, phase=phase, since=now)


def _replace(state: Standing, **changes: object) -> Standing:
    return msgspec.structs.replace(state, **changes) if changes else state


# --- asking without moving -----------------------------------------------------------------------------------


def refusal(state: Standing, event: AnyEvent) -> str | None:
    """Why ``event`` does not apply to ``state`` (``None``: it does)."""
    match event:
        case Request():
            return STEPS[state.phase, Event.REQUEST].refused
        case Enqueue():
            return "a deleted session queues nothing" if state.phase is Phase.DELETED else None
        case Begin(key=key):
            if state.running is not None:
                return f"work {state.running.key} is still running"
            if not state.queue:
                return "nothing is queued"
            if state.queue[0].key != key:
                return f"work {key} is not at the head of the queue (work {state.queue[0].key} is)"
            return None
        case Finish(key=key):
            if state.running is None or state.running.key != key:
                return f"work {key} is not running"
            return None
        case Restoring(under_way=under_way):
            if under_way and state.restoring:
                return "a restore is under way already"
            return None
        case Release():
            return STEPS[state.phase, Event.RELEASE].refused
        case HeldBy(event=held):
            if held not in (Event.HELD_ELSEWHERE, Event.KEPT):
                return f"{held} does not name a holder"
            return STEPS[state.phase, held].refused
        case Event():
            refused = STEPS[state.phase, event].refused
            if refused is None and event in _NEEDS_PROCESS and not state.process:
                return "no process serves it"
            if refused is None and event is Event.REAPED and state.process:
                return "a process still serves it: its reap unbinds it first"
            return refused


_TAKEN_FROM_HERE: Final = frozenset({Phase.ELSEWHERE, Phase.TAKING_OVER})

_NEEDS_PROCESS: Final = frozenset({Event.SUSPEND, Event.PROCESS_ENDED, Event.HANDED_OVER})
"""Events about the session's process: they apply only while one serves it."""


def accepts(state: Standing, event: AnyEvent) -> bool:
    """Whether ``event`` applies to ``state`` (``advance`` would not raise)."""
    return refusal(state, event) is None


def fate_of(
    state: Standing, waiting: Waiting, *, withdrawn: bool, refusing: bool, task_cancelled: bool = False
) -> Fate:
    """What becomes of queued work ``waiting`` now that its turn has come (a request or a prompt).

    ``withdrawn``: the gateway withdrew it (``$/cancel_request``) meanwhile; ``refusing``: the
    proxy is stopping; ``task_cancelled``: an operator cancelled the prompt's task while it waited.
    The first that holds decides, in this order.
    """
    if withdrawn:
        return Fate.WITHDRAWN
    if refusing:
        return Fate.SHUTDOWN
    if waiting.work is Work.PROMPT and (task_cancelled or state.epoch != waiting.epoch):
        return Fate.CANCELLED
    if state.deleted:
        return Fate.DELETED
    if state.ending or state.phase is Phase.CLOSED:
        return Fate.CLOSED
    if state.phase in _TAKEN_FROM_HERE and state.served:
        return Fate.MOVED
    return Fate.SEND


def describe(event: AnyEvent) -> str:
    """An event as a log line or a table names it."""
    if isinstance(event, Event):
        return event.value
    fields = ", ".join(f"{name}={getattr(event, name)!r}" for name in event.__struct_fields__)
    return f"{type(event).__name__.lower()}({fields})"
