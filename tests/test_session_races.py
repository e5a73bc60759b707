"""Sessions under pressure: pipelined requests, closes and cancels racing resumes, shutdown while
requests wait for the pool, the cap while evicted processes are still stopping, several proxies."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_proxy.ownership.owner import WRAPPER_NAME
from acp_proxy.sessions.registry import SessionState
from tests.support import (
    LOAD_ONLY,
    MARKER_VARIABLE,
    RESUME_AND_LOAD,
    TEST_INITIALIZE,
    Gateway,
    adapter_calls,
    cli,
    fake_command,
    marked_processes,
    registry,
    start,
    state_of,
)

pytestmark = pytest.mark.anyio


def prompt_message(request_id: str, session: str, text: str) -> dict[str, Any]:
    params = {"sessionId": session, "prompt": [{"type": "text", "text": text}]}
    return {"jsonrpc": "2.0", "id": request_id, "method": "session/prompt", "params": params}


def live_adapters(env: dict[str, str]) -> int:
    """Fake adapter processes of this test still running (not their wrappers)."""
    return sum(
        1
        for marked in marked_processes(env[MARKER_VARIABLE]).values()
        if any(arg.endswith("fake_adapter.py") for arg in marked.argv)
        and not any(arg.endswith(WRAPPER_NAME) for arg in marked.argv)  # its argv names the adapter too
    )


async def test_requests_queued_for_a_suspended_session_keep_their_order(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """set_mode then prompt, sent together for a suspended session: the prompt sees the new mode."""
    async with start(proc_env, tmp_path, caps=RESUME_AND_LOAD, modes=True) as gw:
        await gw.initialize()
        session = await gw.new_session()
        for n in range(6):
            await gw.new_session()  # suspends the session (max_live = 1)
            mode = "plan" if n % 2 == 0 else "default"
            set_mode = {"sessionId": session, "modeId": mode}
            lines = [
                {"jsonrpc": "2.0", "id": f"m{n}", "method": "session/set_mode", "params": set_mode},
                prompt_message(f"p{n}", session, "state"),
            ]
            await gw.send_raw("".join(json.dumps(line) + "\n" for line in lines).encode())
            assert "result" in await gw.response_to(f"m{n}")
            assert "result" in await gw.response_to(f"p{n}")
            updates = gw.updates(session)
            gw.clear_stash()
            assert json.loads(updates[-1]["params"]["update"]["content"]["text"])["mode"] == mode, n


async def test_a_session_request_sent_with_initialize_restores_the_session(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """initialize and a prompt for a suspended session written together, to a new proxy: the restore
    waits for the agent's initialize answer (what it can resume) and resumes, never starts afresh."""
    options = {"caps": RESUME_AND_LOAD, "init_delay": 0.3}
    async with start(proc_env, tmp_path, **options) as gw:
        await gw.initialize()
        session = await gw.new_session()
        await gw.prompt(session, "stream 2")  # two updates: its history
    async with start(proc_env, tmp_path, **options) as gw:
        initialize = {"jsonrpc": "2.0", "id": "i", "method": "initialize", "params": TEST_INITIALIZE}
        lines = [initialize, prompt_message("p", session, "state")]
        await gw.send_raw("".join(json.dumps(line) + "\n" for line in lines).encode())
        assert "result" in await gw.response_to("i")
        assert (await gw.response_to("p"))["result"]["stopReason"] == "end_turn"
        updates = gw.updates(session)
        assert not any("historyReset" in json.dumps(update) for update in updates)
        assert json.loads(updates[-1]["params"]["update"]["content"]["text"])["history"] == 2
        assert [call["method"] for call in adapter_calls(gw, "session/resume")] == ["session/resume"]


async def test_cap_holds_while_evicted_processes_are_still_stopping(proc_env: dict[str, str], tmp_path: Path) -> None:
    """Adapters that ignore stdin EOF take stdin_grace to stop; the pool counts them until they have exited."""
    config = tmp_path / "slow-stop.toml"
    command = fake_command(ignore_eof=True, store=str(tmp_path / "store"), caps=RESUME_AND_LOAD)
    config.write_text(
        '[shutdown]\nclose_timeout = "100ms"\nstdin_grace = "500ms"\nterm_grace = "1s"\n'
        f'[pool]\nmax_live = 1\nacquire_timeout = "10s"\n[backends.fake]\ncommand = {json.dumps(command)}\n'
    )
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=["--config", str(config)]) as gw:
        await gw.initialize()
        most = 0
        for round_ in range(2):
            ids = [f"new-{round_}-{n}" for n in range(2)]
            for request_id in ids:  # two at once: neither may take the slot of a process still stopping
                params = {"cwd": "/tmp", "mcpServers": []}
                await gw.send({"jsonrpc": "2.0", "id": request_id, "method": "session/new", "params": params})
            answered: list[dict[str, Any]] = []

            async def collect(into: list[dict[str, Any]], ids: list[str]) -> None:
                for request_id in ids:  # one reader of the gateway's inbox at a time
                    into.append(await gw.response_to(request_id, timeout=20))

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(collect, answered, ids)
                while len(answered) < len(ids):
                    most = max(most, live_adapters(proc_env))
                    await anyio.sleep(0.01)
            assert all("result" in answer for answer in answered)
        assert most == 1, "an evicted process's slot is free once it has exited, not before"


async def test_shutdown_answers_requests_waiting_for_the_pool_and_starts_nothing(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with start(proc_env, tmp_path, pool={"acquire_timeout": "20s"}, caps=RESUME_AND_LOAD) as gw:
        await gw.initialize()
        first = await gw.new_session()
        second = await gw.new_session()
        await gw.send(prompt_message("busy", second, "sleep 5"))
        await anyio.sleep(0.3)
        await gw.send(prompt_message("waiting", first, "stream 1"))
        await gw.send(
            {"jsonrpc": "2.0", "id": "new", "method": "session/new", "params": {"cwd": "/", "mcpServers": []}}
        )
        await anyio.sleep(0.3)
        gw.signal(signal.SIGTERM)
        with anyio.fail_after(15):
            assert await gw.process.wait() == 0
        answers = {m["id"]: m for m in gw.received if "method" not in m and "id" in m}
        for request_id in ("busy", "waiting", "new"):
            assert answers[request_id]["error"]["data"]["reason"] == "proxy_shutdown", request_id
        assert len(adapter_calls(gw, "initialize")) == 2, "no process started after the signal"
        states = {r.session_id: r.state for r in registry(proc_env).page()}
        assert states == {first: SessionState.SUSPENDED, second: SessionState.SUSPENDED}


async def test_a_restore_cut_short_by_the_shutdown_is_answered_proxy_shutdown(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """The proxy is told to stop while a restore's new process is still in ``initialize``: the shutdown
    stops that process, and the prompt waiting on the restore ends with the proxy (``proxy_shutdown``),
    not as if the agent had crashed (``adapter_exited``)."""
    async with start(proc_env, tmp_path, caps=RESUME_AND_LOAD, init_delay=1.5) as gw:
        await gw.initialize()
        session = await gw.new_session()
        code, _, err = await cli(proc_env, "sessions", "suspend", session)
        assert code == 0, err
        await gw.send(prompt_message("restoring", session, "stream 1"))
        with anyio.fail_after(10):
            while len(adapter_calls(gw, "initialize")) < 2:  # the restore's process is in initialize
                await anyio.sleep(0.02)
        gw.signal(signal.SIGTERM)
        with anyio.fail_after(15):
            assert await gw.process.wait() == 0
        answer = await gw.response_to("restoring")
        assert answer["error"]["data"]["reason"] == "proxy_shutdown", answer
        assert registry(proc_env).get(session).state is SessionState.SUSPENDED  # type: ignore[union-attr]


async def test_close_cuts_a_resume_short_and_answers_what_was_queued(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with start(proc_env, tmp_path, caps=RESUME_AND_LOAD) as gw:
        await gw.initialize()
        first = await gw.new_session()
        second = await gw.new_session()
        await gw.send(prompt_message("busy", second, "sleep 3"))
        await anyio.sleep(0.2)
        await gw.send(prompt_message("queued", first, "stream 1"))  # waits: the only slot is busy
        await anyio.sleep(0.2)
        with anyio.fail_after(2):
            assert (await gw.request("session/close", {"sessionId": first}))["result"] == {}
        assert (await gw.response_to("queued"))["result"] == {"stopReason": "cancelled"}
        assert (await gw.response_to("busy"))["result"]["stopReason"] == "end_turn"
        assert not adapter_calls(gw, "session/resume"), "the closed session was never brought back"
        assert registry(proc_env).get(first).state is SessionState.CLOSED  # type: ignore[union-attr]


async def test_cancel_request_withdraws_a_queued_request(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with start(proc_env, tmp_path, caps=RESUME_AND_LOAD, init_delay=0.8) as gw:
        await gw.initialize()
        first = await gw.new_session()
        await gw.new_session()
        await gw.send(prompt_message("queued", first, "stream 1"))
        await anyio.sleep(0.2)
        await gw.notify("$/cancel_request", {"requestId": "queued"})
        assert (await gw.response_to("queued"))["error"]["code"] == -32800
        prompts = [m for m in adapter_calls(gw, "session/prompt") if m["params"]["sessionId"] == first]
        assert len(prompts) == 0, "never sent"


async def test_close_then_load_reopens_the_session(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with start(proc_env, tmp_path, pool={"max_live": 2}, caps=RESUME_AND_LOAD) as gw:
        await gw.initialize()
        session = await gw.new_session()
        await gw.prompt(session, "stream 2")
        close = {"jsonrpc": "2.0", "id": "close", "method": "session/close", "params": {"sessionId": session}}
        load_params = {"sessionId": session, "cwd": "/tmp", "mcpServers": []}
        load = {"jsonrpc": "2.0", "id": "load", "method": "session/load", "params": load_params}
        await gw.send_raw((json.dumps(close) + "\n" + json.dumps(load) + "\n").encode())
        assert (await gw.response_to("close"))["result"] == {}
        assert "result" in await gw.response_to("load")
        gw.clear_stash()
        assert (await state_of(gw, session))["turns"] == 1
        assert registry(proc_env).get(session).state is SessionState.LIVE  # type: ignore[union-attr]


async def test_resume_of_a_live_session_is_answered_even_if_the_adapter_only_loads(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """The proxy advertises session/resume on the strength of load; it serves it for live sessions too."""
    async with start(proc_env, tmp_path, caps=LOAD_ONLY, fail={"session/resume": -32601}) as gw:
        init = await gw.initialize()
        assert "resume" in init["result"]["agentCapabilities"]["sessionCapabilities"]
        session = await gw.new_session()
        resumed = await gw.request("session/resume", {"sessionId": session, "cwd": "/tmp"})
        assert resumed["result"] == {}


async def test_adapters_numbering_sessions_per_process_get_distinct_stable_ids(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with start(proc_env, tmp_path, pool={"max_live": 2}, store=None) as gw:
        await gw.initialize()
        first, second = await gw.new_session(), await gw.new_session()
        assert first != second
        listed = [s["sessionId"] for s in (await gw.request("session/list", {}))["result"]["sessions"]]
        assert listed == [first, second]
        assert (await state_of(gw, second))["session"] == "fake-1", "the adapter still knows it as its own id"
        assert (await state_of(gw, first))["session"] == "fake-1"


async def test_a_session_left_by_a_proxy_that_died_later_is_served(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with start(proc_env, tmp_path, caps=RESUME_AND_LOAD) as survivor:
        await survivor.initialize()
        async with start(proc_env, tmp_path, caps=RESUME_AND_LOAD) as doomed:
            await doomed.initialize()
            session = await doomed.new_session()
            await doomed.prompt(session, "stream 1")
            doomed.process.kill()
            await doomed.process.wait()
        assert (await state_of(survivor, session))["turns"] == 1


async def test_after_a_fallback_only_the_stable_id_reaches_the_gateway(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """An adapter that writes right behind its answers (as claude-agent-acp does) and names the session
    in load/resume results: nothing the gateway sees carries the adapter's new id."""
    # Resume alone advertised, so that its failure falls back to session/new (not to load); the gateway's
    # own load of the live session is relayed all the same.
    caps = {"sessionCapabilities": {"resume": {}, "close": {}}}
    async with start(proc_env, tmp_path, caps=caps, chatty=True, modes=True, fail={"session/resume": -32002}) as gw:
        await gw.initialize()
        session = await gw.new_session()
        assert "result" in await gw.request("session/set_mode", {"sessionId": session, "modeId": "plan"})
        await gw.new_session()
        state = await state_of(gw, session)  # falls back to session/new: a new adapter id
        assert state["session"] != session
        loaded = await gw.request("session/load", {"sessionId": session, "cwd": "/tmp", "mcpServers": []})
        assert loaded["result"]["sessionId"] == session, "the adapter's answer, with the stable id"
        assert loaded["result"]["modes"]["currentModeId"] == "plan"
        named = {m["params"]["sessionId"] for m in gw.received if "sessionId" in m.get("params", {})}
        named |= {m["result"]["sessionId"] for m in gw.received if "sessionId" in (m.get("result") or {})}
        assert state["session"] not in named, "the adapter's own id never reaches the gateway"
        assert session in named


async def test_a_gateway_load_is_answered_with_the_settings_as_reapplied(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with start(proc_env, tmp_path, caps=RESUME_AND_LOAD, chatty=True, modes=True) as gw:
        await gw.initialize()
        session = await gw.new_session()
        assert "result" in await gw.request("session/set_mode", {"sessionId": session, "modeId": "plan"})
    async with start(proc_env, tmp_path, caps=RESUME_AND_LOAD, chatty=True, modes=True) as gw:
        await gw.initialize()
        loaded = await gw.request("session/load", {"sessionId": session, "cwd": "/tmp", "mcpServers": []})
        assert loaded["result"]["modes"]["currentModeId"] == "plan", "not the adapter's pre-re-apply answer"
        assert loaded["result"]["sessionId"] == session


@pytest.mark.parametrize("forks", [True, False], ids=["adapter-forks", "adapter-does-not"])
async def test_fork_is_advertised_when_the_adapter_forks(proc_env: dict[str, str], tmp_path: Path, forks: bool) -> None:
    """The proxy serves session/fork (the fork gets its own stable id and row) only on adapters that fork."""
    caps = {"loadSession": True, "sessionCapabilities": {"fork": {}, "close": {}} if forks else {"close": {}}}
    async with start(proc_env, tmp_path, caps=caps) as gw:
        sessions = (await gw.initialize())["result"]["agentCapabilities"]["sessionCapabilities"]
        assert ("fork" in sessions) is forks
        assert {"close", "list", "resume", "delete"} <= set(sessions)


async def test_an_id_issued_again_in_a_later_proxy_replaces_the_stale_session(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """Adapters that number sessions per process: the next proxy's first session keeps the plain id."""
    async with start(proc_env, tmp_path, store=None) as gw:
        await gw.initialize()
        first = await gw.new_session()
    async with start(proc_env, tmp_path, store=None) as gw:
        await gw.initialize()
        assert await gw.new_session() == first, "ids pass through unchanged when nothing live holds them"
