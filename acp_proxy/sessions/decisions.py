"""The decisions inside the lifecycle intents, as pure functions and tables: why a session cannot be served,
the stable id of a new session, the answer that opened it, its ownership and visibility row, and what the
proxy answers for a queued request or a turn it cuts short. No I/O; ``tests/test_intents.py`` tables them."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, Final, Literal

from msgspec import Raw

from acp_proxy.journal import SuspendReason
from acp_proxy.protocol import jsonrpc
from acp_proxy.protocol.errors import ProxyError
from acp_proxy.protocol.jsonrpc import Message
from acp_proxy.sessions.lifecycle import Phase
from acp_proxy.sessions.machine import Fate, Standing
from acp_proxy.sessions.registry import Ownership, SessionRecord, SessionState
from acp_proxy.sessions.visibility import SessionRow
from acp_proxy.tasks.turn import Limit

SessionStatus = Literal["open", "saved"]
"""``session/status``'s answers (unstable ACP): in an adapter's memory, or restorable."""

_HOLDS_HERE: Final = frozenset({Phase.LIVE, Phase.RELEASING})
_ASK_THE_INSTALL: Final = frozenset({Phase.ELSEWHERE, Phase.TAKING_OVER})


def status_needs_row(standing: Standing | None) -> bool:
    """Whether ``session_status`` reads the install's row: this proxy does not know the session, or another
    proxy holds it."""
    return standing is None or standing.phase in _ASK_THE_INSTALL


def session_status(standing: Standing | None, row: tuple[SessionState, bool] | None) -> SessionStatus | None:
    """What ``session/status`` answers: ``open`` while a process of the install has the session, ``saved``
    while it can be restored (suspended, closed, being restored, or live in a proxy that is gone), ``None``
    (``-32002``) for a session the install does not know or has deleted.

    ``standing`` is this proxy's own view of it, which comes first (its row may lag its queued writes);
    ``row`` is the install's: the row's state and whether the proxy it names is running.
    """
    if not status_needs_row(standing):
        assert standing is not None
        if standing.phase in (Phase.DELETING, Phase.DELETED):
            return None
        return "open" if standing.phase in _HOLDS_HERE and standing.process else "saved"
    if row is None or row[0] is SessionState.DELETED:
        return None
    state, holder_running = row
    return "open" if state is SessionState.LIVE and holder_running else "saved"


def unknown_session_error(session_id: str, record: SessionRecord | None) -> ProxyError:
    """Why this proxy cannot serve a session, from its row (if any)."""
    if record is not None and record.state is SessionState.CLOSED:
        return ProxyError.session_closed(session_id)
    if record is not None and record.state is SessionState.DELETED:
        return ProxyError.session_deleted(session_id)
    if record is not None:
        return ProxyError.session_in_use(session_id, record.instance_id)
    return ProxyError.unknown_session(session_id)


def stable_id(issued: str, *, taken_here: bool, live_elsewhere: bool) -> str:
    """The id the gateway will know a new session by: the adapter's, unless another session holds it.

    Adapters that number sessions per process give every process's first session the same
    id; a second session with an id already served (here, or live in another proxy) gets a
    proxy-side id, and ``sessionId`` is rewritten on its connection.
    """
    if taken_here or live_elsewhere:
        return f"{issued}~{uuid.uuid4().hex[:8]}"
    return issued


def answered_as(answer: Message, issued: str, stable: str) -> Message | None:
    """The answer that opened a session, under its stable id if that differs from the one the adapter issued."""
    if stable == issued:
        return None
    result = jsonrpc.decode_object(answer.result) or {}
    return Message(jsonrpc="2.0", id=answer.id, result=Raw(jsonrpc.encode_json({**result, "sessionId": stable})))


def ownership_from(meta: dict[str, Any]) -> Ownership:
    def text(key: str) -> str | None:
        value = meta.get(key)
        return value if isinstance(value, str) else None

    return Ownership(
        session_key=text("sessionKey"),
        owner_session_key=text("ownerSessionKey"),
        spawned_by=text("spawnedBy"),
        parent_session_key=text("parentSessionKey"),
        agent_id=text("agentId"),
    )


def visibility_row(record: SessionRecord) -> SessionRow:
    owner = record.ownership
    return SessionRow(
        session_id=record.session_id,
        session_key=owner.session_key,
        owner_session_key=owner.owner_session_key,
        spawned_by=owner.spawned_by,
        parent_session_key=owner.parent_session_key,
        agent_id=owner.agent_id,
        lineage=frozenset(),
    )


CANCELLED: Final = {"stopReason": "cancelled"}
FATE_ERRORS: Final[dict[Fate, Callable[[str, str | None], ProxyError]]] = {
    Fate.WITHDRAWN: lambda session_id, holder: ProxyError.cancelled(),
    Fate.SHUTDOWN: lambda session_id, holder: ProxyError.proxy_shutdown(),
    Fate.CLOSED: lambda session_id, holder: ProxyError.session_closed(session_id),
    Fate.DELETED: lambda session_id, holder: ProxyError.session_deleted(session_id),
    Fate.MOVED: ProxyError.session_moved,
}
"""The error a queued request is answered with, by its fate (``machine.fate_of``), when it is not sent
(from the session's id and the proxy that holds it now, if another does)."""
RECYCLES: Final = frozenset(
    {
        SuspendReason.SESSION_MAX_MEMORY,
        SuspendReason.SESSION_KILL_MEMORY,
        SuspendReason.TURN_IDLE_TIMEOUT,
        SuspendReason.BROKEN,
    }
)
"""Suspensions that recycle a process found unfit (too large, hung, broken), told to the notify command."""
CUT_EVENTS: Final = {
    Limit.TURN_TIMEOUT: "timed_out",
    Limit.TURN_IDLE_TIMEOUT: "idle_timeout",
    Limit.SESSION_KILL_MEMORY: "memory_limit",
}
"""The task event each limit records when it cuts a turn."""
CUT_META: Final = {
    Limit.TURN_TIMEOUT: {"timedOut": True},
    Limit.TURN_IDLE_TIMEOUT: {"timedOut": True, "idle": True},
    Limit.SESSION_KILL_MEMORY: {"memoryLimit": True},
}
"""What the proxy's own answer to a cut turn says, in ``_meta["acp-proxy"]``."""
CUT_REASONS: Final = {
    Limit.TURN_TIMEOUT: SuspendReason.TURN_TIMEOUT,
    Limit.TURN_IDLE_TIMEOUT: SuspendReason.TURN_IDLE_TIMEOUT,
    Limit.SESSION_KILL_MEMORY: SuspendReason.SESSION_KILL_MEMORY,
}
