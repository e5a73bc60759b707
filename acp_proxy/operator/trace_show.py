"""``acp-proxy trace show FILE``: a message trace (``acp_proxy.trace``) as a readable exchange per session.

Each message is put with its session: the ``sessionId`` in its params or result, else the
session of the request it answers (matched by id on its own side: the gateway's ids, or each
adapter process's). What names no session (``initialize``, ``authenticate``, a new session's
request before its answer names it) is under *connection*. One line a message: the time, the
direction, the method (or which request it answers) and the little that says what it carried.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path
from typing import Any

from acp_proxy import trace
from acp_proxy.operator.reports import OperatorError, printable
from acp_proxy.protocol.methods import Method

CONNECTION = "connection"
ARROWS = {
    "gateway>proxy": "gateway → proxy",
    "proxy>gateway": "proxy → gateway",
    "proxy>agent": "proxy → agent",
    "agent>proxy": "agent → proxy",
}
PREVIEW = 70


def trace_show(path: Path, *, session: str | None, as_json: bool) -> int:
    try:
        records = list(trace.read(path))
    except OSError as exc:
        raise OperatorError(f"cannot read {path}: {exc.strerror}", 2) from None
    grouped, problems = group(records)
    if session is not None:
        chosen = [key for key in grouped if key != CONNECTION and key.startswith(session)]
        if not chosen:
            raise OperatorError(f"no session {session!r} in {path}", 2)
        grouped = {key: grouped[key] for key in chosen}
    if as_json:
        document = {key: [_record_json(r) for r in rows] for key, rows in grouped.items()}
        print(json.dumps({"sessions": document, "problems": problems}, indent=2))
        return 0
    for problem in problems:
        print(f"warning: {problem}", file=sys.stderr)
    for key, rows in grouped.items():
        backend = next((r.backend for r in rows if r.backend), None)
        print(f"== {key}" + (f" ({backend})" if backend and key != CONNECTION else ""))
        for record in rows:
            print(line_of(record))
        print()
    return 0


def group(records: list[trace.Record | str]) -> tuple[dict[str, list[trace.Record]], list[str]]:
    """The records per session (``CONNECTION`` first), each in the order written; and what could not be read."""
    grouped: dict[str, list[trace.Record]] = {CONNECTION: []}
    asked: dict[tuple[str, int | None, object], str] = {}
    problems: list[str] = []
    for record in records:
        if isinstance(record, str):
            problems.append(record)
            continue
        if record.truncated:
            problems.append("the trace reached its size limit here: what came after is not in it")
            continue
        message = record.message if isinstance(record.message, dict) else {}
        side = "gateway" if "gateway" in record.dir else "agent"
        pid = record.pid if side == "agent" else None
        session = _session_of(message)
        key = (side, pid, message.get("id"))
        if "method" in message and "id" in message and session is not None:
            asked[key] = session
        elif "method" not in message and session is None:
            session = asked.pop(key, None)
        grouped.setdefault(session or CONNECTION, []).append(record)
    if not grouped[CONNECTION]:
        del grouped[CONNECTION]
    return grouped, problems


def _session_of(message: dict[str, Any]) -> str | None:
    for part in ("params", "result"):
        value = message.get(part)
        if isinstance(value, dict) and isinstance(value.get("sessionId"), str):
            return str(value["sessionId"])
    return None


def line_of(record: trace.Record) -> str:
    when = datetime.datetime.fromtimestamp(record.at).strftime("%H:%M:%S.%f")[:-3]
    where = ARROWS.get(record.dir, record.dir)
    if record.pid is not None:
        where += f" {record.pid}"
    return f"{when}  {where:<22} {printable(summary(record.message))}"


def summary(message: object) -> str:
    """What a message is, in a few words: its method and id, or the request it answers and how."""
    if not isinstance(message, dict):
        return _cut(json.dumps(message))
    ident = f" #{message['id']}" if "id" in message else ""
    if "method" in message:
        return f"{message['method']}{ident}{_params_preview(message['method'], message.get('params'))}"
    if "error" in message:
        error = message["error"] if isinstance(message["error"], dict) else {}
        return _cut(f"error{ident} {error.get('code')} {error.get('message', '')}")
    result = message.get("result")
    detail = ""
    if isinstance(result, dict) and "stopReason" in result:
        detail = f" {result['stopReason']}"
    elif isinstance(result, dict) and "sessionId" in result:
        detail = f" session {result['sessionId']}"
    return f"answer{ident}{detail}"


def _params_preview(method: str, params: object) -> str:
    if not isinstance(params, dict):
        return "" if params is None else f" {_cut(json.dumps(params))}"
    if method == Method.UPDATE:
        update = params.get("update")
        update = update if isinstance(update, dict) else {}
        kind = update.get("sessionUpdate", "?")
        content = update.get("content")
        text = content.get("text") if isinstance(content, dict) else None
        return f" {kind}" + (f" {_cut(json.dumps(text))}" if isinstance(text, str) else "")
    if method == Method.PROMPT:
        blocks = params.get("prompt")
        blocks = blocks if isinstance(blocks, list) else []
        texts = [str(b["text"]) for b in blocks if isinstance(b, dict) and isinstance(b.get("text"), str)]
        return f" {_cut(json.dumps(' '.join(texts)))}" if texts else ""
    shown = {k: v for k, v in params.items() if k not in ("sessionId", "_meta")}
    return f" {_cut(json.dumps(shown))}" if shown else ""


def _cut(text: str) -> str:
    return text if len(text) <= PREVIEW else text[: PREVIEW - 1] + "…"


def _record_json(record: trace.Record) -> dict[str, Any]:
    out: dict[str, Any] = {"at": record.at, "dir": record.dir, "message": record.message}
    if record.pid is not None:
        out["pid"] = record.pid
    if record.backend is not None:
        out["backend"] = record.backend
    return out
