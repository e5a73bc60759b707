"""What the proxy's periodic looks at its trees cost: measuring their memory, and checking for dead proxies.

With a memory budget or a per-session ceiling, every proxy measures its trees every
``MEMORY_EVERY`` seconds (``pool.memory.measure_trees``: one pass over the process table, then
each process's PSS from ``smaps_rollup``); every ``[ownership] reap_interval`` it checks whether
a proxy of its install has died (``sessions.leftovers.dead_proxies``). Both run while sessions
stream, so both are measured here, per tree and per check, against the same figures read the
plain way a client would (psutil: each process's RSS, children found by psutil).

The trees are ``TREES`` Python processes, each with two children, every process holding
``HOLD_MIB`` MiB resident. Where the trees' cgroups have a memory controller (``memory.current``),
reading it is measured too; where not, the report says so.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, Final

import psutil

from acp_proxy.ownership import cgroups
from acp_proxy.ownership.owner import Owner
from acp_proxy.pool.memory import ProcMemory, Usage, measure_trees
from acp_proxy.sessions.leftovers import dead_proxies
from benchmarks.common import figures
from benchmarks.harness import (
    Column,
    Report,
    Section,
    Target,
    col,
    figure_cols,
    isolated,
    progress,
    render_table,
    target_col,
)

TREES: Final = 8
HOLD_MIB: Final = 20
PEERS: Final = 3
"""Other live proxies of the install when checking for dead ones (each is probed)."""
TARGET_VS_PSUTIL: Final = 1.0
"""Measuring a tree may cost at most what reading its RSS through psutil does (for a figure that counts
shared pages once)."""
TARGET_CHECK_US: Final = 1000.0
"""The periodic check for dead proxies may cost at most this, on the event loop."""

_HOLDER = (
    "import os, subprocess, sys, time\n"
    "hold = b'\\x01' * ({mib} << 20)\n"
    "kids = [subprocess.Popen([sys.executable, '-c', sys.argv[1]]) for _ in range(int(sys.argv[2]))]\n"
    "print('ready', flush=True)\n"
    "sys.stdin.read()\n"
    "for kid in kids: kid.terminate(); kid.wait()\n"
)


class StatmOnly(ProcMemory):
    """RSS from ``statm`` alone: what the measure falls back to where PSS cannot be read."""

    def read(self, pid: int) -> Usage | None:
        return self.read_rss(pid)


@contextlib.contextmanager
def trees(env: dict[str, str], count: int) -> Iterator[list[int]]:
    leaf = f"import time\nhold = b'\\x01' * ({HOLD_MIB} << 20)\ntime.sleep(3600)"
    holder = _HOLDER.format(mib=HOLD_MIB)
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", holder, leaf, "2"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        for _ in range(count)
    ]
    try:
        for process in processes:
            assert process.stdout is not None
            process.stdout.readline()
        time.sleep(0.5)  # the children have allocated too
        yield [process.pid for process in processes]
    finally:
        for process in processes:
            assert process.stdin is not None
            process.stdin.close()
        for process in processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def psutil_trees(roots: list[int]) -> dict[int, int]:
    """Each tree's RSS the way a client would read it: psutil's children and memory_info."""
    sizes = {}
    for root in roots:
        parent = psutil.Process(root)
        sizes[root] = sum(p.memory_info().rss for p in [parent, *parent.children(recursive=True)])
    return sizes


def timed(rounds: int, action: Callable[[], Any]) -> list[float]:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        action()
        samples.append((time.perf_counter() - start) * 1e6)
    return samples


def measure(report: Report, args: argparse.Namespace) -> None:
    results: dict[str, Any] = {"trees": TREES, "processes_per_tree": 3, "hold_mib": HOLD_MIB}
    report.measuring = results
    rounds = args.measure_rounds
    with isolated(report, "measuring", results) as run:
        progress(f"measuring: {TREES} trees of 3 processes, {rounds} rounds per reader ...")
        with trees(run.env, TREES) as roots:
            pss = measure_trees(roots)
            results["tree_mib_pss"] = sum(t.total for t in pss.values()) / len(roots) / 2**20
            results["tree_mib_rss"] = sum(psutil_trees(roots).values()) / len(roots) / 2**20
            cases: list[tuple[str, str, Callable[[], Any]]] = [
                ("psutil", "psutil: children, then each RSS (a client's way)", lambda: psutil_trees(roots)),
                ("pss", "proxy: PSS (smaps_rollup), one process-table pass", lambda: measure_trees(roots)),
                ("rss", "proxy: RSS (statm), one process-table pass", lambda: measure_trees(roots, reader=StatmOnly())),
            ]
            here = cgroups.detect("auto")  # where a proxy started here would read its trees' cgroups
            if here.memory and here.base is not None:
                base = here.base
                label = "cgroup: working set (memory.current, memory.stat)"
                cases.append(("cgroup", label, lambda: cgroups.memory_working_set(base)))
                results["cgroup"] = base
            else:
                results["cgroup"] = None
            samples: dict[str, list[float]] = {key: [] for key, _, _ in cases}
            for _ in range(rounds // 10 or 1):  # interleaved: drift hits every reader alike
                for key, _, action in cases:
                    samples[key] += timed(10, action)
        per_tree = {key: 1 if key == "cgroup" else TREES for key, _, _ in cases}
        rows = [
            {
                "reader": key,
                "label": label,
                "rounds": len(samples[key]),
                **figures("us", (s / per_tree[key] for s in samples[key]), "median", "p90"),
            }
            for key, label, _ in cases
        ]
        base = next(row for row in rows if row["reader"] == "psutil")
        for row in rows:
            row["vs_psutil"] = row["median_us"] / base["median_us"]
        results["per_tree"] = rows
        progress(f"measuring: the periodic check for dead proxies, {rounds} checks ...")
        owners = [Owner.start(run.workdir / "state", grace=1.0) for _ in range(1 + PEERS)]
        try:
            own = owners[0]
            check = figures("us", timed(rounds, lambda: dead_proxies(own.db, own.instance_id)), "median", "p90")
        finally:
            for owner in owners:
                owner.close()
        results["check"] = {"checks": rounds, "peers": PEERS, **check}


def targets_of(report: Report) -> list[Target]:
    results = report.measuring
    found = [
        Target(f"memory measure per tree against psutil's, {row['label']}", row["vs_psutil"], TARGET_VS_PSUTIL, "x")
        for row in results.get("per_tree", [])
        if row["reader"] in ("pss", "cgroup")
    ]
    if "check" in results:
        found.append(Target("periodic check for dead proxies", results["check"]["median_us"], TARGET_CHECK_US, "us"))
    return found


COLUMNS = (
    Column("reader", lambda row: str(row["label"])),
    *figure_cols("us", "median", "p90"),
    col("x psutil (median)", "vs_psutil", digits=2),
    target_col(
        f"target <= {TARGET_VS_PSUTIL:g}x psutil", "vs_psutil", TARGET_VS_PSUTIL, when=lambda r: r["reader"] != "psutil"
    ),
)


def render(report: Report) -> list[str]:
    results = report.measuring
    if not results.get("per_tree"):
        return []
    cgroup = (
        f"`{results['cgroup']}` is read for the cgroup row."
        if results["cgroup"]
        else "No cgroup here has the memory controller on cgroup v2 (`memory.current`): no cgroup row."
    )
    check = results["check"]
    return [
        f"## Measuring trees: per tree, {results['trees']} trees of {results['processes_per_tree']} processes",
        "",
        f"Each process holds {results['hold_mib']} MiB: a tree is {results['tree_mib_pss']:.0f} MiB by PSS, "
        f"{results['tree_mib_rss']:.0f} MiB by RSS. Figures per tree (a round measures every tree and is "
        f"divided by their number), rounds interleaved across readers. {cgroup}",
        "",
        *render_table(COLUMNS, results["per_tree"]),
        "",
        f"The periodic check for dead proxies (`dead_proxies`, on the event loop, {check['peers']} live peers): median "
        f"{check['median_us']:.0f} us, p90 {check['p90_us']:.0f} us over {check['checks']} checks "
        f"(target <= {TARGET_CHECK_US:g} us).",
        "",
    ]


SECTION = Section(("measuring",), measure, render, targets_of)
