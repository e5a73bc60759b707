"""Sessions a process opens: ``session/new``, a load or resume of a session the registry does not know
(adopted, if the adapter has it), and ``session/fork``. The id the adapter answers becomes the stable
id (``decisions.stable_id``), and the session is live on that process from the start."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from msgspec import UNSET, Raw, UnsetType

from acp_proxy.concurrency import Background
from acp_proxy.config import BackendConfig, Config
from acp_proxy.logs import ids
from acp_proxy.pool.adapter import Adapter
from acp_proxy.pool.processes import ProcessPool
from acp_proxy.protocol import jsonrpc
from acp_proxy.protocol.acp import proxy_meta, session_of
from acp_proxy.protocol.errors import ProxyError
from acp_proxy.protocol.jsonrpc import Message, RequestId
from acp_proxy.protocol.methods import Method
from acp_proxy.sessions.decisions import answered_as, ownership_from, stable_id
from acp_proxy.sessions.lifecycle import Event
from acp_proxy.sessions.machine import Work
from acp_proxy.sessions.registry import Ownership, SessionRecord, SessionRegistry, SessionState
from acp_proxy.sessions.restore import GatewayPort
from acp_proxy.sessions.table import Session, SessionTable
from acp_proxy.timings import Timing

log = logging.getLogger("acp_proxy.lifecycle")

Answer = Callable[[Message], Message | None]


class Opener:
    """Opens sessions on prepared processes of the pool, and forks them."""

    def __init__(
        self,
        config: Config,
        registry: SessionRegistry,
        table: SessionTable,
        pool: ProcessPool,
        gateway: GatewayPort,
        background: Background,
        *,
        ensure_live: Callable[[Session], Awaitable[Adapter | None]],
        fail_unknown: Callable[[RequestId | UnsetType, str], Awaitable[None]],
    ) -> None:
        self.config = config
        self.registry = registry
        self.table = table
        self.pool = pool
        self.gateway = gateway
        self.background = background
        self._ensure_live = ensure_live
        """The session's process, restored first if it has none (``SessionIntents``: from its queue)."""
        self._fail_unknown = fail_unknown
        """Answer a request for a session this proxy cannot serve, saying why."""

    def backend_named(self, meta: dict[str, Any]) -> BackendConfig:
        """The backend ``_meta["acp-proxy"].backend`` names, else the proxy's default."""
        name = meta.get("backend")
        if name is None:
            return self.pool.default_backend
        if not isinstance(name, str) or name not in self.config.backends:
            raise ProxyError.unknown_backend(name, self.config.backends)
        return self.config.backends[name]

    async def _prepared_for(self, msg: Message) -> Adapter | None:
        """A prepared process of the backend the request names; ``None`` (the request answered) if none."""
        try:
            return await self.pool.take(self.backend_named(proxy_meta(msg.params)))
        except ProxyError as exc:
            await self.gateway.fail(msg.id, exc)
            return None

    async def _send_first(self, adapter: Adapter, msg: Message, on_answer: Answer) -> None:
        """The request a process was taken for, under its start deadline (past it, ``start_timeout`` answered)."""
        try:
            await self.pool.forward_first(adapter, msg, on_answer)
        except ProxyError as exc:
            await self.gateway.fail(msg.id, exc)

    async def new(self, msg: Message) -> None:
        """``session/new``: on a prepared adapter; the id it answers becomes the stable id."""
        received = time.monotonic()
        await self.registry.caught_up()  # the answer's stable id is decided from the rows, in a callback
        adapter = await self._prepared_for(msg)
        if adapter is None:
            return
        backend = adapter.backend

        def created(answer: Message) -> Message | None:
            adapter.tenancy.unclaim()
            session_id = session_of(answer.result) if answer.error is UNSET else None
            if session_id is None:
                return None  # the error goes to the gateway; the process stays as a spare
            self.pool.timings.observe(Timing.SESSION_NEW, backend.name, time.monotonic() - received)
            return answered_as(answer, session_id, self._register(session_id, backend, adapter, msg.params))

        await self._send_first(adapter, msg, created)

    def _register(self, session_id: str, backend: BackendConfig, adapter: Adapter, params: Raw | UnsetType) -> str:
        """A session the adapter just opened (``session/new``, or a load of one the registry did not know).

        A suspended row of an earlier proxy with the same id is replaced: the adapter has
        issued that id afresh, so the old session is not one it could restore.
        """
        stable = self._stable_for(session_id)
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
        self.table.open(self.registry.create(record), adapter, session_id)
        return stable

    def _stable_for(self, issued: str) -> str:
        """The stable id of a session the adapter just opened under ``issued`` (``stable_id``, from the rows)."""
        taken = self.registry.get(issued)  # up to date: the request waited for the queued writes
        live_elsewhere = (
            taken is not None
            and taken.state in (SessionState.LIVE, SessionState.RESUMING)
            and taken.instance_id != self.registry.instance_id
            and not self.registry.take_over_if_orphaned(issued)
        )
        stable = stable_id(issued, taken_here=self.table.get(issued) is not None, live_elsewhere=live_elsewhere)
        if stable != issued:
            log.info("session %s: the adapter's id is taken by another session; known as %s", issued, stable)
        elif taken is not None and taken.state is not SessionState.CLOSED:
            log.info("session %s: issued again by the adapter; the older session of that id is replaced", issued)
        return stable

    def _auth_method(self) -> str | None:
        obj = jsonrpc.decode_object(self.pool.auth_params) or {}
        method = obj.get("methodId")
        return method if isinstance(method, str) else None

    async def adopt(self, msg: Message, session_id: str) -> None:
        """A load/resume of a session the registry does not know (or closed): the adapter may have it."""
        await self.registry.caught_up()  # as for ``new``
        adapter = await self._prepared_for(msg)
        if adapter is None:
            return
        backend = adapter.backend
        adapter.assign(session_id)
        caps = adapter.capabilities
        if msg.method == Method.RESUME and not caps.resume and caps.load:
            # The proxy advertised resume on the strength of load: load it, without the replay.
            adapter.tenancy.swallow(True)
            try:
                answer = await self.pool.call_answer(adapter, Method.LOAD, msg.params)
            except ProxyError as exc:
                adapter.release_to_spare()  # also ends the swallowing if no answer ever came
                await self.gateway.fail(msg.id, exc)
                return
            if answer.error is not UNSET:
                adapter.release_to_spare()
                await self.gateway.send(jsonrpc.with_id(answer, msg.id))  # type: ignore[arg-type]
                return
            self._register(session_id, backend, adapter, msg.params)
            await self.gateway.answer(msg.id, answer.result if answer.result is not UNSET else {})
            return

        def adopted(answer: Message) -> None:
            if answer.error is not UNSET:
                adapter.release_to_spare()
                return
            self._register(session_id, backend, adapter, msg.params)

        await self._send_first(adapter, msg, adopted)

    async def fork(self, msg: Message, session_id: str) -> None:
        """``session/fork``: made on the parent's process (only it is sure to hold all of the parent),
        which then serves the fork; the parent is suspended, and comes back on a process of its
        own when next used, as any suspended session. In the parent's queue, after its turn."""
        parent = await self.table.find(session_id)
        if parent is None:
            await self._fail_unknown(msg.id, session_id)
            return
        self.table.enqueue(parent, Work.FORK, lambda: self._fork_when_ready(parent, msg))

    async def _fork_when_ready(self, parent: Session, msg: Message) -> None:
        if parent.closed:
            await self._fail_unknown(msg.id, parent.session_id)
            return
        known = self.pool.known_capabilities.get(parent.record.backend)
        if parent.live_adapter is None and known is not None and not known.fork:
            # Not worth a restore: the backend would only answer that it does not fork.
            await self.gateway.fail(msg.id, ProxyError.fork_unsupported(parent.session_id, parent.record.backend))
            return
        try:
            adapter = await self._ensure_live(parent)
        except ProxyError as exc:
            await self.gateway.fail(msg.id, exc)
            return
        if adapter is None or parent.closed:
            await self._fail_unknown(msg.id, parent.session_id)
            return
        await self.registry.caught_up()  # the fork's row is made from the parent's, in a callback
        answered = anyio.Event()

        def forked(answer: Message) -> Message | None:
            answered.set()
            fork_id = session_of(answer.result) if answer.error is UNSET else None
            if fork_id is None:
                return None
            return answered_as(answer, fork_id, self._take_over_for_fork(parent, adapter, fork_id, msg.params))

        call_id: int | None = None
        with anyio.CancelScope() as scope:
            self.table.restoring(parent, scope)  # a close or delete of the parent cuts the fork short
            try:
                await adapter.until_answered()  # the parent's turn ends before its process changes hands
                if not (adapter.gone or parent.closed or parent.adapter is not adapter):
                    call_id = await adapter.forward(msg, forked)
                    await adapter.answered.until(
                        lambda: answered.is_set() or adapter.gone or call_id not in adapter.pending
                    )
            finally:
                self.table.restoring(parent, None)
        if answered.is_set():
            return
        if call_id is not None and adapter.take_pending(call_id) is None:
            return  # answered for: the relay failed what the process owed when it exited
        # Never sent, or sent and given up: the process exited, or the parent was closed meanwhile.
        if parent.closed:
            await self._fail_unknown(msg.id, parent.session_id)
        else:
            await self.gateway.fail(msg.id, self.pool.gone_error(adapter))

    def _take_over_for_fork(self, parent: Session, adapter: Adapter, fork_id: str, params: Raw | UnsetType) -> str:
        """The fork's row (parent recorded, ownership inherited unless given) and its process: the parent's."""
        record = self.registry.get(parent.session_id) or parent.record  # up to date: see ``_fork_when_ready``
        given = jsonrpc.decode_object(params) or {}
        meta = proxy_meta(params)
        inherited = record.ownership
        ownership = (
            ownership_from(meta)
            if any(key in meta for key in ("sessionKey", "ownerSessionKey", "spawnedBy", "parentSessionKey"))
            else Ownership(
                owner_session_key=inherited.owner_session_key,
                spawned_by=inherited.session_key,
                parent_session_key=inherited.session_key,
                agent_id=inherited.agent_id,
            )
        )
        stable = self._stable_for(fork_id)
        directories = given.get("additionalDirectories")
        fork = SessionRecord(
            session_id=stable,
            adapter_session_id=fork_id,
            backend=record.backend,
            cwd=str(given.get("cwd", record.cwd)),
            mcp_servers=jsonrpc.encode_json(given["mcpServers"]).decode()
            if "mcpServers" in given
            else record.mcp_servers,
            additional_directories=record.additional_directories
            if directories is None
            else jsonrpc.encode_json(directories).decode(),
            lease_id=adapter.supervised.lease.lease_id,
            settings=record.settings,
            auth_method=record.auth_method,
            ownership=ownership,
            parent_session_id=parent.session_id,
        )
        created = self.registry.create(fork)
        if parent.adapter is not adapter or adapter.gone:  # its process is going: the fork starts suspended
            self.registry.mark_suspended(created.session_id)
            return stable
        if not self.table.accepts(parent, Event.HANDED_OVER):
            # The parent is being closed or deleted: its reap ends this process, so the fork starts suspended.
            self.registry.mark_suspended(created.session_id)
            return stable
        self.table.advance(parent, Event.HANDED_OVER)
        self.registry.mark_suspended(parent.session_id)
        self.table.open(created, adapter, fork_id)
        log.info(
            "session %s forked as %s on pid %s, which serves the fork from now on; %s suspended, resumable",
            parent.session_id,
            stable,
            adapter.pid,
            parent.session_id,
            extra=ids(session=stable, lease=adapter.supervised.lease.lease_id),
        )
        return stable
