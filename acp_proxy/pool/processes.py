"""The process pool: the adapter processes this proxy runs, started within the budget and stopped by lease.

Who may start, and whom to suspend for it, is decided by the pure plan
(``pool.plan``) over a snapshot of the live slots; here the decision meets
processes. The budget is the install's (``pool.install``): every process holds a
slot file of the state dir, so the caps hold across every proxy of it, and the
plan's snapshot has the other proxies' slots too. Calls that go upward are handed
in by the composition root: ``suspend`` (the sessions' intent, for the idle session
the plan chose), ``attach`` (the relay, which reads a new adapter's output) and
``peers`` (another proxy's control socket, to suspend one of its sessions).
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import os
import sqlite3
import time
from collections.abc import Callable, Sequence
from typing import Final, Protocol

import anyio
import msgspec
from msgspec import UNSET, Raw, UnsetType

from acp_proxy.concurrency import Background, Changes, Stopping
from acp_proxy.config import BackendConfig, Config
from acp_proxy.journal import Kind, SuspendReason
from acp_proxy.logs import ids
from acp_proxy.ownership.leases import command_hash
from acp_proxy.ownership.owner import Owner
from acp_proxy.ownership.supervised import SupervisedProcess
from acp_proxy.pool.adapter import Adapter, AdapterGone, SpawnError
from acp_proxy.pool.admission import POLL, REFUSED_FOR, Ask, GiveUp, Granted, Take, Waiting, admit
from acp_proxy.pool.install import Held, HeldSlot, InstallSlots, SlotRecord, Ticket
from acp_proxy.pool.learned import Learned, all_peaks
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
from acp_proxy.pool.plan import Slot, expired, protection
from acp_proxy.protocol.acp import PROTOCOL_VERSION, AgentCapabilities
from acp_proxy.protocol.errors import ProxyError
from acp_proxy.protocol.jsonrpc import Message
from acp_proxy.protocol.methods import Method

log = logging.getLogger("acp_proxy.lifecycle")

DRAIN_TIMEOUT: Final = 1.0
"""How long to keep relaying an exited adapter's last output before closing its stdout."""
SNAPSHOT_FOR: Final = 0.01
"""How long one reading of the other proxies' slot files serves every plan made meanwhile."""
ALIVE_FOR: Final = 1.0
"""How long a proxy found alive (or gone) is taken to be so before its lock is looked at again."""
TURNAROUND_DECAY: Final = 0.8
"""Per turn, how much of the longest turnaround seen so far is still believed."""
TURNAROUNDS_KEPT: Final = 10_000
START_COST_WEIGHT: Final = 0.3
"""Weight of the newest start in the running estimate of a backend's start cost."""
WARM_KEY: Final = "spare:warm"
MEMORY_EVERY: Final = 2.0
"""With a memory budget, how often each proxy measures its trees (and the keeper checks the install)."""
BUDGET_ROLE: Final = "memory-budget"

Answer = Callable[[Message], Message | None]
"""Called with the adapter's answer to a gateway request before it is forwarded (``PendingCall.on_answer``)."""

Suspend = Callable[[str, str, SuspendReason], bool]
"""Suspend the session of this id if it is idle (why, for the log; the reason, for the journal); False if not.
Synchronous, so that the plan's choice and the suspension happen in one step."""


class Peers(Protocol):
    """The other proxies of the install, as the pool needs them."""

    def alive(self, instance_id: str) -> bool: ...

    async def evict(self, instance_id: str, key: str, why: str, reason: SuspendReason) -> bool:
        """Ask that proxy to suspend its session (or stop its spare) ``key`` if idle; False if it refused."""
        ...


class WarmStart(msgspec.Struct):
    """The adapter launched with the proxy, before the event loop, and the install slot it holds."""

    process: SupervisedProcess
    slot: Held
    since: float = msgspec.field(default_factory=time.time)

    def record(self, instance_id: str, backend: str) -> SlotRecord:
        """A spare nobody has taken: the first to go when another start needs its slot."""
        return SlotRecord(
            instance=instance_id,
            pid=os.getpid(),
            backend=backend,
            key=WARM_KEY,
            adapter_pid=self.process.process.pid,
            since=self.since,
            busy=False,
            wrapper_pid=self.process.process.pid,
            command=self.process.lease.command_hash,
            starting=True,
        )


def launch_warm(config: Config, owner: Owner, backend: BackendConfig) -> WarmStart | None:
    """Launch ``backend`` at once if the install has a slot free for it, nobody waits for one, and
    it fits the memory budget as it is (suspending nothing: a start made for a request does that).

    Nearly every gateway's first request needs an adapter: launched now, its start-up
    overlaps the proxy's own. A full install starts it later, when a slot is had.
    """
    install = InstallSlots(owner.db.state_dir, owner.instance_id)
    if install.waiting(backend.name):
        return None
    slot = install.try_take(backend.name, global_cap=config.pool.max_live, backend_cap=backend.max_live)
    if slot is None:
        return None
    try:
        if not _fits_at_once(MemoryBudget.of(config), owner, backend, install, slot):
            slot.release()
            return None
        process = Adapter.launch(backend, owner=owner, shutdown=config.shutdown, hold=slot.descriptors)
    except BaseException:
        slot.release()
        raise
    warm = WarmStart(process, slot)
    slot.publish(warm.record(owner.instance_id, backend.name))
    return warm


def _fits_at_once(
    budget: MemoryBudget, owner: Owner, backend: BackendConfig, install: InstallSlots, held: Held
) -> bool:
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


class _Waiter(msgspec.Struct, eq=False):
    """A request waiting for a process slot."""

    arrived: float
    moved: anyio.Event = msgspec.field(default_factory=anyio.Event)
    """Set when the line moves up to it (while it is too far back to do anything)."""


def slot_key(adapter: Adapter) -> str:
    return adapter.gateway_session or f"spare:{adapter.backend.name}:{adapter.pid}"


def slot_of_record(held: HeldSlot, moment: float, *, alive: bool = True) -> Slot:
    """Another proxy's slot as its file describes it (``alive``: whether its holder is).

    A slot whose holder is a proxy that is gone is being freed (its wrapper holds it until the
    tree is gone); one not described yet is a start in progress.
    """
    record = held.record
    if record is None:
        return Slot(
            key=f"starting:{held.index}", backend="", last_active=moment, busy=True, index=held.index, starting=True
        )
    return Slot(
        key=record.key,
        backend=record.backend,
        last_active=record.last_active,
        busy=record.busy,
        spare=record.session is None,
        pinned=record.pinned,
        recent_until=record.recent_until,
        stopping=record.stopping or not alive,
        instance=record.instance,
        memory=record.memory,
        index=held.index,
        root=record.wrapper_pid,
        starting=record.starting,
        command=record.command,
    )


def starting_record(instance_id: str, backend: BackendConfig, held: Held) -> SlotRecord:
    """A slot taken for a start that has no process yet: counted as its backend's largest tree."""
    return SlotRecord(
        instance=instance_id,
        pid=os.getpid(),
        backend=backend.name,
        key=f"starting:{held.index}",
        since=time.time(),
        busy=True,
        command=command_of(backend),
        starting=True,
    )


def command_of(backend: BackendConfig) -> str:
    """The hash a lease records of ``backend``'s command: what the install's facts of it are kept under."""
    return command_hash(tuple(backend.command))


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


class ProcessPool:
    """Every adapter process this proxy started and has not yet stopped, and the budget they share."""

    def __init__(
        self,
        config: Config,
        owner: Owner,
        background: Background,
        stopping: Stopping,
        *,
        default_backend: BackendConfig,
        warm: WarmStart | None,
        suspend: Suspend,
        attach: Callable[[Adapter], None],
        peers: Peers | None = None,
    ) -> None:
        self.config = config
        self.owner = owner
        self.background = background
        self.stopping = stopping
        self.default_backend = default_backend
        self._warm = warm
        self._suspend = suspend
        self._attach = attach
        self.peers = peers
        self.install = InstallSlots(owner.db.state_dir, owner.instance_id)
        self.journal = owner.journal
        self.budget = MemoryBudget.of(config)
        self.peaks = Peaks(Learned(owner.db))
        self._measure_due = Changes()
        """Notified when a new adapter has answered: measure it now, rather than at the next round."""
        self._overruns: set[str | None] = set()
        """Budgets found exceeded with nothing left to suspend, already logged (until they fit again)."""
        self._start_costs: dict[str, float] = {}
        self._turnarounds: dict[str, float] = {}
        """Per session, the longest recent gap between a turn's end and the gateway's next prompt
        (least recently active first)."""
        """Per backend, a running estimate of how long a start takes (slot taken -> session bound)."""
        self.running: set[Adapter] = set()
        """Every adapter process started and not yet stopped."""
        self.changed = Changes()
        """Notified when a slot may have freed up (a process ended, a session went idle)."""
        self._reserved: dict[str, int] = {}
        self._taking: list[Held] = []
        """Install slots taken for starts that are not running yet."""
        self._evicting: set[Adapter] = set()
        self._slot_queues: dict[str, collections.deque[_Waiter]] = {}
        """Per backend, who waits for a process slot, oldest first."""
        self._others: tuple[float, list[Slot]] | None = None
        """The other proxies' slots as last read, and when."""
        self._instances_alive: dict[str, tuple[float, bool]] = {}
        self._install_ahead: dict[str, int] = {}
        """Per backend, how many waiters of other proxies stand before this proxy's first."""
        self.client_init: Raw | UnsetType = UNSET
        """The gateway's ``initialize`` params: every later process is initialized with them."""
        self.auth_params: Raw | UnsetType = UNSET
        """The gateway's successful ``authenticate`` params, sent again to every later process."""
        self.known_capabilities: dict[str, AgentCapabilities] = {}
        """Per backend, what its last initialized process advertised."""

    # --- what runs ------------------------------------------------------------------------------

    def spare(self, backend: BackendConfig) -> Adapter | None:
        """A running process of ``backend`` that serves no session and is not taken."""
        for adapter in self.running:
            if (
                adapter.backend.name == backend.name
                and adapter.gateway_session is None
                and not adapter.claimed
                and not adapter.gone
                and adapter not in self._evicting
            ):
                return adapter
        return None

    def any_adapter(self) -> Adapter | None:
        """For requests naming no session: a spare first, else the most recently used process."""
        spare = self.spare(self.default_backend)
        if spare is not None:
            return spare
        candidates = [a for a in self.running if not a.gone and a not in self._evicting]
        return max(candidates, key=lambda a: a.last_active, default=None)

    def live(self) -> list[Adapter]:
        return [a for a in self.running if not a.gone]

    def serving(self, backend: BackendConfig) -> list[Adapter]:
        """The processes of ``backend`` that run and are not being stopped."""
        return [a for a in self.running if a.backend.name == backend.name and not a.gone and a not in self._evicting]

    def slots(self) -> list[Slot]:
        """The snapshot the plan decides over."""
        slots = []
        for adapter in self.running:
            stopping = adapter in self._evicting
            if adapter.returncode is not None or (adapter.gone and not stopping):
                continue  # its tree is gone: the wrapper exits only once it has ended it
            slots.append(
                Slot(
                    key=slot_key(adapter),
                    backend=adapter.backend.name,
                    last_active=adapter.last_active,
                    busy=adapter.busy,
                    spare=adapter.gateway_session is None,
                    pinned=adapter.backend.resume == "never" and adapter.gateway_session is not None,
                    recent_until=adapter.recent_until,
                    stopping=stopping,
                    memory=adapter.memory,
                    index=adapter.slot.index if adapter.slot is not None else None,
                    root=adapter.supervised.process.pid,
                    starting=adapter.starting,
                    command=adapter.supervised.lease.command_hash,
                )
            )
        if self._warm is not None:  # launched with the proxy, not taken yet: the first spare to go
            warm = self._warm
            slots.append(
                Slot(
                    key=WARM_KEY,
                    backend=self.default_backend.name,
                    last_active=0.0,
                    spare=True,
                    index=warm.slot.index,
                    root=warm.process.process.pid,
                    starting=True,
                    command=warm.process.lease.command_hash,
                )
            )
        return slots

    def _teardown_bound(self) -> float:
        """How long a suspended session's tree may take to end: its close, then stdin EOF, then SIGTERM."""
        shutdown = self.config.shutdown
        return shutdown.close_timeout + shutdown.stdin_grace + shutdown.term_grace + 1.0

    def install_slots(self) -> list[Slot]:
        """The plan's snapshot for the whole install: ours as we know them, the others' from their slot files."""
        return [*self.slots(), *self._others_slots(time.monotonic())]

    def _others_slots(self, moment: float) -> list[Slot]:
        """The slots of the install this proxy does not hold, from their files (``slot_of_record``),
        re-read at most every ``SNAPSHOT_FOR``: every waiter at the front of the line plans over the
        same reading."""
        if self._others is not None and moment - self._others[0] < SNAPSHOT_FOR:
            return self._others[1]
        others = [
            slot_of_record(held, moment, alive=held.record is None or self._alive(held.record.instance, moment))
            for held in self.install.holders(skip=self._own_install_indexes())
        ]
        self._others = (moment, others)
        return others

    def _alive(self, instance_id: str, moment: float) -> bool:
        known = self._instances_alive.get(instance_id)
        if known is None or moment - known[0] >= ALIVE_FOR:
            known = (moment, self.peers.alive(instance_id) if self.peers is not None else True)
            self._instances_alive[instance_id] = known
        return known[1]

    def _memory_slots(self) -> tuple[list[MemorySlot], dict[str, Slot]]:
        """The install's live trees for the budget (being stopped: already on their way out), and
        each one's plan slot, to suspend it by."""
        moment = time.monotonic()
        slots = [slot for slot in self.install_slots() if not slot.stopping and not slot.key.startswith("starting:")]
        measured = [memory_slot(slot, slot.memory or 0, moment) for slot in slots]
        return measured, {budget_key(slot): slot for slot in slots}

    def _own_install_indexes(self) -> set[int]:
        held = [a.slot for a in self.running if a.slot is not None]
        if self._warm is not None:
            held.append(self._warm.slot)
        held.extend(self._taking)
        return {index for h in held for scope, index in h.scope_indexes if scope == "all"}

    def backend_cap(self, backend: BackendConfig) -> int:
        return backend.max_live if backend.max_live is not None else self.config.pool.max_live

    def start_timeout(self, backend: BackendConfig) -> float:
        """``start_timeout`` for ``backend``, the backend's own first; ``inf`` when it is 0 (no limit)."""
        timeout = backend.start_timeout if backend.start_timeout is not None else self.config.pool.start_timeout
        return timeout or math.inf

    def refuse(self) -> None:
        """From now on, requests waiting for a slot (and new ones) fail fast with ``proxy_shutdown``."""
        self.stopping.refusing = True
        self.changed.notify()

    # --- the budget -----------------------------------------------------------------------------

    async def _acquire_slot(self, backend: BackendConfig) -> Held:
        """Take room for one more process of ``backend`` in the install, suspending an idle session if needed.

        Waits at most ``acquire_timeout``; then ``pool_exhausted``. The caller must call
        ``_release_reservation`` once the process runs (or failed), and owns the slot.
        Waiters for one backend are served first come, first served, across the install:
        only the first in line starts, so a slot freed for it is not taken by a later
        arrival, and none waits out its timeout behind newer ones. The next ones in line
        may each have a session suspended for the slot they will need (side by side, never
        more than there are waiters); the rest sleep until the line moves up to them.
        Within this proxy the first waiter stands in the install's queue under its own
        arrival time. What a waiter does next is ``admission.admit``'s decision; this is its
        driver: it reads the install, takes slot files, asks, and sleeps.
        """
        arrived = time.monotonic()
        deadline = arrived + self.config.pool.acquire_timeout
        queue = self._slot_queues.setdefault(backend.name, collections.deque())
        waiter = _Waiter(arrived)
        queue.append(waiter)
        depth = max(1, min(self.backend_cap(backend), self.config.pool.max_live))
        place: Ticket | None = None
        refused: dict[str, float] = {}
        granted: list[Granted] = []
        waiting_logged = waited = False
        outcome = "abandoned"
        try:
            while True:
                changed = self.changed.next()
                position = queue.index(waiter)
                if position == 0:
                    if place is None and self.install.waiting(backend.name):
                        place = self.install.enqueue(backend.name, waiter.arrived)
                    self._install_ahead[backend.name] = (
                        self.install.ahead_of(place, backend.name) if place is not None else 0
                    )
                planning = position < depth
                moment = time.monotonic()
                granted = [g for g in granted if g.until > moment and self._tree_there(g.slot)]
                step = admit(
                    Waiting(
                        backend=backend.name,
                        backend_cap=self.backend_cap(backend),
                        global_cap=self.config.pool.max_live,
                        now=moment,
                        deadline=deadline,
                        position=position,
                        depth=depth,
                        ahead=position + self._install_ahead.get(backend.name, 0),
                        slots=self.install_slots() if planning else (),
                        reserved=self._reserved,
                        refused=refused,
                        granted=granted,
                        quiet_at=self._first_quiet_at(moment),
                        refusing=self.stopping.refusing,
                    )
                )
                if isinstance(step, Take):
                    held = self._take_install_slot(backend)
                    if held is not None:
                        outcome = "admitted"
                        return held
                    step = step.otherwise
                if isinstance(step, GiveUp):
                    if step.reason == "shutdown":
                        raise ProxyError.proxy_shutdown()
                    outcome = "exhausted"
                    break
                waited = True
                if isinstance(step, Ask):
                    if await self._evict_anywhere(step.slot):
                        # Its slot comes free once its tree is gone: a wait bounded by the teardown's
                        # own graces, not by acquire_timeout (that is for busy sessions).
                        granted.append(Granted(step.slot, time.monotonic() + self._teardown_bound()))
                        await self._wait_for_change(changed, POLL)
                    else:
                        # Not idle after all (its record was stale, or its session is mid-change):
                        # the next candidate is planned for; this one not again for a while.
                        refused[step.slot.key] = time.monotonic() + REFUSED_FOR
                        await anyio.lowlevel.checkpoint()
                    continue
                if step.line:
                    waiter.moved = anyio.Event()
                    await self._wait_for_change(waiter.moved, step.until - time.monotonic())
                    continue
                if position == 0:
                    if not waiting_logged:
                        log.info("pool full for backend %s: %s; waiting", backend.name, step.reason)
                        waiting_logged = True
                    if place is None:
                        place = self.install.enqueue(backend.name, waiter.arrived)
                await self._wait_for_change(changed, step.until - time.monotonic())
        finally:
            if waited:
                seconds = time.monotonic() - waiter.arrived
                self.journal.record(Kind.POOL_WAIT, backend=backend.name, label=outcome, seconds=seconds)
            if place is not None:
                place.leave()
            position = queue.index(waiter)
            queue.remove(waiter)
            if position < depth <= len(queue):
                queue[depth - 1].moved.set()  # the line moved up to it
            if not queue:
                del self._slot_queues[backend.name]
                self._install_ahead.pop(backend.name, None)
            self.changed.notify()  # the next in line plans now
        raise ProxyError.pool_exhausted(backend.name, self.backend_cap(backend))

    def _take_install_slot(self, backend: BackendConfig) -> Held | None:
        held = self.install.try_take(backend.name, global_cap=self.config.pool.max_live, backend_cap=backend.max_live)
        if held is not None:
            self._reserved[backend.name] = self._reserved.get(backend.name, 0) + 1
            self._taking.append(held)
            if not self.budget.empty:  # other proxies' starts count it from now on
                held.publish(starting_record(self.owner.instance_id, backend, held))
        return held

    @staticmethod
    async def _wait_for_change(changed: anyio.Event, timeout: float) -> None:
        with anyio.move_on_after(timeout):
            await changed.wait()

    async def _evict_anywhere(
        self, slot: Slot, why: str = "least recently used of the install", reason: SuspendReason = SuspendReason.POOL
    ) -> bool:
        """Suspend what the plan chose, in this proxy or (through its control socket) in another."""
        if slot.instance is None:
            return self.evict(slot, why, reason)
        if self.peers is None:
            return False
        log.info("pool: asking proxy %s to suspend %s (%s)", slot.instance, slot.key, why)
        self._others = None  # its record is about to change: the next plan reads it again
        evicted = await self.peers.evict(slot.instance, slot.key, why, reason)
        self.journal.record(Kind.EVICT_ASKED, backend=slot.backend, label="yes" if evicted else "no")
        return evicted

    def _first_quiet_at(self, moment: float) -> float:
        """When the first session busy only with background work counts as idle again (no event
        marks that moment: a waiter for a slot plans again then)."""
        return min((a.quiet_at for a in self.running if a.quiet_at > moment), default=math.inf)

    def _release_reservation(self, backend: BackendConfig, held: Held) -> None:
        self._reserved[backend.name] -= 1
        self._taking.remove(held)
        self.changed.notify()

    def evict(self, slot: Slot, why: str = "least recently used", reason: SuspendReason = SuspendReason.POOL) -> bool:
        """Suspend what the plan chose (a spare is simply stopped); False if it is no longer idle.

        The bookkeeping happens at once, before anything waits, so the slot is free for
        the caller's plan; the process is stopped in the background, so that whoever
        needed the slot does not wait for the teardown.
        """
        if slot.key == WARM_KEY and self._warm is not None:
            log.info("pool: stopping the adapter launched with the proxy, not taken yet (%s)", why)
            self.background.start(self.stop_warm)
            return True
        for adapter in list(self.running):
            if slot_key(adapter) != slot.key:
                continue
            if adapter.gateway_session is None:
                if adapter.busy:
                    return False
                log.info("pool: stopping a spare %s adapter (%s)", adapter.backend.name, why)
                self.stop_in_background(adapter)
                return True
            return self._suspend(adapter.gateway_session, why, reason)
        return False

    def evict_for_peer(self, key: str, why: str, reason: SuspendReason = SuspendReason.PEER) -> bool:
        """Another proxy's plan chose ``key``: suspend it if it is idle here too (False: refused).

        The other proxy read a record that may be a moment stale; this proxy's own state
        decides, with the same checks as its own plan.
        """
        if self.stopping.begun:
            return False
        moment = time.monotonic()
        for slot in self.slots():
            if slot.key != key:
                continue
            if slot.stopping:
                return True  # already on its way out: the slot is coming free
            if slot.busy or slot.pinned or (not slot.spare and slot.recent_until > moment):
                self.changed.notify()  # the record that said otherwise is rewritten
                return False
            return self.evict(slot, why, reason)
        return False

    # --- the memory budget -----------------------------------------------------------------------

    async def keep_memory_budget(self) -> None:
        """With ``max_memory`` set: measure this proxy's trees every few seconds (for its slot records),
        and, if this proxy keeps the install's budget, suspend idle sessions until the install fits.

        One proxy of the install keeps the budget at a time (``InstallSlots.lead``): two keepers
        reading the same records would suspend twice what is needed. A budget is not a kill
        switch: busy sessions are never suspended; an overrun nothing can relieve is logged once.
        """
        if self.budget.empty:
            return
        while not self.stopping.begun:
            due = self._measure_due.next()
            await self._measure()
            if self.install.lead(BUDGET_ROLE):
                measured, by_key = self._memory_slots()
                await self._carry_out(plan_budget(measured, self.budget), by_key, "over the memory budget")
            await self._wait_for_change(due, MEMORY_EVERY)

    async def _measure(self) -> None:
        """Measure this proxy's trees, for its slot records; what they measure is learned by the install."""
        adapters = [a for a in self.running if not a.gone]
        roots = {a.supervised.process.pid: a for a in adapters}
        trees = await anyio.to_thread.run_sync(measure_trees, list(roots))  # /proc reads block
        for root, tree in trees.items():
            adapter = roots[root]
            adapter.memory, adapter.memory_kind = tree.total, tree.method
            if tree.processes:
                self.peaks.saw(adapter.backend.name, adapter.supervised.lease.command_hash, tree.total)
        self.changed.notify()  # the slot records carry the figures

    def _came_up(self, adapter: Adapter) -> None:
        """A new adapter has answered its first request: loaded, it counts as measured from now on."""
        if adapter.starting:
            adapter.starting = False
            self._measure_due.notify()
            self.changed.notify()

    async def _make_room_in_memory(self, backend: BackendConfig, held: Held) -> None:
        """Before a start (``held``: its slot): suspend idle sessions until the new tree fits the budget,
        and wait until their trees are gone.

        Every live tree of the install counts, measured now, and every other start in progress too
        (``counted_trees``); the new tree is expected to be as large as the largest its backend has
        had. A spawn waits for the budget only while the trees it counted on end (at most
        ``acquire_timeout``): with nothing left to suspend it goes ahead, and the overrun is logged.
        """
        if self.budget.empty:
            return
        refused: set[str] = set()
        while True:
            moment = time.monotonic()
            self._others = None  # a start decides on the install as it is now
            slots = [*self.install_slots(), *self._own_starts(held, moment)]
            trees = await anyio.to_thread.run_sync(measure_trees, roots_of(slots))  # /proc reads block
            plan = plan_start(slots, trees, self.peaks, backend, self.budget, moment, frozenset(refused))
            by_key = {budget_key(slot): slot for slot in slots}
            going = await self._carry_out(plan, by_key, f"room in the memory budget for a {backend.name} start")
            await self._until_gone([by_key[key] for key in going])
            declined = {chosen.key for chosen in plan.suspend} - set(going)
            if not declined:
                return
            refused |= declined  # not idle after all: plan again without them

    def _own_starts(self, exclude: Held, moment: float) -> list[Slot]:
        """This proxy's other starts in progress (slots taken, no process yet), as the plan's slots."""
        return [
            Slot(
                key=f"starting:{held.index}",
                backend=held.backend,
                last_active=moment,
                busy=True,
                index=held.index,
                starting=True,
                command=command_of(self.config.backends[held.backend]),
            )
            for held in self._taking
            if held is not exclude and held.backend in self.config.backends
        ]

    async def _until_gone(self, slots: list[Slot]) -> None:
        """Wait until the trees of ``slots`` are gone: their slot files let go of, or held for another tree.

        A tree's wrapper holds its slot until the whole tree has ended. At most ``acquire_timeout``:
        a tree that will not end is left to its own proxy, and the start goes ahead.
        """
        waiting = [slot for slot in slots if slot.index is not None]
        with anyio.move_on_after(self.config.pool.acquire_timeout):
            while True:
                changed = self.changed.next()
                waiting = [slot for slot in waiting if self._tree_there(slot)]
                if not waiting:
                    return
                await self._wait_for_change(changed, POLL)
        log.warning(
            "memory budget: %d suspended trees still there after %gs; starting anyway",
            len(waiting),
            self.config.pool.acquire_timeout,
        )

    def _tree_there(self, slot: Slot) -> bool:
        assert slot.index is not None
        held = self.install.holder(slot.index)
        if held is None:
            return False
        record = held.record
        if record is None:
            return True  # let go of by its proxy, still held by its wrapper: the tree is ending
        same_tree = record.wrapper_pid == slot.root if slot.root is not None else record.key == slot.key
        return record.instance == (slot.instance or self.owner.instance_id) and same_tree

    async def _carry_out(self, plan: BudgetPlan, by_key: dict[str, Slot], why: str) -> list[str]:
        """Suspend what the plan chose; the keys of the trees now on their way out (those refused are not)."""
        going = []
        for chosen in plan.suspend:
            slot = by_key[chosen.key]
            if not chosen.stopping:
                log.info("pool: suspending %s (%.0f MB): %s", slot.key, chosen.memory / 1e6, why)
                if not await self._evict_anywhere(slot, why, SuspendReason.MEMORY):
                    continue
            going.append(chosen.key)
        exceeded = {overrun.backend for overrun in plan.overrun}
        for overrun in plan.overrun:
            if overrun.backend not in self._overruns:
                log.warning("memory budget: %s; serving on", overrun)
        self._overruns = exceeded
        return going

    async def suspend_idle(self) -> None:
        """The idle TTL sweeper: suspend sessions (and stop spares) idle longer than ``idle_ttl``."""
        ttl = self.config.pool.idle_ttl
        interval = max(0.05, min(ttl / 4, 30.0))
        while True:
            await anyio.sleep(interval)
            if self.stopping.begun:
                return
            for slot in expired(self.slots(), time.monotonic(), ttl):
                self.evict(slot, f"idle for {ttl:g}s", SuspendReason.IDLE_TTL)

    # --- starting ------------------------------------------------------------------------------

    async def start(self, backend: BackendConfig, *, prepare: bool, session_key: str | None = None) -> Adapter:
        """A new running adapter of ``backend`` (within the budget).

        ``prepare``: send it ``initialize`` with the gateway's own params, and
        ``authenticate`` again if the gateway did, so it can take a session.
        Its start deadline counts from now (the slot is ours): the warm process
        launched with the proxy is counted from the request that takes it.
        """
        warm: WarmStart | None = None
        if backend is self.default_backend and self._warm is not None:
            warm, self._warm = self._warm, None
            held = warm.slot
            self._reserved[backend.name] = self._reserved.get(backend.name, 0) + 1
            self._taking.append(held)
        else:
            held = await self._acquire_slot(backend)
            try:
                await self._make_room_in_memory(backend, held)
            except BaseException:
                self._release_reservation(backend, held)
                held.release()
                raise
        started = time.monotonic()
        try:
            if self.stopping.refusing:
                held.release()
                raise ProxyError.proxy_shutdown()
            deadline = anyio.current_time() + self.start_timeout(backend)
            try:
                supervised = warm.process if warm is not None else await self._launch(backend, session_key, held)
                adapter = await Adapter.attach(backend, supervised, self.config.max_line_bytes)
            except Exception as exc:
                # Whatever went wrong (a missing binary, an unusable state database), the
                # gateway gets an answer and the proxy keeps serving.
                held.release()
                if not isinstance(exc, SpawnError):
                    log.exception("starting backend %r failed", backend.name)
                    exc = SpawnError(f"cannot start backend {backend.name!r}: {exc}")
                self.journal.record(Kind.SPAWN_FAILED, backend=backend.name, session_id=session_key, detail=str(exc))
                raise ProxyError.spawn_failed(backend.name, str(exc)) from None
            except BaseException:
                held.release()  # a launched wrapper keeps it until its tree is gone
                raise
            adapter.last_active = time.monotonic()
            adapter.started_at = started
            adapter.slot = held
            adapter.on_turn_start = self._publish
            adapter.claimed = prepare
            adapter.start_deadline = deadline
            self.running.add(adapter)
            self.journal.record(Kind.ADAPTER_STARTED, backend=backend.name, label="warm" if warm else "started")
        finally:
            self._release_reservation(backend, held)
        self._attach(adapter)
        self.background.start_task(self._watch_exit, adapter)
        if prepare:
            try:
                await self._prepare(adapter)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self.stop(adapter)
                raise
            self._came_up(adapter)
        return adapter

    async def _launch(self, backend: BackendConfig, session_key: str | None, held: Held) -> SupervisedProcess:
        launch = functools.partial(
            Adapter.launch,
            backend,
            owner=self.owner,
            shutdown=self.config.shutdown,
            session_key=session_key,
            hold=held.descriptors,
        )
        if self.owner.db.writer is None:  # the lease is written on this thread's own connection
            return launch()
        # The lease is written, and waited for, before the spawn: from a worker thread, so that a
        # database another process holds locked delays this start, not the relay.
        return await anyio.to_thread.run_sync(launch)

    async def take(self, backend: BackendConfig, session_key: str | None = None) -> Adapter:
        """A prepared adapter for a new or restored session: the spare, else a new one.

        A spare has answered only ``initialize``: its first session is still part of its
        start, so its start deadline counts from now.
        """
        adapter = self.spare(backend)
        if adapter is not None:
            adapter.claimed = True
            adapter.start_deadline = anyio.current_time() + self.start_timeout(backend)
            return adapter
        return await self.start(backend, prepare=True, session_key=session_key)

    async def start_for(
        self, msg: Message, backend: BackendConfig, *, prepare: bool, on_answer: Answer | None = None
    ) -> None:
        """A gateway request no process is there for: to a new one, which is a spare once it has answered."""
        adapter = await self.start(backend, prepare=prepare)
        adapter.claimed = False
        await self.forward_first(adapter, msg, on_answer)

    async def forward_first(self, adapter: Adapter, msg: Message, on_answer: Answer | None = None) -> None:
        """Send a process the request it was started (or taken) for, and wait until its start deadline.

        That request is part of the start: an adapter that hangs in it would leave the
        gateway waiting for ever. Past the deadline the request is taken off the adapter
        (``on_answer`` never runs, a late answer is dropped), the process is stopped and
        ``start_timeout`` raised, for the caller to answer with. Answered in time, the
        process is like any other from then on.
        """
        deadline, adapter.start_deadline = adapter.start_deadline, None
        call_id = await adapter.forward(msg, on_answer)
        with anyio.CancelScope(deadline=math.inf if deadline is None else deadline):
            await adapter.answered.until(lambda: adapter.gone or call_id not in adapter.pending)
        if adapter.take_pending(call_id) is None:
            if not adapter.gone:
                self._came_up(adapter)
            return  # answered (or answered for: the relay fails what a process that exited owed)
        if adapter.gone:  # it exited before the request reached it
            raise ProxyError.adapter_exited(adapter.returncode, adapter.backend.name)
        timeout = self.start_timeout(adapter.backend)
        log.warning(
            "%s adapter pid %s did not answer %s within start_timeout (%gs): stopping it",
            adapter.backend.name,
            adapter.pid,
            msg.method,
            timeout,
            extra=ids(lease=adapter.supervised.lease.lease_id, backend=adapter.backend.name, pid=adapter.pid),
        )
        self.stop_in_background(adapter)
        self.journal.record(
            Kind.START_TIMEOUT,
            backend=adapter.backend.name,
            label=str(msg.method),
            detail=f"pid {adapter.pid} did not answer {msg.method} within {timeout:g}s",
        )
        raise ProxyError.start_timeout(str(msg.method), adapter.backend.name, timeout)

    async def _prepare(self, adapter: Adapter) -> None:
        """``initialize`` (and ``authenticate``) a fresh adapter as the gateway did its first one.

        Bounded by its start deadline and, each request, by ``resume_timeout``: the earlier
        one ends it, and the error names that one (``start_timeout``, ``restore_timeout``).
        """
        init = self.client_init if self.client_init is not UNSET else {"protocolVersion": PROTOCOL_VERSION}
        method = Method.INITIALIZE
        deadline = math.inf if adapter.start_deadline is None else adapter.start_deadline
        with anyio.CancelScope(deadline=deadline) as scope:
            answer = await self.call(adapter, method, init)
            adapter.capabilities = AgentCapabilities.from_initialize(answer.result)
            adapter.can_close_sessions = adapter.capabilities.close
            self.known_capabilities[adapter.backend.name] = adapter.capabilities
            if self.auth_params is not UNSET:
                method = Method.AUTHENTICATE
                await self.call(adapter, method, self.auth_params)
        if scope.cancelled_caught:
            timeout = self.start_timeout(adapter.backend)
            self.journal.record(
                Kind.START_TIMEOUT,
                backend=adapter.backend.name,
                label=method,
                detail=f"pid {adapter.pid} did not answer {method} within {timeout:g}s",
            )
            raise ProxyError.start_timeout(method, adapter.backend.name, timeout)

    async def call(self, adapter: Adapter, method: str, params: object) -> Message:
        """A request of the proxy's own, bounded by ``resume_timeout``; an error answer raises ``restore_failed``."""
        answer = await self.call_answer(adapter, method, params)
        if answer.error is not UNSET:
            raise ProxyError.restore_failed(method, adapter.backend.name, answer.error)
        return answer

    async def call_answer(self, adapter: Adapter, method: str, params: object) -> Message:
        """A request of the proxy's own, bounded by ``resume_timeout``; its answer, error or not."""
        timeout = self.config.pool.resume_timeout
        try:
            with anyio.fail_after(timeout):
                return await adapter.call(method, params)
        except TimeoutError:
            raise ProxyError.restore_timeout(method, adapter.backend.name, timeout) from None
        except AdapterGone as exc:
            raise ProxyError.adapter_exited(exc.returncode, adapter.backend.name, during=method) from None

    # --- what the install sees -------------------------------------------------------------------

    def protection(self, backend: BackendConfig, session: str | None = None) -> float:
        """How long a session just active is not taken (``plan.protection``: ``min_idle``, a start's
        cost, twice its gateway's turnaround)."""
        turnaround = self._turnarounds.get(session) if session is not None else None
        return protection(self.config.pool.min_idle, self._start_costs.get(backend.name), turnaround)

    def note_bound(self, adapter: Adapter) -> None:
        """A session now runs on ``adapter`` (opened or restored): learn the start cost, mark it recent."""
        moment = time.monotonic()
        adapter.last_active = moment
        if adapter.started_at is not None:
            cost = moment - adapter.started_at
            adapter.started_at = None
            old = self._start_costs.get(adapter.backend.name)
            name = adapter.backend.name
            self._start_costs[name] = cost if old is None else old + START_COST_WEIGHT * (cost - old)
        adapter.recent_until = moment + self.protection(adapter.backend, adapter.gateway_session)

    def note_turn_ended(self, adapter: Adapter) -> None:
        """A turn has ended: learn how fast the gateway came back after the one before, mark it recent."""
        moment = time.monotonic()
        session = adapter.gateway_session
        if session is not None and adapter.turnaround is not None:
            known = self._turnarounds.pop(session, 0.0)
            self._turnarounds[session] = max(adapter.turnaround, known * TURNAROUND_DECAY)
            if len(self._turnarounds) > TURNAROUNDS_KEPT:
                del self._turnarounds[next(iter(self._turnarounds))]  # the least recently active session's
        adapter.turnaround = None
        adapter.turn_ended_at = moment
        # Its last use is the turn's end, not its start: a long turn just ended is not the least recently
        # used session (the pool's order), nor idle since it began (idle_ttl).
        adapter.last_active = moment
        adapter.recent_until = moment + self.protection(adapter.backend, session)

    def record_of(self, adapter: Adapter) -> SlotRecord:
        return SlotRecord(
            instance=self.owner.instance_id,
            pid=os.getpid(),
            backend=adapter.backend.name,
            key=slot_key(adapter),
            session=adapter.gateway_session,
            adapter_pid=adapter.pid,
            since=adapter.slot_since,
            last_active=adapter.last_active,
            recent_until=adapter.recent_until,
            busy=adapter.busy,
            pinned=adapter.backend.resume == "never" and adapter.gateway_session is not None,
            stopping=adapter in self._evicting or adapter.stopping,
            memory=adapter.memory,
            memory_kind=adapter.memory_kind,
            wrapper_pid=adapter.supervised.process.pid,
            command=adapter.supervised.lease.command_hash,
            starting=adapter.starting,
        )

    def _publish(self, adapter: Adapter) -> None:
        if adapter.slot is not None:
            adapter.slot.publish(self.record_of(adapter))

    async def publish_slots(self) -> None:
        """Keep this proxy's slot records current: who holds each, for which session, how idle."""
        while True:
            changed = self.changed.next()
            for adapter in list(self.running):
                self._publish(adapter)
            if self._warm is not None:
                self._warm.slot.publish(self._warm.record(self.owner.instance_id, self.default_backend.name))
            await changed.wait()

    # --- stopping ------------------------------------------------------------------------------

    async def stop(self, adapter: Adapter, *, drain: bool = True) -> None:
        """End one adapter process and its tree, and let waiters for a slot know.

        ``drain``: keep relaying what it wrote last (briefly) before closing its stdout.
        """
        await adapter.stop(self.config.shutdown)
        if adapter.slot is not None:
            adapter.slot.release()  # its wrapper has exited: the install's slot is free now
            adapter.slot = None
        if drain:
            with anyio.move_on_after(DRAIN_TIMEOUT):
                await adapter.drained.wait()
            await adapter.close_output()
        self.running.discard(adapter)
        self.changed.notify()

    def stop_in_background(self, adapter: Adapter) -> anyio.Event:
        """Stop ``adapter`` without waiting for it; the event is set once it is gone."""
        self._evicting.add(adapter)
        self.changed.notify()  # its slot record says it is being stopped
        stopped = anyio.Event()

        async def stop() -> None:
            try:
                await self.stop(adapter)
            finally:
                self._evicting.discard(adapter)
                stopped.set()
                self.changed.notify()

        self.background.start(stop)
        return stopped

    async def stop_all(self) -> None:
        async with anyio.create_task_group() as tasks:
            for adapter in list(self.running):
                tasks.start_soon(self.stop, adapter)

    async def stop_warm(self) -> None:
        """The adapter launched at startup, if no request ever took it."""
        warm, self._warm = self._warm, None
        if warm is not None:
            shutdown = self.config.shutdown
            try:
                await warm.process.stop(stdin_grace=shutdown.stdin_grace, term_grace=shutdown.term_grace)
            finally:
                warm.slot.release()
                self.changed.notify()

    async def _watch_exit(self, adapter: Adapter) -> None:
        """When the wrapper exits, make sure its whole tree is gone and its lease settled.

        A wrapper exits on its own only after tearing its tree down; if it was
        killed instead, this is what finds the orphans (by marker) and ends them.
        """
        await adapter.wait_exit(math.inf)
        self.changed.notify()  # its slot is free: the whole tree is gone
        await self.stop(adapter)
