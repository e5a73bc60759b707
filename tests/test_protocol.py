"""The protocol layer read against its sources: the ACP schema for the method table, the docs for the errors."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

from acp_proxy.protocol.acp import AgentCapabilities
from acp_proxy.protocol.errors import ProxyError
from acp_proxy.protocol.jsonrpc import ErrorObject
from acp_proxy.protocol.methods import METHODS, Direction, Effect, Method, facts, is_setting, routed_by_session

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "tests" / "data" / "acp-schema" / "schema.json").read_text())["$defs"]
SIDES = {"agent": Direction.TO_AGENT, "client": Direction.TO_CLIENT, "protocol": Direction.BOTH}


def schema_methods() -> dict[str, dict[str, Any]]:
    """Each method of the schema: who handles it, whether it is a notification, whether it must name a session."""
    found: dict[str, dict[str, Any]] = {}
    for name, definition in SCHEMA.items():
        if "x-method" not in definition or name.endswith("Response"):
            continue
        found[definition["x-method"]] = {
            "direction": SIDES[definition["x-side"]],
            "notification": name.endswith("Notification"),
            "names_session": "sessionId" in definition.get("required", []),
        }
    return found


@pytest.mark.parametrize(("method", "expected"), sorted(schema_methods().items()))
def test_the_method_table_says_what_the_schema_says(method: str, expected: dict[str, Any]) -> None:
    known = METHODS.get(method)
    assert known is not None, f"{method} is in the ACP schema but not in the method table"
    assert known.direction is expected["direction"]
    assert known.notification is expected["notification"]
    assert known.names_session is expected["names_session"]


def test_the_table_knows_no_method_beyond_the_schema_but_the_old_set_model_the_unstable_fork_status_and_attach() -> (
    None
):
    # session/attach and session/detach: the draft RFD "Multi-Client Session Attach", served by the proxy itself;
    # session/status: in the unstable schema the TypeScript SDK 2.4 ships, served by the proxy itself;
    # session/claim_permission: the Remote drafts' claim of a pending interaction, served by the proxy itself
    unstable = {Method.FORK, Method.STATUS, Method.ATTACH, Method.DETACH, Method.CLAIM_PERMISSION}
    assert set(METHODS) - set(schema_methods()) == {Method.SET_MODEL, *unstable}
    assert facts(Method.STATUS).names_session
    assert facts(Method.STATUS).capability == "sessionCapabilities.status"
    assert is_setting(Method.SET_MODEL), "older adapters still take it: it is re-applied like the others"
    assert facts(Method.FORK).names_session
    assert facts(Method.FORK).capability == "sessionCapabilities.fork"


# (method, must name its session when the gateway sends it, a setting, what its answer does on the adapter)
ROUTING = [
    ("session/prompt", True, False, Effect.NONE),
    ("session/cancel", True, False, Effect.NONE),
    ("session/load", True, False, Effect.OPENS),
    ("session/resume", True, False, Effect.OPENS),
    ("session/close", True, False, Effect.ENDS),
    ("session/delete", True, False, Effect.ENDS),
    ("session/fork", True, False, Effect.NONE),
    ("session/set_mode", True, True, Effect.NONE),
    ("session/set_config_option", True, True, Effect.NONE),
    ("session/set_model", True, True, Effect.NONE),
    ("session/new", False, False, Effect.OPENS),
    ("session/list", False, False, Effect.NONE),
    ("initialize", False, False, Effect.NONE),
    ("session/update", False, False, Effect.NONE),  # agent->client: the gateway never sends it
    ("_vendor/anything", False, False, Effect.NONE),  # unknown and extension methods pass through
]


@pytest.mark.parametrize(("method", "routed", "setting", "effect"), ROUTING)
def test_what_the_proxy_reads_off_the_table(method: str, routed: bool, setting: bool, effect: Effect) -> None:
    assert routed_by_session(method) is routed
    assert is_setting(method) is setting
    assert facts(method).effect is effect


def documented_reasons() -> set[str]:
    """Every ``error.data.reason`` in the table of errors the proxy returns (docs/sessions.md)."""
    text = (ROOT / "docs" / "sessions.md").read_text()
    table = text[text.index("| `error.data.reason` |") :].split("\n\n", 1)[0]
    reasons: set[str] = set()
    for row in table.splitlines()[2:]:
        first_cell = row.split("|")[1]
        reasons |= set(re.findall(r"`([a-z_]+)`", first_cell))
    return reasons


def constructed_reasons() -> dict[str, list[str]]:
    """Each reason, with the named constructors that make it."""
    made: dict[str, list[str]] = {}
    for name, member in inspect.getmembers(ProxyError, inspect.ismethod):
        if name.startswith("_"):
            continue
        samples = {"int": 7, "int | None": 7, "float": 1.5, "jsonrpc.ErrorObject": ErrorObject(code=7, message="x")}
        args = [
            samples.get(p.annotation, "x")
            for p in inspect.signature(member).parameters.values()
            if p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty
        ]
        made.setdefault(member(*args).reason, []).append(name)
    return made


def test_every_documented_reason_has_a_named_constructor_and_every_constructor_is_documented() -> None:
    assert set(constructed_reasons()) == documented_reasons()


@pytest.mark.parametrize(
    ("error", "code", "reason"),
    [
        (ProxyError.pool_exhausted("claude", 2), -32603, "pool_exhausted"),
        (ProxyError.unknown_session("s1"), -32002, "unknown_session"),
        (ProxyError.session_closed("s1"), -32002, "session_closed"),
        (ProxyError.resume_disabled("s1", "claude"), -32002, "resume_disabled"),
        (ProxyError.unknown_backend("nope", ["b", "a"]), -32602, "unknown_backend"),
        (ProxyError.proxy_shutdown(), -32800, "proxy_shutdown"),
        (ProxyError.cancelled(), -32800, "cancelled"),
        (ProxyError.line_too_long(1024), -32600, "line_too_long"),
        (ProxyError.adapter_exited(-9, "claude"), -32603, "adapter_exited"),
    ],
)
def test_an_error_answers_with_its_code_and_reason(error: ProxyError, code: int, reason: str) -> None:
    answer = json.loads(error.response(3, method="session/prompt"))
    assert answer["id"] == 3
    assert answer["error"]["code"] == code
    assert answer["error"]["data"]["reason"] == reason
    assert answer["error"]["data"]["method"] == "session/prompt"


def _adapter_error(code: int, message: str, data: object = None) -> ErrorObject:
    raw = msgspec.UNSET if data is None else msgspec.Raw(json.dumps(data).encode())
    return ErrorObject(code=code, message=message, data=raw)


# (sentence, the adapter's error, the error the gateway gets: code, message, data)
RESTORE_ERRORS = [
    (
        "gemini's details stay beside the proxy's reason",
        _adapter_error(-32603, "Internal error", {"details": "No previous sessions found for this project."}),
        (
            -32603,
            "Internal error",
            {
                "details": "No previous sessions found for this project.",
                "reason": "restore_failed",
                "method": "session/load",
                "backend": "gemini",
            },
        ),
    ),
    (
        "data that is not an object is kept whole",
        _adapter_error(-32000, "Authentication required", ["gemini-api-key"]),
        (
            -32000,
            "Authentication required",
            {
                "reason": "restore_failed",
                "method": "session/load",
                "backend": "gemini",
                "adapterData": ["gemini-api-key"],
            },
        ),
    ),
    (
        "an adapter's own reason is not overwritten",
        _adapter_error(-32603, "Failed", {"reason": "quota", "retry": 3}),
        (
            -32603,
            "Failed",
            {
                "reason": "restore_failed",
                "method": "session/load",
                "backend": "gemini",
                "adapterData": {"reason": "quota", "retry": 3},
            },
        ),
    ),
    (
        "data that is not JSON is left out",
        ErrorObject(code=-32603, message="Internal error", data=msgspec.Raw(b"{broken")),
        (-32603, "Internal error", {"reason": "restore_failed", "method": "session/load", "backend": "gemini"}),
    ),
]


@pytest.mark.parametrize(("error", "expected"), [r[1:] for r in RESTORE_ERRORS], ids=[r[0] for r in RESTORE_ERRORS])
def test_a_restore_step_that_failed_answers_with_the_adapters_own_error(
    error: ErrorObject, expected: tuple[int, str, dict[str, Any]]
) -> None:
    made = ProxyError.restore_failed("session/load", "gemini", error)
    assert (made.code, made.message, made.data) == expected


def test_a_crash_is_told_as_a_person_reads_it() -> None:
    assert ProxyError.adapter_exited(-9, "b").message == "The agent process exited before answering (killed by SIGKILL)"
    assert ProxyError.adapter_exited(3, "b", during="initialize").data == {
        "reason": "adapter_exited",
        "method": "initialize",
        "backend": "b",
    }
    assert ProxyError.unknown_backend("nope", ["b", "a"]).data["configured"] == ["a", "b"]


def test_no_method_name_is_spelled_out_in_the_package_but_in_its_table() -> None:
    names = sorted(METHODS, key=len, reverse=True)
    pattern = re.compile("|".join(re.escape(f'"{name}"') for name in names))
    offenders = []
    for path in sorted((ROOT / "acp_proxy").rglob("*.py")):
        if path == ROOT / "acp_proxy" / "protocol" / "methods.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []


@pytest.mark.parametrize(
    ("agent_capabilities", "load", "resume", "close"),
    [
        ({}, False, False, False),
        ({"loadSession": True}, True, False, False),
        ({"loadSession": False, "sessionCapabilities": {"resume": {}}}, False, True, False),
        ({"sessionCapabilities": {"close": {}, "resume": None}}, False, False, True),
        ({"sessionCapabilities": "all of them"}, False, False, False),
    ],
)
def test_capabilities_are_read_where_the_method_table_says(
    agent_capabilities: dict[str, Any], load: bool, resume: bool, close: bool
) -> None:
    result = msgspec.Raw(json.dumps({"agentCapabilities": agent_capabilities}).encode())
    assert AgentCapabilities.from_initialize(result) == AgentCapabilities(load=load, resume=resume, close=close)
