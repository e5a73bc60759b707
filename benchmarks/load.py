"""Load benchmark: 200 concurrent sessions over ``max_live = 8``, streaming turns, one gateway.

The workload and how it is run are ``benchmarks/pool.py``'s. Runs, side by side on one machine:

* ``proxy (asyncio)`` / ``proxy (trio)``: one client connection to one ``acp-proxy`` with
  ``[pool] max_live = 8``, serving all 200 sessions;
* ``direct, 8 at a time``: the client runs the agents itself under the same cap and LRU
  rule: the same work without the proxy, and the base of the ratios;
* ``direct, all 200 live``: no cap at all, one agent per session for the whole run; no
  turn ever resumes. What the cap saves in memory, and what resuming costs.

Beside the figures every pool run yields: slot waits (every call of the pool's acquire,
``session/new``'s included: through the proxy from ``load_proxy.py``, direct from the
client's own pool), the proxy's peak RSS (``VmHWM``) and its CPU in the turn phase.
"""

from __future__ import annotations

from benchmarks import pool
from benchmarks.harness import Column, Row, col, fmt, proxied
from benchmarks.pool import (
    DIRECT_ALL,
    DIRECT_POOL,
    OUTCOME_COLUMNS,
    PROXIES,
    SAMPLE_INTERVAL,
    SEED,
    Workload,
    peak_adapters,
)


def proxy_figures(cpu_turns: list[float], memory: dict[str, list[float]]) -> Row:
    return {
        "proxy_peak_rss_mb": memory["VmHWM"][0] if memory["VmHWM"] else None,
        "proxy_cpu_s": cpu_turns[0] if cpu_turns else None,
    }


def direct_figures(evictions: Row, starts: Row) -> Row:
    return {"eviction_wait_ms": evictions, "start_cost_ms": starts, "proxy_peak_rss_mb": None}


LOAD = Workload(
    name="load",
    sessions=200,
    max_live=8,
    bursts=3,
    quick_bursts=1,
    proxies=1,
    through="proxy",
    modes=(DIRECT_POOL, PROXIES, DIRECT_ALL),
    turn_phase_waits=False,
    proxy_figures=proxy_figures,
    direct_figures=direct_figures,
    compared=("resumed_ms", "live_ms"),
    recorded={"seed": SEED},
)


# --- reporting -------------------------------------------------------------------------------


def p50_p99(key: str) -> Column:
    """A turn latency's p50 (p99) and how many turns it is of."""

    def cell(row: Row) -> str:
        figures = row[key]
        return f"{fmt(figures['p50'], 1)} ({fmt(figures['p99'], 1)}), n={figures['n']}"

    return Column(f"{key.removesuffix('_ms')} turn p50 (p99) ms", cell)


def slot_waits(row: Row) -> str:
    waits = row["acquire_ms"]
    return f"{fmt(waits['p50'], 1)} / {fmt(waits['p99'], 1)} / {fmt(waits['max'], 1)}, n={waits['n']}"


COLUMNS = (
    Column("run by", lambda row: LOAD.label(row["mode"])),
    Column("turns ok", lambda row: f"{row['turns_ok']:,}/{row['turns']:,}"),
    col("turn phase s", "turns_s"),
    col("turns/s", "turns_per_s", 0),
    col("resumes/s", "resumes_per_s"),
    col("updates/s", "updates_per_s", 0),
    col("throughput vs direct 8", "vs_direct_pool_throughput", 2, "x", when=lambda row: row["mode"] != DIRECT_POOL),
    p50_p99("resumed_ms"),
    p50_p99("live_ms"),
    Column("slot wait p50 / p99 / max ms", slot_waits),
    Column("peak live adapters sampled / exact", peak_adapters),
    col("proxy peak RSS MB", "proxy_peak_rss_mb", when=proxied),
    *OUTCOME_COLUMNS,
)


def heading(results: Row) -> list[str]:
    turns = results["bursts"] * results["burst_turns"]
    return [
        f"## Load: {results['sessions']} concurrent sessions over `max_live = {results['max_live']}`, "
        f"{turns} streaming turns each ({results['updates_per_turn']} updates of 180 B), one client",
        "",
        f"Each session is a client thread: `session/new` all at once, then {results['bursts']} burst(s) of "
        f"{results['burst_turns']} back-to-back prompts after a random pause of up to "
        f"{results['think_max_s'] * 1000:.0f} ms (seed {results['seed']}). A turn is *resumed* when it was the "
        "first on a process that had just restored its session, else *live* (the agent says which). "
        f"Direct, {results['max_live']} at a time: the client itself runs the agents under the same cap and "
        "LRU rule (stop the least recently used idle agent and wait for its exit, spawn, `initialize`, "
        "`session/resume`): the same work without the proxy, and the base of the ratios. "
        f"Direct, all {results['sessions']} live: no cap, nothing ever resumes. Slot waits through the "
        "proxy: every call of the pool's acquire (including `session/new`), timed in the proxy; direct: the "
        "client pool's own. Peak live adapters: sampled from /proc every "
        f"{SAMPLE_INTERVAL * 1000:.0f} ms / exact (from each agent's own record of its start and exit). "
        "Tree RSS: the peak sampled sum over proxy, wrappers and adapters "
        "(direct: the agents).",
        "",
    ]


def row_summary(row: Row) -> str:
    """What the table leaves out: how the sessions opened, the requests, and what the proxy logged."""
    created = row["session_new_ms"]
    line = (
        f"* {LOAD.label(row['mode'])}: {row['sessions']} `session/new` at once took {row['creation_s']:.1f} s "
        f"(each p50 {fmt(created['p50'], 0)} ms, p99 {fmt(created['p99'], 0)} ms)"
    )
    if row["mode"] != DIRECT_POOL and row.get("added_resumed_ms_p50") is not None:
        line += f"; resumed p50 {row['added_resumed_ms_p50']:+.1f} ms vs direct 8"
    if row.get("added_live_ms_p50") is not None and row["mode"] != DIRECT_POOL:
        line += f", live p50 {row['added_live_ms_p50']:+.1f} ms"
    requests = row["requests"]
    line += f"; {requests['sent']:,} requests, {requests['lost']} lost, {requests['duplicated']} answered twice"
    if row["mode"] == DIRECT_POOL and row.get("start_cost_ms"):
        line += f"; a start (spawn, `initialize`, restore) took p50 {fmt(row['start_cost_ms']['p50'], 0)} ms"
    if "log_lines" in row:
        line += (
            f"; the proxy logged {row['log_lines']:,} lines ({row['pool_full_log_lines']:,} 'pool full'), "
            f"{row['acquires_failed']} slot waits failed; {row['acquires_suspending_own']} slot waits "
            f"suspended a session ({row['evictions_refused']} refusals); a restore inside the proxy took "
            f"p50 {fmt(row['logged_resume_ms']['p50'], 0)} ms (n={row['logged_resume_ms']['n']}); "
            f"suspended: {row['suspended_by_reason'] or 'none'}; a slot wait that suspended a session took "
            f"p50 {fmt(row['eviction_ms']['p50'], 0)} ms, of which plan / ask / free p50 "
            f"{' / '.join(fmt(row[part]['p50'], 1) for part in ('plan_ms', 'ask_ms', 'free_ms'))} ms; "
            f"the proxy used {fmt(row['proxy_cpu_s'], 1)} s of CPU in the turn phase; waiters for a slot woke "
            f"{row['waiter_wakeups']['woken']:,} times on a change and {row['waiter_wakeups']['timed_out']:,} "
            "times on a timeout (the whole run) and read the install's slots "
            f"{row['install_reads']['count']:,} times ({row['install_reads']['seconds']:.1f} s); "
            f"start cost learned p50 {fmt(row['start_cost_ms']['p50'], 0)} ms (p99 "
            f"{fmt(row['start_cost_ms']['p99'], 0)}), protection granted p50 "
            f"{fmt(row['protection_ms']['p50'], 0)} ms (p99 {fmt(row['protection_ms']['p99'], 0)})"
        )
    return line


SECTION = pool.section(LOAD, heading, COLUMNS, row_summary)
