"""Admission: what one waiter for a process slot does next, decided over a snapshot of the install.

A request for a session with no process is admitted in two parts: it waits for a slot, then
(with a memory budget) for room in the budget. Both are one decision: each time something may
have changed, the driver (``SlotAdmission.acquire``, pool/slots.py) reads the install (the slot
files, the install's queue, the clocks, the trees' memory) into a ``Waiting`` and asks ``admit``
what to do; ``admit`` does no I/O and keeps no state, and the driver does what it says:

* ``Take``: try to take a free slot file (only the first in line does, and before it reads
  anything else of the install); if none is free, ask again with ``tried_take``. Once it has
  one, the waiter leaves the line and its ``room`` is what is left to decide.
* ``Look``: read the install's slots (every slot file's record) into ``slots``, and ask again.
* ``Measure``: measure the install's trees now and plan whom to suspend so that the new tree
  fits the memory budget (``memory.plan_spawn``) into ``room``, and ask again.
* ``Ask``: have that slot's session suspended (or its spare stopped), by this proxy or by
  the proxy that holds it. A yes is ``Granted``: the slot comes free once its tree is gone.
* ``Sleep``: until something changes (or, far back in line, until the line moves), at the
  latest ``until``.
* ``Start``: admitted: the slot is held, and the new tree fits the budget (or nothing more
  can be done for it: ``overdue`` trees granted for it did not end in time).
* ``GiveUp``: the proxy is shutting down, or ``acquire_timeout`` has passed.

Whom to suspend is ``plan.plan_acquire``'s choice (the least recently used idle session,
spares first, never a session active moments ago); this module adds the waiter's own
history: the suspensions it was granted whose trees are not gone yet, and the sessions whose
proxies refused it moments ago.

A granted suspension is waited for until its tree is gone, not for a fixed time: once
it is gone, its slot went to whoever was first in line, and a waiter that still has no
slot plans again at once. (Several waiters that read the same records may ask for the same
session; its proxy says yes to each, since its slot is coming free, and only one of them
gets that slot.) A tree that outlives ``Granted.until`` (its session's close and the
teardown's graces) is no longer counted on.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from typing import Final, Literal

import msgspec

from acp_proxy.pool.memory import BudgetPlan
from acp_proxy.pool.plan import Admit, Slot, plan_acquire

POLL: Final = 0.02
"""How often a waiter looks at the install's slot files while another proxy holds one or waits
before it: other proxies free slots without telling it (within a proxy, waiters are woken at once)."""
LONE_POLL: Final = 0.25
"""How often it looks while this proxy holds every slot of the install and nobody waits before
it: every change that could admit it is then this proxy's own, and wakes it; the look is only for
a proxy that starts meanwhile."""
REFUSED_FOR: Final = 0.25
"""A session whose proxy refused to suspend it is not asked again for this long (its record,
which said it was idle, is rewritten by then)."""
QUIET_MARGIN: Final = 0.01
RECENT_MARGIN: Final = 0.005


class Rule(enum.StrEnum):
    """Which rule of ``RULES`` a step follows."""

    SHUTDOWN = "shutdown"
    BACK = "back of the line"
    ROOM = "room"
    ENDING = "granted, ending"
    EVICT = "evict"
    FREEING = "being freed"
    RECENT = "recent"
    BUSY = "busy"
    DEADLINE = "deadline"
    FITS = "fits"
    MEMORY = "memory"
    MAKING_ROOM = "making room"
    OVERDUE = "overdue"


RULES: Final[tuple[tuple[Rule, str, str], ...]] = (
    (Rule.SHUTDOWN, "the proxy is shutting down", "give up: `proxy_shutdown`"),
    (
        Rule.BACK,
        "`depth` or more of this proxy's waiters for the backend are before it",
        "sleep until the line moves up to it",
    ),
    (
        Rule.ROOM,
        "the install has room for one more process of the backend",
        "the first in line takes a slot file; the others look again when it has (or at the next poll)",
    ),
    (
        Rule.ENDING,
        "no room, and a suspension it was granted is still ending",
        "wait for that tree to be gone, at most its teardown's graces; suspend nothing more",
    ),
    (
        Rule.EVICT,
        "no room, and an idle session not active moments ago (spares first, then the least recently used)",
        "ask for its suspension, here or of the proxy that holds it; a refusal counts it busy for `REFUSED_FOR`",
    ),
    (
        Rule.FREEING,
        "no room, but slots being freed cover it and every waiter ahead of it",
        "wait for one of them",
    ),
    (
        Rule.RECENT,
        "no room, and every idle session was active moments ago",
        "sleep until the first stops being so (at most a poll)",
    ),
    (
        Rule.BUSY,
        "no room, and every session is busy",
        "look again at the next poll, or when a session busy with background work turns quiet",
    ),
    (
        Rule.DEADLINE,
        "`acquire_timeout` has passed",
        "give up: `pool_exhausted` (the first in line tries one last take)",
    ),
    (
        Rule.FITS,
        "it holds a slot, and no memory budget is set or the new tree fits it (measured now)",
        "start",
    ),
    (
        Rule.MEMORY,
        "it holds a slot, and the new tree (as large as its backend's largest) would exceed `max_memory`",
        "ask for the suspension of the idle trees the budget's plan chose, one by one",
    ),
    (
        Rule.MAKING_ROOM,
        "it holds a slot, and trees suspended for its room are still there",
        "wait for them to be gone (at most `acquire_timeout`); then measure again if one was refused",
    ),
    (
        Rule.OVERDUE,
        "trees suspended for its room are still there after `acquire_timeout`",
        "start anyway: the budget is not a kill switch (logged)",
    ),
)
"""The rules ``admit`` follows, in the order it applies them (``docs/architecture.md`` shows them)."""


def markdown_table() -> str:
    """``RULES`` as the Markdown table in ``docs/architecture.md``."""
    rows = ["| rule | when | the waiter |", "| --- | --- | --- |"]
    rows += [f"| `{rule.value}` | {when} | {does} |" for rule, when, does in RULES]
    return "\n".join(rows)


class Granted(msgspec.Struct, frozen=True):
    """A suspension this waiter asked for and got: its slot comes free once its tree is gone."""

    slot: Slot
    until: float
    """By then its tree should be gone (its session's close, then the teardown's graces)."""


class Room(msgspec.Struct, frozen=True, kw_only=True):
    """The second part of an admission: the slot file is held, and the new tree must fit the memory
    budget. Each round measures the install, plans, asks, and waits for what it was granted to end."""

    plan: BudgetPlan | None = None
    """Whom to suspend so that the new tree fits, over the install's trees measured now (``None``:
    not measured yet, ``Measure``)."""
    slots: Mapping[str, Slot] = msgspec.field(default_factory=dict)
    """The plan's trees by their key (``budget.budget_key``), to ask for them by."""
    asked: Mapping[str, bool] = msgspec.field(default_factory=dict)
    """The chosen trees asked for this round: granted (``True``) or refused."""
    going: Sequence[Slot] = ()
    """The trees granted (or already being stopped) whose slots are still held."""
    until: float = math.inf
    """Trees still there after this are no longer waited for (``acquire_timeout`` after the measuring)."""
    refused: frozenset[str] = frozenset()
    """Trees whose proxies refused, in earlier rounds: planned as busy."""


class Waiting(msgspec.Struct, frozen=True, kw_only=True):
    """One waiter for a slot of ``backend``, and the install as it sees it now."""

    backend: str
    backend_cap: int
    global_cap: int
    now: float
    """``time.monotonic()``: the clock of ``deadline``, the slots' times and ``Granted.until``."""
    deadline: float
    position: int
    """Its place in this proxy's line for the backend (0: first)."""
    depth: int
    """How many of a line plan at once; the others sleep until the line moves up to them."""
    ahead: int = 0
    """Waiters of the install before it: ``position`` and the other proxies' waiters before this
    proxy's first."""
    slots: Sequence[Slot] | None = None
    """The install's live slots (``ProcessPool.install_slots``); ``None``: not read yet (``Look``)."""
    reserved: Mapping[str, int] = msgspec.field(default_factory=dict)
    """Slots this proxy took for starts that are not running yet, per backend."""
    refused: Mapping[str, float] = msgspec.field(default_factory=dict)
    """Sessions whose proxy refused to suspend them, and until when that counts (they count as busy)."""
    granted: Sequence[Granted] = ()
    """Its granted suspensions whose trees are still there."""
    quiet_at: float = math.inf
    """When the first of this proxy's sessions busy only with background work counts as idle."""
    refusing: bool = False
    """The proxy is shutting down: waiters fail fast."""
    tried_take: bool = False
    """It is first in line and has just found no slot file free: what now (``slots`` are read for this)."""
    budget: bool = False
    """A memory budget is set (``[pool] max_memory`` or a backend's): a start must fit it."""
    room: Room | None = None
    """It holds a slot file: the memory budget is what is left to decide (``None``: still in line)."""


class Take(msgspec.Struct, frozen=True):
    """Take a free slot file now; if none is free, ask ``admit`` again with ``tried_take``."""


class Look(msgspec.Struct, frozen=True):
    """Read the install's slots into ``Waiting.slots``, and ask ``admit`` again."""


class Measure(msgspec.Struct, frozen=True):
    """Measure the install's trees now and plan the memory budget into ``Waiting.room``, and ask again."""

    rule: Rule = Rule.FITS


class Ask(msgspec.Struct, frozen=True):
    """Have ``slot`` suspended (a spare stopped) to make room: by this proxy, or by its holder."""

    slot: Slot
    rule: Rule = Rule.EVICT


class Sleep(msgspec.Struct, frozen=True):
    """Wait for a change until ``until`` at the latest (``line``: for the line to move instead)."""

    until: float
    reason: str
    rule: Rule
    line: bool = False


class Start(msgspec.Struct, frozen=True):
    """Admitted: start the process (``overdue``: trees granted for its room that were still there)."""

    rule: Rule = Rule.FITS
    overdue: int = 0


class GiveUp(msgspec.Struct, frozen=True):
    reason: Literal["shutdown", "exhausted"]
    rule: Rule


Step = Take | Look | Measure | Ask | Sleep | Start | GiveUp


def admit(waiting: Waiting) -> Step:
    """What the waiter does next (see the module's docstring)."""
    w = waiting
    if w.refusing:
        return GiveUp("shutdown", Rule.SHUTDOWN)
    if w.room is not None:
        return _room(w.room, w) if w.budget else Start()
    if w.position >= w.depth:
        if w.now >= w.deadline:
            return GiveUp("exhausted", Rule.DEADLINE)
        return Sleep(w.deadline, f"{w.position} ahead of it in this proxy's line", Rule.BACK, line=True)
    if w.ahead == 0 and not w.tried_take:
        return Take()  # the first in line tries a slot file first, even at its deadline
    if w.now >= w.deadline:
        return GiveUp("exhausted", Rule.DEADLINE)
    if w.slots is None:
        return Look()
    return _plan(w.slots, w)


def _plan(live: Sequence[Slot], w: Waiting) -> Ask | Sleep:
    slots = [
        msgspec.structs.replace(slot, busy=True) if w.refused.get(slot.key, -math.inf) > w.now else slot
        for slot in live
    ]
    decision = plan_acquire(
        slots,
        w.backend,
        backend_cap=w.backend_cap,
        global_cap=w.global_cap,
        reserved=w.reserved,
        now=w.now,
        ahead=w.ahead,
    )
    alone = w.ahead == w.position and all(slot.instance is None for slot in live)
    poll = min(w.deadline, w.now + (LONE_POLL if alone else POLL), w.quiet_at + QUIET_MARGIN)
    if not isinstance(decision, Admit):
        if decision.freeing:
            return Sleep(poll, decision.reason, Rule.FREEING)
        if decision.until is not None:
            return Sleep(min(poll, max(w.now, decision.until) + RECENT_MARGIN), decision.reason, Rule.RECENT)
        return Sleep(poll, decision.reason, Rule.BUSY)
    if decision.evict is None:
        return Sleep(poll, "a slot is free: taken at the front of the line", Rule.ROOM)
    if any(granted.until > w.now for granted in w.granted):
        # The records read may not show the suspension it was granted yet: its slot is coming
        # free, and suspending a second session for the same start would take one too many.
        return Sleep(poll, "a session suspended for it is ending", Rule.ENDING)
    return Ask(decision.evict)


def _room(room: Room, w: Waiting) -> Measure | Ask | Sleep | Start:
    """The memory budget's part: the slot is held (no deadline of the line applies any more)."""
    if room.plan is None:
        return Measure()
    for chosen in room.plan.suspend:
        if not chosen.stopping and chosen.key not in room.asked:
            return Ask(room.slots[chosen.key], Rule.MEMORY)
    if room.going:
        if w.now < room.until:
            return Sleep(min(room.until, w.now + POLL), "trees suspended for its room are ending", Rule.MAKING_ROOM)
        return Start(Rule.OVERDUE, overdue=len(room.going))
    if not all(room.asked.values()):
        return Measure(Rule.MAKING_ROOM)  # one was not idle after all: plan again without it
    return Start()
