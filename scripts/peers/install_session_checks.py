"""retention-acpx-echo, handover-acpx-echo, fast-agent: sessions that belong to the install, with real clients.

- ``retention-acpx-echo``: acpx ``exec`` ends by EOF without closing. With ``on_eof = "close"`` its session is
  closed; without, it is left suspended, and ``acp-proxy sessions prune`` closes it. A named session keeps its
  history across acpx commands.
- ``handover-acpx-echo``: acpx's queue owner holds a named session live; another gateway's proxy of the same
  install loads it (the session moves, with its history), and acpx's next prompt is told ``session_moved``.
- ``fast-agent``: fast-agent (PyPI ``fast-agent-acp``, offline with ``--model passthrough``), zero-config first
  (its backend named after the agent), then from a config that names the same command otherwise: the session
  loads there with its history. Needs a Python 3.12 or later for fast-agent's venv (``installation``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .harness import Peers, call, call_result, end, open_peer, updates
from .report import CheckFailed


def _states(peers: Peers, env: dict[str, str]) -> dict[str, tuple[str, str]]:
    listed = peers.proxy_json(env, "sessions", "list", "--all")["sessions"]
    return {s["sessionId"]: (s["state"], s["backend"]) for s in listed}


def _setup(peers: Peers, name: str, config: str) -> tuple[Path, dict[str, str], str]:
    base = peers.work / "install" / name
    shutil.rmtree(base, ignore_errors=True)
    (base / "home").mkdir(parents=True)
    path = base / "proxy.toml"
    path.write_text(config)
    path.chmod(0o600)
    env, marker = peers.runs.env(name, HOME=str(base / "home"), ACP_PROXY_STATE_DIR=str(base / "state"))
    return path, env, marker


def _echo_config(peers: Peers, name: str) -> str:
    """Two backends of the echo agent, its history kept on disk (as real adapters keep theirs) so that another
    process of it loads a session: one closing its sessions at the gateway's EOF, one suspending them."""
    echo = json.dumps([*peers.echo_agent(), "--store", str(peers.work / "install" / name / "store")])
    return f'[backends.closing]\ncommand = {echo}\non_eof = "close"\n[backends.keeping]\ncommand = {echo}\n'


def retention_acpx(peers: Peers, name: str) -> str:
    config, env, marker = _setup(peers, name, _echo_config(peers, name))
    (log,) = peers.fresh_logs(name, "acpx.stderr")
    agent = [*peers.proxy, "--config", str(config), "--backend"]
    seen = []
    for backend in ("closing", "keeping"):
        rc, out = peers.acpx([*agent, backend], "--approve-all", "--format", "quiet", "exec", "hello", env=env, log=log)
        if rc != 0 or "hello" not in out:
            raise CheckFailed(f"acpx exec through backend {backend} exited {rc}: {out.strip()[:200]} (see {log})")
        seen.append(out.strip())
    states = _states(peers, env)
    by_backend = {backend: state for state, backend in states.values()}
    if by_backend != {"closing": "closed", "keeping": "suspended"}:
        raise CheckFailed(f"after two acpx exec runs (on_eof close, suspend), the sessions are {states}")
    pruned = peers.proxy_json(env, "sessions", "prune", "--older-than", "0")["closed"]
    after = _states(peers, env)
    if len(pruned) != 1 or {state for state, _ in after.values()} != {"closed"}:
        raise CheckFailed(f"sessions prune closed {pruned}; the sessions are now {after}")
    peers.check_leftovers(name, "proxy", marker)
    return (
        f"acpx exec: on_eof close -> closed, suspend -> suspended ({'; '.join(seen)}); "
        f"sessions prune closed the suspended one; {len(after)} sessions listed, all closed"
    )


def handover_acpx(peers: Peers, name: str) -> str:
    config, env, marker = _setup(peers, name, _echo_config(peers, name))
    (log, raw_log) = peers.fresh_logs(name, "acpx.stderr", "raw.stderr")
    agent = [*peers.proxy, "--config", str(config), "--backend", "keeping"]
    gateway = None
    try:
        rc, _ = peers.acpx(agent, "--format", "quiet", "sessions", "new", "--name", "s1", env=env, log=log)
        if rc != 0:
            raise CheckFailed(f"acpx sessions new exited {rc} (see {log})")
        for text in ("first", "second"):
            rc, out = peers.acpx(
                agent, "--approve-all", "--format", "quiet", "prompt", "-s", "s1", text, env=env, log=log
            )
            if rc != 0:
                raise CheckFailed(f"acpx prompt {text!r} exited {rc}: {out.strip()[:200]} (see {log})")
        session = peers.acpx_session_id(agent, "s1", env, log)
        if _states(peers, env).get(session, ("?",))[0] != "live":
            raise CheckFailed(f"acpx's queue owner does not hold {session} live: {_states(peers, env)}")
        gateway = open_peer([*peers.proxy, "--config", str(config), "--backend", "keeping"], env, raw_log, peers.ws)
        call_result(gateway, "initialize", {"protocolVersion": 1, "clientCapabilities": {}})
        before = len(gateway.received)
        call_result(gateway, "session/load", {"sessionId": session, "cwd": str(peers.ws), "mcpServers": []})
        replayed = [u for u in updates(gateway, before) if u.get("sessionId") == session]
        prompts = [u for u in replayed if (u.get("update") or {}).get("sessionUpdate") == "user_message_chunk"]
        answer = call(gateway, "session/prompt", {"sessionId": session, "prompt": [{"type": "text", "text": "third"}]})
        if (answer.get("result") or {}).get("stopReason") != "end_turn":
            raise CheckFailed(f"the prompt after the handover: {answer}")
        if "remember 2 earlier prompts" not in json.dumps(updates(gateway, before)):
            raise CheckFailed("the turn after the handover did not remember the two prompts made through acpx")
        rc, out = peers.acpx(
            agent, "--approve-all", "--format", "quiet", "prompt", "-s", "s1", "fourth", env=env, log=log
        )
        moved = "session_moved" in out or "has moved" in out or "has moved" in log.read_text()
        if rc == 0 or not moved:
            raise CheckFailed(f"acpx's prompt after the handover exited {rc} without session_moved: {out[-300:]}")
        events = peers.proxy_json(env, "sessions", "show", session)["recentEvents"]
        handovers = sorted(e["label"] for e in events if e["kind"] == "handover")
    finally:
        if gateway is not None:
            end(gateway)
        peers.acpx(agent, "--format", "quiet", "sessions", "close", "s1", env=env, log=log)
    peers.check_leftovers(name, "proxy", marker, wait=10.0)
    if handovers != ["released", "taken"]:
        raise CheckFailed(f"the journal's handovers for {session}: {handovers}")
    return (
        f"acpx's queue owner held {session} live; another gateway's load moved it with its history "
        f"({len(replayed)} updates replayed, {len(prompts)} of them prompts; the next turn remembered both), "
        "acpx's next prompt failed with session_moved; journal: released, taken"
    )


def fast_agent(peers: Peers, name: str) -> str:
    program = peers.work / "venv-fast-agent" / "bin" / "fast-agent"
    if not program.exists():
        raise CheckFailed(f"{program} is not installed (it needs a Python 3.12 or later; see installation.py)")
    command = [str(program), "acp", "--model", "passthrough"]
    config, env, marker = _setup(peers, name, f"[backends.fast]\ncommand = {json.dumps(command)}\n")
    (zero_log, config_log) = peers.fresh_logs(name, "zero-config.stderr", "config.stderr")
    gateway = open_peer(peers.proxied(command), env, zero_log, peers.ws)
    try:
        call_result(gateway, "initialize", {"protocolVersion": 1, "clientCapabilities": {}}, timeout=180)
        session = str(call_result(gateway, "session/new", {"cwd": str(peers.ws), "mcpServers": []}, 180)["sessionId"])
        for text in ("hello one", "hello two"):
            params = {"sessionId": session, "prompt": [{"type": "text", "text": text}]}
            if call_result(gateway, "session/prompt", params, 180).get("stopReason") != "end_turn":
                raise CheckFailed(f"prompt {text!r} did not end end_turn")
        peers.end_gateway(gateway, "the zero-config proxy")
    finally:
        end(gateway)
    zero = _states(peers, env)
    if zero.get(session) != ("suspended", "fast-agent"):
        raise CheckFailed(f"after the zero-config run: {zero} (expected {session} suspended, backend fast-agent)")
    gateway = open_peer([*peers.proxy, "--config", str(config)], env, config_log, peers.ws)
    try:
        call_result(gateway, "initialize", {"protocolVersion": 1, "clientCapabilities": {}}, timeout=180)
        before = len(gateway.received)
        call_result(gateway, "session/load", {"sessionId": session, "cwd": str(peers.ws), "mcpServers": []}, 180)
        replayed = json.dumps(updates(gateway, before))
        if "hello one" not in replayed or "hello two" not in replayed:
            raise CheckFailed(f"the load from the config replayed no history: {replayed[:300]}")
        params = {"sessionId": session, "prompt": [{"type": "text", "text": "hello three"}]}
        if call_result(gateway, "session/prompt", params, 180).get("stopReason") != "end_turn":
            raise CheckFailed("the prompt after the load did not end end_turn")
        peers.end_gateway(gateway, "the configured proxy")
    finally:
        end(gateway)
    after = _states(peers, env)
    if after.get(session) != ("suspended", "fast"):
        raise CheckFailed(f"after the configured run: {after} (expected backend renamed to fast)")
    peers.check_leftovers(name, "proxy", marker, wait=10.0)
    return (
        f"zero-config: backend fast-agent, two turns; a config naming the same command `fast` loaded {session} "
        "with both turns replayed, a third turn, the row now of backend fast; nothing left running"
    )
