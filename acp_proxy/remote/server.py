"""``acp-proxy serve --listen/--socket``: the composition root of the network server.

The listening sockets are made here (a unix socket private to the user from its first
moment, a TCP port known before anyone connects). ``front.py`` accepts on them and gives each
connection to the server that speaks it: WebSockets to ``wsserver.py``, HTTP/1.1 and HTTP/2 to
hypercorn; behind TLS hypercorn's own accept loop takes them all. The ASGI application and the
hub do the rest. ``serve`` owns no adapter itself: each connection's stdio proxy does, so a ``serve``
that is killed leaves its proxies an EOF on stdin, and they suspend their sessions and exit.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path
from typing import Final

import anyio
import msgspec
import sniffio

from acp_proxy.remote.app import AcpApp
from acp_proxy.remote.front import FrontDoor, serve_front
from acp_proxy.remote.hub import Hub, Limits
from acp_proxy.remote.launcher import Launcher
from acp_proxy.remote.status import StatusFile
from acp_proxy.remote.tokens import RemoteStore

log = logging.getLogger("acp_proxy.serve")

WEBSOCKET_PING_INTERVAL: Final = 20.0
LOOPBACK: Final = frozenset({"127.0.0.1", "::1", "localhost"})


class ServeOptions(msgspec.Struct, frozen=True):
    """What the command line asked ``serve`` for."""

    state_dir: Path
    proxy_argv: list[str]
    listen: list[tuple[str, int]] = []
    unix_socket: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    allowed_origins: list[str] = []
    limits: Limits = Limits()
    proxy_exit_grace: float = 15.0
    default_backend: str | None = None


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[V6]:PORT`` or ``PORT`` (loopback); ``ValueError`` says what was expected."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--listen: expected HOST:PORT or PORT, got {text!r}")
    return host, int(port)


def is_loopback(host: str) -> bool:
    return host in LOOPBACK or host.startswith("127.")


def tcp_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def unix_socket(path: Path) -> socket.socket:
    """A unix socket only its user can connect to: made under umask 077, so never briefly open."""
    with suppress(FileNotFoundError):
        if path.is_socket():
            path.unlink()  # a socket left by a serve that was killed; a live serve holds its own lock
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


async def serve_network(options: ServeOptions, launcher: Launcher | None = None) -> int:
    """Serve until a signal; each connection's proxy forked by ``launcher``, or exec'd without one."""
    from hypercorn.config import Config as HttpConfig

    store = RemoteStore(options.state_dir)
    hub = Hub(
        store,
        options.proxy_argv,
        options.limits,
        default_backend=options.default_backend,
        proxy_exit_grace=options.proxy_exit_grace,
        launcher=launcher,
    )
    sockets = [tcp_socket(host, port) for host, port in options.listen]
    if options.unix_socket is not None:
        sockets.append(unix_socket(options.unix_socket))
    http = HttpConfig()
    http.bind = [f"fd://{sock.fileno()}" for sock in sockets]
    if options.tls_cert is not None and options.tls_key is not None:
        http.certfile, http.keyfile = str(options.tls_cert), str(options.tls_key)
    http.accesslog = None
    http.errorlog = logging.getLogger("acp_proxy.serve.http")
    http.websocket_max_message_size = options.limits.max_message_bytes
    http.websocket_ping_interval = WEBSOCKET_PING_INTERVAL
    http.h11_max_incomplete_size = 64 * 1024
    http.graceful_timeout = 2.0
    http.keep_alive_max_requests = 2**62  # every client message is a POST: a connection must not run out of them
    app = AcpApp(hub, store, allowed_origins=options.allowed_origins, unix_socket=options.unix_socket is not None)
    status = StatusFile(options.state_dir, hub, [_address(sock, options) for sock in sockets])
    hub.on_change = status.changed
    stop, http_done = anyio.Event(), anyio.Event()
    try:
        async with anyio.create_task_group() as tasks:
            await tasks.start(hub.run)
            tasks.start_soon(_stop_on_signals, stop)
            tasks.start_soon(status.keep)
            if options.tls_cert is not None:
                tasks.start_soon(_serve_http, app, http, stop, http_done)
            else:
                door = FrontDoor(
                    app, http, max_message=options.limits.max_message_bytes, ping_interval=WEBSOCKET_PING_INTERVAL
                )
                tasks.start_soon(_serve_front, door, sockets, stop, http_done, http.graceful_timeout)
            for address in status.addresses:
                print(f"listening: {address}", flush=True)
                log.info("serving ACP at %s", address)
            await stop.wait()
            log.info("shutting down: ending %d connection(s)", len(hub.connections))
            hub.end_all()  # each connection's proxy gets EOF; its handler returns, so hypercorn can finish
            with anyio.move_on_after(http.graceful_timeout + 3):
                await http_done.wait()
            hub.stop()  # waits for the connections' proxies to exit
            with anyio.move_on_after(options.proxy_exit_grace + 10):
                await hub.all_released.wait()
            tasks.cancel_scope.cancel()
    finally:
        status.remove()
        store.close()
        for sock in sockets:
            with suppress(OSError):  # hypercorn closes the descriptors it was handed
                sock.close()
        if options.unix_socket is not None:
            with suppress(OSError):
                options.unix_socket.unlink()
    return 0


class _ClosedConnectionCancelled(logging.Filter):
    """Drops Python 3.11's report of a finished connection's task cancelled at shutdown.

    hypercorn's WebSocket ping task keeps the task of a connection that has closed alive until its
    next ping; cancelled at shutdown, ``asyncio.streams`` (3.11) logs it as an error with a
    traceback, though nothing failed (3.13 no longer does).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        cancelled = record.exc_info is not None and isinstance(record.exc_info[1], asyncio.CancelledError)
        return not (cancelled and "StreamReaderProtocol.connection_made" in record.getMessage())


async def _serve_http(app: AcpApp, http: object, stop: anyio.Event, done: anyio.Event) -> None:
    if sniffio.current_async_library() == "trio":
        from hypercorn.trio import serve
    else:
        from hypercorn.asyncio import serve  # type: ignore[assignment]

        logging.getLogger("asyncio").addFilter(_ClosedConnectionCancelled())
    try:
        await serve(app, http, shutdown_trigger=stop.wait)  # type: ignore[arg-type]
    finally:
        stop.set()
        done.set()


async def _serve_front(
    door: FrontDoor, sockets: list[socket.socket], stop: anyio.Event, done: anyio.Event, grace: float
) -> None:
    try:
        await serve_front(door, sockets, stop, grace)
    finally:
        stop.set()
        done.set()


async def _stop_on_signals(stop: anyio.Event) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("received %s", signal.Signals(signum).name)
            stop.set()
            return


def _address(sock: socket.socket, options: ServeOptions) -> str:
    if sock.family == socket.AF_UNIX:
        return f"unix:{sock.getsockname()}"
    host, port = sock.getsockname()[:2]
    scheme = "https" if options.tls_cert is not None else "http"
    shown = f"[{host}]" if ":" in host else host
    return f"{scheme}://{shown}:{port}/acp"


def proxy_args(options: Sequence[str], command: Sequence[str], async_backend: str) -> list[str]:
    """The command line of the stdio proxy each connection runs (after ``python -m acp_proxy``): these
    options, this backend command."""
    args = ["--async-backend", async_backend, *options]
    return [*args, "--", *command] if command else args
