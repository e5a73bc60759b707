"""Manual check: published ACP clients and adapters work unchanged through acp-proxy.

    scripts/check-peers [WORKDIR] [--proxy CMD] [--proxy-python PY] [--no-install] [--only NAME]...

Not run by the test suite: it needs npm, and network access to the npm registry
and PyPI. It installs the peers into WORKDIR (default /tmp/acp-peers):

* npm: acpx (a headless ACP client) and the adapters of the ADAPTERS table
  (@zed-industries/codex-acp, @zed-industries/claude-agent-acp,
  @google/gemini-cli, opencode-ai, @qwen-code/qwen-code, @github/copilot,
  @augmentcode/auggie, pi-acp, and the pi program pi-acp runs);
* a venv with agent-client-protocol, the Python ACP SDK, used for both a client
  and an agent (the agent answers offline, so no API key is needed).

Every check runs twice, once straight against the peer and once with the agent
command wrapped as ``acp-proxy -- CMD``, and compares the two: the only allowed
differences are in the initialize result: ``_meta["acp-proxy"]``, and the
session capabilities the proxy serves itself (``close``, ``list`` and
``delete``, and ``resume`` when the adapter can load), which must be present
through the proxy; ``fork`` is relayed as the adapter advertised it.
After each run no process it started may be left (every process gets a marker
in its environment and /proc is searched for it); a leftover after a proxied
run is a failure, after a direct run a note.

* sdk-prompt-turn[-trio]: SDK client and SDK agent, the wire messages on both
  sides of the proxy compared (the -trio variant runs the proxy on trio);
* acpx-exec-*, acpx-sessions-*: acpx driving the SDK agent, the proxy's echo
  agent, codex-acp and claude-agent-acp (the adapters stop at their auth error);
* raw-*: initialize, session/new (and a prompt if a session opened) piped into
  each adapter, then stdin EOF, then the same with SIGTERM to the proxy;
* sessions-*: the session pool, through the proxy only, with ``max_live = 1``
  (a config of its own, a private HOME and state dir per check):
  sessions-codex-acp / sessions-claude-agent-acp drive raw JSON-RPC: two
  sessions over one process slot (the second suspends the first, a prompt to
  the first resumes it), then a second proxy on the same state dir whose
  session/load must replay the first session's prompts;
  sessions-acpx-* drive acpx named sessions (every acpx command a new proxy),
  then read both conversations back with session/load through a fresh proxy.
  The adapters keep a session only once it had a turn, and a turn fails without
  credentials only after the prompt is recorded, so the conversations checked
  are the users' prompts. No session id the gateway never got from
  session/new may reach it.
* spec-*: session/close, session/delete and session/fork through the proxy
  (raw JSON-RPC, ``max_live = 1``, the sessions-* setup): a closed session is
  listed as closed, its process tree is gone, a prompt to it is -32002
  session_closed, and the gateway's session/load (or session/resume) brings
  it back, the load replaying its prompt; session/delete of a live and of a
  closed session is ``{}``, unlists them, and a later session/load is -32002
  session_deleted, also for a second proxy on the same state dir. Where the
  adapter forks (claude-agent-acp), session/fork after a prompt: the fork gets
  its own id and row (``parentSessionId``) and the parent's process, and its
  prompt; the parent comes back on a process of its own, its load replaying
  only its own prompt. NOTE lines say whether the adapter itself advertises
  delete and still loads a session the proxy deleted, and what it answered
  to session/fork; those are the adapter's business, not failures.
* install-acpx-*: the install's one pool across proxies. acpx runs a queue
  owner, hence a proxy, per named session; three named sessions over one state
  dir whose config says ``max_live = 1`` (and a generous acquire_timeout).
  sessions new x3, prompts one/two/three/one, then set-mode two/three/one one at
  a time and all three at once: each step needs its session's adapter, so
  another proxy must suspend its session first, and the step must bring the
  session back on a new process. Meanwhile a thread samples /proc every 50 ms
  for the check's adapter trees (processes carrying a lease marker) and fails
  the check if two were ever alive at once, and another runs ``acp-proxy status
  --json`` about every second (at most one slot held). Then the queue owners
  are stopped (SIGTERM, as stopping acpx does), nothing may be left, and a fresh
  proxy's session/load must replay each session's prompts, whole and apart.
  acpx drops its agent's stderr, so the proxies' logs are appended to
  WORKDIR/logs/<check>-proxies.stderr (the agent command is ``sh -c 'exec
  acp-proxy ... 2>>LOG'``).

* matrix-*: one scenario for every adapter of the ADAPTERS table (codex-acp,
  claude-agent-acp, gemini-cli, opencode, qwen-code, GitHub Copilot CLI, auggie,
  pi-acp), run straight and through ``acp-proxy -- ADAPTER ARGV`` (a private HOME
  per run, a private state dir for the proxy): initialize, authenticate (where
  the row names a method), session/new, session/set_mode to ``plan`` (or
  session/set_config_option where only a mode option is offered), a prompt
  (where the adapter records it offline), a prompt cancelled with
  session/cancel (where a turn stays under way offline), session/close, session/load and
  session/resume (where advertised, each after a close), session/list. Straight,
  a closed session's process ends as the proxy ends it and each restore runs on
  a new process. Compared: initialize (the allowed differences above),
  authenticate, session/new and the mode setting (answers and notifications),
  the prompt's outcome; the cancelled turn's outcome, answered through the
  proxy within its cancel_timeout (30 s by default) however late the adapter
  answers; a restore the adapter did straight must be done through
  the proxy, without starting afresh, with the same result but for the mode the
  proxy re-applies, which modes and configOptions must both show; a restore the
  adapter refused may start afresh (historyReset) on the errors the proxy falls
  back on, and otherwise the proxy's error keeps the adapter's code, message and
  data, adding its own data.reason; session/list lists the session with the
  title the adapter's own list gives it (asked straight afterwards, on the
  proxied run's HOME). Adapters that refuse session/new without a login
  (copilot, auggie, pi-acp) must refuse it identically through the proxy, which
  then lists nothing. Nothing may be left running after either run, nor any
  process of the session after session/close through the proxy.

Prints one PASS/FAIL line per check (NOTE lines add what the peers did) and
exits 1 if any check failed. Logs and transcripts are kept in WORKDIR/logs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.kit import markers, proctree
from tests.kit.gateway import Closed, SyncGateway

REPO = Path(__file__).resolve().parent.parent
PYPI_PACKAGES = ("agent-client-protocol",)
PROXY_META = "acp-proxy"
MARKER_VAR = "ACP_CHECK_PEERS_RUN"
# Credentials are scrubbed so every adapter answers the same way on every
# machine (without them the adapters still answer initialize, then refuse).
# IS_SANDBOX makes claude-agent-acp pass --dangerously-skip-permissions, which
# Claude Code refuses as root, so session/new would fail for a reason of its own.
SCRUBBED_ENV = (
    "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
    "CODEX_API_KEY",
    "CODEX_HOME",
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_AUTH_TOKEN",
    "CLAUDE_CODE_OAUTH_TOKEN",
    "CLAUDE_CONFIG_DIR",
    "IS_SANDBOX",
    "GEMINI_API_KEY",
    "GOOGLE_API_KEY",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GOOGLE_CLOUD_PROJECT",
    "DASHSCOPE_API_KEY",
    "GH_TOKEN",
    "GITHUB_TOKEN",
    "COPILOT_GITHUB_TOKEN",
    "AUGMENT_SESSION_AUTH",
    "OPENCODE_CONFIG",
    "ACP_PROXY_CONFIG",
    "ACP_PROXY_STATE_DIR",
    "ACP_PROXY_LOG_LEVEL",
    "ACP_PROXY_ASYNC_BACKEND",
    "XDG_CONFIG_HOME",
    "XDG_STATE_HOME",
    "XDG_DATA_HOME",
    "XDG_CACHE_HOME",
)

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
CLIENT_INITIALIZE = {
    "protocolVersion": 1,
    "clientInfo": {"name": "check-peers", "version": "1"},
    "clientCapabilities": {"fs": {"readTextFile": False, "writeTextFile": False}, "terminal": False},
}
FIRST_WORDS = "remember the word PELICAN"
SECOND_WORDS = "which word did I ask you to remember?"
OTHER_WORDS = "remember the word OTTER"
THIRD_WORDS = "remember the word HERON"
PROMPT_TIMEOUT = 180.0  # codex-acp retries an unreachable model for about 30s
# The install-* checks: acpx named sessions, each its own queue owner and so its own proxy,
# over one state dir whose pool has one process slot. The queue owners must outlive the
# check's steps (a codex-acp turn takes half a minute offline); they are stopped at the end.
INSTALL_SESSIONS = ("one", "two", "three")
INSTALL_TTL = 600
INSTALL_POOL = 'acquire_timeout = "3m"  # three proxies may queue for the slot at once\n'
TREE_SAMPLE_EVERY = 0.05
SLOT_SAMPLE_EVERY = 1.0
PROXY_REASONS = frozenset(
    {
        "spawn_failed",
        "adapter_exited",
        "pool_exhausted",
        "restore_failed",
        "restore_timeout",
        "resume_disabled",
        "unknown_session",
        "session_in_use",
        "session_closed",
        "session_deleted",
        "start_timeout",
        "unknown_backend",
        "proxy_shutdown",
    }
)

# --- the Python SDK peers ---------------------------------------------------------------
# Written into WORKDIR/sdk and run with the venv's Python. Both record every wire
# message they see or send (the SDK's stream observers), so the direct run and
# the proxied run can be compared message by message on both sides of the proxy.

SDK_AGENT = r'''
"""An ACP agent on the Python SDK's Agent API (acp.run_agent); answers offline.

A prompt turn streams a thought, a plan and a tool call, asks the client for
permission, streams the prompt back word by word, calls a client extension
method, sends an extension notification and ends the turn. The prompt
"wait for cancel" streams one chunk and waits for session/cancel.
Wire messages are appended to $PEER_AGENT_TRANSCRIPT if set.
"""

import asyncio
import json
import os
from typing import Any

from acp import (
    PROTOCOL_VERSION, InitializeResponse, NewSessionResponse, PromptResponse, RequestError,
    plan_entry, run_agent, start_tool_call, update_agent_message_text, update_agent_thought_text,
    update_plan, update_tool_call,
)
from acp.schema import AgentCapabilities, Implementation, PermissionOption, ToolCallUpdate

TRANSCRIPT = os.environ.get("PEER_AGENT_TRANSCRIPT")


def record(event: Any) -> None:
    if TRANSCRIPT:
        with open(TRANSCRIPT, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"dir": event.direction.value, "msg": event.message}) + "\n")


class PeerAgent:
    def __init__(self) -> None:
        self.sessions = 0
        self.cancelled: dict[str, asyncio.Event] = {}

    def on_connect(self, conn: Any) -> None:
        self.conn = conn

    async def initialize(self, protocol_version: int, client_capabilities: Any = None,
                         client_info: Any = None, **kwargs: Any) -> InitializeResponse:
        response = InitializeResponse(
            protocol_version=min(protocol_version, PROTOCOL_VERSION),
            agent_capabilities=AgentCapabilities(load_session=False),
            agent_info=Implementation(name="sdk-peer-agent", version="1.0.0"),
        )
        # The agent's own _meta must survive the proxy adding its key next to it.
        response.field_meta = {"sdk-peer": {"kept": True}}
        return response

    async def new_session(self, cwd: str, mcp_servers: Any = None, **kwargs: Any) -> NewSessionResponse:
        self.sessions += 1
        session_id = f"sdk-session-{self.sessions}"
        self.cancelled[session_id] = asyncio.Event()
        response = NewSessionResponse(session_id=session_id)
        response.field_meta = {"requestMeta": kwargs or None}  # shows the request's _meta arrived
        return response

    async def cancel(self, session_id: str, **kwargs: Any) -> None:
        self.cancelled.setdefault(session_id, asyncio.Event()).set()

    async def prompt(self, session_id: str, prompt: list[Any], **kwargs: Any) -> PromptResponse:
        text = " ".join(getattr(block, "text", "") or "" for block in prompt)
        cancelled = self.cancelled.setdefault(session_id, asyncio.Event())
        cancelled.clear()
        say = self.conn.session_update
        if text == "wait for cancel":
            await say(session_id, update_agent_message_text("waiting "))
            try:
                await asyncio.wait_for(cancelled.wait(), timeout=15)
            except asyncio.TimeoutError:
                return PromptResponse(stop_reason="end_turn")
            return PromptResponse(stop_reason="cancelled")
        await say(session_id, update_agent_thought_text("echoing the prompt"))
        await say(session_id, update_plan([plan_entry("echo the prompt", status="in_progress")]))
        await say(session_id, start_tool_call("echo-1", "Echo", kind="other", status="pending"))
        permission = await self.conn.request_permission(
            session_id=session_id,
            tool_call=ToolCallUpdate(tool_call_id="echo-1", title="Echo"),
            options=[
                PermissionOption(option_id="allow", name="Allow", kind="allow_once"),
                PermissionOption(option_id="reject", name="Reject", kind="reject_once"),
            ],
        )
        if getattr(permission.outcome, "option_id", None) != "allow":
            await say(session_id, update_tool_call("echo-1", status="failed"))
            return PromptResponse(stop_reason="refusal")
        await say(session_id, update_tool_call("echo-1", status="completed"))
        for word in text.split():
            await say(session_id, update_agent_message_text(word + " "))
        try:
            pong = await self.conn.ext_method("peers/ping", {"session": session_id})
        except RequestError as exc:  # a client without the extension: method not found
            pong = {"error": exc.code}
        await self.conn.ext_notification("peers/turn_done", {"session": session_id})
        response = PromptResponse(stop_reason="end_turn")
        response.field_meta = {"pong": pong}
        return response

    async def ext_method(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        if method == "peers/echo":
            return {"method": method, "params": params}
        raise RequestError.method_not_found("_" + method)

    async def ext_notification(self, method: str, params: dict[str, Any]) -> None:
        return None


if __name__ == "__main__":
    asyncio.run(run_agent(PeerAgent(), observers=[record]))
'''

SDK_CLIENT = r'''
"""An ACP client on the Python SDK (acp.spawn_agent_process).

usage: sdk_client.py TRANSCRIPT STDERR_LOG -- AGENT_CMD ARG...

initialize, session/new (with _meta), a full prompt turn (answering the agent's
permission request and extension call), a client extension request and
notification, an unknown method, and a cancelled turn. Prints a JSON summary;
wire messages are appended to TRANSCRIPT.
"""

import asyncio
import json
import os
import sys
import time
from typing import Any

from acp import PROTOCOL_VERSION, RequestError, spawn_agent_process, text_block
from acp.schema import AllowedOutcome, ClientCapabilities, Implementation, RequestPermissionResponse

BIG_WORD = "x" * (2 * 1024 * 1024)  # a 2 MiB line, far over any pipe buffer


class PeerClient:
    def __init__(self) -> None:
        self.updates: list[str] = []
        self.permission_requests = 0
        self.ext_notifications: list[str] = []
        self.first_chunk = asyncio.Event()

    async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
        kind = getattr(update, "session_update", type(update).__name__)
        if kind == "agent_message_chunk":
            self.first_chunk.set()
        self.updates.append(kind)

    async def request_permission(self, session_id: str, tool_call: Any, options: Any, **kwargs: Any) -> Any:
        self.permission_requests += 1
        return RequestPermissionResponse(outcome=AllowedOutcome(outcome="selected", option_id="allow"))

    async def ext_method(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        return {"pong": params}

    async def ext_notification(self, method: str, params: dict[str, Any]) -> None:
        self.ext_notifications.append(method)


def dump(model: Any) -> Any:
    return model.model_dump(by_alias=True, exclude_none=True)


async def run(transcript: str, stderr_log: str, command: list[str]) -> dict[str, Any]:
    def record(event: Any) -> None:
        with open(transcript, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"dir": event.direction.value, "msg": event.message}) + "\n")

    client = PeerClient()
    summary: dict[str, Any] = {}
    with open(stderr_log, "ab") as err:
        async with spawn_agent_process(
            client, command[0], *command[1:],
            env=dict(os.environ),
            transport_kwargs={"stderr": err, "shutdown_timeout": 5.0},
            observers=[record],
        ) as (conn, process):
            init = await conn.initialize(
                protocol_version=PROTOCOL_VERSION,
                client_capabilities=ClientCapabilities(),
                client_info=Implementation(name="sdk-peer-client", version="1.0.0"),
            )
            summary["initialize"] = dump(init)
            session = await conn.new_session(cwd="/", mcp_servers=[], gateway={"trace": "t-1"})
            summary["session"] = dump(session)
            sid = session.session_id
            turn = await conn.prompt(session_id=sid, prompt=[text_block(f"stream these words {BIG_WORD} please")])
            summary["turn"] = dump(turn)
            summary["updates"] = list(client.updates)
            summary["permission_requests"] = client.permission_requests
            payload = {"nested": {"list": [1, 2.5, None, "\u00fc\u20ac"]}}
            summary["ext_echo"] = await conn.ext_method("peers/echo", payload)
            await conn.ext_notification("peers/note", {"hello": "agent"})
            try:
                await conn._conn.send_request("session/does_not_exist", {"sessionId": sid})
                summary["unknown_method"] = "answered"
            except RequestError as exc:
                summary["unknown_method"] = {"code": exc.code}
            client.first_chunk.clear()
            waiting = asyncio.ensure_future(conn.prompt(session_id=sid, prompt=[text_block("wait for cancel")]))
            await asyncio.wait_for(client.first_chunk.wait(), timeout=15)
            await conn.cancel(session_id=sid)
            summary["cancelled_turn"] = dump(await asyncio.wait_for(waiting, timeout=15))
            summary["ext_notifications"] = client.ext_notifications
            closing = time.monotonic()
        # Leaving the block closed the agent's stdin and waited for it to exit
        # (SIGTERM after shutdown_timeout): the exit status says which happened.
        summary["exit_status"] = process.returncode
        summary["exit_seconds"] = round(time.monotonic() - closing, 2)
    return summary


def main() -> int:
    transcript, stderr_log, sep, *command = sys.argv[1:]
    assert sep == "--" and command, __doc__
    summary = asyncio.run(asyncio.wait_for(run(transcript, stderr_log, command), timeout=90))
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''


# --- results ----------------------------------------------------------------------------


class CheckFailed(Exception):
    """A check's verdict: the message says what differed or broke."""


class Report:
    def __init__(self) -> None:
        self.failed: list[str] = []
        self.passed: list[str] = []

    def result(self, name: str, ok: bool, detail: str) -> None:
        (self.passed if ok else self.failed).append(name)
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)

    @staticmethod
    def note(name: str, detail: str) -> None:
        print(f"NOTE  {name}: {detail}", flush=True)


# --- processes --------------------------------------------------------------------------


class Runs:
    """Environments for the processes a check starts, and the search for leftovers.

    Each run (one check, direct or proxied) gets its own marker value in the
    environment; every descendant inherits it, even one that left the process
    group, so /proc finds whatever a run left behind.
    """

    def __init__(self, base_env: dict[str, str]) -> None:
        self.base_env = base_env
        self.prefix = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def env(self, run: str, **extra: str) -> tuple[dict[str, str], str]:
        marker = f"{self.prefix}-{run}"
        return {**self.base_env, MARKER_VAR: marker, **extra}, marker

    def leftovers(self, marker: str, wait: float) -> list[tuple[int, str]]:
        """Processes still carrying ``marker`` after ``wait`` seconds; they are then killed."""
        deadline = time.monotonic() + wait
        while (found := markers.find(MARKER_VAR, marker)) and time.monotonic() < deadline:
            time.sleep(0.1)
        markers.kill(found.values())
        return [(pid, marked.command[:160]) for pid, marked in found.items()]

    def kill_everything(self) -> None:
        """Last resort on exit: no process this invocation started may outlive it."""
        markers.kill(markers.find(MARKER_VAR, self.prefix, prefix=True).values())


def kill_group(process: subprocess.Popen[bytes]) -> None:
    """End a process started with ``start_new_session=True`` and its group."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except OSError:
            return
        try:
            process.wait(3)
            return
        except subprocess.TimeoutExpired:
            continue


def run_command(argv: list[str], env: dict[str, str], log: Path, timeout: float, cwd: Path) -> tuple[int, str]:
    """Run to completion in its own process group; stdout returned, stderr to ``log``."""
    with open(log, "ab") as err:
        err.write(f"$ {shlex.join(argv)}\n".encode())
        err.flush()
        process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env, cwd=cwd, start_new_session=True
        )
        try:
            out, _ = process.communicate(b"", timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(process)
            raise CheckFailed(f"timed out after {timeout:.0f}s: {shlex.join(argv)} (see {log})") from None
    return process.returncode, out.decode(errors="replace")


def open_peer(argv: list[str], env: dict[str, str], log: Path, cwd: Path) -> SyncGateway:
    """A JSON-RPC peer on stdio (the kit's client), in its own process group; its stderr goes to ``log``."""
    with open(log, "ab") as err:
        return SyncGateway.launch(
            argv, env=env, cwd=cwd, stderr=err, start_new_session=True, name=Path(argv[0]).name, first_id=1
        )


def answer_to(peer: SyncGateway, request_id: Any, timeout: float) -> dict[str, Any]:
    """Read until the response to a request sent with ``send``; everything read is kept in ``received``."""
    try:
        return peer.response_to(request_id, timeout)
    except TimeoutError:
        raise CheckFailed(f"no answer to request {request_id!r} within {timeout:.0f}s") from None
    except Closed:
        raise CheckFailed(f"stdout closed before the answer to request {request_id!r}") from None


def call(peer: SyncGateway, method: str, params: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
    """A numbered request and its answer."""
    try:
        return peer.request(method, params, timeout=timeout)
    except TimeoutError:
        raise CheckFailed(f"no answer to {method} within {timeout:.0f}s") from None
    except Closed:
        raise CheckFailed(f"stdout closed before the answer to {method}") from None


def call_result(peer: SyncGateway, method: str, params: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
    """The answer's result; an error answer fails the check."""
    answer = call(peer, method, params, timeout)
    if "result" not in answer:
        raise CheckFailed(f"{method} failed: {short(answer.get('error'))}")
    return answer["result"] if isinstance(answer["result"], dict) else {}


def updates(peer: SyncGateway, since: int = 0) -> list[dict[str, Any]]:
    """The ``session/update`` params received since message ``since``."""
    return [
        m["params"]
        for m in peer.received[since:]
        if m.get("method") == "session/update" and isinstance(m.get("params"), dict)
    ]


def transcript(peer: SyncGateway) -> list[Any]:
    """Every message received, then any line that was not a JSON object."""
    return [*peer.received, *({"non-json": line.decode(errors="replace")} for line in peer.bad_lines)]


def close_stdin(peer: SyncGateway, timeout: float) -> float | None:
    """Close stdin; seconds until the process exited, or None if it was still running."""
    start = time.monotonic()
    peer.close_input()
    return time.monotonic() - start if peer.wait(timeout) else None


def end(peer: SyncGateway) -> None:
    if peer.process.poll() is None:
        kill_group(peer.process)
    peer.close(timeout=5)


# --- comparing what each side saw --------------------------------------------------------


def pop_proxy_meta(message: Any) -> Any:
    """Remove and return ``_meta["acp-proxy"]`` from a response's result (None if absent)."""
    result = message.get("result") if isinstance(message, dict) else None
    meta = result.get("_meta") if isinstance(result, dict) else None
    if not isinstance(meta, dict) or PROXY_META not in meta:
        return None
    found = meta.pop(PROXY_META)
    if not meta:
        assert isinstance(result, dict)
        del result["_meta"]
    return found


def strip_proxy_meta(messages: list[Any], proxied: bool, where: str) -> list[Any]:
    """The messages without the proxy's initialize annotation, which must be there iff proxied."""
    found = [meta for meta in map(pop_proxy_meta, messages) if meta is not None]
    if proxied and len(found) != 1:
        raise CheckFailed(f"{where}: expected _meta[{PROXY_META!r}] in the initialize result once, got {found}")
    if proxied and not (isinstance(found[0], dict) and {"version", "backend"} <= found[0].keys()):
        raise CheckFailed(f"{where}: _meta[{PROXY_META!r}] lacks version/backend: {found[0]}")
    if not proxied and found:
        raise CheckFailed(f"{where}: _meta[{PROXY_META!r}] present without the proxy")
    for message in messages:
        result = message.get("result") if isinstance(message, dict) else None
        if isinstance(result, dict) and "protocolVersion" in result:
            add_served_capabilities(result, proxied, where)
    return messages


SERVED_SESSION_CAPABILITIES = ("close", "list", "delete")


def add_served_capabilities(result: dict[str, Any], proxied: bool, where: str) -> None:
    """An initialize result with the session capabilities the proxy serves itself.

    The proxy adds ``sessionCapabilities.close``, ``.list`` and ``.delete`` always,
    and ``.resume`` when the adapter can load or resume; ``.fork`` it relays as the
    adapter advertised it (README). Proxied, the first three must be there; both
    sides then get the same adjustments, so what remains compared is everything
    else the adapter itself advertised, ``fork`` included.
    """
    caps = result.get("agentCapabilities")
    caps = dict(caps) if isinstance(caps, dict) else {}
    sessions = caps.get("sessionCapabilities")
    sessions = dict(sessions) if isinstance(sessions, dict) else {}
    missing = [key for key in SERVED_SESSION_CAPABILITIES if not isinstance(sessions.get(key), dict)]
    if proxied and missing:
        raise CheckFailed(f"{where}: the initialize result lacks sessionCapabilities {missing}, served by the proxy")
    for key in SERVED_SESSION_CAPABILITIES:
        sessions.setdefault(key, {})
    if caps.get("loadSession") is True or isinstance(sessions.get("resume"), dict):
        sessions.setdefault("resume", {})
    caps["sessionCapabilities"] = sessions
    result["agentCapabilities"] = caps


def label_ids(entries: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Messages per direction, request ids replaced by their order among that side's requests.

    The proxy remaps ids per hop, so an agent sees other ids than the client sent,
    and agent->client requests reach the client under the proxy's ids; what must
    not change is which answer belongs to which request.
    """
    labels: dict[tuple[str, str], str] = {}
    count = {"incoming": 0, "outgoing": 0}
    by_direction: dict[str, list[Any]] = {"incoming": [], "outgoing": []}
    for entry in entries:
        direction, message = entry["dir"], dict(entry["msg"])
        if "id" in message and "method" in message:
            label = f"{direction}-request-{count[direction]}"
            count[direction] += 1
            labels[(direction, json.dumps(message["id"]))] = label
            message["id"] = label
        elif "id" in message:
            other = "outgoing" if direction == "incoming" else "incoming"
            message["id"] = labels.get((other, json.dumps(message["id"])), f"unmatched {message['id']!r}")
        by_direction[direction].append(message)
    return by_direction


def relabel_requests(messages: list[Any]) -> list[Any]:
    """Request ids replaced by the request's position; an answer gets its request's label.

    acpx prints what it saw without saying who sent it, and agent->client requests
    reach it under ids the proxy chose, so only the pairing of answers with
    requests is compared. An answer belongs to the latest unanswered request with
    its id (acpx's ids and the agent's may coincide).
    """
    pending: dict[str, list[str]] = {}
    out = []
    requests = 0
    for message in messages:
        if isinstance(message, dict) and "id" in message:
            message, key = dict(message), json.dumps(message["id"])
            if "method" in message:
                label = f"request-{requests}"
                requests += 1
                pending.setdefault(key, []).append(label)
                message["id"] = label
            else:
                waiting = pending.get(key)
                message["id"] = waiting.pop() if waiting else f"unmatched {message['id']!r}"
        out.append(message)
    return out


def first_difference(direct: list[Any], proxied: list[Any]) -> str | None:
    for index, (a, b) in enumerate(zip(direct, proxied, strict=False)):
        if a != b:
            return f"message {index}: direct {short(a)} vs proxied {short(b)}"
    if len(direct) != len(proxied):
        return f"direct had {len(direct)} messages, proxied {len(proxied)}"
    return None


def short(value: Any, limit: int = 400) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[:limit] + "..."


PID_IN_ID = re.compile(r"\becho-\d+-")
ECHO_ID = re.compile(r"\becho-[0-9a-f]{8}\b")
UUID = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b")


def normalize_ids(value: Any) -> Any:
    """Session ids are fresh in every run (the echo agent's are random or carry its pid, Claude's are UUIDs)."""
    text = ECHO_ID.sub("echo-ID", PID_IN_ID.sub("echo-PID-", json.dumps(value)))
    return json.loads(UUID.sub("UUID", text))


def unordered_notifications(messages: list[Any]) -> list[Any]:
    """Requests and answers in order, then the notifications sorted.

    An adapter may send a notification (Claude's available_commands_update) from
    a timer, so where it lands among the answers varies from run to run, with or
    without the proxy; which notifications arrive, and their content, must not.
    """

    def is_notification(m: Any) -> bool:
        return isinstance(m, dict) and "method" in m and "id" not in m

    ordered = [m for m in messages if not is_notification(m)]
    loose = sorted((m for m in messages if is_notification(m)), key=lambda m: json.dumps(m, sort_keys=True))
    return ordered + loose


def json_lines(text: str) -> list[Any]:
    out = []
    for line in text.splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError:
                out.append({"text": line})
    return out


# --- the checks -------------------------------------------------------------------------


class Checker:
    def __init__(self, args: argparse.Namespace, report: Report) -> None:
        self.work = Path(args.workdir).resolve()
        self.logs = self.work / "logs"
        self.ws = self.work / "workspace"  # the cwd given to sessions
        self.home = self.work / "home"
        self.proxy = shlex.split(args.proxy) if args.proxy else default_proxy()
        self.proxy_python = args.proxy_python or default_proxy_python()
        self.report = report
        self.bin = self.work / "npm" / "node_modules" / ".bin"
        self.venv_python = self.work / "venv" / "bin" / "python"
        for directory in (self.logs, self.ws, self.home):
            directory.mkdir(parents=True, exist_ok=True)
        # claude-agent-acp watches ~/.claude once a session exists, and that watch
        # keeps it alive after stdin closes; create it so every run sees the state
        # a real user's machine has (and the same state direct and proxied).
        (self.home / ".claude").mkdir(exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}
        # A private HOME: no real credentials, acpx session store or proxy config leaks in.
        env.update(HOME=str(self.home), NO_COLOR="1", PYTHONDONTWRITEBYTECODE="1")
        self.runs = Runs(env)

    # -- setup -------------------------------------------------------------------

    def install(self) -> None:
        env = dict(os.environ)
        if shutil.which("npm") is None:
            raise SystemExit("check-peers: npm not found (Node 18+ with npm is needed)")
        print(f"== installing peers into {self.work}", flush=True)
        subprocess.run(
            [
                "npm",
                "install",
                "--prefix",
                str(self.work / "npm"),
                "--no-audit",
                "--no-fund",
                "--loglevel=error",
                *NPM_PACKAGES,
            ],
            check=True,
            env=env,
        )
        if not self.venv_python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(self.work / "venv")], check=True)
        subprocess.run(
            [
                str(self.venv_python),
                "-m",
                "pip",
                "install",
                "--quiet",
                "--upgrade",
                "--disable-pip-version-check",
                *PYPI_PACKAGES,
            ],
            check=True,
            env=env,
        )

    def write_sdk_peers(self) -> None:
        sdk = self.work / "sdk"
        sdk.mkdir(exist_ok=True)
        (sdk / "sdk_agent.py").write_text(SDK_AGENT.lstrip())
        (sdk / "sdk_client.py").write_text(SDK_CLIENT.lstrip())

    def versions(self) -> None:
        for package in (
            "acpx",
            *(adapter.package for adapter in ADAPTERS.values()),
            "@anthropic-ai/claude-agent-sdk",
            *(need.rpartition("@")[0] for adapter in ADAPTERS.values() for need in adapter.needs),
        ):
            manifest = self.work / "npm" / "node_modules" / package / "package.json"
            version = json.loads(manifest.read_text())["version"] if manifest.exists() else "missing"
            print(f"   {package} {version}")
        code = "import importlib.metadata as m; print(m.version('agent-client-protocol'))"
        found = self.venv_python.exists()
        sdk = subprocess.run([str(self.venv_python), "-c", code], capture_output=True, text=True) if found else None
        print(f"   agent-client-protocol (PyPI) {(sdk.stdout.strip() if sdk else '') or 'missing'}")
        proxy = subprocess.run([*self.proxy, "--version"], capture_output=True, text=True, env=self.runs.base_env)
        print(f"   {shlex.join(self.proxy)}: {proxy.stdout.strip() or proxy.stderr.strip()}")
        print(
            f"   node {subprocess.run(['node', '--version'], capture_output=True, text=True).stdout.strip()}",
            flush=True,
        )

    # -- helpers -----------------------------------------------------------------

    def command(self, adapter: str) -> list[str]:
        """The adapter's launch command, its program from the npm install."""
        program, *args = ADAPTERS[adapter].argv
        return [str(self.bin / program), *args]

    def adapter_env(self, adapter: str) -> dict[str, str]:
        """What the adapter needs in its environment: placeholder credentials, the install's .bin on PATH."""
        found = ADAPTERS[adapter]
        extra = dict(found.env)
        if found.needs:
            extra["PATH"] = f"{self.bin}{os.pathsep}{self.runs.base_env.get('PATH', os.defpath)}"
        return extra

    def sdk_agent(self) -> list[str]:
        return [str(self.venv_python), str(self.work / "sdk" / "sdk_agent.py")]

    def echo_agent(self) -> list[str]:
        return [self.proxy_python, "-m", "acp_proxy.examples.echo_agent"]

    def proxied(self, command: list[str]) -> list[str]:
        return [*self.proxy, "--", *command]

    def check_leftovers(self, name: str, mode: str, marker: str, wait: float = 5.0) -> None:
        left = self.runs.leftovers(marker, wait)
        if not left:
            return
        listing = "; ".join(f"pid {pid} {cmd}" for pid, cmd in left)
        if mode == "proxy":
            raise CheckFailed(f"processes left running after the proxied run (killed now): {listing}")
        self.report.note(name, f"the direct run left processes running (killed now): {listing}")

    def run_check(self, name: str, body: Callable[[str], str]) -> None:
        try:
            detail = body(name)
        except CheckFailed as exc:
            self.report.result(name, False, str(exc))
        except Exception as exc:  # a broken peer install or a bug here: still one line per check
            self.report.result(name, False, f"{type(exc).__name__}: {exc}")
        else:
            self.report.result(name, True, detail)

    # -- 1. the Python SDK: client and agent -------------------------------------

    def sdk_turn(self, name: str, proxy_options: tuple[str, ...] = ()) -> str:
        results = {}
        for mode in ("direct", "proxy"):
            stem = self.logs / f"{name}-{mode}"
            for suffix in (".client.jsonl", ".agent.jsonl", ".stderr"):
                Path(f"{stem}{suffix}").unlink(missing_ok=True)
            env, marker = self.runs.env(f"{name}-{mode}", PEER_AGENT_TRANSCRIPT=f"{stem}.agent.jsonl")
            agent = self.sdk_agent()
            if mode == "proxy":
                agent = [*self.proxy, *proxy_options, "--", *agent]
            argv = [
                str(self.venv_python),
                str(self.work / "sdk" / "sdk_client.py"),
                f"{stem}.client.jsonl",
                f"{stem}.stderr",
                "--",
                *agent,
            ]
            rc, out = run_command(argv, env, Path(f"{stem}.stderr"), timeout=120, cwd=self.ws)
            if rc != 0:
                raise CheckFailed(f"{mode}: the SDK client failed (exit {rc}); see {stem}.stderr")
            summary = json.loads(out.strip().splitlines()[-1])
            if mode == "proxy" and pop_proxy_meta({"result": summary["initialize"]}) is None:
                raise CheckFailed("proxied initialize result lacks _meta['acp-proxy']")
            add_served_capabilities(summary["initialize"], mode == "proxy", f"{mode} SDK client")
            if summary["exit_status"] != 0:
                raise CheckFailed(
                    f"{mode}: the agent command exited {summary['exit_status']} after stdin "
                    f"closed ({summary['exit_seconds']}s; negative: killed by the SDK client)"
                )
            expected = {
                "turn": {"_meta": {"pong": {"pong": {"session": "sdk-session-1"}}}, "stopReason": "end_turn"},
                "cancelled_turn": {"stopReason": "cancelled"},
                "permission_requests": 1,
            }
            for key, want in expected.items():
                if summary[key] != want:
                    raise CheckFailed(f"{mode}: {key} was {short(summary[key])}, expected {short(want)}")
            self.check_leftovers(name, mode, marker)
            results[mode] = summary
            for side in ("client", "agent"):
                entries = [json.loads(line) for line in Path(f"{stem}.{side}.jsonl").read_text().splitlines()]
                results[f"{mode}-{side}"] = entries
        for side in ("client", "agent"):
            direct = label_ids(results[f"direct-{side}"])
            proxied = label_ids(results[f"proxy-{side}"])
            for direction in ("incoming", "outgoing"):
                # Only the client's incoming side may carry the proxy's annotation.
                annotated = side == "client" and direction == "incoming"
                strip_proxy_meta(direct[direction], False, f"direct {side} {direction}")
                strip_proxy_meta(proxied[direction], annotated, f"proxied {side} {direction}")
                diff = first_difference(direct[direction], proxied[direction])
                if diff:
                    raise CheckFailed(f"{side} {direction} messages differ, {diff}")
        for key in ("exit_seconds",):
            results["direct"].pop(key)
            results["proxy"].pop(key)
        diff = first_difference([results["direct"]], [results["proxy"]])
        if diff:
            raise CheckFailed(f"SDK client results differ: {diff}")
        count = len(results["proxy-client"])
        updates = len(results["proxy"]["updates"])
        return (
            f"{count} messages seen by the client and by the agent, identical direct and proxied "
            f"(ids aside); {updates} session/update, permission round trip, extension calls, "
            f"a 2 MiB chunk, method-not-found and a cancelled turn all relayed"
        )

    # -- 2. acpx, a published client ---------------------------------------------

    def acpx(
        self, agent: list[str], *args: str, env: dict[str, str], log: Path, timeout: float = 120
    ) -> tuple[int, str]:
        argv = [str(self.bin / "acpx"), "--cwd", str(self.ws), "--agent", shlex.join(agent), *args]
        return run_command(argv, env, log, timeout=timeout, cwd=self.ws)

    def acpx_exec(
        self, name: str, agent: list[str], prompt: str, expect: Callable[[int, list[Any]], str | None]
    ) -> str:
        """``acpx exec`` (one stateless turn) against ``agent`` and ``acp-proxy -- agent``."""
        outputs = {}
        for mode, command in (("direct", agent), ("proxy", self.proxied(agent))):
            log = self.logs / f"{name}-{mode}.stderr"
            log.unlink(missing_ok=True)
            env, marker = self.runs.env(f"{name}-{mode}")
            rc, out = self.acpx(
                command, "--format", "json", "--approve-all", "--timeout", "60", "exec", prompt, env=env, log=log
            )
            (self.logs / f"{name}-{mode}.stdout").write_text(out)
            messages = strip_proxy_meta(normalize_ids(json_lines(out)), mode == "proxy", f"{mode} acpx output")
            problem = expect(rc, messages)
            if problem:
                raise CheckFailed(f"{mode}: {problem} (exit {rc}; see {log} and .stdout)")
            self.check_leftovers(name, mode, marker)
            outputs[mode] = (rc, messages)
        if outputs["direct"][0] != outputs["proxy"][0]:
            raise CheckFailed(f"acpx exit status {outputs['direct'][0]} direct vs {outputs['proxy'][0]} proxied")
        direct, proxied = (unordered_notifications(relabel_requests(outputs[mode][1])) for mode in ("direct", "proxy"))
        diff = first_difference(direct, proxied)
        if diff:
            raise CheckFailed(f"acpx saw different messages, {diff}")
        rc, messages = outputs["proxy"]
        return f"exit {rc} both ways, the same {len(messages)} messages ({outline(messages)})"

    def acpx_exec_adapter(self, name: str, adapter: str) -> str:
        """``acpx exec`` against a real adapter, which stops at its auth error without credentials."""
        return self.acpx_exec(name, self.command(adapter), "say hi", expect_initialized)

    def acpx_sessions(self, name: str) -> str:
        """acpx's persistent mode: a detached queue owner runs the agent for a named session."""
        outputs = {}
        for mode, command in (("direct", self.sdk_agent()), ("proxy", self.proxied(self.sdk_agent()))):
            log = self.logs / f"{name}-{mode}.stderr"
            log.unlink(missing_ok=True)
            env, marker = self.runs.env(f"{name}-{mode}")
            session = f"peers-{mode}"
            turn = ("--format", "json", "--approve-all", "--ttl", "1", "prompt", "-s", session, "persistent prompt")
            steps = [("sessions", "new", "--name", session), turn, ("sessions", "close", session)]
            transcript = []
            for step in steps:
                rc, out = self.acpx(command, *step, env=env, log=log)
                if rc != 0:
                    raise CheckFailed(f"{mode}: acpx {' '.join(step[:2])} exited {rc} (see {log})")
                transcript.append(normalize_ids(json_lines(out)))
            (self.logs / f"{name}-{mode}.stdout").write_text(json.dumps(transcript, indent=1))
            prompt = strip_proxy_meta(transcript[1], mode == "proxy", f"{mode} acpx prompt output")
            problem = expect_turn(0, prompt)
            if problem:
                raise CheckFailed(f"{mode}: {problem} (see {log})")
            # The queue owner lingers for its TTL (1 s) before it stops the agent.
            self.check_leftovers(name, mode, marker, wait=15)
            outputs[mode] = prompt
        diff = first_difference(relabel_requests(outputs["direct"]), relabel_requests(outputs["proxy"]))
        if diff:
            raise CheckFailed(f"acpx saw different messages, {diff}")
        return (
            f"sessions new / prompt / sessions close through acpx's queue owner: the same "
            f"{len(outputs['proxy'])} prompt messages ({outline(outputs['proxy'])}), nothing left running"
        )

    # -- 3. raw lines into the adapters --------------------------------------------

    def raw_session(self, peer: SyncGateway) -> None:
        """initialize, session/new and (if a session opened) a prompt, one line at a time."""
        peer.send(
            {
                "jsonrpc": "2.0",
                "id": 1,
                "method": "initialize",
                "params": {
                    "protocolVersion": 1,
                    "clientInfo": {"name": "check-peers", "version": "1"},
                    "clientCapabilities": {"fs": {"readTextFile": False, "writeTextFile": False}, "terminal": False},
                },
            }
        )
        answer_to(peer, 1, timeout=60)
        # A string id, to see it come back unchanged.
        peer.send(
            {
                "jsonrpc": "2.0",
                "id": "new-session",
                "method": "session/new",
                "params": {"cwd": str(self.ws), "mcpServers": []},
            }
        )
        answer = answer_to(peer, "new-session", timeout=60)
        session_id = (answer.get("result") or {}).get("sessionId")
        if session_id:  # an adapter that opens a session without credentials refuses the turn
            peer.send(
                {
                    "jsonrpc": "2.0",
                    "id": 3,
                    "method": "session/prompt",
                    "params": {"sessionId": session_id, "prompt": [{"type": "text", "text": "say hi"}]},
                }
            )
            answer_to(peer, 3, timeout=60)
        peer.drain(quiet=1.5, limit=10.0)

    def raw_adapter(self, name: str, adapter: str) -> str:
        seen: dict[str, list[Any]] = {}
        eof: dict[str, float | None] = {}
        for mode in ("direct", "proxy"):
            command = self.command(adapter)
            if mode == "proxy":
                command = self.proxied(command)
            log = self.logs / f"{name}-{mode}.stderr"
            log.unlink(missing_ok=True)
            env, marker = self.runs.env(f"{name}-{mode}")
            peer = open_peer(command, env, log, self.ws)
            try:
                self.raw_session(peer)
                # Direct: does the adapter exit on stdin EOF by itself? Proxied: the
                # proxy must exit, after its stdin grace and SIGTERM if needed.
                eof[mode] = close_stdin(peer, timeout=3.0 if mode == "direct" else 10.0)
                if mode == "proxy" and eof[mode] is None:
                    raise CheckFailed("the proxy was still running 10s after its stdin closed")
                if mode == "proxy" and peer.process.returncode != 0:
                    raise CheckFailed(f"the proxy exited {peer.process.returncode} after stdin EOF")
            finally:
                received = transcript(peer)  # what arrived before stdin closed
                end(peer)
            self.check_leftovers(name, mode, marker, wait=2.0)
            (self.logs / f"{name}-{mode}.stdout").write_text("\n".join(json.dumps(m) for m in received))
            received = normalize_ids(received)
            seen[mode] = unordered_notifications(strip_proxy_meta(received, mode == "proxy", f"{mode} {adapter}"))
        diff = first_difference(seen["direct"], seen["proxy"])
        if diff:
            raise CheckFailed(f"{adapter} answered differently, {diff}")
        if eof["direct"] is None:
            self.report.note(
                name,
                f"{adapter} ignores stdin EOF (still running 3s after it); through the "
                f"proxy it was stopped anyway (proxy exited {eof['proxy']:.1f}s after EOF)",
            )
        else:
            self.report.note(name, f"{adapter} exits on stdin EOF by itself ({eof['direct']:.1f}s)")
        term = self.raw_sigterm(name, adapter)
        return (
            f"the same {len(seen['proxy'])} messages ({outline(seen['proxy'])}); proxy exited 0 "
            f"{eof['proxy']:.1f}s after stdin EOF and {term:.1f}s after SIGTERM, no process left"
        )

    def raw_sigterm(self, name: str, adapter: str) -> float:
        """A gateway that stops its agent with SIGTERM (stdin left open): nothing may outlive the proxy."""
        log = self.logs / f"{name}-proxy-sigterm.stderr"
        log.unlink(missing_ok=True)
        env, marker = self.runs.env(f"{name}-proxy-sigterm")
        peer = open_peer(self.proxied(self.command(adapter)), env, log, self.ws)
        try:
            self.raw_session(peer)
            start = time.monotonic()
            peer.process.send_signal(signal.SIGTERM)  # the proxy only, as a gateway would
            try:
                status = peer.process.wait(10)
            except subprocess.TimeoutExpired:
                raise CheckFailed("the proxy was still running 10s after SIGTERM") from None
            if status != 0:
                raise CheckFailed(f"the proxy exited {status} after SIGTERM")
            elapsed = time.monotonic() - start
        finally:
            end(peer)
        self.check_leftovers(name, "proxy", marker, wait=2.0)
        return elapsed

    # -- 4. sessions: the pool with one process slot ----------------------------------

    def session_setup(self, name: str, adapter: str, pool: str = "") -> tuple[list[str], dict[str, str], str]:
        """The proxy command (a config with max_live = 1, and ``pool``'s lines), its environment and marker.

        Each check gets a fresh HOME (the adapters keep their sessions there) and
        state dir, so no check sees another's sessions or credentials.
        """
        base = self.work / "sessions" / name
        shutil.rmtree(base, ignore_errors=True)
        (base / "home" / ".claude").mkdir(parents=True)
        config = base / "proxy.toml"
        config.write_text(
            f"[pool]\nmax_live = 1\n{pool}\n[backends.{adapter}]\ncommand = {json.dumps(self.command(adapter))}\n"
        )
        env, marker = self.runs.env(
            name,
            HOME=str(base / "home"),
            ACP_PROXY_STATE_DIR=str(base / "state"),
            **self.adapter_env(adapter),
        )
        return [*self.proxy, "--config", str(config)], env, marker

    def session_gateway(self, command: list[str], env: dict[str, str], log: Path) -> tuple[SyncGateway, dict[str, Any]]:
        """A gateway that has initialized (and authenticated, if a method's variables are set)."""
        gateway = open_peer(command, env, log, self.ws)
        try:
            init = call_result(gateway, "initialize", CLIENT_INITIALIZE)
            for method in init.get("authMethods") or []:
                variables = [v.get("name") for v in method.get("vars") or [] if isinstance(v, dict)]
                if method.get("type") == "env_var" and variables and all(v in env for v in variables):
                    call_result(gateway, "authenticate", {"methodId": method["id"]})
                    break
        except BaseException:
            end(gateway)
            raise
        return gateway, init

    def end_gateway(self, gateway: SyncGateway, what: str) -> None:
        """stdin EOF: the proxy must exit 0 by itself (its stdin grace, then SIGTERM to the adapters)."""
        if close_stdin(gateway, timeout=15.0) is None:
            raise CheckFailed(f"{what}: the proxy was still running 15s after its stdin closed")
        if gateway.process.returncode != 0:
            raise CheckFailed(f"{what}: the proxy exited {gateway.process.returncode} after stdin EOF")

    def sessions_raw(self, name: str, adapter: str) -> str:
        """Two sessions over one slot, a transparent resume, then a restart and session/load."""
        command, env, marker = self.session_setup(name, adapter)
        logs = [self.logs / f"{name}-run{run}.stderr" for run in (1, 2)]
        for log in logs:
            log.unlink(missing_ok=True)
        problems: list[str] = []
        cwd = {"cwd": str(self.ws), "mcpServers": []}

        gateway, init = self.session_gateway(command, env, logs[0])
        try:
            first = call_result(gateway, "session/new", cwd)
            s1 = first["sessionId"]
            answer = call(gateway, "session/prompt", prompt_params(s1, FIRST_WORDS), timeout=PROMPT_TIMEOUT)
            if proxy_error(answer):
                raise CheckFailed(f"the first prompt got the proxy's error {short(answer)}")
            mode = other_mode(first)
            if mode:  # a setting the proxy must re-apply whenever S1 comes back
                call_result(gateway, "session/set_mode", {"sessionId": s1, "modeId": mode})
            s2 = call_result(gateway, "session/new", cwd)["sessionId"]
            if not wait_for_log(logs[0], f"session {s1} suspended"):
                raise CheckFailed(f"session/new of S2 did not suspend S1 (max_live = 1; see {logs[0]})")
            answer = call(gateway, "session/prompt", prompt_params(s1, SECOND_WORDS), timeout=PROMPT_TIMEOUT)
            if proxy_error(answer) or "id" not in answer:
                raise CheckFailed(f"the prompt to suspended S1 got {short(answer)}")
            if not wait_for_log(logs[0], f"session {s1} resumed"):
                raise CheckFailed(f"no 'session {s1} resumed' in {logs[0]}")
            since = len(gateway.received)
            if mode:
                call_result(gateway, "session/set_mode", {"sessionId": s2, "modeId": mode}, timeout=PROMPT_TIMEOUT)
            else:
                call(gateway, "session/prompt", prompt_params(s2, OTHER_WORDS), timeout=PROMPT_TIMEOUT)
            s2_reset = history_reset(updates(gateway, since), s2)
            listed = call_result(gateway, "session/list", {}).get("sessions") or []
            if {s.get("sessionId") for s in listed} != {s1, s2}:
                raise CheckFailed(f"session/list gave {short(listed)}, expected S1 and S2")
            gateway.drain(quiet=1.0, limit=10.0)
            problems += [f"run 1: {leak}" for leak in foreign_session_ids(gateway.received, {s1, s2})]
            self.end_gateway(gateway, "run 1")
        finally:
            (self.logs / f"{name}-run1.stdout").write_text("\n".join(json.dumps(m) for m in transcript(gateway)))
            end(gateway)
        self.check_leftovers(name, "proxy", marker, wait=3.0)

        gateway, _ = self.session_gateway(command, env, logs[1])
        try:
            listed = call_result(gateway, "session/list", {}).get("sessions") or []
            states = {s.get("sessionId"): ((s.get("_meta") or {}).get(PROXY_META) or {}).get("state") for s in listed}
            if states != {s1: "suspended", s2: "suspended"}:
                raise CheckFailed(f"after a restart session/list gave {states}, expected S1 and S2 suspended")
            since = len(gateway.received)
            loaded = call_result(gateway, "session/load", {"sessionId": s1, **cwd}, timeout=PROMPT_TIMEOUT)
            replay = user_texts(updates(gateway, since), s1)
            if not in_order([FIRST_WORDS, SECOND_WORDS], replay):
                raise CheckFailed(f"session/load of S1 after a restart replayed {replay}, not both prompts")
            shown = (loaded.get("modes") or {}).get("currentModeId")
            if mode and shown is not None and shown != mode:
                announced = announced_modes(updates(gateway, since), s1)
                problems.append(
                    f"run 2: session/load of S1 answered currentModeId {shown!r}, though the proxy had re-applied "
                    f"{mode!r}" + (f" (and a session/update before the answer said {announced})" if announced else "")
                )
            since = len(gateway.received)
            call_result(gateway, "session/load", {"sessionId": s2, **cwd}, timeout=PROMPT_TIMEOUT)
            gateway.drain(quiet=1.0, limit=10.0)
            problems += [f"run 2: {leak}" for leak in foreign_session_ids(gateway.received, {s1, s2})]
            self.end_gateway(gateway, "run 2")
        finally:
            (self.logs / f"{name}-run2.stdout").write_text("\n".join(json.dumps(m) for m in transcript(gateway)))
            end(gateway)
        self.check_leftovers(name, "proxy", marker, wait=3.0)

        caps = init.get("agentCapabilities") or {}
        sessions = sorted((caps.get("sessionCapabilities") or {}).keys())
        self.report.note(
            name,
            f"{adapter} advertises loadSession={caps.get('loadSession')}, sessionCapabilities {sessions} "
            f"(as relayed); a session without a turn "
            + ("is not kept by the adapter: it came back afresh, historyReset announced" if s2_reset else "was kept"),
        )
        if problems:
            raise CheckFailed("; ".join(problems))
        return (
            "S1 suspended for S2 and resumed transparently for a prompt the adapter answered; "
            f"S2 {'came back afresh (historyReset)' if s2_reset else 'resumed'}; after a restart session/load "
            "replayed S1's two prompts; no foreign session id reached the gateway; nothing left running"
        )

    def acpx_session_id(self, command: list[str], session: str, env: dict[str, str], log: Path) -> str:
        rc, out = self.acpx(command, "--format", "json", "sessions", "show", session, env=env, log=log)
        try:
            return str(json.loads(out)["acpSessionId"])
        except (ValueError, KeyError, TypeError):
            raise CheckFailed(f"acpx sessions show {session} exited {rc} without a record (see {log})") from None

    def sessions_acpx(self, name: str, adapter: str) -> str:
        """acpx named sessions through the proxy; every acpx command runs a new proxy (ttl 1)."""
        command, env, marker = self.session_setup(name, adapter)
        log = self.logs / f"{name}.stderr"
        log.unlink(missing_ok=True)
        ids: dict[str, str] = {}
        for session in ("one", "two"):
            rc, _ = self.acpx(command, "sessions", "new", "--name", session, env=env, log=log)
            if rc != 0:
                raise CheckFailed(f"acpx sessions new --name {session} exited {rc} (see {log})")
            ids[session] = self.acpx_session_id(command, session, env, log)
        transcript = []
        options = ("--format", "json", "--approve-all", "--ttl", "1", "--timeout", f"{PROMPT_TIMEOUT:.0f}")
        for session, words in (("one", FIRST_WORDS), ("two", OTHER_WORDS), ("one", SECOND_WORDS)):
            rc, out = self.acpx(
                command, *options, "prompt", "-s", session, words, env=env, log=log, timeout=PROMPT_TIMEOUT + 60
            )
            messages = json_lines(out)
            transcript.append(messages)
            if not any(isinstance(m, dict) and m.get("method") == "session/prompt" for m in messages):
                raise CheckFailed(f"acpx prompt -s {session} exited {rc} before session/prompt (see {log})")
            reasons = [proxy_error(m) for m in messages if proxy_error(m)]
            if reasons:
                raise CheckFailed(f"acpx prompt -s {session} got the proxy's error {reasons[0]} (see {log})")
        (self.logs / f"{name}.stdout").write_text(json.dumps(transcript, indent=1))
        seen = [message for messages in transcript for message in messages]
        problems = [f"acpx saw {leak}" for leak in foreign_session_ids(seen, set(ids.values()))]
        after = {session: self.acpx_session_id(command, session, env, log) for session in ids}
        if after != ids:
            problems.append(f"acpx's records moved from {ids} to {after}")
        self.check_leftovers(name, "proxy", marker, wait=15)  # the queue owners linger for their ttl

        audit = self.logs / f"{name}-audit.stderr"
        audit.unlink(missing_ok=True)
        gateway, _ = self.session_gateway(command, env, audit)
        replays = {}
        try:
            for session in ids:
                since = len(gateway.received)
                params = {"sessionId": ids[session], "cwd": str(self.ws), "mcpServers": []}
                call_result(gateway, "session/load", params, timeout=PROMPT_TIMEOUT)
                replays[session] = user_texts(updates(gateway, since), ids[session])
            self.end_gateway(gateway, "the audit")
        finally:
            end(gateway)
        self.check_leftovers(name, "proxy", marker, wait=3.0)
        if not in_order([FIRST_WORDS, SECOND_WORDS], replays["one"]) or OTHER_WORDS in replays["one"]:
            raise CheckFailed(f"session one replayed {replays['one']}")
        if not in_order([OTHER_WORDS], replays["two"]) or FIRST_WORDS in replays["two"]:
            raise CheckFailed(f"session two replayed {replays['two']}")
        if problems:
            raise CheckFailed("; ".join(problems))
        return (
            "sessions new one/two, prompt one, two, one (each a new proxy): acpx kept its session ids, "
            "and session/load through a fresh proxy replayed each conversation whole and apart; nothing left running"
        )

    # -- 5. session/close, session/delete and session/fork through the proxy ----------

    def spec_raw(self, name: str, adapter: str) -> str:
        """close then load or resume, delete of a live and of a closed session, fork; raw JSON-RPC, ``max_live = 1``."""
        command, env, marker = self.session_setup(name, adapter)
        logs = [self.logs / f"{name}-run{run}.stderr" for run in (1, 2)]
        for log in logs:
            log.unlink(missing_ok=True)
        problems: list[str] = []

        gateway, init = self.session_gateway(command, env, logs[0])
        probe = SessionProbe(gateway, self.ws, problems)
        try:
            served = (init.get("agentCapabilities") or {}).get("sessionCapabilities") or {}
            missing = [key for key in ("close", "list", "delete", "resume") if not isinstance(served.get(key), dict)]
            if missing:
                problems.append(f"the initialize result lacks sessionCapabilities {missing}")

            s1 = probe.new()
            probe.prompt(s1, FIRST_WORDS, "S1")
            if not probe.processes_but_proxy(marker, wait=0):
                problems.append("live S1's processes were not found (the scan after session/close would prove nothing)")
            probe.empty("session/close", s1, "S1")
            left = probe.processes_but_proxy(marker)
            if left:
                problems.append(f"after session/close of S1 still running: {'; '.join(left)}")
            probe.refused("session/prompt", prompt_params(s1, SECOND_WORDS), "session_closed", "closed S1")
            if probe.states().get(s1) != "closed":
                problems.append(f"after session/close, session/list gave {probe.states()}, expected S1 closed")
            replay = probe.restore("session/load", s1, "closed S1")
            if replay is not None and not in_order([FIRST_WORDS], replay):
                problems.append(f"session/load of closed S1 replayed {replay}, not its prompt")
            if probe.states().get(s1) != "live":
                problems.append(f"after session/load of closed S1, session/list gave {probe.states()}")

            s2 = probe.new()
            probe.prompt(s2, OTHER_WORDS, "S2")
            probe.empty("session/close", s2, "S2")
            probe.restore("session/resume", s2, "closed S2")
            if probe.states().get(s2) != "live":
                problems.append(f"after session/resume of closed S2, session/list gave {probe.states()}")

            # S2 is live; S1 was suspended for it (one slot), then is closed
            probe.empty("session/delete", s2, "live S2")
            left = probe.processes_but_proxy(marker)
            if left:
                problems.append(f"after session/delete of S2 still running: {'; '.join(left)}")
            probe.empty("session/close", s1, "suspended S1")
            probe.empty("session/delete", s1, "closed S1")
            listed = probe.states()
            if s1 in listed or s2 in listed:
                problems.append(f"after session/delete, session/list still gave {listed}")
            for sid, what in ((s1, "deleted S1"), (s2, "deleted S2")):
                probe.refused("session/load", probe.load_params(sid), "session_deleted", what)
            probe.empty("session/delete", s1, "deleted S1")
            probe.empty("session/delete", "never-issued", "an unknown id")

            fork_note = self.spec_fork(probe, adapter, served, logs[0])
            gateway.drain(quiet=1.0, limit=10.0)
            problems += [f"run 1: {leak}" for leak in foreign_session_ids(gateway.received, probe.known)]
            self.end_gateway(gateway, "run 1")
        finally:
            (self.logs / f"{name}-run1.stdout").write_text("\n".join(json.dumps(m) for m in transcript(gateway)))
            end(gateway)
        self.check_leftovers(name, "proxy", marker, wait=3.0)

        # a new proxy on the same state dir: the tombstones and the other rows last
        gateway, _ = self.session_gateway(command, env, logs[1])
        try:
            after = SessionProbe(gateway, self.ws, problems)
            listed = after.listing()
            kept = probe.known - {s1, s2}
            if listed.keys() != kept or any(meta.get("state") != "suspended" for meta in listed.values()):
                problems.append(f"after a restart session/list gave {listed}, expected {sorted(kept)} suspended")
            after.refused("session/load", after.load_params(s1), "session_deleted", "deleted S1 after a restart")
            self.end_gateway(gateway, "run 2")
        finally:
            (self.logs / f"{name}-run2.stdout").write_text("\n".join(json.dumps(m) for m in transcript(gateway)))
            end(gateway)
        self.check_leftovers(name, "proxy", marker, wait=3.0)

        self.report.note(name, self.kept_by_adapter(name, adapter, env, s1))
        self.report.note(name, fork_note)
        self.check_leftovers(name, "proxy", marker, wait=3.0)
        if problems:
            raise CheckFailed("; ".join(problems))
        return (
            "closed S1 listed closed with its tree reaped, a prompt to it -32002 session_closed, session/load "
            "restored it with its prompt; closed S2 restored by session/resume; session/delete of live S2 and "
            "closed S1 {}, both unlisted, session/load -32002 session_deleted (also after a restart), a second "
            "delete and an unknown id {}; no foreign session id reached the gateway; nothing left running"
        )

    def spec_fork(self, probe: SessionProbe, adapter: str, served: dict[str, Any], log: Path) -> str:
        """session/fork of a session that had a turn; a NOTE line on what the adapter did."""
        problems = probe.problems
        parent = probe.new()
        if "fork" not in served:
            answer = call(probe.gateway, "session/fork", probe.load_params(parent))
            if "error" not in answer:
                problems.append(f"session/fork, not advertised, answered {short(answer)}")
            return (
                f"{adapter} advertises no sessionCapabilities.fork, nor does the proxy; session/fork: {short(answer)}"
            )
        probe.prompt(parent, FIRST_WORDS, "the parent")
        answer = call(probe.gateway, "session/fork", probe.load_params(parent), timeout=PROMPT_TIMEOUT)
        fork = (answer.get("result") or {}).get("sessionId")
        if not isinstance(fork, str):
            if proxy_error(answer) or "error" not in answer:
                problems.append(f"session/fork answered {short(answer)}")
            return f"{adapter} could not fork without credentials: session/fork answered {short(answer)}"
        probe.known.add(fork)
        if fork == parent:
            problems.append(f"session/fork answered the parent's own id {fork}")
        forked_on = log_match(log, rf"session {re.escape(parent)} forked as {re.escape(fork)} on pid (\d+)")
        listed = probe.listing()
        if listed.get(fork, {}).get("parentSessionId") != parent or listed.get(parent, {}).get("state") != "suspended":
            problems.append(f"after session/fork, session/list gave {listed}, expected the fork with its parent")
        probe.prompt(fork, OTHER_WORDS, "the fork")
        parent_replay = probe.restore("session/load", parent, "the parent") or []
        if not in_order([FIRST_WORDS], parent_replay) or OTHER_WORDS in parent_replay:
            problems.append(f"session/load of the parent replayed {parent_replay}")
        back_on = log_match(log, rf"session {re.escape(parent)} resumed on pid (\d+)")
        if forked_on is None or back_on is None or forked_on == back_on:
            problems.append(f"the parent came back on pid {back_on}, the fork was made on pid {forked_on} (see {log})")
        fork_replay = probe.restore("session/load", fork, "the fork") or []
        if OTHER_WORDS not in fork_replay:
            problems.append(f"session/load of the fork replayed {fork_replay}, not its own prompt")
        final = probe.states()
        if final.get(parent) != "suspended" or final.get(fork) != "live":
            problems.append(f"at last session/list gave {final}, expected the parent suspended and the fork live")
        return (
            f"{adapter} forked offline: the fork made on the parent's pid {forked_on}, which then served its prompt; "
            f"the parent back on pid {back_on}, its load replaying {checked_words(parent_replay)}; the fork's "
            f"load replayed {checked_words(fork_replay)} (the parent's history, then its own prompt)"
        )

    def kept_by_adapter(self, name: str, adapter: str, env: dict[str, str], session_id: str) -> str:
        """Whether the adapter itself still has a session the proxy deleted (its own load, straight)."""
        log = self.logs / f"{name}-direct.stderr"
        log.unlink(missing_ok=True)
        peer, init = self.session_gateway(self.command(adapter), env, log)
        try:
            deletes = isinstance(
                ((init.get("agentCapabilities") or {}).get("sessionCapabilities") or {}).get("delete"), dict
            )
            params = {"sessionId": session_id, "cwd": str(self.ws), "mcpServers": []}
            answer = call(peer, "session/load", params, timeout=PROMPT_TIMEOUT)
        finally:
            end(peer)
        kept = (
            "still loads it (its storage kept the session)" if "result" in answer else f"answers {short(answer, 200)}"
        )
        return (
            f"{adapter} {'advertises' if deletes else 'does not advertise'} session/delete "
            f"({'sent' if deletes else 'so the proxy deleted its own record only'}); "
            f"a session/load of deleted S1 straight on {adapter} {kept}"
        )

    # -- 6. one pool for the install: acpx sessions, each through a proxy of its own ---

    def install_acpx(self, name: str, adapter: str) -> str:
        """acpx named sessions, each served by its own proxy (acpx's queue owners), one state dir, ``max_live = 1``.

        Every step needs its session's adapter, which only another proxy's eviction makes
        room for; /proc is sampled throughout, and ``acp-proxy status --json``.
        """
        command, env, marker = self.session_setup(name, adapter, pool=INSTALL_POOL)
        log = self.logs / f"{name}.stderr"
        proxies_log = self.logs / f"{name}-proxies.stderr"
        audit_log = self.logs / f"{name}-audit.stderr"
        for path in (log, proxies_log, audit_log):
            path.unlink(missing_ok=True)
        # acpx drops its agent's stderr (and its queue owner's): each proxy appends its log here.
        agent = ["/bin/sh", "-c", 'exec "$@" 2>>"$0"', str(proxies_log), *command]
        acpx = AcpxSteps(self, agent, env, log, proxies_log)
        problems: list[str] = []
        status_env = {k: v for k, v in env.items() if k != MARKER_VAR}  # not one of the check's processes
        begun = time.monotonic()
        with TreeWatch(marker) as trees, SlotWatch([*command, "status", "--json"], status_env, self.ws) as slots:
            try:
                ids = self.install_steps(acpx, problems)
            except BaseException:
                stop_queue_owners(marker)
                self.runs.leftovers(marker, wait=20)
                raise
            finally:
                (self.logs / f"{name}.stdout").write_text(json.dumps(acpx.outputs, indent=1))
            owners = stop_queue_owners(marker)
            # The gateways are gone: each proxy suspends its session and exits, its tree reaped.
            self.check_leftovers(name, "proxy", marker, wait=30)
            stopped = time.monotonic()
            replays, last_slot = self.install_audit(command, env, audit_log, ids, slots, problems)
            self.check_leftovers(name, "proxy", marker, wait=5)
        elapsed = watched = time.monotonic() - begun

        if trees.samples < 10:
            raise CheckFailed(f"the /proc sampler took {trees.samples} samples only")
        if trees.peak > 1:
            problems.append(f"{trees.peak} adapter trees alive at once: {'; '.join(trees.overlaps)}")
        if slots.peak > 1:
            problems.append(f"acp-proxy status --json showed {slots.peak} slots held: {'; '.join(slots.crowded)}")
        if slots.samples == 0:
            problems.append(f"acp-proxy status --json never answered: {'; '.join(slots.failures)}")
        if trees.peak_proxies < len(ids):
            problems.append(
                f"at most {trees.peak_proxies} proxies ran at once: acpx did not keep one per session alive"
            )
        if len(owners) < len(ids):
            problems.append(f"{len(owners)} acpx queue owners were running at the end, not {len(ids)}")
        words = {"one": [FIRST_WORDS, SECOND_WORDS], "two": [OTHER_WORDS], "three": [THIRD_WORDS]}
        for session, wanted in words.items():
            got = checked_words(replays.get(session) or [])
            if got != wanted:
                problems.append(f"session/load of {session} replayed {got}, expected {wanted}")
        if last_slot != ids["three"]:
            problems.append(f"after loading three, status --json showed the slot held by {last_slot!r}")
        text = proxies_log.read_text(errors="replace")
        across = len(re.findall(r"session \S+ suspended \([^)]*for another proxy\)", text))
        asked = text.count("pool: asking proxy")
        within = len(re.findall(r"session \S+ suspended \((?![^)]*for another proxy)", text))
        afresh = {s: len(re.findall(rf"session {re.escape(sid)} started afresh", text)) for s, sid in ids.items()}
        if any(count > 1 for count in afresh.values()):
            problems.append(f"sessions started afresh more than once (history lost after a turn): {afresh}")
        audit_text = audit_log.read_text(errors="replace")
        audit_evictions = len(re.findall(r"session \S+ suspended \(", audit_text))
        holders = sorted(session for session, sid in ids.items() if sid in slots.holders)
        self.report.note(
            name,
            f"{len(acpx.steps)} acpx commands in {stopped - begun:.0f}s: "
            + ", ".join(f"{label} {seconds:.1f}s" for label, seconds in acpx.steps),
        )
        if problems:
            raise CheckFailed("; ".join(problems))
        period = watched / trees.samples * 1000
        return (
            f"3 acpx sessions, up to {trees.peak_proxies} proxies at once on one state dir, max_live = 1: "
            f"peak live adapter trees {trees.peak} ({trees.samples} /proc samples, one per {period:.0f} ms, "
            f"slowest {trees.slowest * 1000:.0f} ms; {len(trees.seen)} trees in all, {trees.handovers} passes "
            f"caught a handover); status --json slots at most {slots.peak} ({slots.samples} samples; held for "
            f"{', '.join(holders)}); {across} evictions across proxies ({asked} asked), {within} within a proxy, "
            f"{audit_evictions} in the audit proxy; every step brought its session back on a new process, and "
            "session/load through a fresh proxy replayed each conversation whole and apart; nothing left running; "
            f"{elapsed:.0f}s"
        )

    def install_steps(self, acpx: AcpxSteps, problems: list[str]) -> dict[str, str]:
        """sessions new, interleaved prompts, then set-mode one at a time and all at once; the acpx ids."""
        ids: dict[str, str] = {}
        for session in INSTALL_SESSIONS:
            rc, _ = acpx.run(f"new {session}", "sessions", "new", "--name", session)
            if rc != 0:
                raise CheckFailed(f"acpx sessions new --name {session} exited {rc} (see {acpx.log})")
            ids[session] = self.acpx_session_id(acpx.agent, session, acpx.env, acpx.log)
        acpx.ids = ids
        options = ("--format", "json", "--approve-all", "--ttl", str(INSTALL_TTL), "--timeout", f"{PROMPT_TIMEOUT:.0f}")
        # Each prompt reaches the queue owner of its session (started by the first), whose proxy
        # must take the install's one slot from the proxy of the session before it.
        for session, words in (
            ("one", FIRST_WORDS),
            ("two", OTHER_WORDS),
            ("three", THIRD_WORDS),
            ("one", SECOND_WORDS),
        ):
            rc, messages = acpx.run(f"prompt {session}", *options, "prompt", "-s", session, words, restores=session)
            if not any(isinstance(m, dict) and m.get("method") == "session/prompt" for m in messages):
                raise CheckFailed(f"acpx prompt -s {session} exited {rc} before session/prompt (see {acpx.log})")
        current, modes = session_modes([m for out in acpx.outputs for m in out["messages"]])
        other = next((mode for mode in modes if mode != current), None)
        if current is None or other is None:
            raise CheckFailed(f"no mode to set: the sessions offered {modes} (current {current})")
        # set-mode through the running queue owners: the proxy must bring the session back first.
        for session in ("two", "three", "one"):
            rc, _ = acpx.run(f"set-mode {session}", "set-mode", "-s", session, other, restores=session)
            if rc != 0:
                problems.append(f"acpx set-mode -s {session} {other} exited {rc} (see {acpx.log})")
        # All three at once: three proxies queue for the one slot, first come, first served.
        with ThreadPoolExecutor(len(INSTALL_SESSIONS)) as pool:
            futures = {
                session: pool.submit(acpx.run, f"set-mode {session} (together)", "set-mode", "-s", session, current)
                for session in INSTALL_SESSIONS
            }
            results = {session: future.result() for session, future in futures.items()}
        for session, (rc, _) in results.items():
            if rc != 0:
                problems.append(f"acpx set-mode -s {session} {current} (together) exited {rc} (see {acpx.log})")
        problems += acpx.missed
        seen = [m for out in acpx.outputs for m in out["messages"]]
        problems += [f"acpx saw {leak}" for leak in foreign_session_ids(seen, set(ids.values()))]
        after = {session: self.acpx_session_id(acpx.agent, session, acpx.env, acpx.log) for session in ids}
        if after != ids:
            problems.append(f"acpx's records moved from {ids} to {after}")
        return ids

    def install_audit(
        self,
        command: list[str],
        env: dict[str, str],
        log: Path,
        ids: dict[str, str],
        slots: SlotWatch,
        problems: list[str],
    ) -> tuple[dict[str, list[str]], str | None]:
        """A fresh proxy on the state dir: every session listed and loaded, its prompts replayed."""
        gateway, _ = self.session_gateway(command, env, log)
        replays: dict[str, list[str]] = {}
        try:
            probe = SessionProbe(gateway, self.ws, problems)
            listed = probe.states()
            missing = [session for session, sid in ids.items() if sid not in listed]
            if missing:
                problems.append(f"after the queue owners stopped, session/list lacked {missing}: {listed}")
            for session, sid in ids.items():
                replays[session] = probe.restore("session/load", sid, session) or []
            held = slots.sample()
            last = next((str(view.get("sessionId")) for view in held), None)
            self.end_gateway(gateway, "the audit")
        finally:
            end(gateway)
        return replays, last

    # -- 7. the matrix: one scenario for every adapter of the table, straight and proxied --

    def matrix(self, name: str, adapter: Adapter) -> str:
        """The scenario of ``Adapter``, straight, then through ``acp-proxy --``; the two compared."""
        direct = self.matrix_run(name, adapter, "direct", None)
        proxied = self.matrix_run(name, adapter, "proxy", direct)
        if proxied.session_id is not None and direct.plan.lists:
            self.matrix_own_list(name, adapter, proxied)
        self.report.note(name, f"straight: {direct.outline()}; {eof_outline(direct.eof)}")
        problems = [*proxied.problems, *matrix_problems(direct, proxied)]
        if (direct.session_id is None) != adapter.login:
            problems.append(
                f"straight, session/new {'opened a session' if adapter.login else 'was refused'}; the table says "
                f"it {'refuses' if adapter.login else 'opens'} one without a login"
            )
        if problems:
            raise CheckFailed(f"through the proxy: {proxied.outline()}; " + "; ".join(problems))
        return f"through the proxy: {proxied.outline()}; nothing left running"

    def matrix_run(self, name: str, adapter: Adapter, mode: str, direct: Scenario | None) -> Scenario:
        """One side of a matrix-* check: a private HOME (and state dir, proxied), every step's answer kept.

        Straight, the steps follow what the adapter advertised; proxied, the same steps as
        straight. The proxy ends a closed session's process and restores it on a new one,
        so straight, session/close is sent if the adapter advertises it, and then its
        process ends the way the proxy ends it (stdin EOF, then the group is killed), and
        each restore runs on a new process (initialize and authenticate again) on the
        same HOME.
        """
        base = self.work / "matrix" / name / mode
        shutil.rmtree(base, ignore_errors=True)
        (base / "home" / ".claude").mkdir(parents=True)
        extra = {"HOME": str(base / "home"), **self.adapter_env(adapter.name)}
        if mode == "proxy":
            extra["ACP_PROXY_STATE_DIR"] = str(base / "state")
        env, marker = self.runs.env(f"{name}-{mode}", **extra)
        seen = Scenario(mode == "proxy", env)
        log = self.logs / f"{name}-{mode}.stderr"
        log.unlink(missing_ok=True)
        command = self.command(adapter.name)
        proxied = mode == "proxy"
        peer = self.matrix_start(command if not proxied else self.proxied(command), env, log, adapter, seen)
        try:
            seen.plan = direct.plan if direct is not None else restore_plan(seen.result("initialize"))
            new = seen.step(peer, "session/new", {"cwd": str(self.ws), "mcpServers": []}, settle=True)
            sid = new.get("sessionId")
            if isinstance(sid, str):
                seen.session_id = sid
                self.matrix_session(peer, seen, adapter, direct)
                for index, method in enumerate(seen.plan.restores):
                    if proxied:
                        self.matrix_close(peer, seen, marker, again=index > 0)
                    else:
                        self.matrix_stop(peer, seen, record=index == 0)
                        peer = self.matrix_start(command, env, log, adapter, None)
                    self.matrix_restore(peer, seen, method)
                if not seen.plan.restores:
                    if proxied:
                        self.matrix_close(peer, seen, marker, again=False)
                    elif seen.plan.closes:
                        seen.step(peer, "session/close", {"sessionId": sid})
            if proxied or seen.plan.lists:
                seen.step(peer, "session/list", {})
            peer.drain(quiet=1.0, limit=10.0)
            if proxied:
                known = {sid} if isinstance(sid, str) else set()
                seen.problems += foreign_session_ids(peer.received, known)
                self.end_gateway(peer, "the proxied run")
            else:
                self.matrix_stop(peer, seen, record=False)
        finally:
            seen.keep(peer)
            end(peer)
            (self.logs / f"{name}-{mode}.stdout").write_text("".join(json.dumps(m) + "\n" for m in seen.received))
        self.check_leftovers(name, mode, marker, wait=5.0)
        return seen

    def matrix_own_list(self, name: str, adapter: Adapter, proxied: Scenario) -> None:
        """The adapter's own session/list on the proxied run's HOME, straight: what it says of the session."""
        log = self.logs / f"{name}-own-list.stderr"
        log.unlink(missing_ok=True)
        env, marker = self.runs.env(f"{name}-own-list", HOME=proxied.env["HOME"], **self.adapter_env(adapter.name))
        peer = self.matrix_start(self.command(adapter.name), env, log, adapter, None)
        try:
            proxied.step(peer, "session/list", {}, name=OWN_LIST)
            close_stdin(peer, timeout=3.0)
        finally:
            end(peer)
        self.check_leftovers(name, "direct", marker, wait=5.0)

    def matrix_start(
        self, command: list[str], env: dict[str, str], log: Path, adapter: Adapter, seen: Scenario | None
    ) -> SyncGateway:
        """A new process, initialized (and authenticated); ``seen`` records the answers if given."""
        peer = open_peer(command, env, log, self.ws)
        record = seen if seen is not None else Scenario(False, env)
        try:
            record.step(peer, "initialize", CLIENT_INITIALIZE)
            if adapter.auth:
                record.step(peer, "authenticate", {"methodId": adapter.auth})
        except BaseException:
            end(peer)
            raise
        return peer

    def matrix_session(self, peer: SyncGateway, seen: Scenario, adapter: Adapter, direct: Scenario | None) -> None:
        """A cancelled turn (where one stays under way), another mode than the session's (where it offers
        modes), then a prompt (where the adapter records it).

        The cancel comes first, in the session's first mode: gemini-cli answers a cancel in
        ``plan`` at once, in its default mode about a minute late.
        """
        if adapter.cancel:
            self.matrix_cancel(peer, seen)
        new = seen.result("session/new")
        setting = direct.setting if direct is not None else mode_setting(new)
        if setting is not None:
            method, params = setting
            seen.setting = setting
            seen.step(peer, method, {"sessionId": seen.session_id, **params}, settle=True)
        if adapter.prompt:
            assert seen.session_id is not None
            seen.step(peer, "session/prompt", prompt_params(seen.session_id, FIRST_WORDS), PROMPT_TIMEOUT)

    def matrix_cancel(self, peer: SyncGateway, seen: Scenario) -> None:
        """A turn, session/cancel once it is under way, and how long its answer then took."""
        assert seen.session_id is not None
        request = {"jsonrpc": "2.0", "id": "cancelled-turn", "method": "session/prompt"}
        peer.send({**request, "params": prompt_params(seen.session_id, SECOND_WORDS)})
        time.sleep(CANCEL_AFTER)
        start = time.monotonic()
        peer.send({"jsonrpc": "2.0", "method": "session/cancel", "params": {"sessionId": seen.session_id}})
        answer = answer_to(peer, "cancelled-turn", timeout=PROMPT_TIMEOUT)
        seen.cancel_seconds = time.monotonic() - start
        seen.answers[CANCELLED] = {k: v for k, v in answer.items() if k not in ("id", "jsonrpc")}

    def matrix_close(self, peer: SyncGateway, seen: Scenario, marker: str, again: bool) -> None:
        """session/close through the proxy: ``{}``, and the session's processes gone."""
        step = "session/close (again)" if again else "session/close"
        answer = seen.step(peer, "session/close", {"sessionId": seen.session_id}, name=step)
        if answer != {}:
            seen.problems.append(f"{step} answered {short(seen.answers[step])}, expected {{}}")
        deadline = time.monotonic() + 10.0
        while (found := markers.find(MARKER_VAR, marker)) and time.monotonic() < deadline:
            found.pop(peer.process.pid, None)
            if not found:
                break
            time.sleep(0.1)
        found.pop(peer.process.pid, None)
        if found:
            seen.problems.append(f"after {step} still running: {'; '.join(map(str, found.values()))}")

    def matrix_stop(self, peer: SyncGateway, seen: Scenario, record: bool) -> None:
        """End a straight run's process as the proxy ends one: session/close if advertised, stdin EOF, kill."""
        if seen.plan.closes and seen.session_id is not None:
            params = {"sessionId": seen.session_id}
            if record:
                seen.step(peer, "session/close", params)
            else:
                call(peer, "session/close", params)
        seen.eof.append(close_stdin(peer, timeout=3.0))
        seen.keep(peer)
        end(peer)

    def matrix_restore(self, peer: SyncGateway, seen: Scenario, method: str) -> None:
        """session/load or session/resume of the closed session; straight, a failed resume is followed by
        a load where the adapter loads, to learn whether a proxy's fallback had a restore to fall back to."""
        assert seen.session_id is not None
        params = {"sessionId": seen.session_id, "cwd": str(self.ws), "mcpServers": []}
        since = len(peer.received)
        seen.step(peer, method, params, PROMPT_TIMEOUT)
        received = updates(peer, since)
        seen.replays[method] = user_texts(received, seen.session_id)
        if history_reset(received, seen.session_id):
            seen.resets.add(method)
        error = seen.answers[method].get("error")
        if not seen.proxied and method == "session/resume" and seen.plan.loads and isinstance(error, dict):
            seen.step(peer, "session/load", params, PROMPT_TIMEOUT, name=THEN_LOAD)


# --- the matrix: what one side saw, and what the proxy may change --------------------------

FALLBACK_CODES = frozenset({-32002, -32601, -32602})
"""The errors on which the proxy's restore falls back (resume -> load -> new), as the design says."""
THEN_LOAD = "session/resume, then session/load"
OWN_LIST = "the adapter's own session/list, straight, on the same HOME"
PLAN = "plan"
CANCELLED = "session/prompt, then session/cancel"
CANCEL_AFTER = 2.0
"""Seconds between a prompt and its session/cancel: the turn is under way (its model call retrying)."""
CANCEL_ANSWERED_WITHIN = 35.0
"""The proxy answers a cancelled turn itself after its cancel_timeout (30 s by default), if the adapter has not."""
TIMER_UPDATES = frozenset({"available_commands_update"})
"""session/update kinds some adapters send on a timer: where they land varies from run to run."""


@dataclass(frozen=True)
class RestorePlan:
    """The steps an adapter's initialize result calls for; the proxied run takes the straight run's."""

    restores: tuple[str, ...] = ()
    loads: bool = False
    closes: bool = False
    lists: bool = False


def restore_plan(init: dict[str, Any]) -> RestorePlan:
    caps = init.get("agentCapabilities") or {}
    sessions = caps.get("sessionCapabilities") or {}
    loads = caps.get("loadSession") is True
    resumes = isinstance(sessions.get("resume"), dict)
    restores = (*(("session/load",) if loads else ()), *(("session/resume",) if resumes else ()))
    closes, lists = (isinstance(sessions.get(key), dict) for key in ("close", "list"))
    return RestorePlan(restores, loads, closes, lists)


def mode_setting(new: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """How to put a new session in another mode: session/set_mode where it offers modes,
    session/set_config_option where it offers only a mode config option; None if neither.

    ``plan`` where offered: the read-only mode every adapter grants (gemini-cli refuses
    its auto-approving modes in a folder the user has not trusted).
    """
    modes = new.get("modes") or {}
    offered = [str(mode.get("id")) for mode in modes.get("availableModes") or [] if isinstance(mode, dict)]
    if offered:
        others = [mode for mode in offered if mode != modes.get("currentModeId")]
        return ("session/set_mode", {"modeId": PLAN if PLAN in others else others[0]}) if others else None
    for option in new.get("configOptions") or []:
        if isinstance(option, dict) and option.get("category") == "mode":
            values = [str(value.get("value")) for value in option.get("options") or [] if isinstance(value, dict)]
            others = [value for value in values if value != option.get("currentValue")]
            if others:
                value = PLAN if PLAN in others else others[0]
                return "session/set_config_option", {"configId": option.get("id"), "value": value}
    return None


def set_to(setting: tuple[str, dict[str, Any]]) -> str:
    """The mode a mode setting puts the session in."""
    params = setting[1]
    return str(params.get("modeId", params.get("value")))


class Scenario:
    """What one side of a matrix-* check saw: each step's answer (without its id), in order."""

    def __init__(self, proxied: bool, env: dict[str, str]) -> None:
        self.proxied = proxied
        self.env = env
        self.answers: dict[str, dict[str, Any]] = {}
        self.notifications: dict[str, list[str]] = {}
        """Each step's notifications, by method (and session/update kind), those sent on a timer left out."""
        self.plan = RestorePlan()
        self.session_id: str | None = None
        self.setting: tuple[str, dict[str, Any]] | None = None
        self.replays: dict[str, list[str]] = {}
        self.resets: set[str] = set()
        """The restores after which the proxy announced historyReset (it started the session afresh)."""
        self.problems: list[str] = []
        self.eof: list[float | None] = []
        """Straight, for each process ended: seconds until it exited after stdin EOF (None: it did not, in 3 s)."""
        self.cancel_seconds = 0.0
        """From session/cancel to the cancelled turn's answer."""
        self.received: list[Any] = []
        """Every message received, from each process in turn."""
        self._kept: list[SyncGateway] = []

    def keep(self, peer: SyncGateway) -> None:
        """Add what ``peer`` received to ``received``, once."""
        if not any(kept is peer for kept in self._kept):
            self._kept.append(peer)
            self.received += transcript(peer)

    def step(
        self,
        peer: SyncGateway,
        method: str,
        params: dict[str, Any],
        timeout: float = 60.0,
        name: str | None = None,
        settle: bool = False,
    ) -> dict[str, Any]:
        """A request whose answer is kept under ``name`` (its method by default); the result, or {} on an error.

        ``settle``: the notifications that follow the answer within a second count as the
        step's (an adapter may announce a change just after answering, and through the proxy
        the same notification may come just before the answer).
        """
        since = len(peer.received)
        answer = {k: v for k, v in call(peer, method, params, timeout).items() if k not in ("id", "jsonrpc")}
        if settle:
            peer.drain(quiet=1.0, limit=5.0)
        self.answers[name or method] = answer
        self.notifications[name or method] = sorted(
            kind for kind in map(notification_kind, peer.received[since:]) if kind is not None
        )
        result = answer.get("result")
        return result if isinstance(result, dict) else {}

    def result(self, step: str) -> dict[str, Any]:
        result = self.answers.get(step, {}).get("result")
        return result if isinstance(result, dict) else {}

    def outline(self) -> str:
        """Each step and how it ended, for the report."""
        parts = []
        for step, answer in self.answers.items():
            result, error = answer.get("result"), answer.get("error")
            if isinstance(error, dict):
                reason = (error.get("data") or {}).get("reason") if isinstance(error.get("data"), dict) else None
                outcome = f"{error.get('code')} {str(error.get('message'))[:80]!r}" + (f" ({reason})" if reason else "")
            elif step in ("session/list", OWN_LIST) and isinstance(result, dict):
                rows = result.get("sessions") or []
                titled = sum(1 for row in rows if isinstance(row, dict) and row.get("title"))
                outcome = f"{len(rows)} listed" + (f", {titled} titled" if titled else "")
            elif isinstance(result, dict) and "stopReason" in result:
                outcome = f"stopReason {result['stopReason']}"
            elif step in self.resets:
                outcome = "started afresh (historyReset)"
            else:
                outcome = "ok"
            if step == CANCELLED:
                outcome += f" {self.cancel_seconds:.0f}s after the cancel"
            if self.replays.get(step):
                outcome += f", replayed {checked_words(self.replays[step]) or len(self.replays[step])}"
            if step in ("session/set_mode", "session/set_config_option") and self.setting is not None:
                step = f"{step} {set_to(self.setting)}"
            parts.append(f"{step}: {outcome}")
        return "; ".join(parts)


def eof_outline(eof: list[float | None]) -> str:
    if not eof:
        return "no process was ended by the scenario"
    if all(seconds is None for seconds in eof):
        return "ignores stdin EOF (still running 3s after it, killed)"
    if all(seconds is not None for seconds in eof):
        return f"exits on stdin EOF (within {max(s for s in eof if s is not None):.1f}s)"
    return f"exited on stdin EOF {sum(1 for s in eof if s is not None)} of {len(eof)} times (else killed after 3s)"


def notification_kind(message: Any) -> str | None:
    if not isinstance(message, dict) or "id" in message or "method" not in message:
        return None
    kind = ((message.get("params") or {}).get("update") or {}).get("sessionUpdate")
    if kind in TIMER_UPDATES:
        return None
    return f"{message['method']}:{kind}" if kind else str(message["method"])


def matrix_problems(direct: Scenario, proxied: Scenario) -> list[str]:
    """How the proxied run differs from the straight one beyond what the proxy documents.

    Allowed: ``_meta["acp-proxy"]`` and the session capabilities the proxy serves in
    the initialize result; session/close and session/list answered by the proxy; a
    restore the proxy re-applies the session's mode to; a restore that starts afresh
    (historyReset) where, straight, every restore the adapter offers failed with an
    error the proxy falls back on.
    """
    problems: list[str] = []
    sid = {"direct": direct.session_id, "proxy": proxied.session_id}
    same = {
        "initialize": "the initialize result",
        "authenticate": "authenticate",
        "session/new": "session/new",
        "session/set_mode": "session/set_mode",
        "session/set_config_option": "session/set_config_option",
    }
    for step, what in same.items():
        if step not in direct.answers and step not in proxied.answers:
            continue
        sides = []
        for side, seen in (("direct", direct), ("proxy", proxied)):
            answer = json.loads(json.dumps(seen.answers.get(step)))
            if step == "initialize" and isinstance(answer, dict):
                try:
                    strip_proxy_meta([answer], side == "proxy", f"{side} initialize")
                except CheckFailed as exc:
                    problems.append(str(exc))
            sides.append(normalize_ids(replace_id(answer, sid[side])))
        if sides[0] != sides[1]:
            problems.append(f"{what} answered {short(sides[0])} straight, {short(sides[1])} through the proxy")
        if step != "initialize" and direct.notifications.get(step) != proxied.notifications.get(step):
            problems.append(
                f"{what} came with {direct.notifications.get(step)} straight, "
                f"{proxied.notifications.get(step)} through the proxy"
            )
    if "session/prompt" in direct.answers:
        outcomes = [turn_outcome(seen.answers.get("session/prompt")) for seen in (direct, proxied)]
        if outcomes[0] != outcomes[1]:
            problems.append(f"session/prompt ended {outcomes[0]} straight, {outcomes[1]} through the proxy")
    if CANCELLED in direct.answers:
        outcomes = [turn_outcome(seen.answers.get(CANCELLED)) for seen in (direct, proxied)]
        if outcomes[0] != outcomes[1]:
            problems.append(f"the cancelled turn ended {outcomes[0]} straight, {outcomes[1]} through the proxy")
        if proxied.cancel_seconds > CANCEL_ANSWERED_WITHIN:
            problems.append(
                f"the cancelled turn was answered {proxied.cancel_seconds:.0f}s after session/cancel through the "
                f"proxy (straight {direct.cancel_seconds:.0f}s), over its cancel_timeout"
            )
    for method in direct.plan.restores:
        if method in proxied.answers:
            problems += restore_problems(method, direct, proxied)
    problems += list_problems(proxied)
    return problems


def replace_id(value: Any, session_id: str | None) -> Any:
    """``value`` with the run's session id replaced by a placeholder (each run gets its own)."""
    if not session_id:
        return value
    return json.loads(json.dumps(value).replace(json.dumps(session_id)[1:-1], "SESSION-ID"))


def turn_outcome(answer: Any) -> str:
    answer = answer if isinstance(answer, dict) else {}
    if isinstance(answer.get("error"), dict):
        return f"error {answer['error'].get('code')}"
    return f"stopReason {(answer.get('result') or {}).get('stopReason')}"


def restore_problems(method: str, direct: Scenario, proxied: Scenario) -> list[str]:
    """A restore through the proxy against the same restore straight (on a new process there too)."""
    problems = []
    straight, answer = direct.answers[method], proxied.answers[method]
    fallback = direct.answers.get(THEN_LOAD) if method == "session/resume" else None
    restored = "result" in straight or (fallback is not None and "result" in fallback)
    if "result" in answer:
        if method in proxied.resets and restored:
            problems.append(
                f"{method} through the proxy started afresh (historyReset), though straight the adapter restored "
                f"the session ({method if 'result' in straight else THEN_LOAD})"
            )
        if "result" in straight and method not in proxied.resets:
            mine, theirs = (without_mode(seen.result(method), seen.session_id) for seen in (direct, proxied))
            if mine != theirs:
                problems.append(f"{method} answered {short(mine)} straight, {short(theirs)} through the proxy")
            if method == "session/load" and checked_words(direct.replays[method]) != checked_words(
                proxied.replays[method]
            ):
                problems.append(
                    f"{method} replayed {direct.replays[method]} straight, {proxied.replays[method]} through the proxy"
                )
        problems += mode_problems(method, proxied)
    elif restored:
        problems.append(
            f"{method} through the proxy answered {short(answer)}, though straight the adapter restored the session "
            f"({method if 'result' in straight else THEN_LOAD})"
        )
    elif "error" in straight:
        kept = kept_error(straight["error"], answer.get("error"))
        if kept is not None:
            problems.append(f"{method}: straight {short(straight['error'])}, through the proxy {kept}")
    return problems


def kept_error(adapter: dict[str, Any], proxy: Any) -> str | None:
    """Whether the proxy's error keeps the adapter's code, message and data (adding its own ``reason``)."""
    if not isinstance(proxy, dict):
        return f"no error but {short(proxy)}"
    found = proxy.get("data")
    data: dict[str, Any] = found if isinstance(found, dict) else {}
    theirs = adapter.get("data")
    missing = []
    if proxy.get("code") != adapter.get("code"):
        missing.append("code")
    if proxy.get("message") != adapter.get("message"):
        missing.append("message")
    if isinstance(theirs, dict):
        if any(data.get(key) != value for key, value in theirs.items()):
            missing.append("data")
    elif theirs is not None and theirs not in data.values():
        missing.append("data")
    if data.get("reason") not in PROXY_REASONS:
        missing.append("its own data.reason")
    return f"{short(proxy)}, which lacks the adapter's {', '.join(missing)}" if missing else None


MODE_FIELDS = ("modes", "configOptions")


def without_mode(result: dict[str, Any], session_id: str | None) -> Any:
    """A restore's result without the current mode (the proxy re-applies the mode it was set to)."""
    result = replace_id(result, session_id)
    modes = result.get("modes")
    if isinstance(modes, dict):
        modes.pop("currentModeId", None)
    for option in result.get("configOptions") or []:
        if isinstance(option, dict) and option.get("category") == "mode":
            option.pop("currentValue", None)
    return normalize_ids(result)


def mode_problems(method: str, proxied: Scenario) -> list[str]:
    """A restored session is in the mode it was set to, and its answer says so the same way everywhere."""
    result = proxied.result(method)
    shown = {}
    modes = result.get("modes")
    if isinstance(modes, dict) and "currentModeId" in modes:
        shown["modes.currentModeId"] = modes["currentModeId"]
    for option in result.get("configOptions") or []:
        if isinstance(option, dict) and option.get("category") == "mode":
            shown[f"configOptions[{option.get('id')}].currentValue"] = option.get("currentValue")
    setting = proxied.setting
    step = setting[0] if setting else None
    wanted = set_to(setting) if setting and "result" in proxied.answers.get(str(step), {}) else None
    if wanted is None and len(set(map(str, shown.values()))) <= 1:
        return []
    if wanted is not None and all(value == wanted for value in shown.values()):
        return []
    return [
        f"{method} through the proxy answered {shown}"
        + (f", the session having been set to {wanted!r}" if wanted else "")
    ]


def list_problems(proxied: Scenario) -> list[str]:
    """The proxy lists the session (and none where none opened), with the title the adapter's own list gives it."""
    listed = proxied.result("session/list").get("sessions")
    if not isinstance(listed, list):
        return [f"session/list through the proxy answered {short(proxied.answers.get('session/list'))}"]
    rows = {row.get("sessionId"): row for row in listed if isinstance(row, dict)}
    if proxied.session_id is None:
        return [f"session/list through the proxy gave {short(listed)}, though no session opened"] if rows else []
    if proxied.session_id not in rows:
        return [f"session/list through the proxy gave {short(listed)}, without the session"]
    own = {row.get("sessionId"): row for row in proxied.result(OWN_LIST).get("sessions") or [] if isinstance(row, dict)}
    title = own.get(proxied.session_id, {}).get("title")
    shown = rows[proxied.session_id].get("title")
    if title is not None and shown != title:
        return [f"session/list: the adapter's own list titles the session {title!r}, the proxy's {shown!r}"]
    return []


class AcpxSteps:
    """The acpx commands of an install-* check, each through the proxy; what each printed, and how long it took."""

    def __init__(self, checker: Checker, agent: list[str], env: dict[str, str], log: Path, proxies_log: Path) -> None:
        self.checker = checker
        self.agent = agent
        self.env = env
        self.log = log
        self.proxies_log = proxies_log
        self.ids: dict[str, str] = {}
        self.outputs: list[dict[str, Any]] = []
        self.steps: list[tuple[str, float]] = []
        self.missed: list[str] = []
        """Steps that should have brought their session back on a new process and did not."""

    def run(self, label: str, *args: str, restores: str | None = None) -> tuple[int, list[Any]]:
        """acpx ``args``; with ``restores`` (a session's name), that session must have come back meanwhile."""
        before = self.restores(restores)
        begun = time.monotonic()
        rc, out = self.checker.acpx(self.agent, *args, env=self.env, log=self.log, timeout=PROMPT_TIMEOUT + 60)
        self.steps.append((label, time.monotonic() - begun))
        messages = json_lines(out)
        self.outputs.append({"step": label, "exit": rc, "messages": messages})
        reasons = [proxy_error(m) for m in messages if proxy_error(m)]
        if reasons:
            raise CheckFailed(f"acpx {label} got the proxy's error {reasons[0]} (see {self.log}, {self.proxies_log})")
        if restores is not None and self.restores(restores) <= before:
            self.missed.append(f"acpx {label}: {restores} did not come back on a new process")
        return rc, messages

    def restores(self, session: str | None) -> int:
        """How often the proxies brought ``session`` back on a new process so far."""
        if session is None or session not in self.ids or not self.proxies_log.exists():
            return 0
        pattern = rf"session {re.escape(self.ids[session])} (?:resumed|started afresh) on pid"
        return len(re.findall(pattern, self.proxies_log.read_text(errors="replace")))


def stop_queue_owners(marker: str) -> list[int]:
    """SIGTERM acpx's queue owners of a run (as stopping acpx would); their pids."""
    owners = [m for m in markers.find(MARKER_VAR, marker).values() if "__queue-owner" in m.argv]
    for owner in owners:
        if markers.alive(owner.pid, owner.ticks):
            with contextlib.suppress(ProcessLookupError):
                os.kill(owner.pid, signal.SIGTERM)
    return [owner.pid for owner in owners]


def session_modes(messages: list[Any]) -> tuple[str | None, list[str]]:
    """The current mode and the modes offered, from the last result that listed them."""
    current, modes = None, []
    for message in messages:
        result = message.get("result") if isinstance(message, dict) else None
        offered = result.get("modes") if isinstance(result, dict) else None
        if isinstance(offered, dict) and offered.get("availableModes"):
            current = offered.get("currentModeId")
            modes = [str(mode.get("id")) for mode in offered["availableModes"] if isinstance(mode, dict)]
    return current, modes


class SessionProbe:
    """Requests to one proxy whose wrong answers are collected in ``problems``, so one check reports them all.

    Only a missing answer (or a prompt the proxy itself refused) ends the check at once.
    """

    def __init__(self, gateway: SyncGateway, cwd: Path, problems: list[str]) -> None:
        self.gateway = gateway
        self.cwd = str(cwd)
        self.problems = problems
        self.known: set[str] = set()
        """The session ids the gateway was given (session/new, session/fork)."""

    def load_params(self, session_id: str) -> dict[str, Any]:
        return {"sessionId": session_id, "cwd": self.cwd, "mcpServers": []}

    def new(self) -> str:
        session_id = str(call_result(self.gateway, "session/new", {"cwd": self.cwd, "mcpServers": []})["sessionId"])
        self.known.add(session_id)
        return session_id

    def prompt(self, session_id: str, words: str, what: str) -> None:
        """A turn: the adapter fails it without credentials, once it has recorded it; the proxy must not."""
        answer = call(self.gateway, "session/prompt", prompt_params(session_id, words), timeout=PROMPT_TIMEOUT)
        if proxy_error(answer) or "id" not in answer:
            raise CheckFailed(f"the prompt to {what} got {short(answer)}")

    def empty(self, method: str, session_id: str, what: str) -> None:
        """``method`` for a session, which must answer ``{}``."""
        answer = call(self.gateway, method, {"sessionId": session_id}, timeout=PROMPT_TIMEOUT)
        if answer.get("result") != {}:
            self.problems.append(f"{method} of {what} answered {short(answer)}, expected {{}}")

    def refused(self, method: str, params: dict[str, Any], reason: str, what: str) -> None:
        """A request the proxy must refuse with ``-32002`` and ``data.reason``."""
        answer = call(self.gateway, method, params, timeout=PROMPT_TIMEOUT)
        error = answer.get("error") or {}
        if error.get("code") != -32002 or (error.get("data") or {}).get("reason") != reason:
            self.problems.append(f"{method} of {what} answered {short(answer)}, expected -32002 {reason}")

    def restore(self, method: str, session_id: str, what: str) -> list[str] | None:
        """session/load or session/resume: the user prompts replayed; None if it failed (a problem noted)."""
        since = len(self.gateway.received)
        answer = call(self.gateway, method, self.load_params(session_id), timeout=PROMPT_TIMEOUT)
        result = answer.get("result")
        if not isinstance(result, dict):
            self.problems.append(f"{method} of {what} answered {short(answer)}")
            return None
        if result.get("sessionId", session_id) != session_id:
            self.problems.append(f"{method} of {what} answered sessionId {result['sessionId']!r}, not {session_id!r}")
        return user_texts(updates(self.gateway, since), session_id)

    def listing(self) -> dict[str, dict[str, Any]]:
        """session/list: each session's ``_meta["acp-proxy"]`` by id."""
        rows = call_result(self.gateway, "session/list", {}).get("sessions") or []
        return {str(row.get("sessionId")): (row.get("_meta") or {}).get(PROXY_META) or {} for row in rows}

    def states(self) -> dict[str, Any]:
        return {session_id: meta.get("state") for session_id, meta in self.listing().items()}

    def processes_but_proxy(self, marker: str, wait: float = 5.0) -> list[str]:
        """The run's processes other than the proxy still there after ``wait`` s: with no session
        live there should be none (the pool keeps no spare process)."""
        deadline = time.monotonic() + wait
        while True:
            found = markers.find(MARKER_VAR, marker)
            found.pop(self.gateway.process.pid, None)
            if not found or time.monotonic() >= deadline:
                return [str(marked) for marked in found.values()]
            time.sleep(0.1)


class TreeWatch:
    """Samples /proc in a thread: how many adapter trees of one check are alive at once.

    A tree is every live process carrying the check's marker and one lease's marker
    (``tests.kit.proctree``), so a tree counts from its wrapper's exec until its last
    process has ended. When a pass finds more than one tree, only those still alive at a
    second look count, which proves they were all alive at once. Also counted: the check's
    proxies alive at once.
    """

    def __init__(self, marker: str, every: float = TREE_SAMPLE_EVERY) -> None:
        self.marker = marker
        self.samples = 0
        self.peak = 0
        self.overlaps: list[str] = []
        """What was alive each time more than one tree was (at most a few kept)."""
        self.seen: set[str] = set()
        """Every lease marker seen: one per adapter process started."""
        self.peak_proxies = 0
        self.handovers = 0
        """Passes that found two trees, one of which had ended by the second look (a slot handed over)."""
        self._every = proctree.Every(every, self.sample, "tree-watch")

    @property
    def slowest(self) -> float:
        return self._every.slowest

    def __enter__(self) -> TreeWatch:
        self._every.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._every.__exit__(kind, exc, tb)

    def sample(self) -> None:
        found = markers.find(MARKER_VAR, self.marker)
        trees = proctree.group_by_lease(found.values())
        proxies = sum(1 for marked in found.values() if marked.lease is None and is_proxy(marked.argv))
        self.samples += 1
        self.seen.update(trees)
        self.peak_proxies = max(self.peak_proxies, proxies)
        if len(trees) > 1:
            trees = proctree.alive_together(trees)
            self.handovers += len(trees) <= 1
        self.peak = max(self.peak, len(trees))
        if len(trees) > 1 and len(self.overlaps) < 5:
            self.overlaps.append(
                " | ".join(
                    f"lease {lease.split('.')[1]}: " + ", ".join(str(m) for m in members)
                    for lease, members in trees.items()
                )
            )


def is_proxy(argv: tuple[str, ...]) -> bool:
    """A serving acp-proxy (not one of its operator commands, such as ``status``)."""
    return any(Path(arg).name == "acp-proxy" for arg in argv[:2]) and not {"status", "sessions", "leases"} & set(argv)


class SlotWatch:
    """``acp-proxy status --json`` in a thread, about every second: the install's held slots."""

    def __init__(self, command: list[str], env: dict[str, str], cwd: Path, every: float = SLOT_SAMPLE_EVERY) -> None:
        self.command = command
        self.env = env
        self.cwd = cwd
        self.samples = 0
        self.peak = 0
        self.crowded: list[str] = []
        """The slot lists of samples with more than one slot held (at most a few kept)."""
        self.holders: set[str] = set()
        """Every session seen holding a slot."""
        self.failures: list[str] = []
        self._every = proctree.Every(every, self.sample, "slot-watch")

    def __enter__(self) -> SlotWatch:
        self._every.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._every.__exit__(kind, exc, tb)

    def sample(self) -> list[dict[str, Any]]:
        try:
            done = subprocess.run(
                self.command, capture_output=True, env=self.env, cwd=self.cwd, timeout=30, check=False
            )
            slots = json.loads(done.stdout)["slots"]
        except (subprocess.TimeoutExpired, ValueError, KeyError, TypeError) as exc:
            if len(self.failures) < 5:
                self.failures.append(f"{type(exc).__name__}: {exc}")
            return []
        self.samples += 1
        self.peak = max(self.peak, len(slots))
        self.holders.update(str(view["sessionId"]) for view in slots if view.get("sessionId"))
        if len(slots) > 1 and len(self.crowded) < 5:
            self.crowded.append(short(slots, 600))
        return list(slots)


def outline(messages: list[Any]) -> str:
    """A few words per message: its method, or what the answer was."""
    words = []
    for message in messages:
        if not isinstance(message, dict):
            words.append("?")
        elif "method" in message:
            words.append(message["method"] + ("" if "id" in message else "(n)"))
        elif "error" in message:
            words.append(f"error {message['error'].get('code')} {message['error'].get('message', '')!r}")
        elif "result" in message:
            words.append("result")
        else:
            words.append("text")
    collapsed: list[str] = []
    for word in words:  # "session/update(n) x12" rather than twelve times the same word
        if collapsed and collapsed[-1].split(" x")[0] == word:
            head, _, count = collapsed[-1].partition(" x")
            collapsed[-1] = f"{head} x{int(count or 1) + 1}"
        else:
            collapsed.append(word)
    return ", ".join(collapsed)


def expect_turn(rc: int, messages: list[Any]) -> str | None:
    if rc != 0:
        return "acpx failed"
    if not any(isinstance(m.get("result"), dict) and m["result"].get("stopReason") == "end_turn" for m in messages):
        return "no session/prompt result with stopReason end_turn"
    if not any(m.get("method") == "session/update" for m in messages):
        return "no session/update was streamed"
    return None


def expect_initialized(rc: int, messages: list[Any]) -> str | None:
    """Without credentials an adapter answers initialize, then refuses the session: fine either way."""
    if not any(isinstance(m.get("result"), dict) and "protocolVersion" in m["result"] for m in messages):
        return "no initialize result"
    return None


def proxy_error(message: Any) -> str | None:
    """The proxy's own ``error.data.reason`` (None for an adapter's error or a result)."""
    error = message.get("error") if isinstance(message, dict) else None
    data = error.get("data") if isinstance(error, dict) else None
    reason = data.get("reason") if isinstance(data, dict) else None
    return reason if reason in PROXY_REASONS else None


def foreign_session_ids(messages: list[Any], known: set[str]) -> list[str]:
    """Session ids in params or results the gateway never got from session/new, with the message."""
    found = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        for part in (message.get("params"), message.get("result")):
            sid = part.get("sessionId") if isinstance(part, dict) else None
            if isinstance(sid, str) and sid not in known:
                kind = message.get("method") or "a result"
                if kind == "session/update":
                    kind += f" ({message['params'].get('update', {}).get('sessionUpdate')})"
                found.append(f"{sid} in {kind}")
    return found


def user_texts(updates: list[dict[str, Any]], session_id: str) -> list[str]:
    """The user messages replayed for ``session_id``."""
    texts = []
    for params in updates:
        update = params.get("update") or {}
        content = update.get("content")
        if (
            params.get("sessionId") == session_id
            and update.get("sessionUpdate") == "user_message_chunk"
            and isinstance(content, dict)
            and isinstance(content.get("text"), str)
        ):
            texts.append(content["text"])
    return texts


def checked_words(texts: list[str]) -> list[str]:
    """The prompts the checks sent, among the user messages a load replayed (adapters add their own)."""
    return [text for text in texts if text in (FIRST_WORDS, SECOND_WORDS, OTHER_WORDS, THIRD_WORDS)]


def in_order(wanted: list[str], texts: list[str]) -> bool:
    remaining = iter(texts)
    return all(any(text == word for text in remaining) for word in wanted)


def history_reset(updates: list[dict[str, Any]], session_id: str) -> bool:
    """Whether the proxy announced that ``session_id`` came back without its history."""
    for params in updates:
        update = params.get("update") or {}
        meta = (update.get("_meta") or {}).get(PROXY_META) or {}
        if params.get("sessionId") == session_id and meta.get("historyReset") is True:
            return True
    return False


def announced_modes(updates: list[dict[str, Any]], session_id: str) -> list[str]:
    """The modes ``session/update``s reported for ``session_id`` (mode updates, mode config options)."""
    modes = []
    for params in updates:
        update = params.get("update") or {}
        if params.get("sessionId") != session_id:
            continue
        if update.get("sessionUpdate") == "current_mode_update":
            modes.append(str(update.get("currentModeId")))
        elif update.get("sessionUpdate") == "config_option_update":
            for option in update.get("configOptions") or []:
                if isinstance(option, dict) and option.get("category") == "mode":
                    modes.append(str(option.get("currentValue")))
    return modes


def other_mode(session: dict[str, Any]) -> str | None:
    """A mode the session is not in (to set one the proxy must re-apply on resume)."""
    modes = session.get("modes") or {}
    current = modes.get("currentModeId")
    for mode in modes.get("availableModes") or []:
        if mode.get("id") != current:
            return str(mode["id"])
    return None


def wait_for_log(log: Path, text: str, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in log.read_text(errors="replace"):
            return True
        time.sleep(0.1)
    return False


def log_match(log: Path, pattern: str, timeout: float = 10.0) -> str | None:
    """The first group of ``pattern`` once it appears in ``log``; None if it did not within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text(errors="replace"))
        if found:
            return found.group(1)
        time.sleep(0.1)
    return None


def prompt_params(session_id: str, words: str) -> dict[str, Any]:
    return {"sessionId": session_id, "prompt": [{"type": "text", "text": words}]}


def default_proxy() -> list[str]:
    local = REPO / ".venv" / "bin" / "acp-proxy"
    if local.exists():
        return [str(local)]
    found = shutil.which("acp-proxy")
    if found is None:
        raise SystemExit("check-peers: no acp-proxy (create .venv with scripts/test, or pass --proxy)")
    return [found]


def default_proxy_python() -> str:
    local = REPO / ".venv" / "bin" / "python"
    return str(local) if local.exists() else sys.executable


def registered_checks(checker: Checker) -> dict[str, Callable[[str], str]]:
    """Every check by name, in the order they run: the SDK and echo peers, then each kind of
    check over the adapters it applies to, then the matrix over every adapter of the table."""
    checks: dict[str, Callable[[str], str]] = {
        "sdk-prompt-turn": checker.sdk_turn,
        "sdk-prompt-turn-trio": partial(checker.sdk_turn, proxy_options=("--async-backend", "trio")),
        "acpx-exec-sdk-agent": partial(
            checker.acpx_exec, agent=checker.sdk_agent(), prompt="hello through acpx", expect=expect_turn
        ),
        "acpx-exec-echo-agent": partial(
            checker.acpx_exec, agent=checker.echo_agent(), prompt="echo this, with permission", expect=expect_turn
        ),
        "acpx-sessions-sdk-agent": checker.acpx_sessions,
    }
    per_adapter: tuple[tuple[str, Callable[..., str]], ...] = (
        ("acpx-exec", checker.acpx_exec_adapter),
        ("raw", checker.raw_adapter),
        ("sessions", checker.sessions_raw),
        ("sessions-acpx", checker.sessions_acpx),
        ("spec", checker.spec_raw),
        ("install-acpx", checker.install_acpx),
    )
    for kind, body in per_adapter:
        for adapter in POOL_ADAPTERS:
            checks[f"{kind}-{adapter}"] = partial(body, adapter=adapter)
    for adapter in ADAPTERS:
        checks[f"matrix-{adapter}"] = partial(checker.matrix, adapter=ADAPTERS[adapter])
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(prog="scripts/check-peers", description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", nargs="?", default="/tmp/acp-peers", help="where peers are installed")
    parser.add_argument("--proxy", help="the acp-proxy command (default: .venv/bin/acp-proxy)")
    parser.add_argument("--proxy-python", help="a Python that imports acp_proxy, to run its echo agent")
    parser.add_argument("--no-install", action="store_true", help="reuse the peers already in WORKDIR")
    parser.add_argument("--only", action="append", metavar="NAME", help="run only this check (repeatable)")
    args = parser.parse_args()
    if not sys.platform.startswith("linux"):
        print("check-peers: the leftover-process search reads /proc; run it on Linux", file=sys.stderr)
        return 2

    report = Report()
    checker = Checker(args, report)
    checks = registered_checks(checker)
    unknown = set(args.only or ()) - checks.keys()
    if unknown:
        parser.error(f"unknown check(s) {', '.join(sorted(unknown))}; known: {', '.join(checks)}")
    if not args.no_install:
        checker.install()
    checker.write_sdk_peers()
    print("== peers", flush=True)
    checker.versions()

    print("== checks (each direct, then through the proxy)", flush=True)
    try:
        for name, body in checks.items():
            if not args.only or name in args.only:
                checker.run_check(name, body)
    finally:
        checker.runs.kill_everything()
    print(f"== {len(report.passed)} passed, {len(report.failed)} failed; logs in {checker.logs}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
