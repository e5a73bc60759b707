"""The decisions inside the lifecycle intents, as tables, and the change notices the intents wait on."""

from __future__ import annotations

import anyio
import pytest

from acp_proxy.concurrency import Background, Changes
from acp_proxy.sessions.decisions import FATE_ERRORS, stable_id, unknown_session_error
from acp_proxy.sessions.lifecycle import Phase
from acp_proxy.sessions.machine import Fate, Standing, Waiting, Work, fate_of
from acp_proxy.sessions.registry import SessionRecord, SessionState

# withdrawn, refusing (shutting down), a prompt cancelled meanwhile, the session closed -> what the request becomes
QUEUED = [
    (False, False, False, False, None),  # nothing happened: it is sent
    (True, False, False, False, "cancelled"),  # $/cancel_request: -32800 reason cancelled
    (True, True, True, True, "cancelled"),  # the gateway's own withdrawal wins over everything
    (False, True, False, False, "proxy_shutdown"),
    (False, True, True, True, "proxy_shutdown"),  # shutting down wins over a cancel or a close
    (False, False, True, False, "stopReason cancelled"),  # a prompt after session/cancel: answered, not failed
    (False, False, True, True, "stopReason cancelled"),  # close cancels the prompts queued before it
    (False, False, False, True, "session_closed"),  # anything else queued before a close
]


@pytest.mark.parametrize(("withdrawn", "refusing", "prompt_cancelled", "closed", "expected"), QUEUED)
def test_what_a_queued_request_becomes(
    withdrawn: bool, refusing: bool, prompt_cancelled: bool, closed: bool, expected: str | None
) -> None:
    """The session machine decides (``fate_of``); the intents answer with the error its fate names."""
    prompt = Waiting(1, Work.PROMPT if prompt_cancelled else Work.REQUEST, epoch=0)
    state = Standing(
        Phase.CLOSING if closed else Phase.LIVE, epoch=1 if closed or prompt_cancelled else 0, process=True
    )
    fate = fate_of(state, prompt, withdrawn=withdrawn, refusing=refusing)
    if expected is None:
        assert fate is Fate.SEND
    elif expected == "stopReason cancelled":
        assert fate is Fate.CANCELLED
    else:
        assert fate in FATE_ERRORS
        assert FATE_ERRORS[fate]("s1", None).reason == expected


@pytest.mark.parametrize(
    ("phase", "served", "fate"),
    [
        (Phase.ELSEWHERE, True, Fate.MOVED),
        (Phase.TAKING_OVER, True, Fate.MOVED),
        (Phase.ELSEWHERE, False, Fate.SEND),
        (Phase.RELEASING, True, Fate.SEND),
    ],
)
def test_a_request_for_a_session_handed_away_from_here_is_answered_that_it_moved(
    phase: Phase, served: bool, fate: Fate
) -> None:
    """A request queued here for a session this proxy served and another took is answered ``session_moved``, naming
    the holder, never sent after it; one this proxy never served is sent (taken over first)."""
    state = Standing(phase, holder="inst-b", served=served)
    assert fate_of(state, Waiting(1, Work.PROMPT, 0), withdrawn=False, refusing=False) is fate
    if fate is Fate.MOVED:
        error = FATE_ERRORS[fate]("s1", state.holder)
        assert (error.reason, error.code, error.data["holder"]) == ("session_moved", -32010, "inst-b")
        assert "session/load brings it back" in error.message


def test_an_operator_cancelling_a_queued_prompt_cancels_it_and_nothing_else() -> None:
    state = Standing(Phase.LIVE, process=True)
    for work, expected in ((Work.PROMPT, Fate.CANCELLED), (Work.REQUEST, Fate.SEND)):
        assert fate_of(state, Waiting(1, work, 0), withdrawn=False, refusing=False, task_cancelled=True) is expected


def _record(state: SessionState, instance: str | None = "inst-b") -> SessionRecord:
    return SessionRecord("s1", "s1", "fake", "/w", state=state, instance_id=instance)


# the row the registry has for the id -> the reason and code the gateway gets
UNKNOWN = [
    (None, "unknown_session", -32002),
    (_record(SessionState.CLOSED), "session_closed", -32002),
    (_record(SessionState.LIVE), "session_in_use", -32010),
    (_record(SessionState.RESUMING), "session_in_use", -32010),
]


@pytest.mark.parametrize(("record", "reason", "code"), UNKNOWN)
def test_why_a_session_cannot_be_served(record: SessionRecord | None, reason: str, code: int) -> None:
    error = unknown_session_error("s1", record)
    assert (error.reason, error.code) == (reason, code)
    if reason == "session_in_use":
        assert error.data["instanceId"] == "inst-b", "the message names the proxy that holds it"


@pytest.mark.parametrize(
    ("taken_here", "live_elsewhere", "keeps_the_adapters_id"),
    [
        (False, False, True),  # the usual case: the gateway sees the adapter's id
        (True, False, False),  # this proxy already serves a session of that id (ids numbered per process)
        (False, True, False),  # a live session of another running proxy has it
    ],
)
def test_the_stable_id_of_a_new_session(taken_here: bool, live_elsewhere: bool, keeps_the_adapters_id: bool) -> None:
    given = stable_id("sess-1", taken_here=taken_here, live_elsewhere=live_elsewhere)
    if keeps_the_adapters_id:
        assert given == "sess-1"
    else:
        assert given.startswith("sess-1~")
        assert len(given) == len("sess-1~") + 8
        assert given != stable_id("sess-1", taken_here=taken_here, live_elsewhere=live_elsewhere), "never reused"


@pytest.mark.anyio
async def test_a_change_made_between_looking_and_waiting_is_not_missed() -> None:
    changes = Changes()
    state = {"ready": False}
    woken = anyio.Event()

    async def waiter() -> None:
        await changes.until(lambda: state["ready"])
        woken.set()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        changes.notify()  # a notice without the state changing: the waiter looks again and waits on
        await anyio.wait_all_tasks_blocked()
        assert not woken.is_set()
        state["ready"] = True
        changes.notify()
        with anyio.fail_after(5):
            await woken.wait()

    event = changes.next()  # taken before looking, as every waiter does
    changes.notify()
    assert event.is_set(), "a notice after the event was taken reaches it"
    changes.notify()  # nobody waits: nothing is made, nothing fails


@pytest.mark.anyio
async def test_background_work_is_counted_until_it_ends() -> None:
    release = anyio.Event()
    async with anyio.create_task_group() as tasks:
        background = Background(tasks, "state.db")

        async def work() -> None:
            await release.wait()

        background.start(work)
        background.start(work)
        with anyio.move_on_after(0.05) as scope:
            await background.wait_idle()
        assert scope.cancelled_caught, "two handlers still run"
        release.set()
        with anyio.fail_after(5):
            await background.wait_idle()
