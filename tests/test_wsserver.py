"""``serve``'s own WebSocket server and its front door, in-process: over socket pairs, no process started.

The frames it writes are read back by ``frames.FrameReader`` and by wsproto (another parser than
the one that wrote them); the client side of every exchange here is wsproto's. Through a real
``serve``, its WebSockets are every WebSocket test of ``test_serve.py``, ``test_replay.py`` and
``test_attach_remote.py`` (behind TLS hypercorn's, in ``test_tls_on_a_public_listener...``).
"""

from __future__ import annotations

import logging
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import pytest
from hypothesis import given
from hypothesis import strategies as st
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    CloseConnection,
    Message,
    Ping,
    Pong,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)

from acp_proxy.remote.frames import FrameReader, text_frames
from acp_proxy.remote.front import is_websocket_upgrade, peek_head, prepare
from acp_proxy.remote.wsserver import LINES, serve_websocket

UPGRADE = (
    b"GET /acp HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        (UPGRADE, True),
        (UPGRADE.replace(b"Upgrade: websocket", b"upgrade:  WebSocket "), True),
        (UPGRADE.replace(b"Upgrade: websocket", b"Upgrade: foo, websocket"), True),
        (UPGRADE.replace(b"GET ", b"POST "), False),
        (UPGRADE.replace(b"Upgrade: websocket", b"X-Upgrade: websocket"), False),
        (UPGRADE.replace(b"Upgrade: websocket", b"Upgrade: h2c"), False),
        (UPGRADE[:-2], False),  # the head is not whole yet
        (b"GET /acp HTTP/1.1\r\nHost: x\r\n\r\nUpgrade: websocket\r\n\r\n", False),  # after the head: a body
        (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", False),  # HTTP/2 by prior knowledge
        (b"POST /acp HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}", False),
        (b"", False),
    ],
)
def test_which_connections_are_websocket_upgrades(head: bytes, expected: bool) -> None:
    assert is_websocket_upgrade(head) is expected


payloads = st.text(max_size=300).map(str.encode).filter(lambda line: not line.endswith(b"\n")) | st.sampled_from(
    [b"x" * n for n in (125, 126, 127, 65535, 65536)]
)
"""A message's bytes: a line's own newline, when it has one, is not part of it."""


@given(st.lists(st.tuples(payloads, st.booleans()), max_size=20))
def test_a_run_of_lines_is_a_text_frame_each(lines: list[tuple[bytes, bool]]) -> None:
    """Each line (its newline, if any, left out) is one final text frame: the client's reader and wsproto read the
    same messages back from the one block."""
    block = text_frames([payload + b"\n" if newline else payload for payload, newline in lines])
    expected = [payload.decode() for payload, _ in lines]
    reader = FrameReader()
    reader.feed(block)
    assert list(reader.texts) == expected
    assert reader.closed is None
    client = _open_client()
    client.receive_data(block)
    assert [event.data for event in client.events() if isinstance(event, TextMessage)] == expected


def _open_client() -> WSConnection:
    """A wsproto client whose handshake was accepted (by a wsproto server): ready to read frames."""
    client, server = WSConnection(ConnectionType.CLIENT), WSConnection(ConnectionType.SERVER)
    server.receive_data(client.send(Request(host="x", target="/acp")))
    assert any(isinstance(event, Request) for event in server.events())
    client.receive_data(server.send(AcceptConnection()))
    assert any(isinstance(event, AcceptConnection) for event in client.events())
    return client


# --- a server socket over a socket pair, driven by a wsproto client ------------------------------------------

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Scope]]
Send = Callable[[Scope], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class Client:
    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.pending: list[object] = []

    async def send(self, event: Any) -> None:
        await self.stream.send(self.ws.send(event))

    async def next(self) -> object:
        """The next event the server's bytes make (``None``: the server closed the link)."""
        while not self.pending:
            with anyio.fail_after(5):
                try:
                    data = await self.stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return None
            self.ws.receive_data(data)
            self.pending.extend(self.ws.events())
        return self.pending.pop(0)

    async def handshake(self, **extra: Any) -> object:
        await self.send(Request(host="x", target="/acp?q=1", **extra))
        return await self.next()


@asynccontextmanager
async def served(app: App, max_message: int = 1000) -> AsyncIterator[tuple[Client, list[Scope]]]:
    """``app`` served on one end of a socket pair, a client on the other; yields the client and the scopes seen."""
    left, right = socket.socketpair()
    scopes: list[Scope] = []

    async def recorded(scope: Scope, receive: Receive, send: Send) -> None:
        scopes.append(scope)
        await app(scope, receive, send)

    server = await anyio.abc.SocketStream.from_socket(left)
    client = Client(await anyio.abc.SocketStream.from_socket(right))
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(
            lambda: serve_websocket(
                server, recorded, client=("10.0.0.1", 5), server=None, max_message=max_message, ping_interval=0.2
            )
        )
        yield client, scopes
        await client.stream.aclose()


async def echo(scope: Scope, receive: Receive, send: Send) -> None:
    """Accepts; each text is sent back twice (as a run of two, and as a message of its own) until the client ends."""
    assert (await receive())["type"] == "websocket.connect"
    await send({"type": "websocket.accept", "headers": [(b"acp-connection-id", b"c1")]})
    while True:
        event = await receive()
        if event["type"] == "websocket.disconnect":
            echo.codes.append(event["code"])  # type: ignore[attr-defined]
            return
        line = event["text"].encode()
        await send({"type": LINES, "lines": [line + b"\n", line]})
        await send({"type": "websocket.send", "text": event["text"]})


echo.codes = []  # type: ignore[attr-defined]


@pytest.mark.anyio
async def test_a_websocket_served_in_process() -> None:
    """The handshake with the application's headers; texts (a fragmented one too) in, runs of frames out; a ping
    answered; the client's close ends it with the client's code, after the server's reply."""
    echo.codes.clear()  # type: ignore[attr-defined]
    async with served(echo) as (client, scopes):
        accepted = await client.handshake(extra_headers=[(b"authorization", b"Bearer t")])
        assert isinstance(accepted, AcceptConnection)
        assert (b"acp-connection-id", b"c1") in accepted.extra_headers
        scope = scopes[0]
        assert (scope["path"], scope["query_string"], scope["client"]) == ("/acp", b"q=1", ("10.0.0.1", 5))
        assert (b"authorization", b"Bearer t") in scope["headers"]
        assert (b"host", b"x") in scope["headers"]
        assert LINES in scope["extensions"]
        await client.send(Message(data="héllo"))
        assert [(await client.next()).data for _ in range(3)] == ["héllo"] * 3  # type: ignore[attr-defined]
        await client.send(Message(data="par", message_finished=False))
        await client.send(Message(data="ts", message_finished=True))
        assert [(await client.next()).data for _ in range(3)] == ["parts"] * 3  # type: ignore[attr-defined]
        await client.send(Ping(payload=b"p"))
        event = await client.next()
        while isinstance(event, Ping):  # the server's own keepalive may come first
            await client.send(event.response())
            event = await client.next()
        assert isinstance(event, Pong)
        assert event.payload == b"p"
        await client.send(CloseConnection(code=4000, reason="bye"))
        reply = await client.next()
        while isinstance(reply, Ping):
            reply = await client.next()
        assert isinstance(reply, CloseConnection)
        assert reply.code == 4000
        assert await client.next() is None, "the server cuts the link after the close handshake"
    assert echo.codes == [4000]  # type: ignore[attr-defined]


@pytest.mark.anyio
async def test_keepalive_pings_while_idle() -> None:
    async with served(echo) as (client, _):
        assert isinstance(await client.handshake(), AcceptConnection)
        assert isinstance(await client.next(), Ping), "a ping within the interval (0.2 s here)"


@pytest.mark.anyio
async def test_a_message_over_the_limit_closes_with_1009() -> None:
    echo.codes.clear()  # type: ignore[attr-defined]
    async with served(echo, max_message=10) as (client, _):
        await client.handshake()
        await client.send(Message(data="x" * 11))
        closed = await client.next()
        assert isinstance(closed, CloseConnection)
        assert closed.code == 1009
    assert echo.codes == [1009]  # type: ignore[attr-defined]


@pytest.mark.anyio
async def test_a_link_that_breaks_is_a_disconnect_1006() -> None:
    echo.codes.clear()  # type: ignore[attr-defined]
    async with served(echo) as (client, _):
        await client.handshake()
        await client.stream.send(b"\x81")  # half a frame, then the link is gone
    assert echo.codes == [1006]  # type: ignore[attr-defined]


async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
    await receive()
    await send({"type": "websocket.http.response.start", "status": 401, "headers": [(b"x-why", b"token")]})
    await send({"type": "websocket.http.response.body", "body": b"authentication required\n"})


async def fail_after_accepting(scope: Scope, receive: Receive, send: Send) -> None:
    await receive()
    await send({"type": "websocket.accept"})
    raise RuntimeError("a bug")


async def say_nothing(scope: Scope, receive: Receive, send: Send) -> None:
    await receive()


@pytest.mark.anyio
async def test_refusals_and_failures_answer_the_client() -> None:
    """A refusal is the application's HTTP response; an application that fails closes with 1011; one that returns
    without answering the handshake is a 500, as ASGI asks."""
    async with served(refuse) as (client, _):
        refused = await client.handshake()
        assert isinstance(refused, RejectConnection)
        assert refused.status_code == 401
        assert (b"x-why", b"token") in refused.headers
        body = await client.next()
        assert isinstance(body, RejectData)
        assert body.data == b"authentication required\n"
    async with served(fail_after_accepting) as (client, _):
        assert isinstance(await client.handshake(), AcceptConnection)
        closed = await client.next()
        assert isinstance(closed, CloseConnection)
        assert closed.code == 1011
        await client.send(closed.response())
    async with served(say_nothing) as (client, _):
        refused = await client.handshake()
        assert isinstance(refused, RejectConnection)
        assert refused.status_code == 500


@pytest.mark.anyio
async def test_a_request_that_is_no_upgrade_is_answered_400() -> None:
    left, right = socket.socketpair()
    server = await anyio.abc.SocketStream.from_socket(left)
    async with await anyio.abc.SocketStream.from_socket(right) as client:
        await client.send(b"GET /acp HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n\r\n")  # no key, no version
        await serve_websocket(server, echo, client=None, server=None, max_message=10, ping_interval=1)
        answer = await client.receive()
    assert answer.startswith(b"HTTP/1.1 400 ")


@pytest.mark.anyio
async def test_the_head_is_looked_at_unread_even_when_it_comes_in_parts() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.setblocking(False)

        async def write_in_parts() -> None:
            right.sendall(UPGRADE[:20])
            await anyio.sleep(0.05)
            right.sendall(UPGRADE[20:])

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(write_in_parts)
            head = await peek_head(left)
        assert head == UPGRADE
        assert is_websocket_upgrade(head)
        left.setblocking(True)
        assert left.recv(len(UPGRADE), socket.MSG_WAITALL) == UPGRADE, "left for the server that takes it"
        right.shutdown(socket.SHUT_WR)
        left.setblocking(False)
        assert await peek_head(left) == b"", "a client gone before a byte"


def test_accepted_tcp_connections_send_small_writes_at_once() -> None:
    with (
        socket.create_server(("127.0.0.1", 0)) as listener,
        socket.create_connection(listener.getsockname()[:2]),
        listener.accept()[0] as accepted,
    ):
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
        prepare(accepted)
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        assert accepted.getblocking() is False


@pytest.mark.anyio
async def test_a_text_sent_alone_is_sent_as_it_is_and_a_close_code_no_frame_may_carry_is_not_echoed() -> None:
    async def send_one(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.send", "text": "ends with a newline\n"})
        while (await receive())["type"] != "websocket.disconnect":
            pass

    async with served(send_one) as (client, _):
        assert isinstance(await client.handshake(), AcceptConnection)
        message = await client.next()
        assert isinstance(message, TextMessage)
        assert message.data == "ends with a newline\n", "only a run of JSON lines loses its newlines"
        await client.stream.send(bytes([0x88, 0x82, 0, 0, 0, 0]) + (1006).to_bytes(2, "big"))  # a close saying 1006
        reply = await client.next()
        while isinstance(reply, Ping):
            reply = await client.next()
        assert isinstance(reply, CloseConnection)
        assert reply.code == 1005, "answered with an empty close, not 1006"


@pytest.mark.anyio
async def test_a_client_that_resets_before_its_upgrade_is_served_is_let_go_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from hypercorn.config import Config

    from acp_proxy.remote.front import FrontDoor

    door = FrontDoor(echo, Config(), max_message=100, ping_interval=1)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname()[:2])
        accepted, _ = listener.accept()
        client.sendall(UPGRADE)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()  # with a reset, not a FIN
        await anyio.sleep(0.05)
        await door.connection(accepted)
    assert accepted.fileno() == -1, "closed"
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]
