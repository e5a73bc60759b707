"""Shared sessions from ``acp-proxy serve``'s clients, and who may not attach.

A session opened by a stdio gateway is attached to by WebSocket clients of ``serve`` (a token
that sees every session), as a controller and as an observer; a token that sees only its own
sessions, and a process of another user on the holder's control socket, are refused. Real
processes on both anyio backends; nothing a test started may outlive it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_proxy.sockets import socket_path
from tests.remote_kit import HttpClient, WsClient, make_token, serve
from tests.support import TEST_INITIALIZE, Gateway, write_config

pytestmark = pytest.mark.anyio


def prompt(session_id: str, text: str) -> dict[str, Any]:
    return {"sessionId": session_id, "prompt": [{"type": "text", "text": text}]}


def chunks(messages: list[dict[str, Any]]) -> list[str]:
    return [
        m["params"]["update"]["content"]["text"]
        for m in messages
        if m.get("method") == "session/update" and m["params"]["update"].get("sessionUpdate") == "agent_message_chunk"
    ]


def attach_params(session: str, role: str, name: str, history: str = "full") -> dict[str, Any]:
    return {"sessionId": session, "role": role, "historyPolicy": history, "clientInfo": {"name": name}}


async def test_watch_and_approve_a_stdio_session_from_serve_clients(proc_env: dict[str, str], tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    cfg = write_config(tmp_path, pool={"max_live": 4}, backends={"fake": {"store": store}})
    ops = make_token(proc_env, "ops", "--sees", "all")
    mine = make_token(proc_env, "laptop")
    async with Gateway.start(proc_env, tmp_path, proxy_args=["--config", str(cfg)], store=store) as gw:
        await gw.initialize()
        session = await gw.new_session()
        assert (await gw.prompt(session, "stream 3"))["result"]["stopReason"] == "end_turn"
        opened = chunks(gw.take_updates(session))
        async with serve(proc_env, cfg) as served:
            async with WsClient.open(served.target(ops)) as phone, WsClient.open(served.target(ops)) as screen:
                for client in (phone, screen):
                    init = await client.call("initialize", TEST_INITIALIZE)
                    assert init["result"]["agentCapabilities"]["sessionCapabilities"]["attach"]["roles"] == [
                        "controller",
                        "observer",
                    ]
                watching = await screen.call("session/attach", attach_params(session, "observer", "screen"))
                assert watching["result"]["role"] == "observer"
                assert chunks(screen.updates(session)) == opened  # the full replay, in order
                taking = await phone.call("session/attach", attach_params(session, "controller", "phone", "none"))
                assert taking["result"]["role"] == "controller"

                asking = gw.new_id()
                await gw.send(
                    {
                        "jsonrpc": "2.0",
                        "id": asking,
                        "method": "session/prompt",
                        "params": prompt(session, "stream 2; permission"),
                    }
                )
                asked = await gw.expect(lambda m: m.get("method") == "session/request_permission")
                copy = await phone.wait_for(lambda m: m.get("method") == "session/request_permission")
                assert copy["params"]["toolCall"] == asked["params"]["toolCall"]
                await phone.send(
                    {"id": copy["id"], "result": {"outcome": {"outcome": "selected", "optionId": "allow"}}}
                )
                assert (await gw.response_to(asking))["result"]["stopReason"] == "end_turn"
                await gw.expect(lambda m: m.get("method") == "$/cancel_request")
                resolved = await screen.wait_for(
                    lambda m: (
                        m.get("method") == "session/update"
                        and m["params"]["update"].get("type") == "permission_resolved"
                    )
                )
                assert resolved["params"]["update"]["resolvedBy"]["name"].startswith("phone (ops over websocket")
                seen = chunks(gw.take_updates(session))
                assert seen[-1] == "permission granted"
                with anyio.fail_after(10):
                    while chunks([m for m in screen.stash if m.get("method") == "session/update"]) != seen:
                        await anyio.sleep(0.05)

                refused = await screen.call("session/prompt", prompt(session, "stream 1"))
                assert refused["error"]["data"]["reason"] == "observer"
                by_phone = await phone.call("session/prompt", prompt(session, "stream 1"))
                assert by_phone["result"]["stopReason"] == "end_turn"
                assert chunks(gw.take_updates(session)) == ["chunk 0 "]

            async with WsClient.open(served.target(mine)) as stranger:
                await stranger.call("initialize", TEST_INITIALIZE)
                denied = await stranger.call("session/attach", attach_params(session, "observer", "stranger"))
                assert denied["error"]["data"]["reason"] == "unknown_session"  # as if it did not exist
        # detach is not close: the gateway goes on
        assert (await gw.prompt(session, "stream 1"))["result"]["stopReason"] == "end_turn"


async def test_a_streamable_http_client_approves_from_its_session_stream(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """The same over HTTP/2: the attach's answer, the agent's request and the live updates on the session's stream."""
    store = str(tmp_path / "store")
    cfg = write_config(tmp_path, pool={"max_live": 4}, backends={"fake": {"store": store}})
    ops = make_token(proc_env, "ops", "--sees", "all")
    async with Gateway.start(proc_env, tmp_path, proxy_args=["--config", str(cfg)], store=store) as gw:
        await gw.initialize()
        session = await gw.new_session()
        async with serve(proc_env, cfg) as served, HttpClient.open(served.url, ops) as phone:
            assert (await phone.initialize()).status_code == 200
            await phone.open_stream()
            await phone.open_stream(session)
            attaching = await phone.request(
                "session/attach", attach_params(session, "controller", "phone", "none"), session
            )
            answer = await phone.wait_for(session, lambda m: m.get("id") == attaching)
            assert answer["result"]["role"] == "controller"
            asking = gw.new_id()
            params = prompt(session, "stream 2; permission")
            await gw.send({"jsonrpc": "2.0", "id": asking, "method": "session/prompt", "params": params})
            await gw.expect(lambda m: m.get("method") == "session/request_permission")
            ask = await phone.wait_for(session, lambda m: m.get("method") == "session/request_permission")
            reply = {"id": ask["id"], "result": {"outcome": {"outcome": "selected", "optionId": "allow"}}}
            assert (await phone.post(reply, session)).status_code == 202
            assert (await gw.response_to(asking))["result"]["stopReason"] == "end_turn"
            await phone.wait_for(session, lambda m: "permission granted" in json.dumps(m))
            assert chunks(phone.events[session]) == ["chunk 0 ", "chunk 1 "]


@pytest.mark.skipif(os.geteuid() != 0, reason="a client of another uid needs root (setuid to nobody)")
async def test_another_users_attach_is_refused(proc_env: dict[str, str], tmp_path: Path) -> None:
    """Even with every file opened up, the holder's control socket checks the peer's uid."""
    opened = Path(tempfile.mkdtemp(prefix="acp-proxy-attach-"))  # pytest's tmp dirs are private to their owner
    state = opened / "state"
    proc_env = {**proc_env, "ACP_PROXY_STATE_DIR": str(state)}
    try:
        await refused_as_nobody(proc_env, tmp_path, opened, state)
    finally:
        shutil.rmtree(opened, ignore_errors=True)


async def refused_as_nobody(proc_env: dict[str, str], tmp_path: Path, opened: Path, state: Path) -> None:
    async with Gateway.start(proc_env, tmp_path) as gw:
        await gw.initialize()
        session = await gw.new_session()
        [sock] = list((state / "control").glob("*.sock"))
        assert sock == socket_path(state, sock.stem)
        for directory in (opened, state, state / "control"):
            directory.chmod(0o755)
        sock.chmod(0o666)
        request = {"id": 1, "command": "attach", "args": {"sessionId": session, "role": "controller"}}
        script = (
            "import os, socket, sys\n"
            "os.setgid(65534); os.setuid(65534)\n"
            "s = socket.socket(socket.AF_UNIX); s.settimeout(5); s.connect(sys.argv[1])\n"
            "try:\n"
            "    s.sendall(sys.argv[2].encode() + b'\\n')\n"
            "except BrokenPipeError:\n"
            "    pass  # refused before it asked: the reason waits to be read\n"
            "print(s.recv(65536).decode())\n"
        )
        result = await anyio.run_process(
            [sys.executable, "-c", script, str(sock), json.dumps(request)], check=False, env=proc_env
        )
        assert result.returncode == 0, result.stderr
        answer = json.loads(result.stdout)
        assert answer["ok"] is False
        assert answer["error"]["code"] == "forbidden"
        assert (await gw.prompt(session, "stream 1"))["result"]["stopReason"] == "end_turn"
