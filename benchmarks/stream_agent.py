"""A minimal, fast ACP agent for the benchmarks. Standard library only.

It answers ``initialize``, ``session/new`` and the ``_bench/ping`` extension at
once, and answers ``session/prompt`` with a stream of ``agent_message_chunk``
updates followed by ``{"stopReason": "end_turn"}``. The number of updates comes
from the prompt's ``_meta.bench.updates`` (default ``$BENCH_UPDATES`` or 1000).

The stream is built before the first write and written in blocks of
``LINES_PER_WRITE`` lines, so the producer is never what a benchmark measures.
Every line is ``LINE_BYTES`` bytes long, newline included.

The other fake agents (``load_agent.py``, ``session_agent.py``) import from here
how an agent reads its requests (``serve``) and writes its answers and updates.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

LINE_BYTES = 180
SESSION_PREFIX = os.urandom(4).hex()
"""This process's part of its session ids."""
LINES_PER_WRITE = 1000
DEFAULT_UPDATES = int(os.environ.get("BENCH_UPDATES", "1000"))
FILLER = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor " * 4

OUT = sys.stdout.fileno()


def write_all(data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(OUT, view) :]


def line(message: dict[str, Any]) -> bytes:
    """A JSON-RPC message as one compact line."""
    return json.dumps({"jsonrpc": "2.0", **message}, separators=(",", ":")).encode() + b"\n"


def answer(request_id: Any, result: Any) -> bytes:
    """The line answering request ``request_id`` with ``result``."""
    return line({"id": request_id, "result": result})


def unknown_method(request_id: Any, method: str) -> bytes:
    return line({"id": request_id, "error": {"code": -32601, "message": f"unknown method {method}"}})


def update_line(session_id: str, index: int) -> bytes:
    """One ``session/update`` line of exactly ``LINE_BYTES`` bytes."""
    head = (
        '{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":'
        + json.dumps(session_id)
        + ',"update":{"sessionUpdate":"agent_message_chunk","content":{"type":"text","text":"'
    )
    tail = '"}}}}\n'
    text = f"chunk {index:06d} {FILLER}"
    room = LINE_BYTES - len(head) - len(tail)
    if room < 1:
        raise ValueError(f"session id too long for {LINE_BYTES}-byte lines: {session_id!r}")
    return (head + text[:room] + tail).encode()


def stream(session_id: str, count: int) -> None:
    lines = [update_line(session_id, i) for i in range(min(count, LINES_PER_WRITE))]
    block = b"".join(lines)
    full, rest = divmod(count, LINES_PER_WRITE)
    for _ in range(full):
        write_all(block)
    if rest:
        write_all(b"".join(lines[:rest]))


def requested_updates(params: dict[str, Any], default: int = DEFAULT_UPDATES) -> int:
    """How many updates a prompt asks for in ``_meta.bench.updates``."""
    meta = params.get("_meta")
    bench = meta.get("bench") if isinstance(meta, dict) else None
    count = bench.get("updates") if isinstance(bench, dict) else None
    return count if isinstance(count, int) and count >= 0 else default


def initialized(request_id: Any, name: str, capabilities: dict[str, Any]) -> bytes:
    """The answer to ``initialize`` of the agent called ``name``."""
    info = {"name": name, "version": "1.0.0"}
    result = {"protocolVersion": 1, "agentCapabilities": capabilities, "agentInfo": info, "authMethods": []}
    return answer(request_id, result)


def serve(handle: Callable[[str, Any, dict[str, Any]], bytes]) -> None:
    """Answer every request read from stdin, until EOF: ``handle(method, id, params)`` is what to write.

    Responses and notifications need no answer here; a line that is not JSON is answered with a parse error.
    """
    for raw in sys.stdin.buffer:
        if not raw.strip():
            continue
        try:
            msg = json.loads(raw)
        except ValueError:
            write_all(line({"id": None, "error": {"code": -32700, "message": "Parse error"}}))
            continue
        if isinstance(msg, dict) and msg.get("method") is not None and "id" in msg:
            write_all(handle(msg["method"], msg["id"], msg.get("params") or {}))


def run(main: Callable[[], int]) -> NoReturn:
    """Exit with ``main()``'s status; a closed pipe (the client went away) or an interrupt ends it with 0."""
    try:
        sys.exit(main())
    except (BrokenPipeError, KeyboardInterrupt):
        sys.exit(0)


def handle(method: str, request_id: Any, params: dict[str, Any], sessions: list[str]) -> bytes:
    if method == "_bench/ping":
        return answer(request_id, {})
    if method == "initialize":
        return initialized(request_id, "stream-agent", {"loadSession": False})
    if method == "session/new":
        # Unique on the host, as a real agent's ids are: two proxies of one install whose agents named their
        # sessions alike would see the second rename its session and relay each of its lines alone.
        sessions.append(f"bench-{SESSION_PREFIX}-{len(sessions) + 1}")
        return answer(request_id, {"sessionId": sessions[-1]})
    if method == "session/prompt":
        stream(str(params.get("sessionId", "")), requested_updates(params))
        return answer(request_id, {"stopReason": "end_turn"})
    return unknown_method(request_id, method)


def main() -> int:
    sessions: list[str] = []
    serve(lambda method, request_id, params: handle(method, request_id, params, sessions))
    return 0


if __name__ == "__main__":
    run(main)
