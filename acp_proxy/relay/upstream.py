"""The agents' requests to the client that wait for an answer, by the id each was sent upstream under.

An adapter's ``session/request_permission`` (or ``fs/*``, ``elicitation/create``) reaches the gateway,
and an attached client, under an id of this proxy's counter; whoever answers first, the answer goes
back to the adapter that asked under that adapter's own id. The relay registers each request as it
passes; every answer, the gateway's, an attached client's or an operator's, goes back through
``Sharing.hand_back`` over this table, which is built before both, so the shared sessions never call
the relay.
"""

from __future__ import annotations

import logging
from contextlib import suppress

from msgspec import UNSET

from acp_proxy.pool.adapter import Adapter, AdapterGone
from acp_proxy.pool.processes import ProcessPool
from acp_proxy.pool.tenancy import busy
from acp_proxy.protocol import jsonrpc
from acp_proxy.protocol.jsonrpc import Message, RequestId
from acp_proxy.protocol.methods import Method
from acp_proxy.tasks.turn import Turn
from acp_proxy.tasks.turns import TurnBook

log = logging.getLogger("acp_proxy.relay")

Waiting = tuple[Adapter, RequestId, str, Turn | None]
"""A request waiting upstream: the adapter that asked, its id there, the method, and the turn it was
asked during (whose idle clock stops while it waits)."""


def permission_choice(msg: Message) -> str:
    """What the gateway answered a permission request: the option chosen, or ``cancelled``."""
    if msg.error is not UNSET:
        return f"error {msg.error.code}"
    result = jsonrpc.decode_object(msg.result) or {}
    outcome = result.get("outcome")
    if isinstance(outcome, dict):
        option = outcome.get("optionId")
        return (
            str(option) if outcome.get("outcome") == "selected" and option is not None else str(outcome.get("outcome"))
        )
    return ""


class AgentRequests:
    """Every agent->client request sent upstream and not yet answered."""

    def __init__(self, pool: ProcessPool, turns: TurnBook) -> None:
        self.pool = pool
        self.turns = turns
        self.waiting: dict[int, Waiting] = {}
        self._next_id = 0

    def new_id(self) -> int:
        """A fresh id for a request to the gateway (an adapter's, or an attached session holder's)."""
        upstream_id = self._next_id
        self._next_id += 1
        return upstream_id

    def register(self, adapter: Adapter, adapter_id: RequestId, method: str, turn: Turn | None) -> int:
        """``adapter`` asks the client something: the id it goes upstream under."""
        upstream_id = self.new_id()
        self.waiting[upstream_id] = (adapter, adapter_id, method, turn)
        adapter.tenancy.asked_upstream()
        if turn is not None:
            turn.asked()
        return upstream_id

    def find(self, adapter: Adapter, adapter_id: RequestId) -> int | None:
        """The upstream id of ``adapter``'s request ``adapter_id``, if it still waits."""
        for upstream_id, (owner, their_id, _, _) in self.waiting.items():
            if owner is adapter and their_id == adapter_id:
                return upstream_id
        return None

    def no_longer_waited_for(self, upstream_id: int) -> None:
        """The agent withdrew it: its turn's idle clock runs again (the request stays, for a late answer)."""
        owner, their_id, method, turn = self.waiting[upstream_id]
        if turn is not None:
            turn.answered()
            self.waiting[upstream_id] = (owner, their_id, method, None)

    def of(self, adapter: Adapter) -> list[int]:
        """Forget every request of ``adapter`` (it has gone): their upstream ids."""
        orphaned = [upstream_id for upstream_id, (owner, _, _, _) in self.waiting.items() if owner is adapter]
        for upstream_id in orphaned:
            del self.waiting[upstream_id]
        return orphaned

    def take(self, upstream_id: int) -> Waiting | None:
        """The request answered now, if it still waited (the first answer wins); taken out of the table."""
        return self.waiting.pop(upstream_id, None)

    async def hand_back(self, waiting: Waiting, msg: Message, by: str, *, from_gateway: bool) -> None:
        """The answer taken for ``waiting``, from ``by``: to the adapter that asked, under its own id."""
        adapter, adapter_id, method, turn = waiting
        if turn is not None:
            turn.answered()
        if method == Method.REQUEST_PERMISSION:
            choice = permission_choice(msg)
            self.turns.note(
                adapter.tenancy.turn, "permission_answered", choice if from_gateway else f"{choice} by {by}"
            )
        adapter.tenancy.answered_upstream()
        adapter.answered.notify()  # a handover waiting for its session to be quiet looks again
        if not busy(adapter):
            self.pool.changed.notify()
        try:
            await adapter.send(jsonrpc.with_id(msg, adapter_id))
        except AdapterGone:
            log.info("answer to request %r dropped: the adapter has exited", adapter_id)

    async def cancel_routed(self, routed_id: str) -> None:
        """``$/cancel_request`` for an attached client's request already with an adapter."""
        for adapter in list(self.pool.processes.running):
            call_id = adapter.find_gateway_call(routed_id)
            if call_id is not None:
                with suppress(AdapterGone):
                    await adapter.send(jsonrpc.notification(Method.CANCEL_REQUEST, {"requestId": call_id}))
                return
