"""remote-acpx-*: acpx reaching its agent over the network, through ``acp-proxy connect``.

``acp-proxy serve --listen 127.0.0.1:PORT`` serves ACP over WebSocket at /acp (each connection
served by a stdio proxy of the install); ``acp-proxy connect ws://127.0.0.1:PORT/acp``, with the
token of ``acp-proxy token create`` in ``ACP_PROXY_TOKEN``, is the stdio<->WebSocket bridge
acpx launches as its agent command. Each check runs the same acpx commands twice: first against
``acp-proxy -- AGENT`` (``--config`` for an adapter) on stdio, the reference, then through the
bridge to ``serve`` with the same backend, and compares what acpx printed.

The commands: ``exec`` (one turn), then a named session: ``sessions new``, ``prompt -s`` (its
queue owner, hence its bridge, kept running with ``--ttl``), then, remote only, the link
dropped mid-session (``serve`` stopped with SIGTERM, a new ``serve`` started on the same port
and state dir) and ``prompt -s`` again: the session must go on under the same id, on the same
bridge, resumed (not started afresh) by the new serve's proxy; with the echo agent acpx's
output must be the same as on stdio, where nothing happened (an adapter answers an offline turn
in a new process otherwise than in the same one). Then the queue owner is stopped and
``session/load`` through a fresh gateway (the bridge, for the remote run) must replay both
prompts. Nothing of either run may be left running.

remote-acpx-echo runs the proxy's echo agent, which answers prompts offline and says how many
earlier prompts of the session it remembers; remote-acpx-ADAPTER a real adapter, which creates
sessions offline (placeholder credentials) and records a prompt before its model call fails.
acpx drops its agent's stderr, so the bridge's (or the stdio proxy's) log is appended to
WORKDIR/logs/<check>-<mode>-agent.stderr; ``serve``'s goes to <check>-remote-serve1/2.stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from acp_proxy.ownership.proctable import default_table
from tests.kit import markers

from .acpx_checks import expect_initialized, expect_turn
from .harness import MARKER_VAR, PROMPT_TIMEOUT, Peers, call, end, kill_group, run_command, updates
from .install_checks import stop_queue_owners
from .report import CheckFailed
from .wire import (
    FIRST_WORDS,
    SECOND_WORDS,
    foreign_session_ids,
    in_order,
    json_lines,
    normalize_ids,
    outline,
    proxy_error,
    relabel_requests,
    short,
    unordered_notifications,
    user_texts,
)

MODES = ("stdio", "remote")
SESSION = "remote"
TTL = 600  # the queue owner, and so its bridge, must outlive the drop; stopped at the end
ECHO_REMEMBERS = "(I remember 1 earlier prompt)"
LINK_ERRORS = frozenset({"link_dropped", "unreachable", "refused"})
"""``error.data.reason`` of the bridge's own answers (a request in flight at a drop, one that waited
too long for a link, or one the server refused a link for)."""


@dataclass(frozen=True)
class Backend:
    """The agent behind the proxy, said both ways: after ``acp-proxy`` and after ``acp-proxy serve --listen ADDR``."""

    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    offline_turns: bool = False
    """Prompts are answered (end_turn) offline: the echo agent. An adapter fails them, once recorded."""


BackendFor = Callable[[Path], Backend]
"""The backend of one run, given that run's private directory."""


def remote_acpx_echo(peers: Peers, name: str) -> str:
    """The echo agent as an ad-hoc backend (``serve ... -- CMD``), its history kept on disk (``--store``)."""

    def backend(base: Path) -> Backend:
        return Backend(["--", *peers.echo_agent(), "--store", str(base / "store")], offline_turns=True)

    return remote_acpx(peers, name, backend)


def remote_acpx_adapter(peers: Peers, name: str, adapter: str) -> str:
    """A real adapter as the config's only backend (``serve ... --config CFG``), placeholder credentials."""

    def backend(base: Path) -> Backend:
        config = base / "proxy.toml"
        config.write_text(f"[backends.{adapter}]\ncommand = {json.dumps(peers.command(adapter))}\n")
        return Backend(["--config", str(config)], env=peers.adapter_env(adapter))

    return remote_acpx(peers, name, backend)


def remote_acpx(peers: Peers, name: str, backend_for: BackendFor) -> str:
    """The acpx commands on stdio, then remote with the link dropped mid-session; what each printed, compared."""
    runs = {mode: RemoteRun(peers, name, mode, backend_for).run() for mode in MODES}
    problems = [problem for run in runs.values() for problem in run.problems]
    stdio, remote = runs["stdio"], runs["remote"]
    pairs = [("exec", stdio.exec, remote.exec), *zip(stdio.labels, stdio.steps, remote.steps, strict=True)]
    if not remote.backend.offline_turns:
        # After the drop the remote turn runs on a new adapter process, the stdio one on the same: an
        # adapter answers a second offline turn differently there (claude-agent-acp: end_turn in the
        # same process, -32000 in a new one). Continuity is judged by the resume and the load instead.
        pairs.pop()
    for label, ours, theirs in pairs:
        if ours[0] != theirs[0]:
            problems.append(f"acpx {label} exited {ours[0]} on stdio, {theirs[0]} remote")
        diff = difference(comparable(ours[1]), comparable(theirs[1]))
        if diff:
            problems.append(f"acpx {label} printed different messages, {diff}")
    if stdio.replay != remote.replay:
        problems.append(f"session/load replayed {stdio.replay} on stdio, {remote.replay} remote")
    if remote.errors:
        peers.report.note(name, f"serve logged {remote.errors}")
    if problems:
        raise CheckFailed("; ".join(problems))
    exec_rc, exec_messages = remote.exec
    turn_rc, turn = remote.steps[-1]
    return (
        f"the same both ways: exec exit {exec_rc}, {len(exec_messages)} messages ({outline(exec_messages)}); "
        f"session {remote.session_id}: the link dropped after the first prompt (serve stopped by SIGTERM in "
        f"{remote.stopped_in:.1f}s, a new serve on port {remote.port} in {remote.restarted_in:.1f}s), the next "
        f"prompt exit {turn_rc} under the same id on the same bridge (pid {remote.bridge}, linked "
        f"{remote.links} times), {len(turn)} messages ({outline(turn)}); session/load through the bridge "
        f"replayed {remote.replay}; nothing left running"
    )


def comparable(messages: list[Any]) -> list[Any]:
    return unordered_notifications(relabel_requests(normalize_ids(messages)))


def difference(stdio: list[Any], remote: list[Any]) -> str | None:
    for index, (a, b) in enumerate(zip(stdio, remote, strict=False)):
        if a != b:
            return f"message {index}: stdio {short(a)} vs remote {short(b)}"
    if len(stdio) != len(remote):
        return f"stdio had {len(stdio)} messages, remote {len(remote)}"
    return None


class RemoteRun:
    """One run of the acpx commands: through ``acp-proxy`` on stdio, or through the bridge to ``serve``."""

    def __init__(self, peers: Peers, name: str, mode: str, backend_for: BackendFor) -> None:
        self.peers = peers
        self.name = name
        self.mode = mode
        self.remote = mode == "remote"
        base = peers.work / "remote" / name / mode
        shutil.rmtree(base, ignore_errors=True)
        (base / "home" / ".claude").mkdir(parents=True)  # as the other checks' HOMEs
        self.backend = backend_for(base)
        self.env, self.marker = peers.runs.env(
            f"{name}-{mode}", HOME=str(base / "home"), ACP_PROXY_STATE_DIR=str(base / "state"), **self.backend.env
        )
        self.log, self.agent_log, *self.serve_logs, self.audit_log = peers.fresh_logs(
            f"{name}-{mode}", "acpx.stderr", "agent.stderr", "serve1.stderr", "serve2.stderr", "audit.stderr"
        )
        self.stdout = peers.logs / f"{name}-{mode}.stdout"
        self.problems: list[str] = []
        self.exec: tuple[int, list[Any]] = (0, [])
        self.labels = ["sessions new", "prompt -s (first)", "prompt -s (after the drop)"]
        self.steps: list[tuple[int, list[Any]]] = []
        self.session_id = ""
        self.replay: list[str] = []
        self.serve: Serve | None = None
        self.port = 0
        self.stopped_in = self.restarted_in = 0.0
        self.bridge: int | None = None
        self.links = 0
        self.errors = ""

    def wrapped(self, command: list[str]) -> list[str]:
        """``command`` with its stderr appended to the agent log (acpx drops its agent's stderr)."""
        return ["/bin/sh", "-c", 'exec "$@" 2>>"$0"', str(self.agent_log), *command]

    def run(self) -> RemoteRun:
        try:
            if self.remote:
                token = self.create_token()
                self.serve = Serve(self.peers, self.backend.args, self.env, self.serve_logs[0])
                self.port = self.serve.start(0)
                agent = self.wrapped([*self.peers.proxy, "connect", f"ws://127.0.0.1:{self.port}/acp"])
                acpx_env = {**self.env, "ACP_PROXY_TOKEN": token}
            else:
                agent = self.wrapped([*self.peers.proxy, *self.backend.args])
                acpx_env = self.env
            self.exec_turn(agent, acpx_env)
            self.session(agent, acpx_env)
            self.audit(agent, acpx_env)
            if self.serve is not None:
                self.stop_serve("the last serve")
                self.errors = self.serve_errors()
            left = self.peers.runs.leftovers(self.marker, 10.0)
            if left:
                listing = "; ".join(f"pid {pid} {cmd}" for pid, cmd in left)
                self.problems.append(f"{self.mode}: processes left running (killed now): {listing}")
        except CheckFailed as exc:
            raise CheckFailed(f"{self.mode}: {exc}") from None
        finally:
            self.stdout.write_text(json.dumps({"exec": self.exec, "steps": self.steps}, indent=1))
            if self.serve is not None:
                self.serve.kill()
            stop_queue_owners(self.marker)
            self.peers.runs.leftovers(self.marker, 5.0)
        return self

    def create_token(self) -> str:
        env = {k: v for k, v in self.env.items() if k != "ACP_PROXY_TOKEN"}
        return create_token(self.peers, "check-peers", env, self.log)

    def acpx(self, agent: list[str], env: dict[str, str], *args: str) -> tuple[int, list[Any]]:
        rc, out = self.peers.acpx(agent, *args, env=env, log=self.log, timeout=PROMPT_TIMEOUT + 60)
        messages = json_lines(out)
        for message in messages:
            if proxy_error(message) or bridge_error(message):
                whose = "the proxy's" if proxy_error(message) else "the bridge's"
                raise CheckFailed(f"acpx {' '.join(args[-3:])} got {whose} error {short(message)} (see {self.log})")
        return rc, messages

    def exec_turn(self, agent: list[str], env: dict[str, str]) -> None:
        options = ("--format", "json", "--approve-all", "--timeout", f"{PROMPT_TIMEOUT:.0f}")
        prompt = "echo this, with permission" if self.backend.offline_turns else "say hi"
        rc, messages = self.acpx(agent, env, *options, "exec", prompt)
        problem = (expect_turn if self.backend.offline_turns else expect_initialized)(rc, messages)
        if problem:
            raise CheckFailed(f"acpx exec: {problem} (exit {rc}; see {self.log})")
        self.exec = (rc, messages)
        # The bridge has left: its connection's proxy must end too, and only serve (and its launcher) remain.
        extra = self.others(self.serving, wait=30)
        if extra:
            self.problems.append(f"{self.mode}: 30s after acpx exec still running: {'; '.join(extra)}")

    def session(self, agent: list[str], env: dict[str, str]) -> None:
        """sessions new, a prompt, the link dropped (remote), a prompt: one session throughout."""
        rc, messages = self.acpx(agent, env, "--format", "json", "sessions", "new", "--name", SESSION)
        if rc != 0:
            raise CheckFailed(f"acpx sessions new exited {rc} (see {self.log})")
        self.steps.append((rc, messages))
        self.session_id = self.peers.acpx_session_id(agent, SESSION, env, self.log)
        options = ("--format", "json", "--approve-all", "--ttl", str(TTL), "--timeout", f"{PROMPT_TIMEOUT:.0f}")
        self.steps.append(self.turn(agent, env, options, FIRST_WORDS))
        if self.serve is not None:
            self.drop_link()
        self.steps.append(self.turn(agent, env, options, SECOND_WORDS))
        after = self.peers.acpx_session_id(agent, SESSION, env, self.log)
        if after != self.session_id:
            self.problems.append(f"{self.mode}: acpx's record of the session moved from {self.session_id} to {after}")
        seen = [message for _, messages in self.steps for message in messages]
        self.problems += [f"{self.mode}: acpx saw {leak}" for leak in foreign_session_ids(seen, {self.session_id})]
        if self.remote:
            self.check_relinked()

    def turn(
        self, agent: list[str], env: dict[str, str], options: tuple[str, ...], words: str
    ) -> tuple[int, list[Any]]:
        rc, messages = self.acpx(agent, env, *options, "prompt", "-s", SESSION, words)
        prompts = [m for m in messages if isinstance(m, dict) and m.get("method") == "session/prompt"]
        if not prompts:
            raise CheckFailed(f"acpx prompt -s {SESSION} exited {rc} before session/prompt (see {self.log})")
        if any((m.get("params") or {}).get("sessionId") != self.session_id for m in prompts):
            self.problems.append(f"{self.mode}: acpx prompted {short(prompts)}, not session {self.session_id}")
        if self.backend.offline_turns:
            problem = expect_turn(rc, messages)
            if problem:
                raise CheckFailed(f"acpx prompt -s {SESSION}: {problem} (exit {rc}; see {self.log})")
            if words == SECOND_WORDS and ECHO_REMEMBERS not in json.dumps(messages):
                self.problems.append(f"{self.mode}: the second prompt's answer lacks {ECHO_REMEMBERS!r}")
        return rc, messages

    def drop_link(self) -> None:
        """serve stopped by SIGTERM while acpx's queue owner and its bridge run; a new serve on the same port."""
        assert self.serve is not None
        linked = markers.find(MARKER_VAR, self.marker)
        bridges = [m.pid for m in linked.values() if "connect" in m.argv]
        if len(bridges) != 1 or not any("__queue-owner" in m.argv for m in linked.values()):
            raise CheckFailed(f"before the drop, expected acpx's queue owner and one bridge, found {describe(linked)}")
        self.bridge = bridges[0]
        self.stopped_in = self.stop_serve("serve, the link dropped mid-session,")
        extra = self.others(lambda m: "__queue-owner" in m.argv or m.pid == self.bridge, wait=10)
        if extra:
            self.problems.append(f"after serve stopped, more than the queue owner and bridge ran: {'; '.join(extra)}")
        begun = time.monotonic()
        self.serve = Serve(self.peers, self.backend.args, self.env, self.serve_logs[1])
        self.serve.start(self.port)
        self.restarted_in = time.monotonic() - begun

    def stop_serve(self, what: str) -> float:
        assert self.serve is not None
        seconds, status = self.serve.stop()
        if status != 0:
            self.problems.append(f"{what} exited {status} after SIGTERM (see {self.serve.log})")
        return seconds

    def check_relinked(self) -> None:
        """The queue owner's bridge went on (same pid), re-linked, and the new serve resumed the session."""
        if self.bridge is None or not markers.alive(self.bridge):
            self.problems.append(f"the queue owner's bridge (pid {self.bridge}) did not outlive the drop")
        text = self.agent_log.read_text(errors="replace")
        mine = [line for line in text.splitlines() if line.startswith(f"acp-proxy[{self.bridge}]")]
        self.links = sum(" linked to " in line for line in mine)
        drops = sum(" down (" in line for line in mine)
        if self.links < 2 or not drops:
            self.problems.append(
                f"the bridge (pid {self.bridge}) logged {self.links} links and {drops} drops (see {self.agent_log})"
            )
        resumed = self.serve_logs[1].read_text(errors="replace")
        if not re.search(rf"session {re.escape(self.session_id)} resumed on pid", resumed):
            afresh = f"session {self.session_id} started afresh" in resumed
            why = "started afresh" if afresh else "not resumed"
            self.problems.append(f"the new serve's proxy {why} session {self.session_id} (see {self.serve_logs[1]})")

    def audit(self, agent: list[str], env: dict[str, str]) -> None:
        """The queue owner stopped, then a fresh gateway (on the same agent command) loads the session."""
        stop_queue_owners(self.marker)
        extra = self.others(self.serving, wait=30)
        if extra:
            self.problems.append(f"{self.mode}: 30s after the queue owner's SIGTERM still running: {'; '.join(extra)}")
        gateway, _ = self.peers.session_gateway(agent, env, self.audit_log)
        try:
            params = {"sessionId": self.session_id, "cwd": str(self.peers.ws), "mcpServers": []}
            answer = call(gateway, "session/load", params, timeout=PROMPT_TIMEOUT)
            if not isinstance(answer.get("result"), dict):
                raise CheckFailed(f"session/load of {self.session_id} answered {short(answer)} (see {self.audit_log})")
            self.replay = [text for text in user_texts(updates(gateway), self.session_id) if text in WORDS]
            self.peers.end_gateway(gateway, f"the {self.mode} audit")
        finally:
            end(gateway)
        if not in_order(list(WORDS), self.replay):
            self.problems.append(f"{self.mode}: session/load of {self.session_id} replayed {self.replay}")

    def serving(self, found: markers.Marked) -> bool:
        """Whether ``found`` is the running serve or its launcher (its child on its command line, which forks
        each connection's proxy: ``acp_proxy/remote/launcher.py``)."""
        if self.serve is None:
            return False
        if found.pid == self.serve.pid:
            return True
        info = default_table().info(found.pid)
        serve = markers.find(MARKER_VAR, self.marker).get(self.serve.pid)
        return info is not None and info.ppid == self.serve.pid and serve is not None and found.argv == serve.argv

    def others(self, allowed: Callable[[markers.Marked], bool], wait: float) -> list[str]:
        """The run's processes, but those ``allowed``, still running after up to ``wait`` seconds."""
        deadline = time.monotonic() + wait
        while True:
            extra = [str(m) for m in markers.find(MARKER_VAR, self.marker).values() if not allowed(m)]
            if not extra or time.monotonic() >= deadline:
                return extra
            time.sleep(0.1)

    def serve_errors(self) -> str:
        """acp-proxy's ERROR lines in the serve logs (not the adapters'), counted by their text, for a NOTE."""
        found: dict[str, int] = {}
        for log in self.serve_logs:
            for line in log.read_text(errors="replace").splitlines():
                ours = re.match(r"acp-proxy\[\d+\] (ERROR .*)", line)
                if ours:
                    key = ours.group(1)[:140]
                    found[key] = found.get(key, 0) + 1
        return "; ".join(f"{count} x {line!r}" for line, count in found.items())


WORDS = (FIRST_WORDS, SECOND_WORDS)


def bridge_error(message: Any) -> str | None:
    """The bridge's own ``error.data.reason`` (``LINK_ERRORS``), None for anything else."""
    error = message.get("error") if isinstance(message, dict) else None
    data = error.get("data") if isinstance(error, dict) else None
    reason = data.get("reason") if isinstance(data, dict) else None
    return reason if reason in LINK_ERRORS else None


def describe(found: dict[int, markers.Marked]) -> str:
    return "; ".join(str(m) for m in found.values()) or "nothing"


def create_token(peers: Peers, name: str, env: dict[str, str], log: Path) -> str:
    """The secret of ``acp-proxy token create NAME`` in ``env``'s state dir (its stderr to ``log``)."""
    rc, out = run_command([*peers.proxy, "token", "create", name], env, log, 30, peers.ws)
    token = out.strip()
    if rc != 0 or not token or len(token.split()) != 1:
        raise CheckFailed(f"acp-proxy token create exited {rc} printing {out!r} (see {log})")
    return token


@dataclass
class EchoServed:
    """A ``serve`` of the echo agent (``serving_echo``), for a client to reach."""

    url: str
    token: str
    env: dict[str, str]
    client_log: Path
    serve_log: Path
    seconds: float = 0.0
    """How long it took to exit on SIGTERM (once the block has ended)."""


@contextlib.contextmanager
def serving_echo(peers: Peers, name: str) -> Iterator[EchoServed]:
    """``serve`` in front of the echo agent (its history on disk, so another process of it loads a session), in
    a scratch state dir of ``name``'s with a token, until the block ends: then stopped by SIGTERM, which it
    must exit 0 on, and nothing of the run may be left running."""
    base = peers.work / "remote" / name
    shutil.rmtree(base, ignore_errors=True)
    (base / "home").mkdir(parents=True)
    env, marker = peers.runs.env(name, HOME=str(base / "home"), ACP_PROXY_STATE_DIR=str(base / "state"))
    serve_log, client_log = peers.fresh_logs(name, "serve.stderr", "client.stderr")
    token = create_token(peers, name, env, client_log)
    serve = Serve(peers, ["--", *peers.echo_agent(), "--store", str(base / "store")], env, serve_log)
    try:
        served = EchoServed(f"http://127.0.0.1:{serve.start(0)}/acp", token, env, client_log, serve_log)
        yield served
        served.seconds, status = serve.stop()
        if status != 0:
            raise CheckFailed(f"serve exited {status} after SIGTERM (see {serve_log})")
    finally:
        serve.kill()
    peers.check_leftovers(name, "proxy", marker, wait=10.0)


class Serve:
    """``acp-proxy serve --listen 127.0.0.1:PORT ARGS`` in its own process group, its stderr to ``log``."""

    def __init__(self, peers: Peers, args: list[str], env: dict[str, str], log: Path) -> None:
        self.peers = peers
        self.args = args
        self.env = env
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else -1

    def start(self, port: int, timeout: float = 30.0) -> int:
        """Start, and the port of its ``listening: http://127.0.0.1:PORT/acp`` line."""
        argv = [*self.peers.proxy, "serve", "--listen", f"127.0.0.1:{port}", *self.args]
        with open(self.log, "ab") as err:
            err.write(f"$ {' '.join(argv)}\n".encode())
            err.flush()
            self.process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, env=self.env,
                cwd=self.peers.ws, start_new_session=True,
            )  # fmt: skip
        assert self.process.stdout is not None
        fd, seen, deadline = self.process.stdout.fileno(), b"", time.monotonic() + timeout
        while b"\n" not in seen:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise CheckFailed(f"serve printed no 'listening:' line within {timeout:.0f}s (see {self.log})")
            chunk = os.read(fd, 4096)
            if not chunk:
                raise CheckFailed(f"serve exited {self.process.wait()} before listening (see {self.log})")
            seen += chunk
        found = re.match(rb"listening: http://127\.0\.0\.1:(\d+)/acp\n", seen)
        if found is None:
            raise CheckFailed(f"serve printed {seen!r}, not 'listening: http://127.0.0.1:PORT/acp'")
        return int(found.group(1))

    def stop(self, timeout: float = 30.0) -> tuple[float, int]:
        """SIGTERM to serve alone, as an operator stops it; the seconds until it exited, and its status."""
        assert self.process is not None
        begun = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            status = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_group(self.process)
            raise CheckFailed(f"serve still ran {timeout:.0f}s after SIGTERM (see {self.log})") from None
        return time.monotonic() - begun, status

    def kill(self) -> None:
        if self.process is not None:
            if self.process.poll() is None:
                kill_group(self.process)
            if self.process.stdout is not None:
                self.process.stdout.close()
