"""Where the time goes: latency histograms per backend, kept for the whole install.

Each proxy counts what it times (``Timings.observe``: a bisect and a dict update, no I/O) and
adds what it counted to the install's totals about once a second (``Timings.flush``: one
queued write), and at exit. The totals are rows of the journal's ``counters`` table, one per
(timing, backend, label, bucket) with the observations in that bucket and their sum, so that
they outlive every proxy, never go backwards, and need no schema of their own:
``name = "timing:<Timing>"``, ``label = "<label>|<bucket's upper bound>"`` (``+Inf`` for the
last). ``acp-proxy metrics`` exports them as Prometheus histograms (cumulative buckets,
``_sum``, ``_count``); ``status`` and ``top`` show p50 and p95 estimated from the buckets the
way Prometheus's ``histogram_quantile`` does (linear within the bucket).
"""

from __future__ import annotations

import bisect
import enum
import functools
import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any, Final

import msgspec

from acp_proxy import journal
from acp_proxy.state import StateDB

log = logging.getLogger("acp_proxy.journal")


class Timing(enum.StrEnum):
    """What is timed, each in seconds."""

    START = "start"
    """an adapter process's spawn to its ``initialize`` answered"""
    SESSION_NEW = "session_new"
    """a gateway's ``session/new``, received to answered (a start included when it needed one)"""
    RESTORE = "restore"
    """a suspended session brought back on a new process (label: the method that restored it)"""
    FIRST_UPDATE = "first_update"
    """a prompt sent to its adapter to the turn's first ``session/update``"""
    TURN = "turn"
    """a prompt turn, sent to ended"""
    SLOT_WAIT = "slot_wait"
    """a start's wait for a process slot of the install (label: ``admitted`` or ``exhausted``)"""
    EVICTION = "eviction"
    """another proxy of the install asked to suspend a session for a slot, to its answer (label: ``yes``, ``no``)"""


DESCRIPTIONS: Final[Mapping[Timing, str]] = {
    Timing.START: "Adapter process spawned to initialize answered",
    Timing.SESSION_NEW: "session/new received to answered, a process start included when it needed one",
    Timing.RESTORE: "Suspended sessions brought back on a new process, by method",
    Timing.FIRST_UPDATE: "Prompt sent to the adapter to the turn's first session/update",
    Timing.TURN: "Prompt turns, sent to ended",
    Timing.SLOT_WAIT: "Starts' waits for a process slot of the install, by outcome",
    Timing.EVICTION: "Another proxy asked to suspend a session for a slot, to its answer",
}
LABELS: Final[Mapping[Timing, str | None]] = {
    Timing.RESTORE: "method",
    Timing.SLOT_WAIT: "outcome",
    Timing.EVICTION: "answer",
}
"""The Prometheus label a timing's ``label`` is exported as (``None``: it has none)."""

BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
"""Upper bounds in seconds, from a relay's few milliseconds to a long turn; ``+Inf`` follows."""
PREFIX: Final = "timing:"


def bound_text(index: int) -> str:
    return "+Inf" if index == len(BUCKETS) else repr(BUCKETS[index])


class Timings:
    """What this proxy timed since its last flush: (timing, backend, label, bucket) -> [count, sum]."""

    def __init__(self, db: StateDB) -> None:
        self.db = db
        self._pending: dict[tuple[Timing, str, str, int], list[float]] = {}

    def observe(self, timing: Timing, backend: str, seconds: float, label: str = "") -> None:
        if not seconds >= 0.0:  # NaN, or a clock that went back
            return
        key = (timing, backend, label, bisect.bisect_left(BUCKETS, seconds))
        counted = self._pending.get(key)
        if counted is None:
            self._pending[key] = [1, seconds]
        else:
            counted[0] += 1
            counted[1] += seconds

    def flush(self) -> None:
        """Add what was counted to the install's totals: one queued write (none if nothing was)."""
        if not self._pending:
            return
        rows = [
            (f"{PREFIX}{timing}", backend, f"{label}|{bound_text(index)}", int(count), total)
            for (timing, backend, label, index), (count, total) in self._pending.items()
        ]
        self._pending = {}
        statement = functools.partial(journal.add_counts, rows)
        self.db.write_or_log(statement, log, logging.WARNING, "could not record %s: %s", "timings")


# --- reading, for the operator ------------------------------------------------------------


class Histogram(msgspec.Struct, frozen=True):
    """One timing of one backend (and label) since the install was created."""

    timing: Timing
    backend: str
    label: str
    counts: tuple[int, ...]
    """Observations per bucket (``BUCKETS``, then ``+Inf``), not cumulative."""
    total: float
    """The sum of every observation, in seconds."""

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, observations at most le)`` per bucket, as Prometheus exposes them."""
        out, running = [], 0
        for index, count in enumerate(self.counts):
            running += count
            out.append((bound_text(index), running))
        return out

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile estimated from the buckets (``histogram_quantile``); ``None`` with no observation.

        Linear within the bucket it falls in, from the bucket below's bound (0 for the first);
        one that falls in ``+Inf`` is the largest finite bound."""
        total = self.count
        if total == 0:
            return None
        rank = q * total
        running = 0
        for index, count in enumerate(self.counts):
            if count and running + count >= rank:
                if index == len(BUCKETS):
                    return BUCKETS[-1]
                lower = BUCKETS[index - 1] if index else 0.0
                return lower + (BUCKETS[index] - lower) * max(0.0, rank - running) / count
            running += count
        return BUCKETS[-1]


def merged(histograms: Iterable[Histogram]) -> Histogram | None:
    """One histogram of several of the same timing (a backend's over every label)."""
    found = list(histograms)
    if not found:
        return None
    counts = [sum(h.counts[i] for h in found) for i in range(len(BUCKETS) + 1)]
    first = found[0]
    return Histogram(first.timing, first.backend, "", tuple(counts), math.fsum(h.total for h in found))


def histograms(counters: Iterable[journal.Counter]) -> list[Histogram]:
    """Every timing among the install's ``counters``, sorted by timing, backend and label."""
    found: dict[tuple[Timing, str, str], tuple[list[int], list[float]]] = {}
    bounds = {bound_text(i): i for i in range(len(BUCKETS) + 1)}
    for row in counters:
        name, backend, label, count, seconds = row.name, row.backend, row.label, row.count, row.seconds
        if not name.startswith(PREFIX):
            continue
        try:
            timing = Timing(name[len(PREFIX) :])
        except ValueError:
            continue  # a timing of a later release
        sub, _, bound = label.rpartition("|")
        index = bounds.get(bound)
        if index is None:
            continue  # buckets of a later release
        counts, total = found.setdefault((timing, backend, sub), ([0] * (len(BUCKETS) + 1), [0.0]))
        counts[index] += count
        total[0] += seconds
    return [
        Histogram(timing, backend, label, tuple(counts), total[0])
        for (timing, backend, label), (counts, total) in sorted(found.items())
    ]


class Quantiles(msgspec.Struct, frozen=True):
    """A timing's p50 and p95 in seconds, and how many observations they are estimated from."""

    count: int
    p50: float | None
    p95: float | None


def by_backend(found: Iterable[Histogram]) -> dict[str, dict[Timing, Quantiles]]:
    """Each backend's timings (over every label), as ``status`` shows them."""
    grouped: dict[tuple[str, Timing], list[Histogram]] = {}
    for histogram in found:
        grouped.setdefault((histogram.backend, histogram.timing), []).append(histogram)
    out: dict[str, dict[Timing, Quantiles]] = {}
    for backend in sorted({backend for backend, _ in grouped}):
        for timing in Timing:  # in the order a request meets them
            if (quantiles := _quantiles(grouped.get((backend, timing), ()))) is not None:
                out.setdefault(backend, {})[timing] = quantiles
    return out


def overall(found: Iterable[Histogram]) -> dict[Timing, Quantiles]:
    """Each timing over every backend and label, as ``top`` shows them."""
    grouped: dict[Timing, list[Histogram]] = {}
    for histogram in found:
        grouped.setdefault(histogram.timing, []).append(histogram)
    out: dict[Timing, Quantiles] = {}
    for timing in Timing:
        if (quantiles := _quantiles(grouped.get(timing, ()))) is not None:
            out[timing] = quantiles
    return out


def _quantiles(group: Iterable[Histogram]) -> Quantiles | None:
    """p50 and p95 of histograms of one timing taken together; ``None`` when nothing was timed."""
    one = merged(group)
    if one is None or not one.count:
        return None
    return Quantiles(one.count, one.quantile(0.5), one.quantile(0.95))


def quantiles_json(found: Mapping[Timing, Quantiles]) -> dict[str, dict[str, Any]]:
    """``{timing: {count, p50, p95}}``, as ``status --json`` and ``top --json`` write them."""
    return {timing.value: msgspec.structs.asdict(q) for timing, q in found.items()}


def quantiles_from(document: Mapping[str, Mapping[str, Any]]) -> dict[Timing, Quantiles]:
    """``quantiles_json``'s document read back."""
    return {Timing(name): Quantiles(q["count"], q["p50"], q["p95"]) for name, q in document.items()}


def brief(seconds: float | None) -> str:
    """``4ms``, ``1.2s``, ``38s``, ``4m05s``: a timing for a narrow column."""
    if seconds is None:
        return "-"
    if seconds < 1.0:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 10.0:
        return f"{seconds:.1f}s"
    if seconds < 60.0:
        return f"{seconds:.0f}s"
    whole = int(seconds)
    return f"{whole // 60}m{whole % 60:02d}s"


SHORT_NAMES: Final[Mapping[Timing, str]] = {
    Timing.START: "start",
    Timing.SESSION_NEW: "new",
    Timing.RESTORE: "restore",
    Timing.FIRST_UPDATE: "1st update",
    Timing.TURN: "turn",
    Timing.SLOT_WAIT: "slot wait",
    Timing.EVICTION: "evict",
}


def line_of(quantiles: Mapping[Timing, Quantiles], *, counts: bool = False) -> str:
    """``start 410ms/1.2s  restore 1.9s/4.0s  …``: p50/p95 of each timing there is (``counts``: then
    ``(n)``, how many were timed)."""
    return "  ".join(
        f"{SHORT_NAMES[timing]} {brief(q.p50)}/{brief(q.p95)}" + (f" ({q.count})" if counts else "")
        for timing, q in quantiles.items()
    )
