"""sessions-*: the session pool, through the proxy only, with ``max_live = 1`` (a config of its
own, a private HOME and state dir per check).

sessions-codex-acp / sessions-claude-agent-acp drive raw JSON-RPC: two sessions over one process
slot (the second suspends the first, a prompt to the first resumes it), then a second proxy on
the same state dir whose session/load must replay the first session's prompts. sessions-acpx-*
drive acpx named sessions (every acpx command a new proxy), then read both conversations back
with session/load through a fresh proxy. The adapters keep a session only once it had a turn,
and a turn fails without credentials only after the prompt is recorded, so the conversations
checked are the users' prompts. No session id the gateway never got from session/new may reach
it.

spec-*: session/close, session/delete and session/fork through the proxy (raw JSON-RPC,
``max_live = 1``, the sessions-* setup).

A closed session is listed as closed, its process tree is gone, a prompt to it is -32002
session_closed, and the gateway's session/load (or session/resume) brings it back, the load
replaying its prompt; session/delete of a live and of a closed session is ``{}``, unlists them,
and a later session/load is -32002 session_deleted, also for a second proxy on the same state
dir. Where the adapter forks (claude-agent-acp), session/fork after a prompt: the fork gets its
own id and row (``parentSessionId``) and the parent's process, and its prompt; the parent comes
back on a process of its own, its load replaying only its own prompt. NOTE lines say whether the
adapter itself advertises delete and still loads a session the proxy deleted, and what it
answered to session/fork; those are the adapter's business, not failures.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from .harness import PROMPT_TIMEOUT, Peers, call, call_result, end, end_keeping, log_match, updates, wait_for_log
from .probe import SessionProbe
from .report import CheckFailed
from .wire import (
    FIRST_WORDS,
    OTHER_WORDS,
    PROXY_META,
    SECOND_WORDS,
    announced_modes,
    checked_words,
    foreign_session_ids,
    history_reset,
    in_order,
    json_lines,
    other_mode,
    prompt_params,
    proxy_error,
    short,
    user_texts,
)


def sessions_raw(peers: Peers, name: str, adapter: str) -> str:
    """Two sessions over one slot, a transparent resume, then a restart and session/load."""
    command, env, marker = peers.session_setup(name, adapter)
    logs = peers.fresh_logs(name, "run1.stderr", "run2.stderr")
    problems: list[str] = []
    cwd = {"cwd": str(peers.ws), "mcpServers": []}

    gateway, init = peers.session_gateway(command, env, logs[0])
    try:
        first = call_result(gateway, "session/new", cwd)
        s1 = first["sessionId"]
        answer = call(gateway, "session/prompt", prompt_params(s1, FIRST_WORDS), timeout=PROMPT_TIMEOUT)
        if proxy_error(answer):
            raise CheckFailed(f"the first prompt got the proxy's error {short(answer)}")
        mode = other_mode(first)
        if mode:  # a setting the proxy must re-apply whenever S1 comes back
            call_result(gateway, "session/set_mode", {"sessionId": s1, "modeId": mode})
        s2 = call_result(gateway, "session/new", cwd)["sessionId"]
        if not wait_for_log(logs[0], f"session {s1} suspended"):
            raise CheckFailed(f"session/new of S2 did not suspend S1 (max_live = 1; see {logs[0]})")
        answer = call(gateway, "session/prompt", prompt_params(s1, SECOND_WORDS), timeout=PROMPT_TIMEOUT)
        if proxy_error(answer) or "id" not in answer:
            raise CheckFailed(f"the prompt to suspended S1 got {short(answer)}")
        if not wait_for_log(logs[0], f"session {s1} resumed"):
            raise CheckFailed(f"no 'session {s1} resumed' in {logs[0]}")
        since = len(gateway.received)
        if mode:
            call_result(gateway, "session/set_mode", {"sessionId": s2, "modeId": mode}, timeout=PROMPT_TIMEOUT)
        else:
            call(gateway, "session/prompt", prompt_params(s2, OTHER_WORDS), timeout=PROMPT_TIMEOUT)
        s2_reset = history_reset(updates(gateway, since), s2)
        listed = call_result(gateway, "session/list", {}).get("sessions") or []
        if {s.get("sessionId") for s in listed} != {s1, s2}:
            raise CheckFailed(f"session/list gave {short(listed)}, expected S1 and S2")
        problems += peers.last_words(gateway, "run 1", {s1, s2})
    finally:
        end_keeping(gateway, peers.logs / f"{name}-run1.stdout")
    peers.check_leftovers(name, "proxy", marker, wait=3.0)

    gateway, _ = peers.session_gateway(command, env, logs[1])
    try:
        listed = call_result(gateway, "session/list", {}).get("sessions") or []
        states = {s.get("sessionId"): ((s.get("_meta") or {}).get(PROXY_META) or {}).get("state") for s in listed}
        if states != {s1: "suspended", s2: "suspended"}:
            raise CheckFailed(f"after a restart session/list gave {states}, expected S1 and S2 suspended")
        since = len(gateway.received)
        loaded = call_result(gateway, "session/load", {"sessionId": s1, **cwd}, timeout=PROMPT_TIMEOUT)
        replay = user_texts(updates(gateway, since), s1)
        if not in_order([FIRST_WORDS, SECOND_WORDS], replay):
            raise CheckFailed(f"session/load of S1 after a restart replayed {replay}, not both prompts")
        shown = (loaded.get("modes") or {}).get("currentModeId")
        if mode and shown is not None and shown != mode:
            announced = announced_modes(updates(gateway, since), s1)
            problems.append(
                f"run 2: session/load of S1 answered currentModeId {shown!r}, though the proxy had re-applied "
                f"{mode!r}" + (f" (and a session/update before the answer said {announced})" if announced else "")
            )
        since = len(gateway.received)
        call_result(gateway, "session/load", {"sessionId": s2, **cwd}, timeout=PROMPT_TIMEOUT)
        problems += peers.last_words(gateway, "run 2", {s1, s2})
    finally:
        end_keeping(gateway, peers.logs / f"{name}-run2.stdout")
    peers.check_leftovers(name, "proxy", marker, wait=3.0)

    caps = init.get("agentCapabilities") or {}
    sessions = sorted((caps.get("sessionCapabilities") or {}).keys())
    peers.report.note(
        name,
        f"{adapter} advertises loadSession={caps.get('loadSession')}, sessionCapabilities {sessions} "
        f"(as relayed); a session without a turn "
        + ("is not kept by the adapter: it came back afresh, historyReset announced" if s2_reset else "was kept"),
    )
    if problems:
        raise CheckFailed("; ".join(problems))
    return (
        "S1 suspended for S2 and resumed transparently for a prompt the adapter answered; "
        f"S2 {'came back afresh (historyReset)' if s2_reset else 'resumed'}; after a restart session/load "
        "replayed S1's two prompts; no foreign session id reached the gateway; nothing left running"
    )


def sessions_acpx(peers: Peers, name: str, adapter: str) -> str:
    """acpx named sessions through the proxy; every acpx command runs a new proxy (ttl 1)."""
    command, env, marker = peers.session_setup(name, adapter)
    log = peers.logs / f"{name}.stderr"
    log.unlink(missing_ok=True)
    ids: dict[str, str] = {}
    for session in ("one", "two"):
        rc, _ = peers.acpx(command, "sessions", "new", "--name", session, env=env, log=log)
        if rc != 0:
            raise CheckFailed(f"acpx sessions new --name {session} exited {rc} (see {log})")
        ids[session] = peers.acpx_session_id(command, session, env, log)
    transcript = []
    options = ("--format", "json", "--approve-all", "--ttl", "1", "--timeout", f"{PROMPT_TIMEOUT:.0f}")
    for session, words in (("one", FIRST_WORDS), ("two", OTHER_WORDS), ("one", SECOND_WORDS)):
        rc, out = peers.acpx(
            command, *options, "prompt", "-s", session, words, env=env, log=log, timeout=PROMPT_TIMEOUT + 60
        )
        messages = json_lines(out)
        transcript.append(messages)
        if not any(isinstance(m, dict) and m.get("method") == "session/prompt" for m in messages):
            raise CheckFailed(f"acpx prompt -s {session} exited {rc} before session/prompt (see {log})")
        reasons = [proxy_error(m) for m in messages if proxy_error(m)]
        if reasons:
            raise CheckFailed(f"acpx prompt -s {session} got the proxy's error {reasons[0]} (see {log})")
    (peers.logs / f"{name}.stdout").write_text(json.dumps(transcript, indent=1))
    seen = [message for messages in transcript for message in messages]
    problems = [f"acpx saw {leak}" for leak in foreign_session_ids(seen, set(ids.values()))]
    after = {session: peers.acpx_session_id(command, session, env, log) for session in ids}
    if after != ids:
        problems.append(f"acpx's records moved from {ids} to {after}")
    peers.check_leftovers(name, "proxy", marker, wait=15)  # the queue owners linger for their ttl

    audit = peers.logs / f"{name}-audit.stderr"
    audit.unlink(missing_ok=True)
    gateway, _ = peers.session_gateway(command, env, audit)
    replays = {}
    try:
        for session in ids:
            since = len(gateway.received)
            params = {"sessionId": ids[session], "cwd": str(peers.ws), "mcpServers": []}
            call_result(gateway, "session/load", params, timeout=PROMPT_TIMEOUT)
            replays[session] = user_texts(updates(gateway, since), ids[session])
        peers.end_gateway(gateway, "the audit")
    finally:
        end(gateway)
    peers.check_leftovers(name, "proxy", marker, wait=3.0)
    if not in_order([FIRST_WORDS, SECOND_WORDS], replays["one"]) or OTHER_WORDS in replays["one"]:
        raise CheckFailed(f"session one replayed {replays['one']}")
    if not in_order([OTHER_WORDS], replays["two"]) or FIRST_WORDS in replays["two"]:
        raise CheckFailed(f"session two replayed {replays['two']}")
    if problems:
        raise CheckFailed("; ".join(problems))
    return (
        "sessions new one/two, prompt one, two, one (each a new proxy): acpx kept its session ids, "
        "and session/load through a fresh proxy replayed each conversation whole and apart; nothing left running"
    )


def spec_raw(peers: Peers, name: str, adapter: str) -> str:
    """close then load or resume, delete of a live and of a closed session, fork; raw JSON-RPC, ``max_live = 1``."""
    command, env, marker = peers.session_setup(name, adapter)
    logs = peers.fresh_logs(name, "run1.stderr", "run2.stderr")
    problems: list[str] = []

    gateway, init = peers.session_gateway(command, env, logs[0])
    probe = SessionProbe(gateway, peers.ws, problems)
    try:
        served = (init.get("agentCapabilities") or {}).get("sessionCapabilities") or {}
        missing = [key for key in ("close", "list", "delete", "resume") if not isinstance(served.get(key), dict)]
        if missing:
            problems.append(f"the initialize result lacks sessionCapabilities {missing}")

        s1 = probe.new()
        probe.prompt(s1, FIRST_WORDS, "S1")
        if not probe.processes_but_proxy(marker, wait=0):
            problems.append("live S1's processes were not found (the scan after session/close would prove nothing)")
        probe.empty("session/close", s1, "S1")
        left = probe.processes_but_proxy(marker)
        if left:
            problems.append(f"after session/close of S1 still running: {'; '.join(left)}")
        probe.refused("session/prompt", prompt_params(s1, SECOND_WORDS), "session_closed", "closed S1")
        if probe.states().get(s1) != "closed":
            problems.append(f"after session/close, session/list gave {probe.states()}, expected S1 closed")
        replay = probe.restore("session/load", s1, "closed S1")
        if replay is not None and not in_order([FIRST_WORDS], replay):
            problems.append(f"session/load of closed S1 replayed {replay}, not its prompt")
        if probe.states().get(s1) != "live":
            problems.append(f"after session/load of closed S1, session/list gave {probe.states()}")

        s2 = probe.new()
        probe.prompt(s2, OTHER_WORDS, "S2")
        probe.empty("session/close", s2, "S2")
        probe.restore("session/resume", s2, "closed S2")
        if probe.states().get(s2) != "live":
            problems.append(f"after session/resume of closed S2, session/list gave {probe.states()}")

        # S2 is live; S1 was suspended for it (one slot), then is closed
        probe.empty("session/delete", s2, "live S2")
        left = probe.processes_but_proxy(marker)
        if left:
            problems.append(f"after session/delete of S2 still running: {'; '.join(left)}")
        probe.empty("session/close", s1, "suspended S1")
        probe.empty("session/delete", s1, "closed S1")
        listed = probe.states()
        if s1 in listed or s2 in listed:
            problems.append(f"after session/delete, session/list still gave {listed}")
        for sid, what in ((s1, "deleted S1"), (s2, "deleted S2")):
            probe.refused("session/load", probe.load_params(sid), "session_deleted", what)
        probe.empty("session/delete", s1, "deleted S1")
        probe.empty("session/delete", "never-issued", "an unknown id")

        fork_note = spec_fork(probe, adapter, served, logs[0])
        problems += peers.last_words(gateway, "run 1", probe.known)
    finally:
        end_keeping(gateway, peers.logs / f"{name}-run1.stdout")
    peers.check_leftovers(name, "proxy", marker, wait=3.0)

    # a new proxy on the same state dir: the tombstones and the other rows last
    gateway, _ = peers.session_gateway(command, env, logs[1])
    try:
        after = SessionProbe(gateway, peers.ws, problems)
        listed = after.listing()
        kept = probe.known - {s1, s2}
        if listed.keys() != kept or any(meta.get("state") != "suspended" for meta in listed.values()):
            problems.append(f"after a restart session/list gave {listed}, expected {sorted(kept)} suspended")
        after.refused("session/load", after.load_params(s1), "session_deleted", "deleted S1 after a restart")
        peers.end_gateway(gateway, "run 2")
    finally:
        end_keeping(gateway, peers.logs / f"{name}-run2.stdout")
    peers.check_leftovers(name, "proxy", marker, wait=3.0)

    peers.report.note(name, kept_by_adapter(peers, name, adapter, env, s1))
    peers.report.note(name, fork_note)
    peers.check_leftovers(name, "proxy", marker, wait=3.0)
    if problems:
        raise CheckFailed("; ".join(problems))
    return (
        "closed S1 listed closed with its tree reaped, a prompt to it -32002 session_closed, session/load "
        "restored it with its prompt; closed S2 restored by session/resume; session/delete of live S2 and "
        "closed S1 {}, both unlisted, session/load -32002 session_deleted (also after a restart), a second "
        "delete and an unknown id {}; no foreign session id reached the gateway; nothing left running"
    )


def spec_fork(probe: SessionProbe, adapter: str, served: dict[str, Any], log: Path) -> str:
    """session/fork of a session that had a turn; a NOTE line on what the adapter did."""
    problems = probe.problems
    parent = probe.new()
    if "fork" not in served:
        answer = call(probe.gateway, "session/fork", probe.load_params(parent))
        if "error" not in answer:
            problems.append(f"session/fork, not advertised, answered {short(answer)}")
        return f"{adapter} advertises no sessionCapabilities.fork, nor does the proxy; session/fork: {short(answer)}"
    probe.prompt(parent, FIRST_WORDS, "the parent")
    answer = call(probe.gateway, "session/fork", probe.load_params(parent), timeout=PROMPT_TIMEOUT)
    fork = (answer.get("result") or {}).get("sessionId")
    if not isinstance(fork, str):
        if proxy_error(answer) or "error" not in answer:
            problems.append(f"session/fork answered {short(answer)}")
        return f"{adapter} could not fork without credentials: session/fork answered {short(answer)}"
    probe.known.add(fork)
    if fork == parent:
        problems.append(f"session/fork answered the parent's own id {fork}")
    forked_on = log_match(log, rf"session {re.escape(parent)} forked as {re.escape(fork)} on pid (\d+)")
    listed = probe.listing()
    if listed.get(fork, {}).get("parentSessionId") != parent or listed.get(parent, {}).get("state") != "suspended":
        problems.append(f"after session/fork, session/list gave {listed}, expected the fork with its parent")
    probe.prompt(fork, OTHER_WORDS, "the fork")
    parent_replay = probe.restore("session/load", parent, "the parent") or []
    if not in_order([FIRST_WORDS], parent_replay) or OTHER_WORDS in parent_replay:
        problems.append(f"session/load of the parent replayed {parent_replay}")
    back_on = log_match(log, rf"session {re.escape(parent)} resumed on pid (\d+)")
    if forked_on is None or back_on is None or forked_on == back_on:
        problems.append(f"the parent came back on pid {back_on}, the fork was made on pid {forked_on} (see {log})")
    fork_replay = probe.restore("session/load", fork, "the fork") or []
    if OTHER_WORDS not in fork_replay:
        problems.append(f"session/load of the fork replayed {fork_replay}, not its own prompt")
    final = probe.states()
    if final.get(parent) != "suspended" or final.get(fork) != "live":
        problems.append(f"at last session/list gave {final}, expected the parent suspended and the fork live")
    return (
        f"{adapter} forked offline: the fork made on the parent's pid {forked_on}, which then served its prompt; "
        f"the parent back on pid {back_on}, its load replaying {checked_words(parent_replay)}; the fork's "
        f"load replayed {checked_words(fork_replay)} (the parent's history, then its own prompt)"
    )


def kept_by_adapter(peers: Peers, name: str, adapter: str, env: dict[str, str], session_id: str) -> str:
    """Whether the adapter itself still has a session the proxy deleted (its own load, straight)."""
    log = peers.logs / f"{name}-direct.stderr"
    log.unlink(missing_ok=True)
    peer, init = peers.session_gateway(peers.command(adapter), env, log)
    try:
        deletes = isinstance(
            ((init.get("agentCapabilities") or {}).get("sessionCapabilities") or {}).get("delete"), dict
        )
        params = {"sessionId": session_id, "cwd": str(peers.ws), "mcpServers": []}
        answer = call(peer, "session/load", params, timeout=PROMPT_TIMEOUT)
    finally:
        end(peer)
    kept = "still loads it (its storage kept the session)" if "result" in answer else f"answers {short(answer, 200)}"
    return (
        f"{adapter} {'advertises' if deletes else 'does not advertise'} session/delete "
        f"({'sent' if deletes else 'so the proxy deleted its own record only'}); "
        f"a session/load of deleted S1 straight on {adapter} {kept}"
    )
