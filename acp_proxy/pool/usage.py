"""What the pool keeps of one adapter process: its slot, when it was used, how recent, how large.

An ``Adapter`` is a connection (its process, pipes, pending calls and id maps); this is the
pool's account of it, kept beside it as ``Adapter.usage``. Only the pool's modules assign its
fields (``tests/test_layers.py``): the start (``ProcessPool.start``), recency (``Recency``), the
memory budget (``MemoryKeeper``), and the connection's own reports of activity (a request
forwarded, work reported between turns). Everyone else reads it: the slot records
(``publishing``), the plans, the operator's views.
"""

from __future__ import annotations

import time

import msgspec

from acp_proxy.pool.install import Held


class Usage(msgspec.Struct, kw_only=True):
    slot: Held | None = None
    """The install's slot it holds (its wrapper holds it too, until the tree is gone)."""
    slot_since: float = msgspec.field(default_factory=time.time)
    """Wall-clock time the slot was taken."""
    started_at: float | None = None
    """Monotonic time its slot was had, until its first session is bound (what a start costs)."""
    start_deadline: float | None = None
    """By when it must answer the request it was started (or, a spare, taken) for: ``start_timeout``."""
    starting: bool = True
    """It has not answered the request it was started for yet: still loading (the memory budget
    counts it as at least the largest tree its backend has had)."""
    last_active: float = 0.0
    """Monotonic time it was last used: a request forwarded, a turn ended, work reported."""
    recent_until: float = 0.0
    """Monotonic time until which it was active moments ago (``[pool] min_idle``): not taken."""
    quiet_at: float = 0.0
    """Monotonic time until which it counts as busy: it reported work after its turn ended
    (``[pool] quiet_after`` from its last such update)."""
    turn_ended_at: float | None = None
    turnaround: float | None = None
    """How long the gateway took to send this turn's prompt after the previous turn ended."""
    memory: int | None = None
    """Its tree's memory when last measured (bytes), and how (``pss`` or ``rss``)."""
    memory_kind: str | None = None

    @property
    def working_in_background(self) -> bool:
        """It reported work between turns moments ago (``quiet_after``)."""
        return self.quiet_at > 0 and time.monotonic() < self.quiet_at

    def used(self) -> None:
        """A request was forwarded to it."""
        self.last_active = time.monotonic()

    def turn_started(self) -> None:
        """A prompt was forwarded: how long the gateway took to come back after the last turn."""
        if self.turn_ended_at is not None:
            self.turnaround, self.turn_ended_at = self.last_active - self.turn_ended_at, None

    def heard_working(self, quiet_after: float) -> None:
        """It reported work with no turn running: busy until ``quiet_after`` passes without more."""
        moment = time.monotonic()
        self.quiet_at = moment + quiet_after
        self.last_active = moment
