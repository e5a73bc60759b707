"""``acp-proxy permissions`` and ``sessions show --transcript``: the shared sessions' operator commands.

``permissions list`` asks every running proxy of the install which of the agent's requests wait
for an answer (its ``status``); ``permissions answer`` answers one through the proxy that holds
it, on the same first-answer-wins path as an attached client: a request someone answered first
is refused (exit 1), an option it does not offer is bad input (exit 2). A request is named
``<instance>.<n>``: the first characters of its proxy's instance id, and its number there.

``sessions show ID --transcript`` prints what the session's gateway saw, as the proxy keeps it
(``sessions.transcript``): its last second may not be written yet.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from acp_proxy.operator import reports
from acp_proxy.operator.reports import EXIT_UNREACHABLE, EXIT_USAGE, OperatorError
from acp_proxy.ownership import instances
from acp_proxy.sessions.transcript import Entry, EntryKind, read_transcript
from acp_proxy.state import StateDB


def running(db: StateDB) -> list[str]:
    """The install's running proxies (instance ids)."""
    return [instance_id for instance_id, _pid, _ in instances.unended(db) if instances.instance_alive(db, instance_id)]


def waiting_requests(state_dir: Path) -> list[dict[str, Any]]:
    """Every running proxy's waiting requests, oldest first, each with its proxy's instance and pid."""
    with reports.opened(state_dir) as db:
        if db is None:
            return []
        live = running(db)
    found: list[dict[str, Any]] = []
    for instance_id, answer in reports.status_answers(state_dir)(live).items():
        if isinstance(answer, dict):
            for request in answer.get("waiting") or []:
                found.append({**request, "instance": instance_id, "pid": answer.get("pid")})
    return sorted(found, key=lambda r: r.get("askedAt") or 0.0)


def permissions_list(state_dir: Path, *, as_json: bool) -> int:
    found = waiting_requests(state_dir)
    if as_json:
        print(json.dumps({"requests": found}, indent=2))
        return 0
    if not found:
        print("no request waits for an answer")
        return 0
    rows = []
    for request in found:
        options = " ".join(str(o.get("optionId")) for o in request.get("options") or [])
        subject = reports.printable(str(request.get("subject") or request.get("method")))
        rows.append(
            (
                request["request"],
                f"{request.get('waitingSeconds', 0):.0f}s",
                reports.printable(str(request["sessionId"]))[:24],
                subject[:40],
                options or "-",
                reports.printable(str(request.get("claimedBy") or "-"))[:24],
            )
        )
    reports.table(("REQUEST", "WAITING", "SESSION", "ASKS", "OPTIONS", "CLAIMED BY"), rows)
    return 0


def permissions_answer(state_dir: Path, key: str, option: str | None, *, as_json: bool) -> int:
    """Answer request ``key`` with ``option`` (``None``: cancel it)."""
    prefix, _, number = key.partition(".")
    if len(prefix) < 4 or not number.isdigit():
        raise OperatorError(f"{key!r} is not a request name (acp-proxy permissions list shows them: <instance>.<n>)")
    with reports.opened(state_dir) as db:
        if db is None:
            raise OperatorError(f"no request {key}: no proxy has used {state_dir}")
        matches = [instance_id for instance_id in running(db) if instance_id.startswith(prefix)]
    if len(matches) != 1:
        raise OperatorError(f"no running proxy holds request {key}", EXIT_UNREACHABLE if not matches else EXIT_USAGE)
    result = answer_on(state_dir, matches[0], key, option, by=f"acp-proxy permissions, uid {os.getuid()}")
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        outcome = result.get("outcome") or {}
        chosen = outcome.get("optionId") if outcome.get("outcome") == "selected" else "cancelled"
        print(f"request {key} answered: {chosen} (session {result.get('sessionId')})")
    return 0


def answer_on(state_dir: Path, instance_id: str, key: str, option: str | None, *, by: str) -> dict[str, Any]:
    """Answer request ``key`` in the proxy ``instance_id`` with ``option`` (``None``: cancelled), as ``by``.

    The first answer wins: one someone gave first is refused (``OperatorError``, exit 1); an option
    the request does not offer is bad input (exit 2)."""
    args: dict[str, Any] = {"request": key, "by": by}
    if option is None:
        args["cancel"] = True
    else:
        args["optionId"] = option
    return reports.ask(state_dir, instance_id, "answer_permission", args)  # not_waiting: exit 1; invalid_args: 2


# --- the transcript ----------------------------------------------------------------------------


def entry_view(entry: Entry) -> dict[str, Any]:
    view: dict[str, Any] = {"at": entry.at, "kind": entry.kind, "message": json.loads(bytes(entry.message))}
    if entry.by is not None:
        view["by"] = entry.by
    return view


def entry_text(entry: Entry) -> str:
    """One line for a person: what happened, shortly."""
    message = json.loads(bytes(entry.message))
    by = f" by {entry.by}" if entry.by else ""
    if entry.kind == EntryKind.UPDATE:
        params = message.get("params") if isinstance(message, dict) else None
        update = params.get("update") if isinstance(params, dict) else None
        if not isinstance(update, dict):
            return f"{message.get('method', 'notification') if isinstance(message, dict) else 'notification'}"
        kind = str(update.get("sessionUpdate") or update.get("type"))
        content = update.get("content")
        text = content.get("text") if isinstance(content, dict) else None
        if isinstance(text, str):
            return f"{kind}: {reports.printable(text)[:200]}"
        title = update.get("title")
        return f"{kind}{': ' + reports.printable(title)[:200] if isinstance(title, str) else ''}"
    if entry.kind == EntryKind.PROMPT:
        blocks = message.get("prompt") if isinstance(message, dict) else None
        words = [b.get("text", "") for b in blocks or [] if isinstance(b, dict) and b.get("type") == "text"]
        return f"prompt{by}: {reports.printable(' '.join(words))[:200]}"
    if entry.kind == EntryKind.ASKED:
        params = message.get("params") or {}
        tool_call = params.get("toolCall") if isinstance(params, dict) else None
        title = tool_call.get("title") if isinstance(tool_call, dict) else None
        return f"asked {message.get('method')} {message.get('id')}: {reports.printable(str(title or ''))[:200]}"
    if entry.kind == EntryKind.ANSWERED:
        outcome = message.get("outcome") or {}
        chosen = outcome.get("optionId") or outcome.get("outcome") if isinstance(outcome, dict) else outcome
        return f"answered {message.get('request')}{by}: {chosen}"
    return f"{entry.kind}{by}"


def transcript_show(state_dir: Path, session_id: str, *, as_json: bool) -> int:
    with reports.opened(state_dir) as db:
        session_id = reports.resolve_session(db, state_dir, session_id)
    entries = read_transcript(state_dir, session_id)
    if as_json:
        print(json.dumps({"sessionId": session_id, "entries": [entry_view(e) for e in entries]}, indent=2))
        return 0
    if not entries:
        print(f"session {session_id}: no transcript kept", file=sys.stderr)
        return 0
    print(f"session {session_id}: {len(entries)} entries")
    for entry in entries:
        print(f"  {time.strftime('%H:%M:%S', time.localtime(entry.at))}  {entry_text(entry)}")
    return 0
