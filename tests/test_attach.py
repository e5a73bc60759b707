"""Shared sessions: ``session/attach`` to a session another proxy of the install holds.

A gateway opens a session through its own proxy (the holder); other clients attach to it
through proxies of their own (stdio gateways of the same user here, ``serve`` clients in
``test_attach_remote.py``). Real processes on both anyio backends; every message the holder's
gateway gets is checked against the ACP schema, and nothing a test started may outlive it.
The attached clients speak the draft's extension (``permission_resolved`` and the like are not
in the v1 schema), so theirs is not checked.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from acp_proxy.relay.sharing import (
    Ask,
    History,
    Role,
    history_items,
    parse_attach,
    update_line,
    valid_permission_answer,
)
from acp_proxy.sessions.transcript import Entry, EntryKind
from tests.support import Gateway, adapter_calls, cli, cli_json, survivors, write_config


def allow(request: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request["id"], "result": {"outcome": {"outcome": "selected", "optionId": "allow"}}}


def texts(messages: list[dict[str, Any]]) -> list[str]:
    return [
        m["params"]["update"]["content"]["text"]
        for m in messages
        if m.get("method") == "session/update" and m["params"]["update"].get("sessionUpdate") == "agent_message_chunk"
    ]


def config(tmp_path: Path, **attach: Any) -> Path:
    path = write_config(tmp_path, pool={"max_live": 4}, backends={"fake": {"store": str(tmp_path / "store")}})
    if attach:
        with path.open("a") as out:
            out.write("[attach]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in attach.items()))
    return path


@asynccontextmanager
async def holder(env: dict[str, str], tmp_path: Path, cfg: Path) -> AsyncIterator[tuple[Gateway, str]]:
    """A gateway with a session open: the session's holder."""
    async with Gateway.start(env, tmp_path, proxy_args=["--config", str(cfg)], store=str(tmp_path / "store")) as gw:
        await gw.initialize()
        session = await gw.new_session()
        yield gw, session


@asynccontextmanager
async def client(env: dict[str, str], tmp_path: Path, cfg: Path) -> AsyncIterator[Gateway]:
    """Another gateway of the same user, through a proxy of its own: to attach with."""
    async with Gateway.start(env, tmp_path, proxy_args=["--config", str(cfg)], store=str(tmp_path / "store")) as gw:
        gw.observers.remove(gw._conform)  # it speaks the draft's extension
        await gw.initialize()
        yield gw


async def attach(gw: Gateway, session: str, role: str = "controller", history: str = "full", name: str = "dash") -> Any:
    return await gw.request(
        "session/attach",
        {"sessionId": session, "role": role, "historyPolicy": history, "clientInfo": {"name": name, "version": "1"}},
    )


@pytest.mark.anyio
async def test_attach_is_advertised(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with Gateway.start(proc_env, tmp_path) as gw:
        answer = await gw.initialize()
        caps = answer["result"]["agentCapabilities"]["sessionCapabilities"]
        assert caps["attach"] == {"roles": ["controller", "observer"]}


@pytest.mark.anyio
async def test_controller_and_observer_follow_a_stdio_session(proc_env: dict[str, str], tmp_path: Path) -> None:
    cfg = config(tmp_path)
    async with holder(proc_env, tmp_path, cfg) as (gw, session):
        first = await gw.prompt(session, "stream 3")
        assert first["result"]["stopReason"] == "end_turn"
        async with client(proc_env, tmp_path, cfg) as watcher, client(proc_env, tmp_path, cfg) as boss:
            seen = await attach(watcher, session, role="observer", name="watcher")
            assert seen["result"]["role"] == "observer"
            assert [h["type"] for h in seen["result"]["history"]] == ["prompt"]
            replayed = texts(watcher.take_updates(session))
            assert replayed == texts(gw.take_updates(session))
            assert len(replayed) == 3
            taken = await attach(boss, session, name="boss")
            assert taken["result"]["role"] == "controller"
            assert {c["name"] for c in taken["result"]["connectedClients"]} >= {"the gateway", "watcher"}
            boss.take_updates(session)

            second = await gw.prompt(session, "stream 4")
            assert second["result"]["stopReason"] == "end_turn"
            live = texts(gw.take_updates(session))
            with anyio.fail_after(10):
                while len(texts(watcher.stashed("session/update"))) < len(live):
                    await anyio.sleep(0.02)
            assert texts(watcher.take_updates(session)) == live

            refused = await watcher.request(
                "session/prompt", {"sessionId": session, "prompt": [{"type": "text", "text": "hi"}]}
            )
            assert refused["error"]["code"] == -32002
            assert refused["error"]["data"]["reason"] == "observer"

            by_boss = await boss.request(
                "session/prompt", {"sessionId": session, "prompt": [{"type": "text", "text": "stream 2"}]}
            )
            assert by_boss["result"]["stopReason"] == "end_turn"
            assert len(texts(gw.take_updates(session))) == 2  # the gateway sees the other controller's turn

            detached = await boss.request("session/detach", {"sessionId": session})
            assert detached.get("result") == {"sessionId": session, "status": "detached"}, detached
            gone = await watcher.expect(
                lambda m: (
                    m.get("method") == "session/update" and m["params"]["update"].get("type") == "client_disconnected"
                )
            )
            assert gone["params"]["update"]["client"]["name"] == "boss"
        third = await gw.prompt(session, "stream 1")  # detach is not close
        assert third["result"]["stopReason"] == "end_turn"


@pytest.mark.anyio
async def test_first_answer_wins(proc_env: dict[str, str], tmp_path: Path) -> None:
    cfg = config(tmp_path)
    async with holder(proc_env, tmp_path, cfg) as (gw, session), client(proc_env, tmp_path, cfg) as boss:
        await attach(boss, session, history="none", name="phone")
        prompt_id = gw.new_id()
        await gw.send(
            {
                "jsonrpc": "2.0",
                "id": prompt_id,
                "method": "session/prompt",
                "params": {"sessionId": session, "prompt": [{"type": "text", "text": "permission"}]},
            }
        )
        asked_gateway = await gw.expect(lambda m: m.get("method") == "session/request_permission")
        asked_boss = await boss.expect(lambda m: m.get("method") == "session/request_permission")
        assert asked_boss["params"] == asked_gateway["params"]
        await boss.send(allow(asked_boss))
        withdrawn = await gw.expect(lambda m: m.get("method") == "$/cancel_request")
        assert withdrawn["params"]["requestId"] == asked_gateway["id"]
        done = await gw.response_to(prompt_id)
        assert done["result"]["stopReason"] == "end_turn"
        assert "permission granted" in texts(gw.take_updates(session))
        await gw.send(allow(asked_gateway))  # too late: the agent has its answer
        resolved = await boss.expect(
            lambda m: m.get("method") == "session/update" and m["params"]["update"].get("type") == "permission_resolved"
        )
        update = resolved["params"]["update"]
        assert update["chosenOptionId"] == "allow"
        assert update["resolvedBy"]["name"].startswith("phone")
        await gw.prompt(session, "stream 1")
        answers = [json.loads(e["in"]) for e in gw.adapter_record() if '"outcome"' in e.get("in", "")]
        assert len(answers) == 1  # the agent got one answer, the first
        answered = re.compile(
            r'acp_proxy_answered_elsewhere_total\{backend="\w+",method="session/request_permission"\} 1\.0'
        )
        with anyio.fail_after(10):  # counted (the journal's writes are queued)
            while not answered.search(metrics := (await cli(proc_env, "metrics"))[1]):
                await anyio.sleep(0.2)
        assert re.search(r'acp_proxy_attaches_total\{backend="\w+",role="controller"\} 1\.0', metrics)


async def prompt_in_flight(gw: Gateway, session: str, text: str) -> int:
    request_id = gw.new_id()
    params = {"sessionId": session, "prompt": [{"type": "text", "text": text}]}
    await gw.send({"jsonrpc": "2.0", "id": request_id, "method": "session/prompt", "params": params})
    return request_id


def is_update(kind: str) -> Any:
    return lambda m: m.get("method") == "session/update" and m["params"]["update"].get("type") == kind


@pytest.mark.anyio
async def test_pending_only_gets_what_waits_and_none_gets_only_what_comes(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    cfg = config(tmp_path)
    async with holder(proc_env, tmp_path, cfg) as (gw, session):
        await gw.prompt(session, "stream 2")
        asking = await prompt_in_flight(gw, session, "permission")
        asked = await gw.expect(lambda m: m.get("method") == "session/request_permission")
        async with client(proc_env, tmp_path, cfg) as phone, client(proc_env, tmp_path, cfg) as logger:
            pending = await attach(phone, session, history="pending_only", name="phone")
            [item] = pending["result"]["history"]
            assert item["type"] == "permission_request"
            assert item["status"] == "pending"
            assert item["toolCallId"] == asked["params"]["toolCall"]["toolCallId"]
            assert phone.stashed("session/update") == []  # no replay
            quiet = await attach(logger, session, role="observer", history="none", name="logger")
            assert "history" not in quiet["result"]
            copy = await phone.expect(lambda m: m.get("method") == "session/request_permission")
            assert copy["params"] == asked["params"]
            await phone.send(allow(copy))
            assert (await gw.response_to(asking))["result"]["stopReason"] == "end_turn"
            withdrawn = await gw.expect(lambda m: m.get("method") == "$/cancel_request")
            assert withdrawn["params"]["requestId"] == asked["id"]
            await logger.expect(is_update("permission_resolved"))
            with anyio.fail_after(10):
                while "permission granted" not in texts(logger.stashed("session/update")):
                    await anyio.sleep(0.02)
            assert texts(logger.take_updates(session)) == ["permission granted"]  # nothing from before


@pytest.mark.anyio
async def test_prompts_of_several_controllers_take_turns(proc_env: dict[str, str], tmp_path: Path) -> None:
    cfg = config(tmp_path)
    async with holder(proc_env, tmp_path, cfg) as (gw, session), client(proc_env, tmp_path, cfg) as boss:
        await attach(boss, session, history="none", name="boss")
        first = await prompt_in_flight(gw, session, "trickle 1")
        await gw.expect(lambda m: m.get("method") == "session/update")
        by_boss = boss.new_id()
        await boss.send(
            {
                "jsonrpc": "2.0",
                "id": by_boss,
                "method": "session/prompt",
                "params": {"sessionId": session, "prompt": [{"type": "text", "text": "stream 1"}]},
            }
        )
        third = await prompt_in_flight(gw, session, "stream 1")
        assert (await gw.response_to(first))["result"]["stopReason"] == "end_turn"
        assert (await boss.response_to(by_boss))["result"]["stopReason"] == "end_turn"
        assert (await gw.response_to(third))["result"]["stopReason"] == "end_turn"
        record = gw.adapter_record()
        order = []
        for entry in record:
            message = json.loads(entry.get("in") or entry.get("out"))
            if message.get("method") == "session/prompt":
                order.append(("sent", message["params"]["prompt"][0]["text"]))
            elif "result" in message and "stopReason" in (message.get("result") or {}):
                order.append(("answered", message["result"]["stopReason"]))
        # one turn at a time, in arrival order: trickle, the other controller's, then the gateway's second
        assert order == [
            ("sent", "trickle 1"),
            ("answered", "end_turn"),
            ("sent", "stream 1"),
            ("answered", "end_turn"),
            ("sent", "stream 1"),
            ("answered", "end_turn"),
        ]


@pytest.mark.anyio
async def test_a_prompt_waiting_its_turn_goes_on_when_the_proxy_ends_the_turn_before_it(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """The turn before it ends without its adapter's answer: it runs past turn_timeout and its adapter
    ignores the proxy's session/cancel, so the proxy answers the prompt itself and recycles the process.
    The waiting prompt is woken by that turn's end (not by a poll) and runs on the restored session."""
    cfg = write_config(
        tmp_path,
        pool={"max_live": 4},
        tasks={"turn_timeout": "1s"},
        backends={"fake": {"store": str(tmp_path / "store")}},
    )
    async with holder(proc_env, tmp_path, cfg) as (gw, session), client(proc_env, tmp_path, cfg) as boss:
        stubborn = await prompt_in_flight(gw, session, "ignore_cancel 60")  # before anyone attached
        await gw.expect(lambda m: m.get("method") == "session/update")
        await attach(boss, session, history="none", name="boss")
        by_boss = boss.new_id()
        await boss.send(
            {
                "jsonrpc": "2.0",
                "id": by_boss,
                "method": "session/prompt",
                "params": {"sessionId": session, "prompt": [{"type": "text", "text": "stream 1"}]},
            }
        )
        with anyio.fail_after(20):
            assert (await gw.response_to(stubborn))["result"]["stopReason"] == "cancelled"
            assert (await boss.response_to(by_boss))["result"]["stopReason"] == "end_turn"


@pytest.mark.anyio
async def test_a_busy_session_refuses_another_controllers_prompt_when_configured(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    cfg = config(tmp_path, prompts="refuse")
    async with holder(proc_env, tmp_path, cfg) as (gw, session), client(proc_env, tmp_path, cfg) as boss:
        await attach(boss, session, history="none", name="boss")
        running = await prompt_in_flight(gw, session, "trickle 1")
        await gw.expect(lambda m: m.get("method") == "session/update")
        refused = await boss.request(
            "session/prompt", {"sessionId": session, "prompt": [{"type": "text", "text": "stream 1"}]}
        )
        assert refused["error"]["data"]["reason"] == "session_busy"
        assert (await gw.response_to(running))["result"]["stopReason"] == "end_turn"
        done = await boss.request(
            "session/prompt", {"sessionId": session, "prompt": [{"type": "text", "text": "stream 1"}]}
        )
        assert done["result"]["stopReason"] == "end_turn"


@pytest.mark.anyio
async def test_any_controller_cancels_the_turn_an_observer_cannot(proc_env: dict[str, str], tmp_path: Path) -> None:
    cfg = config(tmp_path)
    async with (
        holder(proc_env, tmp_path, cfg) as (gw, session),
        client(proc_env, tmp_path, cfg) as boss,
        client(proc_env, tmp_path, cfg) as watcher,
    ):
        await attach(boss, session, history="none", name="boss")
        await attach(watcher, session, role="observer", history="none", name="watcher")
        running = await prompt_in_flight(gw, session, "wait_cancel")
        await watcher.expect(lambda m: m.get("method") == "session/update")
        await watcher.notify("session/cancel", {"sessionId": session})
        await anyio.sleep(0.3)
        assert not [m for m in gw.received if m.get("id") == running and "method" not in m]  # still running
        await boss.notify("session/cancel", {"sessionId": session})
        assert (await gw.response_to(running))["result"]["stopReason"] == "cancelled"
        cancels = adapter_calls(gw, "session/cancel")
        assert len(cancels) == 1  # the observer's was dropped


@pytest.mark.anyio
async def test_a_holder_killed_with_clients_attached(proc_env: dict[str, str], tmp_path: Path) -> None:
    cfg = config(tmp_path)
    async with client(proc_env, tmp_path, cfg) as boss:
        async with holder(proc_env, tmp_path, cfg) as (gw, session):
            await attach(boss, session, history="none", name="boss")
            running = boss.new_id()
            params = {"sessionId": session, "prompt": [{"type": "text", "text": "wait_cancel"}]}
            await boss.send({"jsonrpc": "2.0", "id": running, "method": "session/prompt", "params": params})
            await boss.expect(lambda m: m.get("method") == "session/update")
            adapter = gw.adapter_record()[-1]["pid"]
            gw.kill()
            ended = await boss.expect(is_update("attach_ended"))
            assert ended["params"]["update"]["reason"] == "holder_gone"
            failed = await boss.response_to(running)
            assert failed["error"]["data"]["reason"] == "holder_gone"
            assert await survivors([adapter]) == []
        # Not attached any more: the client's own proxy takes the session over, as any proxy of the install would.
        again = await boss.request("session/prompt", {**params, "prompt": [{"type": "text", "text": "stream 1"}]})
        assert again["result"]["stopReason"] == "end_turn"
    # SIGKILLed under load, the holder now and then left an empty tree cgroup under its instance's (2 runs in
    # 18, six at once): made for a tree whose wrapper had not joined it yet, it has no wrapper to remove it.
    # Clearing a dead proxy's leftovers is the install's reaper's job (a proxy's start, every reap_interval,
    # or this command); the test's end then finds nothing of the install left.
    code, _, err = await cli(proc_env, "reap")
    assert code == 0, err


@pytest.mark.anyio
async def test_the_gateway_sees_nothing_new_unless_it_attaches_itself(proc_env: dict[str, str], tmp_path: Path) -> None:
    cfg = config(tmp_path)
    async with holder(proc_env, tmp_path, cfg) as (gw, session), client(proc_env, tmp_path, cfg) as boss:
        await attach(boss, session, history="none", name="boss")
        for turn in range(2):
            if turn == 1:
                gw.observers.remove(gw._conform)  # from now on it gets the draft's updates: not in the v1 schema
                own = await attach(gw, session, history="full", name="editor")
                assert own["result"]["role"] == "controller"
                assert [c["name"] for c in own["result"]["connectedClients"]] == ["boss"]
                assert [(h["type"], h.get("status")) for h in own["result"]["history"]] == [
                    ("prompt", None),  # permission
                    ("permission_request", "resolved"),
                    ("prompt", None),  # stream 1
                ]
            asking = await prompt_in_flight(gw, session, "permission")
            asked = await gw.expect(lambda m: m.get("method") == "session/request_permission")
            await boss.send(allow(await boss.expect(lambda m: m.get("method") == "session/request_permission")))
            assert (await gw.response_to(asking))["result"]["stopReason"] == "end_turn"
            assert (await gw.expect(lambda m: m.get("method") == "$/cancel_request"))["params"]["requestId"] == asked[
                "id"
            ]
            await boss.expect(is_update("permission_resolved"))
            await gw.prompt(session, "stream 1")
            told = [
                m for m in gw.stashed("session/update") if m["params"]["update"].get("type") == "permission_resolved"
            ]
            assert len(told) == turn  # nothing new before it attached itself, the resolution after
            gw.clear_stash()


@pytest.mark.anyio
async def test_bad_attaches_are_answered_and_the_proxy_goes_on(proc_env: dict[str, str], tmp_path: Path) -> None:
    cfg = config(tmp_path, max_clients=1)
    async with holder(proc_env, tmp_path, cfg) as (gw, session), client(proc_env, tmp_path, cfg) as other:
        cases = [
            ({"sessionId": session, "role": "admin"}, -32602, "invalid_params"),
            ({"sessionId": session, "historyPolicy": "everything"}, -32602, "invalid_params"),
            ({"role": "observer"}, -32602, "invalid_params"),
            ({"sessionId": "no-such-session"}, -32001, "not_live"),
        ]
        for params, code, reason in cases:
            answer = await other.request("session/attach", params)
            assert answer["error"]["code"] == code, (params, answer)
            assert answer["error"]["data"]["reason"] == reason
        assert (await other.request("session/detach", {"sessionId": session}))["error"]["code"] == -32602
        assert "result" in await attach(other, session, history="none")
        again = await attach(other, session, history="none")
        assert again["error"]["code"] == -32600  # attached already, through this proxy
        async with client(proc_env, tmp_path, cfg) as third:
            full = await attach(third, session, history="none")
            assert full["error"]["data"]["reason"] == "too_many_clients"
        other_session = await other.new_session()
        assert "result" in await attach(other, other_session, history="none")  # its own: answered at once
        assert (await gw.prompt(session, "stream 1"))["result"]["stopReason"] == "end_turn"


# --- the pure parts ---------------------------------------------------------------------------------

OPTIONS = [
    {"optionId": "allow", "name": "Allow", "kind": "allow_once"},
    {"optionId": "reject", "name": "No", "kind": None},
]


@pytest.mark.parametrize(
    ("result", "valid"),
    [
        ({"outcome": {"outcome": "selected", "optionId": "allow"}}, True),
        ({"outcome": {"outcome": "selected", "optionId": "reject"}}, True),
        ({"outcome": {"outcome": "cancelled"}}, True),
        ({"outcome": {"outcome": "selected", "optionId": "always"}}, False),  # an option it does not offer
        ({"outcome": {"outcome": "selected"}}, False),
        ({"outcome": "allow"}, False),
        ({}, False),
        (None, False),
    ],
)
def test_which_answers_to_a_permission_request_are_valid(result: Any, valid: bool) -> None:
    assert valid_permission_answer(result, OPTIONS) is valid


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        ({"sessionId": "s"}, None),
        ({"sessionId": "s", "role": "observer", "historyPolicy": "pending_only", "clientInfo": {"name": "x"}}, None),
        ({"sessionId": "s", "role": "admin"}, "role"),
        ({"sessionId": "s", "historyPolicy": "some"}, "historyPolicy"),
        ({"role": "observer"}, "sessionId"),
        ({"sessionId": 7}, "sessionId"),
        ({"sessionId": "s", "clientInfo": "me"}, "clientInfo"),
    ],
)
def test_attach_arguments(args: dict[str, Any], problem: str | None) -> None:
    if problem is None:
        request = parse_attach(args)
        assert request.sessionId == "s"
        assert request.role in (Role.CONTROLLER, Role.OBSERVER)
        return
    with pytest.raises(ValueError, match=problem):
        parse_attach(args)


def entry(kind: EntryKind, message: dict[str, Any], by: str | None = None) -> Entry:
    return Entry(at=1767225600.0, kind=kind.value, message=msgspec.Raw(json.dumps(message).encode()), by=by)


def waiting_ask() -> Ask:
    params = {"sessionId": "s", "toolCall": {"toolCallId": "call-2", "title": "rm"}, "options": OPTIONS}
    raw = msgspec.Raw(json.dumps(params).encode())
    return Ask(
        upstream_id=7,
        key="abcd1234.7",
        session_id="s",
        method="session/request_permission",
        params=raw,
        asked_at=1767225601.0,
        subject="rm",
        options=OPTIONS,
    )


TRANSCRIPT = [
    entry(EntryKind.PROMPT, {"sessionId": "s", "prompt": [{"type": "text", "text": "fix it"}]}, "the gateway"),
    entry(EntryKind.UPDATE, {"jsonrpc": "2.0", "method": "session/update", "params": {"sessionId": "s"}}),
    entry(
        EntryKind.ANSWERED,
        {"request": "abcd1234.3", "toolCallId": "call-1", "outcome": {"outcome": "cancelled"}},
        "phone",
    ),
]


@pytest.mark.parametrize(
    ("policy", "types"),
    [
        (History.FULL, [("prompt", None), ("permission_request", "resolved"), ("permission_request", "pending")]),
        (History.PENDING_ONLY, [("permission_request", "pending")]),
    ],
)
def test_the_history_an_attach_answers(policy: History, types: list[tuple[str, str | None]]) -> None:
    items = history_items(TRANSCRIPT, [waiting_ask()], policy)
    assert [(i["type"], i.get("status")) for i in items] == types
    assert items[-1]["toolCallId"] == "call-2"
    assert items[-1]["request"] == "abcd1234.7"
    if policy is History.FULL:
        assert items[0]["content"] == [{"type": "text", "text": "fix it"}]
        assert items[0]["by"] == "the gateway"
        assert items[1]["resolvedBy"] == "phone"


def test_the_drafts_updates_carry_both_discriminators() -> None:
    line = json.loads(update_line("s", {"type": "permission_resolved", "toolCallId": "c"}))
    assert line["method"] == "session/update"
    assert line["params"]["update"]["type"] == line["params"]["update"]["sessionUpdate"] == "permission_resolved"


def is_asked(m: dict[str, Any]) -> bool:
    return m.get("method") == "session/request_permission"


@pytest.mark.anyio
async def test_a_claimed_permission_is_answered_by_its_claimant_alone_until_it_disconnects(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    cfg = config(tmp_path)
    async with holder(proc_env, tmp_path, cfg) as (gw, session):
        gw.observers.remove(gw._conform)  # it asks for the draft's updates
        await attach(gw, session, history="none")  # its own session: it is told of claims from now on
        async with client(proc_env, tmp_path, cfg) as boss:
            await attach(boss, session, history="none", name="phone")
            asking = await prompt_in_flight(gw, session, "permission")
            asked_gateway, asked_boss = await gw.expect(is_asked), await boss.expect(is_asked)
            tool_call = asked_boss["params"]["toolCall"]["toolCallId"]
            claim = {"sessionId": session, "toolCallId": tool_call}
            claimed = await boss.request("session/claim_permission", claim)
            assert claimed["result"]["claimedBy"]["name"].startswith("phone"), claimed
            told = (await boss.expect(is_update("permission_claimed")))["params"]["update"]
            assert told["toolCallId"] == tool_call
            refused = await gw.request("session/claim_permission", claim)
            assert refused["error"]["data"]["reason"] == "permission_claimed", refused
            await gw.send(allow(asked_gateway))  # not the claimant's: dropped, the agent still waits
            key = (await cli_json(proc_env, "permissions", "list", "--json"))["requests"][0]
            assert key["claimedBy"].startswith("phone")
            code, _, err = await cli(proc_env, "permissions", "answer", key["request"], "allow")
            assert code == 1, err
            assert "claimed by phone" in err, "an operator does not overrule a claim"
            assert (await gw.expect(is_update("permission_claimed")))["params"]["update"]["toolCallId"] == tool_call
        # the claimant's proxy is gone: its claim ended, the request waits for anyone eligible
        await gw.expect(is_update("permission_unclaimed"))
        await gw.send(allow(asked_gateway))
        done = await gw.response_to(asking)
        assert done["result"]["stopReason"] == "end_turn"
        assert "permission granted" in texts(gw.take_updates(session))
        answers = [json.loads(e["in"]) for e in gw.adapter_record() if '"outcome"' in e.get("in", "")]
        assert len(answers) == 1, "the agent got one answer: the one given once the claim had ended"


@pytest.mark.anyio
async def test_each_permission_policy_asks_whom_it_names(proc_env: dict[str, str], tmp_path: Path) -> None:
    """``designated``: the phone alone is asked, not the gateway; ``prompter``: whoever prompted the turn."""
    phone_env = {**proc_env, "ACP_PROXY_PRINCIPAL": "phone"}
    for policy, extra in (("designated", {"designated": ["phone"]}), ("prompter", {})):
        (tmp_path / policy).mkdir()
        cfg = config(tmp_path / policy, permissions=policy, **extra)
        async with holder(proc_env, tmp_path, cfg) as (gw, session), client(phone_env, tmp_path, cfg) as phone:
            await attach(phone, session, history="none", name="phone")
            asking = await prompt_in_flight(phone, session, "permission")
            await phone.send(allow(await phone.expect(is_asked)))
            assert (await phone.response_to(asking))["result"]["stopReason"] == "end_turn"
            if policy == "prompter":  # the gateway's own turn asks the gateway, not the phone
                asking = await prompt_in_flight(gw, session, "permission")
                await gw.send(allow(await gw.expect(is_asked)))
                assert (await gw.response_to(asking))["result"]["stopReason"] == "end_turn"
                assert not phone.stashed("session/request_permission"), "the phone did not prompt that turn"
            assert not gw.stashed("session/request_permission"), f"{policy}: the gateway was not asked the phone's"
