"""Retiring the sessions nobody closes: ``[sessions] keep_suspended``, ``on_eof = "close"``, ``sessions prune``.

The rule is one statement of the registry's, tested on a database alone; the rest with real proxies
(each start applies the retention; a gateway's EOF closes its sessions where the backend says so) and the
operator's command. A closed session stays listed and is brought back by the gateway's own load.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import anyio
import pytest

from acp_proxy.journal import Journal
from acp_proxy.sessions.registry import SessionRecord, SessionRegistry, SessionState
from acp_proxy.sessions.retention import retire_suspended
from acp_proxy.state import StateDB
from tests.support import Gateway, adapter_pid, cli, cli_json, pid_alive, registry, write_config
from tests.test_install_pool import reason_of, turn_ok

DAY = 86400.0


def _rows(tmp_path: Path) -> tuple[SessionRegistry, StateDB]:
    """Sessions in every state, some last active 10 days ago, some now."""
    db = StateDB(tmp_path)
    reg = SessionRegistry(db, "instance-1")
    for name, state, age in [
        ("old-suspended", SessionState.SUSPENDED, 10 * DAY),
        ("new-suspended", SessionState.SUSPENDED, 0.0),
        ("old-live", SessionState.LIVE, 10 * DAY),
        ("old-closed", SessionState.CLOSED, 10 * DAY),
        ("old-deleted", SessionState.DELETED, 10 * DAY),
    ]:
        reg.create(SessionRecord(session_id=name, adapter_session_id=name, backend="fake", cwd="/w"))
        db.call(
            lambda conn, name=name, state=state, age=age: conn.execute(
                "UPDATE sessions SET state = ?, last_active_at = ? WHERE session_id = ?",
                (state.value, time.time() - age, name),
            )
        )
    return reg, db


def _states(reg: SessionRegistry) -> dict[str, SessionState]:
    names = ("old-suspended", "new-suspended", "old-live", "old-closed", "old-deleted")
    return {name: reg.get(name).state for name in names}  # type: ignore[union-attr]


def test_only_sessions_suspended_longer_than_the_limit_are_closed(tmp_path: Path) -> None:
    reg, db = _rows(tmp_path)
    before = _states(reg)
    assert [r.session_id for r in retire_suspended(reg, None, 7 * DAY, dry_run=True)] == ["old-suspended"]
    assert _states(reg) == before, "a dry run changes nothing"
    retired = retire_suspended(reg, Journal(db, "instance-1"), 7 * DAY)
    assert [r.session_id for r in retired] == ["old-suspended"]
    assert _states(reg) == {**before, "old-suspended": SessionState.CLOSED}
    closed_at = db.call(
        lambda conn: conn.execute("SELECT closed_at FROM sessions WHERE session_id = 'old-suspended'").fetchone()[0]
    )
    assert closed_at is not None
    assert retire_suspended(reg, None, 7 * DAY) == [], "nothing is closed twice"
    closes = db.call(lambda conn: conn.execute("SELECT label, count FROM counters WHERE name = 'closed'").fetchall())
    assert [tuple(row) for row in closes] == [("retention", 1)]


pytestmark = pytest.mark.anyio


def config(tmp_path: Path, **backend: object) -> list[str]:
    path = write_config(
        tmp_path,
        pool={"max_live": 2},
        backends={"fake": {"store": str(tmp_path / "store"), **backend}},
        sessions={"keep_suspended": "1s"},
    )
    return ["--config", str(path)]


async def test_a_start_closes_sessions_suspended_past_keep_suspended_and_a_load_brings_one_back(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    args = config(tmp_path)
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=args) as gw:
        await gw.initialize()
        session = await gw.new_session()
        assert turn_ok(await gw.prompt(session, "stream 2"))
    assert registry(proc_env).get(session).state is SessionState.SUSPENDED  # type: ignore[union-attr]
    await anyio.sleep(1.2)  # past keep_suspended
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=args) as gw:
        await gw.initialize()
        assert registry(proc_env).get(session).state is SessionState.CLOSED  # type: ignore[union-attr]
        refused = await gw.prompt(session, "stream 1")
        assert reason_of(refused) == "session_closed", refused  # closed as by session/close
        listed = await gw.call("session/list", {})
        assert session in [s["sessionId"] for s in listed["sessions"]]
        load = await gw.request("session/load", {"sessionId": session, "cwd": str(tmp_path), "mcpServers": []})
        assert "result" in load, load
        assert turn_ok(await gw.prompt(session, "stream 1")), "the adapter's history was untouched"


async def test_on_eof_close_closes_the_gateways_sessions_instead_of_suspending_them(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    args = config(tmp_path, on_eof="close")
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=args) as gw:
        await gw.initialize()
        session = await gw.new_session()
        assert turn_ok(await gw.prompt(session, "stream 1"))
        pid = await adapter_pid(gw, session)
    assert not pid_alive(pid)
    record = registry(proc_env).get(session)
    assert record is not None
    assert record.state is SessionState.CLOSED
    code, out, _ = await cli(proc_env, "sessions", "list", "--all", "--json")
    assert code == 0
    assert [s["state"] for s in json.loads(out)["sessions"] if s["sessionId"] == session] == ["closed"]


async def test_sessions_prune_closes_what_the_operator_says_and_a_dry_run_nothing(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    args = config(tmp_path)
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=args) as gw:
        await gw.initialize()
        first, second = await gw.new_session(), await gw.new_session()
    dry = await cli_json(proc_env, "sessions", "prune", "--older-than", "0", "--dry-run")
    assert dry["dryRun"] is True
    assert sorted(s["sessionId"] for s in dry["closed"]) == sorted([first, second])
    assert registry(proc_env).get(first).state is SessionState.SUSPENDED  # type: ignore[union-attr]
    code, out, _ = await cli(proc_env, "sessions", "prune", "--older-than", "1h")
    assert (code, out.strip()) == (0, "nothing to prune: no session suspended for more than 1h")
    pruned = await cli_json(proc_env, "sessions", "prune", "--older-than", "0")
    assert len(pruned["closed"]) == 2
    assert {registry(proc_env).get(s).state for s in (first, second)} == {SessionState.CLOSED}  # type: ignore[union-attr]
    code, _, err = await cli(proc_env, "sessions", "prune", "--older-than", "soon")
    assert code == 2
    assert "--older-than: expected a duration" in err
