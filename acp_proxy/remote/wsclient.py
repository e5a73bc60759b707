"""A WebSocket client for ``/acp``: wsproto over an anyio stream (TCP, TLS or a unix socket).

Small on purpose: ``acp-proxy connect`` starts with every gateway session, so it loads no
HTTP client library, only wsproto (and h11, which wsproto uses for the handshake). Data frames,
both ways, are ``frames.py``'s; wsproto does the handshake and the control frames.
"""

from __future__ import annotations

import contextlib
import ssl
from collections import deque
from collections.abc import Mapping
from typing import Final
from urllib.parse import urlsplit

import anyio
import anyio.abc
import msgspec
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError

from acp_proxy.remote.frames import TEXT, FrameReader, ProtocolError, client_frame

PATH: Final = "/acp"


class Target(msgspec.Struct, frozen=True):
    """Where a remote ``serve`` is, and the token to show it."""

    host: str
    port: int
    path: str = PATH
    tls: bool = False
    unix: str | None = None
    token: str | None = None

    @classmethod
    def parse(cls, url: str, token: str | None = None) -> Target:
        """``ws://HOST:PORT/acp``, ``wss://…``, ``http(s)://…`` (the same endpoint) or ``unix:PATH``."""
        if url.startswith("unix:"):
            return cls(host="localhost", port=0, unix=url.removeprefix("unix:"), token=token)
        parts = urlsplit(url)
        if parts.scheme not in ("ws", "wss", "http", "https") or not parts.hostname:
            raise ValueError(f"expected ws://HOST:PORT/acp, wss://HOST:PORT/acp or unix:PATH, got {url!r}")
        tls = parts.scheme in ("wss", "https")
        return cls(
            host=parts.hostname,
            port=parts.port or (443 if tls else 80),
            path=parts.path or PATH,
            tls=tls,
            token=token,
        )

    def describe(self) -> str:
        if self.unix is not None:
            return f"unix:{self.unix}"
        return f"{'wss' if self.tls else 'ws'}://{self.host}:{self.port}{self.path}"


class Refused(Exception):
    """The server answered the upgrade with an HTTP status instead of a WebSocket."""

    def __init__(self, status: int, body: str) -> None:
        self.status = status
        self.body = body.strip()
        super().__init__(f"HTTP {status}: {self.body}" if self.body else f"HTTP {status}")


class Closed(Exception):
    """The WebSocket is closed: by the server (with its code and reason) or by a broken link."""

    def __init__(self, code: int | None, reason: str) -> None:
        self.code = code
        self.reason = reason
        super().__init__(f"closed ({code}): {reason}" if code is not None else f"closed: {reason}")


def _after_handshake(ws: WSConnection) -> bytes | None:
    """What came after the server's 101 in the same read (``None`` if wsproto does not say: it parses then)."""
    try:
        trailing = ws.handshake._h11_connection.trailing_data[0]  # where wsproto keeps it
    except AttributeError:
        return None
    return bytes(trailing) if isinstance(trailing, bytes | bytearray) else None


class WebSocket:
    """One open WebSocket: text frames in and out, pings answered."""

    def __init__(self, stream: anyio.abc.ByteStream, ws: WSConnection, headers: Mapping[str, str]) -> None:
        self._stream = stream
        self._ws = ws
        self.headers = dict(headers)
        self.connection_id = self.headers.get("acp-connection-id")
        self._sending = anyio.Lock()
        self._reader: FrameReader | None = None
        """Parses what the server sends; ``None``: wsproto does (the bytes after the 101 were not to be had)."""
        self._text: list[str] = []
        self._ready: deque[str] = deque()
        self.closed: Closed | None = None
        self.set_cookies: list[str] = []

    @classmethod
    async def connect(
        cls, target: Target, *, cookies: Mapping[str, str] | None = None, headers: Mapping[str, str] | None = None
    ) -> WebSocket:
        stream: anyio.abc.ByteStream
        if target.unix is not None:
            stream = await anyio.connect_unix(target.unix)
        elif target.tls:
            context = ssl.create_default_context()
            stream = await anyio.connect_tcp(target.host, target.port, ssl_context=context, tls_hostname=target.host)
        else:
            stream = await anyio.connect_tcp(target.host, target.port)
        try:
            return await cls._handshake(stream, target, cookies or {}, headers or {})
        except BaseException:
            await anyio.aclose_forcefully(stream)
            raise

    @classmethod
    async def _handshake(
        cls, stream: anyio.abc.ByteStream, target: Target, cookies: Mapping[str, str], extra: Mapping[str, str]
    ) -> WebSocket:
        ws = WSConnection(ConnectionType.CLIENT)
        headers = [(name.encode(), value.encode()) for name, value in extra.items()]
        if target.token is not None:
            headers.append((b"authorization", f"Bearer {target.token}".encode()))
        if cookies:
            headers.append((b"cookie", "; ".join(f"{k}={v}" for k, v in cookies.items()).encode()))
        host = target.host if target.port in (80, 443) or target.unix else f"{target.host}:{target.port}"
        await stream.send(ws.send(Request(host=host, target=target.path, extra_headers=headers)))
        status = 0
        body: list[bytes] = []
        while True:
            try:
                data = await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                raise Refused(status, b"".join(body).decode("utf-8", "replace") or "connection closed") from None
            ws.receive_data(data)
            for event in ws.events():
                if isinstance(event, AcceptConnection):
                    pairs = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in event.extra_headers]
                    client = cls(stream, ws, dict(pairs))
                    client.set_cookies = [value for name, value in pairs if name == "set-cookie"]
                    trailing = _after_handshake(ws)
                    if trailing is not None:
                        client._reader = FrameReader()
                        client._reader.feed(trailing)
                    return client
                if isinstance(event, RejectConnection):
                    status = event.status_code
                    if not event.has_body:
                        raise Refused(status, "")
                elif isinstance(event, RejectData):
                    body.append(bytes(event.data))
                    if event.body_finished:
                        raise Refused(status, b"".join(body).decode("utf-8", "replace"))

    def cookies(self) -> dict[str, str]:
        """Cookies the server set on the upgrade (a load balancer's affinity cookie among them)."""
        found: dict[str, str] = {}
        for raw in self.set_cookies:
            name, _, value = raw.split(";", 1)[0].partition("=")
            if name.strip():
                found[name.strip()] = value.strip()
        return found

    async def send_text(self, text: str) -> None:
        async with self._sending:
            try:
                await self._stream.send(client_frame(TEXT, text.encode()))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, LocalProtocolError) as exc:
                raise Closed(None, f"link broken: {exc}") from None

    async def receive_text(self) -> str:
        """The next text message; ``Closed`` once the socket is (after the messages that came before)."""
        ready = await self._wait_ready()
        return ready.popleft()

    async def receive_texts(self) -> list[str]:
        """Every text message that has come (at least one, waiting for it); ``Closed`` as ``receive_text``."""
        ready = await self._wait_ready()
        texts = list(ready)
        ready.clear()
        return texts

    async def _wait_ready(self) -> deque[str]:
        reader = self._reader
        while True:
            ready = reader.texts if reader is not None else self._ready
            if ready:
                return ready
            if self.closed is not None:
                raise self.closed
            try:
                data = await self._stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                self.closed = Closed(None, "link broken")
                raise self.closed from None
            if reader is None:
                self._ws.receive_data(data)
                for event in self._ws.events():
                    await self._handle(event)
                continue
            try:
                reader.feed(data)
            except ProtocolError as exc:
                reader.closed = (exc.code, str(exc))
            for payload in reader.pings:
                await self._handle(Ping(payload=payload))
            reader.pings.clear()
            if reader.closed is not None:
                await self._handle(CloseConnection(code=reader.closed[0] or 1005, reason=reader.closed[1]))

    async def _handle(self, event: object) -> None:
        """An event of wsproto's, or the same made of what ``FrameReader`` parsed."""
        if isinstance(event, TextMessage):
            self._text.append(event.data)
            if event.message_finished:
                self._ready.append("".join(self._text))
                self._text.clear()
        elif isinstance(event, Ping):
            async with self._sending:
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    await self._stream.send(self._ws.send(event.response()))
        elif isinstance(event, CloseConnection):
            self.closed = Closed(event.code, event.reason or "")
            async with self._sending:
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, LocalProtocolError):
                    await self._stream.send(self._ws.send(event.response()))
        elif isinstance(event, BytesMessage):
            pass  # ACP is text frames; binary ones are ignored

    async def aclose(self, code: int = 1000, reason: str = "") -> None:
        with anyio.move_on_after(1, shield=True):
            async with self._sending:
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, LocalProtocolError):
                    await self._stream.send(self._ws.send(CloseConnection(code=code, reason=reason)))
        await anyio.aclose_forcefully(self._stream)
