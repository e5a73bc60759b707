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
import time
from collections.abc import Callable
from typing import Final, Protocol

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectSendStream
from msgspec import UNSET, Raw, UnsetType

from acp_proxy.concurrency import Background, Changes, Stopping
from acp_proxy.config import BackendConfig, Config
from acp_proxy.journal import Kind, SuspendReason
from acp_proxy.logs import ids
from acp_proxy.ownership.owner import Owner
from acp_proxy.ownership.supervised import SupervisedProcess
from acp_proxy.pool.adapter import Adapter, AdapterGone, SpawnError
from acp_proxy.pool.admission import POLL, REFUSED_FOR, Ask, GiveUp, Granted, Look, Rule, Take, Waiting, admit
from acp_proxy.pool.budget import MemoryKeeper, Peaks, fits_at_once
from acp_proxy.pool.install import Held, InstallSlots, SlotRecord, Ticket
from acp_proxy.pool.learned import Learned
from acp_proxy.pool.memory import MemoryBudget
from acp_proxy.pool.plan import Slot
from acp_proxy.pool.publishing import WARM_KEY, record_of, slot_key, slot_of_adapter, slot_of_record, starting_record
from acp_proxy.pool.recency import Recency, sweep_idle
from acp_proxy.protocol.acp import PROTOCOL_VERSION, AgentCapabilities
from acp_proxy.protocol.errors import ProxyError
from acp_proxy.protocol.jsonrpc import Message
from acp_proxy.protocol.methods import Method
from acp_proxy.timings import Timing
from acp_proxy.trace import Trace

log = logging.getLogger("acp_proxy.lifecycle")

DRAIN_TIMEOUT: Final = 1.0
"""How long to keep relaying an exited adapter's last output before closing its stdout."""
SNAPSHOT_FOR: Final = 0.01
"""How long one reading of the other proxies' slot files serves every plan made meanwhile."""
ALIVE_FOR: Final = 1.0
"""How long a proxy found alive (or gone) is taken to be so before its lock is looked at again."""

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
        if not fits_at_once(MemoryBudget.of(config), owner, backend, install, slot):
            slot.release()
            return None
        process = Adapter.launch(backend, owner=owner, shutdown=config.shutdown, hold=slot.descriptors)
    except BaseException:
        slot.release()
        raise
    warm = WarmStart(process, slot)
    slot.publish(warm.record(owner.instance_id, backend.name))
    return warm


class _Waiter(msgspec.Struct, eq=False):
    """A request waiting for a process slot."""

    arrived: float
    moved: anyio.Event = msgspec.field(default_factory=anyio.Event)
    """Set when the line moves up to it (while it is too far back to do anything)."""


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
        started: MemoryObjectSendStream[Adapter],
        peers: Peers | None = None,
        trace: Trace | None = None,
    ) -> None:
        self.config = config
        self.owner = owner
        self.background = background
        self.stopping = stopping
        self.default_backend = default_backend
        self._warm = warm
        self._suspend = suspend
        self._started = started
        """Every adapter it starts goes here as it starts, to the relay that reads its output."""
        self.peers = peers
        self.install = InstallSlots(owner.db.state_dir, owner.instance_id)
        self.journal = owner.journal
        self.timings = owner.timings
        self.trace = trace
        """Where every wire message is recorded (``--trace``), handed to each adapter it starts."""
        self.peaks = Peaks(Learned(owner.db))
        self.memory = MemoryKeeper(self, self.peaks)
        """The memory budget (``[pool] max_memory``): measuring, keeping it, making room before a start."""
        self.recency = Recency(config.pool.min_idle)
        """Start costs and gateway turnarounds learned, and how long a session just active is not taken."""
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
        return max(candidates, key=lambda a: a.usage.last_active, default=None)

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
            slots.append(slot_of_adapter(adapter, stopping=stopping))
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

    def install_slots(self, *, fresh: bool = False) -> list[Slot]:
        """The plan's snapshot for the whole install: ours as we know them, the others' from their slot files
        (``fresh``: read now, not the reading of moments ago that every waiter's plan shares)."""
        if fresh:
            self._others = None
        return [*self.slots(), *self._others_slots(time.monotonic())]

    def starts_in_progress(self) -> list[Held]:
        """The install slots this proxy took for starts that are not running yet."""
        return list(self._taking)

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
        return record.instance == (slot.instance or self.owner.instance_id) and same_tree

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

    def _own_install_indexes(self) -> set[int]:
        held = [a.usage.slot for a in self.running if a.usage.slot is not None]
        if self._warm is not None:
            held.append(self._warm.slot)
        held.extend(self._taking)
        return {index for h in held for scope, index in h.scope_indexes if scope == "all"}

    def backend_cap(self, backend: BackendConfig) -> int:
        """Live processes ``backend`` may have: its own ``max_live``, else the install's (``Config.resolved``)."""
        return int(self.config.resolved(backend, "max_live"))

    def start_timeout(self, backend: BackendConfig) -> float:
        """``start_timeout`` for ``backend``, the backend's own first; ``inf`` when it is 0 (no limit)."""
        return float(self.config.resolved(backend, "start_timeout")) or math.inf

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
                moment = time.monotonic()
                granted = [g for g in granted if g.until > moment and self.tree_there(g.slot)]
                waiting = Waiting(
                    backend=backend.name,
                    backend_cap=self.backend_cap(backend),
                    global_cap=self.config.pool.max_live,
                    now=moment,
                    deadline=deadline,
                    position=position,
                    depth=depth,
                    ahead=position + self._install_ahead.get(backend.name, 0),
                    reserved=self._reserved,
                    refused=refused,
                    granted=granted,
                    quiet_at=self._first_quiet_at(moment),
                    refusing=self.stopping.refusing,
                )
                step = admit(waiting)
                while isinstance(step, Take | Look):  # steps that need no wait: then it decides again
                    if isinstance(step, Take):
                        held = self._take_install_slot(backend)
                        if held is not None:
                            outcome = "admitted"
                            return held
                        waiting = msgspec.structs.replace(waiting, tried_take=True)
                    else:
                        waiting = msgspec.structs.replace(waiting, slots=self.install_slots())
                    step = admit(waiting)
                if isinstance(step, GiveUp):
                    if step.reason == "shutdown":
                        raise ProxyError.proxy_shutdown()
                    outcome = "exhausted"
                    break
                waited = True
                if isinstance(step, Ask):
                    if await self.evict_anywhere(step.slot):
                        # Its slot comes free once its tree is gone: a wait bounded by the teardown's
                        # own graces, not by acquire_timeout (that is for busy sessions).
                        granted.append(Granted(step.slot, time.monotonic() + self._teardown_bound()))
                        await self.wait_for_change(changed, POLL)
                    else:
                        # Not idle after all (its record was stale, or its session is mid-change):
                        # the next candidate is planned for; this one not again for a while.
                        refused[step.slot.key] = time.monotonic() + REFUSED_FOR
                        await anyio.lowlevel.checkpoint()
                    continue
                if step.line:
                    waiter.moved = anyio.Event()
                    await self.wait_for_change(waiter.moved, step.until - time.monotonic())
                    continue
                if position == 0:
                    if not waiting_logged and step.rule in (Rule.FREEING, Rule.RECENT, Rule.BUSY):
                        log.info("pool full for backend %s: %s; waiting", backend.name, step.reason)
                        waiting_logged = True
                    if place is None:
                        place = self.install.enqueue(backend.name, waiter.arrived)
                await self.wait_for_change(changed, step.until - time.monotonic())
        finally:
            seconds = time.monotonic() - waiter.arrived
            if outcome != "abandoned":
                self.timings.observe(Timing.SLOT_WAIT, backend.name, seconds, outcome)
            if waited:
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
            # Described at once: other proxies' plans count it for its backend, their starts count it
            # for the memory budget, and a waiter that was granted this slot's last tree sees that
            # tree gone (``tree_there``) rather than a file being let go of.
            held.publish(starting_record(self.owner.instance_id, backend, held))
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
            return self.evict(slot, why, reason)
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

    def _first_quiet_at(self, moment: float) -> float:
        """When the first session busy only with background work counts as idle again (no event
        marks that moment: a waiter for a slot plans again then)."""
        return min((a.usage.quiet_at for a in self.running if a.usage.quiet_at > moment), default=math.inf)

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
                await self.memory.make_room(backend, held)
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
            adapter.usage.last_active = time.monotonic()
            adapter.usage.started_at = started
            adapter.usage.slot = held
            adapter.on_turn_start = self._publish
            adapter.claimed = prepare
            adapter.usage.start_deadline = deadline
            self.running.add(adapter)
            self.journal.record(Kind.ADAPTER_STARTED, backend=backend.name, label="warm" if warm else "started")
        finally:
            self._release_reservation(backend, held)
        adapter.trace = self.trace
        self._started.send_nowait(adapter)
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
            memory_limit=self.config.session_memory(backend.name)[1],
        )
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
            if adapter.first_answered is not None:
                await adapter.first_answered.wait()  # a gateway that sent initialize and a session request together
            if not adapter.gone and adapter not in self._evicting:  # else its first request failed: stopped
                adapter.usage.start_deadline = anyio.current_time() + self.start_timeout(backend)
                return adapter
        return await self.start(backend, prepare=True, session_key=session_key)

    async def start_for(
        self, msg: Message, backend: BackendConfig, *, prepare: bool, on_answer: Answer | None = None
    ) -> None:
        """A gateway request no process is there for: to a new one, which is a spare once it has answered."""
        adapter = await self.start(backend, prepare=prepare)
        adapter.claimed = False
        adapter.first_answered = anyio.Event()
        try:
            await self.forward_first(adapter, msg, on_answer)
        finally:
            adapter.first_answered.set()

    async def forward_first(self, adapter: Adapter, msg: Message, on_answer: Answer | None = None) -> None:
        """Send a process the request it was started (or taken) for, and wait until its start deadline.

        That request is part of the start: an adapter that hangs in it would leave the
        gateway waiting for ever. Past the deadline the request is taken off the adapter
        (``on_answer`` never runs, a late answer is dropped), the process is stopped and
        ``start_timeout`` raised, for the caller to answer with. Answered in time, the
        process is like any other from then on.
        """
        deadline, adapter.usage.start_deadline = adapter.usage.start_deadline, None
        call_id = await adapter.forward(msg, on_answer)
        with anyio.CancelScope(deadline=math.inf if deadline is None else deadline):
            await adapter.until_call_answered(call_id)
        if adapter.take_pending(call_id) is None:
            if not adapter.gone:
                self._came_up(adapter)
            return  # answered (or answered for: the relay fails what a process that exited owed)
        if adapter.gone:  # it exited before the request reached it
            raise self.gone_error(adapter)
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
        deadline = math.inf if adapter.usage.start_deadline is None else adapter.usage.start_deadline
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
        except AdapterGone:
            raise self.gone_error(adapter, during=method) from None

    def gone_error(self, adapter: Adapter, *, during: str | None = None) -> ProxyError:
        """The answer owed for a request whose process has exited: ``proxy_shutdown`` when the shutdown
        ended it (the gateway left; what was in flight ends with the proxy), else ``adapter_exited``."""
        if self.stopping.begun and adapter.stopping:
            return ProxyError.proxy_shutdown(exitStatus=adapter.returncode, backend=adapter.backend.name)
        return ProxyError.adapter_exited(adapter.returncode, adapter.backend.name, during=during)

    def _came_up(self, adapter: Adapter) -> None:
        """A new adapter has answered its first request: loaded, it counts as measured from now on."""
        if adapter.usage.starting:
            adapter.usage.starting = False
            if adapter.usage.started_at is not None:
                self.timings.observe(Timing.START, adapter.backend.name, time.monotonic() - adapter.usage.started_at)
            self.memory.measure_soon()
            self.changed.notify()

    # --- what the install sees -------------------------------------------------------------------

    async def suspend_idle(self) -> None:
        """Suspend sessions (and stop spares) idle longer than ``idle_ttl`` (``recency.sweep_idle``)."""
        await sweep_idle(self.config.pool.idle_ttl, self.slots, self.evict, self.stopping)

    def _publish(self, adapter: Adapter) -> None:
        if adapter.usage.slot is not None:
            stopping = adapter in self._evicting or adapter.stopping
            adapter.usage.slot.publish(record_of(adapter, self.owner.instance_id, stopping=stopping))

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
        if adapter.usage.slot is not None:
            adapter.usage.slot.release()  # its wrapper has exited: the install's slot is free now
            adapter.usage.slot = None
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
