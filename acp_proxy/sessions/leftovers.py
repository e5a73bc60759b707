"""What the install's dead proxies left, cleared while this proxy runs, not only when one starts.

A proxy that starts clears what the install's dead proxies left: it reaps their process trees and
removes their cgroups (``Owner.start``), marks their unfinished tasks ``lost``
(``TurnBook.maintain``) and suspends the sessions they left live
(``SessionRegistry.adopt_orphans``). A long-lived proxy (an editor's) is
often the only one of its install for days, so every ``[ownership] reap_interval`` it also looks
whether a proxy of the install has died since: one query per table and a ``flock`` probe per
proxy found, on the event loop (``dead_proxies``). Only when one has does it clear what that
proxy left, the same three ways, in a worker thread with a database connection of its own
(``clear``): reaping waits out the graces of what it stops, and a shutdown waits for it.
"""

from __future__ import annotations

import functools
import logging
import sqlite3
from pathlib import Path

import anyio
import msgspec

from acp_proxy.concurrency import Stopping
from acp_proxy.ownership import cgroups, instances
from acp_proxy.ownership.owner import Owner, log_reaped
from acp_proxy.ownership.proctable import ProcessTable
from acp_proxy.ownership.reaping import ReapAction, reap_dead_instances
from acp_proxy.sessions.registry import SessionRegistry, titles_of
from acp_proxy.state import StateDB
from acp_proxy.state.connection import StateError
from acp_proxy.tasks.notify import Notifier
from acp_proxy.tasks.records import Swept, sweep_lost, unfinished_by

log = logging.getLogger("acp_proxy.proxy")


class Cleared(msgspec.Struct, frozen=True):
    """What one clearing did."""

    reaped: list[ReapAction]
    """The dead proxies' leases and what became of each (their trees)."""
    lost: list[Swept]
    """Their unfinished tasks, now ``lost``."""
    suspended: list[str]
    """The sessions they left live, now suspended (resumable)."""


def dead_proxies(db: StateDB, own_instance: str) -> list[str]:
    """The install's proxies that are gone and left something behind: an instance not ended, an
    unfinished task, a live session, a cgroup. Cheap enough for the event loop: reads, a directory
    listing and lock probes only."""
    candidates = {
        *instances.other_instances(db, own_instance),
        *(found for found in cgroups.recorded_instances(db.state_dir) if found != own_instance),
        *unfinished_by(db, own_instance),
        *SessionRegistry(db, own_instance).held_elsewhere(),
    }
    return sorted(instance for instance in candidates if not instances.instance_alive(db, instance))


def clear(state_dir: Path, own_instance: str, *, grace: float, table: ProcessTable) -> Cleared:
    """Reap the dead proxies' trees, mark their tasks lost, suspend their live sessions: in the
    calling (worker) thread, on a database connection of its own."""
    db = StateDB(state_dir)
    try:
        reaped = reap_dead_instances(db, own_instance, grace=grace, table=table, when="periodic")
        lost: list[Swept] = []
        sweep_lost(db, own_instance, lost.append, titles_of)
        suspended = SessionRegistry(db, own_instance).adopt_orphans()
        return Cleared(reaped, lost, suspended)
    finally:
        db.close()


async def clear_periodically(
    owner: Owner, interval: float, grace: float, stopping: Stopping, notifier: Notifier | None
) -> None:
    """Every ``interval`` seconds, clear what proxies of the install that died since left (``interval`` > 0)."""
    while True:
        await anyio.sleep(interval)
        if stopping.begun:
            return
        try:
            dead = dead_proxies(owner.db, owner.instance_id)
            if not dead:
                continue
            log.info("proxies of this install are gone: %s; clearing what they left", ", ".join(dead))
            cleared = await anyio.to_thread.run_sync(
                functools.partial(clear, owner.db.state_dir, owner.instance_id, grace=grace, table=owner.table)
            )
        except (sqlite3.Error, StateError, OSError) as exc:
            log.error("clearing what dead proxies left failed (tried again in %gs): %s", interval, exc)
            continue
        log_reaped(cleared.reaped, "periodic reaping")
        for session_id in cleared.suspended:
            log.info("session %s: left live by a proxy that is gone; suspended, resumable", session_id)
        if cleared.lost:
            log.warning("%d task(s) of proxies that ended without recording an outcome marked lost", len(cleared.lost))
        if notifier is not None:
            for task in cleared.lost:
                notifier.swept(task)
