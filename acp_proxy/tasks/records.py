"""Prompt turns as durable tasks: what ran, what it did, and how it ended.

Every ``session/prompt`` the gateway sends becomes a task row the moment the proxy
routes it, before the turn can produce any event, so no turn goes unrecorded and
no "started" is lost. A row moves ``queued`` -> ``running`` -> one terminal status
and never back; the status comes from the turn's answer through one pure table
(``outcome_of``). A proxy killed mid-turn cannot write an outcome: the next proxy
to start marks its unfinished tasks ``lost``.

This module holds every SQL statement on the ``tasks`` table: the registry that writes a
turn's row (``TaskRegistry``), the reads the operator's commands make, and the maintenance
(lost tasks swept, old ones pruned). What a status is and how an answer decides it is
``tasks.status``; the turn in memory (progress, events, the agent's text) is ``tasks.turn``,
written here at most once per flush interval, never per message.
"""

from __future__ import annotations

import functools
import json
import logging
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import msgspec

from acp_proxy.config import NOTIFY_POLICIES, NotifyPolicy
from acp_proxy.journal import Kind, count_in
from acp_proxy.ownership import instances
from acp_proxy.state import StateDB, now
from acp_proxy.state.writer import Statement
from acp_proxy.tasks.status import TaskStatus
from acp_proxy.tasks.turn import Event, Turn

log = logging.getLogger("acp_proxy.tasks")

DEFAULT_LIST_LIMIT: Final = 50


# --- rows ---------------------------------------------------------------------------


class TaskRecord(msgspec.Struct, frozen=True):
    task_id: str
    session_id: str
    backend: str
    instance_id: str
    lease_id: str | None
    request_id: str | None
    status: TaskStatus
    stop_reason: str | None
    error: str | None
    traceparent: str | None
    prompt: str
    created_at: float
    started_at: float | None
    first_output_at: float | None
    ended_at: float | None
    summary: str
    update_count: int
    tool_calls: int
    events: tuple[Event, ...]
    events_dropped: int
    updated_at: float

    @classmethod
    def from_row(cls, row: Any) -> TaskRecord:
        return cls(
            task_id=row["task_id"],
            session_id=row["session_id"],
            backend=row["backend"],
            instance_id=row["instance_id"],
            lease_id=row["lease_id"],
            request_id=row["request_id"],
            status=TaskStatus(row["status"]),
            stop_reason=row["stop_reason"],
            error=row["error"],
            traceparent=row["traceparent"],
            prompt=row["prompt"],
            created_at=row["created_at"],
            started_at=row["started_at"],
            first_output_at=row["first_output_at"],
            ended_at=row["ended_at"],
            summary=row["progress_summary"],
            update_count=row["update_count"],
            tool_calls=row["tool_calls"],
            events=tuple(Event(e["at"], e["kind"], e.get("detail", "")) for e in json.loads(row["recent_events"])),
            events_dropped=row["events_dropped"],
            updated_at=row["updated_at"],
        )


def _events_json(events: Iterable[Event]) -> str:
    return _encode_json([e.to_json() for e in events]).decode()  # written twice a turn: msgspec, not json


_encode_json: Final = msgspec.json.Encoder().encode


_PROGRESS_COLUMNS: Final = (
    "first_output_at = ?, progress_summary = ?, update_count = ?, tool_calls = ?, recent_events = ?, "
    "events_dropped = ?, updated_at = ?"
)


def _progress_values(turn: Turn) -> tuple[object, ...]:
    return (
        turn.first_output_at,
        turn.summary,
        turn.update_count,
        turn.tool_calls,
        _events_json(turn.events),
        turn.events_dropped,
        now(),
    )


Told = Callable[[Turn, BaseException | None], None]
"""Told how a write of a turn went (its error, or ``None``)."""


class TaskRegistry:
    """Task rows in the state database, written at a turn's milestones.

    Each write takes its values from the turn when it is made (on the event loop) and
    is handed to the state database's writer (``StateDB.write``): the relay never waits
    for it. A queued progress write of a task is replaced by a newer one. Whoever sets
    ``on_written`` is told how each write went (later, from the writer's thread).
    """

    def __init__(self, db: StateDB, instance_id: str) -> None:
        self.db = db
        self.instance_id = instance_id
        self.on_written: Told | None = None

    def _write(self, turn: Turn, statement: Statement, *, progress: bool = False) -> None:
        turn.dirty = False
        told = self.on_written
        done = None if told is None else functools.partial(_tell, told, turn)
        self.db.write(statement, key=("progress", turn.task_id) if progress else None, done=done)

    def create(self, turn: Turn) -> None:
        """The turn's row (the session's last activity is the sessions registry's to note: ``note_prompt``)."""
        self.write_whole(turn)

    def mark_running(self, turn: Turn) -> None:
        values = (turn.started_at, turn.lease_id, *_progress_values(turn), turn.task_id)
        self._write(
            turn,
            functools.partial(
                _execute,
                f"""UPDATE tasks SET status = 'running', started_at = ?, lease_id = ?, {_PROGRESS_COLUMNS}
                    WHERE task_id = ? AND status = 'queued'""",
                values,
            ),
        )

    def save_progress(self, turn: Turn) -> None:
        turn.digest()
        values = (*_progress_values(turn), turn.task_id)
        self._write(
            turn,
            functools.partial(
                _execute,
                f"UPDATE tasks SET {_PROGRESS_COLUMNS} WHERE task_id = ? AND status IN ('queued', 'running')",
                values,
            ),
            progress=True,
        )

    def write_whole(self, turn: Turn) -> None:
        """The turn's whole row, created or brought up to date (``create``, or a retry after a failed
        write), with the session's last activity. A row that has already ended is left as it is:
        terminal statuses are final.
        """
        turn.digest()
        values = (
            turn.task_id,
            turn.session_id,
            turn.backend,
            self.instance_id,
            turn.lease_id,
            turn.request_id,
            turn.status.value,
            turn.stop_reason,
            turn.error,
            turn.traceparent,
            turn.prompt,
            turn.created_at,
            turn.started_at,
            turn.ended_at,
            turn.operation_id,
            None if turn.answer is None else turn.answer.decode(),
            *_progress_values(turn),
        )
        self._write(turn, functools.partial(_upsert, values))

    def record_notify(self, turn: Turn) -> None:
        """The task's own notification policy, on its row (for the sweep, should this proxy die)."""
        sql = "UPDATE tasks SET notify = ? WHERE task_id = ?"
        self.db.write(functools.partial(_execute, sql, (turn.notify, turn.task_id)))

    def finish(self, turn: Turn) -> None:
        """Record a terminal status, unless the row has already ended (terminal statuses are final)."""
        values = (
            turn.status.value,
            turn.stop_reason,
            turn.error,
            turn.ended_at,
            None if turn.answer is None else turn.answer.decode(),
            *_progress_values(turn),
            turn.task_id,
        )
        self._write(turn, functools.partial(_finish, values, turn.backend, turn.status.value))


def _tell(
    told: Callable[[Turn, BaseException | None], None], turn: Turn, result: object, error: BaseException | None
) -> None:
    told(turn, error)


def _finish(values: tuple[object, ...], backend: str, status: str, conn: sqlite3.Connection) -> int:
    """A terminal status, counted (``turn_ended``) in the same transaction if the row took it."""
    changed = _execute(
        f"""UPDATE tasks SET status = ?, stop_reason = ?, error = ?, ended_at = ?, answer = ?, {_PROGRESS_COLUMNS}
            WHERE task_id = ? AND status IN ('queued', 'running')""",
        values,
        conn,
    )
    if changed:
        count_in(conn, Kind.TURN_ENDED, backend=backend, label=status)
    return changed


def _execute(sql: str, values: tuple[object, ...], conn: sqlite3.Connection) -> int:
    """One statement; how many rows it changed."""
    return conn.execute(sql, values).rowcount


def _upsert(values: tuple[object, ...], conn: sqlite3.Connection) -> int:
    return conn.execute(
        """INSERT INTO tasks (task_id, session_id, backend, instance_id, lease_id, request_id, status,
               stop_reason, error, traceparent, prompt, created_at, started_at, ended_at, operation_id, answer,
               first_output_at, progress_summary, update_count, tool_calls, recent_events, events_dropped,
               updated_at)
           VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
           ON CONFLICT (task_id) DO UPDATE SET
               lease_id = excluded.lease_id, status = excluded.status, stop_reason = excluded.stop_reason,
               error = excluded.error, started_at = excluded.started_at, ended_at = excluded.ended_at,
               answer = excluded.answer,
               first_output_at = excluded.first_output_at, progress_summary = excluded.progress_summary,
               update_count = excluded.update_count, tool_calls = excluded.tool_calls,
               recent_events = excluded.recent_events, events_dropped = excluded.events_dropped,
               updated_at = excluded.updated_at
           WHERE tasks.status IN ('queued', 'running')""",
        values,
    ).rowcount


# --- reading, for the CLI and the control socket ---------------------------------------------


class AmbiguousId(Exception):
    def __init__(self, prefix: str, matches: Sequence[str]) -> None:
        self.matches = list(matches)
        super().__init__(f"{prefix!r} matches {len(matches)} tasks ({', '.join(matches[:5])}); give more characters")


def get_task(db: StateDB, task_id: str) -> TaskRecord | None:
    """A task by id, or by a unique prefix of at least 4 characters; ``AmbiguousId`` if several match."""
    row = db.conn.execute("SELECT * FROM tasks WHERE task_id = ?", (task_id,)).fetchone()
    if row is not None:
        return TaskRecord.from_row(row)
    if len(task_id) < 4 or not task_id.isalnum():
        return None
    rows = db.conn.execute(
        "SELECT * FROM tasks WHERE task_id >= ? AND task_id < ? ORDER BY task_id LIMIT 6",
        (task_id, task_id + "\U0010ffff"),
    ).fetchall()
    if len(rows) > 1:
        raise AmbiguousId(task_id, [r["task_id"] for r in rows])
    return TaskRecord.from_row(rows[0]) if rows else None


class Earlier(msgspec.Struct, frozen=True):
    """The latest task of a session with a given operation id, as far as the decision needs it."""

    task_id: str
    status: TaskStatus
    created_at: float
    answer: bytes | None


def earlier_operation(db: StateDB, session_id: str, operation_id: str, other_than: str = "") -> Earlier | None:
    """The session's latest task with that operation id (any proxy's), but the task ``other_than``."""
    row = db.conn.execute(
        """SELECT task_id, status, created_at, answer FROM tasks
           WHERE session_id = ? AND operation_id = ? AND task_id != ? ORDER BY created_at DESC LIMIT 1""",
        (session_id, operation_id, other_than),
    ).fetchone()
    if row is None:
        return None
    answer = row["answer"]
    return Earlier(
        row["task_id"], TaskStatus(row["status"]), row["created_at"], None if answer is None else answer.encode()
    )


def list_tasks(
    db: StateDB,
    *,
    statuses: Sequence[TaskStatus] = (),
    session_id: str | None = None,
    limit: int | None = DEFAULT_LIST_LIMIT,
) -> list[TaskRecord]:
    """Tasks, newest first, filtered by recorded status and session."""
    query = "SELECT * FROM tasks WHERE 1 = 1"
    args: list[object] = []
    if statuses:
        query += f" AND status IN ({', '.join('?' * len(statuses))})"
        args += [s.value for s in statuses]
    if session_id is not None:
        query += " AND session_id = ?"
        args.append(session_id)
    query += " ORDER BY created_at DESC, task_id LIMIT ?"
    args.append(-1 if limit is None else limit)
    return [TaskRecord.from_row(row) for row in db.conn.execute(query, args)]


def active_by_session(db: StateDB) -> dict[str, int]:
    """How many tasks of each session are queued or running, as recorded."""
    return dict(
        db.conn.execute(
            "SELECT session_id, COUNT(*) FROM tasks WHERE status IN ('queued', 'running') GROUP BY session_id"
        ).fetchall()
    )


def has_tasks_of(db: StateDB, session_id: str) -> bool:
    return db.conn.execute("SELECT 1 FROM tasks WHERE session_id = ?", (session_id,)).fetchone() is not None


def counts_since(db: StateDB, since: float) -> dict[str, int]:
    """How many tasks created since ``since`` (wall clock) are in each status."""
    return dict(
        db.conn.execute("SELECT status, COUNT(*) FROM tasks WHERE created_at >= ? GROUP BY status", (since,)).fetchall()
    )


def recent(db: StateDB, since: float, session_id: str | None = None) -> list[sqlite3.Row]:
    """Task rows active or ended since ``since`` (wall clock)."""
    query = "SELECT * FROM tasks WHERE (status IN ('queued', 'running') OR ended_at >= ?)"
    args: list[object] = [since]
    if session_id is not None:
        query += " AND session_id = ?"
        args.append(session_id)
    return db.conn.execute(query, args).fetchall()


# --- maintenance ------------------------------------------------------------------


LOST_ERROR: Final = "the acp-proxy process serving it ended without recording an outcome"


class Swept(msgspec.Struct, frozen=True):
    """A task ``sweep_lost`` marked lost, with what a notification of it needs."""

    record: TaskRecord
    """As it is now: ``lost``."""
    previous: TaskStatus
    notify: NotifyPolicy | None
    """Its own notification policy, if an operator set one."""
    title: str | None
    """Its session's title."""


def unfinished_by(db: StateDB, own_instance: str | None) -> list[str]:
    """The proxies, other than ``own_instance``, that have unfinished tasks on record."""
    rows = db.conn.execute(
        "SELECT DISTINCT instance_id FROM tasks WHERE status IN ('queued', 'running') AND instance_id IS NOT ?",
        (own_instance,),
    )
    return [row[0] for row in rows]


Titles = Callable[[sqlite3.Connection, Iterable[str]], dict[str, str | None]]
"""Sessions' titles by id, read on the connection given (``sessions.registry.titles_of``: their SQL is theirs)."""


def sweep_lost(
    db: StateDB,
    own_instance: str | None,
    told: Callable[[Swept], None] | None = None,
    titles: Titles | None = None,
) -> int:
    """Mark ``lost`` the unfinished tasks of proxies that are gone; idempotent. ``told`` of each one,
    with its session's title where ``titles`` reads it.

    A proxy that dies (SIGKILL, OOM, power) cannot record how its turns ended;
    its lock being free is the proof it is gone, never its PID.
    """
    dead = [instance for instance in unfinished_by(db, own_instance) if not instances.instance_alive(db, instance)]
    swept = 0
    at = now()
    lost: list[Swept] = []
    for instance_id in dead:
        with db.transaction() as conn:
            if told is not None:
                rows = conn.execute(
                    "SELECT * FROM tasks WHERE instance_id = ? AND status IN ('queued', 'running')", (instance_id,)
                ).fetchall()
                named = titles(conn, {row["session_id"] for row in rows}) if titles is not None else {}
                lost += filter(None, (_swept(row, at, named.get(row["session_id"])) for row in rows))
            for backend, count in conn.execute(
                """SELECT backend, COUNT(*) FROM tasks WHERE instance_id = ? AND status IN ('queued', 'running')
                   GROUP BY backend""",
                (instance_id,),
            ).fetchall():
                count_in(conn, Kind.TURN_ENDED, backend=backend, label=TaskStatus.LOST.value, count=count)
            cursor = conn.execute(
                """UPDATE tasks SET status = 'lost', ended_at = ?, updated_at = ?, error = ?
                   WHERE instance_id = ? AND status IN ('queued', 'running')""",
                (at, at, LOST_ERROR, instance_id),
            )
            swept += cursor.rowcount
    if told is not None:
        for task in lost:
            told(task)
    return swept


def _swept(row: Any, at: float, title: str | None) -> Swept | None:
    """What a notification of a task swept lost needs; ``None`` for a row too damaged to read
    (it is marked lost all the same; only its notification is lost)."""
    try:
        record = TaskRecord.from_row(row)
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("task %s: swept lost, not notified: its row cannot be read (%s)", row["task_id"], exc)
        return None
    notify = row["notify"] if row["notify"] in NOTIFY_POLICIES else None
    return Swept(
        msgspec.structs.replace(record, status=TaskStatus.LOST, ended_at=at, error=LOST_ERROR, updated_at=at),
        record.status,
        notify,
        title,
    )


def prune(db: StateDB, retention: float, *, at: float | None = None) -> int:
    """Delete terminal tasks that ended more than ``retention`` seconds ago; idempotent."""
    cutoff = (now() if at is None else at) - retention
    sql = "DELETE FROM tasks WHERE status NOT IN ('queued', 'running') AND ended_at < ?"
    return db.call(functools.partial(_execute, sql, (cutoff,)))  # after this proxy's queued writes
