"""raw-*: initialize, session/new (and a prompt if a session opened) piped into each adapter, then
stdin EOF, then the same with SIGTERM to the proxy.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from typing import Any

from tests.kit.gateway import SyncGateway

from .harness import Peers, answer_to, close_stdin, end, open_peer, transcript
from .report import CheckFailed
from .wire import first_difference, normalize_ids, outline, strip_proxy_meta, unordered_notifications


def raw_adapter(peers: Peers, name: str, adapter: str) -> str:
    seen: dict[str, list[Any]] = {}
    eof: dict[str, float | None] = {}
    for mode in ("direct", "proxy"):
        command = peers.command(adapter)
        if mode == "proxy":
            command = peers.proxied(command)
        log = peers.logs / f"{name}-{mode}.stderr"
        log.unlink(missing_ok=True)
        env, marker = peers.runs.env(f"{name}-{mode}")
        peer = open_peer(command, env, log, peers.ws)
        try:
            raw_session(peers, peer)
            # Direct: does the adapter exit on stdin EOF by itself? Proxied: the
            # proxy must exit, after its stdin grace and SIGTERM if needed.
            eof[mode] = close_stdin(peer, timeout=3.0 if mode == "direct" else 10.0)
            if mode == "proxy" and eof[mode] is None:
                raise CheckFailed("the proxy was still running 10s after its stdin closed")
            if mode == "proxy" and peer.process.returncode != 0:
                raise CheckFailed(f"the proxy exited {peer.process.returncode} after stdin EOF")
        finally:
            received = transcript(peer)  # what arrived before stdin closed
            end(peer)
        peers.check_leftovers(name, mode, marker, wait=2.0)
        (peers.logs / f"{name}-{mode}.stdout").write_text("\n".join(json.dumps(m) for m in received))
        received = normalize_ids(received)
        seen[mode] = unordered_notifications(strip_proxy_meta(received, mode == "proxy", f"{mode} {adapter}"))
    diff = first_difference(seen["direct"], seen["proxy"])
    if diff:
        raise CheckFailed(f"{adapter} answered differently, {diff}")
    if eof["direct"] is None:
        peers.report.note(
            name,
            f"{adapter} ignores stdin EOF (still running 3s after it); through the "
            f"proxy it was stopped anyway (proxy exited {eof['proxy']:.1f}s after EOF)",
        )
    else:
        peers.report.note(name, f"{adapter} exits on stdin EOF by itself ({eof['direct']:.1f}s)")
    term = raw_sigterm(peers, name, adapter)
    return (
        f"the same {len(seen['proxy'])} messages ({outline(seen['proxy'])}); proxy exited 0 "
        f"{eof['proxy']:.1f}s after stdin EOF and {term:.1f}s after SIGTERM, no process left"
    )


def raw_session(peers: Peers, peer: SyncGateway) -> None:
    """initialize, session/new and (if a session opened) a prompt, one line at a time."""
    peer.send(
        {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": 1,
                "clientInfo": {"name": "check-peers", "version": "1"},
                "clientCapabilities": {"fs": {"readTextFile": False, "writeTextFile": False}, "terminal": False},
            },
        }
    )
    answer_to(peer, 1, timeout=60)
    # A string id, to see it come back unchanged.
    peer.send(
        {
            "jsonrpc": "2.0",
            "id": "new-session",
            "method": "session/new",
            "params": {"cwd": str(peers.ws), "mcpServers": []},
        }
    )
    answer = answer_to(peer, "new-session", timeout=60)
    session_id = (answer.get("result") or {}).get("sessionId")
    if session_id:  # an adapter that opens a session without credentials refuses the turn
        peer.send(
            {
                "jsonrpc": "2.0",
                "id": 3,
                "method": "session/prompt",
                "params": {"sessionId": session_id, "prompt": [{"type": "text", "text": "say hi"}]},
            }
        )
        answer_to(peer, 3, timeout=60)
    peer.drain(quiet=1.5, limit=10.0)


def raw_sigterm(peers: Peers, name: str, adapter: str) -> float:
    """A gateway that stops its agent with SIGTERM (stdin left open): nothing may outlive the proxy."""
    log = peers.logs / f"{name}-proxy-sigterm.stderr"
    log.unlink(missing_ok=True)
    env, marker = peers.runs.env(f"{name}-proxy-sigterm")
    peer = open_peer(peers.proxied(peers.command(adapter)), env, log, peers.ws)
    try:
        raw_session(peers, peer)
        start = time.monotonic()
        peer.process.send_signal(signal.SIGTERM)  # the proxy only, as a gateway would
        try:
            status = peer.process.wait(10)
        except subprocess.TimeoutExpired:
            raise CheckFailed("the proxy was still running 10s after SIGTERM") from None
        if status != 0:
            raise CheckFailed(f"the proxy exited {status} after SIGTERM")
        elapsed = time.monotonic() - start
    finally:
        end(peer)
    peers.check_leftovers(name, "proxy", marker, wait=2.0)
    return elapsed
