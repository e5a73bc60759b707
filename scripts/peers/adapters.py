"""The peers as data: the adapters the checks install and run (one row each), and the packages.

The matrix-* checks run one scenario over every row; the other families run against
POOL_ADAPTERS. Credentials are placeholders only, so a model request fails, offline.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

PYPI_PACKAGES = ("agent-client-protocol[http]",)
"""The Python SDK, with its network transports' needs (httpx, websockets)."""
PLACEHOLDER = "sk-check-peers-placeholder-not-a-key"
UNREACHABLE_MODEL = "http://127.0.0.1:9/v1"  # the discard port: a model request fails at once


@dataclass(frozen=True)
class Adapter:
    """An adapter the checks install and run, as data; the matrix-* checks run one scenario over these rows.

    ``argv[0]`` is a program in the npm install's ``.bin``. ``env`` holds placeholder
    credentials (never real ones: a model request then fails, offline), ``auth`` the
    ``authenticate`` method sent after ``initialize``. ``login``: the adapter refuses
    ``session/new`` until someone logged in by hand, so its scenario ends at that
    refusal. ``prompt``: the adapter records a prompt offline before the model call
    fails, so the scenario sends one (the conversation then has something to restore).
    The other steps follow from what the adapter advertises: ``session/set_mode``
    where ``session/new`` offers modes (``session/set_config_option`` where only a
    mode config option is offered), ``session/load`` where ``loadSession``,
    ``session/resume`` and ``session/list`` where ``sessionCapabilities`` say so.
    """

    name: str
    package: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    auth: str | None = None
    login: bool = False
    prompt: bool = False
    cancel: bool = False
    """A turn stays under way offline (the model call retries) long enough to be cancelled."""
    needs: tuple[str, ...] = ()
    """Other npm packages it runs, found on PATH (the install's .bin is put first)."""


# codex-acp opens no session before `authenticate`; with a placeholder key it
# authenticates offline (the key is only sent with a model request, which then
# fails), so its sessions can be created, resumed and loaded without credentials.
# acpx authenticates with a method's key from ACPX_AUTH_<METHOD>. gemini-cli
# likewise takes any GEMINI_API_KEY for its gemini-api-key method; qwen-code takes
# its key and model URL as arguments.
ADAPTERS = {
    adapter.name: adapter
    for adapter in (
        Adapter(
            "codex-acp",
            "@zed-industries/codex-acp",
            ("codex-acp",),
            env={"OPENAI_API_KEY": PLACEHOLDER, "ACPX_AUTH_OPENAI_API_KEY": PLACEHOLDER},
            auth="openai-api-key",
            prompt=True,
            cancel=True,
        ),
        Adapter(
            "claude-agent-acp",
            "@zed-industries/claude-agent-acp",
            ("claude-agent-acp",),
            prompt=True,
        ),
        Adapter(
            "gemini",
            "@google/gemini-cli",
            ("gemini", "--acp"),
            env={"GEMINI_API_KEY": PLACEHOLDER},
            auth="gemini-api-key",
            cancel=True,
        ),
        Adapter("opencode", "opencode-ai", ("opencode", "acp")),
        Adapter(
            "qwen",
            "@qwen-code/qwen-code",
            (
                "qwen",
                "--acp",
                "--auth-type",
                "openai",
                "--openai-api-key",
                PLACEHOLDER,
                "--openai-base-url",
                UNREACHABLE_MODEL,
            ),
            prompt=True,
        ),
        Adapter("copilot", "@github/copilot", ("copilot", "--acp"), login=True),
        Adapter("auggie", "@augmentcode/auggie", ("auggie", "--acp"), login=True),
        # pi-acp runs `pi`. The package now named @earendil-works/pi-coding-agent did not
        # install from the registry (its dependency marked-cjk-friendly answered 404); the
        # same program under its former name does.
        Adapter("pi-acp", "pi-acp", ("pi-acp",), login=True, needs=("@mariozechner/pi-coding-agent@0.73.1",)),
    )
}


# The adapters the sessions-*, spec-*, raw-* and acpx checks run (the matrix-* checks run them all).
POOL_ADAPTERS = ("codex-acp", "claude-agent-acp")
NPM_PACKAGES = (
    "acpx@latest",
    *(f"{adapter.package}@latest" for adapter in ADAPTERS.values()),
    *(need for adapter in ADAPTERS.values() for need in adapter.needs),
)
