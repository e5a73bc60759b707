"""Each session's transcript: bounded, pruned with its session, never holding a secret.

The store itself first (``sessions.transcript``, in this process), then a real proxy's, read back
with ``acp-proxy sessions show ID --transcript``.
"""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from acp_proxy.sessions.transcript import (
    DB_NAME,
    EntryKind,
    Transcripts,
    cut_to,
    decode_entries,
    encode_entries,
    newest,
    read_transcript,
)
from tests.support import Gateway, cli, cli_json, write_config


def update(text: str) -> bytes:
    params = {
        "sessionId": "s1",
        "update": {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": text}},
    }
    return json.dumps({"jsonrpc": "2.0", "method": "session/update", "params": params}).encode()


def test_cut_keeps_the_newest_whole_lines() -> None:
    body = b"aaa\nbbb\nccc\n"
    assert cut_to(body, 100) == body
    assert cut_to(body, 8) == b"bbb\nccc\n"
    assert cut_to(body, 5) == b"ccc\n"
    assert cut_to(body, 2) == b""


@pytest.mark.parametrize(
    ("message", "lines"),
    [
        (b'{"n":0}\n{"n":1}\n{"n":2}\n', [b'{"n":0}', b'{"n":1}', b'{"n":2}']),  # a block, as the relay reads it
        (b'{"n":0}', [b'{"n":0}']),  # one message, no newline
        (b'\n{"a":1}\n\n{"b":2}\n', [b'{"a":1}', b'{"b":2}']),  # blank lines are not entries
    ],
)
def test_entries_are_one_json_line_per_message(message: bytes, lines: list[bytes]) -> None:
    encoded = encode_entries([(1767225600.25, "update", "phone", message)])
    entries = decode_entries(encoded)
    assert [bytes(e.message) for e in entries] == lines
    assert all(e.at == 1767225600.25 and e.kind == "update" and e.by == "phone" for e in entries)
    assert encoded.count(b"\n") == len(lines)


def test_only_the_newest_of_a_flood_is_encoded() -> None:
    entries = [(float(i), "update", None, b"x" * 100) for i in range(10)]
    assert newest(entries, 250) == entries[-3:]
    assert newest(entries, 5000) == entries


@pytest.mark.anyio
async def test_the_store_keeps_the_newest_entries_within_its_bound(tmp_path: Path) -> None:
    store = Transcripts(tmp_path, max_bytes=4096)
    try:
        for i in range(200):
            store.record("s1", EntryKind.UPDATE, update(f"chunk {i}"))
            if i % 50 == 49:
                await store.flush()
        store.record("s1", EntryKind.PROMPT, b'{"sessionId":"s1","prompt":[]}', by="the gateway")
        store.record("s2", EntryKind.UPDATE, update("other session"))
        entries = await store.read_then("s1", lambda found: found)
        written = read_transcript(tmp_path, "s1")
    finally:
        store.close()
    texts = [json.loads(bytes(e.message))["params"]["update"]["content"]["text"] for e in entries if e.kind == "update"]
    assert texts[-1] == "chunk 199"
    assert "chunk 0" not in texts
    assert texts == [f"chunk {i}" for i in range(200 - len(texts), 200)]  # in order, nothing twice, no gap
    assert entries[-1].kind == "prompt"
    assert entries[-1].by == "the gateway"
    assert [e.kind for e in written][-1] == "prompt"  # read_then wrote what it had
    size = sum(len(json.dumps({"at": e.at, "kind": e.kind, "message": json.loads(bytes(e.message))})) for e in written)
    assert size <= 4096 * 1.1


@pytest.mark.anyio
async def test_forgotten_and_old_transcripts_are_pruned(tmp_path: Path) -> None:
    store = Transcripts(tmp_path, max_bytes=1 << 20)
    try:
        for session in ("kept", "deleted", "gone"):
            store.record(session, EntryKind.UPDATE, update(session))
        await store.flush()
        store.forget("deleted")
        await store.flush()
        assert read_transcript(tmp_path, "deleted") == []
        assert store.prune(3600, exists=lambda ids: {"kept"}) == 1  # "gone" has no session any more
        assert read_transcript(tmp_path, "gone") == []
        assert len(read_transcript(tmp_path, "kept")) == 1
        await anyio.sleep(0.01)
        assert store.prune(0.0) == 1  # past the retention
        assert read_transcript(tmp_path, "kept") == []
    finally:
        store.close()


def test_nothing_is_kept_when_the_bound_is_zero(tmp_path: Path) -> None:
    store = Transcripts(tmp_path, max_bytes=0)
    store.record("s1", EntryKind.UPDATE, update("x"))
    assert not (tmp_path / DB_NAME).exists()
    assert read_transcript(tmp_path, "s1") == []


@pytest.mark.anyio
async def test_a_proxys_transcript_is_bounded_readable_and_secret_free(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    cfg = write_config(tmp_path, backends={"fake": {"store": str(tmp_path / "store")}})
    with cfg.open("a") as out:
        out.write('[attach]\ntranscript_max_bytes = "8K"\n')
    proc_env = {**proc_env, "SECRET_FOR_THE_AGENT": "env-s3cr3t-value"}
    async with Gateway.start(
        proc_env, tmp_path, proxy_args=["--config", str(cfg)], store=str(tmp_path / "store")
    ) as gw:
        await gw.initialize()
        assert "error" not in await gw.request("authenticate", {"methodId": "key", "_meta": {"apiKey": "auth-s3cr3t"}})
        session = await gw.new_session(
            mcpServers=[
                {"name": "tool", "command": "/bin/true", "args": [], "env": [{"name": "K", "value": "mcp-s3cr3t"}]}
            ]
        )
        assert (await gw.prompt(session, "remember kiwi"))["result"]["stopReason"] == "end_turn"
        assert (await gw.prompt(session, "stream 300"))["result"]["stopReason"] == "end_turn"
        with anyio.fail_after(10):
            while not any("chunk 299" in json.dumps(e) for e in (await transcript(proc_env, session))):
                await anyio.sleep(0.2)
        entries = await transcript(proc_env, session)
        assert sum(len(json.dumps(e["message"])) for e in entries) <= 8 * 1024
        assert "chunk 0 " not in json.dumps(entries)  # the oldest went first
        code, text, _ = await cli(proc_env, "sessions", "show", session[:8], "--transcript")
        assert code == 0
        assert "agent_message_chunk: chunk 299" in text
        raw = (Path(proc_env["ACP_PROXY_STATE_DIR"]) / DB_NAME).read_bytes()
        for secret in (b"auth-s3cr3t", b"mcp-s3cr3t", b"env-s3cr3t-value"):
            assert secret not in raw
        assert (await gw.request("session/delete", {"sessionId": session})).get("result") == {}
        with anyio.fail_after(10):
            while await transcript(proc_env, session):
                await anyio.sleep(0.2)


async def transcript(env: dict[str, str], session: str) -> list[dict[str, object]]:
    found = await cli_json(env, "sessions", "show", session, "--transcript")
    return list(found["entries"])
