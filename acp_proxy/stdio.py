"""Pipes as anyio byte streams on raw file descriptors, on asyncio and trio alike.

Used for the proxy's own stdin/stdout and for the pipes to each adapter. Reads
and writes go straight to the descriptors in non-blocking mode and wait for
readiness through anyio: no worker thread, no extra buffer copy, no protocol
callbacks. A read that did not have to wait still yields once (a checkpoint) so
a busy pipe cannot starve other tasks; one that waited has already yielded.
Regular files (``acp-proxy < transcript.jsonl``) cannot be polled and never
block, so they are read in blocking mode. Descriptors we do not own (our
stdin/stdout) get their original flags back on close; owned ones are closed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat

import anyio
import anyio.lowlevel
from anyio.abc import ByteReceiveStream, ByteSendStream


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


class FdReceiveStream(_FdStreamBase, ByteReceiveStream):
    async def receive(self, max_bytes: int = 65536) -> bytes:
        waited = False
        while True:
            if self._closed:
                raise anyio.ClosedResourceError
            try:
                data = os.read(self._fd, max_bytes)
            except BlockingIOError:
                await anyio.wait_readable(self._fd)
                waited = True
                continue
            except OSError as exc:
                raise anyio.BrokenResourceError from exc
            if not data:
                raise anyio.EndOfStream
            if not waited:
                await anyio.lowlevel.checkpoint()
            return data

    async def aclose(self) -> None:
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
