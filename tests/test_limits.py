"""A turn's limits and a session's ceilings, with real processes: ``turn_idle_timeout``, the memory
ceiling (``session_max_memory``) and hard limit (``session_kill_memory``) of a session's tree.

The fake adapter's ``grow`` commands keep memory resident, so that the proxy measures the tree
growing (PSS) as it would an agent's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_proxy.journal import counters, recent_events
from acp_proxy.sessions.ceilings import Verdict, judge
from acp_proxy.sessions.registry import SessionState
from acp_proxy.tasks.records import list_tasks
from tests.support import (
    RESUME_AND_LOAD,
    Gateway,
    adapter_pid,
    cli,
    pid_alive,
    registry,
    send_prompt,
    state_db,
    state_of,
    write_config,
)

pytestmark = pytest.mark.anyio

MIB = 2**20


def start(env: dict[str, str], tmp_path: Path, **backend: Any) -> Any:
    backend.setdefault("store", str(tmp_path / "store"))
    backend.setdefault("caps", RESUME_AND_LOAD)
    config = write_config(tmp_path, pool={"max_live": 4}, backends={"fake": backend})
    return Gateway.start(env, tmp_path, [], proxy_args=["--config", str(config)])


def suspensions(env: dict[str, str]) -> list[tuple[str, str]]:
    """The journal's suspensions: (reason, detail), oldest first."""
    events = recent_events(state_db(env).conn, 1000)[::-1]
    return [(e.label, e.detail) for e in events if e.kind == "suspended"]


async def until_suspended(env: dict[str, str], session: str, old_pid: int) -> None:
    with anyio.fail_after(15):  # the row is written once the tree is gone: a moment after the pid
        while pid_alive(old_pid) or registry(env).get(session).state is not SessionState.SUSPENDED:  # type: ignore[union-attr]
            await anyio.sleep(0.05)


# --- turn_idle_timeout -------------------------------------------------------------------------


async def test_a_quiet_turn_is_cut_after_turn_idle_timeout_and_a_chatty_one_is_not(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with start(proc_env, tmp_path, turn_idle_timeout="500ms") as gw:
        await gw.initialize()
        session = await gw.new_session()
        pid = await adapter_pid(gw, session)
        chatty = await gw.prompt(session, "trickle 2")  # four times the limit, talking all along
        assert chatty["result"]["stopReason"] == "end_turn"
        quiet = await gw.prompt(session, "silent")  # silent: cancelled, and it ends the turn itself
        assert quiet["result"]["stopReason"] == "cancelled"
        assert await adapter_pid(gw, session) == pid, "an adapter that ends its cancelled turn is kept"
        # One that ignores the cancel too: answered by the proxy, its process recycled.
        stuck = await gw.prompt(session, "sleep 30", timeout=15)
        assert stuck["result"]["stopReason"] == "cancelled"
        assert stuck["result"]["_meta"]["acp-proxy"] == {"timedOut": True, "idle": True}
        await until_suspended(proc_env, session, pid)
        restored = await state_of(gw, session)
        assert restored["pid"] != pid
        assert restored["turns"] >= 3, "the session came back with its history"
    tasks = {t.prompt: t for t in list_tasks(state_db(proc_env))}
    assert tasks["trickle 2"].status.value == "done"
    for prompt in ("silent", "sleep 30"):
        assert tasks[prompt].status.value == "timed_out"
        assert tasks[prompt].error is not None
        assert "turn_idle_timeout" in tasks[prompt].error
        assert "idle_timeout" in [e.kind for e in tasks[prompt].events]
    assert [reason for reason, _ in suspensions(proc_env)] == ["turn_idle_timeout", "shutdown"]


async def test_a_request_waiting_for_the_client_stops_the_idle_clock(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with start(proc_env, tmp_path, turn_idle_timeout="400ms") as gw:
        await gw.initialize()
        session = await gw.new_session()
        request_id = await send_prompt(gw, session, "permission")
        asked = await gw.expect(lambda m: m.get("method") == "session/request_permission")
        await anyio.sleep(1.5)  # the user takes their time: the turn waits for them, it is not hung
        await gw.send(
            {"jsonrpc": "2.0", "id": asked["id"], "result": {"outcome": {"outcome": "selected", "optionId": "allow"}}}
        )
        answer = await gw.response_to(request_id)
        assert answer["result"]["stopReason"] == "end_turn"
        texts = [m["params"]["update"]["content"]["text"] for m in gw.updates(session)]
        assert "permission granted" in texts
    task = next(t for t in list_tasks(state_db(proc_env)) if t.prompt == "permission")
    assert task.status.value == "done"


async def test_a_restored_process_that_leaves_its_request_unanswered_is_recycled_not_reused(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    config = write_config(
        tmp_path,
        pool={"max_live": 4, "idle_ttl": "300ms"},
        backends={
            "fake": {
                "store": str(tmp_path / "store"),
                "caps": RESUME_AND_LOAD,
                "hang": ["session/set_mode"],
                "start_timeout": "1s",
            }
        },
    )
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=["--config", str(config)]) as gw:
        await gw.initialize()
        session = await gw.new_session()
        pid = await adapter_pid(gw, session)
        await until_suspended(proc_env, session, pid)  # idle_ttl
        answer = await gw.request("session/set_mode", {"sessionId": session, "modeId": "plan"}, timeout=15)
        assert answer["error"]["data"]["reason"] == "start_timeout"
        assert "did not answer session/set_mode within start_timeout (1s)" in answer["error"]["message"]
        with anyio.fail_after(10):  # journalled as it is answered: written a moment later
            while not (broken := [detail for reason, detail in suspensions(proc_env) if reason == "broken"]):
                await anyio.sleep(0.05)
        assert len(broken) == 1
        assert "after a restore" in broken[0]
        restored = await state_of(gw, session)  # a new process serves it, history intact
        assert restored["pid"] not in (pid, int(broken[0].split()[1]))
        assert restored["turns"] == 1


async def test_a_request_the_agent_withdrew_stops_the_idle_clock_no_more(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with start(proc_env, tmp_path, turn_idle_timeout="500ms") as gw:
        await gw.initialize()
        session = await gw.new_session()
        # The agent asks, withdraws the request with $/cancel_request, then waits for an answer the
        # gateway never gives: the turn is quiet, and nothing waits for the client any more.
        request_id = await send_prompt(gw, session, "ask_then_cancel")
        await gw.expect(lambda m: m.get("method") == "$/cancel_request")
        answer = await gw.response_to(request_id, timeout=15)
        assert answer["result"]["stopReason"] == "cancelled"
        assert answer["result"]["_meta"]["acp-proxy"] == {"timedOut": True, "idle": True}


# --- the memory ceiling of a session -----------------------------------------------------------


def test_the_ceiling_decisions() -> None:
    soft, hard = 100 * MIB, 200 * MIB
    assert judge(90 * MIB, soft=soft, hard=hard, busy=False, turn_running=False) is None
    assert judge(150 * MIB, soft=soft, hard=hard, busy=False, turn_running=False) is Verdict.RECYCLE
    assert judge(150 * MIB, soft=soft, hard=hard, busy=True, turn_running=True) is Verdict.AFTER_TURN
    assert judge(250 * MIB, soft=soft, hard=hard, busy=True, turn_running=True) is Verdict.END_TURN
    assert judge(250 * MIB, soft=soft, hard=hard, busy=True, turn_running=False) is Verdict.AFTER_TURN
    assert judge(250 * MIB, soft=soft, hard=hard, busy=False, turn_running=False) is Verdict.RECYCLE
    assert judge(250 * MIB, soft=None, hard=hard, busy=False, turn_running=False) is Verdict.RECYCLE
    assert judge(150 * MIB, soft=None, hard=hard, busy=True, turn_running=True) is None
    assert judge(100 * MIB, soft=soft, hard=None, busy=False, turn_running=False) is None  # at it fits
    assert judge(10**12, soft=None, hard=None, busy=False, turn_running=False) is None


async def test_an_idle_session_over_its_ceiling_is_recycled_and_comes_back_with_its_history(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with start(proc_env, tmp_path, session_max_memory="80M") as gw:
        await gw.initialize()
        session = await gw.new_session()
        pid = await adapter_pid(gw, session)
        assert (await gw.prompt(session, "grow 40"))["result"]["stopReason"] == "end_turn"
        await anyio.sleep(2.5)  # a measuring round or more: under the ceiling, kept
        assert pid_alive(pid)
        assert registry(proc_env).get(session).state is SessionState.LIVE
        assert (await gw.prompt(session, "grow 60"))["result"]["stopReason"] == "end_turn"
        await until_suspended(proc_env, session, pid)
        restored = await state_of(gw, session)
        assert restored["pid"] != pid
        assert restored["turns"] == 3, "history intact: the turns before the recycle"
    recycled = [(reason, detail) for reason, detail in suspensions(proc_env) if reason != "shutdown"]
    assert len(recycled) == 1
    reason, detail = recycled[0]
    assert reason == "session_max_memory"
    # The operator sees it, with the figures: top's recent events, and the metrics by reason.
    code, out, _ = await cli(proc_env, "top", "--once")
    assert code == 0
    assert f"session_max_memory: {detail}" in out
    code, out, _ = await cli(proc_env, "metrics")
    assert code == 0
    assert 'acp_proxy_evictions_total{backend="fake",reason="session_max_memory"} 1.0' in out
    assert "over session_max_memory (80 MiB)" in detail
    assert "MiB" in detail.split("uses ")[1]


async def test_a_busy_session_over_its_ceiling_finishes_its_turn_then_is_recycled(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with start(proc_env, tmp_path, session_max_memory="60M") as gw:
        await gw.initialize()
        session = await gw.new_session()
        pid = await adapter_pid(gw, session)
        # Over the ceiling from the turn's start, talking for longer than a measuring round, and back
        # under it once the turn has ended: only the turn's end can recycle it.
        answer = await gw.prompt(session, "grow_for_turn 80; trickle 3", timeout=30)
        assert answer["result"]["stopReason"] == "end_turn", "a ceiling never cuts a turn"
        await until_suspended(proc_env, session, pid)
        assert (await state_of(gw, session))["pid"] != pid
    task = next(t for t in list_tasks(state_db(proc_env)) if t.prompt == "grow_for_turn 80; trickle 3")
    assert task.status.value == "done"
    assert [reason for reason, _ in suspensions(proc_env)] == ["session_max_memory", "shutdown"]


async def test_a_turn_past_the_hard_limit_is_ended_with_the_memory_reason(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with start(proc_env, tmp_path, session_max_memory="60M", session_kill_memory="120M") as gw:
        await gw.initialize()
        session = await gw.new_session()
        pid = await adapter_pid(gw, session)
        answer = await gw.prompt(session, "grow_until_cancel 10", timeout=30)
        assert answer["result"]["stopReason"] == "cancelled"
        await until_suspended(proc_env, session, pid)  # recycled although it ended the turn itself
        assert (await state_of(gw, session))["pid"] != pid
    task = next(t for t in list_tasks(state_db(proc_env)) if t.prompt == "grow_until_cancel 10")
    assert task.status.value == "cancelled"
    assert task.error is not None
    assert task.error.startswith("session_kill_memory: its tree uses")
    assert "memory_limit" in [e.kind for e in task.events]
    reasons = [reason for reason, _ in suspensions(proc_env)]
    assert reasons[0] == "session_kill_memory", reasons
    assert {c.label: c.count for c in counters(state_db(proc_env).conn, ["suspended"])}["session_kill_memory"] == 1


async def test_a_recycle_is_told_to_the_notify_command(proc_env: dict[str, str], tmp_path: Path) -> None:
    told = tmp_path / "told.jsonl"
    script = f"import sys; open({str(told)!r}, 'a').write(sys.stdin.read())"
    config = write_config(
        tmp_path,
        pool={"max_live": 4},
        tasks={"notify": "done_only", "notify_command": [sys.executable, "-c", script]},
        backends={"fake": {"store": str(tmp_path / "store"), "caps": RESUME_AND_LOAD, "session_max_memory": "50M"}},
    )
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=["--config", str(config)]) as gw:
        await gw.initialize()
        session = await gw.new_session()
        pid = await adapter_pid(gw, session)
        await gw.prompt(session, "grow 80")
        await until_suspended(proc_env, session, pid)
        with anyio.fail_after(10):
            while not told.exists() or "session_recycled" not in told.read_text():
                await anyio.sleep(0.05)
    notices = [json.loads(line) for line in told.read_text().splitlines()]
    recycled = [n for n in notices if n["event"] == "session_recycled"]
    assert len(recycled) == 1
    assert recycled[0]["sessionId"] == session
    assert recycled[0]["taskId"] is None
    assert recycled[0]["status"] == "recycled"
    assert recycled[0]["previousStatus"] == "session_max_memory"
    assert "over session_max_memory (50 MiB)" in recycled[0]["reason"]
    assert all(n["event"] == "task" for n in notices if n["taskId"] is not None)
