"""What the install has learned about each backend, kept in the state database for every proxy of it.

A fact is a (backend, name) -> text row of ``backend_facts``. A proxy learns them as it works and
a fresh proxy of the install starts from them, rather than each proxy (one per session, under
acpx or openab) paying to learn them again:

* ``restore_method``: the restore method (``session/resume``, ``session/load``) that last restored
  a session of the backend, tried first next time;
* ``unsupported:<method>``: a restore method the backend advertised but refused as unsupported
  (-32601), never tried again while the backend's command is the same;
* ``peak_memory``: the largest tree (bytes) the backend has had, which a start counts for a tree
  not yet measured.

Facts are tied to the backend's command (``command_hash``): a different adapter, or another version
of it launched from another path, starts from nothing. Writes are queued (``StateDB.write``), never
waited for: a fact lost with a killed proxy is learned again.
"""

from __future__ import annotations

import logging
import sqlite3
from typing import Final

import msgspec

from acp_proxy.config import BackendConfig
from acp_proxy.ownership.leases import command_hash
from acp_proxy.state import StateDB, now

log = logging.getLogger("acp_proxy.pool.learned")

RESTORE_METHOD: Final = "restore_method"
PEAK_MEMORY: Final = "peak_memory"
COMMAND: Final = "command"
UNSUPPORTED_PREFIX: Final = "unsupported:"


def command_of(backend: BackendConfig) -> str:
    """The hash a lease records of ``backend``'s command: what the install's facts of it are kept under."""
    return command_hash(tuple(backend.command))


class BackendFacts(msgspec.Struct, frozen=True):
    """What is known of one backend; empty for one never seen."""

    restore_method: str | None = None
    unsupported: frozenset[str] = frozenset()
    peak_memory: int = 0


def read_facts(conn: sqlite3.Connection, backend: str, command_hash: str) -> BackendFacts:
    """The backend's facts, or none if they were learned under another command."""
    rows = dict(conn.execute("SELECT fact, value FROM backend_facts WHERE backend = ?", (backend,)).fetchall())
    if rows.get(COMMAND) != command_hash:
        return BackendFacts()
    peak = rows.get(PEAK_MEMORY, "0")
    return BackendFacts(
        restore_method=rows.get(RESTORE_METHOD),
        unsupported=frozenset(
            fact.removeprefix(UNSUPPORTED_PREFIX) for fact in rows if fact.startswith(UNSUPPORTED_PREFIX)
        ),
        peak_memory=int(peak) if peak.isdigit() else 0,
    )


def all_peaks(conn: sqlite3.Connection) -> dict[str, int]:
    """The largest tree of every backend the install has measured, by backend name."""
    return {
        backend: int(value)
        for backend, value in conn.execute("SELECT backend, value FROM backend_facts WHERE fact = ?", (PEAK_MEMORY,))
        if str(value).isdigit()
    }


class Learned:
    """One proxy's reader and writer of the install's backend facts."""

    def __init__(self, db: StateDB) -> None:
        self.db = db

    def facts(self, backend: str, command_hash: str) -> BackendFacts:
        try:
            return read_facts(self.db.conn, backend, command_hash)
        except sqlite3.Error as exc:
            log.warning("could not read what the install knows of backend %s: %s", backend, exc)
            return BackendFacts()

    def restored_with(self, backend: str, command_hash: str, method: str) -> None:
        """``method`` restored a session of the backend: try it first next time."""
        self._write(backend, command_hash, {RESTORE_METHOD: method})

    def unsupported(self, backend: str, command_hash: str, method: str) -> None:
        """The backend refused ``method`` as unsupported although it advertised it: never try it again."""
        self._write(backend, command_hash, {UNSUPPORTED_PREFIX + method: "1"})

    def peak(self, backend: str, command_hash: str, size: int) -> None:
        """A tree of the backend measured ``size`` bytes: the peak is raised to it if it is larger."""
        self._write(backend, command_hash, {}, peak=size)

    def _write(self, backend: str, command_hash: str, facts: dict[str, str], *, peak: int | None = None) -> None:
        at = now()

        def apply(conn: sqlite3.Connection) -> None:
            current = conn.execute(
                "SELECT value FROM backend_facts WHERE backend = ? AND fact = ?", (backend, COMMAND)
            ).fetchone()
            if current is None or current[0] != command_hash:
                # Another command under this name: what was learned of the old one no longer holds.
                conn.execute("DELETE FROM backend_facts WHERE backend = ?", (backend,))
                facts_now = {COMMAND: command_hash, **facts}
            else:
                facts_now = facts
            for fact, value in facts_now.items():
                conn.execute(
                    """INSERT INTO backend_facts (backend, fact, value, updated_at) VALUES (?, ?, ?, ?)
                       ON CONFLICT (backend, fact) DO UPDATE SET value = excluded.value,
                           updated_at = excluded.updated_at""",
                    (backend, fact, value, at),
                )
            if peak is not None:
                conn.execute(
                    """INSERT INTO backend_facts (backend, fact, value, updated_at) VALUES (?, ?, ?, ?)
                       ON CONFLICT (backend, fact) DO UPDATE SET
                           value = MAX(CAST(value AS INTEGER), CAST(excluded.value AS INTEGER)),
                           updated_at = excluded.updated_at""",
                    (backend, PEAK_MEMORY, str(peak), at),
                )

        # The proxy goes on without the fact.
        self.db.write_or_log(
            apply, log, logging.WARNING, "could not record what was learned of backend %s: %s", backend
        )
