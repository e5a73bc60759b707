"""Bringing a suspended session back on a fresh adapter: the restore strategy.

spawn -> ``initialize`` (the gateway's params) -> ``authenticate`` (if it did) ->
``session/resume`` -> ``session/load`` -> ``session/new`` (per strategy, capability
and what the install has learned of the backend), each giving way to the next only
on the error classes that say the adapter cannot restore it that way -> re-apply
mode and config options, and say so in the answer. Which requests to try and when
to give way are pure functions in ``pool.plan``; what the install learns (the method
that worked, those refused as unsupported) is kept by ``pool.learned``.
"""

from __future__ import annotations

import logging
import time
from typing import Final, Protocol

import anyio
import msgspec
from msgspec import UNSET, Raw, UnsetType

from acp_proxy.config import BackendConfig, Config
from acp_proxy.journal import Kind, SuspendReason
from acp_proxy.logs import ids
from acp_proxy.ownership.leases import last_command_of
from acp_proxy.pool.adapter import Adapter
from acp_proxy.pool.learned import Learned, command_of
from acp_proxy.pool.plan import falls_back, refused_as_unsupported, restore_order
from acp_proxy.pool.processes import ProcessPool
from acp_proxy.protocol import jsonrpc
from acp_proxy.protocol.acp import history_reset_update, session_of
from acp_proxy.protocol.errors import ProxyError
from acp_proxy.protocol.jsonrpc import Message, RequestId
from acp_proxy.protocol.methods import Method
from acp_proxy.protocol.settings import reflect_setting
from acp_proxy.sessions.lifecycle import Event
from acp_proxy.sessions.machine import HeldBy
from acp_proxy.sessions.registry import SessionRecord, SessionRegistry, SessionState
from acp_proxy.sessions.table import Session, SessionTable
from acp_proxy.timings import Timing

log = logging.getLogger("acp_proxy.lifecycle")

RELEASE_WAIT: Final = 5.0
"""How long a failed restore waits for its released claim to be written before it answers."""


class Suspend(Protocol):
    """``SessionIntents.suspend``, as a restore that proved its process broken calls it."""

    def __call__(self, session_id: str, why: str, reason: SuspendReason, *, even_if_busy: bool = False) -> bool: ...


class GatewayPort(Protocol):
    """What the sessions may send the gateway: the relay's writer implements it."""

    async def send(self, data: bytes) -> None: ...

    async def answer(self, request_id: RequestId | UnsetType, result: object) -> None: ...

    async def fail(self, request_id: RequestId | UnsetType, error: ProxyError) -> None: ...

    async def reply(self, request_id: RequestId | UnsetType, data: bytes) -> None: ...


class Restorer:
    """Restores sessions onto fresh processes of the pool."""

    def __init__(
        self,
        config: Config,
        registry: SessionRegistry,
        table: SessionTable,
        pool: ProcessPool,
        gateway: GatewayPort,
    ) -> None:
        self.config = config
        self.registry = registry
        self.table = table
        self.pool = pool
        self.gateway = gateway
        self.learned = Learned(pool.journal.db)

    async def restore_cancellable(self, session: Session, gateway_asked: str | None) -> Message | None:
        """``restore``, cut short (``None``) if a ``session/close`` arrives meanwhile."""
        with anyio.CancelScope() as scope:
            self.table.restoring(session, scope)
            try:
                return await self.restore(session, gateway_asked)
            finally:
                self.table.restoring(session, None)
        return None

    async def restore(self, session: Session, gateway_asked: str | None = None) -> Message:
        """Bring ``session`` back on a fresh adapter; the answer of the restoring request.

        A timeout or any other failure stops the new process and leaves the session
        suspended (or closed, for a reopen), mapping kept (``ProxyError``).
        """
        self.table.advance(session, Event.RESTORE)
        try:
            return await self._bring_back(session, gateway_asked)
        except BaseException:
            # Not once it is live: a failure after it was bound is not the restore's to undo.
            if self.table.accepts(session, Event.RESTORE_FAILED):
                self.table.advance(session, Event.RESTORE_FAILED)
            raise

    async def _bring_back(self, session: Session, gateway_asked: str | None) -> Message:
        if session.stopping is not None:  # its previous process must be gone before another starts
            await session.stopping.wait()
        gone_within = self.config.shutdown.gone_within
        if not await self.pool.admission.until_gone_elsewhere(session.session_id, gone_within):  # another proxy's
            log.warning(
                "session %s: the process another proxy served it on was still there after %gs; restoring anyway",
                session.session_id,
                gone_within,
                extra=ids(session=session.session_id),
            )
        record = await self.registry.current(session.session_id) or session.record
        self.table.refresh(session, record)
        backend = self.config.backends.get(record.backend) or self._same_command(record)
        if backend is None:
            raise ProxyError.backend_gone(record.session_id, record.backend)
        started = time.monotonic()
        # A resume that does not take leaves the session as it was: suspended, or closed.
        was = SessionState.CLOSED if record.state is SessionState.CLOSED else SessionState.SUSPENDED
        reopen = gateway_asked is not None  # only the gateway's own load or resume reopens a closed session
        if was is SessionState.CLOSED and not reopen:
            raise ProxyError.session_closed(record.session_id)
        if not await self.registry.mark_resuming(record.session_id, reopen=reopen):
            holder = await self.registry.held_by_another(record.session_id)
            if holder is not None:  # another proxy took it since this one last looked: it is held there
                self.table.advance(session, HeldBy(Event.HELD_ELSEWHERE, holder))
                raise ProxyError.session_in_use(record.session_id, holder)
            if not await self.registry.mark_resuming(record.session_id, reopen=reopen):  # its holder had died
                now = await self.registry.current(record.session_id)
                if now is not None and now.state is SessionState.CLOSED:  # closed meanwhile (keep_suspended)
                    raise ProxyError.session_closed(record.session_id)
                raise ProxyError.session_in_use(record.session_id)
        try:
            adapter = await self.pool.take(backend, session_key=record.session_id)
        except BaseException:
            await self._release_claim(record.session_id, was)
            raise
        adapter.assign(record.session_id, record.adapter_session_id)
        try:
            answer, adapter_session_id, restored_by = await self._restore(adapter, backend, record, gateway_asked)
            result = jsonrpc.decode_object(answer.result) or {}
            for method, params in record.settings:
                setting_params = msgspec.json.decode(params)
                setting = await self.pool.call_answer(
                    adapter, method, {**setting_params, "sessionId": adapter_session_id}
                )
                if setting.error is not UNSET:
                    log.warning("session %s: %s not re-applied: %s", record.session_id, method, setting.error.message)
                else:
                    reflect_setting(result, method, setting_params, jsonrpc.decode_object(setting.result) or {})
        except BaseException:
            with anyio.CancelScope(shield=True):
                adapter.assign(None)
                await self._release_claim(record.session_id, was)
                await self.pool.processes.stop(adapter)
            raise
        # Bound in the same step as the row is written: a close from here on finds it live, and reaps it.
        self.registry.mark_live(record.session_id, adapter.supervised.lease.lease_id, adapter_session_id)
        self.table.bind(session, adapter, adapter_session_id)
        self.table.refresh(session, await self.registry.current(record.session_id) or record)
        took = time.monotonic() - started
        log.info(
            "session %s %s on pid %s in %.0f ms",
            record.session_id,
            "resumed" if adapter_session_id == record.adapter_session_id else "started afresh",
            adapter.pid,
            took * 1000,
            extra=ids(session=record.session_id, lease=adapter.supervised.lease.lease_id, backend=backend.name),
        )
        self.pool.timings.observe(Timing.RESTORE, backend.name, took, restored_by)
        self.pool.journal.record(
            Kind.RESUMED,
            backend=backend.name,
            label=restored_by,
            session_id=record.session_id,
            seconds=took,
            detail=f"{restored_by} on pid {adapter.pid} in {took * 1000:.0f} ms",
        )
        # What the gateway is answered (when it asked for the load or resume itself): its own id,
        # and the settings as they are now, after re-applying them.
        if result.get("sessionId") == adapter_session_id:
            result["sessionId"] = record.session_id
        return Message(jsonrpc="2.0", result=Raw(jsonrpc.encode_json(result)))

    async def expect_answer(
        self, session: Session, adapter: Adapter, call_id: int, msg: Message, suspend: Suspend
    ) -> None:
        """The request a restore was for must be answered within ``start_timeout``, as it would be by a
        process started for it: a restored process that does not answer it is broken (a dead or stuck
        connection), and is recycled rather than reused. A prompt is not held to this (a turn's limits
        are ``turn_timeout`` and ``turn_idle_timeout``), nor an extension method (``_vendor/...``:
        its time is its own), nor a process that runs a turn meanwhile."""
        timeout = self.pool.start_timeout(adapter.backend)
        if timeout == float("inf"):
            return
        with anyio.move_on_after(timeout):
            await adapter.until_call_answered(call_id)
        if adapter.gone or call_id not in adapter.pending or session.live_adapter is not adapter:
            return
        if adapter.tenancy.turn is not None:  # a turn runs there: its own limits judge the process
            log.warning(
                "session %s: pid %s has not answered %s within start_timeout (%gs) after a restore; "
                "a turn runs there, so it is kept",
                session.session_id,
                adapter.pid,
                msg.method,
                timeout,
                extra=ids(session=session.session_id),
            )
            return
        call = adapter.take_pending(call_id)
        assert call is not None
        why = f"pid {adapter.pid} did not answer {msg.method} within start_timeout ({timeout:g}s) after a restore"
        log.warning(
            "session %s: %s: a broken process, recycled", session.session_id, why, extra=ids(session=session.session_id)
        )
        adapter.tenancy.mute()
        suspend(session.session_id, why, SuspendReason.BROKEN, even_if_busy=True)
        await self.gateway.fail(
            call.gateway_id, ProxyError.start_timeout(str(msg.method), adapter.backend.name, timeout)
        )

    def _same_command(self, record: SessionRecord) -> BackendConfig | None:
        """The configured backend that runs the command the session's own (no longer configured) backend ran:
        a zero-config backend named after the agent and a config's backend of another name are one agent."""
        command = last_command_of(self.registry.db, record.backend)
        same = next((b for b in self.config.backends.values() if command is not None and b.command == command), None)
        if same is not None:
            log.info(
                "session %s: backend %r is not configured; restored by backend %r, which runs the same command",
                record.session_id,
                record.backend,
                same.name,
                extra=ids(session=record.session_id),
            )
            self.registry.note_backend(record.session_id, same.name)
        return same

    async def _release_claim(self, session_id: str, was: SessionState) -> None:
        """The claim given back, on record before whoever asked is told the restore failed (bounded)."""
        self.registry.release_claim(session_id, was)
        with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_WAIT):
            await self.registry.caught_up()

    async def _restore(
        self, adapter: Adapter, backend: BackendConfig, record: SessionRecord, gateway_asked: str | None
    ) -> tuple[Message, str, str]:
        """Run the restoring requests in ``restore_order`` until one takes; its answer, the adapter's id
        for the session, and the method that restored it."""
        caps = adapter.capabilities
        command = command_of(backend)
        known = self.learned.facts(backend.name, command)
        order = restore_order(
            backend.resume,
            can_resume=caps.resume,
            can_load=caps.load,
            gateway_asked=gateway_asked,
            worked=known.restore_method,
            unsupported=known.unsupported,
        )
        if not order:
            raise ProxyError.resume_disabled(record.session_id, backend.name)
        params = record.restore_params()
        last_failure: tuple[str, int, str] | None = None
        for method in order:
            if method == Method.NEW:
                break
            adapter.tenancy.swallow(not (method == Method.LOAD and gateway_asked == Method.LOAD))
            try:
                restoring = {**params, "sessionId": record.adapter_session_id}
                answer = await self.pool.call_answer(adapter, method, restoring)
            finally:
                adapter.tenancy.swallow(False)
            if answer.error is UNSET:
                if method != known.restore_method:
                    self.learned.restored_with(backend.name, command, method)
                return answer, record.adapter_session_id, method
            code = answer.error.code
            if not falls_back(method, code):
                raise ProxyError.restore_failed(method, backend.name, answer.error)
            if refused_as_unsupported(code) and backend.resume == "auto":
                self.learned.unsupported(backend.name, command, method)
            log.warning(
                "session %s: %s failed with %d (%s); trying the next way",
                record.session_id,
                method,
                code,
                answer.error.message,
                extra=ids(session=record.session_id, backend=backend.name),
            )
            last_failure = (method, code, answer.error.message)
        if last_failure is not None:
            failed, code, message = last_failure
            self.pool.journal.record(
                Kind.FALLBACK,
                backend=backend.name,
                label=failed,
                session_id=record.session_id,
                detail=f"{failed} failed ({code}: {message}); history reset",
            )
        fresh = await self.pool.call(adapter, Method.NEW, params)
        new_id = session_of(fresh.result)
        if new_id is None:
            raise ProxyError.no_session_id(Method.NEW, backend.name)
        self.registry.note_history_reset(record.session_id, new_id)
        adapter.renamed(new_id)
        # The adapter could not restore the history: tell the gateway this session starts afresh.
        await self.gateway.send(jsonrpc.notification(Method.UPDATE, history_reset_update(record.session_id)))
        result = jsonrpc.decode_object(fresh.result) or {}
        result.pop("sessionId", None)
        return Message(jsonrpc="2.0", result=Raw(jsonrpc.encode_json(result))), new_id, Method.NEW
