"""A session's lifecycle in this proxy: its phases, the events that move it, and what each step does.

One table, ``STEPS``, maps every (phase, event) pair to the next phase and the actions the
step takes, or to a refusal that says why the event does not apply. ``step`` reads it; it
does no I/O and keeps no state. ``SessionTable.advance`` is the only code that assigns a
session's phase, and it does so only as this table says; it also carries out the actions that
are memory alone (``NEW_EPOCH``, ``CUT_SHORT``, ``UNBIND``), and the intents perform the rest.
``docs/architecture.md`` shows the same table (``markdown_table`` renders it; a test checks
that the two agree).

The phase is the proxy's own view of a session it holds in memory. The registry's row
(``SessionState``) follows it through the write actions: ``suspended``, ``resuming``,
``live``, ``closed``, ``deleted``. Where a step both writes and answers, the table says
whether the answer waits for the write (``ANSWER_AFTER_WRITE``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final

import msgspec


class Phase(enum.StrEnum):
    """Where a session held in memory stands."""

    SUSPENDED = "suspended"
    """No process: resumable, and resumed by its next request."""
    RESUMING = "resuming"
    """Being restored on a fresh process (from its queue: its requests wait behind)."""
    LIVE = "live"
    """A process serves it; requests go to it in the order the gateway sent them."""
    REOPENING = "reopening"
    """A closed session being restored for the gateway's own ``session/load`` or ``session/resume``."""
    CLOSING = "closing"
    """Closed by the gateway or an operator: what waits is answered, then its tree is reaped."""
    CLOSED = "closed"
    """Closed: only the gateway's own load or resume reopens it."""
    DELETING = "deleting"
    """Deleted: ended as a close, its row a tombstone from the reap's start."""
    DELETED = "deleted"
    """Gone for good: never listed or restored again."""
    RELEASING = "releasing"
    """Live here, and asked for by another proxy of the install: handed to it once nothing of it runs (the
    turn under way goes on undisturbed); requests that arrive meanwhile wait."""
    ELSEWHERE = "elsewhere"
    """Held by another proxy of the install (``Standing.holder``), or handed to it from here: a request that
    needs a process here, or the gateway's load or resume, has it handed over first."""
    TAKING_OVER = "taking_over"
    """Its holder is being asked to release it (within ``[sessions] handover_timeout``)."""


class Event(enum.StrEnum):
    """What can happen to a session."""

    REQUEST = "request"
    """A request for it from the gateway (a prompt, a setting, anything but those below)."""
    CANCEL = "cancel"
    """``session/cancel``: its prompts end ``cancelled``."""
    RESTORE = "restore"
    """Its queue's turn to bring it back: a request needs a process, or the gateway loads or resumes it."""
    RESTORED = "restored"
    """A fresh process serves it."""
    RESTORE_FAILED = "restore_failed"
    """The restore did not take (refused, timed out, or cut short by a close)."""
    SUSPEND = "suspend"
    """The pool, the idle TTL, an operator or a deadline asks that its process be stopped."""
    PROCESS_ENDED = "process_ended"
    """Its process exited (a crash, or a stop it did not ask for)."""
    HANDED_OVER = "handed_over"
    """``session/fork``: its process now serves the fork."""
    CLOSE = "close"
    """``session/close``, from the gateway or an operator."""
    DELETE = "delete"
    """``session/delete``."""
    REAP = "reap"
    """Its queue's turn to end what runs and stop its tree (after a close or delete)."""
    REAPED = "reaped"
    """Its tree is gone."""
    RELEASE = "release"
    """Another proxy of the install asks for it (``Release``: which one); it waits its turn in the queue."""
    QUIET = "quiet"
    """Nothing of it runs on its process: no turn, no request either way (fed while it is ``releasing``)."""
    RELEASE_EXPIRED = "release_expired"
    """The asker's ``handover_timeout`` passed with a turn still running: it stays here."""
    TAKE_OVER = "take_over"
    """Its turn in the queue has come, and it is held elsewhere: ask its holder for it."""
    RELEASED = "released"
    """Its holder let it go, or is gone: it is this proxy's now, suspended."""
    HELD_ELSEWHERE = "held_elsewhere"
    """Restoring it here, its claim found another live proxy of the install holding it (``HeldBy``: which)."""
    KEPT = "kept"
    """Its holder kept it (a turn ran past ``handover_timeout``): what needed it is refused ``session_busy``."""


class Action(enum.StrEnum):
    """What a step does. The ``WRITE_*`` actions are the registry's rows; the others, the proxy's work."""

    SEND = "send"
    """Send the request to its process, behind whatever the session's queue holds."""
    QUEUE = "queue"
    """Queue the request. When its turn comes it is sent, restoring the session first if need be, or
    answered instead: withdrawn, cancelled (a prompt of an earlier epoch), closed, deleted."""
    NEW_EPOCH = "new_epoch"
    """Prompts queued so far are answered ``cancelled`` when their turn comes."""
    ASK_TO_END_TURN = "ask_to_end_turn"
    """``session/cancel`` to the process for the turn it runs."""
    WAIT_FOR_STOP = "wait_for_stop"
    """Wait until its previous process is gone, before another starts."""
    CLAIM = "claim"
    """Claim the row for this proxy (``resuming``), awaited: another proxy may hold the session."""
    BIND = "bind"
    """The process serves it from now on."""
    UNBIND = "unbind"
    """Its process serves it no more."""
    STOP_PROCESS = "stop_process"
    """Stop the process in the background."""
    CUT_SHORT = "cut_short"
    """Cancel the restore (or fork) in progress."""
    QUEUE_REAP = "queue_reap"
    """Queue the reap, behind what the gateway sent before."""
    END_TURNS = "end_turns"
    """Ask the running turn to end, give it ``close_timeout``, answer the rest (prompts ``cancelled``)."""
    FORGET = "forget"
    """Drop it from memory."""
    JOURNAL = "journal"
    """Record the step in the journal (suspended, crashed, resumed, closed)."""
    RELEASE_CLAIM = "release_claim"
    """Give the row back as it was before the claim (``suspended``, or ``closed`` for a reopen)."""
    WRITE_LIVE = "write_live"
    WRITE_SUSPENDED = "write_suspended"
    WRITE_CLOSED = "write_closed"
    WRITE_DELETED = "write_deleted"
    ANSWER_AFTER_WRITE = "answer_after_write"
    """The gateway's request is answered once the row says so."""
    ASK_RELEASE = "ask_release"
    """Ask its holder, through its control socket, to release it (bounded by ``handover_timeout``)."""
    WRITE_HANDED = "write_handed"
    """The row: ``resuming`` under the proxy that asked, so that only it can claim it, before it is told."""
    ANSWER_RELEASED = "answer_released"
    """Tell the proxy that asked that the session is its now (once the row says so)."""


class Step(msgspec.Struct, frozen=True):
    """The next phase and the actions to take, or a refusal: the event does not apply in this phase."""

    phase: Phase
    actions: tuple[Action, ...] = ()
    refused: str | None = None


P, E, A = Phase, Event, Action

_ENDING: Final = (A.NEW_EPOCH, A.QUEUE_REAP)
_ENDING_A_RESTORE: Final = (A.NEW_EPOCH, A.CUT_SHORT, A.QUEUE_REAP)

# Every pair not listed here is refused with the reason in ``_WHY_REFUSED``.
_STEPS: Final[dict[tuple[Phase, Event], tuple[Phase, tuple[Action, ...]]]] = {
    (P.SUSPENDED, E.REQUEST): (P.SUSPENDED, (A.QUEUE,)),
    (P.SUSPENDED, E.CANCEL): (P.SUSPENDED, (A.NEW_EPOCH,)),
    (P.SUSPENDED, E.RESTORE): (P.RESUMING, (A.WAIT_FOR_STOP, A.CLAIM)),
    (P.SUSPENDED, E.PROCESS_ENDED): (P.SUSPENDED, (A.UNBIND, A.JOURNAL)),
    (P.SUSPENDED, E.CLOSE): (P.CLOSING, _ENDING),
    (P.SUSPENDED, E.DELETE): (P.DELETING, _ENDING),
    (P.RESUMING, E.REQUEST): (P.RESUMING, (A.QUEUE,)),
    (P.RESUMING, E.CANCEL): (P.RESUMING, (A.NEW_EPOCH,)),
    (P.RESUMING, E.RESTORED): (P.LIVE, (A.WRITE_LIVE, A.BIND, A.JOURNAL)),
    (P.RESUMING, E.RESTORE_FAILED): (P.SUSPENDED, (A.RELEASE_CLAIM, A.STOP_PROCESS)),
    (P.RESUMING, E.PROCESS_ENDED): (P.RESUMING, (A.UNBIND, A.JOURNAL)),
    (P.RESUMING, E.CLOSE): (P.CLOSING, _ENDING_A_RESTORE),
    (P.RESUMING, E.DELETE): (P.DELETING, _ENDING_A_RESTORE),
    (P.LIVE, E.REQUEST): (P.LIVE, (A.SEND,)),
    (P.LIVE, E.CANCEL): (P.LIVE, (A.NEW_EPOCH, A.ASK_TO_END_TURN)),
    (P.LIVE, E.RESTORE): (P.RESUMING, (A.WAIT_FOR_STOP, A.CLAIM)),
    (P.LIVE, E.SUSPEND): (P.SUSPENDED, (A.UNBIND, A.WRITE_SUSPENDED, A.JOURNAL, A.STOP_PROCESS)),
    (P.LIVE, E.PROCESS_ENDED): (P.SUSPENDED, (A.UNBIND, A.WRITE_SUSPENDED, A.JOURNAL)),
    (P.LIVE, E.HANDED_OVER): (P.SUSPENDED, (A.UNBIND, A.WRITE_SUSPENDED)),
    (P.LIVE, E.CLOSE): (P.CLOSING, _ENDING_A_RESTORE),
    (P.LIVE, E.DELETE): (P.DELETING, _ENDING_A_RESTORE),
    (P.REOPENING, E.REQUEST): (P.REOPENING, (A.QUEUE,)),
    (P.REOPENING, E.CANCEL): (P.REOPENING, (A.NEW_EPOCH,)),
    (P.REOPENING, E.RESTORED): (P.LIVE, (A.WRITE_LIVE, A.BIND, A.JOURNAL)),
    (P.REOPENING, E.RESTORE_FAILED): (P.CLOSED, (A.RELEASE_CLAIM, A.STOP_PROCESS)),
    (P.REOPENING, E.CLOSE): (P.CLOSING, _ENDING_A_RESTORE),
    (P.REOPENING, E.DELETE): (P.DELETING, _ENDING_A_RESTORE),
    (P.CLOSING, E.REQUEST): (P.CLOSING, (A.QUEUE,)),
    (P.CLOSING, E.CANCEL): (P.CLOSING, (A.NEW_EPOCH, A.ASK_TO_END_TURN)),
    (P.CLOSING, E.RESTORE_FAILED): (P.CLOSING, (A.RELEASE_CLAIM, A.STOP_PROCESS)),
    (P.CLOSING, E.PROCESS_ENDED): (P.CLOSING, (A.UNBIND,)),
    (P.CLOSING, E.DELETE): (P.DELETING, (A.NEW_EPOCH, A.QUEUE_REAP)),
    (P.CLOSING, E.REAP): (P.CLOSING, (A.UNBIND, A.END_TURNS, A.STOP_PROCESS)),
    (P.CLOSING, E.REAPED): (P.CLOSED, (A.WRITE_CLOSED, A.FORGET, A.JOURNAL, A.ANSWER_AFTER_WRITE)),
    (P.CLOSED, E.REQUEST): (P.CLOSED, (A.QUEUE,)),
    (P.CLOSED, E.RESTORE): (P.REOPENING, (A.WAIT_FOR_STOP, A.CLAIM)),
    (P.CLOSED, E.CLOSE): (P.CLOSING, _ENDING),
    (P.CLOSED, E.DELETE): (P.DELETING, _ENDING),
    (P.DELETING, E.REQUEST): (P.DELETING, (A.QUEUE,)),
    (P.DELETING, E.CANCEL): (P.DELETING, (A.NEW_EPOCH, A.ASK_TO_END_TURN)),
    (P.DELETING, E.RESTORE_FAILED): (P.DELETING, (A.RELEASE_CLAIM, A.STOP_PROCESS)),
    (P.DELETING, E.PROCESS_ENDED): (P.DELETING, (A.UNBIND,)),
    (P.DELETING, E.REAP): (P.DELETING, (A.WRITE_DELETED, A.UNBIND, A.END_TURNS, A.STOP_PROCESS)),
    (P.DELETING, E.REAPED): (P.DELETED, (A.FORGET, A.JOURNAL, A.ANSWER_AFTER_WRITE)),
    # handing a session to another proxy of the install (the holder's side) ...
    (P.LIVE, E.RELEASE): (P.RELEASING, ()),
    (P.SUSPENDED, E.RELEASE): (P.ELSEWHERE, (A.WRITE_HANDED, A.JOURNAL, A.ANSWER_RELEASED)),
    (P.CLOSED, E.RELEASE): (P.ELSEWHERE, (A.ANSWER_RELEASED,)),
    (P.ELSEWHERE, E.RELEASE): (P.ELSEWHERE, (A.ANSWER_RELEASED,)),
    (P.RELEASING, E.REQUEST): (P.RELEASING, (A.QUEUE,)),
    (P.RELEASING, E.CANCEL): (P.RELEASING, (A.NEW_EPOCH, A.ASK_TO_END_TURN)),
    (P.RELEASING, E.QUIET): (P.ELSEWHERE, (A.UNBIND, A.WRITE_HANDED, A.JOURNAL, A.STOP_PROCESS, A.ANSWER_RELEASED)),
    (P.RELEASING, E.PROCESS_ENDED): (P.ELSEWHERE, (A.UNBIND, A.WRITE_HANDED, A.JOURNAL, A.ANSWER_RELEASED)),
    (P.RELEASING, E.RELEASE_EXPIRED): (P.LIVE, ()),
    (P.RELEASING, E.CLOSE): (P.CLOSING, _ENDING_A_RESTORE),
    (P.RELEASING, E.DELETE): (P.DELETING, _ENDING_A_RESTORE),
    # ... and taking one over (the asker's side)
    (P.ELSEWHERE, E.REQUEST): (P.ELSEWHERE, (A.QUEUE,)),
    (P.ELSEWHERE, E.CANCEL): (P.ELSEWHERE, (A.NEW_EPOCH,)),
    (P.ELSEWHERE, E.TAKE_OVER): (P.TAKING_OVER, (A.ASK_RELEASE,)),
    (P.TAKING_OVER, E.REQUEST): (P.TAKING_OVER, (A.QUEUE,)),
    (P.TAKING_OVER, E.CANCEL): (P.TAKING_OVER, (A.NEW_EPOCH,)),
    (P.TAKING_OVER, E.RELEASED): (P.SUSPENDED, (A.JOURNAL,)),
    (P.TAKING_OVER, E.KEPT): (P.ELSEWHERE, ()),
    (P.RESUMING, E.HELD_ELSEWHERE): (P.ELSEWHERE, ()),
    (P.REOPENING, E.HELD_ELSEWHERE): (P.ELSEWHERE, ()),
}

_WHY_REFUSED: Final[dict[Event, str]] = {
    E.REQUEST: "a deleted session is answered from its row",
    E.CANCEL: "nothing of it runs or waits",
    E.RESTORE: "it is not waiting for a process",
    E.RESTORED: "no restore is in progress",
    E.RESTORE_FAILED: "no restore is in progress",
    E.SUSPEND: "only a live session is suspended",
    E.PROCESS_ENDED: "no process serves it",
    E.HANDED_OVER: "only a live session's process serves a fork",
    E.CLOSE: "it is being closed or deleted already, or deleted",
    E.DELETE: "it is deleted, or being deleted, already",
    E.REAP: "it is not being closed or deleted",
    E.REAPED: "no reap is in progress",
    E.RELEASE: "it is being restored, closed, deleted or taken over here: the release waits its turn in the queue",
    E.QUIET: "it is not being released",
    E.RELEASE_EXPIRED: "it is not being released",
    E.TAKE_OVER: "it is not held by another proxy",
    E.RELEASED: "it is not being taken over",
    E.KEPT: "it is not being taken over",
    E.HELD_ELSEWHERE: "it is not being claimed",
}

_WHY_REFUSED_IN: Final[dict[Phase, str]] = {
    P.ELSEWHERE: "another proxy of the install holds it: it is taken over first",
    P.TAKING_OVER: "it is being taken over from another proxy of the install",
}
"""Where a phase says more about a refusal than the event does."""

STEPS: Final[Mapping[tuple[Phase, Event], Step]] = {
    (phase, event): (
        Step(*_STEPS[phase, event])
        if (phase, event) in _STEPS
        else Step(phase, refused=_WHY_REFUSED_IN.get(phase, _WHY_REFUSED[event]))
    )
    for phase in Phase
    for event in Event
}
"""Every (phase, event) pair: where it leads and what it does, or why it is refused."""


def step(phase: Phase, event: Event) -> Step:
    """What ``event`` does to a session in ``phase`` (a refused step leaves the phase as it is)."""
    return STEPS[phase, event]


def markdown_table() -> str:
    """The table as ``docs/architecture.md`` shows it: a row per phase, a column per event."""
    header = "| phase | " + " | ".join(f"`{event}`" for event in Event) + " |"
    rule = "| --- |" + " --- |" * len(Event)
    rows = []
    for phase in Phase:
        cells = []
        for event in Event:
            result = STEPS[phase, event]
            if result.refused is not None:
                cells.append("—")
            else:
                moved = "" if result.phase is phase else f"→ **{result.phase}**"
                done = ", ".join(action.value for action in result.actions)
                cells.append(" ".join(part for part in (moved, done) if part))
        rows.append(f"| **{phase}** | " + " | ".join(cells) + " |")
    return "\n".join([header, rule, *rows])
