"""A scripted gateway session through acp-proxy, printed for a person to read.

The "gateway" here is this script: it launches ``acp-proxy --config demo.toml``
exactly as an editor or chat bridge would launch an agent, speaks ACP to it over
stdio (with the kit's client, ``tests.kit.gateway``), and narrates each step.
The config runs the example echo agent (which keeps session histories on disk, as
real adapters do) with ``max_live = 1``: two sessions share one live process slot,
so one of them is always suspended.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from acp_proxy.protocol.methods import Method
from tests.kit.gateway import SyncGateway

BOLD, DIM, GREEN, RED, CYAN, RESET = "\033[1m", "\033[2m", "\033[32m", "\033[31m", "\033[36m", "\033[0m"
if not sys.stdout.isatty() or os.environ.get("NO_COLOR"):
    BOLD = DIM = GREEN = RED = CYAN = RESET = ""


PACE = 0.0
"""Seconds to pause before each step (``--pace``), to watch the run with ``acp-proxy top``."""


def step(title: str) -> None:
    time.sleep(PACE)
    print(f"\n{BOLD}{title}{RESET}")


def line(arrow: str, text: str) -> None:
    print(f"  {CYAN}{arrow}{RESET} {text}")


def ok(text: str) -> None:
    print(f"  {GREEN}✓{RESET} {text}")


def fail(text: str) -> None:
    print(f"  {RED}✗ {text}{RESET}")


def request(gw: SyncGateway, method: str, params: dict[str, Any]) -> dict[str, Any]:
    request_id = gw.new_id()
    line("gateway → proxy", f"{method} (id {request_id})")
    return gw.request(method, params, request_id=request_id, timeout=15)


class Narrator:
    """Shows the agent's words as they arrive, while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.chunks: list[str] = []

    def __call__(self, direction: str, msg: dict[str, Any]) -> None:
        text = agent_text(msg) if direction == "in" and self.on else ""
        if text:
            self.chunks.append(text)
            print(f"      {DIM}session/update{RESET} {text!r}")


def answer_permission(msg: dict[str, Any]) -> dict[str, Any] | None:
    if msg.get("method") != Method.REQUEST_PERMISSION:
        return None
    line("proxy → gateway", f"session/request_permission (id {msg['id']}, the proxy's own id space)")
    line("gateway → proxy", "allow")
    return {"result": {"outcome": {"outcome": "selected", "optionId": "allow"}}}


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


def sessions_view(env: dict[str, str], gw: SyncGateway) -> dict[str, str]:
    """session/list, served by the proxy from its registry: every session and its state."""
    listed = request(gw, Method.LIST, {})["result"]["sessions"]
    return {s["sessionId"]: s["_meta"]["acp-proxy"]["state"] for s in listed}


def live_lease(env: dict[str, str]) -> dict[str, Any]:
    (lease,) = [lease for lease in leases(env) if lease["state"] == "open"]
    return lease


def write_config(state: str) -> str:
    path = os.path.join(state, "demo.toml")
    command = [sys.executable, "-m", "acp_proxy.examples.echo_agent", "--store", os.path.join(state, "histories")]
    with open(path, "w") as fh:
        fh.write(
            "[pool]\nmax_live = 1          # one live adapter process; the other session waits suspended\n\n"
            f"[backends.echo]\ncommand = {json.dumps(command)}\n"
        )
    return path


def options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/demo", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--state-dir",
        metavar="DIR",
        help="keep the demo's config, state and histories in DIR (default: a temporary directory, removed after)",
    )
    parser.add_argument(
        "--pace",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="pause before each step and stream slower, to watch the run in another terminal with acp-proxy top",
    )
    return parser.parse_args()


def main() -> int:
    global PACE
    args = options()
    PACE = max(0.0, args.pace)
    print(f"{BOLD}acp-proxy demo{RESET}: this script plays the gateway; the agent is the example echo agent.")
    print(f"{DIM}  $ acp-proxy --config demo.toml      # [pool] max_live = 1, backend: the echo agent{RESET}")
    keep = args.state_dir is not None
    if keep:
        state = os.path.abspath(args.state_dir)
        os.makedirs(state, mode=0o700, exist_ok=True)
    else:
        state = tempfile.mkdtemp(prefix="acp-proxy-demo-")
    env = {
        **os.environ,
        "ACP_PROXY_LOG_LEVEL": os.environ.get("ACP_PROXY_LOG_LEVEL", "error"),
        "ACP_PROXY_STATE_DIR": os.path.join(state, "state"),
    }
    if PACE:
        env["ECHO_AGENT_WORD_DELAY"] = str(min(0.5, PACE / 8))  # a turn streams for a second or more
    if keep or PACE:
        print(f"{DIM}  watch it: ACP_PROXY_STATE_DIR={env['ACP_PROXY_STATE_DIR']} .venv/bin/acp-proxy top{RESET}")
    narrator = Narrator()
    gw = SyncGateway.launch(
        [sys.executable, "-m", "acp_proxy", "--config", write_config(state)],
        env=env,
        stderr=None,
        name="acp-proxy",
        handler=answer_permission,
        observers=[narrator],
    )
    failures = 0

    def check(condition: bool, good: str, bad: str) -> None:
        nonlocal failures
        if condition:
            ok(good)
        else:
            fail(bad)
            failures += 1

    step("1. Handshake")
    init = request(gw, Method.INITIALIZE, {"protocolVersion": 1, "clientCapabilities": {}})
    result = init["result"]
    served = sorted(result["agentCapabilities"].get("sessionCapabilities", {}))
    line(
        "proxy → gateway",
        f"agent {result['agentInfo']['name']} {result['agentInfo']['version']} via acp-proxy "
        f"{result['_meta']['acp-proxy']['version']}; session capabilities: {', '.join(served)}",
    )

    step("2. Session A: a streamed turn, in its own owned process tree")
    first = request(gw, Method.NEW, {"cwd": os.getcwd(), "mcpServers": []})["result"]["sessionId"]
    line("proxy → gateway", f"sessionId {first}")
    narrator.on = True
    turn = request(gw, Method.PROMPT, {"sessionId": first, "prompt": [{"type": "text", "text": "hello A"}]})
    line("proxy → gateway", f"stopReason {turn['result']['stopReason']} after {len(narrator.chunks)} updates")
    lease = live_lease(env)
    first_pid = lease["adapterPid"]
    ok(f"lease {lease['lease']}: the adapter (pid {first_pid}) runs in its own process group ($ acp-proxy leases):")
    show_tree(lease)

    step("3. The agent asks the gateway for permission")
    prompt = {"sessionId": first, "prompt": [{"type": "text", "text": "permission granted please"}]}
    turn = request(gw, Method.PROMPT, prompt)  # the handler answers the agent's request
    line("proxy → gateway", f"stopReason {turn['result']['stopReason']}")
    narrator.on = False

    step("4. session/cancel ends a turn; the agent process stays")
    long_text = " ".join(f"word{i}" for i in range(200))
    request_id = gw.new_id()
    line("gateway → proxy", f"session/prompt (id {request_id}), 200 words")
    gw.send(
        {
            "jsonrpc": "2.0",
            "id": request_id,
            "method": Method.PROMPT,
            "params": {"sessionId": first, "prompt": [{"type": "text", "text": long_text}]},
        }
    )
    time.sleep(0.2)
    line("gateway → proxy", Method.CANCEL)
    gw.notify(Method.CANCEL, {"sessionId": first})
    turn = gw.response_to(request_id, timeout=15)
    line("proxy → gateway", f"stopReason {turn['result']['stopReason']}")
    check(pid_alive(first_pid), f"adapter pid {first_pid} still running: cancel is not close", "it died on cancel")

    step("5. Session B, with max_live = 1: the idle session A is suspended to make room")
    second = request(gw, Method.NEW, {"cwd": os.getcwd(), "mcpServers": []})["result"]["sessionId"]
    line("proxy → gateway", f"sessionId {second}")
    deadline = time.monotonic() + 10
    while pid_alive(first_pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    view = sessions_view(env, gw)
    line("proxy → gateway", f"session/list: {', '.join(f'{sid} {st}' for sid, st in view.items())}")
    check(
        not pid_alive(first_pid) and view.get(first) == "suspended",
        f"session A is suspended: its process tree (pid {first_pid}) is gone, the session is kept",
        f"session A: {view.get(first)}, pid {first_pid} alive={pid_alive(first_pid)}",
    )
    second_pid = live_lease(env)["adapterPid"]

    step("6. A prompt for A resumes it, transparently: same id, history intact")
    narrator.chunks.clear()
    narrator.on = True
    prompt = {"sessionId": first, "prompt": [{"type": "text", "text": "are you still there?"}]}
    turn = request(gw, Method.PROMPT, prompt)
    narrator.on = False
    resumed = live_lease(env)
    line("proxy → gateway", f"stopReason {turn['result']['stopReason']}")
    check(
        any("remember 3 earlier" in c for c in narrator.chunks)
        and resumed["adapterPid"] not in (first_pid, second_pid),
        f"A resumed on a new process (pid {resumed['adapterPid']}) and remembers its 3 earlier prompts",
        f"history lost or no resume: {narrator.chunks}",
    )
    view = sessions_view(env, gw)
    check(view.get(second) == "suspended", "B was suspended for it, in turn", f"session B: {view.get(second)}")

    step("7. Bad input gets an error; the proxy keeps serving")
    line("gateway → proxy", "this is not JSON")
    gw.send_raw(b"this is not JSON\n")
    error = gw.expect(lambda m: "error" in m, timeout=15)
    line("proxy → gateway", f"error {error['error']['code']}: {error['error']['message']}")

    step("8. session/close frees A's processes; session/delete removes it for good")
    tree = [p["pid"] for p in resumed["processes"]]
    request(gw, Method.CLOSE, {"sessionId": first})
    check(
        not any(pid_alive(pid) for pid in tree) and sessions_view(env, gw).get(first) == "closed",
        f"closed: none of its {len(tree)} processes is left; it is still listed (closed), and the gateway's"
        " session/load would bring it back",
        f"still running: {[p for p in tree if pid_alive(p)]}",
    )
    request(gw, Method.DELETE, {"sessionId": first})
    check(
        first not in sessions_view(env, gw),
        "deleted: no longer listed, and no load brings it back",
        "still listed after session/delete",
    )

    step("9. The gateway goes away")
    line("gateway → proxy", "EOF on stdin")
    status = gw.close(timeout=15)
    ok(f"acp-proxy exited with status {status}")
    final = leases(env)
    running = [p["pid"] for lease in final for p in lease.get("processes", []) if pid_alive(p["pid"])]
    states = sorted({lease["state"] for lease in final})
    check(
        not running and states == ["closed"],
        f"{len(final)} leases, all closed; no process left. Session B stays suspended, resumable by the next proxy.",
        f"lease states {states}; still running: {running}",
    )

    step("10. Every turn is on record (acp-proxy tasks list, read from the state database)")
    table = subprocess.run(
        [sys.executable, "-m", "acp_proxy", "tasks", "list"], env=env, capture_output=True, text=True, check=True
    ).stdout
    for row in table.splitlines():
        print(f"      {DIM}{row}{RESET}")
    tasks = json.loads(
        subprocess.run(
            [sys.executable, "-m", "acp_proxy", "tasks", "list", "--json"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )["tasks"]
    outcomes = sorted(task["status"] for task in tasks)
    check(
        bool(tasks) and set(outcomes) == {"done", "cancelled"} and outcomes.count("cancelled") == 1,
        f"{len(tasks)} prompt turns, each with its outcome: the cancelled one too",
        f"outcomes: {outcomes}",
    )
    if keep:
        print(f"{DIM}  kept in {state}: ACP_PROXY_STATE_DIR={env['ACP_PROXY_STATE_DIR']} acp-proxy status{RESET}")
    else:
        shutil.rmtree(state, ignore_errors=True)
    print()
    return 1 if failures or status != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
