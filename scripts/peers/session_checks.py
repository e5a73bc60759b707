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
"""

from __future__ import annotations

import json

from .harness import PROMPT_TIMEOUT, Peers, call, call_result, end, end_keeping, updates, wait_for_log
from .report import CheckFailed
from .wire import (
    FIRST_WORDS,
    OTHER_WORDS,
    PROXY_META,
    SECOND_WORDS,
    announced_modes,
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
        gateway.drain(quiet=1.0, limit=10.0)
        problems += [f"run 1: {leak}" for leak in foreign_session_ids(gateway.received, {s1, s2})]
        peers.end_gateway(gateway, "run 1")
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
        gateway.drain(quiet=1.0, limit=10.0)
        problems += [f"run 2: {leak}" for leak in foreign_session_ids(gateway.received, {s1, s2})]
        peers.end_gateway(gateway, "run 2")
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
