"""The live-process budget: who may start an adapter, whom to suspend for it, who has idled too long.

Everything here is a pure decision over a snapshot of the live slots, in the
manner of httpcore's connection pool: the proxy takes the snapshot, asks, and
then does the slow work (suspending a session, spawning an adapter) outside.

A *slot* is one live adapter process: a session's, or a *spare* (started for
``initialize``/``authenticate`` before any session exists, and handed to the
next ``session/new``). A slot is *idle* when no turn is in flight on it and no
agent->client request of it is pending; only idle slots are ever suspended.
Spares go first, then the least recently used session.

A session active moments ago (its turn just ended, it was just opened) is *recent*
until ``recent_until``: the gateway's next prompt is likely on its way, and taking
its process now would cost it a restore. It is not taken while it is recent; a waiter
for a slot plans again when it stops being so. The slots may be the whole install's
(every proxy of a state dir), read from its slot files: a slot being stopped still
counts, and means a slot is coming free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

import msgspec

from acp_proxy.protocol.methods import Method


class Slot(msgspec.Struct, frozen=True):
    key: str
    """The session id, or ``spare:<backend>``."""
    backend: str
    last_active: float
    busy: bool = False
    spare: bool = False
    pinned: bool = False
    """Never suspended by the pool (a backend whose sessions cannot be resumed)."""
    recent_until: float = 0.0
    """Until then it counts as active moments ago: not taken (same clock as ``now``)."""
    stopping: bool = False
    """Being stopped: it still counts, and its slot is coming free."""
    instance: str | None = None
    """The proxy that holds it, if not this one."""
    memory: int | None = None
    """Its tree's memory when last measured (bytes); the memory budget's, not this plan's, like
    the fields below."""
    index: int | None = None
    """Its slot file's number (``slots/all``): a start waits on it for the tree to be gone."""
    root: int | None = None
    """The tree's root (its wrapper's pid), to measure it by; ``None`` while not launched."""
    starting: bool = False
    """Its adapter has not answered yet: still loading."""
    command: str | None = None
    """Its backend's command hash, under which the install learns how large the backend's trees get."""


class Admit(msgspec.Struct, frozen=True):
    """Start the process, after suspending ``evict`` (if set) to make room."""

    evict: Slot | None = None


class Wait(msgspec.Struct, frozen=True):
    """No room and nothing idle to suspend: wait for a slot to free up."""

    reason: str
    until: float | None = None
    """When a recently active session stops being so: plan again then."""
    freeing: bool = False
    """Slots being freed cover this waiter and every one ahead of it: it waits for one of them."""


Decision = Admit | Wait


def _eviction_order(slot: Slot) -> tuple[bool, float]:
    return (not slot.spare, slot.last_active)


def plan_acquire(
    live: Sequence[Slot],
    backend: str,
    *,
    backend_cap: int,
    global_cap: int,
    reserved: Mapping[str, int] | None = None,
    now: float = 0.0,
    ahead: int = 0,
) -> Decision:
    """Decide how a new process for ``backend`` gets a slot.

    ``reserved`` counts slots promised to starts in progress (per backend), which
    are not in ``live`` yet but must not be promised twice. ``now`` is the clock
    ``recent_until`` is on. ``ahead`` counts the waiters before this one: free slots
    and slots being freed go to them first, in order, so this one suspends a session
    for a slot of its own only when there are no more of those than waiters ahead
    (several slots are then freed side by side, never more than there are waiters).
    Only the first in line (``ahead == 0``) is admitted to start.
    """
    pending = reserved or {}
    in_backend = sum(1 for slot in live if slot.backend == backend) + pending.get(backend, 0)
    total = len(live) + sum(pending.values())
    if ahead == 0 and in_backend < backend_cap and total < global_cap:
        return Admit()
    backend_room = max(0, backend_cap - in_backend) + sum(1 for s in live if s.backend == backend and s.stopping)
    global_room = max(0, global_cap - total) + sum(1 for s in live if s.stopping)
    if backend_room > ahead and global_room > ahead:
        reason = "a slot is being freed" if ahead == 0 else f"a slot is being freed for each of {ahead} ahead"
        return Wait(reason, freeing=True)
    backend_short = backend_room <= ahead
    scope = [slot for slot in live if slot.backend == backend] if backend_short else list(live)
    idle = [slot for slot in scope if not slot.busy and not slot.pinned and not slot.stopping]
    ready = [slot for slot in idle if slot.spare or slot.recent_until <= now]
    if ready:
        return Admit(evict=min(ready, key=_eviction_order))
    which = f"backend {backend!r} ({backend_cap})" if backend_short else f"all backends ({global_cap})"
    if idle:
        return Wait(f"every idle session of {which} was active moments ago", until=min(s.recent_until for s in idle))
    return Wait(f"every live session of {which} is busy")


PROTECTION_FLOOR: Final = 0.05
TURNAROUND_MARGIN: Final = 2.0


def protection(min_idle: float, start_cost: float | None, turnaround: float | None) -> float:
    """How long a session active moments ago is not taken (``recent_until`` minus now).

    At most ``min_idle``, and no longer than a start of its backend takes (``start_cost``,
    ``None`` while unknown): taking it would cost it a start (a restore) when the gateway's
    next request comes, so a waiter that waits for it instead never waits longer than that.
    Once its gateway has been seen coming back after a turn (``turnaround``: the longest recent
    gap between a turn's end and its next prompt), no longer than twice that, and at least
    ``PROTECTION_FLOOR``: a session whose gateway sends its next prompt within milliseconds does
    not keep a slot idle for a start's length after its last turn.
    """
    cap = min_idle if start_cost is None else min(min_idle, start_cost)
    return cap if turnaround is None else min(cap, max(PROTECTION_FLOOR, TURNAROUND_MARGIN * turnaround))


def expired(live: Sequence[Slot], now: float, idle_ttl: float) -> list[Slot]:
    """Idle slots not used for ``idle_ttl`` seconds, oldest first."""
    stale = [slot for slot in live if not slot.busy and not slot.pinned and now - slot.last_active >= idle_ttl]
    return sorted(stale, key=_eviction_order)


# --- how a suspended session comes back -------------------------------------------------------

STRATEGY_METHODS: Final = {"resume": Method.RESUME, "load": Method.LOAD, "new": Method.NEW}
"""The request each named ``resume`` strategy restores with."""

METHOD_NOT_FOUND: Final = -32601
FALLBACK_ERRORS: Final = frozenset({-32002, METHOD_NOT_FOUND, -32602})
"""Resource not found, method not found, invalid params: the adapter cannot restore this session
that way (it never kept it, or does not serve the method), so the next way is tried, down to a
fresh ``session/new``. Any other error, a timeout or an interruption keeps the mapping: trying
again later may work."""


def restore_order(
    strategy: str,
    *,
    can_resume: bool,
    can_load: bool,
    gateway_asked: str | None = None,
    worked: str | None = None,
    unsupported: frozenset[str] = frozenset(),
) -> tuple[str, ...]:
    """The requests that may restore a session on a fresh adapter, in the order to try them.

    ``auto`` goes ``session/resume`` (no replay) -> ``session/load`` -> ``session/new``, each
    only where the adapter advertises it and the install has not seen the backend refuse it
    as unsupported (``unsupported``); the method that last restored a session of the backend
    (``worked``) goes first. A gateway that itself sent ``session/load`` wants the replay, so
    it gets a load first when the adapter can load. A named strategy tries its request, then
    ``session/new``; ``never`` restores nothing (empty). The next request is tried only when the
    one before failed with one of ``FALLBACK_ERRORS`` (``falls_back``).
    """
    if strategy == "never":
        return ()
    if strategy != "auto":
        wanted = STRATEGY_METHODS[strategy]
        return (wanted,) if wanted == Method.NEW else (wanted, Method.NEW)
    order: list[str] = [
        method
        for method, advertised in ((Method.RESUME, can_resume), (Method.LOAD, can_load))
        if advertised and method not in unsupported
    ]
    first = Method.LOAD if gateway_asked == Method.LOAD and Method.LOAD in order else worked
    if first in order:
        order.remove(first)
        order.insert(0, first)
    return (*order, Method.NEW)


def falls_back(method: str, error_code: int | None) -> bool:
    """Whether a failed restore request may give way to the next one of ``restore_order``."""
    return method != Method.NEW and error_code in FALLBACK_ERRORS


def refused_as_unsupported(error_code: int | None) -> bool:
    """An error that says the adapter does not serve the method at all (not: not this session)."""
    return error_code == METHOD_NOT_FOUND
