"""A backend is its command as well as its name: zero-config names it after the agent, and a session of a backend
no longer configured is restored by the configured backend that runs the same command."""

from __future__ import annotations

from pathlib import Path

import pytest

from acp_proxy.config import agent_name
from tests.support import Gateway, fake_command, registry, state_of, write_config
from tests.test_install_pool import turn_ok

NAMES = [
    # the adapter command after `acp-proxy --` -> the zero-config backend's name
    (["python3", "x.py"], "x"),
    (["/usr/bin/python3.11", "-u", "/srv/agents/claude_bridge.py", "--verbose"], "claude_bridge"),
    (["python", "-m", "pkg"], "pkg"),
    (["python3", "-X", "utf8", "-m", "fast_agent.acp", "--model", "passthrough"], "fast_agent"),
    (["python", "-m", "mytool.__main__"], "mytool"),
    (["node", "/usr/lib/node_modules/@zed-industries/claude-agent-acp/dist/index.js"], "claude-agent-acp"),
    (["node", "/home/me/.npm/node_modules/opencode-ai/bin/cli.js", "acp"], "opencode-ai"),
    (["node", "/opt/my-agent/bin/cli.js"], "my-agent"),
    (["npx", "-y", "@zed-industries/codex-acp@0.16.0"], "codex-acp"),
    (["bunx", "pi-acp"], "pi-acp"),
    (["uvx", "fast-agent-acp", "--model", "passthrough"], "fast-agent-acp"),
    (["pipx", "run", "some-agent==1.2"], "some-agent"),
    (["pnpm", "dlx", "@scope/agent"], "agent"),
    (["uv", "run", "agents/reviewer.py"], "reviewer"),
    (["env", "RUST_LOG=info", "codex-acp"], "codex-acp"),
    (["gemini", "--acp"], "gemini"),
    (["/usr/local/bin/qwen", "--acp"], "qwen"),
    (["C:\\Tools\\copilot.exe", "--acp"], "copilot"),
    (["python3"], "python3"),  # nothing else to go by
]


@pytest.mark.parametrize(("command", "name"), NAMES, ids=[" ".join(c) for c, _ in NAMES])
def test_a_zero_config_backend_is_named_after_the_agent_not_its_interpreter(command: list[str], name: str) -> None:
    assert agent_name(command) == name


@pytest.mark.anyio
async def test_a_zero_config_session_is_restored_by_a_configured_backend_with_the_same_command(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    store = str(tmp_path / "store")
    async with Gateway.start(
        proc_env, tmp_path, fake_command(store=store)
    ) as gw:  # acp-proxy -- python fake_adapter.py
        await gw.initialize()
        session = await gw.new_session()
        assert turn_ok(await gw.prompt(session, "stream 2"))
    assert registry(proc_env).get(session).backend == "fake_adapter"  # type: ignore[union-attr]
    config = write_config(tmp_path, backends={"mine": {"store": store}})  # the same command, a name of its own
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=["--config", str(config)]) as gw:
        await gw.initialize()
        loaded = await gw.request("session/load", {"sessionId": session, "cwd": str(tmp_path), "mcpServers": []})
        assert "result" in loaded, loaded
        assert (await state_of(gw, session))["turns"] == 1, "its history came with it"
    assert registry(proc_env).get(session).backend == "mine"  # type: ignore[union-attr]


@pytest.mark.anyio
async def test_a_session_whose_backend_is_gone_and_no_command_matches_is_refused_by_name(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with Gateway.start(proc_env, tmp_path, fake_command(store=str(tmp_path / "store"))) as gw:
        await gw.initialize()
        session = await gw.new_session()
    config = write_config(tmp_path, backends={"other": {"store": str(tmp_path / "elsewhere")}})
    async with Gateway.start(proc_env, tmp_path, [], proxy_args=["--config", str(config)]) as gw:
        await gw.initialize()
        refused = await gw.prompt(session, "stream 1")
        assert refused["error"]["data"]["reason"] == "unknown_backend", refused
        assert refused["error"]["data"]["backend"] == "fake_adapter"
