"""Exact ownership where the kernel offers it: each adapter tree in a cgroup v2 of its own.

Where this process may write to its own cgroup v2 directory (root; a systemd unit with
``Delegate=yes``; ``systemd-run --user --scope -p Delegate=yes``), a proxy creates

    <its own cgroup>/acp-proxy.<install id>.<instance id>/             the instance's, while it has trees
    <its own cgroup>/acp-proxy.<install id>.<instance id>/<lease id>/  one per adapter tree

and the wrapper moves itself into its tree's cgroup before it forks the adapter, so the
adapter and every descendant are members from their first instruction, whatever they do
to their environment, session or parent. Ending a tree is then one write of ``1`` to its
``cgroup.kill`` (after the graces of DESIGN.md §4), a bounded wait for ``populated 0`` in
``cgroup.events``, and ``rmdir``.

That write is the one way, besides ``verify.send_verified_signal``, that acp-proxy ends a
process, and it needs no per-process check: the proxy created the cgroup, put only its own
wrapper in it, and every member got there by descending from it. (A process of the same uid
could move itself in or out: the delegated files are that uid's. Nothing of another uid can.)

Everywhere else (``off`` in the config, no cgroup2 mount, a cgroup this process may not
write, a kernel without ``cgroup.kill``) the mode is ``markers``: the wrapper as subreaper,
verified signals and marker sweeps, exactly as without this module.

Never touched: any cgroup the proxy did not create. An instance's cgroup is named after the
install and the instance, and recorded in ``instances/<instance id>.cgroup`` in the state dir
*before* it is created; only a recorded path of that name, under a cgroup2 mount, is ever
killed or removed: by the instance itself (each tree's when it ends, its own when it exits), by
its wrappers (each moves back to the proxy's cgroup once its tree is gone and removes the tree's,
and the instance's if that was its last tree), or by whoever reaps it once it is dead.

The memory controller is used when the proxy's own cgroup already hands it to its children
(``memory`` in its ``cgroup.subtree_control``): then ``memory.current`` is each tree's exact
figure. cgroup v2 lets a cgroup that holds processes (the proxy's own does) hand no controller
on, so in practice that is a proxy started in the root cgroup of a pure v2 host; the proxy
never moves itself to get it, and never writes a cgroup above its own.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final, Literal

import msgspec

from acp_proxy.config import CgroupSetting

Mode = Literal["cgroup", "markers"]

POLL_INTERVAL: Final = 0.01
KILL_WAIT: Final = 2.0
"""How long the processes of a cgroup have to be gone after ``cgroup.kill``."""
KILL_SINCE: Final = (5, 14)
"""The kernel release that added ``cgroup.kill``."""
PREFIX: Final = "acp-proxy."
DELEGATE_HINT: Final = (
    "run acp-proxy under systemd with Delegate=yes (a unit's [Service] section, or "
    "systemd-run --user --scope -p Delegate=yes acp-proxy ...), or as root"
)
MOUNT_HINT: Final = "run on a host with cgroup v2 mounted (systemd's unified or hybrid layout)"
KERNEL_HINT: Final = "cgroup.kill needs Linux 5.14 or later"


class CgroupsUnavailable(Exception):
    """``[ownership] cgroups = "required"``, and this proxy cannot have them; the message says why."""


class Support(msgspec.Struct, frozen=True):
    """Which ownership mode a proxy started here gets, and why."""

    mode: Mode
    reason: str
    remedy: str = ""
    """In ``markers`` mode, what would give this host cgroup mode (empty: nothing, or not wanted)."""
    base: str | None = None
    """The proxy's own cgroup v2 directory, under which instance cgroups are made."""
    memory: bool = False
    """``memory`` is delegated to the base's children: each tree has ``memory.current``."""

    def to_json(self) -> dict[str, object]:
        return {"mode": self.mode, "reason": self.reason, "remedy": self.remedy or None, "memory": self.memory}

    def describe(self) -> str:
        """One line for ``status`` and ``leases``: the mode, and why."""
        if self.mode == "cgroup":
            return f"cgroup: each adapter tree in a cgroup of its own ({self.reason})"
        return f"markers: subreaper wrapper and marker sweeps ({self.reason})"


# --- detection: pure over /proc and the cgroup file system --------------------------------------


def _unescape(field: str) -> str:
    r"""A mountinfo path field: spaces, tabs, newlines and backslashes come as ``\040`` and the like."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def cgroup2_mounts(mountinfo: str) -> list[tuple[str, str]]:
    """Every cgroup2 mount in ``/proc/self/mountinfo`` text, as (mount point, root within the hierarchy)."""
    found = []
    for line in mountinfo.splitlines():
        head, separator, tail = line.partition(" - ")
        fields = head.split()
        if separator and len(fields) >= 5 and tail.split()[:1] == ["cgroup2"]:
            found.append((_unescape(fields[4]), _unescape(fields[3])))
    return found


def own_cgroup(proc_cgroup: str) -> str | None:
    """This process's cgroup v2 path, from ``/proc/self/cgroup`` text (the ``0::`` line)."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


def _release(release: str) -> tuple[int, int]:
    parts = release.split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return 0, 0


def _words(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except OSError:
        return []


def detect(
    setting: CgroupSetting,
    *,
    proc: Path = Path("/proc"),
    release: str | None = None,
    access: Callable[[Path, int], bool] = os.access,
) -> Support:
    """Whether a proxy started here, with ``[ownership] cgroups = setting``, runs its trees in cgroups.

    Only looks: nothing is created. ``Owner.start`` then creates the instance's cgroup, which
    is the proof (it must have ``cgroup.kill``); ``release`` (default: this kernel's) stands in
    for a look at ``cgroup.kill`` where the proxy's cgroup is the hierarchy's root, which has
    none. ``proc``, ``release`` and ``access`` are parameters for tests.
    """
    if setting == "off":
        return Support("markers", 'cgroups = "off" in [ownership]')
    try:
        mountinfo = (proc / "self/mountinfo").read_text()
        membership = (proc / "self/cgroup").read_text()
    except OSError:
        return Support("markers", f"no {proc}/self/mountinfo or {proc}/self/cgroup (not Linux, or no /proc)")
    mounts = cgroup2_mounts(mountinfo)
    if not mounts:
        return Support("markers", "no cgroup2 file system is mounted", MOUNT_HINT)
    path = own_cgroup(membership)
    if path is None:
        reason = f"this process is in no cgroup v2 cgroup (no 0:: line in {proc}/self/cgroup)"
        return Support("markers", reason, MOUNT_HINT)
    for mount, root in mounts:
        inside = path if root == "/" else path[len(root) :] if path == root or path.startswith(root + "/") else None
        if inside is not None and os.path.isdir(mount + inside):
            break
    else:
        reason = f"this process's cgroup {path} is not visible under any cgroup2 mount"
        return Support("markers", reason, "run acp-proxy where its own cgroup is visible (its own cgroup namespace)")
    base = Path(os.path.normpath(mount + inside))
    # The hierarchy's root has neither cgroup.kill nor cgroup.type; its children have both. A
    # cgroup namespace's root (a container's "/") is a child of the host's, and has them.
    if not (base / "cgroup.kill").exists():
        if (base / "cgroup.type").exists():
            return Support("markers", f"{base} has no cgroup.kill", KERNEL_HINT)
        if _release(release or os.uname().release) < KILL_SINCE:
            return Support("markers", "this kernel has no cgroup.kill", KERNEL_HINT)
    if not (access(base, os.W_OK) and access(base / "cgroup.procs", os.W_OK)):
        return Support("markers", f"{base} is not writable by uid {os.getuid()}", DELEGATE_HINT)
    memory = "memory" in _words(base / "cgroup.subtree_control")
    said = (
        "memory.current per tree"
        if memory
        else f"no memory.current (memory is not in {base / 'cgroup.subtree_control'})"
    )
    reason = f"cgroup2 at {mount}: {base} is writable, cgroup.kill present; {said}"
    return Support("cgroup", reason, base=str(base), memory=memory)


# --- an instance's cgroup and its trees' ------------------------------------------------------


class Cleared(msgspec.Struct):
    """What ending a cgroup (and what is under it) did."""

    killed: list[int] = msgspec.field(default_factory=list)
    """The processes it held when ``cgroup.kill`` was written."""
    remaining: list[int] = msgspec.field(default_factory=list)
    """Processes still there when the wait ran out (the directory is then left in place)."""
    removed: bool = False
    error: str = ""


def instance_name(install_id: str, instance_id: str) -> str:
    return f"{PREFIX}{install_id}.{instance_id}"


def record_path(state_dir: Path, instance_id: str) -> Path:
    return state_dir / "instances" / f"{instance_id}.cgroup"


def recorded_instances(state_dir: Path) -> list[str]:
    """The instances that recorded a cgroup which nobody has removed yet."""
    try:
        names = os.listdir(state_dir / "instances")
    except OSError:
        return []
    return sorted(name.removesuffix(".cgroup") for name in names if name.endswith(".cgroup"))


def forget(state_dir: Path, instance_id: str) -> None:
    record_path(state_dir, instance_id).unlink(missing_ok=True)


def populated(path: Path) -> bool:
    """Whether the cgroup or any under it holds a process (``cgroup.events``); a gone one holds none."""
    try:
        events = path.joinpath("cgroup.events").read_text()
    except FileNotFoundError:
        return False
    return "populated 1" in events


def members(path: Path) -> list[int]:
    """Every process in the cgroup and the cgroups under it."""
    found: list[int] = []
    for directory, _, files in os.walk(path):
        if "cgroup.procs" in files:
            found += [int(pid) for pid in _words(Path(directory, "cgroup.procs"))]
    return found


def _bottom_up(path: Path) -> Iterator[Path]:
    for directory, _, _ in os.walk(path, topdown=False):
        yield Path(directory)


def clear(path: Path, timeout: float, *, dry_run: bool = False) -> Cleared:
    """Kill everything in the cgroup at ``path`` and remove it (with any cgroup under it).

    A process can join between the check that the cgroup is empty and its removal (a dead
    proxy's wrapper still starting joins its tree's cgroup before it forks the adapter): the
    removal then fails with ``EBUSY``, and the cgroup is killed again and removed again, until
    ``timeout``. Only for a cgroup an ``InstanceCgroup`` names: callers reach it through one.
    """
    cleared = Cleared()
    if not path.is_dir():
        cleared.removed = True
        return cleared
    deadline = time.monotonic() + timeout
    try:
        while True:
            if populated(path):
                cleared.killed += [pid for pid in members(path) if pid not in cleared.killed]
                if dry_run:
                    return cleared
                path.joinpath("cgroup.kill").write_text("1")
                while populated(path) and time.monotonic() < deadline:
                    time.sleep(POLL_INTERVAL)
            elif dry_run:
                return cleared
            if populated(path):
                cleared.remaining = members(path)
                return cleared
            try:
                for directory in _bottom_up(path):
                    with contextlib.suppress(FileNotFoundError):  # its wrapper removed it meanwhile (``leave_cgroup``)
                        directory.rmdir()
            except OSError as exc:
                if exc.errno == errno.EBUSY and time.monotonic() < deadline:
                    continue  # someone joined after the check: killed too, on the next round
                raise
            cleared.removed = True
            return cleared
    except OSError as exc:
        cleared.error = f"{exc.filename or path}: {exc.strerror}"
    return cleared


class InstanceCgroup(msgspec.Struct, frozen=True):
    """A proxy instance's cgroup: made by it, recorded in the state dir, one child per lease."""

    path: str
    memory: bool = False

    def tree(self, lease_id: str) -> Path:
        return Path(self.path, lease_id)

    def create_tree(self, lease_id: str) -> Path:
        """The tree's cgroup, for its wrapper to join before it forks the adapter.

        The instance's own is made here too when it is not there: it exists only while it has
        trees (``clear_tree`` removes it with the last, and so does a wrapper whose tree was the
        last, the proxy alive or not), so that a proxy killed with no tree running, or whose wrappers ended theirs,
        leaves nothing in the cgroup file system.
        """
        instance, tree = Path(self.path), self.tree(lease_id)
        for attempt in range(3):
            with contextlib.suppress(FileExistsError):  # trees are launched from several threads
                instance.mkdir()
            try:
                if self.memory:
                    instance.joinpath("cgroup.subtree_control").write_text("+memory")
                tree.mkdir()
            except FileNotFoundError:  # another tree's end removed the instance's meanwhile
                if attempt == 2:
                    raise
                continue
            break
        return tree

    def clear_tree(self, lease_id: str, timeout: float = KILL_WAIT, *, dry_run: bool = False) -> Cleared:
        """End the tree's cgroup (``clear``); the instance's too if that was its last tree."""
        cleared = clear(self.tree(lease_id), timeout, dry_run=dry_run)
        if cleared.removed and not dry_run:
            with contextlib.suppress(OSError):  # not empty: other trees run
                os.rmdir(self.path)
        return cleared

    def clear(self, timeout: float = KILL_WAIT, *, dry_run: bool = False) -> Cleared:
        """Every tree's cgroup, then the instance's own."""
        return clear(Path(self.path), timeout, dry_run=dry_run)


def create_instance_cgroup(support: Support, state_dir: Path, install_id: str, instance_id: str) -> InstanceCgroup:
    """Record this instance's cgroup, and prove it can be made: made, looked at, removed (its first tree
    makes it again). ``OSError`` if it cannot be made, or has no ``cgroup.kill``.

    Recorded first, for as long as the proxy lives: a proxy that dies at any moment leaves at most
    a record of a cgroup that does not exist (forgotten by its reaper), never a cgroup nobody knows
    is ours.
    """
    assert support.base is not None
    path = Path(support.base, instance_name(install_id, instance_id))
    record = record_path(state_dir, instance_id)
    fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with open(fd, "w") as fh:
        fh.write(str(path))
    try:
        path.mkdir()
    except OSError:
        forget(state_dir, instance_id)
        raise
    try:
        if not path.joinpath("cgroup.kill").exists():
            raise OSError(0, "no cgroup.kill (needs Linux 5.14 or later)", str(path))
        if support.memory:
            path.joinpath("cgroup.subtree_control").write_text("+memory")
    except OSError:
        forget(state_dir, instance_id)
        raise
    finally:
        path.rmdir()
    return InstanceCgroup(str(path), memory=support.memory)


def recorded_instance_cgroup(
    state_dir: Path, install_id: str, instance_id: str, *, proc: Path = Path("/proc")
) -> InstanceCgroup | None:
    """The cgroup a (dead) instance of this install recorded, if the record names one it can have made:
    its own name, under a cgroup2 mount. ``None`` when there is no such record, or it names anything else."""
    try:
        recorded = record_path(state_dir, instance_id).read_text().strip()
    except OSError:
        return None
    path = Path(recorded)
    if not path.is_absolute() or path.name != instance_name(install_id, instance_id) or ".." in path.parts:
        return None
    try:
        mounts = cgroup2_mounts((proc / "self/mountinfo").read_text())
    except OSError:
        return None
    if not any(path.parent == Path(mount) or Path(mount) in path.parents for mount, _ in mounts):
        return None
    return InstanceCgroup(str(path))


# --- memory -----------------------------------------------------------------------------------


def memory_current(path: str | Path) -> int | None:
    """The bytes a tree's cgroup uses (``memory.current``: its pages, cache included), if it has one."""
    try:
        return int(Path(path, "memory.current").read_text())
    except (OSError, ValueError):
        return None


def memory_working_set(path: str | Path) -> int | None:
    """What a tree's cgroup holds that it cannot simply give back: ``memory.current`` less the
    inactive page cache (``inactive_file`` in ``memory.stat``), as the kubelet counts a
    container's working set. An agent that reads a large repository fills the cache, which the
    kernel reclaims first; that is no reason to recycle its session."""
    current = memory_current(path)
    if current is None:
        return None
    try:
        stat = Path(path, "memory.stat").read_text()
    except OSError:
        return current
    for line in stat.splitlines():
        name, _, value = line.partition(" ")
        if name == "inactive_file" and value.strip().isdigit():
            return max(0, current - int(value))
    return current


def set_memory_limits(path: str | Path, *, high: int | None = None, maximum: int | None = None) -> None:
    """Throttle the tree above ``high`` bytes and have it OOM-killed above ``maximum`` (``None``: no limit).

    ``OSError`` where the cgroup has no memory controller.
    """
    for name, value in (("memory.high", high), ("memory.max", maximum)):
        Path(path, name).write_text("max" if value is None else str(value))
