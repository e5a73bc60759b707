"""The state database's schema: ordered migrations, each in its own transaction, and its version.

A database records its schema version (``PRAGMA user_version``) and the release that last
migrated it (``releases.WRITTEN_BY_KEY``); ``StateDB`` brings it up to ``SCHEMA_VERSION`` when it
opens it, and refuses one a newer release has written.
"""

from __future__ import annotations

import sqlite3
from typing import Final

from acp_proxy import releases

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
    # 5: the install's journal (recent events, counters since the install was created: acp_proxy.journal),
    # and a task's own notification policy (NULL: the config's [tasks] notify).
    """
    CREATE TABLE events (
        event_id INTEGER PRIMARY KEY AUTOINCREMENT,
        at REAL NOT NULL,
        instance_id TEXT,
        kind TEXT NOT NULL,
        backend TEXT NOT NULL DEFAULT '',
        label TEXT NOT NULL DEFAULT '',
        session_id TEXT,
        detail TEXT NOT NULL DEFAULT ''
    );
    CREATE TABLE counters (
        name TEXT NOT NULL,
        backend TEXT NOT NULL DEFAULT '',
        label TEXT NOT NULL DEFAULT '',
        count INTEGER NOT NULL DEFAULT 0,
        seconds REAL NOT NULL DEFAULT 0,
        PRIMARY KEY (name, backend, label)
    ) WITHOUT ROWID;
    ALTER TABLE tasks ADD COLUMN notify TEXT;
    """,
    # 6: what the install has learned about each backend (acp_proxy.pool.learned): the restore method
    # that worked and those refused as unsupported, the largest tree it has had.
    """
    CREATE TABLE backend_facts (
        backend TEXT NOT NULL,
        fact TEXT NOT NULL,
        value TEXT NOT NULL,
        updated_at REAL NOT NULL,
        PRIMARY KEY (backend, fact)
    ) WITHOUT ROWID;
    """,
    # 7: a prompt's operation id (a client's retry of it is answered, not run again) and the answer it got.
    """
    ALTER TABLE tasks ADD COLUMN operation_id TEXT;
    ALTER TABLE tasks ADD COLUMN answer TEXT;
    CREATE INDEX tasks_by_operation ON tasks (session_id, operation_id) WHERE operation_id IS NOT NULL;
    """,
)
SCHEMA_VERSION: Final = len(MIGRATIONS)


def schema_written_by(conn: sqlite3.Connection) -> str | None:
    """The release that last migrated the database, if it recorded itself (releases since 0.7.0 do)."""
    try:
        row = conn.execute("SELECT value FROM meta WHERE key = ?", (releases.WRITTEN_BY_KEY,)).fetchone()
    except sqlite3.Error:  # no meta table: a database no migration has finished
        return None
    return str(row[0]) if row else None
