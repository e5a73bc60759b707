"""``acp-proxy serve`` on the network and ``acp-proxy connect``: the RFD's routing, tokens, limits,
and the session lifecycle over WebSocket and streamable HTTP (HTTP/2), with real processes."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import trio.testing
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, Request, TextMessage

from acp_proxy.remote.access import FailedAttempts, Gate, bearer_token, gate, origin_allowed
from acp_proxy.remote.outbox import Outbox
from acp_proxy.remote.routing import Body, Head, Refused, Route, route
from acp_proxy.remote.tokens import Principal, RemoteStore
from acp_proxy.remote.wsclient import Refused as WsRefused
from acp_proxy.remote.wsclient import WebSocket
from acp_proxy.sessions.registry import SessionState
from tests.remote_kit import HttpClient, Served, WsClient, make_token, run_cli, serve
from tests.support import RESUME_AND_LOAD, TEST_INITIALIZE, registry, wait_for_task, write_config

NEW = {"cwd": "/tmp", "mcpServers": []}


def prompt(session_id: str, text: str) -> dict[str, Any]:
    return {"sessionId": session_id, "prompt": [{"type": "text", "text": text}]}


# --- the routing table, the gate, tokens: pure ----------------------------------------------------

C, S = "conn-1", "sess-1"
ROUTES = [
    # (head, body, expected): each row a sentence of the RFD
    (Head("GET", "/acp", upgrade="websocket"), None, Route.WEBSOCKET),
    (Head("GET", "/acp", accept="text/event-stream", connection_id=C), None, Route.STREAM),
    (Head("GET", "/acp", accept="text/event-stream", connection_id=C, session_id=S), None, Route.STREAM),
    (Head("GET", "/acp", accept="text/event-stream"), None, Refused(400, "")),
    (Head("GET", "/acp", accept="application/json", connection_id=C), None, Refused(406, "")),
    (Head("GET", "/acp", accept="*/*", connection_id=C), None, Refused(406, "")),
    (Head("POST", "/acp", content_type="application/json"), Body(method="initialize"), Route.INITIALIZE),
    (Head("POST", "/acp", content_type="application/json"), Body(method="session/new"), Refused(400, "")),
    (Head("POST", "/acp", content_type="text/plain", connection_id=C), Body(method="session/new"), Refused(415, "")),
    (Head("POST", "/acp", content_type="application/json", connection_id=C), Body(batch=True), Refused(501, "")),
    (Head("POST", "/acp", content_type="application/json", connection_id=C), Body(method="session/new"), Route.POST),
    (
        Head("POST", "/acp", content_type="application/json", connection_id=C),
        Body(method="session/prompt", session_id=S),
        Refused(400, ""),
    ),
    (
        Head("POST", "/acp", content_type="application/json; charset=utf-8", connection_id=C, session_id=S),
        Body(method="session/prompt", session_id=S),
        Route.POST,
    ),
    (
        Head("POST", "/acp", content_type="application/json", connection_id=C, session_id="other"),
        Body(method="session/prompt", session_id=S),
        Refused(400, ""),
    ),
    (
        Head("POST", "/acp", content_type="application/json", connection_id=C),
        Body(method="session/load", session_id=S),
        Route.POST,
    ),
    (Head("POST", "/acp", content_type="application/json", connection_id=C), Body(), Route.POST),  # a response
    (Head("DELETE", "/acp", connection_id=C), None, Route.DELETE),
    (Head("DELETE", "/acp"), None, Refused(400, "")),
    (Head("PUT", "/acp"), None, Refused(405, "")),
    (Head("GET", "/other", upgrade="websocket"), None, Refused(404, "")),
]


@pytest.mark.parametrize(("head", "body", "expected"), ROUTES)
def test_the_rfd_routing_table(head: Head, body: Body | None, expected: Route | Refused) -> None:
    decided = route(head, body)
    if isinstance(expected, Refused):
        assert isinstance(decided, Refused), decided
        assert decided.status == expected.status, decided
    else:
        assert decided is expected


OWN = Principal(key="token:a", label="a")
LIMITED = Principal(key="token:l", label="l", backends=("fake",))
ADMIN = Principal(key="token:root", label="root", sees="all")
GATES = [
    (OWN, "session/prompt", S, "token:a", None, Gate.PASS),  # its own session
    (OWN, "session/prompt", S, "token:b", None, Gate.UNKNOWN),  # another token's
    (OWN, "session/load", S, None, None, Gate.UNKNOWN),  # a local gateway's, or none at all
    (ADMIN, "session/load", S, "token:b", None, Gate.PASS),  # sees every session
    (ADMIN, "session/load", S, None, None, Gate.PASS),
    (OWN, "session/new", None, None, "any", Gate.PASS),
    (LIMITED, "session/new", None, None, "fake", Gate.PASS),
    (LIMITED, "session/new", None, None, "other", Gate.BACKEND),
    (OWN, "initialize", None, None, None, Gate.PASS),
]


@pytest.mark.parametrize(("who", "method", "session", "owner", "backend", "expected"), GATES)
def test_who_may_touch_a_session(
    who: Principal, method: str, session: str | None, owner: str | None, backend: str | None, expected: Gate
) -> None:
    assert gate(who, method, session, owner, backend) is expected


def test_bearer_origin_and_failed_attempts() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer ") is None
    assert bearer_token(None) is None
    assert origin_allowed(None, [])
    assert not origin_allowed("http://evil.example", [])
    assert origin_allowed("https://app.example/", ["https://app.example"])
    failed = FailedAttempts(limit=2)
    delays = [failed.delay("1.2.3.4", now=t) for t in (0, 1, 2, 3)]
    assert delays == sorted(delays)
    assert delays[0] < delays[-1]
    assert failed.delay("1.2.3.4", now=1000) == delays[0]  # forgotten after a quiet minute
    failed.delay("5.6.7.8", now=1000)
    failed.delay("9.9.9.9", now=1001)
    assert len(failed.recent) == 2
    assert failed.total == 7


def test_tokens_are_stored_hashed_and_revoked(tmp_path: Path) -> None:
    store = RemoteStore(tmp_path)
    token, secret = store.create("laptop", backends=("fake",))
    assert secret not in (tmp_path / "remote.db").read_bytes().decode("latin-1")
    assert store.verify(secret) == token
    assert store.verify(secret + "x") is None
    other = RemoteStore(tmp_path)  # another process's revocation counts at once
    other.revoke("laptop")
    assert store.verify(secret) is None
    assert oct((tmp_path / "remote.db").stat().st_mode & 0o777) == "0o600"


@pytest.mark.anyio
async def test_a_slow_reader_is_waited_for_and_one_that_takes_nothing_is_let_go() -> None:
    stalled: list[bool] = []
    outbox = Outbox(3, 0.5, lambda: stalled.append(True))
    for i in range(3):
        await outbox.put(None, b"%d" % i)  # no stream yet: kept
    stream = outbox.open(None)
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(outbox.put, "s", b"3")  # the stream is full: this waits (a session without a stream
        await anyio.sleep(0.1)  # of its own goes to the connection's)
        assert stream.receive_nowait() == b"0"  # a reader takes one: it goes in
    assert [stream.receive_nowait() for _ in range(3)] == [b"1", b"2", b"3"]
    assert stalled == []
    for i in range(3):
        await outbox.put(None, b"%d" % i)
    with anyio.fail_after(5):
        await outbox.put(None, b"more")  # nobody takes anything: given up on after the stall timeout
    assert stalled == [True]


@pytest.mark.parametrize(
    "anyio_backend", [("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})], ids=["trio-mock-clock"]
)
@pytest.mark.anyio
async def test_a_client_reading_slowly_is_not_taken_for_one_that_stopped_reading(anyio_backend: object) -> None:
    """A put waits past the stall timeout while its stream's writer still gets runs through (a phone reading
    a long replay over a slow link); once nothing has gone through for the stall timeout, it is a stall."""
    stalled: list[float] = []
    outbox = Outbox(1, 1.0, lambda: stalled.append(anyio.current_time()))
    stream = outbox.open(None)
    await outbox.put(None, b"0")  # the stream is full
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(outbox.put, None, b"1")  # waits
        for _ in range(5):  # 2.5 s, a run through every 0.5 s
            await anyio.sleep(0.5)
            outbox.wrote(None)
        assert stalled == []
        assert stream.receive_nowait() == b"0"
    assert stream.receive_nowait() == b"1"
    await outbox.put(None, b"2")
    waited_from = anyio.current_time()
    await outbox.put(None, b"3")  # nothing goes through any more
    assert stalled == [waited_from + 1.0]
    assert stream.receive_nowait() == b"2"  # each line once: the one given up on is not there either
    with pytest.raises(anyio.WouldBlock):
        stream.receive_nowait()


# --- real processes ----------------------------------------------------------------------------


async def until_state(env: dict[str, str], session: str, state: SessionState, timeout: float) -> None:
    """Until the registry says ``session`` is in ``state``."""
    with anyio.fail_after(timeout):
        while registry(env).get(session).state is not state:  # type: ignore[union-attr]
            await anyio.sleep(0.05)


def config_for(tmp_path: Path, **backend: Any) -> Path:
    backend.setdefault("store", str(tmp_path / "store"))
    backend.setdefault("caps", RESUME_AND_LOAD)
    backends = {"fake": backend, "other": dict(backend)}
    return write_config(tmp_path, pool={"max_live": 8}, backends=backends, default_backend="fake")


@pytest.mark.anyio
async def test_websocket_session_lifecycle(proc_env: dict[str, str], tmp_path: Path) -> None:
    """new, a prompt with streamed updates, a permission round trip, cancel, close; then a load
    from a second connection after the first has gone, under the same id."""
    token = make_token(proc_env, "laptop")
    async with serve(proc_env, config_for(tmp_path)) as served:
        async with WsClient.open(served.target(token)) as client:
            assert client.ws.connection_id
            init = await client.call("initialize", TEST_INITIALIZE)
            with anyio.fail_after(10):  # serve writes its status file within half a second of a change
                while not (status := json.loads(run_cli(proc_env, "status", "--json").stdout))["servers"][0][
                    "connections"
                ]:
                    await anyio.sleep(0.05)
            [server] = status["servers"]
            assert server["addresses"] == [served.url]
            assert [c["principal"] for c in server["connections"]] == ["laptop"]
            assert server["connections"][0]["proxyPid"] > 0
            assert "servers: 1 running" in run_cli(proc_env, "status").stdout
            metrics = run_cli(proc_env, "metrics").stdout
            assert 'acp_proxy_serve_connections{transport="websocket"} 1.0' in metrics
            assert json.loads(run_cli(proc_env, "top", "--once", "--json").stdout)["remoteConnections"] == 1
            assert init["result"]["agentCapabilities"]["sessionCapabilities"]["resume"] == {}
            session = (await client.call("session/new", NEW))["result"]["sessionId"]
            answer = await client.call("session/prompt", prompt(session, "stream 5"))
            assert answer["result"]["stopReason"] == "end_turn"
            assert [u["params"]["update"]["content"]["text"] for u in client.updates(session)] == [
                f"chunk {i} " for i in range(5)
            ]
            asking = await client.request_id("session/prompt", prompt(session, "permission"))
            ask = await client.wait_for(lambda m: m.get("method") == "session/request_permission")
            await client.send({"id": ask["id"], "result": {"outcome": {"outcome": "selected", "optionId": "allow"}}})
            assert (await client.answer_of(asking))["result"]["stopReason"] == "end_turn"
            assert any("permission granted" in json.dumps(u) for u in client.updates(session))
            silent = await client.request_id("session/prompt", prompt(session, "silent"))
            await anyio.sleep(0.2)
            await client.send({"method": "session/cancel", "params": {"sessionId": session}})
            assert (await client.answer_of(silent))["result"]["stopReason"] == "cancelled"
            await client.call("session/prompt", prompt(session, "remember kiwi"))
        async with WsClient.open(served.target(token)) as again:
            await again.call("initialize", TEST_INITIALIZE)
            loaded = await again.call("session/load", {"sessionId": session, **NEW})
            assert "error" not in loaded, loaded
            replay = [u["params"]["update"].get("content", {}).get("text") for u in again.updates(session)]
            assert replay == [f"chunk {i} " for i in range(5)] + ["permission granted"], "its history, in order"
            assert (await again.call("session/close", {"sessionId": session}))["result"] == {}
            # the row says closed once the tree is reaped, after the answer
            await until_state(proc_env, session, SessionState.CLOSED, timeout=10)


@pytest.mark.anyio
async def test_streamable_http_session_lifecycle(proc_env: dict[str, str], tmp_path: Path) -> None:
    """The same over HTTP/2: initialize answered in the POST, the rest on the streams."""
    token = make_token(proc_env, "laptop")
    async with serve(proc_env, config_for(tmp_path)) as served, HttpClient.open(served.url, token) as client:
        init = await client.initialize()
        assert init.status_code == 200
        assert init.http_version == "HTTP/2"
        assert client.connection_id
        assert init.json()["result"]["protocolVersion"] == 1
        await client.open_stream()
        new = await client.request("session/new", NEW)
        session = (await client.wait_for(None, lambda m: m.get("id") == new))["result"]["sessionId"]
        await client.open_stream(session)
        asked = await client.request("session/prompt", prompt(session, "stream 3; permission"), session)
        ask = await client.wait_for(session, lambda m: m.get("method") == "session/request_permission")
        reply = {"id": ask["id"], "result": {"outcome": {"outcome": "selected", "optionId": "allow"}}}
        assert (await client.post(reply, session)).status_code == 202
        done = await client.wait_for(session, lambda m: m.get("id") == asked)
        assert done["result"]["stopReason"] == "end_turn"
        texts = [m["params"]["update"]["content"]["text"] for m in client.events[session] if "method" in m]
        assert texts == ["chunk 0 ", "chunk 1 ", "chunk 2 ", "permission granted"]
        silent = await client.request("session/prompt", prompt(session, "silent"), session)
        await anyio.sleep(0.2)
        cancel = {"method": "session/cancel", "params": {"sessionId": session}}
        assert (await client.post(cancel, session)).status_code == 202
        assert (await client.wait_for(session, lambda m: m.get("id") == silent))["result"]["stopReason"] == "cancelled"
        closed = await client.request("session/close", {"sessionId": session}, session)
        assert (await client.wait_for(session, lambda m: m.get("id") == closed))["result"] == {}
        assert (await client.http.delete(served.url, headers=client.headers())).status_code == 202
        unknown = await client.post({"id": 99, "method": "session/list", "params": {}})
        assert unknown.status_code == 404  # the connection is gone
    async with serve(proc_env, config_for(tmp_path)) as served, HttpClient.open(served.url, token) as client:
        await client.initialize()
        await client.open_stream()
        await client.open_stream(session)
        loaded = await client.request("session/load", {"sessionId": session, **NEW}, session)
        assert "result" in await client.wait_for(None, lambda m: m.get("id") == loaded)
        # The replay is on the session's stream, the answer on the connection's: two HTTP/2 streams,
        # in no order against each other.
        await client.wait_for(session, lambda m: m.get("method") == "session/update")


@pytest.mark.anyio
async def test_the_rfd_status_codes_over_http2(proc_env: dict[str, str], tmp_path: Path) -> None:
    token = make_token(proc_env, "laptop")
    config = config_for(tmp_path)
    config.write_text("max_line_bytes = 65536\n" + config.read_text())
    async with serve(proc_env, config) as served, HttpClient.open(served.url, token) as client:
        http, url = client.http, served.url
        assert (await http.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "session/new"})).status_code == 400
        assert (await http.post(url, content=b"{}", headers={"content-type": "text/plain"})).status_code == 415
        batch = await http.post(url, content=b"[{}]", headers={"content-type": "application/json"})
        assert batch.status_code == 501
        assert (
            await http.get(url, headers={"acp-connection-id": "nope", "accept": "text/event-stream"})
        ).status_code == 404
        assert (await http.delete(url)).status_code == 400
        await client.initialize()
        assert (await http.get(url, headers={**client.headers()})).status_code == 406  # accepts no event stream
        stranger = {**client.headers("someone-elses"), "accept": "text/event-stream"}
        assert (await http.get(url, headers=stranger)).status_code == 409, "that session alone refused"
        malformed = await http.post(
            url, content=b"{not json", headers={**client.headers(), "content-type": "application/json"}
        )
        assert malformed.status_code == 400
        assert malformed.json()["error"]["code"] == -32700
        huge = b'{"jsonrpc":"2.0","method":"x","params":{"p":"' + b"x" * (2**20) + b'"}}'
        async with httpx.AsyncClient(headers=http.headers, timeout=20) as other:  # HTTP/1.1: the answer comes mid-body
            headers = {**client.headers(), "content-type": "application/json"}
            assert (await other.post(url, content=huge, headers=headers)).status_code == 413
        assert (await client.initialize()).status_code == 200  # and it keeps serving


@pytest.mark.anyio
async def test_malformed_and_oversized_websocket_frames(proc_env: dict[str, str], tmp_path: Path) -> None:
    token = make_token(proc_env, "laptop")
    config = config_for(tmp_path)
    config.write_text("max_line_bytes = 65536\n" + config.read_text())
    async with serve(proc_env, config) as served:
        async with WsClient.open(served.target(token)) as client:
            await client.ws.send_text("{not json")
            parse_error = await client.wait_for(lambda m: "error" in m)
            assert parse_error["error"]["code"] == -32700
            await client.ws.send_text('{"jsonrpc": "2.0", "id": 7, "method": 5}')
            assert (await client.answer_of(7))["error"]["code"] == -32600
            await client.call("initialize", TEST_INITIALIZE)  # and the connection goes on
            await client.ws.send_text('{"jsonrpc":"2.0","method":"x","params":{"p":"' + "x" * 70000 + '"}}')
            with anyio.fail_after(10):
                while client.closed is None:
                    await anyio.sleep(0.05)
            assert "1009" in str(client.closed)  # message too big
        async with WsClient.open(served.target(token)) as client:  # and the server goes on
            await client.call("initialize", TEST_INITIALIZE)


@pytest.mark.anyio
async def test_nobody_in_without_a_valid_token(proc_env: dict[str, str], tmp_path: Path) -> None:
    revoked = make_token(proc_env, "old")
    assert run_cli(proc_env, "token", "revoke", "old").returncode == 0
    assert run_cli(proc_env, "token", "revoke", "old").returncode == 2  # no live token of that name
    async with serve(proc_env, config_for(tmp_path)) as served:
        for shown in (None, "acpp_wrong", revoked):
            with pytest.raises(WsRefused) as refused:
                await WebSocket.connect(served.target(shown))
            assert refused.value.status == 401
        async with httpx.AsyncClient(http1=False, http2=True, timeout=30) as http:  # each failure slower
            body = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {}}
            assert (await http.post(served.url, json=body, headers={"authorization": "Bearer x"})).status_code == 401
        with anyio.fail_after(10):  # each failure is counted (and was answered late)
            while 'acp_proxy_serve_refusals_total{reason="failed_auth"} 4.0' not in run_cli(proc_env, "metrics").stdout:
                await anyio.sleep(0.2)


@pytest.mark.anyio
async def test_connect_with_a_wrong_token_says_so_and_exits_2(proc_env: dict[str, str], tmp_path: Path) -> None:
    from tests.support import Gateway

    async with serve(proc_env, config_for(tmp_path)) as served:
        bad = {**proc_env, "ACP_PROXY_TOKEN": "acpp_wrong"}
        argv = [sys.executable, "-m", "acp_proxy", "connect", served.ws_url]
        async with Gateway.launch(argv, env=bad, name="connect", first_id=1001) as gw:
            answer = await gw.request("initialize", TEST_INITIALIZE, timeout=30)
            assert answer["error"]["data"]["reason"] == "refused"
            assert "401" in answer["error"]["message"]
            assert await gw.close() == 2


@pytest.mark.anyio
async def test_browser_origins_are_refused_and_revoking_a_token_ends_its_connections(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    token = make_token(proc_env, "laptop")
    options = ("--allow-origin", "https://app.example", "--idle-timeout", "1s")  # the sweep each second
    async with serve(proc_env, config_for(tmp_path), *options) as served:
        evil = {"origin": "http://evil.example"}  # a browser's origin is refused, token or not
        with pytest.raises(WsRefused) as refused:
            await WebSocket.connect(served.target(token), headers=evil)
        assert refused.value.status == 403
        async with httpx.AsyncClient(timeout=20) as http:
            response = await http.post(served.url, json={}, headers={"authorization": f"Bearer {token}", **evil})
            assert response.status_code == 403
        listed = await WebSocket.connect(served.target(token), headers={"origin": "https://app.example"})
        await listed.aclose()
        async with WsClient.open(served.target(token)) as client:  # revoking a token ends its connections
            await client.call("initialize", TEST_INITIALIZE)
            assert run_cli(proc_env, "token", "revoke", "laptop").returncode == 0
            with anyio.fail_after(15):
                while client.closed is None:
                    await anyio.sleep(0.1)


@pytest.mark.anyio
async def test_two_tokens_cannot_see_each_others_sessions(proc_env: dict[str, str], tmp_path: Path) -> None:
    alice, bob = make_token(proc_env, "alice"), make_token(proc_env, "bob", "--backend", "fake")
    admin = make_token(proc_env, "ops", "--sees", "all")
    listed = json.loads(run_cli(proc_env, "token", "list", "--json").stdout)
    assert [(t["name"], t["backends"], t["sees"], t["state"]) for t in listed] == [
        ("alice", None, "own", "live"),
        ("bob", ["fake"], "own", "live"),
        ("ops", None, "all", "live"),
    ]
    assert not any(secret in json.dumps(listed) for secret in (alice, bob, admin))
    async with serve(proc_env, config_for(tmp_path)) as served:
        async with WsClient.open(served.target(alice)) as a, WsClient.open(served.target(bob)) as b:
            await a.call("initialize", TEST_INITIALIZE)
            await b.call("initialize", TEST_INITIALIZE)
            mine = (await a.call("session/new", NEW))["result"]["sessionId"]
            theirs = (await b.call("session/new", NEW))["result"]["sessionId"]
            other_backend = await b.call("session/new", {**NEW, "_meta": {"acp-proxy": {"backend": "other"}}})
            assert "may not use backend" in other_backend["error"]["message"]
            for method, params in (
                ("session/prompt", prompt(mine, "hello")),
                ("session/load", {"sessionId": mine, **NEW}),
                ("session/resume", {"sessionId": mine, **NEW}),
                ("session/close", {"sessionId": mine}),
                ("session/status", {"sessionId": mine}),
            ):
                refused = await b.call(method, params)
                assert refused["error"]["data"]["reason"] == "unknown_session", (method, refused)
            listed = await b.call("session/list", {})
            assert [s["sessionId"] for s in listed["result"]["sessions"]] == [theirs]
            for client, session in ((a, mine), (b, theirs)):
                assert (await client.call("session/status", {"sessionId": session}))["result"] == {"status": "open"}
        async with WsClient.open(served.target(admin)) as ops:
            await ops.call("initialize", TEST_INITIALIZE)
            everything = await ops.call("session/list", {})
            assert {mine, theirs} <= {s["sessionId"] for s in everything["result"]["sessions"]}


def stalled_client(port: int, token: str) -> socket.socket:
    """A WebSocket client on a blocking socket: it opens a session, asks for a flood of updates and
    then reads nothing (an event loop's transport would go on reading into memory)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    ws = WSConnection(ConnectionType.CLIENT)
    auth = [(b"authorization", f"Bearer {token}".encode())]
    sock.sendall(ws.send(Request(host="localhost", target="/acp", extra_headers=auth)))

    def send(message: dict[str, Any]) -> None:
        sock.sendall(ws.send(TextMessage(data=json.dumps({"jsonrpc": "2.0", **message}))))

    session = None
    while session is None:
        ws.receive_data(sock.recv(65536))
        for event in ws.events():
            if isinstance(event, AcceptConnection):
                send({"id": 0, "method": "initialize", "params": TEST_INITIALIZE})
                send({"id": 1, "method": "session/new", "params": NEW})
            elif isinstance(event, TextMessage) and '"sessionId"' in event.data and '"id":1' in event.data:
                session = json.loads(event.data)["result"]["sessionId"]
    send({"id": 2, "method": "session/prompt", "params": prompt(session, "stream 30000")})
    return sock


@pytest.mark.anyio
async def test_a_client_that_stops_reading_is_disconnected(proc_env: dict[str, str], tmp_path: Path) -> None:
    token = make_token(proc_env, "laptop")
    flooding = write_config(tmp_path, backends={"fake": {}})  # no store: the flood is as fast as a pipe
    async with serve(proc_env, flooding, "--max-pending", "64", "--stall-timeout", "2s") as served:
        port = int(served.url.rsplit(":", 1)[1].split("/")[0])
        sock = await anyio.to_thread.run_sync(stalled_client, port, token)
        status_file = next((tmp_path / "state" / "serve").glob("*.json"))
        with anyio.fail_after(60):  # not buffered without bound: the client is let go
            while (status := json.loads(status_file.read_text()))["slowReaders"] < 1 or status["connections"]:
                await anyio.sleep(0.2)
        sock.close()
        async with WsClient.open(served.target(token)) as client:  # and it keeps serving
            await client.call("initialize", TEST_INITIALIZE)


async def drop_mid_turn(served: Served, token: str, text: str) -> str:
    """A new session whose turn (``text``) is streaming when its link goes without a close frame
    (a laptop that slept, a network that failed): the session's id."""
    async with WsClient.open(served.target(token)) as client:
        await client.call("initialize", TEST_INITIALIZE)
        session: str = (await client.call("session/new", NEW))["result"]["sessionId"]
        await client.request_id("session/prompt", prompt(session, text))
        await client.wait_for(lambda m: m.get("method") == "session/update")
        await anyio.aclose_forcefully(client.ws._stream)
    return session


@pytest.mark.anyio
async def test_a_dropped_link_lets_the_turn_in_flight_finish(proc_env: dict[str, str], tmp_path: Path) -> None:
    token = make_token(proc_env, "laptop")
    async with serve(proc_env, config_for(tmp_path)) as served:
        session = await drop_mid_turn(served, token, "trickle 1.5; permission; stream 2")
        finished = await wait_for_task(proc_env, "done", prompt="trickle 1.5", timeout=20)  # not cut by the drop
        assert finished["sessionId"] == session
        # then its proxy lets go: the session is suspended, resumable
        await until_state(proc_env, session, SessionState.SUSPENDED, timeout=20)
        async with WsClient.open(served.target(token)) as again:
            await again.call("initialize", TEST_INITIALIZE)
            answer = await again.call("session/prompt", prompt(session, "hello again"))
            assert answer["result"]["stopReason"] == "end_turn"


@pytest.mark.anyio
async def test_a_session_wanted_again_is_taken_from_a_lingering_proxy(proc_env: dict[str, str], tmp_path: Path) -> None:
    token = make_token(proc_env, "laptop")
    async with serve(proc_env, config_for(tmp_path)) as served:
        session = await drop_mid_turn(served, token, "trickle 60")
        async with WsClient.open(served.target(token)) as again:
            await again.call("initialize", TEST_INITIALIZE)
            with anyio.fail_after(30):  # well before the 60 s turn or the linger would end
                answer = await again.call("session/prompt", prompt(session, "hello again"), timeout=30)
            assert answer["result"]["stopReason"] == "end_turn"


@pytest.mark.anyio
async def test_a_stop_after_closed_websockets_logs_no_error(proc_env: dict[str, str], tmp_path: Path) -> None:
    token = make_token(proc_env, "laptop")
    log = tmp_path / "serve.log"
    async with serve(proc_env, config_for(tmp_path), log=log) as served:
        for _ in range(3):
            async with WsClient.open(served.target(token)) as client:
                await client.call("initialize", TEST_INITIALIZE)
    text = log.read_text()
    assert "received SIGTERM" in text
    assert "ERROR" not in text, text


@pytest.mark.slow  # scale: 600 sockets
@pytest.mark.anyio
async def test_five_hundred_idle_connections(proc_env: dict[str, str], tmp_path: Path) -> None:
    token = make_token(proc_env, "laptop")
    async with serve(
        proc_env, config_for(tmp_path), "--max-connections", "600", "--max-connections-per-token", "600"
    ) as served:
        sockets = []
        for _ in range(500):
            sockets.append(await WebSocket.connect(served.target(token)))
        status_file = next((tmp_path / "state" / "serve").glob("*.json"))
        with anyio.fail_after(10):
            while len(json.loads(status_file.read_text())["connections"]) < 500:
                await anyio.sleep(0.2)
        async with WsClient.open(served.target(token)) as client:  # a busy one is still served
            await client.call("initialize", TEST_INITIALIZE)
            session = (await client.call("session/new", NEW))["result"]["sessionId"]
            assert (await client.call("session/prompt", prompt(session, "hi")))["result"]["stopReason"] == "end_turn"
        for _ in range(100):  # up to --max-connections
            sockets.append(await WebSocket.connect(served.target(token)))
        with pytest.raises(WsRefused) as refused:
            await WebSocket.connect(served.target(token))
        assert refused.value.status == 503
        for ws in sockets:
            await ws.aclose()


@pytest.mark.anyio
async def test_serve_killed_mid_turn_leaves_nothing_and_a_new_serve_restores(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    token = make_token(proc_env, "laptop")
    config = config_for(tmp_path)
    async with serve(proc_env, config) as served, WsClient.open(served.target(token)) as client:
        await client.call("initialize", TEST_INITIALIZE)
        session = (await client.call("session/new", NEW))["result"]["sessionId"]
        await client.call("session/prompt", prompt(session, "stream 3"))
        await client.request_id("session/prompt", prompt(session, "trickle 30"))
        await client.wait_for(lambda m: m.get("method") == "session/update" and "." in json.dumps(m))
        served.process.send_signal(signal.SIGKILL)
    # its connection's proxy got EOF: it suspends the session and exits
    await until_state(proc_env, session, SessionState.SUSPENDED, timeout=30)
    async with serve(proc_env, config) as served, WsClient.open(served.target(token)) as client:
        await client.call("initialize", TEST_INITIALIZE)
        answer = await client.call("session/prompt", prompt(session, "state"))
        assert answer["result"]["stopReason"] == "end_turn"
        [said] = [u["params"]["update"]["content"]["text"] for u in client.updates(session)]
        restored = json.loads(said)  # the adapter's own account of the conversation it was given back
        assert restored["session"] == session, "resumed: the same conversation, not a new one"
        assert restored["turns"] >= 1, "the first turn is on record (the cut one may be too)"
        assert restored["history"] >= 3, "the first turn's three chunks are its history"


@pytest.mark.anyio
async def test_unix_socket_needs_no_token_and_is_private(proc_env: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "acp.sock"
    async with serve(proc_env, config_for(tmp_path), "--socket", str(path)) as served:
        assert oct(path.stat().st_mode & 0o777) == "0o600"
        from acp_proxy.remote.wsclient import Target

        async with WsClient.open(Target.parse(f"unix:{path}")) as client:
            await client.call("initialize", TEST_INITIALIZE)
            session = (await client.call("session/new", NEW))["result"]["sessionId"]
            listed = await client.call("session/list", {})
            assert session in {s["sessionId"] for s in listed["result"]["sessions"]}
        with pytest.raises(WsRefused):
            await WebSocket.connect(served.target(None))  # the TCP port still wants a token
    assert not path.exists()


def test_serve_refuses_a_clear_text_public_listener(proc_env: dict[str, str], tmp_path: Path) -> None:
    done = run_cli(proc_env, "serve", "--listen", "0.0.0.0:0", "--config", str(config_for(tmp_path)))
    assert done.returncode == 2
    assert "--tls-cert" in done.stderr


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, made by the openssl command."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
@pytest.mark.anyio
async def test_tls_on_a_public_listener_for_websocket_and_http2(proc_env: dict[str, str], tmp_path: Path) -> None:
    """TLS on every address: wss for connect (the CA from SSL_CERT_FILE), HTTP/2 negotiated by ALPN."""
    from tests.support import Gateway

    cert, key = self_signed(tmp_path)
    token = make_token(proc_env, "laptop")
    options = ("--tls-cert", str(cert), "--tls-key", str(key))
    async with serve(proc_env, config_for(tmp_path), *options) as served:
        assert served.url.startswith("https://")
        async with httpx.AsyncClient(
            http2=True, verify=ssl.create_default_context(cafile=str(cert)), timeout=30
        ) as http:
            init = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": TEST_INITIALIZE}
            response = await http.post(served.url, json=init, headers={"authorization": f"Bearer {token}"})
            assert response.status_code == 200
            assert response.http_version == "HTTP/2"  # by ALPN
        env = {**proc_env, "ACP_PROXY_TOKEN": token, "SSL_CERT_FILE": str(cert)}
        argv = [sys.executable, "-m", "acp_proxy", "connect", served.url.replace("https://", "wss://")]
        async with Gateway.launch(argv, env=env, name="connect", first_id=1001) as gw:
            await gw.initialize(TEST_INITIALIZE)
            session = await gw.new_session()
            assert (await gw.prompt(session, "hello"))["result"]["stopReason"] == "end_turn"
        untrusting = {**proc_env, "ACP_PROXY_TOKEN": token}  # the system's CAs do not know this one
        async with Gateway.launch(argv, env=untrusting, name="connect", first_id=1001) as gw:
            answer = await gw.request("initialize", TEST_INITIALIZE, timeout=30)
            assert answer["error"]["data"]["reason"] == "refused"  # at once: no retry would change it
            assert "CERTIFICATE_VERIFY_FAILED" in answer["error"]["message"]
            assert await gw.close() == 2


@pytest.mark.anyio
async def test_connect_cancels_the_turns_of_a_gateway_that_left(proc_env: dict[str, str], tmp_path: Path) -> None:
    """The server cannot tell a close from a drop, so the bridge ends what its gateway left running."""
    from tests.support import Gateway

    token = make_token(proc_env, "laptop")
    env = {**proc_env, "ACP_PROXY_TOKEN": token}
    async with serve(proc_env, config_for(tmp_path)) as served:
        argv = [sys.executable, "-m", "acp_proxy", "connect", served.ws_url, "--eof-grace", "1s"]
        async with Gateway.launch(argv, env=env, name="connect", first_id=1001) as gw:
            await gw.initialize(TEST_INITIALIZE)
            session = await gw.new_session()
            turn = gw.new_id()
            await gw.send(
                {"jsonrpc": "2.0", "id": turn, "method": "session/prompt", "params": prompt(session, "silent")}
            )
            await wait_for_task(proc_env, "running", prompt="silent")
            assert await gw.close(timeout=30) == 0  # EOF: the turn gets its grace (1 s), then is cancelled
        cancelled = await wait_for_task(proc_env, "cancelled", prompt="silent", timeout=20)
        assert cancelled["sessionId"] == session
        # and the session is suspended at once, not left to linger
        await until_state(proc_env, session, SessionState.SUSPENDED, timeout=20)


@pytest.mark.anyio
async def test_connect_bridges_a_gateway_and_survives_a_dropped_link(proc_env: dict[str, str], tmp_path: Path) -> None:
    """A stdio gateway runs ``acp-proxy connect``; serve restarts under it mid-session: the session
    goes on under its id, and the turn in flight at the drop is answered with an error saying so."""
    from tests.support import Gateway

    token = make_token(proc_env, "laptop")
    config = config_for(tmp_path)
    env = {**proc_env, "ACP_PROXY_TOKEN": token}
    async with serve(proc_env, config, listen="127.0.0.1:0") as served:
        port = served.url.rsplit(":", 1)[1].split("/")[0]
        argv = [sys.executable, "-m", "acp_proxy", "connect", served.ws_url]
        async with Gateway.launch(argv, env=env, name="connect", first_id=1001) as gw:
            await gw.initialize(TEST_INITIALIZE)
            session = await gw.new_session()
            response = await gw.prompt(session, "remember papaya")
            assert response["result"]["stopReason"] == "end_turn"
            turn = gw.new_id()
            await gw.send(
                {"jsonrpc": "2.0", "id": turn, "method": "session/prompt", "params": prompt(session, "trickle 30")}
            )
            with anyio.fail_after(10):
                while not gw.updates(session):
                    await anyio.sleep(0.05)
            served.process.send_signal(signal.SIGKILL)
            dropped = await gw.response_to(turn, timeout=20)
            assert dropped["error"]["data"]["reason"] == "link_dropped", dropped
            # the killed serve's proxy got EOF: it suspends the session, then exits
            await until_state(proc_env, session, SessionState.SUSPENDED, timeout=30)
            async with serve(proc_env, config, listen=f"127.0.0.1:{port}"):
                gw.clear_stash()
                response = await gw.prompt(session, "state", timeout=40)
                assert response["result"]["stopReason"] == "end_turn"
                state = json.loads(gw.updates(session)[-1]["params"]["update"]["content"]["text"])
                assert state["history"] >= 2  # restored, not started afresh: the turn before the drop is in it
