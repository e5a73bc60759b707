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

import os
import signal
import sys
import time
import uuid
from typing import Any

from stream_agent import (  # this script's own directory
    answer,
    initialized,
    requested_updates,
    run,
    serve,
    unknown_method,
    update_line,
)

DEFAULT_UPDATES = 20
CAPABILITIES = {"loadSession": True, "sessionCapabilities": {"resume": {}}}


class Agent:
    def __init__(self) -> None:
        self.opened_by: dict[str, str] = {}
        self.turns: dict[str, int] = {}

    def open(self, session_id: str, method: str) -> None:
        self.opened_by[session_id] = method
        self.turns[session_id] = 0

    def handle(self, method: str, request_id: Any, params: dict[str, Any]) -> bytes:
        session_id = str(params.get("sessionId", ""))
        if method == "initialize":
            return initialized(request_id, "load-agent", CAPABILITIES)
        if method == "session/new":
            session_id = f"load-{uuid.uuid4().hex[:12]}"
            self.open(session_id, method)
            return answer(request_id, {"sessionId": session_id})
        if method in ("session/resume", "session/load"):
            self.open(session_id, method)
            return answer(request_id, {})
        if method == "session/prompt":
            turn = self.turns.get(session_id, 0)
            self.turns[session_id] = turn + 1
            stream = b"".join(update_line(session_id, i) for i in range(requested_updates(params, DEFAULT_UPDATES)))
            report = {"pid": os.getpid(), "openedBy": self.opened_by.get(session_id), "turn": turn}
            return stream + answer(request_id, {"stopReason": "end_turn", "_meta": {"bench": report}})
        return unknown_method(request_id, method)


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
        serve(Agent().handle)
    finally:
        record_lifetime("end")
    return 0


if __name__ == "__main__":
    run(main)
