"""The adapter processes this proxy runs: their set, their slot records, and their stopping.

What runs is read by the admission (``pool.slots``: this proxy's slots in the plan's snapshot,
the slot files its processes hold) and by the relay and the sessions; a process the plan chose
is suspended or stopped here (``evict``). Starting one is the pool's (``pool.processes``), which
adds it here once it runs. The call that goes upward is handed in by the composition root:
``suspend`` (the sessions' intent, for the idle session the plan chose).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from typing import Final

import anyio
import msgspec

from acp_proxy.concurrency import Background, Changes, Stopping
from acp_proxy.config import BackendConfig, Config
from acp_proxy.journal import SuspendReason
from acp_proxy.ownership.supervised import SupervisedProcess
from acp_proxy.pool.adapter import Adapter
from acp_proxy.pool.install import Held, SlotRecord
from acp_proxy.pool.plan import Slot
from acp_proxy.pool.publishing import WARM_KEY, record_of, slot_key, slot_of_adapter
from acp_proxy.pool.recency import sweep_idle
from acp_proxy.pool.tenancy import busy

log = logging.getLogger("acp_proxy.lifecycle")

DRAIN_TIMEOUT: Final = 1.0
"""How long to keep relaying an exited adapter's last output before closing its stdout."""

Suspend = Callable[[str, str, SuspendReason], bool]
"""Suspend the session of this id if it is idle (why, for the log; the reason, for the journal); False if not.
Synchronous, so that the plan's choice and the suspension happen in one step."""


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


class Processes:
    """Every adapter process this proxy started and has not yet stopped (and the one launched with it)."""

    def __init__(
        self,
        config: Config,
        instance_id: str,
        background: Background,
        stopping: Stopping,
        changed: Changes,
        *,
        default_backend: BackendConfig,
        warm: WarmStart | None,
        suspend: Suspend,
    ) -> None:
        self.config = config
        self.instance_id = instance_id
        self.background = background
        self.stopping = stopping
        self.changed = changed
        """Notified when a slot may have freed up (a process ended, a session went idle)."""
        self.default_backend = default_backend
        self._warm = warm
        self._suspend = suspend
        self.running: set[Adapter] = set()
        """Every adapter process started and not yet stopped."""
        self._evicting: set[Adapter] = set()

    # --- what runs ------------------------------------------------------------------------------

    def spare(self, backend: BackendConfig) -> Adapter | None:
        """A running process of ``backend`` that serves no session and is not taken."""
        for adapter in self.running:
            if (
                adapter.backend.name == backend.name
                and adapter.gateway_session is None
                and not adapter.tenancy.claimed
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

    def being_stopped(self, adapter: Adapter) -> bool:
        return adapter in self._evicting

    def slots(self) -> list[Slot]:
        """This proxy's part of the plan's snapshot."""
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

    def held(self) -> list[Held]:
        """The install slots its processes hold."""
        held = [a.usage.slot for a in self.running if a.usage.slot is not None]
        if self._warm is not None:
            held.append(self._warm.slot)
        return held

    def quiet_at(self, moment: float) -> float:
        """When the first session busy only with background work counts as idle again (no event
        marks that moment: a waiter for a slot plans again then)."""
        return min((a.usage.quiet_at for a in self.running if a.usage.quiet_at > moment), default=math.inf)

    def take_warm(self, backend: BackendConfig) -> WarmStart | None:
        """The process launched with the proxy, for the first start of the default backend."""
        if backend is not self.default_backend or self._warm is None:
            return None
        warm, self._warm = self._warm, None
        return warm

    def add(self, adapter: Adapter) -> None:
        """A process now runs: counted, and described in its slot record."""
        self.running.add(adapter)

    def watch(self, adapter: Adapter) -> None:
        """Settle its tree once its wrapper exits (``watch_exit``), in the background."""
        self.background.start_task(self.watch_exit, adapter)

    # --- what the install sees -------------------------------------------------------------------

    def publish(self, adapter: Adapter) -> None:
        if adapter.usage.slot is not None:
            stopping = adapter in self._evicting or adapter.stopping
            adapter.usage.slot.publish(record_of(adapter, self.instance_id, stopping=stopping))

    async def publish_slots(self) -> None:
        """Keep this proxy's slot records current: who holds each, for which session, how idle."""
        while True:
            changed = self.changed.next()
            for adapter in list(self.running):
                self.publish(adapter)
            if self._warm is not None:
                self._warm.slot.publish(self._warm.record(self.instance_id, self.default_backend.name))
            await changed.wait()

    async def suspend_idle(self) -> None:
        """Suspend sessions (and stop spares) idle longer than ``idle_ttl`` (``recency.sweep_idle``)."""
        await sweep_idle(self.config.pool.idle_ttl, self.slots, self.evict, self.stopping)

    # --- suspending and stopping ------------------------------------------------------------------

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
                if busy(adapter):
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

    async def watch_exit(self, adapter: Adapter) -> None:
        """When the wrapper exits, make sure its whole tree is gone and its lease settled.

        A wrapper exits on its own only after tearing its tree down; if it was
        killed instead, this is what finds the orphans (by marker) and ends them.
        """
        await adapter.wait_exit(math.inf)
        self.changed.notify()  # its slot is free: the whole tree is gone
        await self.stop(adapter)
