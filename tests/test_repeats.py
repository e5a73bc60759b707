"""A prompt sent again with its operation id runs once: the retry gets the first one's answer.

The rules (which id a prompt carries, what becomes of a repeat by the first one's task) are tested
in-process; a retry after the answer, one while the turn runs, a bad id, and one that reaches a new proxy
after a restart (answered from the task's row, with no process started), with real proxies on both loops.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_proxy.tasks.status import MAX_OPERATION_ID, Repeat, TaskStatus, answer_json, operation_of, repeat_of
from tests.kit.gateway import prompt_params
from tests.support import Gateway, adapter_calls, state_db


@pytest.mark.parametrize(
    ("params", "found"),
    [
        ({}, None),
        ({"operationId": "op-1"}, "op-1"),  # the drafts' place
        ({"_meta": {"operationId": "op-2"}}, "op-2"),  # a v1 client's
        ({"operationId": "top", "_meta": {"operationId": "meta"}}, "top"),
        ({"_meta": "not an object"}, None),
        ({"_meta": {"operationId": None}}, None),
    ],
)
def test_the_operation_id_of_a_prompt(params: dict[str, Any], found: str | None) -> None:
    assert operation_of(params) == found


@pytest.mark.parametrize("bad", [7, "", "x" * (MAX_OPERATION_ID + 1), ["op"], {"id": "op"}])
def test_an_operation_id_that_could_not_be_recognised_again_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="operationId"):
        operation_of({"operationId": bad})
    with pytest.raises(ValueError, match="operationId"):
        operation_of({"_meta": {"operationId": bad}})


# (what the first one's task says: status, whether it has its answer, its age; the window) -> the repeat
REPEATS = [
    (None, False, 0.0, 60.0, Repeat.RUN),  # no first one
    (TaskStatus.DONE, True, 10.0, 60.0, Repeat.ANSWER),
    (TaskStatus.FAILED, True, 10.0, 60.0, Repeat.ANSWER),  # its error, as the client first got it
    (TaskStatus.CANCELLED, True, 10.0, 60.0, Repeat.ANSWER),
    (TaskStatus.TIMED_OUT, True, 10.0, 60.0, Repeat.ANSWER),
    (TaskStatus.RUNNING, False, 10.0, 60.0, Repeat.WAIT),
    (TaskStatus.QUEUED, False, 10.0, 60.0, Repeat.WAIT),
    (TaskStatus.LOST, False, 10.0, 60.0, Repeat.RUN),  # its proxy was killed in it: it never ended
    (TaskStatus.DONE, True, 61.0, 60.0, Repeat.RUN),  # past the window
    (TaskStatus.DONE, True, 0.0, 0.0, Repeat.RUN),  # the window is 0: off
    (TaskStatus.DONE, False, 10.0, 60.0, Repeat.RUN),  # ended with no answer kept (an older release's row)
]


@pytest.mark.parametrize(("status", "answered", "age", "window", "repeat"), REPEATS)
def test_what_becomes_of_a_repeat(
    status: TaskStatus | None, answered: bool, age: float, window: float, repeat: Repeat
) -> None:
    assert repeat_of(status, answered, created_at=1000.0, now=1000.0 + age, window=window) is repeat


def test_an_answer_the_proxy_made_is_kept_as_the_client_got_it() -> None:
    assert answer_json(stop_reason="cancelled", error=None) == b'{"result":{"stopReason":"cancelled"}}'
    assert answer_json(stop_reason=None, error=(-32603, "boom")) == b'{"error":{"code":-32603,"message":"boom"}}'


# --- real processes ----------------------------------------------------------------------------


def _prompt(session: str, text: str, operation: object, *, in_meta: bool = True) -> dict[str, Any]:
    params = prompt_params(session, text)
    if in_meta:
        params["_meta"] = {"operationId": operation}
    else:
        params["operationId"] = operation
    return params


def _rows(env: dict[str, str], session: str) -> list[tuple[str | None, str]]:
    db = state_db(env)
    try:
        rows = db.conn.execute("SELECT operation_id, status FROM tasks WHERE session_id = ?", (session,))
        return sorted((r["operation_id"], r["status"]) for r in rows)
    finally:
        db.close()


@pytest.mark.anyio
async def test_a_retried_prompt_runs_once_here_while_it_runs_and_after_a_restart(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with Gateway.start(proc_env, tmp_path) as gw:
        await gw.initialize()
        session = await gw.new_session()
        first = await gw.request("session/prompt", _prompt(session, "remember mango", "op-1"))
        again = await gw.request("session/prompt", _prompt(session, "remember mango", "op-1"))
        assert again["result"] == first["result"] == {"stopReason": "end_turn"}
        assert again["id"] != first["id"], "the retry is answered under its own id"

        running, retry = gw.new_id(), gw.new_id()
        for request_id in (running, retry):  # the retry while the first still runs
            params = _prompt(session, "trickle 1", "op-2", in_meta=False)
            await gw.send({"jsonrpc": "2.0", "id": request_id, "method": "session/prompt", "params": params})
        with anyio.fail_after(20):
            answers = [await gw.response_to(running), await gw.response_to(retry)]
        assert [a["result"]["stopReason"] for a in answers] == ["end_turn", "end_turn"]

        bad = await gw.request("session/prompt", _prompt(session, "hi", 7))
        assert bad["error"]["code"] == -32602, bad
        assert "operationId" in bad["error"]["message"]
        texts = [m["params"]["prompt"][0]["text"] for m in adapter_calls(gw, "session/prompt")]
        assert texts == ["remember mango", "trickle 1"], "each ran once; the refused one not at all"

    async with Gateway.start(proc_env, tmp_path) as gw:
        await gw.initialize()
        late = await gw.request("session/prompt", _prompt(session, "remember mango", "op-1"))
        assert late["result"] == first["result"], "answered from the task's row"
        assert not adapter_calls(gw, "session/prompt") + adapter_calls(gw, "session/load"), "no process for it"
        fresh = await gw.request("session/prompt", _prompt(session, "remember kiwi", "op-3"))
        assert fresh["result"]["stopReason"] == "end_turn", "a new operation id runs"
    assert _rows(proc_env, session) == [("op-1", "done"), ("op-2", "done"), ("op-3", "done")]


@pytest.mark.anyio
async def test_a_retry_through_another_proxy_while_the_first_runs_is_answered_once_it_ends(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """The retry takes the session over from the proxy running the first attempt (after its turn, as any
    request would), then finds that attempt ended: answered as it was, not run a second time."""
    async with Gateway.start(proc_env, tmp_path) as first, Gateway.start(proc_env, tmp_path) as second:
        await first.initialize()
        await second.initialize()
        session = await first.new_session()
        running = first.new_id()
        params = _prompt(session, "trickle 1", "op-1")
        await first.send({"jsonrpc": "2.0", "id": running, "method": "session/prompt", "params": params})
        await first.expect(lambda m: m.get("method") == "session/update")  # under way in the first proxy
        retried = await second.request("session/prompt", params, timeout=30)
        answered = await first.response_to(running)
        assert retried["result"] == answered["result"] == {"stopReason": "end_turn"}
        ran = adapter_calls(first, "session/prompt") + adapter_calls(second, "session/prompt")
        assert [m["params"]["prompt"][0]["text"] for m in ran] == ["trickle 1"], "run once, in the first proxy"
    assert _rows(proc_env, session) == [("op-1", "done"), ("op-1", "done")], "the retry's own task, answered"
