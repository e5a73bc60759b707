"""The ``/acp`` endpoint's routing, as ACP's transport RFD gives it: one table, no I/O.

    GET    + Upgrade: websocket                     -> WebSocket
    GET    (Accept: text/event-stream, connection)  -> the connection's stream, or a session's
    POST   initialize, no connection id             -> a new connection, 200 with the answer
    POST   anything else                            -> to the connection's proxy, 202
    DELETE (connection id)                          -> end the connection, 202

Refusals: 400 no connection id (or a session-scoped request without ``Acp-Session-Id``, or one
naming another session than its body), 404 not ``/acp`` (unknown ids are the caller's, once
authenticated), 405 another method, 406 a GET that does not accept ``text/event-stream``, 415 a
POST that is not JSON, 501 a batch.
"""

from __future__ import annotations

import enum
from typing import Final

import msgspec

from acp_proxy.protocol.methods import Method, routed_by_session

ENDPOINT: Final = "/acp"
SESSION_HEADER_OPTIONAL: Final = frozenset({Method.LOAD, Method.RESUME, Method.FORK, Method.CLOSE, Method.DELETE})
"""Requests naming a session they may not hold a stream for yet: ``Acp-Session-Id`` is optional."""


class Route(enum.Enum):
    WEBSOCKET = enum.auto()
    STREAM = enum.auto()
    INITIALIZE = enum.auto()
    """A POST of ``initialize`` with no connection id: a new connection."""
    POST = enum.auto()
    DELETE = enum.auto()


class Head(msgspec.Struct, frozen=True):
    """What routing reads of a request: its method, path and the headers that matter."""

    method: str
    path: str
    upgrade: str | None = None
    accept: str | None = None
    content_type: str | None = None
    connection_id: str | None = None
    session_id: str | None = None
    last_event_id: str | None = None
    """An event stream's ``Last-Event-ID``: resume it after that cursor (``remote.replay``)."""


class Body(msgspec.Struct, frozen=True):
    """What routing reads of a POST's JSON-RPC message."""

    batch: bool = False
    method: str | None = None
    session_id: str | None = None


class Refused(msgspec.Struct, frozen=True):
    status: int
    message: str


def route(head: Head, body: Body | None = None) -> Route | Refused:
    """Where a request goes, or the status that refuses it. ``body`` is read for a POST only."""
    if head.path.rstrip("/") != ENDPOINT:
        return Refused(404, f"not found: ACP is served at {ENDPOINT}")
    if head.method == "GET":
        if head.upgrade is not None and head.upgrade.lower() == "websocket":
            return Route.WEBSOCKET
        if "text/event-stream" not in (head.accept or ""):
            return Refused(406, "a GET stream must accept text/event-stream")
        if head.connection_id is None:
            return Refused(400, "missing Acp-Connection-Id: POST initialize first")
        return Route.STREAM
    if head.method == "DELETE":
        return Route.DELETE if head.connection_id is not None else Refused(400, "missing Acp-Connection-Id")
    if head.method != "POST":
        return Refused(405, f"method {head.method} not allowed at {ENDPOINT}")
    if (head.content_type or "").split(";")[0].strip().lower() != "application/json":
        return Refused(415, "a POST body must be application/json")
    assert body is not None
    if body.batch:
        return Refused(501, "batch requests are not supported")
    if head.connection_id is None:
        if body.method == Method.INITIALIZE:
            return Route.INITIALIZE
        return Refused(400, "missing Acp-Connection-Id: POST initialize first")
    if body.method is not None and body.session_id is not None and routed_by_session(body.method):
        if head.session_id is None and body.method not in SESSION_HEADER_OPTIONAL:
            return Refused(400, f"{body.method} is session-scoped: send Acp-Session-Id")
        if head.session_id is not None and head.session_id != body.session_id:
            return Refused(400, "Acp-Session-Id names another session than the message's sessionId")
    return Route.POST
