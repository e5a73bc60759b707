"""How a check starts its peers and what it may leave behind.

``Peers`` holds the work dirs, the proxy command and the scrubbed environment; every run
(one check, direct or proxied) gets a marker in its environment, which every descendant
inherits, so /proc finds whatever a run left behind (``Runs``). The helpers below speak
JSON-RPC through the kit's ``SyncGateway``; a wrong answer raises ``CheckFailed``.
"""

from __future__ import annotations

import argparse
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
from pathlib import Path
from typing import Any

from tests.kit import markers
from tests.kit.gateway import Closed, SyncGateway

from .adapters import ADAPTERS
from .report import CheckFailed, Report
from .wire import CLIENT_INITIALIZE, foreign_session_ids, short

PROGRAMS = Path(__file__).resolve().parent
"""Where the SDK agent and client are: run as files by the SDK venv's Python (``acp`` is not ours to import)."""
REPO = PROGRAMS.parent.parent
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
PROMPT_TIMEOUT = 180.0  # codex-acp retries an unreachable model for about 30s


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


def end_keeping(peer: SyncGateway, stdout: Path) -> None:
    """End ``peer``, first keeping in ``stdout`` every message it received (one JSON object a line)."""
    try:
        stdout.write_text("\n".join(json.dumps(m) for m in transcript(peer)))
    finally:
        end(peer)


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


class Peers:
    """Where the peers are installed and how a check starts them: the work dirs, the proxy command,
    the scrubbed environment and each run's marker, and the leftovers search after a run."""

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
        return [str(self.venv_python), str(PROGRAMS / "sdk_agent.py")]

    def echo_agent(self) -> list[str]:
        return [self.proxy_python, "-m", "acp_proxy.examples.echo_agent"]

    def proxied(self, command: list[str]) -> list[str]:
        return [*self.proxy, "--", *command]

    def fresh_logs(self, name: str, *suffixes: str) -> list[Path]:
        """``WORKDIR/logs/NAME-SUFFIX`` for each suffix, none left from an earlier run."""
        logs = [self.logs / f"{name}-{suffix}" for suffix in suffixes]
        for log in logs:
            log.unlink(missing_ok=True)
        return logs

    def check_leftovers(self, name: str, mode: str, marker: str, wait: float = 5.0) -> None:
        left = self.runs.leftovers(marker, wait)
        if not left:
            return
        listing = "; ".join(f"pid {pid} {cmd}" for pid, cmd in left)
        if mode == "proxy":
            raise CheckFailed(f"processes left running after the proxied run (killed now): {listing}")
        self.report.note(name, f"the direct run left processes running (killed now): {listing}")

    def proxy_json(self, env: dict[str, str], *args: str) -> Any:
        """``acp-proxy ARGS --json``'s output, in ``env``; a failure is the check's."""
        done = subprocess.run([*self.proxy, *args, "--json"], env=env, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise CheckFailed(f"acp-proxy {' '.join(args)} exited {done.returncode}: {done.stderr.strip()[-300:]}")
        return json.loads(done.stdout)

    def acpx(
        self, agent: list[str], *args: str, env: dict[str, str], log: Path, timeout: float = 120
    ) -> tuple[int, str]:
        argv = [str(self.bin / "acpx"), "--cwd", str(self.ws), "--agent", shlex.join(agent), *args]
        return run_command(argv, env, log, timeout=timeout, cwd=self.ws)

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

    def last_words(self, gateway: SyncGateway, what: str, known: set[str]) -> list[str]:
        """Once the gateway has gone quiet: the session ids it was never given that reached it, then
        its stdin EOF, which the proxy must exit 0 on (``end_gateway``)."""
        gateway.drain(quiet=1.0, limit=10.0)
        leaks = [f"{what}: {leak}" for leak in foreign_session_ids(gateway.received, known)]
        self.end_gateway(gateway, what)
        return leaks

    def acpx_session_id(self, command: list[str], session: str, env: dict[str, str], log: Path) -> str:
        rc, out = self.acpx(command, "--format", "json", "sessions", "show", session, env=env, log=log)
        try:
            return str(json.loads(out)["acpSessionId"])
        except (ValueError, KeyError, TypeError):
            raise CheckFailed(f"acpx sessions show {session} exited {rc} without a record (see {log})") from None
