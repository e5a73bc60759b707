"""A session's settings as a restore's answer states them, after the proxy re-applied them.

ACP states one setting in up to two places of a ``session/new``/``load``/``resume`` result:
the mode as ``modes.currentModeId`` and as the ``configOptions`` entry of category
``mode``; the model as ``models.currentModelId`` (older adapters) and as the entry of
category ``model``. An adapter restarted for a restore answers with its defaults (qwen-code
says ``currentModeId: "default"`` in both), and the proxy then re-applies what the gateway
had set. ``reflect_setting`` updates every place that states the re-applied setting, so the
gateway is never told two different modes (or models) in one answer. Pure: dicts in, the
updated result out.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final

from acp_proxy.protocol.methods import Method

MODE: Final = "mode"
MODEL: Final = "model"

STATED_TWICE: Final[dict[str, tuple[str, str, str, str]]] = {
    Method.SET_MODE: ("modeId", "modes", "currentModeId", MODE),
    Method.SET_MODEL: ("modelId", "models", "currentModelId", MODEL),
}
"""A setting request -> its param, the result's member that states it, that member's current key, and the
category of the config option that states it too."""


def _values(option: dict[str, Any]) -> Iterator[object]:
    """The values a select option offers, groups flattened."""
    for entry in option.get("options") or ():
        if not isinstance(entry, dict):
            continue
        if "value" in entry:
            yield entry["value"]
        for inner in entry.get("options") or ():  # a group of options
            if isinstance(inner, dict):
                yield inner.get("value")


def _with_category_value(options: object, category: str, value: object) -> object:
    """``configOptions`` with the ``category`` entry set to ``value`` where it offers that value."""
    if not isinstance(options, list):
        return options
    return [
        {**option, "currentValue": value}
        if isinstance(option, dict) and option.get("category") == category and value in _values(option)
        else option
        for option in options
    ]


def _with_current(state: object, key: str, value: object) -> object:
    """``modes`` or ``models`` with ``key`` (currentModeId, currentModelId) set to ``value``."""
    return {**state, key: value} if isinstance(state, dict) else state


def _is_option(option: object, config_id: object) -> bool:
    return isinstance(option, dict) and option.get("id") == config_id


def _category_of(options: object, config_id: object) -> str | None:
    for option in options if isinstance(options, list) else ():
        if isinstance(option, dict) and option.get("id") == config_id:
            category = option.get("category")
            return category if isinstance(category, str) else None
    return None


def reflect_setting(result: dict[str, Any], method: str, params: dict[str, Any], answer: dict[str, Any]) -> None:
    """Update a restore's ``result`` in place for ``method`` re-applied with ``params`` (its ``answer``)."""
    if method in STATED_TWICE:
        key, state, current, stated_as = STATED_TWICE[method]
        value = params.get(key)
        if state in result:
            result[state] = _with_current(result[state], current, value)
        if "configOptions" in result:
            result["configOptions"] = _with_category_value(result["configOptions"], stated_as, value)
    elif method == Method.SET_CONFIG_OPTION:
        config_id, value = params.get("configId"), params.get("value")
        if isinstance(answer.get("configOptions"), list):
            result["configOptions"] = answer["configOptions"]  # the full set, as the adapter has it now
        elif isinstance(result.get("configOptions"), list):
            result["configOptions"] = [
                {**option, "currentValue": value} if _is_option(option, config_id) else option
                for option in result["configOptions"]
            ]
        category = _category_of(result.get("configOptions"), config_id)
        if category == MODE and _offers(result.get("modes"), "availableModes", "id", value):
            result["modes"] = _with_current(result["modes"], "currentModeId", value)
        elif category == MODEL and _offers(result.get("models"), "availableModels", "modelId", value):
            result["models"] = _with_current(result["models"], "currentModelId", value)


def _offers(state: object, listed: str, key: str, value: object) -> bool:
    """Whether ``modes``/``models`` lists ``value`` among what may be chosen."""
    entries = state.get(listed) if isinstance(state, dict) else None
    return isinstance(entries, list) and any(isinstance(e, dict) and e.get(key) == value for e in entries)
