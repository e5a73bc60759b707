"""The acp-proxy benchmark suite: every figure is a ratio against the same work without the proxy.

    scripts/bench                  full run: 1,000,000 updates (median of 3 runs),
                                   10,000 round trips, 20 cold starts, 20 closes and spawns,
                                   30 resumes, 2,000 prompt turns
    scripts/bench --quick          a fast check: 100,000 updates (1 run), 1,000 round trips,
                                   5 cold starts, 5 closes and spawns, 8 resumes, 200 turns
    scripts/bench --only ownership the process-ownership figures alone
    scripts/bench --only sessions  the session figures alone (resume, memory, registry)
    scripts/bench --only tasks     the task figures alone (per-turn overhead, bookkeeping, writes)
    scripts/bench --only load      200 concurrent sessions over max_live = 8 (--quick: 1 burst each)
    scripts/bench --only install   20 proxies of one session each over one install's max_live = 4, against a
                                   client-side pool of the same work (--quick: 3 bursts each instead of 10)
    scripts/bench --help           every option (--updates N, --round-trips N, --backends ...)

One synchronous client (the kit's ``SyncGateway``, reading raw bytes where a row
counts lines) talks newline-delimited JSON-RPC over pipes to one of these, so that
only the middle differs between rows:

* ``direct``: the client spawns ``benchmarks/stream_agent.py`` itself;
* ``cat``: the agent's stdout goes through a ``cat`` process (a plain byte relay;
  the client's few requests go to the agent directly);
* ``proxy (asyncio)`` / ``proxy (trio)``: ``acp-proxy --async-backend B -- python stream_agent.py``.

Measured: streaming throughput (one ``session/prompt`` answered by N
``session/update`` lines, read by a counting client and by a decoding client),
request latency (``_bench/ping`` round trips), cold start (spawn to the
``initialize`` answer) and the proxy's peak RSS; and what owning an adapter's process
tree costs (closing it, spawning under the wrapper, reaping dead leases at startup:
see ``benchmarks/ownership.py``); and what sessions cost (resuming a suspended
session, the proxy's memory with 1,000 registered sessions, registry operations:
see ``benchmarks/sessions.py``); and what recording every prompt turn as a task
costs (short turns' time, the bookkeeping alone, task writes: see
``benchmarks/tasks.py``); and the pool under load, in one proxy (200 sessions over
``max_live = 8``: ``benchmarks/load.py``) and across the proxies of one install (20
proxies of one session each over ``max_live = 4``, as acpx runs them: throughput,
resumes, cross-proxy eviction latency, peak live adapters, memory per proxy:
``benchmarks/install.py``). The figures are reported, never
asserted: a missed target is printed, it does not fail the run. A run fails only
when a relay loses, reorders or corrupts messages, or a process hangs.

Prints a markdown report and writes ``bench-results/bench.json``. Spawned
interpreters keep their bytecode in ``bench-results/pycache``, as an installed
proxy would have it, even where ``PYTHONDONTWRITEBYTECODE`` is set.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import psutil

from benchmarks import install, load, ownership, sessions, tasks
from benchmarks.common import (
    ROOT,
    BenchError,
    Report,
    attempt,
    child_environment,
    cpu_seconds,
    fmt,
    percentile,
    proc_status_kb,
    progress,
    proxy_mode,
    table,
    verdict,
)
from tests.kit.gateway import GatewayError, SyncGateway

AGENT = ROOT / "benchmarks" / "stream_agent.py"
RESULTS = ROOT / "bench-results" / "bench.json"

READ_SIZE = 1 << 20
LATENCY_WARMUP = 200
RSS_SAMPLE_INTERVAL = 0.05
CLOSE_GRACE = 10.0
INITIALIZE_TIMEOUT = 30.0

TARGET_THROUGHPUT_VS_CAT = 1.5
TARGET_LATENCY_ADDED_US = 100.0
TARGET_COLD_START_ADDED_MS = 80.0
TARGET_RSS_MB = 35.0

MEASUREMENTS = ("throughput", "latency", "cold-start", "ownership", "sessions", "tasks", "load", "install")

DIRECT = "direct"
CAT = "cat"
CLIENTS = ("counting", "decoding")
CLIENT_LABELS = {
    "counting": "counting client (bytes.count of newlines)",
    "decoding": "decoding client (msgspec.json.decode of every line)",
}


@dataclass
class BenchReport(Report):
    """The report, with the session, task, load and install figures (``benchmarks/sessions.py``, ``tasks.py``,
    ``load.py``, ``install.py``)."""

    sessions: dict[str, Any] = field(default_factory=dict)
    tasks: dict[str, Any] = field(default_factory=dict)
    load: dict[str, Any] = field(default_factory=dict)
    install: dict[str, Any] = field(default_factory=dict)


def mode_label(mode: str) -> str:
    if mode.startswith("proxy-"):
        return f"proxy ({mode.removeprefix('proxy-')})"
    return {DIRECT: "direct", CAT: "cat relay"}[mode]


def agent_argv() -> list[str]:
    return [sys.executable, str(AGENT)]


def proxy_argv(backend: str) -> list[str]:
    return [sys.executable, "-m", "acp_proxy", "--async-backend", backend, "--", *agent_argv()]


# --- the client ------------------------------------------------------------------


def open_connection(mode: str) -> SyncGateway:
    """The kit's client over pipes to ``mode``'s processes (their stderr kept for error reports)."""
    common: dict[str, Any] = {"cwd": ROOT, "env": child_environment()}
    options: dict[str, Any] = {"name": mode_label(mode), "read_size": READ_SIZE}
    if mode != CAT:
        argv = agent_argv() if mode == DIRECT else proxy_argv(mode.removeprefix("proxy-"))
        return SyncGateway.launch(argv, **common, **options)
    log = tempfile.TemporaryFile()  # noqa: SIM115 - the connection closes it
    pipes: dict[str, Any] = {"stderr": log, "bufsize": 0, **common}
    agent = subprocess.Popen(agent_argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, **pipes)
    assert agent.stdin is not None
    assert agent.stdout is not None
    try:
        cat = subprocess.Popen(["cat"], stdin=agent.stdout, stdout=subprocess.PIPE, **pipes)
    except OSError:
        agent.kill()
        agent.wait()
        log.close()
        raise
    agent.stdout.close()
    assert cat.stdout is not None
    # The client's few requests go to the agent; everything it says comes through cat.
    return SyncGateway(agent.stdin, cat.stdout, processes=[agent, cat], stderr_file=log, **options)


@dataclass
class Relay:
    """One connection through ``mode`` and every process behind it.

    ``middle`` is the process whose resources are reported: the proxy, ``cat``,
    or (direct) the agent itself. The proxy's adapter runs in a session of its own:
    it is remembered after ``initialize`` so that cleanup reaches it too.
    """

    mode: str
    conn: SyncGateway
    descendants: list[psutil.Process] = field(default_factory=list)
    expired: bool = False

    @property
    def middle(self) -> subprocess.Popen[bytes]:
        return self.conn.processes[-1]

    def initialize(self) -> Any:
        result = self.conn.call("initialize", INITIALIZE_PARAMS, timeout=INITIALIZE_TIMEOUT)
        self._discover_descendants()
        return result

    def _discover_descendants(self) -> None:
        try:
            found = psutil.Process(self.middle.pid).children(recursive=True)
        except psutil.Error:
            return
        known = {p.pid for p in self.descendants}
        self.descendants.extend(p for p in found if p.pid not in known)

    def kill(self) -> None:
        self.conn.kill()
        for process in self.descendants:
            with contextlib.suppress(psutil.Error):
                process.kill()

    @contextlib.contextmanager
    def deadline(self, seconds: float, what: str) -> Iterator[None]:
        """Kill everything if ``what`` takes longer than ``seconds`` (blocked reads then end)."""

        def expire() -> None:
            self.expired = True
            self.kill()

        timer = threading.Timer(seconds, expire)
        timer.daemon = True
        timer.start()
        try:
            yield
        except (BenchError, GatewayError) as exc:
            if self.expired:
                raise BenchError(f"{mode_label(self.mode)}: {what} took over {seconds:.0f} s") from exc
            raise
        finally:
            timer.cancel()

    def close(self) -> None:
        """Close both pipes, wait for every process (killing stragglers)."""
        self._discover_descendants()
        self.conn.close(CLOSE_GRACE)
        for process in self.descendants:
            try:
                process.wait(CLOSE_GRACE)
            except psutil.TimeoutExpired:
                with contextlib.suppress(psutil.Error):
                    process.kill()
            except psutil.Error:
                pass


INITIALIZE_PARAMS = {
    "protocolVersion": 1,
    "clientCapabilities": {"fs": {"readTextFile": False, "writeTextFile": False}, "terminal": False},
    "clientInfo": {"name": "acp-proxy-bench", "version": "1"},
}


@contextlib.contextmanager
def connected(mode: str) -> Iterator[Relay]:
    relay = Relay(mode, open_connection(mode))
    try:
        yield relay
    except BaseException:
        relay.kill()
        raise
    finally:
        relay.close()


def check_response(conn: SyncGateway, line: bytes, request_id: int) -> Any:
    """The result in ``line``, which must be the answer to ``request_id``."""
    try:
        msg = msgspec.json.decode(line)
    except msgspec.DecodeError:
        raise BenchError(f"{conn.name} sent invalid JSON: {line[:200]!r}") from None
    if not isinstance(msg, dict) or msg.get("id") != request_id or "result" not in msg:
        raise BenchError(f"{conn.name}: expected the answer to request {request_id}, got {line[:300]!r}")
    return msg["result"]


# --- resource sampling -------------------------------------------------------------


class RssSampler:
    """The highest RSS of one process, sampled every ``RSS_SAMPLE_INTERVAL`` seconds."""

    def __init__(self, pid: int) -> None:
        self.max_rss = 0
        self._process = psutil.Process(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _sample(self) -> None:
        with contextlib.suppress(psutil.Error):
            self.max_rss = max(self.max_rss, self._process.memory_info().rss)

    def _run(self) -> None:
        while not self._stop.wait(RSS_SAMPLE_INTERVAL):
            self._sample()


def mb(value_bytes: float | None) -> float | None:
    return None if value_bytes is None else value_bytes / (1024 * 1024)


# --- (a) throughput ----------------------------------------------------------------


def receive_counting(conn: SyncGateway, updates: int, prompt_id: int) -> None:
    """Count newlines until all ``updates`` lines and the answer are in; check the answer."""
    expected = updates + 1
    data = conn.take_buffered()
    lines = data.count(b"\n")
    tail = data[-512:]
    while lines < expected:
        chunk = conn.read_chunk()
        lines += chunk.count(b"\n")
        tail = chunk[-512:] if len(chunk) >= 512 else (tail + chunk)[-512:]
    if lines != expected or not tail.endswith(b"\n"):
        raise BenchError(f"{conn.name}: expected {expected} lines, got {lines}+")
    check_prompt_answer(conn, tail[:-1].rsplit(b"\n", 1)[-1], prompt_id)


def receive_decoding(conn: SyncGateway, updates: int, prompt_id: int) -> None:
    """Decode every line to Python objects, as a gateway would, until the prompt's answer."""
    decode = msgspec.json.decode
    pending = conn.take_buffered()
    seen = 0
    answer: Any = None
    while answer is None:
        chunk = conn.read_chunk()
        if pending:
            chunk = pending + chunk
        cut = chunk.rfind(b"\n")
        if cut < 0:
            pending = chunk
            continue
        pending = chunk[cut + 1 :]
        try:
            for line in chunk[:cut].split(b"\n"):
                msg = decode(line)
                if "id" in msg:
                    if answer is not None:
                        raise BenchError(f"{conn.name}: a second answer: {line!r}")
                    answer = msg
                elif msg.get("method") == "session/update" and answer is None:
                    seen += 1
                else:
                    raise BenchError(f"{conn.name}: unexpected line {line[:200]!r}")
        except (msgspec.DecodeError, TypeError) as exc:
            raise BenchError(f"{conn.name}: a line is not a JSON object: {exc}") from None
    if seen != updates or pending:
        raise BenchError(f"{conn.name}: expected {updates} updates, got {seen}")
    check_prompt_answer(conn, msgspec.json.encode(answer), prompt_id)


def check_prompt_answer(conn: SyncGateway, line: bytes, prompt_id: int) -> None:
    try:
        msg = msgspec.json.decode(line)
    except msgspec.DecodeError:
        msg = None
    ok = isinstance(msg, dict) and msg.get("id") == prompt_id and msg.get("result") == {"stopReason": "end_turn"}
    if not ok:
        raise BenchError(f"{conn.name}: the last line is not the answer: {line!r}")


RECEIVERS: dict[str, Callable[[SyncGateway, int, int], None]] = {
    "counting": receive_counting,
    "decoding": receive_decoding,
}


def throughput_run(mode: str, client: str, updates: int, timeout: float) -> dict[str, Any]:
    with connected(mode) as relay, relay.deadline(timeout, f"streaming {updates} updates"):
        relay.initialize()
        conn = relay.conn
        session_id = conn.new_session(str(ROOT))
        rss_at_idle = proc_status_kb(relay.middle.pid, "VmRSS")
        cpu_before = cpu_seconds(relay.middle.pid)
        prompt = {
            "sessionId": session_id,
            "prompt": [{"type": "text", "text": "stream"}],
            "_meta": {"bench": {"updates": updates}},
        }
        prompt_id, data = conn.request_bytes("session/prompt", prompt)
        with RssSampler(relay.middle.pid) as sampler:
            start = time.perf_counter()
            conn.send_raw(data)
            RECEIVERS[client](conn, updates, prompt_id)
            seconds = time.perf_counter() - start
        hwm = proc_status_kb(relay.middle.pid, "VmHWM")
        cpu_after = cpu_seconds(relay.middle.pid)
    cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
    return {
        "seconds": seconds,
        "middle_cpu_s": cpu,
        "middle_peak_rss_mb": None if hwm is None else hwm / 1024,
        "middle_sampled_max_rss_mb": mb(sampler.max_rss),
        "middle_idle_rss_mb": None if rss_at_idle is None else rss_at_idle / 1024,
    }


# --- (b) latency -------------------------------------------------------------------


def latency_run(mode: str, round_trips: int, timeout: float) -> dict[str, Any]:
    samples: list[float] = []
    with connected(mode) as relay, relay.deadline(timeout, f"{round_trips} round trips"):
        relay.initialize()
        conn = relay.conn
        clock = time.perf_counter_ns
        for i in range(LATENCY_WARMUP + round_trips):
            request_id, data = conn.request_bytes("_bench/ping", {})
            start = clock()
            conn.send_raw(data)
            line = conn.read_line()
            elapsed = clock() - start
            check_response(conn, line, request_id)
            if i >= LATENCY_WARMUP:
                samples.append(elapsed / 1000)
    samples.sort()
    return {
        "round_trips": round_trips,
        "p50_us": percentile(samples, 50),
        "p90_us": percentile(samples, 90),
        "p99_us": percentile(samples, 99),
        "mean_us": statistics.fmean(samples),
        "max_us": samples[-1],
    }


# --- (c) cold start ----------------------------------------------------------------


def cold_start_once(mode: str, timeout: float) -> float:
    start = time.perf_counter()
    with connected(mode) as relay, relay.deadline(timeout, "initialize"):
        relay.initialize()
        return (time.perf_counter() - start) * 1000


# --- the run -----------------------------------------------------------------------


def measure_throughput(report: Report, modes: list[str], args: argparse.Namespace) -> None:
    timeout = 60 + args.updates / 10_000
    broken: set[str] = set()  # a relay that failed once is not measured again
    for client in CLIENTS:
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
        # Interleave the modes so that drift on the machine hits them alike.
        for repeat in range(args.repeat):
            for mode in modes:
                if mode in broken:
                    continue
                progress(f"throughput: {client} client, {mode_label(mode)}, run {repeat + 1}/{args.repeat} ...")
                run = attempt(
                    report,
                    f"throughput {client} {mode_label(mode)}",
                    lambda m=mode, c=client: throughput_run(m, c, args.updates, timeout),
                )
                if run is None:
                    broken.add(mode)
                else:
                    runs[mode].append(run)
        for mode in modes:
            if not runs[mode] or mode in broken:
                continue
            seconds = [run["seconds"] for run in runs[mode]]
            median = statistics.median(seconds)

            def worst(key: str, mode_runs: list[dict[str, Any]] = runs[mode]) -> float | None:
                values = [run[key] for run in mode_runs if run[key] is not None]
                return max(values) if values else None

            cpu = [run["middle_cpu_s"] for run in runs[mode] if run["middle_cpu_s"] is not None]
            report.throughput.append(
                {
                    "client": client,
                    "mode": mode,
                    "updates": args.updates,
                    "line_bytes": 180,
                    "seconds": median,
                    "all_seconds": seconds,
                    "lines_per_s": args.updates / median,
                    "mb_per_s": args.updates * 180 / median / 1e6,
                    "middle_cpu_s": statistics.median(cpu) if cpu else None,
                    "middle_peak_rss_mb": worst("middle_peak_rss_mb"),
                    "middle_sampled_max_rss_mb": worst("middle_sampled_max_rss_mb"),
                    "middle_idle_rss_mb": worst("middle_idle_rss_mb"),
                }
            )
    by_key = {(row["client"], row["mode"]): row for row in report.throughput}
    for row in report.throughput:
        direct = by_key.get((row["client"], DIRECT))
        cat = by_key.get((row["client"], CAT))
        row["vs_direct"] = row["seconds"] / direct["seconds"] if direct else None
        row["vs_cat"] = row["seconds"] / cat["seconds"] if cat else None


def measure_latency(report: Report, modes: list[str], args: argparse.Namespace) -> None:
    timeout = 60 + args.round_trips / 200
    for mode in modes:
        progress(f"latency: {mode_label(mode)}, {args.round_trips} round trips ...")
        row = attempt(
            report,
            f"latency {mode_label(mode)}",
            lambda m=mode: latency_run(m, args.round_trips, timeout),
        )
        if row is not None:
            report.latency.append({"mode": mode, **row})
    direct = next((row for row in report.latency if row["mode"] == DIRECT), None)
    for row in report.latency:
        row["added_p50_us"] = row["p50_us"] - direct["p50_us"] if direct else None
        row["added_p99_us"] = row["p99_us"] - direct["p99_us"] if direct else None


def measure_cold_start(report: Report, modes: list[str], args: argparse.Namespace) -> None:
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    progress(f"cold start: {args.cold_starts} x {', '.join(mode_label(m) for m in modes)} ...")
    broken: set[str] = set()
    for mode in modes:  # untimed: fills the bytecode cache, warms the page cache
        if attempt(report, f"cold start {mode_label(mode)}", lambda m=mode: cold_start_once(m, 30)) is None:
            broken.add(mode)
    for _ in range(args.cold_starts):
        for mode in modes:
            if mode in broken:
                continue
            ms = attempt(report, f"cold start {mode_label(mode)}", lambda m=mode: cold_start_once(m, 30))
            if ms is None:
                broken.add(mode)
            else:
                times[mode].append(ms)
    for mode in modes:
        if times[mode] and mode not in broken:
            values = sorted(times[mode])
            report.cold_start.append(
                {
                    "mode": mode,
                    "runs": len(values),
                    "median_ms": statistics.median(values),
                    "min_ms": values[0],
                    "p90_ms": percentile(values, 90),
                    "max_ms": values[-1],
                    "all_ms": times[mode],
                }
            )
    direct = next((row for row in report.cold_start if row["mode"] == DIRECT), None)
    for row in report.cold_start:
        row["added_ms"] = row["median_ms"] - direct["median_ms"] if direct else None


def evaluate_targets(report: BenchReport, backends: list[str]) -> None:
    def target(name: str, value: float | None, limit: float, unit: str) -> None:
        report.targets.append(
            {
                "name": name,
                "value": value,
                "target": limit,
                "unit": unit,
                "met": None if value is None else value <= limit,
            }
        )

    for backend in backends:
        mode = proxy_mode(backend)
        label = mode_label(mode)
        for row in report.throughput:
            if row["mode"] == mode:
                target(
                    f"throughput {label} / cat relay, {row['client']} client",
                    row["vs_cat"],
                    TARGET_THROUGHPUT_VS_CAT,
                    "x",
                )
        for row in report.latency:
            if row["mode"] == mode:
                target(f"latency added p50, {label}", row["added_p50_us"], TARGET_LATENCY_ADDED_US, "us")
        for row in report.cold_start:
            if row["mode"] == mode:
                target(f"cold start added, {label}", row["added_ms"], TARGET_COLD_START_ADDED_MS, "ms")
        peaks = [
            row["middle_peak_rss_mb"]
            for row in report.throughput
            if row["mode"] == mode and row["middle_peak_rss_mb"] is not None
        ]
        if peaks:
            target(f"peak RSS during throughput, {label}", max(peaks), TARGET_RSS_MB, "MB")
    for name, value, limit, unit in ownership.targets(report):
        target(name, value, limit, unit)
    for name, value, limit, unit in sessions.targets(report.sessions):
        target(name, value, limit, unit)


# --- reporting -----------------------------------------------------------------------


def render(report: BenchReport) -> str:
    opts, machine = report.options, report.machine
    out = [
        "# acp-proxy benchmarks",
        "",
        f"Machine: {machine['cpu_model']}, {machine['cpus_usable']} usable cores "
        f"({machine['cpu_count']} online), Linux {machine['kernel']}, "
        f"Python {machine['python']}, msgspec {machine['versions'].get('msgspec')}, "
        f"anyio {machine['versions'].get('anyio')}, trio {machine['versions'].get('trio')}",
        "",
    ]
    if report.throughput:
        out += [
            f"## Throughput: one session/prompt, {opts['updates']:,} session/update lines of 180 B, then the answer",
            "",
            f"Wall time from sending the prompt to receiving its answer; median of "
            f"{opts['repeat']} run(s). Target: proxy <= {TARGET_THROUGHPUT_VS_CAT}x the cat relay. "
            "CPU and peak RSS are the middle process's (for direct: the agent's).",
            "",
        ]
        rows = []
        for row in report.throughput:
            is_proxy = row["mode"].startswith("proxy-")
            rows.append(
                [
                    row["client"],
                    mode_label(row["mode"]),
                    fmt(row["seconds"], 3),
                    fmt(row["lines_per_s"] / 1000, 0, "k"),
                    fmt(row["mb_per_s"], 0),
                    fmt(row["vs_direct"], 2, "x"),
                    fmt(row["vs_cat"], 2, "x"),
                    verdict(row["vs_cat"], TARGET_THROUGHPUT_VS_CAT) if is_proxy else "",
                    fmt(row["middle_cpu_s"], 2),
                    fmt(row["middle_peak_rss_mb"], 1),
                ]
            )
        header = [
            "client",
            "relay",
            "wall s",
            "lines/s",
            "MB/s",
            "vs direct",
            "vs cat",
            f"target <= {TARGET_THROUGHPUT_VS_CAT}x cat",
            "middle CPU s",
            "middle peak RSS MB",
        ]
        out += table(header, rows)
        out += ["", *(f"* {name}: {label}" for name, label in CLIENT_LABELS.items()), ""]
    if report.latency:
        out += [
            f"## Latency: {opts['round_trips']:,} sequential _bench/ping round trips (after {LATENCY_WARMUP} warm-up)",
            "",
        ]
        rows = []
        for row in report.latency:
            is_proxy = row["mode"].startswith("proxy-")
            rows.append(
                [
                    mode_label(row["mode"]),
                    fmt(row["p50_us"], 1),
                    fmt(row["p90_us"], 1),
                    fmt(row["p99_us"], 1),
                    fmt(row["mean_us"], 1),
                    fmt(row["added_p50_us"], 1) if row["mode"] != DIRECT else "",
                    fmt(row["added_p99_us"], 1) if row["mode"] != DIRECT else "",
                    verdict(row["added_p50_us"], TARGET_LATENCY_ADDED_US) if is_proxy else "",
                ]
            )
        header = [
            "relay",
            "p50 us",
            "p90 us",
            "p99 us",
            "mean us",
            "added p50 us",
            "added p99 us",
            f"target added p50 <= {TARGET_LATENCY_ADDED_US:.0f} us",
        ]
        out += table(header, rows)
        out += [""]
    if report.cold_start:
        out += [
            f"## Cold start: spawn to the initialize answer, {opts['cold_starts']} runs each (interleaved)",
            "",
        ]
        rows = []
        for row in report.cold_start:
            is_proxy = row["mode"].startswith("proxy-")
            rows.append(
                [
                    mode_label(row["mode"]),
                    fmt(row["median_ms"], 1),
                    fmt(row["min_ms"], 1),
                    fmt(row["p90_ms"], 1),
                    fmt(row["added_ms"], 1) if row["mode"] != DIRECT else "",
                    verdict(row["added_ms"], TARGET_COLD_START_ADDED_MS) if is_proxy else "",
                ]
            )
        header = [
            "command",
            "median ms",
            "min ms",
            "p90 ms",
            "added ms (median)",
            f"target added <= {TARGET_COLD_START_ADDED_MS:.0f} ms",
        ]
        out += table(header, rows)
        out += [""]
    proxy_rows = [row for row in report.throughput if row["mode"].startswith("proxy-")]
    if proxy_rows:
        out += ["## Proxy memory during the throughput runs", ""]
        rows = []
        for row in proxy_rows:
            rows.append(
                [
                    mode_label(row["mode"]),
                    row["client"],
                    fmt(row["middle_idle_rss_mb"], 1),
                    fmt(row["middle_sampled_max_rss_mb"], 1),
                    fmt(row["middle_peak_rss_mb"], 1),
                    verdict(row["middle_peak_rss_mb"], TARGET_RSS_MB),
                ]
            )
        header = [
            "proxy",
            "client",
            "RSS before the prompt MB",
            f"max sampled RSS MB (every {RSS_SAMPLE_INTERVAL * 1000:.0f} ms)",
            "peak RSS MB (VmHWM)",
            f"target <= {TARGET_RSS_MB:.0f} MB",
        ]
        out += table(header, rows)
        out += [""]
    out += ownership.render(report)
    out += sessions.render(report.sessions)
    out += tasks.render(report.tasks)
    out += load.render(report.load)
    out += install.render(report.install)
    if report.targets:
        out += ["## Targets", ""]
        rows = [
            [
                t["name"],
                fmt(t["value"], 2, " " + t["unit"]),
                f"<= {t['target']:g} {t['unit']}",
                "n/a" if t["met"] is None else ("met" if t["met"] else "MISSED"),
            ]
            for t in report.targets
        ]
        out += table(["figure", "value", "target", "result"], rows)
        out += [""]
    if report.errors:
        counts = Counter(report.errors)
        out += ["## Errors", ""]
        out += [f"* {error}" + (f" ({n} times)" if n > 1 else "") for error, n in counts.items()]
        out += [""]
    return "\n".join(out)


def machine_info() -> dict[str, Any]:
    cpu_model = platform.processor() or "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    versions = {}
    for package in ("acp-proxy", "msgspec", "anyio", "trio", "psutil"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    commit = None
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        commit = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    return {
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "memory_gb": round(psutil.virtual_memory().total / 1e9, 1),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "kernel": platform.release(),
        "platform": platform.platform(),
        "versions": versions,
        "git": commit,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/bench",
        description="Benchmark acp-proxy against the same work without it (direct, cat relay).",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a fast check: 100,000 updates, 1,000 round trips, 5 cold starts, 5 closes and spawns, 3 reapings, "
        "8 resumes, 1 memory run, 2,000 registry operations, 200 prompt turns, 2,000 task writes, "
        "1 burst of turns per load session, 3 per install session",
    )
    parser.add_argument("--updates", type=int, help="session/update lines per prompt (1,000,000)")
    parser.add_argument("--round-trips", type=int, help="latency round trips (10,000)")
    parser.add_argument("--cold-starts", type=int, help="cold starts per command (20)")
    parser.add_argument(
        "--repeat", type=int, help="throughput runs per relay and client, median reported (3; --quick: 1)"
    )
    parser.add_argument(
        "--backends",
        default="asyncio,trio",
        help="proxy event loops to measure, comma-separated (default: asyncio,trio)",
    )
    parser.add_argument("--close-runs", type=int, help="ownership: closes per adapter and runner (20; --quick: 5)")
    parser.add_argument("--spawn-runs", type=int, help="ownership: spawns per runner (20; --quick: 5)")
    parser.add_argument("--reap-runs", type=int, help="ownership: Owner.start runs per state dir (10; --quick: 3)")
    parser.add_argument("--dead-leases", type=int, default=100, help="ownership: dead leases to reap (100)")
    parser.add_argument(
        "--stdin-grace",
        type=float,
        default=0.2,
        help="ownership: stdin grace for the adapter that ignores EOF and SIGTERM, seconds (0.2; "
        "the cooperative one uses the configured defaults)",
    )
    parser.add_argument(
        "--term-grace",
        type=float,
        default=0.5,
        help="ownership: term grace for the adapter that ignores EOF and SIGTERM, seconds (0.5)",
    )
    parser.add_argument("--resumes", type=int, help="sessions: timed resumes per case (30; --quick: 8)")
    parser.add_argument(
        "--replay", type=int, default=100, help="sessions: updates a session/load replays when resuming (100)"
    )
    parser.add_argument("--rss-runs", type=int, help="sessions: proxy memory runs per case (3; --quick: 1)")
    parser.add_argument(
        "--registry-ops", type=int, help="sessions: registry operations per kind (10,000; --quick: 2,000)"
    )
    parser.add_argument("--turns", type=int, help="tasks: timed prompt turns per relay (2,000; --quick: 200)")
    parser.add_argument(
        "--task-ops", type=int, help="tasks: turns recorded in-process, task writes per kind (10,000; --quick: 2,000)"
    )
    parser.add_argument(
        "--min-idle",
        type=float,
        help="load, install: [pool] min_idle for the proxies, seconds (default: the proxy's own, 2 s)",
    )
    parser.add_argument(
        "--only",
        default=",".join(MEASUREMENTS),
        help=f"what to measure, comma-separated (default: {','.join(MEASUREMENTS)})",
    )
    parser.add_argument("--output", type=Path, default=RESULTS, help=f"JSON results (default: {RESULTS})")
    args = parser.parse_args(argv)
    quick = args.quick
    args.updates = args.updates if args.updates is not None else (100_000 if quick else 1_000_000)
    args.round_trips = args.round_trips if args.round_trips is not None else (1_000 if quick else 10_000)
    args.cold_starts = args.cold_starts if args.cold_starts is not None else (5 if quick else 20)
    args.repeat = args.repeat if args.repeat is not None else (1 if quick else 3)
    args.close_runs = args.close_runs if args.close_runs is not None else (5 if quick else 20)
    args.spawn_runs = args.spawn_runs if args.spawn_runs is not None else (5 if quick else 20)
    args.reap_runs = args.reap_runs if args.reap_runs is not None else (3 if quick else 10)
    args.resumes = args.resumes if args.resumes is not None else (8 if quick else 30)
    args.rss_runs = args.rss_runs if args.rss_runs is not None else (1 if quick else 3)
    args.registry_ops = args.registry_ops if args.registry_ops is not None else (2_000 if quick else 10_000)
    args.turns = args.turns if args.turns is not None else (200 if quick else 2_000)
    args.task_ops = args.task_ops if args.task_ops is not None else (2_000 if quick else 10_000)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    args.only = {o.strip() for o in args.only.split(",") if o.strip()}
    for backend in args.backends:
        if backend not in ("asyncio", "trio"):
            parser.error(f"--backends: unknown event loop {backend!r} (asyncio, trio)")
    unknown = args.only - set(MEASUREMENTS)
    if unknown:
        parser.error(f"--only: unknown measurement(s) {', '.join(sorted(unknown))}")
    if min(args.updates, args.round_trips, args.cold_starts, args.repeat) < 1:
        parser.error("--updates, --round-trips, --cold-starts and --repeat must be at least 1")
    if min(args.close_runs, args.spawn_runs, args.reap_runs, args.dead_leases) < 1:
        parser.error("--close-runs, --spawn-runs, --reap-runs and --dead-leases must be at least 1")
    if min(args.resumes, args.rss_runs, args.registry_ops) < 1:
        parser.error("--resumes, --rss-runs and --registry-ops must be at least 1")
    if min(args.turns, args.task_ops) < 1:
        parser.error("--turns and --task-ops must be at least 1")
    if args.min_idle is not None and args.min_idle < 0:
        parser.error("--min-idle must not be negative")
    if args.replay < 0:
        parser.error("--replay must not be negative")
    if min(args.stdin_grace, args.term_grace) < 0:
        parser.error("--stdin-grace and --term-grace must not be negative")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    proxies = [proxy_mode(backend) for backend in args.backends]
    report = BenchReport(
        options={
            "quick": args.quick,
            "updates": args.updates,
            "round_trips": args.round_trips,
            "cold_starts": args.cold_starts,
            "repeat": args.repeat,
            "backends": args.backends,
            "close_runs": args.close_runs,
            "spawn_runs": args.spawn_runs,
            "reap_runs": args.reap_runs,
            "dead_leases": args.dead_leases,
            "stdin_grace": args.stdin_grace,
            "term_grace": args.term_grace,
            "resumes": args.resumes,
            "replay": args.replay,
            "rss_runs": args.rss_runs,
            "registry_ops": args.registry_ops,
            "turns": args.turns,
            "task_ops": args.task_ops,
            "min_idle": args.min_idle,
            "only": sorted(args.only),
        },
        machine=machine_info(),
    )
    started = time.perf_counter()
    if "throughput" in args.only:
        measure_throughput(report, [DIRECT, CAT, *proxies], args)
    if "latency" in args.only:
        measure_latency(report, [DIRECT, CAT, *proxies], args)
    if "cold-start" in args.only:
        measure_cold_start(report, [DIRECT, *proxies], args)
    if "ownership" in args.only:
        ownership.measure_ownership(report, args)
    if "sessions" in args.only:
        report.sessions = sessions.measure_sessions(report, args)
    if "tasks" in args.only:
        report.tasks = tasks.measure_tasks(report, args)
    if "load" in args.only:
        report.load = load.measure_load(report, args)
    if "install" in args.only:
        report.install = install.measure_install(report, args)
    evaluate_targets(report, args.backends)
    report.options["elapsed_s"] = time.perf_counter() - started
    print(render(report), flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report.__dict__, indent=2) + "\n")
    progress(f"wrote {args.output} ({report.options['elapsed_s']:.0f} s)")
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
