"""A scripted gateway session through acp-proxy, printed for a person to read.

The "gateway" here is this script: it launches ``acp-proxy -- python -m
acp_proxy.examples.echo_agent`` exactly as an editor or chat bridge would launch
an agent, speaks ACP to it over stdio, and narrates each step.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

BOLD, DIM, GREEN, RED, CYAN, RESET = "\033[1m", "\033[2m", "\033[32m", "\033[31m", "\033[36m", "\033[0m"
if not sys.stdout.isatty() or os.environ.get("NO_COLOR"):
    BOLD = DIM = GREEN = RED = CYAN = RESET = ""


def step(title: str) -> None:
    print(f"\n{BOLD}{title}{RESET}")


def line(arrow: str, text: str) -> None:
    print(f"  {CYAN}{arrow}{RESET} {text}")


def ok(text: str) -> None:
    print(f"  {GREEN}✓{RESET} {text}")


def fail(text: str) -> None:
    print(f"  {RED}✗ {text}{RESET}")


class DemoGateway:
    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "acp_proxy", "--", sys.executable, "-m", "acp_proxy.examples.echo_agent"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self.inbox: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.ids = itertools.count(0)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.inbox.put(json.loads(raw))
        self.inbox.put(None)

    def send(self, msg: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"jsonrpc": "2.0", **msg}).encode() + b"\n")
        self.proc.stdin.flush()

    def send_raw(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data + b"\n")
        self.proc.stdin.flush()

    def request(self, method: str, params: dict[str, Any], on_message: Any = None) -> dict[str, Any]:
        request_id = next(self.ids)
        line("gateway → proxy", f"{method} (id {request_id})")
        self.send({"id": request_id, "method": method, "params": params})
        return self.until(lambda m: m.get("id") == request_id and "method" not in m, on_message)

    def until(self, done: Any, on_message: Any = None) -> dict[str, Any]:
        while True:
            msg = self.inbox.get(timeout=15)
            if msg is None:
                raise RuntimeError("acp-proxy closed its output")
            if done(msg):
                return msg
            if on_message is not None:
                on_message(msg)


def agent_text(msg: dict[str, Any]) -> str:
    update = msg.get("params", {}).get("update", {})
    return (
        str(update.get("content", {}).get("text", "")) if update.get("sessionUpdate") == "agent_message_chunk" else ""
    )


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def leases(env: dict[str, str]) -> list[dict[str, Any]]:
    """What ``acp-proxy leases --json`` reports (read from the state database)."""
    out = subprocess.run(
        [sys.executable, "-m", "acp_proxy", "leases", "--json"], env=env, capture_output=True, text=True, check=True
    ).stdout
    return list(json.loads(out)["leases"])


def show_tree(lease: dict[str, Any]) -> None:
    for proc in lease["processes"]:
        role = (
            "wrapper"
            if proc["pid"] == lease["wrapperPid"]
            else "adapter"
            if proc["pid"] == lease["adapterPid"]
            else "child"
        )
        print(f"      {DIM}{role:<8} pid {proc['pid']:<7} pgid {proc['pgid']:<7} {proc['command'][:60]}{RESET}")


def main() -> int:
    print(f"{BOLD}acp-proxy demo{RESET}: this script plays the gateway; the agent is the example echo agent.")
    print(f"{DIM}  $ acp-proxy -- python -m acp_proxy.examples.echo_agent{RESET}")
    state = tempfile.mkdtemp(prefix="acp-proxy-demo-")
    env = {
        **os.environ,
        "ACP_PROXY_LOG_LEVEL": os.environ.get("ACP_PROXY_LOG_LEVEL", "warning"),
        "ACP_PROXY_STATE_DIR": os.path.join(state, "state"),
    }
    gw = DemoGateway(env)
    failures = 0

    step("1. Handshake")
    init = gw.request("initialize", {"protocolVersion": 1, "clientCapabilities": {}})
    result = init["result"]
    line(
        "proxy → gateway",
        f"agent {result['agentInfo']['name']} {result['agentInfo']['version']}, "
        f"loadSession={result['agentCapabilities'].get('loadSession')}, "
        f"via acp-proxy {result['_meta']['acp-proxy']['version']}",
    )
    (lease,) = leases(env)
    adapter_pid = lease["adapterPid"]
    ok(f"lease {lease['lease']} is {lease['state']}: the adapter (pid {adapter_pid}) runs in its own process group")
    print(f"    {DIM}under a wrapper that owns its whole tree ($ acp-proxy leases):{RESET}")
    show_tree(lease)

    step("2. A session and a streamed turn")
    session = gw.request("session/new", {"cwd": os.getcwd(), "mcpServers": []})["result"]["sessionId"]
    line("proxy → gateway", f"sessionId {session}")
    chunks: list[str] = []

    def show(msg: dict[str, Any]) -> None:
        text = agent_text(msg)
        if text:
            chunks.append(text)
            print(f"      {DIM}session/update{RESET} {text!r}")

    prompt = {"sessionId": session, "prompt": [{"type": "text", "text": "streams pass through untouched"}]}
    turn = gw.request("session/prompt", prompt, show)
    line("proxy → gateway", f"stopReason {turn['result']['stopReason']} after {len(chunks)} updates")

    step("3. The agent asks the gateway for permission")

    def answer_permission(msg: dict[str, Any]) -> None:
        if msg.get("method") == "session/request_permission":
            line("proxy → gateway", f"session/request_permission (id {msg['id']}, the proxy's own id space)")
            line("gateway → proxy", "allow")
            gw.send({"id": msg["id"], "result": {"outcome": {"outcome": "selected", "optionId": "allow"}}})
        else:
            show(msg)

    prompt = {"sessionId": session, "prompt": [{"type": "text", "text": "permission granted please"}]}
    turn = gw.request("session/prompt", prompt, answer_permission)
    line("proxy → gateway", f"stopReason {turn['result']['stopReason']}")

    step("4. session/cancel ends a turn; the agent process stays")
    long_text = " ".join(f"word{i}" for i in range(200))
    request_id = next(gw.ids)
    line("gateway → proxy", f"session/prompt (id {request_id}), 200 words")
    gw.send(
        {
            "id": request_id,
            "method": "session/prompt",
            "params": {"sessionId": session, "prompt": [{"type": "text", "text": long_text}]},
        }
    )
    time.sleep(0.2)
    line("gateway → proxy", "session/cancel")
    gw.send({"method": "session/cancel", "params": {"sessionId": session}})
    turn = gw.until(lambda m: m.get("id") == request_id and "method" not in m)
    line("proxy → gateway", f"stopReason {turn['result']['stopReason']}")
    if adapter_pid and pid_alive(adapter_pid):
        ok(f"adapter pid {adapter_pid} still running: cancel is not close")
    else:
        fail("the adapter died on cancel")
        failures += 1

    step("5. Bad input gets an error; the proxy keeps serving")
    line("gateway → proxy", "this is not JSON")
    gw.send_raw(b"this is not JSON")
    error = gw.until(lambda m: "error" in m)
    line("proxy → gateway", f"error {error['error']['code']}: {error['error']['message']}")
    replayed: list[dict[str, Any]] = []
    gw.request("session/load", {"sessionId": session, "cwd": os.getcwd(), "mcpServers": []}, replayed.append)
    ok(f"session/load answered afterwards, with {len(replayed)} history updates replayed")

    step("6. The gateway goes away")
    line("gateway → proxy", "EOF on stdin")
    assert gw.proc.stdin is not None
    gw.proc.stdin.close()
    status = gw.proc.wait(timeout=15)
    ok(f"acp-proxy exited with status {status}")
    tree = [p["pid"] for p in lease["processes"]]
    (ended,) = leases(env)
    if not any(pid_alive(pid) for pid in tree) and ended["state"] == "closed":
        ok(f"lease {ended['lease']} is {ended['state']}: none of its {len(tree)} processes is left running")
    else:
        fail(f"lease {ended['lease']} is {ended['state']}; still running: {[p for p in tree if pid_alive(p)]}")
        failures += 1
    shutil.rmtree(state, ignore_errors=True)
    print()
    return 1 if failures or status != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
