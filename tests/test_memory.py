"""The memory budget: whom to suspend (pure tables), and what real adapter trees measure."""

from __future__ import annotations

import pytest

from acp_proxy.pool.memory import BudgetPlan, MemoryBudget, MemorySlot, Overrun, plan_budget, plan_spawn, tree_pids

MB = 1024**2


def slot(key: str, backend: str = "a", memory: int = 100, last_active: float = 0.0, **flags: bool) -> MemorySlot:
    """A live tree of ``memory`` MB."""
    return MemorySlot(key=key, backend=backend, memory=memory * MB, last_active=last_active, **flags)


def budget(total: int | None = None, **per_backend: int) -> MemoryBudget:
    """Budgets in MB."""
    return MemoryBudget(None if total is None else total * MB, {b: size * MB for b, size in per_backend.items()})


def keys(plan: BudgetPlan) -> list[str]:
    return [s.key for s in plan.suspend]


def overruns(plan: BudgetPlan) -> list[tuple[str | None, int]]:
    """(backend or None, MB still used) of each budget left exceeded."""
    return [(o.backend, o.used // MB) for o in plan.overrun]


# (sentence, live slots, budget, expected suspensions in order, expected overruns)
BUDGET = [
    ("no budget at all: nothing is suspended", [slot("s1", memory=5000)], budget(), [], []),
    ("within the budget: nothing is suspended", [slot("s1"), slot("s2")], budget(300), [], []),
    ("a total equal to the budget fits", [slot("s1"), slot("s2")], budget(200), [], []),
    (
        "over the install-wide budget: the least recently used idle session goes, and only as many as needed",
        [slot("new", last_active=9), slot("old", last_active=1), slot("mid", last_active=5)],
        budget(200),
        ["old"],
        [],
    ),
    (
        "several go, least recently used first, until the total fits",
        [slot("new", last_active=9), slot("old", last_active=1), slot("mid", last_active=5)],
        budget(100),
        ["old", "mid"],
        [],
    ),
    (
        "a busy session is never suspended, even the oldest",
        [slot("old", last_active=1, busy=True), slot("new", last_active=9)],
        budget(150),
        ["new"],
        [],
    ),
    (
        "a pinned session (resume = never) is never suspended",
        [slot("old", last_active=1, pinned=True), slot("new", last_active=9)],
        budget(150),
        ["new"],
        [],
    ),
    (
        "a recent session goes only after every other idle one, however old it is",
        [slot("recent", last_active=1, recent=True), slot("a", last_active=5), slot("b", last_active=9)],
        budget(50),
        ["a", "b", "recent"],
        [],
    ),
    (
        "a recent session is left alone when the others are enough",
        [slot("recent", last_active=1, recent=True), slot("a", last_active=5)],
        budget(100),
        ["a"],
        [],
    ),
    (
        "a spare goes before any session, however recently started",
        [slot("s1", last_active=1), slot("spare:a", last_active=9, spare=True)],
        budget(100),
        ["spare:a"],
        [],
    ),
    (
        "every session busy: nothing to suspend, and the budget is reported still exceeded",
        [slot("s1", busy=True), slot("s2", busy=True)],
        budget(150),
        [],
        [(None, 200)],
    ),
    (
        "suspending every idle session is not enough: they all go, and what is left is reported",
        [slot("busy", memory=300, busy=True), slot("idle", last_active=1)],
        budget(200),
        ["idle"],
        [(None, 300)],
    ),
    (
        "a backend over its own budget: only that backend's sessions go, even if another's is older",
        [slot("b-old", backend="b", last_active=0), slot("a-old", last_active=1), slot("a-new", last_active=9)],
        budget(a=100),
        ["a-old"],
        [],
    ),
    (
        "a backend over budget with its sessions busy: another backend's idle session does not help",
        [slot("a1", busy=True, memory=200), slot("b1", backend="b", last_active=0)],
        budget(a=100),
        [],
        [("a", 200)],
    ),
    (
        "another backend's budget is left as it is when only the install-wide one is exceeded",
        [slot("b1", backend="b", last_active=0), slot("a1", last_active=1)],
        budget(150, b=500),
        ["b1"],
        [],
    ),
    (
        "both budgets exceeded: one suspension that lowers both is enough",
        [slot("b1", backend="b", last_active=5), slot("a1", last_active=1), slot("a2", last_active=9)],
        budget(250, a=150),
        ["a1"],
        [],
    ),
    (
        "both budgets exceeded: suspensions go on in order until the install-wide one fits too",
        [slot("b1", backend="b", last_active=5, memory=300), slot("a1", last_active=1), slot("a2", last_active=9)],
        budget(250, a=150),
        ["a1", "b1"],
        [],
    ),
    (
        "a backend without a budget of its own counts only towards the install-wide one",
        [slot("b1", backend="b", memory=900)],
        budget(a=100),
        [],
        [],
    ),
]


@pytest.mark.parametrize(
    ("live", "limits", "suspended", "left_over"), [row[1:] for row in BUDGET], ids=[row[0] for row in BUDGET]
)
def test_plan_budget(
    live: list[MemorySlot], limits: MemoryBudget, suspended: list[str], left_over: list[tuple[str | None, int]]
) -> None:
    plan = plan_budget(live, limits)
    assert keys(plan) == suspended
    assert overruns(plan) == left_over


# (sentence, live slots, backend to spawn, its expected MB or None, budget, expected suspensions, expected overruns)
SPAWN = [
    ("no budget: the spawn goes ahead, nothing suspended", [slot("s1")], "a", 5000, budget(), [], []),
    ("room for the expected size: nothing suspended", [slot("s1")], "a", 100, budget(200), [], []),
    (
        "no room: the least recently used idle session goes first",
        [slot("new", last_active=9), slot("old", last_active=1)],
        "a",
        100,
        budget(250),
        ["old"],
        [],
    ),
    (
        "an unknown size counts as nothing: suspend only if already over",
        [slot("s1", last_active=1), slot("s2", last_active=9)],
        "a",
        None,
        budget(200),
        [],
        [],
    ),
    (
        "an unknown size with the install already over: suspend until it fits",
        [slot("s1", last_active=1), slot("s2", last_active=9)],
        "a",
        None,
        budget(150),
        ["s1"],
        [],
    ),
    (
        "a recent session goes only after every other idle one",
        [slot("recent", last_active=1, recent=True), slot("old", last_active=5)],
        "a",
        100,
        budget(200),
        ["old"],
        [],
    ),
    (
        "nothing can be suspended: the spawn goes ahead, and the overrun is reported",
        [slot("s1", busy=True), slot("s2", pinned=True)],
        "a",
        100,
        budget(200),
        [],
        [(None, 300)],
    ),
    (
        "the spawn's backend budget: only that backend's sessions make room",
        [slot("b1", backend="b", last_active=0), slot("a1", last_active=1)],
        "a",
        100,
        budget(a=150),
        ["a1"],
        [],
    ),
    (
        "another backend's budget, even exceeded, is not the spawn's business",
        [slot("b1", backend="b", memory=900, last_active=0), slot("a1", last_active=1)],
        "a",
        100,
        budget(b=100),
        [],
        [],
    ),
    (
        "a process larger than the whole budget: every idle session goes first, then the overrun is reported",
        [slot("s1", last_active=1), slot("s2", last_active=2)],
        "a",
        500,
        budget(400),
        ["s1", "s2"],
        [(None, 500)],
    ),
]


@pytest.mark.parametrize(
    ("live", "backend", "expected", "limits", "suspended", "left_over"),
    [row[1:] for row in SPAWN],
    ids=[row[0] for row in SPAWN],
)
def test_plan_spawn(
    live: list[MemorySlot],
    backend: str,
    expected: int | None,
    limits: MemoryBudget,
    suspended: list[str],
    left_over: list[tuple[str | None, int]],
) -> None:
    plan = plan_spawn(live, backend, None if expected is None else expected * MB, limits)
    assert keys(plan) == suspended
    assert overruns(plan) == left_over


def test_an_overrun_reads_as_a_sentence_to_log() -> None:
    assert str(Overrun("codex", 7 * 1024 * MB, 6 * 1024 * MB)) == (
        "backend 'codex' use 7168 MiB of a 6144 MiB max_memory, and no idle session that would lower it "
        "is left to suspend"
    )
    assert str(Overrun(None, 300 * MB, 200 * MB)).startswith("all backends use 300 MiB of a 200 MiB max_memory")


# (sentence, pid -> ppid, roots, expected pids per root)
TREES = [
    ("a root and its child", {10: 1, 11: 10}, [10], {10: [10, 11]}),
    ("grandchildren too, breadth first", {10: 1, 11: 10, 12: 11, 13: 10}, [10], {10: [10, 11, 13, 12]}),
    ("another tree is not counted", {10: 1, 11: 10, 20: 1, 21: 20}, [10, 20], {10: [10, 11], 20: [20, 21]}),
    ("a root that is gone has no tree (its orphans went elsewhere)", {11: 1}, [10], {10: []}),
    ("a cycle from a reused pid ends", {10: 11, 11: 10}, [10], {10: [10, 11]}),
]


@pytest.mark.parametrize(("parents", "roots", "expected"), [r[1:] for r in TREES], ids=[r[0] for r in TREES])
def test_tree_pids(parents: dict[int, int], roots: list[int], expected: dict[int, list[int]]) -> None:
    assert tree_pids(parents, roots) == expected
