"""``serve``'s own HTTP/2 server (remote/h2server.py), in-process: over socket pairs, no process started.

The client side of every exchange is h2's client state machine (another implementation than the one
serving). Through a real ``serve``, its HTTP/2 is every streamable HTTP test of ``test_serve.py``,
``test_replay.py`` and ``test_attach_remote.py`` (httpx's HTTP/2 client).
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest

from acp_proxy.remote.front import is_http2, is_websocket_upgrade
from acp_proxy.remote.h2server import Http2Server, serve_http2
from acp_proxy.remote.http2 import DATA, END_STREAM, PREFACE
from tests.test_http2 import frames_of

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Scope]]
Send = Callable[[Scope], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

GET = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"example:1"), (b":path", b"/acp?x=1")]
POST = [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"example:1"), (b":path", b"/acp")]


class Client:
    """An h2 client over one end of a socket pair: events gathered by stream as they come."""

    def __init__(self, stream: anyio.abc.ByteStream, window: int = 65_535) -> None:
        self.stream = stream
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.h2.local_settings = h2.settings.Settings(client=True, initial_values={4: window})
        self.h2.initiate_connection()
        self.events: list[h2.events.Event] = []
        self.closed = False
        self.after_goaway = b""

    @property
    def goaway(self) -> bool:
        return any(isinstance(e, h2.events.ConnectionTerminated) for e in self.events)

    async def flush(self) -> None:
        await self.stream.send(self.h2.data_to_send())

    async def request(self, headers: list[tuple[bytes, bytes]], body: bytes | None = None) -> int:
        stream_id = self.h2.get_next_available_stream_id()
        self.h2.send_headers(stream_id, headers, end_stream=body is None)
        if body is not None:
            self.h2.send_data(stream_id, body, end_stream=True)
        await self.flush()
        return stream_id

    async def until(self, done: Callable[[list[h2.events.Event]], bool], *, acknowledge: bool = True) -> None:
        """Read until ``done(self.events)`` (or the server closes the link), crediting what comes."""
        with anyio.fail_after(5):
            while not done(self.events) and not self.closed:
                try:
                    data = await self.stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    self.closed = True
                    return
                if self.goaway:  # h2 reads nothing after a GOAWAY: the frames of the streams still served
                    self.after_goaway += data
                    continue
                for event in self.h2.receive_data(data):
                    self.events.append(event)
                    if acknowledge and isinstance(event, h2.events.DataReceived):
                        self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                pending = self.h2.data_to_send()
                if pending:
                    await self.stream.send(pending)

    def of(self, stream_id: int, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind) and getattr(e, "stream_id", None) == stream_id]

    def body(self, stream_id: int) -> bytes:
        return b"".join(e.data for e in self.of(stream_id, h2.events.DataReceived))

    def ended(self, stream_id: int) -> Callable[[list[h2.events.Event]], bool]:
        return lambda events: any(
            isinstance(e, h2.events.StreamEnded | h2.events.StreamReset) and e.stream_id == stream_id for e in events
        )


@asynccontextmanager
async def served(
    app: App, *, idle_timeout: float = 5.0, window: int = 65_535
) -> AsyncIterator[tuple[Client, Http2Server]]:
    """``app`` served on one end of a socket pair (as ``front.py`` serves it), an h2 client on the other."""
    left, right = socket.socketpair()
    server_stream = await anyio.abc.SocketStream.from_socket(left)
    client = Client(await anyio.abc.SocketStream.from_socket(right), window)
    connections: list[Http2Server] = []
    registered = anyio.Event()

    def register(connection: Http2Server) -> Callable[[], None]:
        connections.append(connection)
        registered.set()
        return lambda: connections.remove(connection)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(
            lambda: serve_http2(
                server_stream, app, client=("10.0.0.2", 7), server=None, idle_timeout=idle_timeout, register=register
            )
        )
        await client.flush()
        await registered.wait()
        yield client, connections[0]
        await client.stream.aclose()
    assert connections == [], "the server let its connection go"


async def echo(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers 200 with the scope's method and path and the whole body it read."""
    body = b""
    while True:
        event = await receive()
        body += event.get("body", b"")
        if not event.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": [(b"x-path", scope["path"].encode())]})
    await send({"type": "http.response.body", "body": scope["method"].encode() + b" " + body})


@pytest.mark.anyio
async def test_requests_on_one_connection_are_served_concurrently_as_asgi() -> None:
    scopes: list[Scope] = []
    release = anyio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        scopes.append(scope)
        if scope["method"] == "GET":  # an event stream: open until told
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b": open\n\n", "more_body": True})
            await release.wait()
            await send({"type": "http.response.body", "body": b"data: last\n\n"})
            return
        await echo(scope, receive, send)

    async with served(app) as (client, _):
        stream = await client.request(GET)
        await client.until(lambda events: bool(client.of(stream, h2.events.DataReceived)))
        posts = [await client.request([*POST, (b"x-n", b"%d" % n)], b"body %d" % n) for n in range(3)]
        for post in posts:
            await client.until(client.ended(post))
            assert client.body(post) == b"POST body %d" % (posts.index(post))
            assert client.of(post, h2.events.ResponseReceived)[0].headers == [
                (b":status", b"200"),
                (b"x-path", b"/acp"),
            ]
        release.set()
        await client.until(client.ended(stream))
        assert client.body(stream) == b": open\n\ndata: last\n\n"
    get = scopes[0]
    assert (get["type"], get["http_version"], get["method"], get["path"], get["query_string"]) == (
        "http",
        "2",
        "GET",
        "/acp",
        b"x=1",
    )
    assert (b"host", b"example:1") in get["headers"]
    assert get["client"] == ("10.0.0.2", 7)
    # Concurrent, as HTTP/2's streams are (trio starts tasks in no set order): a client that needs an order
    # waits for one POST's answer before it sends the next.
    assert sorted(dict(s["headers"]).get(b"x-n") for s in scopes[1:]) == [b"0", b"1", b"2"]


@pytest.mark.anyio
async def test_a_body_larger_than_the_clients_window_waits_for_its_credit() -> None:
    big = bytes(range(256)) * 1000  # 256 kB, four windows of the client's

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": big})

    async with served(app) as (client, _):
        stream = await client.request(GET)
        await client.until(
            lambda events: sum(len(e.data) for e in client.of(stream, h2.events.DataReceived)) >= 65_535,
            acknowledge=False,
        )
        with anyio.move_on_after(0.2):
            await client.until(client.ended(stream), acknowledge=False)
        assert len(client.body(stream)) == 65_535, "nothing past the window before a credit"
        for event in client.of(stream, h2.events.DataReceived):
            client.h2.acknowledge_received_data(event.flow_controlled_length, stream)
        await client.flush()
        await client.until(client.ended(stream))
        assert client.body(stream) == big


@pytest.mark.anyio
async def test_a_stream_the_client_resets_is_a_disconnect_and_a_write_to_it_fails() -> None:
    told: list[str] = []
    done = anyio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b": open\n\n", "more_body": True})
        told.append((await receive())["type"])  # the body's end (none), then the reset
        told.append((await receive())["type"])
        try:
            await send({"type": "http.response.body", "body": b"late", "more_body": True})
        except OSError as exc:
            told.append(type(exc).__name__)
        done.set()

    async with served(app) as (client, _):
        stream = await client.request(GET)
        await client.until(lambda events: bool(client.of(stream, h2.events.DataReceived)))
        client.h2.reset_stream(stream)
        await client.flush()
        with anyio.fail_after(5):
            await done.wait()
    assert told == ["http.request", "http.disconnect", "Gone"]


@pytest.mark.anyio
async def test_an_application_that_fails_answers_500_or_resets_what_it_began() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] == "/began":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"part", "more_body": True})
        raise RuntimeError("a bug")

    async with served(app) as (client, _):
        unanswered = await client.request(POST, b"{}")
        await client.until(client.ended(unanswered))
        assert client.of(unanswered, h2.events.ResponseReceived)[0].headers == [(b":status", b"500")]
        began = await client.request([*GET[:3], (b":path", b"/began")])
        await client.until(client.ended(began))
        assert [e.error_code for e in client.of(began, h2.events.StreamReset)] == [2]  # INTERNAL_ERROR
        again = await client.request(POST, b"{}")  # and the connection goes on
        await client.until(client.ended(again))
        assert client.of(again, h2.events.ResponseReceived)


@pytest.mark.anyio
async def test_a_client_that_breaks_the_protocol_gets_goaway_and_its_open_requests_a_disconnect() -> None:
    told: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        told.append((await receive())["type"])

    async with served(app) as (client, _):
        await client.request(GET)
        await client.stream.send(b"\x00\x00\x01\x00\x00\x00\x00\x00\x00x")  # DATA on stream 0
        await client.until(lambda events: any(isinstance(e, h2.events.ConnectionTerminated) for e in events))
        goaway = next(e for e in client.events if isinstance(e, h2.events.ConnectionTerminated))
        assert goaway.error_code == 1  # PROTOCOL_ERROR
        await client.until(lambda _: False)  # the server closes the link
        assert client.closed
    assert told == ["http.disconnect"]


@pytest.mark.anyio
async def test_an_idle_connection_is_let_go_with_goaway() -> None:
    async with served(echo, idle_timeout=0.2) as (client, _):
        stream = await client.request(POST, b"x")
        await client.until(client.ended(stream))
        await client.until(lambda _: False)
        assert client.closed
        goaway = [e for e in client.events if isinstance(e, h2.events.ConnectionTerminated)]
        assert [(e.error_code, e.last_stream_id) for e in goaway] == [(0, stream)]


@pytest.mark.anyio
async def test_wind_down_serves_what_is_open_then_closes() -> None:
    release = anyio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        await release.wait()
        await send({"type": "http.response.body", "body": b"b"})

    async with served(app) as (client, connection):
        stream = await client.request(GET)
        await client.until(lambda events: bool(client.of(stream, h2.events.DataReceived)))
        await connection.wind_down()
        await client.until(lambda events: client.goaway)
        release.set()
        await client.until(lambda _: False)
        assert client.closed, "closed once its one request is done"
        assert (DATA, END_STREAM, stream, b"b") in frames_of(client.after_goaway)


@pytest.mark.parametrize(
    ("head", "http2"),
    [
        (PREFACE, True),
        (PREFACE[:18], True),  # what a peek up to the first blank line finds
        (b"GET /acp HTTP/1.1\r\nHost: x\r\n\r\n", False),
        (b"PRI * HTTP/1.1\r\n\r\n", False),
    ],
)
def test_which_connections_are_http2(head: bytes, http2: bool) -> None:
    assert is_http2(head) is http2
    assert not is_websocket_upgrade(head)


@pytest.mark.anyio
async def test_a_body_larger_than_the_servers_window_is_credited_as_it_is_read() -> None:
    """3 MiB against a 1 MiB window (the connection's and the stream's): the client sends what the window
    allows, and more as the application reads it."""
    big = bytes(range(256)) * (3 * 4096)

    async with served(echo) as (client, _):
        stream_id = client.h2.get_next_available_stream_id()
        client.h2.send_headers(stream_id, POST)
        view = memoryview(big)
        with anyio.fail_after(10):
            while view:
                room = min(client.h2.local_flow_control_window(stream_id), client.h2.max_outbound_frame_size)
                if room == 0:
                    await client.flush()
                    seen = len(client.events)
                    await client.until(lambda events, seen=seen: len(events) > seen)  # the server's WINDOW_UPDATE
                    continue
                client.h2.send_data(stream_id, view[:room].tobytes(), end_stream=len(view) <= room)
                view = view[room:]
            await client.flush()
        await client.until(client.ended(stream_id))
        assert client.body(stream_id) == b"POST " + big


@pytest.mark.anyio
async def test_a_body_read_once_the_connection_is_quiet_is_credited_all_the_same() -> None:
    """The whole window sent, and read by the application only once the server has nothing else to read or
    write: the credit goes out with the read, or the client would wait for it forever."""

    async def late(scope: Scope, receive: Receive, send: Send) -> None:
        await anyio.sleep(0.3)  # the server has read the window's worth and waits for more
        await echo(scope, receive, send)

    body = b"w" * (2**20 + 100_000)
    async with served(late) as (client, _):
        stream_id = client.h2.get_next_available_stream_id()
        client.h2.send_headers(stream_id, POST)
        view = memoryview(body)
        with anyio.fail_after(10):
            while view:
                room = min(client.h2.local_flow_control_window(stream_id), client.h2.max_outbound_frame_size)
                if room == 0:
                    await client.flush()
                    seen = len(client.events)
                    await client.until(lambda events, seen=seen: len(events) > seen)
                    continue
                client.h2.send_data(stream_id, view[:room].tobytes(), end_stream=len(view) <= room)
                view = view[room:]
            await client.flush()
        await client.until(client.ended(stream_id))
        assert client.body(stream_id) == b"POST " + body
