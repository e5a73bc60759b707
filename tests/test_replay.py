"""A dropped event stream loses nothing: ``Last-Event-ID`` replays what came after the client's cursor.

The replay buffer's rules (cursors, retention, what it refuses) and the outbox's hand-back of what a dead
stream's reader never took are tested in-process; a stream dropped in the middle of a turn and resumed,
and a client gone without its DELETE whose successor loads its session at once, with a real ``serve``
and its proxies, on both loops.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from acp_proxy.remote.outbox import Outbox
from acp_proxy.remote.replay import Replay, ReplayLimits
from tests.remote_kit import HttpClient, make_token, serve
from tests.test_serve import NEW, config_for, prompt


def _replay(**limits: Any) -> Replay:
    return Replay("e1", ReplayLimits(**limits))


def test_cursors_rise_and_a_cursor_gets_what_came_after_it_in_order() -> None:
    replay = _replay()
    cursors = [replay.record(b"m%d" % i, now=0.0) for i in range(5)]
    assert len(set(cursors)) == 5
    assert replay.after(cursors[1], now=1.0) == [(cursors[i], b"m%d" % i) for i in (2, 3, 4)]
    assert replay.after(cursors[4], now=1.0) == [], "the latest cursor: nothing missed"
    assert replay.after(cursors[1], now=1.0) == replay.after(cursors[1], now=1.0), "reading takes nothing away"


@pytest.mark.parametrize("cursor", ["e1-99", "e2-1", "e1-x", "", "1", "e1-"])
def test_a_cursor_this_stream_never_issued_is_refused(cursor: str) -> None:
    replay = _replay()
    replay.record(b"only", now=0.0)
    assert replay.after(cursor, now=0.0) is None


@pytest.mark.parametrize(
    ("limits", "times"),
    [
        ({"messages": 3}, [0.0] * 5),
        ({"bytes": 6}, [0.0] * 5),  # two-byte messages: three kept
        ({"seconds": 10.0}, [0.0, 0.0, 20.0, 20.0, 20.0]),  # at 25 s only the last three are 10 s old or less
    ],
)
def test_retention_in_messages_bytes_and_age(limits: dict[str, Any], times: list[float]) -> None:
    replay = _replay(**limits)
    cursors = [replay.record(b"m%d" % i, now=at) for i, at in enumerate(times)]
    now = 25.0 if "seconds" in limits else 0.0
    assert replay.after(cursors[0], now=now) is None, "what came right after it is gone: refused, not skipped"
    assert replay.after(cursors[1], now=now) == [(cursors[i], b"m%d" % i) for i in (2, 3, 4)]
    assert replay.after(cursors[4], now=now) == []


@given(
    st.lists(st.lists(st.integers(min_value=1, max_value=9), max_size=6), max_size=12),
    st.integers(min_value=1, max_value=20),
    st.integers(min_value=1, max_value=60),
)
def test_a_run_recorded_at_once_is_kept_as_its_messages_one_by_one(
    runs: list[list[int]], kept: int, kept_bytes: int
) -> None:
    """A writer records a run of messages with one call: the same cursors, the same retention (in messages and
    in bytes), the same replay."""
    by_run, one_by_one = _replay(messages=kept, bytes=kept_bytes), _replay(messages=kept, bytes=kept_bytes)
    numbers = iter(range(1000))
    for sizes in runs:
        run = [b"m%d" % next(numbers) + b"." * size for size in sizes]
        assert by_run.record_run(run, now=0.0) == [one_by_one.record(line, now=0.0) for line in run]
    first = by_run.cursor(0)
    assert by_run.after(first, now=0.0) == one_by_one.after(first, now=0.0)
    for sequence in range(sum(map(len, runs)) + 1):
        cursor = by_run.cursor(sequence)
        assert by_run.after(cursor, now=0.0) == one_by_one.after(cursor, now=0.0)


@pytest.mark.anyio
async def test_what_a_gone_reader_never_took_waits_for_the_next_stream() -> None:
    outbox = Outbox(10, 1.0, lambda: None, ReplayLimits())
    connection = outbox.open(None)
    first = outbox.open("s")
    for i in range(4):
        await outbox.put("s", b"%d" % i)
    assert first.receive_nowait() == b"0"
    cursors, lines = outbox.record("s", [b"0"], anyio.current_time())
    assert cursors is not None
    written, line = cursors[0], lines[0]
    assert line == b"0", "no cursor in the message for a client that did not ask"
    outbox.release("s", first)  # its HTTP response ended with 1, 2 and 3 untaken
    await outbox.put("s", b"4")  # no stream now: waits
    second = outbox.open("s")
    assert [second.receive_nowait() for _ in range(4)] == [b"1", b"2", b"3", b"4"]
    with pytest.raises(anyio.WouldBlock):
        connection.receive_nowait()  # a session whose stream dropped is not diverted to the connection's
    assert outbox.missed("s", written) == []
    assert outbox.missed(None, written) is None, "another stream's cursor"
    replaced = outbox.open("s")  # a second GET replaces the first: what it had not taken moves along
    await outbox.put("s", b"5")
    assert replaced.receive_nowait() == b"5"


# --- real processes ----------------------------------------------------------------------------


async def _events(response: httpx.Response, into: list[tuple[str | None, dict[str, Any]]]) -> None:
    """Read server-sent events into ``into`` as (id, message)."""
    event_id: str | None = None
    async for line in response.aiter_lines():
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            into.append((event_id, json.loads(line[6:])))
            event_id = None


def _texts(events: list[tuple[str | None, dict[str, Any]]]) -> list[str]:
    return [m["params"]["update"]["content"]["text"] for _, m in events if m.get("method") == "session/update"]


@pytest.mark.anyio
async def test_a_stream_dropped_mid_turn_is_resumed_with_last_event_id(proc_env: dict[str, str], tmp_path: Any) -> None:
    token = make_token(proc_env, "phone")
    async with serve(proc_env, config_for(tmp_path)) as served, HttpClient.open(served.url, token) as client:
        init = await client.initialize()
        assert init.json()["result"]["transport"]["resumable"] == {"retentionMessages": 8000, "retentionSeconds": 300}
        await client.open_stream()
        new = await client.request("session/new", NEW)
        session = (await client.wait_for(None, lambda m: m.get("id") == new))["result"]["sessionId"]
        accept = {**client.headers(session), "accept": "text/event-stream"}

        first: list[tuple[str | None, dict[str, Any]]] = []
        async with client.streaming.stream("GET", served.url, headers=accept, timeout=None) as response:
            assert response.status_code == 200
            asked = await client.request("session/prompt", prompt(session, "stream 30"), session)
            with anyio.fail_after(20):
                async for line in response.aiter_lines():  # three updates read, then the stream drops
                    if line.startswith("id: "):
                        cursor = line[4:]
                    elif line.startswith("data: "):
                        first.append((cursor, json.loads(line[6:])))
                        if len(first) == 3:
                            break
        assert _texts(first) == ["chunk 0 ", "chunk 1 ", "chunk 2 "]
        assert all(event_id for event_id, _ in first), "every event has its cursor"
        last = first[-1][0]
        assert last is not None

        never_issued = f"{last.rpartition('-')[0]}-{10**9}"
        for wrong in ("not-a-cursor", never_issued):
            refused = await client.streaming.get(served.url, headers={**accept, "last-event-id": wrong}, timeout=5)
            assert refused.status_code == 409, "never a silent live stream"
        other_stream = {**client.headers(), "accept": "text/event-stream", "last-event-id": last}
        assert (await client.streaming.get(served.url, headers=other_stream, timeout=5)).status_code == 409

        rest: list[tuple[str | None, dict[str, Any]]] = []
        resumed = {**accept, "last-event-id": last}
        async with client.streaming.stream("GET", served.url, headers=resumed, timeout=None) as response:
            assert response.status_code == 200
            with anyio.move_on_after(20):
                async with anyio.create_task_group() as reading:
                    reading.start_soon(_events, response, rest)
                    while not any(m.get("id") == asked for _, m in rest):
                        await anyio.sleep(0.02)
                    reading.cancel_scope.cancel()
        assert _texts(rest) == [f"chunk {i} " for i in range(3, 30)], "every update once, in order"
        answers = [m for _, m in rest if m.get("id") == asked]
        assert [a["result"]["stopReason"] for a in answers] == ["end_turn"]
        cursors = [event_id for event_id, _ in first + rest]
        assert len(set(cursors)) == len(cursors), "the original cursors, each once"


@pytest.mark.anyio
async def test_a_client_that_vanished_does_not_hold_its_session_from_its_successor(
    proc_env: dict[str, str], tmp_path: Any
) -> None:
    """A streamable HTTP client gone without its DELETE (a killed process, a closed laptop): a new client
    of the same token loads the session at once, with its history; the old connection is told it moved."""
    token = make_token(proc_env, "laptop")
    async with serve(proc_env, config_for(tmp_path)) as served:
        async with HttpClient.open(served.url, token) as gone:
            await gone.initialize()
            await gone.open_stream()
            new = await gone.request("session/new", NEW)
            session = (await gone.wait_for(None, lambda m: m.get("id") == new))["result"]["sessionId"]
            await gone.open_stream(session)
            asked = await gone.request("session/prompt", prompt(session, "stream 2"), session)
            assert (await gone.wait_for(session, lambda m: m.get("id") == asked))["result"]["stopReason"] == "end_turn"
            old_headers = gone.headers(session)
        # its streams are closed with it; its connection stays (no DELETE), its proxy holds the session
        async with HttpClient.open(served.url, token) as successor:
            await successor.initialize()
            await successor.open_stream()
            await successor.open_stream(session)
            loaded = await successor.request("session/load", {"sessionId": session, **NEW}, session)
            answer = await successor.wait_for(None, lambda m: m.get("id") == loaded, timeout=30)
            assert "result" in answer, answer
            # the history came with it, on the session's stream (no order across streams: waited for)
            replayed = await successor.wait_for(session, lambda m: "chunk 1" in json.dumps(m), timeout=10)
            assert replayed["method"] == "session/update"
            turn = await successor.request("session/prompt", prompt(session, "stream 1"), session)
            done = await successor.wait_for(session, lambda m: m.get("id") == turn)
            assert done["result"]["stopReason"] == "end_turn"
            async with httpx.AsyncClient(http1=False, http2=True, headers={"authorization": f"Bearer {token}"}) as old:
                body = {"jsonrpc": "2.0", "id": 7, "method": "session/prompt", "params": prompt(session, "stream 1")}
                assert (await old.post(served.url, json=body, headers=old_headers)).status_code == 202
                headers = {**old_headers, "accept": "text/event-stream"}
                seen: list[tuple[str | None, dict[str, Any]]] = []
                async with old.stream("GET", served.url, headers=headers, timeout=None) as response:
                    with anyio.move_on_after(20):
                        async with anyio.create_task_group() as reading:
                            reading.start_soon(_events, response, seen)
                            while not any(m.get("id") == 7 for _, m in seen):
                                await anyio.sleep(0.02)
                            reading.cancel_scope.cancel()
                (moved,) = [m for _, m in seen if m.get("id") == 7]
                assert moved["error"]["data"]["reason"] == "session_moved", moved


@pytest.mark.anyio
async def test_the_events_a_stream_writes_carry_the_cursors_a_resume_gets() -> None:
    outbox = Outbox(10, 1.0, lambda: None, ReplayLimits())
    events = outbox.record_events("s", [b'{"a":1}', b'{"b":2}', b'{"c":3}'], anyio.current_time())
    blocks = [block.split(b"\n") for block in events.split(b"\n\n") if block]
    ids = [block[0].removeprefix(b"id: ").decode() for block in blocks]
    assert [block[1] for block in blocks] == [b'data: {"a":1}', b'data: {"b":2}', b'data: {"c":3}']
    assert outbox.missed("s", ids[0]) == [(ids[1], b'{"b":2}'), (ids[2], b'{"c":3}')]
    assert outbox.missed("s", ids[2]) == []
    plain = Outbox(10, 1.0, lambda: None, None)
    assert plain.record_events("s", [b"{}"], 0.0) == b"data: {}\n\n", "a stream that keeps nothing names no cursor"
