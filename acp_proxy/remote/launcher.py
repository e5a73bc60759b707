"""Each connection's proxy forked from a launcher that has imported it, rather than exec'd afresh.

A stdio proxy exec'd for a connection spends about 200 ms of CPU (the interpreter, its imports)
before it reads the connection's first message. ``serve`` instead forks, before its event loop
starts and before it listens, one *launcher*: a process with no thread and no socket but its
channel to ``serve``, which imports the proxy once (``preload``) and then forks a child per
request that runs the proxy's command line (``run``) as ``python -m acp_proxy ARGS`` would.

A child is a process of its own: its pid, its process group (``serve``'s, as an exec'd proxy's),
stdin and stdout the pipes ``serve`` hands over, stderr ``serve``'s, ``serve``'s environment with
the connection's additions, the default signal dispositions. ``/proc/PID/cmdline`` shows
``serve``'s command line, not ``-m acp_proxy``.

Protocol (``SOCK_SEQPACKET``, so a request is one message with its descriptors): ``serve`` sends
``{"env": {...}}`` with three descriptors: the child's stdin, its stdout and one end of a socket
pair of its own. On that pair the launcher writes ``pid N`` once forked and ``exit N`` (negative:
killed by that signal) once it has ended. The child stays a zombie until ``serve`` hangs up, so
its pid names no other process while ``serve`` waits for it; ``serve`` signals it through a pidfd.

The launcher ignores SIGINT, SIGTERM and SIGHUP (a terminal's Ctrl-C or a service manager's stop
reaches the whole group; ``serve`` handles them) and exits when its channel closes: when ``serve``
closes it, or dies however it dies. Its children then outlive it as exec'd ones would: each ends
at EOF on its stdin, whose other end was ``serve``'s. If the launcher is gone while ``serve``
runs (killed by someone), ``launch`` raises ``LauncherGone`` and the hub execs proxies from then on.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import selectors
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Final, NoReturn, TextIO

import anyio

from acp_proxy.ownership.verify import signal_child
from acp_proxy.stdio import FdReceiveStream, FdSendStream

log = logging.getLogger("acp_proxy.serve")

MAX_REQUEST: Final = 1 << 20
"""Bytes a request may hold (the connection's environment additions)."""

HANDLED: Final = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What ``serve`` handles for the group; the launcher ignores them, its children get them back."""

Run = Callable[[Sequence[str]], int]
"""Runs a proxy's command line (the arguments after ``python -m acp_proxy``); its exit status."""


class LauncherGone(Exception):
    """The launcher is not there to fork a proxy (it was killed, or could not be started)."""


class LaunchedProxy:
    """A proxy the launcher forked, as ``anyio.abc.Process`` gives the hub an exec'd one."""

    def __init__(self, pid: int, pidfd: int, report: socket.socket, stdin: FdSendStream, stdout: FdReceiveStream):
        self.pid = pid
        self.returncode: int | None = None
        self.stdin = stdin
        self.stdout = stdout
        self._pidfd = pidfd
        self._report = report
        self._told = b""

    @property
    def pidfd(self) -> int:
        """A pidfd of it (signals go through it: ``ownership.verify.signal_pidfd``); -1 once its status is read."""
        return self._pidfd

    async def wait(self) -> int:
        """Its exit status, as the launcher reports it; if the launcher went away first, -1 once it has ended
        (its status went to whoever reaped it)."""
        while self.returncode is None:
            line = await _line(self)
            if line.startswith(b"exit "):
                self.returncode = int(line.split()[1])
            elif not line:
                await anyio.wait_readable(self._pidfd)  # a pidfd is readable once its process has ended
                self.returncode = -1
        self._hang_up()
        return self.returncode

    def _hang_up(self) -> None:
        """Let the launcher reap it (its status has been read) and drop the pidfd."""
        if self._pidfd >= 0:
            self._report.close()
            os.close(self._pidfd)
            self._pidfd = -1

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.stdin.aclose()
            await self.wait()
            await self.stdout.aclose()


async def _line(proxy: LaunchedProxy) -> bytes:
    """The launcher's next line about ``proxy``; empty once the launcher has hung up."""
    while b"\n" not in proxy._told:
        await anyio.wait_readable(proxy._report)
        try:
            chunk = proxy._report.recv(256)
        except BlockingIOError:
            continue
        except OSError:
            chunk = b""
        if not chunk:
            return b""
        proxy._told += chunk
    line, _, proxy._told = proxy._told.partition(b"\n")
    return line


class Launcher:
    """``serve``'s end of the launcher: ``start`` forks it, ``launch`` asks it for a proxy, ``close`` ends it."""

    def __init__(self, pid: int, channel: socket.socket) -> None:
        self.pid = pid
        self._channel = channel
        self.gone = False

    @staticmethod
    def available() -> bool:
        """Whether this system has what the launcher uses (Linux: pidfds, ``SOCK_SEQPACKET``)."""
        return hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal") and hasattr(socket, "SOCK_SEQPACKET")

    @classmethod
    def start(cls, run: Run, argv: Sequence[str], preload: Callable[[], None]) -> Launcher:
        """Fork the launcher: it runs ``preload`` once, then ``run(argv)`` in each child. Call it with no other
        thread running (before the event loop starts)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the launcher: never returns
            ours.close()
            _serve_requests(theirs, run, list(argv), preload)
        theirs.close()
        ours.setblocking(False)
        return cls(pid, ours)

    async def launch(self, env: Mapping[str, str]) -> LaunchedProxy:
        """A proxy with ``env`` added to its environment, its stdin and stdout pipes to us."""
        if self.gone:
            raise LauncherGone("the launcher has gone")
        stdin_read, stdin_write = os.pipe()
        stdout_read, stdout_write = os.pipe()
        report, their_report = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        request = json.dumps({"env": dict(env)}).encode()
        try:
            while True:
                try:
                    socket.send_fds(self._channel, [request], [stdin_read, stdout_write, their_report.fileno()])
                    break
                except BlockingIOError:  # a burst of connections has filled its channel: it is reading
                    await anyio.wait_writable(self._channel)
                except OSError as exc:  # gone (EPIPE, ECONNREFUSED)
                    self.gone = True
                    raise LauncherGone(f"the launcher has gone ({exc.strerror or exc})") from None
        except BaseException:
            for fd in (stdin_write, stdout_read):
                os.close(fd)
            report.close()
            raise
        finally:
            os.close(stdin_read)
            os.close(stdout_write)
            their_report.close()
        report.setblocking(False)
        proxy = LaunchedProxy(
            -1, -1, report, FdSendStream(stdin_write, owned=True), FdReceiveStream(stdout_read, owned=True)
        )
        try:
            line = await _line(proxy)
        except BaseException:  # cancelled: a child forked meanwhile gets EOF, exits, and is reaped by the launcher
            with anyio.CancelScope(shield=True):
                await proxy.stdin.aclose()
                await proxy.stdout.aclose()
            report.close()
            raise
        if not line.startswith(b"pid "):
            await proxy.stdin.aclose()
            await proxy.stdout.aclose()
            report.close()
            self.gone = True
            raise LauncherGone("the launcher went away before it forked")
        proxy.pid = int(line.split()[1])
        proxy._pidfd = os.pidfd_open(proxy.pid)  # held as a zombie by the launcher until we hang up: still this one
        return proxy

    def close(self, timeout: float = 5.0) -> None:
        """End the launcher (EOF on its channel) and reap it."""
        self._channel.close()
        with contextlib.suppress(ChildProcessError):
            deadline = time.monotonic() + timeout
            while os.waitpid(self.pid, os.WNOHANG) == (0, 0):
                if time.monotonic() > deadline:
                    signal_child(self.pid, signal.SIGKILL)  # our child, not reaped: its pid is still its own
                    os.waitpid(self.pid, 0)
                    return
                time.sleep(0.005)


def _serve_requests(channel: socket.socket, run: Run, argv: list[str], preload: Callable[[], None]) -> NoReturn:
    code = 0
    try:
        for sig in HANDLED:
            signal.signal(sig, signal.SIG_IGN)
        preload()
        gc.collect()
        gc.freeze()  # what the imports made is every child's: their collections leave it (and its pages) alone
        _loop(channel, run, argv)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


class Children:
    """A fork server's children not yet reaped, each with the socket its requester reads ``pid N`` and then
    ``exit N`` (negative: killed by that signal) on. A child that has ended is told, not reaped: it stays a
    zombie until its requester hangs up, so that its pid names no other process while the requester may still
    signal it. Used by the launcher and by the test suite's fork server (``tests/kit/zygote.py``)."""

    def __init__(self, selector: selectors.BaseSelector) -> None:
        self._selector = selector
        self._children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, its requester's socket)

    def add(self, pid: int, report: socket.socket) -> None:
        """Tell the requester ``pid`` and watch for its end."""
        with contextlib.suppress(OSError):  # the requester has gone: the child is told and reaped all the same
            report.sendall(f"pid {pid}\n".encode())
        pidfd = os.pidfd_open(pid)
        self._children[pidfd] = (pid, report)
        self._selector.register(pidfd, selectors.EVENT_READ, (self, "ended", pidfd))

    def handle(self, key: selectors.SelectorKey) -> bool:
        """Act on ``key`` if it is one of this table's (a child ended, a requester hung up); whether it was."""
        if not (isinstance(key.data, tuple) and key.data[0] is self):
            return False
        _, what, pidfd = key.data
        pid, report = self._children[pidfd]
        if what == "ended":
            self._selector.unregister(pidfd)
            ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
            assert ended is not None
            killed = ended.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
            with contextlib.suppress(OSError):
                report.sendall(f"exit {-ended.si_status if killed else ended.si_status}\n".encode())
            self._selector.register(report, selectors.EVENT_READ, (self, "hung up", pidfd))
        else:  # the requester hung up (or wrote): reap
            del self._children[pidfd]
            self._selector.unregister(report)
            report.close()
            os.close(pidfd)
            os.waitpid(pid, 0)
        return True


def exit_status(exit_: SystemExit, stderr: TextIO) -> int:
    """The status the interpreter exits with for ``exit_``, printing its message as it would."""
    if exit_.code is None or isinstance(exit_.code, int):
        return exit_.code or 0
    print(exit_.code, file=stderr)
    return 1


def _loop(channel: socket.socket, run: Run, argv: list[str]) -> None:
    selector = selectors.DefaultSelector()
    selector.register(channel, selectors.EVENT_READ, "request")
    children = Children(selector)
    while True:
        for key, _ in selector.select():
            if children.handle(key):
                continue
            try:
                request, fds, _, _ = socket.recv_fds(channel, MAX_REQUEST, 3)
            except ConnectionResetError:
                request, fds = b"", []
            if not request and not fds:
                return  # serve has closed its end
            child = _fork(request, fds, run, argv)
            if child is not None:
                children.add(*child)


def _fork(request: bytes, fds: list[int], run: Run, argv: list[str]) -> tuple[int, socket.socket] | None:
    try:
        env = json.loads(request)["env"]
        valid = len(fds) == 3 and isinstance(env, dict)
    except (ValueError, KeyError, TypeError):
        valid = False
    if not valid:
        for fd in fds:
            os.close(fd)
        return None
    report = socket.socket(fileno=fds[2])
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        _become_the_proxy(fds, env, run, argv)
    os.close(fds[0])
    os.close(fds[1])
    return pid, report


def _become_the_proxy(fds: list[int], env: dict[str, str], run: Run, argv: list[str]) -> NoReturn:
    code = 1
    try:
        for sig in HANDLED:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        os.dup2(fds[0], 0)
        os.dup2(fds[1], 1)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the channel, the other children's pidfds and reports
        os.environ.update(env)
        gc.disable()  # as acp_proxy.__main__: off while the proxy sets itself up
        try:
            code = run(argv)
        except SystemExit as exit_:
            code = exit_status(exit_, sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
