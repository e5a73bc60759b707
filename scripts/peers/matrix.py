"""matrix-*: one scenario for every adapter of the ADAPTERS table, run straight and through
``acp-proxy -- ADAPTER ARGV`` (a private HOME per run, a private state dir for the proxy).

initialize, authenticate (where the row names a method), session/new, a prompt cancelled with
session/cancel (where a turn stays under way offline), session/set_mode to ``plan`` (or
session/set_config_option where only a mode option is offered), a prompt (where the adapter
records it offline), session/close, session/load and session/resume (where advertised, each
after a close), session/list. Straight, a closed session's process ends as the proxy ends it
and each restore runs on a new process. What is compared is in ``scenario``. Adapters that
refuse session/new without a login (copilot, auggie, pi-acp) must refuse it identically through
the proxy, which then lists nothing. Nothing may be left running after either run, nor any
process of the session after session/close through the proxy.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from tests.kit import markers
from tests.kit.gateway import SyncGateway

from .adapters import ADAPTERS, Adapter
from .harness import (
    MARKER_VAR,
    PROMPT_TIMEOUT,
    Peers,
    answer_to,
    call,
    close_stdin,
    end,
    open_peer,
    updates,
)
from .report import CheckFailed
from .scenario import (
    CANCEL_AFTER,
    CANCELLED,
    OWN_LIST,
    THEN_LOAD,
    Scenario,
    eof_outline,
    matrix_problems,
    mode_setting,
    restore_plan,
)
from .wire import (
    CLIENT_INITIALIZE,
    FIRST_WORDS,
    SECOND_WORDS,
    foreign_session_ids,
    history_reset,
    prompt_params,
    short,
    user_texts,
)


def matrix(peers: Peers, name: str, adapter: str) -> str:
    """The scenario of the adapter's row, straight, then through ``acp-proxy --``; the two compared."""
    row = ADAPTERS[adapter]
    direct = matrix_run(peers, name, row, "direct", None)
    proxied = matrix_run(peers, name, row, "proxy", direct)
    if proxied.session_id is not None and direct.plan.lists:
        matrix_own_list(peers, name, row, proxied)
    peers.report.note(name, f"straight: {direct.outline()}; {eof_outline(direct.eof)}")
    problems = [*proxied.problems, *matrix_problems(direct, proxied)]
    if (direct.session_id is None) != row.login:
        problems.append(
            f"straight, session/new {'opened a session' if row.login else 'was refused'}; the table says "
            f"it {'refuses' if row.login else 'opens'} one without a login"
        )
    if problems:
        raise CheckFailed(f"through the proxy: {proxied.outline()}; " + "; ".join(problems))
    return f"through the proxy: {proxied.outline()}; nothing left running"


def matrix_run(peers: Peers, name: str, adapter: Adapter, mode: str, direct: Scenario | None) -> Scenario:
    """One side of a matrix-* check: a private HOME (and state dir, proxied), every step's answer kept.

    Straight, the steps follow what the adapter advertised; proxied, the same steps as
    straight. The proxy ends a closed session's process and restores it on a new one,
    so straight, session/close is sent if the adapter advertises it, and then its
    process ends the way the proxy ends it (stdin EOF, then the group is killed), and
    each restore runs on a new process (initialize and authenticate again) on the
    same HOME.
    """
    base = peers.work / "matrix" / name / mode
    shutil.rmtree(base, ignore_errors=True)
    (base / "home" / ".claude").mkdir(parents=True)
    extra = {"HOME": str(base / "home"), **peers.adapter_env(adapter.name)}
    if mode == "proxy":
        extra["ACP_PROXY_STATE_DIR"] = str(base / "state")
    env, marker = peers.runs.env(f"{name}-{mode}", **extra)
    seen = Scenario(mode == "proxy", env)
    log = peers.logs / f"{name}-{mode}.stderr"
    log.unlink(missing_ok=True)
    command = peers.command(adapter.name)
    proxied = mode == "proxy"
    peer = matrix_start(peers, command if not proxied else peers.proxied(command), env, log, adapter, seen)
    try:
        seen.plan = direct.plan if direct is not None else restore_plan(seen.result("initialize"))
        new = seen.step(peer, "session/new", {"cwd": str(peers.ws), "mcpServers": []}, settle=True)
        sid = new.get("sessionId")
        if isinstance(sid, str):
            seen.session_id = sid
            matrix_session(peers, peer, seen, adapter, direct)
            for index, method in enumerate(seen.plan.restores):
                if proxied:
                    matrix_close(peer, seen, marker, again=index > 0)
                else:
                    matrix_stop(peer, seen, record=index == 0)
                    peer = matrix_start(peers, command, env, log, adapter, None)
                matrix_restore(peers, peer, seen, method)
            if not seen.plan.restores:
                if proxied:
                    matrix_close(peer, seen, marker, again=False)
                elif seen.plan.closes:
                    seen.step(peer, "session/close", {"sessionId": sid})
        if proxied or seen.plan.lists:
            seen.step(peer, "session/list", {})
        peer.drain(quiet=1.0, limit=10.0)
        if proxied:
            known = {sid} if isinstance(sid, str) else set()
            seen.problems += foreign_session_ids(peer.received, known)
            peers.end_gateway(peer, "the proxied run")
        else:
            matrix_stop(peer, seen, record=False)
    finally:
        seen.keep(peer)
        end(peer)
        (peers.logs / f"{name}-{mode}.stdout").write_text("".join(json.dumps(m) + "\n" for m in seen.received))
    peers.check_leftovers(name, mode, marker, wait=5.0)
    return seen


def matrix_own_list(peers: Peers, name: str, adapter: Adapter, proxied: Scenario) -> None:
    """The adapter's own session/list on the proxied run's HOME, straight: what it says of the session."""
    log = peers.logs / f"{name}-own-list.stderr"
    log.unlink(missing_ok=True)
    env, marker = peers.runs.env(f"{name}-own-list", HOME=proxied.env["HOME"], **peers.adapter_env(adapter.name))
    peer = matrix_start(peers, peers.command(adapter.name), env, log, adapter, None)
    try:
        proxied.step(peer, "session/list", {}, name=OWN_LIST)
        close_stdin(peer, timeout=3.0)
    finally:
        end(peer)
    peers.check_leftovers(name, "direct", marker, wait=5.0)


def matrix_start(
    peers: Peers, command: list[str], env: dict[str, str], log: Path, adapter: Adapter, seen: Scenario | None
) -> SyncGateway:
    """A new process, initialized (and authenticated); ``seen`` records the answers if given."""
    peer = open_peer(command, env, log, peers.ws)
    record = seen if seen is not None else Scenario(False, env)
    try:
        record.step(peer, "initialize", CLIENT_INITIALIZE)
        if adapter.auth:
            record.step(peer, "authenticate", {"methodId": adapter.auth})
    except BaseException:
        end(peer)
        raise
    return peer


def matrix_session(peers: Peers, peer: SyncGateway, seen: Scenario, adapter: Adapter, direct: Scenario | None) -> None:
    """A cancelled turn (where one stays under way), another mode than the session's (where it offers
    modes), then a prompt (where the adapter records it).

    The cancel comes first, in the session's first mode: gemini-cli answers a cancel in
    ``plan`` at once, in its default mode about a minute late.
    """
    if adapter.cancel:
        matrix_cancel(peer, seen)
    new = seen.result("session/new")
    setting = direct.setting if direct is not None else mode_setting(new)
    if setting is not None:
        method, params = setting
        seen.setting = setting
        seen.step(peer, method, {"sessionId": seen.session_id, **params}, settle=True)
    if adapter.prompt:
        assert seen.session_id is not None
        seen.step(peer, "session/prompt", prompt_params(seen.session_id, FIRST_WORDS), PROMPT_TIMEOUT)


def matrix_cancel(peer: SyncGateway, seen: Scenario) -> None:
    """A turn, session/cancel once it is under way, and how long its answer then took."""
    assert seen.session_id is not None
    request = {"jsonrpc": "2.0", "id": "cancelled-turn", "method": "session/prompt"}
    peer.send({**request, "params": prompt_params(seen.session_id, SECOND_WORDS)})
    time.sleep(CANCEL_AFTER)
    start = time.monotonic()
    peer.send({"jsonrpc": "2.0", "method": "session/cancel", "params": {"sessionId": seen.session_id}})
    answer = answer_to(peer, "cancelled-turn", timeout=PROMPT_TIMEOUT)
    seen.cancel_seconds = time.monotonic() - start
    seen.answers[CANCELLED] = {k: v for k, v in answer.items() if k not in ("id", "jsonrpc")}


def matrix_close(peer: SyncGateway, seen: Scenario, marker: str, again: bool) -> None:
    """session/close through the proxy: ``{}``, and the session's processes gone."""
    step = "session/close (again)" if again else "session/close"
    answer = seen.step(peer, "session/close", {"sessionId": seen.session_id}, name=step)
    if answer != {}:
        seen.problems.append(f"{step} answered {short(seen.answers[step])}, expected {{}}")
    deadline = time.monotonic() + 10.0
    while (found := markers.find(MARKER_VAR, marker)) and time.monotonic() < deadline:
        found.pop(peer.process.pid, None)
        if not found:
            break
        time.sleep(0.1)
    found.pop(peer.process.pid, None)
    if found:
        seen.problems.append(f"after {step} still running: {'; '.join(map(str, found.values()))}")


def matrix_stop(peer: SyncGateway, seen: Scenario, record: bool) -> None:
    """End a straight run's process as the proxy ends one: session/close if advertised, stdin EOF, kill."""
    if seen.plan.closes and seen.session_id is not None:
        params = {"sessionId": seen.session_id}
        if record:
            seen.step(peer, "session/close", params)
        else:
            call(peer, "session/close", params)
    seen.eof.append(close_stdin(peer, timeout=3.0))
    seen.keep(peer)
    end(peer)


def matrix_restore(peers: Peers, peer: SyncGateway, seen: Scenario, method: str) -> None:
    """session/load or session/resume of the closed session; straight, a failed resume is followed by
    a load where the adapter loads, to learn whether a proxy's fallback had a restore to fall back to."""
    assert seen.session_id is not None
    params = {"sessionId": seen.session_id, "cwd": str(peers.ws), "mcpServers": []}
    since = len(peer.received)
    seen.step(peer, method, params, PROMPT_TIMEOUT)
    received = updates(peer, since)
    seen.replays[method] = user_texts(received, seen.session_id)
    if history_reset(received, seen.session_id):
        seen.resets.add(method)
    error = seen.answers[method].get("error")
    if not seen.proxied and method == "session/resume" and seen.plan.loads and isinstance(error, dict):
        seen.step(peer, "session/load", params, PROMPT_TIMEOUT, name=THEN_LOAD)
