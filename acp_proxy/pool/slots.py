"""Admission and slots: room for one more adapter process, in the install's slots and its memory budget.

A start waits here (``SlotAdmission.acquire``) until it holds a slot file of the install and
the new tree fits the memory budget. What it does next, each time something may have changed,
is ``admission.admit``'s decision over what this driver reads: the install's slot files and
queue, this proxy's own processes (``running.Processes``), the trees' memory measured now. The
driver carries the decision out: it takes slot files, asks this proxy or another (its control
socket, ``Peers``) to suspend an idle session, measures, and sleeps.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Final, Protocol

import anyio
import msgspec

from acp_proxy.concurrency import Changes, Stopping
from acp_proxy.config import BackendConfig, Config
from acp_proxy.journal import Journal, Kind, SuspendReason
from acp_proxy.pool.admission import (
    POLL,
    REFUSED_FOR,
    Ask,
    GiveUp,
    Granted,
    Look,
    Measure,
    Room,
    Rule,
    Start,
    Take,
    Waiting,
    admit,
)
from acp_proxy.pool.budget import Overruns, Peaks, budget_key, plan_start, roots_of
from acp_proxy.pool.install import Held, InstallSlots, Ticket
from acp_proxy.pool.learned import command_of
from acp_proxy.pool.memory import MemoryBudget, measure_trees
from acp_proxy.pool.plan import Slot
from acp_proxy.pool.publishing import slot_of_record, starting_record, starting_slot
from acp_proxy.protocol.errors import ProxyError
from acp_proxy.timings import Timing, Timings

log = logging.getLogger("acp_proxy.lifecycle")

SNAPSHOT_FOR: Final = 0.01
"""How long one reading of the other proxies' slot files serves every plan made meanwhile."""
ALIVE_FOR: Final = 1.0
"""How long a proxy found alive (or gone) is taken to be so before its lock is looked at again."""


class Peers(Protocol):
    """The other proxies of the install, as the pool needs them."""

    def alive(self, instance_id: str) -> bool: ...

    async def evict(self, instance_id: str, key: str, why: str, reason: SuspendReason) -> bool:
        """Ask that proxy to suspend its session (or stop its spare) ``key`` if idle; False if it refused."""
        ...


class Local(Protocol):
    """This proxy's own processes, as the admission sees them (``running.Processes``)."""

    def slots(self) -> list[Slot]: ...

    def held(self) -> list[Held]: ...

    def quiet_at(self, moment: float) -> float: ...

    def evict(self, slot: Slot, why: str, reason: SuspendReason) -> bool: ...


class _Waiter(msgspec.Struct, eq=False):
    """A request waiting for a process slot."""

    arrived: float
    moved: anyio.Event = msgspec.field(default_factory=anyio.Event)
    """Set when the line moves up to it (while it is too far back to do anything)."""


class SlotAdmission:
    """Who may start a process now, across the install: the slots, the line of waiters, the memory budget."""

    def __init__(
        self,
        config: Config,
        install: InstallSlots,
        local: Local,
        changed: Changes,
        stopping: Stopping,
        peaks: Peaks,
        *,
        journal: Journal,
        timings: Timings,
        overruns: Overruns,
        peers: Peers | None = None,
    ) -> None:
        self.config = config
        self.install = install
        self.local = local
        self.changed = changed
        self.stopping = stopping
        self.peaks = peaks
        self.budget = MemoryBudget.of(config)
        self.journal = journal
        self.timings = timings
        self.peers = peers
        self._reserved: dict[str, int] = {}
        self._taking: list[Held] = []
        """Install slots taken for starts that are not running yet."""
        self._lines: dict[str, collections.deque[_Waiter]] = {}
        """Per backend, who waits for a process slot, oldest first."""
        self._others: tuple[float, list[Slot]] | None = None
        """The other proxies' slots as last read, and when."""
        self._instances_alive: dict[str, tuple[float, bool]] = {}
        self._install_ahead: dict[str, int] = {}
        """Per backend, how many waiters of other proxies stand before this proxy's first."""
        self.overruns = overruns

    # --- the install as the plan sees it ------------------------------------------------------------

    def install_slots(self, *, fresh: bool = False) -> list[Slot]:
        """The plan's snapshot for the whole install: ours as we know them, the others' from their slot files
        (``fresh``: read now, not the reading of moments ago that every waiter's plan shares)."""
        if fresh:
            self._others = None
        return [*self.local.slots(), *self._others_slots(time.monotonic())]

    def tree_there(self, slot: Slot) -> bool:
        """Whether the tree that held ``slot`` still holds its slot file (its wrapper lets go once it is gone)."""
        if slot.index is None:
            return False
        held = self.install.holder(slot.index)
        if held is None:
            return False
        record = held.record
        if record is None:
            return True  # let go of by its proxy, still held by its wrapper: the tree is ending
        same_tree = record.wrapper_pid == slot.root if slot.root is not None else record.key == slot.key
        return record.instance == (slot.instance or self.install.instance_id) and same_tree

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

    async def until_gone_elsewhere(self, session_id: str, timeout: float) -> bool:
        """Until no other proxy of the install holds a slot for ``session_id``: the process another proxy served it
        on (suspended, or handed over, just now) is gone, before one starts here. False past ``timeout``."""
        with anyio.move_on_after(timeout):
            while any(
                held.record is not None and held.record.session == session_id
                for held in self.install.holders(skip=self._own_install_indexes())
            ):
                await anyio.sleep(POLL)  # another proxy's tree: its slot file is all there is to watch
            return True
        return False

    def _alive(self, instance_id: str, moment: float) -> bool:
        known = self._instances_alive.get(instance_id)
        if known is None or moment - known[0] >= ALIVE_FOR:
            known = (moment, self.peers.alive(instance_id) if self.peers is not None else True)
            self._instances_alive[instance_id] = known
        return known[1]

    def _own_install_indexes(self) -> set[int]:
        held = [*self.local.held(), *self._taking]
        return {index for h in held for scope, index in h.scope_indexes if scope == "all"}

    def backend_cap(self, backend: BackendConfig) -> int:
        """Live processes ``backend`` may have: its own ``max_live``, else the install's (``Config.resolved``)."""
        return int(self.config.resolved(backend, "max_live"))

    def _depth(self, backend: BackendConfig) -> int:
        """How many waiters of one line plan at once: the most slots it could take."""
        return max(1, min(self.backend_cap(backend), self.config.pool.max_live))

    def _teardown_bound(self) -> float:
        """How long a suspended session's tree may take to end: its close, then stdin EOF, then SIGTERM."""
        shutdown = self.config.shutdown
        return shutdown.close_timeout + shutdown.stdin_grace + shutdown.term_grace + 1.0

    # --- admission ----------------------------------------------------------------------------------

    def reserve(self, backend: BackendConfig, held: Held) -> None:
        """Count ``held`` as a start in progress of ``backend`` (the process launched with the proxy)."""
        self._reserved[backend.name] = self._reserved.get(backend.name, 0) + 1
        self._taking.append(held)

    def release(self, backend: BackendConfig, held: Held) -> None:
        """The start ``held`` was for runs, or failed: it is no longer counted as in progress."""
        self._reserved[backend.name] -= 1
        self._taking.remove(held)
        self.changed.notify()

    async def acquire(self, backend: BackendConfig) -> Held:
        """Room for one more process of ``backend``: a slot file of the install, and room in the memory budget.

        Waits at most ``acquire_timeout`` for the slot; then ``pool_exhausted``. The caller owns the
        slot, and must ``release`` it once the process runs (or failed). Waiters for one backend are
        served first come, first served, across the install: only the first in line takes a slot
        file, so a slot freed for it is not taken by a later arrival, and none waits out its timeout
        behind newer ones. The next ones in line may each have a session suspended for the slot they
        will need (side by side, never more than there are waiters); the rest sleep until the line
        moves up to them. Within this proxy the first waiter stands in the install's queue under its
        own arrival time. Once it holds a slot it leaves the line, and (with a memory budget) it waits
        for room: idle trees suspended until the new one fits, as large as its backend's largest.
        """
        arrived = time.monotonic()
        line = self._lines.setdefault(backend.name, collections.deque())
        waiter = _Waiter(arrived)
        line.append(waiter)
        waiting = Waiting(
            backend=backend.name,
            backend_cap=self.backend_cap(backend),
            global_cap=self.config.pool.max_live,
            now=arrived,
            deadline=arrived + self.config.pool.acquire_timeout,
            position=0,
            depth=self._depth(backend),
            reserved=self._reserved,
            budget=not self.budget.empty,
        )
        place: Ticket | None = None
        in_line = True
        waited = waiting_logged = False
        outcome = "abandoned"
        held: Held | None = None
        try:
            while True:
                changed = self.changed.next()
                moment = time.monotonic()
                if in_line:
                    position = line.index(waiter)
                    if position == 0:
                        if place is None and self.install.waiting(backend.name):
                            place = self.install.enqueue(backend.name, waiter.arrived)
                        self._install_ahead[backend.name] = (
                            self.install.ahead_of(place, backend.name) if place is not None else 0
                        )
                    waiting = msgspec.structs.replace(
                        waiting,
                        now=moment,
                        position=position,
                        ahead=position + self._install_ahead.get(backend.name, 0),
                        granted=[g for g in waiting.granted if g.until > moment and self.tree_there(g.slot)],
                        refused={key: until for key, until in waiting.refused.items() if until > moment},
                        quiet_at=self.local.quiet_at(moment),
                        refusing=self.stopping.refusing,
                        slots=None,
                        tried_take=False,
                    )
                else:
                    assert waiting.room is not None
                    going = [slot for slot in waiting.room.going if self.tree_there(slot)]
                    room = msgspec.structs.replace(waiting.room, going=going)
                    waiting = msgspec.structs.replace(waiting, now=moment, refusing=self.stopping.refusing, room=room)
                step = admit(waiting)
                while isinstance(step, Take | Look | Measure):  # steps that need no wait: then it decides again
                    if isinstance(step, Take):
                        held = self._take_install_slot(backend)
                        if held is None:
                            waiting = msgspec.structs.replace(waiting, tried_take=True)
                        else:
                            outcome = "admitted"
                            self._leave_line(backend, line, waiter, place, waited, outcome)
                            in_line, place = False, None
                            waiting = msgspec.structs.replace(waiting, room=Room())
                    elif isinstance(step, Look):
                        waiting = msgspec.structs.replace(waiting, slots=self.install_slots())
                    else:
                        assert held is not None
                        assert waiting.room is not None
                        room = await self._measure(backend, held, waiting.room)
                        waiting = msgspec.structs.replace(waiting, now=time.monotonic(), room=room)
                    step = admit(waiting)
                if isinstance(step, Start):
                    assert held is not None
                    if step.rule is Rule.OVERDUE:
                        log.warning(
                            "memory budget: %d suspended trees still there after %gs; starting anyway",
                            step.overdue,
                            self.config.pool.acquire_timeout,
                        )
                    return held
                if isinstance(step, GiveUp):
                    if step.reason == "shutdown":
                        raise ProxyError.proxy_shutdown()
                    outcome = "exhausted"
                    break
                waited = True
                if isinstance(step, Ask):
                    waiting = await self._ask(step, waiting, changed)
                    continue
                if step.line:
                    waiter.moved = anyio.Event()
                    await self.wait_for_change(waiter.moved, step.until - time.monotonic())
                    continue
                if in_line and waiting.position == 0:
                    if not waiting_logged and step.rule in (Rule.FREEING, Rule.RECENT, Rule.BUSY):
                        log.info("pool full for backend %s: %s; waiting", backend.name, step.reason)
                        waiting_logged = True
                    if place is None:
                        place = self.install.enqueue(backend.name, waiter.arrived)
                await self.wait_for_change(changed, step.until - time.monotonic())
        except BaseException:
            if held is not None:
                self.release(backend, held)
                held.release()
            raise
        finally:
            if in_line:
                self._leave_line(backend, line, waiter, place, waited, outcome)
        raise ProxyError.pool_exhausted(backend.name, self.backend_cap(backend))

    def _leave_line(
        self,
        backend: BackendConfig,
        line: collections.deque[_Waiter],
        waiter: _Waiter,
        place: Ticket | None,
        waited: bool,
        outcome: str,
    ) -> None:
        """The waiter has its slot, gave up or was cancelled: the next in line plans now."""
        seconds = time.monotonic() - waiter.arrived
        if outcome != "abandoned":
            self.timings.observe(Timing.SLOT_WAIT, backend.name, seconds, outcome)
        if waited:
            self.journal.record(Kind.POOL_WAIT, backend=backend.name, label=outcome, seconds=seconds)
        if place is not None:
            place.leave()
        position = line.index(waiter)
        line.remove(waiter)
        depth = self._depth(backend)
        if position < depth <= len(line):
            line[depth - 1].moved.set()  # the line moved up to it
        if not line:
            del self._lines[backend.name]
            self._install_ahead.pop(backend.name, None)
        self.changed.notify()

    async def _ask(self, step: Ask, waiting: Waiting, changed: anyio.Event) -> Waiting:
        """Carry out an ``Ask``, and what its answer changes in the waiter's view."""
        if waiting.room is not None:  # for the memory budget
            slot, room, key = step.slot, waiting.room, budget_key(step.slot)
            why = f"room in the memory budget for a {waiting.backend} start"
            counted = next((chosen.memory for chosen in room.plan.suspend if chosen.key == key), 0) if room.plan else 0
            log.info("pool: suspending %s (%.0f MB): %s", slot.key, counted / 1e6, why)
            granted = await self.evict_anywhere(slot, why, SuspendReason.MEMORY)
            going = [*room.going, slot] if granted else room.going
            return msgspec.structs.replace(
                waiting, room=msgspec.structs.replace(room, asked={**room.asked, key: granted}, going=going)
            )
        if await self.evict_anywhere(step.slot):
            # Its slot comes free once its tree is gone: a wait bounded by the teardown's own graces,
            # not by acquire_timeout (that is for busy sessions).
            granted_slot = Granted(step.slot, time.monotonic() + self._teardown_bound())
            waiting = msgspec.structs.replace(waiting, granted=[*waiting.granted, granted_slot])
            await self.wait_for_change(changed, POLL)
            return waiting
        # Not idle after all (its record was stale, or its session is mid-change): the next candidate
        # is planned for; this one not again for a while.
        refused = {**waiting.refused, step.slot.key: time.monotonic() + REFUSED_FOR}
        await anyio.lowlevel.checkpoint()
        return msgspec.structs.replace(waiting, refused=refused)

    async def _measure(self, backend: BackendConfig, held: Held, room: Room) -> Room:
        """The install's trees measured now, and the plan that makes room for a new tree of ``backend``."""
        refused = room.refused | {key for key, granted in room.asked.items() if not granted}
        moment = time.monotonic()
        # A start decides on the install as it is now, this proxy's other starts in progress too.
        slots = [*self.install_slots(fresh=True), *self._own_starts(held, moment)]
        trees = await anyio.to_thread.run_sync(measure_trees, roots_of(slots))  # /proc reads block
        plan = plan_start(slots, trees, self.peaks, backend, self.budget, moment, refused)
        self.overruns.note(plan)
        by_key = {budget_key(slot): slot for slot in slots}
        going = [by_key[chosen.key] for chosen in plan.suspend if chosen.stopping]
        until = time.monotonic() + self.config.pool.acquire_timeout
        return Room(plan=plan, slots=by_key, going=going, until=until, refused=refused)

    def _own_starts(self, exclude: Held, moment: float) -> list[Slot]:
        """This proxy's other starts in progress (slots taken, no process yet), as the plan's slots."""
        backends = self.config.backends
        return [
            starting_slot(held.index, held.backend, moment, command_of(backends[held.backend]))
            for held in self._taking
            if held is not exclude and held.backend in backends
        ]

    def _take_install_slot(self, backend: BackendConfig) -> Held | None:
        held = self.install.try_take(backend.name, global_cap=self.config.pool.max_live, backend_cap=backend.max_live)
        if held is not None:
            self.reserve(backend, held)
            # Described at once: other proxies' plans count it for its backend, their starts count it
            # for the memory budget, and a waiter that was granted this slot's last tree sees that
            # tree gone (``tree_there``) rather than a file being let go of.
            held.publish(starting_record(self.install.instance_id, backend, held))
        return held

    @staticmethod
    async def wait_for_change(changed: anyio.Event, timeout: float) -> None:
        """Until ``changed`` is set, or ``timeout`` seconds have passed (the pool's every wait: a slot, the budget)."""
        with anyio.move_on_after(timeout):
            await changed.wait()

    async def evict_anywhere(
        self, slot: Slot, why: str = "least recently used of the install", reason: SuspendReason = SuspendReason.POOL
    ) -> bool:
        """Suspend what the plan chose, in this proxy or (through its control socket) in another."""
        if slot.instance is None:
            return self.local.evict(slot, why, reason)
        if self.peers is None:
            return False
        log.info("pool: asking proxy %s to suspend %s (%s)", slot.instance, slot.key, why)
        self._others = None  # its record is about to change: the next plan reads it again
        asked = time.monotonic()
        evicted = await self.peers.evict(slot.instance, slot.key, why, reason)
        answer = "yes" if evicted else "no"
        self.timings.observe(Timing.EVICTION, slot.backend, time.monotonic() - asked, answer)
        self.journal.record(Kind.EVICT_ASKED, backend=slot.backend, label=answer)
        return evicted
