"""The install's journal: counters that add up across proxies and restarts, events kept bounded."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from acp_proxy import journal
from acp_proxy.journal import Journal, Kind, SuspendReason, count_in, counters, recent_events
from acp_proxy.state import StateDB


@pytest.fixture
def db(tmp_path: Path) -> StateDB:
    return StateDB(tmp_path / "state")


def test_a_record_counts_and_a_shown_kind_is_an_event_too(db: StateDB) -> None:
    Journal(db, "p1").record(Kind.SUSPENDED, backend="codex", label=SuspendReason.IDLE_TTL, session_id="s1", detail="x")
    Journal(db, "p1").record(Kind.TURN_ENDED, backend="codex", label="done")
    db.settle()
    assert [(c.name, c.backend, c.label, c.count) for c in counters(db.conn)] == [
        ("suspended", "codex", "idle_ttl", 1),
        ("turn_ended", "codex", "done", 1),
    ]
    (event,) = recent_events(db.conn)
    assert (event.kind, event.backend, event.label, event.session_id, event.detail, event.instance_id) == (
        "suspended",
        "codex",
        "idle_ttl",
        "s1",
        "x",
        "p1",
    )


def test_counters_add_up_across_proxies_and_keep_their_seconds(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first, second = StateDB(state), StateDB(state)
    Journal(first, "p1").record(Kind.POOL_WAIT, backend="b", label="admitted", seconds=1.5)
    Journal(second, "p2").record(Kind.POOL_WAIT, backend="b", label="admitted", seconds=0.25)
    Journal(second, "p2").record(Kind.POOL_WAIT, backend="b", label="exhausted", seconds=30.0)
    first.close()
    second.close()
    reopened = StateDB(state)
    found = {(c.label): (c.count, c.seconds) for c in counters(reopened.conn, ["pool_wait"])}
    assert found == {"admitted": (2, 1.75), "exhausted": (1, 30.0)}


def test_a_kind_not_shown_by_default_can_be_shown(db: StateDB) -> None:
    Journal(db, None).record(Kind.TREE_REAPED, label="stop")
    Journal(db, None).record(Kind.TREE_REAPED, label="startup", shown=True)
    db.settle()
    assert [e.label for e in recent_events(db.conn)] == ["startup"]
    assert {c.label: c.count for c in counters(db.conn)} == {"stop": 1, "startup": 1}


def test_events_are_kept_bounded_newest_first(db: StateDB, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal, "EVENTS_KEPT", 10)
    monkeypatch.setattr(journal, "PRUNE_EVERY", 5)
    for number in range(40):  # one proxy per event, as an install of one proxy per session has them
        Journal(db, f"p{number}").record(Kind.CRASHED, detail=str(number))
    db.settle()
    kept = recent_events(db.conn, limit=100)
    assert [e.detail for e in kept[:3]] == ["39", "38", "37"]
    assert len(kept) <= 10 + 5
    assert counters(db.conn)[0].count == 40  # counting is never pruned
    newest = kept[0].event_id
    assert recent_events(db.conn, after=newest) == []
    assert [e.detail for e in recent_events(db.conn, after=newest - 2)] == ["39", "38"]


def test_a_count_made_in_a_callers_transaction_rolls_back_with_it(db: StateDB) -> None:
    def failing_write() -> None:
        with db.transaction() as conn:
            count_in(conn, Kind.TURN_ENDED, backend="b", label="done")
            raise RuntimeError("the write beside it failed")

    with pytest.raises(RuntimeError):
        failing_write()
    assert counters(db.conn) == []


def test_a_failing_record_is_logged_and_swallowed(db: StateDB, caplog: pytest.LogCaptureFixture) -> None:
    db.conn.execute("DROP TABLE counters")
    Journal(db, "p").record(Kind.SPAWN_FAILED, backend="b")
    db.settle()
    assert "could not record spawn_failed" in caplog.text
    with pytest.raises(sqlite3.OperationalError):
        counters(db.conn)
