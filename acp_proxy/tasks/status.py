"""A task's status: the statuses, and how a turn's answer decides its status (pure).

``outcome_of`` is the one table from a turn's answer to its task's status; the rest describes a
prompt for an operator (its ``traceparent``, the start of its text).
"""

from __future__ import annotations

import enum
import re
from typing import Any, Final

import msgspec

from acp_proxy.protocol.jsonrpc import REQUEST_CANCELLED


class TaskStatus(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"
    LOST = "lost"


ACTIVE: Final = frozenset({TaskStatus.QUEUED, TaskStatus.RUNNING})
TERMINAL: Final = frozenset(TaskStatus) - ACTIVE
DONE_STOP_REASONS: Final = frozenset({"end_turn", "max_tokens", "max_turn_requests", "refusal"})

PROMPT_PREVIEW_CHARS: Final = 200
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


class Outcome(msgspec.Struct, frozen=True):
    status: TaskStatus
    stop_reason: str | None = None
    error: str | None = None


def outcome_of(
    *,
    stop_reason: str | None = None,
    error: tuple[int, str] | None = None,
    timed_out: bool = False,
    ended_by: str | None = None,
    cut: str | None = None,
) -> Outcome:
    """How a turn ended, from what the gateway was answered.

    ``error`` is the JSON-RPC error ``(code, message)`` if the answer was one (the
    adapter's own, or the proxy's when the adapter crashed or the proxy shut down);
    ``timed_out`` says the proxy cancelled the turn because ``turn_timeout`` passed:
    the turn is ``timed_out`` if it then ended cancelled; a turn that ended otherwise
    meanwhile (it finished, or its adapter crashed) is recorded as it ended.
    ``ended_by`` says why the proxy answered a cancelled turn itself, before its adapter
    did (``cancel_timeout``): kept as the turn's error, beside its stop reason. ``cut`` says
    why the proxy cancelled the turn (``turn_idle_timeout``, ``session_kill_memory``): kept as
    its error however the cancel ended it.
    """
    message = None if error is None else f"{error[1]} (code {error[0]})"
    cancelled = stop_reason == "cancelled" or (error is not None and error[0] == REQUEST_CANCELLED)
    if timed_out and cancelled:  # ended by the cancel the timeout sent (or the proxy's own answer)
        return Outcome(TaskStatus.TIMED_OUT, stop_reason, message or cut)
    if cut is not None and cancelled:
        return Outcome(TaskStatus.CANCELLED, stop_reason, message or cut)
    if ended_by is not None and stop_reason == "cancelled":
        return Outcome(TaskStatus.CANCELLED, stop_reason, ended_by)
    if error is not None:
        status = TaskStatus.CANCELLED if error[0] == REQUEST_CANCELLED else TaskStatus.FAILED
        return Outcome(status, None, message)
    if stop_reason == "cancelled":
        return Outcome(TaskStatus.CANCELLED, stop_reason)
    if stop_reason is None:
        return Outcome(TaskStatus.FAILED, None, "the agent answered without a stopReason")
    # end_turn, max_tokens, max_turn_requests, refusal, and stop reasons newer than this table:
    # the turn ended normally and the reason says how.
    return Outcome(TaskStatus.DONE, stop_reason)


def effective_status(recorded: TaskStatus, instance_alive: bool) -> TaskStatus:
    """What an operator should be told: an unfinished task whose proxy is gone is lost, swept or not."""
    return TaskStatus.LOST if recorded in ACTIVE and not instance_alive else recorded


def traceparent_of(meta: object) -> str | None:
    """A W3C ``traceparent`` from a request's ``_meta`` (the key ACP reserves for it), if well formed."""
    if isinstance(meta, dict):
        value = meta.get("traceparent")
        if isinstance(value, str) and _TRACEPARENT.match(value):
            return value
    return None


def prompt_preview(params: dict[str, Any]) -> str:
    """The start of a prompt's text, for an operator to tell turns apart."""
    blocks = params.get("prompt")
    texts = []
    if isinstance(blocks, list):
        for block in blocks:
            if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif isinstance(block, dict) and isinstance(block.get("type"), str):
                texts.append(f"[{block['type']}]")
    text = " ".join(" ".join(texts).split())
    return text[:PROMPT_PREVIEW_CHARS] + ("…" if len(text) > PROMPT_PREVIEW_CHARS else "")


MAX_OPERATION_ID: Final = 200


def operation_of(params: dict[str, Any]) -> str | None:
    """A prompt's operation id: the drafts' ``operationId`` in its params, or (a v1 client) in its
    ``_meta``; ``None`` if it has none. ``ValueError`` for one that is not a string of 1 to 200
    characters (a retry it names could not be recognised)."""
    meta = params.get("_meta")
    for holder in (params, meta if isinstance(meta, dict) else {}):
        value = holder.get("operationId")
        if value is None:
            continue
        if not isinstance(value, str) or not 0 < len(value) <= MAX_OPERATION_ID:
            raise ValueError(f"operationId must be a string of 1 to {MAX_OPERATION_ID} characters")
        return value
    return None


class Repeat(enum.Enum):
    """What becomes of a prompt whose operation id its session has seen (``repeat_of``)."""

    RUN = "run"
    """Run it: no earlier one within the window, or that one was lost with its proxy (it never ended)."""
    ANSWER = "answer"
    """Answer it as the earlier one was answered."""
    WAIT = "wait"
    """The earlier one still runs (here, or in the proxy that holds the session): answered once it ends."""


def repeat_of(status: TaskStatus | None, answered: bool, created_at: float, now: float, window: float) -> Repeat:
    """The rule for a prompt repeating an earlier one's operation id, from that one's task (``None``: none)."""
    if status is None or window <= 0 or now - created_at > window or status is TaskStatus.LOST:
        return Repeat.RUN
    if status in ACTIVE:
        return Repeat.WAIT
    return Repeat.ANSWER if answered else Repeat.RUN


def answer_json(*, stop_reason: str | None, error: tuple[int, str] | None) -> bytes:
    """A turn's answer as its retries get it (``{"result": …}`` or ``{"error": …}``), when the proxy made it."""
    if error is not None:
        return msgspec.json.encode({"error": {"code": error[0], "message": error[1]}})
    return msgspec.json.encode({"result": {"stopReason": stop_reason or "end_turn"}})
