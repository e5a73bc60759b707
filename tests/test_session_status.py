"""``session/status`` (unstable ACP, the schema the TypeScript SDK 2.4 ships): ``open`` while a process of
the install has the session, ``saved`` while it can be restored, ``-32002`` with the id for one the install
does not know. No side effects: no process started, nothing restored, taken over or touched.

The rule is a pure function (``decisions.session_status``), tabled here; the rest with real proxies of one
install, where a routing layer would ask.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_proxy.ownership.leases import all_leases
from acp_proxy.sessions.decisions import session_status
from acp_proxy.sessions.lifecycle import Phase
from acp_proxy.sessions.machine import Standing
from acp_proxy.sessions.registry import SessionState
from tests.support import Gateway, registry, state_db, write_config
from tests.test_install_pool import turn_ok

LIVE, SUSPENDED, CLOSED, DELETED = SessionState.LIVE, SessionState.SUSPENDED, SessionState.CLOSED, SessionState.DELETED


@pytest.mark.parametrize(
    ("standing", "row", "status"),
    [
        # this proxy's own view comes first: its row may lag its queued writes
        (Standing(Phase.LIVE, process=True), (SUSPENDED, True), "open"),
        (Standing(Phase.RELEASING, process=True, holder="other"), (LIVE, True), "open"),
        (Standing(Phase.SUSPENDED), (LIVE, True), "saved"),
        (Standing(Phase.RESUMING), None, "saved"),
        (Standing(Phase.REOPENING), (CLOSED, True), "saved"),
        (Standing(Phase.CLOSING, process=True), (LIVE, True), "saved"),
        (Standing(Phase.CLOSED), (CLOSED, True), "saved"),
        (Standing(Phase.DELETING, process=True), (LIVE, True), None),
        (Standing(Phase.DELETED), (DELETED, False), None),
        # held by another proxy of the install: its row says
        (Standing(Phase.ELSEWHERE, holder="other"), (LIVE, True), "open"),
        (Standing(Phase.ELSEWHERE, holder="other"), (SUSPENDED, True), "saved"),
        (Standing(Phase.TAKING_OVER, holder="other"), (LIVE, True), "open"),
        # not in this proxy's memory: the install's row
        (None, (LIVE, True), "open"),
        (None, (LIVE, False), "saved"),  # its proxy is gone: restorable
        (None, (SUSPENDED, True), "saved"),
        (None, (CLOSED, False), "saved"),
        (None, (DELETED, False), None),
        (None, None, None),
    ],
)
def test_what_session_status_answers(
    standing: Standing | None, row: tuple[SessionState, bool] | None, status: str | None
) -> None:
    assert session_status(standing, row) == status


def _args(tmp_path: Path, max_live: int = 1) -> list[str]:
    path = write_config(tmp_path, pool={"max_live": max_live}, backends={"fake": {"store": str(tmp_path / "store")}})
    return ["--config", str(path)]


async def _status(gw: Gateway, session_id: Any) -> dict[str, Any]:
    answer = await gw.request("session/status", {"sessionId": session_id})
    return dict(answer)


def _leases(env: dict[str, str]) -> int:
    db = state_db(env)
    try:
        return len(all_leases(db))
    finally:
        db.close()


@pytest.mark.anyio
async def test_session_status_in_every_state_starts_no_process(proc_env: dict[str, str], tmp_path: Path) -> None:
    args = _args(tmp_path)
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=args) as a:
        init = await a.initialize()
        assert init["result"]["agentCapabilities"]["sessionCapabilities"]["status"] == {}
        first = await a.new_session()
        assert (await _status(a, first))["result"] == {"status": "open"}
        second = await a.new_session()  # max_live = 1: the first is suspended
        assert turn_ok(await a.prompt(second, "stream 1"))
        spawned = _leases(proc_env)
        before = registry(proc_env).get(first)
        assert before is not None
        assert before.state is SessionState.SUSPENDED
        for _ in range(3):
            assert (await _status(a, first))["result"] == {"status": "saved"}
        assert (await _status(a, second))["result"] == {"status": "open"}
        after = registry(proc_env).get(first)
        assert after == before, "asking restores nothing and touches nothing"
        assert _leases(proc_env) == spawned, "asking starts no process"

        answers: list[Any] = []

        async def silent_turn() -> None:
            answers.append(await a.prompt(second, "silent"))  # runs until cancelled

        async with anyio.create_task_group() as turns:
            turns.start_soon(silent_turn)
            assert (await _status(a, second))["result"] == {"status": "open"}, "answered beside the turn"
            assert not answers
            await a.notify("session/cancel", {"sessionId": second})
        assert answers[0]["result"]["stopReason"] == "cancelled"

        await a.call("session/close", {"sessionId": second})
        assert (await _status(a, second))["result"] == {"status": "saved"}, "a closed session can be loaded"
        await a.call("session/delete", {"sessionId": first})
        for unknown in (first, "no-such-session"):
            error = (await _status(a, unknown))["error"]
            assert error["code"] == -32002
            assert error["data"]["sessionId"] == unknown
        error = (await a.request("session/status", {}))["error"]
        assert error["code"] == -32602


@pytest.mark.anyio
async def test_session_status_of_a_session_another_proxy_holds(proc_env: dict[str, str], tmp_path: Path) -> None:
    args = _args(tmp_path, max_live=3)
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=args) as a:
        await a.initialize()
        held = await a.new_session()
        async with Gateway.start(proc_env, tmp_path, [], proxy_args=args) as b:
            await b.initialize()
            spawned = _leases(proc_env)
            assert (await _status(b, held))["result"] == {"status": "open"}, "live in another proxy of the install"
            assert _leases(proc_env) == spawned
            record = registry(proc_env).get(held)
            assert record is not None
            assert record.state is SessionState.LIVE
            assert turn_ok(await a.prompt(held, "stream 1")), "asking from another proxy takes nothing away"
            assert await a.close() == 0
            assert (await _status(b, held))["result"] == {"status": "saved"}, "suspended at its proxy's EOF"
            assert _leases(proc_env) == spawned
