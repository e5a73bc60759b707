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
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import select
import signal
import statistics
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio

from acp_proxy.config import CgroupSetting, ShutdownConfig
from acp_proxy.ownership.instances import start_instance
from acp_proxy.ownership.leases import ACTIVE_STATES, LeaseState, create_lease, get_lease, set_state
from acp_proxy.ownership.owner import Owner
from acp_proxy.ownership.proctable import ProcFS
from acp_proxy.ownership.reaping import prepare_tombstone
from acp_proxy.ownership.supervised import SupervisedProcess, WrapperFailed, wrapper_grace
from acp_proxy.state import StateDB
from benchmarks import harness
from benchmarks.common import BenchError, figures, percentile, proc_status_kb, script_argv
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
    isolated,
    known,
    left_running,
    minus,
    progress,
    proxy_mode,
    relayed,
    render_table,
    target_col,
    verdict,
    where,
    with_baseline,
)
from tests.kit.markers import alive, start_ticks
from tests.kit.proctree import Every
from tests.kit.state import record_spawn

COOPERATIVE = "cooperative"
STUBBORN = "stubborn"

POLL_INTERVAL = 0.001
READY_TIMEOUT = 30.0
GONE_TIMEOUT = 15.0
REAP_GRACE = 3.0
DEAD_INSTANCES = 10

TARGET_CLOSE_COOPERATIVE_MS = 50.0
TARGET_CLOSE_OVER_GRACE_MS = 100.0
TARGET_SPAWN_ADDED_MS = 10.0
TARGET_WRAPPER_RSS_MB = 12.0
TARGET_REAP_MS = 200.0

DEFAULT_SHUTDOWN = ShutdownConfig()
TREE = ("adapter", "child", "grandchild")


def mode_label(mode: str) -> str:
    return harness.mode_label(mode, "plain Popen (no proxy)", "SupervisedProcess")


def adapter_argv(kind: str) -> list[str]:
    return script_argv("tree_adapter.py", kind)


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
        self._pending = dict(pids)
        self._every = Every(POLL_INTERVAL, self._poll, "gone-watcher")

    def __enter__(self) -> GoneWatcher:
        self._every.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._every.__exit__()

    def _poll(self) -> None:
        now = time.perf_counter()
        for name, pid in list(self._pending.items()):
            if not alive(pid, self.ticks[name]):
                self.gone_at[name] = now
                del self._pending[name]

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


@contextlib.asynccontextmanager
async def watched(sp: SupervisedProcess, tree: dict[str, int], term_grace: float) -> AsyncIterator[GoneWatcher]:
    """A watcher over the supervised tree; whatever happens, nothing of the tree is left afterwards."""
    watcher = GoneWatcher(tree)
    try:
        yield watcher
    finally:
        watcher.kill_all()
        await stop_quietly(sp, term_grace)


def check_gone(sp: SupervisedProcess, left: list[str]) -> None:
    """``stop()`` ended the whole tree in time and closed its lease."""
    if left:
        raise BenchError(f"{', '.join(left)} still running {GONE_TIMEOUT:.0f} s after stop() returned")
    check_closed(sp)


async def stop_quietly(sp: SupervisedProcess, term_grace: float) -> None:
    with anyio.CancelScope(shield=True):
        await sp.stop(stdin_grace=0, term_grace=term_grace)
        await sp.stdout.aclose()


def check_closed(sp: SupervisedProcess) -> None:
    sp.owner.db.settle()  # a lease's last state is queued for the state writer, as the proxy writes it
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
        async with watched(sp, tree, term_grace) as watcher:
            with watcher:
                start = time.perf_counter()
                await sp.stop(stdin_grace=stdin_grace, term_grace=term_grace)
                returned = time.perf_counter()
                left = watcher.wait(GONE_TIMEOUT)
        check_gone(sp, left)
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

    runs = interleaved(report, "ownership: close", ownership_cases("close", cases, once), args.close_runs)
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
        async with watched(sp, tree, term_grace) as watcher:
            rss = proc_status_kb(tree["wrapper"], "VmRSS")
            hwm = proc_status_kb(tree["wrapper"], "VmHWM")
            adapter_rss = proc_status_kb(tree["adapter"], "VmRSS")
            await sp.stop(stdin_grace=DEFAULT_SHUTDOWN.stdin_grace, term_grace=term_grace)
            with watcher:
                left = watcher.wait(GONE_TIMEOUT)
        check_gone(sp, left)
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

    runs = interleaved(report, "ownership: spawn", ownership_cases("spawn", cases, once), args.spawn_runs)
    rows = []
    for (_, mode), samples in runs.items():
        if not samples:
            continue
        rss = sorted(s["wrapper_rss_mb"] for s in samples if s["wrapper_rss_mb"] is not None)
        hwm = [s["wrapper_hwm_mb"] for s in samples if s["wrapper_hwm_mb"] is not None]
        rows.append(
            {
                "mode": mode,
                "runs": len(samples),
                **figures("ms", (s["ready_ms"] for s in samples), "median", "min", "p90"),
                "wrapper_rss_median_mb": statistics.median(rss) if rss else None,
                "wrapper_rss_max_mb": rss[-1] if rss else None,
                "wrapper_hwm_max_mb": max(hwm) if hwm else None,
                "all": samples,
            }
        )
    direct = next((row for row in rows if row["mode"] == DIRECT), None)
    with_baseline(rows, direct, {"added_ms": ("median_ms", minus)})
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


def owner_start_once(state_dir: Path, expect_reaped: int, cgroup_setting: CgroupSetting) -> dict[str, Any]:
    processes = process_count()
    start = time.perf_counter()
    owner = Owner.start(state_dir, grace=REAP_GRACE, cgroups=cgroup_setting)
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
        return owner_start_once(state_dir, args.dead_leases if case == "dead" else 0, args.cgroups)

    cases = ownership_cases("reaping", [(case, "") for case in REAP_CASES], once)
    runs = interleaved(report, "ownership: startup reaping", cases, args.reap_runs)
    rows = []
    for (case, _), samples in runs.items():
        if not samples:
            continue
        rows.append(
            {
                "case": case,
                "label": reap_case_label(case, args.dead_leases),
                "leases": args.dead_leases if case == "dead" else 0,
                "runs": len(samples),
                **figures("ms", (s["ms"] for s in samples), "median", "min", "p90"),
                "reaped": samples[-1]["reaped"],
                "states": samples[-1]["states"],
                "processes_median": statistics.median(s["processes"] for s in samples),
                "all_ms": [s["ms"] for s in samples],
            }
        )
    empty = next((row for row in rows if row["case"] == "empty"), None)
    with_baseline(rows, empty, {"added_ms": ("median_ms", minus)})
    return rows


# --- the section -----------------------------------------------------------------------------


def ownership_cases(
    what: str, keys: list[tuple[str, str]], once: Callable[[str, str], dict[str, Any]]
) -> list[Case[tuple[str, str]]]:
    """A case per (adapter kind or state dir, how it is run)."""

    def label(kind: str, mode: str) -> str:
        return f"{what} {kind}" + (f" {mode_label(mode)}" if mode else "")

    return [Case(key, label(*key), functools.partial(once, *key)) for key in keys]


def measure_ownership(report: Report, args: argparse.Namespace) -> None:
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
    with isolated(report, "ownership", results, wait=0) as run:
        owner = Owner.start(run.workdir / "state", grace=REAP_GRACE, cgroups=args.cgroups)
        results["mode"] = "cgroup" if owner.cgroup is not None else "markers"
        try:
            progress(f"ownership: close, {args.close_runs} runs x {len(close_cases(args.backends))} cases ...")
            results["close"] = measure_close(report, owner, run.env, args)
            progress(f"ownership: spawn, {args.spawn_runs} runs x {1 + len(args.backends)} cases ...")
            results["spawn"] = measure_spawn(report, owner, run.env, args)
        finally:
            owner.close()
        progress(f"ownership: startup reaping, {args.reap_runs} runs x {len(REAP_CASES)} cases ...")
        results["reaping"] = measure_reaping(report, run.workdir, args)


# --- reporting -------------------------------------------------------------------------------


def targets(report: Report) -> list[Target]:
    found: list[Target] = []
    results = report.ownership
    for row in results.get("close", []):
        if row["mode"] != DIRECT:
            name = (
                f"close -> last process gone p50, {row['adapter']} adapter, {mode_label(row['mode'])}, "
                f"graces {row['stdin_grace_s']:g} + {row['term_grace_s']:g} s"
            )
            found.append(Target(name, row["last_gone_p50_ms"], row["target_ms"], "ms"))
    for row in results.get("spawn", []):
        if row["mode"] != DIRECT:
            label = mode_label(row["mode"])
            found.append(Target(f"spawn to first line added, {label}", row["added_ms"], TARGET_SPAWN_ADDED_MS, "ms"))
            found.append(Target(f"wrapper RSS (max), {label}", row["wrapper_rss_max_mb"], TARGET_WRAPPER_RSS_MB, "MB"))
    for row in results.get("reaping", []):
        if row["case"] == "dead":
            found.append(Target(f"Owner.start with {row['label']}", row["median_ms"], TARGET_REAP_MS, "ms"))
    return found


def grace_label(row: Row) -> str:
    if row["stdin_grace_s"] is None:
        return ""
    return f"{row['stdin_grace_s']:g} + {row['term_grace_s']:g} s"


def label(row: Row) -> str:
    return mode_label(row["mode"])


CLOSE_COLUMNS = (
    Column("adapter", lambda row: str(row["adapter"])),
    Column("run by", label),
    Column("stdin + term grace", grace_label),
    col("adapter gone p50 ms", "adapter_gone_p50_ms"),
    col("stop() returned p50 ms", "stop_p50_ms"),
    col("last process gone p50 ms", "last_gone_p50_ms", when=relayed, otherwise="never"),
    col("last process gone p90 ms", "last_gone_p90_ms", when=relayed, otherwise="never"),
    col("added p50 ms (vs the adapter's own exit)", "added_p50_ms", when=known("added_p50_ms")),
    Column("descendants left running", lambda row: f"{row['left_running']} of {row['descendants']}"),
    Column("target (p50)", lambda row: f"<= {row['target_ms']:g} ms" if relayed(row) else ""),
    Column("result", lambda row: verdict(row["last_gone_p50_ms"], row["target_ms"]) if relayed(row) else ""),
)
SPAWN_COLUMNS = (
    Column("spawned by", label),
    *figure_cols("ms", "median", "min", "p90"),
    col("added ms (median)", "added_ms", when=relayed),
    target_col(f"target added <= {TARGET_SPAWN_ADDED_MS:g} ms", "added_ms", TARGET_SPAWN_ADDED_MS, when=relayed),
    col("wrapper RSS MB (median)", "wrapper_rss_median_mb", when=relayed),
    col("wrapper RSS MB (max)", "wrapper_rss_max_mb", when=relayed),
    col("wrapper peak RSS MB (VmHWM)", "wrapper_hwm_max_mb", when=relayed),
    target_col(
        f"target RSS <= {TARGET_WRAPPER_RSS_MB:g} MB", "wrapper_rss_max_mb", TARGET_WRAPPER_RSS_MB, when=relayed
    ),
)


def reaped(row: Row) -> str:
    if row["case"] != "dead":
        return str(row["reaped"])
    states = ", ".join(f"{n} {state}" for state, n in sorted(row["states"].items()))
    return f"{row['reaped']} ({states})"


REAPING_COLUMNS = (
    Column("state dir", lambda row: str(row["label"])),
    *figure_cols("ms", "median", "min", "p90"),
    col("added ms (median, vs empty)", "added_ms", when=known("added_ms")),
    Column("leases reaped (states after)", reaped),
    target_col(f"target <= {TARGET_REAP_MS:g} ms", "median_ms", TARGET_REAP_MS, when=where("case", "dead")),
)


def render(report: Report) -> list[str]:
    results = report.ownership
    out: list[str] = []
    if results.get("close"):
        out += [
            f"## Ownership: close -> last process gone, {results['close_runs']} runs each (interleaved), "
            f"{results.get('mode', 'markers')} mode",
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
            *render_table(CLOSE_COLUMNS, results["close"]),
        ]
        stubborn = [row for row in results["close"] if row["adapter"] == STUBBORN]
        if stubborn:
            row = stubborn[0]
            out += [
                f"* Stubborn floor: stdin grace + the wrapper's own TERM->KILL grace "
                f"(term grace - min(0.5 s, term grace / 4)) = {fmt(row['floor_ms'], 0)} ms; "
                f"target = stdin grace + term grace + {TARGET_CLOSE_OVER_GRACE_MS:g} ms.",
                "",
            ]
    if results.get("spawn"):
        out += [
            f"## Ownership: spawn to the adapter's first line, {results['spawn_runs']} runs each (interleaved)",
            "",
            "From spawning (`SupervisedProcess.start`: lease rows, wrapper, report; or `subprocess.Popen`) "
            "to reading the line the adapter prints once its tree is up. The wrapper's RSS is read then.",
            "",
            *render_table(SPAWN_COLUMNS, results["spawn"]),
        ]
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
            *render_table(REAPING_COLUMNS, results["reaping"]),
        ]
    return out + left_running(results, "")


SECTION = Section(("ownership",), measure_ownership, render, targets)
