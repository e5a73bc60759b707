"""The one writer to the gateway: every answer, error and relayed line goes out here.

Or nearly: a request an attached client sent (``relay.sharing``) is served like the gateway's
own, under an id of the proxy's making (``routed``), and its answer is handed to that client
instead.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import Final

import anyio
import anyio.abc
from msgspec import UNSET, UnsetType

from acp_proxy.concurrency import Stopping
from acp_proxy.protocol import jsonrpc
from acp_proxy.protocol.errors import ProxyError
from acp_proxy.protocol.jsonrpc import LineWriter, RequestId
from acp_proxy.trace import Trace

log = logging.getLogger("acp_proxy.proxy")

SHUTDOWN_WRITE_GRACE: Final = 2.0
"""How long a write to the gateway may block once the proxy is shutting down."""


class GatewayWriter:
    """Writes to the gateway's stdin; a gateway that stops reading cannot hold a shutdown hostage."""

    def __init__(
        self,
        stream: anyio.abc.ByteSendStream,
        stopping: Stopping,
        trace: Trace | None = None,
    ) -> None:
        self._out = LineWriter(stream)
        self._stopping = stopping
        self.broken = False
        self.closed_by_gateway = anyio.Event()
        """Set when a write finds the gateway's end closed: whoever serves the connection stops on it."""
        self.trace = trace
        """Where every wire message is recorded, both sides (``--trace``), if anywhere."""
        self.routed: dict[str, Callable[[bytes], None]] = {}
        """Requests of attached clients in flight, by the id they are served under: where their answer goes."""

    def route(self, request_id: str, deliver: Callable[[bytes], None]) -> None:
        """The answer to ``request_id`` goes to ``deliver``, not to the gateway."""
        self.routed[request_id] = deliver

    def routed_elsewhere(self, request_id: object) -> Callable[[bytes], None] | None:
        """Where the answer to ``request_id`` goes if not to the gateway (taken: an answer goes once)."""
        if self.routed and type(request_id) is str:
            return self.routed.pop(request_id, None)
        return None

    async def reply(self, request_id: RequestId | UnsetType, data: bytes) -> None:
        """An answer to a request: to the gateway, or to the attached client that sent it."""
        deliver = self.routed_elsewhere(request_id)
        if deliver is not None:
            deliver(data)
        else:
            await self.send(data)

    async def replies(self, answers: Iterable[tuple[RequestId, bytes]]) -> None:
        """Several answers: the gateway's in one write."""
        own = b""
        for request_id, data in answers:
            deliver = self.routed_elsewhere(request_id)
            if deliver is not None:
                deliver(data)
            else:
                own += data
        if own:
            await self.send(own)

    async def send(self, data: bytes) -> None:
        if self.broken:
            return
        if self.trace is not None:
            self.trace.lines("proxy>gateway", data)
        # Once shutting down, these writes run in shielded scopes, so they get a deadline.
        deadline = SHUTDOWN_WRITE_GRACE if self._stopping.begun else math.inf
        try:
            with anyio.move_on_after(deadline) as scope:
                await self._out.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            self.broken = True
            self.closed_by_gateway.set()
            return
        if scope.cancelled_caught:
            log.warning("gateway stopped reading during shutdown: its remaining answers are dropped")
            self.broken = True

    async def answer(self, request_id: RequestId | UnsetType, result: object) -> None:
        await self.reply(request_id, jsonrpc.result_response(None if request_id is UNSET else request_id, result))

    async def fail(self, request_id: RequestId | UnsetType, error: ProxyError) -> None:
        await self.reply(request_id, error.response(None if request_id is UNSET else request_id))
