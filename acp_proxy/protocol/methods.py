"""The ACP methods the proxy knows, and the few facts it needs about each: one table.

A method's name appears here and nowhere else in the package; code asks this
table whether a method must name its session, whether it is a setting to
re-apply after a resume, or which capability gates it. Methods the table does
not know (newer ones, ``_``-extensions) pass through untouched.
"""

from __future__ import annotations

import enum
from typing import Final

import msgspec


class Method(enum.StrEnum):
    """ACP v1 method names (``session/set_model`` is gone from the spec; older adapters still take it)."""

    INITIALIZE = "initialize"
    AUTHENTICATE = "authenticate"
    LOGOUT = "logout"
    NEW = "session/new"
    LOAD = "session/load"
    RESUME = "session/resume"
    LIST = "session/list"
    DELETE = "session/delete"
    CLOSE = "session/close"
    FORK = "session/fork"
    """Unstable in ACP v1 (not in the schema yet); served when the adapter advertises it."""
    STATUS = "session/status"
    """Unstable (the schema the TypeScript SDK 2.4 ships): served by the proxy itself, from the install's state."""
    ATTACH = "session/attach"
    """From ACP's draft RFD "Multi-Client Session Attach": served by the proxy itself (``relay.sharing``)."""
    DETACH = "session/detach"
    CLAIM_PERMISSION = "session/claim_permission"
    """A client claims an agent's permission request (or elicitation) of the session, to answer it alone
    (``relay.claims``; after the ACP Remote drafts' pending interactions, the name provisional)."""
    PROMPT = "session/prompt"
    CANCEL = "session/cancel"
    SET_MODE = "session/set_mode"
    SET_CONFIG_OPTION = "session/set_config_option"
    SET_MODEL = "session/set_model"
    UPDATE = "session/update"
    REQUEST_PERMISSION = "session/request_permission"
    READ_TEXT_FILE = "fs/read_text_file"
    WRITE_TEXT_FILE = "fs/write_text_file"
    TERMINAL_CREATE = "terminal/create"
    TERMINAL_OUTPUT = "terminal/output"
    TERMINAL_RELEASE = "terminal/release"
    TERMINAL_WAIT_FOR_EXIT = "terminal/wait_for_exit"
    TERMINAL_KILL = "terminal/kill"
    ELICITATION_CREATE = "elicitation/create"
    ELICITATION_COMPLETE = "elicitation/complete"
    CANCEL_REQUEST = "$/cancel_request"


class Direction(enum.Enum):
    TO_AGENT = "client->agent"
    TO_CLIENT = "agent->client"
    BOTH = "both"


class Effect(enum.Enum):
    """What a successful answer does to the sessions an adapter has open."""

    NONE = "none"
    OPENS = "opens"
    """The session the answer (``session/new``) or the request (load, resume) names is open."""
    ENDS = "ends"
    """The session the request names is no longer open on the adapter."""


class MethodFacts(msgspec.Struct, frozen=True):
    direction: Direction
    notification: bool = False
    names_session: bool = False
    """``params.sessionId`` is required: without it the proxy has no session to route to."""
    setting: bool = False
    """A session setting: recorded on success and re-applied after a resume."""
    capability: str | None = None
    """The capability entry that advertises it, a dotted path in the handling side's capabilities
    (``agentCapabilities`` for a client->agent method; ``None``: always there). See ``acp.advertises``."""
    effect: Effect = Effect.NONE


_AGENT: Final = Direction.TO_AGENT
_CLIENT: Final = Direction.TO_CLIENT

METHODS: Final[dict[str, MethodFacts]] = {
    Method.INITIALIZE: MethodFacts(_AGENT),
    Method.AUTHENTICATE: MethodFacts(_AGENT),
    Method.LOGOUT: MethodFacts(_AGENT, capability="auth.logout"),
    Method.NEW: MethodFacts(_AGENT, effect=Effect.OPENS),
    Method.LOAD: MethodFacts(_AGENT, names_session=True, capability="loadSession", effect=Effect.OPENS),
    Method.RESUME: MethodFacts(
        _AGENT, names_session=True, capability="sessionCapabilities.resume", effect=Effect.OPENS
    ),
    Method.LIST: MethodFacts(_AGENT, capability="sessionCapabilities.list"),
    Method.DELETE: MethodFacts(_AGENT, names_session=True, capability="sessionCapabilities.delete", effect=Effect.ENDS),
    Method.FORK: MethodFacts(_AGENT, names_session=True, capability="sessionCapabilities.fork"),
    Method.CLOSE: MethodFacts(_AGENT, names_session=True, capability="sessionCapabilities.close", effect=Effect.ENDS),
    Method.STATUS: MethodFacts(_AGENT, names_session=True, capability="sessionCapabilities.status"),
    Method.ATTACH: MethodFacts(_AGENT, names_session=True, capability="sessionCapabilities.attach"),
    Method.DETACH: MethodFacts(_AGENT, names_session=True, capability="sessionCapabilities.attach"),
    Method.CLAIM_PERMISSION: MethodFacts(_AGENT, names_session=True, capability="sessionCapabilities.attach"),
    Method.PROMPT: MethodFacts(_AGENT, names_session=True),
    Method.CANCEL: MethodFacts(_AGENT, notification=True, names_session=True),
    Method.SET_MODE: MethodFacts(_AGENT, names_session=True, setting=True),
    Method.SET_CONFIG_OPTION: MethodFacts(_AGENT, names_session=True, setting=True),
    Method.SET_MODEL: MethodFacts(_AGENT, names_session=True, setting=True),
    Method.UPDATE: MethodFacts(_CLIENT, notification=True, names_session=True),
    Method.REQUEST_PERMISSION: MethodFacts(_CLIENT, names_session=True),
    Method.READ_TEXT_FILE: MethodFacts(_CLIENT, names_session=True, capability="fs.readTextFile"),
    Method.WRITE_TEXT_FILE: MethodFacts(_CLIENT, names_session=True, capability="fs.writeTextFile"),
    Method.TERMINAL_CREATE: MethodFacts(_CLIENT, names_session=True, capability="terminal"),
    Method.TERMINAL_OUTPUT: MethodFacts(_CLIENT, names_session=True, capability="terminal"),
    Method.TERMINAL_RELEASE: MethodFacts(_CLIENT, names_session=True, capability="terminal"),
    Method.TERMINAL_WAIT_FOR_EXIT: MethodFacts(_CLIENT, names_session=True, capability="terminal"),
    Method.TERMINAL_KILL: MethodFacts(_CLIENT, names_session=True, capability="terminal"),
    Method.ELICITATION_CREATE: MethodFacts(_CLIENT, capability="elicitation"),
    Method.ELICITATION_COMPLETE: MethodFacts(_CLIENT, notification=True, capability="elicitation"),
    Method.CANCEL_REQUEST: MethodFacts(Direction.BOTH, notification=True),
}
"""Every method the proxy knows, with its facts."""

_UNKNOWN: Final = MethodFacts(Direction.BOTH)


def facts(method: str) -> MethodFacts:
    """What the table says of ``method``; an unknown method has no facts the proxy acts on."""
    return METHODS.get(method, _UNKNOWN)


def routed_by_session(method: str) -> bool:
    """A gateway request or notification that must name its session (else it is invalid params)."""
    known = METHODS.get(method)
    return known is not None and known.names_session and known.direction is Direction.TO_AGENT


def is_setting(method: str) -> bool:
    return facts(method).setting
