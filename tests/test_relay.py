"""The proxy as a transparent relay between a real gateway connection and a real adapter.

Each test runs the proxy as a subprocess on the test's anyio backend, in front of
the scriptable fake adapter. Everything the proxy writes on either connection is
validated against the ACP schema (see ``support.Gateway``), and no process the
test started may outlive it (see ``conftest.proc_env``).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.support import Gateway, adapter_calls, pid_alive, survivors

pytestmark = pytest.mark.anyio


def allow(request: dict[str, Any]) -> dict[str, Any]:
    assert request["method"] == "session/request_permission"
    return {"result": {"outcome": {"outcome": "selected", "optionId": "allow"}}}


async def test_initialize_is_relayed_with_proxy_meta(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with Gateway.start(
        proc_env, tmp_path, caps={"loadSession": True, "promptCapabilities": {"image": True}}
    ) as gw:
        response = await gw.initialize(request_id=0)
        assert response["id"] == 0
        result = response["result"]
        assert result["agentCapabilities"] == {
            "loadSession": True,
            "promptCapabilities": {"image": True},
            # served by the proxy: close, list, delete, status and attach always, resume because the adapter can load
            "sessionCapabilities": {
                "close": {},
                "list": {},
                "delete": {},
                "resume": {},
                "status": {},
                "attach": {"roles": ["controller", "observer"]},
            },
        }
        assert result["agentInfo"]["name"] == "fake-adapter"
        assert result["_meta"]["acp-proxy"]["version"]
        record = gw.adapter_record()
        sent = json.loads(record[0]["in"])
        assert sent["method"] == "initialize"
        assert sent["params"]["clientInfo"] == {"name": "test-gateway", "version": "1.0"}


REQUEST_IDS = [0, 1, -7, 2**53, "0", "", "req-é", None]


async def test_request_ids_round_trip_exactly(proc_env: dict[str, str], tmp_path: Path) -> None:
    """Every kind of id the gateway may use comes back exactly as sent (one proxy, one id at a time)."""
    async with Gateway.start(proc_env, tmp_path) as gw:
        await gw.initialize()
        for request_id in REQUEST_IDS:
            response = await gw.request("_fake/echo", {"n": 1}, request_id=request_id)
            assert response == {"jsonrpc": "2.0", "id": request_id, "result": {"n": 1}}, f"id {request_id!r}"


async def test_proxy_ids_never_collide_with_gateway_ids(proc_env: dict[str, str], tmp_path: Path) -> None:
    """Several in-flight requests with ids the adapter itself might use all come back right."""
    async with Gateway.start(proc_env, tmp_path) as gw:
        await gw.initialize(request_id=0)
        for request_id in (0, 1, 2, "1"):
            await gw.send({"jsonrpc": "2.0", "id": request_id, "method": "_fake/slow", "params": {"seconds": 0.2}})
        answers = [await gw.response_to(request_id) for request_id in ("1", 2, 1, 0)]
        assert [a["result"] for a in answers] == [{"slept": 0.2}] * 4
        adapter_ids = [json.loads(e["in"]).get("id") for e in gw.adapter_record() if "in" in e]
        assert len(set(map(repr, adapter_ids))) == len(adapter_ids), "the adapter saw a duplicate id"


async def test_streamed_updates_pass_byte_for_byte(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with Gateway.start(proc_env, tmp_path) as gw:
        await gw.initialize()
        session = await gw.new_session()
        response = await gw.prompt(session, "stream 500; ext")
        assert response["result"] == {"stopReason": "end_turn"}
        written = [e["out"] for e in gw.adapter_record() if "out" in e and '"method"' in e["out"]]
        relayed = [json.dumps(m, separators=(",", ":"), ensure_ascii=False) for m in gw.received if "method" in m]
        assert len(written) == 501
        assert relayed == written


async def test_extension_methods_and_meta_pass_unchanged(proc_env: dict[str, str], tmp_path: Path) -> None:
    params = {
        "text": "héllo \u2028 wörld",
        "nested": [1, 2.5, None, {"k": True}],
        "_meta": {"traceparent": "00-4bf9-01"},
    }
    async with Gateway.start(proc_env, tmp_path) as gw:
        await gw.initialize()
        raw_params = '{"text": "h\\u00e9llo", "_meta": {"traceparent": "00-4bf9-01", "x": [1, 2]}}'
        await gw.send_raw(('{"jsonrpc":"2.0","id":5,"method":"_fake/echo","params":' + raw_params + "}\n").encode())
        echoed = await gw.response_to(5)
        assert echoed["result"] == json.loads(raw_params)
        forwarded = [json.loads(e["in"]) for e in gw.adapter_record() if "in" in e and "_fake/echo" in e["in"]]
        assert forwarded[0]["params"] == json.loads(raw_params)
        assert raw_params in [e["in"] for e in gw.adapter_record() if "in" in e][-1]
        response = await gw.request("_fake/echo", params)
        assert response["result"] == params
        await gw.notify("_fake/hint", {"_meta": {"a": 1}})
        session = await gw.new_session()
        await gw.notify("session/set_model", {"sessionId": session, "modelId": "m"})
        await gw.request("_fake/echo", {})  # a round trip: the notifications have arrived
        lines = [e["in"] for e in gw.adapter_record() if "in" in e]
        assert '{"jsonrpc":"2.0","method":"_fake/hint","params":{"_meta":{"a":1}}}' in lines  # as the gateway wrote it
        assert any('"session/set_model"' in line for line in lines)


async def test_unknown_method_error_comes_from_the_adapter(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with Gateway.start(proc_env, tmp_path) as gw:
        await gw.initialize()
        response = await gw.request("no/such_method", {})
        assert response["error"]["code"] == -32601
        assert "no/such_method" in response["error"]["message"]


async def test_permission_request_is_routed_both_ways(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with Gateway.start(proc_env, tmp_path) as gw:
        await gw.initialize()
        session = await gw.new_session()
        await gw.send(
            {
                "jsonrpc": "2.0",
                "id": 77,
                "method": "session/prompt",
                "params": {"sessionId": session, "prompt": [{"type": "text", "text": "permission"}]},
            }
        )
        asked = await gw.expect(lambda m: m.get("method") == "session/request_permission")
        assert asked["params"]["sessionId"] == session
        await gw.send_raw(json.dumps({"jsonrpc": "2.0", "id": asked["id"], **allow(asked)}).encode() + b"\n")
        done = await gw.response_to(77)
        assert done["result"]["stopReason"] == "end_turn"
        texts = [m["params"]["update"]["content"]["text"] for m in gw.stashed("session/update")]
        assert "permission granted" in texts
        adapter_asked = [json.loads(e["out"]) for e in gw.adapter_record() if "request_permission" in e.get("out", "")]
        answered = [json.loads(e["in"]) for e in gw.adapter_record() if '"outcome"' in e.get("in", "")]
        assert answered[0]["id"] == adapter_asked[0]["id"] != asked["id"]


async def test_fs_read_is_routed_to_the_gateway(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with Gateway.start(proc_env, tmp_path) as gw:
        gw.handler = lambda m: {"result": {"content": "file body: " + m["params"]["path"]}}
        await gw.initialize()
        session = await gw.new_session()
        response = await gw.prompt(session, "read /etc/motd")
        assert response["result"]["stopReason"] == "end_turn"
        texts = [m["params"]["update"]["content"]["text"] for m in gw.stashed("session/update")]
        assert "file body: /etc/motd" in texts


async def test_agent_requests_from_parallel_turns_get_distinct_upstream_ids(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with Gateway.start(proc_env, tmp_path) as gw:
        await gw.initialize()
        sessions = [await gw.new_session() for _ in range(3)]
        for n, session in enumerate(sessions):
            await gw.send(
                {
                    "jsonrpc": "2.0",
                    "id": f"turn-{n}",
                    "method": "session/prompt",
                    "params": {"sessionId": session, "prompt": [{"type": "text", "text": "permission"}]},
                }
            )
        asks = [await gw.expect(lambda m: m.get("method") == "session/request_permission") for _ in sessions]
        assert len({a["id"] for a in asks}) == 3
        for ask in reversed(asks):
            await gw.send_raw(json.dumps({"jsonrpc": "2.0", "id": ask["id"], **allow(ask)}).encode() + b"\n")
        for n in range(3):
            assert (await gw.response_to(f"turn-{n}"))["result"]["stopReason"] == "end_turn"


async def test_gateway_cancel_request_reaches_the_adapter_under_its_id(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with Gateway.start(proc_env, tmp_path) as gw:
        await gw.initialize()
        await gw.send({"jsonrpc": "2.0", "id": "slow-1", "method": "_fake/slow", "params": {"seconds": 30}})
        await anyio.sleep(0.2)
        await gw.notify("$/cancel_request", {"requestId": "slow-1", "_meta": {"why": "user"}})
        response = await gw.response_to("slow-1")
        assert response["error"]["code"] == -32800
        sent = [json.loads(e["in"]) for e in gw.adapter_record() if "in" in e]
        slow = next(m for m in sent if m.get("method") == "_fake/slow")
        cancel = next(m for m in sent if m.get("method") == "$/cancel_request")
        assert cancel["params"] == {"requestId": slow["id"], "_meta": {"why": "user"}}


async def test_adapter_cancel_request_reaches_the_gateway_under_its_id(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with Gateway.start(proc_env, tmp_path) as gw:
        await gw.initialize()
        session = await gw.new_session()
        await gw.send(
            {
                "jsonrpc": "2.0",
                "id": 9,
                "method": "session/prompt",
                "params": {"sessionId": session, "prompt": [{"type": "text", "text": "ask_then_cancel"}]},
            }
        )
        asked = await gw.expect(lambda m: m.get("method") == "session/request_permission")
        withdrawn = await gw.expect(lambda m: m.get("method") == "$/cancel_request")
        assert withdrawn["params"] == {"requestId": asked["id"]}
        await gw.send_raw(
            json.dumps(
                {"jsonrpc": "2.0", "id": asked["id"], "error": {"code": -32800, "message": "cancelled"}}
            ).encode()
            + b"\n"
        )
        assert (await gw.response_to(9))["result"]["stopReason"] == "end_turn"
        texts = [m["params"]["update"]["content"]["text"] for m in gw.stashed("session/update")]
        assert any('"code": -32800' in t for t in texts)


async def test_session_cancel_ends_the_turn_and_keeps_the_adapter(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with Gateway.start(proc_env, tmp_path) as gw:
        await gw.initialize()
        session = await gw.new_session()
        pids = (await gw.request("_fake/pids"))["result"]
        await gw.send(
            {
                "jsonrpc": "2.0",
                "id": 3,
                "method": "session/prompt",
                "params": {"sessionId": session, "prompt": [{"type": "text", "text": "wait_cancel"}]},
            }
        )
        await gw.expect(lambda m: m.get("method") == "session/update")
        await gw.notify("session/cancel", {"sessionId": session})
        assert (await gw.response_to(3))["result"]["stopReason"] == "cancelled"
        assert pid_alive(pids["adapter"])
        again = await gw.prompt(session, "stream 2")
        assert again["result"]["stopReason"] == "end_turn"


# --- bad input ---------------------------------------------------------------------------


async def test_bad_gateway_input_gets_errors_and_serving_continues(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with Gateway.start(proc_env, tmp_path) as gw:
        await gw.initialize()
        cases: list[tuple[bytes, int, Any]] = [
            (b"this is not json", -32700, None),
            (b'{"jsonrpc":"2.0","id":4,"method":', -32700, None),
            (b"[1, 2, 3]", -32600, None),
            (b'"just a string"', -32600, None),
            (b'{"jsonrpc":"2.0","id":7}', -32600, 7),
            (b'{"jsonrpc":"2.0","id":8,"method":"x","result":{}}', -32600, 8),
            (b'{"jsonrpc":"2.0","id":1.5,"method":"x"}', -32600, None),
            (b'{"jsonrpc":"2.0","id":{"a":1},"method":"x"}', -32600, None),
            (b'{"jsonrpc":"2.0","method":42}', -32600, None),
            (b'{"jsonrpc":"2.0","id":"s","result":1,"error":{"code":1,"message":"m"}}', -32600, "s"),
            (b"\xff\xfe not utf-8", -32700, None),
        ]
        for line, code, expected_id in cases:
            await gw.send_raw(line + b"\n")
            error = await gw.expect(lambda m: "error" in m and "method" not in m)
            assert error["error"]["code"] == code, line
            assert error["id"] == expected_id, line
            assert (await gw.request("_fake/echo", {"ok": True}))["result"] == {"ok": True}
        await gw.send_raw(b"\n   \n\r\n")  # blank lines are ignored, not errors
        assert (await gw.request("_fake/echo", {"still": "serving"}))["result"] == {"still": "serving"}
        assert gw.stashed() == []


async def test_overlong_line_is_discarded_with_an_error(proc_env: dict[str, str], tmp_path: Path) -> None:
    config = tmp_path / "small.toml"
    config.write_text('max_line_bytes = 4096\n[backends.fake]\ncommand = ["unused"]\n')
    async with Gateway.start(proc_env, tmp_path, proxy_args=["--config", str(config)]) as gw:
        await gw.initialize()
        big = {"jsonrpc": "2.0", "id": 50, "method": "_fake/echo", "params": {"blob": "x" * 100_000}}
        await gw.send_raw(json.dumps(big).encode() + b"\n")
        error = await gw.expect(lambda m: "error" in m)
        assert error["id"] is None
        assert error["error"]["data"] == {"reason": "line_too_long", "maxLineBytes": 4096}
        assert (await gw.request("_fake/echo", {"small": 1}))["result"] == {"small": 1}
        assert not any("blob" in e.get("in", "") for e in gw.adapter_record())


async def test_adapter_stdout_noise_is_skipped_not_forwarded(proc_env: dict[str, str], tmp_path: Path) -> None:
    noise = ["Loading model...", "{not json", "[1,2]", '{"no":"method or id"}']
    async with Gateway.start(proc_env, tmp_path, noise=noise) as gw:
        response = await gw.initialize()
        assert response["result"]["agentInfo"]["name"] == "fake-adapter"
        await gw.request("_fake/echo", {})
        assert gw.stashed() == []
    assert b"Loading model..." in gw.stderr


# --- processes ---------------------------------------------------------------------------


async def test_adapter_crash_answers_every_request_in_flight(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with Gateway.start(proc_env, tmp_path) as gw:
        await gw.initialize()
        session = await gw.new_session()
        await gw.send({"jsonrpc": "2.0", "id": "slow", "method": "_fake/slow", "params": {"seconds": 30}})
        # Requests are independent: the proxy may route the prompt first. In flight means with the adapter.
        with anyio.fail_after(10):
            while not adapter_calls(gw, "_fake/slow"):
                await anyio.sleep(0.01)
        crashed = await gw.prompt(session, "stream 3; crash 3")
        slow = await gw.response_to("slow")
        for response in (crashed, slow):
            assert response["error"]["code"] == -32603
            assert response["error"]["data"]["reason"] == "adapter_exited"
            assert response["error"]["data"]["exitStatus"] == 3
        # Nothing is lost for good: the session resumes on a new process, other requests get one too.
        assert (await gw.prompt(session, "stream 1"))["result"]["stopReason"] == "end_turn"
        assert (await gw.request("_fake/echo", {"n": 2}))["result"] == {"n": 2}


async def test_an_adapter_that_closes_its_output_but_lives_is_stopped_not_reused(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """A broken connection: its stdout closed while the process runs. What it owed is answered, the
    process is stopped (it would never answer again), and the session resumes on a new one."""
    async with Gateway.start(proc_env, tmp_path) as gw:
        await gw.initialize()
        session = await gw.new_session()
        broken = (await gw.request("_fake/pids"))["result"]["adapter"]
        answer = await gw.prompt(session, "stream 1; close_stdout")
        assert answer["error"]["data"]["reason"] == "adapter_exited"
        assert await survivors([broken]) == []
        assert (await gw.prompt(session, "stream 1"))["result"]["stopReason"] == "end_turn"
        assert (await gw.request("_fake/pids"))["result"]["adapter"] != broken
    assert f"adapter pid={broken} closed its output but still runs" in gw.stderr.decode()


async def test_spawn_failure_is_an_error_not_a_hang(proc_env: dict[str, str], tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-adapter")
    async with Gateway.start(proc_env, tmp_path, [missing, "--flag"]) as gw:
        for attempt in range(2):
            response = await gw.initialize(request_id=attempt)
            assert response["error"]["code"] == -32603
            assert response["error"]["data"]["reason"] == "spawn_failed"
            assert "no-such-adapter" in response["error"]["message"]
        assert await gw.close() == 0


async def test_gateway_eof_stops_the_adapter_and_its_children(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with Gateway.start(proc_env, tmp_path) as gw:
        await gw.initialize()
        session = await gw.new_session()
        await gw.prompt(session, "spawn_tree")
        pids = (await gw.request("_fake/pids"))["result"]
        assert all(pid_alive(p) for p in [pids["adapter"], *pids["children"]])
        assert await gw.close() == 0
    assert not any(pid_alive(p) for p in [pids["adapter"], *pids["children"]])
    assert b"still running after stdin EOF" not in gw.stderr, "a cooperative adapter got SIGTERM"


@pytest.mark.parametrize(
    "behaviour",
    [{"ignore_eof": True}, {"ignore_eof": True, "ignore_sigterm": True}],
    ids=["ignores-eof", "ignores-eof-and-sigterm"],
)
async def test_stubborn_adapter_is_still_stopped(
    proc_env: dict[str, str], tmp_path: Path, behaviour: dict[str, bool]
) -> None:
    config = tmp_path / "fast.toml"
    config.write_text('[shutdown]\nstdin_grace = "200ms"\nterm_grace = "300ms"\n[backends.x]\ncommand = ["x"]\n')
    async with Gateway.start(proc_env, tmp_path, proxy_args=["--config", str(config)], **behaviour) as gw:
        await gw.initialize()
        session = await gw.new_session()
        await gw.prompt(session, "spawn_tree")
        pids = (await gw.request("_fake/pids"))["result"]
        assert await gw.close() == 0
    assert not any(pid_alive(p) for p in [pids["adapter"], *pids["children"]])
    assert b"still running after stdin EOF: SIGTERM sent" in gw.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
async def test_signal_answers_in_flight_and_exits_zero(
    proc_env: dict[str, str], tmp_path: Path, sig: signal.Signals
) -> None:
    async with Gateway.start(proc_env, tmp_path) as gw:
        await gw.initialize()
        session = await gw.new_session()
        await gw.prompt(session, "spawn_tree")
        pids = (await gw.request("_fake/pids"))["result"]
        await gw.send({"jsonrpc": "2.0", "id": "pending", "method": "_fake/slow", "params": {"seconds": 30}})
        await anyio.sleep(0.2)
        gw.signal(sig)
        response = await gw.response_to("pending")
        assert response["error"]["code"] == -32800
        assert response["error"]["data"]["reason"] == "proxy_shutdown"
        with anyio.fail_after(10):
            assert await gw.process.wait() == 0
    assert not any(pid_alive(p) for p in [pids["adapter"], *pids["children"]])


@pytest.mark.parametrize("ending", ["eof", "sigterm"])
@pytest.mark.parametrize("advertised", [True, False], ids=["close-advertised", "close-not-advertised"])
async def test_shutdown_closes_open_sessions_first(
    proc_env: dict[str, str], tmp_path: Path, ending: str, advertised: bool
) -> None:
    """DESIGN §4 teardown: session/close for each open session, if advertised, before stdin EOF.

    The gateway's own ``session/close`` is served by the proxy (it answers ``{}`` and reaps);
    the adapter hears of it only if it advertises ``close``.
    """
    caps: dict[str, Any] = {"loadSession": True}
    if advertised:
        caps["sessionCapabilities"] = {"close": {}}
    async with Gateway.start(proc_env, tmp_path, caps=caps) as gw:
        await gw.initialize()
        sessions = [await gw.new_session() for _ in range(3)]
        assert (await gw.request("session/close", {"sessionId": sessions[0]}))["result"] == {}
        if ending == "eof":
            assert await gw.close() == 0
        else:
            gw.signal(signal.SIGTERM)
            with anyio.fail_after(10):
                assert await gw.process.wait() == 0
    # Each session has its own process: each process is told session/close once, for its session.
    closes = [e["pid"] for e in gw.adapter_record() if '"session/close"' in e.get("in", "")]
    if advertised:
        assert len(closes) == len(sessions), "each session is closed once: the gateway's, then the others"
        assert len(set(closes)) == len(sessions), "each by its own process"
    else:
        assert closes == []


async def test_signal_while_the_gateway_is_not_reading_still_stops_everything(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """A gateway that stops reading must not hold the teardown hostage (bounded shutdown writes)."""
    async with Gateway.start(proc_env, tmp_path) as gw:
        await gw.initialize()
        session = await gw.new_session()
        pids = (await gw.request("_fake/pids"))["result"]
        gw.pause_reading()
        prompt = [{"type": "text", "text": "stream 20000; sleep 30"}]
        params = {"sessionId": session, "prompt": prompt}
        await gw.send({"jsonrpc": "2.0", "id": "flood", "method": "session/prompt", "params": params})
        await anyio.sleep(1.0)  # the proxy's stdout pipe is full by now
        gw.signal(signal.SIGTERM)
        with anyio.fail_after(15):
            assert await gw.process.wait() == 0
    assert not pid_alive(pids["adapter"])
