"""The kit's client and marker scanner, against the fake adapter run directly (no proxy in between).

Both faces of the client are driven the same way: ids from the counter, answers matched
to requests, updates kept per session, agent requests answered by the handler (or left
for the caller), ``$/cancel_request``, a timeout on every wait, and a close that ends
even an adapter that ignores EOF.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest

from tests.kit import markers, proctree
from tests.kit.gateway import Closed, Gateway, RpcError, SyncGateway
from tests.support import MARKER_VARIABLE, fake_command

ALLOW = {"result": {"outcome": {"outcome": "selected", "optionId": "allow"}}}


def seen(gw: Any) -> list[tuple[str, Any]]:
    """(direction, id or method) of every message, in the order the observer saw them."""
    log: list[tuple[str, Any]] = []
    gw.observers.append(lambda direction, msg: log.append((direction, msg.get("method", msg.get("id")))))
    return log


@pytest.mark.anyio
async def test_async_requests_updates_agent_requests_and_cancel(proc_env: dict[str, str]) -> None:
    async with Gateway.launch(fake_command(), env=proc_env) as gw:
        log = seen(gw)
        initialized = await gw.request("initialize", {"protocolVersion": 1})
        assert initialized["id"] == 0, "the counter starts at 0"
        session = await gw.new_session()
        assert (await gw.prompt(session, "stream 3"))["result"]["stopReason"] == "end_turn"
        assert len(gw.updates(session)) == 3
        assert len(gw.take_updates(session)) == 3
        assert gw.updates() == []
        # The handler answers the agent's requests; without one, they are left for the caller.
        gw.handler = lambda msg: ALLOW if msg["method"] == "session/request_permission" else None
        assert (await gw.prompt(session, "permission"))["result"]["stopReason"] == "end_turn"
        gw.handler = None
        await gw.send({"jsonrpc": "2.0", "id": "by-hand", "method": "session/prompt", "params": {
            "sessionId": session, "prompt": [{"type": "text", "text": "permission"}]}})  # fmt: skip
        asked = await gw.expect(lambda m: m.get("method") == "session/request_permission")
        await gw.send({"jsonrpc": "2.0", "id": asked["id"], "result": {"outcome": {"outcome": "cancelled"}}})
        assert (await gw.response_to("by-hand"))["result"]["stopReason"] == "refusal"
        # Errors, $/cancel_request, and timeouts.
        with pytest.raises(RpcError) as failed:
            await gw.call("no/such_method", {})
        assert failed.value.code == -32601
        slow = gw.new_id()
        await gw.send({"jsonrpc": "2.0", "id": slow, "method": "_fake/slow", "params": {"seconds": 30}})
        await gw.cancel_request(slow)
        assert (await gw.response_to(slow))["error"]["code"] == -32800
        with pytest.raises(TimeoutError):
            await gw.request("_fake/slow", {"seconds": 30}, timeout=0.2)
        with pytest.raises(TimeoutError):
            await gw.expect(lambda m: False, timeout=0.1)
        assert ("out", "initialize") in log
        assert ("in", "session/request_permission") in log
        assert await gw.close() == 0
    assert gw.bad_lines == []


@pytest.mark.anyio
async def test_async_close_kills_what_ignores_eof_and_a_dead_peer_is_closed(proc_env: dict[str, str]) -> None:
    async with Gateway.launch(fake_command(ignore_eof=True), env=proc_env) as gw:
        await gw.request("initialize", {"protocolVersion": 1})
        started = time.monotonic()
        assert await gw.close(timeout=0.5) == -signal.SIGKILL
        assert time.monotonic() - started < 5
    async with Gateway.launch(fake_command(), env=proc_env) as gw:
        session = await gw.new_session()
        with pytest.raises(Closed):
            await gw.prompt(session, "crash 3")
        assert await gw.close() == 3
        with pytest.raises(Closed):
            await gw.notify("session/cancel", {"sessionId": session})


@pytest.mark.anyio
async def test_async_connect_wraps_given_streams(proc_env: dict[str, str]) -> None:
    async with await anyio.open_process(fake_command(), env=proc_env) as process:
        assert process.stdin is not None
        assert process.stdout is not None
        async with Gateway.connect(process.stdin, process.stdout, first_id=7) as gw:
            assert (await gw.request("_fake/echo", {"a": [1]})) == {"jsonrpc": "2.0", "id": 7, "result": {"a": [1]}}
        assert gw.gone.is_set()
        assert await process.wait() == 0


def test_sync_requests_updates_handler_raw_lines_and_close(proc_env: dict[str, str]) -> None:
    with SyncGateway.launch(fake_command(), env=proc_env, handler=lambda msg: ALLOW) as gw:
        assert gw.initialize()["protocolVersion"] == 1
        session = gw.new_session()
        assert gw.prompt(session, "stream 2; permission")["result"]["stopReason"] == "end_turn"
        said = [m["params"]["update"]["content"]["text"] for m in gw.take_updates(session)]
        assert said[-1] == "permission granted"
        assert len(said) == 3
        request_id, data = gw.request_bytes("_fake/echo", {"x": 1})
        gw.send_raw(data)
        assert gw.read_line(timeout=10) == b'{"jsonrpc":"2.0","id":%d,"result":{"x":1}}' % request_id
        with pytest.raises(RpcError):
            gw.call("no/such_method", {})
        with pytest.raises(TimeoutError):
            gw.request("_fake/slow", {"seconds": 30}, timeout=0.2)
        gw.notify("_fake/ignored", {})
        gw.drain(quiet=0.2, limit=2)
        assert gw.close() == 0
    assert b"Traceback" not in gw.stderr


def test_sync_reader_thread_keeps_an_answer_that_comes_before_it_is_asked_for(proc_env: dict[str, str]) -> None:
    gw = SyncGateway.launch(fake_command(), env=proc_env, reader_thread=True, keep=False)
    request_id = gw.send_request("_fake/echo", {"n": 7})
    deadline = time.monotonic() + 10
    while any(key[1] == request_id for key in gw._pending) and time.monotonic() < deadline:
        time.sleep(0.01)  # until the reader thread has delivered the answer
    assert not any(key[1] == request_id for key in gw._pending)
    assert gw.answer(request_id)["result"] == {"n": 7}
    with pytest.raises(KeyError):
        gw.answer(request_id)  # taken once
    gw.kill()
    assert gw.close() == -signal.SIGKILL


def test_sync_reader_thread_serves_many_threads(proc_env: dict[str, str]) -> None:
    gw = SyncGateway.launch(fake_command(), env=proc_env, reader_thread=True, keep=False)
    answers: list[Any] = []

    def echo(n: int) -> None:
        answers.append(gw.call("_fake/echo", {"n": n})["n"])

    threads = [threading.Thread(target=echo, args=(n,)) for n in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(answers) == list(range(20))
    gw.kill()
    with pytest.raises(Closed):
        gw.call("_fake/echo", {}, timeout=10)
    assert gw.close() == -signal.SIGKILL


def test_markers_find_live_marked_processes_only(proc_env: dict[str, str], tmp_path: Path) -> None:
    marker = proc_env[MARKER_VARIABLE]
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    lease = subprocess.Popen(sleeper, env={**proc_env, "ACP_PROXY_LEASE": f"{marker}.lease-1.x"})
    zombie = subprocess.Popen([sys.executable, "-c", "pass"], env=proc_env)
    try:
        deadline = time.monotonic() + 10
        while markers.start_ticks(zombie.pid) is not None and time.monotonic() < deadline:
            time.sleep(0.01)  # exited, not yet reaped: a zombie, which does not count
        found = markers.find(MARKER_VARIABLE, marker)
        assert set(found) == {lease.pid}
        assert found[lease.pid].argv == tuple(sleeper)
        trees = proctree.adapter_trees(MARKER_VARIABLE, marker)
        assert trees == {f"{marker}.lease-1.x": [found[lease.pid]]}
        assert proctree.alive_together(trees) == trees
        assert set(markers.find("ACP_PROXY_LEASE", f"{marker}.", prefix=True)) == {lease.pid}
        assert markers.find("ACP_PROXY_LEASE", f"{marker}.") == {}
        assert markers.find(MARKER_VARIABLE, marker[:-1]) == {}
        assert os.getpid() not in markers.find(MARKER_VARIABLE, marker[:4], prefix=True)
        markers.kill(found.values())
        assert lease.wait(10) == -signal.SIGKILL
        assert not markers.alive(lease.pid)
        assert proctree.alive_together(trees) == {}, "a tree whose processes all ended is not counted"
    finally:
        for process in (lease, zombie):
            if process.poll() is None:
                process.kill()
            process.wait()


def test_a_sampler_that_fails_fails_the_block() -> None:
    calls: list[float] = []

    def sample() -> None:
        calls.append(time.monotonic())
        if len(calls) == 3:
            raise OSError("unreadable")

    sampler = proctree.Every(0.01, sample, "failing").__enter__()
    while len(calls) < 3:
        time.sleep(0.01)
    with pytest.raises(proctree.SamplerFailed, match="unreadable"):
        sampler.__exit__(None, None, None)
    assert len(calls) == 3, "sampling stops at the first error"


def test_descendants_counts_the_live_processes_at_a_depth(proc_env: dict[str, str]) -> None:
    sleep = "import time; time.sleep(60)"
    script = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {sleep!r}]); {sleep}"
    parent = subprocess.Popen([sys.executable, "-c", script], env=proc_env)
    try:
        with proctree.Descendants(parent.pid, depth=1, count_root=True, seconds=0.01) as tree:
            deadline = time.monotonic() + 10
            while tree.peak_adapters < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        assert tree.peak_adapters == 1
        assert tree.peak_rss > 0
        assert tree.samples > 0
    finally:
        for child in psutil.Process(parent.pid).children():
            child.kill()
        parent.kill()
        parent.wait()


def _process_state(pid: int) -> str | None:
    """The state letter ``/proc`` gives ``pid`` (``Z``: a zombie, ended and not reaped), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
    except (FileNotFoundError, ProcessLookupError):
        return None


@pytest.mark.anyio
@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="the fork server needs pidfds (Linux 5.3 and later)")
async def test_a_forked_proxy_is_a_process_of_its_own(proc_env: dict[str, str], tmp_path: Path) -> None:
    """The fork server's proxies: their own pid, pipes, stderr and exit status; a pid that stays theirs until told."""
    from tests.kit import forked

    initialize = b'{"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {"protocolVersion": 1}}\n'
    with tempfile.TemporaryFile() as stderr:
        version = await forked.spawn(["--version"], env=proc_env, cwd=tmp_path, stderr=stderr)
        assert version.pid not in (os.getpid(), 0)
        out = b"".join([chunk async for chunk in version.stdout])
        assert await version.wait() == 0
        assert out.startswith(b"acp-proxy ")
        refused = await forked.spawn(["--log-level", "loud"], env=proc_env, cwd=tmp_path, stderr=stderr)
        assert await refused.wait() == 2, "bad input: exit status 2, as the program's own"
        stderr.seek(0)
        assert b"loud" in stderr.read()

        serving = await forked.spawn(["--", *fake_command()], env=proc_env, cwd=tmp_path, stderr=stderr)
        await serving.stdin.send(initialize)
        with anyio.fail_after(30):
            assert b'"protocolVersion"' in await serving.stdout.receive()
        assert (tmp_path / "state").is_dir(), "it ran with the environment it was given"
        serving.kill()
        with anyio.fail_after(10):
            while _process_state(serving.pid) != "Z":
                await anyio.sleep(0.01)
        await anyio.sleep(0.1)
        assert _process_state(serving.pid) == "Z", "ended, and not reaped before its requester was told"
        await serving.aclose()
        assert serving.returncode == -signal.SIGKILL
        with anyio.fail_after(10):
            while _process_state(serving.pid) is not None:
                await anyio.sleep(0.01)


JSON_VALUES: list[Any] = [
    {"jsonrpc": "2.0", "id": 7, "result": {"b": [1.5, None, True, False], "a": 'é\n"x\u2028', "n": -0.0}},
    [],
    {},
    "text",
    3,
    1e100,
    {"nested": [{"z": 1, "a": [2, {"y": None}]}]},
]


@pytest.mark.parametrize("value", JSON_VALUES)
def test_the_fake_adapters_json_writes_and_reads_as_json_does(value: Any) -> None:
    """The fake adapter avoids ``import json`` at start (tests/fake_json.py): what it writes and reads
    must be json's, with every option it uses."""
    import json

    from tests import fake_json

    every: list[dict[str, Any]] = [{}, {"sort_keys": True}, {"separators": (",", ":"), "ensure_ascii": False}]
    for options in every:
        text = json.dumps(value, **options)
        assert fake_json.dumps(value, **options) == text
        assert fake_json.loads(text) == json.loads(text)
        assert fake_json.loads(f" \n{text}\r\n".encode()) == json.loads(text)


@pytest.mark.parametrize("bad", ["", " ", "{", "[1,]", "1 2", "nul", '{"a" 1}', '"open'])
def test_the_fake_adapters_json_refuses_what_json_refuses(bad: str) -> None:
    from tests import fake_json

    with pytest.raises(ValueError):  # noqa: PT011 - json's own error is a ValueError too
        fake_json.loads(bad)
    with pytest.raises(TypeError):
        fake_json.dumps({"a": object()})
