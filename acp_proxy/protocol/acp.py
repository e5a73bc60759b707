"""The few ACP fields the proxy reads or rewrites, each decoded on its own.

``sessionId`` (to route, and to rewrite after a fallback gave a new adapter id),
``_meta["acp-proxy"]`` (the gateway's word to the proxy), the session
capabilities of an ``initialize`` answer, and ``$/cancel_request``'s
``requestId``. Everything else stays the bytes it arrived as.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

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


class _SessionParams(msgspec.Struct, gc=False):
    sessionId: str | UnsetType = UNSET


_session_params_decoder: Final = msgspec.json.Decoder(_SessionParams)


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


@dataclass(frozen=True, slots=True)
class AgentCapabilities:
    """The session capabilities an ``initialize`` result advertises (absent = unsupported)."""

    load: bool = False
    resume: bool = False
    close: bool = False

    @classmethod
    def from_initialize(cls, result: Raw | UnsetType) -> AgentCapabilities:
        obj = jsonrpc.decode_object(result) or {}
        capabilities = obj.get("agentCapabilities")
        capabilities = capabilities if isinstance(capabilities, dict) else {}
        return cls(
            load=advertises(capabilities, Method.LOAD),
            resume=advertises(capabilities, Method.RESUME),
            close=advertises(capabilities, Method.CLOSE),
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

    ``session/close`` and ``session/list`` are always served (by the proxy);
    ``session/resume`` is, when the adapter can load or resume (the proxy restores
    the session on a fresh process either way). ``_meta["acp-proxy"]`` says who we are.
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
    sessions.pop("fork", None)  # a forked session would be one the proxy cannot route yet
    if caps.load or caps.resume:
        sessions.setdefault("resume", {})
    agent["sessionCapabilities"] = sessions
    obj["agentCapabilities"] = agent
    meta = obj.get("_meta")
    meta = dict(meta) if isinstance(meta, dict) else {}
    meta[PROXY_META] = {"version": __version__, "backend": backend}
    obj["_meta"] = meta
    return Raw(jsonrpc.encode_json(obj))


def history_reset_update(session_id: str) -> dict[str, Any]:
    """The ``session/update`` params telling the gateway a session starts afresh (its history is gone)."""
    update = {"sessionUpdate": "session_info_update", "_meta": {PROXY_META: {"historyReset": True}}}
    return {"sessionId": session_id, "update": update}


def cancel_target(params: Raw | UnsetType) -> tuple[bool, RequestId]:
    """``$/cancel_request``'s ``requestId``: (False, None) when it names none."""
    obj = jsonrpc.decode_object(params)
    if obj is None or "requestId" not in obj:
        return False, None
    target = obj["requestId"]
    if isinstance(target, bool) or not isinstance(target, int | str | None):
        return False, None
    return True, target


def remap_cancel_request(params: Raw | UnsetType, new_id: RequestId) -> Raw:
    """``$/cancel_request`` params naming ``new_id``, everything else (``_meta``) kept."""
    obj = jsonrpc.decode_object(params) or {}
    obj["requestId"] = new_id
    return Raw(jsonrpc.encode_json(obj))
