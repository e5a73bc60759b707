"""Exact ownership by cgroup v2, and the marker mode everywhere else.

Pure tables first: what ``detect`` makes of a /proc and a cgroup file system laid out in
tmp_path, which recorded cgroups a reaper may act on, the memory files. Then real processes,
skipped where this process cannot make cgroups (not root, no delegation, no cgroup2):
a descendant that clears its environment and escapes with ``setsid`` outlives a SIGKILL of its
wrapper; in ``cgroup`` mode it is gone once its tree is stopped, in ``markers`` mode nothing can
find it. A dead proxy's cgroup is cleared by the next one; a cgroup the proxy did not make is
never touched.

What this host cannot show: the memory controller on cgroup v2 (hybrid layout: it sits on the
v1 side here), and systemd delegation (tests run as root, not in a delegated unit).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest

from acp_proxy.ownership import cgroups, instances
from acp_proxy.ownership.cgroups import CgroupsUnavailable, InstanceCgroup, Support
from acp_proxy.ownership.leases import Lease, LeaseState, all_leases, create_lease
from acp_proxy.ownership.owner import Owner
from acp_proxy.ownership.reaping import reap_dead_instances
from acp_proxy.ownership.supervised import SupervisedProcess, WrapperFailed, owner_tree_cgroup
from acp_proxy.pool.budget import measure_adapters
from acp_proxy.state import StateDB
from tests.support import GONE_WITHIN, MARKER_VARIABLE, Gateway, fake_command, marked_processes, pid_alive, survivors
from wrappers import adapter_wrapper_core

HERE = cgroups.detect("auto")
needs_cgroups = pytest.mark.skipif(
    HERE.mode != "cgroup", reason=f"cgroup mode is not available to this process: {HERE.reason}"
)
FAST = '[shutdown]\nstdin_grace = "300ms"\nterm_grace = "1s"\n[backends.fake]\ncommand = ["unused"]\n'

# --- detection, over a fake /proc and cgroup file system -------------------------------------

HYBRID = "41 31 0:38 / {mount} rw,relatime - cgroup2 cgroup2 rw\n22 1 0:21 / /proc rw - proc proc rw\n"
V1_ONLY = "22 1 0:21 / /proc rw - proc proc rw\n30 25 0:26 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"


@dataclass(frozen=True)
class Host:
    id: str
    sentence: str
    mountinfo: str | None = HYBRID
    membership: str = "9:memory:/\n0::/\n"
    own: str = "/"
    """Which cgroup directory exists (relative to the mount), as the process's own."""
    kill: bool = True
    namespace_root: bool = False
    """``own`` is "/" of a cgroup namespace: a child of the real root, as a container sees it."""
    writable: bool = True
    subtree: str = ""
    release: str = "6.1.0"
    setting: str = "auto"
    mode: str = "cgroup"
    reason: str = "is writable, cgroup.kill present"
    memory: bool = False


HOSTS = [
    Host("root", "root in the hybrid layout's v2 root: cgroup mode, no memory controller", reason="no memory.current"),
    Host("off", 'cgroups = "off": markers, whatever the host offers', setting="off", mode="markers", reason='"off"'),
    Host("no-proc", "no /proc/self/mountinfo: markers", mountinfo=None, mode="markers", reason="no "),
    Host("v1-only", "no cgroup2 mount: markers", mountinfo=V1_ONLY, mode="markers", reason="no cgroup2"),
    Host(
        "no-v2-line",
        "in no v2 cgroup: markers",
        membership="9:memory:/\n",
        mode="markers",
        reason="no 0:: line",
    ),
    Host(
        "invisible",
        "its cgroup is not under the mount (another namespace): markers",
        membership="0::/elsewhere/app.scope\n",
        own="/app.scope",
        mode="markers",
        reason="not visible",
    ),
    Host(
        "delegated",
        "a delegated scope: cgroup mode under it",
        membership="0::/user.slice/user-1000.slice/app.scope\n",
        own="/user.slice/user-1000.slice/app.scope",
    ),
    Host(
        "no-kill",
        "a delegated cgroup without cgroup.kill (Linux < 5.14): markers",
        membership="0::/app.scope\n",
        own="/app.scope",
        kill=False,
        mode="markers",
        reason="no cgroup.kill",
    ),
    Host("old-kernel", "the root cgroup on Linux 5.10: markers", release="5.10.0-21", mode="markers", reason="5.14"),
    Host(
        "namespace-root",
        "a container's cgroup namespace root (a child of the host's, with cgroup.kill): cgroup mode",
        membership="0::/\n",
        own="/",
        namespace_root=True,
        release="5.10.0",
    ),
    Host(
        "not-delegated",
        "a cgroup this uid may not write: markers, and how to grant delegation",
        membership="0::/user.slice\n",
        own="/user.slice",
        writable=False,
        mode="markers",
        reason="Delegate=yes",
    ),
    Host(
        "memory",
        "memory delegated to the proxy's children: memory.current per tree",
        subtree="cpu memory pids",
        memory=True,
        reason="memory.current per tree",
    ),
    Host(
        "required",
        'cgroups = "required" on a host that offers them: cgroup mode',
        setting="required",
    ),
]


def fake_host(tmp_path: Path, host: Host) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    mount = tmp_path / "sys fs cgroup"  # a space, escaped as \040 in mountinfo
    if host.mountinfo is not None:
        (proc / "self/mountinfo").write_text(host.mountinfo.format(mount=str(mount).replace(" ", "\\040")))
    (proc / "self/cgroup").write_text(host.membership)
    own = mount / host.own.lstrip("/")
    own.mkdir(parents=True)
    (own / "cgroup.procs").write_text("")
    (own / "cgroup.subtree_control").write_text(host.subtree + "\n")
    if host.own != "/" or host.namespace_root:  # the hierarchy's root has neither
        (own / "cgroup.type").write_text("domain\n")
        if host.kill:
            (own / "cgroup.kill").write_text("")
    return proc


@pytest.mark.parametrize("host", HOSTS, ids=[host.id for host in HOSTS])
def test_detection(tmp_path: Path, host: Host) -> None:
    proc = fake_host(tmp_path, host)
    found = cgroups.detect(
        host.setting,  # type: ignore[arg-type]
        proc=proc,
        release=host.release,
        access=lambda path, mode: host.writable,
    )
    assert found.mode == host.mode, found
    assert host.reason in f"{found.reason}: {found.remedy}", found
    assert found.memory is host.memory
    if host.mode == "cgroup":
        assert found.base == os.path.normpath(tmp_path / "sys fs cgroup" / host.own.lstrip("/"))
    else:
        assert found.base is None


def test_required_refuses_to_start_without_cgroups(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cgroups, "detect", lambda setting: Support("markers", "no cgroup2 file system is mounted"))
    with pytest.raises(CgroupsUnavailable, match='cgroups = "required", but no cgroup2 file system is mounted'):
        Owner.start(tmp_path / "state", grace=0.1, cgroups="required")
    assert not (tmp_path / "state").exists(), "refused before anything was written"
    owner = Owner.start(tmp_path / "state", grace=0.1, cgroups="auto")
    try:
        assert owner.cgroups.mode == "markers"
        assert owner.cgroup is None
    finally:
        owner.close()


# --- which recorded cgroups a reaper may act on --------------------------------------------------


@dataclass(frozen=True)
class Record:
    id: str
    sentence: str
    content: str | None
    accepted: bool


def records(mount: Path) -> list[Record]:
    name = cgroups.instance_name("inst", "dead")
    return [
        Record("ours", "its own name under a cgroup2 mount: acted on", f"{mount}/app.scope/{name}", True),
        Record("none", "no record: nothing", None, False),
        Record("other-name", "another cgroup's name: never touched", f"{mount}/app.scope/session-1.scope", False),
        Record(
            "other-install",
            "another install's instance: never touched",
            f"{mount}/{cgroups.instance_name('other', 'dead')}",
            False,
        ),
        Record("relative", "a relative path: never touched", f"app.scope/{name}", False),
        Record("dotdot", "a path climbing out: never touched", f"{mount}/a/../../{name}", False),
        Record("not-cgroup2", "outside any cgroup2 mount: never touched", f"/tmp/{name}", False),
    ]


@pytest.mark.parametrize("index", range(7), ids=[r.id for r in records(Path("/m"))])
def test_a_reaper_acts_only_on_cgroups_the_install_recorded_making(tmp_path: Path, index: int) -> None:
    mount = tmp_path / "cg"
    proc = fake_host(tmp_path, Host("any", ""))
    (proc / "self/mountinfo").write_text(HYBRID.format(mount=mount))
    row = records(mount)[index]
    state = tmp_path / "state"
    (state / "instances").mkdir(parents=True)
    if row.content is not None:
        (state / "instances/dead.cgroup").write_text(row.content)
    found = cgroups.recorded_instance_cgroup(state, "inst", "dead", proc=proc)
    assert (found is not None) is row.accepted, row.sentence
    if found is not None:
        assert found.path == row.content


def test_recorded_instances_are_read_from_the_state_dir(tmp_path: Path) -> None:
    (tmp_path / "instances").mkdir()
    for name in ("a.lock", "b.cgroup", "c.reaping", "d.cgroup"):
        (tmp_path / "instances" / name).write_text("")
    assert cgroups.recorded_instances(tmp_path) == ["b", "d"]
    cgroups.forget(tmp_path, "b")
    assert cgroups.recorded_instances(tmp_path) == ["d"]
    assert cgroups.recorded_instances(tmp_path / "missing") == []


# --- memory files ------------------------------------------------------------------------------


def test_memory_current_and_limits_read_and_write_the_cgroup_files(tmp_path: Path) -> None:
    assert cgroups.memory_current(tmp_path) is None, "no memory controller: no figure"
    (tmp_path / "memory.current").write_text("52330496\n")
    assert cgroups.memory_current(tmp_path) == 52330496
    assert cgroups.memory_working_set(tmp_path) == 52330496, "no memory.stat: all of it"
    (tmp_path / "memory.stat").write_text("anon 41943040\ninactive_file 2097152\n")
    assert cgroups.memory_working_set(tmp_path) == 52330496 - 2097152
    cgroups.set_memory_limits(tmp_path, high=1 << 30, maximum=None)
    assert (tmp_path / "memory.high").read_text() == str(1 << 30)
    assert (tmp_path / "memory.max").read_text() == "max"
    with pytest.raises(FileNotFoundError):
        cgroups.set_memory_limits(tmp_path / "gone", high=1)


def test_a_tree_with_the_memory_controller_is_held_to_its_session_kill_memory(tmp_path: Path) -> None:
    owner = types.SimpleNamespace(
        cgroup=InstanceCgroup(str(tmp_path / "instance"), memory=True), cgroups_required=False
    )
    lease = types.SimpleNamespace(lease_id="lease-1")
    tree = Path(owner_tree_cgroup(owner, lease, 400 << 20))  # type: ignore[arg-type]
    assert (tree / "memory.high").read_text() == str(450 << 20), "throttled a little past the proxy's own cut"
    assert (tree / "memory.max").read_text() == str(500 << 20), "the kernel's backstop, a quarter above it"
    plain = Path(owner_tree_cgroup(owner, types.SimpleNamespace(lease_id="lease-2")))  # type: ignore[arg-type]
    assert not (plain / "memory.high").exists(), "no session_kill_memory: no kernel limit"
    without = types.SimpleNamespace(cgroup=InstanceCgroup(str(tmp_path / "other")), cgroups_required=False)
    bare = Path(owner_tree_cgroup(without, lease, 400 << 20))  # type: ignore[arg-type]
    assert not (bare / "memory.high").exists(), "no memory controller: nothing to write"


def test_a_tree_with_memory_current_is_measured_by_it_and_the_others_by_pss(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    (tmp_path / "memory.current").write_text("83886080\n")
    (tmp_path / "memory.stat").write_text(
        "anon 62914560\nfile 20971520\ninactive_file 10485760\nactive_file 10485760\n"
    )
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=proc_env)
    try:
        sizes = measure_adapters([os.getpid(), helper.pid], {helper.pid: str(tmp_path)})
    finally:
        helper.kill()
        helper.wait()
    assert sizes[helper.pid] == (73400320, "cgroup"), "memory.current less the inactive page cache"
    size, kind = sizes[os.getpid()]
    assert kind in ("pss", "rss")
    assert size > 1 << 20


@pytest.mark.skipif(
    not HERE.memory,
    reason="the memory controller is not delegated on cgroup v2 here (on a hybrid host it is on the v1 side)",
)
def test_a_tree_in_cgroup_mode_has_memory_current(proc_env: dict[str, str], tmp_path: Path) -> None:
    owner = Owner.start(tmp_path / "state", grace=0.5, cgroups="required")
    try:
        assert owner.cgroup is not None
        tree = owner.cgroup.create_tree("probe")
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=proc_env)
        try:
            (tree / "cgroup.procs").write_text(str(proc.pid))
            figure = cgroups.memory_current(tree)
            assert figure is not None
            assert figure > 0
        finally:
            proc.kill()
            proc.wait()
    finally:
        owner.close()


# --- real processes in cgroup mode -------------------------------------------------------------


def install_cgroups(state_dir: Path) -> list[str]:
    """The cgroups of this test's install (its id is in their names) that exist under ``HERE.base``."""
    db = StateDB(state_dir, create=False)
    try:
        prefix = cgroups.instance_name(db.install_id, "")
    finally:
        db.close()
    return sorted(name for name in os.listdir(HERE.base or "/nonexistent") if name.startswith(prefix))


@pytest.fixture
def escapee_file(tmp_path: Path) -> Iterator[Path]:
    """Where the escapee writes its pid; it is killed here if a test left it (its failure says so)."""
    path = tmp_path / "escapee.pid"
    yield path
    if path.exists() and pid_alive(pid := int(path.read_text())):
        os.kill(pid, signal.SIGKILL)


def escaping_tree(pid_file: Path, marker: str) -> list[str]:
    """An adapter whose child clears its environment (the tests' marker aside) and leaves with setsid."""
    escape = f"echo $$ > {pid_file}; exec sleep 600"
    return ["sh", "-c", f"setsid env -i {MARKER_VARIABLE}={marker} sh -c '{escape}' & exec sleep 600"]


def written_pid(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def carries_lease_marker(pid: int) -> bool:
    return b"ACP_PROXY_LEASE=" in Path(f"/proc/{pid}/environ").read_bytes()


def exists(path: str | None) -> bool:
    return path is not None and os.path.exists(path)


async def dropped_lease_marker(pid: int) -> bool:
    """Whether ``pid`` has exec'd without the lease's marker (it may not have exec'd yet when its pid is known)."""
    with anyio.move_on_after(GONE_WITHIN):
        while carries_lease_marker(pid):
            await anyio.sleep(0.02)
    return not carries_lease_marker(pid)


async def wait_for_pid(path: Path) -> int:
    with anyio.fail_after(GONE_WITHIN):
        while (pid := written_pid(path)) is None:
            await anyio.sleep(0.02)
    return pid


@pytest.mark.anyio
@pytest.mark.parametrize("setting", ["required", "off"])
async def test_an_escapee_that_clears_its_environment_outlives_its_wrapper_only_without_cgroups(
    proc_env: dict[str, str], tmp_path: Path, escapee_file: Path, setting: str
) -> None:
    """The wrapper is SIGKILLed (so it tears nothing down) after a descendant dropped the lease's
    marker and left with setsid. Stopping the tree ends it in ``cgroup`` mode; in ``markers`` mode
    nothing can find it: that is what the cgroup adds."""
    if setting == "required" and HERE.mode != "cgroup":
        pytest.skip(f"cgroup mode is not available to this process: {HERE.reason}")
    state = tmp_path / "state"
    owner = Owner.start(state, grace=0.5, cgroups=setting)  # type: ignore[arg-type]
    try:
        assert owner.cgroups.mode == ("cgroup" if setting == "required" else "markers"), owner.cgroups
        supervised = await SupervisedProcess.start(
            owner,
            backend="fake",
            argv=escaping_tree(escapee_file, proc_env[MARKER_VARIABLE]),
            env=proc_env,
            cwd=None,
            term_grace=0.5,
        )
        escapee = await wait_for_pid(escapee_file)
        assert pid_alive(escapee)
        assert await dropped_lease_marker(escapee)
        if setting == "required":
            assert supervised.cgroup is not None
            assert escapee in cgroups.members(Path(supervised.cgroup))
        else:
            assert supervised.cgroup is None
        assert supervised.lease.wrapper_pid is not None
        os.kill(supervised.lease.wrapper_pid, signal.SIGKILL)
        await supervised.stop(stdin_grace=0.1, term_grace=0.5)
        if setting == "required":
            assert await survivors([escapee]) == []
            assert not exists(supervised.cgroup), "the tree's cgroup is removed"
        else:
            assert pid_alive(escapee), "markers mode cannot find it: a reason for cgroup mode"
            os.kill(escapee, signal.SIGKILL)
            assert await survivors([escapee]) == []
    finally:
        owner.close()
    (lease,) = _leases(state)
    if setting == "required":
        assert lease.state is LeaseState.CLOSED, lease
        assert install_cgroups(state) == [], "the instance's cgroup is removed when the proxy exits"
        assert cgroups.recorded_instances(state) == []


@needs_cgroups
@pytest.mark.anyio
async def test_in_cgroup_mode_an_escapee_is_gone_after_its_session_closes(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """Through a real proxy: the adapter's grandchild drops its environment and leaves with setsid,
    the wrapper is SIGKILLed; the proxy ends the tree by its cgroup, the session then closes, and
    once the proxy exits nothing of the install is left in the cgroup file system."""
    config = tmp_path / "fast.toml"
    config.write_text(FAST + '[ownership]\ncgroups = "required"\n')
    state = Path(proc_env["ACP_PROXY_STATE_DIR"])
    async with Gateway.start(proc_env, tmp_path, fake_command(), proxy_args=["--config", str(config)]) as gw:
        await gw.initialize()
        session = await gw.new_session()
        assert (await gw.prompt(session, "escape_clean"))["result"]["stopReason"] == "end_turn"
        pids = (await gw.request("_fake/pids"))["result"]
        escapee = pids["children"][-1]
        assert await dropped_lease_marker(escapee)
        (lease,) = [lease for lease in _leases(state) if lease.state is LeaseState.OPEN]
        assert lease.wrapper_pid is not None
        assert len(install_cgroups(state)) == 1
        os.kill(lease.wrapper_pid, signal.SIGKILL)
        assert await survivors([pids["adapter"], escapee]) == [], gw.stderr.decode()[-3000:]
        closed = await gw.request("session/close", {"sessionId": session})
        assert "result" in closed, closed
        assert await gw.close() == 0
    assert install_cgroups(state) == []
    ended = {found.lease_id: found for found in _leases(state)}[lease.lease_id]
    assert ended.state is LeaseState.CLOSED, ended


@needs_cgroups
@pytest.mark.anyio
async def test_a_sigkilled_proxys_wrappers_remove_its_cgroups(proc_env: dict[str, str], tmp_path: Path) -> None:
    """The proxy is SIGKILLed and no other proxy of the install ever starts: its wrappers end their
    trees (lifeline EOF), and each removes its tree's cgroup, the last one the instance's too."""
    config = tmp_path / "fast.toml"
    config.write_text(FAST + '[ownership]\ncgroups = "required"\n[pool]\nmax_live = 2\n')
    state = Path(proc_env["ACP_PROXY_STATE_DIR"])
    async with Gateway.start(proc_env, tmp_path, fake_command(), proxy_args=["--config", str(config)]) as gw:
        await gw.initialize()
        trees = []
        for _ in range(2):
            session = await gw.new_session()
            assert (await gw.prompt(session, "spawn_tree"))["result"]["stopReason"] == "end_turn"
            trees.append((await gw.request("_fake/pids"))["result"])
        assert len(install_cgroups(state)) == 1
        gw.signal(signal.SIGKILL)
        await gw.process.wait()
    assert await survivors([pid for tree in trees for pid in (tree["adapter"], *tree["children"])]) == []
    with anyio.fail_after(GONE_WITHIN):
        while install_cgroups(state):
            await anyio.sleep(0.02)
    assert len(cgroups.recorded_instances(state)) == 1, "the record stays, for the next proxy to drop"


def _leases(state: Path) -> list[Lease]:
    """The install's leases, read on a connection of their own."""
    db = StateDB(state, create=False)
    try:
        return all_leases(db)
    finally:
        db.close()


@needs_cgroups
@pytest.mark.anyio
@pytest.mark.parametrize("setting", ["auto", "required"])
async def test_a_wrapper_that_cannot_join_its_cgroup(
    proc_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    """The wrapper reports that it could not join (here: the tree's cgroup was never made). With
    ``auto`` the tree runs, owned by marker only, and is stopped as ever; ``required`` fails the start."""
    monkeypatch.setattr(InstanceCgroup, "create_tree", lambda self, lease_id: self.tree(lease_id))
    owner = Owner.start(tmp_path / "state", grace=0.5, cgroups=setting)  # type: ignore[arg-type]
    try:
        start = SupervisedProcess.start(
            owner, backend="fake", argv=["sleep", "600"], env=proc_env, cwd=None, term_grace=0.5
        )
        if setting == "required":
            with pytest.raises(WrapperFailed, match=r"cannot join cgroup .*: No such file or directory"):
                await start
        else:
            supervised = await start
            assert supervised.adapter_pid is not None
            assert pid_alive(supervised.adapter_pid)
            await supervised.stop(stdin_grace=0.1, term_grace=0.5)
            assert await survivors([supervised.adapter_pid]) == []
    finally:
        owner.close()
    (lease,) = _leases(tmp_path / "state")
    assert lease.state is LeaseState.CLOSED, lease


# --- dead proxies' cgroups -------------------------------------------------------------------


@needs_cgroups
def test_a_dead_proxys_cgroup_is_cleared_by_the_next_one(proc_env: dict[str, str], tmp_path: Path) -> None:
    """A proxy dies with a tree running in its lease's cgroup (its wrapper gone, the process in it
    unmarked): a dry run names it and kills nothing; the next proxy of the install kills it with
    cgroup.kill, records the lease closed and removes the cgroups."""
    state = tmp_path / "state"
    dead = Owner.start(state, grace=0.5, cgroups="required")
    assert dead.cgroup is not None
    lease = create_lease(dead.db, instance_id=dead.instance_id, boot_id=dead.boot_id, backend="fake", argv=("x",))
    tree = dead.cgroup.create_tree(lease.lease_id)
    unmarked = subprocess.Popen(
        ["setsid", "env", "-i", f"{MARKER_VARIABLE}={proc_env[MARKER_VARIABLE]}", "sleep", "600"]
    )
    try:
        (tree / "cgroup.procs").write_text(str(unmarked.pid))
        dead.db.stop_writer()
        os.close(dead.instance.lock_fd)  # it died: its lock can be taken
        dead.db.close()
        looker = StateDB(state)
        try:
            (looked,) = reap_dead_instances(looker, None, grace=0.1, dry_run=True)
        finally:
            looker.close()
        assert looked.signalled == [unmarked.pid]
        assert unmarked.poll() is None, "a dry run kills nothing"
        successor = Owner.start(state, grace=0.5, cgroups="auto")
        try:
            assert unmarked.wait(timeout=GONE_WITHIN) == -signal.SIGKILL
            (reaped,) = successor.reaped
            assert (reaped.after, reaped.signalled) == ("closed", [unmarked.pid])
            assert not Path(dead.cgroup.path).exists()
            assert cgroups.recorded_instances(state) == [successor.instance_id]
        finally:
            successor.close()
    finally:
        if unmarked.poll() is None:
            unmarked.kill()
            unmarked.wait()
    assert install_cgroups(state) == []


@needs_cgroups
def test_a_cgroup_the_proxy_did_not_make_is_never_touched(proc_env: dict[str, str], tmp_path: Path) -> None:
    """A dead instance's record names a cgroup of another name, with a process in it: the reaper
    leaves both alone and drops the record."""
    state = tmp_path / "state"
    dead = Owner.start(state, grace=0.5, cgroups="off")
    foreign = Path(HERE.base or "", f"not-acp-proxy-{os.getpid()}-{time.monotonic_ns()}")
    foreign.mkdir()
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env=proc_env)
    try:
        (foreign / "cgroup.procs").write_text(str(decoy.pid))
        cgroups.record_path(state, dead.instance_id).write_text(str(foreign))
        os.close(dead.instance.lock_fd)
        dead.db.close()
        successor = Owner.start(state, grace=0.5, cgroups="off")
        successor.close()
        assert decoy.poll() is None, "a process in a cgroup the proxy did not make was killed"
        assert foreign.is_dir()
        assert cgroups.recorded_instances(state) == []
    finally:
        decoy.kill()
        decoy.wait()
        deadline = time.monotonic() + GONE_WITHIN
        while cgroups.populated(foreign) and time.monotonic() < deadline:
            time.sleep(0.02)
        foreign.rmdir()


@needs_cgroups
def test_an_ended_instance_that_could_not_remove_its_cgroup_is_cleared_later(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """An instance recorded ended whose cgroup is still there (its removal failed) is no longer in the
    instances to reap, but its record is: the next proxy removes it."""
    state = tmp_path / "state"
    ended = Owner.start(state, grace=0.5, cgroups="required")
    assert ended.cgroup is not None
    leftover = ended.cgroup
    leftover.create_tree("an-ended-tree")
    ended.cgroup = None  # its exit leaves the cgroup and the record in place
    ended.close()
    assert Path(leftover.path).is_dir()
    assert cgroups.recorded_instances(state) == [ended.instance_id]
    assert not instances.instance_alive(StateDB(state, create=False), ended.instance_id)
    successor = Owner.start(state, grace=0.5, cgroups="off")
    successor.close()
    assert not Path(leftover.path).exists()
    assert cgroups.recorded_instances(state) == []
    assert marked_processes(proc_env[MARKER_VARIABLE]) == {}


@needs_cgroups
def test_a_process_that_joins_as_its_cgroup_is_removed_is_killed_and_the_cgroup_removed(
    proc_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dead proxy's wrapper still starting joins its tree's cgroup after the reaper found it empty:
    the removal fails (EBUSY), and the reaper kills the newcomer and removes the cgroup after all."""
    owner = Owner.start(tmp_path / "state", grace=0.5, cgroups="required")
    try:
        assert owner.cgroup is not None
        tree = owner.cgroup.create_tree("late-joiner")
        newcomer = subprocess.Popen(["sleep", "60"], env=proc_env)
        real_rmdir = Path.rmdir
        joined: list[int] = []

        def join_first(self: Path) -> None:
            if self == tree and not joined:
                self.joinpath("cgroup.procs").write_text(str(newcomer.pid))  # between the check and the removal
                joined.append(newcomer.pid)
            real_rmdir(self)

        monkeypatch.setattr(Path, "rmdir", join_first)
        cleared = owner.cgroup.clear_tree("late-joiner", timeout=5.0)
        monkeypatch.undo()
        assert joined == [newcomer.pid]
        assert cleared.error == ""
        assert cleared.removed
        assert newcomer.pid in cleared.killed
        assert newcomer.wait(timeout=5) == -signal.SIGKILL
        assert not tree.exists()
    finally:
        owner.close()


def test_instance_cgroup_names_carry_install_and_instance() -> None:
    assert cgroups.instance_name("0f1e", "9a61") == "acp-proxy.0f1e.9a61"
    assert InstanceCgroup("/cg/acp-proxy.0f1e.9a61").tree("4f1c") == Path("/cg/acp-proxy.0f1e.9a61/4f1c")


# --- the wrapper's own removal of its cgroups, in-process (directories stand in for cgroups) ---------------


class _BusyFor:
    """``os.rmdir`` that fails ``EBUSY`` for a directory its first ``times`` tries, as the kernel does while it
    lets a cgroup's last processes go."""

    def __init__(self, times: int) -> None:
        self.times = times
        self.tries: list[str] = []
        self.rmdir = os.rmdir

    def __call__(self, path: str) -> None:
        self.tries.append(path)
        if self.tries.count(path) <= self.times:
            raise OSError(errno.EBUSY, "Device or resource busy", path)
        self.rmdir(path)


@pytest.mark.parametrize(
    ("other_tree", "busy", "left"),
    [
        (False, 0, []),  # the last tree: its cgroup and the instance's go
        (True, 0, ["instance", "instance/other"]),  # another tree lives: the instance's stays for it
        (False, 3, []),  # busy a moment after the move out: tried again
        (False, 10_000, ["instance", "instance/tree"]),  # busy past the patience: left to the reaper
    ],
)
def test_a_wrapper_removes_its_trees_cgroup_and_the_instances_when_it_was_the_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, other_tree: bool, busy: int, left: list[str]
) -> None:
    instance = tmp_path / "instance"
    (instance / "tree").mkdir(parents=True)
    if other_tree:
        (instance / "other").mkdir()
    rmdir = _BusyFor(busy)
    monkeypatch.setattr(adapter_wrapper_core.os, "rmdir", rmdir)
    monkeypatch.setattr(adapter_wrapper_core, "move_to_cgroup", lambda directory: None)
    monkeypatch.setattr(adapter_wrapper_core, "EMPTY_PATIENCE", 0.3)
    adapter_wrapper_core.leave_cgroup(str(instance / "tree"))
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == left
