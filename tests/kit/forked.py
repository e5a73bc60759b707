"""Proxies forked from this test worker's fork server (``tests/kit/zygote.py``) instead of exec'd afresh.

``spawn`` gives a ``ForkedProcess``, which a ``Gateway`` drives as it drives an ``anyio`` process:
its ``pid``, its ``stdin`` and ``stdout`` pipes, ``wait`` for its exit status, ``aclose``. ``run``
is ``subprocess.run`` of ``python -m acp_proxy ARGS`` (an operator's command, a proxy given its
input at once), forked the same way. pytest-xdist's controller starts one server that all its workers
share (``share``: one interpreter's imports, not one per worker); a process of the tests without one
starts its own on first use. A server ends with the process that started it (EOF on its stdin).
``ACP_PROXY_TEST_FORK=0`` turns it off: every proxy is exec'd, as a gateway starts one.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

import anyio

from acp_proxy.stdio import FdReceiveStream, FdSendStream

ROOT = Path(__file__).resolve().parent.parent.parent
ENABLED = os.environ.get("ACP_PROXY_TEST_FORK", "1") != "0" and hasattr(os, "pidfd_open") and hasattr(os, "waitid")
"""The server watches its children through pidfds (Linux 5.3 and later); elsewhere every proxy is exec'd."""


def can_fork(argv: Sequence[str], env: Mapping[str, str] | None) -> bool:
    """Whether ``argv`` (under ``env``) is a proxy the fork server can start: ``python -m acp_proxy ...``
    importing the package this process imports (the server's imports are this process's)."""
    same_imports = env is None or env.get("PYTHONPATH") == os.environ.get("PYTHONPATH")
    return ENABLED and list(argv[1:3]) == ["-m", "acp_proxy"] and argv[0] == sys.executable and same_imports


SHARED = "ACP_PROXY_TEST_FORK_SERVER"
"""The socket of a fork server that the process which started this one shares with it (``share``)."""

SHARED_START = 60.0
"""Seconds a test process waits for a shared fork server to listen (it imports while the workers collect)."""


class _Server:
    _running: _Server | None = None
    _starting = threading.Lock()

    def __init__(self, *, wait: bool = True) -> None:
        self.directory = tempfile.mkdtemp(prefix="acp-proxy-zygote-")
        self.path = os.path.join(self.directory, "socket")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.kit.zygote", self.path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE if wait else subprocess.DEVNULL,
            cwd=ROOT,
        )
        if wait:
            assert self.process.stdout is not None
            if self.process.stdout.readline() != b"ready\n":
                raise RuntimeError(f"the fork server did not start (exit status {self.process.wait()})")
        atexit.register(self.close)

    @classmethod
    def get(cls) -> _Server:
        with cls._starting:  # the tests' threads may ask at once
            if cls._running is None or cls._running.process.poll() is not None:
                cls._running = cls()
            return cls._running

    def close(self) -> None:
        if self.process.stdin is None or self.process.stdin.closed:
            return
        self.process.stdin.close()
        self.process.wait(timeout=10)
        with contextlib.suppress(OSError):
            os.unlink(self.path)
            os.rmdir(self.directory)


def share() -> None:
    """Start a fork server for the processes this one starts from now on (pytest-xdist's workers): one
    interpreter importing the proxy for all of them rather than one each. It is not waited for: it imports
    while they start, and they wait for its socket (``SHARED_START``). It ends with this process."""
    if ENABLED and SHARED not in os.environ:
        os.environ[SHARED] = _Server(wait=False).path


def _server_path() -> str:
    return os.environ.get(SHARED) or _Server.get().path


def _connected(path: str) -> socket.socket:
    """A connection to the fork server at ``path``; a shared one still importing is waited for."""
    deadline = time.monotonic() + SHARED_START
    while True:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(path)
            return connection
        except (FileNotFoundError, ConnectionRefusedError):
            connection.close()
            if path != os.environ.get(SHARED) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)
        except BaseException:
            connection.close()
            raise


class ForkedProcess:
    """A proxy forked by the fork server, as ``anyio.abc.Process`` gives the kit a child."""

    def __init__(self, pid: int, connection: socket.socket, stdin: FdSendStream, stdout: FdReceiveStream) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.stdin = stdin
        self.stdout = stdout
        self._connection = connection
        self._told = b""

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # the server reaps it only once told it is over: the pid is still its own
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    async def wait(self) -> int:
        while self.returncode is None:
            line = await self._line()
            if line.startswith(b"exit "):
                self.returncode = int(line.split()[1])
                self._connection.close()
            elif not line:  # the server went away: the child is reaped by nobody we can ask
                raise RuntimeError(f"the fork server went away before proxy {self.pid} ended")
        return self.returncode

    async def _line(self) -> bytes:
        while b"\n" not in self._told:
            await anyio.wait_readable(self._connection.fileno())
            try:
                chunk = self._connection.recv(256)
            except BlockingIOError:
                continue
            if not chunk:
                return b""
            self._told += chunk
        line, _, self._told = self._told.partition(b"\n")
        return line

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.stdin.aclose()
            await self.wait()
            await self.stdout.aclose()


def _ask_for_child(
    args: Sequence[str],
    env: Mapping[str, str],
    cwd: str | os.PathLike[str] | None,
    session: bool,
    fds: list[int],
) -> socket.socket:
    """Ask this process's fork server for ``python -m acp_proxy ARGS`` with ``fds`` as its stdin, stdout and
    stderr (``session``: in a session of its own); the connection its pid and exit status come back on."""
    connection = _connected(_server_path())
    try:
        request = {"args": list(args), "env": dict(env), "cwd": None if cwd is None else str(cwd), "session": session}
        socket.send_fds(connection, [json.dumps(request).encode() + b"\n"], fds)
    except BaseException:
        connection.close()
        raise
    return connection


async def spawn(
    args: list[str],
    *,
    env: dict[str, str] | None,
    cwd: str | os.PathLike[str] | None,
    stderr: IO[bytes] | int | None,
    start_new_session: bool = False,
) -> ForkedProcess:
    """``python -m acp_proxy ARGS``, forked: stdin and stdout pipes to this process, stderr to ``stderr``
    (a file, a descriptor of this process, or ``None``: nowhere)."""
    stdin_read, stdin_write = os.pipe()
    stdout_read, stdout_write = os.pipe()
    error = (
        stderr
        if isinstance(stderr, int)
        else stderr.fileno()
        if stderr is not None
        else os.open(os.devnull, os.O_WRONLY)
    )
    try:
        connection = _ask_for_child(
            args, os.environ if env is None else env, cwd, start_new_session, [stdin_read, stdout_write, error]
        )
    except BaseException:
        for fd in (stdin_write, stdout_read):
            os.close(fd)
        raise
    finally:
        for fd in (stdin_read, stdout_write, *([] if stderr is not None else [error])):
            os.close(fd)
    connection.setblocking(False)
    stdin, stdout = FdSendStream(stdin_write, owned=True), FdReceiveStream(stdout_read, owned=True)
    process = ForkedProcess(0, connection, stdin, stdout)
    line = await process._line()
    if not line.startswith(b"pid "):
        await process.stdin.aclose()
        await process.stdout.aclose()
        connection.close()
        raise RuntimeError(f"the fork server could not start a proxy: {line!r}")
    process.pid = int(line.split()[1])
    return process


def run(
    args: Sequence[str],
    *,
    env: Mapping[str, str],
    stdin: bytes = b"",
    cwd: str | os.PathLike[str] | None = None,
    timeout: float,
) -> subprocess.CompletedProcess[bytes]:
    """``subprocess.run([python, -m, acp_proxy, *ARGS], input=stdin, capture_output=True, ...)``, forked by
    the fork server where it can be (else exactly that): its exit status, stdout and stderr, read until
    both are closed (by it and anything it left holding them). Past ``timeout`` it is killed and
    ``subprocess.TimeoutExpired`` raised, as ``subprocess.run`` does."""
    argv = [sys.executable, "-m", "acp_proxy", *args]
    if not can_fork(argv, env):
        return subprocess.run(argv, input=stdin, capture_output=True, env=dict(env), cwd=cwd, timeout=timeout)
    deadline = time.monotonic() + timeout
    ends = [os.pipe() for _ in range(3)]  # stdin, stdout, stderr
    theirs, ours = [ends[0][0], ends[1][1], ends[2][1]], [ends[0][1], ends[1][0], ends[2][0]]
    try:
        connection = _ask_for_child(args, env, cwd, False, theirs)
    except BaseException:
        for fd in ours:
            os.close(fd)
        raise
    finally:
        for fd in theirs:
            os.close(fd)
    with connection, selectors.DefaultSelector() as selector:
        told, pid, code = b"", 0, None
        streams = {ours[1]: bytearray(), ours[2]: bytearray()}
        pending = memoryview(stdin)
        for fd in ours:
            os.set_blocking(fd, False)
        if pending:
            selector.register(ours[0], selectors.EVENT_WRITE)
        else:
            os.close(ours[0])
        for fd in streams:
            selector.register(fd, selectors.EVENT_READ)
        selector.register(connection, selectors.EVENT_READ)
        try:
            while code is None or any(fd in selector.get_map() for fd in streams):
                left = deadline - time.monotonic()
                if left <= 0:
                    if pid:
                        os.kill(pid, signal.SIGKILL)  # still its own: the server reaps it only once we hang up
                    raise subprocess.TimeoutExpired(argv, timeout)
                for key, _ in selector.select(left):
                    fd = key.fd
                    if fd == ours[0]:
                        try:
                            pending = pending[os.write(fd, pending) :]
                        except BrokenPipeError:
                            pending = pending[:0]
                        if not pending:
                            selector.unregister(fd)
                            os.close(fd)
                    elif fd in streams:
                        chunk = os.read(fd, 65536)
                        if chunk:
                            streams[fd] += chunk
                        else:
                            selector.unregister(fd)
                            os.close(fd)
                    else:
                        chunk = connection.recv(256)
                        told += chunk
                        while b"\n" in told:
                            line, _, told = told.partition(b"\n")
                            word, _, number = line.partition(b" ")
                            if word == b"pid":
                                pid = int(number)
                            elif word == b"exit":
                                code = int(number)
                        if not chunk:
                            selector.unregister(connection)
                            if code is None:
                                raise RuntimeError("the fork server went away before its child ended")
        finally:
            for key in list(selector.get_map().values()):
                if key.fd != connection.fileno():
                    os.close(key.fd)
    return subprocess.CompletedProcess(argv, code, bytes(streams[ours[1]]), bytes(streams[ours[2]]))
