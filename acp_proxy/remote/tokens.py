"""Who may use ``serve``: bearer tokens, and which principal owns which session.

Both live in ``remote.db`` in the state dir, apart from the state database, so that a state
dir stays readable by every release that reads ``state.db``. A token is shown once, when it
is made; only its SHA-256 is kept (a token is 256 random bits, so a fast hash is enough: there
is nothing to guess). A principal is ``token:<id>`` for a token, or ``uid:<uid>`` for a peer on
the unix socket, which is the install's own user and sees every session.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import sqlite3
import time
from pathlib import Path
from typing import Final, Literal

import msgspec

DB_NAME: Final = "remote.db"
TOKEN_PREFIX: Final = "acpp_"
NAME_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")

Sees = Literal["own", "all"]

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS tokens (
    token_id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    digest TEXT NOT NULL UNIQUE,
    backends TEXT,
    sees TEXT NOT NULL DEFAULT 'own',
    created_at REAL NOT NULL,
    revoked_at REAL
);
CREATE TABLE IF NOT EXISTS session_owners (
    session_id TEXT PRIMARY KEY,
    principal TEXT NOT NULL,
    created_at REAL NOT NULL
);
"""


class TokenError(Exception):
    """Bad input to a token command: its message says what to fix (exit 2)."""


class Token(msgspec.Struct, frozen=True):
    token_id: str
    name: str
    backends: tuple[str, ...] | None
    """The backends its sessions may use; ``None``: any."""
    sees: Sees
    """``own``: only the sessions it made; ``all``: every session of the install."""
    created_at: float
    revoked_at: float | None = None

    @property
    def principal(self) -> str:
        return f"token:{self.token_id}"


class Principal(msgspec.Struct, frozen=True):
    """Who is asking, once authenticated."""

    key: str
    label: str
    """For logs and reports: the token's name, or ``uid N``."""
    sees: Sees = "own"
    backends: tuple[str, ...] | None = None

    @classmethod
    def of_token(cls, token: Token) -> Principal:
        return cls(key=token.principal, label=token.name, sees=token.sees, backends=token.backends)

    @classmethod
    def local_user(cls, uid: int) -> Principal:
        return cls(key=f"uid:{uid}", label=f"uid {uid}", sees="all")

    def may_use_backend(self, name: str) -> bool:
        return self.backends is None or name in self.backends


def digest_of(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class RemoteStore:
    """``remote.db``: tokens and session owners. Every statement is short; callers off the event loop."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / DB_NAME
        fresh = not self.path.exists()
        self.conn = sqlite3.connect(self.path, timeout=5.0, isolation_level=None, check_same_thread=False)
        if fresh:
            os.chmod(self.path, 0o600)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.executescript(_SCHEMA)
        self._cache: dict[str, Token] = {}
        self._cache_version = -1

    def close(self) -> None:
        self.conn.close()

    # --- tokens ------------------------------------------------------------------------------

    def create(self, name: str, *, backends: tuple[str, ...] | None = None, sees: Sees = "own") -> tuple[Token, str]:
        """A new token named ``name``: its record, and the secret (shown once, never stored)."""
        if not NAME_PATTERN.fullmatch(name):
            raise TokenError(f"token name {name!r}: use letters, digits, '.', '_' or '-' (at most 64)")
        if any(t.name == name and t.revoked_at is None for t in self.tokens()):
            raise TokenError(f"a token named {name!r} exists; revoke it first (acp-proxy token revoke {name})")
        secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
        token = Token(secrets.token_hex(6), name, backends, sees, time.time())
        self.conn.execute(
            "INSERT INTO tokens (token_id, name, digest, backends, sees, created_at) VALUES (?, ?, ?, ?, ?, ?)",
            (
                token.token_id,
                name,
                digest_of(secret),
                json.dumps(list(backends)) if backends is not None else None,
                sees,
                token.created_at,
            ),
        )
        return token, secret

    def tokens(self) -> list[Token]:
        rows = self.conn.execute(
            "SELECT token_id, name, backends, sees, created_at, revoked_at FROM tokens ORDER BY created_at"
        ).fetchall()
        return [_token(row) for row in rows]

    def revoke(self, name: str) -> Token:
        live = [t for t in self.tokens() if t.name == name and t.revoked_at is None]
        if not live:
            raise TokenError(f"no live token named {name!r} (acp-proxy token list shows them)")
        now = time.time()
        self.conn.execute("UPDATE tokens SET revoked_at = ? WHERE token_id = ?", (now, live[0].token_id))
        return msgspec.structs.replace(live[0], revoked_at=now)

    def verify(self, secret: str) -> Token | None:
        """The live token ``secret`` is, or ``None``. Revocations by another process count at once."""
        version = self.conn.execute("PRAGMA data_version").fetchone()[0]
        if version != self._cache_version:
            rows = self.conn.execute(
                "SELECT token_id, name, backends, sees, created_at, revoked_at, digest FROM tokens"
                " WHERE revoked_at IS NULL"
            ).fetchall()
            self._cache = {row[6]: _token(row[:6]) for row in rows}
            self._cache_version = version
        wanted = digest_of(secret)
        for digest, token in self._cache.items():
            if hmac.compare_digest(digest, wanted):
                return token
        return None

    # --- session owners ----------------------------------------------------------------------

    def owner_of(self, session_id: str) -> str | None:
        row = self.conn.execute("SELECT principal FROM session_owners WHERE session_id = ?", (session_id,)).fetchone()
        return str(row[0]) if row is not None else None

    def owned_by(self, principal: str) -> set[str]:
        rows = self.conn.execute("SELECT session_id FROM session_owners WHERE principal = ?", (principal,))
        return {str(row[0]) for row in rows}

    def set_owner(self, session_id: str, principal: str) -> None:
        """``principal`` owns ``session_id`` from now on (a new session: an adapter that issues an id again
        replaces the older session of that id)."""
        self.conn.execute(
            "INSERT OR REPLACE INTO session_owners (session_id, principal, created_at) VALUES (?, ?, ?)",
            (session_id, principal, time.time()),
        )


def _token(row: tuple[object, ...]) -> Token:
    token_id, name, backends, sees, created_at, revoked_at = row
    listed = tuple(json.loads(str(backends))) if backends is not None else None
    return Token(
        str(token_id),
        str(name),
        listed,
        "all" if sees == "all" else "own",
        float(created_at),  # type: ignore[arg-type]
        float(revoked_at) if revoked_at is not None else None,  # type: ignore[arg-type]
    )
