"""Remote serving: ``acp-proxy serve`` over WebSocket and streamable HTTP, and the ``acp-proxy connect`` bridge.

``acp-proxy serve --listen 127.0.0.1:0`` serves ACP at ``/acp`` over WebSocket and streamable HTTP
(HTTP/2 here, the answers and updates on the session's event stream); each network connection is
served by a stdio ``acp-proxy`` child of its own, and every client shows a bearer token (``acp-proxy
token create``). The base of every ratio is the same work over stdio through the proxy (``acp-proxy
--config CFG`` run by the client): what the network adds to the proxy, not the proxy to the agent
(``benchmarks/streaming.py`` has that). The agent is ``benchmarks/stream_agent.py`` in a config of
its own, and each run has a scratch state dir with one token.

Measured in one run: the turns, streaming and memory by one asynchronous client (anyio on asyncio;
every message decoded with msgspec, the same work on each transport), ``connect`` by the kit's
``SyncGateway`` as the other sections' cold starts are:

* *short turns*: ``session/prompt`` answered by ``SHORT_UPDATES`` ``session/update``s and
  ``end_turn``, p50/p95/p99 over ``--remote-turns`` turns per transport after ``WARM_UP`` untimed,
  the transports taking turns in blocks of ``BLOCK``, with the CPU a turn cost each process on its way
  (the proxy, ``serve``, the client): on a machine whose cores the stdio turn already keeps busy,
  what a transport adds in CPU it adds in time;
* *streaming*: one turn streaming ``--remote-updates`` updates of 180 B, updates/s (median of
  ``--repeat`` runs, at least ``MIN_STREAM_RUNS``, interleaved, ``PAUSE`` apart), with the CPU
  each process spent on it (the stdio proxy or the connection's proxy, ``serve``, the client).
  Every ``serve`` runs with its defaults but ``--max-connections`` (and per token), sized to the
  part: so with ``--max-pending`` messages waiting for a client, the connection's proxy (and
  through its pipe the agent) waits for it, and only a client that takes nothing for
  ``--stall-timeout`` is disconnected;
* *the streaming turn on serve's defaults*: the same turn once over each remote transport, on a
  ``serve`` of its own and a new connection: completed, or disconnected (after how many updates);
* *requests over one streamable HTTP connection*: ``PROBE_REQUESTS`` ``_bench/ping`` requests, each
  a POST, with ``serve``'s defaults: whether all are answered on the one HTTP/2 connection under it;
* *idle connections*: ``serve``'s RSS at rest and with ``--remote-idle`` WebSockets open that have
  sent nothing (a connection's proxy starts with its first message: an idle one has none);
* *sessions*: ``--remote-sessions`` live sessions over ``CONNECTIONS`` initialized WebSockets:
  ``serve``'s RSS and its connections' proxies', against the same sessions over as many stdio
  proxies run by the client (the adapters' trees are not counted on either side);
* ``acp-proxy connect``: cold start (spawn to the answer of ``initialize`` through ``serve``, which
  starts the connection's proxy on it) against spawning a stdio proxy to its ``initialize`` answer,
  ``--cold-starts`` each, interleaved; and the bridge's RSS against a stdio proxy's, each after
  ``initialize``, a session and ``SHORT_UPDATES`` short turns.

Each ``serve`` is stopped with SIGTERM and waited for (it ends its connections' proxies first); the
section's processes carry its marker, and one left at the end fails the run. No target is set:
the figures are reported.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import math
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.abc
import httpx
import msgspec
import psutil

from acp_proxy.remote.wsclient import Closed, Target, WebSocket
from benchmarks.common import (
    INITIALIZE_PARAMS,
    ROOT,
    BenchError,
    cpu_seconds,
    figures,
    proc_status_kb,
    script_argv,
)
from benchmarks.h2client import H2Client, H2Error
from benchmarks.harness import (
    CLOSE_GRACE,
    IO_TIMEOUT,
    Case,
    Column,
    Report,
    Row,
    Section,
    attempt,
    call,
    col,
    connect,
    figure_cols,
    fmt,
    interleaved,
    isolated,
    left_running,
    minus,
    progress,
    ratio,
    render_table,
    stop,
    with_baseline,
)
from tests.kit.gateway import GatewayError

NAME: Final = "remote"
BACKEND: Final = "bench"
SHORT_UPDATES: Final = 10
WARM_UP: Final = 20
BLOCK: Final = 50
CONNECTIONS: Final = 4
"""The initialized WebSockets the sessions are opened over (``--quick``: 2)."""
READ_SIZE: Final = 1 << 16
READY_TIMEOUT: Final = 30.0
STOP_TIMEOUT: Final = 60.0
SETTLE: Final = 0.5
"""Seconds to wait before reading memory: a process's last allocations land."""
PAUSE: Final = 1.0
"""Seconds between streaming turns: what the last one left to do (in every process) is done before the next."""
MIN_STREAM_RUNS: Final = 3
PROBE_REQUESTS: Final = 1_100
"""Requests sent over one streamable HTTP connection by the probe of how many it may carry."""

STDIO: Final = "stdio"
WS: Final = "ws"
HTTP: Final = "http"
HTTPX: Final = "httpx"
LABELS: Final = {
    STDIO: "stdio through the proxy",
    WS: "WebSocket (serve)",
    HTTP: "streamable HTTP/2 (serve)",
    HTTPX: "streamable HTTP/2 (serve), httpx client",
}

Message = dict[str, Any]
ENDED: Final = "_stream_ended"
"""What an HTTP event stream's reader queues when serve ends the stream."""


class Disconnected(BenchError):
    """``serve`` ended the connection: the WebSocket was closed, or an event stream ended."""


def results_of(report: Report) -> dict[str, Any]:
    """This section's results: ``bench.json``'s ``remote``."""
    return report.remote


def agent_argv() -> list[str]:
    return script_argv("stream_agent.py")


def stdio_argv(backend: str, config: Path) -> list[str]:
    return [sys.executable, "-m", "acp_proxy", "--async-backend", backend, "--config", str(config)]


def connect_argv(url: str) -> list[str]:
    return [sys.executable, "-m", "acp_proxy", "connect", url]


def write_config(workdir: Path, max_live: int) -> Path:
    """The backend ``bench`` (the streaming agent), every session live at once (``max_live``)."""
    path = workdir / "remote.toml"
    backend = f"[backends.{BACKEND}]\ncommand = {json.dumps(agent_argv())}\n"
    path.write_text(f'default_backend = "{BACKEND}"\n[pool]\nmax_live = {max_live}\n{backend}')
    return path


def make_token(env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "acp_proxy", "token", "create", "bench"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if done.returncode != 0 or not done.stdout.strip():
        raise BenchError(f"acp-proxy token create: status {done.returncode}: {done.stderr.strip()[-300:]}")
    return done.stdout.strip()


def rss_mb(pid: int) -> float | None:
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return None


def pss_mb(pid: int) -> float | None:
    """Its proportional set size: its own pages, and its share of those it shares (a forked proxy shares
    most of its launcher's), so that the sizes of processes add up."""
    try:
        return psutil.Process(pid).memory_full_info().pss / 2**20
    except (psutil.Error, AttributeError):
        return None


def encode(request_id: int, method: str, params: object) -> bytes:
    return msgspec.json.encode({"jsonrpc": "2.0", "id": request_id, "method": method, "params": params})


def prompt_params(session_id: str, updates: int) -> Message:
    return {
        "sessionId": session_id,
        "prompt": [{"type": "text", "text": "stream"}],
        "_meta": {"bench": {"updates": updates}},
    }


# --- serve -----------------------------------------------------------------------------------------


class Served:
    """One ``acp-proxy serve`` on an ephemeral loopback port."""

    def __init__(self, process: subprocess.Popen[bytes], url: str, log: Any) -> None:
        self.process = process
        self.url = url
        self.ws_url = url.replace("http://", "ws://", 1)
        self.log = log

    @property
    def pid(self) -> int:
        return self.process.pid

    def proxies(self) -> list[psutil.Process]:
        """Its connections' proxies: its launcher's children, and any it exec'd itself."""
        try:
            launchers = self.launchers()
            execd = [child for child in psutil.Process(self.pid).children() if child not in launchers]
            return [proxy for launcher in launchers for proxy in launcher.children()] + execd
        except psutil.Error:
            return []

    def launchers(self) -> list[psutil.Process]:
        """Its launcher, if it has one: the child that runs ``serve``'s own command line, forked from it."""
        try:
            serve = psutil.Process(self.pid)
            return [child for child in serve.children() if child.cmdline() == serve.cmdline()]
        except psutil.Error:
            return []

    def stderr_tail(self) -> str:
        self.log.seek(0)
        return b" | ".join(self.log.read().splitlines()[-3:]).decode("utf-8", "replace")


@contextlib.contextmanager
def serving(env: dict[str, str], config: Path, backend: str, connections: int, *extra: str) -> Iterator[Served]:
    """``acp-proxy serve`` until the block ends; then SIGTERM, and its exit (with its proxies') waited for."""
    argv = [sys.executable, "-m", "acp_proxy", "serve", "--async-backend", backend, "--listen", "127.0.0.1:0"]
    argv += ["--config", str(config), "--max-connections", str(connections)]
    argv += ["--max-connections-per-token", str(connections), *extra]
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, bufsize=0)
        try:
            served = Served(process, ready_url(process, log), log)
            yield served
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            try:
                status = process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                raise BenchError(f"serve did not exit within {STOP_TIMEOUT:g} s of SIGTERM (killed)") from None
            finally:
                assert process.stdout is not None
                process.stdout.close()
        if status != 0:
            raise BenchError(f"serve exited with status {status}: {served.stderr_tail()}")


def ready_url(process: subprocess.Popen[bytes], log: Any) -> str:
    """The URL ``serve`` prints once it listens."""
    assert process.stdout is not None
    deadline = time.monotonic() + READY_TIMEOUT
    out = b""
    while b"\n" not in out:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([process.stdout], [], [], left)[0]:
            raise BenchError(f"serve did not print its address within {READY_TIMEOUT:g} s")
        chunk = process.stdout.read(4096)
        if not chunk:
            log.seek(0)
            raise BenchError(f"serve exited before listening: {log.read()[-300:].decode('utf-8', 'replace')}")
        out += chunk
    line = out.split(b"\n", 1)[0].decode()
    if not line.startswith("listening: "):
        raise BenchError(f"serve printed {line!r}, not its address")
    return line.removeprefix("listening: ").strip()


# --- the clients: one asynchronous client per transport, the same work on each ----------------------


class Channel:
    """A JSON-RPC client connection: requests out, every message in decoded; one request at a time."""

    label: str = ""

    def __init__(self) -> None:
        self.ids = itertools.count(1)
        self.ready: deque[Message] = deque()
        self.pid: int | None = None
        """The process serving it on the other side: the stdio proxy, or the connection's proxy of ``serve``."""
        self.seen = 0
        """Updates received in the current (or last) turn."""

    async def send(self, data: bytes, session_id: str | None) -> None:
        raise NotImplementedError

    async def fill(self) -> None:
        """Decode what comes next into ``ready`` (at least one message)."""
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError

    async def receive(self) -> Message:
        while not self.ready:
            await self.fill()
        return self.ready.popleft()

    async def request(self, method: str, params: object, session_id: str | None = None) -> Any:
        """The result of a request that nothing else answers in between."""
        request_id = next(self.ids)
        with anyio.fail_after(IO_TIMEOUT):
            await self.send(encode(request_id, method, params), session_id)
            msg = await self.receive()
        if msg.get("id") != request_id or "result" not in msg:
            raise BenchError(f"{self.label}: {method}: expected its answer, got {str(msg)[:300]}")
        return msg["result"]

    async def initialize(self) -> None:
        await self.request("initialize", INITIALIZE_PARAMS)

    async def new_session(self) -> str:
        result = await self.request("session/new", {"cwd": str(ROOT), "mcpServers": []})
        return str(result["sessionId"])

    async def turn(self, session_id: str, updates: int) -> float:
        """One prompt turn streaming ``updates`` updates: seconds from sending the prompt to its answer."""
        request_id = next(self.ids)
        data = encode(request_id, "session/prompt", prompt_params(session_id, updates))
        self.seen = 0
        with anyio.fail_after(IO_TIMEOUT + updates / 1000):
            start = time.perf_counter()
            await self.send(data, session_id)
            while True:
                msg = await self.receive()
                if msg.get("method") == "session/update":
                    self.seen += 1
                    continue
                if msg.get("id") == request_id and msg.get("result") == {"stopReason": "end_turn"}:
                    break
                raise BenchError(f"{self.label}: unexpected {str(msg)[:300]}")
            seconds = time.perf_counter() - start
        if self.seen != updates:
            raise BenchError(f"{self.label}: expected {updates} updates, got {self.seen}")
        return seconds


class Stdio(Channel):
    """Over the pipes of a stdio ``acp-proxy`` the client runs."""

    label = LABELS[STDIO]

    def __init__(self, process: anyio.abc.Process) -> None:
        super().__init__()
        self.process = process
        self.pid = process.pid
        self.buffer = b""

    @classmethod
    async def open(cls, argv: list[str], env: dict[str, str], log: Any) -> Stdio:
        process = await anyio.open_process(argv, env=env, cwd=ROOT, stderr=log)
        return cls(process)

    async def send(self, data: bytes, session_id: str | None) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send(data + b"\n")

    async def fill(self) -> None:
        assert self.process.stdout is not None
        while (cut := self.buffer.rfind(b"\n")) < 0:
            try:
                self.buffer += await self.process.stdout.receive(READ_SIZE)
            except anyio.EndOfStream:
                raise BenchError(f"{self.label}: the proxy closed its stdout") from None
        lines, self.buffer = self.buffer[:cut], self.buffer[cut + 1 :]
        self.ready.extend(msgspec.json.decode(line) for line in lines.split(b"\n") if line)

    async def aclose(self) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.aclose()
        try:
            with anyio.fail_after(CLOSE_GRACE):
                status = await self.process.wait()
        except TimeoutError:
            self.process.kill()
            await self.process.wait()
            raise BenchError(f"{self.label}: did not exit within {CLOSE_GRACE:g} s of stdin EOF (killed)") from None
        finally:
            await self.process.aclose()
        if status != 0:
            raise BenchError(f"{self.label}: exited with status {status}")


class Ws(Channel):
    """Over one WebSocket to ``serve`` (``acp_proxy.remote.wsclient``, what ``acp-proxy connect`` uses)."""

    label = LABELS[WS]

    def __init__(self, ws: WebSocket) -> None:
        super().__init__()
        self.ws = ws

    @classmethod
    async def open(cls, url: str, token: str) -> Ws:
        return cls(await WebSocket.connect(Target.parse(url, token)))

    async def send(self, data: bytes, session_id: str | None) -> None:
        await self.ws.send_text(data.decode())

    async def fill(self) -> None:
        try:
            texts = await self.ws.receive_texts()
        except Closed as exc:
            raise Disconnected(f"{self.label}: the WebSocket was {exc}") from None
        self.ready.extend(map(msgspec.json.decode, texts))

    async def aclose(self) -> None:
        await self.ws.aclose()


class Http(Channel):
    """Streamable HTTP over HTTP/2 (``h2client``): POSTs answered 202, messages on the connection's and the
    session's event streams, read by tasks of their own into one queue."""

    label = LABELS[HTTP]

    def __init__(self, url: str, token: str, tasks: anyio.abc.TaskGroup) -> None:
        super().__init__()
        self.url = url
        self.token = token
        self.tasks = tasks
        self.connection_id = ""
        self.inbox, self.outlet = anyio.create_memory_object_stream[list[Message]](math.inf)
        self.client: H2Client | None = None

    async def post(self, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        """A POST's status, headers and body."""
        if self.client is None:
            self.client = await H2Client.connect(self.url, self.tasks)
        response = await self.client.request("POST", self.fields(headers), body)
        answer = await response.read()
        return response.status, {k.decode(): v.decode() for k, v in response.headers.items()}, answer

    async def stream_events(
        self, headers: dict[str, str], on_data: Callable[[bytes], None], task_status: anyio.abc.TaskStatus[None]
    ) -> None:
        """Read an event stream, its chunks given to ``on_data`` as they come (``task_status`` told once it is
        open), until it ends; ``Disconnected`` when it fails."""
        assert self.client is not None
        response = await self.client.request("GET", self.fields(headers), on_data=on_data)
        if response.status != 200:
            raise BenchError(f"{self.label}: event stream answered {response.status}: {response.error}")
        task_status.started()
        await response.done.wait()
        if response.error is not None:
            raise Disconnected(response.error)

    async def delete(self, headers: dict[str, str]) -> None:
        if self.client is not None:
            if headers:  # its answer is not waited for: the reading task may have ended with the benchmark's
                with contextlib.suppress(H2Error, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    await self.client.request("DELETE", self.fields(headers), wait=False)
            await self.client.aclose()

    def fields(self, headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
        return [(b"authorization", b"Bearer " + self.token.encode())] + [
            (name.encode(), value.encode()) for name, value in headers.items()
        ]

    async def initialize(self) -> None:
        """``initialize``'s answer is the POST's body; it names the connection, whose stream is opened then."""
        body = encode(next(self.ids), "initialize", INITIALIZE_PARAMS)
        status, headers, answer = await self.post(body, {"content-type": "application/json"})
        if status != 200 or "result" not in msgspec.json.decode(answer):
            raise BenchError(f"{self.label}: initialize: {status} {answer[:200]!r}")
        self.connection_id = headers["acp-connection-id"]
        await self.open_stream(None)

    async def new_session(self) -> str:
        session_id = await super().new_session()  # answered on the connection's stream
        await self.open_stream(session_id)
        return session_id

    def headers(self, session_id: str | None) -> dict[str, str]:
        headers = {"acp-connection-id": self.connection_id}
        if session_id is not None:
            headers["acp-session-id"] = session_id
        return headers

    async def open_stream(self, session_id: str | None) -> None:
        await self.tasks.start(self.read_stream, session_id)

    async def read_stream(self, session_id: str | None, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        headers = {**self.headers(session_id), "accept": "text/event-stream"}
        why = "serve ended it"
        pending = b""
        decode = msgspec.json.decode

        def take(chunk: bytes) -> None:
            nonlocal pending
            pending += chunk
            cut = pending.rfind(b"\n")
            if cut < 0:
                return
            lines, pending = pending[:cut], pending[cut + 1 :]
            messages = [decode(line[6:]) for line in lines.split(b"\n") if line.startswith(b"data: ")]
            if messages:
                self.inbox.send_nowait(messages)  # a chunk's messages at once, as a socket's reader does

        try:
            await self.stream_events(headers, take, task_status)
        except Disconnected as exc:  # the HTTP/2 connection under it was closed
            why = str(exc)
        self.inbox.send_nowait([{ENDED: why}])  # the turn waiting for its messages fails, saying why

    async def send(self, data: bytes, session_id: str | None) -> None:
        status, _, answer = await self.post(data, {**self.headers(session_id), "content-type": "application/json"})
        if status != 202:
            raise BenchError(f"{self.label}: POST answered {status}: {answer[:200]!r}")

    async def fill(self) -> None:
        self.ready.extend(await self.outlet.receive())
        with contextlib.suppress(anyio.WouldBlock):
            while True:
                self.ready.extend(self.outlet.receive_nowait())
        for msg in self.ready:
            if ENDED in msg:
                raise Disconnected(f"{self.label}: an event stream ended: {msg[ENDED]}")

    async def aclose(self) -> None:
        await self.delete(self.headers(None) if self.connection_id else {})


class Httpx(Http):
    """The same streamable HTTP client over httpx's HTTP/2 (httpcore over h2): a common Python client, and the
    cost of its generality on the client's side."""

    label = LABELS[HTTPX]

    def __init__(self, url: str, token: str, tasks: anyio.abc.TaskGroup) -> None:
        super().__init__(url, token, tasks)
        self.httpx = httpx.AsyncClient(
            http1=False, http2=True, headers={"authorization": f"Bearer {token}"}, timeout=IO_TIMEOUT
        )

    async def post(self, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        response = await self.httpx.post(self.url, content=body, headers=headers)
        if response.http_version != "HTTP/2":
            raise BenchError(f"{self.label}: answered over {response.http_version}")
        return response.status_code, dict(response.headers), response.content

    async def stream_events(
        self, headers: dict[str, str], on_data: Callable[[bytes], None], task_status: anyio.abc.TaskStatus[None]
    ) -> None:
        try:
            async with self.httpx.stream("GET", self.url, headers=headers, timeout=None) as response:
                if response.status_code != 200:
                    raise BenchError(f"{self.label}: event stream answered {response.status_code}")
                task_status.started()
                async for chunk in response.aiter_raw():
                    on_data(chunk)
        except httpx.HTTPError as exc:
            raise Disconnected(repr(exc)) from None

    async def delete(self, headers: dict[str, str]) -> None:
        if headers:
            with contextlib.suppress(httpx.HTTPError):
                await self.httpx.delete(self.url, headers=headers)
        await self.httpx.aclose()


def new_child(served: Served, before: set[int]) -> int | None:
    """The one proxy ``serve`` started since ``before`` (its children's pids then)."""
    started = [p.pid for p in served.proxies() if p.pid not in before]
    return started[0] if len(started) == 1 else None


# --- 1. turns and streaming over each transport ------------------------------------------------------


async def transports_run(served: Served, bench: Bench) -> dict[str, Any]:
    args = bench.args
    async with contextlib.AsyncExitStack() as stack, anyio.create_task_group() as tasks:
        channels: dict[str, Channel] = {}
        channels[STDIO] = await Stdio.open(bench.stdio_argv(), bench.env, bench.log)
        stack.push_async_callback(channels[STDIO].aclose)
        channels[WS] = await Ws.open(served.ws_url, bench.token)
        stack.push_async_callback(channels[WS].aclose)
        channels[HTTP] = Http(served.url, bench.token, tasks)
        stack.push_async_callback(channels[HTTP].aclose)
        channels[HTTPX] = Httpx(served.url, bench.token, tasks)
        stack.push_async_callback(channels[HTTPX].aclose)
        sessions = {}
        for key, channel in channels.items():
            before = {p.pid for p in served.proxies()}
            await channel.initialize()
            if key != STDIO:
                channel.pid = new_child(served, before)
            sessions[key] = await channel.new_session()
        turns: dict[str, list[float]] = {key: [] for key in channels}
        cpu: dict[str, list[Cpu]] = {key: [] for key in channels}
        streams: dict[str, list[Row]] = {key: [] for key in channels}
        errors: list[str] = []

        async def on(key: str, what: str, action: Callable[[Channel], Awaitable[None]]) -> None:
            """``action`` on the transport ``key``; one that fails is reported and dropped, its samples too."""
            if key not in turns:
                return
            try:
                await action(channels[key])
            except FAILURES as exc:
                errors.append(f"{NAME} {what} over {channels[key].label}: {exc!r}"[:600])
                progress(f"  FAILED {errors[-1]}")
                del turns[key], streams[key], cpu[key]

        async def short_turns(count: int, kept: bool, key: str, channel: Channel) -> None:
            before = cpu_now(served, channel)
            samples = [await channel.turn(sessions[key], SHORT_UPDATES) * 1e6 for _ in range(count)]
            if kept:
                turns[key] += samples
                cpu[key].append(cpu_spent(before, cpu_now(served, channel)))

        for key in channels:
            await on(key, "warm-up", functools.partial(short_turns, WARM_UP, False, key))
        rounds = max(1, args.remote_turns // BLOCK)
        for index in range(rounds):
            if index % 5 == 0:
                progress(f"remote: short turns, round {index + 1}/{rounds} x {len(turns)} transports ...")
            count = args.remote_turns - BLOCK * (rounds - 1) if index == rounds - 1 else BLOCK
            for key in channels:
                await on(key, "short turns", functools.partial(short_turns, count, True, key))

        async def stream(key: str, channel: Channel) -> None:
            await anyio.sleep(PAUSE)
            streams[key].append(await stream_once(served, channel, sessions[key], args.remote_updates))

        runs = stream_runs(args)
        for index in range(runs):
            progress(f"remote: streaming {args.remote_updates:,} updates, run {index + 1}/{runs} ...")
            for key in channels:
                await on(key, "streaming", functools.partial(stream, key))
        tasks.cancel_scope.cancel()  # the HTTP event streams; then the exit stack closes the channels
    return {"turns": turns, "cpu": cpu, "streams": streams, "errors": errors}


Cpu = tuple[float | None, float | None, float | None]
"""CPU seconds of the proxy (the stdio one, or the connection's), ``serve`` (``None`` over stdio) and the client."""


def cpu_now(served: Served, channel: Channel) -> Cpu:
    proxy, serve = channel.pid, None if isinstance(channel, Stdio) else served.pid
    return cpu_seconds(proxy) if proxy else None, cpu_seconds(serve) if serve else None, time.process_time()


def cpu_spent(before: Cpu, after: Cpu) -> Cpu:
    proxy, serve, client = (None if b is None or a is None else a - b for b, a in zip(before, after, strict=True))
    return proxy, serve, client


async def stream_once(served: Served, channel: Channel, session_id: str, updates: int) -> Row:
    """One streaming turn, with the CPU the client and the processes in the middle spent on it."""
    before = cpu_now(served, channel)
    seconds = await channel.turn(session_id, updates)
    spent = cpu_spent(before, cpu_now(served, channel))
    return {"seconds": seconds, "proxy_cpu_s": spent[0], "serve_cpu_s": spent[1], "client_cpu_s": spent[2]}


def cpu_per_turn(blocks: list[Cpu], turns: int) -> Row:
    """The CPU each process spent a short turn, in microseconds, over the kept blocks (``None`` where a process
    was not there, or left during the run)."""
    row: Row = {}
    for index, name in enumerate(("proxy", "serve", "client")):
        spent = [block[index] for block in blocks]
        known = [seconds for seconds in spent if seconds is not None]
        row[f"{name}_cpu_us"] = sum(known) / turns * 1e6 if known and len(known) == len(spent) else None
    return row


async def defaults_run(served: Served, bench: Bench) -> list[Row]:
    """One streaming turn over each remote transport, on a new connection to a ``serve`` with its defaults:
    whether it completes, or ``serve`` disconnects the client (and after how many updates)."""
    updates = bench.args.remote_updates
    rows = []
    async with contextlib.AsyncExitStack() as stack, anyio.create_task_group() as tasks:
        channels: list[tuple[str, Channel]] = [(WS, await Ws.open(served.ws_url, bench.token))]
        stack.push_async_callback(channels[0][1].aclose)
        channels.append((HTTP, Http(served.url, bench.token, tasks)))
        stack.push_async_callback(channels[1][1].aclose)
        for key, channel in channels:
            await channel.initialize()
            session_id = await channel.new_session()
            row: Row = {"transport": key, "updates": updates}
            await anyio.sleep(PAUSE)
            try:
                row["seconds"] = await channel.turn(session_id, updates)
                row["outcome"], row["error"] = "completed", None
            except Disconnected as exc:
                row["seconds"], row["outcome"], row["error"] = None, "disconnected", str(exc)
            except FAILURES as exc:
                row["seconds"], row["outcome"], row["error"] = None, "failed", repr(exc)
            row["received"] = channel.seen
            rows.append(row)
        tasks.cancel_scope.cancel()
    return rows


async def requests_probe(served: Served, bench: Bench) -> Row:
    """``PROBE_REQUESTS`` requests over one streamable HTTP connection (one HTTP/2 connection under it): how
    many are answered before something ends it."""
    answered, error = 0, None
    async with contextlib.AsyncExitStack() as stack, anyio.create_task_group() as tasks:
        channel = Http(served.url, bench.token, tasks)
        stack.push_async_callback(channel.aclose)
        await channel.initialize()
        try:
            for _ in range(PROBE_REQUESTS):
                await channel.request("_bench/ping", {})
                answered += 1
        except FAILURES as exc:
            error = repr(exc)
        tasks.cancel_scope.cancel()
    return {"requests": PROBE_REQUESTS, "answered": answered, "error": error}


def transport_rows(measured: dict[str, Any], updates: int) -> tuple[list[Row], list[Row]]:
    turn_rows = [
        {
            "transport": key,
            "turns": len(samples),
            **figures("us", samples, "p50", "p95", "p99", "mean"),
            **cpu_per_turn(measured["cpu"][key], len(samples)),
        }
        for key, samples in measured["turns"].items()
    ]
    stream_rows = []
    for key, runs in measured["streams"].items():
        seconds = statistics.median(run["seconds"] for run in runs)

        def median_of(name: str, runs: list[Row] = runs) -> float | None:
            values = [run[name] for run in runs if run[name] is not None]
            return statistics.median(values) if values else None

        stream_rows.append(
            {
                "transport": key,
                "updates": updates,
                "runs": len(runs),
                "seconds": seconds,
                "all_seconds": [run["seconds"] for run in runs],
                "updates_per_s": updates / seconds,
                "proxy_cpu_s": median_of("proxy_cpu_s"),
                "serve_cpu_s": median_of("serve_cpu_s"),
                "client_cpu_s": median_of("client_cpu_s"),
            }
        )
    base_turn = next((row for row in turn_rows if row["transport"] == STDIO), None)
    for row in turn_rows:
        for name in ("p50", "p95"):
            row[f"vs_stdio_{name}"] = None if base_turn is None else row[f"{name}_us"] / base_turn[f"{name}_us"]
    base_stream = next((row for row in stream_rows if row["transport"] == STDIO), None)
    for row in stream_rows:
        row["vs_stdio"] = None if base_stream is None else row["updates_per_s"] / base_stream["updates_per_s"]
    return turn_rows, stream_rows


# --- 2. what one serve holds --------------------------------------------------------------------------


async def idle_run(served: Served, token: str, count: int) -> Row:
    await anyio.sleep(SETTLE)
    at_rest = rss_mb(served.pid)
    sockets: list[WebSocket] = []
    try:
        start = time.perf_counter()
        with anyio.fail_after(IO_TIMEOUT + count / 10):
            for _ in range(count):
                sockets.append(await WebSocket.connect(Target.parse(served.ws_url, token)))
        opened_s = time.perf_counter() - start
        await anyio.sleep(SETTLE)
        held = rss_mb(served.pid)
        proxies = len(served.proxies())
    finally:
        for ws in sockets:
            await ws.aclose()
    if at_rest is None or held is None:
        raise BenchError("serve's RSS could not be read")
    return {
        "connections": count,
        "opened_s": opened_s,
        "serve_rest_mb": at_rest,
        "serve_idle_mb": held,
        "per_connection_kb": (held - at_rest) * 1024 / count,
        "proxies": proxies,
    }


def served_pss(served: Served) -> float | None:
    """``serve``'s PSS with its launcher's."""
    sizes = [pss_mb(pid) for pid in (served.pid, *(launcher.pid for launcher in served.launchers()))]
    return None if None in sizes else sum(size for size in sizes if size is not None)


async def sessions_run(served: Served, token: str, connections: int, sessions: int) -> Row:
    """``sessions`` sessions over ``connections`` initialized WebSockets, held open while memory is read."""
    await anyio.sleep(SETTLE)
    at_rest = served_pss(served)
    async with contextlib.AsyncExitStack() as stack:
        channels: list[Channel] = []
        for _ in range(connections):
            channel = await Ws.open(served.ws_url, token)
            stack.push_async_callback(channel.aclose)
            await channel.initialize()
            channels.append(channel)
        await open_sessions(channels, sessions)
        await anyio.sleep(SETTLE)
        serve_mb = served_pss(served)
        proxies = [pss_mb(p.pid) for p in served.proxies()]
    if at_rest is None or serve_mb is None or None in proxies or len(proxies) != connections:
        raise BenchError(f"serve's memory could not be read ({len(proxies)} proxies of {connections})")
    sizes = [p for p in proxies if p is not None]
    return {
        "connections": connections,
        "sessions": sessions,
        "serve_rest_mb": at_rest,
        "serve_mb": serve_mb,
        "proxies_mb": sum(sizes),
        "proxy_median_mb": statistics.median(sizes),
        "total_mb": serve_mb + sum(sizes),
    }


async def open_sessions(channels: list[Channel], sessions: int) -> None:
    """``sessions`` sessions, dealt round the channels, each with one short turn (its agent is live)."""
    for index in range(sessions):
        channel = channels[index % len(channels)]
        session_id = await channel.new_session()
        await channel.turn(session_id, SHORT_UPDATES)


async def direct_sessions_run(bench: Bench, row: Row) -> None:
    """The same sessions over as many stdio proxies, run by the client: their RSS, for the base."""
    async with contextlib.AsyncExitStack() as stack:
        channels: list[Channel] = []
        for _ in range(row["connections"]):
            channel = await Stdio.open(bench.stdio_argv(), bench.env, bench.log)
            stack.push_async_callback(channel.aclose)
            await channel.initialize()
            channels.append(channel)
        await open_sessions(channels, row["sessions"])
        await anyio.sleep(SETTLE)
        sizes = [pss_mb(channel.pid) for channel in channels if channel.pid is not None]
    if None in sizes or len(sizes) != row["connections"]:
        raise BenchError("the stdio proxies' memory could not be read")
    known = [size for size in sizes if size is not None]
    row["direct_proxies_mb"] = sum(known)
    row["direct_proxy_median_mb"] = statistics.median(known)
    row["added_mb"] = row["total_mb"] - row["direct_proxies_mb"]


# --- 3. acp-proxy connect -----------------------------------------------------------------------------


def cold_start_once(argv: list[str], env: dict[str, str], who: str) -> float:
    start = time.perf_counter()
    conn = connect(argv, env, who)
    try:
        call(conn, "initialize", INITIALIZE_PARAMS)
        elapsed = (time.perf_counter() - start) * 1000
    except BaseException:
        conn.kill()
        conn.close()
        raise
    if (status := stop(conn)) != 0:
        raise BenchError(f"{who}: exited with status {status}: {conn.stderr_tail()}")
    return elapsed


def memory_once(argv: list[str], env: dict[str, str], who: str, turns: int) -> Row:
    """The process's RSS after ``initialize``, a session and ``turns`` short turns (and its peak)."""
    conn = connect(argv, env, who)
    try:
        call(conn, "initialize", INITIALIZE_PARAMS)
        result, _ = call(conn, "session/new", {"cwd": str(ROOT), "mcpServers": []})
        for _ in range(turns):
            call(conn, "session/prompt", prompt_params(result["sessionId"], SHORT_UPDATES))
        time.sleep(SETTLE)
        rss, hwm = proc_status_kb(conn.pid, "VmRSS"), proc_status_kb(conn.pid, "VmHWM")
    except BaseException:
        conn.kill()
        conn.close()
        raise
    if (status := stop(conn)) != 0:
        raise BenchError(f"{who}: exited with status {status}: {conn.stderr_tail()}")
    if rss is None or hwm is None:
        raise BenchError(f"{who}: its memory could not be read")
    return {"rss_mb": rss / 1024, "hwm_mb": hwm / 1024}


# --- the section ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bench:
    """What every part of the section runs with: one state dir, its token, one config."""

    report: Report
    args: argparse.Namespace
    results: dict[str, Any]
    env: dict[str, str]
    config: Path
    token: str
    log: Any
    """Where the stdio proxies the client runs write their stderr."""

    @property
    def backend(self) -> str:
        return str(self.args.backends[0])

    def serve(self, connections: int, *extra: str) -> contextlib.AbstractContextManager[Served]:
        return serving(self.env, self.config, self.backend, connections, *extra)

    def stdio_argv(self) -> list[str]:
        return stdio_argv(self.backend, self.config)

    def failed(self, what: str, exc: BaseException) -> None:
        self.report.errors.append(f"{NAME} {what}: {exc!r}"[:600])
        progress(f"  FAILED {self.report.errors[-1]}")


FAILURES: Final = (
    BenchError,
    GatewayError,
    OSError,
    TimeoutError,
    httpx.HTTPError,
    msgspec.DecodeError,
    ExceptionGroup,
)
"""What ends a part of the section (recorded as a failure): the run goes on with the next part."""


def measure(report: Report, args: argparse.Namespace) -> None:
    results = results_of(report)
    results.update(
        backend=args.backends[0],
        short_updates=SHORT_UPDATES,
        turns=args.remote_turns,
        updates=args.remote_updates,
        repeat=stream_runs(args),
        idle=args.remote_idle,
        sessions=args.remote_sessions,
        connections=CONNECTIONS if not args.quick else 2,
        cold_starts=args.cold_starts,
    )
    with isolated(report, NAME, results) as run, tempfile.TemporaryFile() as log:
        env = {**run.env, "ACP_PROXY_STATE_DIR": str(run.workdir / "state")}
        config = write_config(run.workdir, max_live=args.remote_sessions + 8)
        bench = Bench(report, args, results, env, config, make_token(env), log)
        parts: list[tuple[str, Callable[[Bench], None]]] = [
            ("transports", measure_transports),
            ("serve's defaults", measure_defaults),
            ("connect", measure_connect),
            ("idle connections", measure_idle),
            ("sessions", measure_sessions),
        ]
        for what, part in parts:
            try:
                part(bench)
            except FAILURES as exc:
                bench.failed(what, exc)


def stream_runs(args: argparse.Namespace) -> int:
    """Streaming runs per transport: ``--repeat``, and at least ``MIN_STREAM_RUNS`` (a turn is short); one for
    ``--smoke``."""
    return 1 if args.smoke else max(MIN_STREAM_RUNS, int(args.repeat))


def measure_transports(bench: Bench) -> None:
    args = bench.args
    progress(f"remote: {args.remote_turns} short turns and {stream_runs(args)} streaming turns over each transport ...")
    with bench.serve(16) as served:
        measured = anyio.run(transports_run, served, bench)
    bench.report.errors += measured["errors"]
    bench.results["turns_by"], bench.results["streams_by"] = transport_rows(measured, args.remote_updates)


def measure_defaults(bench: Bench) -> None:
    progress(f"remote: streaming {bench.args.remote_updates:,} updates on a serve with its defaults ...")
    with bench.serve(16) as served:
        bench.results["defaults_rows"] = anyio.run(defaults_run, served, bench)
        progress(f"remote: {PROBE_REQUESTS:,} requests over one streamable HTTP connection ...")
        bench.results["probe_row"] = anyio.run(requests_probe, served, bench)


def measure_idle(bench: Bench) -> None:
    count = bench.args.remote_idle
    progress(f"remote: {count} idle WebSockets on one serve ...")
    with bench.serve(count + 16) as served:
        bench.results["idle_row"] = anyio.run(idle_run, served, bench.token, count)


def measure_sessions(bench: Bench) -> None:
    connections, sessions = bench.results["connections"], bench.args.remote_sessions
    progress(f"remote: {sessions} sessions over {connections} WebSockets, then over stdio proxies ...")
    with bench.serve(connections + 16) as served:
        row = anyio.run(sessions_run, served, bench.token, connections, sessions)
    anyio.run(direct_sessions_run, bench, row)
    bench.results["sessions_row"] = row


def measure_connect(bench: Bench) -> None:
    report = bench.report
    with bench.serve(64) as served:
        bridge = {**bench.env, "ACP_PROXY_TOKEN": bench.token}
        argvs = {"connect": (connect_argv(served.ws_url), bridge), STDIO: (bench.stdio_argv(), bench.env)}
        labels = {"connect": "acp-proxy connect (through serve)", STDIO: "stdio proxy"}
        cases = [
            Case(key, labels[key], functools.partial(cold_start_once, argv, child_env, labels[key]))
            for key, (argv, child_env) in argvs.items()
        ]
        times = interleaved(report, "remote: cold start", cases, bench.args.cold_starts)
        progress("remote: the bridge's memory and a stdio proxy's ...")
        memory = {
            key: attempt(
                report,
                f"remote: memory of {labels[key]}",
                functools.partial(memory_once, argv, child_env, labels[key], SHORT_UPDATES),
            )
            for key, (argv, child_env) in argvs.items()
        }
    rows = [
        {
            "command": key,
            "label": labels[key],
            "runs": len(times.get(key, [])),
            **(figures("ms", times[key], "median", "min", "p90") if key in times else dict.fromkeys(MS_FIGURES)),
            **(memory[key] or {"rss_mb": None, "hwm_mb": None}),
        }
        for key in argvs
    ]
    base = rows[-1]
    with_baseline(rows, base, {"vs_stdio": ("median_ms", ratio), "rss_vs_stdio": ("rss_mb", ratio)})
    with_baseline(rows, base, {"added_ms": ("median_ms", minus)})
    bench.results["connect_rows"] = rows


MS_FIGURES: Final = ("median_ms", "min_ms", "p90_ms")


# --- rendering ----------------------------------------------------------------------------------------


def transport(row: Row) -> str:
    return LABELS[row["transport"]]


def remote_only(row: Row) -> bool:
    return bool(row["transport"] != STDIO)


TURN_COLUMNS = (
    Column("transport", transport),
    *figure_cols("us", "p50", "p95", "p99", "mean", digits=0),
    col("x stdio p50", "vs_stdio_p50", 2, "x", when=remote_only),
    col("x stdio p95", "vs_stdio_p95", 2, "x", when=remote_only),
    col("proxy CPU us", "proxy_cpu_us", 0),
    col("serve CPU us", "serve_cpu_us", 0, when=remote_only),
    col("client CPU us", "client_cpu_us", 0),
)
STREAM_COLUMNS = (
    Column("transport", transport),
    col("wall s", "seconds", 3),
    Column("updates/s", lambda row: fmt(row["updates_per_s"] / 1000, 1, "k")),
    col("x stdio", "vs_stdio", 2, "x", when=remote_only),
    col("proxy CPU s", "proxy_cpu_s", 2),
    col("serve CPU s", "serve_cpu_s", 2, when=remote_only),
    col("client CPU s", "client_cpu_s", 2),
)


def bridged(row: Row) -> bool:
    return bool(row["command"] != STDIO)


CONNECT_COLUMNS = (
    Column("command", lambda row: str(row["label"])),
    *figure_cols("ms", "median", "min", "p90", digits=0),
    col("added ms (median)", "added_ms", 0, when=bridged),
    col("x stdio (median)", "vs_stdio", 2, "x", when=bridged),
    col("RSS MB", "rss_mb"),
    col("peak RSS MB", "hwm_mb"),
    col("RSS x stdio", "rss_vs_stdio", 2, "x", when=bridged),
)


def defaults_outcome(row: Row) -> str:
    if row["outcome"] == "completed":
        return f"{LABELS[row['transport']]} completed in {row['seconds']:.3f} s"
    return f"{LABELS[row['transport']]} {row['outcome']} after {row['received']:,} updates ({row['error'][:300]})"


def render(report: Report) -> list[str]:
    results = results_of(report)
    if not results:
        return []
    out = [
        f"## Remote serving: serve over WebSocket and streamable HTTP/2, and acp-proxy connect ({results['backend']})",
        "",
        "The base of every ratio is the same work over stdio through the proxy; one asynchronous client decodes "
        "every message on each transport. The agent is benchmarks/stream_agent.py.",
        "",
    ]
    if "turns_by" in results:
        out += [
            f"Short turns: session/prompt answered by {results['short_updates']} updates and end_turn, "
            f"{results['turns']:,} per transport after {WARM_UP} untimed, in interleaved blocks of {BLOCK}; "
            "CPU a turn: the proxy (the stdio one, or the connection's), serve and the client, from each process's "
            "CPU clock over the timed turns.",
            "",
            *render_table(TURN_COLUMNS, results["turns_by"]),
            f"Streaming: one turn of {results['updates']:,} updates of 180 B, median of {results['repeat']} run(s), "
            "on a serve with its defaults. CPU: the stdio proxy (or the connection's proxy), serve, and the client "
            "(this process).",
            "",
            *render_table(STREAM_COLUMNS, results["streams_by"]),
        ]
    if "defaults_rows" in results:
        out += [
            "The same streaming turn on a new connection to a serve with its defaults (--max-pending, "
            "--stall-timeout): " + "; ".join(defaults_outcome(row) for row in results["defaults_rows"]) + ".",
            "",
        ]
    if "probe_row" in results:
        probe = results["probe_row"]
        out += [
            f"{probe['requests']:,} requests (_bench/ping) over one streamable HTTP connection, one HTTP/2 "
            "connection under it: "
            + (
                "all answered."
                if probe["error"] is None
                else f"{probe['answered']:,} answered, then: {probe['error'][:300]}."
            ),
            "",
        ]
    if "connect_rows" in results:
        out += [
            f"acp-proxy connect: spawn to the initialize answer, {results['cold_starts']} runs each (interleaved; "
            "through serve, which starts the connection's proxy on it); RSS after initialize, a session and "
            f"{SHORT_UPDATES} short turns.",
            "",
            *render_table(CONNECT_COLUMNS, results["connect_rows"]),
        ]
    if "idle_row" in results:
        idle = results["idle_row"]
        out += [
            f"Idle connections: {idle['connections']} WebSockets that sent nothing, opened in "
            f"{idle['opened_s']:.2f} s: "
            f"serve's RSS {idle['serve_rest_mb']:.1f} MB at rest, {idle['serve_idle_mb']:.1f} MB with them open "
            f"({idle['per_connection_kb']:.0f} KB a connection; {idle['proxies']} proxies started).",
            "",
        ]
    if "sessions_row" in results:
        row = results["sessions_row"]
        out += [
            f"Sessions: {row['sessions']} live sessions over {row['connections']} initialized WebSockets, "
            f"proportional set sizes: serve and its launcher "
            f"{row['serve_mb']:.1f} MB (at rest {row['serve_rest_mb']:.1f}) + its {row['connections']} proxies "
            f"{row['proxies_mb']:.1f} MB (median {row['proxy_median_mb']:.1f}) = {row['total_mb']:.1f} MB, against "
            f"{row['direct_proxies_mb']:.1f} MB for {row['connections']} stdio proxies serving the same sessions "
            f"(median {row['direct_proxy_median_mb']:.1f}): +{row['added_mb']:.1f} MB. The adapters' trees are not "
            "counted.",
            "",
        ]
    return [*out, *left_running(results, " of the remote section")]


SECTION = Section((NAME,), measure, render)
