"""Session benchmarks: what resuming a suspended session costs, and what the registry costs.

Every adapter here is ``benchmarks/session_agent.py``: it restores any session id
with ``session/resume`` (answered at once) or ``session/load`` (a replay of
``--replay`` updates, then the answer), and answers a prompt with one update
saying which request opened the session in its process, and its pid, so that
every timed prompt is checked to have been served by a fresh, restored process.

1. Resume latency added by the proxy. A proxy with ``[pool] max_live = 1`` serves
   two sessions A and B; prompts alternate A, B, A, B, ... so every prompt finds
   its session suspended. Timed: from sending ``session/prompt`` to reading its
   answer. On that path the proxy suspends the other session (the decision and
   the registry write; its process is stopped in the background), spawns the
   adapter under its wrapper, sends ``initialize`` (the gateway's params),
   ``session/resume`` or ``session/load`` (the replay is read and dropped), and
   forwards the prompt. The baseline is the adapter's own cost of the same:
   the client stops the agent it runs (untimed, as the proxy does not wait for
   that either), then, timed, spawns the agent itself (plain ``Popen``), sends
   ``initialize``, the restoring request (reading the replay) and the prompt. Both restoring requests are measured, with
   ``session/load`` replaying ``--replay`` updates. All cases run side by side,
   one resume each per round (the idle ones wait on their pipes), after two
   untimed resumes per case.
2. Proxy memory with 1,000 registered sessions of which 10 are live: a fresh
   state dir is given 990 suspended rows (``SessionRegistry.create`` then
   ``mark_suspended``, with MCP servers, ownership metadata and a setting each);
   a proxy with ``max_live = 10`` gets ``initialize``, 10 ``session/new`` and one
   ``session/list`` (it reads a page of rows and one more); then ``VmRSS`` and ``VmHWM`` of
   the proxy process are read from ``/proc/PID/status``. The baseline is the
   same proxy with 0 sessions (``initialize`` and ``session/list`` only); a third
   case, 10 live sessions and nothing else registered, separates what the live
   adapters cost the proxy from what the 990 rows cost it.
3. Registry operations per second, in-process on a fresh state dir:
   ``create`` (1,000 rows), then ``get``, ``record_setting``,
   ``mark_suspended``/``mark_live`` (alternating, each call one operation) on
   random rows of those, and ``page()`` (all 1,000 rows). These are absolute
   figures: there is no "without the proxy" to compare them with.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import random
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from acp_proxy.sessions.registry import LIST_PAGE_SIZE, Ownership, SessionRecord, SessionRegistry
from acp_proxy.state import StateDB
from benchmarks import harness
from benchmarks.common import (
    INITIALIZE_PARAMS,
    ROOT,
    BenchError,
    figures,
    ops_row,
    proc_status_kb,
    proxy_argv,
    script_argv,
)
from benchmarks.harness import (
    DIRECT,
    IO_TIMEOUT,
    Case,
    Column,
    Connected,
    Report,
    Row,
    Section,
    Target,
    attempt,
    call,
    col,
    connect,
    figure_cols,
    fmt,
    interleaved,
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
    target_col,
    where,
    with_baseline,
)

RESTORES = ("resume", "load")
BACKEND = "bench"

RESUME_WARMUP = 2
RSS_SESSIONS = 1_000
RSS_LIVE = 10
REGISTRY_ROWS = 1_000

TARGET_RESUME_ADDED_MS = 20.0
TARGET_RSS_MB = 40.0

RESUMED_LOG = b" resumed on pid "
"""What the proxy logs (at info) for every session it brings back."""


def mcp_servers(cwd: str) -> list[dict[str, Any]]:
    """What a gateway typically passes: a filesystem server for the project and one more."""
    return [
        {
            "name": "filesystem",
            "command": "npx",
            "args": ["-y", "@modelcontextprotocol/server-filesystem", cwd],
            "env": [],
        },
        {
            "name": "github",
            "command": "github-mcp-server",
            "args": ["stdio"],
            "env": [{"name": "GITHUB_TOOLSETS", "value": "repos,issues,pull_requests"}],
        },
    ]


SESSION_CWD = str(ROOT)
SESSION_PARAMS = {"cwd": SESSION_CWD, "mcpServers": mcp_servers(SESSION_CWD)}


def mode_label(mode: str) -> str:
    return harness.mode_label(mode, "direct (client runs the agent)")


def restore_label(restore: str, replay: int) -> str:
    if restore == "load":
        return f"session/load ({replay:,} updates replayed)"
    return "session/resume"


def agent_argv(restore: str, replay: int) -> list[str]:
    return script_argv("session_agent.py", restore, str(replay))


def configured_proxy_argv(backend: str, config: Path) -> list[str]:
    """The proxy with ``config``, logging at info (where it says which sessions it resumed)."""
    return proxy_argv(backend, "--log-level", "info", "--config", str(config))


def write_config(path: Path, *, max_live: int, command: list[str]) -> Path:
    """A config with one backend and the given pool size; everything else at its defaults."""
    lines = ["[pool]", f"max_live = {max_live}", f"[backends.{BACKEND}]", f"command = {json.dumps(command)}"]
    path.write_text("\n".join(lines) + "\n")
    return path


# --- the client ------------------------------------------------------------------------------


def check_turn(who: str, result: Any, notes: list[dict[str, Any]], session_id: str, restored_by: str) -> int:
    """Check a prompt's answer and its one update; the pid of the agent process that served it."""
    if result != {"stopReason": "end_turn"}:
        raise BenchError(f"{who}: the prompt answered {result!r}")
    if len(notes) != 1:
        raise BenchError(f"{who}: expected one update before the prompt's answer, got {len(notes)}")
    try:
        said = json.loads(notes[0]["params"]["update"]["content"]["text"])
        pid = int(said["pid"])
    except (KeyError, TypeError, ValueError):
        raise BenchError(f"{who}: the prompt's update is not the agent's report: {notes[0]!r}") from None
    if said.get("sessionId") != session_id or said.get("restoredBy") != restored_by:
        raise BenchError(f"{who}: expected session {session_id} opened by {restored_by}, the agent says {said}")
    return pid


def prompt_params(session_id: str) -> dict[str, Any]:
    return {"sessionId": session_id, "prompt": [{"type": "text", "text": "go on"}]}


# --- (1) resume latency ----------------------------------------------------------------------


class Resume(Connected):
    """Prompts alternating between two sessions, each of which must find its session restored in a process
    other than the one that served the last prompt."""

    def __init__(self, mode: str, restore: str, replay: int) -> None:
        super().__init__()
        self.mode = mode
        self.restore = restore
        self.label = f"{restore_label(restore, replay)}, {mode_label(mode)}"
        self.method = f"session/{restore}"
        self.sessions: list[str] = []
        self.next = 0
        self.last_pid = 0
        self.resumes = 0

    def sample(self, count: int) -> list[float]:
        return [self.resume_once() for _ in range(count)]

    def resume_once(self) -> float:
        """One timed resume, in milliseconds."""
        raise NotImplementedError

    def served(self, session_id: str, result: Any, notes: list[dict[str, Any]], same_process: str) -> None:
        """Check a prompt's answer: its session was restored in a process of its own (``same_process`` if not)."""
        pid = check_turn(self.label, result, notes, session_id, self.method)
        if pid == self.last_pid:
            raise BenchError(f"{self.label}: {same_process}")
        self.last_pid, self.next = pid, 1 - self.next
        self.resumes += 1


class DirectResume(Resume):
    """The baseline: the client runs one agent process at a time itself, as the proxy does with max_live = 1."""

    def __init__(self, restore: str, replay: int, env: dict[str, str]) -> None:
        super().__init__(DIRECT, restore, replay)
        self.argv = agent_argv(restore, replay)
        self.replay = replay
        self.env = env

    def _stop_current(self) -> None:
        if self._conn is not None:
            self.disconnect()

    def open(self) -> None:
        for _ in range(2):
            self._stop_current()
            self.sessions.append(self.connect(self.argv, self.env).new_session(**SESSION_PARAMS, timeout=IO_TIMEOUT))
        self.sample(RESUME_WARMUP)

    def resume_once(self) -> float:
        session_id = self.sessions[self.next]
        self._stop_current()  # outside the timed part: the proxy stops it in the background too
        start = time.perf_counter()
        conn = self.connect(self.argv, self.env)
        _, replayed = call(conn, self.method, {**SESSION_PARAMS, "sessionId": session_id})
        result, notes = call(conn, "session/prompt", prompt_params(session_id))
        elapsed = time.perf_counter() - start
        expected = self.replay if self.restore == "load" else 0
        if len(replayed) != expected:
            raise BenchError(f"{self.label}: {self.method} sent {len(replayed)} updates, not {expected}")
        self.served(session_id, result, notes, "the same process served two sessions")
        return elapsed * 1000

    def finish(self) -> None:
        self._stop_current()


class ProxyResume(Resume):
    """Two sessions through a proxy with ``max_live = 1``: every prompt resumes its session."""

    def __init__(self, backend: str, restore: str, replay: int, env: dict[str, str], workdir: Path) -> None:
        super().__init__(proxy_mode(backend), restore, replay)
        name = f"resume-{backend}-{restore}"
        config = write_config(workdir / f"{name}.toml", max_live=1, command=agent_argv(restore, replay))
        self.argv = configured_proxy_argv(backend, config)
        self.env = {**env, "ACP_PROXY_STATE_DIR": str(workdir / f"state-{name}")}

    def open(self) -> None:
        self.connect(self.argv, self.env)
        # The second session/new suspends the first session (max_live = 1).
        self.sessions = [self.conn.new_session(**SESSION_PARAMS, timeout=IO_TIMEOUT) for _ in range(2)]
        self.sample(RESUME_WARMUP)

    def resume_once(self) -> float:
        session_id = self.sessions[self.next]
        params = prompt_params(session_id)
        start = time.perf_counter()
        result, notes = call(self.conn, "session/prompt", params)
        elapsed = time.perf_counter() - start
        self.served(session_id, result, notes, "the prompt went to the process that served the other session")
        return elapsed * 1000

    def finish(self) -> None:
        resumed = self.disconnect().stderr.count(RESUMED_LOG)
        if resumed != self.resumes:
            raise BenchError(f"{self.label}: the proxy logged {resumed} resumes, the client counted {self.resumes}")


def resume_cases(env: dict[str, str], workdir: Path, args: argparse.Namespace) -> list[DirectResume | ProxyResume]:
    cases: list[DirectResume | ProxyResume] = []
    for restore in RESTORES:
        cases.append(DirectResume(restore, args.replay, env))
        cases += [ProxyResume(backend, restore, args.replay, env, workdir) for backend in args.backends]
    return cases


def measure_resume(
    report: Report, env: dict[str, str], workdir: Path, args: argparse.Namespace
) -> list[dict[str, Any]]:
    cases = resume_cases(env, workdir, args)
    rows: list[dict[str, Any]] = [
        {
            "restore": case.restore,
            "mode": case.mode,
            "replay": args.replay if case.restore == "load" else 0,
            "resumes": len(values),
            **figures("ms", values, "p50", "p90", "min", "max", "mean"),
            "all_ms": values,
        }
        for case, values in standing_rounds(report, "sessions: resume", cases, [1] * args.resumes)
    ]
    for restore in RESTORES:
        alike = [row for row in rows if row["restore"] == restore]
        direct = next((row for row in alike if row["mode"] == DIRECT), None)
        added = {
            "added_p50_ms": ("p50_ms", minus),
            "added_p90_ms": ("p90_ms", minus),
            "vs_direct_p50": ("p50_ms", ratio),
        }
        with_baseline(alike, direct, added)
    return rows


# --- (2) proxy memory with many registered sessions ------------------------------------------

RSS_CASES = ("empty", "live", "registered")


def rss_case_label(case: str) -> str:
    return {
        "empty": "0 sessions",
        "live": f"{RSS_LIVE} sessions, all live",
        "registered": f"{RSS_SESSIONS:,} sessions, {RSS_LIVE} live ({RSS_SESSIONS - RSS_LIVE:,} suspended)",
    }[case]


def realistic_record(index: int) -> SessionRecord:
    """A session row as a gateway's sessions leave it: MCP servers, ownership, a mode set, an auth method."""
    session_id = f"sess-{secrets.token_hex(4)}-{secrets.token_hex(2)}-{secrets.token_hex(2)}-{secrets.token_hex(6)}"
    cwd = f"/home/dev/src/project-{index % 40:02d}"
    settings: tuple[tuple[str, str], ...] = (("session/set_mode", json.dumps({"modeId": "plan"})),)
    if index % 3 == 0:
        settings += (("session/set_config_option", json.dumps({"configId": "model", "value": "large"})),)
    return SessionRecord(
        session_id=session_id,
        adapter_session_id=session_id,
        backend=BACKEND,
        cwd=cwd,
        mcp_servers=json.dumps(mcp_servers(cwd)),
        additional_directories=json.dumps([f"{cwd}/../shared"]) if index % 4 == 0 else None,
        settings=settings,
        auth_method="api-key",
        ownership=Ownership(
            session_key=f"agent:main:thread-{index}",
            owner_session_key="agent:main",
            spawned_by="agent:main" if index % 5 == 0 else None,
            agent_id="main",
        ),
    )


def populate(state_dir: Path, count: int) -> None:
    """``count`` suspended sessions, left by an earlier proxy, in the state dir's database."""
    db = StateDB(state_dir)
    try:
        registry = SessionRegistry(db, "bench-earlier-proxy")
        for index in range(count):
            record = registry.create(realistic_record(index))
            registry.mark_suspended(record.session_id)
    finally:
        db.close()


def session_counts(state_dir: Path) -> dict[str, int]:
    db = StateDB(state_dir, create=False)
    try:
        return SessionRegistry(db, "bench-reader").counts()
    finally:
        db.close()


def rss_once(backend: str, case: str, env: dict[str, str], workdir: Path, index: int) -> dict[str, Any]:
    mode = proxy_mode(backend)
    who = f"memory, {rss_case_label(case)}, {mode_label(mode)}"
    state = workdir / f"state-rss-{index}"
    suspended = RSS_SESSIONS - RSS_LIVE if case == "registered" else 0
    live = 0 if case == "empty" else RSS_LIVE
    if suspended:
        populate(state, suspended)
    config = write_config(workdir / f"rss-{index}.toml", max_live=RSS_LIVE, command=agent_argv("resume", 0))
    with connect(configured_proxy_argv(backend, config), {**env, "ACP_PROXY_STATE_DIR": str(state)}, who) as conn:
        call(conn, "initialize", INITIALIZE_PARAMS)
        for _ in range(live):
            conn.new_session(**SESSION_PARAMS, timeout=IO_TIMEOUT)
        listing, _ = call(conn, "session/list", {})
        total = suspended + live
        listed = listing.get("sessions") if isinstance(listing, dict) else None
        if not isinstance(listed, list) or len(listed) != min(total, LIST_PAGE_SIZE):
            raise BenchError(f"{who}: session/list answered {str(listing)[:300]}")
        if ("nextCursor" in listing) != (total > LIST_PAGE_SIZE):
            raise BenchError(f"{who}: session/list paging is wrong for {total} sessions")
        rss_kb = proc_status_kb(conn.pid, "VmRSS")
        hwm_kb = proc_status_kb(conn.pid, "VmHWM")
        counts = session_counts(state) if total else {}
        expected = {name: n for name, n in (("live", live), ("suspended", suspended)) if n}
        if counts != expected:
            raise BenchError(f"{who}: the registry holds {counts}, expected {expected}")
    if conn.process.returncode != 0:
        raise BenchError(f"{who}: the proxy exited with status {conn.process.returncode}")
    if rss_kb is None or hwm_kb is None:
        raise BenchError(f"{who}: cannot read /proc/{conn.pid}/status")
    return {"rss_mb": rss_kb / 1024, "hwm_mb": hwm_kb / 1024}


def measure_rss(report: Report, env: dict[str, str], workdir: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    counter = itertools.count()

    def once(backend: str, case: str) -> dict[str, Any]:
        return rss_once(backend, case, env, workdir, next(counter))

    cases = [
        Case(
            (backend, case),
            f"{rss_case_label(case)}, {mode_label(proxy_mode(backend))}",
            functools.partial(once, backend, case),
        )
        for backend in args.backends
        for case in RSS_CASES
    ]
    samples = interleaved(report, "sessions: memory", cases, args.rss_runs, warm_up=False)
    rows: list[dict[str, Any]] = []
    for (backend, case), runs in samples.items():
        rows.append(
            {
                "mode": proxy_mode(backend),
                "case": case,
                "label": rss_case_label(case),
                "sessions": {"empty": 0, "live": RSS_LIVE, "registered": RSS_SESSIONS}[case],
                "live": 0 if case == "empty" else RSS_LIVE,
                "runs": len(runs),
                "rss_mb": max(run["rss_mb"] for run in runs),
                "hwm_mb": max(run["hwm_mb"] for run in runs),
                "all": runs,
            }
        )
    for backend in args.backends:
        alike = [row for row in rows if row["mode"] == proxy_mode(backend)]
        empty = next((row for row in alike if row["case"] == "empty"), None)
        with_baseline(alike, empty, {"added_rss_mb": ("rss_mb", minus), "added_hwm_mb": ("hwm_mb", minus)})
    return rows


# --- (3) registry operations -----------------------------------------------------------------


def measure_registry(workdir: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    ops, pages = args.registry_ops, max(10, args.registry_ops // 100)
    rows: list[dict[str, Any]] = []

    def timed(name: str, label: str, count: int, action: Callable[[int], object]) -> None:
        start = time.perf_counter()
        for i in range(count):
            action(i)
        rows.append(ops_row(name, label, count, time.perf_counter() - start))

    db = StateDB(workdir / "state-registry")
    try:
        registry = SessionRegistry(db, "bench")
        records = [realistic_record(index) for index in range(REGISTRY_ROWS)]
        picks = random.Random(1).choices([record.session_id for record in records], k=ops)
        settings = [
            ("session/set_mode", {"modeId": "plan"}),
            ("session/set_config_option", {"configId": "model", "value": "large"}),
            ("session/set_mode", {"modeId": "default"}),
        ]
        progress(f"sessions: registry, {REGISTRY_ROWS:,} rows, {ops:,} operations each ...")
        timed("create", f"create ({REGISTRY_ROWS:,} new rows)", REGISTRY_ROWS, lambda i: registry.create(records[i]))
        timed("get", "get (a random row)", ops, lambda i: registry.get(picks[i]))
        timed(
            "record_setting",
            "record_setting (set_mode / set_config_option, read-modify-write)",
            ops,
            lambda i: registry.record_setting(picks[i], *settings[i % len(settings)]),
        )

        def suspend_or_live(i: int) -> None:
            session_id = picks[i // 2]
            if i % 2 == 0:
                registry.mark_suspended(session_id)
            else:
                registry.mark_live(session_id, "lease-bench", session_id)

        timed("mark_suspended/mark_live", "mark_suspended / mark_live (alternating)", ops, suspend_or_live)
        db.settle()  # page() reads what is written: the writer thread applies the queued writes first
        sizes: set[int] = set()
        timed(
            "page",
            f"page() (all {REGISTRY_ROWS:,} rows decoded)",
            pages,
            lambda i: sizes.add(len(registry.page())),
        )
        if sizes != {REGISTRY_ROWS} or registry.get(picks[0]) is None:
            raise BenchError(f"registry: page() returned {sorted(sizes)} rows, not {REGISTRY_ROWS}")
    finally:
        db.close()
    page = rows[-1]
    page["rows_per_s"] = page["ops_per_s"] * REGISTRY_ROWS
    return rows


# --- the section -----------------------------------------------------------------------------


def measure_sessions(report: Report, args: argparse.Namespace) -> None:
    results: dict[str, Any] = {
        "resumes": args.resumes,
        "resume_warmup": RESUME_WARMUP,
        "replay": args.replay,
        "rss_runs": args.rss_runs,
        "rss_sessions": RSS_SESSIONS,
        "rss_live": RSS_LIVE,
        "registry_rows": REGISTRY_ROWS,
        "registry_ops": args.registry_ops,
    }
    report.sessions = results
    with isolated(report, "sessions", results) as run:
        results["resume"] = measure_resume(report, run.env, run.workdir, args)
        results["rss"] = measure_rss(report, run.env, run.workdir, args)
        results["registry"] = attempt(report, "registry", lambda: measure_registry(run.workdir, args)) or []


# --- reporting -------------------------------------------------------------------------------


def targets(report: Report) -> list[Target]:
    found = []
    for row in report.sessions.get("resume", []):
        if row["mode"] != DIRECT:
            name = f"resume added p50, {restore_label(row['restore'], row['replay'])}, {mode_label(row['mode'])}"
            found.append(Target(name, row["added_p50_ms"], TARGET_RESUME_ADDED_MS, "ms"))
    for row in report.sessions.get("rss", []):
        if row["case"] == "registered":
            name = f"proxy peak RSS, {rss_case_label(row['case'])}, {mode_label(row['mode'])}"
            found.append(Target(name, row["hwm_mb"], TARGET_RSS_MB, "MB"))
    return found


def label(row: Row) -> str:
    return mode_label(row["mode"])


RESUME_COLUMNS = (
    Column("restored with", lambda row: restore_label(row["restore"], row["replay"])),
    Column("run by", label),
    *figure_cols("ms", "p50", "p90", "min", "max"),
    *figure_cols("ms", "added_p50", "added_p90", when=relayed),
    col("vs direct (p50)", "vs_direct_p50", 2, "x", when=relayed),
    target_col(
        f"target added p50 <= {TARGET_RESUME_ADDED_MS:g} ms", "added_p50_ms", TARGET_RESUME_ADDED_MS, when=relayed
    ),
)
RSS_COLUMNS = (
    Column("proxy", label),
    Column("sessions", lambda row: str(row["label"])),
    col("RSS MB (VmRSS)", "rss_mb"),
    col("peak RSS MB (VmHWM)", "hwm_mb"),
    col("added RSS MB", "added_rss_mb", when=known("added_rss_mb")),
    col("added peak MB", "added_hwm_mb", when=known("added_hwm_mb")),
    target_col(f"target peak <= {TARGET_RSS_MB:g} MB", "hwm_mb", TARGET_RSS_MB, when=where("case", "registered")),
)
REGISTRY_COLUMNS = ops_cols()


def render(report: Report) -> list[str]:
    results = report.sessions
    out: list[str] = []
    if results.get("resume"):
        out += [
            f"## Sessions: resume latency, `max_live = 1`, {results['resumes']} resumes each (interleaved)",
            "",
            "Prompts alternate between two sessions, so each one finds its session suspended. Timed from "
            "sending `session/prompt` to its answer. Through the proxy that covers suspending the other "
            "session (its process is stopped in the background), spawning the adapter under its wrapper, "
            "`initialize`, the restoring request and the prompt. Direct, the adapter's own cost: the "
            "client stops the old agent (untimed), then spawns the agent (plain Popen), `initialize`, "
            f"restores, prompts. After {results['resume_warmup']} "
            "untimed resumes per case.",
            "",
            *render_table(RESUME_COLUMNS, results["resume"]),
        ]
    if results.get("rss"):
        out += [
            f"## Sessions: proxy memory with {RSS_SESSIONS:,} registered sessions, {RSS_LIVE} live "
            f"(`max_live = {RSS_LIVE}`), {results['rss_runs']} run(s) each, the highest reported",
            "",
            f"After `initialize`, a `session/new` per live session and one `session/list` (it answers the "
            f"first {LIST_PAGE_SIZE}, reading them and one more row). RSS of the proxy process alone (its "
            "adapters are not counted), from `/proc/PID/status`; added: against the same proxy with "
            "0 sessions.",
            "",
            *render_table(RSS_COLUMNS, results["rss"]),
        ]
    if results.get("registry"):
        out += [
            f"## Sessions: registry operations, in-process, {results['registry_rows']:,} rows",
            "",
            "`SessionRegistry` on a fresh state database (WAL, `synchronous = NORMAL`); every write is "
            'its own transaction. Absolute figures: there is no "without the proxy" to compare them '
            "with, so no target.",
            "",
            *render_table(REGISTRY_COLUMNS, results["registry"]),
        ]
        page = results["registry"][-1]
        if "rows_per_s" in page:
            out += [f"* `page()`: {fmt(page['rows_per_s'], 0)} rows/s decoded into `SessionRecord`s.", ""]
    return out + left_running(results, " of the session benchmarks")


SECTION = Section(("sessions",), measure_sessions, render, targets)
