"""The snapshot ``acp-proxy top`` shows, as plain data, and how it is gathered.

``Gatherer.gather`` makes one ``Snapshot`` of the install as ``install_view.read_install`` reads
it for every operator command: the state database, the install's slot records and each running
proxy's control socket (all asked at once, each with a short timeout: a proxy that does not
answer is shown so, it never holds the view up). Trees no
slot record has measured are measured here, at most every ``MEASURE_EVERY`` seconds. The
agents' requests waiting for an answer come from the same ``status`` answers (their
``waiting`` lists), oldest first over every proxy.

Whatever a gather waits on (a proxy that does not answer, a database another process holds
locked) may keep it for seconds: the view never waits for one to end. Proxies are asked from
daemon threads under one deadline, and a gather that has not returned when the view ends is
left to finish, or not, in its own daemon thread (it only reads).

Titles, agent text, event details, refusals and a waiting request's subject and option names
come from adapters: the rows hold them as one printable line (``reports.printable``), so that
drawing a snapshot never drives the terminal. Ids (a session's, a waiting request's key, an
option's id) are kept as they are (they are what an act names); the view prints them through
``short_id`` or ``reports.printable``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from acp_proxy import timings
from acp_proxy.journal import Event
from acp_proxy.operator import reports
from acp_proxy.operator.commands import open_existing
from acp_proxy.operator.install_view import InstallView, ProxyFacts, read_install
from acp_proxy.ownership.verify import Verdict, check_claim, process_table
from acp_proxy.pool.install import SlotRecord
from acp_proxy.pool.memory import measure_trees
from acp_proxy.remote.status import running_servers
from acp_proxy.sessions.registry import SessionState
from acp_proxy.state import StateDB
from acp_proxy.tasks.records import TaskRecord
from acp_proxy.tasks.status import TaskStatus

PROXY_TIMEOUT: Final = 1.0
"""How long each proxy has to answer ``status`` before it is shown as not answering."""
MEASURE_EVERY: Final = 5.0
"""Trees no slot record has measured are measured here at most this often (a walk of the process table)."""
EVENTS_READ: Final = 50
SESSIONS_READ: Final = 200
CLOSED_SHOWN_FOR: Final = 3600.0
"""A closed session stays listed while its last activity is this recent (the operator sees a close land)."""


# --- the snapshot: plain data ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProxyRow:
    instance: str
    pid: int
    started_at: float
    alive: bool
    answered: bool = False
    problem: str | None = None
    """Why it has no answer: gone, or what asking it said."""
    async_backend: str | None = None
    live: int | None = None
    max_live: int | None = None
    max_memory: int | None = None
    sessions: int | None = None
    turns: int | None = None
    attached_clients: int | None = None
    """Clients attached to its sessions (shared sessions), as it answered."""


@dataclass(frozen=True, slots=True)
class SessionRow:
    session_id: str
    backend: str
    state: str
    title: str | None = None
    instance: str | None = None
    proxy_alive: bool = True
    idle_seconds: float | None = None
    busy: bool = False
    memory: int | None = None
    memory_kind: str | None = None
    """``pss`` or ``rss``: how the figure was read."""


@dataclass(frozen=True, slots=True)
class TurnRow:
    task_id: str
    session_id: str
    backend: str
    status: str
    updates: int
    tool_calls: int
    elapsed_seconds: float | None
    last_text: str


@dataclass(frozen=True, slots=True)
class EventRow:
    event_id: int
    at: float
    kind: str
    label: str = ""
    session_id: str | None = None
    backend: str = ""
    detail: str = ""
    instance: str | None = None


@dataclass(frozen=True, slots=True)
class OptionRow:
    """One answer a waiting permission request offers."""

    option_id: str
    """As the agent sent it: what an answer names."""
    name: str | None = None
    kind: str | None = None


@dataclass(frozen=True, slots=True)
class WaitingRow:
    """A request of an agent's waiting for an answer (``session/request_permission``, ``elicitation/create``)."""

    request: str
    """Its key, as the proxy names it (``acp-proxy permissions``, ``answer_permission``)."""
    instance: str
    """The proxy it waits in: where an answer is sent."""
    pid: int
    session_id: str
    method: str
    subject: str = ""
    """The tool call's title (or the elicitation's message); may be empty."""
    options: tuple[OptionRow, ...] = ()
    waiting_seconds: float | None = None
    """How long it had waited when its proxy answered ``status``."""
    sent_to: tuple[str, ...] = ()
    """The attached clients it was sent to besides the gateway."""
    asked_at: float | None = None


@dataclass(frozen=True, slots=True)
class PoolUsage:
    live: int = 0
    max_live: int | None = None
    memory_used: int | None = None
    max_memory: int | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The install at one moment, as ``top`` shows it."""

    state_dir: str
    taken_at: float
    database: bool
    """Whether any proxy has used the state dir yet."""
    pool: PoolUsage = field(default_factory=PoolUsage)
    proxies: tuple[ProxyRow, ...] = ()
    sessions: tuple[SessionRow, ...] = ()
    turns: tuple[TurnRow, ...] = ()
    events: tuple[EventRow, ...] = ()
    timings: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Each timing's ``count``, ``p50`` and ``p95`` (seconds) over every backend since the install was created."""
    problem: str | None = None
    """The last gathering failed (this is the one before it): why."""
    remote_connections: int | None = None
    """Connections of the running ``acp-proxy serve`` processes; ``None`` when none runs."""
    waiting: tuple[WaitingRow, ...] = ()
    """The agents' requests waiting for an answer, in every proxy, oldest first."""


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def snapshot_json(snapshot: Snapshot) -> dict[str, Any]:
    """The snapshot as one JSON document, keys in the camelCase of the other ``--json`` outputs."""

    def convert(value: object) -> object:
        if isinstance(value, dict):
            return {_camel(key): convert(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [convert(item) for item in value]
        return value

    document = convert(dataclasses.asdict(snapshot))
    assert isinstance(document, dict)
    return document


# --- gathering (I/O) -------------------------------------------------------------------------


class Gatherer:
    """Reads snapshots of one install. Not thread-safe: one thread gathers (the database connection is its own)."""

    def __init__(
        self,
        state_dir: Path,
        *,
        max_live: int | None = None,
        max_memory: int | None = None,
        proxy_timeout: float = PROXY_TIMEOUT,
    ) -> None:
        self.state_dir = state_dir
        self.max_live = max_live
        self.max_memory = max_memory
        self.proxy_timeout = proxy_timeout
        self._db: StateDB | None = None
        self._measured: dict[str, tuple[int, str]] = {}
        self._measured_at = -math.inf

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def gather(self) -> Snapshot:
        moment = time.time()
        if self._db is None:
            self._db = open_existing(self.state_dir)
        db = self._db
        if db is None:
            return Snapshot(str(self.state_dir), moment, False, PoolUsage(0, self.max_live, None, self.max_memory))
        view = read_install(
            db,
            self.state_dir,
            alive=reports.Liveness(db),
            answers=reports.status_answers(self.state_dir, self.proxy_timeout),
            recent_sessions=(moment - CLOSED_SHOWN_FOR, SESSIONS_READ),
            events=EVENTS_READ,
        )
        proxies = tuple(proxy_facts_row(proxy) for proxy in view.proxies)
        waiting = waiting_of(view)
        slot_records = [held.record for held in view.slots]
        by_session = {record.session: record for record in slot_records if record is not None and record.session}
        sessions = self._sessions(view, by_session)
        answered = [p for p in proxies if p.answered]
        max_live = self.max_live or max((p.max_live for p in answered if p.max_live), default=None)
        max_memory = self.max_memory or max((p.max_memory for p in answered if p.max_memory), default=None)
        spares = [r.memory for r in slot_records if r is not None and not r.session and r.memory is not None]
        measured = [s.memory for s in sessions if s.state == "live" and s.memory is not None] + spares
        pool = PoolUsage(len(slot_records), max_live, sum(measured) if measured else None, max_memory)
        events = tuple(event_row(event) for event in view.events)
        found = timings.overall(timings.histograms(view.counters))
        timed = timings.quantiles_json(found)
        servers = running_servers(self.state_dir)
        remote = sum(len(server.get("connections", [])) for server in servers) if servers else None
        return Snapshot(
            str(self.state_dir),
            view.taken_at,
            True,
            pool,
            proxies,
            sessions,
            _turns(view),
            events,
            timed,
            remote_connections=remote,
            waiting=waiting,
        )

    def _sessions(self, view: InstallView, by_session: dict[str, SlotRecord]) -> tuple[SessionRow, ...]:
        rows = view.recent_sessions
        unmeasured = {
            lease_id: session_id
            for session_id, _, state, _, instance_id, lease_id, _ in rows
            if state == SessionState.LIVE and lease_id and view.alive(instance_id)
            if by_session.get(session_id) is None or by_session[session_id].memory is None
        }
        self._measure(view, list(unmeasured))
        sessions = []
        for session_id, backend, state, title, instance_id, lease_id, last_active_at in rows:
            record = by_session.get(session_id)
            live = state in (SessionState.LIVE, SessionState.RESUMING)
            idle = max(0.0, view.taken_at - last_active_at) if last_active_at else None
            memory, kind = None, None
            if live and record is not None:
                idle = max(0.0, view.clock - record.last_active)
                memory, kind = record.memory, record.memory_kind
            if state == SessionState.LIVE and memory is None and lease_id in self._measured:
                memory, kind = self._measured[lease_id]
            sessions.append(
                SessionRow(
                    session_id,
                    backend,
                    state,
                    None if title is None else reports.printable(title),
                    instance_id,
                    view.alive(instance_id) if live else True,
                    idle,
                    bool(record is not None and live and record.busy),
                    memory,
                    kind,
                )
            )
        order = {SessionState.LIVE: 0, SessionState.RESUMING: 0, SessionState.SUSPENDED: 1}
        return tuple(sorted(sessions, key=lambda s: order.get(SessionState(s.state), 2)))

    def _measure(self, view: InstallView, lease_ids: Sequence[str]) -> None:
        """Measure the trees of ``lease_ids`` (the wrapper proved the lease's own first), every few seconds."""
        if not lease_ids or time.monotonic() - self._measured_at < MEASURE_EVERY:
            return
        self._measured_at = time.monotonic()
        table = process_table()
        roots: dict[int, str] = {}
        active = {lease.lease_id: lease for lease in view.active_leases}
        for lease_id in lease_ids:
            lease = active.get(lease_id)
            claim = lease.wrapper_claim() if lease is not None else None
            if claim is not None and check_claim(claim, table).verdict is Verdict.OURS:
                roots[claim.pid] = lease_id
        measured = measure_trees(roots, table=table)
        self._measured = {roots[pid]: (tree.total, tree.method) for pid, tree in measured.items() if tree.processes}


def proxy_facts_row(proxy: ProxyFacts) -> ProxyRow:
    """A proxy's row: gone, or from its answer to ``status`` (or why it gave none)."""
    if not proxy.alive:
        return ProxyRow(proxy.instance_id, proxy.pid, proxy.started_at, False, problem="gone, not yet reaped")
    answer = proxy.answer
    if isinstance(answer, str):  # the row names the proxy already
        answer = answer.removeprefix(f"the proxy (instance {proxy.instance_id})").removeprefix(":").strip()
    return proxy_row(proxy.instance_id, proxy.pid, proxy.started_at, answer if answer is not None else "not asked")


def _turns(view: InstallView) -> tuple[TurnRow, ...]:
    turns = [turn_row(record, view.taken_at) for record in view.active_tasks if view.alive(record.instance_id)]
    return tuple(sorted(turns, key=lambda t: (t.status != TaskStatus.RUNNING, -(t.elapsed_seconds or 0.0))))


# --- rows from what was read (pure) ------------------------------------------------------------


def proxy_row(instance_id: str, pid: int, started_at: float, answer: dict[str, Any] | str) -> ProxyRow:
    """A running proxy's row from its answer to ``status``, or from why it gave none."""
    if isinstance(answer, str):
        return ProxyRow(instance_id, pid, started_at, True, problem=reports.printable(answer))
    pool = answer.get("pool", {})
    async_backend = answer.get("asyncBackend")
    return ProxyRow(
        instance_id,
        pid,
        started_at,
        True,
        answered=True,
        async_backend=None if async_backend is None else reports.printable(str(async_backend)),
        live=pool.get("live"),
        max_live=pool.get("maxLive"),
        max_memory=pool.get("maxMemory"),
        sessions=answer.get("sessions"),
        turns=len(answer.get("turns", [])),
        attached_clients=_count(answer.get("attachedClients")),
    )


def waiting_of(view: InstallView) -> tuple[WaitingRow, ...]:
    """Every answering proxy's waiting requests, oldest first."""
    rows = [
        row
        for proxy in view.proxies
        if proxy.alive and isinstance(proxy.answer, dict)
        for row in waiting_rows(proxy.instance_id, proxy.pid, proxy.answer)
    ]

    def asked_at(row: WaitingRow) -> float:
        return row.asked_at if row.asked_at is not None else view.taken_at - (row.waiting_seconds or 0.0)

    return tuple(sorted(rows, key=lambda row: (asked_at(row), row.request)))


def waiting_rows(instance_id: str, pid: int, answer: dict[str, Any]) -> list[WaitingRow]:
    """The requests a proxy's ``status`` answer lists as waiting (its ``waiting``), as it listed them.

    What is not as the proxy documents it is skipped (a request without a key or a session) or
    left out (an option without an id); the agent's text is made printable."""
    listed = answer.get("waiting")
    rows: list[WaitingRow] = []
    for item in listed if isinstance(listed, list) else ():
        if not isinstance(item, dict):
            continue
        key, session_id = item.get("request"), item.get("sessionId")
        if not isinstance(key, str) or not key or not isinstance(session_id, str):
            continue
        options = item.get("options")
        sent_to = item.get("sentTo")
        rows.append(
            WaitingRow(
                key,
                instance_id,
                pid,
                session_id,
                reports.printable(str(item.get("method") or "?")),
                reports.printable(item["subject"]) if isinstance(item.get("subject"), str) else "",
                tuple(
                    OptionRow(option["optionId"], _text(option.get("name")), _text(option.get("kind")))
                    for option in (options if isinstance(options, list) else ())
                    if isinstance(option, dict) and isinstance(option.get("optionId"), str)
                ),
                _seconds(item.get("waitingSeconds")),
                tuple(reports.printable(label) for label in sent_to if isinstance(label, str))
                if isinstance(sent_to, list)
                else (),
                _seconds(item.get("askedAt")),
            )
        )
    return rows


def _text(value: object) -> str | None:
    return reports.printable(value) if isinstance(value, str) else None


def _seconds(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def turn_row(record: TaskRecord, moment: float) -> TurnRow:
    """A running or queued turn's row; its elapsed time counts while it runs."""
    started = record.started_at
    return TurnRow(
        record.task_id,
        record.session_id,
        record.backend,
        record.status.value,
        record.update_count,
        record.tool_calls,
        None if started is None or record.status is not TaskStatus.RUNNING else max(0.0, moment - started),
        last_line(record.summary),
    )


def event_row(event: Event) -> EventRow:
    """A journal event's row; its label and detail (an adapter's error message, say) made printable."""
    return EventRow(
        event.event_id,
        event.at,
        event.kind,
        reports.printable(event.label),
        event.session_id,
        event.backend,
        reports.printable(event.detail),
        event.instance_id,
    )


def last_line(text: str) -> str:
    """The last non-blank line of the agent's text, its whitespace collapsed, printable."""
    for line in reversed(text.splitlines()):
        if line.strip():
            return reports.printable(" ".join(line.split()))
    return ""
