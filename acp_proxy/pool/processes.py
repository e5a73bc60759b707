"""The process pool: starts adapter processes within the budget, prepares them, and calls them.

Split by job: who may start (``pool.slots``: the install's slots, the line of waiters and the
memory budget, deciding with ``pool.admission``), what runs and its stopping
(``pool.running``), and measuring and keeping the memory budget (``pool.budget``). The pool
builds the three in that order and starts processes through them: a slot (and room) first,
then the launch under a lease, then ``initialize`` as the gateway sent it. Calls that go upward
are handed in by the composition root: ``suspend`` (the sessions' intent, for the idle session
the plan chose), ``started`` (the relay, which reads a new adapter's output) and ``peers``
(another proxy's control socket, to suspend one of its sessions).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable

import anyio
from anyio.streams.memory import MemoryObjectSendStream
from msgspec import UNSET, Raw, UnsetType

from acp_proxy.concurrency import Background, Changes, Stopping
from acp_proxy.config import BackendConfig, Config
from acp_proxy.journal import Kind
from acp_proxy.logs import ids
from acp_proxy.ownership.owner import Owner
from acp_proxy.ownership.supervised import SupervisedProcess
from acp_proxy.pool.adapter import Adapter, AdapterGone, SpawnError
from acp_proxy.pool.budget import MemoryKeeper, Overruns, Peaks, fits_at_once
from acp_proxy.pool.install import Held, InstallSlots
from acp_proxy.pool.learned import Learned
from acp_proxy.pool.memory import MemoryBudget
from acp_proxy.pool.recency import Recency
from acp_proxy.pool.running import Processes, Suspend, WarmStart
from acp_proxy.pool.slots import Peers, SlotAdmission
from acp_proxy.protocol.acp import PROTOCOL_VERSION, AgentCapabilities
from acp_proxy.protocol.errors import ProxyError
from acp_proxy.protocol.jsonrpc import Message
from acp_proxy.protocol.methods import Method
from acp_proxy.timings import Timing
from acp_proxy.trace import Trace

log = logging.getLogger("acp_proxy.lifecycle")

Answer = Callable[[Message], Message | None]
"""Called with the adapter's answer to a gateway request before it is forwarded (``PendingCall.on_answer``)."""


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


class ProcessPool:
    """The adapter processes of this proxy: started within the install's budget, prepared, called, stopped."""

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
        self.stopping = stopping
        self.default_backend = default_backend
        self._started = started
        """Every adapter it starts goes here as it starts, to the relay that reads its output."""
        self.journal = owner.journal
        self.timings = owner.timings
        self.trace = trace
        """Where every wire message is recorded (``--trace``), handed to each adapter it starts."""
        self.changed = Changes()
        """Notified when a slot may have freed up (a process ended, a session went idle)."""
        self.processes = Processes(
            config,
            owner.instance_id,
            background,
            stopping,
            self.changed,
            default_backend=default_backend,
            warm=warm,
            suspend=suspend,
        )
        peaks = Peaks(Learned(owner.db))
        overruns = Overruns()
        self.admission = SlotAdmission(
            config,
            InstallSlots(owner.db.state_dir, owner.instance_id),
            self.processes,
            self.changed,
            stopping,
            peaks,
            journal=owner.journal,
            timings=owner.timings,
            overruns=overruns,
            peers=peers,
        )
        self.memory = MemoryKeeper(
            config, owner, self.processes, self.admission, peaks, overruns, self.changed, stopping
        )
        """The memory budget (``[pool] max_memory``): measuring this proxy's trees, keeping the install to it."""
        self.recency = Recency(config.pool.min_idle)
        """Start costs and gateway turnarounds learned, and how long a session just active is not taken."""
        self.client_init: Raw | UnsetType = UNSET
        """The gateway's ``initialize`` params: every later process is initialized with them."""
        self.auth_params: Raw | UnsetType = UNSET
        """The gateway's successful ``authenticate`` params, sent again to every later process."""
        self.known_capabilities: dict[str, AgentCapabilities] = {}
        """Per backend, what its last initialized process advertised."""

    def start_timeout(self, backend: BackendConfig) -> float:
        """``start_timeout`` for ``backend``, the backend's own first; ``inf`` when it is 0 (no limit)."""
        return float(self.config.resolved(backend, "start_timeout")) or math.inf

    def refuse(self) -> None:
        """From now on, requests waiting for a slot (and new ones) fail fast with ``proxy_shutdown``."""
        self.stopping.refusing = True
        self.changed.notify()

    # --- starting ------------------------------------------------------------------------------

    async def start(self, backend: BackendConfig, *, prepare: bool, session_key: str | None = None) -> Adapter:
        """A new running adapter of ``backend`` (within the budget).

        ``prepare``: send it ``initialize`` with the gateway's own params, and
        ``authenticate`` again if the gateway did, so it can take a session.
        Its start deadline counts from now (the slot is ours): the warm process
        launched with the proxy is counted from the request that takes it.
        """
        warm = self.processes.take_warm(backend)
        if warm is not None:
            held = warm.slot
            self.admission.reserve(backend, held)
        else:
            held = await self.admission.acquire(backend)  # a slot, and room in the memory budget
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
            adapter.tenancy.on_turn_start = functools.partial(self.processes.publish, adapter)
            if prepare:
                adapter.tenancy.claim()
            adapter.usage.start_deadline = deadline
            self.processes.add(adapter)
            self.journal.record(Kind.ADAPTER_STARTED, backend=backend.name, label="warm" if warm else "started")
        finally:
            self.admission.release(backend, held)
        adapter.trace = self.trace
        self._started.send_nowait(adapter)
        self.processes.watch(adapter)
        if prepare:
            try:
                await self._prepare(adapter)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self.processes.stop(adapter)
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
        adapter = self.processes.spare(backend)
        if adapter is not None:
            adapter.tenancy.claim()
            first_answered = adapter.tenancy.first_answered
            if first_answered is not None:
                await first_answered.wait()  # a gateway that sent initialize and a session request together
            if not adapter.gone and not self.processes.being_stopped(adapter):  # else its first request failed: stopped
                adapter.usage.start_deadline = anyio.current_time() + self.start_timeout(backend)
                return adapter
        return await self.start(backend, prepare=True, session_key=session_key)

    async def start_for(
        self, msg: Message, backend: BackendConfig, *, prepare: bool, on_answer: Answer | None = None
    ) -> None:
        """A gateway request no process is there for: to a new one, which is a spare once it has answered."""
        adapter = await self.start(backend, prepare=prepare)
        adapter.tenancy.unclaim()
        adapter.tenancy.first_answered = first_answered = anyio.Event()
        try:
            await self.forward_first(adapter, msg, on_answer)
        finally:
            first_answered.set()

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
        self.processes.stop_in_background(adapter)
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
