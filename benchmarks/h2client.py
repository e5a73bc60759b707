"""A small HTTP/2 client (cleartext, prior knowledge) for the remote benchmark's streamable HTTP figures.

The benchmark's client is a peer whose own cost should not be the figure: over WebSocket it is the
project's own client (``acp_proxy.remote.wsclient``), over stdio a pipe. httpx's HTTP/2 (httpcore
over h2) spends about 1.8 ms of the client's CPU on a short turn, more than the turn takes over
stdio, so the benchmark speaks HTTP/2 through this instead: frames by hand with ``serve``'s own
constants and literal header fields (``acp_proxy.remote.http2``), responses' headers decoded by
``hpack``, one task reading the connection. Requests and their bodies are sent whole; a response's
body is read as it comes, and credited back (WINDOW_UPDATE) as it is read, as any client must.
What the server breaks ends the connection with ``H2Error``; nothing is retried.
"""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator, Callable
from typing import Final
from urllib.parse import urlsplit

import anyio
import anyio.abc
import hpack

from acp_proxy.remote.http2 import (
    ACK,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    FRAME_HEAD,
    GOAWAY,
    HEADERS,
    INITIAL_WINDOW_SIZE,
    MAX_FRAME_SIZE,
    PADDED,
    PING,
    PREFACE,
    PRIORITY_FLAG,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    literal_fields,
)

WINDOW: Final = 1 << 20
"""The receive window of each stream and of the connection; credited back a quarter at a time."""
FRAME: Final = 16_384


class H2Error(Exception):
    """The connection ended, or the server sent what this client does not accept."""


class Response:
    """A response's status and headers, then its body as it comes (``chunks``)."""

    def __init__(self, client: H2Client, stream_id: int) -> None:
        self.client = client
        self.stream_id = stream_id
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.head = anyio.Event()
        self.parts, self.outlet = anyio.create_memory_object_stream[bytes](float("inf"))
        self.error: str | None = None
        self.ended = False
        self.done = anyio.Event()
        self.on_data: Callable[[bytes], None] | None = None
        """Given each part of the body as it is read (in the reading task), instead of ``chunks``."""

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's parts until it ends; ``H2Error`` if the stream or the connection breaks first."""
        async for part in self.outlet:
            self.client.credit(self.stream_id, len(part))
            if self.client.pending:
                await self.client.write(b"")
            yield part
        if self.error is not None:
            raise H2Error(self.error)

    async def read(self) -> bytes:
        if self.ended and self.outlet.statistics().current_buffer_used == 0:
            return b""  # a response whose headers ended it: nothing to wait for
        return b"".join([part async for part in self.chunks()])


class H2Client:
    """One HTTP/2 connection to ``url``'s host (or to a unix socket: ``unix:PATH``), its requests concurrent."""

    def __init__(self, stream: anyio.abc.ByteStream, authority: bytes, path: bytes) -> None:
        self.stream = stream
        self.authority = authority
        self.path = path
        self.decoder = hpack.Decoder()
        self.blocks: dict[tuple[str, tuple[tuple[bytes, bytes], ...]], bytes] = {}
        """Each request's header block, made once: literals never indexed, so no encoder state to keep (what
        a client that indexes them would send is smaller, not cheaper for the server to read)."""
        self.responses: dict[int, Response] = {}
        self.next_id = 1
        self.send_window = 65_535
        self.initial = 65_535
        self.windows: dict[int, int] = {}
        self.unacked: dict[int, int] = {0: 0}
        self.opened = anyio.Event()
        self.lock = anyio.Lock(fast_acquire=True)
        self.block: tuple[int, int, bytearray] | None = None
        self.ended: str | None = None
        self.pending = bytearray()
        """Frames to go out with the next write (credits)."""

    @classmethod
    async def connect(cls, url: str, tasks: anyio.abc.TaskGroup) -> H2Client:
        parts = urlsplit(url)
        stream: anyio.abc.ByteStream = await anyio.connect_tcp(parts.hostname or "127.0.0.1", parts.port or 80)
        client = cls(stream, parts.netloc.encode(), (parts.path or "/").encode())
        settings = struct.pack(">HLHL", INITIAL_WINDOW_SIZE, WINDOW, MAX_FRAME_SIZE, FRAME)
        out = bytearray(PREFACE)
        client.frame(out, SETTINGS, 0, 0, settings)
        client.frame(out, WINDOW_UPDATE, 0, 0, struct.pack(">L", WINDOW - 65_535))
        await stream.send(bytes(out))
        tasks.start_soon(client.read_frames)
        return client

    @staticmethod
    def frame(out: bytearray, kind: int, flags: int, stream_id: int, payload: bytes | memoryview) -> None:
        out += FRAME_HEAD.pack(len(payload) >> 16, len(payload) & 0xFFFF, kind, flags, stream_id)
        out += payload

    async def request(
        self,
        method: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes = b"",
        *,
        wait: bool = True,
        on_data: Callable[[bytes], None] | None = None,
    ) -> Response:
        """Send a request with its whole body; its response once its headers came (``wait``), or at once.
        ``on_data``: its body's parts go there as they are read (``Response.done`` once it ends)."""
        if self.ended is not None and wait:
            raise H2Error(self.ended)
        stream_id, self.next_id = self.next_id, self.next_id + 2
        response = self.responses[stream_id] = Response(self, stream_id)
        response.on_data = on_data
        self.windows[stream_id] = self.initial
        self.unacked[stream_id] = 0
        key = (method, tuple(headers))
        block = self.blocks.get(key)
        if block is None:
            fields = [(b":method", method.encode()), (b":scheme", b"http"), (b":authority", self.authority)]
            block = bytearray()
            literal_fields(block, [*fields, (b":path", self.path), *headers])
            self.blocks[key] = block = bytes(block)
        out = bytearray()
        self.frame(out, HEADERS, END_HEADERS | (0 if body else END_STREAM), stream_id, block)
        view = memoryview(body)
        while view:
            room = min(self.send_window, self.windows.get(stream_id, 0), FRAME)
            if room <= 0:
                raise H2Error("a request body larger than the server's window")  # never in the benchmark
            part, view = view[:room], view[room:]
            self.frame(out, DATA, 0 if view else END_STREAM, stream_id, part)
            self.send_window -= len(part)
            self.windows[stream_id] -= len(part)
        await self.write(out)
        if not wait:
            return response
        await response.head.wait()
        if response.error is not None and not response.status:
            raise H2Error(response.error)
        return response

    def credit(self, stream_id: int, size: int) -> None:
        """A response body's bytes read: the server may send as many again (a quarter window at a time)."""
        out = bytearray()
        for key in (0, stream_id):
            unacked = self.unacked.get(key)
            if unacked is None:
                continue  # a stream that has ended needs no credit
            unacked += size
            if unacked >= WINDOW // 4:
                self.frame(out, WINDOW_UPDATE, 0, key, struct.pack(">L", unacked))
                unacked = 0
            self.unacked[key] = unacked
        self.pending += out

    async def write(self, out: bytearray | bytes) -> None:
        async with self.lock:
            data = bytes(self.pending) + bytes(out) if self.pending else out
            self.pending = bytearray()
            await self.stream.send(bytes(data))

    async def read_frames(self) -> None:
        """Read the connection until it ends: frames to their responses, settings and pings answered."""
        buffer = bytearray()
        why = "the server closed the connection"
        try:
            while True:
                try:
                    buffer += await self.stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    break
                at, out = 0, bytearray()
                while len(buffer) - at >= 9:
                    high, low, kind, flags, stream_id = FRAME_HEAD.unpack_from(buffer, at)
                    length = high << 16 | low
                    if len(buffer) - at - 9 < length:
                        break
                    payload = bytes(buffer[at + 9 : at + 9 + length])
                    at += 9 + length
                    self.on_frame(kind, flags, stream_id & 0x7FFFFFFF, payload, out)
                del buffer[:at]
                if out or self.pending:
                    await self.write(out)
        except H2Error as exc:
            why = str(exc)
        finally:
            self.ended = why
            for response in self.responses.values():
                response.error = why
                response.head.set()
                response.done.set()
                response.parts.close()

    def on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes, out: bytearray) -> None:
        if kind == DATA:
            if flags & PADDED:
                payload = payload[1 : len(payload) - payload[0]]
            response = self.responses.get(stream_id)
            if response is not None:
                if payload and response.on_data is not None:
                    response.on_data(payload)
                    self.credit(stream_id, len(payload))
                elif payload:
                    response.parts.send_nowait(payload)
                if flags & END_STREAM:
                    self.finish(stream_id)
        elif kind in (HEADERS, CONTINUATION):
            if kind == HEADERS:
                if flags & PADDED:
                    payload = payload[1 : len(payload) - payload[0]]
                if flags & PRIORITY_FLAG:
                    payload = payload[5:]
                self.block = (stream_id, flags, bytearray())
            if self.block is None:
                raise H2Error("CONTINUATION without HEADERS")
            first, first_flags, block = self.block
            block += payload
            if flags & END_HEADERS:
                self.block = None
                headers = self.decoder.decode(bytes(block), raw=True)
                response = self.responses.get(first)
                if response is not None and not response.status:
                    response.headers = {bytes(name): bytes(value) for name, value in headers}
                    response.status = int(response.headers.get(b":status", b"0"))
                    response.head.set()
                if first_flags & END_STREAM:
                    self.finish(first)
        elif kind == SETTINGS and not flags & ACK:
            for key, value in struct.iter_unpack(">HL", payload):
                if key == INITIAL_WINDOW_SIZE:
                    for sid in self.windows:
                        self.windows[sid] += value - self.initial
                    self.initial = value
            self.frame(out, SETTINGS, ACK, 0, b"")
        elif kind == WINDOW_UPDATE:
            increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
            if stream_id == 0:
                self.send_window += increment
            elif stream_id in self.windows:
                self.windows[stream_id] += increment
        elif kind == PING and not flags & ACK:
            self.frame(out, PING, ACK, 0, payload)
        elif kind == RST_STREAM:
            response = self.responses.get(stream_id)
            if response is not None:
                response.error = f"the server reset the stream ({int.from_bytes(payload, 'big')})"
                response.head.set()
            self.finish(stream_id)
        elif kind == GOAWAY:
            code = int.from_bytes(payload[4:8], "big")
            if code:
                raise H2Error(f"GOAWAY {code}: {payload[8:].decode(errors='replace')}")

    def finish(self, stream_id: int) -> None:
        response = self.responses.pop(stream_id, None)
        self.windows.pop(stream_id, None)
        self.unacked.pop(stream_id, None)
        if response is not None:
            response.ended = True
            response.head.set()
            response.done.set()
            response.parts.close()

    async def aclose(self) -> None:
        await self.stream.aclose()
