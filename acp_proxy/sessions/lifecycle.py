"""Sessions over a pool of adapter processes: the lifecycle intents and the pool's I/O.

One adapter process per session. The decisions (which idle session to suspend,
how to restore one, when to fall back) are pure functions in ``pool.py``; here
they meet processes and the registry. Each intent is one method a reader can find
by name: ``cancel_turn`` (in ``proxy.py``: it only forwards), ``close_session``,
``suspend_session``, ``resume_session``; startup reaping is ``ownership``'s.

Work that must wait for a session (a resume, a close) runs from that session's
queue, in the order the gateway sent it. ``SessionLifecycle`` is the half of
``Proxy`` that owns sessions and processes; the other half (``proxy.py``) owns
the gateway connection, the relay and shutdown, and provides the few methods
declared at the top of the class.
"""

from __future__ import annotations

import collections
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Final

import anyio
import anyio.abc
import msgspec
from msgspec import UNSET, Raw, UnsetType

from acp_proxy.config import BackendConfig, Config
from acp_proxy.logs import ids
from acp_proxy.ownership.owner import Owner
from acp_proxy.ownership.supervised import SupervisedProcess
from acp_proxy.pool.adapter import Adapter, AdapterGone, AgentCapabilities, SpawnError, describe_exit
from acp_proxy.pool.plan import Admit, Slot, expired, falls_back_to_new, plan_acquire, restore_method
from acp_proxy.protocol import jsonrpc
from acp_proxy.protocol.jsonrpc import Message, RequestId
from acp_proxy.sessions.registry import (
    LIST_PAGE_SIZE,
    SETTING_METHODS,
    Ownership,
    SessionRecord,
    SessionRegistry,
    SessionState,
    decode_cursor,
    encode_cursor,
)
from acp_proxy.sessions.visibility import SessionRow, parse_requester, visible_rows
from acp_proxy.tasks.records import TaskStatus, Turn

log = logging.getLogger("acp_proxy.lifecycle")


class SessionParams(msgspec.Struct, gc=False):
    """The one field of a request's params the router reads."""

    sessionId: str | UnsetType = UNSET


_session_params_decoder: Final = msgspec.json.Decoder(SessionParams)


def session_of(params: Raw | UnsetType) -> str | None:
    """``params.sessionId`` if it is a string (decoding nothing else)."""
    if params is UNSET:
        return None
    try:
        value = _session_params_decoder.decode(params).sessionId
    except (msgspec.DecodeError, RecursionError):  # nesting deeper than msgspec decodes
        return None
    return value if isinstance(value, str) else None


def rewrite_session_id(params: Raw | UnsetType, old: str, new: str) -> Raw | UnsetType:
    """``params`` with ``sessionId`` ``old`` replaced by ``new``; anything else untouched."""
    obj = jsonrpc.decode_object(params)
    if obj is None or obj.get("sessionId") != old:
        return params
    obj["sessionId"] = new
    return Raw(jsonrpc.encode_json(obj))


def proxy_meta(params: Raw | UnsetType) -> dict[str, Any]:
    """``params._meta["acp-proxy"]`` as a dict (empty when absent or not an object)."""
    obj = jsonrpc.decode_object(params) or {}
    meta = obj.get("_meta")
    ours = meta.get("acp-proxy") if isinstance(meta, dict) else None
    return ours if isinstance(ours, dict) else {}


def ownership_from(meta: dict[str, Any]) -> Ownership:
    def text(key: str) -> str | None:
        value = meta.get(key)
        return value if isinstance(value, str) else None

    return Ownership(
        session_key=text("sessionKey"),
        owner_session_key=text("ownerSessionKey"),
        spawned_by=text("spawnedBy"),
        parent_session_key=text("parentSessionKey"),
        agent_id=text("agentId"),
    )


def session_info(record: SessionRecord) -> dict[str, Any]:
    """A ``SessionInfo`` for ``session/list``."""
    info: dict[str, Any] = {"sessionId": record.session_id, "cwd": record.cwd}
    if record.additional_directories is not None:
        info["additionalDirectories"] = msgspec.json.decode(record.additional_directories)
    info["updatedAt"] = datetime.fromtimestamp(record.last_active_at, UTC).isoformat().replace("+00:00", "Z")
    info["_meta"] = {"acp-proxy": {"state": record.state.value, "backend": record.backend}}
    return info


def visibility_row(record: SessionRecord) -> SessionRow:
    owner = record.ownership
    return SessionRow(
        session_id=record.session_id,
        session_key=owner.session_key,
        owner_session_key=owner.owner_session_key,
        spawned_by=owner.spawned_by,
        parent_session_key=owner.parent_session_key,
        agent_id=owner.agent_id,
        lineage=frozenset(),
    )


def reflect_setting(result: dict[str, Any], method: str, params: dict[str, Any], answer: dict[str, Any]) -> None:
    """Update a load/resume result for a setting re-applied after it (mode, model, config options)."""
    if method == "session/set_mode" and isinstance(result.get("modes"), dict):
        result["modes"] = {**result["modes"], "currentModeId": params.get("modeId")}
    elif method == "session/set_model" and isinstance(result.get("models"), dict):
        result["models"] = {**result["models"], "currentModelId": params.get("modelId")}
    elif method == "session/set_config_option" and isinstance(answer.get("configOptions"), list):
        result["configOptions"] = answer["configOptions"]


def slot_key(adapter: Adapter) -> str:
    return adapter.gateway_session or f"spare:{adapter.backend.name}:{adapter.pid}"


class RestoreFailed(Exception):
    """A suspended session could not be brought back; the request that needed it gets this error."""

    def __init__(self, code: int, message: str, data: dict[str, Any]) -> None:
        super().__init__(message)
        self.code, self.message, self.data = code, message, data


@dataclass(slots=True, eq=False)
class Session:
    """A session this proxy has served, with the process (if any) behind it now."""

    record: SessionRecord
    adapter: Adapter | None = None
    queue: collections.deque[Callable[[], Coroutine[Any, Any, None]]] = field(default_factory=collections.deque)
    """Work that must wait for the session (a resume, a close), in the order the gateway sent it."""
    draining: bool = False
    """A task is working through ``queue``; requests that arrive meanwhile queue behind."""
    cancel_epoch: int = 0
    """Bumped by ``session/cancel`` and ``session/close``: a queued prompt that sees it changed is
    answered ``cancelled``."""
    closed: bool = False
    stopping: anyio.Event | None = None
    """Set while its last process is being stopped (a resume waits for that first)."""
    resume_scope: anyio.CancelScope | None = None
    """The resume in progress, which a ``session/close`` cancels."""

    @property
    def session_id(self) -> str:
        return self.record.session_id

    @property
    def ready(self) -> bool:
        """Requests can go straight to the process, in order, without waiting."""
        return self.adapter is not None and not self.adapter.gone and not self.queue and not self.draining


class SessionLifecycle:
    """Sessions and the adapter processes behind them; mixed into ``Proxy``."""

    config: Config
    owner: Owner
    backend: BackendConfig
    registry: SessionRegistry
    sessions: dict[str, Session]
    running: set[Adapter]
    _warm: SupervisedProcess | None
    _reserved: dict[str, int]
    _evicting: set[Adapter]
    _pool_changed: anyio.Event
    _slot_queues: dict[str, collections.deque[object]]
    _client_init: Raw | UnsetType
    _auth_params: Raw | UnsetType
    _tasks: anyio.abc.TaskGroup | None
    _queued_ids: set[RequestId]
    _withdrawn: set[RequestId]
    _refusing: bool
    _shutting_down: bool

    if TYPE_CHECKING:  # provided by Proxy: the gateway connection and the relay

        def _background(self, work: Callable[[], Coroutine[Any, Any, None]]) -> None: ...

        async def _forward(
            self,
            adapter: Adapter,
            msg: Message,
            on_answer: Callable[[Message], Message | None] | None = None,
            *,
            turn: Turn | None = None,
        ) -> None: ...

        def open_turn(self, session: Session, msg: Message, adapter: Adapter | None) -> Turn: ...

        def start_turn(self, turn: Turn, adapter: Adapter, *, resumed: bool) -> None: ...

        def settle(
            self,
            turn: Turn,
            *,
            stop_reason: str | None = None,
            error: tuple[int, str] | None = None,
            write_later: bool = False,
        ) -> None: ...

        async def _answer(self, request_id: RequestId | UnsetType, result: object) -> None: ...

        async def _fail(
            self, request_id: RequestId | UnsetType, code: int, message: str, data: dict[str, Any] | None = None
        ) -> None: ...

        async def _send_gateway(self, data: bytes) -> None: ...

        async def _stop_adapter(self, adapter: Adapter, *, drain: bool = True) -> None: ...

        async def _relay_from_adapter(self, adapter: Adapter) -> None: ...

        async def _watch_adapter_exit(self, adapter: Adapter) -> None: ...

        def _shutdown_error(self) -> RestoreFailed: ...

    # --- adapters: spares, starting, the pool -----------------------------------------

    def _spare(self, backend: BackendConfig) -> Adapter | None:
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

    def _any_adapter(self) -> Adapter | None:
        """For requests naming no session: a spare first, else the most recently used process."""
        spare = self._spare(self.backend)
        if spare is not None:
            return spare
        candidates = [a for a in self.running if not a.gone and a not in self._evicting]
        return max(candidates, key=lambda a: a.last_active, default=None)

    def _slots(self) -> list[Slot]:
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

    def _notify_pool(self) -> None:
        self._pool_changed.set()
        self._pool_changed = anyio.Event()

    def _backend_cap(self, backend: BackendConfig) -> int:
        return backend.max_live if backend.max_live is not None else self.config.pool.max_live

    async def _acquire_slot(self, backend: BackendConfig) -> None:
        """Reserve room for one more process of ``backend``, suspending an idle session if needed.

        Waits at most ``acquire_timeout``; then ``RestoreFailed`` with ``pool_exhausted``.
        The caller must call ``_release_reservation`` once the process runs (or failed).
        Waiters for one backend are served first come, first served: only the oldest
        plans, so a slot freed for it is not taken by a later arrival, and none waits
        out its timeout behind newer ones.
        """
        deadline = anyio.current_time() + self.config.pool.acquire_timeout
        queue = self._slot_queues.setdefault(backend.name, collections.deque())
        ticket = object()
        queue.append(ticket)
        waiting_logged = False
        try:
            while True:
                if self._refusing:
                    raise self._shutdown_error()
                changed = self._pool_changed
                if queue[0] is ticket:
                    decision = plan_acquire(
                        self._slots(),
                        backend.name,
                        backend_cap=self._backend_cap(backend),
                        global_cap=self.config.pool.max_live,
                        reserved=self._reserved,
                    )
                    if isinstance(decision, Admit):
                        if decision.evict is None:
                            self._reserved[backend.name] = self._reserved.get(backend.name, 0) + 1
                            return
                        if self._evict(decision.evict):
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
                with anyio.move_on_after(remaining):
                    await changed.wait()
        finally:
            queue.remove(ticket)
            if not queue:
                del self._slot_queues[backend.name]
            self._notify_pool()  # the next in line plans now
        cap = self._backend_cap(backend)
        raise RestoreFailed(
            jsonrpc.INTERNAL_ERROR,
            f"No adapter process is free: all {cap} live sessions of backend {backend.name!r} are busy",
            {"reason": "pool_exhausted", "maxLive": cap, "backend": backend.name},
        )

    def _release_reservation(self, backend: BackendConfig) -> None:
        self._reserved[backend.name] -= 1
        self._notify_pool()

    def _evict(self, slot: Slot, why: str = "least recently used") -> bool:
        """Suspend what the pool chose (a spare is simply stopped); False if it is no longer idle.

        The decision and the bookkeeping happen here, at once, so the slot is free
        for the caller's plan; the process is stopped in the background, so that
        whoever needed the slot does not wait for the teardown (a resume of the
        suspended session does: see ``resume_session``).
        """
        for adapter in list(self.running):
            if slot_key(adapter) != slot.key:
                continue
            if adapter.gateway_session is None:
                if adapter.busy:
                    return False
                log.info("pool: stopping a spare %s adapter (%s)", adapter.backend.name, why)
                self._stop_in_background(adapter, None)
                return True
            session = self.sessions.get(adapter.gateway_session)
            return session is not None and self.suspend_session(session, why)
        return False

    def _stop_in_background(self, adapter: Adapter, session: Session | None) -> None:
        self._evicting.add(adapter)
        if session is not None:
            session.stopping = anyio.Event()

        async def stop() -> None:
            try:
                await self._stop_adapter(adapter)
            finally:
                self._evicting.discard(adapter)
                if session is not None and session.stopping is not None:
                    session.stopping.set()
                    session.stopping = None
                self._notify_pool()

        self._background(stop)

    async def _start_adapter(self, backend: BackendConfig, *, prepare: bool, session_key: str | None = None) -> Adapter:
        """A new running adapter of ``backend`` (within the pool's budget).

        ``prepare``: send it ``initialize`` with the gateway's own params, and
        ``authenticate`` again if the gateway did, so it can take a session.
        """
        await self._acquire_slot(backend)
        try:
            if self._refusing:
                raise self._shutdown_error()
            warm, self._warm = (self._warm, None) if backend is self.backend else (None, self._warm)
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
                raise RestoreFailed(
                    jsonrpc.INTERNAL_ERROR, str(exc), {"reason": "spawn_failed", "backend": backend.name}
                ) from None
            adapter.last_active = time.monotonic()
            adapter.claimed = prepare
            self.running.add(adapter)
        finally:
            self._release_reservation(backend)
        assert self._tasks is not None
        self._tasks.start_soon(self._relay_from_adapter, adapter)
        self._tasks.start_soon(self._watch_adapter_exit, adapter)
        if prepare:
            try:
                await self._prepare(adapter)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self._stop_adapter(adapter)
                raise
        return adapter

    async def _prepare(self, adapter: Adapter) -> None:
        """``initialize`` (and ``authenticate``) a fresh adapter as the gateway did its first one."""
        init = self._client_init if self._client_init is not UNSET else {"protocolVersion": 1}
        answer = await self._call(adapter, "initialize", init)
        adapter.capabilities = AgentCapabilities.from_initialize(answer.result)
        adapter.can_close_sessions = adapter.capabilities.close
        if self._auth_params is not UNSET:
            await self._call(adapter, "authenticate", self._auth_params)

    async def _call(self, adapter: Adapter, method: str, params: object) -> Message:
        """An internal request, bounded by ``resume_timeout``; an error answer raises ``RestoreFailed``."""
        answer = await self._call_answer(adapter, method, params)
        if answer.error is not UNSET:
            raise RestoreFailed(
                answer.error.code,
                f"{method} failed: {answer.error.message}",
                {"reason": "restore_failed", "method": method, "backend": adapter.backend.name},
            )
        return answer

    async def _call_answer(self, adapter: Adapter, method: str, params: object) -> Message:
        timeout = self.config.pool.resume_timeout
        try:
            with anyio.fail_after(timeout):
                return await adapter.call(method, params)
        except TimeoutError:
            raise RestoreFailed(
                jsonrpc.INTERNAL_ERROR,
                f"{method} timed out after {timeout:g}s",
                {"reason": "restore_timeout", "method": method, "backend": adapter.backend.name},
            ) from None
        except AdapterGone as exc:
            raise RestoreFailed(
                jsonrpc.INTERNAL_ERROR,
                f"The agent process exited during {method} ({describe_exit(exc.returncode)})",
                {"reason": "adapter_exited", "method": method, "backend": adapter.backend.name},
            ) from None

    async def _forward_to_spare(self, msg: Message, backend: BackendConfig) -> None:
        """``initialize`` / ``authenticate``: to the spare process, started for it if need be."""
        adapter = self._spare(backend)
        if adapter is None:
            try:
                adapter = await self._start_adapter(backend, prepare=msg.method != "initialize")
            except RestoreFailed as exc:
                await self._fail(msg.id, exc.code, exc.message, exc.data)
                return
            adapter.claimed = False
        if msg.method == "authenticate":

            def remember(answer: Message) -> None:
                if answer.error is UNSET:
                    self._auth_params = msg.params

            await self._forward(adapter, msg, remember)
        else:
            await self._forward(adapter, msg)

    async def _forward_to_any(self, msg: Message) -> None:
        adapter = self._any_adapter()
        if adapter is None:
            try:
                adapter = await self._start_adapter(self.backend, prepare=True)
            except RestoreFailed as exc:
                await self._fail(msg.id, exc.code, exc.message, exc.data)
                return
            adapter.claimed = False
        await self._forward(adapter, msg)

    async def _take_adapter(self, backend: BackendConfig, session_key: str | None = None) -> Adapter:
        """A prepared adapter for a new or restored session: the spare, else a new one."""
        adapter = self._spare(backend)
        if adapter is not None:
            adapter.claimed = True
            return adapter
        return await self._start_adapter(backend, prepare=True, session_key=session_key)

    # --- session intents ---------------------------------------------------------------

    def _backend_named(self, meta: dict[str, Any]) -> BackendConfig:
        name = meta.get("backend")
        if name is None:
            return self.backend
        if not isinstance(name, str) or name not in self.config.backends:
            configured = ", ".join(sorted(self.config.backends))
            raise RestoreFailed(
                jsonrpc.INVALID_PARAMS,
                f'Unknown backend {name!r} in _meta["acp-proxy"].backend (configured: {configured})',
                {"reason": "unknown_backend", "configured": sorted(self.config.backends)},
            )
        return self.config.backends[name]

    async def _new_session(self, msg: Message) -> None:
        """``session/new``: on a prepared adapter; the id it answers becomes the stable id."""
        try:
            backend = self._backend_named(proxy_meta(msg.params))
            adapter = await self._take_adapter(backend)
        except RestoreFailed as exc:
            await self._fail(msg.id, exc.code, exc.message, exc.data)
            return

        def created(answer: Message) -> Message | None:
            adapter.claimed = False
            session_id = session_of(answer.result) if answer.error is UNSET else None
            if session_id is None:
                return None  # the error goes to the gateway; the process stays as a spare
            stable = self._register(session_id, backend, adapter, msg.params)
            if stable == session_id:
                return None
            result = jsonrpc.decode_object(answer.result) or {}
            return Message(
                jsonrpc="2.0", id=answer.id, result=Raw(jsonrpc.encode_json({**result, "sessionId": stable}))
            )

        await self._forward(adapter, msg, created)

    def _register(self, session_id: str, backend: BackendConfig, adapter: Adapter, params: Raw | UnsetType) -> str:
        """A session the adapter just opened (``session/new``, or a load of one the registry did not know).

        Returns the stable id: the adapter's, unless a session this proxy serves, or one live in
        another running proxy, already has that id (adapters that number sessions per process
        give every process's first session the same id); then a proxy-side id, and
        ``sessionId`` is rewritten on this connection. A suspended row of an earlier proxy with
        the same id is replaced: the adapter has issued that id afresh, so the old session is
        not one it could restore.
        """
        stable = session_id
        taken = self.registry.get(session_id)
        live_elsewhere = (
            taken is not None
            and taken.state in (SessionState.LIVE, SessionState.RESUMING)
            and taken.instance_id != self.owner.instance_id
            and not self.registry.take_over_if_orphaned(session_id)
        )
        if session_id in self.sessions or live_elsewhere:
            stable = f"{session_id}~{uuid.uuid4().hex[:8]}"
            log.info("session %s: the adapter's id is taken by another session; known as %s", session_id, stable)
        elif taken is not None and taken.state is not SessionState.CLOSED:
            log.info("session %s: issued again by the adapter; the older session of that id is replaced", session_id)
        given = jsonrpc.decode_object(params) or {}
        directories = given.get("additionalDirectories")
        record = SessionRecord(
            session_id=stable,
            adapter_session_id=session_id,
            backend=backend.name,
            cwd=str(given.get("cwd", "")),
            mcp_servers=jsonrpc.encode_json(given.get("mcpServers", [])).decode(),
            additional_directories=None if directories is None else jsonrpc.encode_json(directories).decode(),
            lease_id=adapter.supervised.lease.lease_id,
            auth_method=self._auth_method(),
            ownership=ownership_from(proxy_meta(params)),
        )
        self._bind(Session(self.registry.create(record)), adapter, session_id)
        return stable

    def _auth_method(self) -> str | None:
        obj = jsonrpc.decode_object(self._auth_params) or {}
        method = obj.get("methodId")
        return method if isinstance(method, str) else None

    def _bind(self, session: Session, adapter: Adapter, adapter_session_id: str) -> None:
        """From now on ``adapter`` serves ``session`` (its own id for it may differ from the stable one)."""
        adapter.gateway_session = session.session_id
        adapter.adapter_session = adapter_session_id
        adapter.open_sessions = {adapter_session_id}
        adapter.claimed = False
        adapter.last_active = time.monotonic()
        session.adapter = adapter
        self.sessions[session.session_id] = session
        self._notify_pool()

    def _session(self, session_id: str) -> Session | None:
        """A session this proxy can serve: in memory, or in the registry (suspended, or left by a dead proxy)."""
        session = self.sessions.get(session_id)
        if session is not None:
            return session
        record = self.registry.get(session_id)
        if record is None or record.state is SessionState.CLOSED:
            return None
        if record.state is not SessionState.SUSPENDED and record.instance_id != self.owner.instance_id:
            # Live in another proxy: unless that proxy has died since we started (its tree was
            # reaped by then or will be by the next start), it is not ours to serve.
            if not self.registry.take_over_if_orphaned(session_id):
                return None
            log.info(
                "session %s: left live by a proxy that is gone; suspended, resumable",
                session_id,
                extra=ids(session=session_id),
            )
            record = self.registry.get(session_id) or record
        session = Session(record)
        self.sessions[session_id] = session
        return session

    def _enqueue(self, session: Session, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``work`` once everything the gateway sent earlier for this session has run (in order)."""
        session.queue.append(work)
        if not session.draining:
            session.draining = True
            self._background(lambda: self._drain(session))

    async def _drain(self, session: Session) -> None:
        try:
            while session.queue:
                work = session.queue.popleft()
                await work()
                self._notify_pool()
        finally:
            session.draining = False
            self._notify_pool()  # it may be idle now: a waiter for a slot may suspend it

    async def _forward_to_session(self, msg: Message, session_id: str) -> None:
        session = self._session(session_id)
        if session is None:
            await self._unknown_session(msg.id, session_id)
            return
        is_prompt = msg.method == "session/prompt"
        if session.ready:
            assert session.adapter is not None
            turn = self.open_turn(session, msg, session.adapter) if is_prompt else None
            await self._forward(session.adapter, msg, self._bookkeeping(session, msg), turn=turn)
            return
        queued_turn = self.open_turn(session, msg, None) if is_prompt else None
        epoch = session.cancel_epoch
        self._queued_ids.add(msg.id)  # type: ignore[arg-type]
        self._enqueue(session, lambda: self._forward_when_live(session, msg, epoch, queued_turn))

    async def _unknown_session(self, request_id: RequestId | UnsetType, session_id: str) -> None:
        elsewhere = self.registry.get(session_id)
        if elsewhere is not None and elsewhere.state is SessionState.CLOSED:
            await self._fail(
                request_id,
                jsonrpc.RESOURCE_NOT_FOUND,
                f"Session {session_id} was closed",
                {"reason": "session_closed", "sessionId": session_id},
            )
            return
        if elsewhere is not None:
            await self._fail(
                request_id,
                jsonrpc.INTERNAL_ERROR,
                f"Session {session_id} is live in another acp-proxy process (instance {elsewhere.instance_id})",
                {"reason": "session_in_use", "sessionId": session_id, "instanceId": elsewhere.instance_id},
            )
            return
        await self._fail(
            request_id,
            jsonrpc.RESOURCE_NOT_FOUND,
            f"Unknown session {session_id}",
            {"reason": "unknown_session", "sessionId": session_id},
        )

    def _bookkeeping(self, session: Session, msg: Message) -> Callable[[Message], Message | None] | None:
        """What to record when the adapter answers a request of this session."""
        method = msg.method
        if method in SETTING_METHODS:

            def remember(answer: Message) -> None:
                params = jsonrpc.decode_object(msg.params)
                if answer.error is UNSET and params is not None and isinstance(method, str):
                    self.registry.record_setting(session.session_id, method, params)

            return remember
        if method == "session/delete":

            def forget(answer: Message) -> None:
                if answer.error is UNSET:
                    self._close_quietly(session)

            return forget
        return None

    async def _forward_when_live(self, session: Session, msg: Message, epoch: int, turn: Turn | None) -> None:
        """A request that waited for its session: bring the session back if need be, then forward."""
        try:
            if await self._answered_while_queued(session, msg, epoch, turn):
                return
            resumed = session.adapter is None or session.adapter.gone
            try:
                adapter = await self.ensure_live(session)
            except RestoreFailed as exc:
                if turn is not None:
                    self.settle(turn, error=(exc.code, exc.message))
                await self._fail(msg.id, exc.code, exc.message, exc.data)
                return
            if adapter is None:  # a close cut the resume short
                await self._answered_while_queued(session, msg, epoch, turn, closed=True)
                return
            if await self._answered_while_queued(session, msg, epoch, turn):
                return
            if turn is not None:
                self.start_turn(turn, adapter, resumed=resumed)
            await self._forward(adapter, msg, self._bookkeeping(session, msg), turn=turn)
        finally:
            self._queued_ids.discard(msg.id)
            if turn is not None and turn.status is TaskStatus.QUEUED:  # cancelled while it waited
                self.settle(turn, error=(jsonrpc.REQUEST_CANCELLED, "the proxy stopped before sending it"))

    async def _answered_while_queued(
        self, session: Session, msg: Message, epoch: int, turn: Turn | None, *, closed: bool = False
    ) -> bool:
        """Answer a queued request that must not be sent any more (withdrawn, cancelled, closed, shutdown)."""
        is_prompt = msg.method == "session/prompt"
        error: tuple[int, str, dict[str, Any]] | None = None
        if msg.id in self._withdrawn:
            self._withdrawn.discard(msg.id)
            error = (jsonrpc.REQUEST_CANCELLED, "Request cancelled", {"reason": "cancelled"})
        elif self._refusing:
            exc = self._shutdown_error()
            error = (exc.code, exc.message, exc.data)
        elif is_prompt and (session.cancel_epoch != epoch or (turn is not None and turn.cancel_requested)):
            if turn is not None:  # session/cancel or close meanwhile, or an operator cancelled this task
                self.settle(turn, stop_reason="cancelled")
            await self._answer(msg.id, {"stopReason": "cancelled"})
            return True
        elif closed or session.closed:
            if turn is not None:
                self.settle(turn, error=(jsonrpc.RESOURCE_NOT_FOUND, f"Session {session.session_id} was closed"))
            await self._unknown_session(msg.id, session.session_id)
            return True
        else:
            return False
        if turn is not None:
            self.settle(turn, error=error[:2])
        await self._fail(msg.id, *error)
        return True

    async def ensure_live(self, session: Session) -> Adapter | None:
        """The session's process, resuming it first if it has none; ``None`` if a close cut the resume short.

        Runs from the session's queue, so nothing else of the session runs meanwhile.
        """
        if session.adapter is not None and not session.adapter.gone:
            return session.adapter
        await self._resume_cancellable(session, gateway_asked=None)
        return session.adapter

    async def _resume_cancellable(self, session: Session, gateway_asked: str | None) -> Message | None:
        with anyio.CancelScope() as scope:
            session.resume_scope = scope
            try:
                return await self.resume_session(session, gateway_asked)
            finally:
                session.resume_scope = None
        return None

    async def resume_session(self, session: Session, gateway_asked: str | None = None) -> Message:
        """Bring a suspended session back on a fresh adapter; the answer of the restoring request.

        spawn -> initialize (the gateway's params) -> authenticate (if it did) ->
        session/resume | session/load | session/new (per strategy and capability),
        falling back to session/new only on the error classes that say the adapter
        cannot restore it -> re-apply mode and config options. A timeout or any other
        failure stops the new process and leaves the session suspended, mapping kept.
        """
        if session.stopping is not None:  # its previous process must be gone before another starts
            await session.stopping.wait()
        record = self.registry.get(session.session_id) or session.record
        session.record = record
        backend = self.config.backends.get(record.backend)
        if backend is None:
            raise RestoreFailed(
                jsonrpc.INTERNAL_ERROR,
                f"Session {record.session_id} belongs to backend {record.backend!r}, which is no longer configured",
                {"reason": "unknown_backend", "backend": record.backend},
            )
        started = time.monotonic()
        if not self.registry.mark_resuming(record.session_id):
            raise RestoreFailed(
                jsonrpc.INTERNAL_ERROR,
                f"Session {record.session_id} is being served by another acp-proxy process",
                {"reason": "session_in_use", "sessionId": record.session_id},
            )
        try:
            adapter = await self._take_adapter(backend, session_key=record.session_id)
        except BaseException:
            self.registry.mark_suspended(record.session_id)
            raise
        adapter.gateway_session = record.session_id
        adapter.adapter_session = record.adapter_session_id
        try:
            answer, adapter_session_id = await self._restore(adapter, backend, record, gateway_asked)
            result = jsonrpc.decode_object(answer.result) or {}
            for method, params in record.settings:
                setting_params = msgspec.json.decode(params)
                setting = await self._call_answer(adapter, method, {**setting_params, "sessionId": adapter_session_id})
                if setting.error is not UNSET:
                    log.warning("session %s: %s not re-applied: %s", record.session_id, method, setting.error.message)
                else:
                    reflect_setting(result, method, setting_params, jsonrpc.decode_object(setting.result) or {})
        except BaseException:
            with anyio.CancelScope(shield=True):
                adapter.gateway_session = adapter.adapter_session = None
                self.registry.mark_suspended(record.session_id)
                await self._stop_adapter(adapter)
            raise
        self.registry.mark_live(record.session_id, adapter.supervised.lease.lease_id, adapter_session_id)
        session.record = self.registry.get(record.session_id) or record
        self._bind(session, adapter, adapter_session_id)
        log.info(
            "session %s %s on pid %s in %.0f ms",
            record.session_id,
            "resumed" if adapter_session_id == record.adapter_session_id else "started afresh",
            adapter.pid,
            (time.monotonic() - started) * 1000,
            extra=ids(session=record.session_id, lease=adapter.supervised.lease.lease_id, backend=backend.name),
        )
        # What the gateway is answered (when it asked for the load or resume itself): its own id,
        # and the settings as they are now, after re-applying them.
        if result.get("sessionId") == adapter_session_id:
            result["sessionId"] = record.session_id
        return Message(jsonrpc="2.0", result=Raw(jsonrpc.encode_json(result)))

    async def _restore(
        self, adapter: Adapter, backend: BackendConfig, record: SessionRecord, gateway_asked: str | None
    ) -> tuple[Message, str]:
        """Run the restoring request (and the fallback); the answer and the adapter's id for the session."""
        caps = adapter.capabilities
        method = restore_method(backend.resume, can_resume=caps.resume, can_load=caps.load, gateway_asked=gateway_asked)
        if method is None:
            raise RestoreFailed(
                jsonrpc.RESOURCE_NOT_FOUND,
                f'Session {record.session_id} cannot be resumed (backend {backend.name!r} has resume = "never")',
                {"reason": "resume_disabled", "sessionId": record.session_id},
            )
        params = record.restore_params()
        answer: Message | None = None
        if method != "session/new":
            adapter.swallow_updates = not (method == "session/load" and gateway_asked == "session/load")
            try:
                answer = await self._call_answer(adapter, method, {**params, "sessionId": record.adapter_session_id})
            finally:
                adapter.swallow_updates = False
            code = answer.error.code if answer.error is not UNSET else None
            if code is None:
                return answer, record.adapter_session_id
            if not falls_back_to_new(method, code):
                raise RestoreFailed(
                    code,
                    f"{method} failed: {answer.error.message}",  # type: ignore[union-attr]
                    {"reason": "restore_failed", "method": method, "backend": backend.name},
                )
            log.warning(
                "session %s: %s failed with %d; starting afresh with session/new",
                record.session_id,
                method,
                code,
                extra=ids(session=record.session_id, backend=backend.name),
            )
        fresh = await self._call(adapter, "session/new", params)
        new_id = session_of(fresh.result)
        if new_id is None:
            raise RestoreFailed(
                jsonrpc.INTERNAL_ERROR,
                "session/new answered without a sessionId",
                {"reason": "restore_failed", "method": "session/new", "backend": backend.name},
            )
        self.registry.note_history_reset(record.session_id, new_id)
        adapter.adapter_session = new_id
        await self._announce_history_reset(record.session_id)
        result = jsonrpc.decode_object(fresh.result) or {}
        result.pop("sessionId", None)
        return Message(jsonrpc="2.0", result=Raw(jsonrpc.encode_json(result))), new_id

    async def _announce_history_reset(self, session_id: str) -> None:
        """Tell the gateway the adapter could not restore the history: this session starts afresh."""
        update = {
            "sessionUpdate": "session_info_update",
            "_meta": {"acp-proxy": {"historyReset": True}},
        }
        await self._send_gateway(jsonrpc.notification("session/update", {"sessionId": session_id, "update": update}))

    async def _restore_for_gateway(self, msg: Message, session_id: str) -> None:
        """``session/load`` / ``session/resume`` sent by the gateway itself."""
        session = self._session(session_id)
        if session is None:
            record = self.registry.get(session_id)
            if record is not None and record.state is not SessionState.CLOSED:
                await self._unknown_session(msg.id, session_id)  # live in another proxy
            else:
                self._background(lambda: self._adopt_session(msg, session_id))
            return
        self._enqueue(session, lambda: self._restore_when_ready(session, msg))

    async def _restore_when_ready(self, session: Session, msg: Message) -> None:
        if session.closed:  # closed just before: the adapter may still have it in its own storage
            await self._adopt_session(msg, session.session_id)
            return
        if self._refusing:
            exc = self._shutdown_error()
            await self._fail(msg.id, exc.code, exc.message, exc.data)
            return
        adapter = session.adapter
        if adapter is not None and not adapter.gone:
            if msg.method == "session/resume" and not adapter.capabilities.resume:
                await self._answer(msg.id, {})  # live already; the proxy advertised resume, so it serves it
            else:
                await self._forward(adapter, msg)
            return
        try:
            answer = await self._resume_cancellable(session, gateway_asked=str(msg.method))
        except RestoreFailed as exc:
            await self._fail(msg.id, exc.code, exc.message, exc.data)
            return
        if answer is None:
            await self._unknown_session(msg.id, session.session_id)
            return
        await self._answer(msg.id, answer.result if answer.result is not UNSET else {})

    async def _adopt_session(self, msg: Message, session_id: str) -> None:
        """A load/resume of a session the registry does not know: the adapter may (its own storage)."""
        try:
            backend = self._backend_named(proxy_meta(msg.params))
            adapter = await self._take_adapter(backend)
        except RestoreFailed as exc:
            await self._fail(msg.id, exc.code, exc.message, exc.data)
            return
        adapter.gateway_session = adapter.adapter_session = session_id
        caps = adapter.capabilities
        if msg.method == "session/resume" and not caps.resume and caps.load:
            # The proxy advertised resume on the strength of load: load it, without the replay.
            adapter.swallow_updates = True
            try:
                answer = await self._call_answer(adapter, "session/load", msg.params)
            except RestoreFailed as exc:
                adapter.release_to_spare()  # also ends the swallowing if no answer ever came
                await self._fail(msg.id, exc.code, exc.message, exc.data)
                return
            if answer.error is not UNSET:
                adapter.release_to_spare()
                await self._send_gateway(jsonrpc.with_id(answer, msg.id))  # type: ignore[arg-type]
                return
            self._register(session_id, backend, adapter, msg.params)
            await self._answer(msg.id, answer.result if answer.result is not UNSET else {})
            return

        def adopted(answer: Message) -> None:
            if answer.error is not UNSET:
                adapter.release_to_spare()
                return
            self._register(session_id, backend, adapter, msg.params)

        await self._forward(adapter, msg, adopted)

    async def close_session(self, session_id: str, request_id: RequestId | UnsetType | None) -> Session | None:
        """``session/close``: end the turn in flight (answered ``cancelled``), reap the tree, forget the session.

        A resume in progress is cut short, and requests queued for the session are answered
        (prompts ``cancelled``) rather than sent. ``request_id`` is the gateway's request, answered
        once the session is gone (``None``: an operator's close). The session being closed, or
        ``None`` if there is no such session to close.
        """
        session = self._session(session_id)
        if session is None or session.closed:
            if request_id is not None:
                await self._unknown_session(request_id, session_id)
            return None
        session.closed = True
        session.cancel_epoch += 1
        if session.resume_scope is not None:
            session.resume_scope.cancel()
        self._enqueue(session, lambda: self._reap_closed(session, request_id))
        return session

    def _close_quietly(self, session: Session) -> None:
        """After a successful ``session/delete``: the session is gone, so is its process."""
        if not session.closed:
            session.closed = True
            self._enqueue(session, lambda: self._reap_closed(session, None))

    async def _reap_closed(self, session: Session, request_id: RequestId | UnsetType | None) -> None:
        adapter, session.adapter = session.adapter, None
        if adapter is not None and not adapter.gone:
            await self._end_turns(adapter, session.session_id)
            await self._stop_adapter(adapter)
        if session.stopping is not None:
            await session.stopping.wait()
        self.registry.mark_closed(session.session_id)
        if self.sessions.get(session.session_id) is session:
            del self.sessions[session.session_id]
        log.info("session %s closed", session.session_id, extra=ids(session=session.session_id))
        if request_id is not None:
            await self._answer(request_id, {})

    async def _end_turns(self, adapter: Adapter, session_id: str) -> None:
        """Cancel the turn in flight, give the adapter ``close_timeout`` to end it, answer the rest ourselves."""
        if adapter.turn_in_flight:
            cancel = {"sessionId": adapter.adapter_session or session_id}
            with suppress(AdapterGone):
                await adapter.send(jsonrpc.notification("session/cancel", cancel))
            with anyio.move_on_after(self.config.shutdown.close_timeout):
                while adapter.turn_in_flight and not adapter.gone:
                    await anyio.sleep(0.01)
        for call in adapter.take_gateway_calls():
            if call.method == "session/prompt":
                if call.turn is not None:
                    self.settle(call.turn, stop_reason="cancelled")
                await self._answer(call.gateway_id, {"stopReason": "cancelled"})
            else:
                await self._fail(
                    call.gateway_id,
                    jsonrpc.REQUEST_CANCELLED,
                    "The session was closed",
                    {"reason": "session_closed", "method": call.method},
                )

    def suspend_session(self, session: Session, why: str) -> bool:
        """Suspend ``session`` if it is idle (False if not): it keeps its mapping and is resumable;
        from now on it has no process, and that one is being stopped in the background."""
        adapter = session.adapter
        if adapter is None or adapter.gone or adapter.busy or session.queue or session.draining:
            return False
        session.adapter = None
        self.registry.mark_suspended(session.session_id)
        log.info(
            "session %s suspended (%s): stopping pid %s",
            session.session_id,
            why,
            adapter.pid,
            extra=ids(session=session.session_id, lease=adapter.supervised.lease.lease_id),
        )
        self._stop_in_background(adapter, session)
        return True

    async def _suspend_idle_sessions(self) -> None:
        """The idle TTL sweeper: suspend sessions (and stop spares) idle longer than ``idle_ttl``."""
        ttl = self.config.pool.idle_ttl
        interval = max(0.05, min(ttl / 4, 30.0))
        while True:
            await anyio.sleep(interval)
            if self._shutting_down:
                return
            for slot in expired(self._slots(), time.monotonic(), ttl):
                self._evict(slot, f"idle for {ttl:g}s")

    async def _list_sessions(self, msg: Message) -> None:
        """``session/list`` from the registry: suspended sessions included, filtered by who asks."""
        params = jsonrpc.decode_object(msg.params) or {}
        try:
            requester = parse_requester(params.get("_meta"))
            cursor = params.get("cursor")
            after = decode_cursor(cursor) if isinstance(cursor, str) else None
        except ValueError as exc:
            await self._fail(msg.id, jsonrpc.INVALID_PARAMS, str(exc), {"reason": "invalid_params"})
            return
        cwd = params.get("cwd") if isinstance(params.get("cwd"), str) else None
        records = self.registry.page(cwd=cwd, limit=None)
        if requester is not None:
            visible = {row.session_id for row in visible_rows([visibility_row(r) for r in records], requester)}
            records = [r for r in records if r.session_id in visible]
        if after is not None:
            records = [r for r in records if (r.created_at, r.session_id) > (after.created_at, after.session_id)]
        page = records[:LIST_PAGE_SIZE]
        result: dict[str, Any] = {"sessions": [session_info(r) for r in page]}
        if len(records) > len(page):
            result["nextCursor"] = encode_cursor(page[-1])
        await self._answer(msg.id, result)
