"""``acp-proxy top``: a live, full-screen view of the install, refreshed about once a second.

Three parts, kept apart so that the two decisions are plain functions over plain data:

* ``Gatherer.gather`` reads one ``Snapshot`` from the state database, the install's slot
  records and each running proxy's control socket (asked with a short timeout: a proxy that
  does not answer is shown so, it never holds the view up). Trees no slot record has measured
  are measured here, at most every ``MEASURE_EVERY`` seconds.
* ``render(snapshot, view, width, height)`` and ``on_key(view, snapshot, key)`` decide what
  the screen shows and what a key does. Neither does I/O.
* ``run`` is the edge: the terminal in cbreak mode, a refresher thread that gathers, acts
  (suspend, close, cancel) in threads of their own through the same code as ``acp-proxy
  sessions suspend|close`` and ``tasks cancel``, and a self-pipe that wakes the loop when a
  key, a snapshot, an outcome or a resize arrives.

``rich`` draws the screen and owns the alternate screen and the cursor; this module is
imported only by ``acp-proxy top``, never by the relay.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import enum
import json
import math
import os
import re
import select
import signal
import sys
import termios
import threading
import time
import tty
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any, Final, Literal, TextIO

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Column, Table
from rich.text import Text

from acp_proxy.journal import recent_events
from acp_proxy.operator import control, reports
from acp_proxy.operator.commands import open_existing
from acp_proxy.ownership.leases import ACTIVE_STATES, Lease
from acp_proxy.ownership.verify import Verdict, check_claim, process_table
from acp_proxy.pool.install import InstallSlots, SlotRecord
from acp_proxy.pool.memory import measure_trees
from acp_proxy.sessions.registry import SessionState
from acp_proxy.state import StateDB
from acp_proxy.tasks.records import ACTIVE, TaskStatus, list_tasks

DEFAULT_INTERVAL: Final = 1.0
PROXY_TIMEOUT: Final = 1.0
"""How long each proxy has to answer ``status`` before it is shown as not answering."""
MEASURE_EVERY: Final = 5.0
"""Trees no slot record has measured are measured here at most this often (a walk of the process table)."""
EVENTS_READ: Final = 50
SESSIONS_READ: Final = 200
CLOSED_SHOWN_FOR: Final = 3600.0
"""A closed session stays listed while its last activity is this recent (the operator sees a close land)."""

Action = Literal["suspend", "close", "cancel"]


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
    problem: str | None = None
    """The last gathering failed (this is the one before it): why."""


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
        self._askers = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="acp-proxy top ask")
        self._measured: dict[str, tuple[int, str]] = {}
        self._measured_at = -math.inf

    def close(self) -> None:
        self._askers.shutdown(wait=False, cancel_futures=True)
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
        alive = reports.Liveness(db)
        proxies = self._proxies(db, alive)
        slot_records = [held.record for held in InstallSlots(self.state_dir, "reader").holders()]
        held = len(slot_records)
        by_session = {record.session: record for record in slot_records if record is not None and record.session}
        sessions = self._sessions(db, alive, by_session, moment)
        answered = [p for p in proxies if p.answered]
        max_live = self.max_live or max((p.max_live for p in answered if p.max_live), default=None)
        max_memory = self.max_memory or max((p.max_memory for p in answered if p.max_memory), default=None)
        spares = [r.memory for r in slot_records if r is not None and not r.session and r.memory is not None]
        measured = [s.memory for s in sessions if s.state == "live" and s.memory is not None] + spares
        pool = PoolUsage(held, max_live, sum(measured) if measured else None, max_memory)
        events = tuple(
            EventRow(e.event_id, e.at, e.kind, e.label, e.session_id, e.backend, e.detail, e.instance_id)
            for e in recent_events(db.conn, EVENTS_READ)
        )
        return Snapshot(
            str(self.state_dir), moment, True, pool, proxies, sessions, self._turns(db, alive, moment), events
        )

    def _proxies(self, db: StateDB, alive: reports.Liveness) -> tuple[ProxyRow, ...]:
        rows = db.conn.execute(
            "SELECT instance_id, pid, started_at FROM instances WHERE ended_at IS NULL ORDER BY started_at"
        ).fetchall()
        asked = {
            instance_id: self._askers.submit(_ask_status, self.state_dir, instance_id, self.proxy_timeout)
            for instance_id, _, _ in rows
            if alive(instance_id)
        }
        proxies = []
        for instance_id, pid, started_at in rows:
            if instance_id not in asked:
                proxies.append(ProxyRow(instance_id, pid, started_at, False, problem="gone, not yet reaped"))
                continue
            answer = asked[instance_id].result()
            if isinstance(answer, str):
                proxies.append(ProxyRow(instance_id, pid, started_at, True, problem=answer))
                continue
            pool = answer.get("pool", {})
            proxies.append(
                ProxyRow(
                    instance_id,
                    pid,
                    started_at,
                    True,
                    answered=True,
                    async_backend=answer.get("asyncBackend"),
                    live=pool.get("live"),
                    max_live=pool.get("maxLive"),
                    max_memory=pool.get("maxMemory"),
                    sessions=answer.get("sessions"),
                    turns=len(answer.get("turns", [])),
                )
            )
        return tuple(proxies)

    def _sessions(
        self, db: StateDB, alive: reports.Liveness, by_session: dict[str, SlotRecord], moment: float
    ) -> tuple[SessionRow, ...]:
        rows = db.conn.execute(
            """SELECT session_id, backend, state, title, instance_id, lease_id, last_active_at FROM sessions
               WHERE state IN ('live', 'resuming', 'suspended') OR (state = 'closed' AND last_active_at >= ?)
               ORDER BY last_active_at DESC LIMIT ?""",
            (moment - CLOSED_SHOWN_FOR, SESSIONS_READ),
        ).fetchall()
        unmeasured = {
            lease_id: session_id
            for session_id, _, state, _, instance_id, lease_id, _ in rows
            if state == SessionState.LIVE and lease_id and alive(instance_id)
            if by_session.get(session_id) is None or by_session[session_id].memory is None
        }
        self._measure(db, list(unmeasured))
        now_monotonic = time.monotonic()
        sessions = []
        for session_id, backend, state, title, instance_id, lease_id, last_active_at in rows:
            record = by_session.get(session_id)
            live = state in (SessionState.LIVE, SessionState.RESUMING)
            idle = max(0.0, moment - last_active_at) if last_active_at else None
            memory, kind = None, None
            if live and record is not None:
                idle = max(0.0, now_monotonic - record.last_active)
                memory, kind = record.memory, record.memory_kind
            if state == SessionState.LIVE and memory is None and lease_id in self._measured:
                memory, kind = self._measured[lease_id]
            sessions.append(
                SessionRow(
                    session_id,
                    backend,
                    state,
                    title,
                    instance_id,
                    alive(instance_id) if live else True,
                    idle,
                    bool(record is not None and live and record.busy),
                    memory,
                    kind,
                )
            )
        order = {SessionState.LIVE: 0, SessionState.RESUMING: 0, SessionState.SUSPENDED: 1}
        return tuple(sorted(sessions, key=lambda s: order.get(SessionState(s.state), 2)))

    def _measure(self, db: StateDB, lease_ids: Sequence[str]) -> None:
        """Measure the trees of ``lease_ids`` (the wrapper proved the lease's own first), every few seconds."""
        if not lease_ids or time.monotonic() - self._measured_at < MEASURE_EVERY:
            return
        self._measured_at = time.monotonic()
        table = process_table()
        roots: dict[int, str] = {}
        states = [state.value for state in ACTIVE_STATES]
        for lease_id in lease_ids:
            row = db.conn.execute(
                f"SELECT * FROM leases WHERE lease_id = ? AND state IN ({', '.join('?' * len(states))})",
                (lease_id, *states),
            ).fetchone()
            claim = Lease.from_row(row).wrapper_claim() if row is not None else None
            if claim is not None and check_claim(claim, table).verdict is Verdict.OURS:
                roots[claim.pid] = lease_id
        measured = measure_trees(roots, table=table)
        self._measured = {roots[pid]: (tree.total, tree.method) for pid, tree in measured.items() if tree.processes}

    def _turns(self, db: StateDB, alive: reports.Liveness, moment: float) -> tuple[TurnRow, ...]:
        turns = []
        for record in list_tasks(db, statuses=sorted(ACTIVE), limit=None):
            if not alive(record.instance_id):
                continue  # lost with its proxy
            started = record.started_at
            turns.append(
                TurnRow(
                    record.task_id,
                    record.session_id,
                    record.backend,
                    record.status.value,
                    record.update_count,
                    record.tool_calls,
                    None if started is None or record.status is not TaskStatus.RUNNING else max(0.0, moment - started),
                    last_line(record.summary),
                )
            )
        return tuple(sorted(turns, key=lambda t: (t.status != TaskStatus.RUNNING, -(t.elapsed_seconds or 0.0))))


def _ask_status(state_dir: Path, instance_id: str, timeout: float) -> dict[str, Any] | str:
    """A proxy's answer to ``status``, or why there is none (a few words, for its row)."""
    try:
        return control.request(control.socket_path(state_dir, instance_id), "status", timeout=timeout)
    except control.ControlUnavailable:
        return "no answer: its control socket is gone"
    except TimeoutError:
        return f"no answer within {timeout:g}s"
    except control.ControlError as exc:
        return f"refused: {exc.message}"
    except OSError as exc:
        return f"no answer: {exc.strerror or exc}"


def last_line(text: str) -> str:
    """The last non-blank line of the agent's text, its whitespace collapsed."""
    for line in reversed(text.splitlines()):
        if line.strip():
            return " ".join(line.split())
    return ""


# --- the view state and the keys (pure) --------------------------------------------------------


class Focus(enum.StrEnum):
    SESSIONS = "sessions"
    TURNS = "turns"


@dataclass(frozen=True, slots=True)
class Pending:
    """An act that waits for its confirmation, or is being done."""

    action: Action
    target: str
    """The session id (``suspend``, ``close``) or the task id (``cancel``)."""

    def describe(self) -> str:
        what = "turn" if self.action == "cancel" else "session"
        return f"{self.action} {what} {short_id(self.target, 24)}"


@dataclass(frozen=True, slots=True)
class ViewState:
    focus: Focus = Focus.SESSIONS
    session: str | None = None
    """The selected session's id; ``None``, or an id no longer listed: the first row."""
    turn: str | None = None
    pending: Pending | None = None
    """Asked for, waiting for y/n."""
    working: Pending | None = None
    """Confirmed, being done."""
    message: str | None = None
    failed: bool = False


@dataclass(frozen=True, slots=True)
class Step:
    view: ViewState
    act: Pending | None = None
    quit: bool = False


def selected_index(ids: Sequence[str], selected: str | None) -> int | None:
    if not ids:
        return None
    return ids.index(selected) if selected in ids else 0


def selected_session(snapshot: Snapshot, view: ViewState) -> str | None:
    ids = [s.session_id for s in snapshot.sessions]
    index = selected_index(ids, view.session)
    return None if index is None else ids[index]


def selected_turn(snapshot: Snapshot, view: ViewState) -> str | None:
    ids = [t.task_id for t in snapshot.turns]
    index = selected_index(ids, view.turn)
    return None if index is None else ids[index]


def _moved(ids: Sequence[str], selected: str | None, by: int) -> str | None:
    index = selected_index(ids, selected)
    return None if index is None else ids[max(0, min(len(ids) - 1, index + by))]


def on_key(view: ViewState, snapshot: Snapshot, key: str) -> Step:
    """What ``key`` does: the next view state, and the act it confirms (or the quit it asks for)."""
    if view.pending is not None:
        if key in ("y", "Y"):
            return Step(replace(view, pending=None, working=view.pending, message=None), act=view.pending)
        if key in ("n", "N", "esc", "q"):
            return Step(replace(view, pending=None, message="not done", failed=False))
        return Step(view)
    if key == "q":
        return Step(view, quit=True)
    if key in ("up", "k", "down", "j"):
        by = -1 if key in ("up", "k") else 1
        if view.focus is Focus.SESSIONS:
            return Step(replace(view, session=_moved([s.session_id for s in snapshot.sessions], view.session, by)))
        return Step(replace(view, turn=_moved([t.task_id for t in snapshot.turns], view.turn, by)))
    if key in ("tab", "backtab"):
        return Step(replace(view, focus=Focus.TURNS if view.focus is Focus.SESSIONS else Focus.SESSIONS))
    if key in ("s", "c", "x"):
        if view.working is not None:
            return Step(replace(view, message=f"wait: still doing {view.working.describe()}", failed=True))
        if key == "x":
            target = selected_turn(snapshot, view)
            if target is None:
                return Step(replace(view, message="no running turn to cancel", failed=True))
            return Step(replace(view, pending=Pending("cancel", target), message=None))
        target = selected_session(snapshot, view)
        if target is None:
            return Step(replace(view, message="no session selected", failed=True))
        return Step(replace(view, pending=Pending("suspend" if key == "s" else "close", target), message=None))
    if key == "esc":
        return Step(replace(view, message=None))
    return Step(view)


def acted(view: ViewState, message: str, failed: bool) -> ViewState:
    """The view once the act being done has an outcome."""
    return replace(view, working=None, message=message, failed=failed)


# --- rendering (pure) --------------------------------------------------------------------------


def _short(text: str | None, width: int) -> str:
    if not text:
        return ""
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


def short_id(identifier: str | None, width: int) -> str:
    """An id cut in the middle to ``width``: its head can be typed as a prefix (``acp-proxy sessions show``),
    its tail tells apart ids made moments apart (UUIDv7s share their head)."""
    if not identifier or len(identifier) <= width:
        return identifier or ""
    head = max(4, (width - 1) // 2)
    return identifier[:head] + "…" + identifier[len(identifier) - (width - 1 - head) :]


def _span(seconds: float | None) -> str:
    """``42s``, ``3m05s``, ``2h07m``, ``3d04h``: two units at most."""
    if seconds is None:
        return "-"
    whole = int(seconds)
    for unit, size, small, small_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60), ("m", 60, "s", 1)):
        if whole >= size:
            return f"{whole // size}{unit}{(whole % size) // small_size:02d}{small}"
    return f"{whole}s"


def _size(size: int | None) -> str:
    if size is None:
        return "-"
    for unit, scale in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if size >= scale:
            value = size / scale
            return f"{value:.1f}{unit}" if value < 10 else f"{value:.0f}{unit}"
    return f"{size}B"


def _line(text: str | Text, width: int, style: str = "") -> Text:
    line = Text(text, style=style, no_wrap=True, overflow="ellipsis") if isinstance(text, str) else text
    line.no_wrap, line.overflow = True, "ellipsis"
    line.truncate(width, overflow="ellipsis")
    return line


def _table(width: int, columns: Sequence[Column]) -> Table:
    for column in columns:
        column.no_wrap = True
        column.overflow = "ellipsis"
    return Table(
        *columns,
        box=None,
        padding=(0, 1, 0, 0),
        show_edge=False,
        pad_edge=False,
        width=width,
        header_style="bold",
        collapse_padding=True,
    )


@dataclass(frozen=True, slots=True)
class _Panel:
    name: str
    rows: int
    least: int
    """Rows it needs to be worth showing (when it has that many)."""


def allot(height: int, panels: Sequence[_Panel], order: Sequence[str]) -> dict[str, int]:
    """Rows each panel gets within ``height`` lines, a panel taking two more for its title and header.

    Every panel first gets its least (those that do not fit are dropped: the last of ``panels``
    first); what is left goes to the panels in ``order``, each as much as it can show.
    """
    cost = {p.name: 2 + min(p.rows, p.least) if p.rows else 2 for p in panels}
    shown = list(panels)
    while shown and sum(cost[p.name] for p in shown) > height:
        shown.pop()
    rows = {p.name: min(p.rows, p.least) for p in shown}
    left = height - sum(cost[p.name] for p in shown)
    by_name = {p.name: p for p in shown}
    for name in order:
        if name in by_name and left > 0:
            more = min(left, by_name[name].rows - rows[name])
            rows[name] += more
            left -= more
    return rows


def _window(count: int, rows: int, selected: int | None) -> range:
    """Which rows of a list of ``count`` to show in ``rows`` lines so that the selected one is among them."""
    start = 0 if selected is None or selected < rows else selected - rows + 1
    return range(start, min(count, start + rows))


def _title(label: str, count: int, shown: range, width: int, focused: bool | None = None) -> Text:
    mark = "" if focused is None else "» " if focused else "  "
    more = f"  {shown.start + 1}-{shown.stop} of {count}" if count > len(shown) and len(shown) else ""
    return _line(Text(f"{mark}{label} ({count}){more}", style="bold reverse" if focused else "bold"), width)


def _header(snapshot: Snapshot, width: int) -> Text:
    pool = snapshot.pool
    parts = [f"acp-proxy top  {snapshot.state_dir}"]
    parts.append(f"live {pool.live}/{pool.max_live if pool.max_live is not None else '?'}")
    if pool.max_memory is not None:
        parts.append(
            f"memory {_size(pool.memory_used) if pool.memory_used is not None else '?'}/{_size(pool.max_memory)}"
        )
    elif pool.memory_used is not None:
        parts.append(f"memory {_size(pool.memory_used)}")
    parts.append(f"proxies {sum(1 for p in snapshot.proxies if p.alive)}")
    tail = "  ".join(parts[1:])
    head = _short(parts[0], max(14, width - len(tail) - 2))
    return _line(Text(f"{head}  {tail}", style="bold"), width)


KEYS_HELP: Final = "↑↓/jk select  Tab list  s suspend  c close  x cancel turn  q quit"


def _status_line(snapshot: Snapshot, view: ViewState, width: int) -> Text:
    if view.pending is not None:
        return _line(Text(f"{view.pending.describe()}? (y/n)", style="bold yellow"), width)
    if view.working is not None:
        return _line(Text(f"{view.working.describe()}…", style="yellow"), width)
    if view.message:
        return _line(Text(view.message, style="bold red" if view.failed else "green"), width)
    if snapshot.problem:
        return _line(Text(f"cannot read the install: {snapshot.problem}", style="red"), width)
    return _line(Text(KEYS_HELP, style="dim"), width)


def _proxies_table(snapshot: Snapshot, rows: range, width: int) -> Table:
    wide = width >= 100
    columns = [
        Column("PROXY", width=12),
        Column("PID", width=7),
        Column("UP", width=6),
        Column("LOOP", width=7),
        Column("LIVE", width=5),
    ]
    if wide:
        columns += [Column("SESSIONS", width=8), Column("TURNS", width=5)]
    columns.append(Column("NOTE", ratio=1))
    table = _table(width, columns)
    for proxy in (snapshot.proxies[i] for i in rows):
        cells = [
            proxy.instance,
            str(proxy.pid),
            _span(max(0.0, snapshot.taken_at - proxy.started_at)),
            proxy.async_backend or "-",
            "-" if proxy.live is None else str(proxy.live),
        ]
        if wide:
            cells += [
                "-" if proxy.sessions is None else str(proxy.sessions),
                "-" if proxy.turns is None else str(proxy.turns),
            ]
        cells.append(proxy.problem or "")
        table.add_row(*cells, style="" if proxy.answered else "red")
    return table


def _sessions_table(snapshot: Snapshot, view: ViewState, rows: range, width: int) -> Table:
    wide = width >= 100
    id_width = 24 if wide else 14
    columns = [
        Column("", width=1),
        Column("SESSION", width=id_width),
        Column("BACKEND", width=10 if wide else 8),
        Column("STATE", width=9),
        Column("IDLE", width=6),
        Column("MEMORY", width=6),
    ]
    if wide:
        columns.append(Column("PROXY", width=12))
    columns.append(Column("TITLE", ratio=1))
    table = _table(width, columns)
    selected = selected_index([s.session_id for s in snapshot.sessions], view.session)
    focused = view.focus is Focus.SESSIONS
    for index in rows:
        session = snapshot.sessions[index]
        state = "busy" if session.busy and session.state == "live" else session.state
        if session.state in ("live", "resuming") and not session.proxy_alive:
            state += "?"  # its proxy is gone: the row is stale until the next start sweeps it
        cells = [
            ">" if index == selected else "",
            short_id(session.session_id, id_width),
            session.backend,
            state,
            _span(session.idle_seconds) if session.state != "closed" else "-",
            _size(session.memory) if session.memory is not None else "-",
        ]
        if wide:
            cells.append(session.instance or "-")
        cells.append(session.title or "")
        style = ("reverse" if focused else "underline") if index == selected else ""
        table.add_row(*cells, style=style)
    return table


def _turns_table(snapshot: Snapshot, view: ViewState, rows: range, width: int) -> Table:
    wide = width >= 100
    id_width = 24 if wide else 12
    columns = [
        Column("", width=1),
        Column("TASK", width=12),
        Column("SESSION", width=id_width),
        Column("UPD", width=4),
        Column("TOOLS", width=5),
        Column("ELAPSED", width=7),
        Column("LAST TEXT", ratio=1),
    ]
    table = _table(width, columns)
    selected = selected_index([t.task_id for t in snapshot.turns], view.turn)
    focused = view.focus is Focus.TURNS
    for index in rows:
        turn = snapshot.turns[index]
        elapsed = _span(turn.elapsed_seconds) if turn.status == TaskStatus.RUNNING else turn.status
        cells = [
            ">" if index == selected else "",
            short_id(turn.task_id, 12),
            short_id(turn.session_id, id_width),
            str(turn.updates),
            str(turn.tool_calls),
            elapsed,
            turn.last_text,
        ]
        style = ("reverse" if focused else "underline") if index == selected else ""
        table.add_row(*cells, style=style)
    return table


def _events_table(snapshot: Snapshot, rows: range, width: int) -> Table:
    wide = width >= 100
    id_width = 24 if wide else 14
    columns = [
        Column("AGO", width=6),
        Column("EVENT", width=12),
        Column("SESSION", width=id_width),
    ]
    if wide:
        columns.append(Column("BACKEND", width=10))
    columns.append(Column("WHAT", ratio=1))
    table = _table(width, columns)
    for event in (snapshot.events[i] for i in rows):
        what = ": ".join(part for part in (event.label, event.detail) if part)
        cells = [_span(max(0.0, snapshot.taken_at - event.at)), event.kind, short_id(event.session_id, id_width) or "-"]
        if wide:
            cells.append(event.backend or "-")
        cells.append(what)
        table.add_row(*cells, style="red" if event.kind in _BAD_EVENTS else "")
    return table


_BAD_EVENTS: Final = frozenset({"crashed", "spawn_failed", "start_timeout", "unverifiable", "leftovers_killed"})


def render(snapshot: Snapshot, view: ViewState, width: int, height: int) -> RenderableType:
    """The screen for ``snapshot`` and ``view``: at most ``height`` lines, none wider than ``width``.

    Sessions and running turns come first; proxies next; recent events take what is left
    and are the first panel dropped on a short terminal. Narrow terminals lose the less
    useful columns (a proxy's session and turn counts, a session's proxy, an event's backend).
    """
    width, height = max(20, width), max(3, height)
    parts: list[RenderableType] = [_header(snapshot, width)]
    if not snapshot.database:
        parts.append(_line(f"no proxy has used {snapshot.state_dir} yet", width))
        parts.append(_status_line(snapshot, view, width))
        return Group(*parts)
    panels = [
        _Panel("sessions", len(snapshot.sessions), 4),
        _Panel("turns", len(snapshot.turns), 2),
        _Panel("proxies", len(snapshot.proxies), 1),
        _Panel("events", len(snapshot.events), 3),
    ]
    rows = allot(height - 2, panels, ("turns", "proxies", "sessions", "events"))
    session_index = selected_index([s.session_id for s in snapshot.sessions], view.session)
    turn_index = selected_index([t.task_id for t in snapshot.turns], view.turn)
    windows = {
        "proxies": range(rows.get("proxies", 0)),
        "sessions": _window(len(snapshot.sessions), rows.get("sessions", 0), session_index),
        "turns": _window(len(snapshot.turns), rows.get("turns", 0), turn_index),
        "events": range(rows.get("events", 0)),
    }
    for name in ("proxies", "sessions", "turns", "events"):
        if name not in rows:
            continue
        shown = windows[name]
        if name == "proxies":
            parts.append(_title("PROXIES", len(snapshot.proxies), shown, width))
            body: RenderableType = _proxies_table(snapshot, shown, width)
        elif name == "sessions":
            parts.append(_title("SESSIONS", len(snapshot.sessions), shown, width, view.focus is Focus.SESSIONS))
            body = _sessions_table(snapshot, view, shown, width)
        elif name == "turns":
            parts.append(_title("RUNNING TURNS", len(snapshot.turns), shown, width, view.focus is Focus.TURNS))
            body = _turns_table(snapshot, view, shown, width)
        else:
            parts.append(_title("RECENT EVENTS", len(snapshot.events), shown, width))
            body = _events_table(snapshot, shown, width)
        parts.append(body if len(shown) else _line("  none", width, "dim"))
    parts.append(_status_line(snapshot, view, width))
    return Group(*parts)


# --- the one-shot table ----------------------------------------------------------------------


def print_plain(snapshot: Snapshot, out: TextIO) -> None:
    """The snapshot as plain tables (stdout not a terminal, or ``--once``): full ids, one line a row."""
    pool = snapshot.pool
    line = f"state dir: {snapshot.state_dir}"
    if not snapshot.database:
        out.write(f"{line}\nno proxy has used {snapshot.state_dir} yet\n")
        return
    line += f"  live {pool.live}/{pool.max_live if pool.max_live is not None else '?'}"
    if pool.memory_used is not None or pool.max_memory is not None:
        line += f"  memory {_size(pool.memory_used)}" + (f"/{_size(pool.max_memory)}" if pool.max_memory else "")
    out.write(line + "\n\n")
    sections: list[tuple[str, Sequence[str], list[Sequence[object]]]] = [
        (
            "proxies",
            ("PROXY", "PID", "UP", "LOOP", "LIVE", "SESSIONS", "TURNS", "NOTE"),
            [
                (
                    p.instance,
                    p.pid,
                    _span(max(0.0, snapshot.taken_at - p.started_at)),
                    p.async_backend,
                    p.live,
                    p.sessions,
                    p.turns,
                    p.problem or "",
                )
                for p in snapshot.proxies
            ],
        ),
        (
            "sessions",
            ("SESSION", "BACKEND", "STATE", "IDLE", "MEMORY", "PROXY", "TITLE"),
            [
                (
                    s.session_id,
                    s.backend,
                    s.state + ("" if s.proxy_alive else " (proxy gone)") + (" busy" if s.busy else ""),
                    _span(s.idle_seconds),
                    _size(s.memory),
                    s.instance,
                    _short(s.title, 50),
                )
                for s in snapshot.sessions
            ],
        ),
        (
            "running turns",
            ("TASK", "SESSION", "STATUS", "UPDATES", "TOOLS", "ELAPSED", "LAST TEXT"),
            [
                (
                    t.task_id,
                    t.session_id,
                    t.status,
                    t.updates,
                    t.tool_calls,
                    _span(t.elapsed_seconds),
                    _short(t.last_text, 60),
                )
                for t in snapshot.turns
            ],
        ),
        (
            "recent events",
            ("AGO", "EVENT", "SESSION", "BACKEND", "WHAT"),
            [
                (
                    _span(max(0.0, snapshot.taken_at - e.at)),
                    e.kind,
                    e.session_id,
                    e.backend or "-",
                    ": ".join(part for part in (e.label, e.detail) if part) or "-",
                )
                for e in snapshot.events[:20]
            ],
        ),
    ]
    for index, (name, headers, rows) in enumerate(sections):
        if index:
            out.write("\n")
        if rows:
            reports.table(headers, rows, out)
        else:
            out.write(f"no {name}\n")


# --- the terminal (I/O) ------------------------------------------------------------------------

_SEQUENCES: Final = {
    b"\x1b[A": "up",
    b"\x1bOA": "up",
    b"\x1b[B": "down",
    b"\x1bOB": "down",
    b"\x1b[Z": "backtab",
}
_NAMED: Final = {b"\t": "tab", b"\r": "enter", b"\n": "enter", b"\x1b": "esc"}
_CSI_END: Final = re.compile(rb"[\x40-\x7e]")


def decode_keys(data: bytes) -> tuple[list[str], bytes]:
    """The keys in ``data`` read from a terminal in cbreak mode, and an escape sequence cut short (kept
    for the next read). Unknown sequences are skipped; a lone ESC at the end is the Escape key."""
    keys: list[str] = []
    i = 0
    while i < len(data):
        if data[i] == 0x1B and i + 1 < len(data) and data[i + 1] in b"[O":
            end = _CSI_END.search(data, i + 2)
            if end is None:
                return keys, data[i:]
            sequence = data[i : end.end()]
            if sequence in _SEQUENCES:
                keys.append(_SEQUENCES[sequence])
            i = end.end()
            continue
        byte = data[i : i + 1]
        if byte in _NAMED:
            keys.append(_NAMED[byte])
        elif 0x20 <= data[i] < 0x7F:
            keys.append(byte.decode())
        i += 1
    return keys, b""


class _Wakeup:
    """A self-pipe: threads and signal handlers wake the loop's ``select``."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)

    def poke(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self.write_fd, b".")

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.read_fd, 4096):
                pass

    def close(self) -> None:
        os.close(self.read_fd)
        os.close(self.write_fd)


class _Refresher:
    """Gathers a snapshot every ``interval`` (or at once when asked) in a thread of its own."""

    def __init__(self, gatherer: Gatherer, interval: float, wakeup: _Wakeup) -> None:
        self.gatherer = gatherer
        self.interval = interval
        self.wakeup = wakeup
        self.latest: Snapshot | None = None
        self._poke = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="acp-proxy top refresh", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def refresh_now(self) -> None:
        self._poke.set()

    def stop(self) -> None:
        self._stopping = True
        self._poke.set()
        self._thread.join(timeout=2 * PROXY_TIMEOUT)

    def _run(self) -> None:
        try:
            while not self._stopping:
                try:
                    snapshot = self.gatherer.gather()
                except Exception as exc:  # a locked or damaged database: keep showing the last one, say why
                    last = self.latest or Snapshot(str(self.gatherer.state_dir), time.time(), False)
                    snapshot = replace(last, problem=str(exc) or type(exc).__name__)
                self.latest = snapshot
                self.wakeup.poke()
                self._poke.wait(self.interval)
                self._poke.clear()
        finally:
            self.gatherer.close()


class _Acting:
    """One confirmed act, done in a thread of its own (a cancel may wait for the agent for seconds)."""

    def __init__(self, state_dir: Path, act: Pending, wakeup: _Wakeup) -> None:
        self.outcome: tuple[str, bool] | None = None
        self._thread = threading.Thread(
            target=self._run, args=(state_dir, act, wakeup), name="acp-proxy top act", daemon=True
        )
        self._thread.start()

    def _run(self, state_dir: Path, act: Pending, wakeup: _Wakeup) -> None:
        try:
            if act.action == "cancel":
                done = reports.cancel_turn(state_dir, act.target, wait=True)
            else:
                done = reports.act_on_session(state_dir, act.target, action=act.action)
            self.outcome = (done.message, done.exit_code != 0)
        except reports.OperatorError as exc:
            self.outcome = (str(exc), True)
        except Exception as exc:  # shown, not raised: the view stays up
            self.outcome = (f"{act.describe()} failed: {exc}", True)
        wakeup.poke()


@contextlib.contextmanager
def _cbreak(fd: int) -> Iterator[None]:
    """Keys one at a time, not echoed; the tty's modes as they were on the way out, whatever happens."""
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd, termios.TCSANOW)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


@contextlib.contextmanager
def _signals(wakeup: _Wakeup) -> Iterator[None]:
    """A resize wakes the loop; SIGTERM and SIGHUP (the SSH session gone) end it through the cleanup."""

    def resized(signum: int, frame: FrameType | None) -> None:
        wakeup.poke()

    def ended(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    handlers: dict[int, Callable[[int, FrameType | None], None]] = {
        signal.SIGWINCH: resized,
        signal.SIGTERM: ended,
        signal.SIGHUP: ended,
    }
    previous = {signum: signal.signal(signum, handler) for signum, handler in handlers.items()}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _interactive(state_dir: Path, gatherer: Gatherer, interval: float) -> int:
    stdin = sys.stdin.fileno()
    console = Console()
    wakeup = _Wakeup()
    refresher = _Refresher(gatherer, interval, wakeup)
    view = ViewState()
    acting: _Acting | None = None
    pending_bytes = b""
    nothing_yet = Snapshot(str(state_dir), time.time(), False)
    try:
        with (
            _signals(wakeup),
            _cbreak(stdin),
            Live(
                console=console, screen=True, auto_refresh=False, redirect_stdout=False, redirect_stderr=False
            ) as live,
        ):
            refresher.start()
            while True:
                snapshot = refresher.latest or nothing_yet
                if acting is not None and acting.outcome is not None:
                    view, acting = acted(view, *acting.outcome), None
                    refresher.refresh_now()
                width, height = console.size
                screen = render(snapshot, view, width, height) if refresher.latest else Text(f"reading {state_dir}…")
                live.update(screen, refresh=True)
                ready, _, _ = select.select([stdin, wakeup.read_fd], [], [])
                if wakeup.read_fd in ready:
                    wakeup.drain()
                if stdin not in ready:
                    continue
                data = os.read(stdin, 1024)
                if not data:  # the terminal is gone
                    return 0
                keys, pending_bytes = decode_keys(pending_bytes + data)
                for key in keys:
                    step = on_key(view, snapshot, key)
                    view = step.view
                    if step.quit:
                        return 0
                    if step.act is not None:
                        acting = _Acting(state_dir, step.act, wakeup)
    except KeyboardInterrupt:
        return 0
    finally:
        refresher.stop()
        wakeup.close()


def run(
    state_dir: Path,
    *,
    interval: float = DEFAULT_INTERVAL,
    max_live: int | None = None,
    max_memory: int | None = None,
    once: bool = False,
    as_json: bool = False,
    out: TextIO | None = None,
) -> int:
    """``acp-proxy top``: the live view on a terminal; one snapshot (a table, or JSON) otherwise."""
    out = out or sys.stdout
    gatherer = Gatherer(state_dir, max_live=max_live, max_memory=max_memory)
    if as_json or once or not (out.isatty() and sys.stdin.isatty()):
        try:
            snapshot = gatherer.gather()
        finally:
            gatherer.close()
        if as_json:
            out.write(json.dumps(snapshot_json(snapshot), indent=2) + "\n")
        else:
            print_plain(snapshot, out)
        return 0
    return _interactive(state_dir, gatherer, interval)
