"""Prompt turns as durable tasks: what ran, what it did, and how it ended.

Every ``session/prompt`` the gateway sends becomes a task row the moment the proxy
routes it, before the turn can produce any event, so no turn goes unrecorded and
no "started" is lost. A row moves ``queued`` -> ``running`` -> one terminal status
and never back; the status comes from the turn's answer through one pure table
(``outcome_of``). A proxy killed mid-turn cannot write an outcome: the next proxy
to start marks its unfinished tasks ``lost``.

Progress (update count, tool calls, the tail of the agent's text) is kept in
memory by ``Turn`` and written at most once per flush interval, never per
message: the streaming relay only hands each block to ``Turn.observe``, which
keeps a reference and a count and decodes nothing unless the block mentions a
tool call.
"""

from __future__ import annotations

import enum
import functools
import json
import logging
import os
import re
import sqlite3
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import msgspec
from msgspec import UNSET, Raw, UnsetType

from acp_proxy.config import NOTIFY_POLICIES, NotifyPolicy
from acp_proxy.journal import Kind, count_in
from acp_proxy.ownership import instances
from acp_proxy.protocol.acp import SESSION_INFO_MARK, session_info_changes
from acp_proxy.protocol.jsonrpc import REQUEST_CANCELLED
from acp_proxy.protocol.methods import Method
from acp_proxy.state import StateDB, Statement, now

log = logging.getLogger("acp_proxy.tasks")


class TaskStatus(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"
    LOST = "lost"


ACTIVE: Final = frozenset({TaskStatus.QUEUED, TaskStatus.RUNNING})
TERMINAL: Final = frozenset(TaskStatus) - ACTIVE
DONE_STOP_REASONS: Final = frozenset({"end_turn", "max_tokens", "max_turn_requests", "refusal"})

SUMMARY_CHARS: Final = 500
"""How much of the tail of the agent's text a task keeps."""
PROMPT_PREVIEW_CHARS: Final = 200
MAX_EVENTS: Final = 32
"""Recent events kept per task; the milestones (started, resumed, finished...) are never the ones dropped."""
UNREAD_LIMIT: Final = 1024 * 1024
"""Bytes of streamed updates kept for the next digest (about a second's worth): beyond it the oldest
are dropped unread, which only matters for text that is no longer the tail, and for tool calls in
blocks too large to be checked as they pass (see ``Turn.observe``)."""
SCAN_LIMIT: Final = 8 * 1024
"""Blocks up to this size are checked for tool calls as they are relayed (events on time); larger
ones, which only a burst of streaming makes, at the next digest."""
DEFAULT_LIST_LIMIT: Final = 50

_DROPPABLE: Final = frozenset({"tool_call", "permission_asked", "permission_answered", "cancel_requested"})
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


# --- the status table --------------------------------------------------------------


class Outcome(msgspec.Struct, frozen=True):
    status: TaskStatus
    stop_reason: str | None = None
    error: str | None = None


def outcome_of(
    *,
    stop_reason: str | None = None,
    error: tuple[int, str] | None = None,
    timed_out: bool = False,
    ended_by: str | None = None,
) -> Outcome:
    """How a turn ended, from what the gateway was answered.

    ``error`` is the JSON-RPC error ``(code, message)`` if the answer was one (the
    adapter's own, or the proxy's when the adapter crashed or the proxy shut down);
    ``timed_out`` says the proxy cancelled the turn because ``turn_timeout`` passed:
    the turn is ``timed_out`` if it then ended cancelled; a turn that ended otherwise
    meanwhile (it finished, or its adapter crashed) is recorded as it ended.
    ``ended_by`` says why the proxy answered a cancelled turn itself, before its adapter
    did (``cancel_timeout``): kept as the turn's error, beside its stop reason.
    """
    message = None if error is None else f"{error[1]} (code {error[0]})"
    cancelled = stop_reason == "cancelled" or (error is not None and error[0] == REQUEST_CANCELLED)
    if timed_out and cancelled:  # ended by the cancel the timeout sent (or the proxy's own answer)
        return Outcome(TaskStatus.TIMED_OUT, stop_reason, message)
    if ended_by is not None and stop_reason == "cancelled":
        return Outcome(TaskStatus.CANCELLED, stop_reason, ended_by)
    if error is not None:
        status = TaskStatus.CANCELLED if error[0] == REQUEST_CANCELLED else TaskStatus.FAILED
        return Outcome(status, None, message)
    if stop_reason == "cancelled":
        return Outcome(TaskStatus.CANCELLED, stop_reason)
    if stop_reason is None:
        return Outcome(TaskStatus.FAILED, None, "the agent answered without a stopReason")
    # end_turn, max_tokens, max_turn_requests, refusal, and stop reasons newer than this table:
    # the turn ended normally and the reason says how.
    return Outcome(TaskStatus.DONE, stop_reason)


def effective_status(recorded: TaskStatus, instance_alive: bool) -> TaskStatus:
    """What an operator should be told: an unfinished task whose proxy is gone is lost, swept or not."""
    return TaskStatus.LOST if recorded in ACTIVE and not instance_alive else recorded


def traceparent_of(meta: object) -> str | None:
    """A W3C ``traceparent`` from a request's ``_meta`` (the key ACP reserves for it), if well formed."""
    if isinstance(meta, dict):
        value = meta.get("traceparent")
        if isinstance(value, str) and _TRACEPARENT.match(value):
            return value
    return None


def prompt_preview(params: dict[str, Any]) -> str:
    """The start of a prompt's text, for an operator to tell turns apart."""
    blocks = params.get("prompt")
    texts = []
    if isinstance(blocks, list):
        for block in blocks:
            if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif isinstance(block, dict) and isinstance(block.get("type"), str):
                texts.append(f"[{block['type']}]")
    text = " ".join(" ".join(texts).split())
    return text[:PROMPT_PREVIEW_CHARS] + ("…" if len(text) > PROMPT_PREVIEW_CHARS else "")


# --- what streamed updates say (decoded only at a digest) ------------------------------


class _Update(msgspec.Struct, gc=False):
    sessionUpdate: str = ""
    content: Raw = Raw(b"null")
    """Left undecoded (msgspec takes ``Raw`` only on its own, not in a union)."""
    title: str | UnsetType | None = UNSET
    updatedAt: str | UnsetType | None = UNSET


class _UpdateParams(msgspec.Struct, gc=False):
    update: _Update | UnsetType | None = UNSET


class _Notification(msgspec.Struct, gc=False):
    method: str | None = None
    params: _UpdateParams | UnsetType | None = UNSET


class _Text(msgspec.Struct, gc=False):
    type: str | None = None
    text: str | None = None


_notification_decoder: Final = msgspec.json.Decoder(_Notification)
_text_decoder: Final = msgspec.json.Decoder(_Text)


def updates_in(block: bytes) -> list[_Update]:
    """The ``session/update`` payloads of a block of notification lines; lines that do not parse are skipped."""
    try:
        messages = _notification_decoder.decode_lines(block)
    except (msgspec.DecodeError, RecursionError):
        messages = []
        for line in block.splitlines():
            try:
                messages.append(_notification_decoder.decode(line))
            except (msgspec.DecodeError, RecursionError):
                continue
    return [
        msg.params.update
        for msg in messages
        if msg.method == Method.UPDATE
        and isinstance(msg.params, _UpdateParams)
        and isinstance(msg.params.update, _Update)
    ]


def agent_text(update: _Update) -> str:
    if update.sessionUpdate != "agent_message_chunk":
        return ""
    try:
        content = _text_decoder.decode(update.content)
    except (msgspec.DecodeError, RecursionError):
        return ""
    return content.text if content.type == "text" and content.text else ""


# --- a turn in progress -------------------------------------------------------------


class Event(msgspec.Struct, frozen=True):
    at: float
    kind: str
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"at": self.at, "kind": self.kind, "detail": self.detail}


def keep_recent(events: list[Event], event: Event, limit: int = MAX_EVENTS) -> int:
    """Append ``event``, dropping the oldest routine event beyond ``limit``; the number dropped."""
    events.append(event)
    if len(events) <= limit:
        return 0
    index = next((i for i, e in enumerate(events) if e.kind in _DROPPABLE), 0)
    del events[index]
    return 1


def new_task_id() -> str:
    return os.urandom(6).hex()


class Turn(msgspec.Struct, eq=False):
    """One prompt turn this proxy is serving: its task row's fields, kept current in memory."""

    task_id: str
    session_id: str
    backend: str
    request_id: str
    """The gateway's JSON-RPC id for the prompt, as JSON text."""
    prompt: str = ""
    traceparent: str | None = None
    status: TaskStatus = TaskStatus.QUEUED
    created_at: float = msgspec.field(default_factory=now)
    started_at: float | None = None
    first_output_at: float | None = None
    ended_at: float | None = None
    stop_reason: str | None = None
    error: str | None = None
    update_count: int = 0
    tool_calls: int = 0
    summary: str = ""
    events: list[Event] = msgspec.field(default_factory=list)
    events_dropped: int = 0
    lease_id: str | None = None
    dirty: bool = False
    """Progress not yet written to the database."""
    timed_out: bool = False
    cancel_requested: bool = False
    """An operator cancelled it while it was queued: it is answered ``cancelled`` instead of sent."""
    deadline: float | None = None
    """``time.monotonic()`` after which ``turn_timeout`` cancels the turn."""
    cancel_bounded: bool = False
    """A ``session/cancel`` was sent for it and ``cancel_timeout`` counts from the first one."""
    notify: NotifyPolicy | None = None
    """The task's own notification policy, set by an operator; ``None``: the config's ``[tasks] notify``."""
    _unread: list[tuple[bytes, bool]] = msgspec.field(default_factory=list)
    """Blocks relayed since the last digest, each with whether its tool calls have been counted."""
    _unread_bytes: int = 0
    session_info: dict[str, str | None] = msgspec.field(default_factory=dict)
    """What ``session_info_update``s of this turn announced (``title``, ``updatedAt``) and is not
    yet recorded on the session: read where the tool calls are (small blocks at once, bursts at
    the next digest), so that titles cost the streaming path no pass of their own."""

    def event(self, kind: str, detail: str = "") -> None:
        self.events_dropped += keep_recent(self.events, Event(now(), kind, detail))
        self.dirty = True

    def start(self, lease_id: str | None, turn_timeout: float | None) -> None:
        self.status = TaskStatus.RUNNING
        self.started_at = now()
        self.lease_id = lease_id
        if turn_timeout:
            self.deadline = time.monotonic() + turn_timeout
        self.event("started", f"lease {lease_id}" if lease_id else "")

    def observe(self, block: bytes, count: int) -> None:
        """``count`` notification lines of this turn were relayed as ``block``: note them, cheaply.

        Nothing is decoded here unless a small block mentions a tool call. Large blocks
        (a burst) are looked at by the next digest, within ``UNREAD_LIMIT``, so that
        recording a turn never costs the streaming path a pass over every byte.
        """
        self.update_count += count
        if self.first_output_at is None:
            self.first_output_at = now()
            self.event("first_output")
        scanned = len(block) <= SCAN_LIMIT
        if scanned and (b'"tool_call"' in block or SESSION_INFO_MARK in block):
            updates = updates_in(block)
            self._count_tool_calls(updates)
            self._note_session_info(updates)
        self._unread.append((block, scanned))
        self._unread_bytes += len(block)
        while self._unread_bytes > UNREAD_LIMIT and len(self._unread) > 1:
            self._unread_bytes -= len(self._unread.pop(0)[0])
        self.dirty = True

    def _count_tool_calls(self, updates: Iterable[_Update]) -> None:
        for update in updates:
            if update.sessionUpdate == "tool_call":
                self.tool_calls += 1
                self.event("tool_call", update.title if isinstance(update.title, str) else "")

    def _note_session_info(self, updates: Iterable[_Update]) -> None:
        for update in updates:
            if update.sessionUpdate == "session_info_update":
                self.session_info.update(session_info_changes(update.title, update.updatedAt))

    def digest(self) -> None:
        """Fold the updates relayed since the last digest into the text summary (and unseen tool calls)."""
        if not self._unread:
            return
        blocks, self._unread, self._unread_bytes = self._unread, [], 0
        text = []
        for block, scanned in blocks:
            updates = updates_in(block)
            if not scanned:
                self._count_tool_calls(updates)
                self._note_session_info(updates)
            text += [agent_text(update) for update in updates]
        joined = "".join(text)
        if joined:
            self.summary = (self.summary + joined)[-SUMMARY_CHARS:]

    def finish(self, outcome: Outcome) -> None:
        self.digest()
        self.status = outcome.status
        self.stop_reason = outcome.stop_reason
        self.error = outcome.error
        self.ended_at = now()
        detail = outcome.stop_reason or outcome.error or ""
        said = (
            f"{outcome.status.value}: {detail}" if detail and detail != outcome.status.value else outcome.status.value
        )
        self.event("finished", said)


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
    ``on_written`` is told how each write went (with a writer: later, from its thread).
    """

    def __init__(self, db: StateDB, instance_id: str) -> None:
        self.db = db
        self.instance_id = instance_id
        self.on_written: Told | None = None

    def _write(self, turn: Turn, statement: Statement, *, progress: bool = False) -> object:
        turn.dirty = False
        told = self.on_written
        done = None if told is None else functools.partial(_tell, told, turn)
        return self.db.write(statement, key=("progress", turn.task_id) if progress else None, done=done)

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
            *_progress_values(turn),
        )
        self._write(turn, functools.partial(_upsert, values))

    def record_notify(self, turn: Turn) -> None:
        """The task's own notification policy, on its row (for the sweep, should this proxy die)."""
        sql = "UPDATE tasks SET notify = ? WHERE task_id = ?"
        self.db.write(functools.partial(_execute, sql, (turn.notify, turn.task_id)))

    def finish(self, turn: Turn) -> bool | None:
        """Record a terminal status; False if the row had already ended (terminal statuses are final).

        ``None`` when the write is queued for the writer thread (its outcome is not known yet).
        """
        values = (
            turn.status.value,
            turn.stop_reason,
            turn.error,
            turn.ended_at,
            *_progress_values(turn),
            turn.task_id,
        )
        changed = self._write(turn, functools.partial(_finish, values, turn.backend, turn.status.value))
        return None if self.db.writer is not None else changed == 1


def _tell(
    told: Callable[[Turn, BaseException | None], None], turn: Turn, result: object, error: BaseException | None
) -> None:
    told(turn, error)


def _finish(values: tuple[object, ...], backend: str, status: str, conn: sqlite3.Connection) -> int:
    """A terminal status, counted (``turn_ended``) in the same transaction if the row took it."""
    changed = _execute(
        f"""UPDATE tasks SET status = ?, stop_reason = ?, error = ?, ended_at = ?, {_PROGRESS_COLUMNS}
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
               stop_reason, error, traceparent, prompt, created_at, started_at, ended_at, first_output_at,
               progress_summary, update_count, tool_calls, recent_events, events_dropped, updated_at)
           VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
           ON CONFLICT (task_id) DO UPDATE SET
               lease_id = excluded.lease_id, status = excluded.status, stop_reason = excluded.stop_reason,
               error = excluded.error, started_at = excluded.started_at, ended_at = excluded.ended_at,
               first_output_at = excluded.first_output_at, progress_summary = excluded.progress_summary,
               update_count = excluded.update_count, tool_calls = excluded.tool_calls,
               recent_events = excluded.recent_events, events_dropped = excluded.events_dropped,
               updated_at = excluded.updated_at
           WHERE tasks.status IN ('queued', 'running')""",
        values,
    ).rowcount


# --- reading, for the CLI and the control socket ---------------------------------------------

_WITH_SESSION_TITLE: Final = (
    "SELECT tasks.*, sessions.title AS session_title FROM tasks LEFT JOIN sessions USING (session_id)"
)
"""Task rows, each with its session's title (the one statement here that reads ``sessions``)."""


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


def recent_with_titles(db: StateDB, since: float, session_id: str | None = None) -> list[sqlite3.Row]:
    """Task rows active or ended since ``since`` (wall clock), each with its session's title (``session_title``)."""
    query = f"{_WITH_SESSION_TITLE} WHERE (tasks.status IN ('queued', 'running') OR tasks.ended_at >= ?)"
    args: list[object] = [since]
    if session_id is not None:
        query += " AND tasks.session_id = ?"
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


def sweep_lost(db: StateDB, own_instance: str | None, told: Callable[[Swept], None] | None = None) -> int:
    """Mark ``lost`` the unfinished tasks of proxies that are gone; idempotent. ``told`` of each one.

    A proxy that dies (SIGKILL, OOM, power) cannot record how its turns ended;
    its lock being free is the proof it is gone, never its PID.
    """
    rows = db.conn.execute(
        "SELECT DISTINCT instance_id FROM tasks WHERE status IN ('queued', 'running') AND instance_id IS NOT ?",
        (own_instance,),
    ).fetchall()
    dead = [row[0] for row in rows if not instances.instance_alive(db, row[0])]
    swept = 0
    at = now()
    lost: list[Swept] = []
    for instance_id in dead:
        with db.transaction() as conn:
            if told is not None:
                rows = conn.execute(
                    f"{_WITH_SESSION_TITLE} WHERE tasks.instance_id = ? AND tasks.status IN ('queued', 'running')",
                    (instance_id,),
                ).fetchall()
                lost += filter(None, (_swept(row, at) for row in rows))
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


def _swept(row: Any, at: float) -> Swept | None:
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
        row["session_title"],
    )


def prune(db: StateDB, retention: float, *, at: float | None = None) -> int:
    """Delete terminal tasks that ended more than ``retention`` seconds ago; idempotent."""
    cutoff = (now() if at is None else at) - retention
    sql = "DELETE FROM tasks WHERE status NOT IN ('queued', 'running') AND ended_at < ?"
    return db.call(functools.partial(_execute, sql, (cutoff,)))  # after this proxy's queued writes
