"""Cleaning up after leases: marker sweeps, reaping one lease, reaping dead instances.

Everything here acts only through ``send_verified_signal``, and through ``cgroup.kill``
on the cgroups a dead instance of this install recorded making (``cgroups``). A lease ends as

* ``closed``: its tree is verifiably gone and it ended under control: its wrapper
  left a tombstone (written only once the tree was empty), or we killed what was
  left and a final sweep found nothing carrying the marker;
* ``lost``: it was gone before anyone could clean it up (another boot, the
  wrapper's pid now names someone else, or nothing was left and no tombstone);
* ``unverifiable``: something could not be proved ours (or could not be killed);
  it is left alone and reported with the reason.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import time
from pathlib import Path
from typing import Final

import msgspec

from acp_proxy.journal import Journal, Kind
from acp_proxy.ownership import cgroups, instances
from acp_proxy.ownership.cgroups import InstanceCgroup
from acp_proxy.ownership.leases import Lease, LeaseState, leases_of_instance, set_state
from acp_proxy.ownership.proctable import ProcessTable, TableUnavailable
from acp_proxy.ownership.verify import Claim, Verdict, check_claim, process_table, send_verified_signal
from acp_proxy.state import StateDB
from acp_proxy.state.directory import ensure_private_dir

log = logging.getLogger("acp_proxy.ownership")

POLL_INTERVAL: Final = 0.02
SWEEP_ROUNDS: Final = 10


class ReapAction(msgspec.Struct):
    """What was (or, in a dry run, would be) done about one lease."""

    lease_id: str
    instance_id: str
    backend: str
    before: str
    after: str
    reason: str = ""
    signalled: list[int] = msgspec.field(default_factory=list)
    refused: list[str] = msgspec.field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        return {
            "lease": self.lease_id,
            "instance": self.instance_id,
            "backend": self.backend,
            "before": self.before,
            "after": self.after,
            "reason": self.reason,
            "signalled": self.signalled,
            "refused": self.refused,
        }


def tombstone_path(db: StateDB, lease_id: str) -> Path:
    return db.state_dir / "leases" / f"{lease_id}.exited"


def prepare_tombstone(db: StateDB, lease_id: str) -> Path:
    ensure_private_dir(db.state_dir / "leases")
    return tombstone_path(db, lease_id)


def read_tombstone(db: StateDB, lease_id: str) -> dict[str, object] | None:
    try:
        value = json.loads(tombstone_path(db, lease_id).read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def forget_tombstone(db: StateDB, lease_id: str) -> None:
    with contextlib.suppress(OSError):
        tombstone_path(db, lease_id).unlink()


def marked_pids(lease: Lease, table: ProcessTable) -> list[int]:
    """Every process whose environment carries the lease's exact marker."""
    return [pid for pid in table.pids() if table.environ_has(pid, lease.marker)]


def marker_index(table: ProcessTable) -> dict[str, list[int]]:
    """Every process carrying any lease marker, by marker: one pass over the process table.

    Reaping many leases at once reads each process's environment once, not once per lease.
    The index only says where to look; every signal is still verified on its own.
    """
    index: dict[str, list[int]] = {}
    for pid in table.pids():
        marker = table.lease_marker(pid)
        if marker is not None:
            index.setdefault(marker, []).append(pid)
    return index


class SweepResult(msgspec.Struct):
    signalled: list[int] = msgspec.field(default_factory=list)
    refused: list[str] = msgspec.field(default_factory=list)
    remaining: list[int] = msgspec.field(default_factory=list)
    unverifiable: str = ""


def sweep(
    lease: Lease, table: ProcessTable, *, dry_run: bool = False, index: dict[str, list[int]] | None = None
) -> SweepResult:
    """SIGKILL every verified process carrying the marker, until none is left (bounded).

    ``index`` (from ``marker_index``) stands in for the first scan of the process
    table; after anything was killed, the table is scanned again in full, since a
    dying tree may have forked. A process that could not be verified only makes the
    result unverifiable if it is still alive at the end: one caught mid-exit (its
    environment briefly unreadable) proves nothing either way.
    """
    result = SweepResult()
    doubtful: dict[int, str] = {}
    try:
        for round_number in range(SWEEP_ROUNDS):
            if round_number == 0 and index is not None:
                targets = list(index.get(lease.marker, []))
            else:
                targets = marked_pids(lease, table)
            if not targets:
                break
            progress = False
            for pid in targets:
                claim = lease.descendant_claim(pid)
                outcome = check_claim(claim, table) if dry_run else send_verified_signal(claim, signal.SIGKILL, table)
                if outcome.signalled or (dry_run and outcome.verdict is Verdict.OURS):
                    result.signalled.append(pid)
                    progress = True
                elif outcome.verdict is Verdict.UNVERIFIABLE:
                    doubtful[pid] = outcome.reason
                elif outcome.verdict is Verdict.NOT_OURS:
                    result.refused.append(f"pid {pid}: {outcome.reason}")
            if dry_run:
                result.remaining = targets
                break
            time.sleep(POLL_INTERVAL if progress else POLL_INTERVAL * 5)
        else:
            result.remaining = marked_pids(lease, table)
        for pid, reason in doubtful.items():
            info = table.info(pid)
            if info is not None and not info.zombie:
                result.refused.append(f"pid {pid}: {reason}")
                result.unverifiable = reason
    except TableUnavailable as exc:
        result.unverifiable = str(exc)
    return result


def wait_gone(claim: Claim | None, timeout: float, table: ProcessTable) -> Verdict:
    """Poll until ``claim`` no longer names a live process of ours, or ``timeout`` passes."""
    if claim is None:
        return Verdict.GONE
    deadline = time.monotonic() + timeout
    while True:
        verdict = check_claim(claim, table).verdict
        if verdict is not Verdict.OURS or time.monotonic() >= deadline:
            return verdict
        time.sleep(POLL_INTERVAL)


def reap_lease(
    db: StateDB,
    lease: Lease,
    *,
    grace: float,
    table: ProcessTable | None = None,
    dry_run: bool = False,
    index: dict[str, list[int]] | None = None,
    cgroup: InstanceCgroup | None = None,
) -> ReapAction:
    """Make sure nothing of a dead instance's lease survives, then record how it ended.

    ``cgroup``: the dead instance's, if it had one: after the grace, whatever is left in the
    lease's cgroup is killed with one ``cgroup.kill`` and the cgroup removed.
    """
    table = table or process_table()
    action = ReapAction(lease.lease_id, lease.instance_id, lease.backend, lease.state.value, lease.state.value)

    def finish(state: LeaseState, reason: str) -> ReapAction:
        action.after, action.reason = state.value, reason
        if not dry_run:
            set_state(db, lease.lease_id, state, reason)
            forget_tombstone(db, lease.lease_id)
        return action

    try:
        current_boot = table.boot_id()
    except TableUnavailable as exc:
        return finish(LeaseState.UNVERIFIABLE, str(exc))
    if lease.boot_id != current_boot:
        return finish(LeaseState.LOST, "recorded during another boot")
    wrapper = lease.wrapper_claim()
    if dry_run:
        verdict = check_claim(wrapper, table).verdict if wrapper else Verdict.GONE
    else:
        # The wrapper saw its lifeline close and is tearing its tree down: give it the grace.
        verdict = wait_gone(wrapper, grace, table)
    if cgroup is not None:
        cleared = cgroup.clear_tree(lease.lease_id, dry_run=dry_run)
        action.signalled += cleared.killed
        if cleared.error or cleared.remaining:
            action.refused.append(cleared.error or f"processes in its cgroup survived cgroup.kill: {cleared.remaining}")
            return finish(LeaseState.UNVERIFIABLE, action.refused[-1])
    for claim in (wrapper, lease.adapter_claim()):
        if claim is None:
            continue
        outcome = check_claim(claim, table) if dry_run else send_verified_signal(claim, signal.SIGKILL, table)
        if outcome.verdict is Verdict.OURS:
            if claim.pid not in action.signalled:  # a dry run has counted its cgroup's members already
                action.signalled.append(claim.pid)
        elif outcome.verdict is Verdict.UNVERIFIABLE:
            action.refused.append(f"pid {claim.pid}: {outcome.reason}")
    swept = sweep(lease, table, dry_run=dry_run, index=None if action.signalled else index)
    action.signalled += [pid for pid in swept.signalled if pid not in action.signalled]
    action.refused += swept.refused
    if swept.unverifiable or verdict is Verdict.UNVERIFIABLE:
        return finish(LeaseState.UNVERIFIABLE, swept.unverifiable or "could not verify the wrapper")
    if swept.remaining and not dry_run:
        return finish(LeaseState.UNVERIFIABLE, f"processes carrying the marker survived: {swept.remaining}")
    if action.signalled:
        return finish(LeaseState.CLOSED, "reaped after its proxy died")
    if read_tombstone(db, lease.lease_id) is not None:
        return finish(LeaseState.CLOSED, "its wrapper tore the tree down after its proxy died")
    if verdict is Verdict.NOT_OURS:
        return finish(LeaseState.LOST, "its wrapper's pid now belongs to another process")
    return finish(LeaseState.LOST, "gone before cleanup")


def reap_dead_instances(
    db: StateDB,
    own_instance_id: str | None,
    *,
    grace: float,
    table: ProcessTable | None = None,
    dry_run: bool = False,
    when: str | None = None,
) -> list[ReapAction]:
    """Reap the active leases of every dead instance of this install.

    ``when`` labels the reaping in the journal: ``startup`` (a proxy's own, the default when it
    names itself), ``periodic`` (a running proxy's) or ``operator`` (``acp-proxy reap``).

    An instance is dead when its lock can be taken. Its reaper holds the right to reap it
    (``instances.lock_if_dead``) while its leases are reaped, so two proxies starting together
    never reap the same one. An instance whose lock is held is alive and is never touched.

    A dead instance that recorded a cgroup (``cgroups``) has it cleared and removed too, after its
    leases, even if it had ended (an instance that could not remove its cgroup when it exited).
    """
    actions: list[ReapAction] = []
    index: dict[str, list[int]] | None = None
    own = own_instance_id or ""
    candidates = instances.other_instances(db, own_instance_id)
    candidates += [found for found in cgroups.recorded_instances(db.state_dir) if found not in (own, *candidates)]
    for instance_id in candidates:
        with instances.lock_if_dead(db, instance_id) as dead:
            if not dead:
                continue
            cgroup = cgroups.recorded_instance_cgroup(db.state_dir, db.install_id, instance_id)
            for lease in leases_of_instance(db, instance_id):
                if index is None:
                    try:
                        index = marker_index(table or process_table())
                    except TableUnavailable:
                        index = None  # each lease then finds out, and says so
                actions.append(
                    reap_lease(db, lease, grace=grace, table=table, dry_run=dry_run, index=index, cgroup=cgroup)
                )
            if not dry_run:
                remove_instance_cgroup(db, instance_id, cgroup)
                instances.mark_reaped(db, instance_id)
            else:  # nothing was done: leave no trace of the look
                instances.reaping_path(db, instance_id).unlink(missing_ok=True)
    if not dry_run:
        label = when or ("startup" if own_instance_id else "operator")
        _journal_reaping(Journal(db, own_instance_id), actions, label)
    return actions


def remove_instance_cgroup(db: StateDB, instance_id: str, cgroup: InstanceCgroup | None) -> None:
    """A dead instance's cgroup, and what is left under it (trees of leases already settled), then its record.

    A record that names nothing this install can have made is dropped, never acted on. A cgroup
    that cannot be removed keeps its record: the next reaping tries again.
    """
    if cgroup is not None:
        cleared = cgroup.clear()
        if cleared.killed:
            log.warning(
                "killed %d process(es) left in %s by dead proxy %s", len(cleared.killed), cgroup.path, instance_id
            )
        if not cleared.removed:
            log.error("could not remove %s: %s", cgroup.path, cleared.error or f"processes remain: {cleared.remaining}")
            return
    elif cgroups.record_path(db.state_dir, instance_id).exists():
        log.warning("instance %s recorded a cgroup that is not of its making; left alone", instance_id)
    cgroups.forget(db.state_dir, instance_id)


def _journal_reaping(journal: Journal, actions: list[ReapAction], when: str) -> None:
    """Trees a dead proxy left, now verifiably gone (``closed``), and leases that could not be settled."""
    for action in actions:
        detail = f"lease {action.lease_id} of dead proxy {action.instance_id}: {action.reason}"
        if action.signalled:
            detail += f"; killed {len(action.signalled)}"
        if action.after == LeaseState.UNVERIFIABLE.value:
            journal.record(Kind.UNVERIFIABLE, backend=action.backend, label=when, detail=detail)
        elif action.after == LeaseState.CLOSED.value:
            journal.record(Kind.TREE_REAPED, backend=action.backend, label=when, detail=detail, shown=True)
