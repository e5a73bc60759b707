"""A WebSocket client for ``/acp``: wsproto over an anyio stream (TCP, TLS or a unix socket).

Small on purpose: ``acp-proxy connect`` starts with every gateway session, so it loads no
HTTP client library, only wsproto (and h11, which wsproto uses for the handshake). What the
server sends is read by ``FrameReader``, a few lines for the frames a server may send (never
masked, no extension negotiated): wsproto's general parser costs about 20 µs a frame, which a
streaming turn pays for every update; wsproto still writes the client's frames (masked).
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


TEXT, BINARY, CONTINUATION, CLOSE, PING, PONG = 0x1, 0x2, 0x0, 0x8, 0x9, 0xA


class ProtocolError(Exception):
    """What the server sent is not a WebSocket a client may accept (RFC 6455): the close code is 1002."""


class FrameReader:
    """Server frames from bytes as they arrive: text messages (fragments joined), pings, the close. No I/O."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._fragments: list[bytes] = []
        self._message: int | None = None
        """The opcode of the message whose fragments are being joined (``None``: none under way)."""
        self.texts: deque[str] = deque()
        self.pings: list[bytes] = []
        self.closed: tuple[int | None, str] | None = None

    def feed(self, data: bytes) -> None:
        """Parse ``data`` after what came before: complete messages go to ``texts``, pings to ``pings``, the
        server's close to ``closed``; ``ProtocolError`` for what no server may send."""
        buffer = self._buffer
        buffer += data
        at, end = 0, len(buffer)
        while end - at >= 2 and self.closed is None:
            first, second = buffer[at], buffer[at + 1]
            if first & 0x70 or second & 0x80:
                raise ProtocolError("a reserved bit, or a masked frame from the server")
            length, head = second & 0x7F, 2
            if length == 126:
                if end - at < 4:
                    break
                length, head = int.from_bytes(buffer[at + 2 : at + 4], "big"), 4
            elif length == 127:
                if end - at < 10:
                    break
                length, head = int.from_bytes(buffer[at + 2 : at + 10], "big"), 10
            if end - at < head + length:
                break
            payload = bytes(buffer[at + head : at + head + length])
            at += head + length
            self._frame(bool(first & 0x80), first & 0x0F, payload)
        del buffer[:at]

    def _frame(self, fin: bool, opcode: int, payload: bytes) -> None:
        if opcode >= CLOSE:
            if not fin or len(payload) > 125:
                raise ProtocolError("a fragmented or long control frame")
            if opcode == PING:
                self.pings.append(payload)
            elif opcode == CLOSE:
                code = int.from_bytes(payload[:2], "big") if len(payload) >= 2 else None
                self.closed = (code, payload[2:].decode("utf-8", "replace"))
            elif opcode != PONG:
                raise ProtocolError(f"unknown control opcode {opcode}")
            return
        if opcode == CONTINUATION:
            if self._message is None:
                raise ProtocolError("a continuation frame with no message under way")
        elif opcode in (TEXT, BINARY):
            if self._message is not None:
                raise ProtocolError("a new message before the last one ended")
            self._message = opcode
        else:
            raise ProtocolError(f"unknown opcode {opcode}")
        if self._message == TEXT:
            self._fragments.append(payload)
        if fin:
            if self._message == TEXT:  # binary messages are ignored (ACP is text frames)
                joined = self._fragments[0] if len(self._fragments) == 1 else b"".join(self._fragments)
                try:
                    self.texts.append(joined.decode())
                except UnicodeDecodeError:
                    raise ProtocolError("a text message that is not UTF-8") from None
            self._fragments.clear()
            self._message = None


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
        from wsproto.events import Message

        async with self._sending:
            try:
                await self._stream.send(self._ws.send(Message(data=text)))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, LocalProtocolError) as exc:
                raise Closed(None, f"link broken: {exc}") from None

    async def receive_text(self) -> str:
        """The next text message; ``Closed`` once the socket is (after the messages that came before)."""
        reader = self._reader
        while True:
            ready = reader.texts if reader is not None else self._ready
            if ready:
                return ready.popleft()
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
                reader.closed = (1002, str(exc))
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
