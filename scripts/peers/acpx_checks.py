"""acpx-exec-*, acpx-sessions-*: acpx, a published client, driving the SDK agent, the proxy's echo
agent, codex-acp and claude-agent-acp (the adapters stop at their auth error).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from .harness import Peers
from .report import CheckFailed
from .wire import (
    first_difference,
    json_lines,
    normalize_ids,
    outline,
    relabel_requests,
    strip_proxy_meta,
    unordered_notifications,
)


def exec_turn(
    peers: Peers, name: str, agent: list[str], prompt: str, expect: Callable[[int, list[Any]], str | None]
) -> str:
    """``acpx exec`` (one stateless turn) against ``agent`` and ``acp-proxy -- agent``."""
    outputs = {}
    for mode, command in (("direct", agent), ("proxy", peers.proxied(agent))):
        log = peers.logs / f"{name}-{mode}.stderr"
        log.unlink(missing_ok=True)
        env, marker = peers.runs.env(f"{name}-{mode}")
        rc, out = peers.acpx(
            command, "--format", "json", "--approve-all", "--timeout", "60", "exec", prompt, env=env, log=log
        )
        (peers.logs / f"{name}-{mode}.stdout").write_text(out)
        messages = strip_proxy_meta(normalize_ids(json_lines(out)), mode == "proxy", f"{mode} acpx output")
        problem = expect(rc, messages)
        if problem:
            raise CheckFailed(f"{mode}: {problem} (exit {rc}; see {log} and .stdout)")
        peers.check_leftovers(name, mode, marker)
        outputs[mode] = (rc, messages)
    if outputs["direct"][0] != outputs["proxy"][0]:
        raise CheckFailed(f"acpx exit status {outputs['direct'][0]} direct vs {outputs['proxy'][0]} proxied")
    direct, proxied = (unordered_notifications(relabel_requests(outputs[mode][1])) for mode in ("direct", "proxy"))
    diff = first_difference(direct, proxied)
    if diff:
        raise CheckFailed(f"acpx saw different messages, {diff}")
    rc, messages = outputs["proxy"]
    return f"exit {rc} both ways, the same {len(messages)} messages ({outline(messages)})"


def exec_adapter(peers: Peers, name: str, adapter: str) -> str:
    """``acpx exec`` against a real adapter, which stops at its auth error without credentials."""
    return exec_turn(peers, name, peers.command(adapter), "say hi", expect_initialized)


def persistent_sessions(peers: Peers, name: str) -> str:
    """acpx's persistent mode: a detached queue owner runs the agent for a named session."""
    outputs = {}
    for mode, command in (("direct", peers.sdk_agent()), ("proxy", peers.proxied(peers.sdk_agent()))):
        log = peers.logs / f"{name}-{mode}.stderr"
        log.unlink(missing_ok=True)
        env, marker = peers.runs.env(f"{name}-{mode}")
        session = f"peers-{mode}"
        turn = ("--format", "json", "--approve-all", "--ttl", "1", "prompt", "-s", session, "persistent prompt")
        steps = [("sessions", "new", "--name", session), turn, ("sessions", "close", session)]
        transcript = []
        for step in steps:
            rc, out = peers.acpx(command, *step, env=env, log=log)
            if rc != 0:
                raise CheckFailed(f"{mode}: acpx {' '.join(step[:2])} exited {rc} (see {log})")
            transcript.append(normalize_ids(json_lines(out)))
        (peers.logs / f"{name}-{mode}.stdout").write_text(json.dumps(transcript, indent=1))
        prompt = strip_proxy_meta(transcript[1], mode == "proxy", f"{mode} acpx prompt output")
        problem = expect_turn(0, prompt)
        if problem:
            raise CheckFailed(f"{mode}: {problem} (see {log})")
        # The queue owner lingers for its TTL (1 s) before it stops the agent.
        peers.check_leftovers(name, mode, marker, wait=15)
        outputs[mode] = prompt
    diff = first_difference(relabel_requests(outputs["direct"]), relabel_requests(outputs["proxy"]))
    if diff:
        raise CheckFailed(f"acpx saw different messages, {diff}")
    return (
        f"sessions new / prompt / sessions close through acpx's queue owner: the same "
        f"{len(outputs['proxy'])} prompt messages ({outline(outputs['proxy'])}), nothing left running"
    )


def expect_turn(rc: int, messages: list[Any]) -> str | None:
    if rc != 0:
        return "acpx failed"
    if not any(isinstance(m.get("result"), dict) and m["result"].get("stopReason") == "end_turn" for m in messages):
        return "no session/prompt result with stopReason end_turn"
    if not any(m.get("method") == "session/update" for m in messages):
        return "no session/update was streamed"
    return None


def expect_initialized(rc: int, messages: list[Any]) -> str | None:
    """Without credentials an adapter answers initialize, then refuses the session: fine either way."""
    if not any(isinstance(m.get("result"), dict) and "protocolVersion" in m["result"] for m in messages):
        return "no initialize result"
    return None


def exec_sdk_agent(peers: Peers, name: str) -> str:
    return exec_turn(peers, name, peers.sdk_agent(), "hello through acpx", expect_turn)


def exec_echo_agent(peers: Peers, name: str) -> str:
    return exec_turn(peers, name, peers.echo_agent(), "echo this, with permission", expect_turn)
