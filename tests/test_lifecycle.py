"""The session lifecycle table, pair by pair, in memory: every (phase, event) of ``acp_proxy.sessions.lifecycle``.

``EXPECTED`` is the specification, written out: a line per pair that moves or acts, in the form
``phase + event -> next phase : actions`` (or ``nothing``). Every pair not written there must be refused.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any, cast

import anyio
import pytest

from acp_proxy.concurrency import Changes
from acp_proxy.sessions import reference
from acp_proxy.sessions.lifecycle import STEPS, Action, Event, Phase, markdown_table, step
from acp_proxy.sessions.machine import IllegalEvent, Standing
from acp_proxy.sessions.registry import SessionRecord
from acp_proxy.sessions.table import Session, SessionTable

EXPECTED = """
suspended + request        -> suspended : queue
suspended + cancel         -> suspended : new_epoch
suspended + restore        -> resuming  : wait_for_stop, claim
suspended + process_ended  -> suspended : unbind, journal
suspended + close          -> closing   : new_epoch, queue_reap
suspended + delete         -> deleting  : new_epoch, queue_reap
resuming  + request        -> resuming  : queue
resuming  + cancel         -> resuming  : new_epoch
resuming  + restored       -> live      : write_live, bind, journal
resuming  + restore_failed -> suspended : release_claim, stop_process
resuming  + process_ended  -> resuming  : unbind, journal
resuming  + close          -> closing   : new_epoch, cut_short, queue_reap
resuming  + delete         -> deleting  : new_epoch, cut_short, queue_reap
live      + request        -> live      : send
live      + cancel         -> live      : new_epoch, ask_to_end_turn
live      + restore        -> resuming  : wait_for_stop, claim
live      + suspend        -> suspended : unbind, write_suspended, journal, stop_process
live      + process_ended  -> suspended : unbind, write_suspended, journal
live      + handed_over    -> suspended : unbind, write_suspended
live      + close          -> closing   : new_epoch, cut_short, queue_reap
live      + delete         -> deleting  : new_epoch, cut_short, queue_reap
reopening + request        -> reopening : queue
reopening + cancel         -> reopening : new_epoch
reopening + restored       -> live      : write_live, bind, journal
reopening + restore_failed -> closed    : release_claim, stop_process
reopening + close          -> closing   : new_epoch, cut_short, queue_reap
reopening + delete         -> deleting  : new_epoch, cut_short, queue_reap
closing   + request        -> closing   : queue
closing   + cancel         -> closing   : new_epoch, ask_to_end_turn
closing   + restore_failed -> closing   : release_claim, stop_process
closing   + process_ended  -> closing   : unbind
closing   + delete         -> deleting  : new_epoch, queue_reap
closing   + reap           -> closing   : unbind, end_turns, stop_process
closing   + reaped         -> closed    : write_closed, forget, journal, answer_after_write
closed    + request        -> closed    : queue
closed    + restore        -> reopening : wait_for_stop, claim
closed    + close          -> closing   : new_epoch, queue_reap
closed    + delete         -> deleting  : new_epoch, queue_reap
deleting  + request        -> deleting  : queue
deleting  + cancel         -> deleting  : new_epoch, ask_to_end_turn
deleting  + restore_failed -> deleting  : release_claim, stop_process
deleting  + process_ended  -> deleting  : unbind
deleting  + reap           -> deleting  : write_deleted, unbind, end_turns, stop_process
deleting  + reaped         -> deleted   : forget, journal, answer_after_write
live      + release        -> releasing : nothing
suspended + release        -> elsewhere : write_handed, journal, answer_released
closed    + release        -> elsewhere : answer_released
elsewhere + release        -> elsewhere : answer_released
releasing + request        -> releasing : queue
releasing + cancel         -> releasing : new_epoch, ask_to_end_turn
releasing + quiet          -> elsewhere : unbind, write_handed, journal, stop_process, answer_released
releasing + process_ended  -> elsewhere : unbind, write_handed, journal, answer_released
releasing + release_expired -> live     : nothing
releasing + close          -> closing   : new_epoch, cut_short, queue_reap
releasing + delete         -> deleting  : new_epoch, cut_short, queue_reap
elsewhere + request        -> elsewhere : queue
elsewhere + cancel         -> elsewhere : new_epoch
elsewhere + take_over      -> taking_over : ask_release
taking_over + request      -> taking_over : queue
taking_over + cancel       -> taking_over : new_epoch
taking_over + released     -> suspended : journal
taking_over + kept         -> elsewhere : nothing
resuming  + held_elsewhere -> elsewhere : nothing
reopening + held_elsewhere -> elsewhere : nothing
"""


def _expected() -> dict[tuple[Phase, Event], tuple[Phase, tuple[Action, ...]]]:
    table = {}
    for line in EXPECTED.strip().splitlines():
        match = re.fullmatch(r"(\w+) +\+ (\w+) +-> (\w+) +:(.*)", line.strip())
        assert match is not None, line
        phase, event, after, actions = match.groups()
        done = () if actions.strip() == "nothing" else tuple(Action(a) for a in actions.strip().split(", "))
        table[Phase(phase.strip()), Event(event)] = (Phase(after), done)
    return table


PAIRS = list(itertools.product(Phase, Event))


@pytest.mark.parametrize(("phase", "event"), PAIRS, ids=[f"{p}+{e}" for p, e in PAIRS])
def test_every_pair_moves_and_acts_as_specified_or_is_refused(phase: Phase, event: Event) -> None:
    result = step(phase, event)
    expected = _expected().get((phase, event))
    if expected is None:
        assert result.refused, f"{phase} + {event} should be refused"
        assert result.phase is phase
        assert result.actions == ()
    else:
        assert result.refused is None, result.refused
        assert (result.phase, result.actions) == expected


def test_the_table_covers_every_pair_once() -> None:
    assert set(STEPS) == set(PAIRS)
    assert len(_expected()) == sum(1 for result in STEPS.values() if result.refused is None)


def test_a_deleted_session_is_terminal_and_every_phase_is_reachable() -> None:
    assert all(step(Phase.DELETED, event).refused for event in Event)
    reached = {Phase.LIVE, Phase.SUSPENDED, Phase.CLOSED}  # where a session starts: opened, or found in the registry
    frontier = list(reached)
    while frontier:
        phase = frontier.pop()
        for event in Event:
            after = step(phase, event).phase
            if after not in reached:
                reached.add(after)
                frontier.append(after)
    assert reached == set(Phase)


@pytest.mark.parametrize(
    ("into", "writes"),
    [
        (Phase.SUSPENDED, {Action.WRITE_SUSPENDED, Action.RELEASE_CLAIM}),
        (Phase.LIVE, {Action.WRITE_LIVE}),
        (Phase.CLOSED, {Action.WRITE_CLOSED, Action.RELEASE_CLAIM}),
        (Phase.RESUMING, {Action.CLAIM}),
        (Phase.REOPENING, {Action.CLAIM}),
    ],
)
def test_every_step_into_a_phase_the_registry_shows_writes_its_row(into: Phase, writes: set[Action]) -> None:
    """Memory and row agree except while a write the step returned is in flight."""
    written_already = {
        (Phase.TAKING_OVER, Event.RELEASED),  # the holder wrote it suspended (write_handed) before saying so
        (Phase.RELEASING, Event.RELEASE_EXPIRED),  # its row stayed live while it was being released
    }
    for (phase, event), result in STEPS.items():
        if result.refused is None and result.phase is into and phase is not into:
            if (phase, event) in written_already:
                continue
            assert writes & set(result.actions), f"{phase} + {event} -> {into} writes nothing"


def test_a_deleted_row_is_written_before_the_tree_is_stopped_and_a_closed_one_after() -> None:
    deleting = step(Phase.DELETING, Event.REAP).actions
    assert deleting.index(Action.WRITE_DELETED) < deleting.index(Action.STOP_PROCESS)
    assert Action.WRITE_CLOSED not in step(Phase.CLOSING, Event.REAP).actions
    assert Action.WRITE_CLOSED in step(Phase.CLOSING, Event.REAPED).actions


def test_the_answer_to_a_close_or_delete_waits_for_its_row() -> None:
    for phase in (Phase.CLOSING, Phase.DELETING):
        assert Action.ANSWER_AFTER_WRITE in step(phase, Event.REAPED).actions


def test_closing_or_deleting_ends_what_was_queued_and_cuts_a_restore_short() -> None:
    for phase, event in itertools.product(Phase, (Event.CLOSE, Event.DELETE)):
        result = step(phase, event)
        if result.refused is None:
            assert {Action.NEW_EPOCH, Action.QUEUE_REAP} <= set(result.actions)
            # a fork runs while live (or while being released: what runs there goes on until then)
            restoring = phase in (Phase.RESUMING, Phase.REOPENING, Phase.LIVE, Phase.RELEASING)
            assert (Action.CUT_SHORT in result.actions) == restoring


def test_only_a_live_session_sends_and_every_other_one_queues() -> None:
    for phase in Phase:
        result = step(phase, Event.REQUEST)
        if phase is Phase.DELETED:
            assert result.refused
        elif phase is Phase.LIVE:
            assert result.actions == (Action.SEND,)
        else:
            assert result.actions == (Action.QUEUE,)


def test_the_architecture_document_shows_this_table() -> None:
    document = (Path(__file__).parent.parent / "docs" / "architecture.md").read_text()
    assert markdown_table() in document
    assert reference.markdown() in document, "regenerate it: python -m acp_proxy.sessions.reference"


def test_the_reference_names_every_phase_event_and_effect_with_its_meaning() -> None:
    generated = reference.markdown()
    for name in [*Phase, *Event, *Action]:
        row = next(line for line in generated.splitlines() if line.startswith(f"| `{name}` |"))
        assert row.split("|")[2].strip(), f"{name} has no meaning in the reference"


# --- the table carries out each step's effects in memory, in the same step ------------------------


class _Process:
    """A stand-in for the process serving a session: the table reads only whether it has exited."""

    def __init__(self, gone: bool = False) -> None:
        self.gone = gone


def _table() -> SessionTable:
    return SessionTable(cast(Any, None), cast(Any, None), Changes(), on_bound=lambda adapter: None)


def _session(phase: Phase, process: _Process | None = None) -> Session:
    record = SessionRecord(session_id="s1", adapter_session_id="s1", backend="fake", cwd="/")
    return Session(record, Standing(phase, process=process is not None), adapter=cast(Any, process))


@pytest.mark.parametrize(("phase", "event"), [(p, e) for p in Phase for e in Event])
def test_advance_does_in_memory_what_the_step_says_and_nothing_on_a_refusal(phase: Phase, event: Event) -> None:
    table = _table()
    process = None if event is Event.REAPED else _Process()  # a reaped session's process is unbound by its reap
    session = _session(phase, process)
    expected = step(phase, event)
    if expected.refused is not None:
        with pytest.raises(IllegalEvent, match=expected.refused):
            table.advance(session, event)
        assert (session.phase, session.cancel_epoch, session.adapter) == (phase, 0, process)
        return
    moved = table.advance(session, event)
    assert moved.effects == expected.actions
    assert session.phase is expected.phase
    assert session.cancel_epoch == (1 if Action.NEW_EPOCH in expected.actions else 0)
    unbinds = Action.UNBIND in expected.actions
    assert session.adapter is (None if unbinds else process)
    assert moved.released is (process if unbinds else None)


def test_an_unbound_process_that_has_exited_is_not_handed_back() -> None:
    session = _session(Phase.LIVE, _Process(gone=True))
    moved = _table().advance(session, Event.PROCESS_ENDED)
    assert (moved.released, session.adapter, session.phase) == (None, None, Phase.SUSPENDED)


@pytest.mark.anyio
@pytest.mark.parametrize("event", [Event.CLOSE, Event.DELETE])
async def test_closing_or_deleting_a_session_being_restored_cancels_the_restore(event: Event) -> None:
    table = _table()
    session = _session(Phase.RESUMING)
    with anyio.CancelScope() as scope:
        table.restoring(session, scope)
        table.advance(session, event)
        await anyio.sleep_forever()  # the restore, cut short by the step
    assert scope.cancelled_caught
    assert session.cancel_epoch == 1


@pytest.mark.anyio
async def test_a_cancel_does_not_cut_a_restore_short() -> None:
    table = _table()
    session = _session(Phase.RESUMING)
    with anyio.CancelScope() as scope:
        table.restoring(session, scope)
        table.advance(session, Event.CANCEL)
        await anyio.lowlevel.checkpoint()  # a cancelled scope would end here
    assert not scope.cancel_called
    assert session.cancel_epoch == 1
