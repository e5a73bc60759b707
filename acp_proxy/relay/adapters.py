"""Adapter -> gateway: each adapter's output relayed upstream, and the agent->client requests they make.

Agent->client requests reach the gateway under ids from the proxy's own counter
(so two adapters' requests never collide upstream) and their answers are mapped
back; ``$/cancel_request`` is mapped both ways, and a request-scoped
``elicitation/create`` names the gateway's request by the gateway's id. The hot path, a block of
``session/update`` notifications, is decoded with one call and written on as the
very block that was read.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import suppress
from typing import Final

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream
from msgspec import UNSET, Raw, UnsetType

from acp_proxy.concurrency import Background, Stopping
from acp_proxy.config import Config
from acp_proxy.pool.adapter import Adapter, AdapterGone, PendingCall
from acp_proxy.pool.processes import ProcessPool
from acp_proxy.pool.tenancy import busy
from acp_proxy.protocol import jsonrpc
from acp_proxy.protocol.acp import (
    SESSION_INFO_MARK,
    annotate_initialize,
    renamed_batch,
    reports_work,
    retarget_request,
    rewrite_session_id,
    session_info_of,
    session_of,
    target_request,
)
from acp_proxy.protocol.errors import ProxyError, describe_exit
from acp_proxy.protocol.jsonrpc import BadLine, Batch, Kind, Message
from acp_proxy.protocol.methods import Method
from acp_proxy.relay.sharing import Sharing
from acp_proxy.relay.upstream import AgentRequests
from acp_proxy.relay.writer import GatewayWriter
from acp_proxy.sessions.intents import SessionIntents
from acp_proxy.tasks.status import TaskStatus
from acp_proxy.tasks.turns import TurnBook

log = logging.getLogger("acp_proxy.proxy")

_LOGGED_LINE_BYTES: Final = 200


def preview(line: bytes) -> str:
    text = line[:_LOGGED_LINE_BYTES].decode("utf-8", "replace")
    return text + ("..." if len(line) > _LOGGED_LINE_BYTES else "")


def decoded_lines(batch: Batch) -> Iterator[tuple[bytes, tuple[Message, Kind] | BadLine]]:
    """Each line of a batch with its envelope; one decode call when the block allows."""
    msgs = jsonrpc.decode_block(batch.block, batch.count) if batch.block else None
    if msgs is None:
        for line in batch.lines:
            if line.strip():
                yield line, jsonrpc.decode_line(line)
        return
    for line, msg in zip(batch.lines, msgs, strict=True):
        kind = jsonrpc.classify(msg)
        yield line, (msg, kind) if kind is not None else BadLine.INVALID


def is_plain_notification_block(batch: Batch) -> bool:
    """True when every line is a notification the proxy forwards untouched.

    This is the streaming hot path: one decode call for the block, and the block
    is written on as it was read. ``$/cancel_request`` is checked on the decoded
    method names, so no escaping of the raw bytes can slip one past its id mapping.
    """
    if not batch.block:
        return False
    methods = jsonrpc.notification_methods(batch.block, batch.count)
    return methods is not None and Method.CANCEL_REQUEST not in methods


def permission_subject(msg: Message) -> str:
    """What a ``session/request_permission`` asks about: its tool call's title, if any."""
    params = jsonrpc.decode_object(msg.params) or {}
    tool_call = params.get("toolCall")
    title = tool_call.get("title") if isinstance(tool_call, dict) else None
    return title[:200] if isinstance(title, str) else ""


def gateway_scope(adapter: Adapter, params: Raw | UnsetType) -> Raw | UnsetType:
    """A request-scoped ``elicitation/create`` names a request of the gateway's by the id the
    adapter got it under: the gateway's own id instead.

    A request the gateway did not make (the proxy's own, or one already answered) has no id
    of the gateway's; that elicitation goes on as the adapter wrote it.
    """
    ok, target = target_request(params)
    call = adapter.pending.get(target) if ok and isinstance(target, int) else None
    if call is None or call.internal is not None:
        return params
    return retarget_request(params, call.gateway_id)


class AdapterRelay:
    """Relays every adapter's output to the gateway, and the gateway's answers to agent->client requests back."""

    def __init__(
        self,
        config: Config,
        pool: ProcessPool,
        turns: TurnBook,
        intents: SessionIntents,
        writer: GatewayWriter,
        background: Background,
        stopping: Stopping,
        sharing: Sharing,
        requests: AgentRequests,
    ) -> None:
        self.config = config
        self.background = background
        self.pool = pool
        self.sharing = sharing
        """The session's attached clients: what the gateway is sent about a session goes to them too."""
        self.requests = requests
        """Agent->client requests awaiting an answer, by their upstream id."""
        self.turns = turns
        self.intents = intents
        self.writer = writer
        self.stopping = stopping
        self._routed: list[tuple[Callable[[bytes], None], bytes]] = []
        """Answers of this batch to attached clients' requests (``GatewayWriter.routed``), delivered with it."""

    # --- the gateway's side of agent->client requests -----------------------------------------

    async def answer_from_gateway(self, msg: Message) -> None:
        """The gateway answered an agent->client request: hand it to the adapter that asked."""
        key = msg.id
        client = self.sharing.gateway_client
        if not isinstance(key, int) or not await self.sharing.hand_back(key, msg, client, from_gateway=True):
            log.info(
                "gateway answered request id %r, which waits no more (answered elsewhere, or unknown): dropped", key
            )

    async def cancel_request_from_gateway(self, msg: Message, line: bytes) -> None:
        """The gateway's ``$/cancel_request``: to the adapter running that request, or withdraw it if queued."""
        ok, target = target_request(msg.params)
        if not ok:
            return
        for adapter in list(self.pool.processes.running):
            call_id = adapter.find_gateway_call(target)
            if call_id is not None:
                data = jsonrpc.notification(Method.CANCEL_REQUEST, retarget_request(msg.params, call_id))
                with suppress(AdapterGone):
                    await adapter.send(data)
                return
        if not self.intents.withdraw(target):
            log.debug("$/cancel_request for an unknown request: %s", preview(line))

    # --- adapter -> gateway -------------------------------------------------------------------

    async def follow(self, started: MemoryObjectReceiveStream[Adapter]) -> None:
        """Relay the output of every adapter the pool starts, from its start on (until cancelled)."""
        async for adapter in started:
            self.background.start_task(self._relay, adapter)

    async def _relay(self, adapter: Adapter) -> None:
        reader = adapter.lines
        try:
            while True:
                try:
                    batch = await reader.receive_batch()
                except anyio.EndOfStream:
                    break
                if self.writer.trace is not None:
                    self.writer.trace.lines("agent>proxy", batch.block, pid=adapter.pid, backend=adapter.backend.name)
                if batch.overlong:
                    log.warning(
                        "adapter pid=%d wrote %d line(s) over %d bytes: dropped",
                        adapter.pid,
                        batch.overlong,
                        self.config.max_line_bytes,
                    )
                plain = (
                    not adapter.tenancy.swallow_updates
                    and not adapter.tenancy.muted
                    and is_plain_notification_block(batch)
                )
                relayed: Batch | None = batch
                if plain and adapter.rewrites_session:  # a restore fell back to session/new: another id
                    assert adapter.adapter_session is not None
                    assert adapter.gateway_session is not None
                    relayed = renamed_batch(batch, adapter.adapter_session, adapter.gateway_session)
                if plain and relayed is not None:
                    turn = adapter.tenancy.turn
                    if turn is not None and turn.status is TaskStatus.RUNNING:
                        turn.observe(relayed.block, relayed.count)  # titles included, as the turn reads it
                    elif adapter.gateway_session is not None:
                        self._between_turns(adapter, relayed.lines, relayed.block)
                    if adapter.gateway_session is not None:
                        self.sharing.saw(adapter.gateway_session, relayed.block, adapter.replaying)
                    await self.writer.send(relayed.block)
                    continue
                out: list[bytes] = []
                routed = self._routed
                record_first = False
                for line, decoded in decoded_lines(batch):
                    data, recorded = self._translate(adapter, line, decoded)
                    record_first = record_first or recorded
                    if data is not None:
                        out.append(data)
                if record_first:
                    # The session's row is on record before the gateway can use its id, a setting
                    # before the gateway counts on it (a crash right after the answer must not
                    # lose what a resume needs).
                    await self.intents.registry.caught_up()
                if routed:
                    for deliver, data in routed:
                        deliver(data)
                    routed.clear()
                if out:
                    await self.writer.send(b"".join(out))
                if self.turns.settled_unwritten:
                    self.turns.write_settled()  # the gateway has its answers: now their records
        finally:
            with anyio.CancelScope(shield=True):
                await self._adapter_gone(adapter)
                adapter.drained.set()

    def _translate(
        self, adapter: Adapter, line: bytes, decoded: tuple[Message, Kind] | BadLine
    ) -> tuple[bytes | None, bool]:
        """What to send the gateway for one adapter line (``None``: nothing), and whether it answers a
        request with bookkeeping (``on_answer``: a session's row, a setting a resume re-applies).

        Such an answer is sent once what its bookkeeping queued is written, so that a proxy killed
        right after answering cannot lose it. Prompts have none: a turn never waits for a write.
        """
        if isinstance(decoded, BadLine):
            log.warning("adapter pid=%d wrote non-JSON-RPC to stdout, skipped: %s", adapter.pid, preview(line))
            return None, False
        msg, kind = decoded
        if adapter.tenancy.muted and kind is not Kind.RESPONSE:
            return None, False  # the proxy has answered its turn for it: what it says now is too late
        if kind is not Kind.RESPONSE and adapter.rewrites_session:
            assert adapter.adapter_session is not None
            assert adapter.gateway_session is not None
            rewritten = rewrite_session_id(msg.params, adapter.adapter_session, adapter.gateway_session)
            if rewritten is not msg.params:
                msg.params = rewritten
                line = jsonrpc.encode(msg).rstrip(b"\n")
        if kind is Kind.NOTIFICATION:
            return self._notification(adapter, msg, line), False
        if kind is Kind.REQUEST:
            return self._request(adapter, msg), False
        return self._response(adapter, msg)

    def _notification(self, adapter: Adapter, msg: Message, line: bytes) -> bytes | None:
        if msg.method == Method.UPDATE:
            if adapter.tenancy.swallow_updates:
                return None
            turn = adapter.tenancy.turn
            if turn is not None and turn.status is TaskStatus.RUNNING:
                turn.observe(line, 1)
            elif adapter.gateway_session is not None:
                self._between_turns(adapter, [line], line)
        if msg.method != Method.CANCEL_REQUEST:
            if adapter.gateway_session is not None:
                self.sharing.saw(adapter.gateway_session, line, adapter.replaying)
            return line + b"\n"
        ok, target = target_request(msg.params)
        upstream = self.requests.find(adapter, target) if ok else None
        if upstream is None:
            return None
        self.requests.no_longer_waited_for(upstream)
        self.sharing.withdrawn(upstream)
        return jsonrpc.notification(Method.CANCEL_REQUEST, retarget_request(msg.params, upstream))

    def _between_turns(self, adapter: Adapter, lines: list[bytes], block: bytes) -> None:
        """Updates with no turn running: if they report work, the session is busy for ``quiet_after``
        (the replay of a load is history, not work); a title is recorded at once. (During a turn,
        the turn reads both where it reads its tool calls.)"""
        if adapter.tenancy.turn is None and not adapter.replaying and any(reports_work(line) for line in lines):
            adapter.heard_working(self.config.pool.quiet_after)
        if SESSION_INFO_MARK in block:
            self._note_session_info(adapter, lines)

    def _note_session_info(self, adapter: Adapter, lines: list[bytes]) -> None:
        """Record the title and ``updatedAt`` a ``session_info_update`` announces, for ``session/list``."""
        for line in lines:
            found = session_info_of(line)
            if found is None:
                continue
            session_id, changes = found
            if adapter.gateway_session is None or session_id not in (adapter.gateway_session, adapter.adapter_session):
                continue
            try:
                self.intents.registry.record_title(adapter.gateway_session, changes)
            except sqlite3.Error as exc:  # the title is lost; the update itself is relayed
                log.error("could not record the title of session %s: %s", adapter.gateway_session, exc)

    def _request(self, adapter: Adapter, msg: Message) -> bytes | None:
        if msg.method == Method.ELICITATION_CREATE:
            msg.params = gateway_scope(adapter, msg.params)
        turn = adapter.tenancy.running_turn
        upstream_id = self.requests.register(adapter, msg.id, str(msg.method), turn)  # type: ignore[arg-type]
        if msg.method == Method.REQUEST_PERMISSION:
            self.turns.note(adapter.tenancy.turn, "permission_asked", permission_subject(msg))
        if not self.sharing.asked(adapter.gateway_session, upstream_id, msg, turn):
            return None  # [attach] permissions asks others: it waits for them (or an operator)
        return jsonrpc.with_id(msg, upstream_id)

    def _response(self, adapter: Adapter, msg: Message) -> tuple[bytes | None, bool]:
        """What to send for an answer, and whether it had bookkeeping (see ``_translate``)."""
        call = adapter.take_pending(msg.id)
        if call is None and adapter.tenancy.muted:
            log.info("adapter pid=%d answered request id %r after the proxy had: dropped", adapter.pid, msg.id)
            return None, False
        if call is None:
            log.warning("adapter pid=%d answered unknown request id %r: dropped", adapter.pid, msg.id)
            return None, False
        if call.internal is not None:
            # In stream order, so that what the adapter writes right after an answer is seen right:
            if call.method == Method.LOAD:
                adapter.tenancy.swallow(False)  # what follows the answer is not replay
            elif call.method == Method.NEW and adapter.gateway_session is not None:
                fresh = session_of(msg.result)  # a fallback: from now on its id is rewritten
                if fresh:
                    adapter.renamed(fresh)
            call.internal.response = msg
            call.internal.done.set()
            return None, False
        if adapter.rewrites_session and msg.result is not UNSET:
            assert adapter.adapter_session is not None
            assert adapter.gateway_session is not None
            rewritten = rewrite_session_id(msg.result, adapter.adapter_session, adapter.gateway_session)
            if isinstance(rewritten, Raw):
                msg.result = rewritten
        adapter.note_answer(call, msg)
        if call.on_answer is not None:
            try:
                msg = call.on_answer(msg) or msg
            except sqlite3.Error as exc:  # the state database failed: the answer is still relayed
                log.error("could not record the answer to %s in the state database: %s", call.method, exc)
        if call.turn is not None:
            self.turns.settle_answer(call.turn, msg, write_later=True)
            adapter.tenancy.turn_answered(call.turn)
            self.pool.recency.note_turn_ended(adapter)  # the gateway's next prompt may be on its way
            self.intents.recycle_due(adapter)
        if not busy(adapter):
            self.pool.changed.notify()  # a waiter for a slot may now suspend this one
        if call.method == Method.INITIALIZE and msg.result is not UNSET:
            self.pool.known_capabilities[adapter.backend.name] = adapter.capabilities
            msg.result = annotate_initialize(msg.result, adapter.backend.name)
        deliver = self.writer.routed_elsewhere(call.gateway_id)
        if deliver is not None:  # an attached client's request: its answer goes to that client
            self._routed.append((deliver, jsonrpc.with_id(msg, call.gateway_id)))
            return None, call.on_answer is not None
        return jsonrpc.with_id(msg, call.gateway_id), call.on_answer is not None

    async def _adapter_gone(self, adapter: Adapter) -> None:
        """The adapter's stdout closed: answer everything it still owed, with its exit status.

        A session whose process died this way is not lost: it is suspended, and
        the next request for it resumes it.
        """
        returncode = await adapter.wait_exit(1.0)
        if returncode is None and self.stopping.reason is None:
            log.warning(
                "adapter pid=%d closed its output but still runs (a broken connection): it is stopped, "
                "not reused; its sessions resume on a new process",
                adapter.pid,
            )
        failed = adapter.mark_gone()
        if self.stopping.reason is None and failed:
            log.error(
                "adapter pid=%d %s with %d request(s) unanswered",
                adapter.pid,
                describe_exit(returncode),
                len(failed),
            )
        await self.fail_calls(failed, self.pool.gone_error(adapter))
        for upstream_id in self.requests.of(adapter):
            self.sharing.withdrawn(upstream_id)
            await self.writer.send(jsonrpc.notification(Method.CANCEL_REQUEST, {"requestId": upstream_id}))
        adapter.tenancy.upstream_forgotten()
        self.intents.process_ended(adapter, returncode)
        await self.pool.processes.stop(adapter, drain=False)

    async def fail_calls(self, calls: list[PendingCall], error: ProxyError) -> None:
        """Answer the gateway's requests in flight with ``error``; their prompts end with it."""
        for call in calls:
            if call.turn is not None:
                self.turns.settle(call.turn, error=(error.code, error.message))
        if calls:
            await self.writer.replies(
                (call.gateway_id, error.response(call.gateway_id, method=call.method)) for call in calls
            )
