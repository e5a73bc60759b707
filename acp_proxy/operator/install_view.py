"""The install as its operator sees it: one snapshot, read in one place, for ``status``, ``metrics`` and ``top``.

``read_install`` reads everything those three show, once per command (once per refresh for
``top``): the proxies of the install and, for those alive, their own answer to ``status``; the
install's slot files and who waits for one; the sessions, leases and active turns on record;
the journal's counters and latest events; and, when asked, the processes each active lease
owns. Each command renders this ``InstallView`` its own way (``reports.status``,
``metrics.figures_of``, ``top.snapshot``); none of them reads the install by itself. The SQL
is the owning modules' (the registry's for sessions, the records' for tasks, ``ownership`` for
leases and instances, the journal's).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec

from acp_proxy import journal
from acp_proxy.operator.commands import owned_tree
from acp_proxy.ownership import instances, leases
from acp_proxy.ownership.leases import Lease
from acp_proxy.pool.install import HeldSlot, InstallSlots
from acp_proxy.sessions import registry
from acp_proxy.state import StateDB
from acp_proxy.tasks.records import TaskRecord, counts_since, list_tasks
from acp_proxy.tasks.status import ACTIVE

RECENT_WINDOW: Final = 24 * 3600.0
"""How far back ``tasks_last_day`` counts (wall clock)."""

Answers = Callable[[Sequence[str]], Mapping[str, "dict[str, Any] | str"]]
"""Asks the proxies of these instance ids for their ``status``: each one's answer, or why there is none."""


class ProxyFacts(msgspec.Struct, frozen=True):
    """A proxy of the install not recorded as ended."""

    instance_id: str
    pid: int
    started_at: float
    alive: bool
    answer: dict[str, Any] | str | None = None
    """Its answer to ``status``, or why there is none (a message naming the proxy); ``None``: not asked."""

    @property
    def pool(self) -> dict[str, Any]:
        """The pool part of its answer (``{}`` without one)."""
        found = self.answer.get("pool") if isinstance(self.answer, dict) else None
        return found if isinstance(found, dict) else {}


class InstallView(msgspec.Struct, frozen=True, kw_only=True):
    """What ``read_install`` read of one install at one moment."""

    state_dir: Path
    taken_at: float
    """Wall clock."""
    clock: float
    """``time.monotonic()`` at the same moment: the slot records' clock."""
    proxies: tuple[ProxyFacts, ...] = ()
    slots: tuple[HeldSlot, ...] = ()
    """The install's held slot files, each with its holder's record (``None``: a start in progress)."""
    waiting: Mapping[str, int] = msgspec.field(default_factory=dict)
    """Waiters for a slot now, by backend (of the backends asked about)."""
    sessions: Mapping[str, int] = msgspec.field(default_factory=dict)
    """Sessions by state."""
    held_sessions: tuple[tuple[str, str, str, str | None], ...] = ()
    """Sessions a proxy holds (live or resuming), most recently active first: id, backend, state, title."""
    recent_sessions: tuple[tuple[Any, ...], ...] = ()
    """What ``top`` lists (``registry.recent_for_view``), when asked for."""
    backends: frozenset[str] = frozenset()
    """Every backend a session of the install has run on."""
    leases: Mapping[str, int] = msgspec.field(default_factory=dict)
    """Leases by state."""
    active_leases: tuple[Lease, ...] = ()
    trees: Mapping[str, list[dict[str, Any]]] = msgspec.field(default_factory=dict)
    """Per active lease, the processes it owns (``owned_tree``), when asked for."""
    active_tasks: tuple[TaskRecord, ...] = ()
    """Tasks recorded as queued or running (a dead proxy's are lost, whatever their row says)."""
    tasks_last_day: Mapping[str, int] = msgspec.field(default_factory=dict)
    counters: tuple[journal.Counter, ...] = ()
    events: tuple[journal.Event, ...] = ()
    """The latest events, newest first, when asked for."""
    liveness: Callable[[str], bool] = lambda instance_id: False
    """Whether a proxy instance is alive, for one that started after ``proxies`` was read."""

    def alive(self, instance_id: str | None) -> bool:
        """Whether that proxy is alive: as ``proxies`` says, else asked now (one that started since)."""
        if instance_id is None:
            return False
        for proxy in self.proxies:
            if proxy.instance_id == instance_id:
                return proxy.alive
        return self.liveness(instance_id)


def read_install(
    db: StateDB,
    state_dir: Path,
    *,
    alive: Callable[[str], bool],
    answers: Answers | None = None,
    trees: bool = False,
    waiting_for: Collection[str] = (),
    recent_sessions: tuple[float, int] | None = None,
    events: int = 0,
) -> InstallView:
    """Everything operators are shown of the install, read now.

    ``alive``: whether a proxy instance is alive (``reports.Liveness``). ``answers``: ask the live
    proxies for their ``status``, all at once (none asked without it). ``trees``: measure what
    each active lease owns (a ``/proc`` walk per lease). ``waiting_for``: the backends (besides
    those of the install's sessions) whose waiters to count. ``recent_sessions``: (closed since,
    at most) for ``top``'s list. ``events``: how many of the latest events.
    """
    unended = [(instance_id, pid, started, alive(instance_id)) for instance_id, pid, started in instances.unended(db)]
    asked = answers([row[0] for row in unended if row[3]]) if answers is not None else {}
    proxies = tuple(
        ProxyFacts(instance_id, pid, started, live, asked.get(instance_id))
        for instance_id, pid, started, live in unended
    )
    taken_at, clock = time.time(), time.monotonic()  # after the asks (they may take seconds): what follows is now
    install = InstallSlots(state_dir, "reader")
    backends = frozenset(registry.backends_of_sessions(db))
    active = tuple(leases.active_leases(db))
    return InstallView(
        state_dir=state_dir,
        taken_at=taken_at,
        clock=clock,
        proxies=proxies,
        slots=tuple(install.holders()),
        waiting={
            backend: count for backend in sorted(backends | set(waiting_for)) if (count := install.waiters(backend))
        },
        sessions=registry.counts_by_state(db),
        held_sessions=tuple(registry.held(db)),
        recent_sessions=tuple(registry.recent_for_view(db, *recent_sessions)) if recent_sessions else (),
        backends=backends,
        leases=leases.counts_by_state(db),
        active_leases=active,
        trees={lease.lease_id: owned_tree(lease) for lease in active} if trees else {},
        active_tasks=tuple(list_tasks(db, statuses=sorted(ACTIVE), limit=None)),
        tasks_last_day=counts_since(db, taken_at - RECENT_WINDOW),
        counters=tuple(journal.counters(db.conn)),
        events=tuple(journal.recent_events(db.conn, events)) if events else (),
        liveness=alive,
    )
