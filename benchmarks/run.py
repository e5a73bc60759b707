"""The acp-proxy benchmark suite: every figure is a ratio against the same work without the proxy.

    scripts/bench                  full run: 1,000,000 updates (median of 3 runs),
                                   10,000 round trips, 20 cold starts, 20 closes and spawns,
                                   30 resumes, 2,000 prompt turns
    scripts/bench --quick          a fast check: 300,000 updates (5 runs), 1,000 round trips,
                                   5 cold starts, 5 closes and spawns, 8 resumes, 200 turns
    scripts/bench --smoke          every section once, at the smallest sizes that still run each
                                   path (under 2 minutes; the slow tier of scripts/test runs it, so
                                   that a broken benchmark fails CI): its figures are not for quoting
    scripts/bench --only ownership the process-ownership figures alone
    scripts/bench --only sessions  the session figures alone (resume, memory, registry)
    scripts/bench --only tasks     the task figures alone (per-turn overhead, bookkeeping, writes)
    scripts/bench --only load      200 concurrent sessions over max_live = 8 (--quick: 1 burst each)
    scripts/bench --only measuring what measuring the trees' memory and checking for dead proxies costs
    scripts/bench --only install   20 proxies of one session each over one install's max_live = 4, against a
                                   client-side pool of the same work (--quick: 3 bursts each instead of 10)
    scripts/bench --only remote    serve over WebSocket and streamable HTTP/2, and acp-proxy connect, against
                                   stdio through the proxy (--quick: 200 turns, 20,000 updates, 50 idle
                                   connections, 10 sessions)
    scripts/bench --only attach    shared sessions: the transcript on the streaming path, an observer attached,
                                   a controller's answers (--quick: 100,000 updates, 3 rounds, 50 turns)
    scripts/bench --help           every option (--updates N, --round-trips N, --backends ...)

Each benchmark is a module declaring a ``Section`` (``benchmarks/harness.py``): the
same work run directly and through the proxy, its figures and its targets.

* ``benchmarks/streaming.py``: throughput, request latency, cold start and the proxy's
  peak RSS, against the agent alone and a ``cat`` relay;
* ``benchmarks/ownership.py``: what owning an adapter's process tree costs (closing
  it, spawning under the wrapper, reaping dead leases at startup);
* ``benchmarks/sessions.py``: resuming a suspended session, the proxy's memory with
  1,000 registered sessions, registry operations;
* ``benchmarks/tasks.py``: what recording every prompt turn as a task costs;
* ``benchmarks/load.py``: the pool under load in one proxy (200 sessions over
  ``max_live = 8``);
* ``benchmarks/install.py``: across the proxies of one install (20 proxies of one
  session each over ``max_live = 4``, as acpx runs them);
* ``benchmarks/remote.py``: ``acp-proxy serve`` over WebSocket and streamable HTTP/2
  (turns, streaming, idle connections, sessions) and the ``acp-proxy connect`` bridge,
  against stdio through the proxy;
* ``benchmarks/attach.py``: shared sessions (the transcript's cost on the streaming path, a
  session's gateway with an observer attached through another proxy, a permission request
  answered by an attached controller), against the same work without them.

The figures are reported, never
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
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Final

import psutil

from benchmarks import attach, common, install, load, measuring, ownership, remote, sessions, streaming, tasks
from benchmarks.common import ROOT, child_environment
from benchmarks.harness import Column, Report, Section, fmt, progress, render_table

RESULTS = ROOT / "bench-results" / "bench.json"

SECTIONS: tuple[Section, ...] = (
    streaming.SECTION,
    ownership.SECTION,
    measuring.SECTION,
    sessions.SECTION,
    tasks.SECTION,
    load.SECTION,
    install.SECTION,
    remote.SECTION,
    attach.SECTION,
)
MEASUREMENTS = tuple(name for section in SECTIONS for name in section.names)

DEFAULTS: dict[str, tuple[int, int, int]] = {
    "updates": (1_000_000, 300_000, 10_000),
    "round_trips": (10_000, 1_000, 200),
    "cold_starts": (20, 5, 2),
    "repeat": (3, 5, 1),
    "close_runs": (20, 5, 2),
    "spawn_runs": (20, 5, 2),
    "reap_runs": (10, 3, 1),
    "resumes": (30, 8, 2),
    "rss_runs": (3, 1, 1),
    "registry_ops": (10_000, 2_000, 200),
    "turns": (2_000, 200, 50),
    "task_ops": (10_000, 2_000, 200),
    "measure_rounds": (500, 100, 10),
    "remote_turns": (1_000, 200, 20),
    "remote_updates": (100_000, 20_000, 2_000),
    "remote_idle": (200, 50, 5),
    "remote_sessions": (40, 10, 2),
    "attach_updates": (1_000_000, 100_000, 10_000),
    "attach_rounds": (5, 3, 1),
    "attach_round_trips": (300, 50, 10),
}
"""The options each size of run sets: (full, ``--quick``, ``--smoke``)."""

TARGET_COLUMNS = (
    Column("figure", lambda row: str(row["name"])),
    Column("value", lambda row: fmt(row["value"], 2, " " + row["unit"])),
    Column("target", lambda row: f"{'>=' if row.get('at_least') else '<='} {row['target']:g} {row['unit']}"),
    Column("result", lambda row: "n/a" if row["met"] is None else ("met" if row["met"] else "MISSED")),
)


def render(report: Report) -> str:
    machine = report.machine
    out = [
        "# acp-proxy benchmarks",
        "",
        f"Machine: {machine['cpu_model']}, {machine['cpus_usable']} usable cores "
        f"({machine['cpu_count']} online), Linux {machine['kernel']}, "
        f"Python {machine['python']}, msgspec {machine['versions'].get('msgspec')}, "
        f"anyio {machine['versions'].get('anyio')}, trio {machine['versions'].get('trio')}",
        "",
    ]
    for section in SECTIONS:
        out += section.render(report)
    if report.targets:
        out += ["## Targets", "", *render_table(TARGET_COLUMNS, report.targets)]
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
    versions: dict[str, str | None] = {}
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
        help="a fast check: 300,000 updates (5 runs), 1,000 round trips, 5 cold starts, 5 closes and spawns, "
        "3 reapings, 8 resumes, 1 memory run, 2,000 registry operations, 200 prompt turns, 2,000 task writes, "
        "1 burst of turns per load session, 3 per install session, 200 remote turns, 20,000 remote updates, "
        "50 idle remote connections, 10 remote sessions, 100,000 attach updates in 3 rounds, 50 attach turns",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="every section once at its smallest (under 2 minutes): a check that each benchmark runs, "
        "not figures to quote",
    )
    parser.add_argument("--updates", type=int, help="session/update lines per prompt (1,000,000)")
    parser.add_argument("--round-trips", type=int, help="latency round trips (10,000)")
    parser.add_argument("--cold-starts", type=int, help="cold starts per command (20)")
    parser.add_argument(
        "--repeat",
        type=int,
        help="throughput runs per relay and client, median reported (3; --quick: 5 of its shorter flood)",
    )
    parser.add_argument(
        "--backends",
        help="proxy event loops to measure, comma-separated (default: asyncio,trio; --smoke: asyncio)",
    )
    parser.add_argument("--close-runs", type=int, help="ownership: closes per adapter and runner (20; --quick: 5)")
    parser.add_argument("--spawn-runs", type=int, help="ownership: spawns per runner (20; --quick: 5)")
    parser.add_argument("--reap-runs", type=int, help="ownership: Owner.start runs per state dir (10; --quick: 3)")
    parser.add_argument("--dead-leases", type=int, default=100, help="ownership: dead leases to reap (100)")
    parser.add_argument(
        "--cgroups",
        choices=("auto", "off"),
        default="auto",
        help="ownership: [ownership] cgroups for the trees (auto: a cgroup each where this process may make one)",
    )
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
        "--measure-rounds",
        type=int,
        help="measuring: rounds per memory reader and dead-proxy checks (500; --quick: 100)",
    )
    parser.add_argument("--remote-turns", type=int, help="remote: short turns per transport (1,000; --quick: 200)")
    parser.add_argument(
        "--remote-updates", type=int, help="remote: updates in the streaming turn (100,000; --quick: 20,000)"
    )
    parser.add_argument("--remote-idle", type=int, help="remote: idle WebSockets on one serve (200; --quick: 50)")
    parser.add_argument(
        "--remote-sessions", type=int, help="remote: live sessions over serve's connections (40; --quick: 10)"
    )
    parser.add_argument(
        "--attach-updates", type=int, help="attach: updates in each streaming turn (1,000,000; --quick: 100,000)"
    )
    parser.add_argument(
        "--attach-rounds", type=int, help="attach: streaming turns per case, median reported (5; --quick: 3)"
    )
    parser.add_argument(
        "--attach-round-trips", type=int, help="attach: permission turns per answering client (300; --quick: 50)"
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
    if args.smoke:
        args.quick = True  # and smaller still: whatever the sections size by --quick is quick-sized
    for name, (full, quick, smoke) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else quick if args.quick else full)
    if args.backends is None:
        args.backends = "asyncio" if args.smoke else "asyncio,trio"
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
    if min(args.turns, args.task_ops, args.measure_rounds) < 1:
        parser.error("--turns, --task-ops and --measure-rounds must be at least 1")
    if min(args.remote_turns, args.remote_updates, args.remote_idle, args.remote_sessions) < 1:
        parser.error("--remote-turns, --remote-updates, --remote-idle and --remote-sessions must be at least 1")
    if min(args.attach_updates, args.attach_rounds, args.attach_round_trips) < 1:
        parser.error("--attach-updates, --attach-rounds and --attach-round-trips must be at least 1")
    if args.min_idle is not None and args.min_idle < 0:
        parser.error("--min-idle must not be negative")
    if args.replay < 0:
        parser.error("--replay must not be negative")
    if min(args.stdin_grace, args.term_grace) < 0:
        parser.error("--stdin-grace and --term-grace must not be negative")
    return args


WARM_IMPORTS: Final = (
    "acp_proxy.main",
    "acp_proxy.serve",
    "acp_proxy.remote.server",
    "acp_proxy.remote.bridge",
    "anyio._backends._asyncio",
    "anyio._backends._trio",
    "hypercorn.asyncio",
    "hypercorn.trio",
)
"""What the processes the benchmarks start import, the standard library's and the dependencies' modules with it."""


def compile_once() -> None:
    """Every process the benchmarks start reads its bytecode from ``PYCACHE`` (the standard library's too): written
    now, so that no measured start (the first cold start, the first proxy's memory) compiles it."""
    env = child_environment()
    compiled = [sys.executable, "-m", "compileall", "-q", "acp_proxy", "wrappers", "benchmarks", "tests"]
    subprocess.run(compiled, cwd=ROOT, env=env, check=False, capture_output=True, timeout=300)
    imported = [sys.executable, "-c", f"for name in {list(WARM_IMPORTS)!r}: __import__(name)"]
    subprocess.run(imported, cwd=ROOT, env=env, check=False, capture_output=True, timeout=300)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = Report(
        options={
            "quick": args.quick,
            "smoke": args.smoke,
            "updates": args.updates,
            "round_trips": args.round_trips,
            "cold_starts": args.cold_starts,
            "repeat": args.repeat,
            "backends": args.backends,
            "close_runs": args.close_runs,
            "spawn_runs": args.spawn_runs,
            "reap_runs": args.reap_runs,
            "dead_leases": args.dead_leases,
            "cgroups": args.cgroups,
            "stdin_grace": args.stdin_grace,
            "term_grace": args.term_grace,
            "resumes": args.resumes,
            "replay": args.replay,
            "rss_runs": args.rss_runs,
            "registry_ops": args.registry_ops,
            "turns": args.turns,
            "task_ops": args.task_ops,
            "measure_rounds": args.measure_rounds,
            "remote_turns": args.remote_turns,
            "remote_updates": args.remote_updates,
            "remote_idle": args.remote_idle,
            "remote_sessions": args.remote_sessions,
            "attach_updates": args.attach_updates,
            "attach_rounds": args.attach_rounds,
            "attach_round_trips": args.attach_round_trips,
            "min_idle": args.min_idle,
            "only": sorted(args.only),
        },
        machine=machine_info(),
    )
    started = time.perf_counter()
    if args.smoke:
        common.PYCACHE = None  # its figures are not for quoting: nothing compiled for it
    else:
        compile_once()
    for section in SECTIONS:
        if args.only.intersection(section.names):
            section.measure(report, args)
    for section in SECTIONS:
        report.targets += [target.row() for target in section.targets(report)]
    report.options["elapsed_s"] = time.perf_counter() - started
    print(render(report), flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report.__dict__, indent=2) + "\n")
    progress(f"wrote {args.output} ({report.options['elapsed_s']:.0f} s)")
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
