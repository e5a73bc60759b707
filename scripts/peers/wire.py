"""What the checks send, and how they compare what each side saw.

The allowed differences through the proxy: ``_meta["acp-proxy"]`` in the initialize result and
the session capabilities the proxy serves itself; request ids (the proxy remaps them per hop);
session ids (fresh in every run); the order of notifications an adapter sends on a timer.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .report import CheckFailed

PROXY_META = "acp-proxy"
PROXY_REASONS = frozenset(
    {
        "spawn_failed",
        "adapter_exited",
        "pool_exhausted",
        "restore_failed",
        "restore_timeout",
        "resume_disabled",
        "unknown_session",
        "session_in_use",
        "session_closed",
        "session_deleted",
        "start_timeout",
        "unknown_backend",
        "proxy_shutdown",
    }
)
CLIENT_INITIALIZE = {
    "protocolVersion": 1,
    "clientInfo": {"name": "check-peers", "version": "1"},
    "clientCapabilities": {"fs": {"readTextFile": False, "writeTextFile": False}, "terminal": False},
}
FIRST_WORDS = "remember the word PELICAN"
SECOND_WORDS = "which word did I ask you to remember?"
OTHER_WORDS = "remember the word OTTER"
THIRD_WORDS = "remember the word HERON"


def pop_proxy_meta(message: Any) -> Any:
    """Remove and return ``_meta["acp-proxy"]`` from a response's result (None if absent)."""
    result = message.get("result") if isinstance(message, dict) else None
    meta = result.get("_meta") if isinstance(result, dict) else None
    if not isinstance(meta, dict) or PROXY_META not in meta:
        return None
    found = meta.pop(PROXY_META)
    if not meta:
        assert isinstance(result, dict)
        del result["_meta"]
    return found


def strip_proxy_meta(messages: list[Any], proxied: bool, where: str) -> list[Any]:
    """The messages without the proxy's initialize annotation, which must be there iff proxied."""
    found = [meta for meta in map(pop_proxy_meta, messages) if meta is not None]
    if proxied and len(found) != 1:
        raise CheckFailed(f"{where}: expected _meta[{PROXY_META!r}] in the initialize result once, got {found}")
    if proxied and not (isinstance(found[0], dict) and {"version", "backend"} <= found[0].keys()):
        raise CheckFailed(f"{where}: _meta[{PROXY_META!r}] lacks version/backend: {found[0]}")
    if not proxied and found:
        raise CheckFailed(f"{where}: _meta[{PROXY_META!r}] present without the proxy")
    for message in messages:
        result = message.get("result") if isinstance(message, dict) else None
        if isinstance(result, dict) and "protocolVersion" in result:
            add_served_capabilities(result, proxied, where)
    return messages


SERVED_SESSION_CAPABILITIES = ("close", "list", "delete")
ATTACH_ROLES = {"roles": ["controller", "observer"]}
"""What the proxy advertises of ``session/attach``, which it serves for every backend (protocol.md). A
client of the SDK's typed models may drop it (it is not in ACP v1's schema), so it is not required."""


def add_served_capabilities(result: dict[str, Any], proxied: bool, where: str) -> None:
    """An initialize result with the session capabilities the proxy serves itself.

    The proxy adds ``sessionCapabilities.close``, ``.list``, ``.delete``, ``.attach``
    (its roles) and ``.status`` always, and ``.resume`` when the adapter can load or resume; ``.fork`` it
    relays as the adapter advertised it. Proxied, the first three must be there, and
    ``attach`` as the proxy advertises it where the client kept it; both sides then get
    the same adjustments, so what remains compared is everything else the adapter itself
    advertised, ``fork`` included.
    """
    caps = result.get("agentCapabilities")
    caps = dict(caps) if isinstance(caps, dict) else {}
    sessions = caps.get("sessionCapabilities")
    sessions = dict(sessions) if isinstance(sessions, dict) else {}
    missing = [key for key in SERVED_SESSION_CAPABILITIES if not isinstance(sessions.get(key), dict)]
    if proxied and missing:
        raise CheckFailed(f"{where}: the initialize result lacks sessionCapabilities {missing}, served by the proxy")
    if proxied and sessions.get("attach", ATTACH_ROLES) != ATTACH_ROLES:
        raise CheckFailed(f"{where}: sessionCapabilities.attach is {sessions.get('attach')}, not {ATTACH_ROLES}")
    for key in SERVED_SESSION_CAPABILITIES:
        sessions.setdefault(key, {})
    sessions.setdefault("attach", ATTACH_ROLES)
    sessions.setdefault("status", {})  # served by the proxy too; unstable, so a typed client may drop it
    if caps.get("loadSession") is True or isinstance(sessions.get("resume"), dict):
        sessions.setdefault("resume", {})
    caps["sessionCapabilities"] = sessions
    result["agentCapabilities"] = caps


def label_ids(entries: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Messages per direction, request ids replaced by their order among that side's requests.

    The proxy remaps ids per hop, so an agent sees other ids than the client sent,
    and agent->client requests reach the client under the proxy's ids; what must
    not change is which answer belongs to which request.
    """
    labels: dict[tuple[str, str], str] = {}
    count = {"incoming": 0, "outgoing": 0}
    by_direction: dict[str, list[Any]] = {"incoming": [], "outgoing": []}
    for entry in entries:
        direction, message = entry["dir"], dict(entry["msg"])
        if "id" in message and "method" in message:
            label = f"{direction}-request-{count[direction]}"
            count[direction] += 1
            labels[(direction, json.dumps(message["id"]))] = label
            message["id"] = label
        elif "id" in message:
            other = "outgoing" if direction == "incoming" else "incoming"
            message["id"] = labels.get((other, json.dumps(message["id"])), f"unmatched {message['id']!r}")
        by_direction[direction].append(message)
    return by_direction


def relabel_requests(messages: list[Any]) -> list[Any]:
    """Request ids replaced by the request's position; an answer gets its request's label.

    acpx prints what it saw without saying who sent it, and agent->client requests
    reach it under ids the proxy chose, so only the pairing of answers with
    requests is compared. An answer belongs to the latest unanswered request with
    its id (acpx's ids and the agent's may coincide).
    """
    pending: dict[str, list[str]] = {}
    out = []
    requests = 0
    for message in messages:
        if isinstance(message, dict) and "id" in message:
            message, key = dict(message), json.dumps(message["id"])
            if "method" in message:
                label = f"request-{requests}"
                requests += 1
                pending.setdefault(key, []).append(label)
                message["id"] = label
            else:
                waiting = pending.get(key)
                message["id"] = waiting.pop() if waiting else f"unmatched {message['id']!r}"
        out.append(message)
    return out


def first_difference(direct: list[Any], proxied: list[Any]) -> str | None:
    for index, (a, b) in enumerate(zip(direct, proxied, strict=False)):
        if a != b:
            return f"message {index}: direct {short(a)} vs proxied {short(b)}"
    if len(direct) != len(proxied):
        return f"direct had {len(direct)} messages, proxied {len(proxied)}"
    return None


def short(value: Any, limit: int = 400) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[:limit] + "..."


PID_IN_ID = re.compile(r"\becho-\d+-")
ECHO_ID = re.compile(r"\becho-[0-9a-f]{8}\b")
UUID = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b")


def normalize_ids(value: Any) -> Any:
    """Session ids are fresh in every run (the echo agent's are random or carry its pid, Claude's are UUIDs)."""
    text = ECHO_ID.sub("echo-ID", PID_IN_ID.sub("echo-PID-", json.dumps(value)))
    return json.loads(UUID.sub("UUID", text))


def unordered_notifications(messages: list[Any]) -> list[Any]:
    """Requests and answers in order, then the notifications sorted.

    An adapter may send a notification (Claude's available_commands_update) from
    a timer, so where it lands among the answers varies from run to run, with or
    without the proxy; which notifications arrive, and their content, must not.
    """

    def is_notification(m: Any) -> bool:
        return isinstance(m, dict) and "method" in m and "id" not in m

    ordered = [m for m in messages if not is_notification(m)]
    loose = sorted((m for m in messages if is_notification(m)), key=lambda m: json.dumps(m, sort_keys=True))
    return ordered + loose


def json_lines(text: str) -> list[Any]:
    out = []
    for line in text.splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError:
                out.append({"text": line})
    return out


def outline(messages: list[Any]) -> str:
    """A few words per message: its method, or what the answer was."""
    words = []
    for message in messages:
        if not isinstance(message, dict):
            words.append("?")
        elif "method" in message:
            words.append(message["method"] + ("" if "id" in message else "(n)"))
        elif "error" in message:
            words.append(f"error {message['error'].get('code')} {message['error'].get('message', '')!r}")
        elif "result" in message:
            words.append("result")
        else:
            words.append("text")
    collapsed: list[str] = []
    for word in words:  # "session/update(n) x12" rather than twelve times the same word
        if collapsed and collapsed[-1].split(" x")[0] == word:
            head, _, count = collapsed[-1].partition(" x")
            collapsed[-1] = f"{head} x{int(count or 1) + 1}"
        else:
            collapsed.append(word)
    return ", ".join(collapsed)


def proxy_error(message: Any) -> str | None:
    """The proxy's own ``error.data.reason`` (None for an adapter's error or a result)."""
    error = message.get("error") if isinstance(message, dict) else None
    data = error.get("data") if isinstance(error, dict) else None
    reason = data.get("reason") if isinstance(data, dict) else None
    return reason if reason in PROXY_REASONS else None


def foreign_session_ids(messages: list[Any], known: set[str]) -> list[str]:
    """Session ids in params or results the gateway never got from session/new, with the message."""
    found = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        for part in (message.get("params"), message.get("result")):
            sid = part.get("sessionId") if isinstance(part, dict) else None
            if isinstance(sid, str) and sid not in known:
                kind = message.get("method") or "a result"
                if kind == "session/update":
                    kind += f" ({message['params'].get('update', {}).get('sessionUpdate')})"
                found.append(f"{sid} in {kind}")
    return found


def user_texts(updates: list[dict[str, Any]], session_id: str) -> list[str]:
    """The user messages replayed for ``session_id``."""
    texts = []
    for params in updates:
        update = params.get("update") or {}
        content = update.get("content")
        if (
            params.get("sessionId") == session_id
            and update.get("sessionUpdate") == "user_message_chunk"
            and isinstance(content, dict)
            and isinstance(content.get("text"), str)
        ):
            texts.append(content["text"])
    return texts


def checked_words(texts: list[str]) -> list[str]:
    """The prompts the checks sent, among the user messages a load replayed (adapters add their own)."""
    return [text for text in texts if text in (FIRST_WORDS, SECOND_WORDS, OTHER_WORDS, THIRD_WORDS)]


def in_order(wanted: list[str], texts: list[str]) -> bool:
    remaining = iter(texts)
    return all(any(text == word for text in remaining) for word in wanted)


def history_reset(updates: list[dict[str, Any]], session_id: str) -> bool:
    """Whether the proxy announced that ``session_id`` came back without its history."""
    for params in updates:
        update = params.get("update") or {}
        meta = (update.get("_meta") or {}).get(PROXY_META) or {}
        if params.get("sessionId") == session_id and meta.get("historyReset") is True:
            return True
    return False


def announced_modes(updates: list[dict[str, Any]], session_id: str) -> list[str]:
    """The modes ``session/update``s reported for ``session_id`` (mode updates, mode config options)."""
    modes = []
    for params in updates:
        update = params.get("update") or {}
        if params.get("sessionId") != session_id:
            continue
        if update.get("sessionUpdate") == "current_mode_update":
            modes.append(str(update.get("currentModeId")))
        elif update.get("sessionUpdate") == "config_option_update":
            for option in update.get("configOptions") or []:
                if isinstance(option, dict) and option.get("category") == "mode":
                    modes.append(str(option.get("currentValue")))
    return modes


def other_mode(session: dict[str, Any]) -> str | None:
    """A mode the session is not in (to set one the proxy must re-apply on resume)."""
    modes = session.get("modes") or {}
    current = modes.get("currentModeId")
    for mode in modes.get("availableModes") or []:
        if mode.get("id") != current:
            return str(mode["id"])
    return None


def session_modes(messages: list[Any]) -> tuple[str | None, list[str]]:
    """The current mode and the modes offered, from the last result that listed them."""
    current, modes = None, []
    for message in messages:
        result = message.get("result") if isinstance(message, dict) else None
        offered = result.get("modes") if isinstance(result, dict) else None
        if isinstance(offered, dict) and offered.get("availableModes"):
            current = offered.get("currentModeId")
            modes = [str(mode.get("id")) for mode in offered["availableModes"] if isinstance(mode, dict)]
    return current, modes


def prompt_params(session_id: str, words: str) -> dict[str, Any]:
    return {"sessionId": session_id, "prompt": [{"type": "text", "text": words}]}
