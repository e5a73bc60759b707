"""The server side of an HTTP/2 connection (cleartext, prior knowledge): an ASGI application over ``http2.py``.

``serve`` runs its HTTP/2 connections here rather than through hypercorn (which keeps HTTP/1.1, and
everything behind TLS): a short turn over streamable HTTP is a POST, its 202 and a run of events on
a stream already open, and hypercorn made that about 1.7 ms of ``serve``'s CPU. One task reads the
connection and hands what it reads to the requests' applications, a task each; every write takes
what all of them queued (``Http2Connection`` holds the frames), so a run of events and the 202
beside it go out in one block.

The application sees plain ASGI HTTP (``http.request`` and ``http.disconnect``; ``http.response.start``
and ``.body``), so ``AcpApp`` is the same code on both servers.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from typing import Any, Final
from urllib.parse import unquote

import anyio
import anyio.abc

from acp_proxy.remote.http2 import Body, Closing, Code, Credit, Http2Connection, Request, Reset, StreamGone
from acp_proxy.remote.wsserver import App, Message

log = logging.getLogger("acp_proxy.serve")

TEARDOWN_TIMEOUT: Final = 1.0
"""How long a request's last frames (its 500, or its reset) may take to go out once its application ended."""


class Gone(OSError):
    """A write for a request whose client has gone: it reset the stream, or the connection closed (what an ASGI
    server raises from ``send``)."""


class Exchange:
    """One request and its response, as ASGI's ``receive`` and ``send``."""

    def __init__(self, server: Http2Server, stream_id: int, ended: bool) -> None:
        self.server = server
        self.stream_id = stream_id
        self.body: deque[bytes] = deque()
        self.body_ended = ended
        """The client sent the whole body (some of it may still wait in ``body``)."""
        self.told_end = False
        """``receive`` said ``more_body: False``."""
        self.gone = False
        self.finished = False
        """The response was sent whole."""
        self.arrived = anyio.Event()
        self.start: tuple[int, list[tuple[bytes, bytes]]] | None = None
        self.started = False

    def wake(self) -> None:
        self.arrived.set()

    async def receive(self) -> Message:
        while True:
            if self.body or (self.body_ended and not self.told_end):
                data = b"".join(self.body)
                self.body.clear()
                more = not self.body_ended
                self.told_end = not more
                self.server.conn.taken(self.stream_id, len(data))
                if self.server.conn.pending:  # its credit, now: the client may be waiting for it to send more
                    with suppress(Gone):
                        await self.server.flush()
                return {"type": "http.request", "body": data, "more_body": more}
            if self.gone or self.finished:
                return {"type": "http.disconnect"}
            self.arrived = anyio.Event()
            await self.arrived.wait()

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.body":
            if self.start is None:
                raise RuntimeError("http.response.body before http.response.start")
            if self.finished:
                raise RuntimeError("http.response.body after the response's end")
            await self.server.answer(self, bytes(message.get("body", b"")), bool(message.get("more_body", False)))
        elif kind == "http.response.start":
            if self.start is not None:
                raise RuntimeError("a second http.response.start")
            self.start = (int(message["status"]), list(message.get("headers", [])))
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r} on an HTTP/2 stream")


class Http2Server:
    """Serves one HTTP/2 connection on ``stream`` until the client closes it, breaks the protocol, leaves it
    idle for ``idle_timeout`` with no request open, or ``wind_down`` was called and its requests are done."""

    def __init__(
        self,
        stream: anyio.abc.ByteStream,
        app: App,
        *,
        client: tuple[str, int] | None,
        server: tuple[str, int] | None,
        idle_timeout: float,
        max_streams: int = 100,
        max_header_list: int = 2**16,
    ) -> None:
        self.stream = stream
        self.app = app
        self.client = client
        self.server = server
        self.idle_timeout = idle_timeout
        self.conn = Http2Connection(max_streams=max_streams, max_header_list=max_header_list)
        self.exchanges: dict[int, Exchange] = {}
        self.credited = anyio.Event()
        self.broken = False
        self._lock = anyio.Lock(fast_acquire=True)
        self._reading = anyio.CancelScope()
        self._idle = anyio.CancelScope()
        """The reader's wait, cut once the connection has had no request open for ``idle_timeout``."""

    async def run(self) -> None:
        async with anyio.create_task_group() as tasks:
            try:
                with self._reading:
                    await self.flush()
                    await self._read(tasks)
            except Gone:
                pass
            finally:  # the link is gone, or this end let it go: every request's application is told
                self.broken = True
                for exchange in self.exchanges.values():
                    exchange.gone = True
                    exchange.wake()
                self.credited.set()

    async def _read(self, tasks: anyio.abc.TaskGroup) -> None:
        conn = self.conn
        while True:
            idle = self._idle = anyio.CancelScope(deadline=self._idle_deadline())
            with idle:
                try:
                    data = await self.stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    return
            if idle.cancelled_caught:
                conn.goaway()
                await self.flush()
                return
            for event in conn.receive(data):
                if isinstance(event, Body):
                    exchange = self.exchanges.get(event.stream_id)
                    if exchange is not None:
                        if event.data:
                            exchange.body.append(event.data)
                        exchange.body_ended = event.ended
                        exchange.wake()
                    else:
                        conn.taken(event.stream_id, len(event.data))
                elif isinstance(event, Request):
                    exchange = self.exchanges[event.stream_id] = Exchange(self, event.stream_id, event.ended)
                    tasks.start_soon(self._serve, exchange, self._scope(event.headers))
                elif isinstance(event, Credit):
                    self.credited.set()
                elif isinstance(event, Reset):
                    gone = self.exchanges.get(event.stream_id)
                    if gone is not None:
                        gone.gone = True
                        gone.wake()
                        self.credited.set()
                elif isinstance(event, Closing) and not event.by_client:
                    log.info("an HTTP/2 client broke the protocol: %s", event.message)
                    await self.flush()
                    return
            await self.flush()
            if conn.closing is not None and not self.exchanges:
                return

    async def _serve(self, exchange: Exchange, scope: Message) -> None:
        try:
            await self.app(scope, exchange.receive, exchange.send)
        except Gone:
            pass
        except Exception:
            log.exception("an HTTP/2 request's application failed")
        finally:
            del self.exchanges[exchange.stream_id]
            leftover = sum(map(len, exchange.body))
            if leftover:
                self.conn.taken(exchange.stream_id, leftover)
            if not exchange.finished and not exchange.gone and not self.broken:
                with suppress(StreamGone):  # unanswered, or cut short: the client is told it failed
                    if not exchange.started:
                        self.conn.respond(exchange.stream_id, 500, [], end=True)
                    else:
                        self.conn.reset(exchange.stream_id, Code.INTERNAL_ERROR)
            if not self.exchanges:
                self._idle.deadline = self._idle_deadline()  # idle from now (the reader may be waiting already)
                if self.conn.closing is not None:
                    self._reading.cancel()  # nothing left to serve on a connection that is going away
            if self.conn.pending:
                with anyio.CancelScope(shield=True), anyio.move_on_after(TEARDOWN_TIMEOUT), suppress(Gone):
                    await self.flush()

    def _idle_deadline(self) -> float:
        return anyio.current_time() + self.idle_timeout if not self.exchanges else math.inf

    def _scope(self, headers: list[tuple[bytes, bytes]]) -> Message:
        pseudo: dict[bytes, bytes] = {}
        fields: list[tuple[bytes, bytes]] = []
        for name, value in headers:
            if name.startswith(b":"):
                pseudo[name] = value
            else:
                fields.append((name, value))
        authority = pseudo.get(b":authority")
        if authority is not None and not any(name == b"host" for name, _ in fields):
            fields.append((b"host", authority))
        raw_path, _, query = pseudo.get(b":path", b"").partition(b"?")
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "2",
            "method": pseudo[b":method"].decode("latin-1"),
            "scheme": pseudo.get(b":scheme", b"http").decode("latin-1"),
            "path": unquote(raw_path.decode("latin-1")),
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": fields,
            "client": self.client,
            "server": self.server,
            "extensions": {},
        }

    async def answer(self, exchange: Exchange, body: bytes, more: bool) -> None:
        """Send ``body`` on the exchange's stream (its headers first, with the first part), as the client's
        windows allow."""
        conn, stream_id, end = self.conn, exchange.stream_id, not more
        if exchange.gone or self.broken:
            raise Gone("the client has gone")
        try:
            if not exchange.started:
                assert exchange.start is not None
                status, headers = exchange.start
                exchange.started = True
                conn.respond(stream_id, status, headers, end=end and not body)
                if end and not body:
                    exchange.finished = True
            view = memoryview(body)
            while not exchange.finished:
                sent = conn.send(stream_id, view, end=end)
                view = view[sent:]
                if not view:
                    exchange.finished = end
                    break
                if self.credited.is_set():  # before the write: a credit that comes during it is not missed
                    self.credited = anyio.Event()
                credited = self.credited
                await self.flush()
                if not conn.sendable(stream_id) and not (exchange.gone or self.broken):
                    await credited.wait()
                if exchange.gone or self.broken:
                    raise Gone("the client has gone")
        except StreamGone:
            exchange.gone = True
            raise Gone("the client reset the stream") from None
        await self.flush()

    async def flush(self) -> None:
        """Write what every request queued so far, in one block. ``Gone`` once the link has broken."""
        async with self._lock:
            data = self.conn.data_to_send()
            if not data:
                return
            try:
                await self.stream.send(data)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                self.broken = True
                self._reading.cancel()
                raise Gone(f"the HTTP/2 connection broke: {exc}") from None

    async def wind_down(self) -> None:
        """No new request (GOAWAY); the connection closes once those open are done."""
        self.conn.goaway()
        if not self.exchanges:
            self._reading.cancel()
        with suppress(Gone):
            await self.flush()


async def serve_http2(
    stream: anyio.abc.ByteStream,
    app: App,
    *,
    client: tuple[str, int] | None,
    server: tuple[str, int] | None,
    idle_timeout: float,
    register: Callable[[Http2Server], Callable[[], Any]] | None = None,
) -> None:
    """Serve the HTTP/2 connection ``stream`` carries until it ends, then close it. ``register`` is told of the
    connection (for a wind-down) and returns what undoes that."""
    connection = Http2Server(stream, app, client=client, server=server, idle_timeout=idle_timeout)
    forget = register(connection) if register is not None else None
    try:
        await connection.run()
        with anyio.move_on_after(TEARDOWN_TIMEOUT), suppress(Gone):
            await connection.flush()  # a GOAWAY of this end's, queued as it stopped reading
    finally:
        if forget is not None:
            forget()
        await anyio.aclose_forcefully(stream)
