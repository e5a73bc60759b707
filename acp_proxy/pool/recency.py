"""How recently each process was used: what a start costs, how fast a gateway comes back, and the idle TTL.

A session active moments ago (just opened or restored, a turn just ended) is *recent* until
``Usage.recent_until`` and is not taken for another start meanwhile (``plan.protection`` says
for how long). ``Recency`` learns what that takes: per backend, a running estimate of what a
start costs (slot had -> session bound), and per session, how long its gateway took to come
back after a turn. ``sweep_idle`` suspends what has not been used for ``[pool] idle_ttl``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

import anyio

from acp_proxy.concurrency import Stopping
from acp_proxy.journal import SuspendReason
from acp_proxy.pool.adapter import Adapter
from acp_proxy.pool.plan import Slot, expired, protection

TURNAROUND_DECAY: Final = 0.8
"""Per turn, how much of the longest turnaround seen so far is still believed."""
TURNAROUNDS_KEPT: Final = 10_000
START_COST_WEIGHT: Final = 0.3
"""Weight of the newest start in the running estimate of a backend's start cost."""


class Recency:
    """This proxy's estimates of start costs and gateway turnarounds, and the recency of its processes."""

    def __init__(self, min_idle: float) -> None:
        self.min_idle = min_idle
        self._start_costs: dict[str, float] = {}
        """Per backend, a running estimate of how long a start takes (slot taken -> session bound)."""
        self._turnarounds: dict[str, float] = {}
        """Per session, the longest recent gap between a turn's end and the gateway's next prompt
        (least recently active first)."""

    def protection(self, backend: str, session: str | None = None) -> float:
        """How long a session just active is not taken (``plan.protection``: ``min_idle``, a start's
        cost, twice its gateway's turnaround)."""
        turnaround = self._turnarounds.get(session) if session is not None else None
        return protection(self.min_idle, self._start_costs.get(backend), turnaround)

    def note_bound(self, adapter: Adapter) -> None:
        """A session now runs on ``adapter`` (opened or restored): learn the start cost, mark it recent."""
        moment = time.monotonic()
        adapter.usage.last_active = moment
        name = adapter.backend.name
        if adapter.usage.started_at is not None:
            cost = moment - adapter.usage.started_at
            adapter.usage.started_at = None
            old = self._start_costs.get(name)
            self._start_costs[name] = cost if old is None else old + START_COST_WEIGHT * (cost - old)
        adapter.usage.recent_until = moment + self.protection(name, adapter.gateway_session)

    def note_turn_ended(self, adapter: Adapter) -> None:
        """A turn has ended: learn how fast the gateway came back after the one before, mark it recent."""
        moment = time.monotonic()
        session = adapter.gateway_session
        if session is not None and adapter.usage.turnaround is not None:
            known = self._turnarounds.pop(session, 0.0)
            self._turnarounds[session] = max(adapter.usage.turnaround, known * TURNAROUND_DECAY)
            if len(self._turnarounds) > TURNAROUNDS_KEPT:
                del self._turnarounds[next(iter(self._turnarounds))]  # the least recently active session's
        adapter.usage.turnaround = None
        adapter.usage.turn_ended_at = moment
        # Its last use is the turn's end, not its start: a long turn just ended is not the least recently
        # used session (the pool's order), nor idle since it began (idle_ttl).
        adapter.usage.last_active = moment
        adapter.usage.recent_until = moment + self.protection(adapter.backend.name, session)


async def sweep_idle(
    ttl: float,
    slots: Callable[[], list[Slot]],
    evict: Callable[[Slot, str, SuspendReason], bool],
    stopping: Stopping,
) -> None:
    """The idle TTL sweeper: suspend sessions (and stop spares) idle longer than ``ttl``, looking a few
    times per TTL (at most every 30 s)."""
    interval = max(0.05, min(ttl / 4, 30.0))
    while True:
        await anyio.sleep(interval)
        if stopping.begun:
            return
        for slot in expired(slots(), time.monotonic(), ttl):
            evict(slot, f"idle for {ttl:g}s", SuspendReason.IDLE_TTL)
