"""WebSocket frames (``remote/frames.py``): what a server may send, read by the client; what a client may send,
read by ``serve``; parsed from bytes however they are cut up, and written.

Frames are made by wsproto (its server side, or its client side), so the reader is held to the library it
stands in for; both ends against a real ``serve`` are tested wherever ``acp-proxy connect`` and
``tests.remote_kit`` are.
"""

from __future__ import annotations

import random

import pytest
from wsproto.frame_protocol import CloseReason, FrameProtocol, Opcode

from acp_proxy.remote.frames import (
    CLOSE,
    PING,
    TEXT,
    FrameReader,
    ProtocolError,
    client_frame,
    close_frame,
    frame,
    may_send,
)


def _server() -> FrameProtocol:
    return FrameProtocol(client=False, extensions=[])


def _messages() -> tuple[bytes, list[str]]:
    """A stream of the frames a server sends: short, medium (16-bit length) and long (64-bit) texts, a
    fragmented text, a binary message (ignored), a ping; and the texts it holds."""
    server = _server()
    texts = ["{}", "x" * 200, "é" * 40000, '{"jsonrpc":"2.0"}' * 9000]
    out = b"".join(server.send_data(text, fin=True) for text in texts)
    out += server.send_data("first half, ", fin=False) + server.send_data("second half", fin=True)
    out += server.send_data(b"\x00\x01", fin=True) + server.ping(b"are you there")
    out += server.send_data("after the ping", fin=True)
    return out, [*texts, "first half, second half", "after the ping"]


@pytest.mark.parametrize("seed", range(8))
def test_messages_however_the_bytes_are_cut(seed: int) -> None:
    data, texts = _messages()
    rng = random.Random(seed)
    reader = FrameReader()
    at = 0
    while at < len(data):
        step = rng.choice([1, 2, 3, 7, 125, 4096, 70000])
        reader.feed(data[at : at + step])
        at += step
    assert list(reader.texts) == texts
    assert reader.pings == [b"are you there"]
    assert reader.closed is None


def test_the_close_with_its_code_and_reason_and_nothing_read_after_it() -> None:
    server = _server()
    reader = FrameReader()
    reader.feed(server.send_data("last", fin=True) + server.close(CloseReason.POLICY_VIOLATION, "revoked"))
    reader.feed(server.send_data("never", fin=True))
    assert list(reader.texts) == ["last"]
    assert reader.closed == (1008, "revoked")


@pytest.mark.parametrize(
    ("frame", "why"),
    [
        (bytes([0x81, 0x82, 1, 2, 3, 4, 0, 0]), "masked"),  # a server's frames are never masked
        (bytes([0xC1, 0x00]), "reserved"),  # no extension was negotiated
        (bytes([0x80, 0x00]), "continuation"),  # no message under way
        (bytes([0x09, 0x00]), "control"),  # a fragmented ping
        (bytes([0x83, 0x00]), "opcode"),
        (bytes([0x81, 0x02]) + b"\xff\xfe", "UTF-8"),
    ],
)
def test_what_no_server_may_send_is_refused(frame: bytes, why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        FrameReader().feed(frame)


@pytest.mark.parametrize(
    ("after", "why"),
    [
        (bytes([0x81, 0x82, 1, 2, 3, 4, 0, 0]), "masked"),
        (bytes([0xC1, 0x00]), "reserved"),
        (bytes([0x81, 0x02]) + b"\xff\xfe", "UTF-8"),
        (bytes([0x81, 0x7E, 0x00, 0x65]) + b"x" * 101, "over 100 bytes"),
    ],
)
def test_a_run_of_whole_texts_is_read_up_to_the_frame_that_is_refused(after: bytes, why: str) -> None:
    server = _server()
    run = b"".join(server.send_data(text, fin=True) for text in ["{}", "y" * 100, "é" * 50])
    reader = FrameReader(max_message=100)
    with pytest.raises(ProtocolError, match=why):
        reader.feed(run + after + server.send_data("never", fin=True))
    assert list(reader.texts) == ["{}", "y" * 100, "é" * 50]


def test_a_new_message_inside_a_fragmented_one_is_refused() -> None:
    reader = FrameReader()
    reader.feed(bytes([Opcode.TEXT.value, 0x01]) + b"a")
    with pytest.raises(ProtocolError, match="new message"):
        reader.feed(bytes([0x80 | Opcode.TEXT.value, 0x01]) + b"b")


def _client() -> FrameProtocol:
    return FrameProtocol(client=True, extensions=[])


@pytest.mark.parametrize("seed", range(4))
def test_a_clients_masked_frames_however_the_bytes_are_cut(seed: int) -> None:
    client = _client()
    texts = ["{}", "x" * 200, "é" * 40000]
    data = b"".join(client.send_data(text, fin=True) for text in texts)
    data += client.send_data("first, ", fin=False) + client.send_data("second", fin=True) + client.ping(b"hi")
    data += client_frame(TEXT, b"ours") + client.close(CloseReason.NORMAL_CLOSURE, "bye")
    rng = random.Random(seed)
    reader = FrameReader(masked=True)
    for at in range(0, len(data), step := rng.choice([1, 3, 125, 4096])):
        reader.feed(data[at : at + step])
    assert list(reader.texts) == [*texts, "first, second", "ours"]
    assert reader.pings == [b"hi"]
    assert reader.closed == (1000, "bye")


def test_a_server_refuses_unmasked_frames_and_a_message_over_its_limit_before_buffering_it() -> None:
    with pytest.raises(ProtocolError, match="unmasked") as refused:
        FrameReader(masked=True).feed(_server().send_data("x", fin=True))
    assert refused.value.code == 1002
    reader = FrameReader(masked=True, max_message=100)
    reader.feed(client_frame(TEXT, b"x" * 100))
    assert list(reader.texts) == ["x" * 100]
    with pytest.raises(ProtocolError, match="over 100 bytes") as refused:
        reader.feed(bytes([0x81, 0xFF]) + (2**40).to_bytes(8, "big"))  # its length alone is enough
    assert refused.value.code == 1009
    fragmented = FrameReader(masked=True, max_message=100)
    fragmented.feed(_client().send_data("x" * 60, fin=False))
    with pytest.raises(ProtocolError, match="over 100 bytes"):
        fragmented.feed(_client().send_data("y" * 60, fin=True))


def test_the_frames_a_server_writes_are_what_wsproto_reads() -> None:
    client = _client()
    client.receive_bytes(frame(PING, b"p") + close_frame(1008, "revoked"))
    events = list(client.received_frames())
    assert [event.opcode for event in events] == [Opcode.PING, Opcode.CLOSE]
    assert events[0].payload == b"p"
    assert events[1].payload == (1008, "revoked")
    bare = _client()
    bare.receive_bytes(frame(CLOSE, b""))
    assert [event.payload for event in bare.received_frames()] == [(1005, "")]


def test_a_close_carries_only_codes_it_may_and_a_reason_cut_on_a_character() -> None:
    assert [code for code in (999, 1000, 1004, 1005, 1006, 1011, 1015, 2999, 3000, 4999, 5000) if may_send(code)] == [
        1000,
        1011,
        3000,
        4999,
    ]
    client = _client()
    client.receive_bytes(close_frame(1008, "é" * 100))  # 200 bytes of reason: cut to 122, not inside an "é"
    (closing,) = client.received_frames()
    assert closing.payload == (1008, "é" * 61)


def test_text_that_is_not_utf8_is_refused_with_1007() -> None:
    with pytest.raises(ProtocolError, match="UTF-8") as refused:
        FrameReader(masked=True).feed(client_frame(TEXT, b"\xff\xfe"))
    assert refused.value.code == 1007
