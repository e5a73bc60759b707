"""Who gets in, and what a principal may touch: pure decisions, table-tested.

Authentication comes before anything else: a request with no valid token learns nothing,
not even whether a connection or session id exists. Once in, a principal that sees only its
own sessions is told that another's session is unknown, exactly as if it did not exist:
identifiers are never credentials.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Mapping
from typing import Final

import msgspec

from acp_proxy.protocol.methods import Method
from acp_proxy.remote.tokens import Principal

FAILED_DELAY_BASE: Final = 0.25
FAILED_DELAY_MAX: Final = 8.0
FAILED_MEMORY: Final = 60.0
"""A client's failed attempts are remembered this long; each one doubles its next delay."""


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or ``None``."""
    if authorization is None:
        return None
    scheme, _, value = authorization.strip().partition(" ")
    value = value.strip()
    return value if scheme.lower() == "bearer" and value else None


def origin_allowed(origin: str | None, allowed: Iterable[str]) -> bool:
    """A request with no ``Origin`` comes from no browser; a browser's must be listed (DNS rebinding)."""
    if origin is None:
        return True
    return origin.rstrip("/") in {o.rstrip("/") for o in allowed}


class Gate(enum.Enum):
    PASS = "pass"
    UNKNOWN = "unknown"
    """Refused as an unknown session: another principal's, or one no principal of ``serve`` owns."""
    BACKEND = "backend"
    """Refused: the principal may not use the backend asked for."""


SESSION_MAKERS: Final = frozenset({Method.NEW})
"""Requests that name no existing session and make one (owned by the asker once answered)."""


def sees_session(principal: Principal, owner: str | None) -> bool:
    """Whether ``principal`` may see and act on a session ``owner`` owns (``None``: no principal of ``serve``)."""
    return principal.sees == "all" or owner == principal.key


def gate(principal: Principal, method: str, session_id: str | None, owner: str | None, backend: str | None) -> Gate:
    """May ``principal`` send ``method`` naming ``session_id`` (owned by ``owner``), for ``backend``?

    ``backend`` is the one a ``session/new`` asks for (``None``: the default, decided by the
    caller before asking). A session no principal owns was made by a local gateway (a stdio
    proxy) or does not exist: only a principal that sees every session may touch it.
    """
    if method in SESSION_MAKERS and backend is not None and not principal.may_use_backend(backend):
        return Gate.BACKEND
    if session_id is None or sees_session(principal, owner):
        return Gate.PASS
    return Gate.UNKNOWN


def visible_sessions(sessions: list[object], principal: Principal, owned: set[str]) -> list[object]:
    """A ``session/list`` page as ``principal`` may see it."""
    if principal.sees == "all":
        return sessions
    return [s for s in sessions if isinstance(s, Mapping) and s.get("sessionId") in owned]


class FailedAttempts(msgspec.Struct):
    """Failed authentications per client address, to slow the next ones down (bounded memory)."""

    recent: dict[str, tuple[int, float]] = msgspec.field(default_factory=dict)
    total: int = 0
    limit: int = 4096

    def delay(self, client: str, now: float | None = None) -> float:
        """Note a failure from ``client``: how long to wait before answering it."""
        now = time.monotonic() if now is None else now
        self.total += 1
        count, last = self.recent.get(client, (0, now))
        count = count + 1 if now - last < FAILED_MEMORY else 1
        if len(self.recent) >= self.limit and client not in self.recent:
            oldest = min(self.recent, key=lambda key: self.recent[key][1])
            del self.recent[oldest]
        self.recent[client] = (count, now)
        return float(min(FAILED_DELAY_BASE * 2 ** (count - 1), FAILED_DELAY_MAX))
