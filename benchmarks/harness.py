"""The one harness every benchmark runs in: the same work directly and through the proxy, one way to show it.

A benchmark is a module that declares a ``Section``: what ``--only`` calls it, how it
measures (into its own field of the ``Report``), how it renders, which targets it
states. Inside, the work is a list of ``Case``s: a key naming the work and how it
is run (``direct``, or ``proxy-<backend>`` through the proxy on that event loop) and
the function that runs it once. ``run_each`` runs every case once (a load), and
``interleaved`` runs rounds over them all (short samples, so that drift on the
machine hits every case alike); ``standing_rounds`` does that over cases that stay
up between their samples (a connection, a proxy): ``Connected`` ones talk to one
child process at a time through the kit's client. A case that fails is reported
and dropped; the run goes on. The figures come back as rows (plain dicts: what
``bench.json`` holds; ``common.figures`` makes a row's percentiles), and every
table is ``render_table`` over ``Column``s. A section's processes run
``isolated``: each carries ``ACP_PROXY_BENCH=<token>`` in its environment, and one
still found in ``/proc`` at the end is a failed run (and is killed).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import secrets
import sys
import tempfile
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from benchmarks.common import BENCH_MARKER, INITIALIZE_PARAMS, ROOT, BenchError, child_environment, leftovers
from tests.kit.gateway import GatewayError, RpcError, SyncGateway

DIRECT = "direct"
PROXY = "proxy-"
IO_TIMEOUT = 30.0
"""How long a case waits for an answer (or a turn's line) before it fails."""
CLOSE_GRACE = 15.0

K = TypeVar("K", bound=Hashable)
Row = dict[str, Any]


def proxy_mode(backend: str) -> str:
    """The key of the work run through the proxy on ``backend`` (asyncio or trio)."""
    return PROXY + backend


def is_proxy(mode: str) -> bool:
    return mode.startswith(PROXY)


def backend_of(mode: str) -> str:
    return mode.removeprefix(PROXY)


def mode_label(mode: str, direct: str = "direct", through: str = "proxy") -> str:
    """``through (backend)`` for a proxy's rows, else ``direct``: each section names its own two."""
    return f"{through} ({backend_of(mode)})" if is_proxy(mode) else direct


# --- the report ----------------------------------------------------------------------------


@dataclass
class Report:
    """Everything one run measured: ``bench.json`` is this, field by field."""

    options: dict[str, Any]
    machine: dict[str, Any]
    throughput: list[Row] = field(default_factory=list)
    latency: list[Row] = field(default_factory=list)
    cold_start: list[Row] = field(default_factory=list)
    targets: list[Row] = field(default_factory=list)
    ownership: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    sessions: dict[str, Any] = field(default_factory=dict)
    tasks: dict[str, Any] = field(default_factory=dict)
    load: dict[str, Any] = field(default_factory=dict)
    install: dict[str, Any] = field(default_factory=dict)
    measuring: dict[str, Any] = field(default_factory=dict)
    remote: dict[str, Any] = field(default_factory=dict)


def attempt(report: Report, what: str, action: Callable[[], Any]) -> Any:
    """``action()``, or ``None`` with the failure recorded: one misbehaving case does not end the run."""
    try:
        return action()
    except (BenchError, GatewayError, OSError) as exc:
        report.errors.append(f"{what}: {exc}")
        print(f"  FAILED {what}: {exc}", file=sys.stderr)
        return None


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Target:
    """A figure and the most it may be (the least, ``at_least``). Reported, never asserted: a miss is printed, the
    run goes on."""

    name: str
    value: float | None
    limit: float
    unit: str
    at_least: bool = False

    def row(self) -> Row:
        met = None if self.value is None else self.value >= self.limit if self.at_least else self.value <= self.limit
        return {
            "name": self.name,
            "value": self.value,
            "target": self.limit,
            "unit": self.unit,
            "at_least": self.at_least,
            "met": met,
        }


@dataclass(frozen=True)
class Section:
    """One benchmark module: the ``--only`` names it answers to, and how it measures, renders and is judged."""

    names: tuple[str, ...]
    measure: Callable[[Report, argparse.Namespace], None]
    render: Callable[[Report], list[str]]
    targets: Callable[[Report], list[Target]] = lambda _: []


# --- running the cases ---------------------------------------------------------------------


@dataclass(frozen=True)
class Case(Generic[K]):
    """One piece of work: ``key`` says what and how (direct, or through the proxy), ``run`` does it once."""

    key: K
    label: str
    run: Callable[[], Any]


def run_each(report: Report, section: str, cases: Sequence[Case[K]], what: str = "") -> list[tuple[K, Any]]:
    """Each case once, in order: (key, result) of those that did not fail."""
    done = []
    for case in cases:
        progress(f"{section}: {case.label}{what} ...")
        result = attempt(report, f"{section} {case.label}", case.run)
        if result is not None:
            done.append((case.key, result))
    return done


def interleaved(
    report: Report, what: str, cases: Sequence[Case[K]], rounds: int, *, warm_up: bool = True
) -> dict[K, list[Any]]:
    """An untimed run of each case (if ``warm_up``), then ``rounds`` rounds over all of them.

    A case that fails once is dropped, its samples with it: a figure from part of a run is not one.
    """
    samples: dict[K, list[Any]] = {case.key: [] for case in cases}
    broken: set[K] = set()
    if warm_up:
        for case in cases:
            if attempt(report, f"{what} {case.label}", case.run) is None:
                broken.add(case.key)
    for round_ in range(rounds):
        progress(f"{what}, round {round_ + 1}/{rounds} ...")
        for case in cases:
            if case.key in broken:
                continue
            sample = attempt(report, f"{what} {case.label}", case.run)
            if sample is None:
                broken.add(case.key)
            else:
                samples[case.key].append(sample)
    return {key: values for key, values in samples.items() if key not in broken}


class Standing(Protocol):
    """A case that stays up across rounds (a connection, a proxy): opened (and warmed up) once, sampled round
    after round, finished (which checks what it left: an exit status, the proxy's records), or killed where it
    failed."""

    label: str

    def open(self) -> object: ...
    def sample(self, count: int) -> list[float]: ...
    def finish(self) -> object: ...
    def kill(self) -> None: ...


S = TypeVar("S", bound=Standing)


def standing_rounds(
    report: Report, what: str, cases: Sequence[S], rounds: Sequence[int], every: int = 10
) -> list[tuple[S, list[float]]]:
    """Open every case, run rounds over them side by side (``rounds[i]`` samples of each case in round
    ``i``), then finish them: each case that never failed, in order, with its samples. A case that fails is
    killed and dropped."""
    samples: dict[str, list[float]] = {case.label: [] for case in cases}
    live = list(cases)

    def step(case: Standing, name: str, action: Callable[[], object]) -> None:
        if attempt(report, name, lambda: action() or True) is None:
            if case in live:
                live.remove(case)
                case.kill()
            del samples[case.label]

    def take(case: Standing, count: int) -> None:
        samples[case.label] += case.sample(count)

    try:
        for case in cases:
            step(case, f"{what} {case.label}: setup", case.open)
        for index, count in enumerate(rounds):
            if index % every == 0:
                progress(f"{what}, round {index + 1}/{len(rounds)} x {len(live)} cases ...")
            for case in list(live):
                step(case, f"{what} {case.label}", functools.partial(take, case, count))
        for case in list(live):
            live.remove(case)
            step(case, f"{what} {case.label}: shutdown", case.finish)
    finally:
        for case in live:
            case.kill()
    return [(case, samples[case.label]) for case in cases if case.label in samples]


# --- one client connection ------------------------------------------------------------------


def connect(argv: list[str], env: dict[str, str], who: str) -> SyncGateway:
    """The kit's client to a child process: the proxy, a relay or the agent itself (its stderr kept)."""
    return SyncGateway.launch(argv, env=env, cwd=ROOT, name=who)


def call(conn: SyncGateway, method: str, params: object) -> tuple[Any, list[dict[str, Any]]]:
    """A request's result and the updates before its answer; an error answer or any other message fails."""
    try:
        result = conn.call(method, params, timeout=IO_TIMEOUT)
    except RpcError as exc:
        raise BenchError(f"{conn.name}: {exc}") from None
    notes = conn.take_updates()
    if conn.stashed():
        raise BenchError(f"{conn.name}: unexpected {str(conn.stashed()[0])[:300]}")
    return result, notes


def stop(conn: SyncGateway) -> int | None:
    """Close its stdin and wait for it to exit (killing it after ``CLOSE_GRACE``); its exit status."""
    return conn.close(CLOSE_GRACE)


class Connected:
    """A ``Standing`` case's connection to one child process at a time: ``connect`` starts and initializes it,
    ``disconnect`` ends it (an exit status other than 0 fails the case), ``kill`` kills it where the case failed."""

    label: str

    def __init__(self) -> None:
        self._conn: SyncGateway | None = None

    @property
    def conn(self) -> SyncGateway:
        assert self._conn is not None
        return self._conn

    def connect(self, argv: list[str], env: dict[str, str]) -> SyncGateway:
        """Start ``argv`` and ``initialize`` it: the connection, until ``disconnect``."""
        self._conn = connect(argv, env, self.label)
        call(self._conn, "initialize", INITIALIZE_PARAMS)
        return self._conn

    def disconnect(self) -> SyncGateway:
        """Close its stdin and wait for it to exit; the closed connection (its stderr is kept)."""
        conn, self._conn = self.conn, None
        status = stop(conn)
        if status != 0:
            raise BenchError(f"{self.label}: exited with status {status}")
        return conn

    def kill(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.kill()
            conn.close()


@dataclass(frozen=True)
class Isolation:
    """What a section's processes run with: a marked environment and a scratch directory."""

    env: dict[str, str]
    workdir: Path


@contextlib.contextmanager
def isolated(report: Report, section: str, results: dict[str, Any], wait: float = 5.0) -> Iterator[Isolation]:
    """Run a section's processes marked with a token of their own, in a scratch dir; afterwards any process
    still carrying the token is killed and recorded in ``results["left_running"]`` as a failure."""
    token = secrets.token_hex(8)
    env = {**child_environment(), BENCH_MARKER: token}
    env.pop("ACP_PROXY_CONFIG", None)
    with tempfile.TemporaryDirectory(prefix=f"acp-proxy-bench-{section}-") as name:
        yield Isolation(env, Path(name))
    left = leftovers(token, wait)
    results["left_running"] = left
    if left:
        report.errors.append(f"{section}: processes outlived the benchmark (killed now): {left}")


def with_baseline(
    rows: list[Row],
    base: Row | None,
    figures: Mapping[str, tuple[str, Callable[[float, float], float]]],
    *,
    base_too: bool = False,
) -> None:
    """Set ``rows``' comparisons with ``base``: ``figures`` maps a new key to (the key read, how to compare).

    Without a base, or a figure to compare, the comparison is ``None``; so is the base's own unless ``base_too``.
    """
    for row in rows:
        for new, (key, compare) in figures.items():
            row[new] = None
            if base is not None and (base_too or row is not base) and None not in (row[key], base[key]):
                row[new] = compare(row[key], base[key])


def minus(ours: float, theirs: float) -> float:
    return ours - theirs


def ratio(ours: float, theirs: float) -> float:
    return ours / theirs


# --- rendering ---------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 1, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}{suffix}"


def verdict(value: float | None, limit: float | None) -> str:
    if value is None or limit is None:
        return ""
    return "met" if value <= limit else "MISSED"


@dataclass(frozen=True)
class Column:
    """A table column: its header, and the cell of one row."""

    header: str
    cell: Callable[[Row], str]


def col(
    header: str,
    key: str,
    digits: int = 1,
    suffix: str = "",
    *,
    when: Callable[[Row], bool] | None = None,
    otherwise: str = "",
) -> Column:
    """A column showing one figure of each row (``otherwise`` where ``when`` says the row has none to show)."""
    return Column(header, functools.partial(_cell, key, digits, suffix, when, otherwise))


def _cell(key: str, digits: int, suffix: str, when: Callable[[Row], bool] | None, otherwise: str, row: Row) -> str:
    return fmt(row[key], digits, suffix) if when is None or when(row) else otherwise


def figure_cols(unit: str, *names: str, digits: int = 1, when: Callable[[Row], bool] | None = None) -> list[Column]:
    """A column per figure ``<name>_<unit>`` of each row, headed ``<name> <unit>``."""
    return [col(f"{name.replace('_', ' ')} {unit}", f"{name}_{unit}", digits, when=when) for name in names]


def ops_cols(mean: str = "us/op") -> list[Column]:
    """The columns of ``common.ops_row``'s figures: what was done, how often, in how long, how many a second, and
    each one's mean (headed ``mean``)."""
    return [
        Column("operation", lambda row: str(row["label"])),
        Column("ops", lambda row: f"{row['ops']:,}"),
        col("total s", "seconds", 3),
        col("ops/s", "ops_per_s", 0),
        col(mean, "us_per_op"),
    ]


def target_col(header: str, key: str, limit: float, *, when: Callable[[Row], bool] | None = None) -> Column:
    """Whether each row's ``key`` met ``limit`` (blank where ``when`` says the row has no target)."""
    return Column(header, lambda row: verdict(row[key], limit) if when is None or when(row) else "")


def known(key: str) -> Callable[[Row], bool]:
    """Rows with a value for ``key``."""
    return lambda row: row.get(key) is not None


def where(key: str, value: object) -> Callable[[Row], bool]:
    """Rows whose ``key`` is ``value``."""
    return lambda row: bool(row[key] == value)


def proxied(row: Row) -> bool:
    """The row was run through the proxy."""
    return is_proxy(row["mode"])


def relayed(row: Row) -> bool:
    """The row was not run directly (through the proxy, or another relay)."""
    return bool(row["mode"] != DIRECT)


def render_table(columns: Sequence[Column], rows: Sequence[Row]) -> list[str]:
    """A markdown table, then a blank line."""
    header = [column.header for column in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(column.cell(row) for column in columns) + " |" for row in rows]
    return [*lines, ""]


def left_running(results: dict[str, Any], of: str) -> list[str]:
    """The line saying which marked processes outlived the section (``of`` it: none, normally)."""
    if "left_running" not in results:
        return []
    left = results["left_running"]
    return [
        f"Processes carrying this run's marker left running at the end{of}: "
        + (", ".join(map(str, left)) + " (killed)" if left else "none"),
        "",
    ]
