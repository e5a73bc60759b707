"""Install benchmark: 20 proxies of one session each over one install's ``[pool] max_live = 4``, as acpx runs them.

acpx (and openab) start one agent process, hence one ``acp-proxy``, per session: the
cap holds only because every proxy of an install (one state dir) takes its adapters'
slots from the same slot files, queues for them first come, first served, and asks
another proxy, through its control socket, to suspend its idle session when the
install is full (``acp_proxy/pool/install.py``). This measures what that costs
against a client that pools the same agents itself.

Every adapter is ``benchmarks/load_agent.py`` (see ``benchmarks/pool.py``, which runs the workload): each turn
streams ``UPDATES`` ``session/update`` lines of 180 B, and the agent says whether the
turn was the first after its session was restored (*resumed*) or not (*live*).

The workload, identical in every run: ``SESSIONS`` sessions, each driven by its own
client thread. All open at once (through a proxy: ``initialize``, then
``session/new``); then each runs ``bursts`` bursts of ``BURST_TURNS`` back-to-back
prompts, with a seeded random pause of up to ``THINK_MAX`` s before each burst.

Runs, side by side on one machine:

* ``direct, 4 at a time``: the client runs the agents itself, 20 sessions over at
  most 4 processes, with ``benchmarks/pool.py``'s ``DirectPool`` (the same LRU rule:
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
the pool for a slot (``SlotAdmission.acquire`` is entered) to the moment the slot
is held (it returns), for every such wait that began in the turn phase and got its
slot by having another proxy suspend a session (``SlotAdmission.evict_anywhere`` asked
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

from benchmarks import pool
from benchmarks.harness import Column, Row, col, fmt, proxied
from benchmarks.pool import DIRECT_POOL, OUTCOME_COLUMNS, PROXIES, Workload, peak_adapters, spread


def proxy_figures(cpu_turns: list[float], memory: dict[str, list[float]]) -> Row:
    return {
        "proxy_cpu_s": spread(cpu_turns),
        "proxies_cpu_s": sum(cpu_turns),
        "proxy_rss_mb": spread(memory["VmRSS"]),
        "proxy_hwm_mb": spread(memory["VmHWM"]),
    }


def direct_figures(evictions: Row, starts: Row) -> Row:
    return {"eviction_ms": evictions, "start_cost_ms": starts}


INSTALL = Workload(
    name="install",
    sessions=20,
    max_live=4,
    bursts=10,
    quick_bursts=3,
    proxies=20,
    through="install",
    modes=(DIRECT_POOL, PROXIES),
    turn_phase_waits=True,
    proxy_figures=proxy_figures,
    direct_figures=direct_figures,
)


# --- reporting -------------------------------------------------------------------------------


def p50_p99(header: str, key: str) -> Column:
    def cell(row: Row) -> str:
        figures = row[key]
        return f"{fmt(figures['p50'], 1)} / {fmt(figures['p99'], 1)}, n={figures['n']}"

    return Column(header, cell)


def eviction_parts(row: Row) -> str:
    return " / ".join(fmt(row[part]["p50"], 1) for part in ("plan_ms", "ask_ms", "free_ms")) if proxied(row) else ""


def proxy_memory(row: Row) -> str:
    if not proxied(row):
        return ""
    rss, hwm = row["proxy_rss_mb"], row["proxy_hwm_mb"]
    return f"{fmt(rss['p50'], 1)} / {fmt(rss['max'], 1)}; {fmt(hwm['p50'], 1)} / {fmt(hwm['max'], 1)}"


COLUMNS = (
    Column("run by", lambda row: INSTALL.label(row["mode"])),
    Column("turns ok", lambda row: f"{row['turns_ok']:,}/{row['turns']:,}"),
    col("turns/s", "turns_per_s"),
    col("vs direct", "vs_direct_pool_throughput", 2, "x", when=proxied),
    Column("resumed turns", lambda row: f"{row['resumed_ms']['n']:,} ({fmt(row['resumes_per_s'], 1)}/s)"),
    Column(
        "resumed turn p50 (p99) ms",
        lambda row: f"{fmt(row['resumed_ms']['p50'], 1)} ({fmt(row['resumed_ms']['p99'], 1)})",
    ),
    Column("live turn p50 (p99) ms", lambda row: f"{fmt(row['live_ms']['p50'], 1)} ({fmt(row['live_ms']['p99'], 1)})"),
    p50_p99("slot wait p50 / p99 ms", "acquire_ms"),
    p50_p99("eviction p50 / p99 ms", "eviction_ms"),
    Column("eviction plan / ask / free p50 ms", eviction_parts),
    Column("peak live adapters sampled / exact", peak_adapters),
    Column("proxy RSS p50 / max; HWM p50 / max MB", proxy_memory),
    *OUTCOME_COLUMNS,
)


def heading(results: Row) -> list[str]:
    turns = results["bursts"] * results["burst_turns"]
    return [
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


def row_summary(row: Row) -> str:
    """What the table leaves out: how the sessions opened, the requests, and how the proxies shared the slots."""
    line = (
        f"* {INSTALL.label(row['mode'])}: {row['sessions']} sessions opened in {row['creation_s']:.1f} s; "
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
    return line


SECTION = pool.section(INSTALL, heading, COLUMNS, row_summary)
