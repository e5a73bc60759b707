"""The session machine, driven in-process: no event loop, no process, no database, no clock.

The tables read as the spec: a row per rule, a sentence a reviewer can check. The hypothesis state
machine then throws random sequences of events at it (legal and illegal, with a clock that only
moves forward) and checks after every step what must always hold: requests are sent or run once
each, in the order they came; epochs only grow; an illegal event raises and changes nothing; a
session that is gone keeps no process; a deleted session stays deleted.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from acp_proxy.sessions.lifecycle import STEPS, Action, Event, Phase
from acp_proxy.sessions.machine import (
    AnyEvent,
    Begin,
    Effect,
    Enqueue,
    Fate,
    Finish,
    HeldBy,
    IllegalEvent,
    Queue,
    Release,
    Request,
    Restoring,
    Run,
    Send,
    Standing,
    Waiting,
    Work,
    accepts,
    advance,
    fate_of,
)

LIVE = Standing(Phase.LIVE, process=True)


def _run(state: Standing, *events: AnyEvent, now: float = 1.0) -> tuple[Standing, list[Effect]]:
    done: list[Effect] = []
    for event in events:
        state, effects = advance(state, event, now)
        done.extend(effects)
    return state, done


# --- requests: sent at once only to a ready session -----------------------------------------------------------

REQUESTS = [
    # (the session, the process is up, what the request gets) — a sentence each
    (LIVE, True, Send(1)),  # live, nothing waits: straight to its process
    (LIVE, False, Queue(1)),  # its process has just exited: it waits for the restore
    (Standing(Phase.LIVE, process=False), True, Queue(1)),  # live without a process: waits
    (Standing(Phase.LIVE, process=True, queue=(Waiting(9, Work.FORK, 0),)), True, Queue(1)),  # behind a fork
    (Standing(Phase.LIVE, process=True, running=Waiting(9, Work.RESUME, 0)), True, Queue(1)),  # behind a resume
    (Standing(Phase.SUSPENDED), True, Queue(1)),  # suspended: queued, restored when its turn comes
    (Standing(Phase.RESUMING, process=True), True, Queue(1)),  # being restored: waits for the new process
    (Standing(Phase.REOPENING), True, Queue(1)),
    (Standing(Phase.CLOSING, process=True), True, Queue(1)),  # answered closed when its turn comes
    (Standing(Phase.CLOSED), True, Queue(1)),
    (Standing(Phase.DELETING), True, Queue(1)),
]


@pytest.mark.parametrize(("state", "process_up", "expected"), REQUESTS)
@pytest.mark.parametrize("prompt", [False, True])
def test_a_request_is_sent_at_once_only_when_nothing_is_before_it(
    state: Standing, process_up: bool, expected: Effect, prompt: bool
) -> None:
    after, effects = advance(state, Request(1, prompt, process_up), 5.0)
    assert effects == (expected,)
    if isinstance(expected, Send):
        assert after == state
    else:
        assert after.queue == (*state.queue, Waiting(1, Work.PROMPT if prompt else Work.REQUEST, state.epoch))
        assert after.phase is state.phase


def test_a_deleted_session_takes_no_request_and_queues_nothing() -> None:
    deleted = Standing(Phase.DELETED)
    for event in (Request(1), Enqueue(1, Work.ANSWER)):
        with pytest.raises(IllegalEvent):
            advance(deleted, event, 1.0)


# --- the queue: one piece of work at a time, in the order it came -------------------------------------------


def test_work_runs_from_the_head_of_the_queue_one_at_a_time() -> None:
    state, effects = _run(Standing(Phase.SUSPENDED), Request(1, True), Enqueue(2, Work.REAP), Request(3))
    assert [w.key for w in state.queue] == [1, 2, 3]
    state, effects = _run(state, Begin(1))
    assert (effects, state.running, [w.key for w in state.queue]) == ([Run(1)], Waiting(1, Work.PROMPT, 0), [2, 3])
    with pytest.raises(IllegalEvent, match="still running"):
        advance(state, Begin(2), 1.0)
    state, _ = _run(state, Finish(1), Begin(2), Finish(2), Begin(3), Finish(3))
    assert (state.queue, state.running) == ((), None)


QUEUE_REFUSALS = [
    (Standing(Phase.LIVE), Begin(1), "nothing is queued"),
    (
        Standing(Phase.LIVE, queue=(Waiting(1, Work.REQUEST, 0), Waiting(2, Work.REQUEST, 0))),
        Begin(2),
        "not at the head",
    ),
    (Standing(Phase.LIVE, queue=(Waiting(1, Work.REQUEST, 0),)), Finish(1), "not running"),
    (Standing(Phase.LIVE, running=Waiting(1, Work.REQUEST, 0)), Finish(2), "not running"),
    (Standing(Phase.RESUMING, restoring=True), Restoring(True), "under way already"),
]


@pytest.mark.parametrize(("state", "event", "why"), QUEUE_REFUSALS)
def test_work_out_of_turn_is_refused_by_name(state: Standing, event: AnyEvent, why: str) -> None:
    with pytest.raises(IllegalEvent, match=why) as raised:
        advance(state, event, 1.0)
    assert raised.value.state is state
    assert raised.value.event is event


def test_a_live_session_with_work_running_is_not_ready_until_it_is_done() -> None:
    state, _ = _run(LIVE, Enqueue(1, Work.FORK), Begin(1))
    assert not state.ready
    state, effects = _run(state, Request(2))
    assert effects == [Queue(2)]
    state, _ = _run(state, Finish(1))
    assert not state.ready  # request 2 still waits its turn
    state, _ = _run(state, Begin(2), Finish(2))
    assert state.ready


# --- epochs: a cancel or a close ends the prompts queued before it -------------------------------------------

EPOCHS = [
    # events after a prompt was queued on a suspended session -> what the prompt becomes when its turn comes
    ((), Fate.SEND),
    ((Event.CANCEL,), Fate.CANCELLED),
    ((Event.CLOSE,), Fate.CANCELLED),  # a close cancels the prompts queued before it
    ((Event.DELETE,), Fate.CANCELLED),
    ((Event.RESTORE, Event.CANCEL), Fate.CANCELLED),  # cancelled while it was being restored
    ((Event.RESTORE, Event.RESTORED), Fate.SEND),  # restored: it goes to the new process
    ((Event.RESTORE, Event.RESTORE_FAILED), Fate.SEND),  # the restore failed: it tries again (answered then)
]


@pytest.mark.parametrize(("events", "fate"), EPOCHS)
def test_a_queued_prompt_is_cancelled_by_a_new_epoch_and_only_by_it(events: tuple[Event, ...], fate: Fate) -> None:
    state, _ = _run(Standing(Phase.SUSPENDED), Request(1, prompt=True), *events, Begin(1))
    assert state.running is not None
    assert fate_of(state, state.running, withdrawn=False, refusing=False) is fate


@pytest.mark.parametrize(("events", "fate"), EPOCHS)
def test_a_queued_request_other_than_a_prompt_outlives_a_cancel(events: tuple[Event, ...], fate: Fate) -> None:
    state, _ = _run(Standing(Phase.SUSPENDED), Request(1, prompt=False), *events, Begin(1))
    assert state.running is not None
    expected = {Event.CLOSE: Fate.CLOSED, Event.DELETE: Fate.DELETED}.get(events[0] if events else Event.CANCEL)
    assert fate_of(state, state.running, withdrawn=False, refusing=False) is (expected or Fate.SEND)


FATES = [
    # withdrawn, refusing, phase -> fate of a request whose turn came (the first that holds decides)
    (True, True, Phase.DELETING, Fate.WITHDRAWN),
    (False, True, Phase.DELETING, Fate.SHUTDOWN),
    (False, False, Phase.DELETING, Fate.DELETED),
    (False, False, Phase.CLOSING, Fate.CLOSED),
    (False, False, Phase.CLOSED, Fate.CLOSED),  # held closed: only the gateway's load or resume reopens it
    (False, False, Phase.SUSPENDED, Fate.SEND),  # restored first, then sent
    (False, False, Phase.RESUMING, Fate.SEND),
    (False, False, Phase.REOPENING, Fate.SEND),  # behind the gateway's own load, which reopens it
    (False, False, Phase.LIVE, Fate.SEND),
]


@pytest.mark.parametrize(("withdrawn", "refusing", "phase", "fate"), FATES)
def test_what_a_request_becomes_when_its_turn_comes(withdrawn: bool, refusing: bool, phase: Phase, fate: Fate) -> None:
    state = Standing(phase)
    assert fate_of(state, Waiting(1, Work.REQUEST, 0), withdrawn=withdrawn, refusing=refusing) is fate


# --- the process, the restore, the clock ---------------------------------------------------------------------

PROCESS = [
    # events from a live session -> whether a process serves it after, and the effects about it
    ((Event.SUSPEND,), False, Action.STOP_PROCESS),
    ((Event.PROCESS_ENDED,), False, Action.WRITE_SUSPENDED),
    ((Event.HANDED_OVER,), False, Action.UNBIND),
    ((Event.CLOSE, Event.REAP), False, Action.END_TURNS),
    ((Event.DELETE, Event.REAP), False, Action.WRITE_DELETED),
    ((Event.SUSPEND, Event.RESTORE, Event.RESTORED), True, Action.BIND),
    ((Event.CANCEL,), True, Action.ASK_TO_END_TURN),
]


@pytest.mark.parametrize(("events", "process", "effect"), PROCESS)
def test_which_events_bind_and_unbind_the_process(events: tuple[Event, ...], process: bool, effect: Action) -> None:
    state, effects = _run(LIVE, *events)
    assert state.process is process
    assert effect in effects


@pytest.mark.parametrize("event", [Event.SUSPEND, Event.PROCESS_ENDED, Event.HANDED_OVER])
def test_events_about_the_process_need_one(event: Event) -> None:
    with pytest.raises(IllegalEvent, match="no process serves it"):
        advance(Standing(Phase.LIVE, process=False), event, 1.0)


def test_a_session_is_not_reaped_while_a_process_still_serves_it() -> None:
    state, _ = _run(LIVE, Event.CLOSE)
    with pytest.raises(IllegalEvent, match="reap unbinds it first"):
        advance(state, Event.REAPED, 1.0)
    state, effects = _run(state, Event.REAP, Event.REAPED)
    assert state.phase is Phase.CLOSED
    assert Action.ANSWER_AFTER_WRITE in effects


@pytest.mark.parametrize("event", [Event.CLOSE, Event.DELETE])
def test_a_close_cuts_the_restore_short_and_a_cancel_does_not(event: Event) -> None:
    restoring, _ = _run(Standing(Phase.SUSPENDED), Restoring(True), Event.RESTORE)
    cancelled, _ = _run(restoring, Event.CANCEL)
    assert cancelled.restoring
    closed, effects = _run(restoring, event)
    assert not closed.restoring
    assert Action.CUT_SHORT in effects


def test_the_clock_says_when_a_session_entered_its_phase_and_nothing_else_moves_it() -> None:
    state, _ = _run(LIVE, Event.SUSPEND, now=10.0)
    assert state.since == 10.0
    state, _ = _run(state, Request(1), Event.CANCEL, now=20.0)  # neither leaves the phase
    assert state.since == 10.0
    state, _ = _run(state, Event.RESTORE, now=30.0)
    assert (state.phase, state.since) == (Phase.RESUMING, 30.0)


# --- a handover: the holder's side and the asker's ---------------------------------------------------------

SERVED = Standing(Phase.LIVE, process=True, served=True)
"""A live session as the proxy that opened or restored it holds it."""

RELEASES = [
    # the holder's session, the events of its release -> where it ends, the effects the last step has
    (SERVED, (Release("b"), Event.QUIET), Phase.ELSEWHERE, (Action.UNBIND, Action.WRITE_HANDED, Action.STOP_PROCESS)),
    (SERVED, (Release("b"), Event.PROCESS_ENDED), Phase.ELSEWHERE, (Action.UNBIND, Action.WRITE_HANDED)),
    (SERVED, (Release("b"), Event.RELEASE_EXPIRED), Phase.LIVE, ()),  # a turn ran past the asker's timeout: kept
    (Standing(Phase.SUSPENDED), (Release("b"),), Phase.ELSEWHERE, (Action.WRITE_HANDED, Action.ANSWER_RELEASED)),
    (Standing(Phase.CLOSED), (Release("b"),), Phase.ELSEWHERE, (Action.ANSWER_RELEASED,)),  # its row stays closed
]


@pytest.mark.parametrize(("state", "events", "phase", "effects"), RELEASES)
def test_a_holder_lets_a_session_go_only_once_nothing_of_it_runs(
    state: Standing, events: tuple[AnyEvent, ...], phase: Phase, effects: tuple[Action, ...]
) -> None:
    after, done = _run(state, *events)
    assert after.phase is phase
    assert set(effects) <= set(advance(_run(state, *events[:-1])[0], events[-1], 1.0)[1])
    assert not after.process or phase is Phase.LIVE
    assert after.holder == ("b" if phase is Phase.ELSEWHERE else None)
    if phase is Phase.ELSEWHERE:
        assert Action.ANSWER_RELEASED in done  # the asker is told, once the row says so


def test_what_arrives_while_a_session_is_released_waits_and_learns_where_it_went() -> None:
    releasing, _ = _run(SERVED, Release("b"))
    assert releasing.phase is Phase.RELEASING
    assert not releasing.ready
    waiting, effects = _run(releasing, Request(1, prompt=True), Request(2))
    assert effects == [Queue(1), Queue(2)]
    handed, _ = _run(waiting, Event.QUIET, Begin(1))
    assert fate_of(handed, handed.running, withdrawn=False, refusing=False) is Fate.MOVED  # type: ignore[arg-type]
    kept, _ = _run(waiting, Event.RELEASE_EXPIRED, Begin(1))
    assert fate_of(kept, kept.running, withdrawn=False, refusing=False) is Fate.SEND  # type: ignore[arg-type]
    with pytest.raises(IllegalEvent, match="being restored, closed, deleted or taken over"):
        advance(Standing(Phase.RESUMING, process=True), Release("c"), 1.0)
    with pytest.raises(IllegalEvent, match="not being released"):
        advance(SERVED, Event.QUIET, 1.0)


TAKE_OVERS = [
    # events at the proxy that asks, from a session found held by "a" -> its phase, who holds it as far as it knows
    ((Event.TAKE_OVER,), Phase.TAKING_OVER, "a"),
    ((Event.TAKE_OVER, Event.RELEASED), Phase.SUSPENDED, None),  # its own now: restored as any suspended one
    ((Event.TAKE_OVER, HeldBy(Event.KEPT, "a")), Phase.ELSEWHERE, "a"),  # kept: session_busy
    ((Event.TAKE_OVER, Event.RELEASED, Event.RESTORE, Event.RESTORED), Phase.LIVE, None),
    # another proxy took it between the release and the claim: held there now
    ((Event.TAKE_OVER, Event.RELEASED, Event.RESTORE, HeldBy(Event.HELD_ELSEWHERE, "c")), Phase.ELSEWHERE, "c"),
]


@pytest.mark.parametrize(("events", "phase", "holder"), TAKE_OVERS)
def test_a_session_held_elsewhere_is_taken_over_then_restored(
    events: tuple[AnyEvent, ...], phase: Phase, holder: str | None
) -> None:
    state, _ = _run(Standing(Phase.ELSEWHERE, holder="a"), *events)
    assert (state.phase, state.holder) == (phase, holder)
    assert state.served is (phase is Phase.LIVE)


def test_a_gateway_that_knew_the_session_here_is_told_it_moved_and_one_that_did_not_takes_it_over() -> None:
    served, _ = _run(SERVED, Release("b"), Event.QUIET)
    assert served.served
    never, _ = _run(Standing(Phase.ELSEWHERE, holder="b"))
    for state, fate in ((served, Fate.MOVED), (never, Fate.SEND)):
        queued, _ = _run(state, Request(1, prompt=True), Begin(1))
        assert fate_of(queued, queued.running, withdrawn=False, refusing=False) is fate  # type: ignore[arg-type]
    with pytest.raises(IllegalEvent, match="another proxy of the install holds it"):
        advance(served, Event.CLOSE, 1.0)  # taken over first (the intents queue that)


class TwoProxies(RuleBasedStateMachine):
    """One session, two proxies of an install, the handover as the runner sequences it: an asker's
    ``take_over`` asks the holder, whose ``Release`` ends ``quiet`` (handed) or ``expired`` (kept), and the
    asker learns which. Checked after every step: never do both serve the session, and whenever one
    holds it the other knows it is held elsewhere, by that one."""

    def __init__(self) -> None:
        super().__init__()
        self.proxies = {"a": Standing(Phase.LIVE, process=True, served=True), "b": Standing(Phase.SUSPENDED)}
        self.row = "a"
        """Which proxy the session's row names as its holder (``None``: suspended, anyone may claim it)."""
        self.proxies["b"] = Standing(Phase.ELSEWHERE, holder="a")
        self.handovers = 0

    def _feed(self, name: str, event: AnyEvent) -> None:
        self.proxies[name] = advance(self.proxies[name], event, 1.0)[0]

    @staticmethod
    def _other(name: str) -> str:
        return "b" if name == "a" else "a"

    @rule(asker=st.sampled_from(["a", "b"]))
    def ask(self, asker: str) -> None:
        holder = self._other(asker)
        if self.proxies[asker].phase is not Phase.ELSEWHERE:
            return
        self._feed(asker, Event.TAKE_OVER)
        if not accepts(self.proxies[holder], Release(asker)):
            self._feed(asker, HeldBy(Event.KEPT, holder))
            return
        self._feed(holder, Release(asker))
        if self.proxies[holder].phase is Phase.ELSEWHERE:  # it held no process: released at once
            self._released(holder, asker)

    @rule(holder=st.sampled_from(["a", "b"]), quiet=st.booleans())
    def settle(self, holder: str, quiet: bool) -> None:
        """The holder's turn ended (quiet) or the asker's timeout passed first (kept)."""
        asker = self._other(holder)
        if self.proxies[holder].phase is not Phase.RELEASING:
            return
        if quiet:
            self._feed(holder, Event.QUIET)
            self._released(holder, asker)
        else:
            self._feed(holder, Event.RELEASE_EXPIRED)
            self._feed(asker, HeldBy(Event.KEPT, holder))

    def _released(self, holder: str, asker: str) -> None:
        self.row = None  # write_handed: suspended, under the asker
        self._feed(asker, Event.RELEASED)
        self.handovers += 1

    @rule(name=st.sampled_from(["a", "b"]))
    def restore(self, name: str) -> None:
        """A request restores the session where it is suspended: the claim succeeds only on a free row."""
        if self.proxies[name].phase is not Phase.SUSPENDED:
            return
        self._feed(name, Event.RESTORE)
        if self.row is None:
            self.row = name
            self._feed(name, Event.RESTORED)
        else:
            self._feed(name, HeldBy(Event.HELD_ELSEWHERE, self.row))

    @rule(name=st.sampled_from(["a", "b"]))
    def suspend(self, name: str) -> None:
        if accepts(self.proxies[name], Event.SUSPEND):
            self._feed(name, Event.SUSPEND)

    @rule(name=st.sampled_from(["a", "b"]), prompt=st.booleans())
    def request(self, name: str, prompt: bool) -> None:
        if accepts(self.proxies[name], Request(0, prompt)):
            self._feed(name, Request(next(KEYS), prompt))
            state = self.proxies[name]
            if state.queue and state.running is None:
                self._feed(name, Begin(state.queue[0].key))
                self._feed(name, Finish(state.queue[0].key if state.queue else self.proxies[name].running.key))  # type: ignore[union-attr]

    @invariant()
    def never_two_processes(self) -> None:
        assert not (self.proxies["a"].process and self.proxies["b"].process)

    @invariant()
    def the_one_that_serves_it_is_the_one_its_row_names(self) -> None:
        for name, state in self.proxies.items():
            if state.process:
                assert self.row == name
                assert self.proxies[self._other(name)].phase in (Phase.ELSEWHERE, Phase.TAKING_OVER, Phase.SUSPENDED)

    @invariant()
    def a_release_is_asked_by_the_other_only(self) -> None:
        for name, state in self.proxies.items():
            if state.phase is Phase.RELEASING:
                assert state.holder == self._other(name)
                assert self.proxies[self._other(name)].phase is Phase.TAKING_OVER


KEYS = itertools.count(1)
TwoProxies.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
test_two_proxies_handing_a_session_over_never_both_serve_it = TwoProxies.TestCase


# --- random sequences of events --------------------------------------------------------------------------------

LIFECYCLE = st.sampled_from(list(Event))
START = st.sampled_from(
    [Standing(Phase.LIVE, process=True), Standing(Phase.SUSPENDED), Standing(Phase.CLOSED)]
)  # where a session starts: opened, or found in the registry


class SessionMachine(RuleBasedStateMachine):
    """Random events against one session, checking the invariants after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.state = Standing(Phase.LIVE, process=True)
        self.now = 0.0
        self.keys = itertools.count(1)
        self.arrived: list[int] = []
        """Keys of queued work, in the order it was queued."""
        self.ran: list[int] = []
        """Keys of queued work, in the order it ran."""
        self.sent: set[int] = set()
        self.epochs = [0]

    @initialize(start=START)
    def start_from(self, start: Standing) -> None:
        self.state = start

    def _feed(self, event: AnyEvent, elapsed: float) -> tuple[Effect, ...] | None:
        self.now += elapsed
        before = self.state
        if not accepts(before, event):
            with pytest.raises(IllegalEvent):
                advance(before, event, self.now)
            assert self.state is before  # nothing changed
            return None
        self.state, effects = advance(before, event, self.now)
        self.epochs.append(self.state.epoch)
        return effects

    @rule(event=LIFECYCLE, elapsed=st.floats(0, 100))
    def lifecycle(self, event: Event, elapsed: float) -> None:
        before = self.state
        effects = self._feed(event, elapsed)
        if effects is not None:
            assert effects == STEPS[before.phase, event].actions

    @rule(prompt=st.booleans(), process_up=st.booleans())
    def request(self, prompt: bool, process_up: bool) -> None:
        key = next(self.keys)
        effects = self._feed(Request(key, prompt, process_up), 0.0)
        if effects is None:
            return
        assert effects in ((Send(key),), (Queue(key),))
        if effects == (Send(key),):
            assert self.state.phase is Phase.LIVE
            assert self.state.process
            assert process_up
            self.sent.add(key)
        else:
            self.arrived.append(key)

    @rule(work=st.sampled_from([Work.RESUME, Work.FORK, Work.REAP, Work.ANSWER]))
    def enqueue(self, work: Work) -> None:
        key = next(self.keys)
        if self._feed(Enqueue(key, work), 0.0) is not None:
            self.arrived.append(key)

    @rule(any_key=st.booleans())
    def begin(self, any_key: bool) -> None:
        """The head's turn (or, to see it refused, some other work's)."""
        key = self.state.queue[0].key if self.state.queue and not any_key else next(self.keys)
        effects = self._feed(Begin(key), 0.0)
        if effects is not None:
            assert effects == (Run(key),)
            self.ran.append(key)

    @rule()
    def finish(self) -> None:
        running = self.state.running
        self._feed(Finish(running.key if running is not None else next(self.keys)), 0.0)

    @rule(under_way=st.booleans())
    def restoring(self, under_way: bool) -> None:
        self._feed(Restoring(under_way), 0.0)

    @invariant()
    def work_runs_once_each_in_the_order_it_came(self) -> None:
        assert self.ran + [w.key for w in self.state.queue] == self.arrived
        if self.state.running is not None:
            assert self.state.running.key == self.ran[-1]
        assert len(set(self.ran)) == len(self.ran), "no work runs twice"
        assert not self.sent & set(self.arrived), "a request is sent at once or queued, never both"

    @invariant()
    def epochs_only_grow_and_no_work_is_from_the_future(self) -> None:
        assert self.epochs == sorted(self.epochs)
        assert all(w.epoch <= self.state.epoch for w in self.state.queue)

    @invariant()
    def a_session_that_is_gone_keeps_no_process(self) -> None:
        if self.state.phase in (Phase.CLOSED, Phase.DELETED):
            assert not self.state.process

    @invariant()
    def a_deleted_session_stays_deleted(self) -> None:
        if self.state.phase is Phase.DELETED:
            assert all(not accepts(self.state, event) for event in Event)
            assert not accepts(self.state, Request(0))

    @invariant()
    def the_clock_never_runs_back(self) -> None:
        assert self.state.since <= self.now


SessionMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_random_sequences_of_events_keep_the_invariants = SessionMachine.TestCase
