"""Sessions as ACP v1 defines them, method by state, with real processes.

Every session method the gateway can send, against a session in each state the
registry knows (live, suspended, closed, deleted, unknown; resuming has its own
tests below): the answer it gets and the state the session is left in. Close is
not delete: a closed session is still listed and the gateway's own load or resume
brings it back; a deleted one is a tombstone, and deleting what is not there is
``{}``.
"""

from __future__ import annotations

import base64
import json
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_proxy.sessions.registry import SessionState
from tests.support import (
    RESUME_AND_LOAD,
    Gateway,
    adapter_calls,
    cli,
    cli_json,
    pid_alive,
    registry,
    state_of,
    write_config,
)

pytestmark = pytest.mark.anyio

STATES = ("live", "suspended", "closed", "deleted", "unknown")
CAPS = {**RESUME_AND_LOAD, "sessionCapabilities": {"resume": {}, "close": {}, "delete": {}, "fork": {}}}

# What a request of each method answers for a session in each state, and the state it leaves:
# "result" (any result), a dict (that result), or an error reason; None for the unknown session's
# state means "no row".
Expectation = tuple[str | dict[str, Any], str | None]
TABLE: dict[str, dict[str, Expectation]] = {
    "session/prompt": {
        "live": ("result", "live"),
        "suspended": ("result", "live"),  # resumed transparently
        "closed": ("session_closed", "closed"),  # never reopened by itself
        "deleted": ("session_deleted", "deleted"),
        "unknown": ("unknown_session", None),
    },
    "session/set_mode": {
        "live": ({}, "live"),
        "suspended": ({}, "live"),
        "closed": ("session_closed", "closed"),
        "deleted": ("session_deleted", "deleted"),
        "unknown": ("unknown_session", None),
    },
    "session/close": {
        "live": ({}, "closed"),
        "suspended": ({}, "closed"),
        "closed": ({}, "closed"),  # closing what is closed is {}
        "deleted": ("session_deleted", "deleted"),
        "unknown": ("unknown_session", None),
    },
    "session/delete": {
        "live": ({}, "deleted"),
        "suspended": ({}, "deleted"),
        "closed": ({}, "deleted"),
        "deleted": ({}, "deleted"),  # SHOULD succeed silently
        "unknown": ({}, None),
    },
    "session/load": {
        "live": ("result", "live"),
        "suspended": ("result", "live"),
        "closed": ("result", "live"),  # restored exactly as a suspended one
        "deleted": ("session_deleted", "deleted"),
        "unknown": ("adapter:-32002", None),  # the adapter's own answer: it does not have it either
    },
    "session/resume": {
        "live": ("result", "live"),
        "suspended": ("result", "live"),
        "closed": ("result", "live"),
        "deleted": ("session_deleted", "deleted"),
        "unknown": ("adapter:-32002", None),
    },
}


def params_for(method: str, session_id: str) -> dict[str, Any]:
    params: dict[str, Any] = {"sessionId": session_id}
    if method == "session/prompt":
        params["prompt"] = [{"type": "text", "text": "state"}]
    elif method == "session/set_mode":
        params["modeId"] = "plan"
    elif method in ("session/load", "session/resume"):
        params |= {"cwd": "/tmp", "mcpServers": []}
    return params


def spec_config(tmp_path: Path, **pool: Any) -> Path:
    options = {"caps": CAPS, "modes": True, "store": str(tmp_path / "store"), "record": str(tmp_path / "rec.jsonl")}
    return write_config(tmp_path, pool={"max_live": 8, **pool}, backends={"fake": options})


@asynccontextmanager
async def spec_proxy(env: dict[str, str], tmp_path: Path) -> AsyncIterator[Gateway]:
    """A proxy over the spec backend (resume, load, close, delete, fork; modes; a store), initialized."""
    config = spec_config(tmp_path)
    async with Gateway.start(env, tmp_path, [], proxy_args=["--config", str(config)]) as gw:
        gw.record = tmp_path / "rec.jsonl"
        await gw.initialize()
        yield gw


async def session_in(gw: Gateway, env: dict[str, str], state: str) -> str:
    """A session of this proxy in ``state``, with one turn in its history."""
    if state == "unknown":
        return "fake-000000000000"
    session = await gw.new_session()
    assert (await gw.prompt(session, "stream 1"))["result"]["stopReason"] == "end_turn"
    if state == "suspended":
        assert (await cli_json(env, "sessions", "suspend", session))["done"]
    elif state == "closed":
        assert (await gw.request("session/close", {"sessionId": session}))["result"] == {}
    elif state == "deleted":
        assert (await gw.request("session/delete", {"sessionId": session}))["result"] == {}
    return session


def listed_states(answer: dict[str, Any]) -> dict[str, str]:
    return {s["sessionId"]: s["_meta"]["acp-proxy"]["state"] for s in answer["result"]["sessions"]}


@pytest.mark.parametrize("method", sorted(TABLE))
async def test_each_method_against_each_state(proc_env: dict[str, str], tmp_path: Path, method: str) -> None:
    async with spec_proxy(proc_env, tmp_path) as gw:
        sessions = {state: await session_in(gw, proc_env, state) for state in STATES}
        listed = listed_states(await gw.request("session/list", {}))
        assert listed == {sessions[s]: s for s in ("live", "suspended", "closed")}, "deleted is never listed"
        for state, session in sessions.items():
            expected, after = TABLE[method][state]
            answer = await gw.request(method, params_for(method, session))
            where = f"{method} on a {state} session"
            if expected == "result":
                assert "result" in answer, (where, answer)
            elif isinstance(expected, dict):
                assert answer.get("result") == expected, (where, answer)
            elif expected.startswith("adapter:"):
                assert answer["error"]["code"] == int(expected.split(":")[1]), (where, answer)
            else:
                assert answer["error"]["code"] == -32002, (where, answer)
                assert answer["error"]["data"]["reason"] == expected, (where, answer)
            record = registry(proc_env).get(session)
            assert (None if record is None else record.state.value) == after, where
        assert not adapter_calls(gw, "session/fork"), "nothing here forks"


async def test_close_then_load_and_close_then_resume_restore_with_history(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with spec_proxy(proc_env, tmp_path) as gw:
        loaded, resumed = await gw.new_session(), await gw.new_session()
        for session in (loaded, resumed):
            assert (await gw.prompt(session, "stream 2"))["result"]["stopReason"] == "end_turn"
            assert (await gw.request("session/set_mode", {"sessionId": session, "modeId": "plan"}))["result"] == {}
            pid = int((await state_of(gw, session))["pid"])
            assert (await gw.request("session/close", {"sessionId": session}))["result"] == {}
            assert not pid_alive(pid), "close reaps the tree"
        gw.clear_stash()
        assert "result" in await gw.request("session/load", params_for("session/load", loaded))
        replayed = [u["params"]["update"]["sessionUpdate"] for u in gw.updates(loaded)]
        assert replayed.count("agent_message_chunk") == 3, "the gateway's own load replays the history"
        gw.clear_stash()
        assert "result" in await gw.request("session/resume", params_for("session/resume", resumed))
        assert gw.updates(resumed) == [], "resume does not replay"
        for session in (loaded, resumed):
            state = await state_of(gw, session)
            assert (state["turns"], state["mode"]) == (2, "plan"), "same stable id, history and settings"
            assert registry(proc_env).get(session).state is SessionState.LIVE  # type: ignore[union-attr]
        resets = [u for u in gw.received if "historyReset" in json.dumps(u)]
        assert resets == [], "restored, not started afresh"


async def test_delete_reaches_the_backend_on_the_live_process_or_a_short_lived_one(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    config = spec_config(tmp_path)
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=["--config", str(config)]) as gw:
        gw.record = tmp_path / "rec.jsonl"
        init = await gw.initialize()
        assert "delete" in init["result"]["agentCapabilities"]["sessionCapabilities"]
        live = await session_in(gw, proc_env, "live")
        suspended = await session_in(gw, proc_env, "suspended")
        closed = await session_in(gw, proc_env, "closed")
        for session in (live, suspended, closed):
            assert (tmp_path / "store" / f"{session}.json").exists()
            assert (await gw.request("session/delete", {"sessionId": session}))["result"] == {}
            assert not (tmp_path / "store" / f"{session}.json").exists(), "deleted in the adapter's storage too"
        deletes = adapter_calls(gw, "session/delete")
        assert sorted(d["params"]["sessionId"] for d in deletes) == sorted((live, suspended, closed))
        assert listed_states(await gw.request("session/list", {})) == {}
        shown = await cli_json(proc_env, "sessions", "list", "--all")
        assert shown["sessions"] == [], "tombstones are not sessions to an operator either"


@pytest.mark.parametrize("advertised", [True, False], ids=["backend-deletes", "backend-does-not"])
async def test_delete_is_served_for_every_backend(proc_env: dict[str, str], tmp_path: Path, advertised: bool) -> None:
    caps = CAPS if advertised else RESUME_AND_LOAD
    options = {"caps": caps, "store": str(tmp_path / "store"), "record": str(tmp_path / "rec.jsonl")}
    config = write_config(tmp_path, pool={"max_live": 4}, backends={"fake": options})
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=["--config", str(config)]) as gw:
        gw.record = tmp_path / "rec.jsonl"
        init = await gw.initialize()
        assert "delete" in init["result"]["agentCapabilities"]["sessionCapabilities"], "the proxy serves it"
        session = await session_in(gw, proc_env, "suspended")
        spawned = len(adapter_calls(gw, "initialize"))
        assert (await gw.request("session/delete", {"sessionId": session}))["result"] == {}
        assert len(adapter_calls(gw, "session/delete")) == (1 if advertised else 0)
        if not advertised:
            assert len(adapter_calls(gw, "initialize")) == spawned, "no process started for a backend that cannot"
        refused = await gw.request("session/load", params_for("session/load", session))
        assert refused["error"]["data"]["reason"] == "session_deleted"


async def test_a_backend_delete_that_fails_does_not_undo_the_delete(proc_env: dict[str, str], tmp_path: Path) -> None:
    options = {"caps": CAPS, "store": str(tmp_path / "store"), "fail": {"session/delete": -32603}}
    config = write_config(tmp_path, pool={"max_live": 4}, backends={"fake": options})
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=["--config", str(config)]) as gw:
        await gw.initialize()
        session = await session_in(gw, proc_env, "live")
        assert (await gw.request("session/delete", {"sessionId": session}))["result"] == {}
        assert registry(proc_env).get(session).state is SessionState.DELETED  # type: ignore[union-attr]
        assert (await gw.prompt(session, "stream 1"))["error"]["data"]["reason"] == "session_deleted"


# --- resuming: requests that arrive while a session is being brought back -----------------------


async def resuming(gw: Gateway, env: dict[str, str]) -> tuple[str, Any]:
    """A suspended session whose resume (by a prompt, the id returned) is in progress."""
    session = await session_in(gw, env, "suspended")
    request_id = gw.new_id()
    prompt = params_for("session/prompt", session)
    await gw.send({"jsonrpc": "2.0", "id": request_id, "method": "session/prompt", "params": prompt})
    with anyio.fail_after(10):
        while (record := registry(env).get(session)) is None or record.state is not SessionState.RESUMING:
            await anyio.sleep(0.02)
    return session, request_id


Act = Callable[[Gateway, str], Awaitable[dict[str, Any]]]


async def _close(gw: Gateway, session: str) -> dict[str, Any]:
    return await gw.request("session/close", {"sessionId": session})


async def _delete(gw: Gateway, session: str) -> dict[str, Any]:
    return await gw.request("session/delete", {"sessionId": session})


async def _prompt(gw: Gateway, session: str) -> dict[str, Any]:
    return await gw.request("session/prompt", params_for("session/prompt", session))


# (what arrives while resuming, its answer, what the resuming prompt gets, the state after)
RESUMING: list[tuple[str, Act, str | dict[str, Any], str | dict[str, Any], str]] = [
    ("close", _close, {}, {"stopReason": "cancelled"}, "closed"),
    ("delete", _delete, {}, {"stopReason": "cancelled"}, "deleted"),
    ("prompt", _prompt, "result", "result", "live"),
]


@pytest.mark.parametrize(("act", "answer", "first", "after"), [r[1:] for r in RESUMING], ids=[r[0] for r in RESUMING])
async def test_requests_while_resuming(
    proc_env: dict[str, str],
    tmp_path: Path,
    act: Act,
    answer: str | dict[str, Any],
    first: str | dict[str, Any],
    after: str,
) -> None:
    options = {"caps": CAPS, "store": str(tmp_path / "store"), "init_delay": 0.6}
    config = write_config(tmp_path, pool={"max_live": 4}, backends={"fake": options})
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=["--config", str(config)]) as gw:
        await gw.initialize()
        session, prompt_id = await resuming(gw, proc_env)
        got = await act(gw, session)
        assert ("result" in got) if answer == "result" else got.get("result") == answer, got
        resumed = await gw.response_to(prompt_id)
        if first == "result":
            assert resumed["result"]["stopReason"] == "end_turn", resumed
        elif isinstance(first, dict):
            assert resumed["result"] == first, resumed
        else:
            assert resumed["error"]["data"]["reason"] == first, resumed
        assert registry(proc_env).get(session).state.value == after  # type: ignore[union-attr]


# --- titles --------------------------------------------------------------------------------------


def listed_titles(answer: dict[str, Any]) -> dict[str, str | None]:
    return {s["sessionId"]: s.get("title") for s in answer["result"]["sessions"]}


async def test_titles_from_session_info_updates_are_listed_shown_and_survive_a_restart(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    config = spec_config(tmp_path)
    args = ["--config", str(config)]
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=args) as gw:
        await gw.initialize()
        titled, cleared, untitled = await gw.new_session(), await gw.new_session(), await gw.new_session()
        assert (await gw.prompt(titled, "stream 1; title Fix the build"))["result"]["stopReason"] == "end_turn"
        assert (await gw.prompt(cleared, "title Draft; title -"))["result"]["stopReason"] == "end_turn"
        await gw.prompt(untitled, "stream 1")
        listed = await gw.request("session/list", {})
        assert listed_titles(listed) == {titled: "Fix the build", cleared: None, untitled: None}
        stamp = next(s["updatedAt"] for s in listed["result"]["sessions"] if s["sessionId"] == titled)
        assert stamp.endswith("Z")
        shown = await cli_json(proc_env, "sessions", "show", titled)
        assert shown["title"] == "Fix the build"
        status = await cli_json(proc_env, "status")
        assert {s["sessionId"]: s["title"] for s in status["liveSessions"]}[titled] == "Fix the build"
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=args) as gw:
        await gw.initialize()
        listed = await gw.request("session/list", {})
        assert listed_titles(listed)[titled] == "Fix the build", "kept in the registry across a restart"
        listing = await cli_json(proc_env, "sessions", "list")
        assert {s["sessionId"]: s["title"] for s in listing["sessions"]}[titled] == "Fix the build"


# --- background work ------------------------------------------------------------------------------


async def test_background_updates_keep_a_session_from_eviction_until_it_is_quiet(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    options = {"caps": CAPS, "store": str(tmp_path / "store")}
    config = write_config(tmp_path, pool={"max_live": 1, "quiet_after": "500ms"}, backends={"fake": options})
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=["--config", str(config)]) as gw:
        await gw.initialize()
        worker = await gw.new_session()
        # Long enough for the command below to start and ask while it runs, on a loaded machine too.
        assert (await gw.prompt(worker, "stream 1; background 4"))["result"]["stopReason"] == "end_turn"
        # The only slot is the worker's, idle as far as turns go but still reporting work: its first
        # report after the turn has come (the operator's command below must not outrun it).
        await gw.expect(lambda m: m.get("method") == "session/update" and "working" in str(m["params"]["update"]))
        code, out, _ = await cli(proc_env, "sessions", "suspend", worker, "--json")
        assert (code, json.loads(out)["done"]) == (1, False), "busy: not suspended"
        assert "background" in json.loads(out)["reason"]
        other = await gw.new_session()  # waits until the worker has been quiet for quiet_after
        texts = [u["params"]["update"]["content"]["text"] for u in gw.updates(worker)]
        assert "background done" in texts, "its background work was not cut short"
        assert registry(proc_env).get(worker).state is SessionState.SUSPENDED  # type: ignore[union-attr]
        assert registry(proc_env).get(other).state is SessionState.LIVE  # type: ignore[union-attr]


async def test_background_updates_hold_off_the_idle_ttl(proc_env: dict[str, str], tmp_path: Path) -> None:
    options = {"caps": CAPS, "store": str(tmp_path / "store")}
    pool = {"max_live": 2, "idle_ttl": "200ms", "quiet_after": "500ms"}
    config = write_config(tmp_path, pool=pool, backends={"fake": options})
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=["--config", str(config)]) as gw:
        await gw.initialize()
        worker = await gw.new_session()
        assert (await gw.prompt(worker, "background 1.2"))["result"]["stopReason"] == "end_turn"
        with anyio.fail_after(15):
            while registry(proc_env).get(worker).state is not SessionState.SUSPENDED:  # type: ignore[union-attr]
                await anyio.sleep(0.05)
        texts = [u["params"]["update"]["content"]["text"] for u in gw.updates(worker)]
        assert "background done" in texts, "suspended by idle_ttl only once its background work was over"


async def test_metadata_updates_between_turns_are_not_background_work(proc_env: dict[str, str], tmp_path: Path) -> None:
    """A title or the commands list after a turn does not keep a session busy."""
    options = {"caps": CAPS, "store": str(tmp_path / "store"), "chatty": True}
    config = write_config(tmp_path, pool={"max_live": 1, "quiet_after": "1h"}, backends={"fake": options})
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=["--config", str(config)]) as gw:
        await gw.initialize()
        first = await gw.new_session()  # chatty: an available_commands_update right behind the answer
        assert (await gw.prompt(first, "stream 1"))["result"]["stopReason"] == "end_turn"
        suspended = await cli_json(proc_env, "sessions", "suspend", first)
        assert suspended["done"], "idle: metadata is not work"


async def test_the_replay_of_a_load_is_not_background_work(proc_env: dict[str, str], tmp_path: Path) -> None:
    """The history a session/load streams before its answer is the past, not work: the session is idle after it."""
    options = {"caps": CAPS, "store": str(tmp_path / "store")}
    config = write_config(tmp_path, pool={"max_live": 1, "quiet_after": "1h"}, backends={"fake": options})
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=["--config", str(config)]) as gw:
        await gw.initialize()
        session = await gw.new_session()
        assert (await gw.prompt(session, "stream 2"))["result"]["stopReason"] == "end_turn"
        assert (await gw.request("session/close", {"sessionId": session}))["result"] == {}
        loaded = await gw.request("session/load", {"sessionId": session, "cwd": "/tmp", "mcpServers": []})
        assert "result" in loaded
        assert gw.updates(session), "the history was replayed"
        suspended = await cli_json(proc_env, "sessions", "suspend", session)
        assert suspended["done"], "idle once loaded"


# --- fork --------------------------------------------------------------------------------------


async def test_fork_gets_its_own_row_and_process_and_both_suspend_and_resume(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with spec_proxy(proc_env, tmp_path) as gw:
        meta = {"acp-proxy": {"sessionKey": "agent:main", "agentId": "main"}}
        parent = await gw.new_session(_meta=meta)
        assert (await gw.prompt(parent, "stream 2"))["result"]["stopReason"] == "end_turn"
        parent_pid = int((await state_of(gw, parent))["pid"])
        forked = await gw.request("session/fork", {"sessionId": parent, "cwd": "/tmp", "mcpServers": []})
        fork = forked["result"]["sessionId"]
        assert fork != parent
        row = registry(proc_env).get(fork)
        assert row is not None
        assert (row.parent_session_id, row.state) == (parent, SessionState.LIVE)
        assert (row.ownership.parent_session_key, row.ownership.agent_id) == ("agent:main", "main")
        assert registry(proc_env).get(parent).state is SessionState.SUSPENDED  # type: ignore[union-attr]
        fork_state = await state_of(gw, fork)
        assert (fork_state["pid"], fork_state["turns"]) == (parent_pid, 2), "the fork keeps the parent's process"
        parent_state = await state_of(gw, parent)  # the parent comes back on a process of its own
        assert parent_state["pid"] != parent_pid
        assert parent_state["turns"] == 2
        listed = (await gw.request("session/list", {}))["result"]["sessions"]
        parents = {s["sessionId"]: s["_meta"]["acp-proxy"].get("parentSessionId") for s in listed}
        assert parents == {parent: None, fork: parent}
        for session in (fork, parent):
            assert (await cli_json(proc_env, "sessions", "suspend", session))["done"]
            assert (await state_of(gw, session))["turns"] == 3, "resumed with its own history"
        assert (await gw.request("session/close", {"sessionId": fork}))["result"] == {}
        assert (await gw.request("session/delete", {"sessionId": fork}))["result"] == {}
        assert (await state_of(gw, parent))["turns"] == 4, "the parent is untouched by its fork's end"
        mine = {"acp-proxy": {"requester": {"sessionKey": "agent:main", "visibility": "tree"}}}
        fork2 = (await gw.request("session/fork", {"sessionId": parent, "cwd": "/tmp"}))["result"]["sessionId"]
        seen = {s["sessionId"] for s in (await gw.request("session/list", {"_meta": mine}))["result"]["sessions"]}
        assert {parent, fork2} <= seen, "a fork is in its parent's tree"


async def test_fork_of_a_closed_or_unknown_session_is_refused(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with spec_proxy(proc_env, tmp_path) as gw:
        closed = await session_in(gw, proc_env, "closed")
        for session, reason in ((closed, "session_closed"), ("fake-000000000000", "unknown_session")):
            answer = await gw.request("session/fork", {"sessionId": session, "cwd": "/tmp"})
            assert answer["error"]["data"]["reason"] == reason


# --- logout ------------------------------------------------------------------------------------


async def test_logout_reaches_every_live_process_and_later_resumes_do_not_authenticate(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    options = {
        "caps": {**CAPS, "auth": {"logout": {}}},
        "store": str(tmp_path / "store"),
        "record": str(tmp_path / "rec.jsonl"),
        "auth_methods": [{"id": "token", "name": "Token"}],
    }
    config = write_config(tmp_path, pool={"max_live": 4}, backends={"fake": options})
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=["--config", str(config)]) as gw:
        gw.record = tmp_path / "rec.jsonl"
        await gw.initialize()
        assert "result" in await gw.request("authenticate", {"methodId": "token"})
        first, second = await gw.new_session(), await gw.new_session()
        assert json.loads(await _said(gw, second, "auth")) == ["token"], "authenticated again for a new process"
        answer = await gw.request("logout", {})
        assert answer["result"] == {}
        pids = {int((await state_of(gw, s))["pid"]) for s in (first, second)}
        logouts = {e["pid"] for e in gw.adapter_record() if '"method":"logout"' in e.get("in", "").replace(" ", "")}
        assert pids <= logouts, "every live process was logged out"
        assert (await cli_json(proc_env, "sessions", "suspend", first))["done"]
        authenticated_before = len(adapter_calls(gw, "authenticate"))
        assert json.loads(await _said(gw, first, "auth")) == [], "resumed without the forgotten credentials"
        assert len(adapter_calls(gw, "authenticate")) == authenticated_before


async def _said(gw: Gateway, session: str, command: str) -> str:
    assert (await gw.prompt(session, command))["result"]["stopReason"] == "end_turn"
    text = str(gw.updates(session)[-1]["params"]["update"]["content"]["text"])
    gw.clear_stash()
    return text


async def test_a_title_inside_a_burst_is_read_with_the_turns_digest(proc_env: dict[str, str], tmp_path: Path) -> None:
    """A block too large to scan on the streaming path is read at the turn's digest: its title is not lost."""
    async with spec_proxy(proc_env, tmp_path) as gw:
        session = await gw.new_session()

        def update(kind: dict[str, Any]) -> bytes:
            message = {"jsonrpc": "2.0", "method": "session/update", "params": {"sessionId": session, "update": kind}}
            return json.dumps(message, separators=(",", ":")).encode() + b"\n"

        chunk = update({"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": "x" * 200}})
        title = update({"sessionUpdate": "session_info_update", "title": "Burst", "updatedAt": "2026-11-24T03:00:00Z"})
        burst = chunk * 100 + title + chunk * 100  # one write of ~50 KB
        encoded = base64.b64encode(zlib.compress(burst)).decode()
        assert (await gw.prompt(session, f"emit {encoded}"))["result"]["stopReason"] == "end_turn"
        assert listed_titles(await gw.request("session/list", {})) == {session: "Burst"}


# --- races the order of the gateway's requests decides ------------------------------------------


def request(request_id: str, method: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}


async def test_a_close_cuts_short_a_fork_waiting_for_the_parents_turn(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with spec_proxy(proc_env, tmp_path) as gw:
        parent = await gw.new_session()
        await gw.send(request("turn2", "session/prompt", _text(parent, "sleep 2")))
        await gw.send(request("fork", "session/fork", {"sessionId": parent, "cwd": "/tmp"}))
        await anyio.sleep(0.3)
        assert (await gw.request("session/close", {"sessionId": parent}))["result"] == {}
        assert (await gw.response_to("fork"))["error"]["data"]["reason"] == "session_closed"
        assert (await gw.response_to("turn2"))["result"] == {"stopReason": "cancelled"}
        assert [r.session_id for r in registry(proc_env).page()] == [parent], "no fork was registered"
        assert registry(proc_env).get(parent).state is SessionState.CLOSED  # type: ignore[union-attr]


async def test_a_fork_whose_process_exits_first_is_answered(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with spec_proxy(proc_env, tmp_path) as gw:
        parent = await gw.new_session()
        await gw.send(request("turn", "session/prompt", _text(parent, "sleep 0.5; crash 3")))
        await gw.send(request("fork", "session/fork", {"sessionId": parent, "cwd": "/tmp"}))
        assert (await gw.response_to("turn"))["error"]["data"]["reason"] == "adapter_exited"
        forked = await gw.response_to("fork")
        assert "error" in forked or forked["result"]["sessionId"] != parent, forked


async def test_a_close_after_a_load_is_the_last_word(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with spec_proxy(proc_env, tmp_path) as gw:
        session = await session_in(gw, proc_env, "suspended")
        load = request("load", "session/load", params_for("session/load", session))
        close = request("close", "session/close", {"sessionId": session})
        await gw.send_raw((json.dumps(load) + "\n" + json.dumps(close) + "\n").encode())
        assert (await gw.response_to("close"))["result"] == {}
        loaded = await gw.response_to("load")
        assert "result" in loaded or loaded["error"]["data"]["reason"] == "session_closed", loaded
        assert registry(proc_env).get(session).state is SessionState.CLOSED  # type: ignore[union-attr]


async def test_a_closed_session_whose_load_failed_is_not_reopened_by_a_prompt(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    options = {"caps": CAPS, "store": str(tmp_path / "store"), "fail": {"session/resume": -32603}}
    config = write_config(tmp_path, pool={"max_live": 4}, backends={"fake": options})
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=["--config", str(config)]) as gw:
        await gw.initialize()
        session = await session_in(gw, proc_env, "closed")
        load = request("resume", "session/resume", params_for("session/resume", session))
        prompt = request("prompt", "session/prompt", _text(session, "stream 1"))
        await gw.send_raw((json.dumps(load) + "\n" + json.dumps(prompt) + "\n").encode())
        assert (await gw.response_to("resume"))["error"]["data"]["reason"] == "restore_failed"
        assert (await gw.response_to("prompt"))["error"]["data"]["reason"] == "session_closed"
        assert registry(proc_env).get(session).state is SessionState.CLOSED  # type: ignore[union-attr]


def _text(session: str, text: str) -> dict[str, Any]:
    return {"sessionId": session, "prompt": [{"type": "text", "text": text}]}


async def test_a_suspended_session_of_a_backend_that_does_not_fork_is_not_restored_to_be_refused(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    options = {"caps": RESUME_AND_LOAD, "store": str(tmp_path / "store"), "record": str(tmp_path / "rec.jsonl")}
    config = write_config(tmp_path, pool={"max_live": 4}, backends={"fake": options})
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=["--config", str(config)]) as gw:
        gw.record = tmp_path / "rec.jsonl"
        await gw.initialize()
        live = await session_in(gw, proc_env, "live")
        await gw.request("session/fork", {"sessionId": live, "cwd": "/tmp"})
        assert len(adapter_calls(gw, "session/fork")) == 1, "a live process is asked, and answers for itself"
        suspended = await session_in(gw, proc_env, "suspended")
        starts = len(adapter_calls(gw, "initialize"))
        refused = await gw.request("session/fork", {"sessionId": suspended, "cwd": "/tmp"})
        assert (refused["error"]["code"], refused["error"]["data"]["reason"]) == (-32601, "fork_unsupported")
        assert len(adapter_calls(gw, "initialize")) == starts, "not restored only to be refused"
