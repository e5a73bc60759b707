"""remote-sdk-python, remote-sdk-typescript: the official SDKs' network clients against ``serve``.

``acp-proxy serve`` with the echo agent (its history on disk, so another process of it loads a session),
a token, and each SDK's client (``sdk_remote_client.py`` on the Python SDK's ``acp.ws``/``acp.http``
transports; ``sdk_remote_client.mjs`` on the TypeScript SDK's experimental ``ws-client``/``http-client``)
over WebSocket, then streamable HTTP: initialize, session/new, two prompts (the second remembering the
first), the connection closed, and the reconnect each SDK documents: a new transport connection,
initialize, a load of an id the token never made (that load alone fails, the connection goes on), the
load of its session (both prompts replayed), a third prompt remembering both. Then serve is stopped;
nothing of the run may be left.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .harness import Peers, run_command
from .remote_checks import serving_echo
from .report import CheckFailed

PROGRAMS = Path(__file__).parent
PROMPTS = ("first prompt mango", "second prompt kiwi", "third prompt after the reconnect")
REMEMBERS = ("", "(I remember 1 earlier prompt)", "(I remember 2 earlier prompts)")
TRANSPORTS = ("ws", "http")


def sdk_dir(peers: Peers) -> Path:
    """Where ``installation`` puts the TypeScript SDK (2.4, with its experimental transports) and ``ws``."""
    return peers.work / "sdk-ts"


def remote_sdk_python(peers: Peers, name: str) -> str:
    return remote_sdk(peers, name, [str(peers.venv_python), str(PROGRAMS / "sdk_remote_client.py")], {})


def remote_sdk_typescript(peers: Peers, name: str) -> str:
    modules = sdk_dir(peers) / "node_modules"
    if not (modules / "@agentclientprotocol" / "sdk").exists():
        raise CheckFailed(f"the TypeScript SDK is not installed in {modules} (see installation.py)")
    return remote_sdk(peers, name, ["node", str(PROGRAMS / "sdk_remote_client.mjs")], {"NODE_PATH": str(modules)})


def remote_sdk(peers: Peers, name: str, client: list[str], client_env: dict[str, str]) -> str:
    seen: dict[str, dict[str, Any]] = {}
    with serving_echo(peers, name) as served:
        for transport in TRANSPORTS:
            argv = [*client, served.url, served.token, transport, str(peers.ws)]
            rc, out = run_command(argv, {**served.env, **client_env}, served.client_log, 180, peers.ws)
            lines = out.strip().splitlines()
            if rc != 0 or not lines:
                raise CheckFailed(f"the {transport} client exited {rc}: {out.strip()[-300:]} (see {served.client_log})")
            seen[transport] = summary = json.loads(lines[-1])
            problem = judge(summary)
            if problem:
                raise CheckFailed(f"over {transport}: {problem} (see {served.client_log}, {served.serve_log})")
    loads = ", ".join(f"{t}: {seen[t]['unknownLoad']}" for t in TRANSPORTS)
    return (
        f"over WebSocket and streamable HTTP: initialize, new, two turns, a new connection, the load of an unknown "
        f"id failed alone ({loads}), the load replayed both prompts, a third turn remembered both; serve stopped "
        f"in {served.seconds:.1f}s, nothing left running"
    )


def judge(summary: dict[str, Any]) -> str | None:
    """What is wrong with a client's summary, if anything."""
    turns = summary.get("turns", [])
    if [t.get("stopReason") for t in turns] != ["end_turn"] * 3:
        return f"the turns ended {[t.get('stopReason') for t in turns]}"
    for turn, words, remembers in zip(turns, PROMPTS, REMEMBERS, strict=True):
        if not turn["text"].startswith(words) or remembers not in turn["text"]:
            return f"the turn {words!r} answered {turn['text']!r}"
    if summary.get("replayed") != list(PROMPTS[:2]):
        return f"session/load replayed {summary.get('replayed')}"
    if not summary.get("loadSession"):
        return "initialize did not advertise loadSession"
    if summary.get("unknownLoad") == "answered":
        return "a load of an id the token never made was answered"
    return None
