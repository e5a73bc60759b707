"""``serve``'s launcher (``acp_proxy/remote/launcher.py``): each connection's proxy forked from a process that
has imported it; exec'd once the launcher has gone; nothing of either left once ``serve`` has exited."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_proxy.ownership.proctable import default_table
from acp_proxy.remote.launcher import LaunchedProxy, Launcher, LauncherGone
from tests.kit.markers import alive, start_ticks
from tests.remote_kit import WsClient, make_token, run_cli, serve
from tests.support import TEST_INITIALIZE, write_config

NEW = {"cwd": "/tmp", "mcpServers": []}


def parent_of(pid: int) -> int:
    info = default_table().info(pid)
    assert info is not None, f"pid {pid} is not running"
    return info.ppid


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


# --- serve's end of the channel, against a launcher played by the test (no fork) -------------------


class PlayedLauncher:
    """The launcher's end of a ``Launcher``'s channel, played in-process: it takes requests and says what the
    test tells it to."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        self.launcher = Launcher(os.getpid(), ours)
        self.channel = theirs

    def take(self) -> tuple[dict[str, Any], list[int]]:
        """The next request and its descriptors (the child's stdin, its stdout, the report socket)."""
        request, fds, _, _ = socket.recv_fds(self.channel, 1 << 20, 3)
        return json.loads(request), fds


async def taken(played: PlayedLauncher) -> tuple[dict[str, Any], list[int]]:
    await anyio.wait_readable(played.channel)
    return played.take()


@pytest.mark.anyio
async def test_a_launch_hands_over_the_pipes_and_the_environment_and_reads_the_exit_status() -> None:
    played = PlayedLauncher()
    async with anyio.create_task_group() as tasks:
        launched: list[LaunchedProxy] = []

        async def launch() -> None:
            launched.append(await played.launcher.launch({"ACP_PROXY_CLIENT": "laptop"}))

        tasks.start_soon(launch)
        request, (stdin, stdout, report) = await taken(played)
        assert request == {"env": {"ACP_PROXY_CLIENT": "laptop"}}
        os.write(report, f"pid {os.getpid()}\n".encode())
    [proxy] = launched
    assert proxy.pid == os.getpid()
    await proxy.stdin.send(b"to the proxy\n")
    assert os.read(stdin, 100) == b"to the proxy\n"
    os.write(stdout, b"from the proxy\n")
    assert await proxy.stdout.receive() == b"from the proxy\n"
    os.write(report, b"exit 3\n")
    assert await proxy.wait() == 3
    assert proxy.pidfd == -1, "the status read, the pidfd is let go"
    assert os.read(report, 10) == b"", "and the launcher may reap it: hung up"
    await proxy.aclose()
    assert os.read(stdin, 10) == b"", "its stdin closed"
    for fd in (stdin, stdout, report):
        os.close(fd)


@pytest.mark.anyio
async def test_a_launcher_that_hangs_up_is_gone_and_a_proxy_it_forked_is_waited_for_through_its_pidfd(
    proc_env: dict[str, str],
) -> None:
    played = PlayedLauncher()
    sleeper = await anyio.open_process(["/bin/sleep", "0.3"], env=proc_env)  # the proxy the launcher forked
    try:
        async with anyio.create_task_group() as tasks:
            launched: list[LaunchedProxy] = []

            async def launch() -> None:
                launched.append(await played.launcher.launch({}))

            tasks.start_soon(launch)
            _, (stdin, stdout, report) = await taken(played)
            os.write(report, f"pid {sleeper.pid}\n".encode())
        os.close(report)  # the launcher dies before the proxy has ended: no exit line will come
        with anyio.fail_after(10):
            assert await launched[0].wait() == -1, "ended, its status gone to whoever reaped it"
        assert await sleeper.wait() == 0, "it had ended, of itself"
        await launched[0].aclose()
        for fd in (stdin, stdout):
            os.close(fd)

        async def hang_up() -> None:  # the next launch: the launcher goes before it forks
            _, fds = await taken(played)
            for fd in fds:
                os.close(fd)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(hang_up)
            with pytest.raises(LauncherGone):
                await played.launcher.launch({})
        assert played.launcher.gone
        with pytest.raises(LauncherGone, match="has gone"):  # and every launch after it, at once
            await played.launcher.launch({})
    finally:
        with contextlib.suppress(ProcessLookupError):
            sleeper.kill()
        await sleeper.wait()


@pytest.mark.anyio
async def test_a_launch_waits_for_room_in_a_full_channel_and_one_cancelled_lets_its_pipes_go() -> None:
    played = PlayedLauncher()
    filler = 0
    with contextlib.suppress(BlockingIOError):
        while True:  # what a burst of connections would leave unread in the channel
            played.launcher._channel.send(b"x" * 4096)
            filler += 1
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(played.launcher.launch, {"N": "1"})
        await anyio.sleep(0.1)
        for _ in range(filler):  # the launcher reads: the waiting launch goes out
            await anyio.wait_readable(played.channel)
            played.channel.recv(1 << 16)
        request, (stdin, stdout, report) = await taken(played)
        assert request == {"env": {"N": "1"}}
        tasks.cancel_scope.cancel()  # the connection ends before the launcher says it forked
    assert not played.launcher.gone
    for fd in (stdin, report):
        os.set_blocking(fd, False)  # EOF now, or a failure (not a wait)
    assert os.read(stdin, 10) == b"", "a proxy forked for it meanwhile would read EOF and exit"
    assert os.read(report, 10) == b"", "and the launcher reap it"
    for fd in (stdin, stdout, report):
        os.close(fd)
