"""Drive a real ``acp-proxy`` process the way a gateway does, and check what it writes.

``Gateway.start`` launches ``python -m acp_proxy [...] -- fake_adapter.py OPTIONS`` on
the test's own anyio backend. Every line the proxy writes to the gateway is decoded
and validated against the ACP schema as it arrives; every line it writes to the
adapter is recorded by the fake adapter and validated when the gateway closes.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import sniffio

from tests.conformance import Conversation

TESTS = Path(__file__).parent
FAKE_ADAPTER = TESTS / "fake_adapter.py"
MARKER_VARIABLE = "ACP_PROXY_TEST_MARKER"
AUTO: Any = object()


def fake_command(**options: Any) -> list[str]:
    return [sys.executable, str(FAKE_ADAPTER), json.dumps(options)]


def marked_processes(marker: str) -> dict[int, str]:
    """Live processes whose environment carries ``ACP_PROXY_TEST_MARKER=marker``."""
    needle = f"{MARKER_VARIABLE}={marker}".encode()
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                if needle not in fh.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/stat", "rb") as fh:
                if fh.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                found[int(name)] = fh.read().replace(b"\0", b" ").decode(errors="replace")[:120]
        except OSError:
            continue
    return found


def kill_marked(marker: str) -> None:
    for pid in marked_processes(marker):
        with suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


class Gateway:
    def __init__(self, process: anyio.abc.Process, record: Path | None) -> None:
        self.process = process
        self.record = record
        self.to_gateway = Conversation("client")
        self.received: list[dict[str, Any]] = []
        self.stderr = bytearray()
        self._stash: collections.deque[dict[str, Any]] = collections.deque()
        send, receive = anyio.create_memory_object_stream[dict[str, Any]](10_000)
        self._inbox_send, self._inbox = send, receive
        self._raw = bytearray()
        self._reading_paused = False
        self._next_id = 1000
        self.answer_agent_requests: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    # --- lifecycle ------------------------------------------------------------

    @classmethod
    @asynccontextmanager
    async def start(
        cls,
        env: dict[str, str],
        tmp_path: Path,
        adapter: list[str] | None = None,
        *,
        proxy_args: list[str] | None = None,
        record: bool = True,
        **adapter_options: Any,
    ) -> AsyncIterator[Gateway]:
        record_path = None
        if adapter is None:
            record_path = tmp_path / f"adapter-{uuid.uuid4().hex[:8]}.jsonl"
            if record:
                adapter_options.setdefault("record", str(record_path))
            adapter = fake_command(**adapter_options)
        argv = [
            sys.executable,
            "-m",
            "acp_proxy",
            "--async-backend",
            sniffio.current_async_library(),
            *(proxy_args or []),
            "--",
            *adapter,
        ]
        process = await anyio.open_process(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        gateway = cls(process, record_path if record else None)
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(gateway._pump_stdout)
                tasks.start_soon(gateway._pump_stderr)
                try:
                    yield gateway
                finally:
                    with anyio.CancelScope(shield=True):
                        await gateway.close()
                        tasks.cancel_scope.cancel()
        finally:
            if process.returncode is None:
                process.kill()
            with anyio.CancelScope(shield=True):
                await process.aclose()  # waits, and closes the pipes even if a pump stopped reading
        gateway.check_adapter_side()

    async def close(self, timeout: float = 15) -> int | None:
        """Close the proxy's stdin (gateway EOF) and wait for it to exit."""
        assert self.process.stdin is not None
        with suppress(OSError, anyio.BrokenResourceError):
            await self.process.stdin.aclose()
        with anyio.move_on_after(timeout):
            return await self.process.wait()
        return None

    def signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    def pause_reading(self) -> None:
        """Stop reading the proxy's output, as a stuck gateway would."""
        self._reading_paused = True

    async def _pump_stdout(self) -> None:
        assert self.process.stdout is not None
        async for chunk in self.process.stdout:
            if self._reading_paused:
                await anyio.sleep_forever()
            self._raw += chunk
            *lines, rest = self._raw.split(b"\n")
            self._raw = bytearray(rest)
            for line in lines:
                msg = json.loads(line)  # the proxy never writes anything but JSON
                self.to_gateway.check(msg)
                self.received.append(msg)
                await self._inbox_send.send(msg)
        await self._inbox_send.aclose()

    async def _pump_stderr(self) -> None:
        assert self.process.stderr is not None
        async for chunk in self.process.stderr:
            self.stderr += chunk

    def check_adapter_side(self) -> None:
        """Validate every line the proxy wrote to the fake adapter."""
        if self.record is None or not self.record.exists():
            return
        per_process: dict[int, Conversation] = collections.defaultdict(lambda: Conversation("agent"))
        for entry in map(json.loads, self.record.read_text().splitlines()):
            to_adapter = per_process[entry.get("pid", 0)]  # each adapter process has its own id space
            if "out" in entry:
                to_adapter.track_request(json.loads(entry["out"]))
            else:
                to_adapter.check(json.loads(entry["in"]))

    def adapter_record(self) -> list[dict[str, str]]:
        assert self.record is not None
        return [json.loads(line) for line in self.record.read_text().splitlines()]

    # --- traffic -------------------------------------------------------------

    async def send(self, msg: dict[str, Any]) -> None:
        await self.send_raw(json.dumps(msg).encode() + b"\n")

    async def send_raw(self, data: bytes) -> None:
        """Send bytes as they are; any well-formed requests among them are tracked."""
        for line in data.splitlines():
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict) and isinstance(msg.get("method"), str):
                self.to_gateway.track_request(msg)
        assert self.process.stdin is not None
        await self.process.stdin.send(data)

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    async def request(
        self, method: str, params: Any = None, *, request_id: Any = AUTO, timeout: float = 10
    ) -> dict[str, Any]:
        """Send a request and return its response, answering agent requests meanwhile."""
        request_id = self.new_id() if request_id is AUTO else request_id
        msg: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "method": method}
        if params is not None:
            msg["params"] = params
        await self.send(msg)
        return await self.response_to(request_id, timeout=timeout)

    async def response_to(self, request_id: Any, timeout: float = 10) -> dict[str, Any]:
        return await self.expect(
            lambda m: "method" not in m and m.get("id") == request_id and type(m.get("id")) is type(request_id),
            timeout=timeout,
        )

    async def notify(self, method: str, params: Any) -> None:
        await self.send({"jsonrpc": "2.0", "method": method, "params": params})

    async def expect(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 10) -> dict[str, Any]:
        """The first message (stashed or new) matching ``predicate``; others are stashed."""
        for msg in list(self._stash):
            if predicate(msg):
                self._stash.remove(msg)
                return msg
        with anyio.fail_after(timeout):
            async for msg in self._inbox:
                if predicate(msg):
                    return msg
                if "method" in msg and "id" in msg and self.answer_agent_requests is not None:
                    answer = self.answer_agent_requests(msg)
                    if answer is not None:
                        await self.send_raw(json.dumps({"jsonrpc": "2.0", "id": msg["id"], **answer}).encode() + b"\n")
                        continue
                self._stash.append(msg)
        raise AssertionError("the proxy closed its output while a message was still expected")

    def stashed(self, method: str | None = None) -> list[dict[str, Any]]:
        return [m for m in self._stash if method is None or m.get("method") == method]

    # --- common sequences -------------------------------------------------------------------

    async def initialize(self, request_id: Any = 0) -> dict[str, Any]:
        return await self.request(
            "initialize",
            {
                "protocolVersion": 1,
                "clientCapabilities": {"fs": {"readTextFile": True, "writeTextFile": True}, "terminal": True},
                "clientInfo": {"name": "test-gateway", "version": "1.0"},
            },
            request_id=request_id,
        )

    async def new_session(self, cwd: str = "/tmp") -> str:
        response = await self.request("session/new", {"cwd": cwd, "mcpServers": []})
        return str(response["result"]["sessionId"])

    async def prompt(self, session_id: str, text: str, timeout: float = 20) -> dict[str, Any]:
        return await self.request(
            "session/prompt",
            {"sessionId": session_id, "prompt": [{"type": "text", "text": text}]},
            timeout=timeout,
        )
