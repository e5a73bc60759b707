from __future__ import annotations

import gc
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from acp_proxy.ownership import cgroups
from tests.kit import forked as forking
from tests.kit import markers
from tests.support import MARKER_VARIABLE, install_cgroups, marked_processes

# Config files the tests write must not be group-writable (the proxy refuses those), whatever
# umask the suite is started with (many distributions give users 002).
os.umask(0o022)


EVENT_LOOPS = ("asyncio", "trio")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--one-loop",
        action="store_true",
        help="run the async tests on asyncio only (the fast tier); the full suite runs them on trio too",
    )


@pytest.hookimpl(trylast=True)  # after pytest's own deselection (-m, -k): what is ordered is what runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--one-loop`` leaves the trio runs out; then the longest tests first, each on a worker of its own.

    pytest-xdist's ``worksteal`` gives each worker a contiguous share of the list, in order, to run in
    order (an idle worker takes the unstarted end of a busy one's share). Sorted longest first, the
    list would give one worker the whole slow tier back to back (the benchmarks' smoke run and both
    soaks: two and a half minutes), and the run that as its tail. So the sorted tests are dealt out
    like cards, one to each share in turn: every worker starts with one of the longest, and ends with
    pure tests that fill the gaps.
    """
    if config.getoption("--one-loop"):
        kept: list[pytest.Item] = []
        dropped: list[pytest.Item] = []
        for item in items:
            callspec = getattr(item, "callspec", None)
            on_trio = callspec is not None and callspec.params.get("anyio_backend") == "trio"
            (dropped if on_trio else kept).append(item)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept
    ranked = sorted(
        items,
        key=lambda item: (
            item.get_closest_marker("long") is None,
            item.get_closest_marker("slow") is None,
            not starts_processes(item),
        ),
    )
    # Dealt, the tests of share j are ranked[j::workers]. worksteal cuts the list into shares of len // workers
    # items, the last len % workers shares one more: the larger deals go last, so that the cuts fall between.
    workers = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), 1)
    items[:] = [item for deal in reversed(range(workers)) for item in ranked[deal::workers]]


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", None):
        forking.share()  # pytest-xdist's controller: its workers share one fork server


def starts_processes(item: pytest.Item) -> bool:
    """Whether a test starts processes (its fixtures give it the environment for them)."""
    return bool({"proc_env", "cli_env"} & set(getattr(item, "fixturenames", ())))


@pytest.fixture(params=EVENT_LOOPS)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def proc_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """Environment for a test that starts processes; at its end none of them may survive.

    Every process the test starts (the proxy, the adapter, their descendants)
    inherits a unique marker. Teardown waits briefly for stragglers, then fails
    the test naming any that are left (and kills them so the next test starts clean).
    """
    marker = uuid.uuid4().hex
    env = dict(os.environ)
    env[MARKER_VARIABLE] = marker
    env["ACP_PROXY_STATE_DIR"] = str(tmp_path / "state")
    env.pop("ACP_PROXY_CONFIG", None)
    env["PYTHONUNBUFFERED"] = "1"
    yield env
    deadline = time.monotonic() + 5
    while (left := marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    if left:
        markers.kill(left.values())
        pytest.fail(f"processes survived the test: {[str(marked) for marked in left.values()]}")
    kept = install_cgroups(tmp_path / "state")
    while kept and time.monotonic() < deadline:
        time.sleep(0.05)
        kept = install_cgroups(tmp_path / "state")
    if kept:
        for path in kept:
            cgroups.clear(path, 2.0)
        pytest.fail(f"cgroups of the test's install outlived it (removed now): {[str(p) for p in kept]}")


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection made (every test item, its module, its parameters) lives as long as the worker: the
    garbage collector's full passes during the run leave it out (``gc.freeze``), 4-5 % of a tier's CPU.

    hypothesis is imported first: as it is, trio registers its random generator with it, which checks that
    something holds the generator, and a frozen holder is out of its sight."""
    import hypothesis  # noqa: F401

    gc.freeze()
