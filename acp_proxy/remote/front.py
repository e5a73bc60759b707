"""``serve``'s accept loop (plain TCP and the unix socket): each connection goes to the server that speaks it.

A connection's first bytes are looked at without being read (``MSG_PEEK``): a WebSocket upgrade
goes to ``wsserver`` (which writes a run of frames in one block), HTTP/2 by prior knowledge to
``h2server`` (a POST, its 202 and a run of events in one block), anything else (HTTP/1.1) to
hypercorn's server for one connection, the one its own accept loop runs.
Behind TLS the bytes are not readable here, so ``serve --tls-cert`` leaves every connection to
hypercorn, WebSockets included (``server.py``).

hypercorn's connection server is not part of its documented API: ``pyproject.toml`` bounds the
versions whose constructor this module calls (0.17 and 0.18 share it), and every HTTP test of
``serve`` runs through it on both event loops.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any, Final

import anyio
import anyio.abc
import sniffio

from acp_proxy.remote.h2server import Http2Server, serve_http2
from acp_proxy.remote.http2 import PREFACE
from acp_proxy.remote.wsserver import App, serve_websocket

log = logging.getLogger("acp_proxy.serve")

HEAD_LIMIT: Final = 64 * 1024
HEAD_TIMEOUT: Final = 10.0
"""A client that has not sent a whole request head by then goes to hypercorn, which has its own limits."""
HEAD_POLL: Final = 0.005
"""The pause before looking again at a head that came in parts (rare: clients write a head at once)."""
ACCEPT_PAUSE: Final = 0.1
"""After an accept that failed for want of descriptors or memory: the loop tries again after a pause."""


def is_websocket_upgrade(head: bytes) -> bool:
    """A whole request head (up to its blank line) asking ``GET`` with ``Upgrade: websocket``."""
    end = head.find(b"\r\n\r\n")
    if end < 0 or not head.startswith(b"GET "):
        return False
    for header in head[:end].split(b"\r\n")[1:]:
        name, sep, value = header.partition(b":")
        if sep and name.strip().lower() == b"upgrade":
            return any(token.strip().lower() == b"websocket" for token in value.split(b","))
    return False


def is_http2(head: bytes) -> bool:
    """The start of HTTP/2's connection preface (a client that knows the server speaks HTTP/2)."""
    return head.startswith(PREFACE[:16])


def prepare(conn: socket.socket) -> None:
    """Non-blocking, and a TCP connection's small writes sent at once: a short turn is a few small messages
    each way, and Nagle's algorithm would hold each behind the client's delayed ACK (40 ms on Linux)."""
    conn.setblocking(False)
    if conn.family in (socket.AF_INET, socket.AF_INET6):
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def peek_head(sock: socket.socket) -> bytes:
    """What the client has sent so far, up to a whole head (or ``HEAD_LIMIT``, or ``HEAD_TIMEOUT``), left
    unread; ``b""`` for a client that closed before a byte."""
    head = b""
    with anyio.move_on_after(HEAD_TIMEOUT):
        await anyio.wait_readable(sock)
        while True:
            try:
                head = sock.recv(HEAD_LIMIT, socket.MSG_PEEK)
            except BlockingIOError:
                await anyio.wait_readable(sock)
                continue
            if not head or b"\r\n\r\n" in head or len(head) >= HEAD_LIMIT:
                break
            await anyio.sleep(HEAD_POLL)
    return head


class HttpConnections:
    """hypercorn serving one accepted connection at a time, on the running event loop."""

    def __init__(self, app: App, config: Any) -> None:
        from hypercorn.app_wrappers import ASGIWrapper

        if sniffio.current_async_library() == "trio":
            from hypercorn.trio.worker_context import WorkerContext

            self.serve = self._serve_on_trio
        else:
            from hypercorn.asyncio.worker_context import WorkerContext  # type: ignore[assignment]

            self.serve = self._serve_on_asyncio
        self.app = ASGIWrapper(app)  # type: ignore[arg-type]
        self.config = config
        self.context = WorkerContext(None)

    async def _serve_on_trio(self, conn: socket.socket) -> None:
        import trio
        from hypercorn.trio.tcp_server import TCPServer

        stream = trio.SocketStream(trio.socket.from_stdlib_socket(conn))
        await TCPServer(self.app, self.config, self.context, {}, stream)  # type: ignore[arg-type]

    async def _serve_on_asyncio(self, conn: socket.socket) -> None:
        import asyncio

        from hypercorn.asyncio.tcp_server import TCPServer

        reader, writer = await asyncio.open_connection(sock=conn)
        loop = asyncio.get_running_loop()
        await TCPServer(self.app, loop, self.config, self.context, {}, reader, writer)  # type: ignore[arg-type]

    async def wind_down(self) -> None:
        """Connections close once idle, and a kept-alive one takes no new request."""
        await self.context.terminated.set()


class FrontDoor:
    """Accepts on ``sockets`` until cancelled; each connection's task runs in ``connections``."""

    def __init__(self, app: App, http_config: Any, *, max_message: int, ping_interval: float) -> None:
        self.app = app
        self.http = HttpConnections(app, http_config)
        self.idle_timeout = float(http_config.keep_alive_timeout)
        self.max_message = max_message
        self.ping_interval = ping_interval
        self.http2: set[Http2Server] = set()

    async def accept(self, sock: socket.socket, connections: anyio.abc.TaskGroup) -> None:
        sock.setblocking(False)
        while True:
            await anyio.wait_readable(sock)
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                continue  # another accept took it, or the client gave up first
            except OSError as exc:  # out of descriptors or memory: what is open goes on, accepts resume soon
                log.warning("accept failed: %s; trying again in %.1fs", exc, ACCEPT_PAUSE)
                await anyio.sleep(ACCEPT_PAUSE)
                continue
            connections.start_soon(self.connection, conn)

    async def connection(self, conn: socket.socket) -> None:
        try:
            prepare(conn)
            try:
                head = await peek_head(conn)
            except OSError:
                head = b""
            if not head:
                conn.close()
                return
            if is_websocket_upgrade(head):
                await self._websocket(conn)
            elif is_http2(head):
                await self._http2(conn)
            else:
                await self.http.serve(conn)
        except Exception:  # one connection's fault is its own: the others, and the accept loop, go on
            log.exception("a connection failed")
            conn.close()

    async def _http2(self, conn: socket.socket) -> None:
        opened = await _stream_of(conn)
        if opened is None:
            return
        stream, client, server = opened

        def register(connection: Http2Server) -> Callable[[], None]:
            self.http2.add(connection)
            return lambda: self.http2.discard(connection)

        await serve_http2(
            stream, self.app, client=client, server=server, idle_timeout=self.idle_timeout, register=register
        )

    async def wind_down(self) -> None:
        """No new request on a kept-alive connection; each closes once what it serves is done."""
        await self.http.wind_down()
        for connection in list(self.http2):
            await connection.wind_down()

    async def _websocket(self, conn: socket.socket) -> None:
        opened = await _stream_of(conn)
        if opened is None:
            return
        stream, client, server = opened
        await serve_websocket(
            stream,
            self.app,
            client=client,
            server=server,
            max_message=self.max_message,
            ping_interval=self.ping_interval,
        )


async def _stream_of(
    conn: socket.socket,
) -> tuple[anyio.abc.SocketStream, tuple[str, int] | None, tuple[str, int] | None] | None:
    """The connection as a stream, with the client's and this end's addresses (``None`` on a unix socket);
    ``None`` (and closed) for a client that reset it before it was served."""
    tcp = conn.family in (socket.AF_INET, socket.AF_INET6)
    try:
        client = _address(conn.getpeername()) if tcp else None
        server = _address(conn.getsockname()) if tcp else None
        return await anyio.abc.SocketStream.from_socket(conn), client, server
    except (OSError, ValueError) as exc:
        log.debug("a client left before it was served: %s", exc)
        conn.close()
        return None


def _address(address: Sequence[Any]) -> tuple[str, int]:
    return str(address[0]), int(address[1])


async def serve_front(door: FrontDoor, sockets: Sequence[socket.socket], stop: anyio.Event, grace: float) -> None:
    """Accept until ``stop``; then no new connection, kept-alive HTTP ones close once idle, and what is still
    open after ``grace`` is cut."""
    async with anyio.create_task_group() as connections:
        async with anyio.create_task_group() as accepting:
            for sock in sockets:
                accepting.start_soon(door.accept, sock, connections)
            await stop.wait()
            accepting.cancel_scope.cancel()
        await door.wind_down()
        connections.cancel_scope.deadline = anyio.current_time() + grace
