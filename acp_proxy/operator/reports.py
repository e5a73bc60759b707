"""The operator CLI: ``acp-proxy status``, ``sessions`` and ``tasks``.

Reading commands open the state database directly, so they answer with no proxy
running, and after a crash: a task whose proxy is gone is shown ``lost`` even
before the next proxy's startup sweep records it so. Acting commands (cancel,
suspend, close) are sent to the proxy that holds the session or turn, through
its control socket; when that proxy is gone they say so, and act on the
database where that is enough (a dead proxy's session can be closed there).

Output is a table for people and, with ``--json``, one JSON document for
scripts (``tasks show --follow --json``: one JSON snapshot per line). Exit
status: 0 done, 1 the proxy needed could not be reached or did not act, 2 bad
input (an unknown id, a bad ``--status``). Nothing here is imported by the relay.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final, TextIO

import msgspec

from acp_proxy import journal, timings
from acp_proxy.config import CgroupSetting
from acp_proxy.operator import control
from acp_proxy.operator.commands import _age, lease_view, open_existing
from acp_proxy.operator.install_view import Answers, InstallView, read_install
from acp_proxy.ownership import instances
from acp_proxy.ownership.cgroups import detect as detect_mode
from acp_proxy.ownership.leases import Lease, get_lease
from acp_proxy.ownership.owner import detect_platform
from acp_proxy.ownership.verify import process_table
from acp_proxy.pool.install import HeldSlot
from acp_proxy.sessions import registry
from acp_proxy.sessions.registry import SessionRecord, SessionRegistry, SessionState
from acp_proxy.state import StateDB
from acp_proxy.tasks.records import AmbiguousId, TaskRecord, active_by_session, get_task, has_tasks_of, list_tasks
from acp_proxy.tasks.status import ACTIVE, TERMINAL, TaskStatus, effective_status

EXIT_UNREACHABLE: Final = 1
EXIT_USAGE: Final = 2
FOLLOW_INTERVAL: Final = 0.5
STATUS_TIMEOUT: Final = 2.0
"""How long ``status`` waits for each live proxy's own report."""
ASK_GRACE: Final = 0.5
"""How much longer than their timeout a command waits for ``status_answers``'s askers (whose timeouts are their own)."""


class FinishedMeanwhile(Exception):
    """The task ended between reading it and asking its proxy to cancel it."""


class OperatorError(Exception):
    """Printed as ``acp-proxy: MESSAGE``; the process exits with ``exit_code``."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Acted(msgspec.Struct, frozen=True):
    """What an acting command did: the JSON document, the sentence for people, the exit status."""

    document: dict[str, Any]
    message: str
    exit_code: int


def parse_statuses(values: Sequence[str]) -> list[TaskStatus]:
    """``--status`` values (repeatable, comma-separated); ``OperatorError`` naming the valid ones."""
    statuses: list[TaskStatus] = []
    for value in values:
        for part in filter(None, (p.strip().lower() for p in value.split(","))):
            try:
                statuses.append(TaskStatus(part))
            except ValueError:
                valid = ", ".join(s.value for s in TaskStatus)
                raise OperatorError(f"--status: {part!r} is not a task status (one of: {valid})") from None
    return statuses


class Liveness:
    """Which proxy instances are alive, asked once each per command."""

    def __init__(self, db: StateDB) -> None:
        self.db = db
        self.known: dict[str, bool] = {}

    def __call__(self, instance_id: str | None) -> bool:
        if instance_id is None:
            return False
        if instance_id not in self.known:
            self.known[instance_id] = instances.instance_alive(self.db, instance_id)
        return self.known[instance_id]


@contextmanager
def opened(state_dir: Path) -> Iterator[StateDB | None]:
    db = open_existing(state_dir)
    try:
        yield db
    finally:
        if db is not None:
            db.close()


def _print_json(document: object, out: TextIO | None = None) -> None:
    (out or sys.stdout).write(json.dumps(document, indent=2, default=str) + "\n")


def _when(timestamp: float | None) -> str:
    if timestamp is None:
        return "-"
    return datetime.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S")


def _ago(timestamp: float | None, moment: float) -> str:
    return "-" if timestamp is None else _age(max(0.0, moment - timestamp)) + " ago"


def printable(text: str) -> str:
    """``text`` as one line that cannot drive the operator's terminal.

    Titles, agent text, error messages and reasons come from adapters (or their users): a
    newline would break a table's rows, an escape sequence would reach the terminal. Runs
    of whitespace become one space; other characters that are not printable become ``?``.
    """
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else " " if ch.isspace() else "?" for ch in " ".join(text.split()))


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], out: TextIO | None = None) -> None:
    """Left-aligned columns, as wide as their widest cell; the last column is never padded (to stdout by default)."""
    out = out or sys.stdout
    cells = [[str(h) for h in headers]] + [["-" if c is None else printable(str(c)) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        padded = [cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=False)]
        out.write("  ".join([*padded, row[-1]]) + "\n")


def _no_state(state_dir: Path) -> str:
    return f"no proxy has used {state_dir} yet"


# --- tasks ---------------------------------------------------------------------------------


def task_view(record: TaskRecord, alive: Callable[[str | None], bool], *, events: bool = True) -> dict[str, Any]:
    status = effective_status(record.status, alive(record.instance_id) if record.status in ACTIVE else True)
    ended = record.ended_at
    started = record.started_at
    view: dict[str, Any] = {
        "taskId": record.task_id,
        "sessionId": record.session_id,
        "backend": record.backend,
        "status": status.value,
        "recordedStatus": record.status.value,
        "stopReason": record.stop_reason,
        "error": record.error
        if status is record.status
        else "the acp-proxy process serving it has ended without recording an outcome",
        "instance": record.instance_id,
        "lease": record.lease_id,
        "requestId": record.request_id,
        "traceparent": record.traceparent,
        "prompt": record.prompt,
        "createdAt": record.created_at,
        "startedAt": started,
        "firstOutputAt": record.first_output_at,
        "endedAt": ended,
        "durationSeconds": None if started is None or ended is None else round(ended - started, 3),
        "updateCount": record.update_count,
        "toolCalls": record.tool_calls,
        "summary": record.summary,
        "updatedAt": record.updated_at,
    }
    if events:
        view["events"] = [e.to_json() for e in record.events]
        view["eventsDropped"] = record.events_dropped
    return view


def resolve_task(db: StateDB | None, state_dir: Path, task_id: str) -> TaskRecord:
    if db is None:
        raise OperatorError(f"no task {task_id}: {_no_state(state_dir)}")
    try:
        record = get_task(db, task_id)
    except AmbiguousId as exc:
        raise OperatorError(str(exc)) from None
    if record is None:
        raise OperatorError(f"no task {task_id} in {state_dir} (acp-proxy tasks list shows the recent ones)")
    return record


def tasks_list(
    state_dir: Path,
    *,
    statuses: Sequence[TaskStatus],
    session_id: str | None,
    limit: int,
    as_json: bool,
) -> int:
    with opened(state_dir) as db:
        views: list[dict[str, Any]] = []
        if db is not None:
            if session_id is not None:
                session_id = resolve_session(db, state_dir, session_id, must_exist=False)
            alive = Liveness(db)
            wanted = set(statuses)
            # A "lost" task may still be recorded running (its proxy died, nothing swept yet).
            recorded = wanted | (set(ACTIVE) if TaskStatus.LOST in wanted else set())
            exact = not (wanted & (set(ACTIVE) | {TaskStatus.LOST}))
            rows = list_tasks(db, statuses=sorted(recorded), session_id=session_id, limit=limit if exact else None)
            for record in rows:
                view = task_view(record, alive, events=False)
                if not wanted or view["status"] in wanted:
                    views.append(view)
                if len(views) >= limit:
                    break
        elif session_id is not None:
            raise OperatorError(f"no session {session_id}: {_no_state(state_dir)}")
    if as_json:
        _print_json({"stateDir": str(state_dir), "tasks": views})
        return 0
    if not views:
        print("no tasks" + (" match" if statuses or session_id else "") if db is not None else _no_state(state_dir))
        return 0
    moment = time.time()
    table(
        ("TASK", "STATUS", "SESSION", "BACKEND", "CREATED", "TOOK", "UPDATES", "REASON", "PROMPT"),
        [
            (
                v["taskId"],
                v["status"],
                _short(v["sessionId"], 14),
                v["backend"],
                _ago(v["createdAt"], moment),
                _duration(v, moment),
                v["updateCount"],
                v["stopReason"] or _short(v["error"] or "", 40) or "-",
                _short(v["prompt"], 40),
            )
            for v in views
        ],
    )
    return 0


def _duration(view: dict[str, Any], moment: float) -> str:
    if view["startedAt"] is None:
        return "-"
    end = view["endedAt"] if view["endedAt"] is not None else moment
    return f"{end - view['startedAt']:.1f}s" + ("" if view["endedAt"] is not None else "+")


def _short(text: str | None, width: int) -> str:
    if not text:
        return ""
    text = printable(text)
    return text if len(text) <= width else text[: width - 1] + "…"


def tasks_show(state_dir: Path, task_id: str, *, follow: bool, as_json: bool) -> int:
    with opened(state_dir) as db:
        record = resolve_task(db, state_dir, task_id)
        assert db is not None
        alive = Liveness(db)
        view = task_view(record, alive)
        if as_json and not follow:
            _print_json(view)
            return 0
        if as_json:
            print(json.dumps(view, default=str), flush=True)
        else:
            _print_task(view)
        if not follow:
            return 0
        shown = len(view["events"])
        while view["status"] not in TERMINAL:
            time.sleep(FOLLOW_INTERVAL)
            alive.known.clear()
            latest = get_task(db, record.task_id)
            if latest is None:  # pruned under our feet: nothing more will happen to it
                break
            previous, view = view, task_view(latest, alive)
            if as_json:
                if view["updatedAt"] != previous["updatedAt"] or view["status"] != previous["status"]:
                    print(json.dumps(view, default=str), flush=True)
                continue
            for event in view["events"][max(0, shown - view["eventsDropped"] + previous["eventsDropped"]) :]:
                print(_event_line(event), flush=True)
            shown = len(view["events"])
            if view["status"] in {s.value for s in TERMINAL}:
                print(f"-> {view['status']}" + _reason(view), flush=True)
        return 0


def _reason(view: dict[str, Any]) -> str:
    detail = view["stopReason"] or view["error"]
    return f" ({detail})" if detail and detail != view["status"] else ""


def _event_line(event: dict[str, Any]) -> str:
    detail = f"  {event['detail']}" if event.get("detail") else ""
    return f"  {_when(event['at'])}  {event['kind']}{detail}"


def _print_task(view: dict[str, Any]) -> None:
    moment = time.time()
    print(f"task {view['taskId']}: {view['status']}{_reason(view)}")
    if view["status"] != view["recordedStatus"]:
        print(f"  (recorded {view['recordedStatus']}; its proxy instance {view['instance']} is gone)")
    rows = [
        ("session", view["sessionId"]),
        ("backend", view["backend"]),
        ("instance", view["instance"]),
        ("lease", view["lease"] or "-"),
        ("created", f"{_when(view['createdAt'])} ({_ago(view['createdAt'], moment)})"),
        ("started", _when(view["startedAt"])),
        ("first output", _when(view["firstOutputAt"])),
        ("ended", _when(view["endedAt"])),
        ("took", _duration(view, moment)),
        ("updates", f"{view['updateCount']} ({view['toolCalls']} tool calls)"),
        ("traceparent", view["traceparent"] or "-"),
        ("prompt", view["prompt"] or "-"),
    ]
    for name, value in rows:
        print(f"  {name + ':':<14}{value}")
    if view["summary"]:
        print("  last output:")
        for line in view["summary"].splitlines()[-10:] or [""]:
            print(f"    {line}")
    print("  events" + (f" ({view['eventsDropped']} older ones dropped)" if view["eventsDropped"] else "") + ":")
    for event in view["events"]:
        print(_event_line(event))


def tasks_cancel(state_dir: Path, task_id: str, *, wait: bool, as_json: bool) -> int:
    return report(cancel_turn(state_dir, task_id, wait=wait), as_json)


def cancel_turn(state_dir: Path, task_id: str, *, wait: bool) -> Acted:
    """Cancel a running or queued turn through the proxy running it; what happened (``OperatorError``: a bad id)."""
    with opened(state_dir) as db:
        record = resolve_task(db, state_dir, task_id)
        assert db is not None
        view = task_view(record, Liveness(db), events=False)
    outcome: dict[str, Any] = {"taskId": record.task_id, "sessionId": record.session_id, "instance": record.instance_id}
    if record.status in TERMINAL:
        outcome |= {"cancelled": False, "status": record.status.value, "reason": "already ended"}
        return Acted(outcome, f"task {record.task_id} has already ended: {record.status.value}", 0)
    if view["status"] == TaskStatus.LOST.value:
        outcome |= {"cancelled": False, "status": "lost", "reason": "proxy gone"}
        return Acted(
            outcome,
            f"task {record.task_id} cannot be cancelled: the proxy serving it (instance {record.instance_id}) "
            "is gone, and the turn with it; it is recorded lost",
            EXIT_UNREACHABLE,
        )
    try:
        result = ask(state_dir, record.instance_id, "cancel_task", {"taskId": record.task_id, "wait": wait})
    except FinishedMeanwhile:
        with opened(state_dir) as db:
            latest = get_task(db, record.task_id) if db is not None else None
        status = latest.status.value if latest is not None else "ended"
        outcome |= {"cancelled": False, "status": status, "reason": "already ended"}
        return Acted(outcome, f"task {record.task_id} has already ended: {status}", 0)
    except OperatorError as exc:
        outcome |= {"cancelled": False, "status": view["status"], "reason": str(exc)}
        return Acted(outcome, str(exc), exc.exit_code)
    status = result.get("status", "?")
    ended = status in {s.value for s in TERMINAL}
    outcome |= {"cancelled": True, "status": status}
    if status == TaskStatus.QUEUED.value:
        ended = True  # nothing left to wait for: it is answered "cancelled" when its turn to be sent comes
        message = f"task {record.task_id} is queued: it will be answered cancelled instead of being sent"
    elif not wait:
        message = f"task {record.task_id}: session/cancel sent to session {record.session_id}"
    elif ended:
        message = f"task {record.task_id}: {status}"
    else:
        message = (
            f"task {record.task_id}: session/cancel sent, but the agent has not ended the turn yet (still {status}); "
            f"acp-proxy sessions close {record.session_id} ends it for good"
        )
    return Acted(outcome, message, 0 if ended or not wait else EXIT_UNREACHABLE)


def report(acted: Acted, as_json: bool) -> int:
    if as_json:
        _print_json(acted.document)
    else:
        print(acted.message, file=sys.stdout if acted.exit_code == 0 else sys.stderr)
    return acted.exit_code


def ask(
    state_dir: Path, instance_id: str | None, command: str, args: dict[str, Any], *, timeout: float | None = None
) -> dict[str, Any]:
    """A command to the proxy instance ``instance_id``; ``OperatorError`` (exit 1 or 2) saying why not."""
    if instance_id is None:
        raise OperatorError("no proxy holds it", EXIT_UNREACHABLE)
    path = control.socket_path(state_dir, instance_id)
    try:
        return control.request(path, command, args, timeout=timeout or control_timeout(command))
    except control.ControlUnavailable as exc:
        raise OperatorError(f"the proxy (instance {instance_id}) cannot be reached: {exc}", EXIT_UNREACHABLE) from None
    except TimeoutError as exc:
        raise OperatorError(f"the proxy (instance {instance_id}): {exc}", EXIT_UNREACHABLE) from None
    except control.ControlError as exc:
        if exc.code == "task_finished":
            raise FinishedMeanwhile(exc.message) from None
        code = EXIT_USAGE if exc.code in ("unknown_task", "unknown_session", "invalid_args") else EXIT_UNREACHABLE
        raise OperatorError(f"the proxy (instance {instance_id}) refused: {exc.message}", code) from None
    except PermissionError as exc:
        raise OperatorError(f"not allowed to control that proxy: {exc}", EXIT_UNREACHABLE) from None
    except OSError as exc:
        raise OperatorError(f"the proxy (instance {instance_id}) cannot be reached: {exc}", EXIT_UNREACHABLE) from None


def control_timeout(command: str) -> float:
    return 30.0 if command in ("cancel_task", "close_session", "suspend_session") else STATUS_TIMEOUT


# --- sessions ------------------------------------------------------------------------------


def resolve_session(db: StateDB | None, state_dir: Path, session_id: str, *, must_exist: bool = True) -> str:
    """A session id, from itself or a unique prefix (at least 4 characters)."""
    if db is None:
        raise OperatorError(f"no session {session_id}: {_no_state(state_dir)}")
    matches = registry.ids_matching(db, session_id)
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise OperatorError(f"{session_id!r} matches {len(matches)} sessions ({', '.join(matches[:5])}); give more")
    if not must_exist and has_tasks_of(db, session_id):
        return session_id
    raise OperatorError(f"no session {session_id} in {state_dir} (acp-proxy sessions list --all shows them)")


def session_view(record: SessionRecord, alive: Callable[[str | None], bool]) -> dict[str, Any]:
    holder_alive = alive(record.instance_id)
    return {
        "sessionId": record.session_id,
        "state": record.state.value,
        "backend": record.backend,
        "instance": record.instance_id,
        "instanceAlive": holder_alive,
        "lease": record.lease_id,
        "cwd": record.cwd,
        "title": record.title,
        "parentSessionId": record.parent_session_id,
        "adapterSessionId": record.adapter_session_id,
        "historyResets": record.history_resets,
        "createdAt": record.created_at,
        "lastActiveAt": record.last_active_at,
        "ownership": {
            "sessionKey": record.ownership.session_key,
            "ownerSessionKey": record.ownership.owner_session_key,
            "spawnedBy": record.ownership.spawned_by,
            "parentSessionKey": record.ownership.parent_session_key,
            "agentId": record.ownership.agent_id,
        },
    }


def _state_label(view: dict[str, Any]) -> str:
    if view["state"] in ("live", "resuming") and not view["instanceAlive"]:
        return f"{view['state']} (proxy gone)"
    return str(view["state"])


def sessions_list(state_dir: Path, *, states: Sequence[str], show_all: bool, as_json: bool) -> int:
    valid = [s.value for s in SessionState]
    for state in states:
        if state not in valid:
            raise OperatorError(f"--state: {state!r} is not a session state (one of: {', '.join(valid)})")
    views: list[dict[str, Any]] = []
    with opened(state_dir) as db:
        if db is not None:
            alive = Liveness(db)
            counts = active_by_session(db)
            for record in registry.listed(db, states, show_all=show_all):
                view = session_view(record, alive)
                view["activeTasks"] = counts.get(view["sessionId"], 0) if view["instanceAlive"] else 0
                views.append(view)
    if as_json:
        _print_json({"stateDir": str(state_dir), "sessions": views})
        return 0
    if not views:
        print("no sessions" if db is not None else _no_state(state_dir))
        return 0
    moment = time.time()
    table(
        ("SESSION", "STATE", "BACKEND", "INSTANCE", "LAST ACTIVE", "TURNS NOW", "TITLE", "CWD"),
        [
            (
                v["sessionId"],
                _state_label(v),
                v["backend"],
                v["instance"] or "-",
                _ago(v["lastActiveAt"], moment),
                v["activeTasks"],
                _short(v["title"] or "-", 40),
                v["cwd"],
            )
            for v in views
        ],
    )
    print("TURNS NOW: the session's turns running or queued now (each turn is a task: acp-proxy tasks list)")
    return 0


def sessions_show(state_dir: Path, session_id: str, *, as_json: bool) -> int:
    with opened(state_dir) as db:
        session_id = resolve_session(db, state_dir, session_id)
        assert db is not None
        record = SessionRegistry(db, None).get(session_id)  # type: ignore[arg-type]
        assert record is not None
        alive = Liveness(db)
        view = session_view(record, alive)
        lease = _lease_or_none(db, record.lease_id)
        view["processes"] = lease_view(db, lease, {})["processes"] if lease is not None else []
        view["recentTasks"] = [
            task_view(t, alive, events=False) for t in list_tasks(db, session_id=session_id, limit=10)
        ]
        view["recentEvents"] = [
            msgspec.structs.asdict(event) for event in journal.recent_events(db.conn, 10, session_id=session_id)
        ]
    if as_json:
        _print_json(view)
        return 0
    moment = time.time()
    print(f"session {view['sessionId']}: {_state_label(view)}")
    rows = [
        ("title", view["title"] or "-"),
        ("backend", view["backend"]),
        ("cwd", view["cwd"]),
        ("instance", f"{view['instance'] or '-'} ({'alive' if view['instanceAlive'] else 'gone'})"),
        ("lease", view["lease"] or "-"),
        ("adapter id", view["adapterSessionId"]),
        ("created", _when(view["createdAt"])),
        ("last active", f"{_when(view['lastActiveAt'])} ({_ago(view['lastActiveAt'], moment)})"),
        ("history resets", view["historyResets"]),
    ]
    if view["parentSessionId"]:
        rows.append(("forked from", view["parentSessionId"]))
    rows += [(k, v) for k, v in view["ownership"].items() if v]
    for name, value in rows:
        print(f"  {name + ':':<16}{value}")
    for proc in view["processes"]:
        print(f"  process pid {proc['pid']} rss {proc['rssBytes'] / 1e6:.1f} MB  {proc['command'][:80]}")
    if view["recentEvents"]:
        print("  recent events (handovers, suspensions, restores, crashes):")
        for event in view["recentEvents"]:
            what = f"{event['kind']} {event['label']}".strip()
            print(f"    {_ago(event['at'], moment):<9} {what:<20} {event['detail'][:70]}")
    if view["recentTasks"]:
        print("  recent tasks:")
        for task in view["recentTasks"]:
            print(
                f"    {task['taskId']}  {task['status']:<10} {_ago(task['createdAt'], moment):<9} {task['prompt'][:50]}"
            )
    return 0


def _lease_or_none(db: StateDB, lease_id: str | None) -> Lease | None:
    if lease_id is None:
        return None
    try:
        return get_lease(db, lease_id)
    except KeyError:
        return None


def sessions_act(state_dir: Path, session_id: str, *, action: str, as_json: bool) -> int:
    return report(act_on_session(state_dir, session_id, action=action), as_json)


def act_on_session(state_dir: Path, session_id: str, *, action: str) -> Acted:
    """``suspend`` or ``close`` a session, through the proxy holding it (or the database if none does);
    what happened (``OperatorError``: a bad id)."""
    with opened(state_dir) as db:
        session_id = resolve_session(db, state_dir, session_id)
        assert db is not None
        rows = SessionRegistry(db, "")
        record = rows.get(session_id)
        assert record is not None
        holder = record.instance_id
        holder_alive = Liveness(db)(holder)
        outcome: dict[str, Any] = {"sessionId": session_id, "action": action, "instance": holder}
        if record.state is SessionState.CLOSED:
            outcome |= {"done": False, "state": "closed", "reason": "already closed"}
            return Acted(outcome, f"session {session_id} is already closed", 0)
        if holder_alive:
            command = "close_session" if action == "close" else "suspend_session"
            try:
                result = ask(state_dir, holder, command, {"sessionId": session_id})
            except OperatorError as exc:
                if not (exc.exit_code == EXIT_USAGE and record.state is SessionState.SUSPENDED):
                    outcome |= {"done": False, "state": record.state.value, "reason": str(exc)}
                    return Acted(outcome, str(exc), exc.exit_code)
                # The proxy named in the row is alive but no longer holds it: the row is all there is.
            else:
                done = bool(result.get("closed" if action == "close" else "suspended"))
                state = "closed" if action == "close" and done else "suspended" if done else record.state.value
                outcome |= {"done": done, "state": state, "via": "control socket"}
                if action == "suspend" and result.get("already"):
                    message = f"session {session_id} was already suspended"
                elif done:
                    message = f"session {session_id} {'closed' if action == 'close' else 'suspended'}"
                else:
                    message = f"session {session_id}: the proxy is still stopping its process"
                return Acted(outcome, message, 0 if done else EXIT_UNREACHABLE)
        # No live proxy holds it: its process tree (if any) went with its proxy's lease.
        if action == "suspend":
            if record.state in (SessionState.LIVE, SessionState.RESUMING) and not rows.take_over_if_orphaned(
                session_id
            ):
                outcome |= {"done": False, "state": record.state.value, "reason": "changed meanwhile"}
                return Acted(outcome, f"session {session_id} changed meanwhile (a proxy took it); try again", 1)
            outcome |= {"done": True, "state": "suspended", "via": "database"}
            return Acted(outcome, f"session {session_id} is suspended (no proxy holds it)", 0)
        if not rows.close_if_unchanged(record):
            outcome |= {"done": False, "state": record.state.value, "reason": "changed meanwhile"}
            return Acted(outcome, f"session {session_id} changed meanwhile (a proxy took it); try again", 1)
        outcome |= {"done": True, "state": "closed", "via": "database"}
        note = "" if holder_alive else "; the gone proxy's processes are reaped by the next start or acp-proxy reap"
        return Acted(outcome, f"session {session_id} closed (no proxy held it{note})", 0)


# --- status --------------------------------------------------------------------------------


def status(state_dir: Path, *, as_json: bool, cgroups: CgroupSetting = "auto") -> int:
    """``ownershipMode``: the mode a proxy started here would get; each running proxy says its own."""
    report: dict[str, Any] = {
        "stateDir": str(state_dir),
        "ownership": detect_platform(process_table()).describe(),
        "ownershipMode": detect_mode(cgroups).to_json(),
        "instances": [],
        "sessions": {},
        "leases": {},
        "processes": [],
        "liveSessions": [],
        "slots": [],
        "tasks": {"running": 0, "queued": 0, "lastDay": {}},
        "runningTasks": [],
        "timings": {},
    }
    with opened(state_dir) as db:
        if db is not None:
            view = read_install(db, state_dir, alive=Liveness(db), answers=status_answers(state_dir), trees=True)
            report.update(status_report(view))
    from acp_proxy.remote.status import running_servers

    report["servers"] = running_servers(state_dir)
    if as_json:
        _print_json(report)
        return 0
    _print_status(report, db is not None)
    _print_servers(report["servers"])
    return 0


def _print_servers(servers: list[dict[str, Any]]) -> None:
    """``acp-proxy serve`` processes: where they listen, who is connected, what they refused."""
    if not servers:
        return
    print(f"servers: {len(servers)} running")
    for server in servers:
        connections = server.get("connections", [])
        print(
            f"  pid {server['pid']}  {' '.join(server.get('addresses', []))}  connections {len(connections)}"
            f"  refused {server.get('refused', 0)}  failed auth {server.get('failedAuth', 0)}"
            f"  slow readers {server.get('slowReaders', 0)}"
        )
        for c in connections[:20]:
            proxy = f"proxy pid {c['proxyPid']}" if c.get("proxyPid") else "no proxy yet"
            print(
                f"    {c['id'][:12]}  {c['principal']:<16} {c['transport']:<9} {c['peer']:<21} {proxy}"
                f"  sessions {len(c.get('sessions', []))}"
            )
        if len(connections) > 20:
            print(f"    ... and {len(connections) - 20} more (status --json lists them all)")


def status_answers(state_dir: Path, timeout: float = STATUS_TIMEOUT) -> Answers:
    """Asks proxies for their ``status``, all at once: each one's answer, or why there is none.

    The askers are daemon threads, not a pool's: a pool's workers are joined when the interpreter
    exits, so one proxy that does not answer would hold the command (or ``top`` after ``q``) up.
    Each ask ends by its own timeout; the wait for them all has one deadline besides.
    """

    def settle(future: concurrent.futures.Future[dict[str, Any] | str], instance_id: str) -> None:
        try:
            future.set_result(ask(state_dir, instance_id, "status", {}, timeout=timeout))
        except OperatorError as exc:
            future.set_result(str(exc))
        except Exception as exc:  # raised by the caller, as a failure of its own would be
            future.set_exception(exc)

    def answers(instance_ids: Sequence[str]) -> dict[str, dict[str, Any] | str]:
        asked: dict[str, concurrent.futures.Future[dict[str, Any] | str]] = {}
        for instance_id in instance_ids:
            future: concurrent.futures.Future[dict[str, Any] | str] = concurrent.futures.Future()
            asked[instance_id] = future
            threading.Thread(
                target=settle, args=(future, instance_id), name="acp-proxy status ask", daemon=True
            ).start()
        concurrent.futures.wait(asked.values(), timeout=timeout + ASK_GRACE)
        return {
            instance_id: future.result()
            if future.done()
            else f"the proxy (instance {instance_id}): no answer within {timeout:g}s"
            for instance_id, future in asked.items()
        }

    return answers


def status_report(view: InstallView) -> dict[str, Any]:
    """``status --json`` but for the state dir and the ownership mode: the view as the document shows it."""
    instances_ = []
    for proxy in view.proxies:
        entry: dict[str, Any] = {
            "instance": proxy.instance_id,
            "pid": proxy.pid,
            "startedAt": proxy.started_at,
            "alive": proxy.alive,
        }
        if isinstance(proxy.answer, dict):
            entry["proxy"] = proxy.answer
        elif isinstance(proxy.answer, str):
            entry["controlError"] = proxy.answer
        instances_.append(entry)
    tasks: dict[str, Any] = {"running": 0, "queued": 0, "lastDay": dict(view.tasks_last_day)}
    running = []
    for record in view.active_tasks:
        task = task_view(record, view.alive, events=False)
        if task["status"] in ("running", "queued"):
            tasks[task["status"]] += 1
            running.append(task)
    return {
        "instances": instances_,
        "sessions": dict(view.sessions),
        "liveSessions": [
            {"sessionId": session_id, "backend": backend, "state": state, "title": title}
            for session_id, backend, state, title in view.held_sessions
        ],
        "slots": [slot_view(held, view.alive, view.clock) for held in view.slots],
        "leases": dict(view.leases),
        "processes": [
            {"lease": lease.lease_id, "backend": lease.backend, **proc}
            for lease in view.active_leases
            for proc in view.trees.get(lease.lease_id, ())
        ],
        "tasks": tasks,
        "runningTasks": running,
        "timings": {
            backend: timings.quantiles_json(found)
            for backend, found in timings.by_backend(timings.histograms(view.counters)).items()
        },
    }


def slot_view(held: HeldSlot, alive: Callable[[str | None], bool], moment: float) -> dict[str, Any]:
    """A held slot as ``status`` shows it: who holds it (proxy, session, backend), how idle, how much memory
    (``moment``: ``time.monotonic()``, the records' clock)."""
    record = held.record
    if record is None or record.launching:
        return {"slot": held.index, "holder": None}
    return {
        "slot": held.index,
        "holder": {"instance": record.instance, "pid": record.pid, "alive": alive(record.instance)},
        "sessionId": record.session,
        "backend": record.backend,
        "adapterPid": record.adapter_pid,
        "since": record.since,
        "idleSeconds": round(max(0.0, moment - record.last_active), 3),
        "busy": record.busy,
        "recent": record.recent_until > moment,
        "stopping": record.stopping,
        "memoryBytes": record.memory,
        "memoryKind": record.memory_kind,
    }


def _slot_line(view: dict[str, Any]) -> str:
    holder = view["holder"]
    if holder is None:
        return f"  slot {view['slot']}: being taken (a start in progress)"
    who = view["sessionId"] or "a spare"
    state = (
        "stopping"
        if view["stopping"]
        else "busy"
        if view["busy"]
        else f"idle {_age(view['idleSeconds'])}" + (" (recent)" if view["recent"] else "")
    )
    memory = "" if view["memoryBytes"] is None else f"  {view['memoryBytes'] / 1e6:.1f} MB {view['memoryKind']}"
    dead = "" if holder["alive"] else " (proxy gone: its tree is ending)"
    return (
        f"  slot {view['slot']}: {_short(who, 24):<24} {view['backend'][:12]:<12} {state:<14} "
        f"proxy {holder['instance']} pid {holder['pid']}{dead}{memory}"
    )


def _print_status(report: dict[str, Any], has_db: bool) -> None:
    print(f"state dir: {report['stateDir']}")
    print(f"ownership: {report['ownership']}")
    mode = report["ownershipMode"]
    print(f"ownership mode here: {mode['mode']} ({mode['reason']})")
    if not has_db:
        print(_no_state(Path(report["stateDir"])))
        return
    moment = time.time()
    instances_ = report["instances"]
    alive = [i for i in instances_ if i["alive"]]
    print(
        f"proxies: {len(alive)} running"
        + (f", {len(instances_) - len(alive)} dead, not yet reaped" if len(instances_) > len(alive) else "")
    )
    for entry in instances_:
        state = "running" if entry["alive"] else "DEAD"
        line = f"  {entry['instance']}  pid {entry['pid']}  {state}  up {_age(moment - entry['startedAt'])}"
        proxy = entry.get("proxy")
        if proxy:
            pool = proxy.get("pool", {})
            line += (
                f"  pool {pool.get('live', '?')}/{pool.get('maxLive', '?')} live"
                f"  sessions {proxy.get('sessions', '?')}  turns running or queued {len(proxy.get('turns', []))}"
            )
            if "ownership" in proxy:
                line += f"  {proxy['ownership']['mode']} mode"
            if proxy.get("attachedClients"):
                line += f"  {proxy['attachedClients']} attached"
            if proxy.get("waiting"):
                line += f"  {len(proxy['waiting'])} waiting for an answer (acp-proxy permissions list)"
        elif entry.get("controlError"):
            line += f"  ({entry['controlError']})"
        print(line)
    sessions = report["sessions"]
    print("sessions: " + (", ".join(f"{n} {s}" for s, n in sorted(sessions.items())) or "none"))
    for entry in report["liveSessions"]:
        print(
            f"  {_short(entry['sessionId'], 24):<24} {entry['state']:<8} {entry['backend'][:12]:<12} "
            f"{_short(entry['title'] or '-', 40)}"
        )
    slots = report["slots"]
    pools = [entry["proxy"].get("pool", {}) for entry in instances_ if entry.get("proxy")]
    caps = sorted({pool["maxLive"] for pool in pools if "maxLive" in pool})
    budgets = sorted({pool["maxMemory"] for pool in pools if pool.get("maxMemory")})
    measured = [view for view in slots if view.get("memoryBytes") is not None]
    line = f"install slots: {len(slots)} held" + (f" of max_live {'/'.join(map(str, caps))}" if caps else "")
    if measured:
        kinds = "/".join(sorted({view["memoryKind"] for view in measured}))
        line += f"; memory {sum(v['memoryBytes'] for v in measured) / 1e6:.0f} MB ({kinds})"
        line += f" of max_memory {'/'.join(f'{b / 1e6:.0f} MB' for b in budgets)}" if budgets else ""
    print(line)
    for view in slots:
        print(_slot_line(view))
    leases = report["leases"]
    print("leases: " + (", ".join(f"{n} {s}" for s, n in sorted(leases.items())) or "none"))
    processes = report["processes"]
    total = sum(p["rssBytes"] for p in processes)
    print(f"processes: {len(processes)} owned, {total / 1e6:.1f} MB RSS")
    for proc in processes:
        print(
            f"  pid {proc['pid']:<7} {proc['backend'][:12]:<12} "
            f"rss {proc['rssBytes'] / 1e6:7.1f} MB  {proc['command'][:70]}"
        )
    tasks = report["tasks"]
    day = ", ".join(f"{n} {s}" for s, n in sorted(tasks["lastDay"].items())) or "none"
    print(f"tasks: {tasks['running']} running, {tasks['queued']} queued; last 24h: {day}")
    for view in report["runningTasks"]:
        print(
            f"  {view['taskId']}  {view['status']:<8} session {_short(view['sessionId'], 14)}  "
            f"{_duration(view, moment):>8}  {_short(view['prompt'], 50)}"
        )
    _print_timings(report["timings"])


def _print_timings(by_backend: dict[str, dict[str, dict[str, Any]]]) -> None:
    """Where the time goes, per backend: p50/p95 of each timing since the install was created."""
    if not by_backend:
        print("timings: none yet")
        return
    print("timings, p50/p95 (count) since the install was created:")
    for backend, found in by_backend.items():
        print(f"  {backend[:12]:<12} " + timings.line_of(timings.quantiles_from(found), counts=True))
