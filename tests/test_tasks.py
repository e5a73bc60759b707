"""The task registry: the status table, a turn's bounded progress, rows, sweep and prune."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from acp_proxy.concurrency import Stopping
from acp_proxy.config import ConfigError, validate
from acp_proxy.journal import counters
from acp_proxy.ownership import instances
from acp_proxy.protocol.jsonrpc import INTERNAL_ERROR, REQUEST_CANCELLED, ErrorObject
from acp_proxy.sessions.registry import SessionRecord, SessionRegistry, titles_of
from acp_proxy.state import StateDB, now
from acp_proxy.tasks.records import AmbiguousId, Swept, TaskRegistry, get_task, list_tasks, prune, sweep_lost
from acp_proxy.tasks.status import Outcome, TaskStatus, effective_status, outcome_of, prompt_preview, traceparent_of
from acp_proxy.tasks.turn import MAX_EVENTS, SCAN_LIMIT, SUMMARY_CHARS, UNREAD_LIMIT, Event, Turn, keep_recent
from acp_proxy.tasks.turns import TurnBook, error_text
from tests.kit.state import count_tasks
from tests.support import run_together

S = TaskStatus

# (stop reason, JSON-RPC error, timed out) -> outcome
OUTCOMES = [
    ("end_turn", None, False, Outcome(S.DONE, "end_turn")),
    ("max_tokens", None, False, Outcome(S.DONE, "max_tokens")),
    ("max_turn_requests", None, False, Outcome(S.DONE, "max_turn_requests")),
    ("refusal", None, False, Outcome(S.DONE, "refusal")),
    ("a_reason_from_a_newer_protocol", None, False, Outcome(S.DONE, "a_reason_from_a_newer_protocol")),
    ("cancelled", None, False, Outcome(S.CANCELLED, "cancelled")),
    (None, None, False, Outcome(S.FAILED, None, "the agent answered without a stopReason")),
    (None, (INTERNAL_ERROR, "boom"), False, Outcome(S.FAILED, None, "boom (code -32603)")),
    (
        None,
        (-32000, "The agent process exited"),
        False,
        Outcome(S.FAILED, None, "The agent process exited (code -32000)"),
    ),
    (None, (REQUEST_CANCELLED, "shutting down"), False, Outcome(S.CANCELLED, None, "shutting down (code -32800)")),
    ("cancelled", None, True, Outcome(S.TIMED_OUT, "cancelled")),
    (None, (REQUEST_CANCELLED, "gone"), True, Outcome(S.TIMED_OUT, None, "gone (code -32800)")),
    # The timeout fired, but the turn ended otherwise before its cancel took effect: as it ended.
    ("end_turn", None, True, Outcome(S.DONE, "end_turn")),
    (None, (INTERNAL_ERROR, "boom"), True, Outcome(S.FAILED, None, "boom (code -32603)")),
]


@pytest.mark.parametrize(("stop_reason", "error", "timed_out", "expected"), OUTCOMES)
def test_status_table(
    stop_reason: str | None, error: tuple[int, str] | None, timed_out: bool, expected: Outcome
) -> None:
    assert outcome_of(stop_reason=stop_reason, error=error, timed_out=timed_out) == expected


ENDED_BY = "cancel_timeout: not ended by the agent 30s after session/cancel"
# (stop reason, timed out) -> outcome of a turn the proxy answered itself, saying why (ended_by)
ENDED_BY_THE_PROXY = [
    ("cancelled", False, Outcome(S.CANCELLED, "cancelled", ENDED_BY)),
    # turn_timeout had cancelled it first: timed out, as it would be without the cancel_timeout.
    ("cancelled", True, Outcome(S.TIMED_OUT, "cancelled")),
]


@pytest.mark.parametrize(("stop_reason", "timed_out", "expected"), ENDED_BY_THE_PROXY)
def test_status_of_a_turn_the_proxy_answered_itself(stop_reason: str, timed_out: bool, expected: Outcome) -> None:
    assert outcome_of(stop_reason=stop_reason, timed_out=timed_out, ended_by=ENDED_BY) == expected


@pytest.mark.parametrize("recorded", list(S))
@pytest.mark.parametrize("alive", [True, False])
def test_an_unfinished_task_of_a_dead_proxy_reads_as_lost(recorded: TaskStatus, alive: bool) -> None:
    expected = S.LOST if recorded in (S.QUEUED, S.RUNNING) and not alive else recorded
    assert effective_status(recorded, alive) is expected


@pytest.mark.parametrize(
    ("meta", "expected"),
    [
        ({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}, True),
        ({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331"}, False),
        ({"traceparent": "not a trace"}, False),
        ({"traceparent": 7}, False),
        ({}, False),
        (None, False),
        ("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", False),
    ],
)
def test_traceparent_is_taken_only_when_well_formed(meta: object, expected: bool) -> None:
    found = traceparent_of(meta)
    assert (found is not None) is expected
    if expected:
        assert isinstance(meta, dict)
        assert found == meta["traceparent"]


def test_prompt_preview_is_short_and_names_non_text_blocks() -> None:
    params = {"prompt": [{"type": "text", "text": "fix\n  the   bug"}, {"type": "image", "data": "x" * 10_000}]}
    assert prompt_preview(params) == "fix the bug [image]"
    long = prompt_preview({"prompt": [{"type": "text", "text": "word " * 200}]})
    assert len(long) == 201
    assert long.endswith("…")
    assert prompt_preview({"prompt": "not a list"}) == ""
    assert prompt_preview({}) == ""


def _chunk(text: str, kind: str = "agent_message_chunk") -> bytes:
    update = {"sessionUpdate": kind, "content": {"type": "text", "text": text}}
    if kind == "tool_call":
        update = {"sessionUpdate": "tool_call", "toolCallId": "t1", "title": text}
    return json.dumps(
        {"jsonrpc": "2.0", "method": "session/update", "params": {"sessionId": "s", "update": update}}
    ).encode()


def _turn() -> Turn:
    return Turn(task_id="t" * 12, session_id="s", backend="b", request_id="1")


def test_a_turn_counts_updates_keeps_the_tail_of_the_text_and_notes_tool_calls() -> None:
    turn = _turn()
    turn.start("lease-1", None)
    assert turn.status is S.RUNNING
    assert turn.deadline is None
    block = b"\n".join(_chunk(f"word{i} ") for i in range(300)) + b"\n"
    turn.observe(block, 300)
    turn.observe(_chunk("Read file", "tool_call") + b"\n" + b"not json at all\n", 2)
    turn.observe(_chunk("the end") + b"\n", 1)
    assert turn.update_count == 303
    assert turn.tool_calls == 1
    assert turn.first_output_at is not None
    turn.digest()
    assert len(turn.summary) == SUMMARY_CHARS
    assert turn.summary.endswith("word299 the end")
    kinds = [e.kind for e in turn.events]
    assert kinds == ["started", "first_output", "tool_call"]
    assert turn.events[-1].detail == "Read file"


def test_tool_calls_in_a_burst_are_counted_at_the_digest() -> None:
    turn = _turn()
    burst = b"".join(_chunk(f"w{i} ") + b"\n" for i in range(100)) + _chunk("Edit", "tool_call") + b"\n"
    assert len(burst) > SCAN_LIMIT
    turn.observe(burst, 101)
    assert turn.tool_calls == 0, "a large block is not scanned on the streaming path"
    turn.digest()
    assert turn.tool_calls == 1
    assert turn.events[-1].kind == "tool_call"
    assert turn.summary.endswith("w99 ")
    turn.observe(_chunk("Read", "tool_call") + b"\n", 1)
    assert turn.tool_calls == 2, "a small block is scanned as it passes"
    turn.digest()
    assert turn.tool_calls == 2, "and not counted again"


def test_unread_updates_are_bounded_between_digests() -> None:
    turn = _turn()
    line = _chunk("x" * 1000) + b"\n"
    for _ in range(2 * UNREAD_LIMIT // len(line)):
        turn.observe(line, 1)
    assert turn._unread_bytes <= UNREAD_LIMIT + len(line)
    turn.digest()
    assert turn.summary == "x" * SUMMARY_CHARS


@settings(max_examples=200)
@given(st.lists(st.sampled_from(["tool_call", "permission_asked", "permission_answered", "resumed"]), max_size=200))
def test_recent_events_are_bounded_and_milestones_survive(kinds: list[str]) -> None:
    events = [Event(0.0, "started"), Event(0.0, "first_output")]
    dropped = 0
    for kind in kinds:
        dropped += keep_recent(events, Event(0.0, kind))
    assert len(events) <= MAX_EVENTS
    assert len(events) + dropped == len(kinds) + 2
    milestones = 2 + kinds.count("resumed")
    assert sum(e.kind in ("started", "first_output", "resumed") for e in events) == min(milestones, MAX_EVENTS)
    if milestones <= MAX_EVENTS:
        assert [e.kind for e in events[:2]] == ["started", "first_output"]


# --- rows -----------------------------------------------------------------------------------


@pytest.fixture
def db(tmp_path: Path) -> StateDB:
    return StateDB(tmp_path / "state")


def test_a_task_row_follows_its_turn_and_terminal_statuses_are_final(db: StateDB) -> None:
    registry = TaskRegistry(db, "inst-a")
    turn = _turn()
    turn.prompt = "stream 3"
    turn.traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    turn.event("queued")
    registry.create(turn)
    db.settle()
    assert get_task(db, turn.task_id).status is S.QUEUED  # type: ignore[union-attr]
    turn.start("lease-1", 30.0)
    registry.mark_running(turn)
    turn.observe(_chunk("hello") + b"\n", 1)
    registry.save_progress(turn)
    db.settle()
    row = get_task(db, turn.task_id)
    assert row is not None
    assert row.status is S.RUNNING
    assert row.summary == "hello"
    assert row.lease_id == "lease-1"
    turn.finish(outcome_of(stop_reason="end_turn"))
    registry.finish(turn)
    db.settle()
    row = get_task(db, turn.task_id)
    assert row is not None
    assert (row.status, row.stop_reason, row.update_count, row.prompt) == (S.DONE, "end_turn", 1, "stream 3")
    assert row.traceparent == turn.traceparent
    assert row.instance_id == "inst-a"
    assert [e.kind for e in row.events] == ["queued", "started", "first_output", "finished"]
    assert row.ended_at is not None
    assert row.started_at is not None
    assert row.ended_at >= row.started_at
    # Once terminal, no later write changes it.
    turn.status = S.FAILED
    registry.finish(turn)
    registry.mark_running(turn)
    registry.save_progress(turn)
    db.settle()
    assert get_task(db, turn.task_id).status is S.DONE  # type: ignore[union-attr]
    assert [(c.label, c.count) for c in counters(db.conn, ["turn_ended"])] == [("done", 1)], (
        "the second finish changed nothing, so it was not counted"
    )


def test_tasks_are_found_by_unique_prefix_and_listed_newest_first(db: StateDB) -> None:
    registry = TaskRegistry(db, "inst-a")
    ids = ["abc123000001", "abc123000002", "abd999000000"]
    for i, task_id in enumerate(ids):
        turn = Turn(task_id=task_id, session_id="s1" if i < 2 else "s2", backend="b", request_id=str(i))
        turn.created_at = 1000.0 + i
        registry.create(turn)
    db.settle()
    assert get_task(db, "abd9").task_id == "abd999000000"  # type: ignore[union-attr]
    with pytest.raises(AmbiguousId, match="matches 2 tasks"):
        get_task(db, "abc1")
    assert get_task(db, "abc") is None, "prefixes shorter than 4 characters are not guessed at"
    assert get_task(db, "zzzz") is None
    assert get_task(db, "ab%_") is None
    assert [t.task_id for t in list_tasks(db)] == ids[::-1]
    assert [t.task_id for t in list_tasks(db, session_id="s1", limit=1)] == ["abc123000002"]
    assert list_tasks(db, statuses=[S.DONE]) == []
    assert count_tasks(db) == {"queued": 3}


def _instance_with_unfinished_task(db: StateDB, task_id: str) -> instances.Instance:
    instance = instances.start_instance(db, "boot")
    turn = Turn(task_id=task_id, session_id="s", backend="b", request_id="1")
    turn.start(None, None)
    TaskRegistry(db, instance.instance_id).create(turn)
    db.settle()
    return instance


def test_the_sweep_marks_only_dead_proxies_tasks_lost_and_is_idempotent(db: StateDB) -> None:
    dead = _instance_with_unfinished_task(db, "dead00000000")
    alive = _instance_with_unfinished_task(db, "alive0000000")
    own = _instance_with_unfinished_task(db, "own000000000")
    os.close(dead.lock_fd)  # as the kernel does when a proxy is SIGKILLed
    assert sweep_lost(db, own.instance_id) == 1
    assert sweep_lost(db, own.instance_id) == 0
    assert get_task(db, "dead00000000").status is S.LOST  # type: ignore[union-attr]
    assert "ended without recording an outcome" in (get_task(db, "dead00000000").error or "")  # type: ignore[union-attr]
    assert get_task(db, "alive0000000").status is S.RUNNING  # type: ignore[union-attr]
    assert get_task(db, "own000000000").status is S.RUNNING  # type: ignore[union-attr]
    os.close(alive.lock_fd)
    os.close(own.lock_fd)


def test_a_damaged_row_is_swept_lost_and_only_its_notification_is_lost(db: StateDB) -> None:
    for task_id in ("damaged00000", "readable0000"):
        os.close(_instance_with_unfinished_task(db, task_id).lock_fd)
    with db.transaction() as conn:
        conn.execute("UPDATE tasks SET recent_events = 'not json' WHERE task_id = 'damaged00000'")
    told: list[Swept] = []
    assert sweep_lost(db, None, told.append) == 2
    assert [swept.record.task_id for swept in told] == ["readable0000"]
    statuses = dict(db.conn.execute("SELECT task_id, status FROM tasks").fetchall())
    assert statuses == {"damaged00000": "lost", "readable0000": "lost"}


def test_a_task_swept_lost_is_told_with_its_sessions_title_as_the_sessions_registry_reads_it(db: StateDB) -> None:
    registry = SessionRegistry(db, "inst-x")
    registry.create(SessionRecord("s", "s", "b", "/w"))
    registry.record_title("s", {"title": "Long job"})
    db.settle()
    os.close(_instance_with_unfinished_task(db, "titled000000").lock_fd)
    told: list[Swept] = []
    assert sweep_lost(db, None, told.append, titles_of) == 1
    assert [(swept.record.task_id, swept.title) for swept in told] == [("titled000000", "Long job")]


def test_prune_deletes_only_old_finished_tasks_and_is_idempotent(db: StateDB) -> None:
    registry = TaskRegistry(db, "inst-a")
    week = 7 * 86400.0
    moment = now()
    for task_id, ended_ago, status in [
        ("old000000000", week + 60, S.DONE),
        ("oldlost00000", week + 60, S.LOST),
        ("recent000000", week - 60, S.FAILED),
        ("running00000", None, S.RUNNING),
    ]:
        turn = Turn(task_id=task_id, session_id="s", backend="b", request_id="1")
        turn.created_at = moment - 2 * week
        registry.create(turn)
        db.settle()
        if ended_ago is not None:
            with db.transaction() as conn:
                conn.execute(
                    "UPDATE tasks SET status = ?, ended_at = ? WHERE task_id = ?",
                    (status.value, moment - ended_ago, task_id),
                )
    assert prune(db, week, at=moment) == 2
    assert prune(db, week, at=moment) == 0
    assert sorted(t.task_id for t in list_tasks(db)) == ["recent000000", "running00000"]


WRITE_TASKS = """
import json, os, sys
from pathlib import Path
from acp_proxy.ownership import instances
from acp_proxy.state import StateDB
from acp_proxy.tasks.records import TaskRegistry
from acp_proxy.tasks.status import outcome_of
from acp_proxy.tasks.turn import Turn
sys.stdin.readline()
db = StateDB(Path(sys.argv[1]))
instance = instances.start_instance(db, "boot")
registry = TaskRegistry(db, instance.instance_id)
update = {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": "x"}}
chunk = json.dumps({"jsonrpc": "2.0", "method": "session/update", "params": {"sessionId": "s", "update": update}})
for i in range(int(sys.argv[2])):
    turn = Turn(task_id=os.urandom(6).hex(), session_id=f"s{os.getpid()}", backend="b", request_id=str(i))
    registry.create(turn)
    turn.start(None, None)
    registry.mark_running(turn)
    turn.observe(chunk.encode() + b"\\n", 1)
    registry.save_progress(turn)
    turn.finish(outcome_of(stop_reason="end_turn"))
    registry.finish(turn)
db.close()  # what is queued is applied
"""


def test_concurrent_writers_lose_no_task(proc_env: dict[str, str], tmp_path: Path) -> None:
    state = tmp_path / "state"
    StateDB(state).close()
    run_together(WRITE_TASKS, [[str(state), "150"]] * 4, proc_env, timeout=120)
    db = StateDB(state, create=False)
    assert count_tasks(db) == {"done": 600}
    assert db.conn.execute("SELECT COUNT(DISTINCT instance_id) FROM tasks").fetchone()[0] == 4
    assert db.conn.execute("SELECT SUM(update_count) FROM tasks").fetchone()[0] == 600
    assert db.conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_the_status_column_accepts_only_known_statuses(db: StateDB) -> None:
    with pytest.raises(sqlite3.IntegrityError), db.transaction() as conn:
        conn.execute(
            "INSERT INTO tasks (task_id, session_id, backend, instance_id, status, created_at, updated_at) "
            "VALUES ('x', 's', 'b', 'i', 'finished', 0, 0)"
        )


# --- configuration -------------------------------------------------------------------------


def test_tasks_config() -> None:
    config = validate(
        {
            "tasks": {"turn_timeout": "15m", "retention": "2d"},
            "backends": {"a": {"command": ["a"], "turn_timeout": "30s"}, "b": {"command": ["b"]}},
        }
    )
    assert (config.tasks.turn_timeout, config.tasks.retention) == (900.0, 172800.0)
    assert config.backends["a"].turn_timeout == 30.0
    assert config.backends["b"].turn_timeout is None
    assert validate({"backends": {"a": {"command": ["a"]}}}).tasks.retention == 7 * 86400.0
    with pytest.raises(ConfigError) as raised:
        validate({"tasks": {"turn_timeout": "soon", "retension": "1d"}, "backends": {"a": {"command": ["a"]}}})
    text = str(raised.value)
    assert "tasks.turn_timeout" in text
    assert "tasks.retension" in text
    with pytest.raises(ConfigError, match=r"tasks\.retention"):
        validate({"tasks": {"retention": float("inf")}, "backends": {"a": {"command": ["a"]}}})


def test_cancel_timeout_config() -> None:
    """In [tasks] (default 30 s) and per backend; 0 turns it off, for all or for one backend."""
    config = validate(
        {
            "tasks": {"cancel_timeout": "500ms"},
            "backends": {
                "gemini": {"command": ["gemini", "--acp"], "cancel_timeout": "5s"},
                "patient": {"command": ["p"], "cancel_timeout": 0},
                "other": {"command": ["o"]},
            },
        }
    )
    assert config.tasks.cancel_timeout == 0.5
    assert [config.cancel_timeout(name) for name in ("gemini", "patient", "other")] == [5.0, 0.0, 0.5]
    assert validate({"backends": {"a": {"command": ["a"]}}}).cancel_timeout("a") == 30.0
    assert validate({"tasks": {"cancel_timeout": "0s"}, "backends": {"a": {"command": ["a"]}}}).cancel_timeout("a") == 0
    with pytest.raises(ConfigError) as raised:
        validate({"tasks": {"cancel_timeout": "never"}, "backends": {"a": {"command": ["a"], "cancel_timeout": -1}}})
    assert "tasks.cancel_timeout" in str(raised.value)
    assert "backends.a.cancel_timeout" in str(raised.value)


def test_a_failed_write_is_retried_whole_and_never_reopens_an_ended_row(db: StateDB) -> None:
    keeper = TurnBook(TaskRegistry(db, "inst-a"), validate({"backends": {"a": {"command": ["a"]}}}), Stopping())
    turn = _turn()
    turn.start("lease-1", None)
    real_create = keeper.tasks.create

    def locked(turn: Turn) -> None:
        raise sqlite3.OperationalError("database is locked")

    keeper._record(locked, turn)  # the create failed: nothing on record yet
    assert get_task(db, turn.task_id) is None
    assert keeper.unwritten == {turn.task_id: turn}
    turn.observe(_chunk("some text") + b"\n", 1)
    turn.finish(outcome_of(stop_reason="end_turn"))
    keeper._record(keeper.tasks.finish, turn)  # an UPDATE of a row that does not exist: changes nothing
    keeper.retry_unwritten()
    db.settle()
    keeper.take_outcomes()  # the writer has said the retry took
    assert keeper.unwritten == {}
    row = get_task(db, turn.task_id)
    assert row is not None
    assert (row.status, row.stop_reason, row.summary, row.update_count) == (S.DONE, "end_turn", "some text", 1)
    # An upsert never reopens a row that has ended.
    other = _turn()
    other.task_id = "o" * 12
    real_create(other)
    other.finish(outcome_of(stop_reason="cancelled"))
    keeper.tasks.finish(other)
    other.status = S.RUNNING
    keeper.tasks.write_whole(other)
    db.settle()
    assert get_task(db, other.task_id).status is S.CANCELLED  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (None, "Internal error"),
        ('"CODEX_API_KEY is not set"', "Internal error: CODEX_API_KEY is not set"),
        (
            '{"message": "stream disconnected\\n before completion"}',
            "Internal error: stream disconnected before completion",
        ),
        ('{"reason": "adapter_exited"}', "Internal error"),
        ("[1, 2]", "Internal error"),
        ('"Internal error"', "Internal error"),
        ('"   "', "Internal error"),
        ('"' + "x" * 400 + '"', "Internal error: " + "x" * 300 + "…"),
    ],
)
def test_an_adapter_error_is_recorded_with_the_cause_its_data_gives(data: str | None, expected: str) -> None:
    error = ErrorObject(code=INTERNAL_ERROR, message="Internal error")
    if data is not None:
        error.data = msgspec.Raw(data.encode())
    assert error_text(error) == expected
