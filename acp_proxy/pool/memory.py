"""The memory budget's two halves: what a live adapter tree uses, and whom to suspend for the budget.

**Measuring.** An adapter tree is its wrapper and every descendant (the adapter in its own
process group, whatever it forked, and orphans the wrapper, a subreaper, took in). One pass
over the process table (``ProcessTable.parents``) finds the trees; then each process is read:

* ``ProcMemory`` (Linux) reads PSS from ``/proc/PID/smaps_rollup`` (kernel >= 4.14): shared
  pages (the interpreter, libraries) are split among the processes mapping them, so summing a
  tree does not count them several times. Where it cannot be read (an older kernel, a process
  of another uid: it needs ptrace access) it falls back to RSS from ``/proc/PID/statm``,
  which anyone may read but which counts every shared page in full.
* ``PsutilMemory`` (no ``/proc``: macOS) reads RSS through psutil. There psutil's
  ``memory_full_info`` would give USS, but by walking every memory region: too slow for a
  measure taken every few seconds.

``smaps_rollup`` is one summary rather than the per-mapping ``smaps``, read here with bare
``os`` calls (psutil reads the same file, with its own overhead). Its cost is the kernel's walk
of the page tables: about 10 µs per MiB resident (a 600 MiB adapter: 6 ms), against 5 µs for
``statm`` whatever the size. The reads block, so an event loop runs ``measure_trees`` in a
worker thread. A process that vanishes mid-read is skipped, and one that cannot be read at all
is counted apart rather than raising: a budget is advisory, and a figure a little low is
better than none.

**Counting.** A figure measured every few seconds is late for a tree that has just started:
it is still loading, and measures far less than it soon will. So a start counts every live
tree of the install as measured there and then, and a tree still starting (its adapter has
not answered yet) as at least the largest tree its backend has had (``counted_size``); the
new tree is expected to be that large too. That largest tree is learned by the install
(``learned.py``): a proxy's first start knows it from the proxies before it.

**Deciding.** ``plan_budget`` (the periodic check) and ``plan_spawn`` (before a process
starts) are pure decisions over a snapshot, like ``plan_acquire`` in ``plan.py``: which idle
slots to suspend, least recently used first, so that every budget holds. The caller suspends
them afterwards; before a spawn it also waits for their trees (and those already being
stopped that the plan counted on) to be gone. A budget is not a kill switch: when nothing
more can be suspended the decision says which budgets are still exceeded, and a spawn goes
ahead anyway.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Literal, NamedTuple, Protocol

import msgspec

from acp_proxy.config import Config
from acp_proxy.ownership.proctable import ProcessTable, TableUnavailable, default_table

# --- measuring -----------------------------------------------------------------------------------

Method = Literal["pss", "rss", "unreadable"]


class Usage(NamedTuple):
    """One process's memory, and how it was read (``unreadable``: not at all, ``size`` is 0)."""

    method: Method
    size: int


UNREADABLE = Usage("unreadable", 0)


class MemoryReader(Protocol):
    name: str

    def read(self, pid: int) -> Usage | None:
        """The process's memory; ``None`` if it is gone (or a zombie, which holds none)."""
        ...


class ProcMemory:
    """PSS from ``smaps_rollup``, else RSS from ``statm``. The root is a parameter for tests."""

    name = "procfs"

    def __init__(self, root: str | Path = "/proc") -> None:
        self.root = str(root)
        self.page_size = os.sysconf("SC_PAGE_SIZE")

    def _read(self, pid: int, name: str) -> bytes:
        # Bare os calls: this runs for every process of every tree every few seconds.
        fd = os.open(f"{self.root}/{pid}/{name}", os.O_RDONLY)
        try:
            return os.read(fd, 4096)
        finally:
            os.close(fd)

    def read(self, pid: int) -> Usage | None:
        try:
            rollup = self._read(pid, "smaps_rollup")
        except OSError:
            pass  # gone, no smaps_rollup (kernel < 4.14), or another uid's: statm tells which
        else:
            start = rollup.find(b"\nPss:")
            if start >= 0:
                try:
                    return Usage("pss", int(rollup[start + 5 : rollup.index(b"kB", start)]) * 1024)
                except ValueError:
                    pass
        return self.read_rss(pid)

    def read_rss(self, pid: int) -> Usage | None:
        """RSS from ``statm``, which anyone may read (shared pages counted in full)."""
        try:
            statm = self._read(pid, "statm").split()
        except (FileNotFoundError, ProcessLookupError):
            return None
        except OSError:
            return UNREADABLE
        try:
            size, resident = int(statm[0]), int(statm[1])
        except (IndexError, ValueError):
            return UNREADABLE
        # No address space at all: a zombie (its smaps_rollup fails with ESRCH), holding no memory.
        return None if size == 0 else Usage("rss", resident * self.page_size)


class PsutilMemory:
    """RSS through psutil, imported on first use: the Linux path never needs it."""

    name = "psutil"

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil

    def read(self, pid: int) -> Usage | None:
        try:
            return Usage("rss", self._psutil.Process(pid).memory_info().rss)
        except (self._psutil.NoSuchProcess, ProcessLookupError):  # ZombieProcess is a NoSuchProcess
            return None
        except (self._psutil.Error, OSError):
            return UNREADABLE


def default_reader() -> MemoryReader:
    if sys.platform == "linux" and os.path.isdir("/proc/self"):
        return ProcMemory()
    return PsutilMemory()


class TreeMemory(msgspec.Struct, frozen=True):
    """What one adapter tree uses: bytes and processes, split by how each process was read.

    The split rather than one method: a tree read partly by RSS is an overestimate of that
    part only, and an operator (or a test) can see how much of the figure is exact.
    """

    pss: int = 0
    """Bytes, summed over the processes read by PSS."""
    rss: int = 0
    """Bytes, summed over the processes read by RSS (shared pages counted in full)."""
    pss_processes: int = 0
    rss_processes: int = 0
    unreadable: int = 0
    """Processes of the tree whose memory could not be read at all: not in the figure."""
    partial: bool = False
    """The process table could not be listed: only the tree's root was measured."""

    @property
    def total(self) -> int:
        return self.pss + self.rss

    @property
    def processes(self) -> int:
        """The processes counted in ``total``."""
        return self.pss_processes + self.rss_processes

    @property
    def method(self) -> Literal["pss", "rss"]:
        """``pss`` when every counted process was read by PSS; ``rss`` when any fell back."""
        return "rss" if self.rss_processes else "pss"


def _tally(usages: Iterable[Usage], *, partial: bool = False) -> TreeMemory:
    size: dict[Method, int] = {"pss": 0, "rss": 0, "unreadable": 0}
    count: dict[Method, int] = {"pss": 0, "rss": 0, "unreadable": 0}
    for usage in usages:
        size[usage.method] += usage.size
        count[usage.method] += 1
    return TreeMemory(
        pss=size["pss"],
        rss=size["rss"],
        pss_processes=count["pss"],
        rss_processes=count["rss"],
        unreadable=count["unreadable"],
        partial=partial,
    )


def tree_pids(parents: Mapping[int, int], roots: Iterable[int]) -> dict[int, list[int]]:
    """Each root and its descendants in ``parents`` (pid -> ppid), root first; empty if the root is gone."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    trees = {}
    for root in roots:
        found, seen = ([root], {root}) if root in parents else ([], set())
        for pid in found:  # grows as it goes: breadth first
            for child in children.get(pid, ()):
                if child not in seen:  # a snapshot taken over time could show a reused pid as a cycle
                    seen.add(child)
                    found.append(child)
        trees[root] = found
    return trees


def measure_trees(
    roots: Iterable[int], *, table: ProcessTable | None = None, reader: MemoryReader | None = None
) -> dict[int, TreeMemory]:
    """The memory of each tree rooted at one of ``roots`` (wrapper pids), with one pass over the
    process table for all of them. A root that is gone measures as an empty ``TreeMemory``.

    A root should be a child of this process not yet waited for, so that its pid cannot have
    been reused by a stranger.
    """
    table = table or default_table()
    reader = reader or default_reader()
    roots = list(roots)
    try:
        trees = tree_pids(table.parents(), roots)
        partial = False
    except TableUnavailable:
        trees, partial = {root: [root] for root in roots}, True
    measured = {}
    for root, pids in trees.items():
        usages = (reader.read(pid) for pid in pids)
        measured[root] = _tally((usage for usage in usages if usage is not None), partial=partial)
    return measured


# --- deciding ------------------------------------------------------------------------------------


class MemorySlot(msgspec.Struct, frozen=True):
    """One live adapter tree as the budget sees it (of any proxy of the install)."""

    key: str
    """The session id, or ``spare:<backend>``."""
    backend: str
    memory: int
    """Bytes, as last measured (``TreeMemory.total``)."""
    last_active: float
    busy: bool = False
    pinned: bool = False
    """Never suspended (a backend whose sessions cannot be resumed)."""
    recent: bool = False
    """Active moments ago (a turn just ended): taken only once no other idle slot would do."""
    spare: bool = False
    """Started before any session; holds none, so it goes first."""
    stopping: bool = False
    """Being stopped already: it counts until its tree is gone, and is the first to count on."""


def counted_size(measured: int | None, peak: int, *, starting: bool) -> int:
    """What a live tree counts for in a start's decision.

    ``measured``: its figure now (``None``: it could not be measured); ``peak``: the largest
    tree its backend has had (0: none measured yet). A tree still starting is loading: it
    counts as at least the peak. A tree without a figure is guessed at the peak.
    """
    if measured is None:
        return peak
    return max(measured, peak) if starting else measured


class MemoryBudget(msgspec.Struct, frozen=True):
    """``[pool] max_memory`` (all backends of the install together) and each backend's ``max_memory``."""

    total: int | None = None
    per_backend: Mapping[str, int] = msgspec.field(default_factory=dict)

    @classmethod
    def of(cls, config: Config) -> MemoryBudget:
        """The budget a config sets (an empty one, that never suspends, if it sets none)."""
        per_backend = {name: b.max_memory for name, b in config.backends.items() if b.max_memory is not None}
        return cls(config.pool.max_memory, per_backend)

    @property
    def empty(self) -> bool:
        """No budget at all: no need to measure anything."""
        return self.total is None and not self.per_backend


class Overrun(msgspec.Struct, frozen=True):
    """A budget still exceeded once everything that may be suspended is."""

    backend: str | None
    """The backend whose budget it is; ``None``: the install-wide budget."""
    used: int
    """Bytes still used (with a spawn's expected size, for ``plan_spawn``)."""
    budget: int

    def __str__(self) -> str:
        scope = "all backends" if self.backend is None else f"backend {self.backend!r}"
        return (
            f"{scope} use {_mib(self.used)} of a {_mib(self.budget)} max_memory, and no idle "
            "session that would lower it is left to suspend"
        )


class BudgetPlan(msgspec.Struct, frozen=True):
    suspend: tuple[MemorySlot, ...] = ()
    """Suspend these, in this order (one already ``stopping`` is only waited for)."""
    overrun: tuple[Overrun, ...] = ()
    """Budgets exceeded even after ``suspend``: the caller logs them (once per episode, by ``backend``)."""


def _mib(size: int) -> str:
    return f"{size / 1024**2:.0f} MiB"


def _suspension_order(slot: MemorySlot) -> tuple[bool, bool, bool, float]:
    return (not slot.stopping, not slot.spare, slot.recent, slot.last_active)


def _relieve(live: Sequence[MemorySlot], limits: Mapping[str | None, int], extra: int = 0) -> BudgetPlan:
    """Suspend idle slots in order, each only if it lowers a budget still exceeded, until none is.

    ``limits`` maps a scope (a backend, or ``None`` for all) to its budget; ``extra`` bytes are
    added to every scope's use (a spawn's expected size).
    """
    used = {scope: sum(s.memory for s in live if scope in (None, s.backend)) + extra for scope in limits}
    chosen = []
    takeable = (s for s in live if s.stopping or not (s.busy or s.pinned))
    for slot in sorted(takeable, key=_suspension_order):
        over = [scope for scope in limits if used[scope] > limits[scope]]
        if not over:
            break
        if None in over or slot.backend in over:
            chosen.append(slot)
            for scope in limits:
                if scope in (None, slot.backend):
                    used[scope] -= slot.memory
    overrun = tuple(Overrun(scope, used[scope], limit) for scope, limit in limits.items() if used[scope] > limit)
    return BudgetPlan(tuple(chosen), overrun)


def plan_budget(live: Sequence[MemorySlot], budget: MemoryBudget) -> BudgetPlan:
    """Which idle slots to suspend so that the live trees fit every budget.

    Trees already being stopped first (nothing to do but let them end), then spares, then the
    least recently used sessions; a ``recent`` one only after every other idle one; busy and
    pinned ones never. A slot is taken only if it lowers a budget
    still exceeded (another backend's session does not relieve a backend's own budget).
    A total equal to the budget fits.
    """
    limits: dict[str | None, int] = {backend: size for backend, size in budget.per_backend.items()}
    if budget.total is not None:
        limits[None] = budget.total
    return _relieve(live, limits)


def plan_spawn(live: Sequence[MemorySlot], backend: str, expected: int | None, budget: MemoryBudget) -> BudgetPlan:
    """Which idle slots to suspend before starting a process of ``backend``, expected to use
    ``expected`` bytes (``None``: unknown, counted as nothing), so that it starts within budget.

    Only the budgets the new process counts against are considered: the install-wide one and
    its backend's. Same order as ``plan_budget``. A non-empty ``overrun`` does not stop the
    spawn: the caller starts the process anyway and logs it.
    """
    limits: dict[str | None, int] = {}
    if budget.total is not None:
        limits[None] = budget.total
    if backend in budget.per_backend:
        limits[backend] = budget.per_backend[backend]
    return _relieve(live, limits, expected or 0)
