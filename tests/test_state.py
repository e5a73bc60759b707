"""The state database, instance locks, and the operator views over them."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from acp_proxy.ownership import instances
from acp_proxy.ownership.leases import LeaseState, all_leases, create_lease, prune_ended, set_state
from acp_proxy.ownership.proctable import ProcFS, PsutilTable
from acp_proxy.ownership.reaping import marker_index
from acp_proxy.ownership.supervised import WrapperReport
from acp_proxy.ownership.verify import Claim, Verdict, check_claim, send_verified_signal
from acp_proxy.state import StateDB
from acp_proxy.state.connection import StateError
from acp_proxy.state.migrations import SCHEMA_VERSION
from tests.support import run_program, run_together
from wrappers import adapter_wrapper_core


def test_state_dir_and_database_are_private(tmp_path: Path) -> None:
    state = tmp_path / "state"
    db = StateDB(state)
    db.close()
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert stat.S_IMODE((state / "state.db").stat().st_mode) == 0o600
    conn = sqlite3.connect(state / "state.db")
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_install_id_is_created_once(tmp_path: Path) -> None:
    first = StateDB(tmp_path)
    second = StateDB(tmp_path)
    assert first.install_id == second.install_id
    assert StateDB(tmp_path / "other").install_id != first.install_id


def test_a_world_writable_state_dir_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "shared"
    state.mkdir()
    state.chmod(0o777)
    with pytest.raises(StateError, match="writable by other users"):
        StateDB(state)


def test_a_newer_schema_is_refused_not_rewritten(tmp_path: Path) -> None:
    StateDB(tmp_path).close()
    conn = sqlite3.connect(tmp_path / "state.db")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 5}")
    conn.close()
    with pytest.raises(StateError, match="upgrade acp-proxy"):
        StateDB(tmp_path)


def test_a_corrupt_database_is_reported_with_a_way_out(tmp_path: Path) -> None:
    tmp_path.chmod(0o700)
    (tmp_path / "state.db").write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StateError, match="move it aside"):
        StateDB(tmp_path)
    assert (tmp_path / "state.db").read_bytes().startswith(b"this is not sqlite"), "data must never be wiped"


WRITE_LEASES = """
import sys
from pathlib import Path
from acp_proxy.ownership import instances
from acp_proxy.ownership.leases import LeaseState, create_lease, set_state
from acp_proxy.state import StateDB
sys.stdin.readline()
db = StateDB(Path(sys.argv[1]))
instance = instances.start_instance(db, "boot")
for n in range(int(sys.argv[2])):
    lease = create_lease(db, instance_id=instance.instance_id, boot_id="boot", backend="b", argv=(str(n),))
    set_state(db, lease.lease_id, LeaseState.OPEN)
instances.end_instance(db, instance)
"""

OPEN_FRESH = """
import sys
from pathlib import Path
from acp_proxy.ownership import instances
from acp_proxy.state import StateDB
sys.stdin.readline()
db = StateDB(Path(sys.argv[1]))
instances.start_instance(db, "boot")
print(db.install_id)
"""


def test_proxies_creating_the_database_at_once_all_succeed(proc_env: dict[str, str], tmp_path: Path) -> None:
    """Several proxies started together on a new state dir: none fails, one install id."""
    fresh = [[str(tmp_path / "new")]] * 6
    install_ids = {printed.strip() for printed in run_together(OPEN_FRESH, fresh, proc_env)}
    assert len(install_ids) == 1
    assert "" not in install_ids


def test_opening_waits_for_a_proxy_that_is_creating_the_database(tmp_path: Path) -> None:
    """Switching to WAL does not wait on SQLite's busy handler; opening must wait anyway."""
    tmp_path.chmod(0o700)
    creator = sqlite3.connect(tmp_path / "state.db", isolation_level=None)
    creator.execute("BEGIN IMMEDIATE")  # another proxy, mid-way through creating the schema
    creator.execute("CREATE TABLE scratch (x)")
    opened: list[str] = []
    failed: list[BaseException] = []

    def open_it() -> None:
        try:
            opened.append(StateDB(tmp_path).install_id)
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=open_it)
    thread.start()
    time.sleep(0.3)
    assert (opened, failed) == ([], []), "it should be waiting for the write lock"
    creator.execute("COMMIT")
    thread.join(30)
    assert failed == []
    assert len(opened) == 1


def test_a_database_up_to_date_opens_while_another_process_holds_its_write_lock(tmp_path: Path) -> None:
    """Readers (the operator's commands) are not held up by a proxy in a long write, or stopped in one."""
    tmp_path.chmod(0o700)
    install_id = StateDB(tmp_path).install_id
    holder = sqlite3.connect(tmp_path / "state.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("INSERT INTO meta (key, value) VALUES ('unfinished', 'write')")
    try:
        reader = StateDB(tmp_path, create=False)
        assert reader.install_id == install_id
        assert reader.conn.execute("SELECT COUNT(*) FROM meta WHERE key = 'unfinished'").fetchone()[0] == 0
        reader.close()
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_concurrent_writers_share_one_database(proc_env: dict[str, str], tmp_path: Path) -> None:
    StateDB(tmp_path).close()
    run_together(WRITE_LEASES, [[str(tmp_path), "50"]] * 4, proc_env)
    db = StateDB(tmp_path)
    assert len(all_leases(db, limit=1000)) == 200
    assert db.conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_instance_lock_proves_liveness(proc_env: dict[str, str], tmp_path: Path) -> None:
    db = StateDB(tmp_path)
    mine = instances.start_instance(db, "boot")
    assert instances.instance_alive(db, mine.instance_id)
    code = (
        "import sys, time; sys.path.insert(0, sys.argv[2]);"
        "from pathlib import Path; from acp_proxy.state import StateDB; from acp_proxy.ownership import instances;"
        "db = StateDB(Path(sys.argv[1])); i = instances.start_instance(db, 'boot');"
        "print(i.instance_id, flush=True); time.sleep(60)"
    )
    other = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path), str(Path(__file__).parent.parent)],
        stdout=subprocess.PIPE,
        env=proc_env,
        text=True,
    )
    assert other.stdout is not None
    other_id = other.stdout.readline().strip()
    assert instances.instance_alive(db, other_id)
    with instances.lock_if_dead(db, other_id) as dead:
        assert not dead
    other.send_signal(signal.SIGKILL)
    other.wait()
    assert not instances.instance_alive(db, other_id)
    # Another proxy probing the dead instance at this very moment does not make it look alive.
    probe = os.open(instances.lock_path(db, other_id), os.O_RDONLY)
    try:
        fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)
        assert not instances.instance_alive(db, other_id)
    finally:
        os.close(probe)
    assert set(instances.other_instances(db, mine.instance_id)) == {other_id}
    with instances.lock_if_dead(db, other_id) as dead:
        assert dead
        # While it is reaped, it reads as dead to every other proxy (which then takes over its sessions),
        # and a second reaper keeps off.
        assert not instances.instance_alive(db, other_id)
        with instances.lock_if_dead(db, other_id) as again:
            assert not again
    instances.end_instance(db, mine)


def test_lease_state_machine_never_reopens_a_closed_lease(tmp_path: Path) -> None:
    db = StateDB(tmp_path)
    lease = create_lease(db, instance_id="i", boot_id="b", backend="x", argv=("x", "a b"))
    assert lease.state is LeaseState.STARTING
    assert lease.marker.startswith(f"ACP_PROXY_LEASE={db.install_id}.{lease.lease_id}.")
    assert lease.argv == ("x", "a b")
    assert set_state(db, lease.lease_id, LeaseState.OPEN)
    assert set_state(db, lease.lease_id, LeaseState.CLOSED)
    assert not set_state(db, lease.lease_id, LeaseState.OPEN)
    assert all_leases(db)[0].state is LeaseState.CLOSED


# (from, to, allowed): forward only; a stop that began while the adapter was starting is not undone by "ready".
LEASE_TRANSITIONS = [
    (LeaseState.STARTING, LeaseState.OPEN, True),
    (LeaseState.STARTING, LeaseState.CLOSING, True),
    (LeaseState.STARTING, LeaseState.CLOSED, True),
    (LeaseState.OPEN, LeaseState.CLOSING, True),
    (LeaseState.OPEN, LeaseState.LOST, True),
    (LeaseState.CLOSING, LeaseState.OPEN, False),
    (LeaseState.CLOSING, LeaseState.CLOSED, True),
    (LeaseState.CLOSING, LeaseState.UNVERIFIABLE, True),
    (LeaseState.CLOSED, LeaseState.CLOSING, False),
    (LeaseState.LOST, LeaseState.CLOSED, False),
    (LeaseState.UNVERIFIABLE, LeaseState.CLOSED, False),
    (LeaseState.OPEN, LeaseState.STARTING, False),
]


@pytest.mark.parametrize(("start", "target", "allowed"), LEASE_TRANSITIONS)
def test_lease_transitions(tmp_path: Path, start: LeaseState, target: LeaseState, allowed: bool) -> None:
    db = StateDB(tmp_path)
    lease = create_lease(db, instance_id="i", boot_id="b", backend="x", argv=("x",))
    path = {
        LeaseState.STARTING: [],
        LeaseState.OPEN: [LeaseState.OPEN],
        LeaseState.CLOSING: [LeaseState.OPEN, LeaseState.CLOSING],
    }.get(start, [start])
    for step in path:
        assert set_state(db, lease.lease_id, step)
    assert all_leases(db)[0].state is start
    assert set_state(db, lease.lease_id, target) is allowed
    assert all_leases(db)[0].state is (target if allowed else start)


def test_degraded_psutil_path_verifies_the_same_way(proc_env: dict[str, str]) -> None:
    """The no-/proc path (macOS): psutil identity, then os.kill; fail closed likewise."""
    table = PsutilTable()
    marker_value = "degraded.lease.1"
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env={**proc_env, "ACP_PROXY_LEASE": marker_value}
    )
    try:
        time.sleep(0.1)
        info = table.info(proc.pid)
        assert info is not None
        claim = Claim(proc.pid, table.boot_id(), os.getuid(), f"ACP_PROXY_LEASE={marker_value}", info.start_ticks)
        assert check_claim(claim, table).verdict is Verdict.OURS
        reused = Claim(proc.pid, claim.boot_id, os.getuid(), claim.marker, info.start_ticks + 1)
        assert not send_verified_signal(reused, signal.SIGTERM, table).signalled
        assert proc.poll() is None
        assert send_verified_signal(claim, signal.SIGTERM, table).signalled
        assert proc.wait(timeout=5) == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_leases_command_shows_the_owned_tree(proc_env: dict[str, str], tmp_path: Path) -> None:
    fake = [sys.executable, str(Path(__file__).parent / "fake_adapter.py"), "{}"]
    proxy = subprocess.Popen(
        [sys.executable, "-m", "acp_proxy", "--", *fake], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=proc_env
    )
    assert proxy.stdin is not None
    assert proxy.stdout is not None
    try:
        for n, (method, params) in enumerate(
            [
                ("initialize", {"protocolVersion": 1}),
                ("session/new", {"cwd": "/tmp", "mcpServers": []}),
            ]
        ):
            proxy.stdin.write(
                json.dumps({"jsonrpc": "2.0", "id": n, "method": method, "params": params}).encode() + b"\n"
            )
            proxy.stdin.flush()
            proxy.stdout.readline()
        shown = run_program(proc_env, "leases", "--json")
        assert shown.returncode == 0, shown.stderr
        view = json.loads(shown.stdout)
        (lease,) = view["leases"]
        assert lease["state"] == "open"
        assert lease["instanceAlive"] is True
        pids = {p["pid"] for p in lease["processes"]}
        assert {lease["wrapperPid"], lease["adapterPid"]} <= pids
        assert all(p["rssBytes"] > 0 and p["command"] for p in lease["processes"])
        human = run_program(proc_env, "leases")
        assert lease["lease"] in human.stdout
        assert "(alive)" in human.stdout
        assert "ownership: full" in human.stdout
    finally:
        proxy.stdin.close()
        proxy.wait(timeout=30)
    after = json.loads(run_program(proc_env, "leases", "--json").stdout)
    assert after["leases"][0]["state"] == "closed"
    assert after["leases"][0]["processes"] == []


@pytest.mark.parametrize("command", [["leases"], ["leases", "--json"], ["reap"], ["reap", "--dry-run", "--json"]])
def test_operator_commands_on_an_empty_state_dir(proc_env: dict[str, str], command: list[str]) -> None:
    result = run_program(proc_env, *command)
    assert result.returncode == 0, result.stderr
    if "--json" in command:
        json.loads(result.stdout)
    assert not Path(proc_env["ACP_PROXY_STATE_DIR"]).exists(), "read-only commands must not create state"


def test_boot_id_is_read_from_the_kernel() -> None:
    assert len(ProcFS().boot_id()) == 36


@settings(max_examples=200)
@given(
    pid=st.integers(min_value=1, max_value=2**31),
    ticks=st.none() | st.integers(min_value=0, max_value=2**62),
    subreaper=st.booleans(),
    error=st.none() | st.text(),
    cgroup_error=st.none() | st.text(),
)
def test_wrapper_report_is_json_the_proxy_can_decode(
    pid: int, ticks: int | None, subreaper: bool, error: str | None, cgroup_error: str | None
) -> None:
    """The wrapper writes its report without the json module (start-up time); it must still be JSON."""
    line = adapter_wrapper_core.report_line(pid, ticks, subreaper, error, cgroup_error)
    report = msgspec.json.decode(line, type=WrapperReport)
    assert report == WrapperReport(
        adapter_pid=pid, pgid=pid, start_ticks=ticks, subreaper=subreaper, error=error, cgroup_error=cgroup_error
    )


def test_wrapper_report_survives_undecodable_paths() -> None:
    error = "cannot run '/opt/caf\udce9/agent': No such file or directory"  # surrogateescape'd byte
    report = msgspec.json.decode(adapter_wrapper_core.report_line(7, None, True, error), type=WrapperReport)
    assert report.error == "cannot run '/opt/caf\ufffd/agent': No such file or directory"


WRAPPERS = Path(adapter_wrapper_core.__file__).parent
SUBREAPER_PROBE = """
import ctypes, sys
sys.path.insert(0, sys.argv[1])
import adapter_wrapper_core as adapter_wrapper
if sys.argv[2] == "fallback":
    def broken():
        raise AttributeError("no such private interface here")
    adapter_wrapper._libc_prctl = broken
set_ok = adapter_wrapper.set_subreaper()
flag = ctypes.c_int(-1)
ctypes.CDLL(None).prctl(37, ctypes.byref(flag), 0, 0, 0)  # PR_GET_CHILD_SUBREAPER
print(set_ok, flag.value)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a child subreaper is a Linux feature")
@pytest.mark.parametrize("path", ["_ctypes", "fallback"])
def test_the_wrapper_makes_itself_a_subreaper(proc_env: dict[str, str], path: str) -> None:
    """Through ``_ctypes`` alone, or through ``ctypes`` where that private interface fails."""
    probe = subprocess.run(
        [sys.executable, "-I", "-S", "-c", SUBREAPER_PROBE, str(WRAPPERS), path],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        env=proc_env,
    )
    assert probe.stdout.split() == ["True", "1"]


def test_the_wrapper_imports_nothing_that_slows_its_start(proc_env: dict[str, str]) -> None:
    """The wrapper's start is paid for by every adapter start: no ``typing``, ``enum`` (the ``signal``
    module's), ``ctypes`` or ``collections``; the interpreter alone is most of its cost."""
    probe = subprocess.run(
        [
            sys.executable,
            "-I",
            "-S",
            "-c",
            "import sys; sys.path.insert(0, sys.argv[1]); import adapter_wrapper_core as w; w.set_subreaper(); "
            "print(' '.join(sorted(sys.modules)))",
            str(WRAPPERS),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        env=proc_env,
    )
    loaded = set(probe.stdout.split())
    assert "adapter_wrapper_core" in loaded
    assert loaded.isdisjoint({"typing", "enum", "signal", "ctypes", "collections", "json", "re"})


TREE_PROBE = """
import json, os, signal, subprocess, sys, threading, time
sys.path.insert(0, sys.argv[1])
import adapter_wrapper_core as wrapper
sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); "
                          "time.sleep(60)", *sleep])
from_thread, done = [], threading.Event()
def fork_and_stay():  # a child is listed under the thread that forked it, while that thread lives
    from_thread.append(subprocess.Popen(sleep))
    done.wait()
thread = threading.Thread(target=fork_and_stay)
thread.start()
zombie = subprocess.Popen([sys.executable, "-I", "-S", "-c", "pass"])
deadline = time.monotonic() + 20
while time.monotonic() < deadline:
    stat = wrapper.read_stat(zombie.pid)
    grandchildren = [pid for pid, depth in wrapper.descendants(os.getpid()) if depth == 2]
    if from_thread and stat is not None and stat[0] == "Z" and grandchildren:
        break
    time.sleep(0.01)
by_children = wrapper.descendants(os.getpid())
wrapper._children_files[:] = [False]
by_parents = wrapper.descendants(os.getpid())
print(json.dumps({"child": child.pid, "from_thread": from_thread[0].pid, "zombie": zombie.pid,
                  "by_children": sorted(by_children), "by_parents": sorted(by_parents)}), flush=True)
done.set()
os.killpg(0, signal.SIGKILL)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the tree is read from Linux's /proc")
def test_the_wrapper_reads_its_tree_from_child_links_as_from_parent_links(proc_env: dict[str, str]) -> None:
    """The wrapper walks its tree down ``/proc/PID/task/TID/children`` (the tree alone, however many
    processes the host has); every process's parent link, read where that file is missing, finds the
    same tree: a child, its child, a child forked by another thread, and no zombie."""
    probe = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", TREE_PROBE, str(WRAPPERS)],
        stdout=subprocess.PIPE,
        text=True,
        env=proc_env,
        start_new_session=True,  # its group, the whole tree, is SIGKILLed when it has answered
    )
    out, _ = probe.communicate(timeout=30)
    found = json.loads(out)
    by_children = [tuple(entry) for entry in found["by_children"]]
    assert by_children == [tuple(entry) for entry in found["by_parents"]]
    assert {pid for pid, depth in by_children if depth == 1} == {found["child"], found["from_thread"]}
    assert len([pid for pid, depth in by_children if depth == 2]) == 1
    assert len(by_children) == 3  # the zombie is not counted


def test_one_scan_indexes_every_marker(proc_env: dict[str, str]) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)"], env={**proc_env, "ACP_PROXY_LEASE": value}
        )
        for value in ("a.lease.1", "a.lease.1", "b.lease.2")
    ]
    try:
        time.sleep(0.2)
        index = marker_index(ProcFS())
        assert sorted(index["ACP_PROXY_LEASE=a.lease.1"]) == sorted(p.pid for p in procs[:2])
        assert index["ACP_PROXY_LEASE=b.lease.2"] == [procs[2].pid]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_prune_ended_deletes_only_old_closed_and_lost_leases_and_is_idempotent(tmp_path: Path) -> None:
    db = StateDB(tmp_path / "state")
    week = 7 * 86400.0
    moment = time.time()
    ages = {"closed": week + 60, "lost": week + 60, "unverifiable": week + 60, "open": week + 60}
    leases = {}
    for state, age in [*ages.items(), ("recent-closed", week - 60)]:
        lease = create_lease(db, instance_id="i", boot_id="b", backend="x", argv=(state,))
        with db.transaction() as conn:
            conn.execute(
                "UPDATE leases SET state = ?, updated_at = ? WHERE lease_id = ?",
                (state.removeprefix("recent-"), moment - age, lease.lease_id),
            )
        leases[state] = lease.lease_id
    assert prune_ended(db, week, at=moment) == 2
    assert prune_ended(db, week, at=moment) == 0
    kept = {row[0] for row in db.conn.execute("SELECT lease_id FROM leases")}
    assert kept == {leases["unverifiable"], leases["open"], leases["recent-closed"]}
