"""A running proxy's ownership context: state database, live instance, process table.

``Owner.start`` is the first thing a serving proxy does: open the state database,
register as a live instance (taking its lock), create its cgroup where it may
(``cgroups``), then reap whatever dead proxies of the same install left behind.
It runs before the event loop starts: nothing is being served yet, and SQLite
stays on one thread.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from acp_proxy.config import CgroupSetting
from acp_proxy.journal import Journal
from acp_proxy.ownership import cgroups, instances
from acp_proxy.ownership.cgroups import DELEGATE_HINT, CgroupsUnavailable, InstanceCgroup, Support
from acp_proxy.ownership.proctable import ProcessTable
from acp_proxy.ownership.reaping import ReapAction, reap_dead_instances
from acp_proxy.ownership.verify import process_table
from acp_proxy.state import StateDB
from acp_proxy.timings import Timings

log = logging.getLogger("acp_proxy.ownership")

WRAPPER_NAME = "adapter_wrapper.py"


class WrapperMissing(FileNotFoundError):
    """The per-lease wrapper program is not where this install keeps it."""


def wrapper_path() -> Path:
    """The per-lease wrapper program, run as ``python -I -S PATH``.

    The wheel ships the repository's ``wrappers/`` directory inside the package, as
    ``acp_proxy/_wrappers/`` (pyproject.toml); a checkout or an editable install has it
    next to the package, in ``wrappers/``.
    """
    package = Path(__file__).resolve().parent.parent
    shipped = package / "_wrappers" / WRAPPER_NAME
    if shipped.is_file():
        return shipped
    checkout = package.parent / "wrappers" / WRAPPER_NAME
    if checkout.is_file():
        return checkout
    raise WrapperMissing(f"the adapter wrapper is missing: expected {shipped} (or {checkout} in a checkout)")


class Platform(msgspec.Struct):
    """Which ownership primitives this system has, for operators to see."""

    table: str
    pidfd: bool
    subreaper: bool

    @property
    def degraded(self) -> bool:
        return not (self.pidfd and self.subreaper)

    def describe(self) -> str:
        if not self.degraded:
            return "full: /proc identity checks, pidfd signals, subreaper wrapper"
        return (
            f"degraded ({self.table}): no pidfd/subreaper; process-group kill by the wrapper "
            "plus a verified marker sweep (descendants that leave the group are found by marker only)"
        )


def detect_cgroups(setting: CgroupSetting) -> Support:
    """The mode a proxy started here gets; ``CgroupsUnavailable`` when ``required`` and it would not have them."""
    support = cgroups.detect(setting)
    if setting == "required" and support.mode != "cgroup":
        raise CgroupsUnavailable(refusal(support))
    return support


def refusal(support: Support) -> str:
    """Why a proxy with ``cgroups = "required"`` will not start, and what would let it."""
    return f'[ownership] cgroups = "required", but {support.reason}' + (f": {support.remedy}" if support.remedy else "")


def detect_platform(table: ProcessTable) -> Platform:
    return Platform(table=table.name, pidfd=table.has_pidfd, subreaper=sys.platform.startswith("linux"))


def log_reaped(actions: list[ReapAction], what: str) -> None:
    """One line per lease a reaping settled (``what``: when it ran)."""
    for action in actions:
        log.info(
            "%s: lease %s (%s, instance %s) %s -> %s: %s%s",
            what,
            action.lease_id,
            action.backend,
            action.instance_id,
            action.before,
            action.after,
            action.reason,
            f"; killed {action.signalled}" if action.signalled else "",
        )


@dataclass(slots=True)
class Owner:
    db: StateDB
    instance: instances.Instance
    table: ProcessTable
    reaped: list[ReapAction] = field(default_factory=list)
    cgroups: Support = field(default_factory=lambda: Support("markers", "not asked for"))
    """The ownership mode in force for this proxy's trees, and why."""
    cgroup: InstanceCgroup | None = None
    """This instance's cgroup, in ``cgroup`` mode: each tree's is made under it."""
    cgroups_required: bool = False
    journal: Journal = field(init=False)
    timings: Timings = field(init=False)
    """What this proxy timed, added to the install's histograms about once a second and at exit."""

    def __post_init__(self) -> None:
        self.journal = Journal(self.db, self.instance.instance_id)
        self.timings = Timings(self.db)

    @classmethod
    def start(cls, state_dir: Path, *, grace: float, cgroups: CgroupSetting = "auto") -> Owner:
        """``CgroupsUnavailable`` if ``cgroups`` is ``required`` and this proxy cannot have them."""
        support = detect_cgroups(cgroups)
        db = StateDB(state_dir)
        table = process_table()
        instance = instances.start_instance(db, table.boot_id())
        owner = cls(db, instance, table, cgroups_required=cgroups == "required")
        try:
            owner._open_cgroup(support)
        except CgroupsUnavailable:
            owner.close("cgroups unavailable")
            raise
        owner.reaped = reap_dead_instances(db, instance.instance_id, grace=grace, table=table)
        log_reaped(owner.reaped, "startup reaping")
        return owner

    def _open_cgroup(self, support: Support) -> None:
        if support.mode == "cgroup":
            try:
                self.cgroup = cgroups.create_instance_cgroup(
                    support, self.db.state_dir, self.db.install_id, self.instance_id
                )
            except OSError as exc:
                where = exc.filename or support.base
                support = Support("markers", f"cannot create a cgroup in {where}: {exc.strerror}", DELEGATE_HINT)
        self.cgroups = support
        if support.mode == "markers" and self.cgroups_required:
            raise CgroupsUnavailable(refusal(support))
        log.info("ownership: %s (%s)", support.mode, support.reason)

    @property
    def instance_id(self) -> str:
        return self.instance.instance_id

    @property
    def boot_id(self) -> str:
        return self.instance.boot_id

    def close(self, reason: str = "exited") -> None:
        """The last thing a proxy does: its queued writes applied (its leases' last states among them,
        which decide whether it ended cleanly), then its instance ended and the database closed."""
        try:
            self.timings.flush()
            self.db.stop_writer()
            self._remove_cgroup()
            instances.end_instance(self.db, self.instance, reason)
        finally:
            self.db.close()

    def _remove_cgroup(self) -> None:
        """Whatever is still in this instance's cgroup is ours and must not outlive us; then the cgroup goes.

        One that cannot be removed stays recorded, for the proxy that reaps this instance.
        """
        if self.cgroup is None:
            return
        cleared = self.cgroup.clear()
        if cleared.killed:
            log.warning("killed %d process(es) left in %s", len(cleared.killed), self.cgroup.path)
        if cleared.removed:
            cgroups.forget(self.db.state_dir, self.instance_id)
        else:
            log.error(
                "could not remove %s (%s); the proxy that reaps this instance will",
                self.cgroup.path,
                cleared.error or f"processes remain: {cleared.remaining}",
            )
