"""The chaos soak, bounded: a fixed seed whose draw includes every kind of fault, on four proxies of one install.

``scripts/soak --ops N`` runs the same thing as long as asked, with any seed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import soak

pytestmark = pytest.mark.anyio

SEED = 291  # the proxies' first lifetimes end by gateway EOF mid-turn, SIGKILL in the slot queue, SIGKILL
# and gateway EOF again; every turn fault is drawn
OPS = 100
MAX_LIVE = 2


async def test_a_soak_run_keeps_every_invariant(proc_env: dict[str, str], tmp_path: Path, anyio_backend: str) -> None:
    options = soak.Options(seed=SEED, ops=OPS, workers=3, max_live=MAX_LIVE, proxies=3, async_backend=anyio_backend)
    report = await soak.run(options, tmp_path, proc_env)
    print(report.summary())
    assert report.violations == []
    # The run did what it claims: each fault happened, and there was something to check at the end.
    for fault in (
        "proxy SIGKILL",
        "proxy SIGKILL holding a slot",
        "proxy SIGKILL while waiting for a slot",
        "gateway EOF mid-turn",
        "adapter crash mid-turn",
        "adapter hang (turn timeout)",
    ):
        assert report.faults[fault] >= 1, (fault, report.faults)
    assert report.faults["grandchild escape"] + report.ops["tree"] >= 1
    assert report.faults["adapter ignoring SIGTERM and EOF, torn down"] >= 1
    assert report.ops["reopen"] >= 1, "a closed session was loaded back (close is not delete)"
    assert report.ops["delete"] >= 1
    assert report.total_ops >= OPS
    assert report.sessions_checked >= 3
    assert report.decoys == 3
    assert report.answered_once + report.abandoned == report.sent
    # Four proxies shared the install's cap: they took slots from one another, and the count read from
    # /proc (not theirs) reached the cap and never passed it.
    assert len(report.lifetimes) == 4
    assert max(report.lifetimes.values()) >= 2, "a proxy was started again on the same state dir"
    assert report.pool["suspended for another proxy"] >= 1, report.pool
    assert report.cap_reads >= report.total_ops
    assert report.peak_adapters == report.peak_trees == MAX_LIVE
