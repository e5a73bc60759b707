"""A minimal ACP agent for the load benchmark: resumable sessions, streaming turns. Standard library only.

It advertises ``loadSession`` and ``sessionCapabilities.resume``. ``session/new``
answers a fresh id; ``session/resume`` and ``session/load`` accept any id at once
(as if the conversation were read from the adapter's own storage; ``session/load``
replays nothing). ``session/prompt`` streams ``_meta.bench.updates`` (default 20)
``agent_message_chunk`` updates of ``LINE_BYTES`` bytes, then answers
``{"stopReason": "end_turn", "_meta": {"bench": {"pid", "openedBy", "turn"}}}``:
which process served the turn, which request opened the session in that process
(``session/new``, ``session/resume`` or ``session/load``), and how many turns of the
session that process had served before this one. A turn with ``openedBy`` a restore
and ``turn`` 0 is the first after its session was brought back. It exits on stdin EOF
(or SIGTERM). With ``$LOAD_AGENT_LIFETIMES`` set, it appends ``start PID T`` when it
starts and ``end PID T`` when it exits to that file (``T``: ``CLOCK_MONOTONIC``, the
same clock in every process), so that how many ran at once can be counted exactly.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from typing import Any

from stream_agent import update_line, write_all  # this script's own directory

DEFAULT_UPDATES = 20


def line(message: dict[str, Any]) -> bytes:
    return json.dumps({"jsonrpc": "2.0", **message}, separators=(",", ":")).encode() + b"\n"


def requested_updates(params: dict[str, Any]) -> int:
    meta = params.get("_meta")
    bench = meta.get("bench") if isinstance(meta, dict) else None
    count = bench.get("updates") if isinstance(bench, dict) else None
    return count if isinstance(count, int) and count >= 0 else DEFAULT_UPDATES


class Agent:
    def __init__(self) -> None:
        self.opened_by: dict[str, str] = {}
        self.turns: dict[str, int] = {}

    def open(self, session_id: str, method: str) -> None:
        self.opened_by[session_id] = method
        self.turns[session_id] = 0

    def handle(self, msg: dict[str, Any]) -> bytes:
        method, request_id = msg.get("method"), msg.get("id")
        if method is None or "id" not in msg:
            return b""  # responses and notifications need no answer here
        params = msg.get("params") or {}
        session_id = str(params.get("sessionId", ""))
        result: Any
        if method == "initialize":
            result = {
                "protocolVersion": 1,
                "agentCapabilities": {"loadSession": True, "sessionCapabilities": {"resume": {}}},
                "agentInfo": {"name": "load-agent", "version": "1.0.0"},
                "authMethods": [],
            }
        elif method == "session/new":
            session_id = f"load-{uuid.uuid4().hex[:12]}"
            self.open(session_id, method)
            result = {"sessionId": session_id}
        elif method in ("session/resume", "session/load"):
            self.open(session_id, method)
            result = {}
        elif method == "session/prompt":
            turn = self.turns.get(session_id, 0)
            self.turns[session_id] = turn + 1
            stream = b"".join(update_line(session_id, i) for i in range(requested_updates(params)))
            report = {"pid": os.getpid(), "openedBy": self.opened_by.get(session_id), "turn": turn}
            answer = {"stopReason": "end_turn", "_meta": {"bench": report}}
            return stream + line({"id": request_id, "result": answer})
        else:
            return line({"id": request_id, "error": {"code": -32601, "message": f"unknown method {method}"}})
        return line({"id": request_id, "result": result})


def record_lifetime(event: str) -> None:
    path = os.environ.get("LOAD_AGENT_LIFETIMES")
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, f"{event} {os.getpid()} {time.monotonic():.6f}\n".encode())
        finally:
            os.close(fd)


def main() -> int:
    record_lifetime("start")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        serve(Agent())
    finally:
        record_lifetime("end")
    return 0


def serve(agent: Agent) -> None:
    for raw in sys.stdin.buffer:
        if not raw.strip():
            continue
        try:
            msg = json.loads(raw)
        except ValueError:
            write_all(line({"id": None, "error": {"code": -32700, "message": "Parse error"}}))
            continue
        if isinstance(msg, dict) and (out := agent.handle(msg)):
            write_all(out)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (BrokenPipeError, KeyboardInterrupt):
        sys.exit(0)
