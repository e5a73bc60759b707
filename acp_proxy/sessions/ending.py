"""Ending prompt turns: ``session/cancel``, a turn past one of its limits, and a close's end of what runs.

A cancelled turn is asked to end and given ``cancel_timeout``; a turn past ``turn_timeout``,
``turn_idle_timeout`` or its session's memory limit is cancelled and given ``close_timeout``.
A turn still running after that is answered by the proxy, and its process, not worth keeping,
is recycled: the session is suspended and its next request restores it. Nothing else is reaped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import anyio

from acp_proxy.concurrency import Background, Stopping
from acp_proxy.config import Config
from acp_proxy.journal import SuspendReason
from acp_proxy.pool.adapter import Adapter, AdapterGone
from acp_proxy.protocol import jsonrpc
from acp_proxy.protocol.errors import ProxyError
from acp_proxy.protocol.jsonrpc import Message
from acp_proxy.protocol.methods import Method
from acp_proxy.sessions.decisions import CANCELLED, CUT_EVENTS, CUT_META, CUT_REASONS
from acp_proxy.sessions.lifecycle import Event
from acp_proxy.sessions.restore import GatewayPort
from acp_proxy.sessions.table import Session, SessionTable
from acp_proxy.tasks.status import TERMINAL, TaskStatus
from acp_proxy.tasks.turn import Limit, Turn
from acp_proxy.tasks.turns import TurnBook, turn_ids

log = logging.getLogger("acp_proxy.lifecycle")

Suspend = Callable[..., bool]


class TurnEnder:
    """Cancels turns, cuts short those past a limit, and ends what runs when a session is closed."""

    def __init__(
        self,
        config: Config,
        table: SessionTable,
        turns: TurnBook,
        gateway: GatewayPort,
        background: Background,
        stopping: Stopping,
        *,
        suspend: Suspend,
    ) -> None:
        self.config = config
        self.table = table
        self.turns = turns
        self.gateway = gateway
        self.background = background
        self.stopping = stopping
        self._suspend = suspend
        """``SessionIntents.suspend``: a recycled process's session is suspended, its next request restores it."""

    async def cancel(
        self,
        session: Session,
        *,
        by: str | None,
        task: Turn | None = None,
        notification: tuple[Message, bytes] | None = None,
        bounded: bool = True,
    ) -> None:
        """Cancel a session's prompt turns; nothing is reaped while the adapter ends them in time.

        Without ``task`` this is ACP's ``session/cancel``: every prompt queued for the session
        ends ``cancelled``, and the running turn is asked to end (the gateway's own
        ``notification`` is forwarded, else the proxy sends one). With ``task``, only that
        turn: answered ``cancelled`` when its turn to be sent comes, or asked to end if it
        runs. ``by`` is who asked, for the task's events (``None``: the event is already noted).
        ``bounded``: a running turn still unanswered ``cancel_timeout`` after the first
        cancel is answered by the proxy (``_cut_short_after``).
        """
        if task is None:
            if not self.table.accepts(session, Event.CANCEL):
                log.info("dropped session/cancel for session %s: nothing of it runs or waits", session.session_id)
                return
            self.table.advance(session, Event.CANCEL)  # a new epoch: its queued prompts end cancelled
        elif task.status is TaskStatus.QUEUED:
            task.cancel_requested = True
            task.event("cancel_requested", f"by {by} (while queued)")
            return
        adapter = session.live_adapter
        if adapter is None:
            log.info("dropped session/cancel for session %s: it has no live process", session.session_id)
            return
        if by is not None:
            self.turns.note(adapter.tenancy.turn, "cancel_requested", f"by {by}")
        await self.ask_to_end_turn(session, adapter, notification)
        turn = adapter.tenancy.turn if task is None else task
        if bounded and turn is not None and turn.status is TaskStatus.RUNNING and not turn.cancel_bounded:
            limit = self.config.cancel_timeout(session.record.backend)
            if limit > 0:
                turn.cancel_bounded = True
                self.background.start(lambda: self._cut_short_after(limit, session, adapter, turn))

    async def _cut_short_after(self, limit: float, session: Session, adapter: Adapter, turn: Turn) -> None:
        """A cancelled turn its adapter has not ended ``limit`` seconds later (gemini-cli ends its
        network retries first, for a minute or so): the proxy answers it and stops the process."""
        if await self.turns.wait_settled(turn, limit) or adapter.gone or self.stopping.begun:
            return
        turn.event("cancel_timeout", f"still running {limit:g}s after session/cancel")
        log.warning(
            "task %s: still running %gs after session/cancel (cancel_timeout): answered cancelled",
            turn.task_id,
            limit,
            extra=turn_ids(turn),
        )
        await self._answer_for_adapter(
            session,
            adapter,
            turn,
            CANCELLED,
            why=f"still running {limit:g}s after session/cancel",
            reason=SuspendReason.CANCEL_TIMEOUT,
            ended_by=f"cancel_timeout: not ended by the agent {limit:g}s after session/cancel",
        )

    async def ask_to_end_turn(
        self, session: Session, adapter: Adapter, notification: tuple[Message, bytes] | None = None
    ) -> None:
        """``session/cancel`` to the adapter: the gateway's own, else one under the id the adapter knows."""
        try:
            if notification is not None:
                await adapter.pass_on(*notification)
            else:
                cancel = {"sessionId": adapter.adapter_session or session.session_id}
                await adapter.send(jsonrpc.notification(Method.CANCEL, cancel))
        except AdapterGone:
            log.info("dropped session/cancel: the adapter has exited")

    async def end_turns(self, session: Session, adapter: Adapter) -> None:
        """Cancel the turn in flight, give the adapter ``close_timeout`` to end it, answer the rest ourselves."""
        if adapter.turn_in_flight:
            await self.ask_to_end_turn(session, adapter)
            with anyio.move_on_after(self.config.shutdown.close_timeout):
                await adapter.until_answered()
        for call in adapter.take_gateway_calls():
            if call.method == Method.PROMPT:
                if call.turn is not None:
                    self.turns.settle(call.turn, stop_reason="cancelled")
                await self.gateway.answer(call.gateway_id, CANCELLED)
            else:
                await self.gateway.reply(
                    call.gateway_id, ProxyError.closed_in_flight().response(call.gateway_id, method=call.method)
                )

    async def expire_turn(self, turn: Turn, limit: Limit = Limit.TURN_TIMEOUT) -> None:
        """A turn went past ``turn_timeout`` or ``turn_idle_timeout`` (``TurnBook.watch``): cut it."""
        if limit is Limit.TURN_TIMEOUT:
            seconds = self.turns.turn_timeout(turn)
            await self.cut_turn(turn, limit, f"running longer than turn_timeout ({seconds:g}s)")
        else:
            await self.cut_turn(turn, limit, f"nothing heard from it for {turn.idle_limit:g}s (turn_idle_timeout)")

    async def cut_turn(self, turn: Turn, limit: Limit, why: str) -> None:
        """A running turn went past ``limit`` (``why`` says how): ``session/cancel``; if the adapter
        ignores that for ``close_timeout``, the proxy answers the prompt ``cancelled`` itself and
        suspends the session (a stuck process is not worth keeping): its next request restores it."""
        session = self.table.get(turn.session_id)
        adapter = session.live_adapter if session is not None else None
        turn.event(CUT_EVENTS[limit], f"{why}: session/cancel sent")
        log.warning("task %s: %s: cancelling it", turn.task_id, why, extra=turn_ids(turn))
        if session is None or adapter is None:
            return  # the process is gone: the turn is being answered with its exit already
        await self.cancel(session, by=None, task=turn, bounded=False)
        close_timeout = self.config.shutdown.close_timeout
        await self.turns.wait_settled(turn, close_timeout)
        if turn.status in TERMINAL or adapter.gone:
            return
        await self._answer_for_adapter(
            session,
            adapter,
            turn,
            {**CANCELLED, "_meta": {"acp-proxy": CUT_META[limit]}},
            why=f"{limit}: {why}; the turn not ended {close_timeout:g}s after session/cancel",
            reason=CUT_REASONS[limit],
        )

    async def _answer_for_adapter(
        self,
        session: Session,
        adapter: Adapter,
        turn: Turn,
        result: dict[str, Any],
        *,
        why: str,
        reason: SuspendReason,
        ended_by: str | None = None,
    ) -> None:
        """The proxy answers a cancelled turn its adapter does not end, and retires the process.

        The session is suspended (the tree reaped, the session resumable) before the gateway
        has the answer, so that its next request waits for a new process instead of going to
        this one; from now on nothing the old process writes reaches the gateway.
        """
        call = adapter.take_call_of(turn)
        self.turns.settle(turn, stop_reason="cancelled", ended_by=ended_by)
        if session.adapter is adapter and not session.closed:
            adapter.tenancy.mute()
            log.warning(
                "session %s: pid %s did not end its cancelled turn (%s); stopping it (session suspended)",
                session.session_id,
                adapter.pid,
                why,
                extra=turn_ids(turn),
            )
            self._suspend(session.session_id, why, reason, even_if_busy=True)
        if call is not None:
            await self.gateway.answer(call.gateway_id, result)
