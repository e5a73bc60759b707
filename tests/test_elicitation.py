"""Elicitation through the proxy: ``elicitation/create`` and ``elicitation/complete``, with real processes.

An adapter's ``elicitation/create`` is an agent->client request like a permission
request: it reaches the gateway under an id from the proxy's counter, with the
session's stable id, and the gateway's answer goes back to the adapter that asked
under the adapter's own id. Everything the proxy writes either way is checked
against the ACP schema (``support.Gateway``), and no process a test started may
outlive it (``conftest.proc_env``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from acp_proxy.sessions.registry import SessionState
from tests.support import (
    RESUME_AND_LOAD,
    TEST_INITIALIZE,
    Gateway,
    adapter_calls,
    adapter_pid,
    cli,
    registry,
    send_prompt,
    start,
    state_of,
    survivors,
)

pytestmark = pytest.mark.anyio

ELICITATION = {"form": {}, "url": {}}
INITIALIZE = {
    **TEST_INITIALIZE,
    "clientCapabilities": {**TEST_INITIALIZE["clientCapabilities"], "elicitation": ELICITATION},
}
ACCEPT = {"result": {"action": "accept", "content": {"name": "Ada"}}}


def is_elicitation(msg: dict[str, Any]) -> bool:
    return msg.get("method") == "elicitation/create"


def accept(request: dict[str, Any]) -> dict[str, Any]:
    assert is_elicitation(request), request
    return ACCEPT


async def reply(gw: Gateway, request: dict[str, Any], answer: dict[str, Any]) -> None:
    await gw.send({"jsonrpc": "2.0", "id": request["id"], **answer})


def adapter_wrote(gw: Gateway, method: str) -> list[dict[str, Any]]:
    """Every ``method`` message an adapter process wrote, as it wrote it, with the writer's pid."""
    written = [(json.loads(e["out"]), e["pid"]) for e in gw.adapter_record() if "out" in e]
    return [{**msg, "pid": pid} for msg, pid in written if msg.get("method") == method]


def is_echo(msg: dict[str, Any]) -> bool:
    return msg.get("method") == "session/update" and "elicited " in json.dumps(msg)


def echoed(msg: dict[str, Any]) -> dict[str, Any]:
    """The answer the adapter got, from its ``elicited`` message chunk."""
    text = msg["params"]["update"]["content"]["text"]
    return dict(json.loads(text.removeprefix("elicited ")))


def echoes(gw: Gateway, session: str) -> list[dict[str, Any]]:
    return [echoed(m) for m in gw.updates(session) if is_echo(m)]


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(ACCEPT, id="the user accepted and filled the form in"),
        pytest.param({"result": {"action": "decline"}}, id="the user declined"),
        pytest.param({"result": {"action": "cancel", "_meta": {"why": "dismissed"}}}, id="the user dismissed it"),
        pytest.param({"error": {"code": -32602, "message": "form mode not advertised"}}, id="the gateway refused it"),
    ],
)
async def test_an_elicitation_reaches_the_gateway_under_a_proxy_id_and_the_answer_comes_back_under_the_adapters(
    proc_env: dict[str, str], tmp_path: Path, answer: dict[str, Any]
) -> None:
    async with Gateway.start(proc_env, tmp_path) as gw:
        await gw.initialize(INITIALIZE)
        session = await gw.new_session()
        turn = await send_prompt(gw, session, "elicit form")
        asked = await gw.expect(is_elicitation)
        [sent] = adapter_wrote(gw, "elicitation/create")
        assert asked["id"] != sent["id"], "the gateway sees the proxy's id, not the adapter's"
        assert asked["params"] == sent["params"], "params pass unchanged"
        assert asked["params"]["sessionId"] == session
        assert asked["params"]["toolCallId"] == "call-1"
        await reply(gw, asked, answer)
        assert (await gw.response_to(turn))["result"]["stopReason"] == "end_turn"
        assert echoes(gw, session) == [{"jsonrpc": "2.0", "id": sent["id"], **answer}]
        # The gateway's elicitation capability reaches the adapter as the gateway declared it.
        [initialize] = adapter_calls(gw, "initialize")
        assert initialize["params"]["clientCapabilities"]["elicitation"] == ELICITATION


async def test_two_adapters_asking_at_once_with_the_same_id_are_each_answered_their_own(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with Gateway.start(proc_env, tmp_path) as gw:
        await gw.initialize(INITIALIZE)
        sessions = [await gw.new_session(), await gw.new_session()]
        turns = [await send_prompt(gw, session, "elicit form") for session in sessions]
        asked = [await gw.expect(is_elicitation) for _ in sessions]
        sent = adapter_wrote(gw, "elicitation/create")
        assert len({m["pid"] for m in sent}) == 2, "one process per session"
        assert len({m["id"] for m in sent}) == 1, "both adapters asked under the same id"
        assert len({m["id"] for m in asked}) == 2, "upstream the ids differ"
        assert sorted(m["params"]["sessionId"] for m in asked) == sorted(sessions)
        for request in reversed(asked):  # each answer names the session it is for
            content = {"name": request["params"]["sessionId"]}
            await reply(gw, request, {"result": {"action": "accept", "content": content}})
        for session, turn in zip(sessions, turns, strict=True):
            assert (await gw.response_to(turn))["result"]["stopReason"] == "end_turn"
            [got] = echoes(gw, session)
            assert got["id"] == sent[0]["id"]
            assert got["result"]["content"] == {"name": session}


async def test_a_url_elicitation_and_its_completion_reach_the_gateway(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with Gateway.start(proc_env, tmp_path) as gw:
        gw.handler = lambda m: {"result": {"action": "accept"}} if is_elicitation(m) else None
        await gw.initialize(INITIALIZE)
        session = await gw.new_session()
        response = await gw.prompt(session, f"elicit url; elicit_complete url-{session}")
        assert response["result"]["stopReason"] == "end_turn"
        relayed = [m for m in gw.received if m.get("method", "").startswith("elicitation/")]
        assert [m["method"] for m in relayed] == ["elicitation/create", "elicitation/complete"]
        asked, completed = relayed
        assert asked["params"]["mode"] == "url"
        assert asked["params"]["sessionId"] == session
        assert asked["params"]["elicitationId"] == f"url-{session}"
        [sent] = adapter_wrote(gw, "elicitation/complete")
        assert completed == {"jsonrpc": "2.0", "method": "elicitation/complete", "params": sent["params"]}
        assert completed["params"] == {"elicitationId": f"url-{session}"}
        [got] = echoes(gw, session)
        assert got["result"] == {"action": "accept"}


async def test_a_request_scoped_elicitation_names_the_gateways_request_by_the_gateways_id(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with Gateway.start(proc_env, tmp_path) as gw:
        await gw.initialize(INITIALIZE)
        await gw.send({"jsonrpc": "2.0", "id": "sign-in", "method": "_fake/elicit", "params": {}})
        asked = await gw.expect(is_elicitation)
        [forwarded] = adapter_calls(gw, "_fake/elicit")
        [sent] = adapter_wrote(gw, "elicitation/create")
        assert sent["params"]["requestId"] == forwarded["id"] != "sign-in"
        assert asked["params"] == {**sent["params"], "requestId": "sign-in"}
        await reply(gw, asked, {"result": {"action": "accept"}})
        answered = await gw.response_to("sign-in")
        assert answered["result"]["answer"] == {"jsonrpc": "2.0", "id": sent["id"], "result": {"action": "accept"}}


async def test_after_a_fallback_to_new_elicitations_carry_the_stable_session_id(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """The session's process knows it under a new id (its resume failed): upstream it keeps its stable id."""
    resume_only = {"sessionCapabilities": {"resume": {}, "close": {}}}  # no load between resume and new
    async with start(proc_env, tmp_path, caps=resume_only, fail={"session/resume": -32002}) as gw:
        await gw.initialize(INITIALIZE)
        first = await gw.new_session()
        await gw.new_session()  # max_live = 1: the first is suspended
        renamed = (await state_of(gw, first))["session"]  # resumed: the resume fails, session/new serves it
        assert renamed != first
        gw.handler = lambda m: (
            {"result": {"action": "accept", "content": {"name": first}}} if is_elicitation(m) else None
        )
        response = await gw.prompt(first, f"elicit form; elicit url; elicit_complete url-{renamed}")
        assert response["result"]["stopReason"] == "end_turn"
        asked = [m for m in gw.received if is_elicitation(m)]
        sent = adapter_wrote(gw, "elicitation/create")
        assert [m["params"]["sessionId"] for m in sent] == [renamed, renamed]
        assert [m["params"]["sessionId"] for m in asked] == [first, first]
        for upstream, written in zip(asked, sent, strict=True):
            assert upstream["params"] == {**written["params"], "sessionId": first}, "nothing else is rewritten"
        [completed] = [m for m in gw.received if m.get("method") == "elicitation/complete"]
        assert completed["params"] == {"elicitationId": f"url-{renamed}"}, "an elicitation's id is the adapter's"
        answers = echoes(gw, first)  # the updates carry the stable id too
        assert [a["id"] for a in answers] == [m["id"] for m in sent]
        assert answers[0]["result"]["content"] == {"name": first}, "the user's answer is not rewritten"
        # Every process the proxy started heard of the gateway's elicitation capability.
        initializes = adapter_calls(gw, "initialize")
        assert len(initializes) >= 3
        assert all(m["params"]["clientCapabilities"]["elicitation"] == ELICITATION for m in initializes)


async def test_an_adapters_cancel_request_for_its_elicitation_reaches_the_gateway_under_the_proxy_id(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with Gateway.start(proc_env, tmp_path) as gw:
        await gw.initialize(INITIALIZE)
        session = await gw.new_session()
        turn = await send_prompt(gw, session, "elicit_then_cancel")
        asked = await gw.expect(is_elicitation)
        withdrawn = await gw.expect(lambda m: m.get("method") == "$/cancel_request")
        assert withdrawn["params"] == {"requestId": asked["id"]}
        cancelled = {"error": {"code": -32800, "message": "Request cancelled"}}
        await reply(gw, asked, cancelled)
        assert (await gw.response_to(turn))["result"]["stopReason"] == "end_turn"
        [sent] = adapter_wrote(gw, "elicitation/create")
        assert echoes(gw, session) == [{"jsonrpc": "2.0", "id": sent["id"], **cancelled}]


async def test_a_pending_elicitation_keeps_its_session_from_being_suspended(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    # The adapter reports the answer as a message chunk after its turn: background work, over
    # once quiet_after has passed without more.
    pool = {"acquire_timeout": "500ms", "quiet_after": "100ms"}
    async with start(proc_env, tmp_path, caps=RESUME_AND_LOAD, pool=pool) as gw:
        await gw.initialize(INITIALIZE)
        first = await gw.new_session()
        pid = await adapter_pid(gw, first)
        assert (await gw.prompt(first, "elicit_later form"))["result"]["stopReason"] == "end_turn"
        asked = await gw.expect(is_elicitation)  # no turn is running: only the elicitation is pending
        code, _, err = await cli(proc_env, "sessions", "suspend", first)
        assert code == 1
        assert "busy" in err
        refused = await gw.request("session/new", {"cwd": "/tmp", "mcpServers": []})
        assert refused["error"]["data"]["reason"] == "pool_exhausted", "the only live session was not evicted"
        await reply(gw, asked, ACCEPT)
        assert echoed(await gw.expect(is_echo))["result"] == ACCEPT["result"]
        await gw.new_session()  # answered: the first is idle, and is suspended for this one
        assert await survivors([pid]) == []
        assert registry(proc_env).get(first).state is SessionState.SUSPENDED  # type: ignore[union-attr]


async def test_an_adapter_that_exits_with_an_elicitation_pending_withdraws_it_upstream(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with start(proc_env, tmp_path, caps=RESUME_AND_LOAD) as gw:
        await gw.initialize(INITIALIZE)
        session = await gw.new_session()
        assert (await gw.prompt(session, "elicit_later form"))["result"]["stopReason"] == "end_turn"
        asked = await gw.expect(is_elicitation)
        crashed = await gw.prompt(session, "crash 3")
        assert crashed["error"]["data"]["reason"] == "adapter_exited"
        withdrawn = await gw.expect(lambda m: m.get("method") == "$/cancel_request")
        assert withdrawn["params"] == {"requestId": asked["id"]}
        await reply(gw, asked, ACCEPT)  # too late: dropped, and serving goes on
        assert (await gw.prompt(session, "stream 1"))["result"]["stopReason"] == "end_turn"
