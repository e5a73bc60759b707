"""The few ACP fields the proxy reads or rewrites, each decoded on its own.

``sessionId`` (to route, and to rewrite after a fallback gave a new adapter id),
``_meta["acp-proxy"]`` (the gateway's word to the proxy), the session
capabilities of an ``initialize`` answer, and the ``requestId`` of
``$/cancel_request`` and of a request-scoped ``elicitation/create``. Everything
else stays the bytes it arrived as.
"""

from __future__ import annotations

from typing import Any, Final, Literal

import msgspec
from msgspec import UNSET, Raw, UnsetType

from acp_proxy import __version__
from acp_proxy.protocol import jsonrpc
from acp_proxy.protocol.jsonrpc import RequestId
from acp_proxy.protocol.methods import Method, facts

PROXY_META: Final = "acp-proxy"
"""The proxy's own key in ``_meta``, both ways."""

PROTOCOL_VERSION: Final = 1
"""The ACP version the proxy speaks: the newest it lets a gateway and an adapter agree on."""
ATTACH_ROLES: Final = ("controller", "observer")
"""The roles ``session/attach`` offers (ACP's draft RFD "Multi-Client Session Attach")."""


class _SessionParams(msgspec.Struct, gc=False):
    sessionId: str | UnsetType = UNSET


_session_params_decoder: Final = msgspec.json.Decoder(_SessionParams)


class _RoutedNotification(msgspec.Struct, gc=False):
    """Decodes only a notification whose ``params``, if any, is an object with no ``sessionId`` but a string."""

    method: str
    jsonrpc: Literal["2.0"]
    params: _SessionParams | UnsetType = UNSET
    id: UnsetType = UNSET
    result: UnsetType = UNSET
    error: UnsetType = UNSET


_routed_decoder: Final = msgspec.json.Decoder(_RoutedNotification)


def notification_sessions(block: bytes, line_count: int) -> list[str | None] | None:
    """The session of each line of ``block`` (``session_of`` its params), when every line is a notification
    (``None`` otherwise, or where a line would need ``session_of``'s care: the block is then routed line by
    line). One decode call for the block: the streaming path of a connection that routes by session."""
    msgs = jsonrpc.decode_lines(_routed_decoder, block, line_count)
    if msgs is None:
        return None
    return [None if msg.params is UNSET or msg.params.sessionId is UNSET else msg.params.sessionId for msg in msgs]


def renamed_batch(batch: jsonrpc.Batch, old: str, new: str) -> jsonrpc.Batch | None:
    """``batch`` with each line as ``rewrite_session_id`` makes it, ``sessionId`` ``old`` -> ``new``, the
    envelopes decoded with one call; ``None`` when the block needs line-by-line handling (see
    ``jsonrpc.decode_block``). A line whose id is not ``old`` is kept as it came."""
    msgs = jsonrpc.decode_block(batch.block, batch.count)
    if msgs is None:
        return None
    renamed = []
    for msg, line in zip(msgs, batch.lines, strict=True):
        params = rewrite_session_id(msg.params, old, new)
        if params is msg.params:
            renamed.append(line)
        else:
            msg.params = params
            renamed.append(jsonrpc.encode(msg).rstrip(b"\n"))
    return jsonrpc.Batch(b"".join(line + b"\n" for line in renamed), lines=renamed)


def session_of(params: Raw | UnsetType) -> str | None:
    """``params.sessionId`` (or ``result.sessionId``) if it is a string, decoding nothing else."""
    if params is UNSET:
        return None
    try:
        value = _session_params_decoder.decode(params).sessionId
    except (msgspec.DecodeError, RecursionError):  # nesting deeper than msgspec decodes
        return None
    return value if isinstance(value, str) else None


def rewrite_session_id(params: Raw | UnsetType, old: str, new: str) -> Raw | UnsetType:
    """``params`` with ``sessionId`` ``old`` replaced by ``new``; anything else untouched."""
    obj = jsonrpc.decode_object(params)
    if obj is None or obj.get("sessionId") != old:
        return params
    obj["sessionId"] = new
    return Raw(jsonrpc.encode_json(obj))


def proxy_meta(params: Raw | UnsetType) -> dict[str, Any]:
    """``params._meta["acp-proxy"]`` as a dict (empty when absent or not an object)."""
    obj = jsonrpc.decode_object(params) or {}
    meta = obj.get("_meta")
    ours = meta.get(PROXY_META) if isinstance(meta, dict) else None
    return ours if isinstance(ours, dict) else {}


class AgentCapabilities(msgspec.Struct, frozen=True):
    """The session capabilities an ``initialize`` result advertises (absent = unsupported)."""

    load: bool = False
    resume: bool = False
    close: bool = False
    delete: bool = False
    fork: bool = False
    logout: bool = False
    list: bool = False

    @classmethod
    def from_initialize(cls, result: Raw | UnsetType) -> AgentCapabilities:
        obj = jsonrpc.decode_object(result) or {}
        capabilities = obj.get("agentCapabilities")
        capabilities = capabilities if isinstance(capabilities, dict) else {}
        return cls(
            load=advertises(capabilities, Method.LOAD),
            resume=advertises(capabilities, Method.RESUME),
            close=advertises(capabilities, Method.CLOSE),
            delete=advertises(capabilities, Method.DELETE),
            fork=advertises(capabilities, Method.FORK),
            logout=advertises(capabilities, Method.LOGOUT),
            list=advertises(capabilities, Method.LIST),
        )


def advertises(capabilities: dict[str, Any], method: str) -> bool:
    """Whether capabilities (the agent's, for a client->agent method) advertise ``method``.

    The method table names the entry; it advertises the method when it is ``true`` or an
    object (``{}``); absent means unsupported. A method gated on nothing is always there.
    """
    path = facts(method).capability
    if path is None:
        return True
    value: object = capabilities
    for key in path.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value is True or isinstance(value, dict)


def _lower_version(obj: dict[str, Any]) -> bool:
    """``protocolVersion`` newer than ``PROTOCOL_VERSION`` lowered to it (True); anything else left alone."""
    version = obj.get("protocolVersion")
    if isinstance(version, int) and not isinstance(version, bool) and version > PROTOCOL_VERSION:
        obj["protocolVersion"] = PROTOCOL_VERSION
        return True
    return False


def offered_initialize(params: Raw | UnsetType) -> Raw | UnsetType:
    """The gateway's ``initialize`` params as adapters get them: a version newer than the proxy's lowered to it.

    ACP's negotiation: a client asks for the newest version it supports, and an agent that does
    not support it answers with its own newest. The proxy is the agent here, so its adapters are
    asked for no version it does not speak. A ``protocolVersion`` that is missing or not an
    integer passes through untouched, for the adapter to judge (and answer ``-32602``): the
    proxy validates no other ``initialize`` field either.
    """
    obj = jsonrpc.decode_object(params)
    if obj is None or not _lower_version(obj):
        return params
    return Raw(jsonrpc.encode_json(obj))


def annotate_initialize(result: Raw, backend: str) -> Raw:
    """The adapter's ``initialize`` result, adjusted for what the proxy itself provides.

    ``session/close``, ``session/list``, ``session/delete``, the unstable ``session/status`` and the
    draft's ``session/attach`` are always served (by the proxy); ``session/resume`` is, when the adapter
    can load or resume (the proxy restores the session on a fresh process either way); ``session/fork``
    when the adapter forks.
    ``_meta["acp-proxy"]`` says who we are.
    ``protocolVersion`` is at most the proxy's own, whatever the adapter answered.
    """
    obj = jsonrpc.decode_object(result)
    if obj is None:
        return result
    _lower_version(obj)
    caps = AgentCapabilities.from_initialize(result)
    agent = obj.get("agentCapabilities")
    agent = dict(agent) if isinstance(agent, dict) else {}
    sessions = agent.get("sessionCapabilities")
    sessions = dict(sessions) if isinstance(sessions, dict) else {}
    sessions.setdefault("close", {})
    sessions.setdefault("list", {})
    sessions.setdefault("delete", {})
    if caps.load or caps.resume:
        sessions.setdefault("resume", {})
    sessions["status"] = {}  # the proxy's own, from the install's state: never the adapter's
    sessions["attach"] = {"roles": list(ATTACH_ROLES)}  # the proxy's own (relay.sharing)
    agent["sessionCapabilities"] = sessions
    obj["agentCapabilities"] = agent
    meta = obj.get("_meta")
    meta = dict(meta) if isinstance(meta, dict) else {}
    meta[PROXY_META] = {"version": __version__, "backend": backend}
    obj["_meta"] = meta
    return Raw(jsonrpc.encode_json(obj))


SESSION_INFO_MARK: Final = b"session_info_update"
"""Found in the raw bytes before any line is decoded for a title: the streaming path pays one search."""

TITLE_LIMIT: Final = 1000
"""Characters of a title kept in the registry."""

NOT_WORK_UPDATES: Final = frozenset(
    {
        "available_commands_update",
        "current_mode_update",
        "config_option_update",
        "session_info_update",
        "usage_update",
        "user_message_chunk",
    }
)
"""``session/update`` kinds that describe the session, or echo what the user said (a replay),
rather than report work the agent is doing."""


class _Update(msgspec.Struct, gc=False):
    sessionUpdate: str = ""
    title: str | UnsetType | None = UNSET
    updatedAt: str | UnsetType | None = UNSET


class _UpdateParams(msgspec.Struct, gc=False):
    sessionId: str | UnsetType = UNSET
    update: _Update | UnsetType = UNSET


class _UpdateNotification(msgspec.Struct, gc=False):
    method: str = ""
    params: _UpdateParams | UnsetType = UNSET


_update_decoder: Final = msgspec.json.Decoder(_UpdateNotification)


def _update_of(line: bytes) -> tuple[str, _Update] | None:
    try:
        msg = _update_decoder.decode(line)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):  # ValidationError: a field of another type
        return None
    params = msg.params
    if msg.method != Method.UPDATE or params is UNSET or params.update is UNSET or params.sessionId is UNSET:
        return None
    return params.sessionId, params.update


def session_info_of(line: bytes) -> tuple[str, dict[str, str | None]] | None:
    """The session a ``session_info_update`` line is for and what it announces (``title``,
    ``updatedAt``; ``None`` clears); ``None`` for any other line."""
    if SESSION_INFO_MARK not in line:
        return None
    found = _update_of(line)
    if found is None or found[1].sessionUpdate != "session_info_update":
        return None
    session_id, update = found
    changes = session_info_changes(update.title, update.updatedAt)
    return (session_id, changes) if changes else None


def session_info_changes(title: str | UnsetType | None, updated_at: str | UnsetType | None) -> dict[str, str | None]:
    """What a ``session_info_update`` changes: the fields it has (``None`` clears), bounded."""
    changes: dict[str, str | None] = {}
    if title is not UNSET:
        changes["title"] = title[:TITLE_LIMIT] if title is not None else None
    if updated_at is not UNSET:
        changes["updatedAt"] = updated_at[:64] if updated_at is not None else None
    return changes


def reports_work(line: bytes) -> bool:
    """Whether a line is a ``session/update`` of work being done (a message, a thought, a tool
    call, a plan), rather than one describing the session (commands, mode, title, usage)."""
    found = _update_of(line)
    return found is not None and found[1].sessionUpdate not in NOT_WORK_UPDATES


def history_reset_update(session_id: str) -> dict[str, Any]:
    """The ``session/update`` params telling the gateway a session starts afresh (its history is gone)."""
    update = {"sessionUpdate": "session_info_update", "_meta": {PROXY_META: {"historyReset": True}}}
    return {"sessionId": session_id, "update": update}


def target_request(params: Raw | UnsetType) -> tuple[bool, RequestId]:
    """``params.requestId``: the request a ``$/cancel_request`` cancels, or a request-scoped
    ``elicitation/create`` belongs to; (False, None) when it names none."""
    obj = jsonrpc.decode_object(params)
    if obj is None or "requestId" not in obj:
        return False, None
    target = obj["requestId"]
    if isinstance(target, bool) or not isinstance(target, int | str | None):
        return False, None
    return True, target


def retarget_request(params: Raw | UnsetType, new_id: RequestId) -> Raw:
    """``params`` with ``requestId`` ``new_id``, everything else (``_meta``) kept."""
    obj = jsonrpc.decode_object(params) or {}
    obj["requestId"] = new_id
    return Raw(jsonrpc.encode_json(obj))
