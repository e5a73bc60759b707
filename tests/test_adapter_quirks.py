"""Real adapters' ways, taught to the fake adapter: through the proxy each behaves as it does alone.

Each test names the adapter whose way it copies: gemini-cli's failed load with its reason in
``data``, qwen-code's mode stated twice in one answer, its resume advertised but unserved, its
titles kept to its own ``session/list``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from acp_proxy.ownership.leases import command_hash
from acp_proxy.pool.learned import Learned
from acp_proxy.protocol import jsonrpc
from acp_proxy.protocol.errors import ProxyError
from acp_proxy.sessions.registry import SessionState
from acp_proxy.state import StateDB
from tests.support import Gateway, adapter_calls, fake_command, registry, start, state_of, write_config

pytestmark = pytest.mark.anyio

LOAD_AND_CLOSE = {"loadSession": True, "sessionCapabilities": {"close": {}}}
RESUME_ADVERTISED = {"loadSession": True, "sessionCapabilities": {"resume": {}, "close": {}}}
LISTS = {"loadSession": True, "sessionCapabilities": {"list": {}}}
LOAD = {"cwd": "/tmp", "mcpServers": []}

# --- a failed restore: the adapter's own error reaches the gateway ------------------------------

GEMINI_DETAILS = {"details": "No previous sessions found for this project."}

# (sentence, the error the adapter answers session/load with, the error.data the gateway must get, but
# ``backend``)
FAILED_LOADS = [
    (
        "the adapter's data keys stay, the proxy's join them",
        {"code": -32603, "message": "Internal error", "data": GEMINI_DETAILS},
        {**GEMINI_DETAILS, "reason": "restore_failed", "method": "session/load"},
    ),
    (
        "data that is not an object is kept whole",
        {"code": -32603, "message": "Internal error", "data": "disk full"},
        {"reason": "restore_failed", "method": "session/load", "adapterData": "disk full"},
    ),
    (
        "data whose keys the proxy's would replace is kept whole",
        {"code": -32000, "message": "Authentication required", "data": {"reason": "expired"}},
        {
            "reason": "restore_failed",
            "method": "session/load",
            "backend": "default",
            "adapterData": {"reason": "expired"},
        },
    ),
    (
        "no data: the proxy's alone",
        {"code": -32603, "message": "Internal error"},
        {"reason": "restore_failed", "method": "session/load"},
    ),
]


@pytest.mark.parametrize(("error", "data"), [row[1:] for row in FAILED_LOADS], ids=[row[0] for row in FAILED_LOADS])
def test_a_failed_restore_answers_with_the_adapters_code_message_and_data(
    error: dict[str, Any], data: dict[str, Any]
) -> None:
    """How the adapter's error and the proxy's reason are put together, row by row, in memory; the answer
    a gateway gets, through a proxy and a real adapter, is the next test's."""
    failure = jsonrpc.ErrorObject(
        error["code"], error["message"], jsonrpc.Raw(json.dumps(error["data"])) if "data" in error else jsonrpc.UNSET
    )
    answer = json.loads(ProxyError.restore_failed("session/load", "fake_adapter", failure).response(7))
    assert answer["error"].pop("data") == {**data, "backend": "fake_adapter"}
    assert answer == {"jsonrpc": "2.0", "id": 7, "error": {"code": error["code"], "message": error["message"]}}


async def test_a_failed_restore_is_answered_with_the_adapters_error_and_the_session_stays_closed(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    _, error, data = FAILED_LOADS[0]
    async with start(proc_env, tmp_path, caps=LOAD_AND_CLOSE, fail={"session/load": error}) as gw:
        await gw.initialize()
        session = await gw.new_session()
        assert (await gw.request("session/close", {"sessionId": session}))["result"] == {}
        failed = (await gw.request("session/load", {"sessionId": session, **LOAD}))["error"]
        assert failed.pop("data") == {**data, "backend": "fake_adapter"}, (
            "the backend named after the agent, not python"
        )
        assert failed == {"code": error["code"], "message": error["message"]}
        assert registry(proc_env).get(session).state is SessionState.CLOSED  # type: ignore[union-attr]


# --- a restored session's answer states its settings once ----------------------------------------

# (sentence, the setting the gateway made, the mode the answer must state everywhere)
SETTINGS = [
    ("set_mode", "session/set_mode", {"modeId": "plan"}),
    ("set_config_option of the mode", "session/set_config_option", {"configId": "mode", "value": "plan"}),
]


@pytest.mark.parametrize(("method", "params"), [row[1:] for row in SETTINGS], ids=[row[0] for row in SETTINGS])
async def test_a_restored_answer_states_the_reapplied_mode_everywhere(
    proc_env: dict[str, str], tmp_path: Path, method: str, params: dict[str, Any]
) -> None:
    async with start(proc_env, tmp_path, caps=LOAD_AND_CLOSE, mode_option=True) as gw:
        await gw.initialize()
        session = await gw.new_session()
        assert "result" in await gw.request(method, {"sessionId": session, **params})
        assert (await gw.request("session/close", {"sessionId": session}))["result"] == {}
        loaded = (await gw.request("session/load", {"sessionId": session, **LOAD}))["result"]
        assert loaded["modes"]["currentModeId"] == "plan"
        assert [option["currentValue"] for option in loaded["configOptions"]] == ["plan"]
        assert (await state_of(gw, session))["mode"] == "plan", "and the adapter has it so"


# --- resume advertised but unserved: load, not a history reset; the install remembers ------------


async def test_a_resume_refused_as_unsupported_falls_back_to_load_and_the_install_remembers(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    record = tmp_path / "adapter.jsonl"
    options = {
        "caps": RESUME_ADVERTISED,
        "fail": {"session/resume": -32601},
        "store": str(tmp_path / "store"),
        "record": str(record),
    }
    config = write_config(tmp_path, pool={"max_live": 1}, backends={"fake": options})
    proxy_args = ["--config", str(config)]
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=proxy_args) as gw:
        gw.record = record
        await gw.initialize()
        first = await gw.new_session()
        assert (await gw.prompt(first, "stream 2"))["result"]["stopReason"] == "end_turn"
        second = await gw.new_session()  # max_live = 1: the first is suspended
        state = await state_of(gw, first)  # restored: resume refused, then load
        assert (state["turns"], state["history"]) == (1, 2), "the conversation is kept"
        assert not [m for m in gw.received if "historyReset" in str(m)], "no history reset"
        assert (len(adapter_calls(gw, "session/resume")), len(adapter_calls(gw, "session/load"))) == (1, 1)
        await state_of(gw, second)  # restored: straight to load, as the first again is below
        await state_of(gw, first)
        assert (len(adapter_calls(gw, "session/resume")), len(adapter_calls(gw, "session/load"))) == (1, 3)
    known = Learned(StateDB(Path(proc_env["ACP_PROXY_STATE_DIR"]))).facts(
        "fake", command_hash(tuple(fake_command(**options)))
    )
    assert (known.restore_method, known.unsupported) == ("session/load", frozenset({"session/resume"}))
    # A fresh proxy of the install, the same backend: it knows, and goes straight to load.
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=proxy_args) as gw:
        gw.record = record
        await gw.initialize()
        assert "result" in await gw.request("session/resume", {"sessionId": first, **LOAD})
        assert (await state_of(gw, first))["turns"] == 3
        assert (len(adapter_calls(gw, "session/resume")), len(adapter_calls(gw, "session/load"))) == (1, 4)


# --- titles an adapter keeps to its own list ------------------------------------------------------


async def test_titles_only_the_adapters_own_list_shows_are_merged_and_kept(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with start(proc_env, tmp_path, caps=LISTS, list_page=1) as gw:
        await gw.initialize()
        first = await gw.new_session()
        assert (await gw.prompt(first, "stream 1; sleep 0"))["result"]["stopReason"] == "end_turn"
        second = await gw.new_session()  # max_live = 1: the first is suspended; the second's process lists both
        assert (await gw.prompt(second, "sleep 0"))["result"]["stopReason"] == "end_turn"
        listed = (await gw.request("session/list", {}))["result"]
        titles = {info["sessionId"]: info.get("title") for info in listed["sessions"]}
        assert titles == {first: "stream 1; sleep 0", second: "sleep 0"}
        assert "nextCursor" not in listed, "the adapter's own pages are read, the proxy's page is one"
        assert adapter_calls(gw, "session/list"), "asked of the live process"
    # Kept in the registry: listed by a proxy with no live process of the backend.
    assert registry(proc_env).get(first).title == "stream 1; sleep 0"  # type: ignore[union-attr]
