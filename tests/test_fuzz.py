"""Protocol fuzzing against a running proxy, from both of its sides.

One proxy per test serves every hypothesis example, so each example is a batch of
lines thrown at a proxy that has already survived the batches before it.

Gateway side: every line gets what JSON-RPC 2.0 says it deserves, worked out here
from the line's construction and not from the proxy's code: a parse error (-32700,
id null) for bytes that are not one UTF-8 JSON text the decoder can take; invalid
request (-32600, the id if one can be read) for a wrong envelope, and for a line over
the size limit; invalid params (-32602) for a session method that names no session or
a malformed ``session/list``; nothing at all for notifications and stray responses.
Good requests mixed in (ids of every valid type, duplicates in flight) are answered
exactly, and a prompt turn still works after every batch.

Adapter side: the fake adapter writes a hypothesis-built blob (``emit``) in the middle
of a turn. Whatever is not a JSON-RPC message, or answers a request nobody sent, is
dropped; every good message among the garbage reaches the gateway, in order; the
adapter's requests come through under fresh ids and their answers go back under the
adapter's own ids, whatever their type.
"""

from __future__ import annotations

import base64
import collections
import json
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.conformance import Conversation
from tests.support import BAD_ERROR_OBJECTS, Gateway

pytestmark = pytest.mark.anyio

SESSION = "fake-1"
"""The first session of a fresh fake adapter (and state dir): known before the proxy runs,
so that hypothesis can build the adapter's lines up front."""
LIMIT = 64 * 1024
"""The proxy's max_line_bytes here: small, so that lines over it are cheap to send."""
TOO_DEEP = (3_000, 20_000)
"""Nesting no JSON decoder that recurses goes down to (they stop near 1000)."""

FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    # No shrinking: every example runs on the same proxy, so once one has broken it the
    # others fail too and a "smaller" example would be a wrong one. The first failure is
    # reported as it was generated, with a note per line saying what was sent.
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,  # on purpose: one proxy serves every example
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)

ADOPTING_METHODS = ["session/load", "session/resume"]
"""Session methods for which an unknown session is the adapter's to find (so they start one)."""
SESSION_METHODS = [
    "session/prompt",
    "session/close",
    "session/delete",
    "session/set_mode",
    "session/set_config_option",
    "session/set_model",
]


class EnvelopeOnly(Conversation):
    """Checks that each message to the gateway is a well-formed JSON-RPC 2.0 envelope.

    The fuzzed traffic is not ACP (extension methods, echoed junk, an adapter's
    malformed ``session/update`` relayed as it is), so the per-method schema check
    of ``Gateway`` is replaced by this one for these tests.
    """

    def track_request(self, msg: dict[str, Any]) -> None:
        pass

    def check(self, msg: Any) -> None:
        self.checked += 1
        assert isinstance(msg, dict), msg
        assert msg.get("jsonrpc") == "2.0", msg
        assert set(msg) <= {"jsonrpc", "id", "method", "params", "result", "error"}, msg
        if "id" in msg:
            assert msg["id"] is None or type(msg["id"]) in (int, str), msg
        if "method" in msg:
            assert isinstance(msg["method"], str), msg
            assert "result" not in msg, msg
            assert "error" not in msg, msg
            return
        assert "id" in msg, msg
        assert ("result" in msg) != ("error" in msg), msg
        if "error" in msg:
            assert type(msg["error"].get("code")) is int, msg
            assert isinstance(msg["error"].get("message"), str), msg


# --- building lines ------------------------------------------------------------------------------


def dumps(value: Any, ascii_only: bool = True) -> bytes:
    return json.dumps(value, ensure_ascii=ascii_only).encode()


def id_key(request_id: Any) -> tuple[str, str]:
    """Ids compared by type and value: 1, "1" and 1.0 are three different things."""
    return type(request_id).__name__, json.dumps(request_id)


def nested(depth: int, leaf: bytes = b"0") -> bytes:
    return b"[" * depth + leaf + b"]" * depth


def padded(msg: dict[str, Any], size: int) -> bytes:
    """``msg`` with ``params.pad`` grown so that the line is exactly ``size`` bytes."""
    msg = {**msg, "params": {**msg.get("params", {}), "pad": ""}}
    base = dumps(msg)
    msg["params"]["pad"] = "x" * (size - len(base))
    line = dumps(msg)
    assert len(line) == size
    return line


INVALID_UTF8 = [b"\xff", b"\xfe\xfe", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80", b"\xe2\x82"]


def with_invalid_utf8(line: bytes, where: str, bad: bytes) -> bytes:
    """``line`` with ``bad`` spliced into the string that holds ``where``."""
    at = line.index(where.encode()) + len(where) // 2
    return line[:at] + bad + line[at:]


@dataclass
class Batch:
    """Lines to send, and the answers they must get: (id key, outcome) -> how many."""

    lines: list[bytes] = field(default_factory=list)
    answers: collections.Counter[tuple[tuple[str, str], tuple[str, Any]]] = field(default_factory=collections.Counter)
    notes: list[str] = field(default_factory=list)

    def add(self, line: bytes, request_id: Any = None, outcome: tuple[str, Any] | None = None, note: str = "") -> None:
        self.lines.append(line)
        self.notes.append(note or line[:120].decode("utf-8", "replace"))
        if outcome is not None:
            self.answers[(id_key(request_id), outcome)] += 1


def error(code: int) -> tuple[str, Any]:
    return ("error", code)


def result(value: Any) -> tuple[str, Any]:
    return ("result", json.dumps(value, sort_keys=True))


def outcome_of(msg: dict[str, Any]) -> tuple[str, Any]:
    return error(msg["error"]["code"]) if "error" in msg else result(msg["result"])


# --- strategies ------------------------------------------------------------------------------------

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
json_objects = st.dictionaries(st.text(max_size=8), json_values, max_size=4)
valid_ids = st.sampled_from([0, 1, -1, "", "1", None]) | st.integers() | st.text(max_size=12)
"""Every type a request id may have (null included), with small pools so that ids repeat in flight."""
invalid_ids = (
    st.floats(allow_nan=False, allow_infinity=False)
    | st.booleans()
    | st.lists(st.integers(), max_size=2)
    | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
)
not_structured = st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8) | st.booleans()
not_a_string = st.integers() | st.booleans() | st.none() | st.lists(st.integers(), max_size=2) | json_objects
unknown_session = st.text(max_size=10).map(lambda text: "nope-" + text)


@st.composite
def good_echo(draw: st.DrawFn, batch: Batch) -> None:
    """A request the adapter answers: the answer must carry exactly its id and params."""
    request_id = draw(valid_ids)
    params = draw(json_objects)
    if draw(st.booleans()):
        params["deep"] = json.loads(nested(draw(st.integers(1, 200))))
    msg = {"jsonrpc": "2.0", "id": request_id, "method": "_fake/echo", "params": params}
    batch.add(dumps(msg, draw(st.booleans())), request_id, result(params))


@st.composite
def unparseable(draw: st.DrawFn, batch: Batch) -> None:
    """Not one UTF-8 JSON text the decoder can take: -32700 with id null."""
    request = {"jsonrpc": "2.0", "id": draw(valid_ids), "method": "_fake/echo", "params": {"text": "some text"}}
    good = dumps(request)
    kind = draw(st.sampled_from(["bytes", "truncated", "syntax", "utf8", "deep", "deep-result"]))
    if kind == "bytes":  # no JSON value starts with "#"
        line = b"#" + draw(st.binary(max_size=60)).replace(b"\n", b"")
    elif kind == "truncated":  # an object cut before its closing brace
        line = good[: draw(st.integers(1, len(good) - 1))]
    elif kind == "syntax":
        line = draw(
            st.sampled_from(
                [
                    b'{"jsonrpc":"2.0","id":1,"method":"_fake/echo","params":{"a":1,}}',
                    b'{"jsonrpc":"2.0","id":1,"method":"_fake/echo","params":NaN}',
                    b"{'jsonrpc':'2.0','id':1,'method':'_fake/echo'}",
                    b'{"jsonrpc":"2.0","id":1,"method":"_fake/echo"}{"jsonrpc":"2.0","id":2,"method":"_fake/echo"}',
                    b'{"jsonrpc":"2.0","id":"\\ud800","method":"_fake/echo"}',
                    b'{"jsonrpc":"2.0","id":1,"method":"_fake/echo",}',
                ]
            )
        )
    elif kind == "utf8":
        where = draw(st.sampled_from(["some text", "_fake/echo", "jsonrpc"]))
        line = with_invalid_utf8(good, where, draw(st.sampled_from(INVALID_UTF8)))
    elif kind == "deep":
        depth = draw(st.integers(*TOO_DEEP))
        line = b'{"jsonrpc":"2.0","id":1,"method":"_fake/echo","params":{"a":' + nested(depth) + b"}}"
    else:  # a stray response would get no answer, but this one cannot even be read
        depth = draw(st.integers(*TOO_DEEP))
        line = b'{"jsonrpc":"2.0","id":"r","result":' + nested(depth) + b"}"
    batch.add(line, None, error(-32700), kind)


def salvaged(request_id: Any) -> Any:
    """The id an invalid request's error names: its own if it is a valid one, else null."""
    return request_id if type(request_id) in (int, str) else None


@st.composite
def wrong_envelope(draw: st.DrawFn, batch: Batch) -> None:
    """JSON, but not a JSON-RPC 2.0 message: -32600, naming the id if one can be read."""
    request_id = draw(valid_ids)
    base = {"jsonrpc": "2.0", "id": request_id, "method": "_fake/echo", "params": {}}
    kind = draw(
        st.sampled_from(
            [
                "not-an-object",
                "deep-array",
                "deep-id",
                "id",
                "jsonrpc",
                "no-jsonrpc",
                "method",
                "request-with-result",
                "result-and-error",
                "bare-id",
                "nothing",
                "error",
                "params",
                "notification-params",
            ]
        )
    )
    answer_id = salvaged(request_id)
    msg: Any = dict(base)
    if kind == "not-an-object":
        msg = draw(scalars | st.lists(json_values, max_size=3))
        answer_id = None
    elif kind == "deep-array":  # a JSON-RPC batch nested past reading: still just "not an object"
        batch.add(nested(draw(st.integers(*TOO_DEEP))), None, error(-32600), kind)
        return
    elif kind == "deep-id":
        line = b'{"jsonrpc":"2.0","method":"_fake/echo","id":' + nested(draw(st.integers(*TOO_DEEP))) + b"}"
        batch.add(line, None, error(-32600), kind)
        return
    elif kind == "id":
        msg["id"] = draw(invalid_ids)
        answer_id = None
    elif kind == "jsonrpc":
        msg["jsonrpc"] = draw(st.sampled_from(["1.0", "2", "2.00", "", " 2.0"]) | not_a_string)
    elif kind == "no-jsonrpc":
        del msg["jsonrpc"]
    elif kind == "method":
        msg["method"] = draw(not_a_string)
    elif kind == "request-with-result":
        msg["result"] = draw(json_values)
    elif kind == "result-and-error":
        msg = {"jsonrpc": "2.0", "id": request_id, "result": draw(json_values), "error": {"code": 1, "message": "m"}}
    elif kind == "bare-id":
        msg = {"jsonrpc": "2.0", "id": request_id}
    elif kind == "nothing":
        msg = {"jsonrpc": "2.0", **draw(st.sampled_from([{}, {"params": {}}, {"result": 1}]))}
        answer_id = None
    elif kind == "error":
        bad_error = draw(not_structured | st.sampled_from(BAD_ERROR_OBJECTS))
        msg = {"jsonrpc": "2.0", "id": request_id, "error": bad_error}
    elif kind == "params":
        msg["params"] = draw(not_structured)
    else:  # a notification whose params are a bare value: invalid, and its id cannot be known
        msg = {"jsonrpc": "2.0", "method": draw(st.sampled_from(["session/cancel", "_fuzz/note", "$/cancel_request"]))}
        msg["params"] = draw(not_structured)
        answer_id = None
    batch.add(dumps(msg), answer_id, error(-32600), kind)


@st.composite
def oversized(draw: st.DrawFn, batch: Batch) -> None:
    """A good request right at the limit is served; one byte more and it is refused, unread."""
    request_id = draw(valid_ids)
    msg = {"jsonrpc": "2.0", "id": request_id, "method": "_fake/echo", "params": {"n": 1}}
    size = draw(st.sampled_from([LIMIT, LIMIT + 1]) | st.integers(LIMIT + 1, 3 * LIMIT))
    line = padded(msg, size)
    if size <= LIMIT:
        batch.add(line, request_id, result(json.loads(line)["params"]), f"{size} bytes")
    else:
        batch.add(line, None, error(-32600), f"{size} bytes")


@st.composite
def unanswered(draw: st.DrawFn, batch: Batch) -> None:
    """Notifications (bad params included) and responses to ids never sent: no answer at all."""
    kind = draw(st.sampled_from(["response", "error-response", "cancel", "cancel-request", "notification"]))
    if kind == "response":
        msg = {"jsonrpc": "2.0", "id": draw(valid_ids), "result": draw(json_values)}
    elif kind == "error-response":
        error_object = {"code": draw(st.integers(-(2**31), 2**31)), "message": draw(st.text(max_size=10))}
        msg = {"jsonrpc": "2.0", "id": draw(valid_ids), "error": error_object}
    elif kind == "cancel":
        params = draw(
            st.none()
            | st.just({})
            | st.lists(json_values, max_size=2)
            | st.fixed_dictionaries({"sessionId": not_a_string | unknown_session})
        )
        msg = {"jsonrpc": "2.0", "method": "session/cancel", "params": params}
    elif kind == "cancel-request":
        params = draw(st.none() | st.just({}) | st.fixed_dictionaries({"requestId": json_values}))
        msg = {"jsonrpc": "2.0", "method": "$/cancel_request", "params": params}
    else:
        method = draw(st.sampled_from(["_fuzz/note", "fuzz/unknown", ""]))
        msg = {"jsonrpc": "2.0", "method": method, "params": draw(st.none() | json_objects)}
    batch.add(dumps(msg), note=kind)


@st.composite
def invalid_params(draw: st.DrawFn, batch: Batch) -> None:
    """Requests the proxy itself must refuse: -32602 (or -32002 for a session it does not know; a
    delete of one is {})."""
    request_id = draw(valid_ids)
    kind = draw(st.sampled_from(["no-session", "unknown-session", "list-meta", "list-cursor", "new-backend"]))
    code = -32602
    if kind == "no-session":
        method = draw(st.sampled_from(SESSION_METHODS + ADOPTING_METHODS))
        params = draw(
            st.none()
            | st.just({})
            | st.lists(json_values, max_size=2)
            | st.fixed_dictionaries({"sessionId": not_a_string}, optional={"prompt": json_values})
        )
    elif kind == "unknown-session":
        method = draw(st.sampled_from(SESSION_METHODS))
        params = {"sessionId": draw(unknown_session), "prompt": [{"type": "text", "text": "stream 1"}]}
        code = -32002
    elif kind == "list-meta":
        method = "session/list"
        requester = draw(
            st.sampled_from(
                [
                    {"visibility": "everyone"},
                    {"visibility": 1},
                    {"a2a": "yes"},
                    {"sandboxed": 1},
                    {"sessionKey": ""},
                    {"sessionKey": 5},
                    {"agentId": []},
                ]
            )
        )
        ours = draw(st.sampled_from([{"requester": requester}, {"requester": [requester]}, 5, "x", [1]]))
        params = {"_meta": {"acp-proxy": ours}}
    elif kind == "list-cursor":
        method = "session/list"
        params = {"cursor": draw(st.text(max_size=40))}
    else:
        method = "session/new"
        backend = draw(not_a_string.filter(lambda value: value is not None) | unknown_session)
        params = {"cwd": "/tmp", "mcpServers": [], "_meta": {"acp-proxy": {"backend": backend}}}
    msg = {"jsonrpc": "2.0", "id": request_id, "method": method}
    if params is not None:
        msg["params"] = params
    # ACP: deleting a session that does not exist succeeds silently.
    expected = result({}) if code == -32002 and method == "session/delete" else error(code)
    batch.add(dumps(msg), request_id, expected, f"{kind} {method}")


@st.composite
def gateway_batches(draw: st.DrawFn) -> Batch:
    batch = Batch()
    kinds = [good_echo, unparseable, wrong_envelope, oversized, unanswered, invalid_params]
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(kinds))
        draw(kind(batch))
    if draw(st.booleans()):  # blank lines are skipped, not answered
        batch.add(draw(st.sampled_from([b"", b"   ", b"\t", b"\r"])), note="blank")
    order = draw(st.permutations(range(len(batch.lines))))
    batch.lines = [batch.lines[i] for i in order]
    batch.notes = [batch.notes[i] for i in order]
    return batch


# --- gateway side ------------------------------------------------------------------------------


@dataclass
class Served:
    gateway: Gateway
    session: str
    examples: int = 0


@pytest.fixture
async def served(proc_env: dict[str, str], tmp_path: Path) -> AsyncIterator[Served]:
    """One proxy for every example of a test; at the end it must still exit cleanly."""
    config = tmp_path / "fuzz.toml"
    config.write_text(f'max_line_bytes = {LIMIT}\n[backends.fake]\ncommand = ["unused"]\n')
    async with Gateway.start(proc_env, tmp_path, proxy_args=["--config", str(config)]) as gw:
        await gw.initialize()
        session = await gw.new_session()
        assert session == SESSION
        gw.to_gateway = EnvelopeOnly("client")
        served = Served(gw, session)
        yield served
        assert served.examples > 0
        assert gw.stashed() == [], "messages nobody asked for"
        assert await gw.close() == 0, gw.stderr.decode(errors="replace")[-3000:]
    assert b"Traceback" not in gw.stderr, gw.stderr.decode(errors="replace")[-3000:]


async def still_serving(served: Served, n: int) -> None:
    """A prompt turn and an echo still work, and nothing unasked-for has arrived."""
    gw = served.gateway
    echo = await gw.request("_fake/echo", {"after": n})
    assert echo["result"] == {"after": n}
    turn = await gw.prompt(served.session, "stream 2")
    assert turn["result"] == {"stopReason": "end_turn"}
    for _ in range(2):
        update = await gw.expect(lambda m: m.get("method") == "session/update")
        assert update["params"]["sessionId"] == served.session
    assert gw.stashed() == [], "messages nobody asked for"


@settings(FUZZ, max_examples=150)
@given(batch=gateway_batches())
async def test_every_bad_gateway_line_gets_its_answer_and_serving_goes_on(served: Served, batch: Batch) -> None:
    gw = served.gateway
    served.examples += 1
    assert gw.process.stdin is not None
    await gw.process.stdin.send(b"".join(line + b"\n" for line in batch.lines))
    got: collections.Counter[tuple[tuple[str, str], tuple[str, Any]]] = collections.Counter()
    try:
        for _ in range(batch.answers.total()):
            msg = await gw.expect(lambda m: "method" not in m, timeout=10)
            got[(id_key(msg["id"]), outcome_of(msg))] += 1
    except TimeoutError:
        pass
    assert got == batch.answers, "\n".join(batch.notes)
    await still_serving(served, served.examples)


async def test_invalid_utf8_and_deep_nesting_do_not_stop_the_proxy(served: Served) -> None:
    """The lines that took the relay down (UnicodeDecodeError, RecursionError out of the decoder)."""
    gw = served.gateway
    served.examples += 1
    assert gw.process.stdin is not None
    lines = [
        b'{"jsonrpc":"2.0","id":"\xff","method":"_fake/echo"}',
        b'{"jsonrpc":"2.0","id":1,"method":"_fake/\xed\xa0\x80"}',
        b'{"jsonrpc":"2.0","id":2,"method":"_fake/echo","params":{"s":"\xc0\xaf"}}',
        b'{"jsonrpc":"2.0","id":3,"method":"_fake/echo","params":' + nested(5000) + b"}",
    ]
    for line in lines:
        await gw.process.stdin.send(line + b"\n")
        answer = await gw.expect(lambda m: "method" not in m)
        assert answer == {"jsonrpc": "2.0", "id": None, "error": answer["error"]}
        assert answer["error"]["code"] == -32700
    await still_serving(served, 0)


# --- adapter side ---------------------------------------------------------------------------------


@dataclass
class Emitted:
    """What the adapter writes, and what of it must reach the gateway, in order."""

    lines: list[bytes] = field(default_factory=list)
    forwarded: list[tuple[str, Any]] = field(default_factory=list)
    """("notification", message) or ("request", (its id, its params))."""
    notes: list[str] = field(default_factory=list)

    def add(self, line: bytes, forwarded: tuple[str, Any] | None = None, note: str = "") -> None:
        self.lines.append(line)
        self.notes.append(note or line[:120].decode("utf-8", "replace"))
        if forwarded is not None:
            self.forwarded.append(forwarded)


def chunk(session: str, text: str) -> dict[str, Any]:
    update = {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": text}}
    return {"jsonrpc": "2.0", "method": "session/update", "params": {"sessionId": session, "update": update}}


@st.composite
def adapter_good(draw: st.DrawFn, out: Emitted, session: str, token: int) -> None:
    kind = draw(st.sampled_from(["update", "odd-update", "extension", "request"]))
    ascii_only = draw(st.booleans())
    if kind == "update":
        msg = chunk(session, draw(st.text(max_size=20)) + f" #{token}")
    elif kind == "odd-update":  # a relay passes params on as they are, even a wrong-typed sessionId
        msg = chunk(session, f"#{token}")
        sessionless = draw(st.booleans())
        if sessionless:
            del msg["params"]["sessionId"]
        else:
            msg["params"]["sessionId"] = draw(not_a_string)
    elif kind == "extension":
        msg = {"jsonrpc": "2.0", "method": "_fuzz/note", "params": {"token": token, "value": draw(json_values)}}
        if draw(st.booleans()):
            msg["params"]["deep"] = json.loads(nested(draw(st.integers(1, 200))))
    else:
        request_id = draw(valid_ids)
        params = {"token": token, "value": draw(json_values)}
        msg = {"jsonrpc": "2.0", "id": request_id, "method": "_fuzz/ask", "params": params}
        out.add(dumps(msg, ascii_only), ("request", (request_id, params)), kind)
        return
    out.add(dumps(msg, ascii_only), ("notification", msg), kind)


stray_ids = st.integers(max_value=-1) | st.integers(min_value=2**40) | st.text(max_size=10) | st.none()
"""Ids of answers the proxy never asked for (its own ids to an adapter count up from 0)."""


@st.composite
def adapter_garbage(draw: st.DrawFn, out: Emitted, session: str) -> None:
    good = dumps(chunk(session, "some text"))
    kind = draw(
        st.sampled_from(
            [
                "bytes",
                "truncated",
                "syntax",
                "utf8",
                "deep",
                "deep-array",
                "oversized",
                "envelope",
                "stray-answer",
                "stray-cancel",
            ]
        )
    )
    if kind == "bytes":
        line = draw(st.sampled_from([b"#", b"Loading model...", b"\x1b[31m"])) + draw(st.binary(max_size=60))
        line = line.replace(b"\n", b"")
    elif kind == "truncated":
        line = good[: draw(st.integers(1, len(good) - 1))]
    elif kind == "syntax":
        line = draw(st.sampled_from([good[:-1] + b",}", good.replace(b'"', b"'"), good + good, b"{}}"]))
    elif kind == "utf8":
        where = draw(st.sampled_from(["some text", "session/update", "jsonrpc", session]))
        line = with_invalid_utf8(good, where, draw(st.sampled_from(INVALID_UTF8)))
    elif kind == "deep":
        depth = draw(st.integers(*TOO_DEEP))
        line = b'{"jsonrpc":"2.0","method":"session/update","params":{"x":' + nested(depth) + b"}}"
    elif kind == "deep-array":
        line = nested(draw(st.integers(*TOO_DEEP)))
    elif kind == "oversized":
        line = padded(chunk(session, "too long"), draw(st.integers(LIMIT + 1, 3 * LIMIT)))
    elif kind == "envelope":
        msg: Any = draw(
            st.sampled_from(
                [
                    {"method": "session/update", "params": {}},
                    {"jsonrpc": "1.0", "method": "session/update", "params": {}},
                    {"jsonrpc": 2, "method": "_fuzz/note"},
                    {"jsonrpc": "2.0", "method": 7},
                    {"jsonrpc": "2.0", "id": 1.5, "method": "_fuzz/ask"},
                    {"jsonrpc": "2.0", "id": True, "method": "_fuzz/ask"},
                    {"jsonrpc": "2.0", "id": {"a": 1}, "method": "_fuzz/ask"},
                    {"jsonrpc": "2.0", "id": [1], "method": "_fuzz/ask"},
                    {"jsonrpc": "2.0", "id": 0, "result": {}, "error": {"code": 1, "message": "m"}},
                    {"jsonrpc": "2.0", "id": 0},
                    {"jsonrpc": "2.0", "id": 0, "error": {"code": "x", "message": "m"}},
                    {"jsonrpc": "2.0", "method": "session/update", "result": {}},
                    {"jsonrpc": "2.0"},
                ]
            )
            | scalars
            | st.lists(json_values, max_size=3)
        )
        line = dumps(msg)
    elif kind == "stray-answer":
        answer = draw(st.sampled_from([{"result": {"stopReason": "end_turn"}}, {"error": {"code": 1, "message": "m"}}]))
        line = dumps({"jsonrpc": "2.0", "id": draw(stray_ids), **answer})
    else:
        target = draw(st.text(max_size=8).map(lambda text: "nobody-" + text) | invalid_ids)
        line = dumps({"jsonrpc": "2.0", "method": "$/cancel_request", "params": {"requestId": target}})
    out.add(line, note=kind)


@st.composite
def adapter_blobs(draw: st.DrawFn) -> Emitted:
    out = Emitted()
    for token in range(draw(st.integers(1, 12))):
        if draw(st.booleans()):
            draw(adapter_good(out, SESSION, token))
        else:
            draw(adapter_garbage(out, SESSION))
    return out


@settings(FUZZ, max_examples=100)
@given(out=adapter_blobs())
async def test_adapter_garbage_is_dropped_and_good_messages_still_arrive(served: Served, out: Emitted) -> None:
    gw = served.gateway
    served.examples += 1
    recorded = len(gw.adapter_record())
    blob = b"".join(line + b"\n" for line in out.lines)
    command = "emit " + base64.b64encode(zlib.compress(blob, 9)).decode()
    turn = await gw.prompt(served.session, command)
    assert turn["result"] == {"stopReason": "end_turn"}
    arrived = [await gw.expect(lambda m, m0=m0: m is m0) for m0 in gw.stashed()]
    seen: list[tuple[str, Any]] = []
    for msg in arrived:
        if "id" in msg:
            assert msg["method"] == "_fuzz/ask", msg
            assert type(msg["id"]) is int, msg
            seen.append(("request", (msg["id"], msg["params"])))
        else:
            seen.append(("notification", msg))
    expected_requests = [value for what, value in out.forwarded if what == "request"]
    relayed = [value for what, value in seen if what == "request"]
    assert [what for what, _ in seen] == [what for what, _ in out.forwarded], "\n".join(out.notes)
    assert [value for what, value in seen if what == "notification"] == [
        value for what, value in out.forwarded if what == "notification"
    ], "\n".join(out.notes)
    assert [params for _, params in relayed] == [params for _, params in expected_requests]
    upstream_ids = [upstream_id for upstream_id, _ in relayed]
    assert len(set(upstream_ids)) == len(upstream_ids), "two adapter requests under one upstream id"
    # Answer each under the id the gateway saw; the adapter must get it under its own id.
    for upstream_id, params in relayed:
        answer = {"code": -32099, "message": "fuzz", "data": {"token": params["token"]}}
        await gw.send({"jsonrpc": "2.0", "id": upstream_id, "error": answer})
    await still_serving(served, served.examples)
    answered: collections.Counter[tuple[int, tuple[str, str]]] = collections.Counter()
    for entry in gw.adapter_record()[recorded:]:
        msg = json.loads(entry.get("in", "{}"))
        if "method" not in msg and "error" in msg and isinstance(msg["error"].get("data"), dict):
            answered[(msg["error"]["data"]["token"], id_key(msg["id"]))] += 1
    for request_id, params in expected_requests:
        assert answered[(params["token"], id_key(request_id))] == 1, (request_id, params)


# --- found by fuzzing -------------------------------------------------------------------------------


async def test_deeply_nested_list_cursor_is_invalid_params(proc_env: dict[str, str], tmp_path: Path) -> None:
    """A ``session/list`` cursor is base64 of JSON: nested deep enough, decoding it recurses past the limit."""
    cursor = base64.urlsafe_b64encode(b'{"x":' * 5000 + b"1" + b"}" * 5000).decode()
    async with Gateway.start(proc_env, tmp_path) as gw:
        await gw.initialize()
        with anyio.fail_after(10):
            answer = await gw.request("session/list", {"cursor": cursor})
        assert answer["error"]["code"] == -32602
        assert (await gw.request("_fake/echo", {"n": 1}))["result"] == {"n": 1}
