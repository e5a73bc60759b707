"""The session registry: rows round-trip, settings merge, orphans become resumable, paging is stable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from acp_proxy.config import Config
from acp_proxy.ownership import instances
from acp_proxy.protocol import jsonrpc
from acp_proxy.sessions.catalog import SessionCatalog
from acp_proxy.sessions.registry import (
    LIST_PAGE_SIZE,
    Ownership,
    SessionRecord,
    SessionRegistry,
    SessionState,
    decode_cursor,
    encode_cursor,
    merge_setting,
)
from acp_proxy.state import StateDB


def record(session_id: str, **fields: object) -> SessionRecord:
    fields.setdefault("cwd", "/w")
    return SessionRecord(session_id=session_id, adapter_session_id=session_id, backend="fake", **fields)  # type: ignore[arg-type]


def test_a_row_keeps_everything_a_resume_needs(tmp_path: Path) -> None:
    registry = SessionRegistry(StateDB(tmp_path), "instance-1")
    registry.create(
        record(
            "s1",
            mcp_servers='[{"name":"fs","command":"mcp-fs","args":[],"env":[]}]',
            additional_directories='["/extra"]',
            auth_method="api-key",
            ownership=Ownership(session_key="k1", owner_session_key="k0", agent_id="main"),
        )
    )
    registry.record_setting("s1", "session/set_mode", {"sessionId": "s1", "modeId": "plan", "_meta": {"x": 1}})
    registry.record_setting("s1", "session/set_config_option", {"sessionId": "s1", "configId": "model", "value": "a"})
    registry.record_setting("s1", "session/set_config_option", {"sessionId": "s1", "configId": "effort", "value": "hi"})
    registry.record_setting("s1", "session/set_config_option", {"sessionId": "s1", "configId": "model", "value": "b"})
    registry.record_setting("s1", "session/set_mode", {"sessionId": "s1", "modeId": "code"})
    registry.db.settle()
    got = registry.get("s1")
    assert got is not None
    assert got.state is SessionState.LIVE
    assert got.instance_id == "instance-1"
    assert got.restore_params() == {
        "cwd": "/w",
        "mcpServers": [{"name": "fs", "command": "mcp-fs", "args": [], "env": []}],
        "additionalDirectories": ["/extra"],
    }
    assert [(m, json.loads(p)) for m, p in got.settings] == [
        ("session/set_config_option", {"configId": "effort", "value": "hi"}),
        ("session/set_config_option", {"configId": "model", "value": "b"}),
        ("session/set_mode", {"modeId": "code"}),
    ], "latest value per setting, in the order last set, without sessionId or _meta"
    assert got.auth_method == "api-key"
    assert got.ownership == Ownership(session_key="k1", owner_session_key="k0", agent_id="main")


def test_merge_setting_replaces_only_the_same_setting() -> None:
    settings = merge_setting((), "session/set_model", {"modelId": "m1"})
    settings = merge_setting(settings, "session/set_mode", {"modeId": "plan"})
    settings = merge_setting(settings, "session/set_model", {"modelId": "m2"})
    assert [(m, json.loads(p)) for m, p in settings] == [
        ("session/set_mode", {"modeId": "plan"}),
        ("session/set_model", {"modelId": "m2"}),
    ]


def test_sessions_of_a_dead_proxy_become_suspended_those_of_a_live_one_stay(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    db = StateDB(tmp_path)
    dead = instances.start_instance(db, "boot")
    SessionRegistry(db, dead.instance_id).create(record("orphan"))
    instances.end_instance(db, dead)
    live_proxy = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from acp_proxy.state import StateDB; "
            "from acp_proxy.ownership import instances; "
            "from acp_proxy.sessions.registry import SessionRecord, SessionRegistry; "
            "db = StateDB(Path(sys.argv[1])); i = instances.start_instance(db, 'boot'); "
            "SessionRegistry(db, i.instance_id).create(SessionRecord('kept', 'kept', 'fake', '/w')); db.settle(); "
            "print('ready', flush=True); time.sleep(60)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        env=proc_env,
    )
    try:
        assert live_proxy.stdout is not None
        assert live_proxy.stdout.readline().strip() == b"ready"
        me = instances.start_instance(db, "boot")
        registry = SessionRegistry(db, me.instance_id)
        assert registry.adopt_orphans() == ["orphan"]
        assert registry.adopt_orphans() == [], "idempotent"
        assert registry.get("orphan").state is SessionState.SUSPENDED  # type: ignore[union-attr]
        assert registry.get("kept").state is SessionState.LIVE  # type: ignore[union-attr]
    finally:
        live_proxy.kill()
        live_proxy.wait()


@pytest.mark.anyio
async def test_shutdown_suspends_only_this_instances_sessions(tmp_path: Path) -> None:
    db = StateDB(tmp_path)
    mine, other = SessionRegistry(db, "me"), SessionRegistry(db, "other")
    mine.create(record("a"))
    mine.create(record("b"))
    other.create(record("c"))
    mine.mark_closed("b")
    assert await mine.suspend_all_of_this_instance() == 1
    assert mine.counts() == {"suspended": 1, "closed": 1, "live": 1}


def test_paging_is_stable_lists_closed_sessions_and_skips_deleted_ones(tmp_path: Path) -> None:
    registry = SessionRegistry(StateDB(tmp_path), "me")
    for n in range(7):
        registry.create(record(f"s{n}", cwd="/a" if n % 2 else "/b"))
    registry.mark_deleted("s3")
    registry.mark_closed("s4")
    registry.db.settle()
    first = registry.page(limit=3)
    assert [r.session_id for r in first] == ["s0", "s1", "s2"]
    rest = registry.page(cursor=decode_cursor(encode_cursor(first[-1])))
    assert [r.session_id for r in rest] == ["s4", "s5", "s6"], "closed is listed (ACP: close is not delete)"
    assert rest[0].state is SessionState.CLOSED
    assert [r.session_id for r in registry.page(cwd="/a")] == ["s1", "s5"]


@pytest.mark.anyio
async def test_a_tombstone_forgets_what_restored_it_and_is_pruned_after_the_retention(tmp_path: Path) -> None:
    registry = SessionRegistry(StateDB(tmp_path), "me")
    registry.create(record("gone"))
    registry.create(record("kept"))
    registry.record_title("gone", {"title": "Secret plans"})
    registry.mark_deleted("gone")
    registry.db.settle()
    tomb = registry.get("gone")
    assert tomb is not None
    assert tomb.state is SessionState.DELETED
    assert (tomb.mcp_servers, tomb.settings, tomb.title) == ("[]", (), None)
    assert not await registry.mark_resuming("gone", reopen=True), "a deleted session is never restored"
    assert registry.prune_deleted(3600) == 0, "younger than the retention: kept, so a load is told it was deleted"
    assert registry.prune_deleted(-1) == 1
    assert registry.get("gone") is None
    assert registry.get("kept") is not None


def test_titles_are_recorded_as_announced_and_null_clears(tmp_path: Path) -> None:
    registry = SessionRegistry(StateDB(tmp_path), "me")
    registry.create(record("s"))
    registry.record_title("s", {"title": "Fix the build", "updatedAt": "2026-11-24T03:00:00Z"})
    registry.db.settle()
    got = registry.get("s")
    assert got is not None
    assert (got.title, got.title_updated_at) == ("Fix the build", "2026-11-24T03:00:00Z")
    registry.record_title("s", {"updatedAt": "2026-11-24T04:00:00Z"})
    registry.db.settle()
    got = registry.get("s")
    assert got is not None
    assert (got.title, got.title_updated_at) == ("Fix the build", "2026-11-24T04:00:00Z")
    registry.record_title("s", {"title": None})
    registry.db.settle()
    got = registry.get("s")
    assert got is not None
    assert got.title is None


@pytest.mark.anyio
async def test_a_closed_session_can_be_claimed_for_the_gateways_own_resume(tmp_path: Path) -> None:
    registry = SessionRegistry(StateDB(tmp_path), "me")
    registry.create(record("s"))
    registry.mark_closed("s")
    assert not await registry.mark_resuming("s", reopen=False), "only the gateway's own load reopens it"
    assert await registry.mark_resuming("s", reopen=True)
    registry.release_claim("s", SessionState.CLOSED)
    registry.db.settle()
    got = registry.get("s")
    assert got is not None
    assert got.state is SessionState.CLOSED, "a resume that did not take leaves it closed"


@pytest.mark.parametrize("bad", ["", "!!!", "bm90IGpzb24", "eyJ4IjoxfQ"])
def test_a_cursor_that_was_not_issued_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid cursor"):
        decode_cursor(bad)


def test_schema_4_keeps_sessions_and_turns_the_old_closed_ones_into_tombstones(tmp_path: Path) -> None:
    """Before schema 4 "closed" meant gone for good (a delete was recorded so too): nothing comes back."""
    import sqlite3

    from acp_proxy.state import DB_NAME
    from acp_proxy.state.migrations import MIGRATIONS

    tmp_path.chmod(0o700)
    conn = sqlite3.connect(tmp_path / DB_NAME)
    for script in MIGRATIONS[:3]:
        for statement in filter(str.strip, script.split(";")):
            conn.execute(statement)
    conn.execute("PRAGMA user_version = 3")
    columns = "session_id, adapter_session_id, backend, state, cwd, mcp_servers, settings, created_at, last_active_at"
    for session_id, state in (("kept", "suspended"), ("gone", "closed")):
        conn.execute(
            f"INSERT INTO sessions ({columns}) VALUES (?, ?, 'fake', ?, '/w', '[{{\"name\": \"m\"}}]', '[]', 1, 2)",
            (session_id, session_id, state),
        )
    conn.commit()
    conn.close()
    (tmp_path / DB_NAME).chmod(0o600)
    registry = SessionRegistry(StateDB(tmp_path), "me")
    kept, gone = registry.get("kept"), registry.get("gone")
    assert kept is not None
    assert gone is not None
    assert (kept.state, kept.mcp_servers, kept.title) == (SessionState.SUSPENDED, '[{"name": "m"}]', None)
    assert (gone.state, gone.mcp_servers) == (SessionState.DELETED, "[]")
    assert [r.session_id for r in registry.page()] == ["kept"]


class _Answers:
    """The gateway side of a ``SessionCatalog``: the answers it was given, by request id."""

    def __init__(self) -> None:
        self.answers: dict[object, object] = {}

    async def send(self, data: bytes) -> None:
        raise AssertionError("session/list answers; it sends nothing else")

    async def answer(self, request_id: object, result: object) -> None:
        self.answers[request_id] = result

    async def fail(self, request_id: object, error: object) -> None:
        self.answers[request_id] = error

    async def reply(self, request_id: object, data: bytes) -> None:
        raise AssertionError("session/list answers with a result")


@pytest.mark.anyio
async def test_session_list_pages_through_every_row_in_order_reading_a_page_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a requester a page is read with its cursor in SQL (the page and one more row), not every row:
    120 sessions come back in three pages, each once, in the order they were made."""
    registry = SessionRegistry(StateDB(tmp_path), "instance-1")
    made = [f"s{i:03d}" for i in range(120)]
    for session_id in made:
        registry.create(record(session_id))
    registry.db.settle()
    limits: list[int | None] = []
    page = registry.page

    def counted_page(**options: Any) -> list[SessionRecord]:
        limits.append(options.get("limit"))
        return page(**options)

    monkeypatch.setattr(registry, "page", counted_page)
    gateway = _Answers()
    catalog = SessionCatalog(Config(backends={}), registry, None, gateway)  # type: ignore[arg-type]  # no process: no pool
    seen: list[str] = []
    cursor: str | None = None
    for request_id in range(1, 10):
        params = {} if cursor is None else {"cursor": cursor}
        decoded = jsonrpc.decode_line(jsonrpc.request(request_id, "session/list", params))
        assert isinstance(decoded, tuple)
        await catalog.list_sessions(decoded[0])
        result = gateway.answers[request_id]
        assert isinstance(result, dict)
        seen += [s["sessionId"] for s in result["sessions"]]
        cursor = result.get("nextCursor")
        if cursor is None:
            break
    assert seen == made
    assert limits == [LIST_PAGE_SIZE + 1] * 3
