"""Fuzzing at scale: a seeded stream of generated lines, both ways, through one running proxy.

``tests/test_fuzz.py`` works out every answer of a few hundred hypothesis-built batches;
this runs the same kinds of lines by the hundred thousand, generated from templates so
that a million of them take minutes, against one proxy over the fake adapter:

* gateway -> proxy: a seeded mix of lines that are not JSON (random bytes, truncated
  objects, syntax errors, invalid UTF-8, nesting past any decoder), not JSON-RPC 2.0
  (every envelope member of a wrong type, ids that are floats, booleans, arrays or
  objects, bare-value params), lines over the size limit, session methods naming no
  session or an unknown one, notifications and answers to requests never sent, blank
  lines; and good requests between them (``_fake/echo`` with ids of every valid type,
  huge integers included, ``session/list``, and a line exactly at the limit). Every line
  that deserves an answer must get exactly the one JSON-RPC 2.0 says: the echo of its
  params, ``-32700`` with id null, ``-32600`` naming the id if one can be read,
  ``-32602`` or ``-32002``; nothing else may be answered.
* adapter -> proxy: prompts whose ``emit`` command makes the adapter write generated
  blobs mid-turn: garbage (non-JSON, broken JSON, invalid UTF-8, deep and over-long
  lines, bad envelopes, answers and cancellations nobody asked for) between good
  ``session/update``\\ s, extension notifications and requests with ids of every type.
  Every good message must reach the gateway, in order, and nothing else; every request
  is answered by the gateway, and the adapter must get each answer exactly once, under
  its own id.
* meanwhile sessions come and go (``session/new``, a streaming prompt, at the end
  ``session/close``): each answered once and correctly, with all its updates.

At the end the proxy must still serve an echo and a prompt, exit 0 on gateway EOF with
no traceback, and leave no process with the run's marker behind. Every wait is bounded:
a wait that runs out is reported as a hang. ``scripts/fuzz --lines N --seed S`` runs it
from the shell; ``tests/test_fuzz_scale.py`` runs a bounded version on both backends.
"""

from __future__ import annotations

import argparse
import base64
import collections
import dataclasses
import json
import math
import random
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from tests.kit import markers
from tests.kit.gateway import Gateway, GatewayError
from tests.support import (
    BAD_ERROR_OBJECTS,
    MARKER_VARIABLE,
    TEST_INITIALIZE,
    end_run,
    fake_command,
    marked_processes,
    scratch_run,
)

LIMIT = 64 * 1024
"""The proxy's max_line_bytes here: small, so that lines over it are cheap to send."""
TOO_DEEP = (3_000, 20_000)
"""Nesting no JSON decoder that recurses goes down to."""
CHUNK_LINES = 1_000
"""Gateway lines per write."""
WINDOW = 4_000
"""Answers owed before the gateway side waits for some to arrive (bounds the proxy's queues and ours)."""
BLOB_LINES = 400
"""Adapter lines per ``emit`` (fewer when they do not compress into one prompt under the limit)."""
BLOB_BYTES = LIMIT - 4_096
STALL = 60.0
"""No answer, update or echo for this long is a hang."""
SESSION = "fake-1"
KIT_IDS = range(0, 10**9)
"""The ids the kit's own requests take (its counter); the fuzzed requests use others."""
MAX_SESSIONS = 8
"""Sessions started beside the stream, all kept open to the end so that no process is evicted
while echoes (which go to any process) are in flight on it."""

Key = tuple[type, Any]
Outcome = tuple[str, Any]


def key_of(request_id: Any) -> Key:
    """Ids compared by type and value: 1, "1" and 1.0 are three different things."""
    return type(request_id), request_id


def nested(depth: int, leaf: bytes = b"0") -> bytes:
    return b"[" * depth + leaf + b"]" * depth


def dumps(value: Any, ascii_only: bool = True) -> bytes:
    return json.dumps(value, ensure_ascii=ascii_only).encode()


INVALID_UTF8 = [b"\xff", b"\xfe\xfe", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80", b"\xe2\x82"]
STRINGS = ["", "some text", "caf\u00e9", "\u2603 snow", "tab\tand\nnewline", 'quote " and \\', "\U0001f600", "x" * 300]
VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    10**30,
    -(10**30),
    2**64,
    1.5,
    -0.0,
    1e308,
    5e-324,
    "",
    "\u00e9",
    [],
    {},
    [1, "two", [3, {"four": None}]],
    {"nested": {"deeper": {"deepest": [True]}}},
    json.loads(nested(150)),
]
INVALID_IDS: list[Any] = [1.5, 0.0, -2.5e10, True, False, [1], [], {"a": 1}, {}]
NOT_STRUCTURED: list[Any] = [0, 7, -1.5, "x", "", True, False]
BAD_ERRORS: list[Any] = [*NOT_STRUCTURED, *BAD_ERROR_OBJECTS]
NOT_A_STRING: list[Any] = [0, 7, True, None, [1], {"a": 1}]
SESSION_METHODS = [
    "session/prompt",
    "session/close",
    "session/delete",
    "session/set_mode",
    "session/set_config_option",
    "session/set_model",
]
ADOPTING_METHODS = ["session/load", "session/resume"]
SYNTAX_ERRORS = [
    b'{"jsonrpc":"2.0","id":1,"method":"_fake/echo","params":{"a":1,}}',
    b'{"jsonrpc":"2.0","id":1,"method":"_fake/echo","params":NaN}',
    b"{'jsonrpc':'2.0','id':1,'method':'_fake/echo'}",
    b'{"jsonrpc":"2.0","id":1,"method":"_fake/echo"}{"jsonrpc":"2.0","id":2,"method":"_fake/echo"}',
    b'{"jsonrpc":"2.0","id":"\\ud800","method":"_fake/echo"}',
    b'{"jsonrpc":"2.0","id":1,"method":"_fake/echo",}',
    b'{"jsonrpc":"2.0","id":1e400000,"method":"_fake/echo"',
    b"}{",
    b"{",
    b'"unterminated',
    b"[1,2",
    b"tru",
    b"nul",
    b"-",
    b"01",
]


MALFORMED = frozenset(
    {"unparseable", "deep", "wrong envelope", "over the limit", "blank"}
    | {"not JSON", "truncated", "syntax", "invalid UTF-8", "bad envelope"}
)
"""Kinds of line, either way, that are no JSON-RPC message (the others are good, or good but refused or unasked-for)."""


@dataclasses.dataclass
class Options:
    seed: int
    lines: int
    async_backend: str = "asyncio"
    log_level: str = "warning"
    timeout: float | None = None
    """The whole run's bound; None: 300 s plus 1 s per thousand lines."""


@dataclasses.dataclass
class Report:
    seed: int
    async_backend: str
    lines: int
    gateway_lines: int = 0
    adapter_lines: int = 0
    gateway_kinds: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    adapter_kinds: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    bytes_sent: int = 0
    bytes_emitted: int = 0
    errors_answered: collections.Counter[int] = dataclasses.field(default_factory=collections.Counter)
    good_served: int = 0
    relayed: int = 0
    """Good adapter messages that reached the gateway, in order."""
    adapter_answers: int = 0
    """Answers to the adapter's requests that reached it under its own id, once each."""
    prompts: int = 0
    sessions: int = 0
    seconds: float = 0.0
    violations: list[str] = dataclasses.field(default_factory=list)

    @property
    def malformed(self) -> int:
        """Lines that are not a JSON-RPC 2.0 message at all (not counting the good but unasked-for)."""
        return sum(self.gateway_kinds[kind] for kind in MALFORMED) + sum(self.adapter_kinds[kind] for kind in MALFORMED)

    def violation(self, text: str) -> None:
        if len(self.violations) < 100:
            self.violations.append(text)

    def summary(self) -> str:
        def counts(counter: collections.Counter[Any]) -> str:
            return ", ".join(f"{kind} {n:,}" for kind, n in sorted(counter.items(), key=lambda item: -item[1]))

        total = self.gateway_lines + self.adapter_lines
        rate = total / self.seconds if self.seconds else 0.0
        lines = [
            f"fuzz at scale: seed {self.seed}, {self.async_backend}, {total:,} lines in {self.seconds:.1f} s "
            f"({rate:,.0f} lines/s)",
            f"  gateway -> proxy: {self.gateway_lines:,} lines ({self.bytes_sent / 1e6:,.1f} MB): "
            + counts(self.gateway_kinds),
            f"  adapter -> proxy: {self.adapter_lines:,} lines ({self.bytes_emitted / 1e6:,.1f} MB) in "
            f"{self.prompts:,} prompts: " + counts(self.adapter_kinds),
            f"  malformed lines: {self.malformed:,}; errors answered: " + (counts(self.errors_answered) or "none"),
            f"  good requests served: {self.good_served:,}; adapter messages relayed in order: {self.relayed:,}; "
            f"adapter requests answered under their own ids: {self.adapter_answers:,}; sessions: {self.sessions}",
            f"  violations: {len(self.violations)}",
        ]
        lines += [f"    {violation}" for violation in self.violations[:20]]
        return "\n".join(lines)


# --- the gateway's lines -----------------------------------------------------------------------------


class GatewayLines:
    """Generates gateway lines from templates; ``owed`` says what each must be answered, by id."""

    KINDS: dict[str, int] = {
        "good echo": 150,
        "good list": 4,
        "good at the limit": 1,
        "unparseable": 190,
        "deep": 2,
        "wrong envelope": 300,
        "over the limit": 1,
        "invalid params": 40,
        "unanswered": 250,
        "blank": 20,
    }

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.serial = 0
        self.params = [
            {"s": rng.choice(STRINGS), "v": rng.choice(VALUES), "w": [rng.choice(VALUES) for _ in range(3)]}
            for _ in range(64)
        ]
        self.encoded = [(params, dumps(params, ascii_only=i % 2 == 0)) for i, params in enumerate(self.params)]
        self.kinds = list(self.KINDS)
        self.weights = list(self.KINDS.values())
        self.makers: dict[str, Callable[[], tuple[bytes, Any, Outcome | None]]] = {
            "good echo": self.good_echo,
            "good list": self.good_list,
            "good at the limit": self.at_limit,
            "unparseable": self.unparseable,
            "deep": self.deep,
            "wrong envelope": self.wrong_envelope,
            "over the limit": self.over_limit,
            "invalid params": self.invalid_params,
            "unanswered": self.unanswered,
            "blank": self.blank,
        }

    def batch(self, count: int) -> list[tuple[str, bytes, Any, Outcome | None]]:
        """``count`` lines: (kind, line, the id its answer names, the answer) or no answer (None)."""
        out = []
        for kind in self.rng.choices(self.kinds, self.weights, k=count):
            line, request_id, outcome = self.makers[kind]()
            out.append((kind, line, request_id, outcome))
        return out

    def fresh_id(self) -> Any:
        """A request id no other request of the run has: of every valid type."""
        self.serial += 1
        n = self.serial
        form = n % 6
        if form == 0:
            return 10**9 + n
        if form == 1:
            return 10**30 + n
        if form == 2:
            return -(10**25) - n
        if form == 3:
            return f"g{n}"
        if form == 4:
            return f"\u00e9-{n}"
        return f'q"\\ {n}'

    def good_echo(self) -> tuple[bytes, Any, Outcome | None]:
        request_id = self.fresh_id()
        params, encoded = self.rng.choice(self.encoded)
        line = b'{"jsonrpc":"2.0","id":' + dumps(request_id) + b',"method":"_fake/echo","params":' + encoded + b"}"
        return line, request_id, ("echo", params)

    def good_list(self) -> tuple[bytes, Any, Outcome | None]:
        request_id = self.fresh_id()
        return (
            dumps({"jsonrpc": "2.0", "id": request_id, "method": "session/list", "params": {}}),
            request_id,
            (
                "list",
                None,
            ),
        )

    def at_limit(self) -> tuple[bytes, Any, Outcome | None]:
        request_id = self.fresh_id()
        params = {"pad": ""}
        base = len(dumps({"jsonrpc": "2.0", "id": request_id, "method": "_fake/echo", "params": params}))
        params["pad"] = "x" * (LIMIT - base)
        line = dumps({"jsonrpc": "2.0", "id": request_id, "method": "_fake/echo", "params": params})
        assert len(line) == LIMIT
        return line, request_id, ("echo", params)

    def unparseable(self) -> tuple[bytes, Any, Outcome | None]:
        """Not one UTF-8 JSON text the decoder can take: -32700 with id null."""
        rng = self.rng
        form = rng.randrange(4)
        if form == 0:  # no JSON value starts with "#"
            line = b"#" + rng.randbytes(rng.randrange(60)).replace(b"\n", b"")
        elif form == 1:  # an object cut before its closing brace
            good = self.good_echo()[0]
            line = good[: rng.randrange(1, len(good) - 1)]
        elif form == 2:
            line = rng.choice(SYNTAX_ERRORS)
        else:
            good = self.good_echo()[0]
            where = good.index(b'"_fake/echo"') + 4
            line = good[:where] + rng.choice(INVALID_UTF8) + good[where:]
        return line, None, ("error", -32700)

    def deep(self) -> tuple[bytes, Any, Outcome | None]:
        """Nesting past reading: -32700 where the envelope is good, -32600 where it is already wrong."""
        depth = self.rng.randrange(*TOO_DEEP)
        form = self.rng.randrange(3)
        if form == 0:
            line = b'{"jsonrpc":"2.0","id":1,"method":"_fake/echo","params":{"a":' + nested(depth) + b"}}"
        elif form == 1:  # a stray answer would get nothing, but this one cannot even be read
            line = b'{"jsonrpc":"2.0","id":"r","result":' + nested(depth) + b"}"
        else:
            line = b'{"jsonrpc":"2.0","method":"_fake/echo","id":' + nested(depth) + b"}"
            return line, None, ("error", -32600)
        return line, None, ("error", -32700)

    def wrong_envelope(self) -> tuple[bytes, Any, Outcome | None]:
        """JSON, but not a JSON-RPC 2.0 message: -32600, naming the id if one can be read."""
        rng = self.rng
        request_id = self.fresh_id()
        answer_id: Any = request_id
        msg: Any = {"jsonrpc": "2.0", "id": request_id, "method": "_fake/echo", "params": {}}
        form = rng.randrange(12)
        if form == 0:
            msg = rng.choice([*NOT_STRUCTURED, None, [], [1, {"jsonrpc": "2.0"}], [{"jsonrpc": "2.0", "method": "x"}]])
            answer_id = None
        elif form == 1:
            msg["id"] = rng.choice(INVALID_IDS)
            answer_id = None
        elif form == 2:
            msg["jsonrpc"] = rng.choice(["1.0", "2", "2.00", "", " 2.0", 2, 2.0, None])
        elif form == 3:
            del msg["jsonrpc"]
        elif form == 4:
            msg["method"] = rng.choice(NOT_A_STRING)
        elif form == 5:
            msg["result"] = rng.choice(VALUES)
        elif form == 6:
            msg = {
                "jsonrpc": "2.0",
                "id": request_id,
                "result": rng.choice(VALUES),
                "error": {"code": 1, "message": "m"},
            }
        elif form == 7:
            msg = {"jsonrpc": "2.0", "id": request_id}
        elif form == 8:
            msg = {"jsonrpc": "2.0", **rng.choice([{}, {"params": {}}, {"result": 1}])}
            answer_id = None
        elif form == 9:
            bad_error = rng.choice(BAD_ERRORS)
            msg = {"jsonrpc": "2.0", "id": request_id, "error": bad_error}
        elif form == 10:
            msg["params"] = rng.choice(NOT_STRUCTURED)
        else:  # a notification whose params are a bare value: invalid, with no id to name
            msg = {"jsonrpc": "2.0", "method": rng.choice(["session/cancel", "_fuzz/note", "$/cancel_request"])}
            msg["params"] = rng.choice(NOT_STRUCTURED)
            answer_id = None
        return dumps(msg), answer_id, ("error", -32600)

    def over_limit(self) -> tuple[bytes, Any, Outcome | None]:
        """One byte over the limit or more: refused unread, so its id cannot be named."""
        size = self.rng.choice([LIMIT + 1, self.rng.randrange(LIMIT + 1, 2 * LIMIT)])
        head = b'{"jsonrpc":"2.0","id":7,"method":"_fake/echo","params":{"pad":"'
        return head + b"x" * (size - len(head) - 3) + b'"}}', None, ("error", -32600)

    def invalid_params(self) -> tuple[bytes, Any, Outcome | None]:
        """Session methods the proxy itself must refuse: -32602 naming no session, -32002 an unknown one
        (except ``session/delete``, which ACP has succeed silently: ``{}``)."""
        rng = self.rng
        request_id = self.fresh_id()
        if rng.random() < 0.6:
            method = rng.choice(SESSION_METHODS + ADOPTING_METHODS)
            params = rng.choice([None, {}, [1, 2], {"sessionId": rng.choice(NOT_A_STRING)}, {"prompt": []}])
            code = -32602
        else:
            method = rng.choice(SESSION_METHODS)
            params = {"sessionId": f"nope-{self.serial}", "prompt": [{"type": "text", "text": "stream 1"}]}
            code = -32002
        msg: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "method": method}
        if params is not None:
            msg["params"] = params
        if code == -32002 and method == "session/delete":
            return dumps(msg), request_id, ("echo", {})
        return dumps(msg), request_id, ("error", code)

    def unanswered(self) -> tuple[bytes, Any, Outcome | None]:
        """Notifications and answers to requests never sent (ids the proxy never gives): no answer at all."""
        rng = self.rng
        form = rng.randrange(5)
        stray = rng.choice([-(self.serial + 1), f"stray-{self.serial}", None])
        if form == 0:
            msg = {"jsonrpc": "2.0", "id": stray, "result": rng.choice(VALUES)}
        elif form == 1:
            msg = {"jsonrpc": "2.0", "id": stray, "error": {"code": rng.randrange(-(2**31), 2**31), "message": "m"}}
        elif form == 2:
            params = rng.choice([None, {}, [1], {"sessionId": rng.choice([*NOT_A_STRING, "nope-x"])}])
            msg = {"jsonrpc": "2.0", "method": "session/cancel", "params": params}
        elif form == 3:
            target = rng.choice([None, "nobody", -5, 1.5, True, [1], {"a": 1}])
            msg = {"jsonrpc": "2.0", "method": "$/cancel_request", "params": rng.choice([{}, {"requestId": target}])}
        else:
            msg = {"jsonrpc": "2.0", "method": rng.choice(["_fuzz/note", "fuzz/unknown", ""]), "params": {"n": 1}}
        return dumps(msg), None, None

    def blank(self) -> tuple[bytes, Any, Outcome | None]:
        return self.rng.choice([b"", b"   ", b"\t", b"\r"]), None, None


# --- the adapter's lines -------------------------------------------------------------------------------


class AdapterLines:
    """Generates what the adapter writes; ``forwarded`` says what of it must reach the gateway, in order."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.token = 0

    def blob(
        self, count: int, kinds: collections.Counter[str]
    ) -> tuple[list[bytes], list[tuple[bool, int]], dict[int, Any]]:
        """Lines, the good ones as (is a request, token) in order, and each request's id by token."""
        lines: list[bytes] = []
        forwarded: list[tuple[bool, int]] = []
        asks: dict[int, Any] = {}
        for _ in range(count):
            if self.rng.random() < 0.45:
                kind, line, request_id = self.good()
                forwarded.append((request_id is not None, self.token))
                if request_id is not None:
                    asks[self.token] = request_id[0]
            else:
                kind, line = self.garbage()
            kinds[kind] += 1
            lines.append(line)
        return lines, forwarded, asks

    def good(self) -> tuple[str, bytes, tuple[Any] | None]:
        rng = self.rng
        self.token += 1
        token = self.token
        form = rng.randrange(10)
        if form < 5:
            update = {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": rng.choice(STRINGS)}}
            msg = {
                "jsonrpc": "2.0",
                "method": "session/update",
                "params": {"sessionId": SESSION, "update": update, "fz": token},
            }
            return "good update", dumps(msg, rng.random() < 0.5), None
        if form == 5:  # passed on as it is, even with a wrong-typed sessionId or none
            params: dict[str, Any] = {"update": {"sessionUpdate": "agent_message_chunk"}, "fz": token}
            if rng.random() < 0.5:
                params["sessionId"] = rng.choice(NOT_A_STRING)
            return "good odd update", dumps({"jsonrpc": "2.0", "method": "session/update", "params": params}), None
        if form < 8:
            msg = {"jsonrpc": "2.0", "method": "_fuzz/note", "params": {"fz": token, "value": rng.choice(VALUES)}}
            return "good extension", dumps(msg, rng.random() < 0.5), None
        request_id = rng.choice([token, -token, f"ask-{token}", None, 0, "", 2**62 + token])
        msg = {
            "jsonrpc": "2.0",
            "id": request_id,
            "method": "_fuzz/ask",
            "params": {"fz": token, "v": rng.choice(VALUES)},
        }
        return "good request", dumps(msg, rng.random() < 0.5), (request_id,)

    def garbage(self) -> tuple[str, bytes]:
        rng = self.rng
        good = (
            b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"fake-1","update":{"text":"some text"}}}'
        )
        form = rng.choices(range(10), GARBAGE_WEIGHTS)[0]
        if form == 0:
            line = rng.choice([b"#", b"Loading model...", b"\x1b[31m"]) + rng.randbytes(rng.randrange(40))
            return "not JSON", line.replace(b"\n", b"")
        if form == 1:
            return "truncated", good[: rng.randrange(1, len(good) - 1)]
        if form == 2:
            return "syntax", rng.choice(
                [good[:-1] + b",}", good.replace(b'"', b"'"), good + good, b"{}}", *SYNTAX_ERRORS]
            )
        if form == 3:
            at = good.index(b"some text") + 4
            return "invalid UTF-8", good[:at] + rng.choice(INVALID_UTF8) + good[at:]
        if form == 4:
            depth = rng.randrange(*TOO_DEEP)
            if rng.random() < 0.5:
                return "deep", nested(depth)
            return "deep", b'{"jsonrpc":"2.0","method":"session/update","params":{"x":' + nested(depth) + b"}}"
        if form == 5:
            return "over the limit", good[:-3] + b"x" * rng.randrange(LIMIT, 2 * LIMIT) + b'"}}'
        if form == 6:
            msg: Any = rng.choice(
                [
                    {"method": "session/update", "params": {}},
                    {"jsonrpc": "1.0", "method": "session/update", "params": {}},
                    {"jsonrpc": 2, "method": "_fuzz/note"},
                    {"jsonrpc": "2.0", "method": 7},
                    {"jsonrpc": "2.0", "id": rng.choice(INVALID_IDS), "method": "_fuzz/ask"},
                    {"jsonrpc": "2.0", "id": 0, "result": {}, "error": {"code": 1, "message": "m"}},
                    {"jsonrpc": "2.0", "id": 0},
                    {"jsonrpc": "2.0", "id": 0, "error": {"code": "x", "message": "m"}},
                    {"jsonrpc": "2.0", "method": "session/update", "result": {}},
                    {"jsonrpc": "2.0"},
                    *NOT_STRUCTURED,
                    [1, {"jsonrpc": "2.0", "method": "session/update"}],
                ]
            )
            return "bad envelope", dumps(msg)
        if form < 9:  # answers to requests the proxy never made (its ids count up from 0)
            stray = rng.choice([-1 - rng.randrange(10**6), 2**40 + rng.randrange(10**6), "nobody", None])
            answer = rng.choice([{"result": {"stopReason": "end_turn"}}, {"error": {"code": 1, "message": "m"}}])
            return "stray answer", dumps({"jsonrpc": "2.0", "id": stray, **answer})
        target = rng.choice(["nobody", *INVALID_IDS])
        return "stray cancel", dumps({"jsonrpc": "2.0", "method": "$/cancel_request", "params": {"requestId": target}})


GARBAGE_WEIGHTS = [20, 20, 20, 20, 1, 0.3, 20, 20, 20, 20]
"""Of ``AdapterLines.garbage``'s forms: the deep and the over-long lines are costly, so fewer."""


def emit_command(lines: list[bytes]) -> str | None:
    """The prompt text that makes the fake adapter write ``lines``; None if it would not fit under the limit."""
    packed = base64.b64encode(zlib.compress(b"".join(line + b"\n" for line in lines), 6)).decode()
    return "emit " + packed if len(packed) < BLOB_BYTES else None


# --- what arrives --------------------------------------------------------------------------------------


class Tally:
    """Everything the proxy writes to the gateway, checked as it arrives against what is owed.

    The kit's connection calls ``observe`` for every message read; the requests of the
    kit's own counter (prompts, session/new, ...) are left to it.
    """

    def __init__(self, report: Report) -> None:
        self.report = report
        self.owed: dict[Key, Outcome] = {}
        self.owed_null: collections.Counter[int] = collections.Counter()
        self.arrived: list[tuple[bool, int]] = []
        """Good adapter messages as they reach the gateway: (is a request, token)."""
        self.updates: collections.Counter[str] = collections.Counter()
        self.answered_asks: dict[int, Any] = {}
        """Token -> the upstream id the gateway answered it under."""
        self._waiters: list[anyio.Event] = []

    @property
    def owing(self) -> int:
        return len(self.owed) + self.owed_null.total()

    def expect(self, request_id: Any, outcome: Outcome) -> None:
        if request_id is None:
            assert outcome[0] == "error"
            self.owed_null[outcome[1]] += 1
        else:
            self.owed[key_of(request_id)] = outcome

    def observe(self, direction: str, msg: dict[str, Any]) -> None:
        if direction != "in":
            return
        if "method" in msg:
            self._notice(msg)
        else:
            self._answer(msg)
        self.wake()

    def wake(self) -> None:
        """Something changed: every ``until`` checks its condition again."""
        if self._waiters:
            for event in self._waiters:
                event.set()
            self._waiters.clear()

    def _notice(self, msg: dict[str, Any]) -> None:
        params = msg.get("params")
        if isinstance(params, dict) and "fz" in params:
            is_request = "id" in msg
            if is_request and (msg["method"] != "_fuzz/ask" or type(msg["id"]) is not int):
                self.report.violation(f"an adapter request reached the gateway wrong: {str(msg)[:200]}")
            self.arrived.append((is_request, params["fz"]))
        elif msg.get("method") == "session/update" and isinstance(params, dict):
            self.updates[str(params.get("sessionId"))] += 1
        else:
            self.report.violation(f"a message nobody caused: {str(msg)[:200]}")

    def _answer(self, msg: dict[str, Any]) -> None:
        request_id = msg.get("id")
        error = msg.get("error")
        if request_id is None:
            code = error.get("code") if isinstance(error, dict) else None
            if isinstance(code, int) and self.owed_null[code] > 0:
                self.owed_null[code] -= 1
                self.report.errors_answered[code] += 1
            else:
                self.report.violation(f"an answer with id null that no line was owed: {str(msg)[:200]}")
            return
        outcome = self.owed.pop(key_of(request_id), None)
        if outcome is None:
            if type(request_id) is not int or request_id not in KIT_IDS:
                self.report.violation(f"an answer to no request, or a second one: {str(msg)[:200]}")
            return
        what, expected = outcome
        if what == "error":
            if not isinstance(error, dict) or error.get("code") != expected or "result" in msg:
                self.report.violation(f"expected error {expected}, got {str(msg)[:200]}")
            else:
                self.report.errors_answered[expected] += 1
            return
        result = msg.get("result")
        if what == "echo":
            good = result == expected
        else:
            good = isinstance(result, dict) and isinstance(result.get("sessions"), list)
        if good and "error" not in msg:
            self.report.good_served += 1
        else:
            self.report.violation(f"a good {what} request was answered {str(msg)[:200]}")

    def answer_of(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The gateway's answer to an adapter's request: a result or an error, naming its token."""
        params = msg.get("params")
        token = params.get("fz") if isinstance(params, dict) else None
        if not isinstance(token, int):
            self.report.violation(f"an agent request nobody caused: {str(msg)[:200]}")
            return {"error": {"code": -32601, "message": "unexpected"}}
        self.answered_asks[token] = msg.get("id")
        if token % 2:
            return {"result": {"fzanswer": token}}
        return {"error": {"code": -32099, "message": "fuzz", "data": {"fzanswer": token}}}

    async def until(self, condition: Callable[[], bool], what: str, timeout: float = STALL) -> bool:
        """Wait, woken by each message, until ``condition`` holds; a wait that runs out is a hang (reported)."""
        with anyio.move_on_after(timeout):
            while not condition():
                event = anyio.Event()
                self._waiters.append(event)
                await event.wait()
            return True
        self.report.violation(f"hang: nothing for {timeout:g} s while waiting for {what}")
        return False


# --- the run -------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    gw: Gateway
    tally: Tally
    report: Report
    asked: anyio.abc.ObjectReceiveStream[dict[str, Any]]
    """The adapter's requests as they reach the gateway, to be answered."""
    asks: dict[int, Any]
    """Every adapter request by token: the id it was sent under."""
    sessions: list[str] = dataclasses.field(default_factory=list)
    done: bool = False

    async def stream_gateway_lines(self, count: int) -> None:
        """Write ``count`` generated lines in chunks, never owing more than a window of answers."""
        lines = GatewayLines(random.Random(f"{self.report.seed}-gateway"))
        sent = 0
        while sent < count:
            if self.tally.owing > WINDOW and not await self.tally.until(
                lambda: self.tally.owing <= WINDOW // 2, f"answers ({self.tally.owing} owed)"
            ):
                return
            chunk = []
            for kind, line, request_id, outcome in lines.batch(min(CHUNK_LINES, count - sent)):
                self.report.gateway_kinds[kind] += 1
                if outcome is not None:
                    self.tally.expect(request_id, outcome)
                chunk.append(line)
            data = b"\n".join(chunk) + b"\n"
            with anyio.fail_after(STALL):
                await self.gw.send_raw(data)
            sent += len(chunk)
            self.report.gateway_lines = sent
            self.report.bytes_sent += len(data)

    async def emit_adapter_lines(self, count: int) -> None:
        """Prompts whose turn writes ``count`` generated lines in all; each turn's good lines checked as it ends."""
        lines = AdapterLines(random.Random(f"{self.report.seed}-adapter"))
        emitted = 0
        size = BLOB_LINES
        while emitted < count:
            drawn = lines.rng.getstate(), lines.token
            kinds: collections.Counter[str] = collections.Counter()
            blob, forwarded, asks = lines.blob(min(size, count - emitted), kinds)
            command = emit_command(blob)
            if command is None:  # too much that does not compress: the same lines, fewer at once
                if size == 1:
                    self.report.violation("an adapter line does not fit in one prompt")
                    return
                lines.rng.setstate(drawn[0])
                lines.token = drawn[1]
                size = max(1, size // 2)
                continue
            size = BLOB_LINES
            before = len(self.tally.arrived)
            self.asks.update(asks)
            answer = await self.gw.prompt(SESSION, command, timeout=STALL)
            self.report.prompts += 1
            self.report.adapter_kinds.update(kinds)
            emitted += len(blob)
            self.report.adapter_lines = emitted
            self.report.bytes_emitted += sum(len(line) + 1 for line in blob)
            if answer.get("result") != {"stopReason": "end_turn"}:
                self.report.violation(f"an emitting prompt was answered {str(answer)[:200]}")
                return

            def all_arrived(target: int = before + len(forwarded)) -> bool:
                return len(self.tally.arrived) >= target

            if not await self.tally.until(all_arrived, "the adapter's good lines"):
                return
            got = self.tally.arrived[before:]
            if got != forwarded:
                self.report.violation(
                    f"adapter messages lost, added or out of order: sent {forwarded[:5]}..., got {got[:5]}..."
                )
                return
            self.report.relayed += len(got)

    async def answer_asks(self, asked: anyio.abc.ObjectReceiveStream[dict[str, Any]]) -> None:
        """Answer the adapter's requests, from a task of their own: the reader never waits to write."""
        async with asked:
            async for msg in asked:
                await self.gw.send({"jsonrpc": "2.0", "id": msg["id"], **self.tally.answer_of(msg)})
                self.tally.wake()

    async def sessions_meanwhile(self, count: int, spread_over: int) -> None:
        """Start ``count`` sessions spread over the gateway's stream, each with a prompt checked update by update."""
        for n in range(count):

            def due(lines: int = n * spread_over // count) -> bool:
                return self.done or self.report.gateway_lines >= lines

            # Bounded by the run's own timeout: the stream's pace is not a hang.
            if not await self.tally.until(due, "the gateway's stream", timeout=math.inf) or self.done:
                return
            answer = await self.gw.request("session/new", {"cwd": "/tmp", "mcpServers": []}, timeout=STALL)
            session = (answer.get("result") or {}).get("sessionId")
            if not isinstance(session, str):
                self.report.violation(f"session/new was answered {str(answer)[:200]}")
                return
            self.sessions.append(session)
            self.report.sessions += 1
            turn = await self.gw.prompt(session, "stream 3", timeout=STALL)
            if turn.get("result") != {"stopReason": "end_turn"}:
                self.report.violation(f"a prompt to {session} was answered {str(turn)[:200]}")
                return

            def streamed(session: str = session) -> bool:
                return self.tally.updates[session] >= 3

            if not await self.tally.until(streamed, f"{session}'s updates"):
                return
            if self.tally.updates[session] != 3:
                self.report.violation(f"{session} had {self.tally.updates[session]} updates for 3 chunks")

    async def still_serving(self) -> None:
        """An echo, a prompt and a close of every session still work."""
        echo = await self.gw.request("_fake/echo", {"after": "the stream"}, timeout=STALL)
        if echo.get("result") != {"after": "the stream"}:
            self.report.violation(f"the last echo was answered {str(echo)[:200]}")
        before = self.tally.updates[SESSION]
        turn = await self.gw.prompt(SESSION, "stream 2", timeout=STALL)
        if turn.get("result") != {"stopReason": "end_turn"}:
            self.report.violation(f"the last prompt was answered {str(turn)[:200]}")
        await self.tally.until(lambda: self.tally.updates[SESSION] >= before + 2, "the last prompt's updates")
        for session in self.sessions:
            closed = await self.gw.request("session/close", {"sessionId": session}, timeout=STALL)
            if "result" not in closed:
                self.report.violation(f"session/close of {session} was answered {str(closed)[:200]}")


async def serve_the_run(run: Run, options: Options) -> None:
    """Both streams and the sessions beside them, then every answer owed, then one more round of serving."""
    tally = run.tally
    await run.gw.initialize(TEST_INITIALIZE)
    session = await run.gw.new_session()
    if session != SESSION:
        run.report.violation(f"the first session is {session}, not {SESSION}")
    adapter_share = options.lines // 2
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(run.answer_asks, run.asked)
        async with anyio.create_task_group() as streams:
            streams.start_soon(run.emit_adapter_lines, adapter_share)
            gateway_share = options.lines - adapter_share
            streams.start_soon(run.sessions_meanwhile, min(MAX_SESSIONS, 1 + options.lines // 100_000), gateway_share)
            await run.stream_gateway_lines(gateway_share)
            run.done = True
        await tally.until(lambda: tally.owing == 0, f"the last answers ({tally.owing} owed)")
        for key, outcome in list(tally.owed.items())[:5]:
            run.report.violation(f"never answered: id {key[1]!r}, owed {outcome[0]} {str(outcome[1])[:80]}")
        if +tally.owed_null:
            run.report.violation(f"errors with id null never sent: {dict(+tally.owed_null)}")
        await tally.until(lambda: len(tally.answered_asks) >= len(run.asks), "the adapter's requests to be answered")
        await run.still_serving()
        tasks.cancel_scope.cancel()


def write_config(workdir: Path) -> Path:
    config = workdir / "fuzz.toml"
    config.write_text(
        f'max_line_bytes = {LIMIT}\n[pool]\nmax_live = {MAX_SESSIONS + 4}\n[backends.fake]\ncommand = ["unused"]\n'
    )
    return config


async def run(options: Options, workdir: Path, env: dict[str, str]) -> Report:
    """One run in ``workdir`` (state dir from ``env``); the report lists every violation."""
    report = Report(seed=options.seed, async_backend=options.async_backend, lines=options.lines)
    record = workdir / "adapter.jsonl"
    argv = [
        sys.executable,
        "-m",
        "acp_proxy",
        "--async-backend",
        options.async_backend,
        "--config",
        str(write_config(workdir)),
        "--log-level",
        options.log_level,
        "--",
        *fake_command(record=str(record)),
    ]
    tally = Tally(report)
    timeout = options.timeout if options.timeout is not None else 300 + options.lines / 1000
    asking, asked = anyio.create_memory_object_stream[dict[str, Any]](math.inf)

    def stash_request(msg: dict[str, Any]) -> None:
        asking.send_nowait(msg)  # answered by Run.answer_asks

    asks: dict[int, Any] = {}
    started = time.monotonic()
    try:
        async with Gateway.launch(
            argv,
            env=env,
            name="the proxy",
            first_id=1001,
            keep=False,
            observers=[tally.observe],
            handler=stash_request,
            close_timeout=30,
        ) as gw:
            run = Run(gw, tally, report, asked, asks)
            with anyio.move_on_after(timeout) as bounded:
                try:
                    await serve_the_run(run, options)
                except* (GatewayError, TimeoutError) as failed:
                    report.violation(f"the run broke off: {failed.exceptions[0]!r}")
            if bounded.cancelled_caught:
                report.violation(f"hang: the run did not end within {timeout:g} s")
            asking.close()
            status = await gw.close(30)
        report.seconds = time.monotonic() - started
        if status != 0:
            report.violation(f"the proxy exited with status {status}: {gw.stderr_tail()}")
        if b"Traceback" in gw.stderr:
            report.violation(f"a traceback on the proxy's stderr: {gw.stderr_tail(6)}")
        if gw.bad_lines:
            report.violation(f"the proxy wrote {len(gw.bad_lines)} lines that are not JSON objects: {gw.bad_lines[:2]}")
        check_adapter_answers(record, asks, tally.answered_asks, report)
    finally:
        deadline = time.monotonic() + 10
        while (left := marked_processes(env[MARKER_VARIABLE])) and time.monotonic() < deadline:
            await anyio.sleep(0.1)
        if left:
            report.violation(f"processes survived: {[str(marked) for marked in left.values()]}")
            markers.kill(left.values())
    return report


def check_adapter_answers(record: Path, asks: dict[int, Any], answered: dict[int, Any], report: Report) -> None:
    """Each adapter request was answered by the gateway once, and the adapter got that answer once, under its own id."""
    missing = [token for token in asks if token not in answered]
    if missing:
        report.violation(f"{len(missing)} adapter requests never reached the gateway, e.g. tokens {missing[:5]}")
    got: collections.Counter[int] = collections.Counter()
    if record.exists():
        with record.open("rb") as lines:
            for raw in lines:
                if b"fzanswer" not in raw:
                    continue
                entry = json.loads(raw)
                msg = json.loads(entry.get("in", "{}"))
                outcome = msg.get("result") or (msg.get("error") or {}).get("data") or {}
                token = outcome.get("fzanswer")
                if token not in asks or key_of(msg.get("id")) != key_of(asks[token]):
                    report.violation(f"the adapter got an answer under the wrong id: {str(msg)[:200]}")
                got[token] += 1
    twice = [token for token, n in got.items() if n > 1]
    lost = [token for token in answered if got[token] == 0]
    if twice:
        report.violation(f"{len(twice)} answers reached the adapter more than once, e.g. tokens {twice[:5]}")
    if lost:
        report.violation(f"{len(lost)} answers never reached the adapter, e.g. tokens {lost[:5]}")
    report.adapter_answers = sum(1 for n in got.values() if n == 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=100_000, help="lines in all, half each way (default 100000)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: time-based, printed)")
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio", help="the proxy's anyio backend")
    parser.add_argument("--log-level", default="warning", help="the proxy's log level (default warning)")
    parser.add_argument(
        "--timeout", type=float, default=None, help="bound on the run (default 300 s + 1 s per 1000 lines)"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (state, the adapter's record)")
    args = parser.parse_args(argv)
    if args.lines < 2:
        parser.error("--lines must be at least 2")
    seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    options = Options(seed, args.lines, args.backend, args.log_level, args.timeout)
    workdir, env = scratch_run("acp-proxy-fuzz-")
    print(f"fuzz: seed {seed}, {args.lines:,} lines, {args.backend}, work dir {workdir}", file=sys.stderr, flush=True)
    report = anyio.run(run, options, workdir, env, backend=args.backend)
    if args.json:
        print(json.dumps(dataclasses.asdict(report) | {"malformed": report.malformed}, indent=2))
    else:
        print(report.summary())
    end_run(workdir, keep=args.keep or bool(report.violations))
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
