"""The message trace: both sides of the wire in order, secrets absent, bounded; and ``trace show``."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import anyio
import msgspec
import pytest

from acp_proxy.trace import REDACTED, Trace, read, redacted
from tests.support import Gateway, cli

SECRETS = ("s3cret-env-value", "s3cret-header", "s3cret-api-key")


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (
            b'{"jsonrpc":"2.0","id":3,"method":"authenticate","params":{"methodId":"key","apiKey":"s3cret-api-key"}}',
            {"jsonrpc": "2.0", "id": 3, "method": "authenticate", "params": REDACTED},
        ),
        (
            b'{"jsonrpc":"2.0","id":4,"method":"session/new","params":{"cwd":"/w","mcpServers":[{"name":"a",'
            b'"command":"x","args":[],"env":[{"name":"TOKEN","value":"s3cret-env-value"}]},{"type":"http",'
            b'"name":"b","url":"https://mcp","headers":[{"name":"Authorization","value":"s3cret-header"}]}]}}',
            {
                "jsonrpc": "2.0",
                "id": 4,
                "method": "session/new",
                "params": {
                    "cwd": "/w",
                    "mcpServers": [
                        {"name": "a", "command": "x", "args": [], "env": [{"name": "TOKEN", "value": REDACTED}]},
                        {
                            "type": "http",
                            "name": "b",
                            "url": "https://mcp",
                            "headers": [{"name": "Authorization", "value": REDACTED}],
                        },
                    ],
                },
            },
        ),
        (  # a terminal's environment, asked by the agent
            b'{"jsonrpc":"2.0","id":9,"method":"terminal/create","params":{"sessionId":"s","command":"make",'
            b'"env":[{"name":"PASSWORD","value":"s3cret-env-value"}]}}',
            {
                "jsonrpc": "2.0",
                "id": 9,
                "method": "terminal/create",
                "params": {"sessionId": "s", "command": "make", "env": [{"name": "PASSWORD", "value": REDACTED}]},
            },
        ),
        (b'{"env": {"A": "s3cret-env-value"}}', {"env": {"A": REDACTED}}),
        (b"not json at all", "not json at all"),
        (b'{"env": [broken', REDACTED),
    ],
)
def test_secrets_never_reach_the_trace(line: bytes, expected: object) -> None:
    kept = redacted(line)
    assert msgspec.json.decode(kept) == expected
    assert not any(secret.encode() in kept for secret in SECRETS)


def test_a_line_with_no_secret_is_kept_byte_for_byte() -> None:
    line = b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s","update":{"x": 1}}}'
    assert redacted(line) is line


def test_the_trace_is_private_and_bounded(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    trace = Trace(path, max_bytes=2000)
    line = b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s","n":"' + b"x" * 100 + b'"}}\n'
    for _ in range(40):
        trace.lines("agent>proxy", line * 2, pid=7, backend="b")
    trace.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    records = list(read(path))
    assert all(not isinstance(r, str) for r in records)
    assert records[-1].truncated  # type: ignore[union-attr]
    assert sum(1 for r in records if r.truncated) == 1  # type: ignore[union-attr]
    assert path.stat().st_size <= 2000 + 100
    first = records[0]
    assert not isinstance(first, str)
    assert (first.dir, first.pid, first.backend) == ("agent>proxy", 7, "b")


@pytest.mark.anyio
async def test_a_traced_session_shows_both_sides_in_order_with_no_secret(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    path = tmp_path / "trace.jsonl"
    async with Gateway.start(proc_env, tmp_path, proxy_args=["--trace", str(path)]) as gw:
        await gw.initialize()
        assert "result" in await gw.request("authenticate", {"methodId": "key", "apiKey": SECRETS[2]})
        servers = [{"name": "a", "command": "x", "args": [], "env": [{"name": "TOKEN", "value": SECRETS[0]}]}]
        session = (await gw.request("session/new", {"cwd": str(tmp_path), "mcpServers": servers}))["result"][
            "sessionId"
        ]
        assert (await gw.prompt(session, "stream 2"))["result"]["stopReason"] == "end_turn"
    raw = path.read_bytes()
    assert not any(secret.encode() in raw for secret in SECRETS)
    records = [json.loads(line) for line in raw.splitlines()]
    directions = [r["dir"] for r in records]
    assert {"gateway>proxy", "proxy>agent", "agent>proxy", "proxy>gateway"} <= set(directions)
    assert all(("pid" in r) == (r["dir"] in ("proxy>agent", "agent>proxy")) for r in records)
    assert [r["at"] for r in records] == sorted(r["at"] for r in records)
    prompt = [(r["dir"], r["message"].get("method"), "result" in r["message"]) for r in records]
    sent = prompt.index(("gateway>proxy", "session/prompt", False))
    forwarded = prompt.index(("proxy>agent", "session/prompt", False), sent)
    streamed = prompt.index(("agent>proxy", "session/update", False), forwarded)
    relayed = prompt.index(("proxy>gateway", "session/update", False), streamed)
    answered = [i for i, (d, m, result) in enumerate(prompt) if d == "proxy>gateway" and result]
    assert sent < forwarded < streamed < relayed < answered[-1]

    code, shown, err = await cli(proc_env, "trace", "show", str(path))
    assert code == 0, err
    assert not any(secret in shown for secret in SECRETS)
    sections = shown.split("== ")
    [ours] = [s for s in sections if s.startswith(session)]
    lines = [line for line in ours.splitlines()[1:] if line.strip()]
    assert "agent → proxy" in lines[0]
    assert lines[0].endswith(f"session {session}")  # the answer that named the session opens its section
    assert "answer #" in lines[0]
    steps = [
        "gateway → proxy        session/prompt",
        "→ agent",
        "agent → proxy",
        "session/update agent_message_chunk",
        "proxy → gateway        session/update",
        "proxy → gateway        answer",
    ]
    at = 0
    for step in steps:
        at = next(i for i in range(at, len(lines)) if step in lines[i])
    assert lines[-1].endswith("end_turn")
    code, document, err = await cli(proc_env, "trace", "show", str(path), "--session", session[:4], "--json")
    assert code == 0, err
    assert list(json.loads(document)["sessions"]) == [session]


@pytest.mark.anyio
async def test_trace_show_and_trace_say_what_is_wrong(proc_env: dict[str, str], tmp_path: Path) -> None:
    code, _, err = await cli(proc_env, "trace", "show", str(tmp_path / "missing.jsonl"))
    assert code == 2
    assert "cannot read" in err
    path = tmp_path / "odd.jsonl"
    path.write_text('{"at": 1.0, "dir": "gateway>proxy", "message": {"id": 1, "method": "initialize"}}\nnot a record\n')
    code, out, err = await cli(proc_env, "trace", "show", str(path))
    assert code == 0
    assert "initialize #1" in out
    assert "line 2: not a trace record" in err
    code, _, err = await cli(proc_env, "trace", "show", str(path), "--session", "nope")
    assert code == 2
    assert "no session 'nope'" in err
    unwritable = tmp_path / "no-such-dir" / "trace.jsonl"
    code, _, err = await cli(proc_env, "--trace", str(unwritable), "--", sys.executable, "-c", "pass")
    assert code == 2
    assert f"--trace: cannot write {unwritable}" in err
    assert not await anyio.Path(unwritable.parent).exists()
