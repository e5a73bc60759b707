"""attach-*: one session, two proxies of one install: ``session/attach`` (ACP's draft RFD
"Multi-Client Session Attach"), through the proxy only.

Proxy A is the session's holder: a raw JSON-RPC gateway initializes it (and authenticates where
the adapter has a key method), checks that the answer advertises
``sessionCapabilities.attach.roles``, and opens session S with ``session/new``. Proxy B, on the
same state dir, is another client's: it initializes, then

1. attaches to S as an ``observer`` with ``historyPolicy: "full"``: the answer names S and the
   role, the updates replayed before it are those A's gateway saw, an observer's prompt is
   refused ``-32002`` ``observer``, and ``session/detach`` answers ``{sessionId, status:
   "detached"}``;
2. attaches again as a ``controller`` with ``historyPolicy: "none"`` (no replay, no ``history``),
   prompts S, and A's gateway must see the same updates of that turn live; then A prompts S, and
   B must see that turn's updates live;
3. A's stdin is closed (the gateway leaves, so the holder exits): B must get an ``attach_ended``
   update; then B's stdin is closed; both proxies exit 0, and nothing the check started may be
   left running.

attach-echo runs the proxy's echo agent, which answers prompts offline: A prompts S before B
attaches (the ``full`` replay then has a turn in it, and ``history`` its prompt), B's prompt asks
for permission (B, a controller, answers it; A's copy must be withdrawn, and B told who answered
with ``permission_resolved``), and every turn must end ``end_turn``. attach-ADAPTER runs a real
adapter with the placeholder credentials of the other checks, so its turns fail or end as it
answers them offline: each prompt is compared with the same prompt from A's gateway to a session
of its own, R, opened at the same time as S (both the first, then both the second turn of their
session, each session on a process of its own): the answers must be of the same kind (both
errors with the same code, or both results with the same ``stopReason``). The adapter then
behaves through the attachment as through its own gateway.

Transcripts are kept in WORKDIR/logs/<check>-a.stdout and -b.stdout, the proxies' logs in
<check>-a.stderr and -b.stderr.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from tests.kit.gateway import Closed, Message, SyncGateway

from .harness import PROMPT_TIMEOUT, Peers, end_keeping
from .report import CheckFailed
from .wire import CLIENT_INITIALIZE, FIRST_WORDS, SECOND_WORDS, prompt_params, proxy_error, short

ROLES = ("controller", "observer")
DRAFT_UPDATES = frozenset({"permission_resolved", "client_disconnected", "attach_ended"})
"""The updates only attached clients get (the draft's ``type``); left out when two sides are compared."""
CLIENT_B = {"name": "check-peers-b", "version": "1"}
ECHO_FIRST = "echo this first"
ECHO_PERMISSION = "echo this, with permission"
ECHO_LAST = "echo this last"
ATTACH_TIMEOUT = 30.0
ENDED_TIMEOUT = 60.0
"""How long B may wait for ``attach_ended`` after A's stdin closed (the holder's stdin grace, then its exit)."""


def attach_echo(peers: Peers, name: str) -> str:
    """The echo agent behind A and B (``acp-proxy -- CMD``): every turn answered offline."""
    base = fresh_base(peers, name)
    return AttachRun(peers, name, base, [*peers.proxy, "--", *peers.echo_agent()], {}, offline_turns=True).run()


def attach_adapter(peers: Peers, name: str, adapter: str) -> str:
    """A real adapter as the config's only backend, placeholder credentials; turns compared with A's own."""
    base = fresh_base(peers, name)
    config = base / "proxy.toml"
    config.write_text(f"[backends.{adapter}]\ncommand = {json.dumps(peers.command(adapter))}\n")
    command = [*peers.proxy, "--config", str(config)]
    return AttachRun(peers, name, base, command, peers.adapter_env(adapter), offline_turns=False).run()


def fresh_base(peers: Peers, name: str) -> Path:
    """The check's own directory: a HOME (with ``~/.claude``, as the other checks'), a cwd, a state dir."""
    base = peers.work / "attach" / name
    shutil.rmtree(base, ignore_errors=True)
    (base / "home" / ".claude").mkdir(parents=True)
    (base / "cwd").mkdir()
    return base


class AttachRun:
    """Proxies A (the holder) and B (the attaching client's) on one state dir, and what each saw."""

    def __init__(
        self, peers: Peers, name: str, base: Path, command: list[str], extra: dict[str, str], offline_turns: bool
    ) -> None:
        self.peers = peers
        self.name = name
        self.command = command
        self.offline_turns = offline_turns
        self.cwd = str(base / "cwd")
        self.env, self.marker = peers.runs.env(
            name, HOME=str(base / "home"), ACP_PROXY_STATE_DIR=str(base / "state"), **extra
        )
        self.logs = peers.fresh_logs(name, "a.stderr", "b.stderr")
        self.problems: list[str] = []
        self.found: list[str] = []
        """What was seen, for the PASS line."""
        self.a: SyncGateway | None = None
        self.b: SyncGateway | None = None
        self.session = ""
        self.reference = ""
        """R: A's own session, the reference for an adapter's turns (none for the echo agent)."""

    def run(self) -> str:
        try:
            self.a = self.gateway(self.logs[0], "A")
            self.open_session(self.a)
            self.b = self.gateway(self.logs[1], "B")
            self.observer(self.a, self.b)
            self.controller(self.a, self.b)
            self.holder_leaves(self.a, self.b)
        finally:
            for gateway, side in ((self.a, "a"), (self.b, "b")):
                if gateway is not None:
                    end_keeping(gateway, self.peers.logs / f"{self.name}-{side}.stdout")
            left = self.peers.runs.leftovers(self.marker, 5.0)  # also after a failure: nothing stays
        if left:
            listing = "; ".join(f"pid {pid} {cmd}" for pid, cmd in left)
            self.problems.append(f"processes left running after both proxies exited (killed now): {listing}")
        if self.problems:
            raise CheckFailed("; ".join(self.problems))
        return "; ".join([*self.found, "nothing left running"])

    # --- the gateways --------------------------------------------------------------------------

    def gateway(self, log: Path, side: str) -> SyncGateway:
        """A proxy with a reader thread of its own (two proxies are read at once), initialized, and
        authenticated if a method's variables are set; its ``initialize`` must advertise attach."""
        with open(log, "ab") as err:
            gateway = SyncGateway.launch(
                self.command, env=self.env, cwd=self.peers.ws, stderr=err, start_new_session=True,
                name=f"acp-proxy {side}", first_id=1, reader_thread=True,
                handler=self.answer_permission if side == "B" else None,
            )  # fmt: skip
        if side == "A":
            self.a = gateway  # ended by run() whatever happens next
        else:
            self.b = gateway
        init = result_of(gateway, "initialize", CLIENT_INITIALIZE, 60.0, f"{side}'s initialize")
        for method in init.get("authMethods") or []:
            variables = [v.get("name") for v in method.get("vars") or [] if isinstance(v, dict)]
            if method.get("type") == "env_var" and variables and all(v in self.env for v in variables):
                result_of(gateway, "authenticate", {"methodId": method["id"]}, 60.0, f"{side}'s authenticate")
                break
        caps = (init.get("agentCapabilities") or {}).get("sessionCapabilities") or {}
        roles = (caps.get("attach") or {}).get("roles") if isinstance(caps.get("attach"), dict) else None
        if not isinstance(roles, list) or sorted(roles) != sorted(ROLES):
            raise CheckFailed(f"{side}'s initialize advertises sessionCapabilities.attach {short(caps.get('attach'))}")
        return gateway

    def answer_permission(self, request: Message) -> Message | None:
        """B's handler: a permission request is allowed at once (A's gateway never answers one)."""
        if request.get("method") != "session/request_permission":
            return None
        options = (request.get("params") or {}).get("options") or []
        allow = next((o for o in options if isinstance(o, dict) and o.get("kind") == "allow_once"), None)
        if allow is None:
            return {"result": {"outcome": {"outcome": "cancelled"}}}
        return {"result": {"outcome": {"outcome": "selected", "optionId": allow["optionId"]}}}

    def open_session(self, a: SyncGateway) -> None:
        """S (and, for an adapter, R), opened by A; the echo agent's S gets a first turn from A."""
        params = {"cwd": self.cwd, "mcpServers": []}
        self.session = str(result_of(a, "session/new", params, 120.0, "A's session/new")["sessionId"])
        if self.offline_turns:
            answer = request(a, "session/prompt", prompt_params(self.session, ECHO_FIRST), PROMPT_TIMEOUT)
            if (answer.get("result") or {}).get("stopReason") != "end_turn":
                raise CheckFailed(f"A's first prompt to S answered {short(answer)}")
        else:
            self.reference = str(result_of(a, "session/new", params, 120.0, "A's session/new of R")["sessionId"])
        settle(a)

    # --- 1. an observer, the full history ------------------------------------------------------

    def observer(self, a: SyncGateway, b: SyncGateway) -> None:
        s = self.session
        since = len(b.received)
        answer, replay = self.attach(b, "observer", "full")
        result = answer.get("result") or {}
        if self.offline_turns:
            prompts = [entry for entry in result.get("history") or [] if entry.get("type") == "prompt"]
            texts = [text_of(entry.get("content")) for entry in prompts]
            if texts != [ECHO_FIRST]:
                self.problems.append(f"the observer's history has the prompts {texts}, expected [{ECHO_FIRST!r}]")
        elif not isinstance(result.get("history"), list):
            self.problems.append(f"the observer's answer (historyPolicy full) has no history list: {short(result)}")
        refused = request(b, "session/prompt", prompt_params(s, FIRST_WORDS), 30.0)
        error = refused.get("error") or {}
        if error.get("code") != -32002 or (error.get("data") or {}).get("reason") != "observer":
            self.problems.append(f"the observer's session/prompt answered {short(refused)}, expected -32002 observer")
        self.detach(b)
        settle(a)
        live = session_updates(b.received[since:], s, skip_draft=True)[len(replay) :]
        seen = session_updates(a.received, s)
        if replay + live != seen:
            self.problems.append(
                f"the observer got {len(replay)} replayed and {len(live)} live updates of S, A's gateway "
                f"{len(seen)}: {first_difference(seen, replay + live)}"
            )
        self.found.append(
            f"observer (full): {len(replay)} updates replayed, as A's gateway saw them, "
            f"{len(result.get('history') or [])} history entries, connectedClients "
            f"{short(result.get('connectedClients'), 120)}; its prompt -32002 observer; detached"
        )

    def attach(self, b: SyncGateway, role: str, policy: str) -> tuple[Message, list[dict[str, Any]]]:
        """``session/attach`` from B; the answer (which must be a result naming S and the role) and
        the updates replayed before it."""
        since = len(b.received)
        params = {"sessionId": self.session, "role": role, "historyPolicy": policy, "clientInfo": CLIENT_B}
        answer = request(b, "session/attach", params, ATTACH_TIMEOUT)
        result = answer.get("result")
        if not isinstance(result, dict):
            raise CheckFailed(f"session/attach as {role} ({policy}) answered {short(answer)}")
        if result.get("sessionId") != self.session or result.get("role") != role:
            raise CheckFailed(f"session/attach as {role} ({policy}) answered {short(result)}")
        position = next(i for i, m in enumerate(b.received) if m is answer)
        return answer, session_updates(b.received[since:position], self.session)

    def detach(self, b: SyncGateway) -> None:
        answer = request(b, "session/detach", {"sessionId": self.session}, ATTACH_TIMEOUT)
        if answer.get("result") != {"sessionId": self.session, "status": "detached"}:
            self.problems.append(f"session/detach answered {short(answer)}")

    # --- 2. a controller, no history; a turn from each side -----------------------------------

    def controller(self, a: SyncGateway, b: SyncGateway) -> None:
        answer, replay = self.attach(b, "controller", "none")
        result = answer.get("result") or {}
        if replay or "history" in result:
            self.problems.append(
                f"the controller's attach (historyPolicy none) replayed {len(replay)} updates, history "
                f"{short(result.get('history'), 200)}"
            )
        first = ECHO_PERMISSION if self.offline_turns else FIRST_WORDS
        last = ECHO_LAST if self.offline_turns else SECOND_WORDS
        ours = self.turn(a, b, b, first, "B's prompt")
        theirs = self.turn(a, b, a, last, "A's prompt")
        self.found.append(f"controller (none): B's prompt {ours}; A's prompt {theirs}")

    def turn(self, a: SyncGateway, b: SyncGateway, sender: SyncGateway, words: str, what: str) -> str:
        """One prompt to S from ``sender`` (and, for an adapter, the same from A to R at once): both
        gateways must see the turn's updates alike; what it answered."""
        s, r = self.session, self.reference
        marks = len(a.received), len(b.received)
        sent = sender.send_request("session/prompt", prompt_params(s, words))
        reference = a.send_request("session/prompt", prompt_params(r, words)) if r else None
        answer = answer_of(sender, sent, PROMPT_TIMEOUT, what)
        expected = answer_of(a, reference, PROMPT_TIMEOUT, f"{what}'s reference (A to R)") if reference else None
        settle(a)
        settle(b)
        if proxy_error(answer):
            raise CheckFailed(f"{what} got the proxy's error {short(answer)}")
        seen_a = session_updates(a.received[marks[0] :], s)
        seen_b = session_updates(b.received[marks[1] :], s, skip_draft=True)
        if seen_a != seen_b:
            self.problems.append(
                f"{what}: A's gateway saw {len(seen_a)} updates of S, B {len(seen_b)}: "
                f"{first_difference(seen_a, seen_b)}"
            )
        got = shape(answer)
        if self.offline_turns:
            self.echo_turn(a, b, marks, sender, answer, words, what)
            detail = f"{got}, {len(seen_a)} updates alike on both sides"
        else:
            assert expected is not None
            want = shape(expected)
            if got != want:
                self.problems.append(
                    f"{what} to S answered {short(answer)}, the same prompt from A to R {short(expected)}"
                )
            detail = f"{got} as A's to R ({want}), {len(seen_a)} updates alike on both sides"
        return detail

    def echo_turn(
        self,
        a: SyncGateway,
        b: SyncGateway,
        marks: tuple[int, int],
        sender: SyncGateway,
        answer: Message,
        words: str,
        what: str,
    ) -> None:
        """The echo agent's turn: ``end_turn``, it remembers the earlier prompts, and a permission
        request went to both sides, answered by B, A's copy withdrawn, B told who answered."""
        if (answer.get("result") or {}).get("stopReason") != "end_turn":
            self.problems.append(f"{what} answered {short(answer)}, expected end_turn")
        said = "".join(
            text_of(u.get("update", {}).get("content")) for u in session_updates(b.received[marks[1] :], self.session)
        )
        earlier = 1 if sender is b else 2
        remembers = f"(I remember {earlier} earlier prompt{'s' if earlier > 1 else ''})"
        if remembers not in said:
            self.problems.append(f"{what}: the echo agent said {said!r}, without {remembers!r}")
        if "permission" not in words:
            return
        asked = [m for m in a.received[marks[0] :] if m.get("method") == "session/request_permission"]
        asked_b = [m for m in b.received[marks[1] :] if m.get("method") == "session/request_permission"]
        withdrawn = [
            m
            for m in a.received[marks[0] :]
            if m.get("method") == "$/cancel_request"
            and asked
            and (m.get("params") or {}).get("requestId") == asked[0]["id"]
        ]
        resolved = [
            u["update"]
            for u in session_updates(b.received[marks[1] :], self.session)
            if u.get("update", {}).get("type") == "permission_resolved"
        ]
        if len(asked) != 1 or len(asked_b) != 1:
            self.problems.append(f"{what}: the permission request reached A {len(asked)} times, B {len(asked_b)}")
        elif not withdrawn:
            self.problems.append(f"{what}: B answered the permission request, A's copy was not withdrawn")
        by = [str((u.get("resolvedBy") or {}).get("name")) for u in resolved]
        if len(by) != 1 or by[0].partition(" (")[0] != CLIENT_B["name"]:  # "NAME (uid N)": who it came as
            self.problems.append(f"{what}: B got permission_resolved {short(resolved)}, expected resolvedBy B")

    # --- 3. the holder leaves -----------------------------------------------------------------

    def holder_leaves(self, a: SyncGateway, b: SyncGateway) -> None:
        since = len(b.received)
        begun = time.monotonic()
        a.close_input()
        try:
            ended = b.expect(
                lambda m: (
                    m.get("method") == "session/update"
                    and (m.get("params") or {}).get("update", {}).get("type") == "attach_ended"
                ),
                ENDED_TIMEOUT,
            )
        except (TimeoutError, Closed):
            raise CheckFailed(
                f"B got no attach_ended within {ENDED_TIMEOUT:.0f}s of A's stdin EOF; it got "
                f"{short(b.received[since:], 600)}"
            ) from None
        after = time.monotonic() - begun
        update = ended["params"]["update"]
        if ended["params"].get("sessionId") != self.session or update.get("reason") != "holder_gone":
            self.problems.append(f"attach_ended was {short(ended['params'])}, expected S and holder_gone")
        if not a.wait(30.0):
            raise CheckFailed("A was still running 30s after its stdin closed")
        if a.process.returncode != 0:
            self.problems.append(f"A exited {a.process.returncode} after stdin EOF (see {self.logs[0]})")
        b.close_input()
        if not b.wait(30.0):
            raise CheckFailed("B was still running 30s after its stdin closed")
        if b.process.returncode != 0:
            self.problems.append(f"B exited {b.process.returncode} after stdin EOF (see {self.logs[1]})")
        self.found.append(
            f"A's stdin closed: B got attach_ended ({update.get('reason')}) after {after:.1f}s; both proxies exited"
        )


def request(gateway: SyncGateway, method: str, params: dict[str, Any], timeout: float) -> Message:
    return answer_of(gateway, gateway.send_request(method, params), timeout, method)


def answer_of(gateway: SyncGateway, request_id: Any, timeout: float, what: str) -> Message:
    try:
        return gateway.answer(request_id, timeout)
    except TimeoutError:
        raise CheckFailed(f"{gateway.name}: no answer to {what} within {timeout:.0f}s") from None
    except Closed:
        raise CheckFailed(f"{gateway.name}: stdout closed before the answer to {what}") from None


def result_of(gateway: SyncGateway, method: str, params: dict[str, Any], timeout: float, what: str) -> dict[str, Any]:
    answer = request(gateway, method, params, timeout)
    result = answer.get("result")
    if not isinstance(result, dict):
        raise CheckFailed(f"{what} answered {short(answer)}")
    return result


def settle(gateway: SyncGateway, quiet: float = 1.0, limit: float = 10.0) -> None:
    """Wait until nothing has been read for ``quiet`` seconds (the reader thread reads meanwhile)."""
    deadline = time.monotonic() + limit
    count, since = len(gateway.received), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < quiet:
        time.sleep(0.05)
        if len(gateway.received) != count:
            count, since = len(gateway.received), time.monotonic()


def session_updates(messages: list[Message], session_id: str, skip_draft: bool = False) -> list[dict[str, Any]]:
    """The ``session/update`` params of ``session_id`` (without the draft's own updates, if ``skip_draft``)."""
    found = []
    for message in messages:
        params = message.get("params")
        if message.get("method") != "session/update" or not isinstance(params, dict):
            continue
        if params.get("sessionId") != session_id:
            continue
        update = params.get("update")
        if skip_draft and isinstance(update, dict) and update.get("type") in DRAFT_UPDATES:
            continue
        found.append(params)
    return found


def text_of(content: Any) -> str:
    if isinstance(content, dict):
        return str(content.get("text") or "")
    if isinstance(content, list):
        return "".join(text_of(part) for part in content)
    return ""


def shape(answer: Message) -> str:
    """What kind of answer: ``error CODE`` or ``result STOPREASON``."""
    if "error" in answer:
        return f"error {(answer.get('error') or {}).get('code')}"
    return f"result {(answer.get('result') or {}).get('stopReason')}"


def first_difference(ours: list[Any], theirs: list[Any]) -> str:
    for index, (x, y) in enumerate(zip(ours, theirs, strict=False)):
        if x != y:
            return f"update {index}: {short(x, 200)} vs {short(y, 200)}"
    return f"{len(ours)} vs {len(theirs)} updates"
