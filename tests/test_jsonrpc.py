"""JSON-RPC framing and envelopes, without processes."""

from __future__ import annotations

import itertools
import json
from typing import Any

import anyio
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from acp_proxy.protocol import jsonrpc
from acp_proxy.protocol.acp import (
    annotate_initialize,
    notification_sessions,
    renamed_batch,
    rewrite_session_id,
    session_of,
)
from acp_proxy.protocol.jsonrpc import BadLine, Kind, LineReader
from acp_proxy.relay.adapters import decoded_lines, is_plain_notification_block


class ChunkStream(anyio.abc.ByteReceiveStream):
    """Delivers fixed chunks, then end of stream."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = list(chunks)

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if not self.chunks:
            raise anyio.EndOfStream
        return self.chunks.pop(0)

    async def aclose(self) -> None:
        self.chunks.clear()


def read_all(chunks: list[bytes], max_line_bytes: int = 1 << 20) -> tuple[list[bytes], int]:
    async def collect() -> tuple[list[bytes], int]:
        reader = LineReader(ChunkStream(chunks), max_line_bytes)
        lines: list[bytes] = []
        overlong = 0
        while True:
            try:
                batch = await reader.receive_batch()
            except anyio.EndOfStream:
                return lines, overlong
            assert batch.block == b"".join(line + b"\n" for line in batch.lines)
            lines += batch.lines
            overlong += batch.overlong

    return anyio.run(collect)


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


lines_strategy = st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")), max_size=30)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(lines=lines_strategy, cuts=st.lists(st.integers(min_value=0), max_size=20), terminated=st.booleans())
def test_lines_survive_any_chunking(lines: list[bytes], cuts: list[int], terminated: bool) -> None:
    data = b"\n".join(lines) + (b"\n" if terminated and lines else b"")
    got, overlong = read_all(split_at(data, cuts))
    expected = [line for line in data.split(b"\n")]
    if not terminated or not lines:
        # An unterminated final line still counts, unless it is blank.
        if expected and not expected[-1].strip():
            expected.pop()
    else:
        expected.pop()
    assert overlong == 0
    assert got == expected


@settings(max_examples=200)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=300), min_size=1, max_size=12),
    cuts=st.lists(st.integers(min_value=0), max_size=20),
)
def test_overlong_lines_are_dropped_and_counted(sizes: list[int], cuts: list[int]) -> None:
    limit = 100
    lines = [bytes([65 + i % 26]) * size for i, size in enumerate(sizes)]
    data = b"".join(line + b"\n" for line in lines)
    got, overlong = read_all(split_at(data, cuts), max_line_bytes=limit)
    assert got == [line for line in lines if len(line) <= limit]
    assert overlong == sum(1 for line in lines if len(line) > limit)


def test_overlong_line_is_never_buffered_whole() -> None:
    limit = 1000

    class Endless(anyio.abc.ByteReceiveStream):
        sent = 0

        async def receive(self, max_bytes: int = 65536) -> bytes:
            if self.sent > 50_000_000:
                raise anyio.EndOfStream
            self.sent += 1_000_000
            return b"x" * 1_000_000

        async def aclose(self) -> None:
            pass

    async def first() -> jsonrpc.Batch:
        reader = LineReader(Endless(), limit)
        batch = await reader.receive_batch()
        assert reader._partial_len <= limit
        return batch

    assert anyio.run(first).overlong == 1


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (b'{"jsonrpc":"2.0","id":0,"method":"initialize","params":{}}', Kind.REQUEST),
        (b'{"jsonrpc":"2.0","id":"0","method":"x"}', Kind.REQUEST),
        (b'{"jsonrpc":"2.0","id":null,"method":"x"}', Kind.REQUEST),
        (b'{"jsonrpc":"2.0","method":"session/update","params":{"a":1}}', Kind.NOTIFICATION),
        (b'{"jsonrpc":"2.0","id":0,"result":null}', Kind.RESPONSE),
        (b'{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"x"}}', Kind.RESPONSE),
        (b'{"jsonrpc":"2.0","id":1,"error":{"code":1,"message":"m","data":[1]}}', Kind.RESPONSE),
        (b'{"method":"x","id":1,"jsonrpc":"2.0","extra":true}', Kind.REQUEST),
        (b"not json", BadLine.PARSE),
        (b'{"a":1}{"b":2}', BadLine.PARSE),
        (b"", BadLine.PARSE),
        (b"[]", BadLine.INVALID),
        (b'{"jsonrpc":"2.0"}', BadLine.INVALID),
        (b'{"jsonrpc":"2.0","id":1}', BadLine.INVALID),
        (b'{"jsonrpc":"2.0","id":1,"result":1,"error":{"code":1,"message":"m"}}', BadLine.INVALID),
        (b'{"jsonrpc":"2.0","id":true,"method":"x"}', BadLine.INVALID),
        (b'{"jsonrpc":"2.0","id":1,"error":{"code":"x","message":"m"}}', BadLine.INVALID),
        (b'{"jsonrpc":"2.0","id":1,"method":"x","result":{}}', BadLine.INVALID),
        # Found by fuzzing at scale: the envelope decoder refuses a wrong type before it has read
        # the rest, so broken JSON that starts with one was answered -32600 instead of -32700.
        (b"[1,2", BadLine.PARSE),
        (b'"unterminated', BadLine.PARSE),
        (b'{"jsonrpc":"2.0","id":1.5,"method":"x"', BadLine.PARSE),
        (b'{"jsonrpc":"2.0","id":true,"method":"x","params":{,}}', BadLine.PARSE),
        (b"[" * 5000 + b"]" * 5000, BadLine.INVALID),
    ],
)
def test_decode_line_classifies(line: bytes, expected: Kind | BadLine) -> None:
    decoded = jsonrpc.decode_line(line)
    assert (decoded if isinstance(decoded, BadLine) else decoded[1]) == expected


def test_with_id_keeps_params_and_result_bytes() -> None:
    line = b'{"jsonrpc":"2.0","id":"a","method":"m","params":{"z": 1,  "a": [ 2 ]}}'
    decoded = jsonrpc.decode_line(line)
    assert not isinstance(decoded, BadLine)
    out = jsonrpc.with_id(decoded[0], 0)
    assert out == b'{"jsonrpc":"2.0","id":0,"method":"m","params":{"z": 1,  "a": [ 2 ]}}\n'
    response = jsonrpc.decode_line(b'{"id":5,"jsonrpc":"2.0","result":  [1, {"b" :2}] }')
    assert not isinstance(response, BadLine)
    assert jsonrpc.with_id(response[0], "x") == b'{"jsonrpc":"2.0","id":"x","result":[1, {"b" :2}]}\n'


def test_salvaged_id_names_the_invalid_request() -> None:
    assert jsonrpc.salvage_id(b'{"jsonrpc":"2.0","id":7}') == 7
    assert jsonrpc.salvage_id(b'{"id":true}') is None
    assert jsonrpc.salvage_id(b'{"id":[1]}') is None
    assert jsonrpc.salvage_id(b"[1]") is None


line_pool = [
    b'{"jsonrpc":"2.0","method":"session/update","params":{"n":1}}',
    b'{"jsonrpc":"2.0","id":3,"result":{}}',
    b'{"jsonrpc":"2.0","id":4,"method":"fs/read_text_file","params":{}}',
    b"noise",
    b"",
    b"   ",
    b'{"a":1}{"b":2}',
    b'{"jsonrpc":"2.0","method":"x"} {"jsonrpc":"2.0","method":"y"}',
    b"[1]",
    b'{"jsonrpc":"2.0","method":"$/cancel_request","params":{"requestId":1}}',
    b'{"jsonrpc":5,"method":"x"}',
    b'{"jsonrpc":"2.0","method":"x","result":null}',
    b'{"jsonrpc":"2.0","method":"x","id":null}',
    b'{"method":"x","params":[1]}',
    b'\t{"method":"indented"}',
    b'{"jsonrpc":"2.0","method":"session/update","params":',
    b"{}}",
    b'{"jsonrpc":"2.0","method":"$\\/cancel_request","params":{"requestId":1}}',
    b'{"jsonrpc":"2.0","id":"G7","method":"x"} {"jsonrpc":"2.0","method":"y"}',
]


@settings(max_examples=300)
@given(st.lists(st.sampled_from(line_pool), max_size=12))
def test_block_decoding_agrees_with_line_by_line(lines: list[bytes]) -> None:
    batch = jsonrpc.Batch(b"".join(line + b"\n" for line in lines))
    fast = [
        (line, d if isinstance(d, BadLine) else (msgspec.structs.asdict(d[0]), d[1]))
        for line, d in decoded_lines(batch)
    ]
    slow = []
    for line in lines:
        if line.strip():
            d = jsonrpc.decode_line(line)
            slow.append((line, d if isinstance(d, BadLine) else (msgspec.structs.asdict(d[0]), d[1])))
    assert fast == slow
    plain = is_plain_notification_block(batch)
    expected_plain = bool(lines) and all(
        not isinstance(d, BadLine) and d[1] is Kind.NOTIFICATION and d[0].method != "$/cancel_request"
        for d in map(jsonrpc.decode_line, lines)
    )
    # The fast path may decline a block (it then takes the line-by-line path), but it
    # must never accept one that holds anything other than plain notifications.
    assert expected_plain or not plain
    canonical = all(line[:1] == b"{" and line[-1:] == b"}" for line in lines)
    if canonical and expected_plain:
        assert plain, "a block of canonical notification lines takes the fast path"


ROUTED = [  # notifications a block routes by session at once: (line, its session)
    (b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s1","update":{}}}', "s1"),
    (b'{"jsonrpc":"2.0","method":"session/update","params":{"update":{},"sessionId":"s2"}}', "s2"),
    (b'{"jsonrpc":"2.0","method":"session/update","params":{"update":{"sessionId":"deep"}}}', None),
    (b'{"jsonrpc":"2.0","method":"x","params":{"deep":{"sessionId":"z"},"sessionId":"s3"}}', "s3"),
    (b'{"jsonrpc":"2.0","method":"x","params":{"sessionId":"s\\u0031"}}', "s1"),
    (b'{"jsonrpc":"2.0","method":"_x/notice"}', None),
]
UNROUTED = [  # lines that send a block line by line: not notifications, or params session_of must judge
    b'{"jsonrpc":"2.0","method":"x","params":{"sessionId":5}}',
    b'{"jsonrpc":"2.0","method":"x","params":{"sessionId":null}}',
    b'{"jsonrpc":"2.0","method":"x","params":[1]}',
    b'{"jsonrpc":"2.0","id":4,"method":"fs/read_text_file","params":{"sessionId":"s1"}}',
    b'{"jsonrpc":"2.0","id":3,"result":{"sessionId":"s1"}}',
    b'{"jsonrpc":"1.0","method":"x","params":{"sessionId":"s1"}}',
    b'{"method":"x","params":{"sessionId":"s1"}}',
    b" ",
    b"noise",
]


@settings(max_examples=200)
@given(st.lists(st.sampled_from([line for line, _ in ROUTED] + UNROUTED), min_size=1, max_size=10))
def test_a_block_of_notifications_is_routed_as_each_line_would_be(lines: list[bytes]) -> None:
    """``serve``'s streaming path: one decode for a block's sessions, agreeing with ``session_of`` line by
    line; taken by every block of the routed kinds, declined by any block with another line."""
    sessions = notification_sessions(b"".join(line + b"\n" for line in lines), len(lines))
    routed = dict(ROUTED)
    if all(line in routed for line in lines):
        assert sessions == [routed[line] for line in lines]
        for line, session in zip(lines, sessions, strict=True):
            decoded = jsonrpc.decode_line(line)
            assert not isinstance(decoded, BadLine)
            assert decoded[1] is Kind.NOTIFICATION
            assert session_of(decoded[0].params) == session
    else:
        assert sessions is None


RENAMED = [  # an adapter's lines, under its own session id "a1"
    b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"a1","update":{"text":"x"}}}',
    b'{"jsonrpc":"2.0","method":"session/update","params":{"update":{"sessionId":"a1"},"sessionId":"a1"}}',
    b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"other","update":{}}}',
    b'{"jsonrpc":"2.0","method":"_x/notice","params":{"n":1.50,"sessionId":"a1"}}',
    b'{"jsonrpc":"2.0","method":"_x/notice"}',
    b'{ "jsonrpc": "2.0", "method": "x", "params": {"sessionId": "a1"} }',
]


@settings(max_examples=100)
@given(st.lists(st.sampled_from(RENAMED), min_size=1, max_size=8))
def test_a_renamed_sessions_block_is_rewritten_as_each_line_would_be(lines: list[bytes]) -> None:
    """An adapter whose session the gateway knows under another id: a block of its notifications is rewritten
    with one decode, to exactly the bytes the line-by-line rewrite gives each line."""
    batch = renamed_batch(jsonrpc.Batch(b"".join(line + b"\n" for line in lines)), "a1", "g1")
    assert batch is not None
    renamed = batch.lines
    assert batch.block == b"".join(line + b"\n" for line in renamed)
    expected = []
    for line in lines:
        msg = message(line)
        params = rewrite_session_id(msg.params, "a1", "g1")
        if params is msg.params:
            expected.append(line)
        else:
            msg.params = params
            expected.append(jsonrpc.encode(msg).rstrip(b"\n"))
    assert renamed == expected
    sessions = [session_of(message(line).params) for line in lines]
    assert [session_of(message(line).params) for line in renamed] == ["g1" if s == "a1" else s for s in sessions]


def message(line: bytes) -> jsonrpc.Message:
    decoded = jsonrpc.decode_line(line)
    assert not isinstance(decoded, BadLine)
    return decoded[0]


@pytest.mark.parametrize(
    ("result", "expected_meta"),
    [
        ({"protocolVersion": 1}, {}),
        ({"protocolVersion": 1, "_meta": {"other": 1}}, {"other": 1}),
        ({"protocolVersion": 1, "_meta": None}, {}),
    ],
)
def test_initialize_result_gains_proxy_meta(result: dict[str, Any], expected_meta: dict[str, Any]) -> None:
    annotated = json.loads(bytes(annotate_initialize(msgspec.Raw(json.dumps(result).encode()), "codex")))
    proxy_meta = annotated["_meta"].pop("acp-proxy")
    assert proxy_meta["backend"] == "codex"
    assert annotated["_meta"] == expected_meta
    assert annotated["protocolVersion"] == 1


def test_initialize_result_that_is_not_an_object_is_left_alone() -> None:
    assert bytes(annotate_initialize(msgspec.Raw(b"null"), "x")) == b"null"
