"""Requests to one proxy whose wrong answers are collected, so that one check reports them all."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tests.kit import markers
from tests.kit.gateway import SyncGateway

from .harness import MARKER_VAR, PROMPT_TIMEOUT, call, call_result, updates
from .report import CheckFailed
from .wire import PROXY_META, prompt_params, proxy_error, short, user_texts


class SessionProbe:
    """Requests to one proxy whose wrong answers are collected in ``problems``, so one check reports them all.

    Only a missing answer (or a prompt the proxy itself refused) ends the check at once.
    """

    def __init__(self, gateway: SyncGateway, cwd: Path, problems: list[str]) -> None:
        self.gateway = gateway
        self.cwd = str(cwd)
        self.problems = problems
        self.known: set[str] = set()
        """The session ids the gateway was given (session/new, session/fork)."""

    def load_params(self, session_id: str) -> dict[str, Any]:
        return {"sessionId": session_id, "cwd": self.cwd, "mcpServers": []}

    def new(self) -> str:
        session_id = str(call_result(self.gateway, "session/new", {"cwd": self.cwd, "mcpServers": []})["sessionId"])
        self.known.add(session_id)
        return session_id

    def prompt(self, session_id: str, words: str, what: str) -> None:
        """A turn: the adapter fails it without credentials, once it has recorded it; the proxy must not."""
        answer = call(self.gateway, "session/prompt", prompt_params(session_id, words), timeout=PROMPT_TIMEOUT)
        if proxy_error(answer) or "id" not in answer:
            raise CheckFailed(f"the prompt to {what} got {short(answer)}")

    def empty(self, method: str, session_id: str, what: str) -> None:
        """``method`` for a session, which must answer ``{}``."""
        answer = call(self.gateway, method, {"sessionId": session_id}, timeout=PROMPT_TIMEOUT)
        if answer.get("result") != {}:
            self.problems.append(f"{method} of {what} answered {short(answer)}, expected {{}}")

    def refused(self, method: str, params: dict[str, Any], reason: str, what: str) -> None:
        """A request the proxy must refuse with ``-32002`` and ``data.reason``."""
        answer = call(self.gateway, method, params, timeout=PROMPT_TIMEOUT)
        error = answer.get("error") or {}
        if error.get("code") != -32002 or (error.get("data") or {}).get("reason") != reason:
            self.problems.append(f"{method} of {what} answered {short(answer)}, expected -32002 {reason}")

    def restore(self, method: str, session_id: str, what: str) -> list[str] | None:
        """session/load or session/resume: the user prompts replayed; None if it failed (a problem noted)."""
        since = len(self.gateway.received)
        answer = call(self.gateway, method, self.load_params(session_id), timeout=PROMPT_TIMEOUT)
        result = answer.get("result")
        if not isinstance(result, dict):
            self.problems.append(f"{method} of {what} answered {short(answer)}")
            return None
        if result.get("sessionId", session_id) != session_id:
            self.problems.append(f"{method} of {what} answered sessionId {result['sessionId']!r}, not {session_id!r}")
        return user_texts(updates(self.gateway, since), session_id)

    def listing(self) -> dict[str, dict[str, Any]]:
        """session/list: each session's ``_meta["acp-proxy"]`` by id."""
        rows = call_result(self.gateway, "session/list", {}).get("sessions") or []
        return {str(row.get("sessionId")): (row.get("_meta") or {}).get(PROXY_META) or {} for row in rows}

    def states(self) -> dict[str, Any]:
        return {session_id: meta.get("state") for session_id, meta in self.listing().items()}

    def processes_but_proxy(self, marker: str, wait: float = 5.0) -> list[str]:
        """The run's processes other than the proxy still there after ``wait`` s: with no session
        live there should be none (the pool keeps no spare process)."""
        deadline = time.monotonic() + wait
        while True:
            found = markers.find(MARKER_VAR, marker)
            found.pop(self.gateway.process.pid, None)
            if not found or time.monotonic() >= deadline:
                return [str(marked) for marked in found.values()]
            time.sleep(0.1)
