"""The matrix: what one side of a matrix-* check saw, and what the proxy may change.

Compared: initialize (the allowed differences), authenticate, session/new and the mode setting
(answers and notifications), the prompt's outcome; the cancelled turn's outcome, answered
through the proxy within its cancel_timeout (30 s by default) however late the adapter answers;
a restore the adapter did straight must be done through the proxy, without starting afresh,
with the same result but for the mode the proxy re-applies, which modes and configOptions must
both show; a restore the adapter refused may start afresh (historyReset) on the errors the proxy
falls back on, and otherwise the proxy's error keeps the adapter's code, message and data,
adding its own data.reason; session/list lists the session with the title the adapter's own
list gives it (asked straight afterwards, on the proxied run's HOME).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tests.kit.gateway import SyncGateway

from .harness import call, transcript
from .report import CheckFailed
from .wire import PROXY_REASONS, checked_words, normalize_ids, short, strip_proxy_meta

THEN_LOAD = "session/resume, then session/load"
OWN_LIST = "the adapter's own session/list, straight, on the same HOME"
PLAN = "plan"
CANCELLED = "session/prompt, then session/cancel"
CANCEL_AFTER = 2.0
"""Seconds between a prompt and its session/cancel: the turn is under way (its model call retrying)."""
CANCEL_ANSWERED_WITHIN = 35.0
"""The proxy answers a cancelled turn itself after its cancel_timeout (30 s by default), if the adapter has not."""
TIMER_UPDATES = frozenset({"available_commands_update"})
"""session/update kinds some adapters send on a timer: where they land varies from run to run."""


@dataclass(frozen=True)
class RestorePlan:
    """The steps an adapter's initialize result calls for; the proxied run takes the straight run's."""

    restores: tuple[str, ...] = ()
    loads: bool = False
    closes: bool = False
    lists: bool = False


def restore_plan(init: dict[str, Any]) -> RestorePlan:
    caps = init.get("agentCapabilities") or {}
    sessions = caps.get("sessionCapabilities") or {}
    loads = caps.get("loadSession") is True
    resumes = isinstance(sessions.get("resume"), dict)
    restores = (*(("session/load",) if loads else ()), *(("session/resume",) if resumes else ()))
    closes, lists = (isinstance(sessions.get(key), dict) for key in ("close", "list"))
    return RestorePlan(restores, loads, closes, lists)


def mode_setting(new: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """How to put a new session in another mode: session/set_mode where it offers modes,
    session/set_config_option where it offers only a mode config option; None if neither.

    ``plan`` where offered: the read-only mode every adapter grants (gemini-cli refuses
    its auto-approving modes in a folder the user has not trusted).
    """
    modes = new.get("modes") or {}
    offered = [str(mode.get("id")) for mode in modes.get("availableModes") or [] if isinstance(mode, dict)]
    if offered:
        others = [mode for mode in offered if mode != modes.get("currentModeId")]
        return ("session/set_mode", {"modeId": PLAN if PLAN in others else others[0]}) if others else None
    for option in new.get("configOptions") or []:
        if isinstance(option, dict) and option.get("category") == "mode":
            values = [str(value.get("value")) for value in option.get("options") or [] if isinstance(value, dict)]
            others = [value for value in values if value != option.get("currentValue")]
            if others:
                value = PLAN if PLAN in others else others[0]
                return "session/set_config_option", {"configId": option.get("id"), "value": value}
    return None


def set_to(setting: tuple[str, dict[str, Any]]) -> str:
    """The mode a mode setting puts the session in."""
    params = setting[1]
    return str(params.get("modeId", params.get("value")))


class Scenario:
    """What one side of a matrix-* check saw: each step's answer (without its id), in order."""

    def __init__(self, proxied: bool, env: dict[str, str]) -> None:
        self.proxied = proxied
        self.env = env
        self.answers: dict[str, dict[str, Any]] = {}
        self.notifications: dict[str, list[str]] = {}
        """Each step's notifications, by method (and session/update kind), those sent on a timer left out."""
        self.plan = RestorePlan()
        self.session_id: str | None = None
        self.setting: tuple[str, dict[str, Any]] | None = None
        self.replays: dict[str, list[str]] = {}
        self.resets: set[str] = set()
        """The restores after which the proxy announced historyReset (it started the session afresh)."""
        self.problems: list[str] = []
        self.eof: list[float | None] = []
        """Straight, for each process ended: seconds until it exited after stdin EOF (None: it did not, in 3 s)."""
        self.cancel_seconds = 0.0
        """From session/cancel to the cancelled turn's answer."""
        self.received: list[Any] = []
        """Every message received, from each process in turn."""
        self._kept: list[SyncGateway] = []

    def keep(self, peer: SyncGateway) -> None:
        """Add what ``peer`` received to ``received``, once."""
        if not any(kept is peer for kept in self._kept):
            self._kept.append(peer)
            self.received += transcript(peer)

    def step(
        self,
        peer: SyncGateway,
        method: str,
        params: dict[str, Any],
        timeout: float = 60.0,
        name: str | None = None,
        settle: bool = False,
    ) -> dict[str, Any]:
        """A request whose answer is kept under ``name`` (its method by default); the result, or {} on an error.

        ``settle``: the notifications that follow the answer within a second count as the
        step's (an adapter may announce a change just after answering, and through the proxy
        the same notification may come just before the answer).
        """
        since = len(peer.received)
        answer = {k: v for k, v in call(peer, method, params, timeout).items() if k not in ("id", "jsonrpc")}
        if settle:
            peer.drain(quiet=1.0, limit=5.0)
        self.answers[name or method] = answer
        self.notifications[name or method] = sorted(
            kind for kind in map(notification_kind, peer.received[since:]) if kind is not None
        )
        result = answer.get("result")
        return result if isinstance(result, dict) else {}

    def result(self, step: str) -> dict[str, Any]:
        result = self.answers.get(step, {}).get("result")
        return result if isinstance(result, dict) else {}

    def outline(self) -> str:
        """Each step and how it ended, for the report."""
        parts = []
        for step, answer in self.answers.items():
            result, error = answer.get("result"), answer.get("error")
            if isinstance(error, dict):
                reason = (error.get("data") or {}).get("reason") if isinstance(error.get("data"), dict) else None
                outcome = f"{error.get('code')} {str(error.get('message'))[:80]!r}" + (f" ({reason})" if reason else "")
            elif step in ("session/list", OWN_LIST) and isinstance(result, dict):
                rows = result.get("sessions") or []
                titled = sum(1 for row in rows if isinstance(row, dict) and row.get("title"))
                outcome = f"{len(rows)} listed" + (f", {titled} titled" if titled else "")
            elif isinstance(result, dict) and "stopReason" in result:
                outcome = f"stopReason {result['stopReason']}"
            elif step in self.resets:
                outcome = "started afresh (historyReset)"
            else:
                outcome = "ok"
            if step == CANCELLED:
                outcome += f" {self.cancel_seconds:.0f}s after the cancel"
            if self.replays.get(step):
                outcome += f", replayed {checked_words(self.replays[step]) or len(self.replays[step])}"
            if step in ("session/set_mode", "session/set_config_option") and self.setting is not None:
                step = f"{step} {set_to(self.setting)}"
            parts.append(f"{step}: {outcome}")
        return "; ".join(parts)


def eof_outline(eof: list[float | None]) -> str:
    if not eof:
        return "no process was ended by the scenario"
    if all(seconds is None for seconds in eof):
        return "ignores stdin EOF (still running 3s after it, killed)"
    if all(seconds is not None for seconds in eof):
        return f"exits on stdin EOF (within {max(s for s in eof if s is not None):.1f}s)"
    return f"exited on stdin EOF {sum(1 for s in eof if s is not None)} of {len(eof)} times (else killed after 3s)"


def notification_kind(message: Any) -> str | None:
    if not isinstance(message, dict) or "id" in message or "method" not in message:
        return None
    kind = ((message.get("params") or {}).get("update") or {}).get("sessionUpdate")
    if kind in TIMER_UPDATES:
        return None
    return f"{message['method']}:{kind}" if kind else str(message["method"])


def matrix_problems(direct: Scenario, proxied: Scenario) -> list[str]:
    """How the proxied run differs from the straight one beyond what the proxy documents.

    Allowed: ``_meta["acp-proxy"]`` and the session capabilities the proxy serves in
    the initialize result; session/close and session/list answered by the proxy; a
    restore the proxy re-applies the session's mode to; a restore that starts afresh
    (historyReset) where, straight, every restore the adapter offers failed with an
    error the proxy falls back on.
    """
    problems: list[str] = []
    sid = {"direct": direct.session_id, "proxy": proxied.session_id}
    same = {
        "initialize": "the initialize result",
        "authenticate": "authenticate",
        "session/new": "session/new",
        "session/set_mode": "session/set_mode",
        "session/set_config_option": "session/set_config_option",
    }
    for step, what in same.items():
        if step not in direct.answers and step not in proxied.answers:
            continue
        sides = []
        for side, seen in (("direct", direct), ("proxy", proxied)):
            answer = json.loads(json.dumps(seen.answers.get(step)))
            if step == "initialize" and isinstance(answer, dict):
                try:
                    strip_proxy_meta([answer], side == "proxy", f"{side} initialize")
                except CheckFailed as exc:
                    problems.append(str(exc))
            sides.append(normalize_ids(replace_id(answer, sid[side])))
        if step in SETTINGS and restored_after_cancel(direct, proxied, proxied.answers.get(step)):
            continue
        if sides[0] != sides[1]:
            problems.append(f"{what} answered {short(sides[0])} straight, {short(sides[1])} through the proxy")
        if step != "initialize" and direct.notifications.get(step) != proxied.notifications.get(step):
            problems.append(
                f"{what} came with {direct.notifications.get(step)} straight, "
                f"{proxied.notifications.get(step)} through the proxy"
            )
    if "session/prompt" in direct.answers:
        outcomes = [turn_outcome(seen.answers.get("session/prompt")) for seen in (direct, proxied)]
        if outcomes[0] != outcomes[1]:
            problems.append(f"session/prompt ended {outcomes[0]} straight, {outcomes[1]} through the proxy")
    if CANCELLED in direct.answers:
        outcomes = [turn_outcome(seen.answers.get(CANCELLED)) for seen in (direct, proxied)]
        if outcomes[0] != outcomes[1]:
            problems.append(f"the cancelled turn ended {outcomes[0]} straight, {outcomes[1]} through the proxy")
        if proxied.cancel_seconds > CANCEL_ANSWERED_WITHIN:
            problems.append(
                f"the cancelled turn was answered {proxied.cancel_seconds:.0f}s after session/cancel through the "
                f"proxy (straight {direct.cancel_seconds:.0f}s), over its cancel_timeout"
            )
    for method in direct.plan.restores:
        if method in proxied.answers:
            problems += restore_problems(method, direct, proxied)
    problems += list_problems(proxied)
    return problems


SETTINGS = ("session/set_mode", "session/set_config_option")


def restored_after_cancel(direct: Scenario, proxied: Scenario, answer: Any) -> bool:
    """Whether ``answer`` (through the proxy) is the adapter's own refusal to restore its session after the proxy
    answered a cancel the adapter had not (cancel_timeout): the proxy then retires the process, and the next
    request restores the session on a new one, which an adapter that never recorded it (gemini-cli offline)
    refuses, as it refuses the same restore straight."""
    if CANCELLED not in direct.answers or direct.cancel_seconds <= CANCEL_ANSWERED_WITHIN:
        return False  # the adapter answered the cancel in time: the proxy kept its process
    error = answer.get("error") if isinstance(answer, dict) else None
    if not isinstance(error, dict) or (error.get("data") or {}).get("reason") != "restore_failed":
        return False
    refused = [direct.answers[m]["error"] for m in direct.plan.restores if "error" in (direct.answers.get(m) or {})]
    return any(kept_error(straight, error) is None for straight in refused)


def replace_id(value: Any, session_id: str | None) -> Any:
    """``value`` with the run's session id replaced by a placeholder (each run gets its own)."""
    if not session_id:
        return value
    return json.loads(json.dumps(value).replace(json.dumps(session_id)[1:-1], "SESSION-ID"))


def turn_outcome(answer: Any) -> str:
    answer = answer if isinstance(answer, dict) else {}
    if isinstance(answer.get("error"), dict):
        return f"error {answer['error'].get('code')}"
    return f"stopReason {(answer.get('result') or {}).get('stopReason')}"


def restore_problems(method: str, direct: Scenario, proxied: Scenario) -> list[str]:
    """A restore through the proxy against the same restore straight (on a new process there too)."""
    problems = []
    straight, answer = direct.answers[method], proxied.answers[method]
    fallback = direct.answers.get(THEN_LOAD) if method == "session/resume" else None
    restored = "result" in straight or (fallback is not None and "result" in fallback)
    if "result" in answer:
        if method in proxied.resets and restored:
            problems.append(
                f"{method} through the proxy started afresh (historyReset), though straight the adapter restored "
                f"the session ({method if 'result' in straight else THEN_LOAD})"
            )
        if "result" in straight and method not in proxied.resets:
            mine, theirs = (without_mode(seen.result(method), seen.session_id) for seen in (direct, proxied))
            if mine != theirs:
                problems.append(f"{method} answered {short(mine)} straight, {short(theirs)} through the proxy")
            if method == "session/load" and checked_words(direct.replays[method]) != checked_words(
                proxied.replays[method]
            ):
                problems.append(
                    f"{method} replayed {direct.replays[method]} straight, {proxied.replays[method]} through the proxy"
                )
        problems += mode_problems(method, proxied)
    elif restored:
        problems.append(
            f"{method} through the proxy answered {short(answer)}, though straight the adapter restored the session "
            f"({method if 'result' in straight else THEN_LOAD})"
        )
    elif "error" in straight:
        kept = kept_error(straight["error"], answer.get("error"))
        if kept is not None:
            problems.append(f"{method}: straight {short(straight['error'])}, through the proxy {kept}")
    return problems


def kept_error(adapter: dict[str, Any], proxy: Any) -> str | None:
    """Whether the proxy's error keeps the adapter's code, message and data (adding its own ``reason``)."""
    if not isinstance(proxy, dict):
        return f"no error but {short(proxy)}"
    found = proxy.get("data")
    data: dict[str, Any] = found if isinstance(found, dict) else {}
    theirs = adapter.get("data")
    missing = []
    if proxy.get("code") != adapter.get("code"):
        missing.append("code")
    if proxy.get("message") != adapter.get("message"):
        missing.append("message")
    if isinstance(theirs, dict):
        if any(data.get(key) != value for key, value in theirs.items()):
            missing.append("data")
    elif theirs is not None and theirs not in data.values():
        missing.append("data")
    if data.get("reason") not in PROXY_REASONS:
        missing.append("its own data.reason")
    return f"{short(proxy)}, which lacks the adapter's {', '.join(missing)}" if missing else None


def without_mode(result: dict[str, Any], session_id: str | None) -> Any:
    """A restore's result without the current mode (the proxy re-applies the mode it was set to)."""
    result = replace_id(result, session_id)
    modes = result.get("modes")
    if isinstance(modes, dict):
        modes.pop("currentModeId", None)
    for option in result.get("configOptions") or []:
        if isinstance(option, dict) and option.get("category") == "mode":
            option.pop("currentValue", None)
    return normalize_ids(result)


def mode_problems(method: str, proxied: Scenario) -> list[str]:
    """A restored session is in the mode it was set to, and its answer says so the same way everywhere."""
    result = proxied.result(method)
    shown = {}
    modes = result.get("modes")
    if isinstance(modes, dict) and "currentModeId" in modes:
        shown["modes.currentModeId"] = modes["currentModeId"]
    for option in result.get("configOptions") or []:
        if isinstance(option, dict) and option.get("category") == "mode":
            shown[f"configOptions[{option.get('id')}].currentValue"] = option.get("currentValue")
    setting = proxied.setting
    step = setting[0] if setting else None
    wanted = set_to(setting) if setting and "result" in proxied.answers.get(str(step), {}) else None
    if wanted is None and len(set(map(str, shown.values()))) <= 1:
        return []
    if wanted is not None and all(value == wanted for value in shown.values()):
        return []
    return [
        f"{method} through the proxy answered {shown}"
        + (f", the session having been set to {wanted!r}" if wanted else "")
    ]


def list_problems(proxied: Scenario) -> list[str]:
    """The proxy lists the session (and none where none opened), with the title the adapter's own list gives it."""
    listed = proxied.result("session/list").get("sessions")
    if not isinstance(listed, list):
        return [f"session/list through the proxy answered {short(proxied.answers.get('session/list'))}"]
    rows = {row.get("sessionId"): row for row in listed if isinstance(row, dict)}
    if proxied.session_id is None:
        return [f"session/list through the proxy gave {short(listed)}, though no session opened"] if rows else []
    if proxied.session_id not in rows:
        return [f"session/list through the proxy gave {short(listed)}, without the session"]
    own = {row.get("sessionId"): row for row in proxied.result(OWN_LIST).get("sessions") or [] if isinstance(row, dict)}
    title = own.get(proxied.session_id, {}).get("title")
    shown = rows[proxied.session_id].get("title")
    if title is not None and shown != title:
        return [f"session/list: the adapter's own list titles the session {title!r}, the proxy's {shown!r}"]
    return []
