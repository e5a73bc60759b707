"""Leases: the persisted record of every adapter tree a proxy starts.

A lease is written *before* anything is spawned, so a proxy that dies at any
moment leaves a record for the next one to act on. States:

    starting -> open -> closing -> closed
    (any active state) -> lost          gone before it could be cleaned up
    (any active state) -> unverifiable  ownership could not be proved: left alone, reported

The marker ``ACP_PROXY_LEASE=<install>.<lease>.<random>`` goes into the
wrapper's environment and so into every descendant's; together with start
times it is what lets a later sweep recognise the tree without trusting pids.
"""

from __future__ import annotations

import enum
import json
import os
import sqlite3
import time
from collections.abc import Callable
from typing import Final

import msgspec

from acp_proxy.ownership.verify import Claim
from acp_proxy.state import StateDB, now

MARKER_VARIABLE: Final = "ACP_PROXY_LEASE"


class LeaseState(enum.StrEnum):
    STARTING = "starting"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"
    LOST = "lost"
    UNVERIFIABLE = "unverifiable"


ACTIVE_STATES: Final = (LeaseState.STARTING, LeaseState.OPEN, LeaseState.CLOSING)


class Lease(msgspec.Struct, frozen=True):
    lease_id: str
    install_id: str
    instance_id: str
    session_key: str | None
    backend: str
    marker: str
    argv: tuple[str, ...]
    command_hash: str
    boot_id: str
    uid: int
    wrapper_pid: int | None
    wrapper_start_ticks: int | None
    adapter_pid: int | None
    adapter_start_ticks: int | None
    pgid: int | None
    state: LeaseState
    reason: str | None
    created_at: float
    updated_at: float

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> Lease:
        values = dict(row)
        values["argv"] = tuple(json.loads(values["argv"]))
        values["state"] = LeaseState(values["state"])
        return cls(**values)

    @property
    def marker_key(self) -> str:
        return self.marker.partition("=")[0]

    @property
    def marker_value(self) -> str:
        return self.marker.partition("=")[2]

    def wrapper_claim(self) -> Claim | None:
        if self.wrapper_pid is None or self.wrapper_start_ticks is None:
            return None
        return Claim(self.wrapper_pid, self.boot_id, self.uid, self.marker, start_ticks=self.wrapper_start_ticks)

    def adapter_claim(self) -> Claim | None:
        if self.adapter_pid is None or self.adapter_start_ticks is None:
            return None
        return Claim(self.adapter_pid, self.boot_id, self.uid, self.marker, start_ticks=self.adapter_start_ticks)

    def descendant_claim(self, pid: int) -> Claim:
        """A process found by a marker sweep: ours only if it started no earlier than the wrapper."""
        return Claim(pid, self.boot_id, self.uid, self.marker, not_before_ticks=self.wrapper_start_ticks or 0)


def command_hash(argv: tuple[str, ...]) -> str:
    """A fingerprint of the command, for diagnostics only: never used to decide ownership."""
    import hashlib  # only needed when a lease is written

    return hashlib.sha256(json.dumps(list(argv)).encode()).hexdigest()[:16]


def create_lease(
    db: StateDB,
    *,
    instance_id: str,
    boot_id: str,
    backend: str,
    argv: tuple[str, ...],
    session_key: str | None = None,
) -> Lease:
    """Record a lease in state ``starting``; call before spawning anything.

    The write is made by the state writer, after whatever is queued, and waited for: call it
    from a worker thread when the event loop must not wait (``StateDB.call`` blocks its caller).
    """
    lease_id = os.urandom(6).hex()
    lease = Lease(
        lease_id=lease_id,
        install_id=db.install_id,
        instance_id=instance_id,
        session_key=session_key,
        backend=backend,
        marker=f"{MARKER_VARIABLE}={db.install_id}.{lease_id}.{os.urandom(6).hex()}",
        argv=argv,
        command_hash=command_hash(argv),
        boot_id=boot_id,
        uid=os.getuid(),
        wrapper_pid=None,
        wrapper_start_ticks=None,
        adapter_pid=None,
        adapter_start_ticks=None,
        pgid=None,
        state=LeaseState.STARTING,
        reason=None,
        created_at=now(),
        updated_at=now(),
    )

    def insert(conn: sqlite3.Connection) -> None:
        conn.execute(
            """INSERT INTO leases (lease_id, install_id, instance_id, session_key, backend, marker, argv,
                   command_hash, boot_id, uid, state, created_at, updated_at)
               VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'starting', ?, ?)""",
            (
                lease.lease_id,
                lease.install_id,
                lease.instance_id,
                lease.session_key,
                lease.backend,
                lease.marker,
                json.dumps(list(lease.argv)),
                lease.command_hash,
                lease.boot_id,
                lease.uid,
                lease.created_at,
                lease.updated_at,
            ),
        )

    db.call(insert)
    return lease


def get_lease(db: StateDB, lease_id: str) -> Lease:
    row = db.conn.execute("SELECT * FROM leases WHERE lease_id = ?", (lease_id,)).fetchone()
    if row is None:
        raise KeyError(lease_id)
    return Lease.from_row(row)


def spawned(lease: Lease) -> Callable[[sqlite3.Connection], None]:
    """The write that records ``lease``'s process identities as far as they are known (the wrapper
    first, then the adapter): for ``StateDB.call``, ``run`` or ``write``."""
    identities = (
        lease.wrapper_pid,
        lease.wrapper_start_ticks,
        lease.adapter_pid,
        lease.adapter_start_ticks,
        lease.pgid,
    )

    def update(conn: sqlite3.Connection) -> None:
        conn.execute(
            """UPDATE leases SET wrapper_pid = COALESCE(?, wrapper_pid),
                   wrapper_start_ticks = COALESCE(?, wrapper_start_ticks),
                   adapter_pid = COALESCE(?, adapter_pid), adapter_start_ticks = COALESCE(?, adapter_start_ticks),
                   pgid = COALESCE(?, pgid), updated_at = ?
               WHERE lease_id = ?""",
            (*identities, now(), lease.lease_id),
        )

    return update


# Which states a lease may move to ``state`` from: forward only, and a final state is final.
_ALLOWED_FROM: Final[dict[LeaseState, tuple[LeaseState, ...]]] = {
    LeaseState.STARTING: (),
    LeaseState.OPEN: (LeaseState.STARTING,),
    LeaseState.CLOSING: (LeaseState.STARTING, LeaseState.OPEN),
    LeaseState.CLOSED: ACTIVE_STATES,
    LeaseState.LOST: ACTIVE_STATES,
    LeaseState.UNVERIFIABLE: ACTIVE_STATES,
}


def moved_to(lease_id: str, state: LeaseState, reason: str | None = None) -> Callable[[sqlite3.Connection], bool]:
    """The write that moves a lease to ``state`` if the state machine allows it (True), else nothing (False):
    for ``StateDB.call``, ``run`` or ``write``."""
    sources = _ALLOWED_FROM[state]
    marks = ", ".join("?" * len(sources))

    def update(conn: sqlite3.Connection) -> bool:
        if not sources:
            return False
        cursor = conn.execute(
            f"""UPDATE leases SET state = ?, reason = COALESCE(?, reason), updated_at = ?
                WHERE lease_id = ? AND state IN ({marks})""",
            (state.value, reason, now(), lease_id, *(source.value for source in sources)),
        )
        return cursor.rowcount == 1

    return update


def set_state(db: StateDB, lease_id: str, state: LeaseState, reason: str | None = None) -> bool:
    """Move a lease to ``state`` if the state machine allows it; False when it does not (nothing written).
    Waits for the write (see ``create_lease``)."""
    return db.call(moved_to(lease_id, state, reason))


def leases_of_instance(db: StateDB, instance_id: str, *, active_only: bool = True) -> list[Lease]:
    query = "SELECT * FROM leases WHERE instance_id = ?"
    if active_only:
        query += " AND state IN ('starting', 'open', 'closing')"
    return [Lease.from_row(row) for row in db.conn.execute(query + " ORDER BY created_at", (instance_id,))]


def prune_ended(db: StateDB, retention: float, *, at: float | None = None) -> int:
    """Delete ``closed`` and ``lost`` leases last changed more than ``retention`` seconds ago; idempotent.

    Every adapter process started leaves a lease row, so a busy install would grow its
    database without end. ``unverifiable`` leases stay: each names processes an operator
    still has to look at.
    """
    cutoff = (time.time() if at is None else at) - retention

    def delete(conn: sqlite3.Connection) -> int:
        return conn.execute(
            "DELETE FROM leases WHERE state IN ('closed', 'lost') AND updated_at < ?", (cutoff,)
        ).rowcount

    return db.call(delete)  # on the state writer's thread, after every write queued before it


def last_command_of(db: StateDB, backend: str) -> tuple[str, ...] | None:
    """The command (argv template) the newest lease of ``backend`` ran, if the install still has one."""
    row = db.conn.execute(
        "SELECT argv FROM leases WHERE backend = ? ORDER BY created_at DESC LIMIT 1", (backend,)
    ).fetchone()
    return None if row is None else tuple(json.loads(row[0]))


def counts_by_state(db: StateDB) -> dict[str, int]:
    """How many leases the install has in each state."""
    return dict(db.conn.execute("SELECT state, COUNT(*) FROM leases GROUP BY state").fetchall())


def active_leases(db: StateDB) -> list[Lease]:
    """Every lease whose processes may be running (``ACTIVE_STATES``), of any instance."""
    states = [state.value for state in ACTIVE_STATES]
    rows = db.conn.execute(f"SELECT * FROM leases WHERE state IN ({', '.join('?' * len(states))})", states)
    return [Lease.from_row(row) for row in rows.fetchall()]


def all_leases(db: StateDB, *, limit: int = 200) -> list[Lease]:
    """Active leases first, then the most recent others."""
    rows = db.conn.execute(
        """SELECT * FROM leases ORDER BY state NOT IN ('starting', 'open', 'closing'), updated_at DESC LIMIT ?""",
        (limit,),
    )
    return [Lease.from_row(row) for row in rows]
