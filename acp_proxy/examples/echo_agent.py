"""A small ACP agent that needs no API key: it streams your prompt back, word by word.

Run it behind the proxy with ``acp-proxy -- python -m acp_proxy.examples.echo_agent``.
It supports ``initialize``, ``session/new``, ``session/load`` (replaying the
session's history), ``session/resume``, ``session/prompt`` (streaming, and saying
how many earlier prompts of the session it remembers), ``session/cancel``, and
asks the client for permission when a prompt contains the word "permission".

``--store DIR`` keeps each session's history in ``DIR/<sessionId>.json``, as real
adapters keep theirs on disk, so another process of the agent can load or resume
it (without it, history lives in memory). Nothing beyond the standard library and the
proxy's method table; one thread per turn, so a cancel can interrupt a turn.

``--memory MB`` makes it hold MB of resident memory, as a real adapter's heap would be;
``--child-memory MB`` forks a child that holds MB more for as long as the agent lives, so its
tree has two processes. Both are in place before it reads its first request (to measure
memory budgets against).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import threading
import time
import uuid
from typing import Any

from acp_proxy.protocol.methods import Method

WORD_DELAY = float(os.environ.get("ECHO_AGENT_WORD_DELAY", "0.03"))
MB = 1024 * 1024
BALLAST: list[bytearray] = []
"""Memory held for the process's whole life (``--memory``)."""


class EchoAgent:
    def __init__(self, store: str | None = None) -> None:
        self._store = store
        self._out = threading.Lock()
        self._ids = itertools.count()
        self._waiting: dict[int, tuple[threading.Event, list[Any]]] = {}
        self._cancelled: set[str] = set()
        self._history: dict[str, list[dict[str, Any]]] = {}
        self._turns: list[threading.Thread] = []

    def send(self, message: dict[str, Any]) -> None:
        line = json.dumps({"jsonrpc": "2.0", **message}, separators=(",", ":"))
        with self._out:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    def update(self, session_id: str, update: dict[str, Any]) -> None:
        self.send({"method": Method.UPDATE, "params": {"sessionId": session_id, "update": update}})

    def _path(self, session_id: str) -> str | None:
        if self._store is None or not session_id.startswith("echo-") or "/" in session_id:
            return None
        return os.path.join(self._store, session_id + ".json")

    def _known(self, session_id: str) -> list[dict[str, Any]]:
        """The session's history, from memory or the store; -32002 if there is none."""
        if session_id not in self._history:
            path = self._path(session_id)
            if path is None or not os.path.exists(path):
                raise LookupError(-32002, f"unknown session {session_id}")
            with open(path) as fh:
                self._history[session_id] = json.load(fh)
        return self._history[session_id]

    def _save(self, session_id: str) -> None:
        path = self._path(session_id)
        if path is not None:
            os.makedirs(self._store or ".", exist_ok=True)
            with open(path + ".tmp", "w") as fh:
                json.dump(self._history.get(session_id, []), fh)
            os.replace(path + ".tmp", path)

    def ask(self, method: str, params: dict[str, Any]) -> Any:
        request_id = next(self._ids)
        done, box = threading.Event(), list[Any]()
        self._waiting[request_id] = (done, box)
        self.send({"id": request_id, "method": method, "params": params})
        done.wait()
        return box[0]

    def handle(self, msg: dict[str, Any]) -> None:
        method, params, request_id = msg.get("method"), msg.get("params") or {}, msg.get("id")
        if method is None:
            waiter = self._waiting.pop(request_id, None) if isinstance(request_id, int) else None
            if waiter is not None:
                waiter[1].append(msg.get("result", msg.get("error")))
                waiter[0].set()
            return
        if method == Method.CANCEL:
            self._cancelled.add(params.get("sessionId", ""))
            return
        if request_id is None:
            return
        if method == Method.PROMPT:
            turn = threading.Thread(target=self.prompt, args=(request_id, params), daemon=True)
            self._turns.append(turn)
            turn.start()
            return
        try:
            result = self.answer(method, params)
        except LookupError as exc:
            self.send({"id": request_id, "error": {"code": exc.args[0], "message": exc.args[1]}})
            return
        self.send({"id": request_id, "result": result})

    def answer(self, method: str, params: dict[str, Any]) -> Any:
        if method == Method.INITIALIZE:
            return {
                "protocolVersion": 1,
                "agentCapabilities": {"loadSession": True, "sessionCapabilities": {"resume": {}}},
                "agentInfo": {"name": "echo-agent", "version": "1.0.0"},
                "authMethods": [],
            }
        if method == Method.NEW:
            session_id = f"echo-{uuid.uuid4().hex[:8]}"
            self._history[session_id] = []
            self._save(session_id)
            return {"sessionId": session_id}
        if method == Method.LOAD:
            session_id = str(params.get("sessionId", ""))
            for update in self._known(session_id):
                self.update(session_id, update)
            return {}
        if method == Method.RESUME:
            self._known(str(params.get("sessionId", "")))
            return {}
        raise LookupError(-32601, f"method not found: {method}")

    def prompt(self, request_id: int, params: dict[str, Any]) -> None:
        session_id = params.get("sessionId", "")
        text = " ".join(b.get("text", "") for b in params.get("prompt", []) if b.get("type") == "text")
        try:
            history = self._known(session_id)
        except LookupError as exc:
            self.send({"id": request_id, "error": {"code": exc.args[0], "message": exc.args[1]}})
            return
        earlier = sum(1 for update in history if update.get("sessionUpdate") == "user_message_chunk")
        user = {"sessionUpdate": "user_message_chunk", "content": {"type": "text", "text": text}}
        history.append(user)
        self._cancelled.discard(session_id)
        if "permission" in text.lower():
            outcome = self.ask(
                Method.REQUEST_PERMISSION,
                {
                    "sessionId": session_id,
                    "toolCall": {"toolCallId": f"call-{request_id}", "title": "Echo the prompt"},
                    "options": [
                        {"optionId": "allow", "name": "Allow", "kind": "allow_once"},
                        {"optionId": "reject", "name": "Reject", "kind": "reject_once"},
                    ],
                },
            )
            chosen = (outcome or {}).get("outcome", {}).get("optionId")
            if chosen != "allow":
                self._save(session_id)
                self.send({"id": request_id, "result": {"stopReason": "refusal"}})
                return
        words = text.split()
        if earlier:
            words.append(f"(I remember {earlier} earlier prompt{'s' if earlier > 1 else ''})")
        for word in words:
            if session_id in self._cancelled:
                self._save(session_id)
                self.send({"id": request_id, "result": {"stopReason": "cancelled"}})
                return
            chunk = {
                "sessionUpdate": "agent_message_chunk",
                "content": {"type": "text", "text": word + " "},
            }
            history.append(chunk)
            self.update(session_id, chunk)
            time.sleep(WORD_DELAY)
        self._save(session_id)
        self.send({"id": request_id, "result": {"stopReason": "end_turn"}})

    def run(self) -> None:
        for line in sys.stdin:
            if line.strip():
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if isinstance(msg, dict):
                    self.handle(msg)
        for turn in self._turns:  # stdin closed: finish the turns already started
            turn.join(timeout=5)


def resident(megabytes: int) -> bytearray:
    """``megabytes`` of memory, every page written so that the kernel really backs it (an untouched
    allocation costs only address space)."""
    held = bytearray(megabytes * MB)
    page = os.sysconf("SC_PAGE_SIZE")
    held[::page] = b"\x01" * len(range(0, len(held), page))
    return held


def fork_holder(megabytes: int) -> None:
    """Fork a child holding ``megabytes`` until this process exits; return once the memory is resident.

    The child waits for EOF on a pipe whose write end only this process holds, so it ends with the
    agent, however the agent ends. It forks before the agent allocates its own memory, so that
    no page is shared between the two.
    """
    ready_read, ready_write = os.pipe()
    life_read, life_write = os.pipe()
    if os.fork() == 0:
        status = 1
        try:
            os.close(life_write)
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1):  # not the agent's stdio: the proxy must see EOF when the agent ends
                os.dup2(devnull, fd)
            held = resident(megabytes)
            os.write(ready_write, b".")
            os.read(life_read, 1)
            del held
            status = 0
        finally:
            os._exit(status)
    os.close(life_read)
    os.close(ready_write)
    os.read(ready_read, 1)
    os.close(ready_read)


def main() -> None:
    parser = argparse.ArgumentParser(description="A small ACP agent that echoes prompts back, word by word.")
    parser.add_argument("--store", help="directory to keep session histories in (default: memory only)")
    parser.add_argument("--memory", type=int, default=0, metavar="MB", help="hold MB of resident memory")
    parser.add_argument(
        "--child-memory", type=int, default=0, metavar="MB", help="fork a child that holds MB while the agent runs"
    )
    args = parser.parse_args()
    if args.child_memory:
        fork_holder(args.child_memory)
    if args.memory:
        BALLAST.append(resident(args.memory))
    EchoAgent(args.store).run()


if __name__ == "__main__":
    main()
