"""Structured logs on stderr: one event per line, as text (default) or JSON.

Every line names the proxy (pid, instance id); lines about a session, a lease or
a task carry their ids, and a task's lines carry the ``traceparent`` the gateway
put in the prompt's ``_meta``, so one turn can be followed across the gateway's
traces, this proxy's log and ``acp-proxy tasks show``. Log call sites pass the ids
with ``extra=ids(...)``; nothing else about logging changes for them.

Nothing secret is logged: adapter environments are never formatted, and messages
name commands by their argv, which the config keeps free of ``${VAR}`` values.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any, Final

LOG_FORMATS: Final = ("text", "json")
CONTEXT_KEYS: Final = ("session", "lease", "task", "traceparent", "backend", "pid")
"""The ids a line may carry, in the order the text format shows them."""
_CONTEXT_ATTR: Final = "acp_context"


def ids(**context: object) -> dict[str, Any]:
    """``extra=`` for a log call: the ids it is about (``None`` values are left out)."""
    return {_CONTEXT_ATTR: {k: v for k, v in context.items() if v is not None}}


def context_of(record: logging.LogRecord) -> dict[str, Any]:
    found = getattr(record, _CONTEXT_ATTR, None)
    return found if isinstance(found, dict) else {}


class TextFormatter(logging.Formatter):
    """``acp-proxy[PID] LEVEL logger: message  session=... task=...``"""

    def __init__(self) -> None:
        super().__init__("acp-proxy[%(process)d] %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        context = context_of(record)
        if context:
            line += "  " + " ".join(f"{key}={context[key]}" for key in _ordered(context))
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``msg``, ``pid``, ``instance`` and the ids."""

    def __init__(self, instance: str | None = None) -> None:
        super().__init__()
        self.instance = instance

    def format(self, record: logging.LogRecord) -> str:
        event: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "pid": record.process,
        }
        if self.instance is not None:
            event["instance"] = self.instance
        context = context_of(record)
        for key in _ordered(context):
            event[key if key != "pid" else "adapterPid"] = context[key]
        if record.exc_info:
            event["exception"] = self.formatException(record.exc_info)
        return json.dumps(event, default=str, ensure_ascii=False)


def _ordered(context: dict[str, Any]) -> list[str]:
    known = [key for key in CONTEXT_KEYS if key in context]
    return known + sorted(key for key in context if key not in CONTEXT_KEYS)


def configure(level: str, fmt: str) -> None:
    """Send the proxy's logs to stderr at ``level`` in ``fmt`` (``text`` or ``json``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def set_instance(instance_id: str) -> None:
    """Once the proxy has its instance id: every JSON line names it from now on."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler.formatter, JsonFormatter):
            handler.formatter.instance = instance_id
