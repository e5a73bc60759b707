"""A minimal, fast ACP agent for the benchmarks. Standard library only.

It answers ``initialize``, ``session/new`` and the ``_bench/ping`` extension at
once, and answers ``session/prompt`` with a stream of ``agent_message_chunk``
updates followed by ``{"stopReason": "end_turn"}``. The number of updates comes
from the prompt's ``_meta.bench.updates`` (default ``$BENCH_UPDATES`` or 1000).

The stream is built before the first write and written in blocks of
``LINES_PER_WRITE`` lines, so the producer is never what a benchmark measures.
Every line is ``LINE_BYTES`` bytes long, newline included.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

LINE_BYTES = 180
LINES_PER_WRITE = 1000
DEFAULT_UPDATES = int(os.environ.get("BENCH_UPDATES", "1000"))
FILLER = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor " * 4

OUT = sys.stdout.fileno()


def write_all(data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(OUT, view) :]


def send(message: dict[str, Any]) -> None:
    body = json.dumps({"jsonrpc": "2.0", **message}, separators=(",", ":"))
    write_all(body.encode() + b"\n")


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


def requested_updates(params: dict[str, Any]) -> int:
    meta = params.get("_meta")
    bench = meta.get("bench") if isinstance(meta, dict) else None
    count = bench.get("updates") if isinstance(bench, dict) else None
    return count if isinstance(count, int) and count >= 0 else DEFAULT_UPDATES


def handle(msg: dict[str, Any], sessions: list[str]) -> None:
    method, request_id = msg.get("method"), msg.get("id")
    if method is None or "id" not in msg:
        return  # responses and notifications need no answer here
    params = msg.get("params") or {}
    if method == "_bench/ping":
        send({"id": request_id, "result": {}})
    elif method == "initialize":
        send(
            {
                "id": request_id,
                "result": {
                    "protocolVersion": 1,
                    "agentCapabilities": {"loadSession": False},
                    "agentInfo": {"name": "stream-agent", "version": "1.0.0"},
                    "authMethods": [],
                },
            }
        )
    elif method == "session/new":
        sessions.append(f"bench-{len(sessions) + 1}")
        send({"id": request_id, "result": {"sessionId": sessions[-1]}})
    elif method == "session/prompt":
        stream(str(params.get("sessionId", "")), requested_updates(params))
        send({"id": request_id, "result": {"stopReason": "end_turn"}})
    else:
        send({"id": request_id, "error": {"code": -32601, "message": f"unknown method {method}"}})


def main() -> int:
    sessions: list[str] = []
    for line in sys.stdin.buffer:
        if not line.strip():
            continue
        try:
            msg = json.loads(line)
        except ValueError:
            send({"id": None, "error": {"code": -32700, "message": "Parse error"}})
            continue
        if isinstance(msg, dict):
            handle(msg, sessions)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (BrokenPipeError, KeyboardInterrupt):
        sys.exit(0)
