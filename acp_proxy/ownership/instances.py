"""Proxy instances and their liveness locks.

Each running proxy holds an exclusive ``flock`` on ``instances/<instance_id>.lock``
for its whole life. The kernel drops the lock when the process dies, however it
dies, so "can I take this lock?" is an exact liveness test that no pid reuse can
fool. The lock's descriptor is close-on-exec: adapters must not inherit it, or
a dead proxy would look alive for as long as its orphans run.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec

from acp_proxy.state import StateDB, now
from acp_proxy.state.directory import ensure_private_dir


class Instance(msgspec.Struct):
    instance_id: str
    lock_fd: int
    boot_id: str


def instances_dir(db: StateDB) -> Path:
    return db.state_dir / "instances"


def lock_path(db: StateDB, instance_id: str) -> Path:
    return instances_dir(db) / f"{instance_id}.lock"


def _open_lock(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


def start_instance(db: StateDB, boot_id: str) -> Instance:
    """Register this process as a live instance and take its lock for life."""
    ensure_private_dir(instances_dir(db))
    instance_id = os.urandom(6).hex()
    fd = _open_lock(lock_path(db, instance_id))
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with db.transaction() as conn:
        conn.execute(
            "INSERT INTO instances (instance_id, pid, boot_id, uid, started_at) VALUES (?, ?, ?, ?, ?)",
            (instance_id, os.getpid(), boot_id, os.getuid(), now()),
        )
    return Instance(instance_id, fd, boot_id)


def end_instance(db: StateDB, instance: Instance, reason: str = "exited") -> None:
    """Mark the instance ended and release its lock (last thing a proxy does).

    An instance that still has active leases (it is exiting on an error path) is not
    marked ended: its lock is released, so the next proxy sees it dead and reaps them.
    """
    with db.transaction() as conn:
        conn.execute(
            """UPDATE instances SET ended_at = ?, end_reason = ? WHERE instance_id = ? AND NOT EXISTS (
                   SELECT 1 FROM leases WHERE instance_id = ? AND state IN ('starting', 'open', 'closing'))""",
            (now(), reason, instance.instance_id, instance.instance_id),
        )
    lock_path(db, instance.instance_id).unlink(missing_ok=True)  # a missing lock file also means dead
    os.close(instance.lock_fd)


def instance_alive(db: StateDB, instance_id: str) -> bool:
    """True if the instance's lock is held (by a live proxy).

    Probed with a shared lock: a live proxy's exclusive lock refuses it, but two proxies
    probing the same dead instance at once do not (an exclusive probe would make one of them
    read the other's probe as a live proxy). Only the proxy itself ever holds it exclusively:
    a reaper holds a lock of its own (``lock_if_dead``), so a dead instance reads as dead for
    as long as it is reaped too.
    """
    return locked(lock_path(db, instance_id)) is True  # no lock file: nobody can be holding it


def locked(path: Path) -> bool | None:
    """Whether someone holds ``path``'s ``flock`` exclusively (``None``: there is no such file).

    A shared probe: it never makes another prober (or taker) see the file as locked by it
    for longer than the probe, and two probes never disturb each other.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock we got
    return False


def reaping_path(db: StateDB, instance_id: str) -> Path:
    return instances_dir(db) / f"{instance_id}.reaping"


@contextmanager
def lock_if_dead(db: StateDB, instance_id: str) -> Iterator[bool]:
    """The right to reap a dead instance, held for the block (``True``); ``False`` if it is alive, or
    another reaper holds that right.

    The right is a lock of its own (``<id>.reaping``), never the instance's: a reaper that took
    the dead instance's lock would make it read as alive (``instance_alive``) for as long as it
    reaps, which may be seconds (a tree's graces), and meanwhile another proxy would refuse to
    take over its sessions (``session_in_use``) and count its slots as held. An instance found
    dead stays dead (its id is never used again), so the check and the lock need not be one step.
    """
    if instance_alive(db, instance_id):
        yield False
        return
    fd = os.open(reaping_path(db, instance_id), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False  # another proxy is reaping it
            return
        yield True
    finally:
        os.close(fd)


def unended(db: StateDB) -> list[tuple[str, int, float]]:
    """Every instance not recorded as ended (alive, or dead and not yet reaped), oldest first: id, pid, start."""
    return db.conn.execute(
        "SELECT instance_id, pid, started_at FROM instances WHERE ended_at IS NULL ORDER BY started_at"
    ).fetchall()


def other_instances(db: StateDB, own_id: str | None) -> list[str]:
    """Instances of this install that have not been marked ended, except ``own_id``."""
    rows = db.conn.execute(
        "SELECT instance_id FROM instances WHERE ended_at IS NULL AND instance_id != ?", (own_id or "",)
    )
    return [row[0] for row in rows]


def mark_reaped(db: StateDB, instance_id: str) -> None:
    with db.transaction() as conn:
        conn.execute(
            "UPDATE instances SET ended_at = ?, end_reason = 'reaped' WHERE instance_id = ? AND ended_at IS NULL",
            (now(), instance_id),
        )
    lock_path(db, instance_id).unlink(missing_ok=True)
    reaping_path(db, instance_id).unlink(missing_ok=True)  # a reaper that opens it afresh finds nothing left to reap
