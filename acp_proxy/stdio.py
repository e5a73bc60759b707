"""The proxy's own stdin/stdout as anyio byte streams, on asyncio and trio alike.

Reads and writes go straight to the file descriptors in non-blocking mode and
wait for readiness through anyio, so there is no worker thread per message.
Regular files (``acp-proxy < transcript.jsonl``) cannot be polled and never
block, so they are read in blocking mode. The original descriptor flags are
restored on close: the descriptors may be shared with a terminal or a parent.
"""

from __future__ import annotations

import contextlib
import os
import stat

import anyio
import anyio.lowlevel
from anyio.abc import ByteReceiveStream, ByteSendStream


class _FdStreamBase:
    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._closed = False
        self._saved_blocking: bool | None = None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            self._saved_blocking = os.get_blocking(fd)
            os.set_blocking(fd, False)

    def _restore(self) -> None:
        if not self._closed:
            self._closed = True
            if self._saved_blocking is not None:
                with contextlib.suppress(OSError):
                    os.set_blocking(self._fd, self._saved_blocking)


class FdReceiveStream(_FdStreamBase, ByteReceiveStream):
    async def receive(self, max_bytes: int = 65536) -> bytes:
        while True:
            if self._closed:
                raise anyio.ClosedResourceError
            try:
                data = os.read(self._fd, max_bytes)
            except BlockingIOError:
                await anyio.wait_readable(self._fd)
                continue
            except OSError as exc:
                raise anyio.BrokenResourceError from exc
            if not data:
                raise anyio.EndOfStream
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
            except OSError as exc:  # EPIPE: the gateway is gone
                raise anyio.BrokenResourceError from exc
            view = view[written:]
        await anyio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        self._restore()
