"""The session registry: one stable id per session, and what it takes to bring it back.

A session's id is the one the adapter first issued; the gateway keeps using it
whatever happens to the process behind it. A row keeps everything a resume needs
(backend, cwd, MCP servers, additional directories, the mode and config options
the gateway set, the auth method it used), the ownership metadata ``session/list``
filters on, and which proxy instance holds it live under which lease.

States: ``live`` (a process serves it) · ``resuming`` (one is being started) ·
``suspended`` (no process; resumable) · ``closed`` (the gateway closed it: no
process, still listed, restored only by the gateway's own load or resume) ·
``deleted`` (a tombstone: never listed, never restored, pruned after the task
retention). Rows survive the proxy: a session left ``live`` by a proxy that died
is ``suspended`` to the next one (its process tree was reaped with its lease).

Writes go through the state writer, by the rules of ``acp_proxy.state``'s docstring
(the compare-and-set claims, ``mark_resuming`` and ``claim_orphaned``, are awaited);
a serving proxy reads its own sessions with ``current``, after its queued writes.
How a session moves between the states: docs/architecture.md, "The states of a session".
"""

from __future__ import annotations

import base64
import binascii
import enum
import functools
import json
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import msgspec

from acp_proxy.ownership import instances
from acp_proxy.protocol.methods import Method
from acp_proxy.state import StateDB, now

LIST_PAGE_SIZE: Final = 50


class SessionState(enum.StrEnum):
    LIVE = "live"
    RESUMING = "resuming"
    SUSPENDED = "suspended"
    CLOSED = "closed"
    DELETED = "deleted"


class Ownership(msgspec.Struct, frozen=True):
    """Who a session belongs to, from ``_meta["acp-proxy"]`` on ``session/new``."""

    session_key: str | None = None
    owner_session_key: str | None = None
    spawned_by: str | None = None
    parent_session_key: str | None = None
    agent_id: str | None = None


class SessionRecord(msgspec.Struct, frozen=True):
    session_id: str
    adapter_session_id: str
    backend: str
    cwd: str
    mcp_servers: str = "[]"
    """JSON text, as the gateway sent it."""
    additional_directories: str | None = None
    state: SessionState = SessionState.LIVE
    instance_id: str | None = None
    lease_id: str | None = None
    settings: tuple[tuple[str, str], ...] = ()
    """``(method, params JSON)`` of each setting request, latest per setting, oldest first."""
    auth_method: str | None = None
    ownership: Ownership = msgspec.field(default_factory=Ownership)
    history_resets: int = 0
    created_at: float = 0.0
    last_active_at: float = 0.0
    title: str | None = None
    """The title the adapter last announced (``session_info_update``)."""
    title_updated_at: str | None = None
    """The ``updatedAt`` the adapter last announced, as it wrote it (ISO 8601)."""
    parent_session_id: str | None = None
    """For a fork: the session it was forked from."""

    def restore_params(self) -> dict[str, Any]:
        """Params for ``session/load``, ``session/resume`` or ``session/new`` (add ``sessionId``)."""
        params: dict[str, Any] = {"cwd": self.cwd, "mcpServers": json.loads(self.mcp_servers)}
        if self.additional_directories is not None:
            params["additionalDirectories"] = json.loads(self.additional_directories)
        return params

    @classmethod
    def from_row(cls, row: Any) -> SessionRecord:
        return cls(
            session_id=row["session_id"],
            adapter_session_id=row["adapter_session_id"],
            backend=row["backend"],
            cwd=row["cwd"],
            mcp_servers=row["mcp_servers"],
            additional_directories=row["additional_directories"],
            state=SessionState(row["state"]),
            instance_id=row["instance_id"],
            lease_id=row["lease_id"],
            settings=tuple((method, params) for method, params in json.loads(row["settings"])),
            auth_method=row["auth_method"],
            ownership=Ownership(
                session_key=row["session_key"],
                owner_session_key=row["owner_session_key"],
                spawned_by=row["spawned_by"],
                parent_session_key=row["parent_session_key"],
                agent_id=row["agent_id"],
            ),
            history_resets=row["history_resets"],
            created_at=row["created_at"],
            last_active_at=row["last_active_at"],
            title=row["title"],
            title_updated_at=row["title_updated_at"],
            parent_session_id=row["parent_session_id"],
        )


def _execute(sql: str, values: tuple[object, ...], conn: sqlite3.Connection) -> int:
    """One statement; how many rows it changed."""
    return conn.execute(sql, values).rowcount


def setting_key(method: str, params: dict[str, Any]) -> tuple[str, str]:
    """Which earlier setting a new one replaces: one mode, one model, one value per config option."""
    if method == Method.SET_CONFIG_OPTION:
        return method, str(params.get("configId"))
    return method, ""


def merge_setting(
    settings: Sequence[tuple[str, str]], method: str, params: dict[str, Any]
) -> tuple[tuple[str, str], ...]:
    """``settings`` with this request recorded (``sessionId`` and ``_meta`` dropped), replacing its older value."""
    kept = {key: value for key, value in params.items() if key not in ("sessionId", "_meta")}
    key = setting_key(method, kept)
    others = [(m, p) for m, p in settings if setting_key(m, json.loads(p)) != key]
    return (*others, (method, json.dumps(kept, sort_keys=True, separators=(",", ":"))))


class Cursor(msgspec.Struct, frozen=True):
    created_at: float
    session_id: str


def encode_cursor(record: SessionRecord) -> str:
    raw = msgspec.json.encode(Cursor(record.created_at, record.session_id))
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(text: str) -> Cursor:
    """The position a ``nextCursor`` names; ``ValueError`` for anything else."""
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        return msgspec.json.decode(raw, type=Cursor)
    except (binascii.Error, ValueError, msgspec.DecodeError, RecursionError):
        raise ValueError(f"invalid cursor {text!r}: pass back a nextCursor from session/list") from None


class SessionRegistry:
    """Session rows in the state database; every write is one short statement, made by the state writer."""

    def __init__(self, db: StateDB, instance_id: str) -> None:
        self.db = db
        self.instance_id = instance_id

    def create(self, record: SessionRecord) -> SessionRecord:
        """Insert a row, or replace one of the same id (a tombstone, or an id the adapter issued afresh)."""
        at = now()
        record = msgspec.structs.replace(record, instance_id=self.instance_id, created_at=at, last_active_at=at)
        owner = record.ownership
        self.db.write(
            functools.partial(
                _execute,
                """INSERT OR REPLACE INTO sessions (session_id, adapter_session_id, backend, state, instance_id,
                       lease_id, cwd, mcp_servers, additional_directories, settings, auth_method, session_key,
                       owner_session_key, spawned_by, parent_session_key, agent_id, history_resets, created_at,
                       last_active_at, title, title_updated_at, parent_session_id)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
                (
                    record.session_id,
                    record.adapter_session_id,
                    record.backend,
                    record.state.value,
                    record.instance_id,
                    record.lease_id,
                    record.cwd,
                    record.mcp_servers,
                    record.additional_directories,
                    json.dumps(list(record.settings)),
                    record.auth_method,
                    owner.session_key,
                    owner.owner_session_key,
                    owner.spawned_by,
                    owner.parent_session_key,
                    owner.agent_id,
                    record.history_resets,
                    record.created_at,
                    record.last_active_at,
                    record.title,
                    record.title_updated_at,
                    record.parent_session_id,
                ),
            )
        )
        return record

    def get(self, session_id: str) -> SessionRecord | None:
        """The row as committed (a serving proxy's own queued writes may not be in it yet: see ``current``)."""
        row = self.db.conn.execute("SELECT * FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
        return None if row is None else SessionRecord.from_row(row)

    async def current(self, session_id: str) -> SessionRecord | None:
        """The row with every write this proxy has made to it so far."""
        await self.db.caught_up()
        return self.get(session_id)

    async def caught_up(self) -> None:
        """Until this proxy's queued writes are applied (before a read that must see them)."""
        await self.db.caught_up()

    async def holder_of(self, session_id: str) -> str | None:
        """The running proxy (instance id) that holds the session, live or suspended by it; ``None``
        when none does (no such session, closed, deleted, or its proxy is gone)."""

        def holder(conn: sqlite3.Connection) -> str | None:
            row = conn.execute(
                "SELECT instance_id FROM sessions WHERE session_id = ? AND state IN ('live', 'resuming', 'suspended')",
                (session_id,),
            ).fetchone()
            if row is None or row[0] is None or not instances.instance_alive(self.db, row[0]):
                return None
            return str(row[0])

        return await self.db.run(holder)

    async def state_of(self, session_id: str) -> tuple[SessionState, bool] | None:
        """The row's state, and whether the proxy it names is running; ``None`` without a row. Reads only."""

        def state(conn: sqlite3.Connection) -> tuple[SessionState, bool] | None:
            row = conn.execute("SELECT state, instance_id FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
            if row is None:
                return None
            return SessionState(row[0]), row[1] is not None and instances.instance_alive(self.db, row[1])

        return await self.db.run(state)

    def existing(self, session_ids: list[str]) -> set[str]:
        """Which of ``session_ids`` the state database has, deleted ones excepted (blocks the calling thread)."""

        def existing(conn: sqlite3.Connection) -> set[str]:
            found: set[str] = set()
            for start in range(0, len(session_ids), 500):
                chunk = session_ids[start : start + 500]
                marks = ", ".join("?" * len(chunk))
                rows = conn.execute(
                    f"SELECT session_id FROM sessions WHERE state != 'deleted' AND session_id IN ({marks})", chunk
                )
                found.update(row[0] for row in rows)
            return found

        return self.db.call(existing)

    def _update(self, session_id: str, assignments: str, values: Iterable[object]) -> None:
        sql = f"UPDATE sessions SET {assignments} WHERE session_id = ?"
        self.db.write(functools.partial(_execute, sql, (*values, session_id)))

    def mark_live(self, session_id: str, lease_id: str | None, adapter_session_id: str) -> None:
        self._update(
            session_id,
            "state = 'live', instance_id = ?, lease_id = ?, adapter_session_id = ?, last_active_at = ?",
            (self.instance_id, lease_id, adapter_session_id, now()),
        )

    async def mark_resuming(self, session_id: str, *, reopen: bool) -> bool:
        """Claim a suspended session (or, to ``reopen`` it, a closed one) for a restore by this proxy; False if
        another proxy holds it, or it was closed meanwhile (by ``keep_suspended``, say) and this is no reopen.

        One compare-and-set, so two proxies of an install never resume one session at once;
        awaited, after this proxy's earlier writes.
        """
        changed = await self.db.run(
            functools.partial(
                _execute,
                """UPDATE sessions SET state = 'resuming', instance_id = ?
                   WHERE session_id = ? AND (state = 'suspended' OR (state = 'closed' AND ?)
                     OR (state IN ('live', 'resuming') AND instance_id = ?))""",
                (self.instance_id, session_id, reopen, self.instance_id),
            )
        )
        return changed == 1

    def take_over_if_orphaned(self, session_id: str) -> bool:
        """A session live under another instance that has died since: suspend it (it is resumable).

        Blocks the calling thread until it is written (for the CLI, and for the proxy where it
        cannot wait: deciding a new session's stable id); a serving proxy otherwise awaits
        ``claim_orphaned``.
        """
        return self.db.call(self._orphan_claim(session_id))

    async def claim_orphaned(self, session_id: str) -> bool:
        """``take_over_if_orphaned``, awaited off the event loop."""
        return await self.db.run(self._orphan_claim(session_id))

    def _orphan_claim(self, session_id: str) -> Callable[[sqlite3.Connection], bool]:
        def claim(conn: sqlite3.Connection) -> bool:
            row = conn.execute(
                "SELECT instance_id FROM sessions WHERE session_id = ? AND state IN ('live', 'resuming')",
                (session_id,),
            ).fetchone()
            if row is None or (row[0] is not None and instances.instance_alive(self.db, row[0])):
                return False
            cursor = conn.execute(
                """UPDATE sessions SET state = 'suspended', lease_id = NULL
                   WHERE session_id = ? AND state IN ('live', 'resuming') AND instance_id IS ?""",
                (session_id, row[0]),
            )
            return cursor.rowcount == 1

        return claim

    def hand_over(self, session_id: str, to: str) -> None:
        """Released to proxy ``to`` of the install (a handover): suspended, under it, if this proxy held it."""
        sql = """UPDATE sessions SET state = 'suspended', lease_id = NULL, instance_id = ?
                 WHERE session_id = ? AND instance_id = ? AND state IN ('live', 'resuming', 'suspended')"""
        self.db.write(functools.partial(_execute, sql, (to, session_id, self.instance_id)))

    async def held_by_another(self, session_id: str) -> str | None:
        """The other live proxy of the install whose row says it holds the session (live or resuming), if any:
        one that has died is not (its session is suspended for the asker, as ``claim_orphaned`` does)."""
        if await self.claim_orphaned(session_id):
            return None
        record = await self.current(session_id)
        if record is None or record.state not in (SessionState.LIVE, SessionState.RESUMING):
            return None
        return record.instance_id if record.instance_id != self.instance_id else None

    def note_backend(self, session_id: str, backend: str) -> None:
        """The session is served by ``backend`` from now on (its own was renamed in the config)."""
        self._update(session_id, "backend = ?", (backend,))

    def mark_suspended(self, session_id: str) -> None:
        self._update(session_id, "state = 'suspended', lease_id = NULL", ())

    def release_claim(self, session_id: str, state: SessionState) -> None:
        """A resume that did not take: the session is again ``state`` (suspended, or closed)."""
        self._update(session_id, "state = ?, lease_id = NULL", (state.value,))

    def mark_closed(self, session_id: str) -> None:
        self._update(session_id, "state = 'closed', lease_id = NULL, closed_at = ?", (now(),))

    def mark_deleted(self, session_id: str) -> None:
        """A tombstone: never listed or restored again. What it took to restore it is wiped."""
        self._update(
            session_id,
            """state = 'deleted', lease_id = NULL, deleted_at = ?, mcp_servers = '[]', settings = '[]',
               additional_directories = NULL, title = NULL""",
            (now(),),
        )

    def retire_suspended(self, older_than: float, *, dry_run: bool = False) -> list[SessionRecord]:
        """Close every session suspended and last active more than ``older_than`` seconds ago (``[sessions]
        keep_suspended``): as ``session/close`` leaves a session, with no process to reap. The sessions closed
        (with ``dry_run``, those that would be), oldest first; blocks the calling thread."""
        cutoff = now() - older_than

        def retire(conn: sqlite3.Connection) -> list[SessionRecord]:
            cursor = conn.cursor()
            cursor.row_factory = sqlite3.Row
            if dry_run:
                cursor.execute("SELECT * FROM sessions WHERE state = 'suspended' AND last_active_at < ?", (cutoff,))
            else:  # one statement: a session claimed meanwhile by a proxy is not closed, nor reported
                cursor.execute(
                    """UPDATE sessions SET state = 'closed', closed_at = ?, lease_id = NULL
                       WHERE state = 'suspended' AND last_active_at < ? RETURNING *""",
                    (now(), cutoff),
                )
            records = [SessionRecord.from_row(row) for row in cursor.fetchall()]
            return sorted(records, key=lambda record: record.last_active_at or 0.0)

        return self.db.call(retire)

    def prune_deleted(self, retention: float) -> int:
        """Forget tombstones older than ``retention`` seconds; how many (blocks the calling thread)."""
        sql = "DELETE FROM sessions WHERE state = 'deleted' AND deleted_at < ?"
        return self.db.call(functools.partial(_execute, sql, (now() - retention,)))

    def note_prompt(self, session_id: str, at: float) -> None:
        """A prompt for the session arrived at ``at`` (its task's creation): its last activity, which orders lists."""
        self._update(session_id, "last_active_at = MAX(last_active_at, ?)", (at,))

    def record_title(self, session_id: str, changes: dict[str, str | None]) -> None:
        """What a ``session_info_update`` announced: ``title`` and/or ``updatedAt`` (``None`` clears)."""
        columns = {"title": "title", "updatedAt": "title_updated_at"}
        assignments = ", ".join(f"{columns[key]} = ?" for key in changes)
        if assignments:
            self._update(session_id, assignments, changes.values())

    def close_if_unchanged(self, record: SessionRecord) -> bool:
        """Mark a session closed that no proxy holds, unless its row changed since ``record`` was read.

        For an operator's close with no proxy to ask: one compare-and-set, so a proxy that
        takes the session meanwhile wins and the operator is told to try again.
        """
        changed = self.db.call(
            functools.partial(
                _execute,
                """UPDATE sessions SET state = 'closed', lease_id = NULL, closed_at = ?
                   WHERE session_id = ? AND state = ? AND instance_id IS ?""",
                (now(), record.session_id, record.state.value, record.instance_id),
            )
        )
        return changed == 1

    def note_history_reset(self, session_id: str, adapter_session_id: str) -> None:
        self._update(
            session_id,
            "adapter_session_id = ?, history_resets = history_resets + 1",
            (adapter_session_id,),
        )

    def record_setting(self, session_id: str, method: str, params: dict[str, Any]) -> None:
        def merge(conn: sqlite3.Connection) -> None:
            row = conn.execute("SELECT settings FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
            if row is None:
                return
            settings = merge_setting([tuple(pair) for pair in json.loads(row[0])], method, params)
            conn.execute(
                "UPDATE sessions SET settings = ? WHERE session_id = ?", (json.dumps(list(settings)), session_id)
            )

        self.db.write(merge)

    async def suspend_all_of_this_instance(self) -> int:
        """On shutdown: every session this proxy holds becomes resumable by the next one."""
        return await self.db.run(
            functools.partial(
                _execute,
                """UPDATE sessions SET state = 'suspended', lease_id = NULL
                   WHERE instance_id = ? AND state IN ('live', 'resuming')""",
                (self.instance_id,),
            )
        )

    def held_elsewhere(self) -> list[str]:
        """The other proxies that hold sessions live (or resuming) on record."""
        rows = self.db.conn.execute(
            "SELECT DISTINCT instance_id FROM sessions WHERE state IN ('live', 'resuming') AND instance_id != ?",
            (self.instance_id,),
        )
        return [row[0] for row in rows]

    def adopt_orphans(self) -> list[str]:
        """Sessions left ``live``/``resuming`` by proxies that are gone become ``suspended``.

        Their process trees were reaped with their leases at startup; only the
        mapping is left, and it is what makes them resumable.
        """
        rows = self.db.conn.execute(
            """SELECT session_id FROM sessions
               WHERE state IN ('live', 'resuming') AND (instance_id IS NULL OR instance_id != ?)""",
            (self.instance_id,),
        ).fetchall()
        return [row["session_id"] for row in rows if self.take_over_if_orphaned(row["session_id"])]

    def page(
        self, *, cwd: str | None = None, cursor: Cursor | None = None, limit: int | None = None
    ) -> list[SessionRecord]:
        """Listed sessions (all but the deleted), oldest first, after ``cursor``; all of them unless ``limit``."""
        query = "SELECT * FROM sessions WHERE state != 'deleted'"
        args: list[object] = []
        if cwd is not None:
            query += " AND cwd = ?"
            args.append(cwd)
        if cursor is not None:
            query += " AND (created_at, session_id) > (?, ?)"
            args += [cursor.created_at, cursor.session_id]
        query += " ORDER BY created_at, session_id LIMIT ?"
        args.append(-1 if limit is None else limit)
        return [SessionRecord.from_row(row) for row in self.db.conn.execute(query, args)]

    def counts(self) -> dict[str, int]:
        rows = self.db.conn.execute("SELECT state, COUNT(*) FROM sessions GROUP BY state")
        return {state: count for state, count in rows}


# --- reads for the operator: every statement on sessions lives in this module ------------------


def counts_by_state(db: StateDB) -> dict[str, int]:
    """How many sessions the install has in each state."""
    return dict(db.conn.execute("SELECT state, COUNT(*) FROM sessions GROUP BY state").fetchall())


def backends_of_sessions(db: StateDB) -> set[str]:
    """Every backend a session of the install has run on."""
    return {row[0] for row in db.conn.execute("SELECT DISTINCT backend FROM sessions")}


def held(db: StateDB) -> list[tuple[str, str, str, str | None]]:
    """Sessions a proxy holds (live or resuming), most recently active first: id, backend, state, title."""
    return db.conn.execute(
        """SELECT session_id, backend, state, title FROM sessions WHERE state IN ('live', 'resuming')
           ORDER BY last_active_at DESC"""
    ).fetchall()


def ids_matching(db: StateDB, text: str, *, at_most: int = 6) -> list[str]:
    """``text`` if a session has that id, else the ids it begins (at least 4 characters), in order."""
    if db.conn.execute("SELECT 1 FROM sessions WHERE session_id = ?", (text,)).fetchone():
        return [text]
    if len(text) < 4:
        return []
    return [
        row[0]
        for row in db.conn.execute(
            "SELECT session_id FROM sessions WHERE session_id >= ? AND session_id < ? ORDER BY session_id LIMIT ?",
            (text, text + "\U0010ffff", at_most),
        )
    ]


def listed(db: StateDB, states: Sequence[str] = (), *, show_all: bool = False) -> list[SessionRecord]:
    """Sessions in ``states`` (default: all but closed and deleted; ``show_all``: all but deleted), most recent
    first."""
    query = "SELECT * FROM sessions"
    args: list[object] = []
    if states:
        query += f" WHERE state IN ({', '.join('?' * len(states))})"
        args += list(states)
    elif show_all:
        query += " WHERE state != 'deleted'"  # tombstones only when asked for by state
    else:
        query += " WHERE state NOT IN ('closed', 'deleted')"
    query += " ORDER BY last_active_at DESC"
    return [SessionRecord.from_row(row) for row in db.conn.execute(query, args)]


def recent_for_view(db: StateDB, closed_since: float, limit: int) -> list[tuple[Any, ...]]:
    """What ``top`` shows of sessions: all but closed and deleted, and those closed since ``closed_since``
    (wall clock), most recent first: id, backend, state, title, instance, lease, last active."""
    return db.conn.execute(
        """SELECT session_id, backend, state, title, instance_id, lease_id, last_active_at FROM sessions
           WHERE state IN ('live', 'resuming', 'suspended') OR (state = 'closed' AND last_active_at >= ?)
           ORDER BY last_active_at DESC LIMIT ?""",
        (closed_since, limit),
    ).fetchall()


TITLES_AT_ONCE: Final = 500
"""Session ids per ``titles_of`` statement: well under SQLite's limit on bound variables."""


def titles_of(conn: sqlite3.Connection, session_ids: Iterable[str]) -> dict[str, str | None]:
    """The titles of the sessions named (a session with no row is left out): for what reads tasks with them."""
    wanted = sorted(set(session_ids))
    titles: dict[str, str | None] = {}
    for start in range(0, len(wanted), TITLES_AT_ONCE):
        chunk = wanted[start : start + TITLES_AT_ONCE]
        rows = conn.execute(
            f"SELECT session_id, title FROM sessions WHERE session_id IN ({', '.join('?' * len(chunk))})", chunk
        )
        titles.update((row[0], row[1]) for row in rows)
    return titles
