"""Latency histograms: counted in memory, added to the install's totals, read back as buckets and quantiles."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from acp_proxy import journal
from acp_proxy.state import StateDB
from acp_proxy.timings import (
    BUCKETS,
    Histogram,
    Quantiles,
    Timing,
    Timings,
    brief,
    by_backend,
    histograms,
    line_of,
    merged,
    overall,
)


@pytest.fixture
def db(tmp_path: Path) -> StateDB:
    opened = StateDB(tmp_path / "state")
    yield opened
    opened.close()


def read(db: StateDB) -> list[Histogram]:
    db.settle()
    return histograms(journal.counters(db.conn))


def test_what_is_observed_is_added_to_the_installs_totals_at_each_flush(db: StateDB) -> None:
    first, second = Timings(db), Timings(db)  # two proxies of one install
    for seconds in (0.003, 0.004, 0.2, 7.0):
        first.observe(Timing.TURN, "codex", seconds)
    second.observe(Timing.TURN, "codex", 0.2)
    second.observe(Timing.RESTORE, "codex", 1.5, "session/load")
    assert read(db) == [], "nothing is written before a flush"
    first.flush()
    second.flush()
    found = {(h.timing, h.backend, h.label): h for h in read(db)}
    turn = found[(Timing.TURN, "codex", "")]
    assert turn.count == 5
    assert turn.total == pytest.approx(7.407)
    assert turn.counts[BUCKETS.index(0.005)] == 2
    assert turn.counts[BUCKETS.index(0.25)] == 2
    assert turn.counts[BUCKETS.index(10.0)] == 1
    assert found[(Timing.RESTORE, "codex", "session/load")].count == 1
    first.flush()  # nothing new: no write, nothing counted twice
    assert next(h for h in read(db) if h.timing is Timing.TURN).count == 5
    first.observe(Timing.TURN, "codex", 4000.0)  # past the last bound: +Inf
    first.flush()
    turn = next(h for h in read(db) if h.timing is Timing.TURN)
    assert turn.counts[-1] == 1
    assert turn.cumulative()[-1] == ("+Inf", 6)


def test_a_clock_that_went_back_or_nan_is_not_counted(db: StateDB) -> None:
    timings = Timings(db)
    timings.observe(Timing.START, "a", -0.5)
    timings.observe(Timing.START, "a", math.nan)
    timings.flush()
    assert read(db) == []


def test_the_totals_sit_beside_the_journals_counters_without_disturbing_them(db: StateDB) -> None:
    journal.Journal(db, None).record(journal.Kind.TURN_ENDED, backend="a", label="done")
    timings = Timings(db)
    timings.observe(Timing.TURN, "a", 1.0)
    timings.flush()
    db.settle()
    counted = journal.counters(db.conn)
    assert [(c.name, c.count) for c in counted if c.name == "turn_ended"] == [("turn_ended", 1)]
    rows = [
        journal.Counter("timing:turn", "a", "|0.5", 3, 1.2),
        journal.Counter("timing:not_yet_invented", "a", "|0.5", 1, 0.1),  # a later release's
        journal.Counter("timing:turn", "a", "|0.333", 1, 0.3),  # a bucket a later release added
    ]
    [turn] = histograms([*counted, *rows])
    assert turn.count == 4  # 1 from the flush, 3 from the row; the unknown ones are left out


@pytest.mark.parametrize(
    ("counts", "q", "expected"),
    [
        ({BUCKETS.index(0.5): 10}, 0.5, 0.375),  # linear within (0.25, 0.5]
        ({0: 4}, 0.5, 0.0025),  # from 0 in the first bucket
        ({BUCKETS.index(1.0): 1, BUCKETS.index(10.0): 1}, 0.95, 5.0 + 5.0 * 0.9),
        ({len(BUCKETS): 3}, 0.5, BUCKETS[-1]),  # +Inf: the largest finite bound
    ],
)
def test_quantiles_are_estimated_as_prometheus_does(counts: dict[int, int], q: float, expected: float) -> None:
    histogram = Histogram(Timing.TURN, "a", "", tuple(counts.get(i, 0) for i in range(len(BUCKETS) + 1)), 1.0)
    assert histogram.quantile(q) == pytest.approx(expected)


def test_an_estimated_quantile_falls_in_the_bucket_of_the_true_one(db: StateDB) -> None:
    rng = random.Random(7)
    observed = [rng.lognormvariate(0.0, 1.5) for _ in range(2000)]
    timings = Timings(db)
    for seconds in observed:
        timings.observe(Timing.RESTORE, "a", seconds, "session/resume")
    timings.flush()
    [histogram] = read(db)
    for q in (0.5, 0.95):
        true = sorted(observed)[int(q * len(observed)) - 1]
        index = next(i for i, bound in enumerate(BUCKETS) if true <= bound)
        lower = BUCKETS[index - 1] if index else 0.0
        estimate = histogram.quantile(q)
        assert estimate is not None
        assert lower <= estimate <= BUCKETS[index]


def test_no_observation_no_quantile() -> None:
    empty = Histogram(Timing.TURN, "a", "", (0,) * (len(BUCKETS) + 1), 0.0)
    assert empty.quantile(0.5) is None
    assert merged([]) is None


def test_summaries_per_backend_and_over_the_install(db: StateDB) -> None:
    timings = Timings(db)
    timings.observe(Timing.RESTORE, "a", 0.2, "session/load")
    timings.observe(Timing.RESTORE, "a", 0.2, "session/resume")
    timings.observe(Timing.RESTORE, "b", 3.0, "session/load")
    timings.observe(Timing.TURN, "b", 20.0)
    timings.flush()
    found = read(db)
    per_backend = by_backend(found)
    assert set(per_backend) == {"a", "b"}
    assert per_backend["a"][Timing.RESTORE].count == 2  # both methods
    assert set(per_backend["b"]) == {Timing.RESTORE, Timing.TURN}
    install = overall(found)
    assert list(install) == [Timing.RESTORE, Timing.TURN]  # in the order of ``Timing``
    assert install[Timing.RESTORE].count == 3
    assert line_of(install).startswith("restore ")
    assert "turn " in line_of(install)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(None, "-"), (0.0042, "4ms"), (0.25, "250ms"), (1.25, "1.2s"), (38.4, "38s"), (245.0, "4m05s")],
)
def test_brief(seconds: float | None, text: str) -> None:
    assert brief(seconds) == text


def test_a_line_shows_p50_and_p95() -> None:
    assert line_of({Timing.START: Quantiles(3, 0.41, 1.2)}) == "start 410ms/1.2s"
