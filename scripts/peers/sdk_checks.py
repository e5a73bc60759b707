"""sdk-prompt-turn[-trio]: the SDK client and the SDK agent, the wire messages on both sides of the
proxy compared (the -trio variant runs the proxy on trio).

Both programs (``sdk_agent.py``, ``sdk_client.py``) record every wire message they see or send
(the SDK's stream observers), so the direct run and the proxied run are compared message by
message on both sides of the proxy.
"""

from __future__ import annotations

import json
from pathlib import Path

from .harness import PROGRAMS, Peers, run_command
from .report import CheckFailed
from .wire import add_served_capabilities, first_difference, label_ids, pop_proxy_meta, short, strip_proxy_meta


def prompt_turn(peers: Peers, name: str, proxy_options: tuple[str, ...] = ()) -> str:
    results = {}
    for mode in ("direct", "proxy"):
        stem = peers.logs / f"{name}-{mode}"
        for suffix in (".client.jsonl", ".agent.jsonl", ".stderr"):
            Path(f"{stem}{suffix}").unlink(missing_ok=True)
        env, marker = peers.runs.env(f"{name}-{mode}", PEER_AGENT_TRANSCRIPT=f"{stem}.agent.jsonl")
        agent = peers.sdk_agent()
        if mode == "proxy":
            agent = [*peers.proxy, *proxy_options, "--", *agent]
        argv = [
            str(peers.venv_python),
            str(PROGRAMS / "sdk_client.py"),
            f"{stem}.client.jsonl",
            f"{stem}.stderr",
            "--",
            *agent,
        ]
        rc, out = run_command(argv, env, Path(f"{stem}.stderr"), timeout=120, cwd=peers.ws)
        if rc != 0:
            raise CheckFailed(f"{mode}: the SDK client failed (exit {rc}); see {stem}.stderr")
        summary = json.loads(out.strip().splitlines()[-1])
        if mode == "proxy" and pop_proxy_meta({"result": summary["initialize"]}) is None:
            raise CheckFailed("proxied initialize result lacks _meta['acp-proxy']")
        add_served_capabilities(summary["initialize"], mode == "proxy", f"{mode} SDK client")
        if summary["exit_status"] != 0:
            raise CheckFailed(
                f"{mode}: the agent command exited {summary['exit_status']} after stdin "
                f"closed ({summary['exit_seconds']}s; negative: killed by the SDK client)"
            )
        expected = {
            "turn": {"_meta": {"pong": {"pong": {"session": "sdk-session-1"}}}, "stopReason": "end_turn"},
            "cancelled_turn": {"stopReason": "cancelled"},
            "permission_requests": 1,
        }
        for key, want in expected.items():
            if summary[key] != want:
                raise CheckFailed(f"{mode}: {key} was {short(summary[key])}, expected {short(want)}")
        peers.check_leftovers(name, mode, marker)
        results[mode] = summary
        for side in ("client", "agent"):
            entries = [json.loads(line) for line in Path(f"{stem}.{side}.jsonl").read_text().splitlines()]
            results[f"{mode}-{side}"] = entries
    for side in ("client", "agent"):
        direct = label_ids(results[f"direct-{side}"])
        proxied = label_ids(results[f"proxy-{side}"])
        for direction in ("incoming", "outgoing"):
            # Only the client's incoming side may carry the proxy's annotation.
            annotated = side == "client" and direction == "incoming"
            strip_proxy_meta(direct[direction], False, f"direct {side} {direction}")
            strip_proxy_meta(proxied[direction], annotated, f"proxied {side} {direction}")
            diff = first_difference(direct[direction], proxied[direction])
            if diff:
                raise CheckFailed(f"{side} {direction} messages differ, {diff}")
    for key in ("exit_seconds",):
        results["direct"].pop(key)
        results["proxy"].pop(key)
    diff = first_difference([results["direct"]], [results["proxy"]])
    if diff:
        raise CheckFailed(f"SDK client results differ: {diff}")
    count = len(results["proxy-client"])
    updates = len(results["proxy"]["updates"])
    return (
        f"{count} messages seen by the client and by the agent, identical direct and proxied "
        f"(ids aside); {updates} session/update, permission round trip, extension calls, "
        f"a 2 MiB chunk, method-not-found and a cancelled turn all relayed"
    )


def prompt_turn_on_trio(peers: Peers, name: str) -> str:
    """``prompt_turn`` with the proxy on trio."""
    return prompt_turn(peers, name, proxy_options=("--async-backend", "trio"))
