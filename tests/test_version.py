"""Protocol version negotiation: the proxy speaks ACP v1, and lets no gateway and adapter agree on more.

A gateway asking for a newer version is answered with 1, and every adapter process (the
first, and each one started later for a session) is initialised asking for 1. What is not an
integer is passed through for the adapter to judge.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from msgspec import UNSET

from acp_proxy.protocol.acp import annotate_initialize, offered_initialize
from tests.support import TEST_INITIALIZE, Gateway, registry, state_of, write_config

# (sentence, the gateway's protocolVersion, what the adapter is asked for; MISSING: no such key)
MISSING: Any = object()
OFFERED = [
    ("a newer version is lowered to the proxy's", 2, 1),
    ("a far newer one too", 10**30, 1),
    ("the proxy's own passes untouched", 1, 1),
    ("an older one passes untouched, for the adapter to judge", 0, 0),
    ("a string passes untouched, for the adapter to judge", "2", "2"),
    ("a float passes untouched, for the adapter to judge", 2.5, 2.5),
    ("a boolean is no integer here either", True, True),
    ("null passes untouched", None, None),
    ("a missing one stays missing", MISSING, MISSING),
]


def with_version(version: Any) -> dict[str, Any]:
    params = dict(TEST_INITIALIZE)
    if version is MISSING:
        del params["protocolVersion"]
    else:
        params["protocolVersion"] = version
    return params


@pytest.mark.parametrize(("given", "offered"), [row[1:] for row in OFFERED], ids=[row[0] for row in OFFERED])
def test_what_an_adapter_is_asked_for(given: Any, offered: Any) -> None:
    raw = msgspec.Raw(json.dumps(with_version(given)).encode())
    sent = offered_initialize(raw)
    assert json.loads(bytes(sent)) == with_version(offered)  # type: ignore[arg-type]
    if given == offered and type(given) is type(offered):
        assert sent is raw, "params the proxy does not change are sent as they came"


@pytest.mark.parametrize(
    "params", [UNSET, msgspec.Raw(b"[1, 2]"), msgspec.Raw(b'"x"')], ids=["none", "array", "string"]
)
def test_initialize_params_that_are_not_an_object_pass_through(params: Any) -> None:
    assert offered_initialize(params) is params


@pytest.mark.parametrize(("answered", "told"), [(2, 1), (1, 1), (0, 0), ("1", "1")])
def test_the_gateway_is_never_told_a_version_above_the_proxys(answered: Any, told: Any) -> None:
    result = msgspec.Raw(json.dumps({"protocolVersion": answered, "agentCapabilities": {}}).encode())
    assert json.loads(bytes(annotate_initialize(result, "fake")))["protocolVersion"] == told


def initialize_versions(record: Path) -> list[tuple[int, Any]]:
    """(pid, protocolVersion) of every ``initialize`` an adapter process read."""
    sent = []
    for entry in map(json.loads, record.read_text().splitlines()):
        msg = json.loads(entry["in"]) if "in" in entry else {}
        if msg.get("method") == "initialize":
            sent.append((int(entry["pid"]), msg["params"].get("protocolVersion", MISSING)))
    return sent


@pytest.mark.anyio
async def test_the_gateway_gets_1_and_so_does_every_adapter_process(proc_env: dict[str, str], tmp_path: Path) -> None:
    """A gateway asking for 2, through a proxy: every version asked and answered, one by one, is the tests above."""
    asked = 2
    record = tmp_path / "adapter.jsonl"
    store = str(tmp_path / "store")
    config = write_config(tmp_path, pool={"max_live": 1}, backends={"fake": {"store": store, "record": str(record)}})
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=["--config", str(config)]) as gw:
        gw.record = record  # what the proxy sent every adapter is checked against the schema
        answer = await gw.initialize(with_version(asked))
        assert answer["result"]["protocolVersion"] == 1
        first = await gw.new_session()
        second = await gw.new_session()  # max_live = 1: the first session is suspended for it
        assert (await state_of(gw, first))["session"]  # resumed on a third process
        assert {record.session_id for record in registry(proc_env).page()} == {first, second}
    versions = initialize_versions(record)
    assert len({pid for pid, _ in versions}) == 3, "the gateway's process, and one for each later session"
    assert {version for _, version in versions} == {1}
    sent = [json.loads(e["in"]) for e in map(json.loads, record.read_text().splitlines()) if "in" in e]
    first_init = next(m for m in sent if m.get("method") == "initialize")
    assert first_init["params"] == with_version(1), "nothing else of the gateway's params changes"


@pytest.mark.anyio
async def test_a_protocol_version_that_is_no_integer_is_the_adapters_to_judge(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    record = tmp_path / "adapter.jsonl"
    config = write_config(tmp_path, backends={"fake": {"record": str(record)}})
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=["--config", str(config)]) as gw:
        answer = await gw.initialize(with_version("2"))
        assert answer["result"]["protocolVersion"] == 1  # the fake adapter answers with its own
        assert "result" in await gw.initialize(with_version(MISSING))
        assert (await gw.call("session/list", {}))["sessions"] == []  # the proxy serves on
    assert [version for _, version in initialize_versions(record)] == ["2", MISSING]
