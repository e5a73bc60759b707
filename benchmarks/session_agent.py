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

from stream_agent import answer, initialized, line, run, serve, unknown_method  # this script's own directory

HISTORY_TEXT = "an earlier turn of this conversation, replayed from the adapter's storage " * 2


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

    def handle(self, method: str, request_id: Any, params: dict[str, Any]) -> bytes:
        session_id = str(params.get("sessionId", ""))
        if method == "initialize":
            return initialized(request_id, "session-agent", self.capabilities())
        if method == "session/new":
            session_id = f"sess-{uuid.uuid4()}"
            self.opened_by[session_id] = method
            return answer(request_id, {"sessionId": session_id})
        if method == "session/load":
            self.opened_by[session_id] = method
            history = b"".join(chunk(session_id, f"{i:04d} {HISTORY_TEXT}") for i in range(self.replay))
            return history + answer(request_id, {})
        if method == "session/resume" and self.restore == "resume":
            self.opened_by[session_id] = method
            return answer(request_id, {})
        if method == "session/prompt":
            report = {"sessionId": session_id, "restoredBy": self.opened_by.get(session_id), "pid": os.getpid()}
            text = json.dumps(report, sort_keys=True)
            return chunk(session_id, text) + answer(request_id, {"stopReason": "end_turn"})
        return unknown_method(request_id, method)


def main() -> int:
    restore = sys.argv[1] if len(sys.argv) > 1 else "resume"
    replay = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    if restore not in ("resume", "load"):
        print(f"session_agent.py: expected resume or load, got {restore!r}", file=sys.stderr)
        return 2
    serve(Agent(restore, replay).handle)
    return 0


if __name__ == "__main__":
    run(main)
