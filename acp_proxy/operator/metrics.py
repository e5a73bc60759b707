"""``acp-proxy metrics``: the install's figures in the Prometheus text format.

Two kinds of figures, read when the command runs:

* gauges, what the install is now: running proxies, sessions by state, live adapter
  trees and their memory, active turns, waiters for a slot, leases by state (an
  ``unverifiable`` one needs an operator), the caps. From the state database, the
  install's slot files and the running proxies' control sockets.
* counters since the install was created, added up over every proxy that ever ran
  on it (``acp_proxy.journal``): turns by status, resumes by method, fallbacks,
  suspensions (evictions) by reason, failed and timed-out starts, trees reaped at a
  stop, at startup and by ``acp-proxy reap``, pool waits and their time. Kept in the
  database, they never go backwards when a proxy exits, so ``rate()`` works on them
  for an install of short-lived proxies (one per session, as acpx runs them).

The install is read as every operator command reads it (``install_view.read_install``); the
families are built from the ``InstallFigures`` made of that by pure functions, and
written by the Prometheus client library (its exposition format and its atomic
``write_to_textfile``, for node_exporter's textfile collector). Nothing here is
imported by the relay.
"""

from __future__ import annotations

import sys
from collections import Counter as Tally
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import generate_latest, write_to_textfile
from prometheus_client.registry import Collector, CollectorRegistry

from acp_proxy import __version__, journal, timings
from acp_proxy.config import Config
from acp_proxy.operator.commands import open_existing
from acp_proxy.operator.install_view import InstallView, read_install
from acp_proxy.operator.reports import Liveness, OperatorError, status_answers
from acp_proxy.remote.status import running_servers
from acp_proxy.sessions.registry import SessionState
from acp_proxy.tasks.status import ACTIVE, effective_status

PREFIX: Final = "acp_proxy"


class Counted(msgspec.Struct, frozen=True):
    """How a journal counter is exported: its family, its help, and what its label means."""

    metric: str
    doc: str
    label: str | None
    """The name of the journal label's Prometheus label (``None``: a kind without one)."""
    seconds: str | None = None
    """The family of its summed seconds, if it has one."""


COUNTED: Final[Mapping[journal.Kind, Counted]] = {
    journal.Kind.TURN_ENDED: Counted("turns", "Prompt turns ended, by terminal status", "status"),
    journal.Kind.RESUMED: Counted("resumes", "Sessions brought back on a new process, by method", "method"),
    journal.Kind.FALLBACK: Counted(
        "resume_fallbacks",
        "Restores that fell back to session/new (history reset), by the failed method",
        "method",
    ),
    journal.Kind.SUSPENDED: Counted("evictions", "Sessions suspended (tree reaped, session kept), by reason", "reason"),
    journal.Kind.HANDOVER: Counted(
        "handovers",
        "Sessions handed between proxies of the install, by outcome (released, taken, kept, unanswered)",
        "outcome",
        seconds="handover_seconds",
    ),
    journal.Kind.CRASHED: Counted("adapter_exits", "Adapter processes that ended on their own, by how", "how"),
    journal.Kind.CLOSED: Counted("sessions_closed", "Sessions closed, by who asked", "by"),
    journal.Kind.DELETED: Counted("sessions_deleted", "Sessions deleted", None),
    journal.Kind.ADAPTER_STARTED: Counted("adapters_started", "Adapter processes started", "how"),
    journal.Kind.SPAWN_FAILED: Counted("spawn_failures", "Adapter starts that failed to spawn", None),
    journal.Kind.START_TIMEOUT: Counted(
        "start_timeouts", "Adapter starts that did not answer within start_timeout, by request", "request"
    ),
    journal.Kind.TREE_REAPED: Counted(
        "trees_reaped",
        "Adapter process trees reaped: at a stop, or left by a dead proxy (at startup, periodically, "
        "or by acp-proxy reap)",
        "when",
    ),
    journal.Kind.LEFTOVERS_KILLED: Counted(
        "leftover_processes_killed", "Processes that outlived their adapter, killed by their lease marker", None
    ),
    journal.Kind.UNVERIFIABLE: Counted(
        "unverifiable_leases", "Leases whose processes could not be proven gone, by when", "when"
    ),
    journal.Kind.POOL_WAIT: Counted(
        "pool_waits", "Starts that waited for a slot, by outcome", "outcome", seconds="pool_wait_seconds"
    ),
    journal.Kind.NOTIFY_FAILED: Counted(
        "notify_failures", "Task notifications not delivered, by why (exit, timeout, spawn, dropped)", "why"
    ),
    journal.Kind.EVICT_ASKED: Counted(
        "peer_evictions_asked", "Other proxies asked to suspend a session for a slot, by answer", "answer"
    ),
    journal.Kind.ATTACHED: Counted("attaches", "Clients attached to a live session (session/attach), by role", "role"),
    journal.Kind.DETACHED: Counted("detaches", "Attached clients that left, by why", "why"),
    journal.Kind.ANSWERED_ELSEWHERE: Counted(
        "answered_elsewhere",
        "Agent requests answered by an attached client or an operator rather than the gateway, by method",
        "method",
    ),
}


class InstallFigures(msgspec.Struct, frozen=True):
    """What ``families`` exports, gathered once."""

    proxies: int = 0
    sessions: Mapping[str, int] = msgspec.field(default_factory=dict)
    """by state"""
    live_adapters: Mapping[str, int] = msgspec.field(default_factory=dict)
    """install slots held, by backend"""
    memory: Mapping[str, int] = msgspec.field(default_factory=dict)
    """the live trees' memory as the budget measures it (PSS, else RSS), by backend; only where measured"""
    rss: Mapping[str, int] = msgspec.field(default_factory=dict)
    """the owned processes' resident memory, by backend"""
    active_turns: Mapping[tuple[str, str], int] = msgspec.field(default_factory=dict)
    """(backend, running|queued)"""
    waiting: Mapping[str, int] = msgspec.field(default_factory=dict)
    """starts waiting for a slot now, by backend"""
    leases: Mapping[str, int] = msgspec.field(default_factory=dict)
    """by state"""
    max_live: int | None = None
    max_memory: int | None = None
    counters: tuple[journal.Counter, ...] = ()
    serve_connections: Mapping[str, int] = msgspec.field(default_factory=dict)
    """the running ``serve`` processes' connections, by transport"""
    serve_refusals: Mapping[str, int] = msgspec.field(default_factory=dict)
    """what they refused since they started: failed_auth, too_many, slow_reader"""


def families(figures: InstallFigures) -> list[Metric]:
    """The metric families of an install's figures (pure)."""
    out: list[Metric] = []

    def gauge(name: str, help_: str, value: float) -> None:
        out.append(GaugeMetricFamily(f"{PREFIX}_{name}", help_, value=value))

    def gauges(name: str, help_: str, labels: list[str], values: Mapping[tuple[str, ...], float]) -> None:
        family = GaugeMetricFamily(f"{PREFIX}_{name}", help_, labels=labels)
        for key, value in sorted(values.items()):
            family.add_metric(list(key), value)
        out.append(family)

    info = GaugeMetricFamily(f"{PREFIX}_build_info", "The acp-proxy that wrote these figures", labels=["version"])
    info.add_metric([__version__], 1)
    out.append(info)
    gauge("proxies", "Running proxies of the install", figures.proxies)
    gauges(
        "sessions",
        "Sessions by state",
        ["state"],
        {(state.value,): figures.sessions.get(state.value, 0) for state in SessionState},
    )
    gauges("live_adapters", "Live adapter trees (install slots held)", ["backend"], _keyed(figures.live_adapters))
    gauges(
        "adapter_memory_bytes",
        "Memory of the live adapter trees as the memory budget measures it (PSS, else RSS); only with max_memory set",
        ["backend"],
        _keyed(figures.memory),
    )
    gauges("adapter_rss_bytes", "Resident memory of the processes the install owns", ["backend"], _keyed(figures.rss))
    turns: dict[tuple[str, ...], float] = {key: float(value) for key, value in figures.active_turns.items()}
    gauges("turns_active", "Prompt turns running or queued", ["backend", "status"], turns)
    gauges("pool_waiting", "Starts waiting for a slot now", ["backend"], _keyed(figures.waiting))
    gauges("leases", "Leases by state (unverifiable ones need an operator)", ["state"], _keyed(figures.leases))
    if figures.max_live is not None:
        gauge("pool_max_live", "The install's cap on live adapter trees", figures.max_live)
    if figures.max_memory is not None:
        gauge("pool_max_memory_bytes", "The install's memory budget for adapter trees", figures.max_memory)
    gauges(
        "serve_connections",
        "Connections of the running acp-proxy serve processes",
        ["transport"],
        _keyed(figures.serve_connections),
    )
    refusals = CounterMetricFamily(
        f"{PREFIX}_serve_refusals",
        "What the running acp-proxy serve processes refused since they started",
        labels=["reason"],
    )
    for reason, count in sorted(figures.serve_refusals.items()):
        refusals.add_metric([reason], count)
    out.append(refusals)
    out += counter_families(figures.counters)
    out += histogram_families(figures.counters)
    return out


def histogram_families(counters: Iterable[journal.Counter]) -> list[Metric]:
    """One histogram family per ``Timing`` (present even before anything was timed): ``<timing>_seconds``."""
    built: dict[timings.Timing, HistogramMetricFamily] = {}
    for timing in timings.Timing:
        label = timings.LABELS.get(timing)
        labels = ["backend"] if label is None else ["backend", label]
        built[timing] = HistogramMetricFamily(
            f"{PREFIX}_{timing.value}_seconds", timings.DESCRIPTIONS[timing], labels=labels
        )
    for histogram in timings.histograms(counters):
        labelled = timings.LABELS.get(histogram.timing) is not None
        values = [histogram.backend, histogram.label] if labelled else [histogram.backend]
        built[histogram.timing].add_metric(values, histogram.cumulative(), histogram.total)
    return list(built.values())


def counter_families(counters: Iterable[journal.Counter]) -> list[Metric]:
    """One counter family per ``COUNTED`` kind (present even before anything was counted)."""
    built: dict[journal.Kind, tuple[CounterMetricFamily, CounterMetricFamily | None]] = {}
    for kind, counted in COUNTED.items():
        labels = ["backend"] if counted.label is None else ["backend", counted.label]
        family = CounterMetricFamily(f"{PREFIX}_{counted.metric}", counted.doc, labels=labels)
        seconds = None
        if counted.seconds is not None:
            seconds = CounterMetricFamily(
                f"{PREFIX}_{counted.seconds}", f"{counted.doc}: seconds waited", labels=labels
            )
        built[kind] = (family, seconds)
    for counter in counters:
        try:
            kind = journal.Kind(counter.name)
        except ValueError:
            continue  # counted by a newer acp-proxy
        if kind not in built:
            continue
        family, seconds = built[kind]
        values = [counter.backend] if COUNTED[kind].label is None else [counter.backend, counter.label]
        family.add_metric(values, counter.count)
        if seconds is not None:
            seconds.add_metric(values, counter.seconds)
    return [metric for pair in built.values() for metric in pair if metric is not None]


def _keyed(values: Mapping[str, int]) -> dict[tuple[str, ...], float]:
    return {(key,): value for key, value in values.items()}


# --- gathering ---------------------------------------------------------------------------------------


def gather(state_dir: Path, config: Config | None) -> InstallFigures:
    """The install's figures now; an install with no state database yet has none but the caps."""
    max_live = config.pool.max_live if config is not None else None
    max_memory = config.pool.max_memory if config is not None else None
    db = open_existing(state_dir)
    if db is None:
        return with_servers(InstallFigures(max_live=max_live, max_memory=max_memory), running_servers(state_dir))
    try:
        view = read_install(
            db,
            state_dir,
            alive=Liveness(db),
            answers=status_answers(state_dir) if config is None else None,  # the caps the proxies enforce
            trees=True,
            waiting_for=config.backends if config is not None else (),
        )
    finally:
        db.close()
    return with_servers(figures_of(view, max_live, max_memory), running_servers(state_dir))


def with_servers(figures: InstallFigures, servers: Iterable[Mapping[str, Any]]) -> InstallFigures:
    """``figures`` with the connections and refusals of the running ``serve`` processes (pure)."""
    connections: Tally[str] = Tally()
    refusals: Tally[str] = Tally()
    for server in servers:
        for connection in server.get("connections", []):
            connections[str(connection.get("transport"))] += 1
        refusals["failed_auth"] += int(server.get("failedAuth", 0))
        refusals["too_many"] += int(server.get("refused", 0))
        refusals["slow_reader"] += int(server.get("slowReaders", 0))
    return msgspec.structs.replace(figures, serve_connections=dict(connections), serve_refusals=dict(refusals))


def figures_of(view: InstallView, max_live: int | None, max_memory: int | None) -> InstallFigures:
    """What ``families`` exports, from the install as read (the caps: the config's, else the largest
    a running proxy says it enforces)."""
    for proxy in view.proxies:
        max_live = max(max_live or 0, proxy.pool.get("maxLive") or 0) or max_live
        max_memory = max(max_memory or 0, proxy.pool.get("maxMemory") or 0) or max_memory
    live: Tally[str] = Tally()
    memory: Tally[str] = Tally()
    for held in view.slots:
        if held.record is None or held.record.launching:
            continue
        live[held.record.backend] += 1
        if held.record.memory is not None:
            memory[held.record.backend] += held.record.memory
    rss: Tally[str] = Tally()
    for lease in view.active_leases:
        rss[lease.backend] += sum(proc["rssBytes"] for proc in view.trees.get(lease.lease_id, ()))
    turns: Tally[tuple[str, str]] = Tally()
    for task in view.active_tasks:
        effective = effective_status(task.status, view.alive(task.instance_id))
        if effective in ACTIVE:
            turns[(task.backend, effective.value)] += 1
    return InstallFigures(
        proxies=sum(1 for proxy in view.proxies if proxy.alive),
        sessions=dict(view.sessions),
        live_adapters=dict(live),
        memory=dict(memory),
        rss=dict(rss),
        active_turns=dict(turns),
        waiting=dict(view.waiting),
        leases=dict(view.leases),
        max_live=max_live,
        max_memory=max_memory,
        counters=view.counters,
    )


# --- the command -------------------------------------------------------------------------------------


class _Figures(Collector):
    def __init__(self, figures: InstallFigures) -> None:
        self.figures = figures

    def collect(self) -> Iterator[Metric]:
        return iter(families(self.figures))


def _registry(figures: InstallFigures) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Figures(figures))
    return registry


def exposition(figures: InstallFigures) -> bytes:
    """The figures in the Prometheus text format."""
    return generate_latest(_registry(figures))


def metrics_command(state_dir: Path, config: Config | None, *, textfile: str | None) -> int:
    """Print the install's metrics, or write them atomically to ``textfile`` (node_exporter's textfile collector)."""
    figures = gather(state_dir, config)
    if textfile is None:
        sys.stdout.buffer.write(exposition(figures))
        sys.stdout.flush()
        return 0
    try:
        write_to_textfile(textfile, _registry(figures))  # a temporary file beside it, renamed over it
    except OSError as exc:
        raise OperatorError(f"--textfile: cannot write {textfile}: {exc.strerror or exc}") from None
    return 0
