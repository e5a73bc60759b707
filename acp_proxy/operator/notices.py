"""Task notifications from the operator's side: ``acp-proxy tasks notify`` and ``tasks watch``.

``tasks notify ID POLICY`` gives one task a notification policy of its own. Only the
proxy running the task can act on it, so it is told through its control socket (it
keeps the policy on the turn, and writes it to the task's row); a task that has ended
has nothing left to tell, and is refused like other bad input (exit 2).

``tasks watch`` prints task status changes as they happen, for scripts, from the state
database alone: it polls every ``POLL_INTERVAL`` the tasks that are unfinished or ended
in the last ``LATE_WRITES`` seconds, and prints a line for each whose status is not the
one it last saw. It starts from now (what was already there is not printed; with
``--since D``, each task that took its status in the last D is printed first, with no
previous status) and runs until interrupted. A task that went through several statuses between two polls is
printed once, from the status it was last seen in (``queued -> done``); one first seen
already changed has no previous status. A task whose proxy is gone is shown ``lost`` at
once, as ``tasks list`` shows it.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Final, TextIO

from msgspec.structs import replace

from acp_proxy.operator.commands import open_existing
from acp_proxy.operator.reports import (
    EXIT_USAGE,
    Acted,
    FinishedMeanwhile,
    Liveness,
    OperatorError,
    ask,
    opened,
    printable,
    report,
    resolve_session,
    resolve_task,
    task_view,
)
from acp_proxy.sessions.registry import titles_of
from acp_proxy.state import StateDB
from acp_proxy.tasks.notify import Notice, encode_notice, notice_of
from acp_proxy.tasks.records import LOST_ERROR, TaskRecord, get_task, recent
from acp_proxy.tasks.status import ACTIVE, TERMINAL, TaskStatus, effective_status

POLL_INTERVAL: Final = 0.25
LATE_WRITES: Final = 60.0
"""How long after a task's end its row is still looked at: a proxy's writes are queued, and a
busy database may commit one well after the time it carries."""
DEFAULT_POLICY: Final = "default"
"""The policy argument that clears a task's own policy (back to the config's)."""


def tasks_notify(state_dir: Path, task_id: str, policy: str, *, as_json: bool) -> int:
    with opened(state_dir) as db:
        record = resolve_task(db, state_dir, task_id)
        assert db is not None
        view = task_view(record, Liveness(db), events=False)
    outcome: dict[str, Any] = {"taskId": record.task_id, "sessionId": record.session_id, "instance": record.instance_id}
    if view["status"] in {s.value for s in TERMINAL}:
        return _ended(outcome, view["status"], as_json)
    own = None if policy == DEFAULT_POLICY else policy
    try:
        result = ask(state_dir, record.instance_id, "notify_task", {"taskId": record.task_id, "policy": own})
    except FinishedMeanwhile:
        with opened(state_dir) as db:
            latest = get_task(db, record.task_id) if db is not None else None
        return _ended(outcome, latest.status.value if latest is not None else "ended", as_json)
    except OperatorError as exc:
        outcome |= {"changed": False, "status": view["status"], "reason": str(exc)}
        return report(Acted(outcome, str(exc), exc.exit_code), as_json)
    outcome |= {
        "changed": True,
        "status": result.get("status"),
        "policy": result.get("policy"),
        "effective": result.get("effective"),
    }
    whose = "its own" if own is not None else "the config's"
    message = f"task {record.task_id}: notifications {outcome['effective']} ({whose})"
    return report(Acted(outcome, message, 0), as_json)


def _ended(outcome: dict[str, Any], status: str, as_json: bool) -> int:
    outcome |= {"changed": False, "status": status, "reason": "already ended"}
    message = f"task {outcome['taskId']} has already ended ({status}): there is nothing left to notify"
    return report(Acted(outcome, message, EXIT_USAGE), as_json)


# --- watching ------------------------------------------------------------------------------------


def tasks_watch(
    state_dir: Path, *, session_id: str | None, since: float | None, as_json: bool, out: TextIO | None = None
) -> int:
    """Print task status changes until interrupted (to stdout unless ``out``); exit 0 on Ctrl-C or a closed reader."""
    out = out or sys.stdout
    try:
        _watch(state_dir, session_id, since, as_json, out)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # piped into `head`, which has read enough
        # Nothing more can be written; interpreter exit must not try to flush to the closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        return 0
    return 0


def _watch(state_dir: Path, session_id: str | None, since: float | None, as_json: bool, out: TextIO) -> None:
    horizon = None if since is None else time.time() - since
    db = open_existing(state_dir)
    if db is None:  # no proxy has used the state dir yet: its first tasks are changes too
        print(f"no proxy has used {state_dir} yet: waiting for its first tasks (Ctrl-C stops)", file=sys.stderr)
    while db is None:
        time.sleep(POLL_INTERVAL)
        db = open_existing(state_dir)
    try:
        if session_id is not None:
            session_id = resolve_session(db, state_dir, session_id, must_exist=False)
        # Where watching starts: every task is new, and only those that took their status since the
        # horizon are shown (none without --since).
        notices, seen = _changes(db, session_id, {}, max(LATE_WRITES, since or 0.0))
        notices = [notice for notice in notices if horizon is not None and notice.at >= horizon]
        if not as_json:  # for people: from here on, nothing is missed (scripts have --since for that)
            print(f"watching the tasks of {state_dir} (Ctrl-C stops)", file=sys.stderr, flush=True)
        while True:
            for notice in notices:
                out.write(_line(notice, as_json))
                out.flush()
            time.sleep(POLL_INTERVAL)
            notices, seen = _changes(db, session_id, seen, LATE_WRITES)
    finally:
        db.close()


def _changes(
    db: StateDB, session_id: str | None, seen: dict[str, TaskStatus], window: float
) -> tuple[list[Notice], dict[str, TaskStatus]]:
    """The status changes since ``seen``, oldest first, and what is seen now.

    Tasks drop out of what is seen once they have been ended for ``window``; they cannot change again.
    """
    alive = Liveness(db)
    now_seen: dict[str, TaskStatus] = {}
    notices = []
    rows = recent(db, time.time() - window, session_id)
    titles = titles_of(db.conn, {row["session_id"] for row in rows})
    for row in rows:
        try:
            record = TaskRecord.from_row(row)
        except (ValueError, KeyError, TypeError):
            continue  # a damaged row: `acp-proxy doctor` checks the database
        status = now_seen[record.task_id] = _status(record, alive)
        if status is not record.status:  # lost: its proxy is gone, and the next one has not swept it yet
            record = replace(record, error=LOST_ERROR)
        previous = seen.get(record.task_id)
        if status is not previous:
            notices.append(
                notice_of(record, status, previous, title=titles.get(record.session_id), instance=record.instance_id)
            )
    notices.sort(key=lambda n: (n.at, n.taskId))
    return notices, now_seen


def _status(record: TaskRecord, alive: Liveness) -> TaskStatus:
    return effective_status(record.status, alive(record.instance_id) if record.status in ACTIVE else True)


def _line(notice: Notice, as_json: bool) -> str:
    if as_json:
        return encode_notice(notice).decode() + "\n"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(notice.at))
    reason = f"  ({printable(notice.reason)})" if notice.reason and notice.reason != notice.status else ""
    return (
        f"{when}  {notice.taskId}  {notice.sessionId}  {notice.backend}  "
        f"{notice.previousStatus or '-'} -> {notice.status}{reason}\n"
    )
