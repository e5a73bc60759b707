from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from acp_proxy.ownership import cgroups
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The slow tier first, then the tests that start processes, the pure ones last: run in parallel, a
    # long test that starts last would be the whole run's tail, and the short ones fill the gaps.
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None, not starts_processes(item)))
    if not config.getoption("--one-loop"):
        return
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        callspec = getattr(item, "callspec", None)
        on_trio = callspec is not None and callspec.params.get("anyio_backend") == "trio"
        (dropped if on_trio else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


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
