"""A fork server for the proxies the tests start: one interpreter that has imported the proxy, forked per proxy.

A proxy's start is nearly all the interpreter's and its imports (the event loops, msgspec, the
package: about 100 ms of CPU), and the end-to-end tests start hundreds. This program imports it
all once and then, for each request, forks a child that becomes ``python -m acp_proxy ARGS``: its
stdin, stdout and stderr the requester's pipes, its environment, working directory and session
as asked, ``acp_proxy.main.main(ARGS)`` run with the garbage collector held off as
``acp_proxy.__main__`` does, its exit status reported back. The child is a process of its own
(its pid, signals, pipes, exit status), only not exec'd afresh. What differs: ``/proc/PID/environ``
and ``cmdline`` show this server's (the environment the child runs with is the requester's), so
the tests that hold the program itself to how it starts run it with ``exec`` (``Gateway.launch``).

Protocol, one unix-socket connection per child: the requester sends one JSON line
``{"args": [...], "env": {...}, "cwd": ..., "session": bool}`` with the three descriptors
attached (``SCM_RIGHTS``); the server answers ``pid N\\n`` once forked, then ``exit N\\n`` (negative:
killed by that signal, as ``subprocess`` says) when the child has ended, and closes the connection.
The server exits at EOF on its own stdin, when the test worker that started it goes away.

    python -m tests.kit.zygote SOCKET_PATH
"""

from __future__ import annotations

import gc
import json
import os
import selectors
import socket
import sys
import tomllib  # noqa: F401  (a proxy given a config file reads it with this, and its import compiles regexes)
import traceback

# What every proxy imports before it serves (the relay, the sessions, the pool, the backend anyio.run
# loads), and what the other commands forked from here import on top: ``serve`` (its server, hypercorn on
# either loop), ``connect``, the operator's commands (their reports, psutil). Imported here once, inherited
# by every child (a stdio proxy's child leaves the others unused: the tests that hold a proxy to what it
# imports exec it, ``Gateway.launch``).
import anyio._backends._asyncio
import anyio._backends._trio  # noqa: F401
import hypercorn.asyncio
import hypercorn.trio  # noqa: F401

import acp_proxy.main
import acp_proxy.operator.commands
import acp_proxy.operator.doctor
import acp_proxy.remote.bridge
import acp_proxy.remote.server
import acp_proxy.serve
from acp_proxy.remote.launcher import Children, exit_status

MAX_REQUEST = 1 << 20
"""Bytes a request may hold (an environment and arguments)."""


def serve(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "lifeline")
    children = Children(selector)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while True:
        for key, _ in selector.select():
            if children.handle(key):
                continue
            if key.data == "lifeline":
                if not os.read(sys.stdin.fileno(), 4096):
                    return
            elif key.data == "accept":
                connection, _ = listener.accept()
                child = _fork(connection)
                if child is not None:
                    children.add(child, connection)


def _fork(connection: socket.socket) -> int | None:
    request, fds, _, _ = socket.recv_fds(connection, MAX_REQUEST, 3)
    if len(fds) != 3 or not request.endswith(b"\n"):
        for fd in fds:
            os.close(fd)
        connection.close()
        return None
    asked = json.loads(request)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        _become_the_proxy(asked, fds)
    for fd in fds:
        os.close(fd)
    return pid


def _become_the_proxy(asked: dict[str, object], fds: list[int]) -> None:
    code = 1
    try:
        if asked.get("session"):
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # this server's sockets, its other children's pidfds
        env = asked["env"]
        assert isinstance(env, dict)
        os.environ.clear()
        os.environ.update(env)
        cwd = asked.get("cwd")
        if isinstance(cwd, str):
            os.chdir(cwd)
        args = asked["args"]
        assert isinstance(args, list)
        sys.argv = ["-m", *args]
        gc.disable()  # as acp_proxy.__main__: off while the proxy sets itself up
        try:
            code = acp_proxy.main.main(args)
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


if __name__ == "__main__":
    serve(sys.argv[1])
