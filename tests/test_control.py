"""The control socket on its own: framing, limits, and who may connect."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import stat
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from acp_proxy.operator import control
from acp_proxy.operator.control import MAX_REQUEST_BYTES, ControlError, ControlServer

pytestmark = pytest.mark.anyio


async def echo(command: str, args: dict[str, Any]) -> dict[str, Any]:
    if command == "echo":
        return {"args": args}
    if command == "boom":
        raise RuntimeError("a bug")
    raise ControlError("unknown_command", f"unknown command {command!r}")


@asynccontextmanager
async def serving(path: Path, **options: Any) -> AsyncIterator[ControlServer]:
    server = ControlServer(path, echo, **options)
    async with anyio.create_task_group() as tasks:
        await tasks.start(server.serve)
        yield server
        tasks.cancel_scope.cancel()


def exchange(path: Path, *payloads: bytes) -> list[dict[str, Any]]:
    """Send raw bytes on one connection; every JSON line the server answers until it closes or goes quiet."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(str(path))
        for payload in payloads:
            sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return [json.loads(line) for line in data.splitlines()]


async def in_thread(function: Callable[..., Any], *args: Any) -> Any:
    return await anyio.to_thread.run_sync(lambda: function(*args))


async def test_requests_are_answered_in_order_and_the_socket_is_private(tmp_path: Path) -> None:
    path = tmp_path / "control" / "abc.sock"
    async with serving(path):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert await in_thread(control.request, path, "echo", {"x": [1, 2]}) == {"args": {"x": [1, 2]}}
        answers = await in_thread(
            exchange, path, b'{"id": 1, "command": "echo"}\n\n{"id": "two", "command": "echo", "args": {"a": 1}}\n'
        )
        assert answers == [
            {"id": 1, "ok": True, "result": {"args": {}}},
            {"id": "two", "ok": True, "result": {"args": {"a": 1}}},
        ]
    assert not path.exists()


@pytest.mark.parametrize(
    ("line", "code"),
    [
        (b"not json", "parse_error"),
        (b"\xff\xfe{}", "parse_error"),
        (b"[1, 2]", "invalid_request"),
        (b'{"id": 3}', "invalid_request"),
        (b'{"id": 3, "command": 7}', "invalid_request"),
        (b'{"id": 3, "command": "echo", "args": [1]}', "invalid_request"),
        (b'{"id": 3, "command": "nope"}', "unknown_command"),
        (b'{"id": 3, "command": "boom"}', "internal_error"),
    ],
)
async def test_bad_requests_get_an_error_and_the_connection_keeps_serving(
    tmp_path: Path, line: bytes, code: str
) -> None:
    path = tmp_path / "c.sock"
    async with serving(path):
        answers = await in_thread(exchange, path, line + b"\n", b'{"id": 9, "command": "echo"}\n')
    assert answers[0]["ok"] is False
    assert answers[0]["error"]["code"] == code
    assert answers[0]["error"]["message"]
    assert answers[1] == {"id": 9, "ok": True, "result": {"args": {}}}


async def test_an_oversized_request_is_refused_and_the_connection_closed(tmp_path: Path) -> None:
    path = tmp_path / "c.sock"
    async with serving(path):
        answers = await in_thread(exchange, path, b'{"command": "echo", "pad": "' + b"x" * (MAX_REQUEST_BYTES + 10))
        assert answers == [
            {"id": None, "ok": False, "error": {"code": "too_large", "message": answers[0]["error"]["message"]}}
        ]
        assert str(MAX_REQUEST_BYTES) in answers[0]["error"]["message"]
        # The server itself is unharmed.
        assert await in_thread(control.request, path, "echo", {}) == {"args": {}}


async def test_a_peer_of_another_uid_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.sock"
    seen: list[int | None] = []

    def stranger(sock: socket.socket) -> int:
        seen.append(control.peer_uid(sock))
        return os.getuid() + 1

    async with serving(path, uid_of=stranger):
        with pytest.raises(ControlError) as refused:
            await in_thread(control.request, path, "echo", {})
    assert refused.value.code == "forbidden"
    assert f"may not control a proxy of uid {os.getuid()}" in refused.value.message
    assert seen == [os.getuid()], "the real SO_PEERCRED uid of the peer was read"


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory any user can reach (pytest's own tmp dirs are private to their owner)."""
    directory = Path(tempfile.mkdtemp(prefix="acp-proxy-control-"))
    directory.chmod(0o755)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="connecting as another uid needs root (setuid to nobody)")
async def test_a_real_peer_of_another_uid_is_refused_even_when_the_file_lets_it_in(
    proc_env: dict[str, str], open_dir: Path
) -> None:
    path = open_dir / "c.sock"
    async with serving(path):
        os.chmod(open_dir, 0o755)  # undo the server's 0700 and 0600: only SO_PEERCRED stands in the way now
        path.chmod(0o666)
        script = (
            "import os, socket, sys\n"
            "os.setgid(65534); os.setuid(65534)\n"
            "s = socket.socket(socket.AF_UNIX); s.settimeout(5); s.connect(sys.argv[1])\n"
            "print(s.recv(65536).decode())  # the refusal comes unasked, before any request\n"
        )
        result = await anyio.run_process([sys.executable, "-c", script, str(path)], check=False, env=proc_env)
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["ok"] is False
    assert answer["error"]["code"] == "forbidden"
    assert "peer uid 65534" in answer["error"]["message"]


async def test_long_socket_paths_work(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    path = deep / "control" / "0123456789ab.sock"
    assert len(str(path)) > 108
    async with serving(path):
        assert await in_thread(control.request, path, "echo", {"long": True}) == {"args": {"long": True}}


async def test_a_client_is_told_clearly_when_no_proxy_listens(tmp_path: Path) -> None:
    with pytest.raises(control.ControlUnavailable, match="no proxy listens"):
        control.request(tmp_path / "gone.sock", "status")
    # A socket file left by a proxy that was SIGKILLed: nothing accepts on it.
    stale = tmp_path / "stale.sock"
    sock = control.bind_private(stale)
    sock.close()
    with pytest.raises(control.ControlUnavailable):
        control.request(stale, "status")


async def test_an_answer_that_never_ends_times_out_as_a_whole(tmp_path: Path) -> None:
    """The timeout bounds the whole exchange, not each read: a byte at a time never holds the caller."""

    async def trickle(client: anyio.abc.SocketStream) -> None:
        async with client:
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                while True:
                    await client.send(b" ")
                    await anyio.sleep(0.05)

    path = tmp_path / "slow.sock"
    async with await anyio.create_unix_listener(path) as listener, anyio.create_task_group() as tasks:
        tasks.start_soon(listener.serve, trickle)
        with anyio.fail_after(20):  # a liveness bound: before, the client read for ever
            outcome = await anyio.to_thread.run_sync(_request_outcome, path, abandon_on_cancel=True)
        tasks.cancel_scope.cancel()
    assert outcome == "TimeoutError: the proxy did not answer 'status' within 0.5s"


def _request_outcome(path: Path) -> str:
    try:
        control.request(path, "status", timeout=0.5)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "answered"


def test_stale_sockets_of_dead_proxies_are_removed(tmp_path: Path) -> None:
    directory = tmp_path / control.SOCKET_DIR
    for name in ("alive", "dead"):
        control.bind_private(directory / f"{name}.sock").close()
    (directory / "notes.txt").write_text("not a socket")
    assert control.remove_stale(tmp_path, lambda instance: instance == "alive") == 1
    assert sorted(p.name for p in directory.iterdir()) == ["alive.sock", "notes.txt"]
    assert control.remove_stale(tmp_path / "nowhere", lambda instance: False) == 0


async def test_a_silent_client_does_not_hold_the_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(control, "IDLE_TIMEOUT", 0.3)
    path = tmp_path / "c.sock"
    async with serving(path) as server:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as idle:
            idle.connect(str(path))
            idle.sendall(b'{"id": 1, "comm')  # and then nothing
            idle.settimeout(5)
            assert await in_thread(idle.recv, 100) == b"", "dropped after the idle timeout"
        assert server.connections == 0
        assert await in_thread(control.request, path, "echo", {}) == {"args": {}}


async def test_a_failing_accept_is_logged_and_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(control, "ACCEPT_BACKOFF", 0.05)
    failures = [OSError(errno.EMFILE, "Too many open files") for _ in range(2)]
    real_accept = ControlServer._accept

    async def out_of_descriptors(self: ControlServer, listener: Any) -> Any:
        if failures:
            raise failures.pop()
        return await real_accept(self, listener)

    monkeypatch.setattr(ControlServer, "_accept", out_of_descriptors)
    path = tmp_path / "c.sock"
    async with serving(path):
        assert await in_thread(control.request, path, "echo", {}) == {"args": {}}
    assert failures == []
    assert caplog.text.count("accept failed") == 2
    assert "Too many open files" in caplog.text
