"""Prompts sent again: a client that lost a prompt's answer (a dropped link, a restart) sends it again
with the same operation id, and gets the first one's answer instead of a second turn.

The operation id is the drafts' ``operationId`` (in a prompt's params, or its ``_meta`` for a v1
client; ``tasks.status.operation_of``). Whether a prompt repeats one is decided from the first one's task
(``tasks.status.repeat_of``): this proxy's turn if it has it, else the install's task rows, so a retry
that reaches another proxy of the install, or this one after a restart, is recognised too. A retry of a
turn still running waits for its end; one whose first turn ran in another proxy that still holds the
session queues behind the session's handover like any request, and is decided again when its turn
comes (``answered`` with ``own``), when the first one has ended.
"""

from __future__ import annotations

import functools
import logging

import msgspec
from msgspec import UNSET

from acp_proxy.concurrency import Background
from acp_proxy.protocol import jsonrpc
from acp_proxy.protocol.jsonrpc import Message
from acp_proxy.sessions.restore import GatewayPort
from acp_proxy.state import now
from acp_proxy.tasks.records import earlier_operation
from acp_proxy.tasks.status import Repeat, repeat_of
from acp_proxy.tasks.turn import Turn
from acp_proxy.tasks.turns import TurnBook

log = logging.getLogger("acp_proxy.proxy")


class Repeats:
    """Answers prompts that repeat an earlier one's operation id, as that one was answered."""

    def __init__(self, turns: TurnBook, gateway: GatewayPort, background: Background, window: float) -> None:
        self.turns = turns
        self.gateway = gateway
        self.background = background
        self.window = window
        """``[tasks] operation_window``: how long an operation id is remembered (0: not at all)."""

    async def answered(self, msg: Message, session_id: str, operation_id: str, own: Turn | None = None) -> bool:
        """Whether ``msg`` repeats an earlier prompt of the session and is answered as it was (now, or in the
        background once that one ends). ``own``: the turn ``msg`` opened while it waited its turn, settled as
        the earlier one if it repeats it."""
        if self.window <= 0:
            return False
        earlier = self.turns.by_operation(session_id, operation_id, other_than=own)
        if earlier is not None:
            repeat = repeat_of(earlier.status, earlier.answer is not None, earlier.created_at, now(), self.window)
            answer, task_id = earlier.answer, earlier.task_id
        else:
            db = self.turns.tasks.db
            await db.caught_up()  # this proxy's own turns' rows, as written so far
            row = earlier_operation(db, session_id, operation_id, "" if own is None else own.task_id)
            if row is None:
                return False
            repeat = repeat_of(row.status, row.answer is not None, row.created_at, now(), self.window)
            answer, task_id = row.answer, row.task_id
        if repeat is Repeat.WAIT and earlier is not None:
            self.background.start(functools.partial(self._answer_once_ended, msg, earlier, own))
            return True
        if repeat is not Repeat.ANSWER or answer is None:
            return False  # run it (a turn of another proxy still running: behind the handover, decided again)
        await self._answer(msg, answer, task_id, own)
        return True

    async def _answer_once_ended(self, msg: Message, earlier: Turn, own: Turn | None) -> None:
        await self.turns.until_ended(earlier)
        assert earlier.answer is not None  # TurnBook.settle keeps the answer of every turn with an operation id
        await self._answer(msg, earlier.answer, earlier.task_id, own)

    async def _answer(self, msg: Message, answer: bytes, task_id: str, own: Turn | None) -> None:
        request_id = None if msg.id is UNSET else msg.id
        log.info("prompt %s repeats task %s (operation id): answered as it was", request_id, task_id)
        if own is not None:
            own.event("repeat", f"of task {task_id}: answered as it was, not run")
            decoded = jsonrpc.decode_object(msgspec.Raw(answer)) or {}
            error = decoded.get("error")
            if isinstance(error, dict):
                self.turns.settle(own, error=(int(error.get("code", 0)), str(error.get("message", ""))))
            else:
                stop = (decoded.get("result") or {}).get("stopReason")
                self.turns.settle(own, stop_reason=stop if isinstance(stop, str) else None)
        envelope = b'{"jsonrpc":"2.0","id":' + jsonrpc.encode_json(request_id).rstrip(b"\n") + b","
        await self.gateway.reply(msg.id, envelope + answer.lstrip()[1:] + b"\n")
