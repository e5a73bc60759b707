"""The server side of a WebSocket on ``/acp``: an ASGI WebSocket connection over an anyio stream.

``serve`` runs its WebSockets here rather than through hypercorn (which keeps HTTP/1.1 and
HTTP/2, and WebSockets behind TLS): a streaming turn sends one frame for each update, and
hypercorn makes each of them an ASGI event through wsproto's frame writer and a socket write of
its own, about 13 µs of ``serve``'s CPU a message and a syscall a frame for the client too. Here
the application may send a run of messages at once (the ``acp.websocket.lines`` extension): their
frames are built in one pass and written in one block. wsproto does the handshake; the frames,
both ways, are ``frames.py``'s (binary messages from the client are dropped: ACP is text frames).

The application sees plain ASGI (``websocket.connect``, ``.receive``, ``.disconnect``; ``.accept``,
``.send``, ``.close`` and the ``websocket.http.response`` refusal), so ``AcpApp`` is the same code
on both servers.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import suppress
from typing import Any, Final

import anyio
import anyio.abc
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, RejectConnection, RejectData, Request
from wsproto.utilities import RemoteProtocolError

from acp_proxy.remote.frames import (
    BINARY,
    CLOSE,
    NO_STATUS,
    PING,
    PONG,
    TEXT,
    FrameReader,
    ProtocolError,
    close_frame,
    frame,
    may_send,
    text_frames,
)

log = logging.getLogger("acp_proxy.serve")

LINES: Final = "acp.websocket.lines"
"""The ASGI extension (in the scope) and message type: ``{"type": LINES, "lines": [bytes, ...]}`` sends each
line, its newline left out, as one text frame, all of them in one write."""

HANDSHAKE_LIMIT: Final = 64 * 1024
HANDSHAKE_TIMEOUT: Final = 10.0
CLOSE_TIMEOUT: Final = 1.0
"""How long a closed socket waits for the client's close frame before it is cut."""

INTERNAL_ERROR: Final = 1011
ABNORMAL: Final = 1006

Message = MutableMapping[str, Any]
App = Callable[[Message, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


class Gone(OSError):
    """A write to a WebSocket whose client has gone (what an ASGI server raises from ``send``)."""


class ServerSocket:
    """One WebSocket as ASGI's ``receive`` and ``send``. Reads happen in ``receive`` (the application always
    waits in it), writes under one lock; a ping goes out every ``ping_interval`` once accepted.

    After the handshake the frames are ``frames.py``'s both ways; the close handshake is kept here: ``closing``
    once this end sent its close, ``close_code`` once the socket is closed (by either side or a broken link).
    """

    def __init__(self, stream: anyio.abc.ByteStream, ws: WSConnection, max_message: int) -> None:
        self._stream = stream
        self._ws = ws
        """wsproto's handshake, for the upgrade's answer."""
        self._reader = FrameReader(masked=True, max_message=max_message)
        self._lock = anyio.Lock(fast_acquire=True)
        self._connected = False
        self.accepted = False
        self.answered = False
        """Accepted, or refused with an HTTP response: the handshake is over."""
        self.closing = False
        self.close_code: int | None = None
        """What ``websocket.disconnect`` says, once the socket is closed."""
        self._refusal: tuple[int, list[tuple[bytes, bytes]]] | None = None

    async def receive(self) -> Message:
        if not self._connected:
            self._connected = True
            return {"type": "websocket.connect"}
        reader = self._reader
        while True:
            if reader.texts:
                return {"type": "websocket.receive", "text": reader.texts.popleft()}
            if self.close_code is not None or not self.accepted:
                return {"type": "websocket.disconnect", "code": self.close_code or ABNORMAL}
            try:
                data = await self._stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                self.close_code = ABNORMAL
                continue
            try:
                reader.feed(data)
            except ProtocolError as exc:
                await self._close(exc.code, str(exc))
                self.close_code = exc.code
            for payload in reader.pings:
                await self._write(frame(PONG, payload), quiet=True)
            reader.pings.clear()
            if reader.closed is not None and self.close_code is None:
                code = reader.closed[0]
                if not self.closing:  # the client's close, answered with its code (RFC 6455 5.5.1)
                    answer = close_frame(code) if code is not None and may_send(code) else frame(CLOSE, b"")
                    await self._write(answer, quiet=True)
                self.closing = True
                self.close_code = code if code is not None else NO_STATUS

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == LINES:
            await self._data(text_frames(message["lines"]))
        elif kind == "websocket.send":
            text = message.get("text")
            await self._data(frame(TEXT, text.encode()) if text is not None else frame(BINARY, message["bytes"]))
        elif kind == "websocket.accept":
            if self.answered:
                raise RuntimeError("websocket.accept after the handshake was answered")
            self.answered = self.accepted = True
            headers = list(message.get("headers", []))
            await self._write(self._ws.send(AcceptConnection(extra_headers=headers)))
        elif kind == "websocket.close":
            if not self.answered:
                await self._refuse(403, [], b"")
            else:
                await self._close(int(message.get("code", 1000)), str(message.get("reason") or ""))
        elif kind == "websocket.http.response.start":
            if self.answered:
                raise RuntimeError("an HTTP response after the handshake was answered")
            self._refusal = (int(message["status"]), list(message.get("headers", [])))
        elif kind == "websocket.http.response.body":
            if self._refusal is None:
                raise RuntimeError("websocket.http.response.body before its start")
            if not message.get("more_body", False):
                status, headers = self._refusal
                await self._refuse(status, headers, bytes(message.get("body", b"")))
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r} on a WebSocket")

    async def _data(self, frames: bytes) -> None:
        if self.closing or self.close_code is not None:
            raise Gone("the WebSocket is closed")
        await self._write(frames)

    async def _refuse(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.answered = True
        self.close_code = self.close_code or 1000
        headers = [*headers, (b"content-length", b"%d" % len(body))]
        data = self._ws.send(RejectConnection(status_code=status, headers=headers, has_body=bool(body)))
        if body:
            data += self._ws.send(RejectData(data=body, body_finished=True))
        await self._write(data, quiet=True)

    async def _close(self, code: int, reason: str) -> None:
        """This end's close frame (once); the socket is closed when the client's comes back (or it is cut)."""
        if not self.closing and self.close_code is None:
            self.closing = True
            await self._write(close_frame(code, reason), quiet=True)

    async def _write(self, data: bytes, *, quiet: bool = False) -> None:
        try:
            async with self._lock:
                await self._stream.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            if self.close_code is None:
                self.close_code = ABNORMAL
            if not quiet:
                raise Gone(f"the WebSocket's link broke: {exc}") from None

    async def keep_alive(self, interval: float) -> None:
        """A ping every ``interval`` while open: an idle link stays open through intermediaries, and a dead one
        is found by the write that fails."""
        while self.close_code is None:
            await anyio.sleep(interval)
            if self.accepted and not self.closing and self.close_code is None:
                await self._write(frame(PING, b""), quiet=True)

    async def finish(self, *, failed: bool = False) -> None:
        """After the application returned (or ``failed``): refuse a handshake it never answered, close an open
        socket, and wait a moment for the client's close frame (the order RFC 6455 gives a clean close)."""
        if not self.answered:
            await self._refuse(500, [], b"")
            return
        await self._close(INTERNAL_ERROR if failed else 1000, "")
        with anyio.move_on_after(CLOSE_TIMEOUT):
            while self.close_code is None:
                await self.receive()


async def handshake(stream: anyio.abc.ByteStream) -> tuple[WSConnection, Request] | None:
    """Read the client's upgrade request; ``None`` (answered 400, or gone) when it is not one."""
    ws = WSConnection(ConnectionType.SERVER)
    received = 0
    with anyio.move_on_after(HANDSHAKE_TIMEOUT):
        while received <= HANDSHAKE_LIMIT:
            try:
                data = await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                return None
            received += len(data)
            try:
                ws.receive_data(data)
                for event in ws.events():
                    if isinstance(event, Request):
                        return ws, event
            except RemoteProtocolError as exc:
                log.info("refused a WebSocket upgrade: %s", exc)
                break
    with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        body = b"not a WebSocket upgrade request\n"
        await stream.send(
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
        )
    return None


async def serve_websocket(
    stream: anyio.abc.ByteStream,
    app: App,
    *,
    client: tuple[str, int] | None,
    server: tuple[str, int] | None,
    max_message: int,
    ping_interval: float,
) -> None:
    """Run ``app`` for the WebSocket whose upgrade request ``stream`` carries, until both are done."""
    try:
        opened = await handshake(stream)
        if opened is None:
            return
        ws, request = opened
        path, _, query = request.target.partition("?")
        headers = [(name.lower(), value) for name, value in request.extra_headers]
        headers.append((b"host", request.host.encode()))
        scope: Message = {
            "type": "websocket",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "scheme": "ws",
            "path": path,
            "raw_path": path.encode(),
            "query_string": query.encode(),
            "root_path": "",
            "headers": headers,
            "client": client,
            "server": server,
            "subprotocols": request.subprotocols,
            "extensions": {"websocket.http.response": {}, LINES: {}},
        }
        socket = ServerSocket(stream, ws, max_message)
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(socket.keep_alive, ping_interval)
            failed = False
            try:
                await app(scope, socket.receive, socket.send)
            except Exception:
                log.exception("the WebSocket application failed")
                failed = True
            await socket.finish(failed=failed)
            tasks.cancel_scope.cancel()
    finally:
        await anyio.aclose_forcefully(stream)
