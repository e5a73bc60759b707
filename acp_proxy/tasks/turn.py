"""A turn in progress: what a task records while its prompt runs (events, progress, the agent's text).

``Turn`` is kept in memory by the proxy that runs the prompt and written by the task registry
(``tasks.records``) at most once per flush interval, never per message: the streaming relay only
hands each block to ``Turn.observe``, which keeps a reference and a count and decodes nothing
unless the block mentions a tool call.
"""

from __future__ import annotations

import enum
import logging
import os
import time
from collections.abc import Iterable
from typing import Any, Final

import msgspec

from acp_proxy.config import NotifyPolicy
from acp_proxy.protocol.acp import SESSION_INFO_MARK, session_info_changes
from acp_proxy.state import now
from acp_proxy.tasks.status import Outcome, TaskStatus
from acp_proxy.tasks.updates import Update, agent_text, updates_in

log = logging.getLogger("acp_proxy.tasks")

SUMMARY_CHARS: Final = 500
"""How much of the tail of the agent's text a task keeps."""
MAX_EVENTS: Final = 32
"""Recent events kept per task; the milestones (started, resumed, finished...) are never the ones dropped."""
UNREAD_LIMIT: Final = 1024 * 1024
"""Bytes of streamed updates kept for the next digest (about a second's worth): beyond it the oldest
are dropped unread, which only matters for text that is no longer the tail, and for tool calls in
blocks too large to be checked as they pass (see ``Turn.observe``)."""
SCAN_LIMIT: Final = 8 * 1024
"""Blocks up to this size are checked for tool calls as they are relayed (events on time); larger
ones, which only a burst of streaming makes, at the next digest."""
_DROPPABLE: Final = frozenset({"tool_call", "permission_asked", "permission_answered", "cancel_requested"})


class Limit(enum.StrEnum):
    """A limit past which the proxy cuts a running turn short (cancel, then answer it itself)."""

    TURN_TIMEOUT = "turn_timeout"
    """It ran longer than ``turn_timeout``."""
    TURN_IDLE_TIMEOUT = "turn_idle_timeout"
    """Nothing was heard from it for ``turn_idle_timeout``."""
    SESSION_KILL_MEMORY = "session_kill_memory"
    """Its session's tree grew past ``session_kill_memory``."""


class Event(msgspec.Struct, frozen=True):
    at: float
    kind: str
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"at": self.at, "kind": self.kind, "detail": self.detail}


def keep_recent(events: list[Event], event: Event, limit: int = MAX_EVENTS) -> int:
    """Append ``event``, dropping the oldest routine event beyond ``limit``; the number dropped."""
    events.append(event)
    if len(events) <= limit:
        return 0
    index = next((i for i, e in enumerate(events) if e.kind in _DROPPABLE), 0)
    del events[index]
    return 1


def new_task_id() -> str:
    return os.urandom(6).hex()


class Turn(msgspec.Struct, eq=False):
    """One prompt turn this proxy is serving: its task row's fields, kept current in memory."""

    task_id: str
    session_id: str
    backend: str
    request_id: str
    """The gateway's JSON-RPC id for the prompt, as JSON text."""
    prompt: str = ""
    traceparent: str | None = None
    operation_id: str | None = None
    """The client's id for the prompt, the same on each of its retries (``operation_of``)."""
    answer: bytes | None = None
    """The answer the prompt got, as ``{"result": …}`` or ``{"error": …}`` (kept for a turn with an
    ``operation_id``: its retries get it)."""
    status: TaskStatus = TaskStatus.QUEUED
    created_at: float = msgspec.field(default_factory=now)
    started_at: float | None = None
    first_output_at: float | None = None
    ended_at: float | None = None
    stop_reason: str | None = None
    error: str | None = None
    update_count: int = 0
    tool_calls: int = 0
    summary: str = ""
    events: list[Event] = msgspec.field(default_factory=list)
    events_dropped: int = 0
    lease_id: str | None = None
    dirty: bool = False
    """Progress not yet written to the database."""
    timed_out: bool = False
    cancel_requested: bool = False
    """An operator cancelled it while it was queued: it is answered ``cancelled`` instead of sent."""
    deadline: float | None = None
    """``time.monotonic()`` after which ``turn_timeout`` cancels the turn."""
    idle_limit: float = 0.0
    """``turn_idle_timeout``: the turn is cut once nothing is heard from it this long (0: never)."""
    exchanges: int = 0
    """Requests the agent sent the client during the turn, and the client's answers: progress too."""
    asking: int = 0
    """The agent's requests of the turn the client has not answered yet: while any waits, the
    turn is waiting for the client, not quiet."""
    quiet_since: float = 0.0
    """``time.monotonic()`` when the turn last showed progress, as ``TurnBook.watch`` last saw it."""
    heard: int = -1
    """Progress (``update_count + exchanges``) as ``TurnBook.watch`` last saw it."""
    cut: str | None = None
    """Why the proxy cut the turn short (an idle turn, a tree past its memory limit): kept as its error."""
    cancel_bounded: bool = False
    """A ``session/cancel`` was sent for it and ``cancel_timeout`` counts from the first one."""
    notify: NotifyPolicy | None = None
    """The task's own notification policy, set by an operator; ``None``: the config's ``[tasks] notify``."""
    _unread: list[tuple[bytes, bool]] = msgspec.field(default_factory=list)
    """Blocks relayed since the last digest, each with whether its tool calls have been counted."""
    _unread_bytes: int = 0
    session_info: dict[str, str | None] = msgspec.field(default_factory=dict)
    """What ``session_info_update``s of this turn announced (``title``, ``updatedAt``) and is not
    yet recorded on the session: read where the tool calls are (small blocks at once, bursts at
    the next digest), so that titles cost the streaming path no pass of their own."""

    def event(self, kind: str, detail: str = "") -> None:
        self.events_dropped += keep_recent(self.events, Event(now(), kind, detail))
        self.dirty = True

    def start(self, lease_id: str | None, turn_timeout: float | None, idle_limit: float = 0.0) -> None:
        self.status = TaskStatus.RUNNING
        self.started_at = now()
        self.lease_id = lease_id
        moment = time.monotonic()
        if turn_timeout:
            self.deadline = moment + turn_timeout
        self.idle_limit = idle_limit
        self.quiet_since = moment
        self.event("started", f"lease {lease_id}" if lease_id else "")

    def quiet_for(self, moment: float) -> float:
        """How long nothing has been heard from the turn, counting from its last progress seen
        before ``moment`` (each call notes the progress it sees: ``TurnBook.watch`` calls it)."""
        heard = self.update_count + self.exchanges
        if heard != self.heard:
            self.heard, self.quiet_since = heard, moment
        return moment - self.quiet_since

    def asked(self) -> None:
        """The agent sent the client a request (a permission, a file read) during the turn."""
        self.asking += 1
        self.exchanges += 1

    def answered(self) -> None:
        """The client answered one of the turn's requests."""
        self.asking = max(0, self.asking - 1)
        self.exchanges += 1

    def observe(self, block: bytes, count: int) -> None:
        """``count`` notification lines of this turn were relayed as ``block``: note them, cheaply.

        Nothing is decoded here unless a small block mentions a tool call. Large blocks
        (a burst) are looked at by the next digest, within ``UNREAD_LIMIT``, so that
        recording a turn never costs the streaming path a pass over every byte.
        """
        self.update_count += count
        if self.first_output_at is None:
            self.first_output_at = now()
            self.event("first_output")
        scanned = len(block) <= SCAN_LIMIT
        if scanned and (b'"tool_call"' in block or SESSION_INFO_MARK in block):
            updates = updates_in(block)
            self._count_tool_calls(updates)
            self._note_session_info(updates)
        self._unread.append((block, scanned))
        self._unread_bytes += len(block)
        while self._unread_bytes > UNREAD_LIMIT and len(self._unread) > 1:
            self._unread_bytes -= len(self._unread.pop(0)[0])
        self.dirty = True

    def _count_tool_calls(self, updates: Iterable[Update]) -> None:
        for update in updates:
            if update.sessionUpdate == "tool_call":
                self.tool_calls += 1
                self.event("tool_call", update.title if isinstance(update.title, str) else "")

    def _note_session_info(self, updates: Iterable[Update]) -> None:
        for update in updates:
            if update.sessionUpdate == "session_info_update":
                self.session_info.update(session_info_changes(update.title, update.updatedAt))

    def digest(self) -> None:
        """Fold the updates relayed since the last digest into the text summary (and unseen tool calls)."""
        if not self._unread:
            return
        blocks, self._unread, self._unread_bytes = self._unread, [], 0
        text = []
        for block, scanned in blocks:
            updates = updates_in(block)
            if not scanned:
                self._count_tool_calls(updates)
                self._note_session_info(updates)
            text += [agent_text(update) for update in updates]
        joined = "".join(text)
        if joined:
            self.summary = (self.summary + joined)[-SUMMARY_CHARS:]

    def finish(self, outcome: Outcome) -> None:
        self.digest()
        self.status = outcome.status
        self.stop_reason = outcome.stop_reason
        self.error = outcome.error
        self.ended_at = now()
        detail = outcome.stop_reason or outcome.error or ""
        said = (
            f"{outcome.status.value}: {detail}" if detail and detail != outcome.status.value else outcome.status.value
        )
        self.event("finished", said)
