"""The install's journal: what happened to its sessions and processes, and how often.

Two tables of the state database, written by every proxy of the install:

* ``events``: one row per lifecycle step an operator wants to see go by (a session
  suspended and why, resumed and how, a start that failed or timed out, trees reaped
  at startup); ``acp-proxy top`` shows the newest. Only the newest ``EVENTS_KEPT`` are
  kept.
* ``counters``: one row per (what, backend, label), counted since the install was
  created, across every proxy that ever ran on it; ``acp-proxy metrics`` exports them
  as Prometheus counters, which therefore never go backwards when a proxy exits.

A record is one queued write (``StateDB.write``): it costs the event loop a queue
append, never a wait, and it lands in the same transaction as the writes queued
beside it. Recording must never disturb what it records: a failed write is logged by
the writer and nothing else happens.
"""

from __future__ import annotations

import enum
import functools
import logging
import sqlite3
from collections.abc import Sequence
from typing import Final

import msgspec

from acp_proxy.state import StateDB, now

log = logging.getLogger("acp_proxy.journal")

EVENTS_KEPT: Final = 5000
"""Events kept in the database; older ones are deleted as new ones come."""
PRUNE_EVERY: Final = 200
"""The events table is trimmed at every this-many-th event of the install (by its row id: a proxy that
records only a few, as one per session does, takes its turn all the same)."""


class Kind(enum.StrEnum):
    """What a record counts; those in ``SHOWN`` also make an event row."""

    ADAPTER_STARTED = "adapter_started"
    """label: how (``warm``: launched with the proxy; ``started``: for a request)"""
    SPAWN_FAILED = "spawn_failed"
    START_TIMEOUT = "start_timeout"
    """label: the request that was not answered in time"""
    SUSPENDED = "suspended"
    """label: the reason (``SuspendReason``)"""
    CRASHED = "crashed"
    """a session's process ended on its own; label: how"""
    RESUMED = "resumed"
    """label: the method that restored it (session/resume, session/load, session/new)"""
    FALLBACK = "fallback"
    """a restore fell back to session/new (the history reset); label: the method that failed"""
    CLOSED = "closed"
    DELETED = "deleted"
    TURN_ENDED = "turn_ended"
    """label: the task's terminal status"""
    TREE_REAPED = "tree_reaped"
    """a process tree reaped; label: when (``stop``: its session or the proxy let it go; ``startup``,
    ``operator``: left by a dead proxy)"""
    LEFTOVERS_KILLED = "leftovers_killed"
    """processes of a tree found alive after its adapter had exited, killed by their marker"""
    UNVERIFIABLE = "unverifiable"
    """a lease whose processes could not be proven gone"""
    POOL_WAIT = "pool_wait"
    """a start that had to wait for a slot (seconds: how long); label: how it ended (``admitted``, ``exhausted``)"""
    EVICT_ASKED = "evict_asked"
    """another proxy of the install was asked to suspend a session for a slot; label: ``yes`` or ``no``"""
    NOTIFY_FAILED = "notify_failed"
    """a task notification not delivered; label: why (``exit``, ``timeout``, ``spawn``, ``dropped``)"""
    ATTACHED = "attached"
    """a client attached to a live session (``session/attach``); label: its role"""
    DETACHED = "detached"
    """an attached client left; label: why (``detached``, ``gone``, ``slow_reader``, ``closed``)"""
    ATTACHED_PROMPT = "attached_prompt"
    """a prompt sent by an attached client"""
    ANSWERED_ELSEWHERE = "answered_elsewhere"
    """a request of the agent's answered by an attached client or an operator, not the gateway; label: its method"""
    HANDOVER = "handover"
    """a session handed between two proxies of the install (seconds: how long it took); label: ``released`` (by
    its holder), ``taken`` (by the proxy that asked), ``kept`` (its holder's turn ran past ``handover_timeout``),
    ``unanswered`` (its holder did not answer)"""


SHOWN: Final = frozenset(
    {
        Kind.SPAWN_FAILED,
        Kind.START_TIMEOUT,
        Kind.SUSPENDED,
        Kind.CRASHED,
        Kind.RESUMED,
        Kind.FALLBACK,
        Kind.CLOSED,
        Kind.DELETED,
        Kind.UNVERIFIABLE,
        Kind.LEFTOVERS_KILLED,
        Kind.ATTACHED,
        Kind.DETACHED,
        Kind.ATTACHED_PROMPT,
        Kind.ANSWERED_ELSEWHERE,
        Kind.HANDOVER,
    }
)
"""Kinds that are shown as events too. A tree reaped at a stop is only counted (the suspension or close
that stopped it is shown); one reaped after a dead proxy is shown as well (``record(..., shown=True)``)."""


class SuspendReason(enum.StrEnum):
    """Why a session was suspended (its tree reaped, the session kept)."""

    IDLE_TTL = "idle_ttl"
    POOL = "pool"
    """a start in this proxy needed its slot (least recently used)"""
    PEER = "peer"
    """another proxy of the install needed its slot"""
    MEMORY = "memory"
    """the install was over its memory budget"""
    OPERATOR = "operator"
    TURN_TIMEOUT = "turn_timeout"
    TURN_IDLE_TIMEOUT = "turn_idle_timeout"
    """its turn was quiet for ``turn_idle_timeout`` and did not end when cancelled"""
    SESSION_MAX_MEMORY = "session_max_memory"
    """its tree was over ``session_max_memory``: recycled (restored on its next request)"""
    SESSION_KILL_MEMORY = "session_kill_memory"
    """its tree grew past ``session_kill_memory`` during a turn: the turn ended, the tree recycled"""
    BROKEN = "broken"
    """its process left a request unanswered past ``start_timeout`` after a restore: not reused"""
    CANCEL_TIMEOUT = "cancel_timeout"
    """its turn was still running ``cancel_timeout`` after ``session/cancel``: answered by the proxy"""
    SHUTDOWN = "shutdown"


class Record(msgspec.Struct, frozen=True):
    kind: Kind
    backend: str
    label: str
    session_id: str | None
    detail: str
    count: int
    seconds: float
    shown: bool


class Journal:
    """Records for one proxy (or one CLI command) of the install."""

    def __init__(self, db: StateDB, instance_id: str | None) -> None:
        self.db = db
        self.instance_id = instance_id

    def record(
        self,
        kind: Kind,
        *,
        backend: str | None = None,
        label: str = "",
        session_id: str | None = None,
        detail: str = "",
        count: int = 1,
        seconds: float = 0.0,
        shown: bool | None = None,
    ) -> None:
        """Count ``kind`` (and show it as an event: if ``shown``, by default if it is one of ``SHOWN``).

        One queued write.
        """
        shown = kind in SHOWN if shown is None else shown
        record = Record(kind, backend or "", str(label), session_id, detail, count, seconds, shown)
        statement = functools.partial(_apply, record, self.instance_id, now())
        # What it records goes on regardless of the database.
        self.db.write_or_log(statement, log, logging.WARNING, "could not record %s in the journal: %s", kind.value)


ADD_COUNT: Final = """INSERT INTO counters (name, backend, label, count, seconds) VALUES (?, ?, ?, ?, ?)
    ON CONFLICT (name, backend, label) DO UPDATE SET
        count = count + excluded.count, seconds = seconds + excluded.seconds"""
"""Adds ``(name, backend, label, count, seconds)`` to a counter, creating it if need be."""


def _apply(record: Record, instance_id: str | None, at: float, conn: sqlite3.Connection) -> None:
    conn.execute(ADD_COUNT, (record.kind.value, record.backend, record.label, record.count, record.seconds))
    if not record.shown:
        return
    event_id = conn.execute(
        """INSERT INTO events (at, instance_id, kind, backend, label, session_id, detail)
           VALUES (?, ?, ?, ?, ?, ?, ?)""",
        (at, instance_id, record.kind.value, record.backend, record.label, record.session_id, record.detail),
    ).lastrowid
    if event_id is not None and event_id % PRUNE_EVERY == 0:
        conn.execute("DELETE FROM events WHERE event_id <= ?", (event_id - EVENTS_KEPT,))


def add_counts(rows: Sequence[tuple[str, str, str, int, float]], conn: sqlite3.Connection) -> None:
    """Add ``(name, backend, label, count, seconds)`` rows to the counters (a statement for the writer)."""
    conn.executemany(ADD_COUNT, rows)


def count_in(conn: sqlite3.Connection, kind: Kind, *, backend: str = "", label: str = "", count: int = 1) -> None:
    """Count inside a transaction the caller already holds (a count that must agree with the write beside it)."""
    conn.execute(
        ADD_COUNT,
        (kind.value, backend, label, count, 0.0),
    )


# --- reading, for the operator ------------------------------------------------------------


class Event(msgspec.Struct, frozen=True):
    event_id: int
    at: float
    instance_id: str | None
    kind: str
    backend: str
    label: str
    session_id: str | None
    detail: str


class Counter(msgspec.Struct, frozen=True):
    name: str
    backend: str
    label: str
    count: int
    seconds: float


def recent_events(
    conn: sqlite3.Connection, limit: int = 50, *, after: int = 0, session_id: str | None = None
) -> list[Event]:
    """The newest events (newest first), or only those after ``after`` (an ``event_id``); of one session, if given."""
    rows = conn.execute(
        """SELECT event_id, at, instance_id, kind, backend, label, session_id, detail FROM events
           WHERE event_id > ? AND (? IS NULL OR session_id = ?) ORDER BY event_id DESC LIMIT ?""",
        (after, session_id, session_id, limit),
    ).fetchall()
    return [Event(*row) for row in rows]


def counters(conn: sqlite3.Connection, names: Sequence[str] | None = None) -> list[Counter]:
    """Every counter of the install (or those of ``names``), sorted."""
    query = "SELECT name, backend, label, count, seconds FROM counters"
    args: tuple[str, ...] = ()
    if names is not None:
        query += f" WHERE name IN ({', '.join('?' for _ in names)})"
        args = tuple(names)
    return [Counter(*row) for row in conn.execute(query + " ORDER BY name, backend, label", args)]
