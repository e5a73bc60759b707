"""Shared sessions, the attaching side: this proxy's gateway attached to a session another proxy holds.

``session/attach`` names a session of the install. When this proxy holds it, the gateway is its
controller already and is answered at once. Otherwise the proxy that holds it (``holder_of``: the
running proxy on the session's row) is asked over its control socket (``attach``, the same uid
only: ``SO_PEERCRED``), and that connection becomes the ``Link``: what the holder sends goes to
the gateway (the agent's requests under ids of this proxy's upstream counter, so they never meet
its own adapters' requests), and what the gateway sends about that session goes to the holder
(its requests under the link's own ids). ``session/detach`` ends the link and nothing else. A
holder that goes away answers what was in flight ``holder_gone``, withdraws its requests with
``$/cancel_request`` and tells the gateway with an ``attach_ended`` update.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream
from msgspec import Raw, UnsetType

from acp_proxy.concurrency import Background
from acp_proxy.config import Config
from acp_proxy.protocol import jsonrpc
from acp_proxy.protocol.errors import ProxyError
from acp_proxy.protocol.jsonrpc import BadLine, Kind, LineReader, Message, RequestId
from acp_proxy.protocol.methods import Method
from acp_proxy.relay.adapters import decoded_lines, is_plain_notification_block
from acp_proxy.relay.claims import LOCAL, PRINCIPAL_ENV
from acp_proxy.relay.sharing import (
    AttachRequest,
    History,
    Sharing,
    history_items,
    parse_attach,
    update_line,
)
from acp_proxy.relay.writer import GatewayWriter
from acp_proxy.sessions.registry import SessionRegistry
from acp_proxy.sockets import addressable, socket_path

log = logging.getLogger("acp_proxy.sharing")

CONNECT_TIMEOUT: Final = 10.0
"""How long the holder has to answer an attach (its transcript read included)."""
ATTACH_ENDED: Final = b'"attach_ended"'
CLIENT_ENV: Final = "ACP_PROXY_CLIENT"
"""Who this proxy's gateway is, as ``serve`` tells the proxy of each connection (a token's name)."""


class Link:
    """One session attached through its holder's control socket."""

    def __init__(self, session_id: str, stream: anyio.abc.ByteStream, reader: BufferedByteReceiveStream) -> None:
        self.session_id = session_id
        self.stream = stream
        self.reader = reader
        self.requests: dict[int, RequestId] = {}
        """The gateway's requests sent to the holder: the link's id -> the gateway's."""
        self.asks: dict[object, int] = {}
        """The holder's requests sent to the gateway: (its id's key) -> the id the gateway got."""
        self.detaching: int | None = None
        self.told = False
        """The holder sent ``attach_ended`` itself (the session was closed or deleted)."""
        self._next_id = 0
        self._sending = anyio.Lock()

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    async def send(self, data: bytes) -> None:
        async with self._sending:
            await self.stream.send(data if data.endswith(b"\n") else data + b"\n")


class Links:
    """The sessions this proxy's gateway has attached to through other proxies."""

    def __init__(
        self,
        config: Config,
        state_dir: Path,
        registry: SessionRegistry,
        sharing: Sharing,
        writer: GatewayWriter,
        background: Background,
        new_upstream_id: Callable[[], int],
        client_init: Callable[[], Raw | UnsetType],
    ) -> None:
        self.config = config
        self.state_dir = state_dir
        self.registry = registry
        self.sharing = sharing
        self.writer = writer
        self.background = background
        self.new_upstream_id = new_upstream_id
        self.client_init = client_init
        self.links: dict[str, Link] = {}
        self.attaching: set[str] = set()
        """Sessions whose attach is on its way (a second one is refused, not made twice)."""
        self.by_upstream: dict[int, tuple[Link, RequestId]] = {}
        self.who = os.environ.get(CLIENT_ENV) or f"uid {os.getuid()}"

    # --- session/attach ------------------------------------------------------------------------

    async def attach(self, msg: Message, session_id: str) -> None:
        params = jsonrpc.decode_object(msg.params) or {}
        client_info = params.get("clientInfo")
        if not isinstance(client_info, dict):
            client_info = self._gateway_client_info()
        args = {
            "sessionId": session_id,
            "role": params.get("role", "controller"),
            "historyPolicy": params.get("historyPolicy", "full"),
            "clientInfo": client_info,
            "who": self.who,
            "principal": os.environ.get(PRINCIPAL_ENV) or LOCAL,
        }
        try:
            request = parse_attach(args)
        except ValueError as exc:
            await self.writer.fail(msg.id, ProxyError.invalid_params(str(exc)))
            return
        if session_id in self.links or session_id in self.attaching:
            await self.writer.fail(msg.id, ProxyError.invalid_request(f"already attached to session {session_id}"))
            return
        self.attaching.add(session_id)
        try:
            await self._attach(msg, session_id, request, args)
        finally:
            self.attaching.discard(session_id)

    async def _attach(self, msg: Message, session_id: str, request: AttachRequest, args: dict[str, Any]) -> None:
        assert self.sharing.intents is not None
        if self.sharing.intents.table.get(session_id) is not None:
            await self._attach_own(msg, session_id, request.historyPolicy)
            return
        holder = await self.registry.holder_of(session_id)
        if holder is None:
            why = f"no running acp-proxy holds session {session_id}; session/load or session/resume it to take it over"
            await self.writer.fail(msg.id, ProxyError.not_attachable(session_id, why))
            return
        try:
            with anyio.fail_after(CONNECT_TIMEOUT):
                link, answer = await self._connect(holder, session_id, args)
        except (
            OSError,
            TimeoutError,
            ValueError,
            TypeError,
            anyio.EndOfStream,
            anyio.IncompleteRead,
            anyio.DelimiterNotFound,
            anyio.BrokenResourceError,
            anyio.ClosedResourceError,
        ) as exc:
            log.info("session %s: attach through instance %s failed: %r", session_id, holder, exc)
            why = f"its acp-proxy (instance {holder}) did not take the attach: {exc}"
            await self.writer.fail(msg.id, ProxyError.not_attachable(session_id, why))
            return
        except ProxyError as exc:
            await self.writer.fail(msg.id, exc)
            return
        self.links[session_id] = link
        result = answer["result"]
        try:
            replayed = answer.get("replayLines", 0)
            for _ in range(replayed if isinstance(replayed, int) else 0):
                line = await link.reader.receive_until(b"\n", self.config.max_line_bytes)
                await self.writer.send(line + b"\n")
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.DelimiterNotFound, anyio.BrokenResourceError):
            pass  # the holder went meanwhile: the pump below finds it gone
        await self.writer.answer(msg.id, result)
        log.info("session %s: attached through instance %s as %s", session_id, holder, request.role.value)
        self.background.start_task(self._pump, link)  # long-lived: a shutdown does not wait for it

    def _gateway_client_info(self) -> dict[str, Any]:
        init = jsonrpc.decode_object(self.client_init())
        info = init.get("clientInfo") if init is not None else None
        return dict(info) if isinstance(info, dict) else {}

    async def _attach_own(self, msg: Message, session_id: str, policy: History) -> None:
        """The gateway attaches to a session of its own: it is its controller already, and asks for the
        draft's updates (``permission_resolved``, ``client_disconnected``) from now on. Nothing is
        replayed: it saw it."""
        share = self.sharing.shares.get(session_id)
        others = [a.info for a in share.attachments.values()] if share is not None else []
        result: dict[str, Any] = {"sessionId": session_id, "role": "controller", "connectedClients": others}
        if policy is not History.NONE:
            asks = [ask for ask in self.sharing.asks.values() if ask.session_id == session_id]
            entries = await self.sharing.transcripts.read_then(session_id, lambda found: found)
            result["history"] = history_items(entries, asks, policy)
        self.sharing.gateway_attached(session_id)
        await self.writer.answer(msg.id, result)

    async def _connect(self, holder: str, session_id: str, args: dict[str, Any]) -> tuple[Link, dict[str, Any]]:
        path = socket_path(self.state_dir, holder)
        with addressable(path) as name:
            stream = await anyio.connect_unix(name)
        try:
            await stream.send(json.dumps({"id": 1, "command": "attach", "args": args}).encode() + b"\n")
            reader = BufferedByteReceiveStream(stream)
            first = await reader.receive_until(b"\n", 64 * 1024 * 1024)
            response = json.loads(first)
            if not isinstance(response, dict):
                raise ValueError("the holder's answer is not a JSON object")
            if not response.get("ok"):
                error = response.get("error") or {}
                raise _refusal(session_id, str(error.get("code")), str(error.get("message")))
            answer = response.get("result")
            if not isinstance(answer, dict) or not isinstance(answer.get("result"), dict):
                raise ValueError("the holder's answer has no result")
        except BaseException:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
            raise
        return Link(session_id, stream, reader), answer

    # --- the holder's messages, to the gateway ---------------------------------------------------

    async def _pump(self, link: Link) -> None:
        """The holder's messages to the gateway: a block of plain notifications (the streaming path)
        as it was read, anything else line by line, its ids mapped."""
        reader = LineReader(link.reader, self.config.max_line_bytes)  # after what the attach already read
        ended_by_detach = False
        try:
            while not ended_by_detach:
                try:
                    batch = await reader.receive_batch()
                except anyio.EndOfStream:
                    return
                if batch.overlong:
                    log.warning(
                        "session %s: the holder sent %d line(s) over the limit: dropped",
                        link.session_id,
                        batch.overlong,
                    )
                if is_plain_notification_block(batch) and ATTACH_ENDED not in batch.block:
                    await self.writer.send(batch.block)
                    continue
                for line, decoded in decoded_lines(batch):
                    if isinstance(decoded, BadLine):
                        continue
                    if await self._from_holder(link, line, *decoded):
                        ended_by_detach = True
                        break
        finally:
            with anyio.CancelScope(shield=True):
                await self._ended(link, ended_by_detach)

    async def _from_holder(self, link: Link, line: bytes, msg: Message, kind: Kind) -> bool:
        """One message of the holder's, to the gateway; ``True`` once it answered the gateway's detach."""
        if kind is Kind.REQUEST:
            upstream_id = self.new_upstream_id()
            link.asks[jsonrpc.id_key(msg.id)] = upstream_id
            self.by_upstream[upstream_id] = (link, msg.id)  # type: ignore[assignment]
            await self.writer.send(jsonrpc.with_id(msg, upstream_id))
        elif kind is Kind.NOTIFICATION and msg.method == Method.CANCEL_REQUEST:
            target = (jsonrpc.decode_object(msg.params) or {}).get("requestId")
            upstream = link.asks.pop(jsonrpc.id_key(target), None)
            if upstream is not None:
                self.by_upstream.pop(upstream, None)
                await self.writer.send(jsonrpc.notification(Method.CANCEL_REQUEST, {"requestId": upstream}))
        elif kind is Kind.NOTIFICATION:
            if ATTACH_ENDED in line:
                link.told = True  # the holder said why: nothing to add when it goes
            await self.writer.send(line + b"\n")
        else:
            gateway_id = link.requests.pop(msg.id, None) if isinstance(msg.id, int) else None
            if gateway_id is not None:
                await self.writer.send(jsonrpc.with_id(msg, gateway_id))
                return link.detaching == msg.id
        return False

    async def _ended(self, link: Link, detached: bool) -> None:
        if self.links.get(link.session_id) is link:
            del self.links[link.session_id]
        with contextlib.suppress(OSError, anyio.BrokenResourceError):
            await link.stream.aclose()
        gone = ProxyError.holder_gone(link.session_id)
        out = b"".join(gone.response(gateway_id) for gateway_id in link.requests.values())
        link.requests.clear()
        for upstream in link.asks.values():
            self.by_upstream.pop(upstream, None)
            out += jsonrpc.notification(Method.CANCEL_REQUEST, {"requestId": upstream})
        link.asks.clear()
        if not detached and not link.told:
            log.info("session %s: its holder is gone: the attachment ended", link.session_id)
            out += update_line(link.session_id, {"type": "attach_ended", "reason": "holder_gone"})
        if out:
            await self.writer.send(out)

    # --- the gateway's messages, to the holder ---------------------------------------------------

    def holds(self, session_id: str | None) -> bool:
        return session_id is not None and session_id in self.links

    async def request(self, msg: Message, session_id: str) -> None:
        """A request of the gateway's for an attached session: to its holder."""
        link = self.links[session_id]
        link_id = link.new_id()
        link.requests[link_id] = msg.id  # type: ignore[assignment]
        if msg.method == Method.DETACH:
            link.detaching = link_id
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await link.send(jsonrpc.with_id(msg, link_id))  # else the pump sees the link end and answers it

    async def notify(self, msg: Message, line: bytes, session_id: str) -> None:
        link = self.links[session_id]
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await link.send(line)

    async def answer(self, msg: Message) -> bool:
        """The gateway's answer to a request a holder made: to that holder (whether it was one)."""
        if not self.by_upstream or not isinstance(msg.id, int):
            return False
        found = self.by_upstream.pop(msg.id, None)
        if found is None:
            return False
        link, holder_id = found
        link.asks.pop(jsonrpc.id_key(holder_id), None)
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await link.send(jsonrpc.with_id(msg, holder_id))
        return True

    async def cancel_request(self, target: object) -> bool:
        """The gateway's ``$/cancel_request`` for a request it sent over a link: to the holder."""
        for link in self.links.values():
            for link_id, gateway_id in link.requests.items():
                if gateway_id == target and type(gateway_id) is type(target):
                    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                        await link.send(jsonrpc.notification(Method.CANCEL_REQUEST, {"requestId": link_id}))
                    return True
        return False

    async def close_all(self) -> None:
        for link in list(self.links.values()):
            with contextlib.suppress(OSError, anyio.BrokenResourceError):
                await link.stream.aclose()


def _refusal(session_id: str, code: str, message: str) -> ProxyError:
    if code == "unknown_session":
        return ProxyError.not_attachable(session_id, message)
    if code == "forbidden":
        return ProxyError.attach_forbidden(message)
    if code == "too_many_clients":
        return ProxyError.too_many_clients(session_id, message)
    if code == "invalid_args":
        return ProxyError.invalid_params(message)
    return ProxyError.attach_refused(session_id, f"{message} ({code})")
