"""The gateway connection: what the gateway sends, routed by one table, and the shutdown that ends it.

Three id spaces meet in the proxy. The gateway's ids are its own; each adapter
sees ids from its connection's counter (so the proxy's own requests never
collide with the gateway's); agent->client requests reach the gateway under ids
from the proxy's counter (``relay.adapters``). Every other byte passes through
unchanged: params, results, ``_meta``, unknown methods and ``_``-extensions.

A request is routed by ``ROUTES`` (method -> handler); a request for a session
goes to the sessions' intents; anything else goes to a process of the pool.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Awaitable, Callable
from typing import Final

import anyio
import anyio.abc
from msgspec import UNSET

from acp_proxy import journal
from acp_proxy.concurrency import Background, Stopping, state_failed
from acp_proxy.config import BackendConfig, Config
from acp_proxy.pool.adapter import Adapter, AdapterGone
from acp_proxy.pool.processes import Answer, ProcessPool
from acp_proxy.protocol import jsonrpc
from acp_proxy.protocol.acp import offered_initialize, proxy_meta, session_of, target_request
from acp_proxy.protocol.errors import ProxyError
from acp_proxy.protocol.jsonrpc import BadLine, Kind, LineReader, Message
from acp_proxy.protocol.methods import Method, routed_by_session
from acp_proxy.relay.adapters import AdapterRelay, decoded_lines, preview
from acp_proxy.relay.attached import Links
from acp_proxy.relay.sharing import Sharing
from acp_proxy.relay.writer import SHUTDOWN_WRITE_GRACE, GatewayWriter
from acp_proxy.sessions.intents import SessionIntents
from acp_proxy.sessions.registry import SessionRegistry
from acp_proxy.tasks.turns import TurnBook

log = logging.getLogger("acp_proxy.proxy")

Route = Callable[["GatewayConnection", Message], Awaitable[None]]


class GatewayConnection:
    """Serves one gateway: reads its lines, routes each message, and shuts the proxy down when it leaves."""

    def __init__(
        self,
        config: Config,
        *,
        pool: ProcessPool,
        intents: SessionIntents,
        relay: AdapterRelay,
        turns: TurnBook,
        registry: SessionRegistry,
        writer: GatewayWriter,
        background: Background,
        stopping: Stopping,
        sharing: Sharing,
        links: Links,
    ) -> None:
        self.config = config
        self.sharing = sharing
        """The clients attached to this proxy's sessions (``session/attach`` from elsewhere)."""
        self.links = links
        """The sessions of other proxies this gateway is attached to."""
        self.pool = pool
        self.intents = intents
        self.relay = relay
        self.turns = turns
        self.registry = registry
        self.writer = writer
        self.background = background
        self.stopping = stopping
        self._reading = anyio.CancelScope()

    # --- lifecycle ----------------------------------------------------------------------------

    async def run(self, gateway_in: anyio.abc.ByteReceiveStream) -> None:
        """Serve until the gateway closes its end or ``stop`` is called, then shut down."""
        with self._reading:
            await self._read(LineReader(gateway_in, self.config.max_line_bytes))
        if self.stopping.reason is None:
            log.info("gateway closed its input: shutting down")
        await self._shutdown()

    def stop(self, reason: str) -> None:
        """Stop reading from the gateway and shut down (signal handlers call this)."""
        self.stopping.begun = True
        self.pool.refuse()
        if self.stopping.reason is None:
            self.stopping.reason = reason
            log.info("%s: shutting down", reason)
        self._reading.cancel()

    async def _shutdown(self) -> None:
        """Answer what is in flight, then suspend every session (state kept, processes reaped).

        On gateway EOF each adapter gets its stdin grace to answer on its own, and
        those answers are still relayed. On a signal the gateway is waiting, so
        in-flight requests are answered at once.
        """
        self.stopping.begun = True
        shutdown = self.config.shutdown
        with anyio.CancelScope(shield=True):
            if not self.stopping.refusing:
                # Gateway EOF: what it sent before leaving is still served, for a while (a client
                # may pipe in its requests and read the answers after closing its end). Requests
                # already with an adapter get its stdin grace to be answered before its stdin is
                # closed, so that an adapter that ends by itself meanwhile is told apart from one
                # that ends because the proxy stopped it.
                with anyio.move_on_after(shutdown.stdin_grace + SHUTDOWN_WRITE_GRACE):
                    await self.background.wait_idle()
                with anyio.move_on_after(shutdown.stdin_grace):
                    await self._until_answered()
                await self._close_at_eof()  # on_eof = "close": the sessions this gateway leaves are closed
            self.pool.refuse()  # requests still waiting for a process slot give up (proxy_shutdown)
            await self.pool.processes.stop_warm()
            await self.links.close_all()
            if self.stopping.reason is not None:
                for adapter in list(self.pool.processes.running):
                    await self.relay.fail_calls(adapter.take_gateway_calls(), ProxyError.proxy_shutdown())
            await self.pool.processes.stop_all()
            # Requests still being handled (waiting for a slot, a resume in progress) now fail
            # fast and are answered; anything they started meanwhile is stopped too.
            with anyio.move_on_after(SHUTDOWN_WRITE_GRACE + shutdown.term_grace):
                await self.background.wait_idle()
            await self.pool.processes.stop_all()
            if self.stopping.reason is None:  # gateway EOF: sessions opened while it shut down are its too (on_eof)
                await self._close_at_eof()
            self.turns.settle_leftovers("acp-proxy shut down before the turn was answered")
            self.turns.write_settled()
            if self.turns.unwritten:
                self.turns.retry_unwritten()  # a last try; what still fails is swept "lost" by the next start
            suspended = await self.registry.suspend_all_of_this_instance()
            if suspended:
                log.info("suspended %d session(s); the next proxy resumes them on demand", suspended)
                self.pool.journal.record(
                    journal.Kind.SUSPENDED,
                    label=journal.SuspendReason.SHUTDOWN,
                    count=suspended,
                    detail=f"{suspended} session(s) suspended at shutdown ({self.stopping.reason or 'gateway left'})",
                )
            await self.registry.db.drain_writer()  # every queued write applied (or logged) before exit

    async def _close_at_eof(self) -> None:
        """``SessionIntents.close_at_eof``, bounded by a close's own time and its tree's graces."""
        shutdown = self.config.shutdown
        with anyio.move_on_after(shutdown.close_timeout + shutdown.stdin_grace + shutdown.term_grace):
            await self.intents.close_at_eof()

    async def _until_answered(self) -> None:
        """Until every request the gateway sent to an adapter is answered (or its adapter is gone)."""
        for adapter in list(self.pool.processes.running):
            await adapter.until_answered()

    # --- reading ------------------------------------------------------------------------------

    async def _read(self, reader: LineReader) -> None:
        db = self.registry.db
        while True:
            # Backpressure: while the state writer is behind (a database locked for long), no
            # new request is read, so its queue stays bounded and no task row is dropped.
            await db.room()
            try:
                batch = await reader.receive_batch()
            except anyio.EndOfStream:
                return
            if self.writer.trace is not None:
                self.writer.trace.lines("gateway>proxy", batch.block)
            for _ in range(batch.overlong):
                await self.writer.send(ProxyError.line_too_long(self.config.max_line_bytes).response(None))
            for line, decoded in decoded_lines(batch):
                if isinstance(decoded, BadLine):
                    log.warning("gateway sent an invalid message: %s", preview(line))
                    await self.writer.send(jsonrpc.bad_line_response(decoded, line))
                    continue
                msg, kind = decoded
                if kind is not Kind.RESPONSE and not jsonrpc.params_structured(msg.params):
                    log.warning("gateway sent params that are neither an object nor an array: %s", preview(line))
                    error = ProxyError.invalid_request("params must be an object or an array")
                    await self.writer.fail(msg.id, error)
                    continue
                try:
                    if kind is Kind.REQUEST:
                        await self._route_request(msg)
                    elif kind is Kind.NOTIFICATION:
                        await self._route_notification(msg, line)
                    elif not (self.links.by_upstream and await self.links.answer(msg)):
                        await self.relay.answer_from_gateway(msg)
                except sqlite3.Error as exc:
                    state_failed(self.registry.db.path, exc)
                    if kind is Kind.REQUEST and msg.id is not None:
                        await self.writer.fail(msg.id, ProxyError.state_error(exc))

    # --- requests -----------------------------------------------------------------------------

    async def _route_request(self, msg: Message) -> None:
        assert isinstance(msg.method, str)
        if self.links.links and msg.method != Method.ATTACH and self.links.holds(session_of(msg.params)):
            await self.links.request(msg, session_of(msg.params))  # type: ignore[arg-type]
            return
        route = ROUTES.get(msg.method)
        if route is not None:
            await route(self, msg)
        elif routed_by_session(msg.method):
            session_id = await self._session_id_or_fail(msg)
            if session_id is not None:
                await self.intents.forward(msg, session_id)
        elif (session_id := session_of(msg.params)) is not None:
            await self.intents.forward(msg, session_id)  # a method the table does not know, for a session
        elif (adapter := self.pool.processes.any_adapter()) is not None:
            await adapter.forward(msg)  # in order, as a session's request is: no task of its own
        else:
            self.background.start(lambda: self._started(msg, self.pool.default_backend, prepare=True))

    async def _session_id_or_fail(self, msg: Message) -> str | None:
        session_id = session_of(msg.params)
        if session_id is None:
            message = f"Invalid params: {msg.method} needs params.sessionId, a string"
            await self.writer.fail(msg.id, ProxyError.invalid_params(message))
        return session_id

    async def _initialize(self, msg: Message) -> None:
        msg.params = self.pool.client_init = offered_initialize(msg.params)
        self.background.start(lambda: self._to_spare(msg, self.pool.default_backend))

    async def _authenticate(self, msg: Message) -> None:
        self.background.start(lambda: self._to_spare(msg, self.pool.default_backend))

    async def _new(self, msg: Message) -> None:
        self.background.start(lambda: self.intents.new(msg))

    async def _list(self, msg: Message) -> None:
        await self.intents.list_sessions(msg)

    async def _status(self, msg: Message) -> None:
        """``session/status`` (unstable): from the install's state, beside whatever the session is doing."""
        session_id = await self._session_id_or_fail(msg)
        if session_id is not None:
            self.background.start(lambda: self.intents.status(msg, session_id))

    async def _close(self, msg: Message) -> None:
        session_id = await self._session_id_or_fail(msg)
        if session_id is not None:
            self.sharing.session_ended(session_id, "closed")
            await self.intents.close(session_id, msg)  # ordered now; the work queues behind the session's

    async def _delete(self, msg: Message) -> None:
        session_id = await self._session_id_or_fail(msg)
        if session_id is not None:
            self.sharing.session_ended(session_id, "deleted")
            self.sharing.transcripts.forget(session_id)
            await self.intents.delete(msg, session_id)  # ordered now, like a close

    async def _prompt(self, msg: Message) -> None:
        """``session/prompt``: to the session, in turn with its attached controllers' when it is shared."""
        session_id = await self._session_id_or_fail(msg)
        if session_id is None:
            return
        if self.sharing.shared(session_id):

            def reply(data: bytes) -> None:
                self.background.start(lambda: self.writer.send(data))

            self.sharing.prompt(session_id, msg, self.sharing.gateway_client, reply)
            return
        self.sharing.prompted(session_id, msg.params, self.sharing.gateway_client)  # type: ignore[arg-type]
        await self.intents.forward(msg, session_id)

    async def _attach(self, msg: Message) -> None:
        """``session/attach`` (ACP's draft RFD): to the proxy that holds the session."""
        session_id = await self._session_id_or_fail(msg)
        if session_id is not None:
            self.background.start(lambda: self.links.attach(msg, session_id))

    async def _claim(self, msg: Message) -> None:
        """``session/claim_permission`` by the gateway, for a session of this proxy (``Sharing.claim``)."""
        session_id = await self._session_id_or_fail(msg)
        if session_id is None:
            return
        try:
            claimed = self.sharing.claim(
                session_id, jsonrpc.decode_object(msg.params) or {}, self.sharing.gateway_client
            )
        except ProxyError as exc:
            await self.writer.fail(msg.id, exc)
            return
        await self.writer.answer(msg.id, claimed)

    async def _detach(self, msg: Message) -> None:
        """``session/detach`` of a session this gateway did not attach to (an attached one's goes to its holder)."""
        session_id = await self._session_id_or_fail(msg)
        if session_id is not None:
            await self.writer.fail(msg.id, ProxyError.invalid_params(f"not attached to session {session_id}"))

    async def _load_or_resume(self, msg: Message) -> None:
        session_id = await self._session_id_or_fail(msg)
        if session_id is not None:
            await self.intents.resume(msg, session_id)

    async def _logout(self, msg: Message) -> None:
        self.background.start(lambda: self._logout_everywhere(msg))

    async def _logout_everywhere(self, msg: Message) -> None:
        """``logout``: to every live process of the backend, each bounded by ``resume_timeout``; one
        answer, the first error if any, else the first result. With none running, to a new one."""
        try:
            backend = self.intents.backend_named(proxy_meta(msg.params))
        except ProxyError as exc:
            await self.writer.fail(msg.id, exc)
            return
        self.pool.auth_params = UNSET  # from now on, no process is authenticated with what the gateway gave
        live = self.pool.processes.serving(backend)  # spares included
        if not live:
            await self._started(msg, backend, prepare=True)
            return
        answers: list[Message | ProxyError] = []

        async def logout(adapter: Adapter) -> None:
            try:
                answers.append(await self.pool.call_answer(adapter, Method.LOGOUT, msg.params))
            except ProxyError as exc:
                answers.append(exc)

        async with anyio.create_task_group() as tasks:
            for adapter in live:
                tasks.start_soon(logout, adapter)
        failed = [a for a in answers if isinstance(a, ProxyError) or a.error is not UNSET]
        answer = failed[0] if failed else answers[0]
        if isinstance(answer, ProxyError):
            await self.writer.fail(msg.id, answer)
        else:
            await self.writer.send(jsonrpc.with_id(answer, msg.id))  # type: ignore[arg-type]
        log.info("logout sent to %d %s process(es); %d failed", len(live), backend.name, len(failed))

    async def _fork(self, msg: Message) -> None:
        session_id = await self._session_id_or_fail(msg)
        if session_id is not None:
            await self.intents.fork(msg, session_id)

    async def _to_spare(self, msg: Message, backend: BackendConfig) -> None:
        """``initialize`` / ``authenticate``: to the spare process, started for it if need be."""
        on_answer: Answer | None = None
        if msg.method == Method.AUTHENTICATE:

            def remember(answer: Message) -> None:
                if answer.error is UNSET:
                    self.pool.auth_params = msg.params

            on_answer = remember
        adapter = self.pool.processes.spare(backend)
        if adapter is None:
            await self._started(msg, backend, prepare=msg.method != Method.INITIALIZE, on_answer=on_answer)
        else:
            await adapter.forward(msg, on_answer)

    async def _started(
        self, msg: Message, backend: BackendConfig, *, prepare: bool, on_answer: Answer | None = None
    ) -> None:
        """A request no process is there for: to a new process, under its start deadline (an error answered)."""
        try:
            await self.pool.start_for(msg, backend, prepare=prepare, on_answer=on_answer)
        except ProxyError as exc:
            await self.writer.fail(msg.id, exc)

    # --- notifications ------------------------------------------------------------------------

    async def _route_notification(self, msg: Message, line: bytes) -> None:
        if msg.method == Method.CANCEL_REQUEST:
            if self.links.links or self.sharing.gateway_prompts:
                ok, target = target_request(msg.params)
                if ok and await self.links.cancel_request(target):
                    return
                taking_turns = self.sharing.gateway_prompts.get(jsonrpc.id_key(target)) if ok else None
                if taking_turns is not None:
                    await self.sharing.cancel_prompt(*taking_turns)
                    return
            await self.relay.cancel_request_from_gateway(msg, line)
            return
        session_id = session_of(msg.params)
        if self.links.links and self.links.holds(session_id):
            await self.links.notify(msg, line, session_id)  # type: ignore[arg-type]
            return
        if session_id is None and routed_by_session(str(msg.method)):
            log.info("dropped %s: its params name no session", msg.method)
            return
        session = self.intents.table.get(session_id) if session_id is not None else None
        if msg.method == Method.CANCEL and session is not None:  # forwarded by the intent, never reaps
            if session_id is not None and self.sharing.shared(session_id):
                self.sharing.cancel_queued(session_id)
            await self.intents.cancel(session, by="the gateway", notification=(msg, line))
            return
        adapter: Adapter | None
        if session is not None and session.live_adapter is not None:
            adapter = session.live_adapter
        elif session_id is None:
            adapter = self.pool.processes.any_adapter()
        else:
            log.info("dropped %s for session %s: it has no live process", msg.method, session_id)
            return
        if adapter is None or adapter.gone:
            log.info("dropped %s: no adapter is running", msg.method)
            return
        try:
            await adapter.pass_on(msg, line)
        except AdapterGone:
            log.info("dropped %s: the adapter has exited", msg.method)


ROUTES: Final[dict[str, Route]] = {
    Method.INITIALIZE: GatewayConnection._initialize,
    Method.AUTHENTICATE: GatewayConnection._authenticate,
    Method.NEW: GatewayConnection._new,
    Method.LIST: GatewayConnection._list,
    Method.STATUS: GatewayConnection._status,
    Method.CLOSE: GatewayConnection._close,
    Method.DELETE: GatewayConnection._delete,
    Method.FORK: GatewayConnection._fork,
    Method.LOGOUT: GatewayConnection._logout,
    Method.LOAD: GatewayConnection._load_or_resume,
    Method.RESUME: GatewayConnection._load_or_resume,
    Method.PROMPT: GatewayConnection._prompt,
    Method.ATTACH: GatewayConnection._attach,
    Method.DETACH: GatewayConnection._detach,
    Method.CLAIM_PERMISSION: GatewayConnection._claim,
}
"""The requests the proxy handles itself. Any other request naming a session is forwarded to it
(``SessionIntents.forward``; ``session/prompt``, the settings, unknown ones);
one naming none goes to a process of the pool."""
