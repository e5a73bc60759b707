"""Clients of ``acp-proxy serve`` for the tests: a ``serve`` process, a WebSocket client and a
streamable HTTP (HTTP/2) client, each speaking JSON-RPC with an id counter and a stash."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx
import sniffio

from acp_proxy.remote.tokens import RemoteStore
from acp_proxy.remote.wsclient import Target, WebSocket
from tests.kit import forked
from tests.support import run_program


def make_token(env: dict[str, str], name: str, *args: str) -> str:
    """A token made with ``acp-proxy token create NAME ARGS`` (the CLI when there are ``args``, else the
    store it writes to, in this process: the CLI's own start is tested once is enough)."""
    if args:
        done = run_program(env, "token", "create", name, *args, timeout=30)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()
    state = Path(env["ACP_PROXY_STATE_DIR"])
    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    store = RemoteStore(state)
    try:
        return store.create(name)[1]
    finally:
        store.close()


def run_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return run_program(env, *args, timeout=30)


class Served:
    def __init__(self, process: anyio.abc.Process | forked.ForkedProcess, url: str) -> None:
        self.process = process
        self.url = url
        self.ws_url = url.replace("http://", "ws://")

    def target(self, token: str | None) -> Target:
        return Target.parse(self.ws_url, token)


@asynccontextmanager
async def serve(
    env: dict[str, str], config: Path, *extra: str, listen: str = "127.0.0.1:0", log: Path | None = None
) -> AsyncIterator[Served]:
    """``acp-proxy serve`` on ``listen``; stopped with SIGTERM at the end (unless the test ended it).
    Its stderr goes to ``log`` if given (else the test's)."""
    argv = [sys.executable, "-m", "acp_proxy", "serve", "--async-backend", sniffio.current_async_library()]
    argv += ["--listen", listen, "--config", str(config), *extra]
    stderr = log.open("ab") if log is not None else None
    process: anyio.abc.Process | forked.ForkedProcess
    if forked.can_fork(argv, env):  # forked from the fork server: a process of its own, without an interpreter's start
        process = await forked.spawn(argv[3:], env=env, cwd=None, stderr=stderr or 2)  # 2: the test's own, as exec'd
    else:
        process = await anyio.open_process(argv, env=env, stdout=subprocess.PIPE, stderr=stderr)
    assert process.stdout is not None
    buffered = b""
    with anyio.fail_after(20):
        while b"listening: " not in buffered or not buffered.endswith(b"\n"):
            buffered += await process.stdout.receive()
    url = buffered.decode().split("listening: ", 1)[1].split()[0]
    try:
        yield Served(process, url)
    finally:
        with anyio.CancelScope(shield=True):
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
                with anyio.fail_after(40):
                    await process.wait()
            await process.aclose()
            if stderr is not None:
                stderr.close()


class WsClient:
    """A JSON-RPC client over one WebSocket: requests by id, the rest stashed in arrival order."""

    def __init__(self, ws: WebSocket) -> None:
        self.ws = ws
        self.next_id = 0
        self.stash: list[dict[str, Any]] = []
        self.closed: Exception | None = None
        self._arrived = anyio.Event()

    @classmethod
    @asynccontextmanager
    async def open(cls, target: Target, first: dict[str, Any] | None = None) -> AsyncIterator[WsClient]:
        """A client on a new socket; ``first`` is its first frame (a ``stream/resume``), if given."""
        ws = await WebSocket.connect(target)
        client = cls(ws)
        if first is not None:
            await client.send(first)
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(client._receive)
            try:
                yield client
            finally:
                tasks.cancel_scope.cancel()
                with anyio.CancelScope(shield=True):  # unshielded, the cancellation would replace (and the task
                    await ws.aclose()  # group then swallow) whatever the test's body raised

    async def _receive(self) -> None:
        try:
            while True:
                self.stash.append(json.loads(await self.ws.receive_text()))
                self._arrived.set()
        except Exception as exc:  # the socket closed: kept for the test to look at
            self.closed = exc
            self._arrived.set()

    async def send(self, message: dict[str, Any]) -> None:
        await self.ws.send_text(json.dumps({"jsonrpc": "2.0", **message}))

    async def request_id(self, method: str, params: Any) -> int:
        self.next_id += 1
        await self.send({"id": self.next_id, "method": method, "params": params})
        return self.next_id

    async def wait_for(self, predicate: Any, timeout: float = 20) -> dict[str, Any]:
        with anyio.fail_after(timeout):
            while True:
                for message in self.stash:
                    if predicate(message):
                        self.stash.remove(message)
                        return message
                if self.closed is not None:
                    raise AssertionError(f"socket closed: {self.closed}; stash: {self.stash}")
                self._arrived = anyio.Event()
                await self._arrived.wait()

    async def answer_of(self, request_id: int | str, timeout: float = 20) -> dict[str, Any]:
        return await self.wait_for(lambda m: m.get("id") == request_id and "method" not in m, timeout)

    async def call(self, method: str, params: Any, timeout: float = 20) -> dict[str, Any]:
        return await self.answer_of(await self.request_id(method, params), timeout)

    def updates(self, session_id: str) -> list[dict[str, Any]]:
        found = [
            m for m in self.stash if m.get("method") == "session/update" and m["params"]["sessionId"] == session_id
        ]
        for message in found:
            self.stash.remove(message)
        return found


class HttpClient:
    """A streamable HTTP client (HTTP/2): POSTs, and the connection's and sessions' event streams."""

    def __init__(self, url: str, token: str | None) -> None:
        self.url = url
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.AsyncClient(http1=False, http2=True, headers=headers, timeout=20)
        # The event streams on an HTTP/2 connection of their own: httpcore reads a connection in one
        # task at a time, and a POST's answer can wait behind a stream's read until its next event.
        self.streaming = httpx.AsyncClient(http1=False, http2=True, headers=headers, timeout=20)
        self.connection_id: str | None = None
        self.events: dict[str | None, list[dict[str, Any]]] = {}
        self.next_id = 0
        self._arrived = anyio.Event()
        self._tasks: anyio.abc.TaskGroup | None = None

    @classmethod
    @asynccontextmanager
    async def open(cls, url: str, token: str | None) -> AsyncIterator[HttpClient]:
        client = cls(url, token)
        async with client.http, client.streaming, anyio.create_task_group() as tasks:
            client._tasks = tasks
            try:
                yield client
            finally:
                tasks.cancel_scope.cancel()

    def headers(self, session_id: str | None = None) -> dict[str, str]:
        headers = {"acp-connection-id": self.connection_id or ""}
        if session_id is not None:
            headers["acp-session-id"] = session_id
        return headers

    async def initialize(self) -> httpx.Response:
        response = await self.http.post(
            self.url, json={"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {"protocolVersion": 1}}
        )
        self.connection_id = response.headers.get("acp-connection-id")
        return response

    async def open_stream(self, session_id: str | None = None) -> None:
        assert self._tasks is not None
        opened = anyio.Event()
        self.events.setdefault(session_id, [])

        async def read() -> None:
            headers = {**self.headers(session_id), "accept": "text/event-stream"}
            async with self.streaming.stream("GET", self.url, headers=headers, timeout=None) as response:
                assert response.status_code == 200, response.status_code
                opened.set()
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        self.events[session_id].append(json.loads(line[6:]))
                        self._arrived.set()

        self._tasks.start_soon(read)
        with anyio.fail_after(10):
            await opened.wait()

    async def post(self, message: dict[str, Any], session_id: str | None = None) -> httpx.Response:
        return await self.http.post(self.url, json={"jsonrpc": "2.0", **message}, headers=self.headers(session_id))

    async def request(self, method: str, params: Any, session_id: str | None = None) -> int:
        self.next_id += 1
        response = await self.post({"id": self.next_id, "method": method, "params": params}, session_id)
        assert response.status_code == 202, (response.status_code, response.text)
        return self.next_id

    async def wait_for(self, stream: str | None, predicate: Any, timeout: float = 20) -> dict[str, Any]:
        with anyio.fail_after(timeout):
            while True:
                for message in self.events.get(stream, []):
                    if predicate(message):
                        self.events[stream].remove(message)
                        return message
                self._arrived = anyio.Event()
                await self._arrived.wait()
