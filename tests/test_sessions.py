"""Sessions over a bounded pool, with real processes: suspend, resume, close, restart.

Each test drives a real proxy in front of the fake adapter, with the adapter's
session state kept in a directory (``store``) so that a fresh adapter process can
load or resume what an earlier one served, as real adapters do from disk.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_proxy.ownership.leases import LeaseState
from acp_proxy.sessions.registry import SessionState
from acp_proxy.state import StateDB
from tests.support import (
    LOAD_ONLY,
    NEITHER,
    RESUME_AND_LOAD,
    Gateway,
    adapter_calls,
    adapter_pid,
    pid_alive,
    registry,
    start,
    state_of,
    write_config,
)

pytestmark = pytest.mark.anyio

RESUME_ONLY = {"sessionCapabilities": {"resume": {}, "close": {}}}

# --- LRU suspension and transparent resume, over strategies and capabilities ---------------------

# (id, caps, resume strategy, request the proxy restores with, history kept): each way of restoring through
# a real adapter, and a strategy from the config overriding the capabilities. Which request each strategy
# and set of capabilities makes, row by row, is test_pool.test_restore_order.
RESTORE = [
    ("auto-resume", RESUME_AND_LOAD, "auto", "session/resume", True),
    ("auto-load", LOAD_ONLY, "auto", "session/load", True),
    ("auto-new", NEITHER, "auto", "session/new", False),
    ("forced-new", RESUME_AND_LOAD, "new", "session/new", False),
]


@pytest.mark.parametrize(("caps", "strategy", "method", "kept"), [r[1:] for r in RESTORE], ids=[r[0] for r in RESTORE])
async def test_lru_suspends_the_idle_session_and_resume_is_transparent(
    proc_env: dict[str, str], tmp_path: Path, caps: dict[str, Any], strategy: str, method: str, kept: bool
) -> None:
    config = write_config(
        tmp_path,
        pool={"max_live": 1},
        backends={
            "fake": {
                "caps": caps,
                "resume": strategy,
                "store": str(tmp_path / "store"),
                "record": str(tmp_path / "rec.jsonl"),
            }
        },
    )
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=["--config", str(config)]) as gw:
        gw.record = tmp_path / "rec.jsonl"
        await gw.initialize()
        first = await gw.new_session()
        assert (await gw.prompt(first, "stream 2"))["result"]["stopReason"] == "end_turn"
        first_pid = await adapter_pid(gw, first)
        second = await gw.new_session()  # max_live = 1: the first session is suspended for it
        with anyio.fail_after(10):
            while pid_alive(first_pid):
                await anyio.sleep(0.02)
        assert registry(proc_env).get(first).state is SessionState.SUSPENDED  # type: ignore[union-attr]
        gw.clear_stash()
        state = await state_of(gw, first)  # resumes it (suspending the second)
        assert state["pid"] != first_pid
        assert state["turns"] == (2 if kept else 0)
        assert state["history"] == (3 if kept else 0)
        assert adapter_calls(gw, method), f"restored with {method}"
        resets = [
            m
            for m in gw.received
            if m.get("method") == "session/update"
            and m["params"]["update"].get("sessionUpdate") == "session_info_update"
        ]
        assert bool(resets) is not kept, "a history reset is announced, and only then"
        if resets:
            assert resets[0]["params"]["sessionId"] == first
            assert resets[0]["params"]["update"]["_meta"]["acp-proxy"]["historyReset"] is True
        replayed = [m for m in gw.received if m.get("method") == "session/update" and "chunk 0" in json.dumps(m)]
        assert len(replayed) == 1, "the replay of a load the gateway did not ask for is not forwarded"
        # The stable id holds in both directions, even when the adapter's own id changed.
        assert (await gw.prompt(first, "stream 1"))["result"]["stopReason"] == "end_turn"
        assert (await gw.prompt(second, "stream 1"))["result"]["stopReason"] == "end_turn"
        ids = {m["params"]["sessionId"] for m in gw.received if m.get("method") == "session/update"}
        assert ids == {first, second}


# --- fallback error classes, timeouts ------------------------------------------------------


async def test_a_fallback_to_new_rewrites_the_ids_both_ways(proc_env: dict[str, str], tmp_path: Path) -> None:
    """A resume that fails with an error that gives way (-32002 here; which codes do is
    ``test_pool.test_fallback_only_on_the_three_error_classes``, -32601 through a proxy is
    ``test_adapter_quirks``) ends in ``session/new``, and the ids are rewritten both ways."""
    # Resume alone advertised: nothing between it and session/new (see test_adapter_quirks for load in between).
    async with start(proc_env, tmp_path, caps=RESUME_ONLY, fail={"session/resume": -32002}) as gw:
        gw.handler = lambda _: {"result": {"outcome": {"outcome": "selected", "optionId": "allow"}}}
        await gw.initialize()
        first = await gw.new_session()
        await gw.new_session()
        state = await state_of(gw, first)
        assert state["session"] != first, "the adapter knows it under a new id"
        assert state["turns"] == 0
        # Agent->client requests carry the stable id too, and answers find their way back.
        gw.handler = None  # this one is answered by hand
        await gw.send(
            {
                "jsonrpc": "2.0",
                "id": "p",
                "method": "session/prompt",
                "params": {"sessionId": first, "prompt": [{"type": "text", "text": "permission"}]},
            }
        )
        asked = await gw.expect(lambda m: m.get("method") == "session/request_permission")
        assert asked["params"]["sessionId"] == first
        await gw.send_raw(
            json.dumps(
                {
                    "jsonrpc": "2.0",
                    "id": asked["id"],
                    "result": {"outcome": {"outcome": "selected", "optionId": "allow"}},
                }
            ).encode()
            + b"\n"
        )
        assert (await gw.response_to("p"))["result"]["stopReason"] == "end_turn"
        sent = [m for m in adapter_calls(gw, "session/prompt") if m["params"]["prompt"][0]["text"] == "permission"]
        assert sent[0]["params"]["sessionId"] == state["session"], "rewritten on the way to the adapter"
        # A stream of it (blocks of updates, rewritten a block at a time): every update under the gateway's id.
        gw.clear_stash()
        assert (await gw.prompt(first, "stream 300"))["result"]["stopReason"] == "end_turn"
        assert len(gw.updates(first)) == 300
        assert gw.updates(state["session"]) == []


@pytest.mark.parametrize(
    ("fault", "reason"),
    [({"fail": {"session/resume": -32603}}, "restore_failed"), ({"hang": ["session/resume"]}, "restore_timeout")],
    ids=["internal-error", "timeout"],
)
async def test_other_failures_never_fall_back_and_keep_the_mapping(
    proc_env: dict[str, str], tmp_path: Path, fault: dict[str, Any], reason: str
) -> None:
    async with start(proc_env, tmp_path, pool={"resume_timeout": "700ms"}, caps=RESUME_AND_LOAD, **fault) as gw:
        await gw.initialize()
        first = await gw.new_session()
        await gw.new_session()
        failed = await gw.prompt(first, "state")
        assert failed["error"]["data"]["reason"] == reason
        assert not adapter_calls(gw, "session/new")[2:], "no fallback to session/new"
        assert registry(proc_env).get(first).state is SessionState.SUSPENDED  # type: ignore[union-attr]
        listed = await gw.request("session/list", {})
        assert first in [s["sessionId"] for s in listed["result"]["sessions"]]


# --- settings, busy sessions, the pool's limits, idle TTL ------------------------------------


async def test_mode_and_config_options_are_reapplied_after_resume(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with start(proc_env, tmp_path, caps=RESUME_AND_LOAD, modes=True) as gw:
        await gw.initialize()
        first = await gw.new_session()
        assert "result" in await gw.request("session/set_mode", {"sessionId": first, "modeId": "plan"})
        option = {"sessionId": first, "configId": "model", "value": "big"}
        assert "result" in await gw.request("session/set_config_option", option)
        await gw.new_session()
        state = await state_of(gw, first)
        assert (state["mode"], state["config"]) == ("plan", {"model": "big"})
        assert adapter_calls(gw, "session/set_mode")[-1]["params"] == {"sessionId": first, "modeId": "plan"}


async def test_a_busy_session_is_never_evicted_and_the_pool_answers_exhausted(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with start(proc_env, tmp_path, pool={"acquire_timeout": "500ms"}) as gw:
        await gw.initialize()
        first = await gw.new_session()
        await gw.send(
            {
                "jsonrpc": "2.0",
                "id": "busy",
                "method": "session/prompt",
                "params": {"sessionId": first, "prompt": [{"type": "text", "text": "sleep 1.5; stream 1"}]},
            }
        )
        await anyio.sleep(0.2)
        refused = await gw.request("session/new", {"cwd": "/tmp", "mcpServers": []})
        assert refused["error"]["code"] == -32603
        assert refused["error"]["data"]["reason"] == "pool_exhausted"
        assert refused["error"]["data"]["maxLive"] == 1
        assert (await gw.response_to("busy"))["result"]["stopReason"] == "end_turn"
        assert "result" in await gw.request("session/new", {"cwd": "/tmp", "mcpServers": []})


async def test_idle_sessions_are_suspended_after_the_ttl(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with start(proc_env, tmp_path, pool={"max_live": 4, "idle_ttl": "300ms"}, caps=RESUME_AND_LOAD) as gw:
        await gw.initialize()
        session = await gw.new_session()
        pid = await adapter_pid(gw, session)
        # The row says suspended once the proxy's queued write lands: it may come after the process is gone.
        rows = registry(proc_env)
        try:
            with anyio.fail_after(10):
                while pid_alive(pid) or rows.get(session).state is not SessionState.SUSPENDED:  # type: ignore[union-attr]
                    await anyio.sleep(0.05)
        finally:
            rows.db.close()
        assert (await state_of(gw, session))["turns"] == 1


# --- cancel and close ------------------------------------------------------------------------


async def test_cancel_arriving_during_a_resume_cancels_the_queued_prompt(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with start(proc_env, tmp_path, caps=RESUME_AND_LOAD, init_delay=0.6) as gw:
        await gw.initialize()
        first = await gw.new_session()
        await gw.new_session()
        prompt = {"sessionId": first, "prompt": [{"type": "text", "text": "stream 1"}]}
        await gw.send({"jsonrpc": "2.0", "id": "queued", "method": "session/prompt", "params": prompt})
        await anyio.sleep(0.2)
        await gw.notify("session/cancel", {"sessionId": first})
        assert (await gw.response_to("queued"))["result"] == {"stopReason": "cancelled"}
        # The resume itself went on: the session is live and serves the next prompt.
        assert (await gw.prompt(first, "stream 1"))["result"]["stopReason"] == "end_turn"


async def test_cancel_of_a_suspended_session_starts_nothing(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with start(proc_env, tmp_path, caps=RESUME_AND_LOAD) as gw:
        await gw.initialize()
        first = await gw.new_session()
        await gw.new_session()
        await gw.notify("session/cancel", {"sessionId": first})
        await gw.request("session/list", {})  # a round trip: the notification was handled
        leases = StateDB(Path(proc_env["ACP_PROXY_STATE_DIR"]), create=False).conn.execute(
            "SELECT COUNT(*) FROM leases"
        )
        assert leases.fetchone()[0] == 2, "one process per session/new, none for the cancel"


async def test_close_during_a_turn_answers_cancelled_and_reaps_the_tree(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with start(proc_env, tmp_path, pool={"max_live": 2}) as gw:
        await gw.initialize()
        session = await gw.new_session()
        pids = (await gw.request("_fake/pids"))["result"]
        await gw.prompt(session, "spawn_tree")
        tree = [pids["adapter"], *(await gw.request("_fake/pids"))["result"]["children"]]
        prompt = {"sessionId": session, "prompt": [{"type": "text", "text": "sleep 30"}]}
        await gw.send({"jsonrpc": "2.0", "id": "turn", "method": "session/prompt", "params": prompt})
        await anyio.sleep(0.2)
        assert (await gw.request("session/close", {"sessionId": session}))["result"] == {}
        assert (await gw.response_to("turn"))["result"] == {"stopReason": "cancelled"}
        assert not any(pid_alive(p) for p in tree)
        assert registry(proc_env).get(session).state is SessionState.CLOSED  # type: ignore[union-attr]
        again = await gw.request("session/close", {"sessionId": session})
        assert again["result"] == {}, "closing a closed session is {} (ACP: close is not delete)"
        refused = await gw.prompt(session, "stream 1")
        assert (refused["error"]["code"], refused["error"]["data"]["reason"]) == (-32002, "session_closed")


async def test_unknown_session_is_resource_not_found(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with start(proc_env, tmp_path) as gw:
        await gw.initialize()
        for method in ("session/close", "session/prompt", "session/set_mode"):
            params: dict[str, Any] = {"sessionId": "nope", "prompt": [], "modeId": "x"}
            response = await gw.request(method, params)
            assert response["error"]["code"] == -32002, method


# --- restart, several backends, session/list -------------------------------------------------


@pytest.mark.parametrize("first_request", ["session/load", "session/prompt"])
async def test_sessions_survive_a_proxy_restart_with_their_ids(
    proc_env: dict[str, str], tmp_path: Path, first_request: str
) -> None:
    async with start(proc_env, tmp_path, caps=RESUME_AND_LOAD) as gw:
        await gw.initialize()
        session = await gw.new_session()
        assert (await gw.prompt(session, "stream 3"))["result"]["stopReason"] == "end_turn"
    assert registry(proc_env).get(session).state is SessionState.SUSPENDED  # type: ignore[union-attr]
    async with start(proc_env, tmp_path, caps=RESUME_AND_LOAD) as gw:
        await gw.initialize()
        listed = await gw.request("session/list", {})
        assert [s["sessionId"] for s in listed["result"]["sessions"]] == [session]
        if first_request == "session/load":
            loaded = await gw.request("session/load", {"sessionId": session, "cwd": "/tmp", "mcpServers": []})
            assert "result" in loaded
            replay = gw.updates(session)
            assert len(replay) == 3, "the gateway asked for the load: the replay is forwarded"
            gw.clear_stash()
        state = await state_of(gw, session)
        assert state["turns"] == 1
        assert state["session"] == session


async def test_a_session_left_live_by_a_killed_proxy_is_resumed_by_the_next(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with start(proc_env, tmp_path, caps=RESUME_AND_LOAD) as gw:
        await gw.initialize()
        session = await gw.new_session()
        await gw.prompt(session, "stream 2")
        gw.process.kill()
        await gw.process.wait()
    async with start(proc_env, tmp_path, caps=RESUME_AND_LOAD) as gw:
        await gw.initialize()
        assert (await state_of(gw, session))["turns"] == 1
    db = StateDB(Path(proc_env["ACP_PROXY_STATE_DIR"]), create=False)
    states = [row[0] for row in db.conn.execute("SELECT state FROM leases")]
    assert LeaseState.OPEN not in states


async def test_session_new_chooses_a_backend_by_meta(proc_env: dict[str, str], tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    config = write_config(
        tmp_path,
        pool={"max_live": 4},
        backends={"alpha": {"store": store, "title": "alpha"}, "beta": {"store": store, "caps": NEITHER}},
        default_backend="alpha",
    )
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=["--config", str(config)]) as gw:
        await gw.initialize()
        params: dict[str, Any] = {"cwd": "/tmp", "mcpServers": [], "_meta": {"acp-proxy": {"backend": "beta"}}}
        beta = (await gw.request("session/new", params))["result"]["sessionId"]
        alpha = await gw.new_session()
        listed = {
            s["sessionId"]: s["_meta"]["acp-proxy"]["backend"]
            for s in (await gw.request("session/list", {}))["result"]["sessions"]
        }
        assert listed == {alpha: "alpha", beta: "beta"}
        params["_meta"]["acp-proxy"]["backend"] = "gamma"
        unknown = await gw.request("session/new", params)
        assert unknown["error"]["code"] == -32602
        assert "alpha, beta" in unknown["error"]["message"]


async def test_session_list_pages_and_filters_by_requester(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with start(proc_env, tmp_path, pool={"max_live": 2}) as gw:
        await gw.initialize()
        made = []
        for key in ("k1", "k2", "k3"):
            meta = {"acp-proxy": {"sessionKey": key, "agentId": "main", "spawnedBy": "k1" if key == "k3" else None}}
            response = await gw.request("session/new", {"cwd": "/tmp", "mcpServers": [], "_meta": meta})
            made.append(response["result"]["sessionId"])
        seen, cursor = [], None
        while True:
            params: dict[str, Any] = {} if cursor is None else {"cursor": cursor}
            page = (await gw.request("session/list", params))["result"]
            seen += [s["sessionId"] for s in page["sessions"]]
            cursor = page.get("nextCursor")
            if cursor is None:
                break
        assert seen == made
        requester = {"sessionKey": "k1", "agentId": "main", "visibility": "tree"}
        tree = await gw.request("session/list", {"_meta": {"acp-proxy": {"requester": requester}}})
        assert [s["sessionId"] for s in tree["result"]["sessions"]] == [made[0], made[2]]
        bad = await gw.request("session/list", {"cursor": "not-a-cursor"})
        assert bad["error"]["code"] == -32602


async def test_concurrent_agent_requests_from_several_adapters_are_routed_back(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """Each adapter numbers its requests from the same start; upstream they never collide."""
    async with start(proc_env, tmp_path, pool={"max_live": 3}) as gw:
        await gw.initialize()
        sessions = [await gw.new_session() for _ in range(3)]
        for n, session in enumerate(sessions):
            prompt = {"sessionId": session, "prompt": [{"type": "text", "text": "permission"}]}
            await gw.send({"jsonrpc": "2.0", "id": f"turn-{n}", "method": "session/prompt", "params": prompt})
        asked = [await gw.expect(lambda m: m.get("method") == "session/request_permission") for _ in sessions]
        assert sorted(a["params"]["sessionId"] for a in asked) == sorted(sessions)
        assert len({a["id"] for a in asked}) == 3, "distinct upstream ids"
        # Answer in reverse order: allow all but the first session's, which is refused.
        for request in reversed(asked):
            option = "reject" if request["params"]["sessionId"] == sessions[0] else "allow"
            answer = {
                "jsonrpc": "2.0",
                "id": request["id"],
                "result": {"outcome": {"outcome": "selected", "optionId": option}},
            }
            await gw.send_raw(json.dumps(answer).encode() + b"\n")
        stops = [(await gw.response_to(f"turn-{n}"))["result"]["stopReason"] for n in range(3)]
        assert stops == ["refusal", "end_turn", "end_turn"]


async def test_a_resumed_adapter_is_authenticated_as_the_gateway_did(proc_env: dict[str, str], tmp_path: Path) -> None:
    auth = [{"id": "key", "name": "API key"}]
    async with start(proc_env, tmp_path, caps=RESUME_AND_LOAD, auth_methods=auth) as gw:
        await gw.initialize()
        assert (await gw.request("authenticate", {"methodId": "key"}))["result"] == {}
        first = await gw.new_session()
        await gw.new_session()  # suspends the first
        response = await gw.prompt(first, "auth")
        assert response["result"]["stopReason"] == "end_turn"
        said = gw.updates(first)
        assert json.loads(said[-1]["params"]["update"]["content"]["text"]) == ["key"]
        assert registry(proc_env).get(first).auth_method == "key"  # type: ignore[union-attr]
