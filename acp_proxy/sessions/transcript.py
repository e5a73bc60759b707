"""Each session's transcript: what its gateway saw, kept bounded, for ``session/attach`` and operators.

A transcript holds, in order, the notifications relayed to the session's gateway (its
``session/update``s, a ``session/load``'s replay included), the prompts it was sent and by whom,
and the requests the agent made of the client with who answered them. Nothing else: never the
``authenticate`` params, a ``session/new``'s ``mcpServers`` (their ``env`` holds secrets) or the
proxy's environment.

It lives in ``transcripts.db`` in the state dir, apart from the state database (so a state dir
stays readable by every release that reads ``state.db``), as chunks: one row per session per
flush, each a run of JSON lines (``Entry``). Recording is an append to an in-memory buffer (the
streaming path pays one ``list.append`` per block); the buffers are written by ``flush``, in a
worker thread, every ``FLUSH_EVERY`` seconds and when the proxy stops. Each session keeps its
newest ``transcript_max_bytes`` (older chunks are deleted, a single larger chunk is cut at a
line); a session's transcript goes when the session is deleted, and every entry older than the
tasks' ``retention`` goes with the tasks.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Final, TypeVar

import anyio
import anyio.to_thread
import msgspec

from acp_proxy.state.connection import connect

log = logging.getLogger("acp_proxy.transcript")

T = TypeVar("T")

DB_NAME: Final = "transcripts.db"
FLUSH_EVERY: Final = 1.0
"""Seconds between writes of the buffered entries (what ``sessions show --transcript`` may lag by)."""

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS transcript (
    session_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    first_at REAL NOT NULL,
    last_at REAL NOT NULL,
    bytes INTEGER NOT NULL,
    body BLOB NOT NULL,
    PRIMARY KEY (session_id, seq)
);
CREATE INDEX IF NOT EXISTS transcript_by_age ON transcript (last_at);
"""


class EntryKind(enum.StrEnum):
    UPDATE = "update"
    """A notification the gateway was sent (a ``session/update``, a load's replay, an extension's)."""
    PROMPT = "prompt"
    """A ``session/prompt`` request, as it went to the agent; ``by`` who sent it."""
    ASKED = "asked"
    """A request of the agent's to the client (``session/request_permission``, ``elicitation/create``)."""
    ANSWERED = "answered"
    """Such a request answered: ``message`` is ``{"request": key, "outcome": ...}``; ``by`` who answered."""
    ATTACHED = "attached"
    DETACHED = "detached"


class Entry(msgspec.Struct, frozen=True, omit_defaults=True):
    """One line of a transcript."""

    at: float
    kind: str
    message: msgspec.Raw
    by: str | None = None


_decode_entry: Final = msgspec.json.Decoder(Entry).decode


Buffered = tuple[float, str, str | None, bytes]
"""An entry recorded and not yet written: when, its kind, who, and its message (or a block of them)."""


def encode_entries(pending: Iterable[Buffered]) -> bytes:
    """The JSON lines of buffered entries; a buffered message may be a block of several lines."""
    out: list[bytes] = []
    for at, kind, by, message in pending:
        head = b'{"at":%.3f,"kind":"%s"' % (at, kind.encode())
        if by is not None:
            head += b',"by":' + msgspec.json.encode(by)
        prefix = head + b',"message":'
        body = message[:-1] if message.endswith(b"\n") else message
        if body and b"\n\n" not in body and not body.startswith(b"\n"):
            # A block of whole lines (the streaming path): wrapped with one replace, not a split and a join.
            out.append(prefix + body.replace(b"\n", b"}\n" + prefix) + b"}\n")
            continue
        for line in message.split(b"\n"):
            if line.strip():
                out.append(prefix + line + b"}\n")
    return b"".join(out)


def newest(entries: list[Buffered], limit: int) -> list[Buffered]:
    """The newest entries whose messages come to ``limit`` bytes (all, if they come to less): what is
    kept of a flood, found before encoding it (an entry encoded is only longer)."""
    size = 0
    for start in range(len(entries) - 1, -1, -1):
        size += len(entries[start][3])
        if size >= limit:
            return entries[start:]
    return entries


def decode_entries(body: bytes) -> list[Entry]:
    """The entries of a run of JSON lines; a line that does not decode is skipped (logged)."""
    entries: list[Entry] = []
    for line in body.split(b"\n"):
        if not line:
            continue
        try:
            entries.append(_decode_entry(line))
        except msgspec.DecodeError:
            log.warning("transcript: an entry that does not decode was skipped")
    return entries


def cut_to(body: bytes, limit: int) -> bytes:
    """The newest whole lines of ``body`` that fit in ``limit`` bytes."""
    if len(body) <= limit:
        return body
    start = body.find(b"\n", len(body) - limit - 1) + 1
    return body[start:] if 0 < start < len(body) else b""


class _Buffer:
    __slots__ = ("entries", "size")

    def __init__(self) -> None:
        self.entries: list[Buffered] = []
        self.size = 0


class Transcripts:
    """The transcripts of a state dir: recorded on the event loop, written and read in worker threads."""

    def __init__(self, state_dir: Path, max_bytes: int) -> None:
        self.path = state_dir / DB_NAME
        self.max_bytes = max_bytes
        self._buffers: dict[str, _Buffer] = {}
        self._forgotten: set[str] = set()
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        """One connection, used by one thread at a time."""
        self._flushing = anyio.Lock()
        """Held by a flush, and by a read that must see every entry exactly once."""
        self.failed_writes = 0

    # --- recording (on the event loop) -------------------------------------------------------------

    def record(self, session_id: str, kind: EntryKind, message: bytes, by: str | None = None) -> None:
        """Note one message (or a block of notification lines) of the session's."""
        if self.max_bytes <= 0:
            return
        buffer = self._buffers.get(session_id)
        if buffer is None:
            buffer = self._buffers[session_id] = _Buffer()
        buffer.entries.append((time.time(), kind.value, by, message))
        buffer.size += len(message)
        if buffer.size > 2 * self.max_bytes:  # a flood between two flushes: the oldest half goes now
            dropped = 0
            while buffer.size > self.max_bytes and dropped < len(buffer.entries) - 1:
                buffer.size -= len(buffer.entries[dropped][3])
                dropped += 1
            del buffer.entries[:dropped]

    def forget(self, session_id: str) -> None:
        """The session is deleted: its transcript goes (its rows with the next flush)."""
        self._buffers.pop(session_id, None)
        self._forgotten.add(session_id)

    # --- writing (worker thread) -------------------------------------------------------------------

    async def keep_flushing(self) -> None:
        """Write the buffers every ``FLUSH_EVERY`` seconds, until cancelled (then once more, shielded)."""
        try:
            while True:
                await anyio.sleep(FLUSH_EVERY)
                await self.flush()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(5.0):
                await self.flush()

    async def flush(self) -> None:
        """Write what was recorded since the last flush (errors are logged: a transcript is not a record)."""
        async with self._flushing:
            await self._flush()

    async def _flush(self) -> None:
        if not self._buffers and not self._forgotten:
            return
        buffers, self._buffers = self._buffers, {}
        forgotten, self._forgotten = self._forgotten, set()
        try:
            await anyio.to_thread.run_sync(self._write, buffers, forgotten)  # encoded there too: off the loop
        except sqlite3.Error as exc:
            self.failed_writes += 1
            log.error("transcript: could not write %d session(s)' entries: %s", len(buffers), exc)

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            conn = connect(self.path, check_same_thread=False)
            with contextlib.suppress(OSError):
                self.path.chmod(0o600)
            conn.execute("PRAGMA journal_mode = WAL")
            conn.executescript(_SCHEMA)
            self._conn = conn
        return self._conn

    def _write(self, buffers: dict[str, _Buffer], forgotten: set[str]) -> None:
        chunks: dict[str, tuple[float, float, bytes]] = {}
        for session_id, buffer in buffers.items():
            body = cut_to(encode_entries(newest(buffer.entries, self.max_bytes)), self.max_bytes)
            if body:
                chunks[session_id] = (buffer.entries[0][0], buffer.entries[-1][0], body)
        if not chunks and not forgotten:
            return
        with self._lock:
            conn = self._connection()
            conn.execute("BEGIN IMMEDIATE")
            try:
                for session_id in forgotten:
                    conn.execute("DELETE FROM transcript WHERE session_id = ?", (session_id,))
                for session_id, (first_at, last_at, body) in chunks.items():
                    conn.execute(
                        """INSERT INTO transcript (session_id, seq, first_at, last_at, bytes, body)
                           VALUES (?, (SELECT COALESCE(MAX(seq), 0) + 1 FROM transcript WHERE session_id = ?),
                                   ?, ?, ?, ?)""",
                        (session_id, session_id, first_at, last_at, len(body), body),
                    )
                    self._trim(conn, session_id)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

    def _trim(self, conn: sqlite3.Connection, session_id: str) -> None:
        """Delete the session's oldest chunks beyond ``max_bytes``."""
        kept = 0
        rows = conn.execute(
            "SELECT seq, bytes FROM transcript WHERE session_id = ? ORDER BY seq DESC", (session_id,)
        ).fetchall()
        for seq, size in rows:
            kept += size
            if kept > self.max_bytes:
                conn.execute("DELETE FROM transcript WHERE session_id = ? AND seq <= ?", (session_id, seq))
                return

    def prune(self, retention: float, exists: Callable[[list[str]], set[str]] | None = None) -> int:
        """Delete entries older than ``retention`` seconds, and (given ``exists``) the transcripts of
        sessions the state database no longer has; how many chunks (blocks the calling thread)."""
        if not self.path.exists():
            return 0
        with self._lock:
            conn = self._connection()
            pruned = conn.execute("DELETE FROM transcript WHERE last_at < ?", (time.time() - retention,)).rowcount
            if exists is not None:
                ids = [row[0] for row in conn.execute("SELECT DISTINCT session_id FROM transcript")]
                for session_id in set(ids) - exists(ids):
                    pruned += conn.execute("DELETE FROM transcript WHERE session_id = ?", (session_id,)).rowcount
            return int(pruned)

    # --- reading -----------------------------------------------------------------------------------

    async def read_then(self, session_id: str, then: Callable[[list[Entry]], T]) -> T:
        """``then(entries)``: the session's whole transcript, oldest first, handed over at one instant
        of the event loop, so that what ``then`` starts (an attachment's stream) follows it with
        nothing lost and nothing twice."""
        async with self._flushing:  # no flush can move entries between the rows and the buffer meanwhile
            await self._flush()
            committed = await anyio.to_thread.run_sync(self._read, session_id)
            buffer = self._buffers.get(session_id)
            fresh = encode_entries(buffer.entries) if buffer is not None else b""
            return then(decode_entries(cut_to(committed + fresh, self.max_bytes)))

    def _read(self, session_id: str) -> bytes:
        if not self.path.exists():
            return b""
        with self._lock:
            rows = self._connection().execute(
                "SELECT body FROM transcript WHERE session_id = ? ORDER BY seq", (session_id,)
            )
            return b"".join(row[0] for row in rows)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def read_transcript(state_dir: Path, session_id: str) -> list[Entry]:
    """A session's transcript as written (an operator's read: a proxy's last second may be missing)."""
    path = state_dir / DB_NAME
    if not path.exists():
        return []
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
    try:
        try:
            rows = conn.execute("SELECT body FROM transcript WHERE session_id = ? ORDER BY seq", (session_id,))
            return decode_entries(b"".join(row[0] for row in rows))
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):
                return []
            raise
    finally:
        conn.close()
