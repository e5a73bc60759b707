"""Admission, as a table: what a waiter for a process slot does next, for every case the driver meets.

``admit`` is pure: each row builds a ``Waiting`` and asserts the step, its target and its
deadline. The driver (``SlotAdmission.acquire``) is exercised with real processes by
``test_install_pool.py`` and ``test_memory.py``; these rows are the rules it carries out: the
line for a slot, then (holding one) room in the memory budget.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import msgspec
import pytest

from acp_proxy.pool.admission import (
    LONE_POLL,
    POLL,
    QUIET_MARGIN,
    RECENT_MARGIN,
    RULES,
    Ask,
    GiveUp,
    Granted,
    Look,
    Measure,
    Room,
    Rule,
    Sleep,
    Start,
    Take,
    Waiting,
    admit,
    markdown_table,
)
from acp_proxy.pool.memory import BudgetPlan, MemorySlot, Overrun
from acp_proxy.pool.plan import Slot

NOW = 100.0
DEADLINE = NOW + 30.0


def slot(key: str, last_active: float = 0.0, backend: str = "a", **flags: Any) -> Slot:
    return Slot(key=key, backend=backend, last_active=last_active, **flags)


FULL_IDLE = (slot("old", 1.0), slot("mid", 2.0), slot("new", 3.0), slot("newest", 4.0))
FULL_BUSY = tuple(slot(f"b{i}", float(i), busy=True) for i in range(4))
SHARED_BUSY = (*FULL_BUSY[:3], slot("theirs", 3.0, busy=True, instance="proxy-2"))
"""Every session busy, one of them in another proxy: a slot can come free without this proxy hearing of it."""


def waiting(**fields: Any) -> Waiting:
    base: dict[str, Any] = {
        "backend": "a",
        "backend_cap": 4,
        "global_cap": 4,
        "now": NOW,
        "deadline": DEADLINE,
        "position": 0,
        "depth": 4,
        "ahead": 0,
        "slots": (),
    }
    return Waiting(**(base | fields))


def decide(w: Waiting) -> str:
    """What ``admit`` says for ``w``, followed through the steps that need no wait as the driver follows
    them: a ``Take`` that finds no slot file free (``take/...``), a ``Look`` that reads ``slots``."""
    step = admit(w)
    if isinstance(step, Take):
        return "take/" + decide(msgspec.structs.replace(w, tried_take=True))
    if isinstance(step, Look):
        return "look/" + decide(msgspec.structs.replace(w, slots=FULL_BUSY))
    return describe(step)


def describe(step: object) -> str:
    """A step as a short string: ``take/<then>``, ``ask:<key>``, ``sleep[line]@<until-now>``, ``give-up:<why>``,
    each with the rule it follows."""
    if isinstance(step, Ask):
        return f"ask:{step.slot.key} ({step.rule})"
    if isinstance(step, Sleep):
        return f"sleep{'[line]' if step.line else ''}@{step.until - NOW:g} ({step.rule})"
    if isinstance(step, Measure):
        return f"measure ({step.rule})"
    if isinstance(step, Start):
        return f"start{f'[{step.overdue} overdue]' if step.overdue else ''} ({step.rule})"
    assert isinstance(step, GiveUp)
    return f"give-up:{step.reason} ({step.rule})"


# (sentence, Waiting fields, expected step, the rule it follows)
CASES: list[tuple[str, dict[str, Any], str, Rule]] = [
    (
        "shutting down: every waiter fails fast",
        {"refusing": True, "slots": FULL_IDLE},
        "give-up:shutdown",
        Rule.SHUTDOWN,
    ),
    (
        "shutting down beats being far back in line",
        {"refusing": True, "position": 6},
        "give-up:shutdown",
        Rule.SHUTDOWN,
    ),
    (
        "far back in line: asleep until the line moves, at most until its deadline",
        {"position": 4, "ahead": 4},
        f"sleep[line]@{DEADLINE - NOW:g}",
        Rule.BACK,
    ),
    (
        "far back in line past its deadline: exhausted",
        {"position": 5, "now": DEADLINE},
        "give-up:exhausted",
        Rule.DEADLINE,
    ),
    (
        "first in line with room: take a slot file (polling if the snapshot was stale)",
        {"slots": FULL_IDLE[:3]},
        f"take/sleep@{LONE_POLL:g}",
        Rule.ROOM,
    ),
    (
        "first in line, install full: take if one just came free, else suspend the least recently used",
        {"slots": FULL_IDLE},
        "take/ask:old",
        Rule.EVICT,
    ),
    (
        "first in line, every session busy and this proxy's: its changes wake it, the install is looked at seldom",
        {"slots": FULL_BUSY},
        f"take/sleep@{LONE_POLL:g}",
        Rule.BUSY,
    ),
    (
        "every session busy, one in another proxy: look at the install again at the next poll",
        {"slots": SHARED_BUSY},
        f"take/sleep@{POLL:g}",
        Rule.BUSY,
    ),
    (
        "every session busy, a waiter of another proxy before it: look again at the next poll",
        {"slots": FULL_BUSY, "ahead": 1},
        f"sleep@{POLL:g}",
        Rule.BUSY,
    ),
    (
        "room, but another proxy holds a slot: if the take failed, look again at the next poll",
        {"slots": (*FULL_IDLE[:2], slot("theirs", 3.0, instance="proxy-2"))},
        f"take/sleep@{POLL:g}",
        Rule.ROOM,
    ),
    (
        "first in line, the idle ones recent: sleep until the first stops being recent",
        {"slots": tuple(slot(f"r{i}", float(i), recent_until=NOW + 0.01 * (i + 1)) for i in range(4))},
        f"take/sleep@{0.01 + RECENT_MARGIN:g}",
        Rule.RECENT,
    ),
    (
        "recent for longer than a poll: look again at the next poll anyway",
        {"slots": tuple(slot(f"r{i}", float(i), recent_until=NOW + 5.0) for i in range(4))},
        f"take/sleep@{LONE_POLL:g}",
        Rule.RECENT,
    ),
    (
        "a spare goes before any session, however recent the session",
        {"slots": (*FULL_IDLE[:3], slot("spare:a:9", 50.0, spare=True))},
        "take/ask:spare:a:9",
        Rule.EVICT,
    ),
    (
        "a session whose proxy refused moments ago counts as busy: the next one is asked",
        {"slots": FULL_IDLE, "refused": {"old": NOW + 0.1}},
        "take/ask:mid",
        Rule.EVICT,
    ),
    (
        "a refusal long enough ago is forgotten",
        {"slots": FULL_IDLE, "refused": {"old": NOW - 0.1}},
        "take/ask:old",
        Rule.EVICT,
    ),
    (
        "a suspension it was granted is still ending: wait for that slot, suspend nothing more",
        {"slots": FULL_IDLE, "granted": (Granted(slot("gone-soon"), NOW + 6.0),)},
        f"take/sleep@{LONE_POLL:g}",
        Rule.ENDING,
    ),
    (
        "its granted suspension outlived its teardown bound: no longer counted on, the next is asked",
        {"slots": FULL_IDLE, "granted": (Granted(slot("stuck"), NOW - 0.5),)},
        "take/ask:old",
        Rule.EVICT,
    ),
    (
        "second in the install's line with one slot being freed: that slot is the first's, suspend another",
        {"ahead": 1, "position": 1, "slots": (*FULL_IDLE[1:], slot("going", 0.5, stopping=True))},
        "ask:mid",
        Rule.EVICT,
    ),
    (
        "second in line, two slots being freed: one of them is its own, wait",
        {
            "ahead": 1,
            "position": 1,
            "slots": (*FULL_IDLE[2:], slot("g1", 0.5, stopping=True), slot("g2", 0.6, stopping=True)),
        },
        f"sleep@{LONE_POLL:g}",
        Rule.FREEING,
    ),
    (
        "behind waiters of other proxies: never takes a slot file, plans for its own",
        {"ahead": 2, "position": 0, "slots": FULL_IDLE},
        "ask:old",
        Rule.EVICT,
    ),
    (
        "at its deadline, first in line: one last take, then exhausted",
        {"slots": FULL_IDLE, "now": DEADLINE},
        "take/give-up:exhausted",
        Rule.DEADLINE,
    ),
    (
        "at its deadline, not first: exhausted without asking anyone",
        {"slots": FULL_IDLE, "now": DEADLINE, "ahead": 1, "position": 1},
        "give-up:exhausted",
        Rule.DEADLINE,
    ),
    (
        "a poll never sleeps past the deadline",
        {"slots": FULL_BUSY, "deadline": NOW + 0.005},
        "take/sleep@0.005",
        Rule.BUSY,
    ),
    (
        "a session busy only with background work turns idle before the poll: plan again then",
        {"slots": FULL_BUSY, "quiet_at": NOW + 0.004},
        f"take/sleep@{0.004 + QUIET_MARGIN:g}",
        Rule.BUSY,
    ),
    (
        "backend capped below the install: its own least recently used goes, not another backend's",
        {
            "backend_cap": 2,
            "slots": (slot("x-old", 0.5, backend="b"), slot("a-old", 1.0), slot("a-new", 2.0)),
        },
        "take/ask:a-old",
        Rule.EVICT,
    ),
    (
        "starts this proxy reserved fill the install: suspend for this one too",
        {"slots": FULL_IDLE[:3], "reserved": {"a": 1}},
        "take/ask:old",
        Rule.EVICT,
    ),
]


def chosen(key: str, memory: int = 100, stopping: bool = False) -> MemorySlot:
    return MemorySlot(key=key, backend="a", memory=memory, last_active=1.0, stopping=stopping)


TWO_CHOSEN = BudgetPlan(suspend=(chosen("old"), chosen("mid")))
BY_KEY = {"old": slot("old", 1.0), "mid": slot("mid", 2.0), "going": slot("going", 0.5, stopping=True)}

CASES += [
    (
        "holding a slot, no memory budget set: start",
        {"room": Room()},
        "start",
        Rule.FITS,
    ),
    (
        "holding a slot, a memory budget: measure the install's trees first",
        {"room": Room(), "budget": True},
        "measure",
        Rule.FITS,
    ),
    (
        "the new tree fits the budget as measured: start",
        {"room": Room(plan=BudgetPlan()), "budget": True},
        "start",
        Rule.FITS,
    ),
    (
        "a budget nothing can relieve: start anyway (the overrun is logged, the budget is no kill switch)",
        {"room": Room(plan=BudgetPlan(overrun=(Overrun(None, 300, 200),))), "budget": True},
        "start",
        Rule.FITS,
    ),
    (
        "the new tree would not fit: ask for the plan's first choice",
        {"room": Room(plan=TWO_CHOSEN, slots=BY_KEY), "budget": True},
        "ask:old",
        Rule.MEMORY,
    ),
    (
        "then its second, whatever the first answered",
        {"room": Room(plan=TWO_CHOSEN, slots=BY_KEY, asked={"old": False}), "budget": True},
        "ask:mid",
        Rule.MEMORY,
    ),
    (
        "a tree already being stopped is not asked for, only waited for",
        {
            "room": Room(
                plan=BudgetPlan(suspend=(chosen("going", stopping=True),)),
                slots=BY_KEY,
                going=(BY_KEY["going"],),
                until=NOW + 30,
            ),
            "budget": True,
        },
        f"sleep@{POLL:g}",
        Rule.MAKING_ROOM,
    ),
    (
        "every choice asked, the granted ones still there: wait for them, a poll at a time",
        {
            "room": Room(plan=TWO_CHOSEN, slots=BY_KEY, asked={"old": True, "mid": True}, going=(BY_KEY["old"],)),
            "budget": True,
        },
        f"sleep@{POLL:g}",
        Rule.MAKING_ROOM,
    ),
    (
        "the wait for them is bounded: it never sleeps past it",
        {
            "room": Room(
                plan=TWO_CHOSEN,
                slots=BY_KEY,
                asked={"old": True, "mid": True},
                going=(BY_KEY["old"],),
                until=NOW + 0.003,
            ),
            "budget": True,
        },
        "sleep@0.003",
        Rule.MAKING_ROOM,
    ),
    (
        "granted trees still there past the bound: start anyway",
        {
            "room": Room(
                plan=TWO_CHOSEN, slots=BY_KEY, asked={"old": True, "mid": True}, going=(BY_KEY["old"],), until=NOW
            ),
            "budget": True,
        },
        "start[1 overdue]",
        Rule.OVERDUE,
    ),
    (
        "every granted tree gone and none refused: start",
        {"room": Room(plan=TWO_CHOSEN, slots=BY_KEY, asked={"old": True, "mid": True}), "budget": True},
        "start",
        Rule.FITS,
    ),
    (
        "one refused (not idle after all): measure again, planning without it",
        {"room": Room(plan=TWO_CHOSEN, slots=BY_KEY, asked={"old": True, "mid": False}), "budget": True},
        "measure",
        Rule.MAKING_ROOM,
    ),
    (
        "holding a slot, shutting down: give up (the slot is let go of)",
        {"room": Room(plan=TWO_CHOSEN, slots=BY_KEY), "budget": True, "refusing": True},
        "give-up:shutdown",
        Rule.SHUTDOWN,
    ),
    (
        "holding a slot past the line's deadline: the deadline was the line's, room is still made",
        {"room": Room(plan=TWO_CHOSEN, slots=BY_KEY), "budget": True, "now": DEADLINE + 1},
        "ask:old",
        Rule.MEMORY,
    ),
]


@pytest.mark.parametrize(("sentence", "fields", "expected", "rule"), CASES, ids=[case[0] for case in CASES])
def test_admit(sentence: str, fields: dict[str, Any], expected: str, rule: Rule) -> None:
    assert decide(waiting(**fields)) == f"{expected} ({rule})", sentence


def test_every_rule_of_the_table_is_met_by_a_case() -> None:
    assert {case[3] for case in CASES} == set(Rule) == {rule for rule, _, _ in RULES}


def test_architecture_md_shows_the_rules_as_the_code_has_them() -> None:
    doc = (Path(__file__).parent.parent / "docs" / "architecture.md").read_text()
    assert markdown_table() in doc, (
        "docs/architecture.md's admission table differs from acp_proxy/pool/admission.py's RULES; regenerate it: "
        "python -c 'from acp_proxy.pool.admission import markdown_table; print(markdown_table())'"
    )


def test_waiters_that_read_the_same_records_do_not_stall_once_the_shared_slot_is_gone() -> None:
    """Several waiters asked for the same session and were all told yes; the first in line took its
    slot. The others, whose granted suspension is gone, plan again at once: the next session is
    asked, rather than a fixed teardown's length waited out (what once cost 6.5 s per slot)."""
    after = (*FULL_IDLE[1:], slot("first-in-line", 9.0))
    for position in (1, 2, 3):
        assert decide(waiting(position=position, ahead=position, slots=after, granted=())) == f"ask:mid ({Rule.EVICT})"


@pytest.mark.parametrize(("position", "depth", "refusing"), list(itertools.product(range(6), (1, 2, 4), (False, True))))
def test_every_step_is_bounded_by_the_deadline(position: int, depth: int, refusing: bool) -> None:
    """Whatever the line and the install, a waiter never sleeps past its deadline or asks past it."""
    for slots in (FULL_IDLE, FULL_BUSY, FULL_IDLE[:2]):
        for now in (NOW, DEADLINE - 0.001, DEADLINE, DEADLINE + 1):
            w = waiting(position=position, ahead=position, depth=depth, slots=slots, now=now, refusing=refusing)
            step = admit(w)
            if isinstance(step, Take):
                assert position == 0, "only the first in line takes a slot file"
                step = admit(msgspec.structs.replace(w, tried_take=True))
            inner = step
            if refusing:
                assert inner == GiveUp("shutdown", Rule.SHUTDOWN)
            elif now >= DEADLINE:
                assert isinstance(inner, GiveUp), (slots, now)
            elif isinstance(inner, Sleep):
                assert now <= inner.until <= DEADLINE
            else:
                assert isinstance(inner, Ask)
                assert position < depth
            assert not math.isnan(getattr(inner, "until", 0.0))


def test_the_first_in_line_takes_a_slot_file_before_it_reads_the_install() -> None:
    """Reading every slot file's record is for planning: the first in line tries a slot file first,
    and the others, or the first once it found none free, are told to look before they plan."""
    first = waiting(slots=None)
    assert admit(first) == Take()
    assert admit(msgspec.structs.replace(first, tried_take=True)) == Look()
    assert admit(waiting(slots=None, ahead=1, position=1)) == Look()
    assert admit(waiting(slots=None, position=4, ahead=4)).rule is Rule.BACK  # far back: reads nothing
