"""serve's HTTP/2 server connection (remote/http2.py), in-process: h2's client state machine on the other end
(an independent implementation of RFC 9113), or raw frames where a client breaks the protocol."""

from __future__ import annotations

import struct

import h2.config
import h2.connection
import h2.events
import h2.settings
import hpack
import pytest

from acp_proxy.remote.http2 import (
    ACK,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PADDED,
    PING,
    PREFACE,
    REPEATED_BLOCK_SIZE,
    REPEATED_BLOCKS,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    Body,
    Closing,
    Code,
    Credit,
    Http2Connection,
    Request,
    Reset,
    StreamGone,
    literal_fields,
    malformed,
)

POST = [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"x"), (b":path", b"/acp")]
GET = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"x"), (b":path", b"/acp")]


class Pair:
    """A server connection and an h2 client, each fed what the other sends."""

    def __init__(self, **server: int) -> None:
        self.server = Http2Connection(**server)
        self.client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.client.initiate_connection()
        self.events = self.to_server()
        self.answers = self.to_client()

    def to_server(self) -> list[object]:
        return self.server.receive(self.client.data_to_send())

    def to_client(self) -> list[h2.events.Event]:
        return self.client.receive_data(self.server.data_to_send())

    def request(self, headers: list[tuple[bytes, bytes]], body: bytes | None = None) -> int:
        stream_id = self.client.get_next_available_stream_id()
        self.client.send_headers(stream_id, headers, end_stream=body is None)
        if body is not None:
            self.client.send_data(stream_id, body, end_stream=True)
        return stream_id


def frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return struct.pack(">BHBBL", len(payload) >> 16, len(payload) & 0xFFFF, kind, flags, stream_id) + payload


def frames_of(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """(type, flags, stream, payload) of each frame in ``data``."""
    found = []
    while data:
        high, low, kind, flags, stream_id = struct.unpack_from(">BHBBL", data)
        length = high << 16 | low
        found.append((kind, flags, stream_id, data[9 : 9 + length]))
        data = data[9 + length :]
    return found


def opened(extra: bytes = b"") -> tuple[Http2Connection, list[object]]:
    """A server that read a client's preface and empty SETTINGS (and ``extra``)."""
    server = Http2Connection()
    events = server.receive(PREFACE + frame(SETTINGS, 0, 0, b"") + extra)
    return server, events


def test_a_request_and_its_body_come_out_as_events_and_the_answer_reads_back_in_h2() -> None:
    pair = Pair()
    assert pair.events == []
    assert any(isinstance(e, h2.events.RemoteSettingsChanged) for e in pair.answers)
    stream_id = pair.request([*POST, (b"content-type", b"application/json")], b'{"jsonrpc":"2.0"}')
    events = pair.to_server()
    assert events == [
        Request(stream_id, [*POST, (b"content-type", b"application/json")], ended=False),
        Body(stream_id, b'{"jsonrpc":"2.0"}', ended=True),
    ]
    pair.server.respond(
        stream_id, 202, [(b"content-type", b"text/plain"), (b"acp-connection-id", b"c" * 300)], end=True
    )
    answers = pair.to_client()
    response = next(e for e in answers if isinstance(e, h2.events.ResponseReceived))
    assert response.headers == [
        (b":status", b"202"),
        (b"content-type", b"text/plain"),
        (b"acp-connection-id", b"c" * 300),
    ]
    assert any(isinstance(e, h2.events.StreamEnded) for e in answers)
    assert stream_id not in pair.server.streams  # both ends are done with it


@pytest.mark.parametrize("status", [200, 204, 400, 404, 409, 413, 500, 502])
def test_every_status_reads_back_whether_or_not_the_static_table_holds_it(status: int) -> None:
    pair = Pair()
    stream_id = pair.request(GET)
    pair.to_server()
    pair.server.respond(stream_id, status, [], end=True)
    response = next(e for e in pair.to_client() if isinstance(e, h2.events.ResponseReceived))
    assert response.headers == [(b":status", b"%d" % status)]


def test_an_event_stream_sends_parts_and_the_client_reads_them_in_order() -> None:
    pair = Pair()
    stream_id = pair.request(GET)
    pair.to_server()
    pair.server.respond(stream_id, 200, [(b"content-type", b"text/event-stream")], end=False)
    for part in (b": open\n\n", b"data: 1\n\n", b"data: 2\n\n"):
        assert pair.server.send(stream_id, part, end=False) == len(part)
    pair.server.send(stream_id, b"", end=True)
    answers = pair.to_client()
    assert (
        b"".join(e.data for e in answers if isinstance(e, h2.events.DataReceived))
        == b": open\n\ndata: 1\n\ndata: 2\n\n"
    )
    assert isinstance(answers[-1], h2.events.StreamEnded)


def test_sending_stops_at_the_clients_window_and_goes_on_once_it_credits_it() -> None:
    pair = Pair()
    stream_id = pair.request(GET)
    pair.to_server()
    pair.server.respond(stream_id, 200, [], end=False)
    body = b"x" * 100_000
    sent = pair.server.send(stream_id, body, end=True)
    assert sent == 65_535  # h2's default windows, stream and connection
    assert pair.server.sendable(stream_id) == 0
    received = [e for e in pair.to_client() if isinstance(e, h2.events.DataReceived)]
    assert all(len(e.data) <= 16_384 for e in received)  # the client's largest frame
    for event in received:
        pair.client.acknowledge_received_data(event.flow_controlled_length, stream_id)
    assert pair.to_server() == [Credit()]
    assert pair.server.sendable(stream_id) > 0
    assert pair.server.send(stream_id, body[sent:], end=True) == len(body) - sent
    answers = pair.to_client()
    assert sum(len(e.data) for e in answers if isinstance(e, h2.events.DataReceived)) == len(body) - sent
    assert any(isinstance(e, h2.events.StreamEnded) for e in answers)


def test_a_smaller_initial_window_from_the_client_holds_an_open_stream_back() -> None:
    pair = Pair()
    stream_id = pair.request(GET)
    pair.to_server()
    pair.server.respond(stream_id, 200, [], end=False)
    pair.client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 10})
    pair.to_server()
    assert pair.server.send(stream_id, b"y" * 50, end=False) == 10


def test_a_body_is_credited_back_as_it_is_taken_a_quarter_window_at_a_time() -> None:
    pair = Pair(window=40_000)
    stream_id = pair.client.get_next_available_stream_id()
    pair.client.send_headers(stream_id, POST)
    pair.client.send_data(stream_id, b"z" * 9_000)
    pair.to_server()
    pair.server.taken(stream_id, 9_000)
    assert not pair.server.pending  # under a quarter of the window: no update yet
    pair.client.send_data(stream_id, b"z" * 2_000)
    pair.to_server()
    pair.server.taken(stream_id, 2_000)
    updates = [(s, p) for kind, _, s, p in frames_of(pair.server.data_to_send()) if kind == WINDOW_UPDATE]
    assert updates == [(0, struct.pack(">L", 11_000)), (stream_id, struct.pack(">L", 11_000))]


def test_a_client_that_sends_past_the_window_breaks_the_connection() -> None:
    server, _ = opened()
    server.receive(frame(HEADERS, END_HEADERS, 1, hpack.Encoder().encode(POST)))
    server.data_to_send()
    events = server.receive(frame(DATA, 0, 1, b"a" * 16_384) * 70)  # 1 MiB is the window
    assert events[-1] == Closing(Code.FLOW_CONTROL_ERROR, "DATA beyond the connection's window", by_client=False)
    assert frames_of(server.data_to_send())[-1][0] == GOAWAY


def test_a_stream_the_client_resets_is_reported_and_writes_to_it_fail() -> None:
    pair = Pair()
    stream_id = pair.request(GET)
    pair.to_server()
    pair.client.reset_stream(stream_id)
    assert pair.to_server() == [Reset(stream_id, Code.NO_ERROR)]
    with pytest.raises(StreamGone):
        pair.server.send(stream_id, b"late", end=False)


def test_an_answer_before_the_whole_body_asks_the_client_to_stop_sending_it() -> None:
    pair = Pair()
    stream_id = pair.client.get_next_available_stream_id()
    pair.client.send_headers(stream_id, POST)
    pair.client.send_data(stream_id, b"partial")
    pair.to_server()
    pair.server.respond(stream_id, 413, [], end=True)
    answers = pair.to_client()
    assert any(isinstance(e, h2.events.StreamReset) and e.error_code == 0 for e in answers)
    later = pair.server.receive(frame(DATA, END_STREAM, stream_id, b"in flight"))
    assert later == []  # what was already in flight is dropped, and counted against no stream


def test_trailers_end_the_body() -> None:
    pair = Pair()
    stream_id = pair.request(POST, None)  # ended: no body
    pair.to_server()
    stream_id = pair.client.get_next_available_stream_id()
    pair.client.send_headers(stream_id, POST)
    pair.client.send_data(stream_id, b"{}")
    pair.client.send_headers(stream_id, [(b"x-checksum", b"1")], end_stream=True)
    events = pair.to_server()
    assert events[-2:] == [Body(stream_id, b"{}", ended=False), Body(stream_id, b"", ended=True)]


def test_a_header_block_in_continuation_frames_and_padded_frames_are_read() -> None:
    block = hpack.Encoder().encode([*POST, (b"x-long", b"v" * 200)])
    padded_headers = bytes([4]) + block[:50] + b"\0" * 4
    data = frame(HEADERS, PADDED, 1, padded_headers) + frame(CONTINUATION, END_HEADERS, 1, block[50:])
    data += frame(DATA, PADDED | END_STREAM, 1, bytes([3]) + b"{}" + b"\0" * 3)
    _, events = opened(data)
    assert events == [Request(1, [*POST, (b"x-long", b"v" * 200)], ended=False), Body(1, b"{}", ended=True)]


def test_a_ping_is_answered_and_a_settings_frame_acknowledged() -> None:
    server, _ = opened()
    answered = frames_of(server.data_to_send())
    assert (SETTINGS, ACK, 0, b"") in answered  # the client's SETTINGS
    server.receive(frame(PING, 0, 0, b"12345678"))
    assert frames_of(server.data_to_send()) == [(PING, ACK, 0, b"12345678")]


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", Code.PROTOCOL_ERROR),  # not HTTP/2
        (PREFACE + frame(PING, 0, 0, b"12345678"), Code.PROTOCOL_ERROR),  # SETTINGS must come first
        (PREFACE + frame(SETTINGS, 0, 0, b"") + frame(DATA, 0, 0, b"x"), Code.PROTOCOL_ERROR),  # on stream 0
        (PREFACE + frame(SETTINGS, 0, 0, b"") + frame(DATA, 0, 5, b"x"), Code.PROTOCOL_ERROR),  # never opened
        (PREFACE + frame(SETTINGS, 0, 0, b"\0\4"), Code.FRAME_SIZE_ERROR),  # not a multiple of 6
        (PREFACE + frame(SETTINGS, 0, 0, struct.pack(">HL", 4, 2**31)), Code.FLOW_CONTROL_ERROR),
        (PREFACE + frame(SETTINGS, 0, 0, struct.pack(">HL", 5, 100)), Code.PROTOCOL_ERROR),  # frame size
        (PREFACE + frame(SETTINGS, 0, 0, b"") + frame(PING, 0, 0, b"short"), Code.FRAME_SIZE_ERROR),
        (PREFACE + frame(SETTINGS, 0, 0, b"") + frame(WINDOW_UPDATE, 0, 0, b"\0\0\0\0"), Code.PROTOCOL_ERROR),
        (PREFACE + frame(SETTINGS, 0, 0, b"") + frame(RST_STREAM, 0, 7, b"\0\0\0\0"), Code.PROTOCOL_ERROR),
        (PREFACE + frame(SETTINGS, 0, 0, b"") + frame(CONTINUATION, END_HEADERS, 1, b""), Code.PROTOCOL_ERROR),
        (PREFACE + frame(SETTINGS, 0, 0, b"") + frame(HEADERS, END_HEADERS, 2, b"\x82"), Code.PROTOCOL_ERROR),
        (PREFACE + frame(SETTINGS, 0, 0, b"") + frame(HEADERS, END_HEADERS, 1, b"\xff\xff"), Code.COMPRESSION_ERROR),
        (PREFACE + frame(SETTINGS, 0, 0, b"") + frame(DATA, 0, 1, b"x" * 20_000), Code.FRAME_SIZE_ERROR),
        (  # another frame in the middle of a header block
            PREFACE + frame(SETTINGS, 0, 0, b"") + frame(HEADERS, 0, 1, b"\x82") + frame(PING, 0, 0, b"12345678"),
            Code.PROTOCOL_ERROR,
        ),
    ],
)
def test_a_client_that_breaks_the_protocol_gets_goaway_with_its_error_and_nothing_more_is_read(
    data: bytes, code: Code
) -> None:
    server = Http2Connection()
    events = server.receive(data)
    closing = events[-1]
    assert isinstance(closing, Closing)
    assert (closing.code, closing.by_client) == (code, False)
    kind, _, _, payload = frames_of(server.data_to_send())[-1]
    assert (kind, struct.unpack(">LL", payload[:8])[1]) == (GOAWAY, code)
    assert server.receive(frame(PING, 0, 0, b"12345678")) == []
    assert not server.pending


def test_a_preface_that_comes_in_pieces_is_waited_for() -> None:
    server = Http2Connection()
    assert server.receive(PREFACE[:5]) == []
    assert server.receive(PREFACE[5:] + frame(SETTINGS, 0, 0, b"")) == []
    assert server.closing is None


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        (POST, None),
        ([(b":method", b"CONNECT"), (b":authority", b"x")], None),
        ([(b":method", b"GET"), (b":path", b"/")], "missing"),
        ([*POST, (b":path", b"/again")], "pseudo-header"),
        ([*POST, (b"x", b"1"), (b":status", b"200")], "pseudo-header after"),
        ([*POST, (b"Content-Type", b"x")], "not lowercase"),
        ([*POST, (b"connection", b"keep-alive")], "connection-specific"),
        ([*POST, (b"te", b"gzip")], "connection-specific"),
        ([*POST, (b"te", b"trailers")], None),
    ],
)
def test_a_malformed_request_is_named(headers: list[tuple[bytes, bytes]], reason: str | None) -> None:
    found = malformed(headers)
    assert (found is None) if reason is None else (found is not None and reason in found)


def test_a_malformed_request_is_reset_and_the_connection_goes_on() -> None:
    encoder = hpack.Encoder()  # one encoder for every block, as a client's: its table is the server's too
    server, _ = opened()
    bad = [(b":method", b"GET"), (b":path", b"/"), (b"x-kept", b"inserted in the table")]  # no :scheme
    assert server.receive(frame(HEADERS, END_HEADERS | END_STREAM, 1, encoder.encode(bad))) == []
    assert (RST_STREAM, 0, 1, struct.pack(">L", Code.PROTOCOL_ERROR)) in frames_of(server.data_to_send())
    good = [*GET, (b"x-kept", b"inserted in the table")]  # refers to the entry the bad block inserted
    events = server.receive(frame(HEADERS, END_HEADERS | END_STREAM, 3, encoder.encode(good)))
    assert events == [Request(3, good, ended=True)]


def test_streams_over_the_limit_are_refused_and_their_headers_still_decoded() -> None:
    encoder = hpack.Encoder()
    server = Http2Connection(max_streams=2)
    server.receive(PREFACE + frame(SETTINGS, 0, 0, b""))
    server.data_to_send()
    new = [*GET, (b"x-new", b"indexed from here")]
    blocks = [encoder.encode(GET), encoder.encode(GET), encoder.encode(new), encoder.encode(new)]
    events = server.receive(
        b"".join(frame(HEADERS, END_HEADERS | END_STREAM, 1 + 2 * i, b) for i, b in enumerate(blocks))
    )
    assert [e.stream_id for e in events if isinstance(e, Request)] == [1, 3]
    resets = [(s, p) for kind, _, s, p in frames_of(server.data_to_send()) if kind == RST_STREAM]
    assert resets == [(5, struct.pack(">L", Code.REFUSED_STREAM)), (7, struct.pack(">L", Code.REFUSED_STREAM))]
    server.respond(1, 200, [], end=True)
    assert server.receive(frame(HEADERS, END_HEADERS | END_STREAM, 9, encoder.encode(new))) == [
        Request(9, new, ended=True)
    ]


BY_HAND = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/"), (b":authority", b"x")]


def _request_block(tail: bytes) -> bytes:
    """``BY_HAND``'s header block: static entries 3, 6 and 4, an :authority literal that leaves the table as it
    was; then ``tail``."""
    return b"\x83\x86\x84\x01\x01x" + tail


def test_a_header_block_a_client_repeats_is_decoded_once_while_the_table_stays_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, _ = opened()
    decoded: list[bytes] = []
    decode = server._decoder.decode
    monkeypatch.setattr(server._decoder, "decode", lambda block, raw: decoded.append(block) or decode(block, raw))
    indexed = hpack.Encoder()  # as h2, httpx and curl send: the first request indexes, the next refer to it
    headers = [*POST, (b"content-type", b"application/json"), (b"acp-session-id", b"s" * 36)]
    blocks = [indexed.encode(headers) for _ in range(3)]
    literal = _request_block(b"\x00\x06x-mine\x05again")  # literal names and values, never indexed
    for index, block in enumerate([*blocks, literal, literal, blocks[2]]):
        stream_id = 1 + 2 * index
        events = server.receive(frame(HEADERS, END_HEADERS | END_STREAM, stream_id, block))
        want = headers if block is not literal else [*BY_HAND, (b"x-mine", b"again")]
        assert events == [Request(stream_id, want, ended=True)]
        server.respond(stream_id, 202, [], end=True)
    assert decoded == [blocks[0], blocks[1], literal]  # the first one inserted into the table: decoded again


def test_a_kept_header_block_is_decoded_afresh_once_the_table_changes() -> None:
    """Each step a block and the last field it must decode to; references to the dynamic table come after
    every kind of change to it: an entry added, one added in the place of another, the size changed."""
    server, _ = opened()
    refer, refer_second = _request_block(b"\xbe"), _request_block(b"\xbf")  # dynamic entries 62 and 63
    sized = {n: b"\x3f" + bytes([n - 31]) + _request_block(b"") for n in (40, 100)}  # a size update first
    steps = [
        (_request_block(b"\x40\x03x-a\x03one"), (b"x-a", b"one")),  # added (incremental indexing): 62
        (refer, (b"x-a", b"one")),
        (refer, (b"x-a", b"one")),
        (_request_block(b"\x40\x03x-a\x03two"), (b"x-a", b"two")),  # 62 now; (x-a, one) is 63
        (refer, (b"x-a", b"two")),
        (sized[40], (b":authority", b"x")),  # room for one entry of 38 bytes: (x-a, one) goes
        (refer, (b"x-a", b"two")),
        (_request_block(b"\x40\x03x-a\x05three"), (b"x-a", b"three")),  # in the one place: as many entries
        (refer, (b"x-a", b"three")),
        (sized[100], (b":authority", b"x")),  # nothing goes
        (sized[40], (b":authority", b"x")),
        (sized[100], (b":authority", b"x")),  # the same block again, whose size must count again
        (_request_block(b"\x40\x03x-b\x011"), (b"x-b", b"1")),  # 76 bytes in 100: (x-a, three) stays, 63
        (refer_second, (b"x-a", b"three")),
    ]
    for index, (block, last) in enumerate(steps):
        [request] = server.receive(frame(HEADERS, END_HEADERS | END_STREAM, 1 + 2 * index, block))
        assert isinstance(request, Request)
        assert request.headers[-1] == last, index
    emptied = b"\x20" + _request_block(b"")  # a size update to 0 empties the table
    assert isinstance(server.receive(frame(HEADERS, END_HEADERS | END_STREAM, 101, emptied))[0], Request)
    events = server.receive(frame(HEADERS, END_HEADERS | END_STREAM, 103, refer))
    assert events[-1] == Closing(Code.COMPRESSION_ERROR, events[-1].message, by_client=False)


def test_header_blocks_kept_are_bounded_the_oldest_let_go() -> None:
    server, _ = opened()
    blocks = [_request_block(b"\x00\x04x-id\x04%04d" % n) for n in range(REPEATED_BLOCKS + 5)]
    for index, block in enumerate(blocks):
        assert len(server.receive(frame(HEADERS, END_HEADERS | END_STREAM, 1 + 2 * index, block))) == 1
        server.respond(1 + 2 * index, 202, [], end=True)
    assert list(server._decoded) == blocks[-REPEATED_BLOCKS:]
    tail = bytearray()
    literal_fields(tail, [(b"x-id", b"v" * REPEATED_BLOCK_SIZE)])
    large = _request_block(bytes(tail))
    stream_id = 1 + 2 * len(blocks)
    events = server.receive(frame(HEADERS, END_HEADERS | END_STREAM, stream_id, large))
    assert events == [Request(stream_id, [*BY_HAND, (b"x-id", b"v" * REPEATED_BLOCK_SIZE)], ended=True)]
    assert large not in server._decoded


def test_after_goaway_open_streams_are_served_and_new_ones_refused() -> None:
    pair = Pair()
    open_one = pair.request(GET)
    pair.to_server()
    pair.server.goaway()
    goaway = [f for f in frames_of(pair.server.data_to_send()) if f[0] == GOAWAY]
    assert struct.unpack(">LL", goaway[0][3][:8]) == (open_one, Code.NO_ERROR)
    pair.server.goaway()
    assert not pair.server.pending  # said once
    late = pair.request(GET)
    assert pair.to_server() == []
    assert (RST_STREAM, 0, late, struct.pack(">L", Code.REFUSED_STREAM)) in frames_of(pair.server.data_to_send())
    pair.server.respond(open_one, 200, [], end=True)
    assert any(isinstance(e, h2.events.StreamEnded) for e in pair.to_client())


def test_the_clients_goaway_is_an_event() -> None:
    pair = Pair()
    pair.client.close_connection()
    events = pair.to_server()
    assert events == [Closing(Code.NO_ERROR, "", by_client=True)]
