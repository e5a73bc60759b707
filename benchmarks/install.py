"""Install benchmark: 20 proxies of one session each over one install's ``[pool] max_live = 4``, as acpx runs them.

acpx (and openab) start one agent process, hence one ``acp-proxy``, per session: the
cap holds only because every proxy of an install (one state dir) takes its adapters'
slots from the same slot files, queues for them first come, first served, and asks
another proxy, through its control socket, to suspend its idle session when the
install is full (``acp_proxy/pool/install.py``). This measures what that costs
against a client that pools the same agents itself.

Every adapter is ``benchmarks/load_agent.py`` (see ``benchmarks/load.py``): each turn
streams ``UPDATES`` ``session/update`` lines of 180 B, and the agent says whether the
turn was the first after its session was restored (*resumed*) or not (*live*).

The workload, identical in every run: ``SESSIONS`` sessions, each driven by its own
client thread. All open at once (through a proxy: ``initialize``, then
``session/new``); then each runs ``bursts`` bursts of ``BURST_TURNS`` back-to-back
prompts, with a seeded random pause of up to ``THINK_MAX`` s before each burst.

Runs, side by side on one machine:

* ``direct, 4 at a time``: the client runs the agents itself, 20 sessions over at
  most 4 processes, with ``benchmarks/load.py``'s ``DirectPool`` (the same LRU rule:
  a turn for a session without a process stops the least recently used idle agent,
  waits for it to exit, spawns, ``initialize``, ``session/resume``). The base of
  the ratios;
* ``install (asyncio)`` / ``install (trio)``: ``SESSIONS`` proxies, all with one state
  dir and ``[pool] max_live = MAX_LIVE`` (other settings at their defaults), each run
  by ``benchmarks/load_proxy.py`` and with a client connection of its own serving one
  session.

Reported per run: turns/s and resumes (turns the agent saw as resumed) over the turn
phase, the throughput ratio to direct; p50/p99 of resumed and live turns (prompt sent
-> answer read); the slot waits; **cross-proxy eviction latency**; peak live adapter
processes; each proxy's memory; requests lost.

Cross-proxy eviction latency is measured inside the proxy that needs the slot, by
``load_proxy.py``: from the moment a request for a session with no live process asks
the pool for a slot (``ProcessPool._acquire_slot`` is entered) to the moment the slot
is held (it returns), for every such wait that began in the turn phase and got its
slot by having another proxy suspend a session (``ProcessPool._evict_anywhere`` asked
a peer, and the peer agreed). Each is split into: *plan* (from the request to the
granted ask: waiting in the install's queue, or for a session that was active moments
ago to stop being protected), *ask* (the control-socket round trip, the peer's own
decision included) and *free* (from the peer's yes to the slot file being unlocked,
i.e. the evicted adapter's tree gone, seen by a waiter that looks every 20 ms). It does
not include the start that follows (spawn, ``initialize``, ``session/resume``), which
is part of the resumed turn. Direct, the same span is the client pool's wait in which
it stopped an agent (from the request to the slot had, the agent's exit included).

Peak live adapters: sampled from ``/proc`` every 100 ms (processes three levels under
the benchmark: proxy -> wrapper -> adapter) and exactly from each agent's own records
of when it started and exited. More than ``MAX_LIVE`` fails the run. Proxy memory:
``VmRSS`` of each proxy at the end of the turn phase and its ``VmHWM`` (peak), p50 and
max over the ``SESSIONS`` proxies: what each acpx session costs in ``acp-proxy``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import secrets
import statistics
import sys
import tempfile
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import (
    BENCH_MARKER,
    BenchError,
    Report,
    attempt,
    child_environment,
    cpu_seconds,
    fmt,
    leftovers,
    percentile,
    proc_status_kb,
    progress,
    proxy_mode,
    table,
)
from benchmarks.load import (
    BACKEND,
    BURST_TURNS,
    INITIALIZE_PARAMS,
    LOAD_PROXY,
    SAMPLE_INTERVAL,
    UPDATES,
    Acquire,
    DirectClient,
    ProxyClient,
    Turn,
    acquire_figures,
    agent_argv,
    check_row,
    drive,
    eviction_figures,
    lifetime_figures,
    log_figures,
    pool_settings,
    read_acquires,
    stats,
    summarize,
    window_figures,
)
from tests.kit.proctree import Descendants

SESSIONS = 20
MAX_LIVE = 4
BURSTS = 10
QUICK_BURSTS = 3
THINK_MAX = 0.05
OPEN_TIMEOUT = 60.0

DIRECT_POOL = "direct-pool"


def mode_label(mode: str) -> str:
    if mode.startswith("proxy-"):
        return f"install ({mode.removeprefix('proxy-')})"
    return f"direct, {MAX_LIVE} at a time"


class Fleet:
    """``SESSIONS`` proxies of one install, each with a client connection of its own for one session."""

    def __init__(self, backend: str, env: dict[str, str], workdir: Path, pool: str = "") -> None:
        self.who = mode_label(proxy_mode(backend))
        state = workdir / f"state-{backend}"
        config = workdir / f"install-{backend}.toml"
        config.write_text(
            f"[pool]\nmax_live = {MAX_LIVE}\n{pool}[backends.{BACKEND}]\ncommand = {json.dumps(agent_argv())}\n",
        )
        self.acquire_files = [workdir / f"acquires-{backend}-{i}.txt" for i in range(SESSIONS)]
        env = {**env, "ACP_PROXY_STATE_DIR": str(state)}
        self.clients: list[ProxyClient] = []
        try:
            for i, acquires in enumerate(self.acquire_files):
                argv = [sys.executable, str(LOAD_PROXY), str(acquires), "--async-backend", backend]
                self.clients.append(ProxyClient([*argv, "--config", str(config)], env, f"{self.who} #{i}"))
        except BaseException:
            self.kill()
            raise

    def open_session(self, index: int) -> str:
        client = self.clients[index]
        answer = client.call("initialize", INITIALIZE_PARAMS, timeout=OPEN_TIMEOUT)
        if answer is None or "result" not in answer:
            raise BenchError(f"{client.who}: initialize answered {str(answer)[:300]}")
        return client.new_session()

    def prompt(self, index: int, session_id: str) -> Turn:
        return self.clients[index].prompt(session_id)

    def cpu_seconds(self) -> list[float | None]:
        """Each proxy's CPU time so far (user + system)."""
        return [cpu_seconds(client.process.pid) for client in self.clients]

    def memory(self) -> dict[str, list[float]]:
        """Each proxy's ``VmRSS`` now and ``VmHWM``, in MB (the ones that could be read)."""
        found: dict[str, list[float]] = {"VmRSS": [], "VmHWM": []}
        for client in self.clients:
            for name, values in found.items():
                kb = proc_status_kb(client.process.pid, name)
                if kb is not None:
                    values.append(kb / 1024)
        return found

    def close(self) -> list[int | None]:
        """End every proxy (stdin EOF to all first: they suspend and exit side by side); their exit statuses."""
        for client in self.clients:
            client.conn.close_input()
        return [client.close() for client in self.clients]

    def kill(self) -> None:
        for client in self.clients:
            client.kill()

    def logs(self) -> str:
        return "".join(client.stderr_text() for client in self.clients)


def in_window(acquires: list[Acquire], window: tuple[float, float]) -> list[Acquire]:
    return [a for a in acquires if window[0] <= a.began <= window[1]]


def spread(values: list[float]) -> dict[str, float | None]:
    ordered = sorted(values)
    return {
        "n": len(ordered),
        "p50": percentile(ordered, 50) if ordered else None,
        "max": ordered[-1] if ordered else None,
        "mean": statistics.fmean(ordered) if ordered else None,
    }


def proxy_run(backend: str, env: dict[str, str], workdir: Path, bursts: int, pool: str = "") -> dict[str, Any]:
    mode = proxy_mode(backend)
    who = mode_label(mode)
    lifetimes = workdir / f"lifetimes-{mode}.txt"
    fleet = Fleet(backend, {**env, "LOAD_AGENT_LIFETIMES": str(lifetimes)}, workdir, pool)
    cpu_at_turns: list[list[float | None]] = []
    try:
        with Descendants(os.getpid(), depth=3, count_root=False, seconds=SAMPLE_INTERVAL) as sampler:
            driven = drive(
                SESSIONS,
                fleet.open_session,
                fleet.prompt,
                bursts,
                f"install: {who}",
                THINK_MAX,
                on_turns=lambda: cpu_at_turns.append(fleet.cpu_seconds()),
            )
            sampler.sample()
        began = cpu_at_turns[0] if cpu_at_turns else [None] * SESSIONS
        cpu_turns = [
            after - before
            for before, after in zip(began, fleet.cpu_seconds(), strict=True)
            if before is not None and after is not None
        ]
        memory = fleet.memory()
        statuses = fleet.close()
    except BaseException:
        fleet.kill()
        raise
    finally:
        for client in fleet.clients:
            client.conn.close(0)  # after a kill: reaps it and keeps its log
        logged = fleet.logs()
    failed = [(i, status) for i, status in enumerate(statuses) if status != 0]
    if failed:
        raise BenchError(f"{who}: proxies exited with a failure (index, status): {failed}: {logged[-500:]}")
    recorded = [a for path in fleet.acquire_files for a in read_acquires(path)]
    in_turns = in_window(recorded, driven["turns_window"])
    tally: Counter[str] = Counter()
    for client in fleet.clients:
        tally.update(client.tally.lost())
    return summarize(
        mode,
        driven,
        [a.seconds for a in in_turns if a.ok],
        {
            "requests": dict(tally),
            "unexpected_lines": sum(len(client.unexpected) for client in fleet.clients),
            "peak_adapters_sampled": sampler.peak_adapters,
            **lifetime_figures(lifetimes),
            "samples": sampler.samples,
            "proxy_cpu_s": spread(cpu_turns),
            "proxies_cpu_s": sum(cpu_turns),
            "proxy_rss_mb": spread(memory["VmRSS"]),
            "proxy_hwm_mb": spread(memory["VmHWM"]),
            "tree_peak_rss_mb": sampler.peak_rss / (1 << 20),
            **acquire_figures(in_turns),
            **eviction_figures(in_turns, peer=True),
            **window_figures(fleet.acquire_files),
            **log_figures(logged),
        },
        sessions=SESSIONS,
    )


def direct_run(env: dict[str, str], workdir: Path, bursts: int) -> dict[str, Any]:
    who = mode_label(DIRECT_POOL)
    lifetimes = workdir / f"lifetimes-{DIRECT_POOL}.txt"
    client = DirectClient(MAX_LIVE, {**env, "LOAD_AGENT_LIFETIMES": str(lifetimes)})
    lock = threading.Lock()
    window_waits: dict[str, int] = {}

    def open_session(_: int) -> str:
        return client.new_session()

    try:
        with Descendants(os.getpid(), depth=1, count_root=False, seconds=SAMPLE_INTERVAL) as sampler:

            def prompt(_: int, session_id: str) -> Turn:
                with lock:  # the waits of the turn phase start after the last opening's
                    window_waits.setdefault("waits", len(client.pool.waits))
                    window_waits.setdefault("evictions", len(client.pool.eviction_waits))
                    window_waits.setdefault("starts", len(client.pool.start_costs))
                return client.prompt(session_id)

            driven = drive(SESSIONS, open_session, prompt, bursts, f"install: {who}", THINK_MAX)
            sampler.sample()
    finally:
        client.pool.close()
    waits = client.pool.waits[window_waits.get("waits", 0) :]
    evictions = client.pool.eviction_waits[window_waits.get("evictions", 0) :]
    return summarize(
        DIRECT_POOL,
        driven,
        waits,
        {
            "requests": client.tally.lost(),
            "unexpected_lines": 0,
            "peak_adapters_sampled": sampler.peak_adapters,
            "peak_adapters_counted": client.pool.peak,
            **lifetime_figures(lifetimes),
            "samples": sampler.samples,
            "tree_peak_rss_mb": sampler.peak_rss / (1 << 20),
            "eviction_ms": stats(sorted(w * 1000 for w in evictions)),
            "start_cost_ms": stats(sorted(w * 1000 for w in client.pool.start_costs[window_waits.get("starts", 0) :])),
        },
        sessions=SESSIONS,
    )


def measure_install(report: Report, args: argparse.Namespace) -> dict[str, Any]:
    bursts = QUICK_BURSTS if args.quick else BURSTS
    token = secrets.token_hex(8)
    env = {**child_environment(), BENCH_MARKER: token}
    env.pop("ACP_PROXY_CONFIG", None)
    results: dict[str, Any] = {
        "sessions": SESSIONS,
        "max_live": MAX_LIVE,
        "updates_per_turn": UPDATES,
        "bursts": bursts,
        "burst_turns": BURST_TURNS,
        "think_max_s": THINK_MAX,
        "pool_settings": pool_settings(args),
        "rows": [],
    }
    with tempfile.TemporaryDirectory(prefix="acp-proxy-bench-install-") as name:
        workdir = Path(name)
        runs: list[tuple[str, Callable[[], dict[str, Any]]]] = [(DIRECT_POOL, lambda: direct_run(env, workdir, bursts))]
        for backend in args.backends:
            proxied = functools.partial(proxy_run, backend, env, workdir, bursts, pool_settings(args))
            runs.append((proxy_mode(backend), proxied))
        for mode, run in runs:
            who = mode_label(mode)
            progress(f"install: {who}, {SESSIONS} sessions x {bursts * BURST_TURNS} turns ...")
            row = attempt(report, f"install {who}", run)
            if row is not None:
                check_row(report, row, who=f"install {who}", cap=MAX_LIVE)
                results["rows"].append(row)
    base = next((r for r in results["rows"] if r["mode"] == DIRECT_POOL), None)
    for row in results["rows"]:
        row["vs_direct_pool_throughput"] = row["turns_per_s"] / base["turns_per_s"] if base else None
    left = leftovers(token)
    results["left_running"] = left
    if left:
        report.errors.append(f"install: processes outlived the benchmark (killed now): {left}")
    return results


# --- reporting -------------------------------------------------------------------------------


def _p50_p99(figures: dict[str, Any], digits: int = 1) -> str:
    return f"{fmt(figures['p50'], digits)} / {fmt(figures['p99'], digits)}, n={figures['n']}"


def render(results: dict[str, Any]) -> list[str]:
    rows = results.get("rows") or []
    if not rows:
        return []
    turns = results["bursts"] * results["burst_turns"]
    out = [
        f"## Install: {results['sessions']} proxies of one session each over one install's "
        f"`max_live = {results['max_live']}`, {turns} streaming turns per session",
        "",
        f"As acpx runs them: one proxy per session, all of one state dir. Each session opens (`initialize`, "
        f"`session/new`) at once, then runs {results['bursts']} burst(s) of {results['burst_turns']} back-to-back "
        f"prompts ({results['updates_per_turn']} updates of 180 B each) after a random pause of up to "
        f"{results['think_max_s'] * 1000:.0f} ms. Direct, {results['max_live']} at a time: the client pools the "
        "agents itself with the same LRU rule (the base of the ratio). Cross-proxy eviction: a slot wait of the "
        "turn phase that got its slot by having another proxy suspend a session, from the request for a slot to "
        "the slot held (timed in the proxy); plan / ask / free split it (see `benchmarks/install.py`). Direct: "
        "the client pool's waits in which it stopped an agent. Proxy memory: each proxy's VmRSS at the end of the "
        "turns and its VmHWM, p50 / max over the proxies.",
        "",
    ]
    if results.get("pool_settings"):
        out += [f"The proxies ran with these `[pool]` settings too: `{results['pool_settings'].strip()}`.", ""]
    table_rows = []
    for row in rows:
        is_proxy = row["mode"].startswith("proxy-")
        errors = sum(row["turn_errors"].values())
        if is_proxy:
            parts = " / ".join(fmt(row[part]["p50"], 1) for part in ("plan_ms", "ask_ms", "free_ms"))
            memory = (
                f"{fmt(row['proxy_rss_mb']['p50'], 1)} / {fmt(row['proxy_rss_mb']['max'], 1)}; "
                f"{fmt(row['proxy_hwm_mb']['p50'], 1)} / {fmt(row['proxy_hwm_mb']['max'], 1)}"
            )
        else:
            parts = memory = ""
        table_rows.append(
            [
                mode_label(row["mode"]),
                f"{row['turns_ok']:,}/{row['turns']:,}",
                fmt(row["turns_per_s"], 1),
                fmt(row["vs_direct_pool_throughput"], 2, "x") if is_proxy else "",
                f"{row['resumed_ms']['n']:,} ({fmt(row['resumes_per_s'], 1)}/s)",
                f"{fmt(row['resumed_ms']['p50'], 1)} ({fmt(row['resumed_ms']['p99'], 1)})",
                f"{fmt(row['live_ms']['p50'], 1)} ({fmt(row['live_ms']['p99'], 1)})",
                _p50_p99(row["acquire_ms"]),
                _p50_p99(row["eviction_ms"]),
                parts,
                f"{row['peak_adapters_sampled']} / {row['peak_adapters_exact']}"
                + (" **OVER**" if row["over_cap"] else ""),
                memory,
                fmt(row["tree_peak_rss_mb"], 0),
                str(row["requests"]["lost"] + row["requests"]["duplicated"]),
                str(errors) + (f" {row['turn_errors']}" if errors else ""),
            ]
        )
    header = [
        "run by",
        "turns ok",
        "turns/s",
        "vs direct",
        "resumed turns",
        "resumed turn p50 (p99) ms",
        "live turn p50 (p99) ms",
        "slot wait p50 / p99 ms",
        "eviction p50 / p99 ms",
        "eviction plan / ask / free p50 ms",
        "peak live adapters sampled / exact",
        "proxy RSS p50 / max; HWM p50 / max MB",
        "tree peak RSS MB",
        "requests lost",
        "turn errors",
    ]
    out += table(header, table_rows)
    out += [""]
    for row in rows:
        line = (
            f"* {mode_label(row['mode'])}: {row['sessions']} sessions opened in {row['creation_s']:.1f} s; "
            f"turn phase {row['turns_s']:.1f} s"
        )
        requests = row["requests"]
        line += f"; {requests['sent']:,} requests, {requests['lost']} lost, {requests['duplicated']} answered twice"
        if "log_lines" not in row and row.get("start_cost_ms"):
            line += f"; a start (spawn, `initialize`, restore) took p50 {fmt(row['start_cost_ms']['p50'], 0)} ms"
        if "log_lines" in row:
            line += (
                f"; slot waits in the turn phase: {row['acquires']} ({row['acquires_suspending_peer']} by a peer's "
                f"suspension, {row['acquires_suspending_own']} by its own, {row['evictions_refused']} asks refused, "
                f"{row['acquires_failed']} failed); the proxies used {row['proxies_cpu_s']:.1f} s of CPU in the turn "
                f"phase (each p50 {fmt(row['proxy_cpu_s']['p50'], 2)} s, max {fmt(row['proxy_cpu_s']['max'], 2)} s); "
                f"waiters for a slot woke {row['waiter_wakeups']['woken']:,} times on a change and "
                f"{row['waiter_wakeups']['timed_out']:,} on a timeout (the whole run) and read the install's "
                f"slots {row['install_reads']['count']:,} times ({row['install_reads']['seconds']:.1f} s); "
                f"start cost learned p50 {fmt(row['start_cost_ms']['p50'], 0)} ms, protection granted p50 "
                f"{fmt(row['protection_ms']['p50'], 0)} ms; a restore inside the proxy took p50 "
                f"{fmt(row['logged_resume_ms']['p50'], 0)} ms (n={row['logged_resume_ms']['n']}); "
                f"suspended: {row['suspended_by_reason'] or 'none'}"
            )
        out.append(line + ".")
    left = results.get("left_running", [])
    out += [
        "",
        "Processes carrying this run's marker left running at the end of the install benchmark: "
        + (", ".join(map(str, left)) + " (killed)" if left else "none"),
        "",
    ]
    return out
