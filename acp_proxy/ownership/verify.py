"""The one way acp-proxy signals a process: after proving, live, that it owns it.

A ``Claim`` is what a lease recorded about a process. Before any signal the
claim is checked against the kernel, and any failure means no signal (fail
closed):

1. same boot (a pid from another boot means nothing now);
2. a pidfd can be opened (Linux) — from here on the pid cannot be recycled
   under us, so every later check is about the very process we will signal;
3. it is not a zombie (a zombie is dead; signalling it is pointless);
4. its start time equals the recorded one (or, for descendants found by a
   sweep, is not earlier than the wrapper's);
5. same uid;
6. the exact marker is in its environment, where the environment is readable;
7. the signal goes through the pidfd.

Command lines are never consulted: quoting and ``process.title`` make them lie.
Without pidfds (macOS) the same checks run, then ``os.kill``; the window between
check and kill is the documented cost of that platform.

One signal needs no claim: ``kill_child_group``, to a child of this very process that
it has not reaped (a task notification's command, past its timeout). Until the parent
reaps it, its pid, and with it the id of the group it leads, cannot name anything else.
"""

from __future__ import annotations

import enum
import os
import signal
from collections.abc import Callable

import msgspec

from acp_proxy.ownership.proctable import ProcessTable, TableUnavailable, default_table


class Verdict(enum.Enum):
    OURS = "ours"
    GONE = "gone"
    NOT_OURS = "not_ours"
    UNVERIFIABLE = "unverifiable"


class Outcome(msgspec.Struct, frozen=True):
    verdict: Verdict
    reason: str = ""
    signalled: bool = False


class Claim(msgspec.Struct, frozen=True):
    """What a lease knows about a process it owns."""

    pid: int
    boot_id: str
    uid: int
    marker: str
    start_ticks: int | None = None
    not_before_ticks: int | None = None


_table: ProcessTable | None = None


def process_table() -> ProcessTable:
    global _table
    if _table is None:
        _table = default_table()
    return _table


def check_claim(claim: Claim, table: ProcessTable | None = None) -> Outcome:
    """Whether ``claim`` still names a live process we own, without signalling it."""
    table = table or process_table()
    try:
        if table.boot_id() != claim.boot_id:
            return Outcome(Verdict.GONE, "recorded during another boot")
        info = table.info(claim.pid)
        if info is None:
            return Outcome(Verdict.GONE, "no such process")
        if info.zombie:
            return Outcome(Verdict.GONE, "zombie")
        if claim.start_ticks is not None and info.start_ticks != claim.start_ticks:
            return Outcome(
                Verdict.NOT_OURS,
                f"pid {claim.pid} was reused (started at tick {info.start_ticks}, "
                f"the lease's started at {claim.start_ticks})",
            )
        if claim.not_before_ticks is not None and info.start_ticks < claim.not_before_ticks:
            return Outcome(Verdict.NOT_OURS, f"pid {claim.pid} started before the lease")
        if info.uid != claim.uid:
            return Outcome(Verdict.NOT_OURS, f"pid {claim.pid} belongs to uid {info.uid}")
        has_marker = table.environ_has(claim.pid, claim.marker)
    except TableUnavailable as exc:
        return Outcome(Verdict.UNVERIFIABLE, str(exc))
    if has_marker is False:
        return Outcome(Verdict.NOT_OURS, f"pid {claim.pid} does not carry the lease's marker")
    if has_marker is None and claim.start_ticks is None:
        return Outcome(Verdict.UNVERIFIABLE, f"cannot read the environment of pid {claim.pid}")
    return Outcome(Verdict.OURS)


def send_verified_signal(claim: Claim, sig: signal.Signals, table: ProcessTable | None = None) -> Outcome:
    """Signal the process ``claim`` names if, and only if, it is provably ours right now."""
    table = table or process_table()
    if not table.has_pidfd:
        return _deliver(check_claim(claim, table), lambda: os.kill(claim.pid, sig))
    try:
        pidfd = os.pidfd_open(claim.pid)
    except ProcessLookupError:
        return Outcome(Verdict.GONE, "no such process")
    except OSError as exc:
        return Outcome(Verdict.UNVERIFIABLE, f"pidfd_open failed: {exc.strerror}")
    try:
        # Checked after the pidfd is open: whatever the checks see is what the pidfd names.
        return _deliver(check_claim(claim, table), lambda: signal.pidfd_send_signal(pidfd, sig))
    finally:
        os.close(pidfd)


def _deliver(outcome: Outcome, send: Callable[[], None]) -> Outcome:
    if outcome.verdict is not Verdict.OURS:
        return outcome
    try:
        send()
    except ProcessLookupError:
        return Outcome(Verdict.GONE, "exited before the signal")
    except PermissionError as exc:
        return Outcome(Verdict.UNVERIFIABLE, f"signal refused: {exc.strerror}")
    return Outcome(Verdict.OURS, signalled=True)


def kill_child_group(pid: int) -> bool:
    """SIGKILL the process group of ``pid``: a child of ours, started in a session of its own, not yet reaped.

    Nothing needs verifying: until it is reaped, its pid (which is also its group's id) cannot
    name any other process or group. Whether the signal was sent (the group may be gone already).
    """
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def signal_pidfd(pidfd: int, sig: signal.Signals) -> bool:
    """Send ``sig`` to the process ``pidfd`` refers to (a pidfd names one process, never a reused pid).

    For ``serve``'s connection proxies that its launcher forked: ours to stop, not our children.
    Whether it was sent (not if the process has ended, or the descriptor is closed)."""
    try:
        signal.pidfd_send_signal(pidfd, sig)
    except (ProcessLookupError, PermissionError, OSError):
        return False
    return True


def signal_child(pid: int, sig: signal.Signals) -> bool:
    """Send ``sig`` to ``pid``, a child of ours not yet reaped (so its pid names no other process).

    For a child that is no adapter tree: ``serve``'s per-connection proxies. Whether it was sent.
    """
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True
