"""Streaming benchmarks: the same ACP traffic straight to an agent, through ``cat``, and through the proxy.

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
``initialize`` answer) and the proxy's peak RSS during the throughput runs.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import psutil

from benchmarks import harness
from benchmarks.common import (
    INITIALIZE_PARAMS,
    ROOT,
    BenchError,
    child_environment,
    cpu_seconds,
    figures,
    proc_status_kb,
    proxy_argv,
    script_argv,
)
from benchmarks.harness import (
    DIRECT,
    Case,
    Column,
    Report,
    Row,
    Section,
    Target,
    col,
    figure_cols,
    fmt,
    interleaved,
    minus,
    proxied,
    proxy_mode,
    ratio,
    relayed,
    render_table,
    run_each,
    target_col,
    with_baseline,
)
from tests.kit.gateway import GatewayError, SyncGateway
from tests.kit.proctree import Every

READ_SIZE = 1 << 20
LATENCY_WARMUP = 200
RSS_SAMPLE_INTERVAL = 0.05
CLOSE_GRACE = 10.0
INITIALIZE_TIMEOUT = 30.0
LINE_BYTES = 180

TARGET_THROUGHPUT_VS_CAT = 1.5
TARGET_ROUND_TRIP_VS_DIRECT = 2.0
TARGET_COLD_START_VS_DIRECT = 3.0
TARGET_RSS_BEFORE_PROMPT_MB = 25.0

CAT = "cat"
CLIENTS = ("counting", "decoding")
CLIENT_LABELS = {
    "counting": "counting client (bytes.count of newlines)",
    "decoding": "decoding client (msgspec.json.decode of every line)",
}


def mode_label(mode: str) -> str:
    return harness.mode_label(mode, "cat relay" if mode == CAT else "direct")


def agent_argv() -> list[str]:
    return script_argv("stream_agent.py")


# --- the client ------------------------------------------------------------------


def open_connection(mode: str) -> SyncGateway:
    """The kit's client over pipes to ``mode``'s processes (their stderr kept for error reports)."""
    common: dict[str, Any] = {"cwd": ROOT, "env": child_environment()}
    options: dict[str, Any] = {"name": mode_label(mode), "read_size": READ_SIZE}
    if mode != CAT:
        argv = agent_argv() if mode == DIRECT else proxy_argv(mode.removeprefix("proxy-"), "--", *agent_argv())
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
        self._every = Every(RSS_SAMPLE_INTERVAL, self._sample, "rss")

    def __enter__(self) -> RssSampler:
        self._sample()
        self._every.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._every.__exit__()
        self._sample()

    def _sample(self) -> None:
        with contextlib.suppress(psutil.Error):
            self.max_rss = max(self.max_rss, self._process.memory_info().rss)


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
    return {"round_trips": round_trips, **figures("us", samples, "p50", "p90", "p99", "mean", "max")}


# --- (c) cold start ----------------------------------------------------------------


def cold_start_once(mode: str, timeout: float) -> float:
    start = time.perf_counter()
    with connected(mode) as relay, relay.deadline(timeout, "initialize"):
        relay.initialize()
        return (time.perf_counter() - start) * 1000


# --- the cases -------------------------------------------------------------------------------


def relays(args: argparse.Namespace, *, cat: bool = True) -> list[str]:
    return [DIRECT, *([CAT] if cat else []), *(proxy_mode(backend) for backend in args.backends)]


def measure_throughput(report: Report, args: argparse.Namespace) -> None:
    timeout = 60 + args.updates / 10_000
    modes = relays(args)
    for client in CLIENTS:
        cases = [
            Case(mode, mode_label(mode), functools.partial(throughput_run, mode, client, args.updates, timeout))
            for mode in modes
        ]
        runs = interleaved(report, f"throughput {client} client", cases, args.repeat, warm_up=False)
        modes = [mode for mode in modes if mode in runs]  # a relay that failed is not measured again
        for mode, samples in runs.items():
            report.throughput.append(throughput_row(client, mode, samples, args.updates))
    for client in CLIENTS:
        rows = [row for row in report.throughput if row["client"] == client]
        by_mode = {row["mode"]: row for row in rows}
        with_baseline(rows, by_mode.get(DIRECT), {"vs_direct": ("seconds", ratio)}, base_too=True)
        with_baseline(rows, by_mode.get(CAT), {"vs_cat": ("seconds", ratio)}, base_too=True)


def throughput_row(client: str, mode: str, runs: list[Row], updates: int) -> Row:
    seconds = [run["seconds"] for run in runs]
    median = statistics.median(seconds)

    def worst(key: str) -> float | None:
        values = [run[key] for run in runs if run[key] is not None]
        return max(values) if values else None

    cpu = [run["middle_cpu_s"] for run in runs if run["middle_cpu_s"] is not None]
    return {
        "client": client,
        "mode": mode,
        "updates": updates,
        "line_bytes": LINE_BYTES,
        "seconds": median,
        "all_seconds": seconds,
        "lines_per_s": updates / median,
        "mb_per_s": updates * LINE_BYTES / median / 1e6,
        "middle_cpu_s": statistics.median(cpu) if cpu else None,
        "middle_peak_rss_mb": worst("middle_peak_rss_mb"),
        "middle_sampled_max_rss_mb": worst("middle_sampled_max_rss_mb"),
        "middle_idle_rss_mb": worst("middle_idle_rss_mb"),
    }


def measure_latency(report: Report, args: argparse.Namespace) -> None:
    timeout = 60 + args.round_trips / 200
    cases = [
        Case(mode, mode_label(mode), functools.partial(latency_run, mode, args.round_trips, timeout))
        for mode in relays(args)
    ]
    for mode, row in run_each(report, "latency", cases, f", {args.round_trips} round trips"):
        report.latency.append({"mode": mode, **row})
    direct = next((row for row in report.latency if row["mode"] == DIRECT), None)
    added = {"added_p50_us": ("p50_us", minus), "added_p99_us": ("p99_us", minus), "x_direct_p50": ("p50_us", ratio)}
    with_baseline(report.latency, direct, added, base_too=True)


def measure_cold_start(report: Report, args: argparse.Namespace) -> None:
    modes = relays(args, cat=False)
    cases = [Case(mode, mode_label(mode), functools.partial(cold_start_once, mode, 30)) for mode in modes]
    for mode, times in interleaved(report, "cold start", cases, args.cold_starts).items():
        report.cold_start.append(
            {"mode": mode, "runs": len(times), **figures("ms", times, "median", "min", "p90", "max"), "all_ms": times}
        )
    direct = next((row for row in report.cold_start if row["mode"] == DIRECT), None)
    compared = {"added_ms": ("median_ms", minus), "x_direct": ("median_ms", ratio)}
    with_baseline(report.cold_start, direct, compared, base_too=True)


def measure(report: Report, args: argparse.Namespace) -> None:
    if "throughput" in args.only:
        measure_throughput(report, args)
    if "latency" in args.only:
        measure_latency(report, args)
    if "cold-start" in args.only:
        measure_cold_start(report, args)


def targets(report: Report) -> list[Target]:
    """Each a ratio to the same work without the proxy in this run, or the proxy's own memory."""
    found = []
    for backend in report.options["backends"]:
        mode = proxy_mode(backend)
        label = mode_label(mode)
        for row in report.throughput:
            if row["mode"] == mode:
                runs = row["all_seconds"]
                spread = f", {len(runs)} runs within {spread_of(runs):.0%} of their median" if len(runs) > 1 else ""
                name = f"flood {label} x cat relay, {row['client']} client{spread}"
                found.append(Target(name, row["vs_cat"], TARGET_THROUGHPUT_VS_CAT, "x"))
        for row in report.latency:
            if row["mode"] == mode and (value := row["x_direct_p50"]) is not None:
                found.append(Target(f"round trip p50 {label} x direct", value, TARGET_ROUND_TRIP_VS_DIRECT, "x"))
        for row in report.cold_start:
            if row["mode"] == mode and (value := row["x_direct"]) is not None:
                found.append(Target(f"cold start {label} x direct", value, TARGET_COLD_START_VS_DIRECT, "x"))
        before = [row["middle_idle_rss_mb"] for row in report.throughput if row["mode"] == mode]
        if any(rss is not None for rss in before):
            rss = max(r for r in before if r is not None)
            found.append(Target(f"RSS before the first prompt, {label}", rss, TARGET_RSS_BEFORE_PROMPT_MB, "MB"))
    return found


def spread_of(runs: list[float]) -> float:
    """How far the runs lie from their median, at most (0.1: every run within 10 %)."""
    middle = statistics.median(runs)
    return max(abs(run - middle) for run in runs) / middle if middle else 0.0


# --- reporting -------------------------------------------------------------------------------


def label(row: Row) -> str:
    return mode_label(row["mode"])


THROUGHPUT_COLUMNS = (
    Column("client", lambda row: str(row["client"])),
    Column("relay", label),
    col("wall s", "seconds", 3),
    Column("lines/s", lambda row: fmt(row["lines_per_s"] / 1000, 0, "k")),
    col("MB/s", "mb_per_s", 0),
    col("vs direct", "vs_direct", 2, "x"),
    col("vs cat", "vs_cat", 2, "x"),
    target_col(f"target <= {TARGET_THROUGHPUT_VS_CAT}x cat", "vs_cat", TARGET_THROUGHPUT_VS_CAT, when=proxied),
    col("middle CPU s", "middle_cpu_s", 2),
    col("middle peak RSS MB", "middle_peak_rss_mb", 1),
)
LATENCY_COLUMNS = (
    Column("relay", label),
    *figure_cols("us", "p50", "p90", "p99", "mean"),
    *figure_cols("us", "added_p50", "added_p99", when=relayed),
    col("x direct (p50)", "x_direct_p50", 2, "x", when=relayed),
    target_col(
        f"target <= {TARGET_ROUND_TRIP_VS_DIRECT:g}x direct", "x_direct_p50", TARGET_ROUND_TRIP_VS_DIRECT, when=proxied
    ),
)
COLD_START_COLUMNS = (
    Column("command", label),
    *figure_cols("ms", "median", "min", "p90"),
    col("added ms (median)", "added_ms", when=relayed),
    col("x direct (median)", "x_direct", 2, "x", when=relayed),
    target_col(
        f"target <= {TARGET_COLD_START_VS_DIRECT:g}x direct", "x_direct", TARGET_COLD_START_VS_DIRECT, when=proxied
    ),
)
MEMORY_COLUMNS = (
    Column("proxy", label),
    Column("client", lambda row: str(row["client"])),
    col("RSS before the prompt MB", "middle_idle_rss_mb"),
    col(f"max sampled RSS MB (every {RSS_SAMPLE_INTERVAL * 1000:.0f} ms)", "middle_sampled_max_rss_mb"),
    col("peak RSS MB (VmHWM)", "middle_peak_rss_mb"),
    target_col(
        f"target before the prompt <= {TARGET_RSS_BEFORE_PROMPT_MB:.0f} MB",
        "middle_idle_rss_mb",
        TARGET_RSS_BEFORE_PROMPT_MB,
    ),
)


def render(report: Report) -> list[str]:
    opts = report.options
    out: list[str] = []
    if report.throughput:
        out += [
            f"## Throughput: one session/prompt, {opts['updates']:,} session/update lines of {LINE_BYTES} B, "
            "then the answer",
            "",
            f"Wall time from sending the prompt to receiving its answer; median of "
            f"{opts['repeat']} run(s). Target: proxy <= {TARGET_THROUGHPUT_VS_CAT}x the cat relay. "
            "CPU and peak RSS are the middle process's (for direct: the agent's).",
            "",
            *render_table(THROUGHPUT_COLUMNS, report.throughput),
            *(f"* {name}: {text}" for name, text in CLIENT_LABELS.items()),
            "",
        ]
    if report.latency:
        out += [
            f"## Latency: {opts['round_trips']:,} sequential _bench/ping round trips (after {LATENCY_WARMUP} warm-up)",
            "",
            *render_table(LATENCY_COLUMNS, report.latency),
        ]
    if report.cold_start:
        out += [
            f"## Cold start: spawn to the initialize answer, {opts['cold_starts']} runs each (interleaved)",
            "",
            *render_table(COLD_START_COLUMNS, report.cold_start),
        ]
    proxy_rows = [row for row in report.throughput if proxied(row)]
    if proxy_rows:
        out += ["## Proxy memory during the throughput runs", "", *render_table(MEMORY_COLUMNS, proxy_rows)]
    return out


SECTION = Section(("throughput", "latency", "cold-start"), measure, render, targets)
