"""The memory budget: whom to suspend (pure tables), and what real adapter trees measure."""

from __future__ import annotations

import ast
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from msgspec.structs import astuple

from acp_proxy.config import validate
from acp_proxy.ownership.leases import LeaseState, all_leases
from acp_proxy.ownership.proctable import ProcessTable, ProcFS, PsutilTable, TableUnavailable
from acp_proxy.pool.memory import (
    UNREADABLE,
    BudgetPlan,
    MemoryBudget,
    MemoryReader,
    MemorySlot,
    Overrun,
    ProcMemory,
    PsutilMemory,
    TreeMemory,
    Usage,
    counted_size,
    measure_trees,
    plan_budget,
    plan_spawn,
    tree_pids,
)
from tests.kit import gateway
from tests.support import TEST_INITIALIZE, Gateway, state_db


def measure_tree(root: int, *, table: ProcessTable | None = None, reader: MemoryReader | None = None) -> TreeMemory:
    """One tree's memory, as ``measure_trees`` measures it among others."""
    return measure_trees([root], table=table, reader=reader)[root]


MB = 1024**2
PAGE = os.sysconf("SC_PAGE_SIZE")
HAS_ROLLUP = os.access("/proc/self/smaps_rollup", os.R_OK)
NOBODY = 65534


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
        "a start in progress counts like a busy tree: an idle session makes room for both",
        [slot("starting:3", busy=True, last_active=0), slot("old", last_active=1)],
        "a",
        100,
        budget(200),
        ["old"],
        [],
    ),
    (
        "a tree being stopped counts until it is gone, and is counted on first: nothing else goes",
        [slot("going", busy=True, stopping=True, last_active=9), slot("old", last_active=1)],
        "a",
        100,
        budget(200),
        ["going"],
        [],
    ),
    (
        "a tree being stopped is not enough: the least recently used idle session goes after it",
        [slot("going", memory=50, stopping=True), slot("old", last_active=1), slot("new", last_active=9)],
        "a",
        100,
        budget(250),
        ["going", "old"],
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


# (sentence, measured now in MB or None, the backend's peak in MB, still starting, counted MB)
COUNTED = [
    ("a tree up and measured counts what it measures, below its backend's peak too", 50, 100, False, 50),
    ("a tree still starting counts as at least its backend's peak: it is still loading", 10, 100, True, 100),
    ("a tree still starting and already larger than the peak counts what it measures", 150, 100, True, 150),
    ("a tree that could not be measured is guessed at its backend's peak", None, 100, False, 100),
    ("a start not launched yet is its backend's peak", None, 100, True, 100),
    ("a backend never measured: a starting tree counts what it measures now", 10, 0, True, 10),
]


@pytest.mark.parametrize(
    ("measured", "peak", "starting", "expected"), [r[1:] for r in COUNTED], ids=[r[0] for r in COUNTED]
)
def test_counted_size(measured: int | None, peak: int, starting: bool, expected: int) -> None:
    assert counted_size(None if measured is None else measured * MB, peak * MB, starting=starting) == expected * MB


def test_an_overrun_reads_as_a_sentence_to_log() -> None:
    assert str(Overrun("codex", 7 * 1024 * MB, 6 * 1024 * MB)) == (
        "backend 'codex' use 7168 MiB of a 6144 MiB max_memory, and no idle session that would lower it "
        "is left to suspend"
    )
    assert str(Overrun(None, 300 * MB, 200 * MB)).startswith("all backends use 300 MiB of a 200 MiB max_memory")


def test_the_budget_is_taken_from_the_config() -> None:
    config = validate(
        {
            "pool": {"max_memory": "6G"},
            "backends": {"a": {"command": ["a"], "max_memory": "512M"}, "b": {"command": ["b"]}},
        }
    )
    assert MemoryBudget.of(config) == MemoryBudget(6 * 1024 * MB, {"a": 512 * MB})
    assert not MemoryBudget.of(config).empty
    assert MemoryBudget.of(validate({"backends": {"b": {"command": ["b"]}}})).empty


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


# --- reading one process ------------------------------------------------------------------------

ROLLUP = b"55d0-7ffc ---p 00000000 00:00 0   [rollup]\nRss:  1744 kB\nPss:  527 kB\nPss_Anon:  112 kB\n"
STATM = b"4000 300 200 1 0 150 0\n"

# (sentence, files in the fake /proc/PID, expected reading)
READINGS = [
    ("smaps_rollup readable: PSS, in bytes", {"smaps_rollup": ROLLUP, "statm": STATM}, Usage("pss", 527 * 1024)),
    ("no smaps_rollup (a kernel before 4.14): RSS from statm", {"statm": STATM}, Usage("rss", 300 * PAGE)),
    (
        "a smaps_rollup without a Pss line: RSS from statm",
        {"smaps_rollup": b"x\n", "statm": STATM},
        Usage("rss", 300 * PAGE),
    ),
    ("a zombie (no address space) holds no memory: skipped", {"statm": b"0 0 0 0 0 0 0\n"}, None),
    ("the process is gone: skipped", {}, None),
    ("statm unparsable: counted as unreadable, never an error", {"statm": b"garbage"}, UNREADABLE),
]


@pytest.mark.parametrize(("files", "expected"), [r[1:] for r in READINGS], ids=[r[0] for r in READINGS])
def test_proc_memory_reading(tmp_path: Path, files: dict[str, bytes], expected: Usage | None) -> None:
    (tmp_path / "123").mkdir()
    for name, content in files.items():
        (tmp_path / "123" / name).write_bytes(content)
    assert ProcMemory(tmp_path).read(123) == expected


class Denied(ProcMemory):
    """A process of another uid, as seen by a proxy that is not root (the test suite may be)."""

    def __init__(self, *denied: str) -> None:
        super().__init__()
        self.denied = denied

    def _read(self, pid: int, name: str) -> bytes:
        if name in self.denied:
            raise PermissionError(13, "Permission denied")
        return super()._read(pid, name)


def test_a_process_whose_smaps_rollup_is_denied_is_read_by_rss() -> None:
    usage = Denied("smaps_rollup").read(os.getpid())
    assert usage is not None
    assert usage.method == "rss"
    assert usage.size > 0


def measured_as_nobody(root: int) -> TreeMemory:
    """``measure_tree(root)`` in a forked child that has become user nobody (no exec: the
    interpreter may live where nobody cannot read it)."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            tree = measure_tree(root)
            os.write(write_end, repr(astuple(tree)).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], 30)
        answer = os.read(read_end, 1000) if ready else b""
    finally:
        os.close(read_end)
        if not ready:
            os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    assert answer, "the measuring child did not answer"
    return TreeMemory(*ast.literal_eval(answer.decode()))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to measure as another user (setuid to nobody)")
def test_another_users_process_is_read_by_rss_never_raised(proc_env: dict[str, str]) -> None:
    """Only the owner (or ptrace rights) may read smaps_rollup; statm is anyone's."""
    child = waiting_child(proc_env)
    try:
        tree = measured_as_nobody(child.pid)
    finally:
        child.communicate()
    assert (tree.pss_processes, tree.rss_processes, tree.unreadable) == (0, 1, 0)
    assert tree.total > 0
    assert tree.method == "rss"


def test_a_process_that_cannot_be_read_at_all_is_counted_apart_not_raised() -> None:
    tree = measure_tree(os.getpid(), reader=Denied("smaps_rollup", "statm"))
    assert tree.unreadable >= 1
    assert tree.total == 0


class FixedTable(ProcFS):
    """The real /proc, but a process table (pid -> ppid) given by the test."""

    def __init__(self, parents: dict[int, int] | None) -> None:
        super().__init__()
        self.fixed = parents

    def parents(self) -> dict[int, int]:
        if self.fixed is None:
            raise TableUnavailable("no table")
        return self.fixed


def waiting_child(env: dict[str, str], **options: object) -> subprocess.Popen[bytes]:
    """A child that lives until its stdin is closed (``communicate()``)."""
    command = [sys.executable, "-c", "import sys; sys.stdin.read()"]
    return subprocess.Popen(command, stdin=subprocess.PIPE, env=env, **options)  # type: ignore[call-overload]


@pytest.fixture
def gone_pid(proc_env: dict[str, str]) -> int:
    """The pid of a process that has exited and been waited for."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"], env=proc_env)
    proc.wait()
    return proc.pid


def test_a_process_gone_between_the_listing_and_its_reading_is_skipped(gone_pid: int) -> None:
    tree = measure_tree(os.getpid(), table=FixedTable({os.getpid(): 1, gone_pid: os.getpid()}))
    assert (tree.processes, tree.unreadable) == (1, 0)


def test_a_root_that_is_gone_measures_empty(gone_pid: int) -> None:
    assert measure_tree(gone_pid) == TreeMemory()
    assert measure_trees([gone_pid, os.getpid()])[gone_pid] == TreeMemory()


def test_a_zombie_in_the_tree_is_skipped(proc_env: dict[str, str]) -> None:
    zombie = subprocess.Popen([sys.executable, "-c", "pass"], env=proc_env)
    try:
        os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped: a zombie
        assert ProcMemory().read(zombie.pid) is None
    finally:
        zombie.wait()


def test_without_a_process_table_only_the_root_is_measured_and_the_figure_says_so() -> None:
    tree = measure_tree(os.getpid(), table=FixedTable(None))
    assert tree.partial
    assert tree.processes == 1


def test_both_process_tables_list_the_same_parents(proc_env: dict[str, str]) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, env=proc_env
    )
    try:
        for table in (ProcFS(), PsutilTable()):
            parents = table.parents()
            assert parents[os.getpid()] == os.getppid()
            assert parents[child.pid] == os.getpid()
    finally:
        child.communicate()


# --- real trees: the echo agent holding memory ------------------------------------------------------


def echo_agent(*options: str) -> list[str]:
    return [sys.executable, "-m", "acp_proxy.examples.echo_agent", *options]


@pytest.mark.anyio
async def test_an_agent_holding_150_mb_measures_at_least_that_by_pss(proc_env: dict[str, str]) -> None:
    async with gateway.Gateway.launch(echo_agent("--memory", "150"), env=proc_env) as agent:
        await agent.initialize(TEST_INITIALIZE)  # answered once the memory is resident
        tree = measure_tree(agent.pid)
        by_rss = measure_tree(agent.pid, reader=PsutilMemory())
    assert tree.processes == 1
    assert 150 * MB <= tree.total < 250 * MB, tree
    assert tree.method == ("pss" if HAS_ROLLUP else "rss")
    assert (by_rss.method, by_rss.processes) == ("rss", 1)
    assert 150 * MB <= by_rss.total < 250 * MB, by_rss


@pytest.mark.anyio
async def test_a_tree_with_a_forked_child_counts_both(proc_env: dict[str, str]) -> None:
    async with gateway.Gateway.launch(echo_agent("--memory", "150", "--child-memory", "60"), env=proc_env) as agent:
        await agent.initialize(TEST_INITIALIZE)  # answered once both hold their memory
        tree = measure_tree(agent.pid)
        alone = measure_trees([agent.pid], table=FixedTable({agent.pid: os.getpid()}))[agent.pid]
    assert tree.processes == 2
    assert 210 * MB <= tree.total < 360 * MB, tree
    assert tree.total - alone.total >= 60 * MB, (tree, alone)


@pytest.mark.anyio
async def test_an_adapter_tree_under_the_proxy_is_measured_from_its_wrapper(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with Gateway.start(proc_env, tmp_path, echo_agent("--memory", "150")) as gw:
        await gw.initialize()
        await gw.new_session()
        db = state_db(proc_env)
        try:
            (lease,) = [lease for lease in all_leases(db) if lease.state is LeaseState.OPEN]
        finally:
            db.close()
        assert lease.wrapper_pid is not None
        tree = measure_tree(lease.wrapper_pid)
    assert tree.processes == 2  # the wrapper and the adapter
    assert 150 * MB <= tree.total < 300 * MB, tree
    assert tree.method == ("pss" if HAS_ROLLUP else "rss")
