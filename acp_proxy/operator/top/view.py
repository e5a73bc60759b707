"""What ``acp-proxy top`` draws and what its keys do: pure functions of a snapshot and the view state.

``render(snapshot, view, width, height)`` is the screen, fitted to the terminal;
``on_key(view, snapshot, key)`` is the next view state and the act a key confirms.
``print_plain`` is the same snapshot as plain tables, for a pipe.

Keys act on the selected row of their list, whichever list has the focus (the focus only says
which list ``↑↓`` moves in): ``s`` and ``c`` on the selected session, ``x`` on the selected turn,
``1``..``9`` and ``d`` on the selected request waiting for an answer (its option of that number,
or its denial: the request answered ``cancelled``). Every act waits for ``y``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Final, Literal, TextIO

from rich.console import Group, RenderableType
from rich.table import Column, Table
from rich.text import Text

from acp_proxy import timings
from acp_proxy.operator import reports
from acp_proxy.operator.top.snapshot import Snapshot, WaitingRow
from acp_proxy.protocol.methods import Method
from acp_proxy.tasks.status import TaskStatus

Action = Literal["suspend", "close", "cancel", "answer"]

PERMISSION: Final = Method.REQUEST_PERMISSION
"""The only method whose requests an operator may answer (an elicitation's answer is a client's)."""


# --- the view state and the keys (pure) --------------------------------------------------------


class Focus(enum.StrEnum):
    SESSIONS = "sessions"
    TURNS = "turns"
    WAITING = "waiting"


@dataclass(frozen=True, slots=True)
class Pending:
    """An act that waits for its confirmation, or is being done."""

    action: Action
    target: str
    """The session id (``suspend``, ``close``), the task id (``cancel``) or the waiting request's key (``answer``)."""
    instance: str | None = None
    """``answer``: the proxy the request waits in."""
    option: str | None = None
    """``answer``: the option chosen; ``None``: the request denied (answered ``cancelled``)."""
    name: str | None = None
    """``answer``: the option's name, printable, to confirm it by."""

    def describe(self) -> str:
        if self.action == "answer":
            request = short_id(self.target, 24)
            if self.option is None:
                return f"deny request {request}"
            option = _short(reports.printable(self.option), 24)
            named = f" ({_short(self.name, 24)})" if self.name and self.name != self.option else ""
            return f"answer {option}{named} to request {request}"
        what = "turn" if self.action == "cancel" else "session"
        return f"{self.action} {what} {short_id(self.target, 24)}"


@dataclass(frozen=True, slots=True)
class ViewState:
    focus: Focus = Focus.SESSIONS
    session: str | None = None
    """The selected session's id; ``None``, or an id no longer listed: the first row."""
    turn: str | None = None
    request: str | None = None
    """The selected waiting request's key; ``None``, or a key no longer listed: the first (oldest)."""
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


def selected_request(snapshot: Snapshot, view: ViewState) -> WaitingRow | None:
    index = selected_index([w.request for w in snapshot.waiting], view.request)
    return None if index is None else snapshot.waiting[index]


def focus_of(view: ViewState, snapshot: Snapshot) -> Focus:
    """The list that has the focus: the waiting requests' only while any are listed (their pane is only shown then)."""
    return Focus.SESSIONS if view.focus is Focus.WAITING and not snapshot.waiting else view.focus


def _focusable(snapshot: Snapshot) -> list[Focus]:
    """The lists Tab goes through, in the order they are drawn."""
    return ([Focus.WAITING] if snapshot.waiting else []) + [Focus.SESSIONS, Focus.TURNS]


def _moved(ids: Sequence[str], selected: str | None, by: int) -> str | None:
    index = selected_index(ids, selected)
    return None if index is None else ids[max(0, min(len(ids) - 1, index + by))]


_OPTION_KEYS: Final = frozenset("123456789")
"""The keys that choose a waiting request's option, by its number."""


def _answer(view: ViewState, snapshot: Snapshot, key: str) -> Step:
    """``1``..``9``: that option of the selected waiting request; ``d``: deny it. Both wait for ``y``."""
    waiting = selected_request(snapshot, view)
    if waiting is None:
        return Step(replace(view, message="no request is waiting for an answer", failed=True))
    if waiting.method != PERMISSION:
        message = f"{waiting.method} is answered by a client, not here"
        return Step(replace(view, message=message, failed=True))
    if key == "d":
        return Step(replace(view, pending=Pending("answer", waiting.request, waiting.instance), message=None))
    number = int(key)
    if number > len(waiting.options):
        offered = f"options 1-{len(waiting.options)}" if waiting.options else "no options"
        message = f"request {short_id(waiting.request, 24)} has {offered}"
        return Step(replace(view, message=message, failed=True))
    option = waiting.options[number - 1]
    act = Pending("answer", waiting.request, waiting.instance, option.option_id, option.name)
    return Step(replace(view, pending=act, message=None))


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
    focus = focus_of(view, snapshot)
    if key in ("up", "k", "down", "j"):
        by = -1 if key in ("up", "k") else 1
        if focus is Focus.SESSIONS:
            return Step(replace(view, session=_moved([s.session_id for s in snapshot.sessions], view.session, by)))
        if focus is Focus.WAITING:
            return Step(replace(view, request=_moved([w.request for w in snapshot.waiting], view.request, by)))
        return Step(replace(view, turn=_moved([t.task_id for t in snapshot.turns], view.turn, by)))
    if key in ("tab", "backtab"):
        order = _focusable(snapshot)
        step = 1 if key == "tab" else -1
        return Step(replace(view, focus=order[(order.index(focus) + step) % len(order)]))
    if key in ("s", "c", "x", "d") or key in _OPTION_KEYS:
        if view.working is not None:
            return Step(replace(view, message=f"wait: still doing {view.working.describe()}", failed=True))
        if key == "d" or key in _OPTION_KEYS:
            return _answer(view, snapshot, key)
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
    its tail tells apart ids made moments apart (UUIDv7s share their head). Session ids are an
    adapter's: the snapshot keeps them as they are (an act names them), so they are made printable here."""
    if not identifier:
        return ""
    identifier = reports.printable(identifier)
    if len(identifier) <= width:
        return identifier
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
    if snapshot.remote_connections is not None:
        parts.append(f"remote {snapshot.remote_connections}")
    tail = "  ".join(parts[1:])
    head = _short(parts[0], max(14, width - len(tail) - 2))
    return _line(Text(f"{head}  {tail}", style="bold"), width)


KEYS_HELP: Final = "↑↓/jk select  Tab list  s suspend  c close  x cancel turn  q quit"
WAITING_KEYS_HELP: Final = "↑↓/jk select  Tab list  1-9 answer  d deny  s suspend  c close  x cancel  q quit"
"""The help while requests wait for an answer (the keys that answer them first)."""


def _timings_line(snapshot: Snapshot) -> str:
    """``p50/p95  start 410ms/1.2s  restore 1.9s/4.0s  …`` over every backend; empty before anything was timed."""
    if not snapshot.timings:
        return ""
    return "p50/p95  " + timings.line_of(timings.quantiles_from(snapshot.timings))


def _status_line(snapshot: Snapshot, view: ViewState, width: int) -> Text:
    if view.pending is not None:
        return _line(Text(f"{view.pending.describe()}? (y/n)", style="bold yellow"), width)
    if view.working is not None:
        return _line(Text(f"{view.working.describe()}…", style="yellow"), width)
    if view.message:
        return _line(Text(view.message, style="bold red" if view.failed else "green"), width)
    if snapshot.problem:
        return _line(Text(f"cannot read the install: {snapshot.problem}", style="red"), width)
    return _line(Text(WAITING_KEYS_HELP if snapshot.waiting else KEYS_HELP, style="dim"), width)


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
        columns += [Column("SESSIONS", width=8), Column("TURNS NOW", width=9)]
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
    focused = focus_of(view, snapshot) is Focus.SESSIONS
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
    focused = focus_of(view, snapshot) is Focus.TURNS
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


def asks(waiting: WaitingRow) -> str:
    """What a waiting request asks: its subject (a permission's tool call), else its method."""
    if waiting.method == PERMISSION:
        return waiting.subject or waiting.method
    return f"{waiting.method}: {waiting.subject}" if waiting.subject else waiting.method


def options_line(waiting: WaitingRow) -> str:
    """``1 Allow  2 Reject``: the options the keys 1..9 choose (named, else by their id)."""
    if waiting.method != PERMISSION:
        return "answered by a client"
    shown = [
        f"{number} {option.name or reports.printable(option.option_id)}"
        for number, option in enumerate(waiting.options[:9], start=1)
    ]
    if len(waiting.options) > 9:
        shown.append(f"+{len(waiting.options) - 9} more")
    return "  ".join(shown) or "no options"


def _waiting_table(snapshot: Snapshot, view: ViewState, rows: range, width: int) -> Table:
    wide = width >= 100
    id_width = 24 if wide else 14
    columns = [
        Column("", width=1),
        Column("AGE", width=6),
        Column("SESSION", width=id_width),
    ]
    if wide:
        columns.append(Column("REQUEST", width=12))
    columns += [Column("ASKS", ratio=1), Column("OPTIONS", ratio=1)]
    table = _table(width, columns)
    selected = selected_index([w.request for w in snapshot.waiting], view.request)
    focused = focus_of(view, snapshot) is Focus.WAITING
    for index in rows:
        waiting = snapshot.waiting[index]
        cells = [
            ">" if index == selected else "",
            _span(waiting.waiting_seconds),
            short_id(waiting.session_id, id_width),
        ]
        if wide:
            cells.append(short_id(waiting.request, 12))
        cells += [asks(waiting), options_line(waiting)]
        style = ("reverse" if focused else "underline") if index == selected else "yellow"
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


WAITING_ROWS: Final = 5
"""Rows the waiting requests' pane takes at most (it scrolls to the selected one)."""
_BAD_EVENTS: Final = frozenset({"crashed", "spawn_failed", "start_timeout", "unverifiable", "leftovers_killed"})


def render(snapshot: Snapshot, view: ViewState, width: int, height: int) -> RenderableType:
    """The screen for ``snapshot`` and ``view``: at most ``height`` lines, none wider than ``width``.

    Requests waiting for an answer (their pane is drawn only while there are any, on top, a
    few rows at most) come first; sessions and running turns next; then proxies; recent events
    take what is left and are the first panel dropped on a short terminal. Narrow terminals lose
    the less useful columns (a proxy's session and turn counts, a session's proxy, a waiting
    request's key, an event's backend).
    """
    width, height = max(20, width), max(3, height)
    parts: list[RenderableType] = [_header(snapshot, width)]
    timed = _timings_line(snapshot)
    if timed and height >= 8:  # on a very short terminal the panels matter more
        parts.append(_line(Text(timed, style="dim"), width))
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
    if snapshot.waiting:
        panels.insert(0, _Panel("waiting", min(len(snapshot.waiting), WAITING_ROWS), 1))
    order = ("waiting", "turns", "proxies", "sessions", "events")
    rows = allot(height - len(parts) - 1, panels, order)
    focus = focus_of(view, snapshot)
    session_index = selected_index([s.session_id for s in snapshot.sessions], view.session)
    turn_index = selected_index([t.task_id for t in snapshot.turns], view.turn)
    request_index = selected_index([w.request for w in snapshot.waiting], view.request)
    windows = {
        "waiting": _window(len(snapshot.waiting), rows.get("waiting", 0), request_index),
        "proxies": range(rows.get("proxies", 0)),
        "sessions": _window(len(snapshot.sessions), rows.get("sessions", 0), session_index),
        "turns": _window(len(snapshot.turns), rows.get("turns", 0), turn_index),
        "events": range(rows.get("events", 0)),
    }
    for name in ("waiting", "proxies", "sessions", "turns", "events"):
        if name not in rows:
            continue
        shown = windows[name]
        if name == "waiting":
            parts.append(_title("WAITING FOR AN ANSWER", len(snapshot.waiting), shown, width, focus is Focus.WAITING))
            body: RenderableType = _waiting_table(snapshot, view, shown, width)
        elif name == "proxies":
            parts.append(_title("PROXIES", len(snapshot.proxies), shown, width))
            body = _proxies_table(snapshot, shown, width)
        elif name == "sessions":
            parts.append(_title("SESSIONS", len(snapshot.sessions), shown, width, focus is Focus.SESSIONS))
            body = _sessions_table(snapshot, view, shown, width)
        elif name == "turns":
            parts.append(_title("RUNNING TURNS", len(snapshot.turns), shown, width, focus is Focus.TURNS))
            body = _turns_table(snapshot, view, shown, width)
        else:
            parts.append(_title("RECENT EVENTS", len(snapshot.events), shown, width))
            body = _events_table(snapshot, shown, width)
        parts.append(body if len(shown) else _line("  none", width, "dim"))
    parts.append(_status_line(snapshot, view, width))
    return Group(*parts)


# --- the one-shot table ----------------------------------------------------------------------


def _plain_options(waiting: WaitingRow) -> str:
    """``allow (Allow), reject (Reject)``: each option by its id, what ``answer_permission`` names."""
    if waiting.method != PERMISSION:
        return "answered by a client"
    shown = [
        option.option_id + (f" ({option.name})" if option.name and option.name != option.option_id else "")
        for option in waiting.options
    ]
    return ", ".join(shown) or "-"


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
    out.write(line + "\n")
    timed = _timings_line(snapshot)
    out.write((timed + "\n" if timed else "") + "\n")
    sections: list[tuple[str, Sequence[str], list[Sequence[object]]]] = [
        (
            "proxies",
            ("PROXY", "PID", "UP", "LOOP", "LIVE", "SESSIONS", "TURNS NOW", "CLIENTS", "NOTE"),
            [
                (
                    p.instance,
                    p.pid,
                    _span(max(0.0, snapshot.taken_at - p.started_at)),
                    p.async_backend,
                    p.live,
                    p.sessions,
                    p.turns,
                    p.attached_clients,
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
            "requests waiting for an answer",
            ("REQUEST", "AGE", "SESSION", "PROXY", "ASKS", "OPTIONS", "SENT TO"),
            [
                (
                    w.request,
                    _span(w.waiting_seconds),
                    w.session_id,
                    w.instance,
                    _short(asks(w), 50),
                    _plain_options(w),
                    ", ".join(w.sent_to) or "-",
                )
                for w in snapshot.waiting
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
