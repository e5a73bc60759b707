"""Process-ownership benchmarks: what owning an adapter's process tree costs.

Every adapter here is ``benchmarks/tree_adapter.py``: it forks a child and a
grandchild that sleep, prints one line when the tree is up, and then either exits
on stdin EOF (*cooperative*) or ignores EOF and SIGTERM, tree and all (*stubborn*).
Measured, against the same work without the proxy where that makes sense:

* close: from calling ``SupervisedProcess.stop()`` to the moment the last process
  of the tree (wrapper, adapter, child, grandchild) is gone, polled in ``/proc``
  every millisecond from a thread; the plain-``Popen`` row closes the adapter's
  stdin and times its exit (its descendants are left running, then killed here);
* spawn: from spawning to the adapter's first line, through
  ``SupervisedProcess.start`` and through a plain ``subprocess.Popen``; and the
  wrapper's RSS once the adapter has answered;
* startup reaping: ``Owner.start`` on a state dir holding dead instances' leases,
  against ``Owner.start`` on an empty state dir.

Every process started here carries ``ACP_PROXY_BENCH=<token>`` in its
environment; at the end ``/proc`` is searched for it, and anything found is a
failed run (and is killed).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import secrets
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio

from acp_proxy.config import ShutdownConfig
from acp_proxy.ownership.instances import start_instance
from acp_proxy.ownership.leases import ACTIVE_STATES, LeaseState, create_lease, get_lease, record_spawn, set_state
from acp_proxy.ownership.owner import Owner
from acp_proxy.ownership.proctable import ProcFS
from acp_proxy.ownership.reaping import prepare_tombstone
from acp_proxy.ownership.supervised import SupervisedProcess, WrapperFailed, wrapper_grace
from acp_proxy.state import StateDB
from benchmarks.common import (
    BENCH_MARKER,
    ROOT,
    BenchError,
    Report,
    attempt,
    child_environment,
    fmt,
    leftovers,
    percentile,
    proc_status_kb,
    progress,
    proxy_mode,
    table,
    verdict,
)
from tests.kit.markers import alive, start_ticks

TREE_ADAPTER = ROOT / "benchmarks" / "tree_adapter.py"
COOPERATIVE = "cooperative"
STUBBORN = "stubborn"
DIRECT = "direct"

POLL_INTERVAL = 0.001
READY_TIMEOUT = 30.0
GONE_TIMEOUT = 15.0
REAP_GRACE = 3.0
DEAD_INSTANCES = 10

TARGET_CLOSE_COOPERATIVE_MS = 50.0
TARGET_CLOSE_OVER_GRACE_MS = 100.0
TARGET_SPAWN_ADDED_MS = 25.0
TARGET_WRAPPER_RSS_MB = 12.0
TARGET_REAP_MS = 200.0

DEFAULT_SHUTDOWN = ShutdownConfig()
TREE = ("adapter", "child", "grandchild")


def mode_label(mode: str) -> str:
    if mode.startswith("proxy-"):
        return f"SupervisedProcess ({mode.removeprefix('proxy-')})"
    return "plain Popen (no proxy)"


def adapter_argv(kind: str) -> list[str]:
    return [sys.executable, str(TREE_ADAPTER), kind]


# --- processes -------------------------------------------------------------------------


def kill_if_alive(pid: int, ticks: int | None) -> None:
    """SIGKILL a process this benchmark started, if it is still that process."""
    if alive(pid, ticks):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class GoneWatcher:
    """When each of some processes is gone: a thread polls ``/proc`` every ``POLL_INTERVAL``.

    A process counts as gone once it has no ``/proc`` entry, is a zombie (it has
    exited; only its parent's ``wait`` is missing), or its pid names a process
    with another start time.
    """

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.ticks = {name: start_ticks(pid) for name, pid in pids.items()}
        self.gone_at: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> GoneWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        pending = dict(self.pids)
        while pending and not self._stop.is_set():
            now = time.perf_counter()
            for name, pid in list(pending.items()):
                if not alive(pid, self.ticks[name]):
                    self.gone_at[name] = now
                    del pending[name]
            if pending:
                time.sleep(POLL_INTERVAL)

    def running(self) -> list[str]:
        return [name for name, pid in self.pids.items() if alive(pid, self.ticks[name])]

    def wait(self, timeout: float) -> list[str]:
        """Wait until every process is gone or ``timeout`` passes; the names still running."""
        deadline = time.monotonic() + timeout
        while (left := self.running()) and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL)
        return left

    def kill_all(self) -> None:
        for name, pid in self.pids.items():
            kill_if_alive(pid, self.ticks[name])


def parse_ready(line: bytes, who: str) -> dict[str, int]:
    try:
        ready = json.loads(line)
        return {name: int(ready[key]) for name, key in zip(TREE, ("pid", "child", "grandchild"), strict=True)}
    except (ValueError, KeyError, TypeError):
        raise BenchError(f"{who}: the adapter's first line is not its tree: {line[:200]!r}") from None


def read_line_sync(fd: int, timeout: float, who: str) -> bytes:
    deadline = time.monotonic() + timeout
    data = b""
    while not data.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            raise BenchError(f"{who}: no first line from the adapter within {timeout:.0f} s")
        chunk = os.read(fd, 4096)
        if not chunk:
            raise BenchError(f"{who}: the adapter closed its output before its first line")
        data += chunk
    return data


class DirectTree:
    """The adapter under a plain ``Popen`` (own session, pipes): the no-proxy baseline."""

    def __init__(self, kind: str, env: dict[str, str]) -> None:
        self.started = time.perf_counter()
        self.process = subprocess.Popen(
            adapter_argv(kind),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,
            bufsize=0,
        )
        self.watcher: GoneWatcher | None = None

    def ready(self) -> GoneWatcher:
        """Read the adapter's first line; a watcher (not yet started) over its tree."""
        assert self.process.stdout is not None
        line = read_line_sync(self.process.stdout.fileno(), READY_TIMEOUT, mode_label(DIRECT))
        self.watcher = GoneWatcher(parse_ready(line, mode_label(DIRECT)))
        return self.watcher

    def close(self) -> None:
        """Kill what is left of the tree (its process group, which nothing here leaves) and wait."""
        # The adapter leads the group, and its pid cannot name another group while the
        # unreaped leader or any member exists: this reaches only processes of this tree.
        if self.process.returncode is None or (self.watcher is not None and self.watcher.running()):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        if self.watcher is not None:
            self.watcher.kill_all()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        if self.watcher is not None and (left := self.watcher.wait(GONE_TIMEOUT)):
            raise BenchError(f"{mode_label(DIRECT)}: {', '.join(left)} survived SIGKILL")


@contextlib.contextmanager
def direct_tree(kind: str, env: dict[str, str]) -> Iterator[DirectTree]:
    tree = DirectTree(kind, env)
    try:
        yield tree
    finally:
        tree.close()


async def start_supervised(
    owner: Owner, kind: str, env: dict[str, str], term_grace: float
) -> tuple[SupervisedProcess, dict[str, int]]:
    """Start the adapter under its wrapper and read its first line (its tree's pids)."""
    who = "SupervisedProcess"
    try:
        sp = await SupervisedProcess.start(
            owner, backend="bench", argv=adapter_argv(kind), env=env, cwd=None, term_grace=term_grace
        )
    except WrapperFailed as exc:
        raise BenchError(f"{who}: {exc}") from None
    try:
        data = b""
        with anyio.fail_after(READY_TIMEOUT):
            while not data.endswith(b"\n"):
                data += await sp.stdout.receive()
        tree = parse_ready(data, who)
        if tree["adapter"] != sp.lease.adapter_pid:
            raise BenchError(f"{who}: the adapter says pid {tree['adapter']}, its lease {sp.lease.adapter_pid}")
    except BaseException as exc:
        await stop_quietly(sp, term_grace)
        if isinstance(exc, TimeoutError):
            raise BenchError(f"{who}: no first line from the adapter within {READY_TIMEOUT:.0f} s") from None
        if isinstance(exc, anyio.EndOfStream):
            raise BenchError(f"{who}: the adapter closed its output before its first line") from None
        raise
    return sp, {"wrapper": sp.process.pid, **tree}


async def stop_quietly(sp: SupervisedProcess, term_grace: float) -> None:
    with anyio.CancelScope(shield=True):
        await sp.stop(stdin_grace=0, term_grace=term_grace)
        await sp.stdout.aclose()


def check_closed(sp: SupervisedProcess) -> None:
    lease = get_lease(sp.owner.db, sp.lease.lease_id)
    if lease.state is not LeaseState.CLOSED:
        raise BenchError(f"lease {lease.lease_id} ended {lease.state.value}: {lease.reason}")


# --- (1) close -> last process gone ----------------------------------------------------------


def ms_since(start: float, moment: float | None) -> float | None:
    return None if moment is None else (moment - start) * 1000


def supervised_close_once(
    owner: Owner, kind: str, env: dict[str, str], stdin_grace: float, term_grace: float, backend: str
) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        sp, tree = await start_supervised(owner, kind, env, term_grace)
        watcher = GoneWatcher(tree)
        try:
            with watcher:
                start = time.perf_counter()
                await sp.stop(stdin_grace=stdin_grace, term_grace=term_grace)
                returned = time.perf_counter()
                left = watcher.wait(GONE_TIMEOUT)
        finally:
            watcher.kill_all()
            await stop_quietly(sp, term_grace)
        if left:
            raise BenchError(f"{', '.join(left)} still running {GONE_TIMEOUT:.0f} s after stop() returned")
        check_closed(sp)
        gone = {name: ms_since(start, watcher.gone_at.get(name)) for name in tree}
        return {
            "stop_ms": (returned - start) * 1000,
            "adapter_gone_ms": gone["adapter"],
            "tree_gone_ms": max(gone[name] or 0.0 for name in TREE),
            "last_gone_ms": max(value or 0.0 for value in gone.values()),
            "left_running": 0,
        }

    result: dict[str, Any] = anyio.run(run, backend=backend)
    return result


def wait_exit(process: subprocess.Popen[bytes], timeout: float) -> bool:
    """Wait for a child to exit, woken by its pidfd (``Popen.wait(timeout)`` polls in growing sleeps)."""
    pidfd = os.pidfd_open(process.pid)
    try:
        exited = bool(select.select([pidfd], [], [], timeout)[0])
    finally:
        os.close(pidfd)
    if exited:
        process.wait()
    return exited


def direct_close_once(env: dict[str, str]) -> dict[str, Any]:
    """Close the adapter's stdin and wait for it to exit; count the descendants it leaves behind."""
    with direct_tree(COOPERATIVE, env) as tree:
        watcher = tree.ready()
        stdin = tree.process.stdin
        assert stdin is not None
        with watcher:
            start = time.perf_counter()
            stdin.close()
            if not wait_exit(tree.process, GONE_TIMEOUT):
                raise BenchError(f"{mode_label(DIRECT)}: the adapter ignored stdin EOF")
            returned = time.perf_counter()
            time.sleep(0.05)  # the descendants have had their chance to go
            left = watcher.running()
            gone_at = dict(watcher.gone_at)
    return {
        "stop_ms": (returned - start) * 1000,
        "adapter_gone_ms": ms_since(start, gone_at.get("adapter")),
        "tree_gone_ms": None,
        "last_gone_ms": None,
        "left_running": len(left),
    }


def close_cases(backends: list[str]) -> list[tuple[str, str]]:
    return [
        (COOPERATIVE, DIRECT),
        *((COOPERATIVE, proxy_mode(b)) for b in backends),
        *((STUBBORN, proxy_mode(b)) for b in backends),
    ]


def graces(kind: str, args: argparse.Namespace) -> tuple[float, float]:
    if kind == COOPERATIVE:
        return DEFAULT_SHUTDOWN.stdin_grace, DEFAULT_SHUTDOWN.term_grace
    return args.stdin_grace, args.term_grace


def close_target_ms(kind: str, args: argparse.Namespace) -> float:
    if kind == COOPERATIVE:
        return TARGET_CLOSE_COOPERATIVE_MS
    stdin_grace, term_grace = graces(kind, args)
    return (stdin_grace + term_grace) * 1000 + TARGET_CLOSE_OVER_GRACE_MS


def measure_close(report: Report, owner: Owner, env: dict[str, str], args: argparse.Namespace) -> list[dict[str, Any]]:
    cases = close_cases(args.backends)

    def once(kind: str, mode: str) -> dict[str, Any]:
        if mode == DIRECT:
            return direct_close_once(env)
        stdin_grace, term_grace = graces(kind, args)
        return supervised_close_once(owner, kind, env, stdin_grace, term_grace, mode.removeprefix("proxy-"))

    runs = interleaved(report, "close", cases, args.close_runs, once)
    rows = []
    for (kind, mode), samples in runs.items():
        if not samples:
            continue
        stdin_grace, term_grace = graces(kind, args)

        def stat(key: str, q: float, samples: list[dict[str, Any]] = samples) -> float | None:
            values = sorted(s[key] for s in samples if s[key] is not None)
            return percentile(values, q) if values else None

        row: dict[str, Any] = {
            "adapter": kind,
            "mode": mode,
            "runs": len(samples),
            "stdin_grace_s": None if mode == DIRECT else stdin_grace,
            "term_grace_s": None if mode == DIRECT else term_grace,
            "left_running": sum(s["left_running"] for s in samples),
            "descendants": 2 * len(samples),
            "target_ms": None if mode == DIRECT else close_target_ms(kind, args),
            "all": samples,
        }
        for key in ("stop_ms", "adapter_gone_ms", "tree_gone_ms", "last_gone_ms"):
            row[key.replace("_ms", "_p50_ms")] = stat(key, 50)
            row[key.replace("_ms", "_p90_ms")] = stat(key, 90)
        if kind == STUBBORN:
            # The wrapper's own TERM->KILL grace lies inside ours: the tree goes after this long.
            row["floor_ms"] = (stdin_grace + wrapper_grace(term_grace)) * 1000
        rows.append(row)
    direct = next((row for row in rows if row["mode"] == DIRECT), None)
    for row in rows:
        added = None
        if direct and row["adapter"] == COOPERATIVE and row["mode"] != DIRECT and row["last_gone_p50_ms"] is not None:
            added = row["last_gone_p50_ms"] - direct["adapter_gone_p50_ms"]
        row["added_p50_ms"] = added
    return rows


# --- (2) spawn overhead ----------------------------------------------------------------------


def supervised_spawn_once(owner: Owner, env: dict[str, str], backend: str) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        term_grace = DEFAULT_SHUTDOWN.term_grace
        start = time.perf_counter()
        sp, tree = await start_supervised(owner, COOPERATIVE, env, term_grace)
        ready_ms = (time.perf_counter() - start) * 1000
        watcher = GoneWatcher(tree)
        try:
            rss = proc_status_kb(tree["wrapper"], "VmRSS")
            hwm = proc_status_kb(tree["wrapper"], "VmHWM")
            adapter_rss = proc_status_kb(tree["adapter"], "VmRSS")
            await sp.stop(stdin_grace=DEFAULT_SHUTDOWN.stdin_grace, term_grace=term_grace)
            with watcher:
                left = watcher.wait(GONE_TIMEOUT)
        finally:
            watcher.kill_all()
            await stop_quietly(sp, term_grace)
        if left:
            raise BenchError(f"{', '.join(left)} still running {GONE_TIMEOUT:.0f} s after stop() returned")
        check_closed(sp)
        return {
            "ready_ms": ready_ms,
            "wrapper_rss_mb": None if rss is None else rss / 1024,
            "wrapper_hwm_mb": None if hwm is None else hwm / 1024,
            "adapter_rss_mb": None if adapter_rss is None else adapter_rss / 1024,
        }

    result: dict[str, Any] = anyio.run(run, backend=backend)
    return result


def direct_spawn_once(env: dict[str, str]) -> dict[str, Any]:
    with direct_tree(COOPERATIVE, env) as tree:
        tree.ready()
        ready_ms = (time.perf_counter() - tree.started) * 1000
        adapter_rss = proc_status_kb(tree.process.pid, "VmRSS")
    return {
        "ready_ms": ready_ms,
        "wrapper_rss_mb": None,
        "wrapper_hwm_mb": None,
        "adapter_rss_mb": None if adapter_rss is None else adapter_rss / 1024,
    }


def measure_spawn(report: Report, owner: Owner, env: dict[str, str], args: argparse.Namespace) -> list[dict[str, Any]]:
    cases = [(COOPERATIVE, DIRECT), *((COOPERATIVE, proxy_mode(b)) for b in args.backends)]

    def once(kind: str, mode: str) -> dict[str, Any]:
        if mode == DIRECT:
            return direct_spawn_once(env)
        return supervised_spawn_once(owner, env, mode.removeprefix("proxy-"))

    runs = interleaved(report, "spawn", cases, args.spawn_runs, once)
    rows = []
    for (_, mode), samples in runs.items():
        if not samples:
            continue
        ready = sorted(s["ready_ms"] for s in samples)
        rss = sorted(s["wrapper_rss_mb"] for s in samples if s["wrapper_rss_mb"] is not None)
        hwm = [s["wrapper_hwm_mb"] for s in samples if s["wrapper_hwm_mb"] is not None]
        rows.append(
            {
                "mode": mode,
                "runs": len(samples),
                "median_ms": statistics.median(ready),
                "min_ms": ready[0],
                "p90_ms": percentile(ready, 90),
                "wrapper_rss_median_mb": statistics.median(rss) if rss else None,
                "wrapper_rss_max_mb": rss[-1] if rss else None,
                "wrapper_hwm_max_mb": max(hwm) if hwm else None,
                "all": samples,
            }
        )
    direct = next((row for row in rows if row["mode"] == DIRECT), None)
    for row in rows:
        row["added_ms"] = row["median_ms"] - direct["median_ms"] if direct and row["mode"] != DIRECT else None
    return rows


# --- (3) startup reaping ---------------------------------------------------------------------


def vanished_process() -> tuple[int, int]:
    """The pid and start time of a process that has exited (and been reaped)."""
    process = subprocess.Popen(["true"])
    info = ProcFS().info(process.pid)  # running or a zombie: not reaped before wait()
    process.wait()
    if info is None:
        raise BenchError(f"cannot read /proc/{process.pid}/stat of a child not yet reaped")
    return process.pid, info.start_ticks


def build_dead_state(state_dir: Path, leases: int, dead_instances: int) -> None:
    """A state dir holding ``leases`` open leases of dead instances, as proxies killed outright leave it.

    Each lease names a wrapper and an adapter that have exited, and has the
    tombstone its wrapper writes once the tree is down (its lifeline broke).
    """
    db = StateDB(state_dir)
    try:
        boot = ProcFS().boot_id()
        made = 0
        for index in range(dead_instances):
            instance = start_instance(db, boot)
            try:
                share = leases // dead_instances + (1 if index < leases % dead_instances else 0)
                for _ in range(share):
                    lease = create_lease(
                        db,
                        instance_id=instance.instance_id,
                        boot_id=boot,
                        backend="bench",
                        argv=tuple(adapter_argv(COOPERATIVE)),
                    )
                    wrapper_pid, wrapper_ticks = vanished_process()
                    adapter_pid, adapter_ticks = vanished_process()
                    record_spawn(
                        db,
                        lease.lease_id,
                        wrapper_pid=wrapper_pid,
                        wrapper_start_ticks=wrapper_ticks,
                        adapter_pid=adapter_pid,
                        adapter_start_ticks=adapter_ticks,
                        pgid=adapter_pid,
                    )
                    set_state(db, lease.lease_id, LeaseState.OPEN)
                    prepare_tombstone(db, lease.lease_id).write_text(json.dumps({"status": 0, "at": time.time()}))
                    made += 1
            finally:
                os.close(instance.lock_fd)  # the instance is dead now: its lock can be taken
    finally:
        db.close()
    if made != leases:
        raise BenchError(f"built {made} dead leases, not {leases}")


def lease_states(db: StateDB) -> Counter[str]:
    return Counter({row[0]: row[1] for row in db.conn.execute("SELECT state, COUNT(*) FROM leases GROUP BY state")})


def process_count() -> int:
    return sum(name.isdigit() for name in os.listdir("/proc"))


def owner_start_once(state_dir: Path, expect_reaped: int) -> dict[str, Any]:
    processes = process_count()
    start = time.perf_counter()
    owner = Owner.start(state_dir, grace=REAP_GRACE)
    elapsed = (time.perf_counter() - start) * 1000
    try:
        states = lease_states(owner.db)
    finally:
        owner.close()
    active = sum(states[state.value] for state in ACTIVE_STATES)
    if len(owner.reaped) != expect_reaped or active:
        raise BenchError(
            f"Owner.start reaped {len(owner.reaped)} of {expect_reaped} leases; {active} still active ({dict(states)})"
        )
    return {"ms": elapsed, "reaped": len(owner.reaped), "states": dict(states), "processes": processes}


REAP_CASES = ("empty", "database", "dead")


def reap_case_label(case: str, leases: int) -> str:
    return {
        "empty": "empty state dir (new database)",
        "database": "existing database, nothing to reap",
        "dead": f"{leases} dead leases ({DEAD_INSTANCES} dead instances)",
    }[case]


def measure_reaping(report: Report, workdir: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    counter = iter(range(1_000_000))

    def once(case: str, _: str) -> dict[str, Any]:
        state_dir = workdir / f"state-{next(counter)}"
        if case == "database":
            StateDB(state_dir).close()
        elif case == "dead":
            build_dead_state(state_dir, args.dead_leases, min(DEAD_INSTANCES, args.dead_leases))
        return owner_start_once(state_dir, args.dead_leases if case == "dead" else 0)

    runs = interleaved(report, "reaping", [(case, "") for case in REAP_CASES], args.reap_runs, once)
    rows = []
    for (case, _), samples in runs.items():
        if not samples:
            continue
        times = sorted(s["ms"] for s in samples)
        rows.append(
            {
                "case": case,
                "label": reap_case_label(case, args.dead_leases),
                "leases": args.dead_leases if case == "dead" else 0,
                "runs": len(samples),
                "median_ms": statistics.median(times),
                "min_ms": times[0],
                "p90_ms": percentile(times, 90),
                "reaped": samples[-1]["reaped"],
                "states": samples[-1]["states"],
                "processes_median": statistics.median(s["processes"] for s in samples),
                "all_ms": [s["ms"] for s in samples],
            }
        )
    empty = next((row for row in rows if row["case"] == "empty"), None)
    for row in rows:
        row["added_ms"] = row["median_ms"] - empty["median_ms"] if empty and row["case"] != "empty" else None
    return rows


# --- the section -----------------------------------------------------------------------------


def interleaved(
    report: Report,
    what: str,
    cases: list[tuple[str, str]],
    runs: int,
    once: Callable[[str, str], dict[str, Any]],
) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """One untimed warm-up per case, then ``runs`` rounds over all cases (a failing case is dropped)."""
    samples: dict[tuple[str, str], list[dict[str, Any]]] = {case: [] for case in cases}
    broken: set[tuple[str, str]] = set()

    def name(case: tuple[str, str]) -> str:
        kind, mode = case
        return f"{what} {kind}" + (f" {mode_label(mode)}" if mode else "")

    for case in cases:
        if attempt(report, name(case), functools.partial(once, *case)) is None:
            broken.add(case)
    for round_ in range(runs):
        progress(f"ownership: {what}, round {round_ + 1}/{runs} ...")
        for case in cases:
            if case in broken:
                continue
            sample = attempt(report, name(case), functools.partial(once, *case))
            if sample is None:
                broken.add(case)
            else:
                samples[case].append(sample)
    return {case: values for case, values in samples.items() if case not in broken}


def measure_ownership(report: Report, args: argparse.Namespace) -> None:
    token = secrets.token_hex(8)
    env = {**child_environment(), BENCH_MARKER: token}
    results: dict[str, Any] = {
        "close_runs": args.close_runs,
        "spawn_runs": args.spawn_runs,
        "reap_runs": args.reap_runs,
        "dead_leases": args.dead_leases,
        "cooperative_graces_s": list(graces(COOPERATIVE, args)),
        "stubborn_graces_s": list(graces(STUBBORN, args)),
        "poll_interval_ms": POLL_INTERVAL * 1000,
    }
    report.ownership = results
    with tempfile.TemporaryDirectory(prefix="acp-proxy-bench-") as workdir:
        owner = Owner.start(Path(workdir) / "state", grace=REAP_GRACE)
        try:
            progress(f"ownership: close, {args.close_runs} runs x {len(close_cases(args.backends))} cases ...")
            results["close"] = measure_close(report, owner, env, args)
            progress(f"ownership: spawn, {args.spawn_runs} runs x {1 + len(args.backends)} cases ...")
            results["spawn"] = measure_spawn(report, owner, env, args)
        finally:
            owner.close()
        progress(f"ownership: startup reaping, {args.reap_runs} runs x {len(REAP_CASES)} cases ...")
        results["reaping"] = measure_reaping(report, Path(workdir), args)
    leftover = leftovers(token, wait=0)
    results["left_running"] = leftover
    if leftover:
        report.errors.append(f"ownership: processes outlived the benchmark (killed now): {leftover}")


# --- reporting -------------------------------------------------------------------------------


def targets(report: Report) -> list[tuple[str, float | None, float, str]]:
    """(figure, value, limit, unit) for the Targets table."""
    found: list[tuple[str, float | None, float, str]] = []
    results = report.ownership
    for row in results.get("close", []):
        if row["mode"] != DIRECT:
            found.append(
                (
                    f"close -> last process gone p50, {row['adapter']} adapter, {mode_label(row['mode'])}, "
                    f"graces {row['stdin_grace_s']:g} + {row['term_grace_s']:g} s",
                    row["last_gone_p50_ms"],
                    row["target_ms"],
                    "ms",
                )
            )
    for row in results.get("spawn", []):
        if row["mode"] != DIRECT:
            label = mode_label(row["mode"])
            found.append((f"spawn to first line added, {label}", row["added_ms"], TARGET_SPAWN_ADDED_MS, "ms"))
            found.append((f"wrapper RSS (max), {label}", row["wrapper_rss_max_mb"], TARGET_WRAPPER_RSS_MB, "MB"))
    for row in results.get("reaping", []):
        if row["case"] == "dead":
            found.append((f"Owner.start with {row['label']}", row["median_ms"], TARGET_REAP_MS, "ms"))
    return found


def grace_label(row: dict[str, Any]) -> str:
    if row["stdin_grace_s"] is None:
        return ""
    return f"{row['stdin_grace_s']:g} + {row['term_grace_s']:g} s"


def render(report: Report) -> list[str]:
    results = report.ownership
    out: list[str] = []
    if results.get("close"):
        out += [
            f"## Ownership: close -> last process gone, {results['close_runs']} runs each (interleaved)",
            "",
            "`tree_adapter.py` with a child and a grandchild. `stop()` closes the adapter's stdin, waits "
            "the stdin grace, SIGTERMs the wrapper, waits the term grace, SIGKILLs, sweeps by marker. "
            "Times from calling `stop()`; a process is gone once `/proc` shows it absent or a zombie "
            f"(polled every {results['poll_interval_ms']:g} ms, so seen up to that much late). "
            "The cooperative adapter exits on stdin EOF and runs with the configured default graces, "
            "so no grace should be waited; the stubborn "
            "one ignores EOF and SIGTERM (so do its descendants), so both graces are. "
            "The plain-Popen row closes stdin and waits for the adapter (its `stop()` column is that "
            "wait); its descendants stay, and are killed by the benchmark.",
            "",
        ]
        rows = []
        for row in results["close"]:
            is_proxy = row["mode"] != DIRECT
            rows.append(
                [
                    row["adapter"],
                    mode_label(row["mode"]),
                    grace_label(row),
                    fmt(row["adapter_gone_p50_ms"], 1),
                    fmt(row["stop_p50_ms"], 1),
                    fmt(row["last_gone_p50_ms"], 1) if is_proxy else "never",
                    fmt(row["last_gone_p90_ms"], 1) if is_proxy else "never",
                    fmt(row["added_p50_ms"], 1) if row["added_p50_ms"] is not None else "",
                    f"{row['left_running']} of {row['descendants']}",
                    f"<= {row['target_ms']:g} ms" if is_proxy else "",
                    verdict(row["last_gone_p50_ms"], row["target_ms"]) if is_proxy else "",
                ]
            )
        header = [
            "adapter",
            "run by",
            "stdin + term grace",
            "adapter gone p50 ms",
            "stop() returned p50 ms",
            "last process gone p50 ms",
            "last process gone p90 ms",
            "added p50 ms (vs the adapter's own exit)",
            "descendants left running",
            "target (p50)",
            "result",
        ]
        out += table(header, rows)
        stubborn = [row for row in results["close"] if row["adapter"] == STUBBORN]
        if stubborn:
            row = stubborn[0]
            out += [
                "",
                f"* Stubborn floor: stdin grace + the wrapper's own TERM->KILL grace "
                f"(term grace - min(0.5 s, term grace / 4)) = {fmt(row['floor_ms'], 0)} ms; "
                f"target = stdin grace + term grace + {TARGET_CLOSE_OVER_GRACE_MS:g} ms.",
            ]
        out += [""]
    if results.get("spawn"):
        out += [
            f"## Ownership: spawn to the adapter's first line, {results['spawn_runs']} runs each (interleaved)",
            "",
            "From spawning (`SupervisedProcess.start`: lease rows, wrapper, report; or `subprocess.Popen`) "
            "to reading the line the adapter prints once its tree is up. The wrapper's RSS is read then.",
            "",
        ]
        rows = []
        for row in results["spawn"]:
            is_proxy = row["mode"] != DIRECT
            rows.append(
                [
                    mode_label(row["mode"]),
                    fmt(row["median_ms"], 1),
                    fmt(row["min_ms"], 1),
                    fmt(row["p90_ms"], 1),
                    fmt(row["added_ms"], 1) if is_proxy else "",
                    verdict(row["added_ms"], TARGET_SPAWN_ADDED_MS) if is_proxy else "",
                    fmt(row["wrapper_rss_median_mb"], 1) if is_proxy else "",
                    fmt(row["wrapper_rss_max_mb"], 1) if is_proxy else "",
                    fmt(row["wrapper_hwm_max_mb"], 1) if is_proxy else "",
                    verdict(row["wrapper_rss_max_mb"], TARGET_WRAPPER_RSS_MB) if is_proxy else "",
                ]
            )
        header = [
            "spawned by",
            "median ms",
            "min ms",
            "p90 ms",
            "added ms (median)",
            f"target added <= {TARGET_SPAWN_ADDED_MS:g} ms",
            "wrapper RSS MB (median)",
            "wrapper RSS MB (max)",
            "wrapper peak RSS MB (VmHWM)",
            f"target RSS <= {TARGET_WRAPPER_RSS_MB:g} MB",
        ]
        out += table(header, rows)
        out += [""]
    if results.get("reaping"):
        processes = fmt(max(row["processes_median"] for row in results["reaping"]), 0)
        out += [
            f"## Ownership: startup reaping, `Owner.start(state_dir, grace={REAP_GRACE:g})`, "
            f"{results['reap_runs']} runs each (interleaved)",
            "",
            "Dead leases: open leases of instances whose lock is free, naming a wrapper and an adapter "
            "that have exited, each with its wrapper's tombstone. Each run gets a fresh state dir. "
            "A reaping pass reads every process's environment in `/proc` once (for all leases), so "
            f"the time also grows with the number of processes on the machine: {processes} here.",
            "",
        ]
        rows = []
        for row in results["reaping"]:
            is_dead = row["case"] == "dead"
            states = ", ".join(f"{n} {state}" for state, n in sorted(row["states"].items()))
            rows.append(
                [
                    row["label"],
                    fmt(row["median_ms"], 1),
                    fmt(row["min_ms"], 1),
                    fmt(row["p90_ms"], 1),
                    fmt(row["added_ms"], 1) if row["added_ms"] is not None else "",
                    f"{row['reaped']} ({states})" if is_dead else str(row["reaped"]),
                    verdict(row["median_ms"], TARGET_REAP_MS) if is_dead else "",
                ]
            )
        header = [
            "state dir",
            "median ms",
            "min ms",
            "p90 ms",
            "added ms (median, vs empty)",
            "leases reaped (states after)",
            f"target <= {TARGET_REAP_MS:g} ms",
        ]
        out += table(header, rows)
        out += [""]
    if "left_running" in results:
        left = results["left_running"]
        out += [
            "Processes carrying this run's marker left running at the end: "
            + (", ".join(map(str, left)) + " (killed)" if left else "none"),
            "",
        ]
    return out
