"""The pool's decisions and the restore strategy, as tables: pure functions, no processes."""

from __future__ import annotations

import pytest

from acp_proxy.pool.plan import (
    Admit,
    Slot,
    Wait,
    expired,
    falls_back,
    plan_acquire,
    protection,
    restore_order,
)


def slot(key: str, backend: str = "a", last_active: float = 0.0, **flags: bool) -> Slot:
    return Slot(key=key, backend=backend, last_active=last_active, **flags)


# (sentence, live slots, backend asked for, backend cap, global cap, reserved, expected eviction key | "admit" | "wait")
ACQUIRE = [
    ("room in the backend and overall: start it, suspend nothing", [slot("s1")], "a", 2, 4, {}, "admit"),
    (
        "backend full: the least recently used idle session of that backend is suspended",
        [slot("old", last_active=1), slot("new", last_active=5)],
        "a",
        2,
        4,
        {},
        "old",
    ),
    (
        "a busy session is never suspended, even when it is the oldest",
        [slot("old", last_active=1, busy=True), slot("new", last_active=5)],
        "a",
        2,
        4,
        {},
        "new",
    ),
    (
        "every session busy: wait",
        [slot("s1", busy=True), slot("s2", busy=True)],
        "a",
        2,
        4,
        {},
        "wait",
    ),
    (
        "a spare goes before any session, however recent",
        [slot("s1", last_active=1), slot("spare:a", last_active=9, spare=True)],
        "a",
        2,
        4,
        {},
        "spare:a",
    ),
    (
        "backend full: another backend's idle session does not help",
        [slot("a1", busy=True), slot("b1", backend="b", last_active=0)],
        "a",
        1,
        4,
        {},
        "wait",
    ),
    (
        "global cap reached with room in the backend: any backend's idle session may go",
        [slot("a1", busy=True), slot("b1", backend="b", last_active=3)],
        "a",
        4,
        2,
        {},
        "b1",
    ),
    (
        "starts in progress count: a reserved slot is not promised twice",
        [slot("s1", last_active=1)],
        "a",
        2,
        4,
        {"a": 1},
        "s1",
    ),
    (
        "a pinned session (resume = never) is never suspended",
        [slot("s1", pinned=True)],
        "a",
        1,
        4,
        {},
        "wait",
    ),
    (
        "a session active moments ago is passed over for one idle longer, even a more recently used one",
        [Slot("just-ended", "a", last_active=1, recent_until=5), slot("idle", last_active=3)],
        "a",
        2,
        4,
        {},
        "idle",
    ),
    (
        "only sessions active moments ago are idle: wait for them",
        [Slot("just-ended", "a", last_active=1, recent_until=5), slot("busy", busy=True)],
        "a",
        2,
        4,
        {},
        "wait",
    ),
    (
        "a spare goes even if it was started moments ago",
        [Slot("spare:a", "a", last_active=1, spare=True, recent_until=5), slot("busy", busy=True)],
        "a",
        2,
        4,
        {},
        "spare:a",
    ),
    (
        "a slot being stopped is coming free: wait for it rather than suspend another",
        [Slot("going", "a", last_active=1, stopping=True), slot("idle", last_active=0)],
        "a",
        2,
        4,
        {},
        "wait",
    ),
    (
        "another backend's slot being stopped does not free the full backend: suspend its own",
        [Slot("going", "b", last_active=1, stopping=True), slot("idle", last_active=0)],
        "a",
        1,
        4,
        {},
        "idle",
    ),
    (
        "a session of another proxy is a candidate like any other",
        [Slot("theirs", "a", last_active=1, instance="other"), slot("ours", last_active=3)],
        "a",
        2,
        4,
        {},
        "theirs",
    ),
]


@pytest.mark.parametrize(
    ("live", "backend", "backend_cap", "global_cap", "reserved", "expected"),
    [row[1:] for row in ACQUIRE],
    ids=[row[0] for row in ACQUIRE],
)
def test_plan_acquire(
    live: list[Slot], backend: str, backend_cap: int, global_cap: int, reserved: dict[str, int], expected: str
) -> None:
    decision = plan_acquire(live, backend, backend_cap=backend_cap, global_cap=global_cap, reserved=reserved)
    assert_decision(decision, expected)


def assert_decision(decision: Admit | Wait, expected: str) -> None:
    """``expected``: "wait", "admit" (start, suspending nothing), or the key of the slot to suspend."""
    if expected == "wait":
        assert isinstance(decision, Wait)
    elif expected == "admit":
        assert decision == Admit()
    else:
        assert isinstance(decision, Admit)
        assert decision.evict is not None
        assert decision.evict.key == expected


# (sentence, live slots, waiters ahead, expected eviction key | "admit" | "wait"); backend cap 2, global 4
AHEAD = [
    ("first in line with room: start", [slot("s1")], 0, "admit"),
    ("not first in line: never starts, even with room (the room is the first waiter's)", [], 1, "wait"),
    (
        "a free slot goes to the waiter ahead: the second suspends a session for its own",
        [slot("idle", last_active=1)],
        1,
        "idle",
    ),
    (
        "one slot being freed, for the waiter ahead: the second frees another, side by side",
        [Slot("going", "a", 0, stopping=True), slot("idle", last_active=1)],
        1,
        "idle",
    ),
    (
        "as many slots being freed as waiters up to this one: it waits for its own",
        [Slot("going", "a", 0, stopping=True), Slot("going-too", "a", 0, stopping=True)],
        1,
        "wait",
    ),
    (
        "more waiters ahead than sessions to suspend: wait",
        [Slot("going", "a", 0, stopping=True), slot("busy", busy=True)],
        2,
        "wait",
    ),
]


@pytest.mark.parametrize(("live", "ahead", "expected"), [row[1:] for row in AHEAD], ids=[row[0] for row in AHEAD])
def test_plan_acquire_with_waiters_ahead(live: list[Slot], ahead: int, expected: str) -> None:
    assert_decision(plan_acquire(live, "a", backend_cap=2, global_cap=4, ahead=ahead), expected)


# (sentence, min_idle, start cost, turnaround, protection)
PROTECTION = [
    ("nothing learnt yet: min_idle", 2.0, None, None, 2.0),
    ("a start cheaper than min_idle: no longer than a start", 2.0, 0.25, None, 0.25),
    ("a gateway that comes back in 20 ms: twice that, but at least 50 ms", 2.0, 0.25, 0.02, 0.05),
    ("a gateway that comes back in 80 ms: twice that", 2.0, 0.25, 0.08, 0.16),
    ("a slow gateway: still no longer than a start", 2.0, 0.25, 5.0, 0.25),
    ("min_idle = 0: no protection at all", 0.0, 0.25, 0.02, 0.0),
]


@pytest.mark.parametrize(
    ("min_idle", "start_cost", "turnaround", "expected"),
    [row[1:] for row in PROTECTION],
    ids=[row[0] for row in PROTECTION],
)
def test_protection(min_idle: float, start_cost: float | None, turnaround: float | None, expected: float) -> None:
    assert protection(min_idle, start_cost, turnaround) == pytest.approx(expected)


def test_waiting_for_a_recent_session_says_until_when() -> None:
    decision = plan_acquire(
        [Slot("a1", "a", 0, recent_until=7.5), Slot("a2", "a", 0, recent_until=6.0)],
        "a",
        backend_cap=2,
        global_cap=4,
        now=5.0,
    )
    assert decision == Wait("every idle session of backend 'a' (2) was active moments ago", until=6.0)
    later = plan_acquire([Slot("a1", "a", 0, recent_until=7.5)], "a", backend_cap=1, global_cap=4, now=7.5)
    assert isinstance(later, Admit)
    assert later.evict is not None


def test_idle_ttl_picks_only_idle_slots_past_the_ttl_spares_first() -> None:
    live = [
        slot("fresh", last_active=95),
        slot("stale", last_active=10),
        slot("stale-busy", last_active=0, busy=True),
        slot("stale-pinned", last_active=0, pinned=True),
        slot("spare:a", last_active=50, spare=True),
    ]
    assert [s.key for s in expired(live, now=100, idle_ttl=30)] == ["spare:a", "stale"]
    assert expired(live, now=100, idle_ttl=1000) == []


R, L, N = "session/resume", "session/load", "session/new"

# (sentence, strategy, adapter can resume, can load, what the gateway asked, what worked last, refused as
# unsupported, the requests to try in order)
STRATEGY = [
    ("auto goes resume (no replay), load, new", "auto", True, True, None, None, (), (R, L, N)),
    ("auto without resume loads, then starts afresh", "auto", False, True, None, None, (), (L, N)),
    ("auto with neither starts afresh", "auto", False, False, None, None, (), (N,)),
    (
        "a gateway that sent session/load gets a load first (it wants the replay)",
        "auto",
        True,
        True,
        L,
        None,
        (),
        (L, R, N),
    ),
    ("a gateway session/load on an adapter that cannot load: resume", "auto", True, False, L, None, (), (R, N)),
    ("the method that worked last goes first", "auto", True, True, None, L, (), (L, R, N)),
    ("a method refused as unsupported is not tried again", "auto", True, True, None, None, (R,), (L, N)),
    ("what worked is only tried if advertised", "auto", False, False, None, L, (), (N,)),
    ("resume = load uses session/load, then new", "load", True, True, None, None, (), (L, N)),
    ("resume = resume is tried even if not advertised", "resume", False, True, None, None, (), (R, N)),
    ("resume = resume is tried even if refused before", "resume", True, True, None, L, (R,), (R, N)),
    ("resume = new never tries to restore", "new", True, True, None, None, (), (N,)),
    ("resume = new ignores what the gateway asked", "new", True, True, L, None, (), (N,)),
    ("resume = never does not restore at all", "never", True, True, None, None, (), ()),
]


@pytest.mark.parametrize(
    ("strategy", "can_resume", "can_load", "asked", "worked", "unsupported", "expected"),
    [row[1:] for row in STRATEGY],
    ids=[row[0] for row in STRATEGY],
)
def test_restore_order(
    strategy: str,
    can_resume: bool,
    can_load: bool,
    asked: str | None,
    worked: str | None,
    unsupported: tuple[str, ...],
    expected: tuple[str, ...],
) -> None:
    order = restore_order(
        strategy,
        can_resume=can_resume,
        can_load=can_load,
        gateway_asked=asked,
        worked=worked,
        unsupported=frozenset(unsupported),
    )
    assert order == expected


@pytest.mark.parametrize(
    ("method", "code", "gives_way"),
    [
        ("session/resume", -32002, True),  # resource not found
        ("session/resume", -32601, True),  # method not found
        ("session/load", -32602, True),  # invalid params
        ("session/load", -32603, False),  # internal error: try again later, keep the mapping
        ("session/load", -32000, False),  # auth required
        ("session/resume", -32800, False),  # cancelled
        ("session/load", None, False),  # a timeout or interruption has no code
        ("session/new", -32002, False),  # nothing left to fall back to
    ],
)
def test_fallback_only_on_the_three_error_classes(method: str, code: int | None, gives_way: bool) -> None:
    assert falls_back(method, code) is gives_way
