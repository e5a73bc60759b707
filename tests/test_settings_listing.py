"""What a restore's answer says of re-applied settings, and what session/list takes from an adapter's own list:
pure tables."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from acp_proxy.protocol.settings import reflect_setting
from acp_proxy.sessions.listing import title_changes, titles_listed
from acp_proxy.sessions.registry import SessionRecord

MODES = {"currentModeId": "default", "availableModes": [{"id": "default"}, {"id": "plan"}]}
MODELS = {"currentModelId": "small", "availableModels": [{"modelId": "small"}, {"modelId": "big"}]}


def select(option_id: str, category: str | None, current: str, *values: str, grouped: bool = False) -> dict[str, Any]:
    options: list[dict[str, Any]] = [{"value": v, "name": v} for v in values]
    if grouped:
        options = [{"group": "all", "name": "All", "options": options}]
    option: dict[str, Any] = {"id": option_id, "name": option_id, "type": "select", "currentValue": current}
    if category is not None:
        option["category"] = category
    return {**option, "options": options}


QWEN = {
    "modes": MODES,
    "models": MODELS,
    "configOptions": [
        select("mode", "mode", "default", "default", "plan"),
        select("model", "model", "small", "small", "big", grouped=True),
        select("effort", "thought_level", "low", "low", "high"),
    ],
}

# (sentence, the restore's result, the setting re-applied, its params, its answer, what the result must say:
# current mode in modes, the config options' current values)
REFLECT = [
    (
        "set_mode: the mode option says it too (qwen-code)",
        QWEN,
        "session/set_mode",
        {"modeId": "plan"},
        {},
        ("plan", "small", ["plan", "small", "low"]),
    ),
    (
        "set_model: the model option says it too, groups flattened",
        QWEN,
        "session/set_model",
        {"modelId": "big"},
        {},
        ("default", "big", ["default", "big", "low"]),
    ),
    (
        "set_config_option of the mode: modes says it too",
        QWEN,
        "session/set_config_option",
        {"configId": "mode", "value": "plan"},
        {},
        ("plan", "small", ["plan", "small", "low"]),
    ),
    (
        "set_config_option answered with the full set: taken whole, and modes follows it",
        QWEN,
        "session/set_config_option",
        {"configId": "mode", "value": "plan"},
        {"configOptions": [select("mode", "mode", "plan", "default", "plan")]},
        ("plan", "small", ["plan"]),
    ),
    (
        "a category value that is not a mode leaves modes alone",
        QWEN,
        "session/set_config_option",
        {"configId": "mode", "value": "yolo"},
        {},
        ("default", "small", ["yolo", "small", "low"]),
    ),
    (
        "a mode the option does not offer leaves the option alone",
        {**QWEN, "modes": {**MODES, "availableModes": [*MODES["availableModes"], {"id": "auto"}]}},
        "session/set_mode",
        {"modeId": "auto"},
        {},
        ("auto", "small", ["default", "small", "low"]),
    ),
    (
        "an option of another category is left alone",
        QWEN,
        "session/set_config_option",
        {"configId": "effort", "value": "high"},
        {},
        ("default", "small", ["default", "small", "high"]),
    ),
]


@pytest.mark.parametrize(
    ("result", "method", "params", "answer", "expected"), [r[1:] for r in REFLECT], ids=[r[0] for r in REFLECT]
)
def test_a_reapplied_setting_is_stated_the_same_everywhere(
    result: dict[str, Any],
    method: str,
    params: dict[str, Any],
    answer: dict[str, Any],
    expected: tuple[str, str, list[str]],
) -> None:
    result = copy.deepcopy(result)
    reflect_setting(result, method, params, answer)
    stated = (
        result["modes"]["currentModeId"],
        result["models"]["currentModelId"],
        [option["currentValue"] for option in result["configOptions"]],
    )
    assert stated == expected


def test_a_result_without_the_places_gains_none() -> None:
    result: dict[str, Any] = {}
    for method, params in [("session/set_mode", {"modeId": "plan"}), ("session/set_model", {"modelId": "big"})]:
        reflect_setting(result, method, params, {})
    assert result == {}


def record(title: str | None = None, stamp: str | None = None) -> SessionRecord:
    return SessionRecord(
        session_id="stable", adapter_session_id="theirs", backend="qwen", cwd="/w", title=title, title_updated_at=stamp
    )


LISTED = titles_listed(
    [
        {"sessionId": "theirs", "cwd": "/w", "title": "fix the test", "updatedAt": "2026-11-25T10:00:00Z"},
        {"sessionId": "untitled", "cwd": "/w", "title": ""},
        {"sessionId": "stamped", "cwd": "/w", "updatedAt": "2026-11-25T09:00:00Z"},
        "not an object",
        {"title": "no id"},
    ]
)

# (sentence, the registry's row, what it takes from the adapter's list)
TEN = {"updatedAt": "2026-11-25T10:00:00Z"}
TITLES = [
    (
        "no title kept: the adapter's, with its stamp",
        record(),
        {"title": "fix the test", "updatedAt": "2026-11-25T10:00:00Z"},
    ),
    (
        "another title kept: the adapter's own word wins",
        record("old", "2026-11-25T11:00:00Z"),
        {"title": "fix the test", "updatedAt": "2026-11-25T10:00:00Z"},
    ),
    ("the same title, the same stamp: nothing", record("fix the test", "2026-11-25T10:00:00Z"), {}),
    (
        "the same title, an older stamp: the later one",
        record("fix the test", "2026-11-25T08:00:00Z"),
        {"updatedAt": "2026-11-25T10:00:00Z"},
    ),
    ("the same title, a later stamp kept: nothing", record("fix the test", "2026-11-25T12:00:00Z"), {}),
]


@pytest.mark.parametrize(("row", "changes"), [r[1:] for r in TITLES], ids=[r[0] for r in TITLES])
def test_what_the_registry_takes_from_an_adapters_own_list(row: SessionRecord, changes: dict[str, str]) -> None:
    assert title_changes(row, LISTED) == changes


def test_an_adapters_list_is_read_for_titles_and_stamps_only() -> None:
    assert LISTED == {
        "theirs": {"title": "fix the test", "updatedAt": "2026-11-25T10:00:00Z"},
        "stamped": {"updatedAt": "2026-11-25T09:00:00Z"},
    }
    assert title_changes(record(), {}) == {}
