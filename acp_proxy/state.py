"""The state database: one SQLite file per state dir, shared by every proxy of an install.

WAL mode lets readers (the operator CLI) run beside writers (proxies); a busy
timeout serialises concurrent writers instead of failing them; ``BEGIN
IMMEDIATE`` takes the write lock up front so read-modify-write sequences cannot
interleave. The schema carries a version and is brought up to date by ordered
migrations, each in its own transaction. The state dir is created ``0700`` and
the database ``0600``: it names processes and commands, never secrets.

Writes happen at lifecycle events (spawn, close, reap) and a prompt's milestones
(its task created and settled; its progress at most once a second), never per
streamed message. With ``synchronous=NORMAL`` in WAL mode a commit does not wait
for the disk, so they are made directly from the event loop thread; the one slow
part, the WAL checkpoint (an fsync), is moved off it by a serving proxy
(``defer_checkpoints``).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

DB_NAME: Final = "state.db"
BUSY_TIMEOUT_MS: Final = 10_000
DEFERRED_AUTOCHECKPOINT_PAGES: Final = 10_000
"""A backstop: with checkpoints deferred, a commit still checkpoints past this many WAL pages."""

MIGRATIONS: Final[tuple[str, ...]] = (
    # 1: install identity, proxy instances, leases
    """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE instances (
        instance_id TEXT PRIMARY KEY,
        pid INTEGER NOT NULL,
        boot_id TEXT NOT NULL,
        uid INTEGER NOT NULL,
        started_at REAL NOT NULL,
        ended_at REAL,
        end_reason TEXT
    );
    CREATE TABLE leases (
        lease_id TEXT PRIMARY KEY,
        install_id TEXT NOT NULL,
        instance_id TEXT NOT NULL,
        session_key TEXT,
        backend TEXT NOT NULL,
        marker TEXT NOT NULL,
        argv TEXT NOT NULL,
        command_hash TEXT NOT NULL,
        boot_id TEXT NOT NULL,
        uid INTEGER NOT NULL,
        wrapper_pid INTEGER,
        wrapper_start_ticks INTEGER,
        adapter_pid INTEGER,
        adapter_start_ticks INTEGER,
        pgid INTEGER,
        state TEXT NOT NULL CHECK (
            state IN ('starting', 'open', 'closing', 'closed', 'lost', 'unverifiable')
        ),
        reason TEXT,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE INDEX leases_by_instance ON leases (instance_id, state);
    CREATE INDEX leases_by_state ON leases (state);
    """,
    # 2: the session registry (stable ids, what it takes to resume, ownership metadata)
    """
    CREATE TABLE sessions (
        session_id TEXT PRIMARY KEY,
        adapter_session_id TEXT NOT NULL,
        backend TEXT NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('live', 'suspended', 'resuming', 'closed')),
        instance_id TEXT,
        lease_id TEXT,
        cwd TEXT NOT NULL,
        mcp_servers TEXT NOT NULL,
        additional_directories TEXT,
        settings TEXT NOT NULL,
        auth_method TEXT,
        session_key TEXT,
        owner_session_key TEXT,
        spawned_by TEXT,
        parent_session_key TEXT,
        agent_id TEXT,
        history_resets INTEGER NOT NULL DEFAULT 0,
        created_at REAL NOT NULL,
        last_active_at REAL NOT NULL,
        closed_at REAL
    );
    CREATE INDEX sessions_by_state ON sessions (state, backend);
    CREATE INDEX sessions_by_instance ON sessions (instance_id, state);
    """,
    # 3: prompt turns as tasks
    """
    CREATE TABLE tasks (
        task_id TEXT PRIMARY KEY,
        session_id TEXT NOT NULL,
        backend TEXT NOT NULL,
        instance_id TEXT NOT NULL,
        lease_id TEXT,
        request_id TEXT,
        status TEXT NOT NULL CHECK (
            status IN ('queued', 'running', 'done', 'failed', 'cancelled', 'timed_out', 'lost')
        ),
        stop_reason TEXT,
        error TEXT,
        traceparent TEXT,
        prompt TEXT NOT NULL DEFAULT '',
        created_at REAL NOT NULL,
        started_at REAL,
        first_output_at REAL,
        ended_at REAL,
        progress_summary TEXT NOT NULL DEFAULT '',
        update_count INTEGER NOT NULL DEFAULT 0,
        tool_calls INTEGER NOT NULL DEFAULT 0,
        recent_events TEXT NOT NULL DEFAULT '[]',
        events_dropped INTEGER NOT NULL DEFAULT 0,
        updated_at REAL NOT NULL
    );
    CREATE INDEX tasks_by_status ON tasks (status, instance_id);
    CREATE INDEX tasks_by_session ON tasks (session_id, created_at);
    CREATE INDEX tasks_by_created ON tasks (created_at);
    CREATE INDEX tasks_by_end ON tasks (ended_at);
    """,
    # 4: sessions as ACP v1 defines them: closed is restorable, deleted is a tombstone; titles; forks.
    # Before, "closed" meant gone for good (a session/delete the adapter took was recorded so too):
    # those rows become tombstones, so that nothing the gateway deleted comes back into its list.
    """
    CREATE TABLE sessions_v4 (
        session_id TEXT PRIMARY KEY,
        adapter_session_id TEXT NOT NULL,
        backend TEXT NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('live', 'suspended', 'resuming', 'closed', 'deleted')),
        instance_id TEXT,
        lease_id TEXT,
        cwd TEXT NOT NULL,
        mcp_servers TEXT NOT NULL,
        additional_directories TEXT,
        settings TEXT NOT NULL,
        auth_method TEXT,
        session_key TEXT,
        owner_session_key TEXT,
        spawned_by TEXT,
        parent_session_key TEXT,
        agent_id TEXT,
        history_resets INTEGER NOT NULL DEFAULT 0,
        created_at REAL NOT NULL,
        last_active_at REAL NOT NULL,
        closed_at REAL,
        title TEXT,
        title_updated_at TEXT,
        parent_session_id TEXT,
        deleted_at REAL
    );
    INSERT INTO sessions_v4 (session_id, adapter_session_id, backend, state, instance_id, lease_id, cwd,
        mcp_servers, additional_directories, settings, auth_method, session_key, owner_session_key, spawned_by,
        parent_session_key, agent_id, history_resets, created_at, last_active_at, closed_at)
    SELECT session_id, adapter_session_id, backend, state, instance_id, lease_id, cwd, mcp_servers,
        additional_directories, settings, auth_method, session_key, owner_session_key, spawned_by,
        parent_session_key, agent_id, history_resets, created_at, last_active_at, closed_at FROM sessions;
    DROP TABLE sessions;
    ALTER TABLE sessions_v4 RENAME TO sessions;
    UPDATE sessions SET state = 'deleted', deleted_at = COALESCE(closed_at, last_active_at), mcp_servers = '[]',
        settings = '[]' WHERE state = 'closed';
    CREATE INDEX sessions_by_state ON sessions (state, backend);
    CREATE INDEX sessions_by_instance ON sessions (instance_id, state);
    CREATE INDEX sessions_by_deleted ON sessions (deleted_at) WHERE state = 'deleted';
    """,
)
SCHEMA_VERSION: Final = len(MIGRATIONS)


class StateError(Exception):
    """The state dir or database cannot be used; the message says what to do."""


ELSEWHERE: Final = "or point $ACP_PROXY_STATE_DIR (or state_dir in the config) at a directory of your own"


def ensure_private_dir(path: Path) -> None:
    """Create ``path`` (0700) if missing; refuse one that others could write to."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise StateError(f"cannot create {path}: {exc.strerror}; create it yourself (mode 700), {ELSEWHERE}") from None
    check_private_dir(path)


def check_private_dir(path: Path) -> None:
    """Refuse a directory of another user's, or one that others could write to: its contents decide what we signal."""
    info = path.stat()
    if info.st_uid != os.getuid():
        raise StateError(
            f"{path} belongs to uid {info.st_uid}, not to you (uid {os.getuid()}); refusing to use it: {ELSEWHERE}"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise StateError(f"{path} is writable by other users; run: chmod 700 {path}")


def explain_failure(path: Path, exc: sqlite3.Error) -> str:
    """What went wrong with the state database at ``path``, and what to do about it, for people."""
    directory = path.parent
    if not isinstance(exc, sqlite3.OperationalError):
        return f"{path} is not a usable state database ({exc}); move it aside to start afresh (mv {path} {path}.broken)"
    if "full" in str(exc):
        return f"cannot write {path}: {exc}; free some space on the disk holding {directory}"
    for target in (path, directory):
        try:
            info = target.stat()
        except OSError:
            continue
        if info.st_uid != os.getuid():
            return f"cannot use {path} ({exc}): {target} belongs to uid {info.st_uid}, not to you; {ELSEWHERE}"
    beside = "(SQLite writes beside the database)"
    if _read_only_mount(directory):
        return (
            f"cannot use {path} ({exc}): the state dir {directory} is on a read-only file system {beside}; "
            f"mount it read-write, {ELSEWHERE.removeprefix('or ')}"
        )
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        return f"cannot use {path} ({exc}): you may not read and write it; run: chmod 600 {path}"
    if not os.access(directory, os.W_OK | os.X_OK):
        return (
            f"cannot use {path} ({exc}): the state dir {directory} is not writable {beside}; "
            f"run: chmod 700 {directory}, {ELSEWHERE}"
        )
    return f"cannot use {path}: {exc}"


def _read_only_mount(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


class StateDB:
    """A connection to the state database, with the install's identity."""

    def __init__(self, state_dir: Path, *, create: bool = True) -> None:
        self.state_dir = state_dir
        self.path = state_dir / DB_NAME
        self._checkpointer: sqlite3.Connection | None = None
        if create:
            ensure_private_dir(state_dir)
        elif not self.path.exists():
            raise StateError(f"no state database at {self.path}")
        else:
            check_private_dir(state_dir)
        old_umask = os.umask(0o077)
        try:
            self.conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
        except sqlite3.Error as exc:
            raise StateError(explain_failure(self.path, exc)) from None
        finally:
            os.umask(old_umask)
        self.conn.row_factory = sqlite3.Row
        try:
            self.conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            # Changing the journal mode does not wait on the busy handler: when several
            # proxies create the database at once, the losers are told "locked" at once.
            _retry_while_locked(lambda: self.conn.execute("PRAGMA journal_mode = WAL"))
            self.conn.execute("PRAGMA synchronous = NORMAL")
            self._migrate()
            self.install_id = self._install_id()
        except sqlite3.OperationalError as exc:
            self.conn.close()
            if _is_locked(exc):
                raise StateError(
                    f"{self.path} stayed locked for {BUSY_TIMEOUT_MS // 1000} s ({exc}); "
                    "another process holds a long write transaction on it"
                ) from None
            raise StateError(explain_failure(self.path, exc)) from None
        except sqlite3.DatabaseError as exc:
            self.conn.close()
            raise StateError(explain_failure(self.path, exc)) from None

    def close(self) -> None:
        self.conn.close()
        if self._checkpointer is not None:
            self._checkpointer.close()

    def defer_checkpoints(self) -> None:
        """Stop this connection's commits from running WAL checkpoints; ``checkpoint`` does them instead.

        SQLite checkpoints from whichever commit crosses ``wal_autocheckpoint`` pages, and
        a checkpoint (with its fsync) takes milliseconds: a serving proxy's commits run on
        its event loop, so it calls ``checkpoint`` from a worker thread instead. The
        automatic checkpoint is kept, much higher, as a backstop.
        """
        self.conn.execute(f"PRAGMA wal_autocheckpoint = {DEFERRED_AUTOCHECKPOINT_PAGES}")
        self._checkpointer = sqlite3.connect(
            self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False
        )

    def checkpoint(self) -> None:
        """A passive WAL checkpoint on a connection of its own (blocks no reader or writer); any thread."""
        if self._checkpointer is not None:
            self._checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)")

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """A write transaction that holds the database's write lock from its start."""
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.conn
        except BaseException:
            # After some errors (a full disk) SQLite has rolled back already; a ROLLBACK then
            # fails and would hide the error that matters.
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def _migrate(self) -> None:
        with self.transaction() as conn:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StateError(
                    f"{self.path} has schema version {version}, newer than this acp-proxy "
                    f"understands ({SCHEMA_VERSION}); upgrade acp-proxy"
                )
            for number, script in enumerate(MIGRATIONS[version:], start=version + 1):
                for statement in filter(str.strip, script.split(";")):
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {number}")

    def _install_id(self) -> str:
        with self.transaction() as conn:
            conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('install_id', ?)", (os.urandom(8).hex(),))
            return str(conn.execute("SELECT value FROM meta WHERE key = 'install_id'").fetchone()[0])


def now() -> float:
    return time.time()


def _is_locked(exc: sqlite3.OperationalError) -> bool:
    text = str(exc)
    return "locked" in text or "busy" in text


def _retry_while_locked(action: Callable[[], object], timeout: float = BUSY_TIMEOUT_MS / 1000) -> None:
    deadline = time.monotonic() + timeout
    delay = 0.002
    while True:
        try:
            action()
            return
        except sqlite3.OperationalError as exc:
            if not _is_locked(exc) or time.monotonic() >= deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
