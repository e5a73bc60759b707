"""The pipe streams of ``acp_proxy.stdio``, in-process on a pipe: what a reader gets around its waits."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import anyio
import pytest

from acp_proxy.stdio import FdReceiveStream, FdSendStream

pytestmark = pytest.mark.anyio


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    read_fd, write_fd = os.pipe()
    yield read_fd, write_fd
    for fd in (read_fd, write_fd):
        with contextlib.suppress(OSError):  # closed by the stream that owned it
            os.close(fd)


async def test_a_reader_gets_what_comes_before_and_after_it_waits(pipe: tuple[int, int]) -> None:
    read_fd, write_fd = pipe
    stream = FdReceiveStream(read_fd)
    os.write(write_fd, b"first\n")
    assert await stream.receive() == b"first\n"  # there already: no wait
    async with anyio.create_task_group() as tasks:
        got: list[bytes] = []

        async def read() -> None:
            got.append(await stream.receive())

        tasks.start_soon(read)
        await anyio.sleep(0.05)  # the reader waits now
        os.write(write_fd, b"second\n")
    assert got == [b"second\n"]
    os.write(write_fd, b"third\n")
    assert await stream.receive() == b"third\n"
    await stream.aclose()


async def test_a_wait_cancelled_loses_nothing_and_the_next_read_gets_it(pipe: tuple[int, int]) -> None:
    read_fd, write_fd = pipe
    stream = FdReceiveStream(read_fd)
    with anyio.move_on_after(0.05) as scope:
        await stream.receive()
    assert scope.cancelled_caught
    os.write(write_fd, b"while nobody read\n")
    await anyio.sleep(0.05)  # the loop sees it ready with nobody waiting: it stops watching, reads nothing
    assert await stream.receive() == b"while nobody read\n"
    with anyio.move_on_after(0.05) as scope:  # and a wait after that waits again
        await stream.receive()
    assert scope.cancelled_caught
    os.write(write_fd, b"last\n")
    assert await stream.receive() == b"last\n"
    await stream.aclose()


async def test_closing_a_stream_wakes_its_waiting_reader(pipe: tuple[int, int]) -> None:
    read_fd, _ = pipe
    stream = FdReceiveStream(read_fd, owned=True)
    outcome: list[BaseException] = []

    async def read() -> None:
        try:
            await stream.receive()
        except anyio.ClosedResourceError as exc:
            outcome.append(exc)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(read)
            await anyio.sleep(0.05)
            await stream.aclose()
    assert len(outcome) == 1
    with pytest.raises(anyio.ClosedResourceError):
        await stream.receive()


async def test_the_writers_end_is_the_readers_end_of_stream(pipe: tuple[int, int]) -> None:
    read_fd, write_fd = pipe
    reader, writer = FdReceiveStream(read_fd), FdSendStream(write_fd, owned=True)
    await writer.send(b"a line\n")
    await writer.aclose()
    assert await reader.receive() == b"a line\n"
    with pytest.raises(anyio.EndOfStream):
        await reader.receive()
    await reader.aclose()
