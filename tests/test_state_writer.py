"""The state writer: one thread applies the proxy's writes in order, batched, without ever blocking the relay.

The unit tests drive ``StateWriter`` directly on a scratch table; the last test holds the
database's write lock from another process while a turn streams through a real proxy.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import anyio.abc
import pytest

from acp_proxy.state import StateDB
from acp_proxy.state.writer import StateWriter
from tests.kit.gateway import is_answer_to, request_message
from tests.support import RESUME_AND_LOAD, Gateway, cli, start, state_of, write_config

pytestmark = pytest.mark.anyio


@pytest.fixture
def db(tmp_path: Path) -> Iterator[StateDB]:
    db = StateDB(tmp_path / "state")
    db.conn.execute("CREATE TABLE log (n INTEGER, tag TEXT)")
    yield db
    db.close()


def insert(n: int, tag: str = "") -> object:
    def statement(conn: sqlite3.Connection) -> int:
        return conn.execute("INSERT INTO log (n, tag) VALUES (?, ?)", (n, tag)).lastrowid or 0

    return statement


def logged(db: StateDB) -> list[tuple[int, str]]:
    return [(row[0], row[1]) for row in db.conn.execute("SELECT n, tag FROM log ORDER BY rowid")]


class Gate:
    """A write that holds the writer thread until the test opens the gate, so that others queue up behind it."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.opened = threading.Event()

    def __call__(self, conn: sqlite3.Connection) -> None:
        self.reached.set()
        self.opened.wait(10)


def blocked(writer: StateWriter) -> Gate:
    gate = Gate()
    writer.submit(gate)
    assert gate.reached.wait(10), "the writer thread never started the first write"
    return gate


def test_writes_are_applied_in_the_order_they_were_made(db: StateDB) -> None:
    writer = db.writer
    for n in range(500):
        writer.submit(insert(n))  # type: ignore[arg-type]
    assert db.stop_writer() == 0
    assert [n for n, _ in logged(db)] == list(range(500))


def test_what_queued_up_meanwhile_is_committed_in_one_transaction(db: StateDB) -> None:
    writer = db.writer
    gate = blocked(writer)
    for n in range(100):
        writer.submit(insert(n))  # type: ignore[arg-type]
    assert writer.pending == 101
    gate.opened.set()
    db.stop_writer()
    assert writer.batches == 2, "the gate's batch, then the hundred that waited behind it"
    assert len(logged(db)) == 100


def test_a_queued_progress_write_is_replaced_by_a_newer_one_of_the_same_key(db: StateDB) -> None:
    writer = db.writer
    gate = blocked(writer)
    writer.submit(insert(0, "create"))  # type: ignore[arg-type]
    for n in range(1, 6):
        writer.submit(insert(n, "progress a"), key=("progress", "a"))  # type: ignore[arg-type]
        writer.submit(insert(n, "progress b"), key=("progress", "b"))  # type: ignore[arg-type]
    writer.submit(insert(9, "finish"))  # type: ignore[arg-type]
    gate.opened.set()
    db.stop_writer()
    assert logged(db) == [(0, "create"), (5, "progress a"), (5, "progress b"), (9, "finish")], (
        "latest wins, where the first one stood; unkeyed writes are never merged"
    )


async def test_a_full_queue_drops_nothing_and_whoever_writes_waits_for_room(db: StateDB) -> None:
    db.stop_writer()
    db.queue_limit = 4  # the writer the next write starts holds 4
    writer = db.writer
    gate = blocked(writer)
    for n in range(10):
        writer.submit(insert(n))  # type: ignore[arg-type]
    assert writer.full
    waited = anyio.Event()

    async def wait_for_room() -> None:
        await db.room()
        waited.set()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(wait_for_room)
        await anyio.sleep(0.2)
        assert not waited.is_set(), "the queue is full: the writer of more waits"
        gate.opened.set()
        with anyio.fail_after(10):
            await waited.wait()
    await db.caught_up()
    assert [n for n, _ in logged(db)] == list(range(10)), "past the limit nothing was dropped"


async def test_a_failed_write_is_logged_and_told_and_costs_only_itself(
    db: StateDB, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="acp_proxy.state")
    writer = db.writer
    told: list[BaseException | None] = []

    def broken(conn: sqlite3.Connection) -> None:
        conn.execute("INSERT INTO no_such_table VALUES (1)")

    gate = blocked(writer)
    writer.submit(insert(1))  # type: ignore[arg-type]
    writer.submit(broken, done=lambda result, error: told.append(error))
    writer.submit(insert(2))  # type: ignore[arg-type]
    gate.opened.set()
    await db.caught_up()
    assert [n for n, _ in logged(db)] == [1, 2], "the writes around the failed one are kept"
    assert len(told) == 1
    assert isinstance(told[0], sqlite3.OperationalError)
    assert "no such table" in caplog.text
    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        await db.run(broken)  # an awaited write's failure goes to whoever waits for it
    assert await db.run(insert(3)) > 0  # type: ignore[arg-type]
    assert [n for n, _ in logged(db)] == [1, 2, 3], "the writer keeps serving"


async def test_an_awaited_write_lands_after_every_write_queued_before_it(db: StateDB) -> None:
    writer = db.writer
    gate = blocked(writer)
    for n in range(5):
        writer.submit(insert(n))  # type: ignore[arg-type]

    def count(conn: sqlite3.Connection) -> int:
        return int(conn.execute("SELECT COUNT(*) FROM log").fetchone()[0])

    async with anyio.create_task_group() as tasks:

        async def counted() -> None:
            assert await db.run(count) == 5

        tasks.start_soon(counted)
        await anyio.sleep(0.05)
        gate.opened.set()


def test_shutdown_applies_what_is_queued(db: StateDB) -> None:
    writer = db.writer
    gate = blocked(writer)
    for n in range(200):
        writer.submit(insert(n))  # type: ignore[arg-type]
    threading.Timer(0.1, gate.opened.set).start()
    assert db.stop_writer(timeout=10) == 0
    assert len(logged(db)) == 200
    db.write(insert(200))  # type: ignore[arg-type]
    db.settle()
    assert len(logged(db)) == 201, "after the writer stopped, a write starts one again"


def test_shutdown_is_bounded_and_logs_what_it_could_not_apply(
    db: StateDB, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="acp_proxy.state")
    holder = sqlite3.connect(db.path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another connection keeps the write lock
    try:
        writer = db.writer
        told: list[BaseException | None] = []
        for n in range(3):
            writer.submit(insert(n), done=lambda result, error: told.append(error))  # type: ignore[arg-type]
        left = db.stop_writer(timeout=0.5)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert left == 0, "the batch was in hand, not left in the queue"
    assert len(told) == 3
    assert all(isinstance(error, sqlite3.Error) for error in told), "every write is told it was not applied"
    assert "not applied" in caplog.text
    assert logged(db) == []


HOLD_SECONDS = 5.0
HOLDER = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
conn.execute("BEGIN IMMEDIATE")
print("holding", flush=True)
time.sleep(float(sys.argv[2]))
conn.execute("ROLLBACK")
"""


@contextlib.asynccontextmanager
async def holding_the_write_lock(
    db_path: Path, env: dict[str, str], seconds: float = HOLD_SECONDS
) -> AsyncIterator[anyio.abc.Process]:
    """Another process holding the database's write lock (``BEGIN IMMEDIATE``) for ``seconds``."""
    holder = await anyio.open_process([sys.executable, "-c", HOLDER, str(db_path), str(seconds)], env=env, stderr=None)
    async with holder:
        assert holder.stdout is not None
        said = b""
        while not said.endswith(b"\n"):
            said += await holder.stdout.receive()
        assert said == b"holding\n"
        yield holder


def task_rows(db_path: Path) -> list[tuple[str, str]]:
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        return [(row[0], row[1]) for row in conn.execute("SELECT prompt, status FROM tasks ORDER BY created_at")]
    finally:
        conn.close()


async def test_a_turn_streams_and_is_answered_while_another_process_holds_the_write_lock(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    db_path = Path(proc_env["ACP_PROXY_STATE_DIR"]) / "state.db"
    async with Gateway.start(proc_env, tmp_path) as gw:
        await gw.initialize()
        session = await gw.new_session()
        assert (await gw.prompt(session, "stream 1"))["result"]["stopReason"] == "end_turn"
        gw.take_updates(session)
        async with holding_the_write_lock(db_path, proc_env) as holder:
            turn = "stream 3; sleep 0.2; stream 3; sleep 0.2; stream 3"
            answer = await gw.prompt(session, turn, timeout=HOLD_SECONDS * 3)
            still_holding = holder.returncode is None
            streamed = gw.take_updates(session)
            assert answer["result"]["stopReason"] == "end_turn"
            assert len(streamed) == 9, "every update of the turn reached the gateway"
            assert still_holding, "the turn was answered while the other process still held the write lock"
            assert task_rows(db_path) == [("stream 1", "done")], "nothing could be written during the hold"
            await holder.wait()
        assert holder.returncode == 0
        with anyio.fail_after(15):
            while task_rows(db_path) != [("stream 1", "done"), (turn, "done")]:
                await anyio.sleep(0.05)
        assert await gw.close() == 0
    assert b"Traceback" not in gw.stderr


async def test_a_start_waits_for_its_lease_while_another_session_streams_on(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """A new session's process needs its lease written first: while another process holds the lock,
    that start waits, and a turn of another session streams and is answered meanwhile."""
    db_path = Path(proc_env["ACP_PROXY_STATE_DIR"]) / "state.db"
    config = write_config(tmp_path, pool={"max_live": 4})
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=["--config", str(config)]) as gw:
        await gw.initialize()
        session = await gw.new_session()
        assert (await gw.prompt(session, "stream 1"))["result"]["stopReason"] == "end_turn"
        gw.take_updates(session)
        async with holding_the_write_lock(db_path, proc_env) as holder:
            opening = gw.new_id()
            await gw.send(request_message(opening, "session/new", {"cwd": str(tmp_path), "mcpServers": []}))
            turn = "stream 3; sleep 0.2; stream 3"
            answer = await gw.prompt(session, turn, timeout=HOLD_SECONDS * 3)
            still_holding = holder.returncode is None
            opened_during_the_hold = any(is_answer_to(opening)(msg) for msg in gw.stashed())
            assert answer["result"]["stopReason"] == "end_turn"
            assert len(gw.take_updates(session)) == 6
            assert still_holding, "the turn was answered while the other process still held the write lock"
            assert not opened_during_the_hold, "no process was started before its lease could be written"
            await holder.wait()
        opened = await gw.response_to(opening, timeout=HOLD_SECONDS * 3)
        assert "result" in opened, opened
        assert await gw.close() == 0
    assert b"Traceback" not in gw.stderr


def settings_of(db_path: Path, session: str) -> list[list[str]]:
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT settings FROM sessions WHERE session_id = ?", (session,)).fetchone()
        return list(json.loads(row[0]))
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("method", "params"),
    [("session/set_mode", {"modeId": "plan"}), ("session/set_config_option", {"configId": "model", "value": "big"})],
)
async def test_a_setting_is_on_record_before_its_answer_so_a_proxy_killed_right_after_loses_nothing(
    proc_env: dict[str, str], tmp_path: Path, method: str, params: dict[str, str]
) -> None:
    """The gateway counts on a setting once it is answered; a resume re-applies what the database
    says. So the answer waits for the setting's row (here: while another process holds the write
    lock), and a proxy SIGKILLed right after answering leaves the next one the setting."""
    db_path = Path(proc_env["ACP_PROXY_STATE_DIR"]) / "state.db"
    async with start(proc_env, tmp_path, caps=RESUME_AND_LOAD, modes=True) as gw:
        await gw.initialize()
        session = await gw.new_session()
        async with holding_the_write_lock(db_path, proc_env, seconds=1.0) as holder:
            asking = gw.new_id()
            await gw.send(request_message(asking, method, {"sessionId": session, **params}))
            answer = await gw.response_to(asking, timeout=HOLD_SECONDS * 3)
            on_record = settings_of(db_path, session)
            gw.kill()
            await holder.wait()
        assert "result" in answer, answer
        assert [m for m, _ in on_record] == [method], "the answer came once its setting was written"
        await gw.process.wait()
    async with start(proc_env, tmp_path, caps=RESUME_AND_LOAD, modes=True) as gw:
        await gw.initialize()
        state = await state_of(gw, session)
        assert (state["mode"], state["config"]) == (
            ("plan", {}) if method == "session/set_mode" else ("default", {"model": "big"})
        )


async def test_the_operators_reading_commands_answer_while_another_process_holds_the_write_lock(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """A proxy stopped in the middle of a write (SIGSTOP, a debugger) must not blind the operator."""
    state = Path(proc_env["ACP_PROXY_STATE_DIR"])
    StateDB(state).close()
    async with holding_the_write_lock(state / "state.db", proc_env, seconds=60) as holder:
        for command in (["status", "--json"], ["sessions", "list", "--json"], ["tasks", "list"], ["metrics"]):
            code, _out, err = await cli(proc_env, *command)
            assert code == 0, (command, err)
            assert holder.returncode is None, f"{command} answered only once the write lock was given up"
        holder.kill()
