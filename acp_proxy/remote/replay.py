"""What a dropped event stream missed: the recent messages of one stream, each with its cursor.

Following the draft RFD "Durable and Resumable HTTP Transport" (provisional, as its names are): every
message written to a streamable HTTP event stream gets an opaque cursor, monotonic within its stream,
as its SSE ``id:``. A client whose stream dropped opens it again with ``Last-Event-ID`` and gets what came
after that cursor, once, in order, with the original cursors, then the live stream. A cursor this buffer
cannot answer for (another connection's, a stream's of another target, one older than what is kept, one
never issued) is refused, never answered with a silent live stream.

A message counts as delivered only when the client names a later cursor: what was written to a stream
that then died is still here. The buffer is bounded in messages, bytes and age. No I/O; the clock is an
argument.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any, Final

import msgspec

from acp_proxy.protocol.jsonrpc import RequestId

RESUMABLE_META: Final = "acp/resumable"
"""The ``initialize`` ``_meta`` key by which a client asks for a cursor in every message."""
TURN_STATE_META: Final = "acp/turnState"
RESUME: Final = "stream/resume"
"""A WebSocket's first frame to take over a connection whose socket dropped."""
RESUME_FAILED: Final = "stream/resume_failed"
CLOSE: Final = "stream/close"
"""A WebSocket client's end of its connection, as a DELETE is streamable HTTP's: the server cannot tell a
close from a drop (the client's close code does not reach the application), and waits for a resume."""
CURSOR_META: Final = b'{"_meta":{"acp/cursor":"'


def with_cursor(line: bytes, cursor: str) -> bytes:
    """``line`` (a JSON-RPC message, one object) with ``cursor`` as ``_meta["acp/cursor"]`` in its envelope;
    spliced in, not re-encoded (a cursor is ASCII letters, digits and ``-``)."""
    body = line.lstrip()
    if not body.startswith(b"{") or body[1:].lstrip().startswith(b"}"):
        return line
    return b"".join((CURSOR_META, cursor.encode(), b'"},', body[1:]))


def without_cursor(line: bytes) -> tuple[str | None, bytes]:
    """``with_cursor`` undone: the cursor (``None`` if the line has none) and the line as it was."""
    if not line.startswith(CURSOR_META):
        return None, line
    end = line.find(b'"},', len(CURSOR_META))
    if end < 0:
        return None, line
    return line[len(CURSOR_META) : end].decode("ascii", "replace"), b"{" + line[end + 3 :]


class ReplayLimits(msgspec.Struct, frozen=True, kw_only=True):
    """How much of a stream is kept for a client that resumes it."""

    messages: int = 8000
    """The RFD's ``retentionMessages``."""
    bytes: int = 16 * 2**20
    seconds: float = 300.0
    """The RFD's ``retentionSeconds``."""


SEPARATOR: Final = "-"


class Replay:
    """The recent messages of one stream of a connection, by cursor: kept as the runs they were written in
    (a writer records a run at once), trimmed a message at a time from the oldest."""

    def __init__(self, epoch: str, limits: ReplayLimits) -> None:
        self.epoch = epoch
        """Distinguishes this stream's cursors from another's (of another connection, or target)."""
        self.limits = limits
        self.prefix = f"{epoch}{SEPARATOR}"
        """What every cursor of this stream starts with; its sequence number follows."""
        self._runs: deque[tuple[int, list[bytes], float, int]] = deque()
        """Each run kept: the sequence number of its first message, its messages, when, its size in bytes."""
        self._count = 0
        self._bytes = 0
        self._last = 0
        """The sequence number of the latest cursor issued (0: none yet)."""

    def record(self, line: bytes, now: float) -> str:
        """Keep ``line``, about to be written to the stream: its cursor."""
        return self.record_run((line,), now)[0]

    def record_run(self, lines: Sequence[bytes], now: float) -> list[str]:
        """Keep ``lines``, about to be written to the stream in this order: their cursors."""
        cursors = self.next_cursors(len(lines))
        self.record_lines(lines, now)
        return cursors

    def record_lines(self, lines: Sequence[bytes], now: float) -> int:
        """``record_run`` without making the cursors: the sequence number of the first (``cursor`` makes it)."""
        first = self._last + 1
        if lines:
            size = sum(map(len, lines))
            self._runs.append((first, list(lines), now, size))
            self._last += len(lines)
            self._count += len(lines)
            self._bytes += size
            self._trim(now)
        return first

    def next_cursor(self) -> str:
        """The cursor the next ``record`` gives."""
        return self.cursor(self._last + 1)

    def next_cursors(self, count: int) -> list[str]:
        """The cursors the next ``count`` messages recorded get."""
        first = self._last + 1
        return [self.cursor(sequence) for sequence in range(first, first + count)]

    def cursor(self, sequence: int) -> str:
        return f"{self.prefix}{sequence}"

    def after(self, cursor: str, now: float) -> list[tuple[str, bytes]] | None:
        """What came after ``cursor``, oldest first; ``None`` when this stream cannot say (see the module)."""
        self._trim(now)
        epoch, _, number = cursor.rpartition(SEPARATOR)
        if epoch != self.epoch or not number.isdigit():
            return None
        sequence = int(number)
        if sequence > self._last:
            return None  # never issued
        first = self._runs[0][0] if self._runs else self._last + 1
        if sequence < first - 1:
            return None  # what came right after it is no longer kept
        missed = []
        for start, lines, _, _ in self._runs:
            skip = max(sequence + 1 - start, 0)
            missed += [(self.cursor(start + index), lines[index]) for index in range(skip, len(lines))]
        return missed

    def _trim(self, now: float) -> None:
        """Drop the oldest messages while more are kept than the limits allow (a run of them at a time where
        the whole run must go)."""
        limits, runs = self.limits, self._runs
        while runs:
            start, lines, when, size = runs[0]
            excess = self._count - limits.messages
            over_bytes = self._bytes > limits.bytes and self._bytes - size >= limits.bytes
            if now - when > limits.seconds or excess >= len(lines) or over_bytes:
                runs.popleft()  # every message of it goes (a run shares its time)
                self._count -= len(lines)
                self._bytes -= size
                continue
            if excess <= 0 and self._bytes <= limits.bytes:
                return
            drop = max(excess, 0)
            dropped = sum(map(len, lines[:drop]))
            while self._bytes - dropped > limits.bytes:
                dropped += len(lines[drop])
                drop += 1
            runs[0] = (start + drop, lines[drop:], when, size - dropped)
            self._count -= drop
            self._bytes -= dropped
            return


class TurnStates:
    """Whether each session's turn still runs, for a client back after a drop: the draft's
    ``_meta["acp/turnState"]`` (provisional), ``running`` with the prompt's request id, or ``idle`` with the
    last turn's stop reason."""

    def __init__(self) -> None:
        self._running: dict[str, list[RequestId]] = {}
        self._stopped: dict[str, str | None] = {}

    def started(self, session_id: str, request_id: RequestId) -> None:
        self._running.setdefault(session_id, []).append(request_id)

    def ended(self, session_id: str, request_id: RequestId, stop_reason: str | None) -> None:
        """The prompt ``request_id`` was answered: with ``stop_reason``, or (``None``) an error."""
        running = self._running.get(session_id, [])
        if request_id in running:
            running.remove(request_id)
        if not running:
            self._running.pop(session_id, None)
        self._stopped[session_id] = stop_reason

    def of(self, session_id: str) -> dict[str, Any] | None:
        """The session's turn state; ``None`` for a session no prompt of this connection went to."""
        running = self._running.get(session_id)
        if running:
            return {"state": "running", "requestId": running[0]}
        if session_id not in self._stopped:
            return None
        stop_reason = self._stopped[session_id]
        return {"state": "idle"} if stop_reason is None else {"state": "idle", "stopReason": stop_reason}

    def every(self) -> dict[str, dict[str, Any]]:
        """Each session's turn state, by id."""
        sessions = self._running.keys() | self._stopped.keys()
        return {session_id: state for session_id in sorted(sessions) if (state := self.of(session_id)) is not None}
