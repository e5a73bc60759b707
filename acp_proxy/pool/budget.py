"""The memory budget (``[pool] max_memory``): what a start counts, and the keeper that holds the install to it.

The decisions are pure (``pool.memory``: ``plan_budget`` for the install as it is,
``plan_spawn`` for a start); here they meet the install. Every proxy measures its own trees
for its slot records; one proxy of the install (``InstallSlots.lead``) keeps the budget; and a
start makes room as part of its admission (``admission.admit``'s ``Room``, over ``plan_start``):
the install's trees measured now, starts in progress counted as large as their backend's
largest tree (``counted_trees``).
"""

from __future__ import annotations

import functools
import logging
import sqlite3
import time
from collections.abc import Sequence
from typing import Final, Protocol

import anyio
import msgspec

from acp_proxy.concurrency import Changes, Stopping
from acp_proxy.config import BackendConfig, Config
from acp_proxy.journal import SuspendReason
from acp_proxy.ownership.cgroups import memory_working_set
from acp_proxy.ownership.owner import Owner
from acp_proxy.pool.adapter import Adapter
from acp_proxy.pool.install import Held, InstallSlots
from acp_proxy.pool.learned import Learned, all_peaks, command_of
from acp_proxy.pool.memory import (
    BudgetPlan,
    MemoryBudget,
    MemorySlot,
    TreeMemory,
    counted_size,
    measure_trees,
    plan_budget,
    plan_spawn,
)
from acp_proxy.pool.plan import Slot
from acp_proxy.pool.publishing import slot_of_record, starting_record

log = logging.getLogger("acp_proxy.lifecycle")

MEMORY_EVERY: Final = 2.0
"""With a memory budget, how often each proxy measures its trees (and the keeper checks the install)."""
BUDGET_ROLE: Final = "memory-budget"


class Peaks:
    """The largest tree each backend has had: what the install has learned (``pool.learned``), and
    what this proxy has measured since (its writes are queued: the database may not have them yet)."""

    def __init__(self, learned: Learned) -> None:
        self.learned = learned
        self._seen: dict[tuple[str, str], int] = {}

    def of(self, backend: str, command: str | None) -> int:
        """The largest tree of ``backend`` under ``command`` (0: none measured). With no backend (a
        start not described yet), the largest of any backend; with no command, the largest seen here."""
        if not backend:
            try:
                learned = max(all_peaks(self.learned.db.conn).values(), default=0)
            except sqlite3.Error:
                learned = 0
            return max(learned, max(self._seen.values(), default=0))
        if command is None:
            return max((size for (name, _), size in self._seen.items() if name == backend), default=0)
        return max(self._seen.get((backend, command), 0), self.learned.facts(backend, command).peak_memory)

    def saw(self, backend: str, command: str | None, size: int) -> None:
        """A tree of ``backend`` measured ``size`` bytes: the install learns it if it is the largest seen here."""
        if not backend or command is None or size <= self._seen.get((backend, command), 0):
            return
        self._seen[(backend, command)] = size
        self.learned.peak(backend, command, size)


def measure_adapters(roots: list[int], cgroups: dict[int, str]) -> dict[int, tuple[int, str]]:
    """Each tree's bytes and how they were read: its cgroup's working set where ``cgroups`` has one
    (``memory.current`` less the inactive page cache: exact, ``cgroups.memory_working_set``), else
    PSS (or RSS) summed over its processes (``measure_trees``). Reads files that block: in a
    worker thread."""
    sizes: dict[int, tuple[int, str]] = {}
    for root, path in cgroups.items():
        current = memory_working_set(path)
        if current is not None:
            sizes[root] = (current, "cgroup")
    rest = [root for root in roots if root not in sizes]
    for root, tree in measure_trees(rest).items() if rest else ():
        sizes[root] = (tree.total, tree.method)
    return sizes


def roots_of(slots: Sequence[Slot]) -> list[int]:
    return [slot.root for slot in slots if slot.root is not None]


def budget_key(slot: Slot) -> str:
    """A slot's key for the memory budget's plan: unique across the install (a key is unique in its proxy)."""
    return slot.key if slot.instance is None else f"{slot.instance}/{slot.key}"


def memory_slot(slot: Slot, memory: int, moment: float) -> MemorySlot:
    return MemorySlot(
        key=budget_key(slot),
        backend=slot.backend,
        memory=memory,
        last_active=slot.last_active,
        busy=slot.busy,
        pinned=slot.pinned,
        recent=not slot.spare and slot.recent_until > moment,
        spare=slot.spare,
        stopping=slot.stopping,
    )


def counted_trees(slots: Sequence[Slot], trees: dict[int, TreeMemory], peaks: Peaks, moment: float) -> list[MemorySlot]:
    """The install's live trees as a start counts them (``counted_size``), ``trees`` measured now by root.

    What was measured is learned first: a tree measured here raises its backend's peak before
    any tree of that backend is counted against it.
    """
    figures: list[int | None] = []
    for slot in slots:
        tree = trees.get(slot.root) if slot.root is not None else None
        if tree is not None and tree.processes:
            peaks.saw(slot.backend, slot.command, tree.total)
            figures.append(tree.total)
        else:
            figures.append(slot.memory)  # not there to measure: its holder's figure, if any
    peak = functools.cache(peaks.of)
    return [
        memory_slot(slot, counted_size(figure, peak(slot.backend, slot.command), starting=slot.starting), moment)
        for slot, figure in zip(slots, figures, strict=True)
    ]


def plan_start(
    slots: Sequence[Slot],
    trees: dict[int, TreeMemory],
    peaks: Peaks,
    backend: BackendConfig,
    budget: MemoryBudget,
    moment: float,
    refused: frozenset[str] = frozenset(),
) -> BudgetPlan:
    """Whom to suspend so that a new tree of ``backend`` fits the budget: the install's trees counted as a
    start counts them (``trees`` measured now), ``refused`` (their proxies would not suspend them) as busy,
    the new tree as large as the largest its backend has had."""
    live = [
        msgspec.structs.replace(tree, busy=True) if tree.key in refused else tree
        for tree in counted_trees(slots, trees, peaks, moment)
    ]
    return plan_spawn(live, backend.name, peaks.of(backend.name, command_of(backend)), budget)


def fits_at_once(budget: MemoryBudget, owner: Owner, backend: BackendConfig, install: InstallSlots, held: Held) -> bool:
    """Whether a tree of ``backend`` started now fits the memory budget with no session suspended.

    Counted as a start made for a request counts (``counted_trees``), measuring here: this runs
    before the event loop.
    """
    if budget.empty:
        return True
    held.publish(starting_record(owner.instance_id, backend, held))
    moment = time.monotonic()
    others = [slot_of_record(other, moment) for other in install.holders(skip={held.index})]
    plan = plan_start(others, measure_trees(roots_of(others)), Peaks(Learned(owner.db)), backend, budget, moment)
    return not plan.suspend and not plan.overrun


class Overruns:
    """The memory budgets found exceeded with nothing left to suspend, each logged once until it fits
    again: a budget is not a kill switch. One per proxy, for its keeper and its starts alike."""

    def __init__(self) -> None:
        self._logged: set[str | None] = set()

    def note(self, plan: BudgetPlan) -> None:
        """What ``plan`` could not relieve: logged if it was not already."""
        exceeded = {overrun.backend for overrun in plan.overrun}
        for overrun in plan.overrun:
            if overrun.backend not in self._logged:
                log.warning("memory budget: %s; serving on", overrun)
        self._logged = exceeded


class Adapters(Protocol):
    """The processes this proxy runs (``running.Processes``), as the keeper measures them."""

    def live(self) -> list[Adapter]: ...


class Admission(Protocol):
    """The install's slots as the admission sees them (``slots.SlotAdmission``), as the keeper keeps them."""

    install: InstallSlots

    def install_slots(self, *, fresh: bool = False) -> list[Slot]: ...

    async def wait_for_change(self, changed: anyio.Event, timeout: float) -> None:
        """Until ``changed`` is set, or ``timeout`` seconds have passed."""
        ...

    async def evict_anywhere(self, slot: Slot, why: str, reason: SuspendReason) -> bool: ...


class MemoryKeeper:
    """Holds the install to ``max_memory``: measures this proxy's trees, and keeps the budget while this
    proxy leads it. (A start makes room for itself as part of its admission: ``slots.SlotAdmission``.)"""

    def __init__(
        self,
        config: Config,
        owner: Owner,
        adapters: Adapters,
        admission: Admission,
        peaks: Peaks,
        overruns: Overruns,
        changed: Changes,
        stopping: Stopping,
    ) -> None:
        self.owner = owner
        self.adapters = adapters
        self.admission = admission
        self.changed = changed
        self.stopping = stopping
        self.budget = MemoryBudget.of(config)
        self.peaks = peaks
        self._measure_due = Changes()
        """Notified when a new adapter has answered: measure it now, rather than at the next round."""
        self.overruns = overruns
        self.for_ceilings = config.has_session_ceilings()
        """Some backend's sessions have a memory ceiling: measure this proxy's trees for them too."""
        self.measured = Changes()
        """Notified once each round has measured this proxy's trees (``MemoryCeilings.watch`` waits on it)."""

    async def keep(self) -> None:
        """With ``max_memory`` set: measure this proxy's trees every few seconds (for its slot records),
        and, if this proxy keeps the install's budget, suspend idle sessions until the install fits.
        With a memory ceiling per session: measure them, and tell whoever waits on ``measured``.

        One proxy of the install keeps the budget at a time (``InstallSlots.lead``): two keepers
        reading the same records would suspend twice what is needed. A budget is not a kill
        switch: busy sessions are never suspended; an overrun nothing can relieve is logged once.
        """
        if self.budget.empty and not self.for_ceilings:
            return
        while not self.stopping.begun:
            due = self._measure_due.next()
            await self._measure()
            self.measured.notify()
            if not self.budget.empty and self.admission.install.lead(BUDGET_ROLE):
                measured, by_key = self._memory_slots()
                await self._carry_out(plan_budget(measured, self.budget), by_key, "over the memory budget")
            await self.admission.wait_for_change(due, MEMORY_EVERY)

    async def _measure(self) -> None:
        """Measure this proxy's trees, for its slot records; what they measure is learned by the install."""
        adapters = self.adapters.live()
        roots = {a.supervised.process.pid: a for a in adapters}
        sizes = await anyio.to_thread.run_sync(measure_adapters, list(roots), self.cgroups_of(adapters))
        for root, (size, kind) in sizes.items():
            adapter = roots[root]
            adapter.usage.memory, adapter.usage.memory_kind = size, kind
            if size:
                self.peaks.saw(adapter.backend.name, adapter.supervised.lease.command_hash, size)
        self.changed.notify()  # the slot records carry the figures

    def cgroups_of(self, adapters: list[Adapter]) -> dict[int, str]:
        """The trees whose cgroup has ``memory.current`` (cgroup mode, with the memory controller), by root."""
        owned = self.owner.cgroup
        if owned is None or not owned.memory:
            return {}
        return {
            a.supervised.process.pid: a.supervised.cgroup
            for a in adapters
            if a.supervised.cgroup is not None and a.supervised.cgroup_joined
        }

    def measure_soon(self) -> None:
        """A new adapter has answered: measure it now, rather than at the next round."""
        self._measure_due.notify()

    async def _carry_out(self, plan: BudgetPlan, by_key: dict[str, Slot], why: str) -> None:
        """Suspend what the plan chose (a tree already being stopped is on its way out)."""
        for chosen in plan.suspend:
            if not chosen.stopping:
                slot = by_key[chosen.key]
                log.info("pool: suspending %s (%.0f MB): %s", slot.key, chosen.memory / 1e6, why)
                await self.admission.evict_anywhere(slot, why, SuspendReason.MEMORY)
        self.overruns.note(plan)

    def _memory_slots(self) -> tuple[list[MemorySlot], dict[str, Slot]]:
        """The install's live trees for the budget (being stopped: already on their way out), and
        each one's plan slot, to suspend it by."""
        moment = time.monotonic()
        slots = [
            slot
            for slot in self.admission.install_slots()
            if not slot.stopping and not slot.key.startswith("starting:")
        ]
        measured = [memory_slot(slot, slot.memory or 0, moment) for slot in slots]
        return measured, {budget_key(slot): slot for slot in slots}
