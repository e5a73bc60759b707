"""start_timeout: a new process that never answers ``initialize``, or the request it was started for, is reaped.

Each proxy here has a backend that hangs (the fake adapter's ``hang``) where the test needs
it to. The gateway gets ``-32603`` with ``data.reason = "start_timeout"``, the process is
gone, nothing is left registered, and the proxy serves the next request. Deadlines are short
(``500ms``) or long (``1h``), so that no outcome depends on how fast the machine is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from acp_proxy.config import ConfigError, validate
from acp_proxy.sessions.registry import SessionState
from tests.support import Gateway, adapter_pid, registry, survivors, write_config

SHORT = "500ms"
LONG = "1h"


def pids_sent(record: Path, method: str) -> list[int]:
    """The adapter processes that read a ``method`` request (from the fake adapter's record)."""
    pids = []
    for entry in map(json.loads, record.read_text().splitlines()):
        if "in" in entry and json.loads(entry["in"]).get("method") == method:
            pids.append(int(entry["pid"]))
    return pids


def assert_start_timeout(answer: dict[str, Any], backend: str, method: str) -> None:
    error = answer["error"]
    assert error["code"] == -32603, answer
    assert error["data"]["reason"] == "start_timeout", answer
    assert error["data"]["backend"] == backend
    assert error["data"]["method"] == method


async def open_on(gw: Gateway, backend: str, method: str = "session/new") -> dict[str, Any]:
    """The answer to a ``session/new`` (or a load of an unknown session) for ``backend`` (``_meta``)."""
    params: dict[str, Any] = {"cwd": "/tmp", "mcpServers": [], "_meta": {"acp-proxy": {"backend": backend}}}
    if method != "session/new":
        params["sessionId"] = "unknown-to-the-proxy"
    return await gw.request(method, params)


def proxy(env: dict[str, str], tmp_path: Path, config: Path) -> Any:
    return Gateway.start(env, tmp_path, [], proxy_args=["--config", str(config)])


# --- the configuration ----------------------------------------------------------------------------


def test_start_timeout_is_a_duration_in_the_pool_and_per_backend() -> None:
    backends = {"a": {"command": ["a"], "start_timeout": "2m"}, "b": {"command": ["b"]}}
    config = validate({"pool": {"start_timeout": "500ms"}, "backends": backends})
    assert config.pool.start_timeout == 0.5
    assert config.backends["a"].start_timeout == 120.0
    assert config.backends["b"].start_timeout is None
    assert validate({"backends": {"b": {"command": ["b"]}}}).pool.start_timeout == 60.0
    with pytest.raises(ConfigError) as caught:
        validate({"pool": {"start_timeout": "soon"}, "backends": {"a": {"command": ["a"], "start_timeout": -1}}})
    assert [problem.split(":")[0] for problem in caught.value.problems] == [
        "pool.start_timeout",
        "backends.a.start_timeout",
    ]


# --- initialize ------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_an_initialize_never_answered_is_start_timeout_and_its_process_is_reaped(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    record = tmp_path / "stuck.jsonl"
    config = write_config(
        tmp_path,
        pool={"start_timeout": SHORT},
        default_backend="stuck",
        backends={"stuck": {"hang": ["initialize"], "record": str(record)}, "good": {}},
    )
    async with proxy(proc_env, tmp_path, config) as gw:
        # The first goes to the process launched with the proxy, the second to one started for it.
        assert_start_timeout(await gw.initialize(), "stuck", "initialize")
        assert_start_timeout(await gw.initialize(), "stuck", "initialize")
        pids = pids_sent(record, "initialize")
        assert len(set(pids)) == 2
        assert await survivors(pids) == []
        created = await open_on(gw, "good")
        session = created["result"]["sessionId"]
        assert (await gw.prompt(session, "stream 1"))["result"]["stopReason"] == "end_turn"


# (sentence, the request that hangs, the default backend: the gateway's initialize goes to it)
FIRST_REQUEST_HANGS = [
    ("session/new on a process started for it", "session/new", "good"),
    ("session/new on the spare that answered the gateway's initialize", "session/new", "stuck"),
    ("session/load of a session the proxy does not know, on a process started for it", "session/load", "good"),
]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("method", "default"), [row[1:] for row in FIRST_REQUEST_HANGS], ids=[row[0] for row in FIRST_REQUEST_HANGS]
)
async def test_a_session_request_never_answered_on_a_fresh_process_is_start_timeout_and_registers_nothing(
    proc_env: dict[str, str], tmp_path: Path, method: str, default: str
) -> None:
    record = tmp_path / "stuck.jsonl"
    config = write_config(
        tmp_path,
        pool={"start_timeout": SHORT},
        default_backend=default,
        backends={"stuck": {"hang": [method], "record": str(record)}, "good": {}},
    )
    async with proxy(proc_env, tmp_path, config) as gw:
        assert "result" in await gw.initialize()
        assert_start_timeout(await open_on(gw, "stuck", method), "stuck", method)
        assert await survivors(pids_sent(record, method)) == []
        assert registry(proc_env).page() == []
        assert (await gw.call("session/list", {}))["sessions"] == []
        session = (await open_on(gw, "good"))["result"]["sessionId"]
        assert [record.session_id for record in registry(proc_env).page()] == [session]
        assert (await gw.prompt(session, "stream 1"))["result"]["stopReason"] == "end_turn"


# --- restore -------------------------------------------------------------------------------------

# (sentence, [pool] deadlines, the reason the request gets)
RESTORE_DEADLINES = [
    ("start_timeout ends first", {"start_timeout": SHORT, "resume_timeout": LONG}, "start_timeout"),
    ("resume_timeout ends first", {"start_timeout": LONG, "resume_timeout": SHORT}, "restore_timeout"),
]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("pool", "reason"), [row[1:] for row in RESTORE_DEADLINES], ids=[row[0] for row in RESTORE_DEADLINES]
)
async def test_a_restore_on_a_process_that_never_answers_initialize_ends_at_the_earlier_deadline(
    proc_env: dict[str, str], tmp_path: Path, pool: dict[str, str], reason: str
) -> None:
    store = str(tmp_path / "store")
    before = write_config(tmp_path, backends={"fake": {"store": store}})
    async with proxy(proc_env, tmp_path, before) as gw:
        await gw.initialize()
        session = await gw.new_session()
        assert (await gw.prompt(session, "stream 1"))["result"]["stopReason"] == "end_turn"
    # The next proxy on the same state dir: the session's backend now never answers initialize.
    record = tmp_path / "stuck.jsonl"
    after = write_config(
        tmp_path,
        pool=dict(pool),
        default_backend="good",
        backends={"good": {}, "fake": {"store": store, "hang": ["initialize"], "record": str(record)}},
    )
    async with proxy(proc_env, tmp_path, after) as gw:
        await gw.initialize()
        answer = await gw.prompt(session, "stream 1")
        assert answer["error"]["code"] == -32603
        assert answer["error"]["data"]["reason"] == reason
        assert answer["error"]["data"]["backend"] == "fake"
        assert await survivors(pids_sent(record, "initialize")) == []
        assert registry(proc_env).get(session).state is SessionState.SUSPENDED  # type: ignore[union-attr]
        other = (await open_on(gw, "good"))["result"]["sessionId"]
        assert (await gw.prompt(other, "stream 1"))["result"]["stopReason"] == "end_turn"


# --- after the start ----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_process_that_answered_in_time_is_not_reaped_when_a_later_turn_takes_longer(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    config = write_config(tmp_path, pool={"start_timeout": SHORT}, backends={"fake": {}})
    async with proxy(proc_env, tmp_path, config) as gw:
        await gw.initialize()
        session = await gw.new_session()
        pid = await adapter_pid(gw, session)
        assert (await gw.prompt(session, "sleep 1.5"))["result"]["stopReason"] == "end_turn"
        assert await adapter_pid(gw, session) == pid


# (sentence, [pool] start_timeout, the backend's options, the reason its initialize gets, or None: answered)
OVERRIDES = [
    (
        "a backend's shorter start_timeout ends a start the pool's would not",
        LONG,
        {"hang": ["initialize"], "start_timeout": SHORT},
        "start_timeout",
    ),
    (
        "a backend's longer start_timeout lets a slow start finish",
        SHORT,
        {"init_delay": 1.5, "start_timeout": LONG},
        None,
    ),
]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("pool", "options", "reason"), [row[1:] for row in OVERRIDES], ids=[row[0] for row in OVERRIDES]
)
async def test_a_backend_start_timeout_overrides_the_pool_one(
    proc_env: dict[str, str], tmp_path: Path, pool: str, options: dict[str, Any], reason: str | None
) -> None:
    config = write_config(tmp_path, pool={"start_timeout": pool}, backends={"fake": options})
    async with proxy(proc_env, tmp_path, config) as gw:
        answer = await gw.initialize()
        if reason is None:
            assert answer["result"]["protocolVersion"] == 1
        else:
            assert_start_timeout(answer, "fake", "initialize")
            assert answer["error"]["data"]["startTimeout"] == 0.5
