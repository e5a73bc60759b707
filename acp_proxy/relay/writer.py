"""The one writer to the gateway: every answer, error and relayed line goes out here."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
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
        on_broken: Callable[[], None],
        trace: Trace | None = None,
    ) -> None:
        self._out = LineWriter(stream)
        self._stopping = stopping
        self._on_broken = on_broken
        self.broken = False
        self.trace = trace
        """Where every wire message is recorded, both sides (``--trace``), if anywhere."""

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
            self._on_broken()
            return
        if scope.cancelled_caught:
            log.warning("gateway stopped reading during shutdown: its remaining answers are dropped")
            self.broken = True

    async def answer(self, request_id: RequestId | UnsetType, result: object) -> None:
        await self.send(jsonrpc.result_response(None if request_id is UNSET else request_id, result))

    async def fail(self, request_id: RequestId | UnsetType, error: ProxyError) -> None:
        await self.send(error.response(None if request_id is UNSET else request_id))
