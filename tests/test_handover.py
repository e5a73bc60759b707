"""The install holds a session, not a process: two real proxies of one state dir hand sessions between them.

A proxy asked for a session another proxy of the install holds (a load, a resume, a request that needs a
process) has it handed over: idle at once, busy once the running turn has ended (undisturbed), within
``[sessions] handover_timeout`` or ``session_busy``. The proxy it left answers its gateway ``session_moved``
until that gateway loads it back. Live adapters are counted from ``/proc`` throughout: never two for one
session. The machine's side of it (the phases and events) is tested in-process in test_machine.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_proxy.sessions.registry import SessionState
from tests.support import Gateway, adapter_pid, cli_json, pid_alive, registry, send_prompt, state_db, state_of
from tests.test_install_pool import proxies, reason_of, sampling, turn_ok, write_config

pytestmark = pytest.mark.anyio


def install(tmp_path: Path, **sessions: str) -> list[str]:
    config = write_config(
        tmp_path,
        pool={"max_live": 4, "min_idle": "100ms"},
        backends={"fake": {"store": str(tmp_path / "store")}},
        sessions=sessions or None,
    )
    return ["--config", str(config)]


def holder(env: dict[str, str], session: str) -> tuple[SessionState, str | None]:
    record = registry(env).get(session)
    assert record is not None
    return record.state, record.instance_id


def handovers(env: dict[str, str]) -> dict[str, int]:
    """The journal's handover counts, by outcome."""
    rows = state_db(env).call(
        lambda conn: conn.execute(
            "SELECT label, SUM(count) FROM counters WHERE name = 'handover' GROUP BY label"
        ).fetchall()
    )
    return {label: int(count) for label, count in rows}


async def until_handovers(env: dict[str, str], expected: dict[str, int]) -> None:
    """Until the journal counts ``expected`` handovers (each proxy writes its side in the background)."""
    with anyio.move_on_after(5):
        while handovers(env) != expected:
            await anyio.sleep(0.05)
    assert handovers(env) == expected


async def load(gw: Gateway, session: str, tmp_path: Path) -> dict[str, Any]:
    return await gw.request("session/load", {"sessionId": session, "cwd": str(tmp_path), "mcpServers": []})


async def test_an_idle_session_moves_to_the_proxy_that_loads_it_with_its_history(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    with sampling(proc_env) as live:
        async with proxies(proc_env, tmp_path, 2, install(tmp_path)) as (a, b):
            session = await a.new_session()
            assert turn_ok(await a.prompt(session, "stream 2"))
            _, instance_a = holder(proc_env, session)
            pid_at_a = await adapter_pid(a, session)
            answer = await load(b, session, tmp_path)
            assert "result" in answer, answer
            assert not pid_alive(pid_at_a), "a's process was gone before b was answered"
            state, instance_b = holder(proc_env, session)
            assert state is SessionState.LIVE
            assert instance_b != instance_a
            assert (await state_of(b, session))["turns"] == 2  # the turns at a (a prompt, and asking its state)
            await until_handovers(proc_env, {"released": 1, "taken": 1})
            shown = await cli_json(proc_env, "sessions", "show", session)
            seen = [(event["kind"], event["label"]) for event in shown["recentEvents"]]
            assert ("handover", "taken") in seen, seen
            assert ("handover", "released") in seen, seen
            # a's gateway is told where the session went, and how to bring it back
            moved = await a.prompt(session, "stream 1")
            assert reason_of(moved) == "session_moved", moved
            assert moved["error"]["code"] == -32010
            assert moved["error"]["data"]["holder"] == instance_b
            assert "session/load brings it back" in moved["error"]["message"]
            # ... and loading it there does
            assert "result" in await load(a, session, tmp_path)
            assert turn_ok(await a.prompt(session, "stream 1"))
            assert holder(proc_env, session) == (SessionState.LIVE, instance_a)
            assert reason_of(await b.prompt(session, "stream 1")) == "session_moved"
    assert live.peak <= 2, f"{live.peak} adapters for two proxies"  # each proxy's first process answered initialize


async def test_a_busy_session_moves_once_its_turn_has_ended_undisturbed(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with proxies(proc_env, tmp_path, 2, install(tmp_path, handover_timeout="20s")) as (a, b):
        session = await a.new_session()
        turn = await send_prompt(a, session, "sleep 1.5")
        await anyio.sleep(0.3)
        with anyio.fail_after(15):
            loaded = await load(b, session, tmp_path)
        ended = await a.response_to(turn)
        assert turn_ok(ended), ended  # the running turn was not cut short
        assert "result" in loaded, loaded
        assert holder(proc_env, session)[0] is SessionState.LIVE
        assert (await state_of(b, session))["turns"] == 1  # a's turn, on b's process


async def test_past_handover_timeout_the_asker_gets_session_busy_and_the_turn_goes_on(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with proxies(proc_env, tmp_path, 2, install(tmp_path, handover_timeout="400ms")) as (a, b):
        session = await a.new_session()
        _, instance_a = holder(proc_env, session)
        turn = await send_prompt(a, session, "sleep 2")
        await anyio.sleep(0.2)
        refused = await load(b, session, tmp_path)
        assert reason_of(refused) == "session_busy", refused
        assert refused["error"]["code"] == -32010
        assert refused["error"]["data"]["holder"] == instance_a
        assert turn_ok(await a.response_to(turn))
        assert turn_ok(await a.prompt(session, "stream 1")), "the session stayed where it was, and serves"
        await until_handovers(proc_env, {"kept": 2})  # recorded by both sides


async def test_a_request_at_a_proxy_that_never_served_the_session_takes_it_over(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """A gateway that prompts a session by its id (after its own restart, say) gets it, wherever it was held."""
    async with proxies(proc_env, tmp_path, 2, install(tmp_path)) as (a, b):
        session = await a.new_session()
        assert turn_ok(await a.prompt(session, "stream 1"))
        assert turn_ok(await b.prompt(session, "stream 1"))
        assert (await state_of(b, session))["turns"] == 2
        assert reason_of(await a.prompt(session, "stream 1")) == "session_moved"


async def test_two_gateways_alternating_on_one_session_hand_it_over_once_per_load(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    rounds = 4
    with sampling(proc_env) as live:
        async with proxies(proc_env, tmp_path, 2, install(tmp_path)) as (a, b):
            session = await a.new_session()
            serving = await adapter_pid(a, session)
            for _ in range(rounds):
                for gw in (b, a):
                    assert "result" in await load(gw, session, tmp_path)
                    assert not pid_alive(serving), "the process it left was gone before the load was answered"
                    assert turn_ok(await gw.prompt(session, "stream 1"))
                    serving = await adapter_pid(gw, session)
            # every prompt on either side, and each asking of its state (this one is counted after)
            assert (await state_of(a, session))["turns"] == 2 * rounds + 2 * rounds + 1
            await until_handovers(proc_env, {"released": 2 * rounds, "taken": 2 * rounds})
    assert live.peak <= 2


async def test_closing_a_session_another_proxy_holds_takes_it_over_first(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with proxies(proc_env, tmp_path, 2, install(tmp_path)) as (a, b):
        session = await a.new_session()
        assert turn_ok(await a.prompt(session, "stream 1"))
        assert (await b.request("session/close", {"sessionId": session})).get("result") == {}
        assert holder(proc_env, session)[0] is SessionState.CLOSED
        assert reason_of(await a.prompt(session, "stream 1")) == "session_moved"
        status = await cli_json(proc_env, "sessions", "show", session)
        assert status["state"] == "closed"


async def test_a_session_of_a_proxy_shutting_down_is_taken_once_it_has_let_go(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """The holder's gateway has left and its shutdown is slow (an adapter that ignores EOF and SIGTERM): another
    proxy's load waits for the shutdown to suspend the session, instead of answering ``session_in_use``."""
    config = write_config(
        tmp_path,
        pool={"max_live": 4},
        backends={"fake": {"store": str(tmp_path / "store"), "ignore_eof": True, "ignore_sigterm": True}},
        sessions={"handover_timeout": "20s"},
    )
    args = ["--config", str(config)]
    async with proxies(proc_env, tmp_path, 2, args) as (a, b):
        session = await a.new_session()
        assert turn_ok(await a.prompt(session, "stream 2"))
        await a.close_input()  # a's shutdown: its stdin grace, then SIGTERM ignored, then SIGKILL
        await anyio.sleep(0.2)
        loaded = await load(b, session, tmp_path)
        assert "result" in loaded, loaded
        assert (await state_of(b, session))["turns"] == 1
