"""Task notifications and ``tasks watch``, with real proxies in front of the fake adapter.

The notification command is a small script written to the test's directory: it appends
what it reads on its stdin to a file, so each line of that file is one notification.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import Process

from acp_proxy.config import ConfigError, NotifyPolicy, validate
from acp_proxy.journal import counters
from acp_proxy.tasks.notify import LANE_LIMIT, Notifier, notice_of, wanted, wants_waiting
from acp_proxy.tasks.status import TaskStatus, outcome_of
from acp_proxy.tasks.turn import SUMMARY_CHARS, Turn
from tests.support import (
    RESUME_AND_LOAD,
    Gateway,
    cli,
    cli_json,
    send_prompt,
    state_db,
    survivors,
    wait_for_task,
    write_config,
)

pytestmark = pytest.mark.anyio

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
NOTICE_KEYS = {
    "version",
    "event",
    "taskId",
    "sessionId",
    "title",
    "backend",
    "status",
    "previousStatus",
    "reason",
    "durationSeconds",
    "lastText",
    "traceparent",
    "instance",
    "at",
}
RECORDER = "import sys\nwith open(sys.argv[1], 'ab') as fh:\n    fh.write(sys.stdin.buffer.read())\n"
HANGER = (
    "import os, subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)'])\n"
    "with open(sys.argv[1], 'a') as fh:\n"
    "    fh.write(f'{os.getpid()} {child.pid}\\n')\n"
    "time.sleep(3600)\n"
)
FAILER = "import sys\nsys.stdin.read()\nprint('no route to the chat server', file=sys.stderr)\nsys.exit(1)\n"


def script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def recorder(tmp_path: Path) -> tuple[list[str], Path]:
    """A notify_command appending each notification to a file, and that file."""
    return [sys.executable, script(tmp_path, "record.py", RECORDER), str(tmp_path / "notices.jsonl")], (
        tmp_path / "notices.jsonl"
    )


def start(env: dict[str, str], tmp_path: Path, tasks: dict[str, Any], **options: Any) -> Any:
    options.setdefault("store", str(tmp_path / "store"))
    options.setdefault("caps", RESUME_AND_LOAD)
    config = write_config(tmp_path, pool={"max_live": 4}, tasks=tasks)
    return Gateway.start(env, tmp_path, proxy_args=["--config", str(config)], **options)


def read_notices(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def notices_at_least(path: Path, count: int, timeout: float = 15) -> list[dict[str, Any]]:
    with anyio.fail_after(timeout):
        while len(found := read_notices(path)) < count:
            await anyio.sleep(0.05)
    return found


# --- what is told, by policy ----------------------------------------------------------------

WANTED = {
    # policy: the statuses a task under it is told about taking
    "done_only": {"done", "failed", "cancelled", "timed_out", "lost"},
    "waiting": {"done", "failed", "cancelled", "timed_out", "lost"},
    "state_changes": {"queued", "running", "done", "failed", "cancelled", "timed_out", "lost"},
    "silent": set(),
}


@pytest.mark.parametrize("policy", sorted(WANTED))
@pytest.mark.parametrize("status", list(TaskStatus))
def test_which_status_changes_a_policy_tells(policy: NotifyPolicy, status: TaskStatus) -> None:
    assert wanted(policy, status) is (status.value in WANTED[policy])


@pytest.mark.parametrize("policy", sorted(WANTED))
def test_which_policies_tell_a_waiting_request(policy: NotifyPolicy) -> None:
    assert wants_waiting(policy) is (policy in ("waiting", "state_changes"))


@pytest.mark.anyio
async def test_a_waiting_permission_is_told_and_answered_from_the_command_line(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """``[tasks] notify = "waiting"``: the operator's command hears of the request, and
    ``acp-proxy permissions answer`` answers it (the first answer wins: a second is refused)."""
    command, notices = recorder(tmp_path)
    async with start(proc_env, tmp_path, {"notify": "waiting", "notify_command": command}) as gw:
        await gw.initialize()
        session = await gw.new_session()
        request_id = await send_prompt(gw, session, "permission")
        asked = await gw.expect(lambda m: m.get("method") == "session/request_permission")
        [notice] = await notices_at_least(notices, 1)
        assert notice["event"] == "request_waiting"
        assert notice["status"] == "waiting"
        assert notice["sessionId"] == session
        assert notice["reason"].startswith("session/request_permission")
        assert "1 waiting for an answer" in (await cli(proc_env, "status"))[1]
        listed = (await cli_json(proc_env, "permissions", "list"))["requests"]
        assert [r["request"] for r in listed] == [notice["request"]]
        assert [o["optionId"] for o in listed[0]["options"]] == [o["optionId"] for o in asked["params"]["options"]]
        code, _, err = await cli(proc_env, "permissions", "answer", notice["request"], "no-such-option")
        assert code == 2, err
        code, out, err = await cli(proc_env, "permissions", "answer", notice["request"], "allow")
        assert code == 0, err
        assert "allow" in out
        withdrawn = await gw.expect(lambda m: m.get("method") == "$/cancel_request")
        assert withdrawn["params"]["requestId"] == asked["id"]
        assert (await gw.response_to(request_id))["result"]["stopReason"] == "end_turn"
        code, _, err = await cli(proc_env, "permissions", "answer", notice["request"], "allow")
        assert code == 1
        assert "not waiting" in err
        assert (await cli_json(proc_env, "permissions", "list"))["requests"] == []
        told = await notices_at_least(notices, 2)
        assert told[1]["status"] == "done"


# (stop reason, error, why the proxy ended it) -> the notice's reason
REASONS = [
    ("end_turn", None, None, "end_turn"),
    (None, (-32603, "boom"), None, "boom (code -32603)"),
    ("cancelled", None, None, "cancelled"),
    (
        "cancelled",
        None,
        "cancel_timeout: not ended 30s after session/cancel",
        "cancel_timeout: not ended 30s after session/cancel",
    ),
]


@pytest.mark.parametrize(("stop_reason", "error", "ended_by", "reason"), REASONS)
def test_a_notice_says_why_a_task_ended(
    stop_reason: str | None, error: tuple[int, str] | None, ended_by: str | None, reason: str
) -> None:
    turn = Turn(task_id="t1", session_id="s1", backend="gemini", request_id="1")
    turn.start("l1", None)
    turn.finish(outcome_of(stop_reason=stop_reason, error=error, ended_by=ended_by))
    assert notice_of(turn, turn.status, TaskStatus.RUNNING, title=None, instance="p1").reason == reason


def test_a_full_queue_drops_notices_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    notifier = Notifier(("notify",), default="state_changes", timeout=1.0, instance_id="inst")
    turn = Turn(task_id="0123456789ab", session_id="s", backend="b", request_id="1")
    for _ in range(LANE_LIMIT + 2):  # one session: one lane, which nothing is emptying
        notifier.changed(turn, None)
    dropped = [r.getMessage() for r in caplog.records if "already waiting" in r.getMessage()]
    assert (
        dropped
        == [
            f"task 0123456789ab: notification of queued failed: {LANE_LIMIT} notifications are "
            "already waiting; this one is dropped"
        ]
        * 2
    )
    notifier.close()
    notifier.changed(turn, None)  # after the proxy stopped running them: dropped, and said
    assert "notifications have stopped" in caplog.records[-1].getMessage()


async def test_done_only_tells_each_finished_task_once_with_its_fields(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    command, notices = recorder(tmp_path)
    async with start(proc_env, tmp_path, {"notify": "done_only", "notify_command": command}) as gw:
        await gw.initialize()
        session = await gw.new_session()
        request_id = await send_prompt(gw, session, "title Fix the build; stream 300", {"traceparent": TRACEPARENT})
        assert (await gw.response_to(request_id))["result"]["stopReason"] == "end_turn"
        assert "error" in await gw.prompt(session, "crash 3")
        told = await notices_at_least(notices, 2)
        tasks = {t["taskId"]: t for t in (await cli_json(proc_env, "tasks", "list"))["tasks"]}
    assert len(read_notices(notices)) == 2, "one line per finished task, nothing for running"
    done, failed = told
    assert set(done) == NOTICE_KEYS
    task = tasks[done["taskId"]]
    assert done["version"] == 1
    assert done["event"] == "task"
    assert (done["status"], done["previousStatus"], done["reason"]) == ("done", "running", "end_turn")
    assert (done["sessionId"], done["backend"], done["instance"]) == (session, task["backend"], task["instance"])
    assert done["title"] == "Fix the build"
    assert done["traceparent"] == TRACEPARENT
    assert done["lastText"].endswith("chunk 298 chunk 299 ")
    assert len(done["lastText"]) == SUMMARY_CHARS
    assert done["durationSeconds"] == task["durationSeconds"]
    assert done["at"] == task["endedAt"]
    assert (failed["status"], failed["previousStatus"], failed["traceparent"]) == ("failed", "running", None)
    assert "exited" in failed["reason"]


async def test_state_changes_tells_every_status_in_order(proc_env: dict[str, str], tmp_path: Path) -> None:
    command, notices = recorder(tmp_path)
    tasks = {"notify": "state_changes", "notify_command": command}
    async with start(proc_env, tmp_path, tasks) as gw:
        await gw.initialize()
        session = await gw.new_session()
        await gw.prompt(session, "stream 2")
    async with start(proc_env, tmp_path, tasks) as gw:  # the session is suspended: its prompt is queued first
        await gw.initialize()
        assert (await gw.prompt(session, "stream 1"))["result"]["stopReason"] == "end_turn"
    told = read_notices(notices)
    first, second = told[0]["taskId"], told[-1]["taskId"]
    assert [(n["taskId"], n["previousStatus"], n["status"]) for n in told] == [
        (first, None, "running"),
        (first, "running", "done"),
        (second, None, "queued"),
        (second, "queued", "running"),
        (second, "running", "done"),
    ]
    assert [n["reason"] for n in told] == [None, "end_turn", None, None, "end_turn"]
    assert [n["durationSeconds"] is None for n in told] == [True, False, True, True, False]


async def test_silent_tells_nothing(proc_env: dict[str, str], tmp_path: Path) -> None:
    command, notices = recorder(tmp_path)
    async with start(proc_env, tmp_path, {"notify": "silent", "notify_command": command}) as gw:
        await gw.initialize()
        session = await gw.new_session()
        assert (await gw.prompt(session, "stream 2"))["result"]["stopReason"] == "end_turn"
    assert not notices.exists(), "the proxy has exited, with every notification it had queued run"


async def test_a_task_given_a_policy_of_its_own_from_the_cli(proc_env: dict[str, str], tmp_path: Path) -> None:
    command, notices = recorder(tmp_path)
    async with start(proc_env, tmp_path, {"notify_command": command}) as gw:  # notify: silent by default
        await gw.initialize()
        session = await gw.new_session()
        request_id = await send_prompt(gw, session, "wait_cancel")
        running = await wait_for_task(proc_env, "running", prompt="wait_cancel")
        result = await cli_json(proc_env, "tasks", "notify", running["taskId"][:6], "state_changes")
        assert result == {
            "taskId": running["taskId"],
            "sessionId": session,
            "instance": running["instance"],
            "changed": True,
            "status": "running",
            "policy": "state_changes",
            "effective": "state_changes",
        }
        code, out, _ = await cli(proc_env, "tasks", "notify", running["taskId"], "done_only")
        assert (code, out.strip()) == (0, f"task {running['taskId']}: notifications done_only (its own)")
        await gw.notify("session/cancel", {"sessionId": session})
        assert (await gw.response_to(request_id))["result"]["stopReason"] == "cancelled"
        (told,) = await notices_at_least(notices, 1)
        assert (told["taskId"], told["previousStatus"], told["status"]) == (running["taskId"], "running", "cancelled")
        code, _, err = await cli(proc_env, "tasks", "notify", running["taskId"], "silent")
        assert code == 2
        assert "has already ended (cancelled)" in err
        code, _, err = await cli(proc_env, "tasks", "notify", "feedfacecafe", "silent")
        assert code == 2
        assert "no task feedfacecafe" in err
        code, _, err = await cli(proc_env, "tasks", "notify", running["taskId"], "loudly")
        assert code == 2
        assert "invalid choice" in err
        assert (await gw.prompt(session, "stream 1"))["result"]["stopReason"] == "end_turn"
    own = state_db(proc_env).conn.execute("SELECT notify FROM tasks WHERE task_id = ?", (running["taskId"],))
    assert own.fetchone()[0] == "done_only"
    assert len(read_notices(notices)) == 1, "the next task follows the config's policy: silent"


async def test_a_policy_of_its_own_needs_a_notify_command(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with start(proc_env, tmp_path, {}) as gw:
        await gw.initialize()
        session = await gw.new_session()
        request_id = await send_prompt(gw, session, "wait_cancel")
        running = await wait_for_task(proc_env, "running", prompt="wait_cancel")
        code, _, err = await cli(proc_env, "tasks", "notify", running["taskId"], "done_only")
        assert code == 2
        assert "no [tasks] notify_command" in err
        assert (await cli_json(proc_env, "tasks", "notify", running["taskId"], "default"))["effective"] == "silent"
        await gw.notify("session/cancel", {"sessionId": session})
        await gw.response_to(request_id)


async def test_tasks_of_a_killed_proxy_are_told_lost_by_the_next_one(proc_env: dict[str, str], tmp_path: Path) -> None:
    command, notices = recorder(tmp_path)
    tasks = {"notify": "done_only", "notify_command": command}
    async with start(proc_env, tmp_path, tasks) as gw:
        await gw.initialize()
        session = await gw.new_session()
        await send_prompt(gw, session, "title Long job; wait_cancel", {"traceparent": TRACEPARENT})
        running = await wait_for_task(proc_env, "running", prompt="wait_cancel")
        gw.process.kill()
        await gw.process.wait()
    async with start(proc_env, tmp_path, tasks) as gw:
        await gw.initialize()
        (told,) = await notices_at_least(notices, 1)
    assert (told["taskId"], told["previousStatus"], told["status"]) == (running["taskId"], "running", "lost")
    assert (told["instance"], told["traceparent"], told["sessionId"]) == (running["instance"], TRACEPARENT, session)
    assert "ended without recording an outcome" in told["reason"]


# --- commands that misbehave ---------------------------------------------------------------


async def test_a_command_that_hangs_is_killed_with_its_group_and_the_proxy_keeps_serving(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    pids = tmp_path / "pids"
    command = [sys.executable, script(tmp_path, "hang.py", HANGER), str(pids)]
    tasks = {"notify": "done_only", "notify_command": command, "notify_timeout": "2s"}
    async with start(proc_env, tmp_path, tasks) as gw:
        await gw.initialize()
        session = await gw.new_session()
        for turn in (1, 2):  # the second turn is served, and told, like the first
            assert (await gw.prompt(session, "stream 1"))["result"]["stopReason"] == "end_turn"
            with anyio.fail_after(15):
                while len(pids.read_text().splitlines() if pids.exists() else []) < turn:
                    await anyio.sleep(0.05)
            started = [int(pid) for pid in pids.read_text().splitlines()[-1].split()]
            assert await survivors(started) == [], "the command and its child are killed after notify_timeout"
    assert gw.stderr.decode().count("notification of done failed: still running after 2s: killed") == 2
    (failed,) = counters(state_db(proc_env).conn, ["notify_failed"])
    assert (failed.label, failed.count) == ("timeout", 2)


@pytest.mark.parametrize(
    ("command", "logged", "why"),
    [
        ([sys.executable, "-c", FAILER], "ended: exit status 1; its output: no route to the chat server", "exit"),
        (["/nonexistent/notify-helper", "--flag"], "/nonexistent/notify-helper could not be started", "spawn"),
        (["${ACP_PROXY_UNSET_FOR_TEST}"], "not run: environment variable ACP_PROXY_UNSET_FOR_TEST is not set", "spawn"),
    ],
)
async def test_a_command_that_fails_is_logged_and_the_proxy_keeps_serving(
    proc_env: dict[str, str], tmp_path: Path, command: list[str], logged: str, why: str
) -> None:
    async with start(proc_env, tmp_path, {"notify": "done_only", "notify_command": command}) as gw:
        await gw.initialize()
        session = await gw.new_session()
        for _ in range(2):
            assert (await gw.prompt(session, "stream 1"))["result"]["stopReason"] == "end_turn"
    log = gw.stderr.decode()
    assert log.count(logged) == 2, log[-2000:]
    assert "task " in log.split(logged)[0].splitlines()[-1]
    (failed,) = counters(state_db(proc_env).conn, ["notify_failed"])
    assert (failed.label, failed.count) == (why, 2)


# --- configuration ---------------------------------------------------------------------------

BACKENDS = {"backends": {"codex": {"command": ["codex-acp"]}}}


@pytest.mark.parametrize(
    ("tasks", "problem"),
    [
        (
            {"notify": "loud"},
            'tasks.notify: expected one of "done_only", "waiting", "state_changes", "silent", got "loud"',
        ),
        (
            {"notify": "done_only"},
            'tasks.notify_command: required when tasks.notify is "done_only": set notify_command = '
            '["program", "arg", ...] or notify = "silent"',
        ),
        ({"notify_command": "notify-send done"}, "tasks.notify_command: expected an argv list"),
        ({"notify_command": []}, "tasks.notify_command: expected a non-empty list of strings, got []"),
        ({"notify_command": ["n", "${BAD"]}, "tasks.notify_command: unterminated or invalid ${...}"),
        ({"notify_timeout": "0s"}, 'tasks.notify_timeout: expected a duration > 0 such as "500ms" or "10s", got "0s"'),
        ({"notify_timeout": "soon"}, "tasks.notify_timeout: expected a duration such as"),
        (
            {"notify_every": "1s"},
            "tasks.notify_every: unknown key (expected one of: cancel_timeout, notify, notify_command",
        ),
    ],
)
def test_notification_config_problems_name_their_key(tasks: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        validate({**BACKENDS, "tasks": tasks})
    assert len(caught.value.problems) == 1, caught.value.problems
    assert caught.value.problems[0].startswith(problem)


def test_notification_config_defaults_and_values() -> None:
    assert (validate(BACKENDS).tasks.notify, validate(BACKENDS).tasks.notify_command) == ("silent", None)
    assert validate(BACKENDS).tasks.notify_timeout == 10.0
    tasks = validate(
        {**BACKENDS, "tasks": {"notify": "state_changes", "notify_command": ["n", "${HOME}"], "notify_timeout": "2s"}}
    ).tasks
    assert (tasks.notify, tasks.notify_command, tasks.notify_timeout) == ("state_changes", ("n", "${HOME}"), 2.0)


# --- tasks watch -------------------------------------------------------------------------------

WATCH = [sys.executable, "-m", "acp_proxy", "tasks", "watch"]


@asynccontextmanager
async def watching(argv: list[str], env: dict[str, str], **options: Any) -> AsyncIterator[Process]:
    """``acp-proxy tasks watch`` running; killed if a failed test leaves it running."""
    async with await anyio.open_process(argv, env=env, **options) as watcher:
        try:
            yield watcher
        finally:
            if watcher.returncode is None:
                watcher.kill()


async def interrupt(watcher: Process, output: bytes) -> bytes:
    """SIGINT, as Ctrl-C sends it; what it printed until it exited."""
    assert watcher.stdout is not None
    watcher.send_signal(signal.SIGINT)
    with anyio.fail_after(10):
        async for chunk in watcher.stdout:
            output += chunk
        await watcher.wait()
    return output


async def test_tasks_watch_prints_a_prompts_changes_and_exits_0_on_sigint(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with start(proc_env, tmp_path, {}) as gw:
        await gw.initialize()
        session = await gw.new_session()
        request_id = await send_prompt(gw, session, "title Watched; permission", {"traceparent": TRACEPARENT})
        asked = await gw.expect(lambda msg: msg.get("method") == "session/request_permission")
        async with watching([*WATCH, "--json", "--since", "1m"], proc_env) as watcher:
            assert watcher.stdout is not None
            output = b""
            with anyio.fail_after(30):
                while b"\n" not in output:  # the running task, as it was when watching began
                    output += await watcher.stdout.receive()
            answer = {"outcome": {"outcome": "selected", "optionId": "allow"}}
            await gw.send({"jsonrpc": "2.0", "id": asked["id"], "result": answer})
            assert (await gw.response_to(request_id))["result"]["stopReason"] == "end_turn"
            with anyio.fail_after(30):
                while output.count(b"\n") < 2:
                    output += await watcher.stdout.receive()
            output = await interrupt(watcher, output)
        task = (await cli_json(proc_env, "tasks", "list"))["tasks"][0]
    assert watcher.returncode == 0
    running, done = (json.loads(line) for line in output.splitlines())
    assert set(running) == NOTICE_KEYS
    assert (running["taskId"], running["previousStatus"], running["status"]) == (task["taskId"], None, "running")
    assert (done["previousStatus"], done["status"], done["reason"]) == ("running", "done", "end_turn")
    assert (done["sessionId"], done["traceparent"], done["instance"]) == (session, TRACEPARENT, task["instance"])
    assert done["lastText"] == "permission granted"
    assert done["title"] == "Watched"  # the session's title, as the sessions registry reads it
    assert done["durationSeconds"] == task["durationSeconds"]


async def test_tasks_watch_text_starts_from_now_and_follows_one_session(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with start(proc_env, tmp_path, {}) as gw:
        await gw.initialize()
        before = await gw.new_session()
        await gw.prompt(before, "stream 1")
        watched, other = await gw.new_session(), await gw.new_session()
        async with watching([*WATCH, "--session", watched[:-1]], proc_env) as watcher:
            assert watcher.stdout is not None
            assert watcher.stderr is not None
            with anyio.fail_after(30):  # it has seen what there is: from now on, every change is printed
                assert b"(Ctrl-C stops)" in await watcher.stderr.receive()
            request_id = await send_prompt(gw, watched, "wait_cancel")
            await send_prompt(gw, other, "stream 1")
            output = b""
            with anyio.fail_after(30):
                while b"\n" not in output:
                    output += await watcher.stdout.receive()
            await gw.notify("session/cancel", {"sessionId": watched})
            await gw.response_to(request_id)
            with anyio.fail_after(30):
                while output.count(b"\n") < 2:
                    output += await watcher.stdout.receive()
            output = await interrupt(watcher, output)
    assert watcher.returncode == 0
    lines = output.decode().splitlines()
    assert len(lines) == 2, lines
    assert all(f"  {watched}  " in line for line in lines)
    assert lines[0].endswith("- -> running")
    assert lines[1].endswith("running -> cancelled")


async def test_tasks_watch_on_a_state_dir_no_proxy_has_used_says_it_waits(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    env = {**proc_env, "ACP_PROXY_STATE_DIR": str(tmp_path / "not-yet")}
    async with watching(WATCH, env) as watcher:
        assert watcher.stderr is not None
        said = b""
        with anyio.fail_after(30):
            while b"\n" not in said:
                said += await watcher.stderr.receive()
        assert b"no proxy has used" in said
        assert b"waiting for its first tasks" in said
        await interrupt(watcher, b"")
    assert watcher.returncode == 0


async def test_tasks_watch_exits_0_when_its_reader_goes_away(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with start(proc_env, tmp_path, {}) as gw:
        await gw.initialize()
        session = await gw.new_session()
        await gw.prompt(session, "stream 1")
        read_end, write_end = os.pipe()
        argv = [*WATCH, "--since", "1h"]
        async with watching(argv, proc_env, stdout=write_end, stderr=subprocess.DEVNULL) as watcher:
            os.close(write_end)
            with anyio.fail_after(30):
                await anyio.wait_readable(read_end)
            os.close(read_end)  # as `head -1` does once it has its line
            await gw.prompt(session, "stream 1")  # something more to write: the pipe is found closed
            with anyio.fail_after(30):
                await watcher.wait()
    assert watcher.returncode == 0


async def test_tasks_watch_shows_a_killed_proxys_task_lost_at_once(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with start(proc_env, tmp_path, {}) as gw:
        await gw.initialize()
        session = await gw.new_session()
        await send_prompt(gw, session, "wait_cancel")
        running = await wait_for_task(proc_env, "running", prompt="wait_cancel")
        async with watching([*WATCH, "--json", "--since", "1m"], proc_env) as watcher:
            assert watcher.stdout is not None
            output = b""
            with anyio.fail_after(30):
                while b"\n" not in output:
                    output += await watcher.stdout.receive()
            gw.process.kill()
            await gw.process.wait()
            with anyio.fail_after(30):
                while output.count(b"\n") < 2:
                    output += await watcher.stdout.receive()
            output = await interrupt(watcher, output)
    code, _, err = await cli(proc_env, "reap")  # what the killed proxy left running
    assert code == 0, err
    told = [json.loads(line) for line in output.splitlines()]
    assert [(n["taskId"], n["previousStatus"], n["status"]) for n in told] == [
        (running["taskId"], None, "running"),
        (running["taskId"], "running", "lost"),
    ]
    assert "ended without recording an outcome" in told[1]["reason"]
