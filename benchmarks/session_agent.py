"""A minimal ACP agent whose sessions can be restored, for the session benchmarks. Standard library only.

    session_agent.py resume [REPLAY]   advertises loadSession and sessionCapabilities.resume
    session_agent.py load [REPLAY]     advertises loadSession only

It answers ``initialize``; ``session/new`` with a fresh id; ``session/load`` by
replaying REPLAY (default 100) ``agent_message_chunk`` updates of the session's
history, then ``{}``; ``session/resume`` with ``{}`` at once. It keeps nothing
across processes: any session id can be loaded or resumed, as if it were read
from the adapter's own storage. ``session/prompt`` is answered with one update
whose text is JSON ``{"sessionId", "restoredBy", "pid"}`` (``restoredBy``: the
request that opened the session in this process: ``session/new``, ``session/load``
or ``session/resume``), then ``{"stopReason": "end_turn"}``. It exits on stdin EOF.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from typing import Any

HISTORY_TEXT = "an earlier turn of this conversation, replayed from the adapter's storage " * 2

OUT = sys.stdout.fileno()


def write_all(data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(OUT, view) :]


def line(message: dict[str, Any]) -> bytes:
    return json.dumps({"jsonrpc": "2.0", **message}, separators=(",", ":")).encode() + b"\n"


def chunk(session_id: str, text: str) -> bytes:
    update = {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": text}}
    return line({"method": "session/update", "params": {"sessionId": session_id, "update": update}})


class Agent:
    def __init__(self, restore: str, replay: int) -> None:
        self.restore = restore
        self.replay = replay
        self.opened_by: dict[str, str] = {}

    def capabilities(self) -> dict[str, Any]:
        caps: dict[str, Any] = {"loadSession": True}
        if self.restore == "resume":
            caps["sessionCapabilities"] = {"resume": {}}
        return caps

    def handle(self, msg: dict[str, Any]) -> bytes:
        method, request_id = msg.get("method"), msg.get("id")
        if method is None or "id" not in msg:
            return b""  # responses and notifications need no answer here
        params = msg.get("params") or {}
        session_id = str(params.get("sessionId", ""))
        if method == "initialize":
            result: Any = {
                "protocolVersion": 1,
                "agentCapabilities": self.capabilities(),
                "agentInfo": {"name": "session-agent", "version": "1.0.0"},
                "authMethods": [],
            }
        elif method == "session/new":
            session_id = f"sess-{uuid.uuid4()}"
            self.opened_by[session_id] = method
            result = {"sessionId": session_id}
        elif method == "session/load":
            self.opened_by[session_id] = method
            history = b"".join(chunk(session_id, f"{i:04d} {HISTORY_TEXT}") for i in range(self.replay))
            return history + line({"id": request_id, "result": {}})
        elif method == "session/resume" and self.restore == "resume":
            self.opened_by[session_id] = method
            result = {}
        elif method == "session/prompt":
            report = {"sessionId": session_id, "restoredBy": self.opened_by.get(session_id), "pid": os.getpid()}
            text = json.dumps(report, sort_keys=True)
            return chunk(session_id, text) + line({"id": request_id, "result": {"stopReason": "end_turn"}})
        else:
            return line({"id": request_id, "error": {"code": -32601, "message": f"unknown method {method}"}})
        return line({"id": request_id, "result": result})


def main() -> int:
    restore = sys.argv[1] if len(sys.argv) > 1 else "resume"
    replay = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    if restore not in ("resume", "load"):
        print(f"session_agent.py: expected resume or load, got {restore!r}", file=sys.stderr)
        return 2
    agent = Agent(restore, replay)
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
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (BrokenPipeError, KeyboardInterrupt):
        sys.exit(0)
