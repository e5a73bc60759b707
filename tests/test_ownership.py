"""Process ownership, scenario by scenario, with real processes.

Two tables. ``TEARDOWN`` drives a real proxy and adapter through a way of ending
and checks that every process the adapter started is gone and how its lease
ended. ``REAPING`` fabricates leases of a dead proxy that point at real
processes (decoys that are *not* ours, zombies, vanished pids) and checks that
the reaper signals nothing it cannot prove it owns. Decoys run through every
test and must survive it. ``session/cancel`` never reaping is covered in
``test_relay.test_session_cancel_ends_the_turn_and_keeps_the_adapter``.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_proxy import journal
from acp_proxy.ownership import cgroups, instances, leases
from acp_proxy.ownership.leases import Lease, LeaseState, all_leases, create_lease
from acp_proxy.ownership.owner import Owner
from acp_proxy.ownership.proctable import ProcessInfo, ProcFS, TableUnavailable
from acp_proxy.ownership.reaping import reap_lease
from acp_proxy.ownership.supervised import SupervisedProcess
from acp_proxy.ownership.verify import Claim, Verdict, check_claim, send_verified_signal
from acp_proxy.sessions.registry import SessionState
from acp_proxy.state import StateDB
from tests.kit.state import record_spawn
from tests.support import (
    GONE_WITHIN,
    MARKER_VARIABLE,
    Gateway,
    cli,
    cli_json,
    fake_command,
    marked_processes,
    pid_alive,
    registry,
    send_prompt,
    survivors,
    wait_for_task,
)

FAST = '[shutdown]\nstdin_grace = "300ms"\nterm_grace = "1s"\n[backends.fake]\ncommand = ["unused"]\n'
HERE = cgroups.detect("auto")
MODES = {"markers": "off", "cgroup": "required"}
"""Each ownership mode, and the ``[ownership] cgroups`` setting that asks for it."""


def state_dir(env: dict[str, str]) -> Path:
    return Path(env["ACP_PROXY_STATE_DIR"])


def read_leases(env: dict[str, str]) -> list[Lease]:
    db = StateDB(state_dir(env), create=False)
    try:
        return all_leases(db)
    finally:
        db.close()


@dataclass
class Decoys:
    """Processes the proxy did not start, one of them dressed up as a lease's descendant."""

    env: dict[str, str]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, extra_env: dict[str, str] | None = None) -> int:
        proc = subprocess.Popen(["sleep", "600"], env={**self.env, **(extra_env or {})})
        self.procs.append(proc)
        return proc.pid

    def assert_untouched(self) -> None:
        for proc in self.procs:
            assert proc.poll() is None, f"decoy {proc.pid} was signalled"

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


@pytest.fixture
def decoys(proc_env: dict[str, str]) -> Iterator[Decoys]:
    found = Decoys(proc_env)
    found.start()
    found.start({"ACP_PROXY_LEASE": "someone-else.lease.marker"})
    yield found
    found.assert_untouched()
    found.stop()


# --- teardown scenarios, through a real proxy -----------------------------------------------


@dataclass(frozen=True)
class Ending:
    id: str
    sentence: str
    script: str
    ending: str
    options: dict[str, Any] = field(default_factory=dict)
    extra_argv: tuple[str, ...] = ()


TEARDOWN = [
    Ending("eof", "the gateway closes stdin: the whole tree is reaped", "spawn_tree", "eof"),
    Ending(
        "adapter-exits",
        "the adapter exits leaving a child and a grandchild: they are killed",
        "spawn_tree",
        "adapter-exits",
    ),
    Ending("escape", "a grandchild escapes with setsid + double fork: it is killed", "spawn_tree; escape", "eof"),
    Ending(
        "ignores-sigterm",
        "the adapter ignores stdin EOF and SIGTERM: escalation to SIGKILL",
        "spawn_tree",
        "eof",
        {"ignore_eof": True, "ignore_sigterm": True},
    ),
    Ending(
        "ignores-eof", "the adapter ignores stdin EOF: it is still reaped", "spawn_tree", "eof", {"ignore_eof": True}
    ),
    Ending("keeps-forking", "the adapter's child keeps forking: stopped, then killed", "fork_loop", "eof"),
    Ending(
        "odd-argv",
        "argv with spaces and quotes, and a rewritten process title: cleanup still works",
        "spawn_tree",
        "eof",
        {"title": "claude"},
        ("an arg with spaces", "q\"uo'te", "$(not a shell)"),
    ),
    Ending("sigterm", "the proxy gets SIGTERM: in-flight answered, tree reaped", "spawn_tree; escape", "sigterm"),
    Ending(
        "proxy-sigkilled",
        "the proxy is SIGKILLed: the wrapper reaps the tree; the next start marks the lease closed",
        "spawn_tree; escape",
        "kill-proxy",
        {"ignore_sigterm": True},
    ),
    Ending(
        "wrapper-sigkilled",
        "the wrapper is SIGKILLed: the live proxy sweeps the orphans by marker",
        "spawn_tree; escape",
        "kill-wrapper",
    ),
    Ending(
        "wrapper-and-proxy-sigkilled",
        "wrapper and proxy are SIGKILLed: the next start sweeps the orphans by marker",
        "spawn_tree; escape",
        "kill-wrapper-and-proxy",
    ),
]


async def assert_resumed_on_a_new_process(gw: Gateway, env: dict[str, str], session: str, dead_pid: int) -> None:
    """A session whose process died is suspended, not lost: the next prompt resumes it elsewhere.

    The prompt is sent once the proxy has seen the death (its row says suspended): a prompt that
    races the death itself is answered as the process's other requests are (``adapter_exited``).
    """
    rows = registry(env)
    try:
        with anyio.fail_after(GONE_WITHIN):
            while (found := rows.get(session)) is None or found.state is not SessionState.SUSPENDED:
                await anyio.sleep(0.02)
    finally:
        rows.db.close()
    assert (await gw.prompt(session, "stream 1"))["result"]["stopReason"] == "end_turn"
    assert (await gw.request("_fake/pids"))["result"]["adapter"] != dead_pid


@pytest.mark.anyio
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("row", TEARDOWN, ids=[row.id for row in TEARDOWN])
async def test_teardown(proc_env: dict[str, str], tmp_path: Path, decoys: Decoys, row: Ending, mode: str) -> None:
    """Every way of ending, in each ownership mode (cgroup mode where this process can have it)."""
    if mode == "cgroup" and HERE.mode != "cgroup":
        pytest.skip(f"cgroup mode is not available to this process: {HERE.reason}")
    config = tmp_path / "fast.toml"
    config.write_text(FAST + f'[ownership]\ncgroups = "{MODES[mode]}"\n')
    adapter = [*fake_command(**row.options), *row.extra_argv]
    proxy_args = ["--config", str(config)]
    async with Gateway.start(proc_env, tmp_path, adapter, proxy_args=proxy_args) as gw:
        await gw.initialize()
        session = await gw.new_session()
        assert (await gw.prompt(session, row.script))["result"]["stopReason"] == "end_turn"
        pids = (await gw.request("_fake/pids"))["result"]
        tree = [pids["adapter"], *pids["children"]]
        assert all(pid_alive(p) for p in tree)
        (lease,) = [lease for lease in read_leases(proc_env) if lease.state is LeaseState.OPEN]
        assert lease.adapter_pid == pids["adapter"]
        assert lease.argv[-len(row.extra_argv) or len(lease.argv) :] == row.extra_argv
        if row.ending == "eof":
            assert await gw.close() == 0
        elif row.ending == "adapter-exits":
            crashed = await gw.prompt(session, "crash 0")
            assert crashed["error"]["data"]["reason"] == "adapter_exited"
            assert await survivors(tree) == []
            await assert_resumed_on_a_new_process(gw, proc_env, session, pids["adapter"])
        elif row.ending == "sigterm":
            gw.signal(signal.SIGTERM)
            with anyio.fail_after(GONE_WITHIN):
                assert await gw.process.wait() == 0
        elif row.ending == "kill-proxy":
            gw.signal(signal.SIGKILL)
            await gw.process.wait()
        elif row.ending == "kill-wrapper":
            assert lease.wrapper_pid is not None
            os.kill(lease.wrapper_pid, signal.SIGKILL)
            assert await survivors(tree) == []
            await assert_resumed_on_a_new_process(gw, proc_env, session, pids["adapter"])
        elif row.ending == "kill-wrapper-and-proxy":
            assert lease.wrapper_pid is not None
            gw.signal(signal.SIGSTOP)  # so that it cannot sweep before it dies
            os.kill(lease.wrapper_pid, signal.SIGKILL)
            gw.signal(signal.SIGKILL)
            await gw.process.wait()
            await anyio.sleep(0.3)
            orphans = [p for p in pids["children"] if pid_alive(p)]
            assert orphans, "with wrapper and proxy dead, the orphans wait for the next start"
    if row.ending in ("kill-proxy", "kill-wrapper-and-proxy"):
        # The next proxy of the same install reaps what the dead one left.
        async with Gateway.start(proc_env, tmp_path, proxy_args=proxy_args) as next_gw:
            await next_gw.initialize()
    assert await survivors(tree) == []
    ended = {lease.lease_id: lease for lease in read_leases(proc_env)}[lease.lease_id]
    assert ended.state is LeaseState.CLOSED, ended
    assert cgroups.recorded_instances(state_dir(proc_env)) == [], "every cgroup the proxies made is removed"


@pytest.mark.anyio
async def test_sigkilled_proxy_beside_a_live_one(proc_env: dict[str, str], tmp_path: Path, decoys: Decoys) -> None:
    """Two proxies share a state dir; one is SIGKILLed: its tree is reaped, the other's is untouched."""
    config = tmp_path / "fast.toml"
    config.write_text(FAST)
    args = ["--config", str(config)]
    async with (
        Gateway.start(proc_env, tmp_path, proxy_args=args) as live,
        Gateway.start(proc_env, tmp_path, proxy_args=args) as doomed,
    ):
        trees = {}
        for gw in (live, doomed):
            await gw.initialize()
            await gw.prompt(await gw.new_session(), "spawn_tree; escape")
            pids = (await gw.request("_fake/pids"))["result"]
            trees[gw.pid] = [pids["adapter"], *pids["children"]]
        doomed.signal(signal.SIGSTOP)  # its wrapper alone must not get the chance: the reaper must act
        doomed_leases = [lease for lease in read_leases(proc_env) if lease.adapter_pid == trees[doomed.pid][0]]
        assert doomed_leases[0].wrapper_pid is not None
        os.kill(doomed_leases[0].wrapper_pid, signal.SIGKILL)
        doomed.signal(signal.SIGKILL)
        await doomed.process.wait()
        code, out, err = await cli(proc_env, "reap", "--json", "--config", str(config), process=True)
        assert code == 0, err
        actions = json.loads(out)["actions"]
        assert [a["lease"] for a in actions] == [doomed_leases[0].lease_id]
        assert actions[0]["after"] == "closed"
        assert await survivors(trees[doomed.pid]) == [], live.stderr.decode()[-3000:]
        assert all(pid_alive(p) for p in trees[live.pid])
        assert (await live.request("_fake/echo", {"still": "here"}))["result"] == {"still": "here"}
        states = {lease.adapter_pid: lease.state for lease in read_leases(proc_env)}
        assert states[trees[live.pid][0]] is LeaseState.OPEN
        assert states[trees[doomed.pid][0]] is LeaseState.CLOSED


@pytest.mark.anyio
async def test_a_running_proxy_clears_what_a_killed_sibling_left(
    proc_env: dict[str, str], tmp_path: Path, decoys: Decoys
) -> None:
    """A long-lived proxy does not wait for the next start: every ``reap_interval`` it reaps a dead
    sibling's tree (its wrapper killed too), marks its running turn lost and suspends its session."""
    config = tmp_path / "fast.toml"
    config.write_text(FAST)
    reaping = tmp_path / "reaping.toml"
    reaping.write_text(FAST + '[ownership]\nreap_interval = "300ms"\n')
    async with (
        Gateway.start(proc_env, tmp_path, proxy_args=["--config", str(reaping)]) as live,
        Gateway.start(proc_env, tmp_path, proxy_args=["--config", str(config)]) as doomed,
    ):
        trees = {}
        sessions = {}
        for gw in (live, doomed):
            await gw.initialize()
            sessions[gw.pid] = await gw.new_session()
            await gw.prompt(sessions[gw.pid], "spawn_tree; escape")
            pids = (await gw.request("_fake/pids"))["result"]
            trees[gw.pid] = [pids["adapter"], *pids["children"]]
        await send_prompt(doomed, sessions[doomed.pid], "wait_cancel")
        running = await wait_for_task(proc_env, "running", prompt="wait_cancel")
        doomed.signal(signal.SIGSTOP)  # neither it nor its wrapper may end the tree: the live proxy must
        (doomed_lease,) = [lease for lease in read_leases(proc_env) if lease.adapter_pid == trees[doomed.pid][0]]
        assert doomed_lease.wrapper_pid is not None
        os.kill(doomed_lease.wrapper_pid, signal.SIGKILL)
        doomed.signal(signal.SIGKILL)
        await doomed.process.wait()
        assert await survivors(trees[doomed.pid]) == [], live.stderr.decode()[-3000:]
        with anyio.fail_after(GONE_WITHIN):
            while {lease.lease_id: lease for lease in read_leases(proc_env)}[doomed_lease.lease_id].state is not (
                LeaseState.CLOSED
            ):
                await anyio.sleep(0.05)
            while (await cli_json(proc_env, "tasks", "show", running["taskId"]))["recordedStatus"] != "lost":
                await anyio.sleep(0.05)
            rows = registry(proc_env)
            try:
                while (row := rows.get(sessions[doomed.pid])) is None or row.state is not SessionState.SUSPENDED:
                    await anyio.sleep(0.05)
            finally:
                rows.db.close()
            while doomed_lease.instance_id in cgroups.recorded_instances(state_dir(proc_env)):
                await anyio.sleep(0.05)  # in cgroup mode, its cgroup is removed too
        assert all(pid_alive(p) for p in trees[live.pid])
        assert (await live.request("_fake/echo", {"still": "here"}))["result"] == {"still": "here"}
        db = StateDB(state_dir(proc_env), create=False)
        try:
            reaped = [e for e in journal.recent_events(db.conn) if e.kind == "tree_reaped" and e.label != "stop"]
        finally:
            db.close()
        assert [e.label for e in reaped] == ["periodic"]
        # The session it suspended resumes on the live proxy.
        assert (await live.prompt(sessions[doomed.pid], "stream 1"))["result"]["stopReason"] == "end_turn"


# --- reaping fabricated leases: what may never be signalled ---------------------------------


class BrokenTable(ProcFS):
    """A process table that cannot be read (permission denied)."""

    def info(self, pid: int) -> ProcessInfo | None:
        raise TableUnavailable(f"cannot read /proc/{pid}/stat: Permission denied")

    def environ_has(self, pid: int, marker: str) -> bool | None:
        raise TableUnavailable("cannot read environments: Permission denied")

    def pids(self) -> Iterator[int]:
        raise TableUnavailable("cannot list /proc: Permission denied")


@dataclass(frozen=True)
class Fabricated:
    id: str
    sentence: str
    target: str  # which live process the lease's wrapper pid points at
    expected: LeaseState
    ticks: str = "same"  # "same" | "other": the recorded start ticks
    boot: str = "this"  # "this" | "other"
    table: str = "procfs"  # "procfs" | "missing" | "denied"


REAPING = [
    Fabricated("vanished", "a stale lease whose process is gone: lost, nothing signalled", "vanished", LeaseState.LOST),
    Fabricated(
        "pid-reused",
        "the pid now belongs to an unrelated process: no signal, not closed as ours",
        "decoy",
        LeaseState.LOST,
        ticks="other",
    ),
    Fabricated(
        "no-marker",
        "same pid and start time but without the lease's marker: no signal",
        "decoy",
        LeaseState.LOST,
    ),
    Fabricated(
        "other-wrapper",
        "the pid is another live instance's wrapper: untouched",
        "live-wrapper",
        LeaseState.LOST,
    ),
    Fabricated("other-boot", "a lease from another boot: lost", "decoy", LeaseState.LOST, boot="other"),
    Fabricated("zombie", "the process is a zombie: treated as dead", "zombie", LeaseState.LOST),
    Fabricated(
        "no-proc",
        "the process table is unavailable: no signal, unverifiable",
        "marked-decoy",
        LeaseState.UNVERIFIABLE,
        table="missing",
    ),
    Fabricated(
        "denied",
        "reading the process table is denied: no signal, unverifiable",
        "marked-decoy",
        LeaseState.UNVERIFIABLE,
        table="denied",
    ),
]


def start_ticks(pid: int) -> int:
    info = ProcFS().info(pid)
    assert info is not None
    return info.start_ticks


@pytest.mark.parametrize("row", REAPING, ids=[row.id for row in REAPING])
def test_reaping_never_signals_what_it_cannot_prove(
    proc_env: dict[str, str], tmp_path: Path, decoys: Decoys, row: Fabricated
) -> None:
    db = StateDB(state_dir(proc_env))
    boot = ProcFS().boot_id()
    dead = instances.start_instance(db, boot)
    lease = create_lease(db, instance_id=dead.instance_id, boot_id=boot, backend="fake", argv=("fake",))
    os.close(dead.lock_fd)  # the instance is now dead: its lock can be taken
    zombie = None
    live_proxy = None
    if row.target == "vanished":
        gone = subprocess.Popen(["true"])
        gone.wait()
        pid, ticks = gone.pid, 12345
    elif row.target == "decoy":
        pid = decoys.procs[0].pid
        ticks = start_ticks(pid)
    elif row.target == "marked-decoy":
        pid = decoys.start({"ACP_PROXY_LEASE": lease.marker_value})
        ticks = start_ticks(pid)
    elif row.target == "zombie":
        zombie = subprocess.Popen(["true"], env={**proc_env, "ACP_PROXY_LEASE": lease.marker_value})
        while ProcFS().info(zombie.pid) is not None and not ProcFS().info(zombie.pid).zombie:  # type: ignore[union-attr]
            time.sleep(0.01)
        pid, ticks = zombie.pid, start_ticks(zombie.pid)
    else:
        live_proxy = subprocess.Popen(
            [sys.executable, "-m", "acp_proxy", "--", *fake_command()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=proc_env,
        )
        assert live_proxy.stdin is not None
        assert live_proxy.stdout is not None
        live_proxy.stdin.write(b'{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":1}}\n')
        live_proxy.stdin.flush()
        live_proxy.stdout.readline()
        live = [x for x in all_leases(db) if x.state is LeaseState.OPEN]
        assert live[0].wrapper_pid is not None
        pid, ticks = live[0].wrapper_pid, start_ticks(live[0].wrapper_pid)
    if row.ticks == "other":
        ticks -= 1
    record_spawn(db, lease.lease_id, wrapper_pid=pid, wrapper_start_ticks=ticks)
    if row.boot == "other":
        db.conn.execute("UPDATE leases SET boot_id = 'another-boot' WHERE lease_id = ?", (lease.lease_id,))
    fabricated = next(x for x in all_leases(db) if x.lease_id == lease.lease_id)
    table = {"procfs": ProcFS(), "missing": ProcFS(tmp_path / "no-proc"), "denied": BrokenTable()}[row.table]
    try:
        action = reap_lease(db, fabricated, grace=0.2, table=table)
        assert action.signalled == []
        assert LeaseState(action.after) is row.expected, action
        assert next(x for x in all_leases(db) if x.lease_id == lease.lease_id).state is row.expected
        if row.target in ("decoy", "marked-decoy", "live-wrapper"):
            assert pid_alive(pid), "a process that was not provably ours was signalled"
    finally:
        if zombie is not None:
            zombie.wait()
        if live_proxy is not None:
            live_proxy.stdin.close()  # type: ignore[union-attr]
            live_proxy.wait(timeout=30)
        db.close()


@pytest.mark.anyio
async def test_a_failing_database_does_not_stop_a_teardown(
    proc_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lease bookkeeping that fails mid-teardown (a locked or full disk) still leaves no process behind."""
    owner = Owner.start(state_dir(proc_env), grace=1.0)
    try:
        supervised = await SupervisedProcess.start(
            owner,
            backend="fake",
            argv=["sh", "-c", "sleep 600 & exec sleep 600"],
            env=proc_env,
            cwd=None,
            term_grace=1.0,
        )
        marker = proc_env[MARKER_VARIABLE]
        with anyio.fail_after(GONE_WITHIN):
            while len(marked_processes(marker)) < 2:  # the wrapper's adapter and its child
                await anyio.sleep(0.02)
        tree = list(marked_processes(marker))

        def locked(*args: object, **kwargs: object) -> Callable[[sqlite3.Connection], bool]:
            def write(conn: sqlite3.Connection) -> bool:
                raise sqlite3.OperationalError("database is locked")

            return write

        monkeypatch.setattr(leases, "moved_to", locked)  # every lease state change the teardown writes
        await supervised.stop(stdin_grace=0.2, term_grace=1.0)
        assert await survivors(tree) == []
        monkeypatch.undo()
        assert all_leases(owner.db)[0].state is LeaseState.OPEN, "the failed writes left the lease as it was"
    finally:
        owner.close()
    # The next proxy finishes the bookkeeping: nothing is left to kill, the tombstone says it exited.
    successor = Owner.start(state_dir(proc_env), grace=1.0)
    try:
        assert all_leases(successor.db)[0].state in (LeaseState.CLOSED, LeaseState.LOST)
    finally:
        successor.close()


# --- the verification rules themselves ---------------------------------------------------------


def test_verified_signal_reaches_a_process_that_is_provably_ours(proc_env: dict[str, str]) -> None:
    marker = "ACP_PROXY_LEASE=test.lease.0"
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env={**proc_env, "ACP_PROXY_LEASE": "test.lease.0"}
    )
    try:
        time.sleep(0.1)
        table = ProcFS()
        claim = Claim(proc.pid, table.boot_id(), os.getuid(), marker, start_ticks=start_ticks(proc.pid))
        assert check_claim(claim, table).verdict is Verdict.OURS
        wrong = [
            Claim(proc.pid, "other-boot", os.getuid(), marker, start_ticks=claim.start_ticks),
            Claim(proc.pid, claim.boot_id, os.getuid(), marker, start_ticks=(claim.start_ticks or 0) + 1),
            Claim(proc.pid, claim.boot_id, os.getuid() + 1, marker, start_ticks=claim.start_ticks),
            Claim(proc.pid, claim.boot_id, os.getuid(), "ACP_PROXY_LEASE=other", start_ticks=claim.start_ticks),
            Claim(proc.pid, claim.boot_id, os.getuid(), marker, not_before_ticks=(claim.start_ticks or 0) + 1),
        ]
        for bad in wrong:
            assert not send_verified_signal(bad, signal.SIGKILL, table).signalled
        assert proc.poll() is None
        assert send_verified_signal(claim, signal.SIGKILL, table).signalled
        assert proc.wait(timeout=5) == -signal.SIGKILL
        assert send_verified_signal(claim, signal.SIGKILL, table).verdict is Verdict.GONE
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_no_module_outside_ownership_sends_signals() -> None:
    package = Path(__file__).parent.parent / "acp_proxy"
    offenders = []
    for path in package.rglob("*.py"):
        if "ownership" in path.parts:
            continue
        text = path.read_text()
        for needle in ("os.kill(", "os.killpg(", ".send_signal(", ".terminate()", ".kill()", "pidfd_send_signal("):
            if needle in text:
                offenders.append(f"{path.relative_to(package)}: {needle}")
    assert offenders == []
