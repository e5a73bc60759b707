"""A WebSocket that drops loses nothing: its connection waits for a ``stream/resume``, its turns run on.

The cursor in each message's envelope, and the turn state a resuming client is told, are tested
in-process; a socket dropped in the middle of a turn and resumed on a new one, a resume refused, the
grace running out, and a client's own end, with a real ``serve`` and its proxies, on both loops.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import msgspec
import pytest
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, Request, TextMessage

from acp_proxy.remote.replay import Replay, ReplayLimits, TurnStates, with_cursor, without_cursor
from acp_proxy.sessions.registry import SessionState
from tests.remote_kit import WsClient, make_token, serve
from tests.support import TEST_INITIALIZE, write_config
from tests.test_serve import NEW, config_for, prompt, until_state

RESUMABLE = {**TEST_INITIALIZE, "_meta": {"acp/resumable": True}}


@pytest.mark.parametrize(
    "line",
    [
        b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s"}}',
        b'{"jsonrpc":"2.0","id":3,"result":{"stopReason":"end_turn","_meta":{"x":1}}}\n',
        b'  { "jsonrpc": "2.0", "id": "a", "error": {"code": -1, "message": "m"}}',
    ],
)
def test_the_cursor_goes_into_the_envelope_and_nothing_else_changes(line: bytes) -> None:
    written = with_cursor(line, "ab12-7")
    decoded = msgspec.json.decode(written)
    assert decoded.pop("_meta") == {"acp/cursor": "ab12-7"}
    assert decoded == msgspec.json.decode(line)
    assert without_cursor(written) == ("ab12-7", line.lstrip()), "acp-proxy connect takes it off again"


@pytest.mark.parametrize("line", [b"{}", b"[1]", b"not json", b"{ }"])
def test_what_is_not_a_message_object_is_left_as_it_is(line: bytes) -> None:
    assert with_cursor(line, "ab12-7") == line
    assert without_cursor(line) == (None, line)


def test_from_the_start_while_all_is_kept_and_not_once_the_first_message_is_gone() -> None:
    replay = Replay("e", ReplayLimits(messages=2))
    assert replay.next_cursor() == "e-1"
    replay.record(b"a", now=0.0)
    assert replay.after(replay.cursor(0), now=0.0) == [("e-1", b"a")]
    replay.record(b"b", now=0.0)
    replay.record(b"c", now=0.0)
    assert replay.after(replay.cursor(0), now=0.0) is None, "the first message is no longer kept"


def test_turn_states_running_with_the_oldest_prompt_then_idle_with_the_last_stop_reason() -> None:
    turns = TurnStates()
    assert turns.of("s") is None, "no prompt went to it"
    turns.started("s", 4)
    turns.started("s", 5)  # queued behind 4
    assert turns.of("s") == {"state": "running", "requestId": 4}
    turns.ended("s", 4, "end_turn")
    assert turns.of("s") == {"state": "running", "requestId": 5}
    turns.ended("s", 5, "cancelled")
    assert turns.of("s") == {"state": "idle", "stopReason": "cancelled"}
    turns.started("t", "x")
    turns.ended("t", "x", None)  # answered with an error
    assert turns.every() == {"s": {"state": "idle", "stopReason": "cancelled"}, "t": {"state": "idle"}}


# --- real processes ----------------------------------------------------------------------------


def _resume(connection_id: str | None, cursor: str | None) -> dict[str, Any]:
    return {"id": "r", "method": "stream/resume", "params": {"connectionId": connection_id, "cursor": cursor}}


async def until_attached(tmp_path: Path, connection_id: str | None, attached: bool) -> None:
    """Until serve's status file shows the connection with a client on it, or without."""
    with anyio.fail_after(20):
        while True:
            for status in (tmp_path / "state" / "serve").glob("*.json"):
                connections = json.loads(status.read_text())["connections"]
                if any(c["id"] == connection_id and c["attached"] is attached for c in connections):
                    return
            await anyio.sleep(0.05)


def _is_update(message: dict[str, Any]) -> bool:
    return message.get("method") == "session/update"


@pytest.mark.anyio
async def test_a_socket_dropped_mid_turn_is_resumed_on_a_new_one(proc_env: dict[str, str], tmp_path: Path) -> None:
    token = make_token(proc_env, "phone")
    async with serve(proc_env, config_for(tmp_path)) as served:
        async with WsClient.open(served.target(token)) as client:
            init = await client.call("initialize", RESUMABLE)
            assert init["result"]["transport"]["resumable"] == {"retentionMessages": 8000, "retentionSeconds": 300}
            session = (await client.call("session/new", NEW))["result"]["sessionId"]
            asked = await client.request_id("session/prompt", prompt(session, "trickle 3"))
            first = [await client.wait_for(_is_update) for _ in range(3)]
            connection_id = client.ws.connection_id
        # the socket is gone (the server cannot tell a close from a drop); what arrived after these three was
        # never read: the resume brings it again
        await until_attached(tmp_path, connection_id, False)
        cursors = [m["_meta"]["acp/cursor"] for m in [init, *first]]
        async with WsClient.open(served.target(token), _resume(connection_id, cursors[-1])) as resumed:
            ack = await resumed.answer_of("r")
            assert ack["result"]["connectionId"] == connection_id
            state = ack["result"]["_meta"]["acp/turnState"][session]
            assert state in ({"state": "running", "requestId": asked}, {"state": "idle", "stopReason": "end_turn"})
            answer = await resumed.answer_of(asked)
            assert answer["result"]["stopReason"] == "end_turn"
            rest = [m for m in resumed.stash if _is_update(m)]
            assert len(first) + len(rest) == 30, "every update once"
            cursors += [m["_meta"]["acp/cursor"] for m in [*rest, answer]]
            numbers = [int(c.rpartition("-")[2]) for c in cursors]
            assert numbers == sorted(set(numbers)), "in order, each once, with their original cursors"
            status = await resumed.call("session/status", {"sessionId": session})
            assert status["result"]["status"] == "open"
            assert status["result"]["_meta"]["acp/turnState"] == {"state": "idle", "stopReason": "end_turn"}
            turn = await resumed.call("session/prompt", prompt(session, "hi"))
            assert turn["result"]["stopReason"] == "end_turn", "the resumed connection goes on"


@pytest.mark.anyio
async def test_a_resume_refused_the_grace_run_out_and_a_clients_own_end(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    token = make_token(proc_env, "laptop")
    async with serve(proc_env, config_for(tmp_path), "--resume-grace", "2s") as served:
        async with WsClient.open(served.target(token)) as client:
            await client.call("initialize", RESUMABLE)
            session = (await client.call("session/new", NEW))["result"]["sessionId"]
            done = await client.call("session/prompt", prompt(session, "stream 3"))
            cursor = done["_meta"]["acp/cursor"]
            connection_id = client.ws.connection_id
        await until_attached(tmp_path, connection_id, False)
        async with WsClient.open(served.target(token), _resume(connection_id, cursor + "0")) as refused:
            failed = await refused.wait_for(lambda m: m.get("method") == "stream/resume_failed")
            assert failed["params"]["reason"] == "cursor_not_retained"
            assert failed["params"]["connectionId"] == refused.ws.connection_id != connection_id
            assert (await refused.answer_of("r"))["error"]["data"]["reason"] == "cursor_not_retained"
            init = await refused.call("initialize", TEST_INITIALIZE)  # the socket goes on as a new connection
            assert "_meta" not in init, "no cursors for a client that did not ask"
        await until_state(proc_env, session, SessionState.SUSPENDED, timeout=30)  # after the grace, as if closed
        async with WsClient.open(served.target(token), _resume(connection_id, cursor)) as late:
            failed = await late.wait_for(lambda m: m.get("method") == "stream/resume_failed")
            assert failed["params"]["reason"] == "unknown_connection"

        async with WsClient.open(served.target(token)) as client:
            await client.call("initialize", RESUMABLE)
            loaded = await client.call("session/load", {"sessionId": session, **NEW})
            assert "result" in loaded, loaded
            replayed = [m["params"]["update"]["content"]["text"] for m in client.updates(session)]
            assert replayed == ["chunk 0 ", "chunk 1 ", "chunk 2 "], "restored with its history"
            await client.send({"method": "stream/close"})
            connection_id = client.ws.connection_id
            with pytest.raises(AssertionError, match="socket closed"):
                await client.wait_for(lambda m: False, timeout=10)
        await until_state(proc_env, session, SessionState.SUSPENDED, timeout=10)  # at once: no grace to wait out
        async with WsClient.open(served.target(token), _resume(connection_id, None)) as late:
            failed = await late.wait_for(lambda m: m.get("method") == "stream/resume_failed")
            assert failed["params"]["reason"] == "unknown_connection"


class Cutter:
    """A TCP forwarder between a client and ``serve`` whose connections can be cut, as a network drops them."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.scopes: list[anyio.CancelScope] = []
        self.cuts = 0

    async def run(self, *, task_status: anyio.abc.TaskStatus[int]) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
        task_status.started(listener.extra(anyio.abc.SocketAttribute.local_port))
        await listener.serve(self._forward)

    async def _forward(self, client: anyio.abc.SocketStream) -> None:
        with anyio.CancelScope() as scope:
            self.scopes.append(scope)
            upstream = await anyio.connect_tcp("127.0.0.1", self.target_port)
            async with client, upstream, anyio.create_task_group() as tasks:
                tasks.start_soon(self._pump, client, upstream)
                await self._pump(upstream, client)
                tasks.cancel_scope.cancel()

    @staticmethod
    async def _pump(source: anyio.abc.SocketStream, sink: anyio.abc.SocketStream) -> None:
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            async for chunk in source:
                await sink.send(chunk)

    def cut(self) -> None:
        """Every connection through it ends, with no close frame: the server sees its socket drop."""
        self.cuts += 1
        for scope in self.scopes:
            scope.cancel()
        self.scopes.clear()


@pytest.mark.anyio
async def test_connect_resumes_a_dropped_link_and_the_turn_in_flight_loses_nothing(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """The network between ``acp-proxy connect`` and ``serve`` drops mid-turn: the bridge links again and
    resumes the connection; the gateway gets every update once and the turn's answer, and never a cursor."""
    from tests.support import Gateway

    token = make_token(proc_env, "laptop")
    env = {**proc_env, "ACP_PROXY_TOKEN": token}
    async with serve(proc_env, config_for(tmp_path)) as served, anyio.create_task_group() as network:
        cutter = Cutter(int(served.url.rsplit(":", 1)[1].split("/")[0]))
        port = await network.start(cutter.run)
        argv = [sys.executable, "-m", "acp_proxy", "connect", f"ws://127.0.0.1:{port}/acp"]
        async with Gateway.launch(argv, env=env, name="connect", first_id=1001) as gw:
            init = await gw.initialize(TEST_INITIALIZE)
            assert "resumable" not in json.dumps(init), "resuming is the bridge's business: its gateway's link is stdio"
            session = await gw.new_session()
            turn = gw.new_id()
            await gw.send(
                {"jsonrpc": "2.0", "id": turn, "method": "session/prompt", "params": prompt(session, "trickle 2")}
            )
            with anyio.fail_after(10):
                while len(gw.updates(session)) < 3:
                    await anyio.sleep(0.02)
            cutter.cut()
            answer = await gw.response_to(turn, timeout=30)
            assert answer["result"] == {"stopReason": "end_turn"}, answer
            dots = [u["params"]["update"]["content"]["text"] for u in gw.take_updates(session)]
            assert dots == ["."] * 20, "every update once: none lost at the drop, none given twice"
            after = await gw.prompt(session, "hi")
            assert after["result"]["stopReason"] == "end_turn", "the resumed connection goes on"
            assert all("_meta" not in m for m in (answer, after)), "the cursors stay between the bridge and serve"
            assert b"resumed connection" in gw.stderr
        network.cancel_scope.cancel()


UPDATES = 30000
"""More than the socket's buffers hold: the server's writes to the client stall."""


def stalled_resumable_client(port: int, token: str, updates: int) -> tuple[socket.socket, str, str, str]:
    """A client that asks for cursors, opens a session, asks for a flood of updates and then reads nothing
    (a blocking socket with a small receive buffer): the socket, its connection, session and last cursor."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    ws = WSConnection(ConnectionType.CLIENT)
    sock.sendall(
        ws.send(
            Request(host="localhost", target="/acp", extra_headers=[(b"authorization", f"Bearer {token}".encode())])
        )
    )

    def send(message: dict[str, Any]) -> None:
        sock.sendall(ws.send(TextMessage(data=json.dumps({"jsonrpc": "2.0", **message}))))

    connection = session = cursor = ""
    while not session:
        ws.receive_data(sock.recv(65536))
        for event in ws.events():
            if isinstance(event, AcceptConnection):
                connection = dict(event.extra_headers)[b"acp-connection-id"].decode()
                send({"id": 0, "method": "initialize", "params": RESUMABLE})
                send({"id": 1, "method": "session/new", "params": NEW})
            elif isinstance(event, TextMessage) and '"id":1' in event.data:
                answer = json.loads(event.data)
                session, cursor = answer["result"]["sessionId"], answer["_meta"]["acp/cursor"]
    send({"id": 2, "method": "session/prompt", "params": prompt(session, f"stream {updates}")})
    return sock, connection, session, cursor


@pytest.mark.anyio
async def test_a_resumable_client_that_stops_reading_loses_its_socket_not_its_turn(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """A phone out of coverage looks like a client that stopped reading: its socket is let go after
    ``--stall-timeout``, its connection waits for a resume (the agent waiting too), and the resume gets
    every update once, in order, and the answer."""
    token = make_token(proc_env, "phone")
    flooding = write_config(tmp_path, backends={"fake": {}})
    # what the socket's buffers took before the stall counts against the replay buffer: room for all of it
    limits = ("--max-pending", "64", "--stall-timeout", "1s", "--replay-buffer", "40000")
    async with serve(proc_env, flooding, *limits) as served:
        port = int(served.url.rsplit(":", 1)[1].split("/")[0])
        sock, connection, session, cursor = await anyio.to_thread.run_sync(
            stalled_resumable_client, port, token, UPDATES
        )
        await until_attached(tmp_path, connection, False)  # not ended as a slow reader: waiting for a resume
        sock.close()
        async with WsClient.open(served.target(token), _resume(connection, cursor)) as resumed:
            assert (await resumed.answer_of("r"))["result"]["connectionId"] == connection
            answer = await resumed.answer_of(2, timeout=60)
            assert answer["result"]["stopReason"] == "end_turn"
            texts = [m["params"]["update"]["content"]["text"] for m in resumed.updates(session)]
            assert texts == [f"chunk {i} " for i in range(UPDATES)], "every update once, in order"
