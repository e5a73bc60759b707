"""Task benchmarks: what recording every prompt turn as a task row costs.

Every ``session/prompt`` the proxy relays is a task row in its state database,
written when the turn is routed (``TaskRegistry.create``), when a queued turn is
sent (``mark_running``), at most once a second while it runs (``save_progress``)
and when it is answered (``finish``); the relay hands each block of the turn's
streamed ``session/update`` lines to ``Turn.observe``.

1. Per-turn overhead of short turns. One session on ``benchmarks/stream_agent.py``;
   ``--turns`` sequential ``session/prompt`` turns, each answered by
   ``TURN_UPDATES`` ``session/update`` lines of 180 B, then
   ``{"stopReason": "end_turn"}``. Timed: from sending the prompt to reading its
   answer. Direct (the client runs the agent) against the proxy, which records a
   task per turn in a fresh state dir, so its figure includes the bookkeeping;
   and against a *bare relay* on the same event loop (``benchmarks/line_relay.py``:
   one process that starts the agent as a plain child and forwards lines both ways
   with the proxy's own fd streams, ``LineReader`` batches and msgspec envelope
   decode, and nothing else: no wrapper, no id remapping, no sessions, no tasks, no
   database, no logging). *Over bare* is the proxy's p50 (p99) minus the bare
   relay's on the same backend, measured in the same run: what the proxy's session
   and task bookkeeping, id mapping and logging add to a turn.
   The connections are open side by side and take turns in blocks of
   ``TURN_BLOCK`` turns, after ``TURN_WARMUP`` untimed turns each. Every turn's
   lines are checked; at the end the proxy's database must hold one ``done`` task
   per turn, each having counted its ``TURN_UPDATES`` updates.
2. The bookkeeping alone, in-process on a fresh state dir: a turn's whole record
   per second (``Turn``, the writes, one ``observe`` of a 10-line block,
   ``Turn.finish``), for a prompt to a live session (``create`` as running, then
   ``finish``: what every turn of (1) costs the proxy) and for a queued one
   (``create``, ``mark_running``, ``finish``); and ``Turn.observe`` on a 10-line
   block, timed with ``timeit``, with and without a ``tool_call`` update in it.
3. Task writes per second on a fresh state dir: ``create`` (``--task-ops`` new
   rows), ``mark_running``, ``save_progress`` (each after a 10-line block was
   observed, so it digests 10 updates) and ``finish`` of each of them. These are
   absolute figures: there is no "without the proxy" to compare them with.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from acp_proxy import journal
from acp_proxy.state import StateDB
from acp_proxy.tasks.records import TaskRegistry, list_tasks
from acp_proxy.tasks.status import TaskStatus, outcome_of
from acp_proxy.tasks.turn import Turn, new_task_id
from acp_proxy.timings import Timing, Timings, histograms
from benchmarks.common import ROOT, BenchError, cpu_seconds, figures, ops_row, proxy_argv, script_argv
from benchmarks.harness import (
    DIRECT,
    IO_TIMEOUT,
    Column,
    Connected,
    Report,
    Section,
    Target,
    attempt,
    backend_of,
    col,
    figure_cols,
    fmt,
    is_proxy,
    isolated,
    known,
    left_running,
    minus,
    ops_cols,
    progress,
    proxy_mode,
    ratio,
    relayed,
    render_table,
    standing_rounds,
    with_baseline,
)
from benchmarks.sessions import mode_label
from benchmarks.stream_agent import update_line
from tests.kit.state import count_tasks

BARE = "bare-"
TARGET_TURN_CPU_US = 300.0
"""The proxy's CPU for a turn of 10 updates, at most; and at most ``TARGET_TURN_CPU_VS_BARE`` times the bare relay's."""
TARGET_TURN_CPU_VS_BARE = 2.0

TURN_UPDATES = 10
TURN_WARMUP = 100
TURN_BLOCK = 100
TURN_SESSIONS = 10
"""Sessions the in-process turns are spread over."""
OBSERVE_CALLS = 100_000
OBSERVE_REPEAT = 5
FLUSH_RUNS = 200
"""Flushes timed of a second's worth of a proxy's observations."""
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
PROMPT_TEXT = "Rename the config loader's helpers and update their call sites; run the tests when done."
TOOL_CALL_LINE = (
    json.dumps(
        {
            "jsonrpc": "2.0",
            "method": "session/update",
            "params": {
                "sessionId": "bench-1",
                "update": {
                    "sessionUpdate": "tool_call",
                    "toolCallId": "call_0001",
                    "title": "Read acp_proxy/config.py",
                    "kind": "read",
                    "status": "pending",
                },
            },
        },
        separators=(",", ":"),
    ).encode()
    + b"\n"
)


def agent_argv() -> list[str]:
    return script_argv("stream_agent.py")


def bare_argv(backend: str) -> list[str]:
    return script_argv("line_relay.py", "--async-backend", backend, "--", *agent_argv())


def turn_label(mode: str) -> str:
    return f"bare relay ({mode.removeprefix(BARE)})" if mode.startswith(BARE) else mode_label(mode)


def text_block(session_id: str = "bench-1", lines: int = TURN_UPDATES) -> bytes:
    """``lines`` ``agent_message_chunk`` updates, exactly as ``stream_agent.py`` streams them."""
    return b"".join(update_line(session_id, i) for i in range(lines))


def tool_call_block() -> bytes:
    """A 10-line block of which one line is a ``tool_call`` (``Turn.observe`` decodes such a block)."""
    return text_block(lines=TURN_UPDATES - 1) + TOOL_CALL_LINE


# --- (1) per-turn overhead ---------------------------------------------------------------------


class TurnCase(Connected):
    """One connection serving short prompt turns on one session: to the agent, or through a proxy."""

    def __init__(self, mode: str, env: dict[str, str], workdir: Path) -> None:
        super().__init__()
        self.mode = mode
        self.label = turn_label(mode)
        self.state: Path | None = None
        if mode == DIRECT:
            self.argv, self.env = agent_argv(), env
        elif mode.startswith(BARE):
            self.argv, self.env = bare_argv(mode.removeprefix(BARE)), {**env, "PYTHONPATH": str(ROOT)}
        else:
            backend = mode.removeprefix("proxy-")
            self.state = workdir / f"state-turns-{backend}"
            self.argv = proxy_argv(backend, "--", *agent_argv())
            self.env = {**env, "ACP_PROXY_STATE_DIR": str(self.state)}
        self.session_id = ""
        self.turns = 0
        self.cpu_s = 0.0
        self.cpu_known = True

    def open(self) -> None:
        self.session_id = self.connect(self.argv, self.env).new_session(str(ROOT), timeout=IO_TIMEOUT)
        for _ in range(TURN_WARMUP):
            self.turn_once()

    def params(self) -> dict[str, Any]:
        meta = {"traceparent": TRACEPARENT, "bench": {"updates": TURN_UPDATES}}
        return {"sessionId": self.session_id, "prompt": [{"type": "text", "text": PROMPT_TEXT}], "_meta": meta}

    def turn_once(self) -> float:
        """One turn; microseconds from sending the prompt to reading its answer."""
        request_id, data = self.conn.request_bytes("session/prompt", self.params())
        deadline = time.monotonic() + IO_TIMEOUT
        clock = time.perf_counter_ns
        start = clock()
        self.conn.send_raw(data)
        lines = [self.conn.read_line(deadline - time.monotonic()) for _ in range(TURN_UPDATES + 1)]
        elapsed = clock() - start
        self.check(lines, request_id)
        self.turns += 1
        return elapsed / 1000

    def check(self, lines: list[bytes], request_id: int) -> None:
        try:
            decoded = [msgspec.json.decode(line) for line in lines]
        except msgspec.DecodeError:
            raise BenchError(f"{self.label}: a turn's line is not JSON: {lines!r:.300}") from None
        for msg in decoded[:-1]:
            params = msg.get("params") if isinstance(msg, dict) else None
            if (
                not isinstance(params, dict)
                or msg.get("method") != "session/update"
                or "id" in msg
                or params.get("sessionId") != self.session_id
            ):
                raise BenchError(f"{self.label}: expected {TURN_UPDATES} updates, then the answer; got {msg!r:.300}")
        answer = decoded[-1]
        if (
            not isinstance(answer, dict)
            or answer.get("id") != request_id
            or answer.get("result") != {"stopReason": "end_turn"}
        ):
            raise BenchError(f"{self.label}: expected the answer to request {request_id}, got {answer!r:.300}")

    def sample(self, count: int) -> list[float]:
        """``count`` timed turns, and the middle process's CPU time over them."""
        before = cpu_seconds(self.conn.pid)
        samples = [self.turn_once() for _ in range(count)]
        after = cpu_seconds(self.conn.pid)
        if before is None or after is None:
            self.cpu_known = False
        else:
            self.cpu_s += after - before
        return samples

    def finish(self) -> None:
        self.disconnect()
        if self.state is not None:
            self.check_tasks(self.state)

    def check_tasks(self, state: Path) -> None:
        """One ``done`` task per turn, each with its updates counted."""
        db = StateDB(state, create=False)
        try:
            counts = count_tasks(db)
            records = list_tasks(db, limit=None)
        finally:
            db.close()
        if counts != {TaskStatus.DONE.value: self.turns}:
            raise BenchError(f"{self.label}: the proxy recorded {counts} tasks for {self.turns} turns")
        wrong = [r for r in records if r.update_count != TURN_UPDATES or r.stop_reason != "end_turn"]
        if wrong:
            r = wrong[0]
            raise BenchError(
                f"{self.label}: {len(wrong)} task(s) recorded wrongly, e.g. {r.task_id}: "
                f"{r.update_count} updates (expected {TURN_UPDATES}), stop reason {r.stop_reason!r}"
            )


def measure_turns(report: Report, env: dict[str, str], workdir: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    modes = [DIRECT, *(BARE + b for b in args.backends), *(proxy_mode(b) for b in args.backends)]
    cases = [TurnCase(mode, env, workdir) for mode in modes]
    blocks = [min(TURN_BLOCK, args.turns - start) for start in range(0, args.turns, TURN_BLOCK)]
    rows: list[dict[str, Any]] = [
        {
            "mode": case.mode,
            "turns": len(values),
            "updates_per_turn": TURN_UPDATES,
            **figures("us", values, "p50", "p90", "p99", "mean", "min", "max"),
            "middle_cpu_us_per_turn": case.cpu_s / len(values) * 1e6 if case.cpu_known else None,
        }
        for case, values in standing_rounds(report, "tasks: turns", cases, blocks, every=5)
    ]
    by_mode = {row["mode"]: row for row in rows}
    added = {"added_p50_us": ("p50_us", minus), "added_p99_us": ("p99_us", minus)}
    with_baseline(rows, by_mode.get(DIRECT), {**added, "vs_direct_p50": ("p50_us", ratio)})
    for row in rows:
        bare = by_mode.get(BARE + backend_of(row["mode"])) if is_proxy(row["mode"]) else None
        over = {"over_bare_p50_us": ("p50_us", minus), "over_bare_p99_us": ("p99_us", minus)}
        with_baseline([row], bare, over)
    return rows


# --- (2) the bookkeeping alone ---------------------------------------------------------------


def new_turn(index: int) -> Turn:
    """A turn as ``TurnBook.open_turn`` makes one for a gateway's prompt."""
    return Turn(
        task_id=new_task_id(),
        session_id=f"sess-bench-{index % TURN_SESSIONS:02d}",
        backend="default",
        request_id=str(index),
        prompt=PROMPT_TEXT,
        traceparent=TRACEPARENT,
    )


def measure_bookkeeping(workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Whole turns' records per second, and ``Turn.observe`` per call."""
    count = args.task_ops
    block = text_block()
    done = outcome_of(stop_reason="end_turn")
    lease = "lease-bench"

    def live(registry: TaskRegistry, index: int) -> None:
        turn = new_turn(index)
        turn.start(lease, None)
        registry.create(turn)
        turn.observe(block, TURN_UPDATES)
        turn.finish(done)
        registry.finish(turn)

    def queued(registry: TaskRegistry, index: int) -> None:
        turn = new_turn(index)
        turn.event("queued", "waiting for the session's process")
        registry.create(turn)
        turn.start(lease, None)
        registry.mark_running(turn)
        turn.observe(block, TURN_UPDATES)
        turn.finish(done)
        registry.finish(turn)

    lifecycles: list[dict[str, Any]] = []
    cases: list[tuple[str, str, int, Callable[[TaskRegistry, int], None]]] = [
        ("live", "a prompt to a live session: create (running), finish", 2, live),
        ("queued", "a queued prompt: create, mark_running, finish", 3, queued),
    ]
    for name, label, writes, one in cases:
        progress(f"tasks: bookkeeping, {count:,} turns, {label} ...")
        db = StateDB(workdir / f"state-bookkeeping-{name}")
        try:
            registry = TaskRegistry(db, "bench")
            start = time.perf_counter()
            for index in range(count):
                one(registry, index)
            db.settle()  # queued on the caller's thread, applied (in batches) by the writer's
            seconds = time.perf_counter() - start
            counts = count_tasks(db)
        finally:
            db.close()
        if counts != {TaskStatus.DONE.value: count}:
            raise BenchError(f"bookkeeping, {label}: {counts} tasks recorded for {count} turns")
        lifecycles.append(
            {
                "case": name,
                "label": label,
                "writes": writes,
                "turns": count,
                "seconds": seconds,
                "turns_per_s": count / seconds,
                "us_per_turn": seconds / count * 1e6,
            }
        )

    calls = OBSERVE_CALLS // 5 if args.quick else OBSERVE_CALLS
    progress(f"tasks: Turn.observe, {OBSERVE_REPEAT} x {calls:,} calls per block ...")
    observe: list[dict[str, Any]] = []
    for name, label, data in (
        ("text", f"{TURN_UPDATES} agent_message_chunk lines of 180 B", block),
        ("tool_call", f"{TURN_UPDATES} lines, one of them a tool_call (the block is decoded)", tool_call_block()),
    ):
        turn = new_turn(0)
        turn.start(lease, None)
        turn.observe(data, TURN_UPDATES)  # the first block also records first_output
        timer = timeit.Timer("turn.observe(block, count)", globals={"turn": turn, "block": data, "count": 10})
        best = min(timer.repeat(repeat=OBSERVE_REPEAT, number=calls)) / calls
        if turn.update_count != TURN_UPDATES * (1 + OBSERVE_REPEAT * calls):
            raise BenchError(f"Turn.observe counted {turn.update_count} updates")
        observe.append(
            {
                "block": name,
                "label": label,
                "block_bytes": len(data),
                "calls": calls,
                "repeat": OBSERVE_REPEAT,
                "ns_per_call": best * 1e9,
                "ns_per_line": best * 1e9 / TURN_UPDATES,
            }
        )
    return {"lifecycle": lifecycles, "observe": observe, "timings": measure_timings(workdir, calls)}


def measure_timings(workdir: Path, calls: int) -> dict[str, Any]:
    """What a turn's latency histograms cost the proxy: the two observations its settling makes
    (``Timing.TURN``, ``Timing.FIRST_UPDATE``), and a flush (once a second) of a second's worth of keys."""
    progress(f"tasks: Timings.observe, {OBSERVE_REPEAT} x {calls:,} turns ...")
    db = StateDB(workdir / "state-timings")
    try:
        timings = Timings(db)
        timer = timeit.Timer(
            "observe(turn, 'bench', 1.234); observe(first, 'bench', 0.0421)",
            globals={"observe": timings.observe, "turn": Timing.TURN, "first": Timing.FIRST_UPDATE},
        )
        per_turn = min(timer.repeat(repeat=OBSERVE_REPEAT, number=calls)) / calls
        flushes = []
        for _ in range(FLUSH_RUNS):
            for backend in ("a", "b"):
                for timing, seconds in ((Timing.TURN, 3.0), (Timing.FIRST_UPDATE, 0.2), (Timing.START, 0.4)):
                    timings.observe(timing, backend, seconds)
            start = time.perf_counter()
            timings.flush()
            flushes.append(time.perf_counter() - start)
        db.settle()
        counted = sum(h.count for h in histograms(journal.counters(db.conn)))
    finally:
        db.close()
    if counted != 2 * OBSERVE_REPEAT * calls + FLUSH_RUNS * 6:  # the timed ones go with the first flush
        raise BenchError(f"Timings: {counted} observations counted")
    return {
        "calls": calls,
        "repeat": OBSERVE_REPEAT,
        "ns_per_turn": per_turn * 1e9,
        "flush_us_p50": statistics.median(flushes) * 1e6,
        "flush_keys": 6,
    }


# --- (3) task writes ---------------------------------------------------------------------------


def measure_writes(workdir: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    count = args.task_ops
    rows: list[dict[str, Any]] = []

    def timed(name: str, label: str, action: Callable[[int], object]) -> None:
        clock = time.perf_counter_ns
        each: list[float] = []
        start = clock()
        for i in range(count):
            before = clock()
            action(i)
            db.settle()  # one write at a time, each waited for: its latency through the writer thread
            each.append((clock() - before) / 1000)
        seconds = (clock() - start) / 1e9
        rows.append(
            {
                **ops_row(name, label, count, seconds),
                **figures("us", each, "p50", "p99", "max"),
                "over_1ms": sum(1 for us in each if us > 1000),
            }
        )

    block = text_block()
    done = outcome_of(stop_reason="end_turn")
    db = StateDB(workdir / "state-writes")
    try:
        registry = TaskRegistry(db, "bench")
        turns = [new_turn(index) for index in range(count)]
        for turn in turns:
            turn.event("queued", "waiting for the session's process")
        progress(f"tasks: task writes, {count:,} rows, 4 operations each ...")
        timed("create", f"create ({count:,} new rows, queued)", lambda i: registry.create(turns[i]))
        for turn in turns:
            turn.start("lease-bench", None)
        timed("mark_running", "mark_running", lambda i: registry.mark_running(turns[i]))
        for turn in turns:
            turn.observe(block, TURN_UPDATES)
        timed(
            "save_progress",
            f"save_progress (digests {TURN_UPDATES} updates, then writes)",
            lambda i: registry.save_progress(turns[i]),
        )
        for turn in turns:
            turn.finish(done)
        timed("finish", "finish", lambda i: registry.finish(turns[i]))
        counts = count_tasks(db)
    finally:
        db.close()
    if counts != {TaskStatus.DONE.value: count}:
        raise BenchError(f"task writes: {counts} tasks recorded for {count} finished")
    return rows


# --- the section -----------------------------------------------------------------------------


def measure_tasks(report: Report, args: argparse.Namespace) -> None:
    results: dict[str, Any] = {
        "turns": args.turns,
        "turn_warmup": TURN_WARMUP,
        "turn_block": TURN_BLOCK,
        "updates_per_turn": TURN_UPDATES,
        "task_ops": args.task_ops,
    }
    report.tasks = results
    with isolated(report, "tasks", results) as run:
        results["turn_overhead"] = measure_turns(report, run.env, run.workdir, args)
        bookkeeping = attempt(report, "tasks: bookkeeping", lambda: measure_bookkeeping(run.workdir, args)) or {}
        results["lifecycle"] = bookkeeping.get("lifecycle", [])
        results["observe"] = bookkeeping.get("observe", [])
        results["timings"] = bookkeeping.get("timings", {})
        results["writes"] = attempt(report, "tasks: task writes", lambda: measure_writes(run.workdir, args)) or []


# --- reporting -------------------------------------------------------------------------------


TURN_COLUMNS = (
    Column("run by", lambda row: turn_label(row["mode"])),
    *figure_cols("us", "p50", "p90", "p99", "mean"),
    *figure_cols("us", "added_p50", "added_p99", when=relayed),
    col("vs direct (p50)", "vs_direct_p50", 2, "x", when=relayed),
    *figure_cols("us", "over_bare_p50", "over_bare_p99", when=known("over_bare_p50_us")),
    col("middle CPU us/turn", "middle_cpu_us_per_turn", 0),
)
LIFECYCLE_COLUMNS = (
    Column("turn", lambda row: str(row["label"])),
    Column("writes", lambda row: str(row["writes"])),
    Column("turns (rows)", lambda row: f"{row['turns']:,}"),
    col("total s", "seconds", 3),
    col("rows/s", "turns_per_s", 0),
    col("us/turn", "us_per_turn"),
)
OBSERVE_COLUMNS = (
    Column("block", lambda row: str(row["label"])),
    Column("bytes", lambda row: f"{row['block_bytes']:,}"),
    col("ns/call", "ns_per_call", 0),
    col("ns/line", "ns_per_line"),
)
WRITE_COLUMNS = (
    *ops_cols("us/op (mean)"),
    col("p50 us", "p50_us"),
    col("p99 us", "p99_us"),
    col("max us", "max_us", 0),
    Column("over 1 ms", lambda row: f"{row['over_1ms']:,}"),
)


def render(report: Report) -> list[str]:
    results = report.tasks
    out: list[str] = []
    if results.get("turn_overhead"):
        out += [
            f"## Tasks: per-turn overhead, {results['turns']:,} sequential prompt turns of "
            f"{results['updates_per_turn']} session/update lines (after {results['turn_warmup']} warm-up)",
            "",
            f"One session; each turn is one `session/prompt` answered by {results['updates_per_turn']} "
            "`session/update` lines of 180 B, then `end_turn`. Timed from sending the prompt to reading its "
            "answer. Through the proxy every turn is a task row (created, finished) in a fresh state dir, so "
            "the figure includes the bookkeeping: the row is created with the session's last activity in one "
            "transaction, and written finished once the answer is sent. "
            "The proxy runs at its default log level (info), which logs one line per turn. "
            "The bare relay (`benchmarks/line_relay.py`) forwards the same lines with the proxy's own "
            "streams, line batches and envelope decode, and keeps nothing: *over bare* is what the proxy "
            "adds to it on the same loop. The relays take turns in blocks of "
            f"{results['turn_block']} turns. Middle CPU: the relay process's (for direct: the agent's).",
            "",
            *render_table(TURN_COLUMNS, results["turn_overhead"]),
        ]
    if results.get("lifecycle") or results.get("observe"):
        out += [
            "## Tasks: the bookkeeping alone, in-process",
            "",
            "A turn's whole record on a fresh state database (WAL, `synchronous = NORMAL`), made as the "
            "proxy makes it: `Turn`, the writes queued for the state writer thread (which commits what has "
            f"gathered in one transaction), one `observe` of {TURN_UPDATES} lines, `Turn.finish` (which "
            "digests them); timed until the writer has applied the last write.",
            "",
        ]
        if results.get("lifecycle"):
            out += render_table(LIFECYCLE_COLUMNS, results["lifecycle"])
        live = next((row for row in results.get("lifecycle", []) if row["case"] == "live"), None)
        for row in results.get("turn_overhead", []):
            if live and row["added_p50_us"] and is_proxy(row["mode"]):
                share = live["us_per_turn"] / row["added_p50_us"] * 100
                out += [
                    f"* {mode_label(row['mode'])}: the bookkeeping of a turn to a live session "
                    f"({fmt(live['us_per_turn'], 1)} us, most of it on the state writer thread), is "
                    f"{share:.0f}% of the added p50 per turn ({fmt(row['added_p50_us'], 1)} us)."
                ]
        if live and results.get("turn_overhead"):
            out += [""]
        if results.get("observe"):
            first = results["observe"][0]
            out += [
                f"`Turn.observe(block, {TURN_UPDATES})` on a running turn, `timeit`: best of "
                f"{first['repeat']} x {first['calls']:,} calls.",
                "",
                *render_table(OBSERVE_COLUMNS, results["observe"]),
            ]
        if results.get("timings"):
            timed = results["timings"]
            out += [
                "",
                f"Latency histograms (`Timings`): a turn's two observations as its settling makes them cost "
                f"{fmt(timed['ns_per_turn'], 0)} ns (`timeit`: best of {timed['repeat']} x {timed['calls']:,} "
                f"turns); the flush a proxy makes once a second, of {timed['flush_keys']} keys, queues one write "
                f"in {fmt(timed['flush_us_p50'], 1)} us p50 on the event loop (the writer thread applies it).",
            ]
    if results.get("writes"):
        out += [
            f"## Tasks: task writes, in-process, {results['task_ops']:,} rows",
            "",
            "`TaskRegistry` on a fresh state database (WAL, `synchronous = NORMAL`); every write is queued "
            "for the state writer thread and waited for, so it is a transaction of its own. Each of the "
            f"{results['task_ops']:,} rows is created queued, marked running, has its "
            "progress saved once and is finished. Percentiles are of single writes; the slow ones are those "
            "that checkpoint the WAL into the database file. Absolute figures: there is no "
            '"without the proxy" to compare them with, so no target.',
            "",
            *render_table(WRITE_COLUMNS, results["writes"]),
        ]
    return out + left_running(results, " of the task benchmarks")


def targets(report: Report) -> list[Target]:
    rows = report.tasks.get("turn_overhead", [])
    cpu = {row["mode"]: row["middle_cpu_us_per_turn"] for row in rows}
    found = []
    for backend in report.options["backends"]:
        mode = proxy_mode(backend)
        ours, bare = cpu.get(mode), cpu.get(f"{BARE}{backend}")
        if ours is None:
            continue
        label = turn_label(mode)
        found.append(Target(f"CPU of a turn of {TURN_UPDATES} updates, {label}", ours, TARGET_TURN_CPU_US, "us"))
        if bare:
            found.append(Target(f"CPU of a turn, {label} x the bare relay", ours / bare, TARGET_TURN_CPU_VS_BARE, "x"))
    return found


SECTION = Section(("tasks",), measure_tasks, render, targets=targets)
