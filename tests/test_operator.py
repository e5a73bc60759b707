"""Tasks and the operator surface, with real processes: every turn's outcome, the CLI, the control socket.

Each test drives a real proxy in front of the fake adapter and runs the real
``acp-proxy`` CLI against the same state dir, the way an operator would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_proxy.journal import counters
from acp_proxy.operator import control
from acp_proxy.ownership import cgroups
from acp_proxy.sessions.registry import SessionState
from acp_proxy.state import StateDB
from acp_proxy.tasks.records import get_task, list_tasks
from tests.support import (
    RESUME_AND_LOAD,
    Gateway,
    adapter_calls,
    adapter_pid,
    cli,
    cli_json,
    fake_command,
    pid_alive,
    registry,
    send_prompt,
    state_db,
    state_of,
    survivors,
    wait_for_task,
    write_config,
)

pytestmark = pytest.mark.anyio

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def start(
    env: dict[str, str], tmp_path: Path, *, tasks: dict[str, str] | None = None, max_live: int = 4, **options: Any
) -> Any:
    options.setdefault("store", str(tmp_path / "store"))
    options.setdefault("caps", RESUME_AND_LOAD)
    config = write_config(tmp_path, pool={"max_live": max_live}, tasks=tasks)
    return Gateway.start(env, tmp_path, proxy_args=["--config", str(config)], **options)


def files_containing(root: Path, needle: bytes) -> list[Path]:
    return [path for path in root.rglob("*") if path.is_file() and needle in path.read_bytes()]


TASK_KEYS = {
    "taskId",
    "sessionId",
    "backend",
    "status",
    "recordedStatus",
    "stopReason",
    "error",
    "instance",
    "lease",
    "requestId",
    "traceparent",
    "prompt",
    "createdAt",
    "startedAt",
    "firstOutputAt",
    "endedAt",
    "durationSeconds",
    "updateCount",
    "toolCalls",
    "summary",
    "updatedAt",
}


# --- every turn's outcome --------------------------------------------------------------------


async def test_a_finished_turn_is_a_task_with_its_outcome_progress_and_events(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with start(proc_env, tmp_path) as gw:
        await gw.initialize()
        session = await gw.new_session()
        request_id = await send_prompt(gw, session, "stream 5; permission", {"traceparent": TRACEPARENT})
        gw.handler = lambda msg: {"result": {"outcome": {"outcome": "selected", "optionId": "allow"}}}
        answer = await gw.response_to(request_id)
        assert answer["result"]["stopReason"] == "end_turn"
        listed = await cli_json(proc_env, "tasks", "list")
        assert len(listed["tasks"]) == 1
        assert set(listed["tasks"][0]) == TASK_KEYS
        task = await cli_json(proc_env, "tasks", "show", listed["tasks"][0]["taskId"])
    assert set(task) == TASK_KEYS | {"events", "eventsDropped"}
    assert task["status"] == "done"
    assert task["stopReason"] == "end_turn"
    assert task["sessionId"] == session
    assert task["updateCount"] == 6
    assert task["summary"].endswith("chunk 4 permission granted")
    assert task["traceparent"] == TRACEPARENT
    assert task["prompt"] == "stream 5; permission"
    assert task["requestId"] == str(request_id)
    assert task["lease"] is not None
    kinds = [e["kind"] for e in task["events"]]
    assert kinds == ["started", "first_output", "permission_asked", "permission_answered", "finished"]
    assert task["events"][2]["detail"] == "Run the tool"
    assert task["events"][3]["detail"] == "allow"
    assert task["startedAt"] <= task["firstOutputAt"] <= task["endedAt"]


async def test_outcomes_after_errors_crashes_and_cancels(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with start(proc_env, tmp_path, fail={"session/prompt": -32099}) as gw:
        await gw.initialize()
        session = await gw.new_session()
        assert "error" in await gw.prompt(session, "stream 1")
    async with start(proc_env, tmp_path) as gw:
        await gw.initialize()
        crashing = await gw.new_session()
        assert "error" in await gw.prompt(crashing, "stream 2; crash 3")
        cancelled = await gw.new_session()
        request_id = await send_prompt(gw, cancelled, "wait_cancel")
        await wait_for_task(proc_env, "running", prompt="wait_cancel")
        # Its first output first (it is a task event too, and would otherwise come after the cancel).
        await gw.expect(lambda m: m.get("method") == "session/update" and m["params"]["sessionId"] == cancelled)
        await gw.notify("session/cancel", {"sessionId": cancelled})
        assert (await gw.response_to(request_id))["result"]["stopReason"] == "cancelled"
    tasks = {t.session_id: t for t in list_tasks(state_db(proc_env))}
    assert tasks[session].status.value == "failed"
    assert "injected failure (code -32099)" in (tasks[session].error or "")
    assert tasks[crashing].status.value == "failed"
    assert "exited" in (tasks[crashing].error or "")
    assert tasks[crashing].update_count == 2
    assert tasks[cancelled].status.value == "cancelled"
    assert [e.kind for e in tasks[cancelled].events][-2:] == ["cancel_requested", "finished"]


async def test_a_queued_prompt_is_a_task_before_its_session_is_resumed(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with start(proc_env, tmp_path) as gw:
        await gw.initialize()
        session = await gw.new_session()
        await gw.prompt(session, "stream 1")
    async with start(proc_env, tmp_path) as gw:
        await gw.initialize()
        assert (await gw.prompt(session, "stream 2"))["result"]["stopReason"] == "end_turn"
    second = list_tasks(state_db(proc_env))[0]
    assert [e.kind for e in second.events][:3] == ["queued", "resumed", "started"]
    assert second.status.value == "done"


async def test_turn_timeout_cancels_the_turn_and_records_timed_out(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with start(proc_env, tmp_path, tasks={"turn_timeout": "400ms"}) as gw:
        await gw.initialize()
        session = await gw.new_session()
        pid = await adapter_pid(gw, session)
        answer = await gw.prompt(session, "wait_cancel")
        assert answer["result"]["stopReason"] == "cancelled"
        assert await adapter_pid(gw, session) == pid, "the adapter ended the turn itself: it is kept"
        # An adapter that ignores session/cancel: answered by the proxy, process retired, session resumable.
        answer = await gw.prompt(session, "sleep 30", timeout=15)
        assert answer["result"]["stopReason"] == "cancelled"
        assert answer["result"]["_meta"]["acp-proxy"]["timedOut"] is True
        with anyio.fail_after(10):  # the row is written once the tree is gone: a moment after the pid
            while pid_alive(pid) or registry(proc_env).get(session).state is not SessionState.SUSPENDED:  # type: ignore[union-attr]
                await anyio.sleep(0.05)
        assert (await gw.prompt(session, "stream 1"))["result"]["stopReason"] == "end_turn"
    statuses = [t.status.value for t in list_tasks(state_db(proc_env))][::-1]
    assert statuses == ["done", "timed_out", "done", "timed_out", "done"]  # "state" turns are tasks too


async def test_a_turn_still_running_cancel_timeout_after_session_cancel_is_answered_and_its_process_retired(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    # The adapter ignores the cancel for a second (gemini --acp ends its retries first), and its
    # stdin closing and SIGTERM: it writes on for a while after the proxy has given up on it.
    late = {"ignore_eof": True, "ignore_sigterm": True}
    async with start(proc_env, tmp_path, tasks={"cancel_timeout": "300ms"}, **late) as gw:
        await gw.initialize()
        session = await gw.new_session()
        pid = await adapter_pid(gw, session)
        request_id = await send_prompt(gw, session, "ignore_cancel 1")
        await gw.expect(lambda m: m.get("method") == "session/update")  # the turn runs
        await gw.notify("session/cancel", {"sessionId": session})
        assert (await gw.response_to(request_id))["result"] == {"stopReason": "cancelled"}
        answered = next(i for i, m in enumerate(gw.received) if m.get("id") == request_id and "method" not in m)
        assert await survivors([pid]) == [], "the process that ignored the cancel is stopped, tree and all"
        after = gw.received[answered + 1 :]
        assert [m for m in after if "late" in json.dumps(m) or m.get("id") == request_id] == []
        old = [e for e in gw.adapter_record() if e["pid"] == pid]
        closed_at = next(i for i, e in enumerate(old) if "session/close" in e.get("in", ""))
        assert any("late" in e.get("out", "") for e in old[closed_at:]), "it wrote on after the proxy's answer"
        assert registry(proc_env).get(session).state is SessionState.SUSPENDED  # type: ignore[union-attr]
        restored = await state_of(gw, session)  # the next request brings it back, history and all
        assert restored["pid"] != pid
        assert restored["history"] > 0
        db = state_db(proc_env)
        with anyio.fail_after(10):
            while db.conn.execute("SELECT state FROM leases WHERE adapter_pid = ?", (pid,)).fetchone()[0] != "closed":
                await anyio.sleep(0.05)
    task = next(t for t in list_tasks(state_db(proc_env)) if t.prompt == "ignore_cancel 1")
    assert (task.status.value, task.stop_reason) == ("cancelled", "cancelled")
    assert (task.error or "").startswith("cancel_timeout")
    assert "cancel_timeout" in [e.kind for e in task.events]
    suspended = counters(state_db(proc_env).conn, ["suspended"])
    assert [(c.label, c.count) for c in suspended if c.label != "shutdown"] == [("cancel_timeout", 1)]
    code, out, _ = await cli(proc_env, "metrics")
    assert code == 0
    assert any(
        line.startswith("acp_proxy_evictions_total{") and 'reason="cancel_timeout"' in line for line in out.splitlines()
    )


async def test_cancel_timeout_0_for_a_backend_waits_for_its_adapter(proc_env: dict[str, str], tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        tasks={"cancel_timeout": "300ms"},
        backends={"slow": {"store": str(tmp_path / "store"), "caps": RESUME_AND_LOAD, "cancel_timeout": 0}},
    )
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=["--config", str(config)]) as gw:
        await gw.initialize()
        session = await gw.new_session()
        pid = await adapter_pid(gw, session)
        request_id = await send_prompt(gw, session, "ignore_cancel 1")
        await gw.expect(lambda m: m.get("method") == "session/update")
        await gw.notify("session/cancel", {"sessionId": session})
        assert (await gw.response_to(request_id))["result"] == {"stopReason": "cancelled"}
        late = [m for m in gw.updates(session) if "late" in json.dumps(m)]
        assert late, "the late updates of the adapter, which answered on its own"
        assert await adapter_pid(gw, session) == pid, "and its process is kept"
    task = next(t for t in list_tasks(state_db(proc_env)) if t.prompt == "ignore_cancel 1")
    assert (task.status.value, task.stop_reason, task.error) == ("cancelled", "cancelled", None)
    assert [c.label for c in counters(state_db(proc_env).conn, ["suspended"])] == ["shutdown"]


async def test_tasks_of_a_killed_proxy_are_lost_at_once_to_readers_and_swept_at_the_next_start(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with start(proc_env, tmp_path) as gw:
        await gw.initialize()
        session = await gw.new_session()
        await send_prompt(gw, session, "wait_cancel")
        running = await wait_for_task(proc_env, "running", prompt="wait_cancel")
        gw.process.kill()
        await gw.process.wait()
    shown = await cli_json(proc_env, "tasks", "show", running["taskId"])
    assert (shown["status"], shown["recordedStatus"]) == ("lost", "running")
    code, _out, err = await cli(proc_env, "tasks", "cancel", running["taskId"])
    assert code == 1
    assert "is gone" in err
    assert (await cli_json(proc_env, "tasks", "list", "--status", "lost"))["tasks"][0]["taskId"] == running["taskId"]
    async with start(proc_env, tmp_path) as gw:
        await gw.initialize()
        record = get_task(state_db(proc_env), running["taskId"])
        assert record is not None
        assert record.status.value == "lost"
        assert (await gw.prompt(session, "stream 1"))["result"]["stopReason"] == "end_turn"


# --- acting through the control socket ------------------------------------------------------


async def test_tasks_cancel_ends_a_running_turn_and_keeps_the_process(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with start(proc_env, tmp_path) as gw:
        await gw.initialize()
        session = await gw.new_session()
        pid = await adapter_pid(gw, session)
        request_id = await send_prompt(gw, session, "wait_cancel")
        running = await wait_for_task(proc_env, "running", prompt="wait_cancel")
        result = await cli_json(proc_env, "tasks", "cancel", running["taskId"][:6])
        assert result == {
            "taskId": running["taskId"],
            "sessionId": session,
            "instance": running["instance"],
            "cancelled": True,
            "status": "cancelled",
        }
        assert (await gw.response_to(request_id))["result"]["stopReason"] == "cancelled"
        assert await adapter_pid(gw, session) == pid
        code, out, _ = await cli(proc_env, "tasks", "cancel", running["taskId"])
        assert code == 0
        assert "already ended: cancelled" in out
    events = (await cli_json(proc_env, "tasks", "show", running["taskId"]))["events"]
    assert {"kind": "cancel_requested", "detail": "by an operator"} in [
        {"kind": e["kind"], "detail": e["detail"]} for e in events
    ]


async def test_tasks_show_follow_prints_until_the_task_ends(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with start(proc_env, tmp_path) as gw:
        await gw.initialize()
        session = await gw.new_session()
        request_id = await send_prompt(gw, session, "wait_cancel")
        running = await wait_for_task(proc_env, "running", prompt="wait_cancel")
        argv = [sys.executable, "-m", "acp_proxy", "tasks", "show", running["taskId"], "--follow", "--json"]
        async with await anyio.open_process(argv, env=proc_env) as follower:
            assert follower.stdout is not None
            output = b""
            with anyio.fail_after(30):
                while b"\n" not in output:  # it has shown the running task: now the turn may end
                    output += await follower.stdout.receive()
            await gw.notify("session/cancel", {"sessionId": session})
            await gw.response_to(request_id)
            with anyio.fail_after(10):
                async for chunk in follower.stdout:
                    output += chunk
                await follower.wait()
    snapshots = [json.loads(line) for line in output.splitlines()]
    assert follower.returncode == 0
    assert snapshots[0]["status"] == "running"
    assert snapshots[-1]["status"] == "cancelled"
    assert [e["kind"] for e in snapshots[-1]["events"]][-1] == "finished"


async def test_a_queued_task_cancelled_by_an_operator_is_answered_cancelled_and_never_sent(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with start(proc_env, tmp_path, max_live=1) as gw:
        await gw.initialize()
        first = await gw.new_session()
        second = await gw.new_session()  # the only slot: the first is suspended
        busy = await send_prompt(gw, first, "wait_cancel")  # resumes the first, suspending the second
        await wait_for_task(proc_env, "running", prompt="wait_cancel")
        waiting = await send_prompt(gw, second, "stream 1; never sent")
        queued = await wait_for_task(proc_env, "queued", prompt="never sent")
        result = await cli_json(proc_env, "tasks", "cancel", queued["taskId"], "--no-wait")
        assert (result["cancelled"], result["status"]) == (True, "queued")
        await gw.notify("session/cancel", {"sessionId": first})
        assert (await gw.response_to(busy))["result"]["stopReason"] == "cancelled"
        assert (await gw.response_to(waiting))["result"]["stopReason"] == "cancelled"
    record = get_task(state_db(proc_env), queued["taskId"])
    assert record is not None
    assert record.status.value == "cancelled"
    assert record.started_at is None
    prompts = [m["params"]["prompt"][0]["text"] for m in adapter_calls(gw, "session/prompt")]
    assert "stream 1; never sent" not in prompts


async def test_sessions_suspend_and_close_from_the_shell(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with start(proc_env, tmp_path) as gw:
        await gw.initialize()
        first, second = await gw.new_session(), await gw.new_session()
        pid = await adapter_pid(gw, first)
        listed = await cli_json(proc_env, "sessions", "list")
        assert {s["sessionId"]: s["state"] for s in listed["sessions"]} == {first: "live", second: "live"}
        shown = await cli_json(proc_env, "sessions", "show", first)
        assert [p["pid"] for p in shown["processes"] if p["pid"] == pid] == [pid]
        assert all(p["rssBytes"] > 0 for p in shown["processes"])
        assert [t["status"] for t in shown["recentTasks"]] == ["done"]
        suspended = await cli_json(proc_env, "sessions", "suspend", first)
        assert (suspended["done"], suspended["state"], suspended["via"]) == (True, "suspended", "control socket")
        assert not pid_alive(pid)
        assert registry(proc_env).get(first).state is SessionState.SUSPENDED  # type: ignore[union-attr]
        assert (await state_of_turns(gw, first)) == 1, "resumed transparently: the earlier turn is remembered"
        closed = await cli_json(proc_env, "sessions", "close", first)
        assert (closed["done"], closed["state"]) == (True, "closed")
        answer = await gw.prompt(first, "stream 1")
        assert answer["error"]["message"] == f"Session {first} was closed: session/load or session/resume it first"
        code, out, _ = await cli(proc_env, "sessions", "close", first)
        assert (code, out.strip()) == (0, f"session {first} is already closed")
        listed = await cli_json(proc_env, "sessions", "list")
        assert [s["sessionId"] for s in listed["sessions"]] == [second]
        everything = await cli_json(proc_env, "sessions", "list", "--all")
        assert {s["sessionId"] for s in everything["sessions"]} == {first, second}


async def state_of_turns(gw: Gateway, session: str) -> int:
    answer = await gw.prompt(session, "state")
    assert answer["result"]["stopReason"] == "end_turn"
    updates = gw.updates(session)
    gw.clear_stash()
    return int(json.loads(updates[-1]["params"]["update"]["content"]["text"])["turns"])


async def test_a_busy_session_is_not_suspended(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with start(proc_env, tmp_path) as gw:
        await gw.initialize()
        session = await gw.new_session()
        request_id = await send_prompt(gw, session, "wait_cancel")
        await wait_for_task(proc_env, "running", prompt="wait_cancel")
        code, _, err = await cli(proc_env, "sessions", "suspend", session)
        assert code == 1
        assert "busy" in err
        await gw.notify("session/cancel", {"sessionId": session})
        assert (await gw.response_to(request_id))["result"]["stopReason"] == "cancelled"


async def test_a_dead_proxys_session_is_closed_in_the_database(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with start(proc_env, tmp_path) as gw:
        await gw.initialize()
        session = await gw.new_session()
        gw.process.kill()
        await gw.process.wait()
    closed = await cli_json(proc_env, "sessions", "close", session)
    assert (closed["done"], closed["state"], closed["via"]) == (True, "closed", "database")
    code, _, _ = await cli(proc_env, "reap")
    assert code == 0


async def test_status_reports_proxies_sessions_leases_processes_and_turns(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with start(proc_env, tmp_path) as gw:
        await gw.initialize()
        session = await gw.new_session()
        request_id = await send_prompt(gw, session, "wait_cancel")
        running = await wait_for_task(proc_env, "running", prompt="wait_cancel")
        report = await cli_json(proc_env, "status")
        code, text, _ = await cli(proc_env, "status")
        await gw.notify("session/cancel", {"sessionId": session})
        await gw.response_to(request_id)
    assert set(report) == {
        "stateDir",
        "ownership",
        "ownershipMode",
        "instances",
        "sessions",
        "liveSessions",
        "slots",
        "leases",
        "processes",
        "tasks",
        "runningTasks",
        "timings",
        "servers",
    }
    assert report["servers"] == []  # no acp-proxy serve runs here
    assert [s["sessionId"] for s in report["liveSessions"]] == [session]
    [slot] = report["slots"]
    assert slot["sessionId"] == session
    assert slot["busy"] is True  # its turn is running
    [instance] = report["instances"]
    assert instance["alive"] is True
    assert instance["pid"] == gw.pid
    assert instance["proxy"]["pool"]["live"] >= 1
    # The mode in force for this proxy's trees, and the one a proxy started here would get: the same.
    here = cgroups.detect("auto")
    assert instance["proxy"]["ownership"]["mode"] == report["ownershipMode"]["mode"] == here.mode
    assert report["ownershipMode"]["reason"] == here.reason
    assert [t["taskId"] for t in instance["proxy"]["turns"]] == [running["taskId"]]
    assert report["sessions"] == {"live": 1}
    assert report["leases"]["open"] >= 1
    assert report["processes"]
    assert all(p["rssBytes"] > 0 and p["lease"] for p in report["processes"])
    assert report["tasks"]["running"] == 1
    assert report["runningTasks"][0]["taskId"] == running["taskId"]
    assert code == 0
    assert "1 running" in text
    assert f"ownership mode here: {here.mode} ({here.reason})" in text
    assert f"{here.mode} mode" in text.split("proxies:")[1]
    assert running["taskId"] in text
    # Where the time went, counted by the proxy and added to the install's totals at the latest at its exit.
    after = (await cli_json(proc_env, "status"))["timings"]
    [backend] = after
    assert {name: q["count"] for name, q in after[backend].items()} == {
        "start": 1,
        "session_new": 1,
        "first_update": 1,  # the cancelled turn streamed before it waited
        "turn": 1,
    }  # no slot wait: the process launched with the proxy took its slot at launch
    for q in after[backend].values():
        assert 0 <= q["p50"] <= q["p95"]
    code, text, _ = await cli(proc_env, "status")
    assert "timings, p50/p95 (count) since the install was created:" in text
    assert "start " in text
    assert "turn " in text


async def test_control_socket_commands_and_refusals(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with start(proc_env, tmp_path) as gw:
        await gw.initialize()
        await gw.new_session()
        [path] = (Path(proc_env["ACP_PROXY_STATE_DIR"]) / "control").glob("*.sock")
        assert oct(path.stat().st_mode & 0o777) == "0o600"
        assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
        status = await anyio.to_thread.run_sync(control.request, path, "status", None)
        assert status["pid"] == gw.pid
        for command, args, code in [
            ("bogus", {}, "unknown_command"),
            ("cancel_task", {}, "invalid_args"),
            ("cancel_task", {"taskId": "nope"}, "unknown_task"),
            ("close_session", {"sessionId": 7}, "invalid_args"),
            ("suspend_session", {"sessionId": "nope"}, "unknown_session"),
        ]:
            with pytest.raises(control.ControlError) as refused:
                await anyio.to_thread.run_sync(control.request, path, command, args)
            assert refused.value.code == code
    assert not path.exists(), "the socket is removed when the proxy exits"


# --- reading with no proxy, and bad input ---------------------------------------------------


@pytest.mark.parametrize("state", ["missing", "empty"])
async def test_the_cli_against_a_missing_or_empty_state_dir(
    proc_env: dict[str, str], tmp_path: Path, state: str
) -> None:
    if state == "empty":
        (tmp_path / "state").mkdir(mode=0o700)
    for args, key in [(("status",), "instances"), (("sessions", "list"), "sessions"), (("tasks", "list"), "tasks")]:
        document = await cli_json(proc_env, *args)
        assert document[key] == []
        code, out, err = await cli(proc_env, *args)
        assert code == 0
        assert "no proxy has used" in out
        assert err == ""
    for args in [
        ("tasks", "show", "0123456789ab"),
        ("tasks", "cancel", "0123456789ab"),
        ("sessions", "show", "s-1"),
        ("sessions", "close", "s-1"),
        ("tasks", "list", "--session", "s-1"),
    ]:
        code, out, err = await cli(proc_env, *args)
        assert code == 2, args
        assert err.startswith("acp-proxy: no ")
    assert not (tmp_path / "state" / "state.db").exists(), "reading never creates a database"


async def test_bad_input_exits_2_with_a_clear_message(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with start(proc_env, tmp_path) as gw:
        await gw.initialize()
        session = await gw.new_session()
        await gw.prompt(session, "stream 1")
        for args, message in [
            (("tasks", "list", "--status", "finished"), "'finished' is not a task status"),
            (("tasks", "list", "--status", "done,bogus"), "'bogus' is not a task status"),
            (("sessions", "list", "--state", "dead"), "'dead' is not a session state"),
            (("tasks", "show", "ffffffffffff"), "no task ffffffffffff"),
            (("sessions", "suspend", "nope-nope"), "no session nope-nope"),
            (("tasks", "list", "--limit", "0"), "expected a positive integer"),
        ]:
            code, _, err = await cli(proc_env, *args, process=True)  # the program's own exit status
            assert code == 2, (args, err)
            assert message in err, (args, err)
        done = await cli_json(proc_env, "tasks", "list", "--status", "done", "--session", session[:8])
        assert len(done["tasks"]) == 1
        assert (await cli_json(proc_env, "tasks", "list", "--status", "failed,lost"))["tasks"] == []


# --- logs -------------------------------------------------------------------------------------


async def test_json_logs_carry_ids_and_the_traceparent(proc_env: dict[str, str], tmp_path: Path) -> None:
    env = {**proc_env, "ACP_PROXY_LOG_FORMAT": "json"}
    async with start(env, tmp_path) as gw:
        await gw.initialize()
        session = await gw.new_session()
        request_id = await send_prompt(gw, session, "stream 2", {"traceparent": TRACEPARENT})
        await gw.response_to(request_id)
    lines = [json.loads(line) for line in gw.stderr.decode().splitlines()]
    assert lines
    assert all({"ts", "level", "logger", "msg", "pid"} <= set(line) for line in lines)
    assert all(line["pid"] == gw.pid for line in lines)
    done = [line for line in lines if line.get("task") and line["msg"].endswith("done: end_turn")]
    assert len(done) == 1
    assert done[0]["session"] == session
    assert done[0]["traceparent"] == TRACEPARENT
    assert done[0]["lease"]
    assert done[0]["instance"]


async def test_an_invalid_log_format_is_bad_input(proc_env: dict[str, str], tmp_path: Path) -> None:
    code, _, err = await cli({**proc_env, "ACP_PROXY_LOG_FORMAT": "xml"}, "--", "true")
    assert code == 2
    assert "ACP_PROXY_LOG_FORMAT must be one of text, json" in err


# --- many proxies, one database -----------------------------------------------------------------


async def test_concurrent_proxies_record_every_turn_in_one_database(proc_env: dict[str, str], tmp_path: Path) -> None:
    async def serve(index: int) -> list[str]:
        sessions = []
        async with start(proc_env, tmp_path / f"p{index}", store=str(tmp_path / "store")) as gw:
            await gw.initialize()
            for _ in range(3):
                session = await gw.new_session()
                sessions.append(session)
                for _ in range(4):
                    assert (await gw.prompt(session, "stream 3"))["result"]["stopReason"] == "end_turn"
        return sessions

    (tmp_path / "p0").mkdir()
    (tmp_path / "p1").mkdir()
    (tmp_path / "p2").mkdir()
    results: dict[int, list[str]] = {}

    async def run(index: int) -> None:
        results[index] = await serve(index)

    async with anyio.create_task_group() as tasks:
        for index in range(3):
            tasks.start_soon(run, index)
    db = state_db(proc_env)
    rows = list_tasks(db, limit=None)
    assert len(rows) == 36
    assert {r.status.value for r in rows} == {"done"}
    assert all(r.update_count == 3 for r in rows)
    assert len({r.instance_id for r in rows}) == 3
    assert db.conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


async def test_secrets_expanded_from_the_environment_reach_neither_the_database_nor_the_logs(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    canary = "canary-5f0c1d2e9a"
    env = {**proc_env, "ACP_PROXY_TEST_TOKEN": canary, "ACP_PROXY_LOG_FORMAT": "json", "ACP_PROXY_LOG_LEVEL": "debug"}
    command = [*fake_command(), "--token=${ACP_PROXY_TEST_TOKEN}"]
    config = tmp_path / "secret.toml"
    config.write_text(
        f'[backends.fake]\ncommand = {json.dumps(command)}\nenv = {{ FAKE_TOKEN = "${{ACP_PROXY_TEST_TOKEN}}" }}\n'
    )
    async with Gateway.start(env, tmp_path, [], proxy_args=["--config", str(config)]) as gw:
        await gw.initialize()
        session = await gw.new_session()
        assert (await gw.prompt(session, "stream 2"))["result"]["stopReason"] == "end_turn"
        leases = await cli(env, "leases", "--json")
    assert canary not in gw.stderr.decode()
    assert files_containing(Path(env["ACP_PROXY_STATE_DIR"]), canary.encode()) == []
    lease_argv = json.loads(leases[1])["leases"][0]["argv"]
    assert lease_argv[-1] == "--token=${ACP_PROXY_TEST_TOKEN}", "the template is recorded, not its value"


async def test_a_turn_in_flight_when_the_gateway_leaves_is_recorded_cancelled(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with start(proc_env, tmp_path) as gw:
        await gw.initialize()
        session = await gw.new_session()
        request_id = await send_prompt(gw, session, "wait_cancel")
        running = await wait_for_task(proc_env, "running", prompt="wait_cancel")
        assert await gw.close() == 0
    [answer] = [m for m in gw.received if m.get("id") == request_id]
    assert answer["error"]["code"] == -32800
    assert answer["error"]["data"]["reason"] == "proxy_shutdown"
    record = get_task(state_db(proc_env), running["taskId"])
    assert record is not None
    assert record.status.value == "cancelled"


async def test_a_control_socket_that_cannot_be_made_does_not_stop_the_proxy(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    state = tmp_path / "state"
    await anyio.to_thread.run_sync(lambda: state.mkdir(mode=0o700))
    await anyio.to_thread.run_sync((state / "control").write_text, "in the way")
    async with start(proc_env, tmp_path) as gw:
        await gw.initialize()
        session = await gw.new_session()
        assert (await gw.prompt(session, "stream 2"))["result"]["stopReason"] == "end_turn"
        code, _, err = await cli(proc_env, "sessions", "suspend", session)
        assert code == 1
        assert "cannot be reached" in err
    assert "control socket" in gw.stderr.decode()
    assert "not available" in gw.stderr.decode()


async def test_a_corrupt_database_is_a_clear_message_not_a_traceback(proc_env: dict[str, str], tmp_path: Path) -> None:
    state = tmp_path / "state"
    await anyio.to_thread.run_sync(lambda: state.mkdir(mode=0o700))
    await anyio.to_thread.run_sync((state / "state.db").write_bytes, b"this is not a database" * 100)
    for args in [("status",), ("tasks", "list"), ("sessions", "list", "--json"), ("leases",)]:
        code, _, err = await cli(proc_env, *args)
        assert code == 2, (args, err)
        assert err.startswith("acp-proxy: state: ")
        assert "Traceback" not in err


def test_the_demo_runs_clean(proc_env: dict[str, str]) -> None:
    """``scripts/demo``, a new user's first command, passes every one of its own checks."""
    result = subprocess.run(
        [sys.executable, "-m", "scripts.demo"],
        env=proc_env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parent.parent,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "✗" not in result.stdout
    assert "Every turn is on record" in result.stdout


async def test_cancelling_a_task_whose_end_is_being_written_says_it_ended(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from acp_proxy.concurrency import Stopping
    from acp_proxy.config import validate
    from acp_proxy.operator.control import ControlError
    from acp_proxy.operator.operations import Operations
    from acp_proxy.tasks.records import TaskRegistry
    from acp_proxy.tasks.status import outcome_of
    from acp_proxy.tasks.turn import Turn
    from acp_proxy.tasks.turns import TurnBook

    turn = Turn(task_id="0123456789ab", session_id="s", backend="b", request_id="1")
    turn.start(None, None)
    turn.finish(outcome_of(stop_reason="end_turn"))
    stopping = Stopping()
    config = validate({"backends": {"b": {"command": ["b"]}}})
    turns = TurnBook(TaskRegistry(StateDB(tmp_path / "state"), "inst"), config, stopping)
    turns.settled_unwritten.append(turn)
    proxy = SimpleNamespace(turns=turns, stopping=stopping)
    with pytest.raises(ControlError) as refused:
        await Operations(proxy).cancel_task({"taskId": turn.task_id})  # type: ignore[arg-type]
    assert refused.value.code == "task_finished"
    assert "(done)" in refused.value.message
