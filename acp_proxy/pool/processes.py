"""The process pool: the adapter processes this proxy runs, started within the budget and stopped by lease.

Who may start, and whom to suspend for it, is decided by the pure plan
(``pool.plan``) over a snapshot of the live slots; here the decision meets
processes. Two calls go upward, both handed in by the composition root:
``suspend`` (the sessions' intent, for the idle session the plan chose) and
``attach`` (the relay, which reads a new adapter's output).
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable
from typing import Final

import anyio
from msgspec import UNSET, Raw, UnsetType

from acp_proxy.concurrency import Background, Changes, Stopping
from acp_proxy.config import BackendConfig, Config
from acp_proxy.logs import ids
from acp_proxy.ownership.owner import Owner
from acp_proxy.ownership.supervised import SupervisedProcess
from acp_proxy.pool.adapter import Adapter, AdapterGone, SpawnError
from acp_proxy.pool.plan import Admit, Slot, expired, plan_acquire
from acp_proxy.protocol.acp import PROTOCOL_VERSION, AgentCapabilities
from acp_proxy.protocol.errors import ProxyError
from acp_proxy.protocol.jsonrpc import Message
from acp_proxy.protocol.methods import Method

log = logging.getLogger("acp_proxy.lifecycle")

DRAIN_TIMEOUT: Final = 1.0
"""How long to keep relaying an exited adapter's last output before closing its stdout."""

Answer = Callable[[Message], Message | None]
"""Called with the adapter's answer to a gateway request before it is forwarded (``PendingCall.on_answer``)."""

Suspend = Callable[[str, str], bool]
"""Suspend the session of this id if it is idle (the reason for the log); False if it is not.
Synchronous, so that the plan's choice and the suspension happen in one step."""


def slot_key(adapter: Adapter) -> str:
    return adapter.gateway_session or f"spare:{adapter.backend.name}:{adapter.pid}"


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
        warm: SupervisedProcess | None,
        suspend: Suspend,
        attach: Callable[[Adapter], None],
    ) -> None:
        self.config = config
        self.owner = owner
        self.background = background
        self.stopping = stopping
        self.default_backend = default_backend
        self._warm = warm
        self._suspend = suspend
        self._attach = attach
        self.running: set[Adapter] = set()
        """Every adapter process started and not yet stopped."""
        self.changed = Changes()
        """Notified when a slot may have freed up (a process ended, a session went idle)."""
        self._reserved: dict[str, int] = {}
        self._evicting: set[Adapter] = set()
        self._slot_queues: dict[str, collections.deque[object]] = {}
        """Per backend, who waits for a process slot, oldest first."""
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
                    busy=adapter.busy or stopping,  # being stopped: it still counts, but cannot be chosen
                    spare=adapter.gateway_session is None,
                    pinned=adapter.backend.resume == "never" and adapter.gateway_session is not None,
                )
            )
        return slots

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

    async def _acquire_slot(self, backend: BackendConfig) -> None:
        """Reserve room for one more process of ``backend``, suspending an idle session if needed.

        Waits at most ``acquire_timeout``; then ``pool_exhausted``. The caller must call
        ``_release_reservation`` once the process runs (or failed). Waiters for one backend
        are served first come, first served: only the oldest plans, so a slot freed for it
        is not taken by a later arrival, and none waits out its timeout behind newer ones.
        """
        deadline = anyio.current_time() + self.config.pool.acquire_timeout
        queue = self._slot_queues.setdefault(backend.name, collections.deque())
        ticket = object()
        queue.append(ticket)
        waiting_logged = False
        try:
            while True:
                if self.stopping.refusing:
                    raise ProxyError.proxy_shutdown()
                changed = self.changed.next()
                if queue[0] is ticket:
                    decision = plan_acquire(
                        self.slots(),
                        backend.name,
                        backend_cap=self.backend_cap(backend),
                        global_cap=self.config.pool.max_live,
                        reserved=self._reserved,
                    )
                    if isinstance(decision, Admit):
                        if decision.evict is None:
                            self._reserved[backend.name] = self._reserved.get(backend.name, 0) + 1
                            return
                        if self.evict(decision.evict):
                            # The slot is ours once its process has exited: a wait bounded by the
                            # teardown's own graces, not by acquire_timeout (that is for busy sessions).
                            await changed.wait()
                            continue
                    elif not waiting_logged:
                        log.info("pool full for backend %s: %s; waiting", backend.name, decision.reason)
                        waiting_logged = True
                remaining = deadline - anyio.current_time()
                if remaining <= 0:
                    break
                with anyio.move_on_after(min(remaining, self._until_a_session_quiets())):
                    await changed.wait()
        finally:
            queue.remove(ticket)
            if not queue:
                del self._slot_queues[backend.name]
            self.changed.notify()  # the next in line plans now
        raise ProxyError.pool_exhausted(backend.name, self.backend_cap(backend))

    def _until_a_session_quiets(self) -> float:
        """Seconds until the first session busy only with background work counts as idle again
        (no event marks that moment: a waiter for a slot plans again then)."""
        moment = time.monotonic()
        pending = [a.quiet_at - moment for a in self.running if a.quiet_at > moment]
        return min(pending, default=math.inf) + 0.01

    def _release_reservation(self, backend: BackendConfig) -> None:
        self._reserved[backend.name] -= 1
        self.changed.notify()

    def evict(self, slot: Slot, why: str = "least recently used") -> bool:
        """Suspend what the plan chose (a spare is simply stopped); False if it is no longer idle.

        The bookkeeping happens at once, before anything waits, so the slot is free for
        the caller's plan; the process is stopped in the background, so that whoever
        needed the slot does not wait for the teardown.
        """
        for adapter in list(self.running):
            if slot_key(adapter) != slot.key:
                continue
            if adapter.gateway_session is None:
                if adapter.busy:
                    return False
                log.info("pool: stopping a spare %s adapter (%s)", adapter.backend.name, why)
                self.stop_in_background(adapter)
                return True
            return self._suspend(adapter.gateway_session, why)
        return False

    async def suspend_idle(self) -> None:
        """The idle TTL sweeper: suspend sessions (and stop spares) idle longer than ``idle_ttl``."""
        ttl = self.config.pool.idle_ttl
        interval = max(0.05, min(ttl / 4, 30.0))
        while True:
            await anyio.sleep(interval)
            if self.stopping.begun:
                return
            for slot in expired(self.slots(), time.monotonic(), ttl):
                self.evict(slot, f"idle for {ttl:g}s")

    # --- starting ------------------------------------------------------------------------------

    async def start(self, backend: BackendConfig, *, prepare: bool, session_key: str | None = None) -> Adapter:
        """A new running adapter of ``backend`` (within the budget).

        ``prepare``: send it ``initialize`` with the gateway's own params, and
        ``authenticate`` again if the gateway did, so it can take a session.
        Its start deadline counts from now (the slot is ours): the warm process
        launched with the proxy is counted from the request that takes it.
        """
        await self._acquire_slot(backend)
        try:
            if self.stopping.refusing:
                raise ProxyError.proxy_shutdown()
            deadline = anyio.current_time() + self.start_timeout(backend)
            warm, self._warm = (self._warm, None) if backend is self.default_backend else (None, self._warm)
            try:
                supervised = warm or Adapter.launch(
                    backend, owner=self.owner, shutdown=self.config.shutdown, session_key=session_key
                )
                adapter = await Adapter.attach(backend, supervised, self.config.max_line_bytes)
            except Exception as exc:
                # Whatever went wrong (a missing binary, an unusable state database), the
                # gateway gets an answer and the proxy keeps serving.
                if not isinstance(exc, SpawnError):
                    log.exception("starting backend %r failed", backend.name)
                    exc = SpawnError(f"cannot start backend {backend.name!r}: {exc}")
                raise ProxyError.spawn_failed(backend.name, str(exc)) from None
            adapter.last_active = time.monotonic()
            adapter.claimed = prepare
            adapter.start_deadline = deadline
            self.running.add(adapter)
        finally:
            self._release_reservation(backend)
        self._attach(adapter)
        self.background.start_task(self._watch_exit, adapter)
        if prepare:
            try:
                await self._prepare(adapter)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self.stop(adapter)
                raise
        return adapter

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
            raise ProxyError.start_timeout(method, adapter.backend.name, self.start_timeout(adapter.backend))

    async def call(self, adapter: Adapter, method: str, params: object) -> Message:
        """A request of the proxy's own, bounded by ``resume_timeout``; an error answer raises ``restore_failed``."""
        answer = await self.call_answer(adapter, method, params)
        if answer.error is not UNSET:
            raise ProxyError.restore_failed(method, adapter.backend.name, answer.error.code, answer.error.message)
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

    # --- stopping ------------------------------------------------------------------------------

    async def stop(self, adapter: Adapter, *, drain: bool = True) -> None:
        """End one adapter process and its tree, and let waiters for a slot know.

        ``drain``: keep relaying what it wrote last (briefly) before closing its stdout.
        """
        await adapter.stop(self.config.shutdown)
        if drain:
            with anyio.move_on_after(DRAIN_TIMEOUT):
                await adapter.drained.wait()
            await adapter.close_output()
        self.running.discard(adapter)
        self.changed.notify()

    def stop_in_background(self, adapter: Adapter) -> anyio.Event:
        """Stop ``adapter`` without waiting for it; the event is set once it is gone."""
        self._evicting.add(adapter)
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
        if self._warm is not None:
            shutdown = self.config.shutdown
            await self._warm.stop(stdin_grace=shutdown.stdin_grace, term_grace=shutdown.term_grace)

    async def _watch_exit(self, adapter: Adapter) -> None:
        """When the wrapper exits, make sure its whole tree is gone and its lease settled.

        A wrapper exits on its own only after tearing its tree down; if it was
        killed instead, this is what finds the orphans (by marker) and ends them.
        """
        await adapter.wait_exit(math.inf)
        self.changed.notify()  # its slot is free: the whole tree is gone
        await self.stop(adapter)
