"""Bad state and a missing adapter: a clear way out, never a traceback, never a rewritten database.

A damaged, unreadable or read-only state database stops the proxy and the CLI
with one line that names the file and what to do; the file is left exactly as it
was, for the operator to inspect or move aside. A database that fills up while
the proxy serves costs no answer: the task rows wait in memory and are written
once there is space again. A missing adapter is an error the gateway can read.

Modes cannot stop root, so the permission cases run the command with an empty
capability bounding set when the tests run as root: uid 0 then gets what its
file modes say, like any other owner.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import sqlite3
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest

from acp_proxy.concurrency import Stopping
from acp_proxy.config import validate
from acp_proxy.protocol import jsonrpc
from acp_proxy.protocol.jsonrpc import Message
from acp_proxy.state import StateDB
from acp_proxy.tasks.records import TaskRegistry, get_task
from acp_proxy.tasks.status import TaskStatus
from acp_proxy.tasks.turns import TurnBook
from tests.support import Gateway, fake_command, run_program

IS_ROOT = os.geteuid() == 0
PR_CAPBSET_DROP = 24
REQUESTS = [
    {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {"protocolVersion": 1}},
    {"jsonrpc": "2.0", "id": 1, "method": "session/new", "params": {"cwd": "/tmp", "mcpServers": []}},
]
OPERATOR_COMMANDS = [("status", "--json"), ("tasks", "list"), ("leases",), ("reap",)]


def _without_capabilities() -> None:
    """In the child before exec: with an empty bounding set, root keeps no capability across exec."""
    libc = ctypes.CDLL(None, use_errno=True)
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for cap in range(last + 1):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def run(
    env: dict[str, str], *args: str, stdin: str = "", as_owner_only: bool = False
) -> subprocess.CompletedProcess[str]:
    """``acp-proxy ARGS``; ``as_owner_only``: bound by file modes even when running as root (exec'd, to drop
    the capabilities before it runs)."""
    if not (as_owner_only and IS_ROOT):
        return run_program(env, *args, stdin=stdin)
    return subprocess.run(
        [sys.executable, "-m", "acp_proxy", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        preexec_fn=_without_capabilities,
    )


def serve_adhoc(env: dict[str, str], *, as_owner_only: bool = False) -> subprocess.CompletedProcess[str]:
    """A proxy in front of the fake adapter, given two requests and then EOF."""
    stdin = "".join(json.dumps(r) + "\n" for r in REQUESTS)
    return run(env, "--", *fake_command(), stdin=stdin, as_owner_only=as_owner_only)


def populate(env: dict[str, str]) -> Path:
    """A real state database: one proxy served a session and a turn, and exited cleanly."""
    prompt = {
        "jsonrpc": "2.0",
        "id": 2,
        "method": "session/prompt",
        "params": {"sessionId": "fake-1", "prompt": [{"type": "text", "text": "stream 3"}]},
    }
    proxy = subprocess.Popen(
        [sys.executable, "-m", "acp_proxy", "--", *fake_command()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    assert proxy.stdin is not None
    assert proxy.stdout is not None
    for request in [*REQUESTS, prompt]:
        proxy.stdin.write(json.dumps(request) + "\n")
        proxy.stdin.flush()
        while "method" in (answer := json.loads(proxy.stdout.readline())):
            pass
        assert "result" in answer, answer
    proxy.stdin.close()
    assert proxy.wait(timeout=30) == 0
    path = Path(env["ACP_PROXY_STATE_DIR"]) / "state.db"
    assert sorted(p.name for p in path.parent.glob("state.db*")) == ["state.db"], "a clean exit leaves no WAL"
    return path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_clear_refusal(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit 2, one ``acp-proxy: state:`` line naming what it needs to, nothing on stdout."""
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("acp-proxy: state: "), result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    for needle in needles:
        assert needle in result.stderr, (needle, result.stderr)


# --- a damaged, unreadable or read-only database ------------------------------------------------


def truncate_mid_file(path: Path) -> None:
    size = path.stat().st_size
    os.truncate(path, size // 2 + 1000)  # inside a page, past the schema


def overwrite_the_instances_table(path: Path) -> None:
    """The page every starting proxy writes first holds garbage now; the header and schema are intact."""
    overwrite_table(path, "instances")


def overwrite_table(path: Path, table: str) -> None:
    conn = sqlite3.connect(path)
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    (root,) = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (table,)).fetchone()
    conn.close()
    with open(path, "r+b") as fh:
        fh.seek((root - 1) * page_size)
        fh.write(b"\xa5" * page_size)


@pytest.mark.parametrize(
    ("damage", "readable"),
    [
        (truncate_mid_file, []),
        # Only what reads the proxies' table fails; the tasks and the leases can still be read.
        (overwrite_the_instances_table, [("tasks", "list"), ("leases",)]),
    ],
    ids=["truncated", "overwritten"],
)
def test_a_damaged_database_stops_proxy_and_cli_and_is_left_as_it_was(
    proc_env: dict[str, str], damage: Callable[[Path], None], readable: list[tuple[str, ...]]
) -> None:
    db = populate(proc_env)
    damage(db)
    before = digest(db)
    assert_clear_refusal(serve_adhoc(proc_env), str(db), "not a usable state database", "move it aside")
    for command in OPERATOR_COMMANDS:
        result = run(proc_env, *command)
        if command in readable:
            assert (result.returncode, result.stderr) == (0, ""), command
        else:
            assert_clear_refusal(result, str(db), "not a usable state database", f"mv {db} {db}.broken")
    assert digest(db) == before, "the damaged database was written to"
    assert sorted(p.name for p in db.parent.glob("state.db*")) == ["state.db"]


def test_an_unreadable_database_names_the_file_and_the_chmod(proc_env: dict[str, str]) -> None:
    db = populate(proc_env)
    before = digest(db)
    db.chmod(0)
    try:
        assert_clear_refusal(serve_adhoc(proc_env, as_owner_only=True), str(db), f"chmod 600 {db}")
        for command in OPERATOR_COMMANDS:
            assert_clear_refusal(run(proc_env, *command, as_owner_only=True), str(db), f"chmod 600 {db}")
    finally:
        db.chmod(0o600)
    assert digest(db) == before


@contextlib.contextmanager
def read_only(directory: Path, how: str) -> Iterator[None]:
    """``directory`` read-only: by its mode, or as a read-only bind mount of itself (root)."""
    if how == "mode":
        directory.chmod(0o500)
        try:
            yield
        finally:
            directory.chmod(0o700)
        return
    if not IS_ROOT:
        pytest.skip("needs root to mount a read-only file system")
    subprocess.run(["mount", "--bind", str(directory), str(directory)], check=True)
    try:
        mounted = subprocess.run(["mount", "-o", "remount,bind,ro", str(directory)], capture_output=True, text=True)
        if mounted.returncode != 0:
            pytest.skip(f"cannot remount read-only here: {mounted.stderr.strip()}")
        yield
    finally:
        subprocess.run(["umount", str(directory)], check=True)


@pytest.mark.parametrize(("how", "says"), [("mode", "is not writable"), ("mount", "is on a read-only file system")])
def test_a_read_only_state_dir_is_a_clear_message(proc_env: dict[str, str], how: str, says: str) -> None:
    db = populate(proc_env)
    before = digest(db)
    with read_only(db.parent, how):
        assert_clear_refusal(serve_adhoc(proc_env, as_owner_only=True), str(db), says, "ACP_PROXY_STATE_DIR")
        assert_clear_refusal(run(proc_env, "tasks", "list", as_owner_only=True), str(db.parent), says)
    assert digest(db) == before


def test_a_state_dir_that_cannot_be_created_is_a_clear_message(proc_env: dict[str, str], tmp_path: Path) -> None:
    parent = tmp_path / "locked"
    parent.mkdir(mode=0o500)
    env = {**proc_env, "ACP_PROXY_STATE_DIR": str(parent / "state")}
    refused = serve_adhoc(env, as_owner_only=True)
    assert_clear_refusal(refused, f"cannot create {parent / 'state'}", "ACP_PROXY_STATE_DIR")


# --- a missing adapter ------------------------------------------------------------------------


def broken_adapter(tmp_path: Path, kind: str) -> str:
    path = tmp_path / f"adapter-{kind}"
    if kind == "not-executable":
        path.write_text("#!/bin/sh\nexit 0\n")
        path.chmod(0o644)
    return str(path)


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["missing", "not-executable"])
async def test_an_adapter_that_cannot_start_is_an_error_on_every_request_and_the_proxy_keeps_serving(
    proc_env: dict[str, str], tmp_path: Path, kind: str
) -> None:
    program = broken_adapter(tmp_path, kind)
    config = tmp_path / "broken.toml"
    config.write_text(f"[backends.broken]\ncommand = {json.dumps([program, '--acp'])}\n")
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=["--config", str(config)]) as gw:
        answers = [
            await gw.request("session/new", {"cwd": "/tmp", "mcpServers": []}),
            await gw.initialize(),
            await gw.request("session/new", {"cwd": "/tmp", "mcpServers": []}),
            await gw.request("session/new", {"cwd": "/tmp", "mcpServers": []}),
        ]
        for answer in answers:
            assert answer["error"]["code"] == jsonrpc.INTERNAL_ERROR, answer
            assert answer["error"]["data"]["reason"] == "spawn_failed", answer
            assert program in answer["error"]["message"], answer
        assert (await gw.request("_fake/echo", {}))["error"]["data"]["reason"] == "spawn_failed"
        assert await gw.close() == 0
    assert b"Traceback" not in gw.stderr
    leases = json.loads(run(proc_env, "leases", "--json").stdout)["leases"]
    assert leases, "each attempt was recorded as a lease"
    assert {lease["state"] for lease in leases} == {"closed"}, "no lease left starting or open"


# --- a full disk --------------------------------------------------------------------------------


def task_book(db: StateDB) -> TurnBook:
    """The task keeping of a proxy, without the proxy."""
    config = validate({"backends": {"fake": {"command": ["fake"]}}})
    return TurnBook(TaskRegistry(db, "inst-full"), config, Stopping())


def prompt_message(request_id: int) -> Message:
    line = json.dumps(
        {
            "jsonrpc": "2.0",
            "id": request_id,
            "method": "session/prompt",
            "params": {"sessionId": "s-1", "prompt": [{"type": "text", "text": "x" * 300}]},
        }
    ).encode()
    decoded = jsonrpc.decode_line(line)
    assert isinstance(decoded, tuple)
    return decoded[0]


def test_turns_opened_on_a_full_database_stay_pending_and_are_written_once_there_is_room(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A real SQLITE_FULL (the database may not grow): every turn is kept, its row written later."""
    db = StateDB(tmp_path / "state")
    keeper = task_book(db)

    def written_so_far() -> None:
        db.settle()
        keeper.take_outcomes()  # what the writer said of the writes

    # The limit is the connection's own: the writer's, which makes every write.
    pages = db.call(lambda conn: conn.execute("PRAGMA page_count").fetchone()[0])
    db.call(lambda conn: conn.execute(f"PRAGMA max_page_count = {pages + 2}").fetchone())
    caplog.set_level(logging.INFO, logger="acp_proxy.tasks")
    written = []
    for request_id in range(10_000):
        turn = keeper.open_turn("s-1", "fake", prompt_message(request_id), None)
        written_so_far()
        if keeper.unwritten:
            break
        written.append(turn)
    assert keeper.unwritten == {turn.task_id: turn}, "the database never filled up"
    assert get_task(db, turn.task_id) is None
    assert "database or disk is full" in caplog.text, "the log says what failed"
    keeper.settle(turn, stop_reason="end_turn")
    written_so_far()
    assert turn.task_id in keeper.unwritten
    assert get_task(db, turn.task_id) is None
    keeper.retry_unwritten()
    written_so_far()
    assert turn.task_id in keeper.unwritten, "still full: still pending"
    db.call(lambda conn: conn.execute("PRAGMA max_page_count = 1073741823").fetchone())  # room again
    keeper.retry_unwritten()
    written_so_far()
    assert keeper.unwritten == {}
    row = get_task(db, turn.task_id)
    assert row is not None
    assert (row.status, row.stop_reason) == (TaskStatus.DONE, "end_turn")
    assert all(get_task(db, t.task_id) is not None for t in written)
    assert "recorded in the state database after all" in caplog.text


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs, mounted for the test and unmounted after it whatever happens."""
    if not IS_ROOT:
        pytest.skip("needs root to mount a small tmpfs to fill up")
    mountpoint = tmp_path / "disk"
    mountpoint.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mountpoint)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mountpoint
    finally:
        if subprocess.run(["umount", str(mountpoint)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mountpoint)], check=True)


def fill(directory: Path) -> Path:
    ballast = directory / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 20, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * size)
    finally:
        os.close(fd)
    return ballast


def task_statuses(db_path: Path) -> list[str]:
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        return [row[0] for row in conn.execute("SELECT status FROM tasks ORDER BY created_at")]
    finally:
        conn.close()


@pytest.mark.anyio
async def test_a_full_disk_costs_no_answer_and_the_rows_follow_once_there_is_space(
    proc_env: dict[str, str], tmp_path: Path, small_disk: Path
) -> None:
    state = small_disk / "state"
    env = {**proc_env, "ACP_PROXY_STATE_DIR": str(state)}
    db_path = state / "state.db"
    async with Gateway.start(env, tmp_path) as gw:
        await gw.initialize()
        session = await gw.new_session()
        assert (await gw.prompt(session, "stream 1"))["result"]["stopReason"] == "end_turn"
        with anyio.fail_after(10):  # the turn's rows are written after its answer, by the state writer
            while task_statuses(db_path) != ["done"]:
                await anyio.sleep(0.02)
        # Empty the WAL, so that the next write must take new space, then take all of it.
        conn = sqlite3.connect(db_path, timeout=10)
        assert conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0
        conn.close()
        assert (state / "state.db-wal").stat().st_size == 0
        ballast = await anyio.to_thread.run_sync(fill, small_disk)
        assert os.statvfs(small_disk).f_bavail == 0
        for _ in range(3):
            answer = await gw.prompt(session, "stream 2")
            assert answer["result"]["stopReason"] == "end_turn", answer
        streamed = gw.updates(session)
        assert len(streamed) == 1 + 3 * 2, "every streamed update reached the gateway"
        assert task_statuses(db_path) == ["done"], "nothing could be written while the disk was full"
        with anyio.fail_after(10):  # told by the writer thread, logged at the turn book's next step
            while "could not record it in the state database" not in gw.stderr.decode():
                await anyio.sleep(0.05)
        log = gw.stderr.decode()
        assert "could not record it in the state database" in log
        assert "database or disk is full" in log
        ballast.unlink()
        with anyio.fail_after(15):
            while task_statuses(db_path) != ["done"] * 4:
                await anyio.sleep(0.1)
        assert "recorded in the state database after all" in gw.stderr.decode()
        assert await gw.close() == 0
    assert b"Traceback" not in gw.stderr
    assert stat.S_IMODE(db_path.stat().st_mode) == 0o600


def test_a_table_damaged_under_a_serving_proxy_is_an_error_to_each_request_not_an_exit(
    proc_env: dict[str, str],
) -> None:
    """The proxy starts (its own tables are fine); every request that needs the damaged one gets an error."""
    path = populate(proc_env)
    overwrite_table(path, "sessions")
    prompt = {
        "jsonrpc": "2.0",
        "id": 2,
        "method": "session/prompt",
        "params": {"sessionId": "fake-1", "prompt": [{"type": "text", "text": "stream 1"}]},
    }
    echo = {"jsonrpc": "2.0", "id": 3, "method": "_fake/echo", "params": {"still": "serving"}}
    stdin = "".join(json.dumps(r) + "\n" for r in [REQUESTS[0], prompt, {**prompt, "id": 4}, echo])
    result = run(proc_env, "--", *fake_command(), stdin=stdin)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    answers = {m["id"]: m for m in map(json.loads, result.stdout.splitlines()) if "id" in m and "method" not in m}
    assert sorted(answers) == [0, 2, 3, 4], "every request answered once"
    for request_id in (2, 4):
        assert answers[request_id]["error"]["data"]["reason"] == "state_error", answers[request_id]
        assert str(path) in result.stderr
    assert answers[3]["result"] == {"still": "serving"}
