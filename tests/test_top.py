"""``acp-proxy top``: what it draws (golden files), what keys do, what it gathers from a real install,
and the real command in a pseudo-terminal (keys act; the terminal is left as it was found).

Goldens live in tests/data/top/; after an intended change to the layout, regenerate them with
``UPDATE_TOP_SNAPSHOTS=1 pytest tests/test_top.py -k golden`` and review the diff.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import pytest
import sniffio
from rich.console import Console
from rich.text import Text

from acp_proxy.journal import Event
from acp_proxy.operator import reports
from acp_proxy.operator.control import socket_path
from acp_proxy.operator.install_view import InstallView, ProxyFacts
from acp_proxy.operator.top.snapshot import (
    PROXY_TIMEOUT,
    EventRow,
    Gatherer,
    OptionRow,
    PoolUsage,
    ProxyRow,
    SessionRow,
    Snapshot,
    TurnRow,
    WaitingRow,
    event_row,
    last_line,
    proxy_facts_row,
    proxy_row,
    snapshot_json,
    turn_row,
    waiting_of,
    waiting_rows,
)
from acp_proxy.operator.top.terminal import _screen, _Wakeup, answer_request, decode_keys
from acp_proxy.operator.top.view import (
    WAITING_KEYS_HELP,
    Focus,
    Pending,
    ViewState,
    allot,
    on_key,
    print_plain,
    render,
    short_id,
)
from acp_proxy.operator.top.view import _Panel as Panel
from acp_proxy.sessions.registry import SessionState
from acp_proxy.tasks.records import TaskRecord
from acp_proxy.tasks.status import TaskStatus
from tests.support import (
    RESUME_AND_LOAD,
    Gateway,
    cli,
    cli_json,
    registry,
    send_prompt,
    state_db,
    wait_for_task,
    write_config,
)

GOLDEN = Path(__file__).parent / "data" / "top"
UPDATE = bool(os.environ.get("UPDATE_TOP_SNAPSHOTS"))
T0 = 1_700_000_000.0
GIB = 1024**3
MIB = 1024**2


# --- snapshots built by hand -----------------------------------------------------------------


def busy_install() -> Snapshot:
    """3 proxies (one not answering), 12 sessions (long ids, titles), 2 running turns, a memory budget, 8 events."""
    proxies = (
        ProxyRow("a1b2c3d4e5f0", 41000, T0 - 65, True, True, None, "asyncio", 3, 8, 6 * GIB, 5, 1),
        ProxyRow("a1b2c3d4e5f1", 41007, T0 - 3700, True, True, None, "trio", 2, 8, 6 * GIB, 4, 1),
        ProxyRow("a1b2c3d4e5f2", 41020, T0 - 7300, True, False, "no answer within 1s"),
    )
    states = ("live", "live", "suspended", "resuming", "closed", "suspended")
    backends = ("claude", "codex", "gemini")
    sessions = tuple(
        SessionRow(
            f"0199a7c2-3f4e-7b1a-9c2d-{i:012x}" if i % 3 else f"fake-{i:02d}",
            backends[i % 3],
            states[i % 6],
            title=None if i % 4 == 0 else f"Refactor the payment module and add tests for edge case {i}",
            instance=f"a1b2c3d4e5f{i % 3}",
            proxy_alive=i != 9,
            idle_seconds=i * 37.0,
            busy=i == 1,
            memory=(i + 1) * 150 * MIB if states[i % 6] == "live" else None,
            memory_kind="pss",
        )
        for i in range(12)
    )
    turns = (
        TurnRow(
            "9bac59b75e4a",
            sessions[1].session_id,
            "codex",
            "running",
            148,
            12,
            754.2,
            "Now I am going to run the whole test suite again to verify that the refactoring of the payment "
            "module did not break anything else in the checkout flow",
        ),
        TurnRow("0d47acf9227b", sessions[0].session_id, "claude", "running", 3, 0, 4.0, "Reading the module"),
    )
    kinds = [
        ("suspended", "idle_ttl", ""),
        ("resumed", "session/resume", ""),
        ("crashed", "exit 1", ""),
        ("spawn_failed", "", "FileNotFoundError: codex-acp"),
        ("tree_reaped", "startup", "3 processes of a dead proxy"),
        ("closed", "", ""),
        ("suspended", "operator", ""),
        ("suspended", "memory", "the install used 6.2G of its 6.0G max_memory"),
    ]
    events = tuple(
        EventRow(100 - i, T0 - i * 61, kind, label, sessions[i].session_id, backends[i % 3], detail, "a1b2c3d4e5f0")
        for i, (kind, label, detail) in enumerate(kinds)
    )
    pool = PoolUsage(live=7, max_live=8, memory_used=5 * GIB + 300 * MIB, max_memory=6 * GIB)
    timed = {
        "start": {"count": 212, "p50": 0.41, "p95": 1.2},
        "session_new": {"count": 30, "p50": 0.62, "p95": 2.4},
        "restore": {"count": 181, "p50": 1.9, "p95": 4.1},
        "first_update": {"count": 1040, "p50": 0.9, "p95": 3.3},
        "turn": {"count": 1031, "p50": 38.0, "p95": 245.0},
        "slot_wait": {"count": 90, "p50": 0.004, "p95": 2.2},
    }
    return Snapshot("/home/operator/.local/state/acp-proxy", T0, True, pool, proxies, sessions, turns, events, timed)


def empty_install() -> Snapshot:
    proxy = ProxyRow("c0ffee000001", 5150, T0 - 12, True, True, None, "asyncio", 0, 4, None, 0, 0)
    return Snapshot("/tmp/state", T0, True, PoolUsage(0, 4), (proxy,))


BUSY = busy_install()
ALLOW, REJECT = OptionRow("allow", "Allow", "allow_once"), OptionRow("reject", "Reject", "reject_once")


def waiting_install() -> Snapshot:
    """The busy install with three requests waiting: two permissions (one sent to a client attached
    to its session) and an elicitation."""
    sessions = BUSY.sessions
    waiting = (
        WaitingRow(
            "a1b2c3d4.7",
            "a1b2c3d4e5f0",
            41000,
            sessions[1].session_id,
            "session/request_permission",
            "Run `pytest -q tests/test_checkout.py` in the payment module",
            (ALLOW, OptionRow("allow_always", "Always allow", "allow_always"), REJECT),
            754.0,
            ("phone (alice)",),
            T0 - 754,
        ),
        WaitingRow(
            "a1b2c3d4.9",
            "a1b2c3d4e5f0",
            41000,
            sessions[0].session_id,
            "session/request_permission",
            "",
            (ALLOW, REJECT),
            42.0,
            (),
            T0 - 42,
        ),
        WaitingRow(
            "a1b2c3d4.3",
            "a1b2c3d4e5f1",
            41007,
            sessions[3].session_id,
            "elicitation/create",
            "Your name?",
            (),
            5.0,
            (),
            T0 - 5,
        ),
    )
    return replace(BUSY, waiting=waiting)


WAITING = waiting_install()
W0, W1, W2 = (w.request for w in WAITING.waiting)
CASES: dict[str, tuple[Snapshot, ViewState]] = {
    "no-state": (Snapshot("/tmp/never-used", T0, False, PoolUsage(0, 4)), ViewState()),
    "empty": (empty_install(), ViewState()),
    "busy": (BUSY, ViewState(session=BUSY.sessions[9].session_id)),
    "confirm": (BUSY, ViewState(session=BUSY.sessions[2].session_id, pending=Pending("suspend", "0199a7c2-3f4e-7b1a"))),
    "message": (
        BUSY,
        ViewState(
            focus=Focus.TURNS,
            turn="0d47acf9227b",
            message="the proxy (instance a1b2c3d4e5f0) refused: session fake-00 is busy (a turn or request is "
            "in flight); cancel it or wait",
            failed=True,
        ),
    ),
    "waiting": (WAITING, ViewState(focus=Focus.WAITING, request=W1)),
}


def rendered(snapshot: Snapshot, view: ViewState, width: int, height: int) -> str:
    console = Console(
        width=width, height=height, record=True, color_system=None, force_terminal=False, file=io.StringIO()
    )
    console.print(render(snapshot, view, width, height))
    return console.export_text()


@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24", "120x40"])
@pytest.mark.parametrize("case", list(CASES))
def test_golden_render(case: str, size: tuple[int, int]) -> None:
    width, height = size
    snapshot, view = CASES[case]
    text = rendered(snapshot, view, width, height)
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines), [line for line in lines if len(line) > width]
    assert len(lines) <= height
    normalized = "\n".join(line.rstrip() for line in lines) + "\n"
    golden = GOLDEN / f"{case}-{width}x{height}.txt"
    if UPDATE:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(normalized)
    assert golden.exists(), f"no golden {golden.name}: run with UPDATE_TOP_SNAPSHOTS=1"
    assert normalized == golden.read_text()


@pytest.mark.parametrize("height", [3, 8, 12, 16, 24])
@pytest.mark.parametrize("width", [40, 80])
def test_small_terminals_are_never_overflowed(width: int, height: int) -> None:
    for snapshot, view in CASES.values():
        lines = rendered(snapshot, view, width, height).splitlines()
        assert len(lines) <= height
        assert all(len(line) <= width for line in lines)


def test_the_busy_view_at_80x24_keeps_the_selected_session_the_turns_and_the_key_help() -> None:
    snapshot, view = CASES["busy"]
    text = rendered(snapshot, view, 80, 24)
    assert "> fake-09" in text, "the selected row is scrolled into view"
    assert [part for part in ("9bac59b75e4a", "0d47acf9227b", "live 7/8", "memory 5.3G/6.0G") if part not in text] == []
    assert text.splitlines()[-1].startswith("↑↓/jk select")


# --- keys ------------------------------------------------------------------------------------

S0, S1 = BUSY.sessions[0].session_id, BUSY.sessions[1].session_id


@pytest.mark.parametrize(
    ("view", "key", "expected", "act", "quits"),
    [
        # moving: the first row is selected until another is
        (ViewState(), "down", ViewState(session=S1), None, False),
        (ViewState(), "j", ViewState(session=S1), None, False),
        (ViewState(session=S1), "k", ViewState(session=S0), None, False),
        (ViewState(), "up", ViewState(session=S0), None, False),
        (ViewState(focus=Focus.TURNS), "down", ViewState(focus=Focus.TURNS, turn="0d47acf9227b"), None, False),
        (ViewState(), "tab", ViewState(focus=Focus.TURNS), None, False),
        # an act is asked for, then confirmed or not
        (ViewState(), "s", ViewState(pending=Pending("suspend", S0)), None, False),
        (ViewState(session=S1), "c", ViewState(session=S1, pending=Pending("close", S1)), None, False),
        (ViewState(), "x", ViewState(pending=Pending("cancel", "9bac59b75e4a")), None, False),
        (
            ViewState(pending=Pending("close", S0)),
            "y",
            ViewState(working=Pending("close", S0)),
            Pending("close", S0),
            False,
        ),
        (ViewState(pending=Pending("close", S0)), "n", ViewState(message="not done"), None, False),
        (ViewState(pending=Pending("close", S0)), "q", ViewState(message="not done"), None, False),
        (ViewState(pending=Pending("close", S0)), "down", ViewState(pending=Pending("close", S0)), None, False),
        # one act at a time
        (
            ViewState(working=Pending("close", S0)),
            "s",
            ViewState(working=Pending("close", S0), message=f"wait: still doing close session {S0}", failed=True),
            None,
            False,
        ),
        (ViewState(), "q", ViewState(), None, True),
        (ViewState(), "?", ViewState(), None, False),
    ],
)
def test_keys(view: ViewState, key: str, expected: ViewState, act: Pending | None, quits: bool) -> None:
    step = on_key(view, BUSY, key)
    assert (step.view, step.act, step.quit) == (expected, act, quits)


def test_acting_on_an_empty_list_says_so() -> None:
    empty = empty_install()
    assert on_key(ViewState(), empty, "s").view.message == "no session selected"
    assert on_key(ViewState(), empty, "x").view.message == "no running turn to cancel"
    assert on_key(ViewState(), empty, "down").view == ViewState()


P0, P1 = "a1b2c3d4e5f0", "a1b2c3d4e5f1"
ANSWER_ALLOW = Pending("answer", W0, P0, "allow", "Allow")


@pytest.mark.parametrize(
    ("view", "key", "expected", "act"),
    [
        # the oldest waiting request is selected until another is; its options are numbered from 1
        (ViewState(), "1", ViewState(pending=ANSWER_ALLOW), None),
        (ViewState(), "3", ViewState(pending=Pending("answer", W0, P0, "reject", "Reject")), None),
        (
            ViewState(request=W1),
            "2",
            ViewState(request=W1, pending=Pending("answer", W1, P0, "reject", "Reject")),
            None,
        ),
        # d denies it: answered cancelled
        (ViewState(request=W1), "d", ViewState(request=W1, pending=Pending("answer", W1, P0)), None),
        # then confirmed, or not
        (ViewState(pending=ANSWER_ALLOW), "y", ViewState(working=ANSWER_ALLOW), ANSWER_ALLOW),
        (ViewState(pending=ANSWER_ALLOW), "n", ViewState(message="not done"), None),
        # the waiting list is drawn first: Tab goes sessions, turns, waiting; backtab the other way
        (ViewState(focus=Focus.TURNS), "tab", ViewState(focus=Focus.WAITING), None),
        (ViewState(focus=Focus.WAITING), "tab", ViewState(focus=Focus.SESSIONS), None),
        (ViewState(), "backtab", ViewState(focus=Focus.WAITING), None),
        (ViewState(focus=Focus.WAITING), "down", ViewState(focus=Focus.WAITING, request=W1), None),
        (ViewState(focus=Focus.WAITING, request=W2), "k", ViewState(focus=Focus.WAITING, request=W1), None),
        (ViewState(focus=Focus.WAITING, request=W2), "j", ViewState(focus=Focus.WAITING, request=W2), None),
        # the keys act on the selected request whichever list has the focus, as s, c and x do
        (
            ViewState(focus=Focus.TURNS, request=W1),
            "1",
            ViewState(focus=Focus.TURNS, request=W1, pending=Pending("answer", W1, P0, "allow", "Allow")),
            None,
        ),
        # what cannot be answered here says so
        (ViewState(), "4", ViewState(message="request a1b2c3d4.7 has options 1-3", failed=True), None),
        (
            ViewState(request=W2),
            "1",
            ViewState(request=W2, message="elicitation/create is answered by a client, not here", failed=True),
            None,
        ),
        (
            ViewState(request=W2),
            "d",
            ViewState(request=W2, message="elicitation/create is answered by a client, not here", failed=True),
            None,
        ),
        # one act at a time
        (
            ViewState(working=ANSWER_ALLOW),
            "2",
            ViewState(
                working=ANSWER_ALLOW,
                message="wait: still doing answer allow (Allow) to request a1b2c3d4.7",
                failed=True,
            ),
            None,
        ),
    ],
)
def test_keys_on_requests_waiting_for_an_answer(
    view: ViewState, key: str, expected: ViewState, act: Pending | None
) -> None:
    step = on_key(view, WAITING, key)
    assert (step.view, step.act, step.quit) == (expected, act, False)


def test_without_waiting_requests_the_answer_keys_say_so_and_the_focus_stays_on_the_other_lists() -> None:
    for key in ("1", "9", "d"):
        assert on_key(ViewState(), BUSY, key).view == ViewState(
            message="no request is waiting for an answer", failed=True
        )
    # answered meanwhile: the waiting list is gone, its focus goes back to the sessions
    assert on_key(ViewState(focus=Focus.WAITING), BUSY, "down").view == ViewState(focus=Focus.WAITING, session=S1)
    assert on_key(ViewState(focus=Focus.WAITING), BUSY, "tab").view == ViewState(focus=Focus.TURNS)
    assert on_key(ViewState(focus=Focus.TURNS), BUSY, "tab").view == ViewState(focus=Focus.SESSIONS)


def test_the_waiting_pane_lists_each_request_with_its_numbered_options() -> None:
    text = rendered(WAITING, ViewState(), 120, 40)
    lines = [line.rstrip() for line in text.splitlines()]
    assert lines[2].startswith("  WAITING FOR AN ANSWER (3)"), "on top, under the header and the timings"
    [first] = [line for line in lines if "a1b2c3d4.7" in line]
    assert first.startswith("> 12m34s 0199a7c2-3f…000000000001")
    assert first.endswith("1 Allow  2 Always allow  3 Reject")
    assert "Run `pytest -q" in first
    [unnamed] = [line for line in lines if "a1b2c3d4.9" in line]
    assert "session/request_permission" in unnamed, "no subject: its method"
    assert "elicitation/create: Your name?" in text
    assert lines[-1] == WAITING_KEYS_HELP
    # focused: its title is marked; the selected request is asked about before it is answered
    focused = [
        line.rstrip()
        for line in rendered(WAITING, ViewState(focus=Focus.WAITING, pending=ANSWER_ALLOW), 80, 24).splitlines()
    ]
    assert focused[2].startswith("» WAITING FOR AN ANSWER (3)  1-1 of 3")
    assert focused[-1] == "answer allow (Allow) to request a1b2c3d4.7? (y/n)"
    deny = [
        line.rstrip() for line in rendered(WAITING, ViewState(pending=Pending("answer", W1, P0)), 80, 24).splitlines()
    ]
    assert deny[-1] == "deny request a1b2c3d4.9? (y/n)"
    # none waiting: no pane, the keys help as before
    assert "WAITING" not in rendered(BUSY, ViewState(), 120, 40)


@pytest.mark.parametrize("height", range(3, 12))
@pytest.mark.parametrize("width", [20, 33, 40])
def test_the_waiting_pane_never_overflows_a_small_terminal(width: int, height: int) -> None:
    for view in (ViewState(focus=Focus.WAITING, request=W2), ViewState(pending=ANSWER_ALLOW)):
        lines = rendered(WAITING, view, width, height).splitlines()
        assert len(lines) <= max(3, height)
        assert all(len(line) <= max(20, width) for line in lines)


@pytest.mark.parametrize(
    ("data", "keys", "rest"),
    [
        (b"jk", ["j", "k"], b""),
        (b"\x1b[A\x1b[B\x1bOA\x1bOB", ["up", "down", "up", "down"], b""),
        (b"\t\x1b[Z", ["tab", "backtab"], b""),
        (b"s\x1b", ["s", "esc"], b""),
        (b"\x1b[1;5C" + b"q", ["q"], b""),  # an unknown sequence is skipped whole
        (b"y\x1b[", ["y"], b"\x1b["),  # cut short: kept for the next read
        ("é".encode(), [], b""),
    ],
)
def test_decode_keys(data: bytes, keys: list[str], rest: bytes) -> None:
    assert decode_keys(data) == (keys, rest)


def test_the_layout_gives_rows_to_turns_proxies_sessions_then_events() -> None:
    panels = [Panel("sessions", 12, 4), Panel("turns", 2, 2), Panel("proxies", 3, 1), Panel("events", 8, 3)]
    assert allot(22, panels, ("turns", "proxies", "sessions", "events")) == {
        "sessions": 6,
        "turns": 2,
        "proxies": 3,
        "events": 3,
    }
    assert allot(12, panels, ("turns", "proxies", "sessions", "events")) == {"sessions": 6, "turns": 2}
    assert allot(100, panels, ("turns",)) == {"sessions": 4, "turns": 2, "proxies": 1, "events": 3}


def test_ids_are_cut_in_the_middle_and_text_to_its_last_line() -> None:
    assert short_id("0199a7c2-3f4e-7b1a-9c2d-00000000000b", 14) == "0199a7…000000b"
    assert short_id("fake-01", 14) == "fake-01"
    assert last_line("first\n  second   line \n\n") == "second line"
    assert last_line("") == ""


# --- rows from what was read: an adapter's text never drives the terminal ---------------------

NASTY = "Fix\nthe\tbuild\x1b[2J\x07 now"
"""A newline, a tab, an escape sequence and a bell, as an adapter may send them."""
CLEAN = "Fix the build?[2J? now"


def a_running_task(summary: str) -> TaskRecord:
    return TaskRecord(
        "task-1", "fake-01", "fake", "a1b2c3d4e5f0", None, None, TaskStatus.RUNNING, None, None, None, "go",
        T0 - 60, T0 - 30, T0 - 29, None, summary, 3, 1, (), 0, T0,
    )  # fmt: skip


def test_an_events_label_and_detail_are_one_printable_line() -> None:
    event = Event(7, T0, "a1b2c3d4e5f0", "crashed", "fake", NASTY, "fake-01", NASTY)
    assert event_row(event) == EventRow(7, T0, "crashed", CLEAN, "fake-01", "fake", CLEAN, "a1b2c3d4e5f0")


def test_a_turns_last_text_is_its_last_line_made_printable() -> None:
    row = turn_row(a_running_task("first line\nthe\tbuild\x1b[2J\x07 now\n\n"), T0)
    assert (row.last_text, row.elapsed_seconds) == ("the build?[2J? now", 30.0)
    assert turn_row(a_running_task("done\n"), T0).last_text == "done"


def test_a_proxys_refusal_and_answer_are_printable() -> None:
    refused = proxy_row("a1b2c3d4e5f0", 41000, T0, f"refused: {NASTY}")
    assert (refused.answered, refused.problem) == (False, f"refused: {CLEAN}")
    answer = {"asyncBackend": "trio\x1b[2J", "pool": {"live": 2, "maxLive": 4}, "sessions": 3, "turns": [{}]}
    answered = proxy_row("a1b2c3d4e5f0", 41000, T0, answer)
    assert (answered.answered, answered.async_backend, answered.live, answered.turns) == (True, "trio?[2J", 2, 1)


def status_answer(*waiting: dict[str, Any]) -> dict[str, Any]:
    return {"pool": {"live": 1}, "sessions": 1, "turns": [], "waiting": list(waiting), "attachedClients": 2}


def a_waiting_request(key: str, asked_at: float, **fields: Any) -> dict[str, Any]:
    return {
        "request": key,
        "sessionId": "fake-01",
        "method": "session/request_permission",
        "subject": "Run the tool",
        "options": [{"optionId": "allow", "name": "Allow", "kind": "allow_once"}],
        "askedAt": asked_at,
        "waitingSeconds": T0 - asked_at,
        "sentTo": [],
        **fields,
    }


def test_a_waiting_requests_subject_option_names_and_clients_are_printable() -> None:
    answer = status_answer(
        a_waiting_request(
            "a1b2c3d4.1",
            T0 - 3,
            subject=NASTY,
            options=[{"optionId": "al\nlow", "name": NASTY, "kind": None}, {"name": "no id"}, "junk"],
            sentTo=[NASTY, 7],
        ),
        {"request": "no session"},
        "junk",
    )
    [row] = waiting_rows("a1b2c3d4e5f0", 41000, answer)
    assert row == WaitingRow(
        "a1b2c3d4.1",
        "a1b2c3d4e5f0",
        41000,
        "fake-01",
        "session/request_permission",
        CLEAN,
        (OptionRow("al\nlow", CLEAN, None),),  # an id is kept as it is: an answer names it
        3.0,
        (CLEAN,),
        T0 - 3,
    )
    assert proxy_row("a1b2c3d4e5f0", 41000, T0, answer).attached_clients == 2
    assert waiting_rows("a1b2c3d4e5f0", 41000, {"pool": {}}) == [], "a proxy that lists none"


def test_waiting_requests_of_every_proxy_are_listed_oldest_first() -> None:
    view = InstallView(
        state_dir=Path("/tmp/state"),
        taken_at=T0,
        clock=0.0,
        proxies=(
            ProxyFacts(P0, 41000, T0 - 100, True, status_answer(a_waiting_request("a.2", T0 - 5))),
            ProxyFacts(
                P1,
                41007,
                T0 - 100,
                True,
                status_answer(a_waiting_request("b.1", T0 - 9), a_waiting_request("b.4", T0 - 1)),
            ),
            ProxyFacts("a1b2c3d4e5f2", 41020, T0 - 100, True, "no answer within 1s"),
            ProxyFacts("a1b2c3d4e5f3", 41030, T0 - 100, False, status_answer(a_waiting_request("gone.1", T0 - 20))),
        ),
    )
    assert [(w.request, w.instance, w.pid) for w in waiting_of(view)] == [
        ("b.1", P1, 41007),
        ("a.2", P0, 41000),
        ("b.4", P1, 41007),
    ]


def test_the_plain_table_lists_waiting_requests_with_their_option_ids() -> None:
    out = io.StringIO()
    print_plain(WAITING, out)
    table = out.getvalue()
    [header] = [line for line in table.splitlines() if line.startswith("REQUEST")]
    assert header.split() == ["REQUEST", "AGE", "SESSION", "PROXY", "ASKS", "OPTIONS", "SENT", "TO"]
    [first] = [line for line in table.splitlines() if line.startswith("a1b2c3d4.7")]
    assert "allow (Allow), allow_always (Always allow), reject (Reject)" in first
    assert first.endswith("phone (alice)")
    assert "elicitation/create: Your name?" in table
    out = io.StringIO()
    print_plain(BUSY, out)
    assert "no requests waiting for an answer" in out.getvalue()


def test_an_adapters_session_id_is_printed_printable() -> None:
    assert short_id("fake\x1b[2J-01", 14) == "fake?[2J-01"


def test_the_json_snapshot_uses_camel_case() -> None:
    document = snapshot_json(BUSY)
    assert document["pool"] == {"live": 7, "maxLive": 8, "memoryUsed": 5 * GIB + 300 * MIB, "maxMemory": 6 * GIB}
    assert document["sessions"][0]["idleSeconds"] == 0.0
    assert document["turns"][0]["lastText"].startswith("Now I am going")
    json.dumps(document)
    waiting = snapshot_json(WAITING)["waiting"]
    assert waiting[0] == {
        "request": "a1b2c3d4.7",
        "instance": P0,
        "pid": 41000,
        "sessionId": BUSY.sessions[1].session_id,
        "method": "session/request_permission",
        "subject": "Run `pytest -q tests/test_checkout.py` in the payment module",
        "options": [
            {"optionId": "allow", "name": "Allow", "kind": "allow_once"},
            {"optionId": "allow_always", "name": "Always allow", "kind": "allow_always"},
            {"optionId": "reject", "name": "Reject", "kind": "reject_once"},
        ],
        "waitingSeconds": 754.0,
        "sentTo": ["phone (alice)"],
        "askedAt": T0 - 754,
    }
    assert document["waiting"] == []


# --- against a real install --------------------------------------------------------------------


def start(env: dict[str, str], tmp_path: Path, **options: Any) -> Any:
    options.setdefault("store", str(tmp_path / "store"))
    options.setdefault("caps", RESUME_AND_LOAD)
    config = write_config(tmp_path, pool={"max_live": 4})
    return Gateway.start(env, tmp_path, proxy_args=["--config", str(config)], **options), config


def gather_once(state_dir: Path, **options: Any) -> Snapshot:
    """One snapshot, gathered and closed in the same thread (the database connection is that thread's)."""
    gatherer = Gatherer(state_dir, **options)
    try:
        return gatherer.gather()
    finally:
        gatherer.close()


@pytest.mark.anyio
async def test_a_snapshot_of_a_real_install(proc_env: dict[str, str], tmp_path: Path) -> None:
    state_dir = Path(proc_env["ACP_PROXY_STATE_DIR"])
    proxy, _ = start(proc_env, tmp_path)
    async with proxy as gw:
        await gw.initialize()
        working, idle = await gw.new_session(), await gw.new_session()
        await gw.prompt(idle, "title Fix the flaky test")
        code, _, err = await cli(proc_env, "sessions", "suspend", idle)
        assert code == 0, err
        request_id = await send_prompt(gw, working, "stream 3; wait_cancel")
        running = await wait_for_task(proc_env, "running", prompt="wait_cancel")
        snapshot = await anyio.to_thread.run_sync(gather_once, state_dir)
        code, table, _ = await cli(proc_env, "top")
        document = await cli_json(proc_env, "top")
        await gw.notify("session/cancel", {"sessionId": working})
        assert (await gw.response_to(request_id))["result"]["stopReason"] == "cancelled"

    [proxy_row] = snapshot.proxies
    assert (proxy_row.pid, proxy_row.answered, proxy_row.async_backend) == (
        gw.pid,
        True,
        sniffio.current_async_library(),
    )
    assert proxy_row.live == 1
    sessions = {s.session_id: s for s in snapshot.sessions}
    assert (sessions[working].state, sessions[working].busy) == ("live", True)
    assert (sessions[working].memory or 0) > 0, "measured here: no budget is set"
    assert (sessions[idle].state, sessions[idle].title, sessions[idle].memory) == (
        "suspended",
        "Fix the flaky test",
        None,
    )
    [turn] = snapshot.turns
    assert (turn.task_id, turn.session_id, turn.status) == (running["taskId"], working, "running")
    assert turn.elapsed_seconds is not None
    suspended = [e for e in snapshot.events if e.kind == "suspended"]
    assert [(e.session_id, e.label) for e in suspended] == [(idle, "operator")]
    assert (snapshot.pool.live, snapshot.pool.max_live, snapshot.pool.max_memory) == (1, 4, None)

    assert code == 0
    assert [part for part in ("PROXY", working, running["taskId"], "operator") if part not in table] == []
    assert document["turns"][0]["taskId"] == running["taskId"]
    assert {s["sessionId"]: s["state"] for s in document["sessions"]} == {working: "live", idle: "suspended"}
    # Where the time went, as the proxy added it to the install's totals (by its exit at the latest).
    after = await anyio.to_thread.run_sync(gather_once, state_dir)
    assert after.timings["turn"]["count"] == 2
    assert after.timings["session_new"]["count"] == 2
    assert after.timings["first_update"]["p50"] <= after.timings["first_update"]["p95"]
    code, table, _ = await cli(proc_env, "top")
    assert "p50/p95  start " in table


@pytest.mark.anyio
async def test_a_title_that_would_drive_the_terminal_is_drawn_as_one_printable_line(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    state_dir = Path(proc_env["ACP_PROXY_STATE_DIR"])
    proxy, _ = start(proc_env, tmp_path)
    async with proxy as gw:
        await gw.initialize()
        session = await gw.new_session()
        await gw.prompt(session, "title Fix the\nflaky test\x1b[2J")
        with anyio.fail_after(10):  # a turn's title is recorded with its outcome, moments after its answer
            while not (snapshot := await anyio.to_thread.run_sync(gather_once, state_dir)).sessions[0].title:
                await anyio.sleep(0.05)
        code, table, _ = await cli(proc_env, "top", "--once")

    [row] = snapshot.sessions
    assert (row.session_id, row.title) == (session, "Fix the flaky test?[2J")
    screen = rendered(snapshot, ViewState(), 80, 24)
    assert len(screen.splitlines()) <= 24
    assert "\x1b" not in screen
    assert "Fix the flaky test?[2J" in screen
    assert code == 0
    assert "\x1b" not in table
    assert "Fix the flaky test?[2J" in table


@pytest.mark.anyio
async def test_top_on_a_state_dir_no_proxy_has_used(proc_env: dict[str, str], tmp_path: Path) -> None:
    code, out, _ = await cli(proc_env, "top")
    assert (code, out.splitlines()[-1]) == (0, f"no proxy has used {proc_env['ACP_PROXY_STATE_DIR']} yet")
    document = await cli_json(proc_env, "top")
    assert (document["database"], document["sessions"]) == (False, [])
    code, _, err = await cli(proc_env, "top", "--interval", "0")
    assert code == 2
    assert "positive" in err


# --- in a pseudo-terminal ----------------------------------------------------------------------

ALT_SCREEN_OFF = b"\x1b[?1049l"
CURSOR_SHOWN = b"\x1b[?25h"
TAKE_TERMINAL = (
    "import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    "os.execv(sys.executable, [sys.executable, '-m', 'acp_proxy', *sys.argv[1:]])"
)
"""Run by the child in a new session: the pty becomes its controlling terminal (so Ctrl-C is SIGINT), then top."""


class Terminal:
    """A pseudo-terminal of 80x24 with ``acp-proxy top`` in it; every read bounded by a deadline."""

    def __init__(self, env: dict[str, str], *args: str) -> None:
        self.master, self.slave = os.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        self.modes = termios.tcgetattr(self.slave)
        self.output = bytearray()
        self.process = subprocess.Popen(
            [sys.executable, "-c", TAKE_TERMINAL, "top", *args],
            stdin=self.slave,
            stdout=self.slave,
            stderr=self.slave,
            env={**env, "TERM": "xterm-256color"},
            start_new_session=True,
        )

    def pump(self, done: Callable[[], bool], timeout: float = 30.0) -> None:
        """Read what top draws (it must never block on a full pty) until ``done()``; fail after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                tail = bytes(self.output[-2000:]).decode(errors="replace")
                raise AssertionError(f"timed out; the terminal showed, last: {tail!r}")
            ready, _, _ = select.select([self.master], [], [], min(left, 0.1))
            if ready:
                with contextlib.suppress(OSError):
                    self.output += os.read(self.master, 65536)

    def drain(self) -> None:
        """Read what is left in the pty: once top has exited, everything it wrote is there, but ``pump``
        stops at the exit and may not have read the last of it."""
        while select.select([self.master], [], [], 0.05)[0]:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return
            if not data:
                return
            self.output += data

    def shows(self, text: str) -> Callable[[], bool]:
        start = len(self.output)
        return lambda: text.encode() in self.output[start:]

    def press(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def exited(self) -> bool:
        return self.process.poll() is not None

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        os.close(self.master)
        os.close(self.slave)


@contextlib.contextmanager
def terminal(env: dict[str, str], *args: str) -> Iterator[Terminal]:
    term = Terminal(env, *args)
    try:
        yield term
    finally:
        term.close()


def session_state(env: dict[str, str], session: str) -> SessionState | None:
    registry_ = registry(env)
    try:
        record = registry_.get(session)
        return None if record is None else record.state
    finally:
        registry_.db.close()


def assert_left_cleanly(term: Terminal) -> None:
    assert term.process.returncode == 0, bytes(term.output[-1000:])
    term.drain()
    tail = bytes(term.output[-64:])
    assert tail.endswith(CURSOR_SHOWN + ALT_SCREEN_OFF), "the alternate screen is left, the cursor shown"
    assert termios.tcgetattr(term.slave) == term.modes, "the tty's modes are restored"


def drive_suspend_then_quit(env: dict[str, str], config: Path, session: str) -> None:
    with terminal(env, "--config", str(config)) as term:
        term.pump(term.shows(short_id(session, 14)))  # drawn, with the session (the only one: selected)
        term.press(b"s")
        term.pump(term.shows("(y/n)"))
        term.press(b"y")
        term.pump(lambda: session_state(env, session) is SessionState.SUSPENDED)
        term.pump(term.shows("suspended"))
        term.press(b"q")
        term.pump(term.exited, timeout=15)
        assert_left_cleanly(term)


def drive_ctrl_c(env: dict[str, str], config: Path) -> None:
    with terminal(env, "--config", str(config)) as term:
        term.pump(term.shows("SESSIONS"))
        term.press(b"\x03")
        term.pump(term.exited, timeout=15)
        assert_left_cleanly(term)


def test_a_view_that_fails_still_leaves_the_terminal_as_it_found_it() -> None:
    master, slave = os.openpty()
    wakeup = _Wakeup()
    try:
        modes = termios.tcgetattr(slave)
        taken: list[list[Any]] = []

        def draw_then_fail(console: Console) -> None:
            with _screen(slave, console, wakeup) as live:
                live.update(Text("drawn"), refresh=True)
                taken.append(termios.tcgetattr(slave))
                raise RuntimeError("a bug in the view")

        with open(slave, "w", encoding="utf-8", closefd=False) as tty_file, pytest.raises(RuntimeError):
            draw_then_fail(Console(file=tty_file, force_terminal=True, width=80, height=24))
        assert taken[0] != modes, "the view ran in cbreak mode"
        output = b""
        while select.select([master], [], [], 0.5)[0]:
            output += os.read(master, 65536)
        assert b"drawn" in output
        assert output.endswith(CURSOR_SHOWN + ALT_SCREEN_OFF)
        assert termios.tcgetattr(slave) == modes
    finally:
        wakeup.close()
        os.close(master)
        os.close(slave)


@pytest.mark.anyio
async def test_top_in_a_terminal_acts_on_keys_and_restores_the_terminal(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    proxy, config = start(proc_env, tmp_path)
    async with proxy as gw:
        await gw.initialize()
        session = await gw.new_session()
        await anyio.to_thread.run_sync(drive_suspend_then_quit, proc_env, config, session)
        await anyio.to_thread.run_sync(drive_ctrl_c, proc_env, config)
        listed = await cli_json(proc_env, "sessions", "list")
    assert [(s["sessionId"], s["state"]) for s in listed["sessions"]] == [(session, "suspended")]


def drive_answer_allow_then_quit(env: dict[str, str], config: Path, request: str) -> None:
    """Select the waiting request (the only one), choose its option 1 (allow), confirm, see it answered, quit."""
    with terminal(env, "--config", str(config)) as term:
        term.pump(term.shows("WAITING FOR AN ANSWER (1)"))
        focused = term.shows("» WAITING FOR AN ANSWER (1)")
        term.press(b"\x1b[Z")  # backtab: from the sessions to the waiting requests, drawn above them
        term.pump(focused)
        asked = term.shows(f"answer allow (Allow) to request {request}? (y/n)")
        term.press(b"1")
        term.pump(asked)
        answered = term.shows(f"request {request} answered allow")
        term.press(b"y")
        term.pump(answered)
        term.press(b"q")
        term.pump(term.exited, timeout=15)
        assert_left_cleanly(term)


@pytest.mark.anyio
async def test_top_answers_a_waiting_permission_request_before_the_gateway_does(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    proxy, config = start(proc_env, tmp_path)
    async with proxy as gw:
        await gw.initialize()
        session = await gw.new_session()
        prompt_id = gw.new_id()
        await gw.send(
            {
                "jsonrpc": "2.0",
                "id": prompt_id,
                "method": "session/prompt",
                "params": {"sessionId": session, "prompt": [{"type": "text", "text": "permission"}]},
            }
        )
        asked = await gw.expect(lambda m: m.get("method") == "session/request_permission")  # left unanswered
        document = await cli_json(proc_env, "top")
        code, table, _ = await cli(proc_env, "top", "--once")
        [waiting] = document["waiting"]
        await anyio.to_thread.run_sync(drive_answer_allow_then_quit, proc_env, config, waiting["request"])
        withdrawn = await gw.expect(lambda m: m.get("method") == "$/cancel_request")
        done = await gw.response_to(prompt_id)
        texts = [m["params"]["update"]["content"]["text"] for m in gw.take_updates(session)]
        after = await cli_json(proc_env, "top")
        again = Pending("answer", waiting["request"], waiting["instance"], "reject", "Reject")
        too_late = await anyio.to_thread.run_sync(answer_request, Path(proc_env["ACP_PROXY_STATE_DIR"]), again)

    assert (waiting["sessionId"], waiting["method"], waiting["subject"]) == (
        session,
        "session/request_permission",
        "Run the tool",
    )
    assert [o["optionId"] for o in waiting["options"]] == ["allow", "reject"]
    assert waiting["instance"] == instance_of_any(document, gw.pid)
    assert code == 0
    assert [part for part in (waiting["request"], "allow (Allow), reject (Reject)") if part not in table] == []
    # The operator answered first: the gateway's own copy of the request is withdrawn, the turn goes on.
    assert withdrawn["params"]["requestId"] == asked["id"]
    assert done["result"]["stopReason"] == "end_turn"
    assert "permission granted" in texts
    assert after["waiting"] == []
    [elsewhere] = [e for e in after["events"] if e["kind"] == "answered_elsewhere"]
    assert elsewhere["sessionId"] == session
    assert elsewhere["detail"].startswith("Run the tool: answered by operator (top, uid ")
    # A second answer is too late: said so, not sent.
    assert too_late.exit_code != 0
    assert f"request {waiting['request']} is not waiting" in too_late.message, too_late.message


def instance_of_any(document: dict[str, Any], pid: int) -> str:
    """The instance id of the proxy with ``pid``, as the JSON snapshot lists it."""
    [instance] = [p["instance"] for p in document["proxies"] if p["pid"] == pid]
    return str(instance)


TRICKLER = """
import os, socket, sys, threading, time
path = sys.argv[1]
if os.path.exists(path):
    os.unlink(path)
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(path)
server.listen(64)
print("listening", flush=True)

def trickle(conn):
    try:
        while True:
            conn.sendall(b" ")
            time.sleep(0.1)
    except OSError:
        conn.close()

while True:
    conn, _ = server.accept()
    threading.Thread(target=trickle, args=(conn,), daemon=True).start()
"""
"""Put in a live proxy's place at its control socket's path: it answers every ask a byte at a time, never a line."""


def instance_of(env: dict[str, str], pid: int) -> str:
    db = state_db(env)
    try:
        row = db.conn.execute("SELECT instance_id FROM instances WHERE pid = ? AND ended_at IS NULL", (pid,)).fetchone()
    finally:
        db.close()
    return str(row[0])


@contextlib.contextmanager
def answering_forever(env: dict[str, str], path: Path) -> Iterator[None]:
    trickler = subprocess.Popen([sys.executable, "-c", TRICKLER, str(path)], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert trickler.stdout is not None
        assert trickler.stdout.readline() == "listening\n"
        yield
    finally:
        trickler.kill()
        trickler.wait()


def drive_quit_while_a_proxy_answers_forever(env: dict[str, str], config: Path, control_path: Path) -> None:
    """``q``, Ctrl-C and SIGTERM end the view while its first gather waits on a proxy that never answers."""
    for how, code in ((b"q", 0), (b"\x03", 0), (signal.SIGTERM, 128 + signal.SIGTERM)):
        with answering_forever(env, control_path), terminal(env, "--config", str(config)) as term:
            term.pump(term.shows("reading"))  # drawn; the refresher is asking the proxy
            if isinstance(how, bytes):
                term.press(how)
            else:
                term.process.send_signal(how)
            term.pump(term.exited, timeout=5)  # a liveness bound: the ask never ends
            assert term.process.returncode == code, (how, bytes(term.output[-1000:]))
            term.drain()
            assert bytes(term.output[-64:]).endswith(CURSOR_SHOWN + ALT_SCREEN_OFF), how
            assert termios.tcgetattr(term.slave) == term.modes, how


@pytest.mark.anyio
async def test_top_quits_at_once_while_a_proxy_never_finishes_its_answer(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    proxy, config = start(proc_env, tmp_path)
    async with proxy as gw:
        await gw.initialize()
        await gw.new_session()
        path = socket_path(Path(proc_env["ACP_PROXY_STATE_DIR"]), instance_of(proc_env, gw.pid))
        await anyio.to_thread.run_sync(drive_quit_while_a_proxy_answers_forever, proc_env, config, path)


def test_a_proxy_that_does_not_listen_is_shown_so(tmp_path: Path) -> None:
    answer = reports.status_answers(tmp_path, PROXY_TIMEOUT)(["a1b2c3d4e5f0"])["a1b2c3d4e5f0"]
    assert isinstance(answer, str)
    row = proxy_facts_row(ProxyFacts("a1b2c3d4e5f0", 41000, T0, True, answer))
    assert not row.answered
    assert row.problem is not None
    assert row.problem.startswith("cannot be reached: no proxy listens on "), row.problem


def test_a_poke_after_the_wakeup_is_closed_does_nothing() -> None:
    wakeup = _Wakeup()
    wakeup.poke()
    assert select.select([wakeup.read_fd], [], [], 0)[0], "a poke wakes the loop"
    wakeup.close()
    read_fd, write_fd = os.pipe()  # most likely given the numbers the wakeup had
    try:
        wakeup.poke()
        assert not select.select([read_fd], [], [], 0)[0], "nothing written to a descriptor reused since"
        wakeup.close()
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_snapshot_problem_is_shown_in_the_status_line() -> None:
    snapshot = replace(empty_install(), problem="database is locked")
    assert "cannot read the install: database is locked" in rendered(snapshot, ViewState(), 80, 24)
