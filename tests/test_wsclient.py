"""The WebSocket client's frame reader: what a server may send, parsed from bytes however they are cut up.

Frames are made by wsproto's own server side, so the reader is held to the library it stands in for;
the client against a real ``serve`` is tested wherever ``acp-proxy connect`` and ``tests.remote_kit`` are.
"""

from __future__ import annotations

import random

import pytest
from wsproto.frame_protocol import CloseReason, FrameProtocol, Opcode

from acp_proxy.remote.wsclient import FrameReader, ProtocolError


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


def test_a_new_message_inside_a_fragmented_one_is_refused() -> None:
    reader = FrameReader()
    reader.feed(bytes([Opcode.TEXT.value, 0x01]) + b"a")
    with pytest.raises(ProtocolError, match="new message"):
        reader.feed(bytes([0x80 | Opcode.TEXT.value, 0x01]) + b"b")
