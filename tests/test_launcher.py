"""``serve``'s launcher (``acp_proxy/remote/launcher.py``): each connection's proxy forked from a process that
has imported it; exec'd once the launcher has gone; nothing of either left once ``serve`` has exited."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.kit.markers import alive, start_ticks
from tests.remote_kit import WsClient, make_token, run_cli, serve
from tests.support import TEST_INITIALIZE, write_config

NEW = {"cwd": "/tmp", "mcpServers": []}


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def proxies(env: dict[str, str]) -> list[tuple[str, int]]:
    """Each connection's proxy and the principal it serves, as ``acp-proxy status`` shows them."""
    [server] = json.loads(run_cli(env, "status", "--json").stdout)["servers"]
    return [(c["principal"], c["proxyPid"]) for c in server["connections"] if c["proxyPid"]]


async def proxies_until(env: dict[str, str], count: int) -> list[tuple[str, int]]:
    """``proxies`` once there are ``count`` (serve writes its status file a moment after a change)."""
    with anyio.fail_after(20):
        while len(found := proxies(env)) != count:
            await anyio.sleep(0.05)
    return found


async def a_turn(client: WsClient, text: str) -> dict[str, Any]:
    session = (await client.call("session/new", NEW))["result"]["sessionId"]
    prompt = {"sessionId": session, "prompt": [{"type": "text", "text": text}]}
    return await client.call("session/prompt", prompt)


@pytest.mark.anyio
async def test_proxies_are_forked_by_the_launcher_then_execd_once_it_is_gone(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    config = write_config(tmp_path, pool={"max_live": 4}, backends={"fake": {"store": str(tmp_path / "store")}})
    log = tmp_path / "serve.log"
    laptop, phone = make_token(proc_env, "laptop"), make_token(proc_env, "phone")
    async with serve(proc_env, config, log=log) as served:
        async with WsClient.open(served.target(laptop)) as first:
            await first.call("initialize", TEST_INITIALIZE)
            [(_, forked)] = await proxies_until(proc_env, 1)
            launcher = parent_of(forked)
            assert launcher != served.process.pid
            assert parent_of(launcher) == served.process.pid
            assert (await a_turn(first, "hello"))["result"]["stopReason"] == "end_turn"
            watched = [(pid, start_ticks(pid)) for pid in (launcher, forked)]

            # Killed by someone: the proxy it forked serves on; the next connection's proxy is exec'd by serve.
            os.kill(launcher, signal.SIGKILL)
            async with WsClient.open(served.target(phone)) as second:
                await second.call("initialize", TEST_INITIALIZE)
                execd = dict(await proxies_until(proc_env, 2))["phone"]
                assert parent_of(execd) == served.process.pid
                assert (await a_turn(second, "hello"))["result"]["stopReason"] == "end_turn"
                assert (await a_turn(first, "again"))["result"]["stopReason"] == "end_turn"
            watched.append((execd, start_ticks(execd)))
        await proxies_until(proc_env, 0)  # the first connection's proxy ends with it, read without a launcher
        assert not alive(forked, dict(watched)[forked])
    assert served.process.returncode == 0
    assert [pid for pid, ticks in watched if alive(pid, ticks)] == []
    assert "each connection's proxy is exec'd from now on" in log.read_text()


@pytest.mark.anyio
async def test_serve_ends_its_launcher_and_every_proxy_it_forked(proc_env: dict[str, str], tmp_path: Path) -> None:
    config = write_config(tmp_path, pool={"max_live": 4}, backends={"fake": {"store": str(tmp_path / "store")}})
    token = make_token(proc_env, "laptop")
    async with serve(proc_env, config) as served:
        clients = [WsClient.open(served.target(token)) for _ in range(3)]
        async with clients[0] as one, clients[1] as two, clients[2] as three:
            for client in (one, two, three):
                await client.call("initialize", TEST_INITIALIZE)
            assert (await a_turn(two, "hello"))["result"]["stopReason"] == "end_turn"
            forked = [pid for _, pid in await proxies_until(proc_env, 3)]
            [launcher] = {parent_of(pid) for pid in forked}
            watched = [(pid, start_ticks(pid)) for pid in (launcher, *forked)]
            served.process.send_signal(signal.SIGTERM)  # with every connection still open
            with anyio.fail_after(40):
                await served.process.wait()
    assert served.process.returncode == 0
    assert [pid for pid, ticks in watched if alive(pid, ticks)] == []
