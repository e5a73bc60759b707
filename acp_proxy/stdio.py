"""Pipes as anyio byte streams on raw file descriptors, on asyncio and trio alike.

Used for the proxy's own stdin/stdout and for the pipes to each adapter. Reads
and writes go straight to the descriptors in non-blocking mode and wait for
readiness through the event loop: no worker thread, no extra buffer copy. On
asyncio a reading descriptor stays registered with the loop between reads
(``anyio.wait_readable`` adds and removes it for every wait: two ``epoll_ctl``
calls and a registry lookup per message on a relay that alternates); on trio,
``anyio.wait_readable``. A read that did not have to wait still yields once (a
checkpoint) so a busy pipe cannot starve other tasks; one that waited has already yielded.
Regular files (``acp-proxy < transcript.jsonl``) cannot be polled and never
block, so they are read in blocking mode. Descriptors we do not own (our
stdin/stdout) get their original flags back on close; owned ones are closed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import sniffio
from anyio.abc import ByteReceiveStream, ByteSendStream

if TYPE_CHECKING:
    import asyncio


class _FdStreamBase:
    def __init__(self, fd: int, *, owned: bool = False) -> None:
        self._fd = fd
        self._owned = owned
        self._closed = False
        self._saved_blocking: bool | None = None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            self._saved_blocking = os.get_blocking(fd)
            os.set_blocking(fd, False)

    def _restore(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            if self._owned:
                anyio.notify_closing(self._fd)  # wake any task waiting on it before it goes
                os.close(self._fd)
            elif self._saved_blocking is not None:
                os.set_blocking(self._fd, self._saved_blocking)


class _Watched:
    """asyncio: a descriptor registered with the loop from its first wait until nobody waits on it.

    Readiness with a reader waiting wakes it; readiness with none unregisters the descriptor (a
    relay that stopped reading, held up by its output, is not woken for nothing on every turn of the
    loop), and the next wait registers it again.
    """

    def __init__(self, fd: int) -> None:
        import asyncio  # running already: not imported before the first adapter is launched (``acp_proxy.main``)

        self._fd = fd
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] | None = None
        self._registered = False

    def _ready(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is None:
            self._loop.remove_reader(self._fd)
            self._registered = False
        elif not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        if not self._registered:
            self._loop.add_reader(self._fd, self._ready)
            self._registered = True
        self._waiter = waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            if self._waiter is waiter:  # cancelled: nobody waits now
                self._waiter = None

    def close(self) -> None:
        """Before the descriptor is closed: unregistered, and a waiting reader woken (it finds the stream closed)."""
        if self._registered:
            self._loop.remove_reader(self._fd)
            self._registered = False
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class FdReceiveStream(_FdStreamBase, ByteReceiveStream):
    _watched: _Watched | None = None
    _on_asyncio: bool | None = None
    """Which loop reads it: asked at its first wait, not at every one (a trio relay waits per message)."""

    async def receive(self, max_bytes: int = 65536) -> bytes:
        waited = False
        while True:
            if self._closed:
                raise anyio.ClosedResourceError
            try:
                data = os.read(self._fd, max_bytes)
            except BlockingIOError:
                await self._wait_readable()
                waited = True
                continue
            except OSError as exc:
                raise anyio.BrokenResourceError from exc
            if not data:
                raise anyio.EndOfStream
            if not waited:
                await anyio.lowlevel.checkpoint()
            return data

    async def _wait_readable(self) -> None:
        if self._on_asyncio is None:
            self._on_asyncio = sniffio.current_async_library() == "asyncio"
            if self._on_asyncio:
                self._watched = _Watched(self._fd)
        if self._watched is not None:
            await self._watched.wait()
        else:
            await anyio.wait_readable(self._fd)

    async def aclose(self) -> None:
        if self._watched is not None and not self._closed:
            self._watched.close()
        self._restore()


class FdSendStream(_FdStreamBase, ByteSendStream):
    async def send(self, item: bytes) -> None:
        view = memoryview(item)
        while view:
            if self._closed:
                raise anyio.ClosedResourceError
            try:
                written = os.write(self._fd, view)
            except BlockingIOError:
                await anyio.wait_writable(self._fd)
                continue
            except OSError as exc:  # EPIPE: the reader is gone
                raise anyio.BrokenResourceError from exc
            view = view[written:]
        # A write that did not have to wait does not yield: a relay task alternates
        # reads (which do) and writes, so a checkpoint here would only cost a trip
        # through the event loop per message.

    async def aclose(self) -> None:
        self._restore()


PIPE_BYTES = 1024 * 1024


def enlarge_pipe(fd: int) -> None:
    """Ask for a 1 MiB pipe buffer (Linux): fewer, larger reads on the streaming path."""
    if hasattr(fcntl, "F_SETPIPE_SZ"):
        with contextlib.suppress(OSError):  # above /proc/sys/fs/pipe-max-size: keep the default
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
