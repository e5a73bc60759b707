"""Shared sessions: what the transcript, an attached observer and an attached controller cost.

A session opened through one proxy (the *holder*) can be attached from another proxy of the same
install (``session/attach`` sent to that proxy, which asks the holder over its control socket);
every proxy also keeps a transcript of what its gateway saw (``[attach] transcript_max_bytes``,
default 2 MiB, 0: none). Measured on each event loop of the run (``--backends``), in one run each,
every figure against the same work in the same rounds:

* *the transcript on the streaming path*: one ``session/prompt`` streaming ``--attach-updates``
  updates of 180 B (``benchmarks/stream_agent.py``) to a counting client through a proxy with the
  default transcript, against a proxy with ``transcript_max_bytes = 0`` (an install each, or the
  second would rename its agent's session, which has the same id); both proxies stay up and take
  turns (``--attach-rounds`` rounds after one untimed turn each), each turn followed by
  ``FLUSH_WAIT`` so that the transcript's write of it lands inside the proxy's CPU figure and never
  inside the other proxy's turn. Beside it, the record call itself in this process
  (``Transcripts.record``, no flush): microseconds per call for a block of lines and for one line;
* *fan-out*: the same streaming turn on the holder's gateway with an observer attached through a
  second proxy (``historyPolicy: "none"``), against the same turn with nobody attached (the
  observer detaches between rounds; both proxies stay up); and the observer's own receive time:
  from sending the prompt until it has all the updates, against the gateway's (one thread reads
  each, in this process);
* *answering a permission request*: a turn of ``tests/fake_adapter.py`` whose prompt is
  ``permission`` (the agent asks ``session/request_permission`` with option ``allow``, then ends
  the turn), ``--attach-round-trips`` turns per case, in interleaved blocks of ``BLOCK``: answered
  by the holder's gateway with nobody attached (the base), by the gateway with a controller
  attached (whose copy is withdrawn), and by the controller attached through the second proxy
  (the gateway's copy is withdrawn). Each turn's time from the prompt to its answer at the
  gateway, split at the moment the answering client got the request.

The targets are on throughput kept (with / without): at least ``TARGET_TRANSCRIPT`` with the
transcript, at least ``TARGET_FANOUT`` with an observer attached; they are stated as the share of
throughput lost (at most 5 %, 20 %), since a target is a most. The observer's pace and the
answer's latency have none: they are reported. Every process carries the section's marker; one
left at the end fails the run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import anyio

from acp_proxy.sessions.transcript import EntryKind, Transcripts
from benchmarks.common import ROOT, BenchError, cpu_seconds, figures, proxy_argv, script_argv
from benchmarks.harness import (
    IO_TIMEOUT,
    Column,
    Connected,
    Report,
    Row,
    Section,
    Target,
    attempt,
    call,
    col,
    figure_cols,
    fmt,
    isolated,
    left_running,
    progress,
    render_table,
    standing_rounds,
)
from tests.kit.gateway import SyncGateway

NAME: Final = "attach"
TARGET_TRANSCRIPT: Final = 0.95
"""Throughput with the default transcript / without one: at least this."""
TARGET_FANOUT: Final = 0.80
"""The holder's gateway's throughput with one observer attached / with nobody attached: at least this."""
WARM_UP_UPDATES: Final = 1_000
FLUSH_WAIT: Final = 1.3
"""Seconds after each streaming turn: the transcript's flush (every second) of it is over before the next."""
BLOCK: Final = 25
"""Permission turns of one case in a row before the next case's."""
WARM_UP_TURNS: Final = 5
READ_SIZE: Final = 1 << 20
LINE_BYTES: Final = 180
RECORD_CALLS: Final = 200_000
RECORD_BLOCK_LINES: Final = 364
"""Lines in a block of the in-process record figure: about what one 64 KiB read of the agent's pipe holds."""
ALLOW: Final = {"outcome": {"outcome": "selected", "optionId": "allow"}}

ON, OFF = "on", "off"
NOBODY, OBSERVER = "nobody", "observer"
GATEWAY, GATEWAY_SHARED, CONTROLLER = "gateway", "gateway-shared", "controller"
ANSWER_LABELS: Final = {
    GATEWAY: "the gateway, nobody attached",
    GATEWAY_SHARED: "the gateway, a controller attached",
    CONTROLLER: "the controller, through a second proxy",
}


def results_of(report: Report) -> dict[str, Any]:
    """This section's results: ``bench.json``'s ``attach``, an entry of the report's own (``bench.json`` is
    ``vars(report)``)."""
    results: dict[str, Any] = vars(report).setdefault(NAME, {})
    return results


# --- configs, processes, a turn ------------------------------------------------------------------


def write_config(path: Path, agent: list[str], transcript: str | None = None) -> Path:
    """One backend ``bench`` running ``agent``; ``transcript``: ``[attach] transcript_max_bytes`` if given."""
    text = f'default_backend = "bench"\n[pool]\nmax_live = 8\n[backends.bench]\ncommand = {json.dumps(agent)}\n'
    if transcript is not None:
        text += f"[attach]\ntranscript_max_bytes = {transcript}\n"
    path.write_text(text)
    return path


def ask_agent() -> list[str]:
    """The tests' fake adapter: its prompt ``permission`` asks ``session/request_permission``."""
    return [sys.executable, str(ROOT / "tests" / "fake_adapter.py"), "{}"]


def prompt_params(session_id: str, updates: int) -> dict[str, Any]:
    return {
        "sessionId": session_id,
        "prompt": [{"type": "text", "text": "stream"}],
        "_meta": {"bench": {"updates": updates}},
    }


def new_session(conn: SyncGateway) -> str:
    result, _ = call(conn, "session/new", {"cwd": str(ROOT), "mcpServers": []})
    return str(result["sessionId"])


class Proxy(Connected):
    """A stdio proxy of the install, its gateway this process."""

    def __init__(self, label: str, argv: list[str], env: dict[str, str]) -> None:
        super().__init__()
        self.label = label
        self.argv = argv
        self.env = env

    def start(self) -> SyncGateway:
        self.connect(self.argv, self.env)
        self.conn.read_size = READ_SIZE
        return self.conn

    def cpu(self) -> float:
        seconds = cpu_seconds(self.conn.pid)
        if seconds is None:
            raise BenchError(f"{self.label}: its CPU time could not be read")
        return seconds

    def attach(self, session_id: str, role: str) -> None:
        params = {
            "sessionId": session_id,
            "role": role,
            "historyPolicy": "none",
            "clientInfo": {"name": f"bench-{role}", "version": "1"},
        }
        result, _ = call(self.conn, "session/attach", params)
        if result.get("role") != role:
            raise BenchError(f"{self.label}: attached as {result.get('role')!r}, not {role}")

    def detach(self, session_id: str) -> None:
        """``session/detach``; what came before its answer (the last turn's tail) is dropped."""
        try:
            self.conn.call("session/detach", {"sessionId": session_id}, timeout=IO_TIMEOUT)
        finally:
            self.conn.clear_stash()


def count_lines(conn: SyncGateway, expected: int, deadline: float) -> bytes:
    """Read until ``expected`` lines have come (one more is an error); the last line, without its newline."""
    data = conn.take_buffered()
    lines = data.count(b"\n")
    tail = data[-512:]
    while lines < expected:
        left = deadline - time.monotonic()
        if left <= 0:
            raise BenchError(f"{conn.name}: {lines:,} of {expected:,} lines before the deadline")
        chunk = conn.read_chunk(left)
        lines += chunk.count(b"\n")
        tail = (tail + chunk)[-512:]
    if lines != expected or not tail.endswith(b"\n"):
        raise BenchError(f"{conn.name}: expected {expected:,} lines, got {lines:,}+")
    return tail[:-1].rsplit(b"\n", 1)[-1]


def check_answer(conn: SyncGateway, line: bytes, prompt_id: int) -> None:
    try:
        msg = json.loads(line)
    except ValueError:
        msg = None
    if not (isinstance(msg, dict) and msg.get("id") == prompt_id and msg.get("result") == {"stopReason": "end_turn"}):
        raise BenchError(f"{conn.name}: the last line is not the prompt's answer: {line[:300]!r}")


def turn_deadline(updates: int) -> float:
    return time.monotonic() + IO_TIMEOUT + updates / 5_000


def stream_turn(conn: SyncGateway, session_id: str, updates: int) -> float:
    """One prompt streaming ``updates`` updates, counted: seconds from sending it to its answer."""
    prompt_id, data = conn.request_bytes("session/prompt", prompt_params(session_id, updates))
    deadline = turn_deadline(updates)
    start = time.perf_counter()
    conn.send_raw(data)
    last = count_lines(conn, updates + 1, deadline)
    seconds = time.perf_counter() - start
    check_answer(conn, last, prompt_id)
    return seconds


# --- 1. the transcript on the streaming path ---------------------------------------------------


class Streaming(Proxy):
    """A ``Standing`` case: one proxy and a session, a streaming turn per sample (then ``FLUSH_WAIT``)."""

    def __init__(self, key: str, label: str, argv: list[str], env: dict[str, str], updates: int) -> None:
        super().__init__(label, argv, env)
        self.key = key
        self.updates = updates
        self.session_id = ""
        self.cpu_s: list[float] = []

    def open(self) -> object:
        conn = self.start()
        self.session_id = new_session(conn)
        stream_turn(conn, self.session_id, WARM_UP_UPDATES)
        time.sleep(FLUSH_WAIT)
        return True

    def sample(self, count: int) -> list[float]:
        out = []
        for _ in range(count):
            before = self.cpu()
            out.append(stream_turn(self.conn, self.session_id, self.updates))
            time.sleep(FLUSH_WAIT)
            self.cpu_s.append(self.cpu() - before)
        return out

    def finish(self) -> object:
        self.disconnect()
        return True


def measure_transcript(bench: Bench, backend: str) -> Row | None:
    updates, rounds = bench.args.attach_updates, bench.args.attach_rounds
    configs = {
        ON: write_config(bench.dir / "transcript-on.toml", script_argv("stream_agent.py")),
        OFF: write_config(bench.dir / "transcript-off.toml", script_argv("stream_agent.py"), "0"),
    }
    labels = {ON: "transcript on (default 2M)", OFF: "transcript off (0)"}
    # An install each: neither case's state (its transcripts) weighs on the other's.
    cases = [
        Streaming(
            key,
            f"{labels[key]} ({backend})",
            proxy_argv(backend, "--config", str(path)),
            {**bench.env, "ACP_PROXY_STATE_DIR": str(bench.dir / f"state-transcript-{key}")},
            updates,
        )
        for key, path in configs.items()
    ]
    done = standing_rounds(bench.report, f"{NAME}: transcript, {updates:,} updates ({backend})", cases, [1] * rounds)
    by = {case.key: (case, samples) for case, samples in done}
    if len(by) != 2:
        return None
    (on, on_s), (off, off_s) = by[ON], by[OFF]
    with_s, without_s = statistics.median(on_s), statistics.median(off_s)
    return {
        "backend": backend,
        "updates": updates,
        "rounds": rounds,
        "with_s": with_s,
        "without_s": without_s,
        "all_with_s": on_s,
        "all_without_s": off_s,
        "with_updates_per_s": updates / with_s,
        "without_updates_per_s": updates / without_s,
        "ratio": without_s / with_s,
        "with_cpu_s": statistics.median(on.cpu_s),
        "without_cpu_s": statistics.median(off.cpu_s),
    }


def record_figures(updates: int) -> dict[str, Any]:
    """``Transcripts`` in this process. ``record``: ``RECORD_CALLS`` calls each (no flush between them) of a
    block of lines (as the proxy records what it reads in one go) and of a single line, 2 MiB kept and none;
    the mean and the longest call (each call timed, the timer included). ``flush``: what writing one
    turn of ``updates`` updates (recorded in blocks) costs, wall and CPU (its worker thread's), the
    database already made by a first flush."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="acp-proxy-bench-transcript-") as name:
        for what, size in (("a block of 364 lines", LINE_BYTES * RECORD_BLOCK_LINES), ("one line", LINE_BYTES)):
            data = b"x" * (size - 1) + b"\n"
            row: Row = {"what": what, "bytes": size, "calls": RECORD_CALLS}
            for key, limit in ((ON, 2 * 1024 * 1024), (OFF, 0)):
                record = Transcripts(Path(name), limit).record
                clock = time.perf_counter
                total = longest = 0.0
                for _ in range(RECORD_CALLS):
                    began = clock()
                    record("bench", EntryKind.UPDATE, data)
                    took = clock() - began
                    total += took
                    longest = max(longest, took)
                row[f"{key}_us"] = total / RECORD_CALLS * 1e6
                row[f"{key}_max_ms"] = longest * 1e3
            rows.append(row)
        transcripts = Transcripts(Path(name), 2 * 1024 * 1024)
        block = (b"x" * (LINE_BYTES - 1) + b"\n") * RECORD_BLOCK_LINES

        def turn() -> None:
            for _ in range(max(1, updates // RECORD_BLOCK_LINES)):
                transcripts.record("turn", EntryKind.UPDATE, block)

        turn()
        anyio.run(transcripts.flush)  # makes the database
        turn()
        began, cpu = time.perf_counter(), process_cpu()
        anyio.run(transcripts.flush)
        flush = {"updates": updates, "wall_ms": (time.perf_counter() - began) * 1e3}
        flush["cpu_ms"] = (process_cpu() - cpu) * 1e3
        transcripts.close()
    return {"record_rows": rows, "flush_row": flush}


def process_cpu() -> float:
    """This process's CPU seconds so far, all its threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# --- 2. fan-out to an observer ----------------------------------------------------------------------


class Observer(threading.Thread):
    """Counts the updates an attached client gets, until all have come: when, or what went wrong."""

    def __init__(self, conn: SyncGateway, updates: int, deadline: float) -> None:
        super().__init__(daemon=True, name="observer")
        self.conn = conn
        self.updates = updates
        self.deadline = deadline
        self.done_at: float | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            last = count_lines(self.conn, self.updates, self.deadline)
            self.done_at = time.perf_counter()
            if b'"agent_message_chunk"' not in last:
                raise BenchError(f"{self.conn.name}: the last line is not an update: {last[:300]!r}")
        except BaseException as exc:  # reported by the main thread
            self.error = exc

    def seconds_since(self, start: float) -> float:
        self.join(max(0.0, self.deadline - time.monotonic()) + 1)
        if self.is_alive():
            raise BenchError(f"{self.conn.name}: the observer's updates did not all come in time")
        if self.error is not None:
            raise BenchError(f"{self.conn.name}: {self.error}") from self.error
        assert self.done_at is not None
        return self.done_at - start


@dataclass
class Pair:
    """The holder (its gateway opened the session) and the second proxy of the install, to attach with."""

    holder: Proxy
    other: Proxy
    session_id: str = ""

    @contextlib.contextmanager
    def running(self) -> Iterator[Pair]:
        """Both started (a session opened on the holder); at the end both closed, or killed where they failed."""
        try:
            self.session_id = new_session(self.holder.start())
            self.other.start()
            yield self
            self.other.disconnect()
            self.holder.disconnect()
        finally:
            self.other.kill()  # nothing left to kill once disconnected
            self.holder.kill()


def pair(bench: Bench, backend: str, config: Path) -> Pair:
    argv = proxy_argv(backend, "--config", str(config))
    return Pair(Proxy(f"holder ({backend})", argv, bench.env), Proxy(f"second proxy ({backend})", argv, bench.env))


def fanout_sample(proxies: Pair, updates: int, observed: bool) -> Row:
    holder, other = proxies.holder, proxies.other
    session_id = proxies.session_id
    if observed:
        other.attach(session_id, "observer")
    prompt_id, data = holder.conn.request_bytes("session/prompt", prompt_params(session_id, updates))
    deadline = turn_deadline(updates)
    cpu = (holder.cpu(), other.cpu())
    observer = Observer(other.conn, updates, deadline) if observed else None
    if observer is not None:
        observer.start()
    start = time.perf_counter()
    holder.conn.send_raw(data)
    last = count_lines(holder.conn, updates + 1, deadline)
    seconds = time.perf_counter() - start
    check_answer(holder.conn, last, prompt_id)
    observer_s = observer.seconds_since(start) if observer is not None else None
    time.sleep(FLUSH_WAIT)
    row = {"seconds": seconds, "observer_s": observer_s, "holder_cpu_s": holder.cpu() - cpu[0]}
    row["other_cpu_s"] = other.cpu() - cpu[1]
    if observed:
        other.detach(session_id)
    return row


def measure_fanout(bench: Bench, backend: str) -> Row | None:
    updates, rounds = bench.args.attach_updates, bench.args.attach_rounds
    config = write_config(bench.dir / "stream.toml", script_argv("stream_agent.py"))
    samples: dict[str, list[Row]] = {NOBODY: [], OBSERVER: []}

    def run() -> bool:
        with pair(bench, backend, config).running() as proxies:
            stream_turn(proxies.holder.conn, proxies.session_id, WARM_UP_UPDATES)
            for observed in (False, True):
                fanout_sample(proxies, WARM_UP_UPDATES, observed)
            for index in range(rounds):
                progress(f"{NAME}: fan-out ({backend}), round {index + 1}/{rounds} ...")
                for key in (NOBODY, OBSERVER):
                    samples[key].append(fanout_sample(proxies, updates, key == OBSERVER))
        return True

    if attempt(bench.report, f"{NAME} fan-out ({backend})", run) is None:
        return None
    nobody, observer = samples[NOBODY], samples[OBSERVER]
    alone_s = statistics.median(s["seconds"] for s in nobody)
    shared_s = statistics.median(s["seconds"] for s in observer)
    observer_s = statistics.median(s["observer_s"] for s in observer)
    return {
        "backend": backend,
        "updates": updates,
        "rounds": rounds,
        "alone_s": alone_s,
        "shared_s": shared_s,
        "observer_s": observer_s,
        "all_alone_s": [s["seconds"] for s in nobody],
        "all_shared_s": [s["seconds"] for s in observer],
        "all_observer_s": [s["observer_s"] for s in observer],
        "ratio": alone_s / shared_s,
        "observer_ratio": shared_s / observer_s,
        "observer_updates_per_s": updates / observer_s,
        "alone_holder_cpu_s": statistics.median(s["holder_cpu_s"] for s in nobody),
        "shared_holder_cpu_s": statistics.median(s["holder_cpu_s"] for s in observer),
        "other_cpu_s": statistics.median(s["other_cpu_s"] for s in observer),
    }


# --- 3. answering a permission request ----------------------------------------------------------------


def is_method(method: str) -> Callable[[dict[str, Any]], bool]:
    return lambda msg: msg.get("method") == method


def granted(msg: dict[str, Any]) -> bool:
    update = msg.get("params", {}).get("update", {}) if msg.get("method") == "session/update" else {}
    return bool(update.get("content", {}).get("text") == "permission granted")


def permission_turn(proxies: Pair, mode: str) -> tuple[float, float]:
    """One turn whose agent asks a permission, answered by ``mode``'s client: (seconds to the request at
    the answering client, seconds from then to the prompt's answer at the gateway)."""
    gateway, other = proxies.holder.conn, proxies.other.conn
    answering = other if mode == CONTROLLER else gateway
    params = {"sessionId": proxies.session_id, "prompt": [{"type": "text", "text": "permission"}]}
    start = time.perf_counter()
    prompt_id = gateway.send_request("session/prompt", params)
    ask = answering.expect(is_method("session/request_permission"), IO_TIMEOUT)
    asked = time.perf_counter()
    answering.send({"jsonrpc": "2.0", "id": ask["id"], "result": ALLOW})
    answer = gateway.answer(prompt_id, IO_TIMEOUT)
    ended = time.perf_counter()
    if answer.get("result") != {"stopReason": "end_turn"}:
        raise BenchError(f"{gateway.name}: the permission turn ended {str(answer)[:300]}")
    if mode != GATEWAY:  # the other client's copy is withdrawn; the controller sees the turn to its end
        if mode == CONTROLLER:
            gateway.expect(is_method("$/cancel_request"), IO_TIMEOUT)
        else:
            other.expect(is_method("$/cancel_request"), IO_TIMEOUT)
        other.expect(granted, IO_TIMEOUT)
    gateway.clear_stash()
    other.clear_stash()
    return asked - start, ended - asked


def measure_answers(bench: Bench, backend: str) -> list[Row]:
    turns = bench.args.attach_round_trips
    config = write_config(bench.dir / "ask.toml", ask_agent())
    samples: dict[str, list[tuple[float, float]]] = {mode: [] for mode in ANSWER_LABELS}

    def block(proxies: Pair, count: int, keep: bool) -> None:
        for mode in ANSWER_LABELS:
            if mode == GATEWAY_SHARED:
                proxies.other.attach(proxies.session_id, "controller")
            taken = [permission_turn(proxies, mode) for _ in range(count)]
            if keep:
                samples[mode] += taken
            if mode == CONTROLLER:
                proxies.other.detach(proxies.session_id)

    def run() -> bool:
        with pair(bench, backend, config).running() as proxies:
            block(proxies, WARM_UP_TURNS, keep=False)
            blocks = -(-turns // BLOCK)
            for index in range(blocks):
                if index % 4 == 0:
                    progress(f"{NAME}: permission turns ({backend}), block {index + 1}/{blocks} ...")
                block(proxies, min(BLOCK, turns - index * BLOCK), keep=True)
        return True

    if attempt(bench.report, f"{NAME} permission turns ({backend})", run) is None:
        return []
    rows: list[Row] = []
    for mode, taken in samples.items():
        whole = [(asked + rest) * 1e6 for asked, rest in taken]
        rows.append(
            {
                "backend": backend,
                "mode": mode,
                "turns": len(taken),
                **figures("us", whole, "p50", "p95", "mean"),
                **{f"ask_{k}": v for k, v in figures("us", [a * 1e6 for a, _ in taken], "p50", "p95").items()},
                **{f"answer_{k}": v for k, v in figures("us", [r * 1e6 for _, r in taken], "p50", "p95").items()},
            }
        )
    base = rows[0]
    for row in rows:
        for key in ("p50_us", "p95_us", "answer_p50_us", "answer_p95_us"):
            row[f"x_{key}"] = row[key] / base[key]
    return rows


# --- the section -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bench:
    """What one backend's parts run with: the run's options, a state dir of their own, where configs go."""

    report: Report
    args: argparse.Namespace
    env: dict[str, str]
    dir: Path


def measure(report: Report, args: argparse.Namespace) -> None:
    results = results_of(report)
    results.update(
        backends=list(args.backends),
        updates=args.attach_updates,
        rounds=args.attach_rounds,
        round_trips=args.attach_round_trips,
        block=BLOCK,
        load_average=os.getloadavg(),
        cpus=len(os.sched_getaffinity(0)),
        transcript_rows=[],
        fanout_rows=[],
        answer_rows=[],
    )
    progress(f"{NAME}: Transcripts.record in this process, {RECORD_CALLS:,} calls each ...")
    results.update(record_figures(args.attach_updates))
    with isolated(report, NAME, results) as run:
        for backend in args.backends:
            workdir = run.workdir / backend
            workdir.mkdir()
            env = {**run.env, "ACP_PROXY_STATE_DIR": str(workdir / "state")}
            bench = Bench(report, args, env, workdir)
            progress(f"{NAME}: transcript on and off ({backend}) ...")
            if (row := measure_transcript(bench, backend)) is not None:
                results["transcript_rows"].append(row)
            progress(f"{NAME}: an observer attached, and nobody ({backend}) ...")
            if (row := measure_fanout(bench, backend)) is not None:
                results["fanout_rows"].append(row)
            progress(f"{NAME}: permission requests answered by the gateway and by a controller ({backend}) ...")
            results["answer_rows"] += measure_answers(bench, backend)


def lost_pct(ratio: float) -> float:
    return (1 - ratio) * 100


def targets(report: Report) -> list[Target]:
    results = results_of(report)
    found = []
    for row in results.get("transcript_rows", []):
        name = f"attach: throughput lost to the transcript ({row['backend']})"
        found.append(Target(name, lost_pct(row["ratio"]), lost_pct(TARGET_TRANSCRIPT), "%"))
    for row in results.get("fanout_rows", []):
        name = f"attach: gateway throughput lost with an observer attached ({row['backend']})"
        found.append(Target(name, lost_pct(row["ratio"]), lost_pct(TARGET_FANOUT), "%"))
    return found


# --- rendering -------------------------------------------------------------------------------------------


def at_least(key: str, limit: float) -> Column:
    """Whether each row's ``key`` is at least ``limit`` (a target here is a least)."""

    def cell(row: Row) -> str:
        value = row[key]
        return "" if value is None else ("met" if value >= limit else "MISSED")

    return Column(f"target >= {limit:.2f}x", cell)


TRANSCRIPT_COLUMNS = (
    Column("backend", lambda row: str(row["backend"])),
    col("with s", "with_s", 3),
    col("without s", "without_s", 3),
    Column("with updates/s", lambda row: fmt(row["with_updates_per_s"] / 1000, 1, "k")),
    col("throughput with / without", "ratio", 3, "x"),
    at_least("ratio", TARGET_TRANSCRIPT),
    col("proxy CPU s with (incl. flush)", "with_cpu_s", 2),
    col("proxy CPU s without", "without_cpu_s", 2),
)
RECORD_COLUMNS = (
    Column("recorded", lambda row: f"{row['what']} ({row['bytes']:,} B)"),
    Column("calls", lambda row: f"{row['calls']:,}"),
    col("us/call, 2 MiB kept", "on_us", 2),
    col("longest call ms, 2 MiB kept", "on_max_ms", 2),
    col("us/call, transcript off", "off_us", 2),
    col("longest call ms, off", "off_max_ms", 2),
)
FANOUT_COLUMNS = (
    Column("backend", lambda row: str(row["backend"])),
    col("gateway s, nobody attached", "alone_s", 3),
    col("gateway s, observer attached", "shared_s", 3),
    col("gateway throughput attached / alone", "ratio", 3, "x"),
    at_least("ratio", TARGET_FANOUT),
    col("observer s", "observer_s", 3),
    Column("observer updates/s", lambda row: fmt(row["observer_updates_per_s"] / 1000, 1, "k")),
    col("observer / gateway throughput", "observer_ratio", 3, "x"),
    col("holder CPU s alone / attached", "alone_holder_cpu_s", 2),
    col("(attached)", "shared_holder_cpu_s", 2),
    col("second proxy CPU s", "other_cpu_s", 2),
)


def based(row: Row) -> bool:
    return bool(row["mode"] != GATEWAY)


ANSWER_COLUMNS = (
    Column("backend", lambda row: str(row["backend"])),
    Column("answered by", lambda row: ANSWER_LABELS[row["mode"]]),
    Column("turns", lambda row: f"{row['turns']:,}"),
    *figure_cols("us", "p50", "p95", digits=0),
    col("x p50", "x_p50_us", 2, "x", when=based),
    col("x p95", "x_p95_us", 2, "x", when=based),
    *figure_cols("us", "ask_p50", "answer_p50", "answer_p95", digits=0),
    col("x answer p50", "x_answer_p50_us", 2, "x", when=based),
)


def render(report: Report) -> list[str]:
    results = results_of(report)
    if not results:
        return []
    load = ", ".join(f"{value:.2f}" for value in results["load_average"])
    out = [
        "## Shared sessions: the transcript, an observer, a controller's answers",
        "",
        f"Load average at the start: {load} ({results['cpus']} usable cores). Streaming: one session/prompt of "
        f"{results['updates']:,} updates of {LINE_BYTES} B (benchmarks/stream_agent.py) to a counting client, "
        f"median of {results['rounds']} interleaved rounds, {FLUSH_WAIT:g} s after each turn (the transcript's "
        "flush of it is in the proxy's CPU).",
        "",
    ]
    if results["transcript_rows"]:
        out += [
            "The transcript on the streaming path: the default transcript_max_bytes (2 MiB) against 0, two "
            "proxies (an install each) taking turns.",
            "",
            *render_table(TRANSCRIPT_COLUMNS, results["transcript_rows"]),
        ]
    if results.get("record_rows"):
        out += [
            "Transcripts.record alone, in this process (no flush between the calls; each call timed):",
            "",
            *render_table(RECORD_COLUMNS, results["record_rows"]),
        ]
    if results.get("flush_row"):
        flush = results["flush_row"]
        out += [
            f"Transcripts.flush of one turn of {flush['updates']:,} updates recorded in blocks of "
            f"{RECORD_BLOCK_LINES} lines (2 MiB kept): {flush['wall_ms']:.1f} ms, {flush['cpu_ms']:.1f} ms of CPU "
            "(in its worker thread).",
            "",
        ]
    if results["fanout_rows"]:
        out += [
            "Fan-out: the holder's gateway streams the turn with an observer attached through a second proxy "
            "(historyPolicy none) and with nobody attached; the observer's time runs from the prompt until it has "
            "every update. CPU: the holder, and the second proxy relaying to the observer.",
            "",
            *render_table(FANOUT_COLUMNS, results["fanout_rows"]),
        ]
    if results["answer_rows"]:
        out += [
            f"Permission requests (tests/fake_adapter.py, prompt 'permission'): {results['round_trips']:,} turns "
            f"per case in interleaved blocks of {BLOCK}; the turn from the prompt to its answer at the gateway, "
            "split where the answering client got the request (ask) and the rest (answer).",
            "",
            *render_table(ANSWER_COLUMNS, results["answer_rows"]),
        ]
    return [*out, *left_running(results, " of the attach section")]


SECTION = Section((NAME,), measure, render, targets)
