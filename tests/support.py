"""What the tests share: a real proxy driven as a gateway drives it, the fake adapter, and their helpers.

``Gateway.start`` launches ``python -m acp_proxy [...] -- fake_adapter.py OPTIONS`` on
the test's own anyio backend, through the kit's client (``tests.kit.gateway``).
Every message the proxy writes to the gateway is validated against the ACP schema as
it arrives; every line it writes to the adapter is recorded by the fake adapter and
validated when the gateway closes.

Every process a test starts carries ``MARKER_VARIABLE`` (see ``conftest.proc_env``),
which ``marked_processes`` finds.
"""

from __future__ import annotations

import collections
import io
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import traceback
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import anyio
import sniffio

from acp_proxy.ownership import cgroups
from acp_proxy.remote.launcher import exit_status
from acp_proxy.sessions.registry import SessionRegistry
from acp_proxy.state import DB_NAME, StateDB
from acp_proxy.state.connection import StateError
from tests.conformance import Conversation
from tests.kit import forked, gateway, markers

TESTS = Path(__file__).parent
FAKE_ADAPTER = TESTS / "fake_adapter.py"
MARKER_VARIABLE = "ACP_PROXY_TEST_MARKER"
GONE_WITHIN = 8.0  # a liveness bound for process checks, not a performance figure

RESUME_AND_LOAD = {"loadSession": True, "sessionCapabilities": {"resume": {}, "close": {}}}
LOAD_ONLY = {"loadSession": True}
NEITHER: dict[str, Any] = {}

BAD_ERROR_OBJECTS: list[Any] = [
    {"code": "1", "message": "m"},
    {"message": "m"},
    {"code": 1},
    {"code": 1.5, "message": "m"},
    {"code": 1, "message": 5},
    {"code": True, "message": "m"},
    [1, "m"],
]
"""``error`` members that are objects (or arrays) but no JSON-RPC error: what a bad answer carries."""

TEST_INITIALIZE = {
    "protocolVersion": 1,
    "clientCapabilities": {"fs": {"readTextFile": True, "writeTextFile": True}, "terminal": True},
    "clientInfo": {"name": "test-gateway", "version": "1.0"},
}


pid_alive = markers.alive


def fake_command(**options: Any) -> list[str]:
    # -S: the standard library is all it imports, and the venv's site (its .pth files) is a seventh of its start
    return [sys.executable, "-S", str(FAKE_ADAPTER), json.dumps(options)]


# --- processes -------------------------------------------------------------------------------


def scratch_run(prefix: str) -> tuple[Path, dict[str, str]]:
    """A work dir and an environment for a run from the shell (the soak, the fuzzer at scale):
    a marker of its own, a state dir of its own, no config from the caller's environment."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    env = dict(os.environ)
    env[MARKER_VARIABLE] = uuid.uuid4().hex
    env["ACP_PROXY_STATE_DIR"] = str(workdir / "state")
    env.pop("ACP_PROXY_CONFIG", None)
    env["PYTHONUNBUFFERED"] = "1"
    return workdir, env


def end_run(workdir: Path, *, keep: bool) -> None:
    """Keep the work dir of a run that asked for it or found something, else remove it."""
    if keep:
        print(f"work dir kept: {workdir}", file=sys.stderr)
    else:
        shutil.rmtree(workdir, ignore_errors=True)


def marked_processes(marker: str) -> dict[int, markers.Marked]:
    """Live processes whose environment carries ``ACP_PROXY_TEST_MARKER=marker``."""
    return markers.find(MARKER_VARIABLE, marker)


def kill_marked(marker: str) -> None:
    markers.kill(marked_processes(marker).values())


async def survivors(pids: list[int], timeout: float = GONE_WITHIN) -> list[int]:
    """The pids still alive once they have all exited or ``timeout`` has passed."""
    with anyio.move_on_after(timeout):
        while any(pid_alive(p) for p in pids):
            await anyio.sleep(0.02)
    return [p for p in pids if pid_alive(p)]


# --- the gateway -------------------------------------------------------------------------------


class Gateway(gateway.Gateway):
    """The kit's client, checking every message against the schema both ways."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.to_gateway = Conversation("client")
        self.record: Path | None = None
        self.observers.append(self._conform)

    def _conform(self, direction: str, msg: dict[str, Any]) -> None:
        if direction == "in":
            self.to_gateway.check(msg)
        elif isinstance(msg.get("method"), str):
            self.to_gateway.track_request(msg)

    @classmethod
    @asynccontextmanager
    async def start(
        cls,
        env: dict[str, str],
        tmp_path: Path,
        adapter: list[str] | None = None,
        *,
        proxy_args: list[str] | None = None,
        record: bool = True,
        forked: bool = True,
        **adapter_options: Any,
    ) -> AsyncIterator[Gateway]:
        """A proxy in front of ``adapter`` (default: the fake adapter with ``adapter_options``, recorded).

        ``forked``: the proxy is forked from the tests' fork server (``tests/kit/forked.py``), not
        exec'd; ``False`` for a test that finds it as a gateway's child is found (by its marker).
        """
        record_path = None
        if adapter is None:
            record_path = tmp_path / f"adapter-{uuid.uuid4().hex[:8]}.jsonl"
            if record:
                adapter_options.setdefault("record", str(record_path))
            adapter = fake_command(**adapter_options)
        backend = sniffio.current_async_library()
        argv = [sys.executable, "-m", "acp_proxy", "--async-backend", backend, *(proxy_args or []), "--", *adapter]
        # Ids from 1001: the tests' own ids (0 for initialize, small numbers, strings) never collide.
        async with cls.launch(argv, env=env, name="the proxy", first_id=1001, forked=forked) as gw:
            gw.record = record_path if record else None
            yield gw
        assert gw.bad_lines == [], f"the proxy wrote lines that are not JSON objects: {gw.bad_lines[:3]}"
        gw.check_adapter_side()

    def check_adapter_side(self) -> None:
        """Validate every line the proxy wrote to the fake adapter."""
        if self.record is None or not self.record.exists():
            return
        per_process: dict[int, Conversation] = collections.defaultdict(lambda: Conversation("agent"))
        for entry in map(json.loads, self.record.read_text().splitlines()):
            to_adapter = per_process[entry.get("pid", 0)]  # each adapter process has its own id space
            if "out" in entry:
                to_adapter.track_request(json.loads(entry["out"]))
            else:
                to_adapter.check(json.loads(entry["in"]))

    def adapter_record(self) -> list[dict[str, str]]:
        assert self.record is not None
        return [json.loads(line) for line in self.record.read_text().splitlines()]

    async def initialize(self, params: dict[str, Any] | None = None, *, request_id: Any = 0) -> dict[str, Any]:
        return await super().initialize(params or TEST_INITIALIZE, request_id=request_id)


# --- proxies with sessions over a pool -----------------------------------------------------------


BACKEND_KEYS = ("turn_idle_timeout", "session_max_memory", "session_kill_memory", "turn_timeout", "on_eof")
"""Backend keys ``write_config`` writes as they are (the other options are the fake adapter's)."""


def write_config(
    tmp_path: Path,
    *,
    pool: dict[str, str | int] | None = None,
    backends: dict[str, dict[str, Any]] | None = None,
    default_backend: str | None = None,
    tasks: dict[str, Any] | None = None,
    shutdown: dict[str, str] | None = None,
    sessions: dict[str, str] | None = None,
) -> Path:
    """A TOML config: fast shutdown (unless ``shutdown`` says otherwise), the given pool, backends (each a
    dict of fake adapter options, but ``resume``, ``max_live``, ``start_timeout``, ``cancel_timeout`` and
    ``BACKEND_KEYS``, which are the backend's own)."""
    lines = []
    if default_backend:
        lines.append(f'default_backend = "{default_backend}"')
    graces = {"close_timeout": "500ms", "stdin_grace": "300ms", "term_grace": "1s", **(shutdown or {})}
    lines += ["[shutdown]", *(f"{key} = {json.dumps(value)}" for key, value in graces.items()), "[pool]"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in (pool or {}).items()]
    if tasks:
        lines += ["[tasks]", *(f"{key} = {json.dumps(value)}" for key, value in tasks.items())]
    if sessions:
        lines += ["[sessions]", *(f"{key} = {json.dumps(value)}" for key, value in sessions.items())]
    for name, options in (backends or {"unused": {}}).items():
        settings = dict(options)
        resume = settings.pop("resume", None)
        max_live = settings.pop("max_live", None)
        start_timeout = settings.pop("start_timeout", None)
        cancel_timeout = settings.pop("cancel_timeout", None)
        own = {key: settings.pop(key) for key in BACKEND_KEYS if key in settings}
        lines += [f"[backends.{name}]", f"command = {json.dumps(fake_command(**settings))}"]
        if resume:
            lines.append(f'resume = "{resume}"')
        if max_live:
            lines.append(f"max_live = {max_live}")
        if start_timeout:
            lines.append(f"start_timeout = {json.dumps(start_timeout)}")
        if cancel_timeout is not None:
            lines.append(f"cancel_timeout = {json.dumps(cancel_timeout)}")
        lines += [f"{key} = {json.dumps(value)}" for key, value in own.items()]
    path = tmp_path / f"config-{len(list(tmp_path.glob('config-*')))}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def start(
    env: dict[str, str],
    tmp_path: Path,
    *,
    pool: dict[str, str | int] | None = None,
    forked: bool = True,
    **options: Any,
) -> Any:
    """A proxy serving one fake backend with ``options``, its sessions stored under tmp_path/store."""
    options.setdefault("store", str(tmp_path / "store"))
    config = write_config(tmp_path, pool={"max_live": 1, **(pool or {})})
    return Gateway.start(env, tmp_path, proxy_args=["--config", str(config)], forked=forked, **options)


async def state_of(gw: Gateway, session: str) -> dict[str, Any]:
    """What the adapter serving ``session`` knows about it (the ``state`` prompt command)."""
    response = await gw.prompt(session, "state")
    assert response["result"]["stopReason"] == "end_turn", response
    updates = gw.updates(session)
    gw.clear_stash()
    return dict(json.loads(updates[-1]["params"]["update"]["content"]["text"]))


async def adapter_pid(gw: Gateway, session: str) -> int:
    return int((await state_of(gw, session))["pid"])


def registry(env: dict[str, str]) -> SessionRegistry:
    return SessionRegistry(StateDB(Path(env["ACP_PROXY_STATE_DIR"]), create=False), "reader")


def state_db(env: dict[str, str]) -> StateDB:
    return StateDB(Path(env["ACP_PROXY_STATE_DIR"]), create=False)


def adapter_calls(gw: Gateway, method: str) -> list[dict[str, Any]]:
    """Every ``method`` request the proxy sent to any adapter process."""
    sent = [json.loads(e["in"]) for e in gw.adapter_record() if "in" in e]
    return [m for m in sent if m.get("method") == method]


async def send_prompt(gw: Gateway, session: str, text: str, meta: dict[str, Any] | None = None) -> int:
    """Send a prompt without waiting for its answer; its id."""
    request_id = gw.new_id()
    params = gateway.prompt_params(session, text)
    if meta is not None:
        params["_meta"] = meta
    await gw.send({"jsonrpc": "2.0", "id": request_id, "method": "session/prompt", "params": params})
    return request_id


def run_together(code: str, argvs: list[list[str]], env: dict[str, str], timeout: float = 60) -> list[str]:
    """Run ``python -c CODE ARGV`` once per argv under ``env`` (a test's ``proc_env``: its marker), released
    together, and return what each printed.

    Each child reads one line of stdin before its work, so all of them start it at once, as proxies
    started together would. Each must exit 0. They import this checkout's package, nothing more
    (a ``multiprocessing`` child would import the test module and pytest first, half a second each).
    """
    children = [
        subprocess.Popen(
            [sys.executable, "-c", code, *argv],
            cwd=TESTS.parent,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for argv in argvs
    ]
    for child in children:
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
    printed = []
    for child in children:
        out, _ = child.communicate(timeout=timeout)
        assert child.returncode == 0, f"a child exited {child.returncode}"
        printed.append(out)
    return printed


# --- the operator's CLI ------------------------------------------------------------------------


_CLI_HERE = threading.Lock()
"""One command line at a time runs in this process: it has the process's environment and streams."""


def _cli_here(env: dict[str, str], args: tuple[str, ...]) -> tuple[int, str, str]:
    """``acp-proxy ARGS`` run by its own ``main`` in this process, under ``env``, its streams captured.

    What the program does besides ``main`` (the interpreter's start, ``__main__``'s garbage
    collector held off) is the same for every command; the tests that hold the program itself to
    its exit status and streams run it as a process (``cli(..., process=True)``, ``test_config``,
    ``test_security``, ``test_doctor``).
    """
    from acp_proxy.main import main

    out, err = _captured(), _captured()
    with _CLI_HERE:
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(env)
        try:
            with redirect_stdout(out), redirect_stderr(err), _stdin_closed():
                try:
                    code = main(list(args))
                except SystemExit as exit_:
                    code = exit_status(exit_, err)
                except Exception:  # as the interpreter would: the traceback, status 1
                    traceback.print_exc(file=err)
                    code = 1
        finally:
            os.environ.clear()
            os.environ.update(saved)
    return code, _written(out), _written(err)


def _captured() -> io.TextIOWrapper:
    """A text stream over bytes, as a process's stdout is (``metrics`` writes to its ``buffer``)."""
    return io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True)


def _written(stream: io.TextIOWrapper) -> str:
    stream.flush()
    return stream.buffer.getvalue().decode()  # type: ignore[attr-defined]


@contextmanager
def _stdin_closed() -> Iterator[None]:
    saved = sys.stdin
    sys.stdin = io.StringIO("")
    try:
        yield
    finally:
        sys.stdin = saved


async def cli(env: dict[str, str], *args: str, process: bool = False) -> tuple[int, str, str]:
    """Run ``acp-proxy ARGS`` as an operator would; exit status, stdout, stderr.

    It runs in a worker thread of this process (the CLI's start is most of its cost, and the
    tests run hundreds), or with ``process=True`` as a process of its own (``run_program``).
    """
    if not process:
        return await anyio.to_thread.run_sync(_cli_here, env, args)
    result = await anyio.to_thread.run_sync(lambda: run_program(env, *args))
    return result.returncode, result.stdout, result.stderr


def run_program(
    env: dict[str, str], *args: str, stdin: str = "", cwd: Path | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``python -m acp_proxy ARGS`` as a process of its own, given ``stdin`` (then EOF): its exit status,
    stdout and stderr, as ``subprocess.run(..., capture_output=True, text=True)`` gives them. Forked
    from the fork server (``tests/kit/forked.py``): a process with its own pid, streams, environment
    and exit status, without an interpreter's start."""
    done = forked.run(args, env=env, stdin=stdin.encode(), cwd=cwd, timeout=timeout)
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(), done.stderr.decode())


async def cli_json(env: dict[str, str], *args: str) -> Any:
    code, out, err = await cli(env, *args, "--json")
    assert code == 0, (args, code, out, err)
    return json.loads(out)


async def wait_for_task(env: dict[str, str], status: str, *, prompt: str, timeout: float = 10) -> dict[str, Any]:
    """The newest task in ``status`` whose prompt holds ``prompt``, once there is one.

    Named by its prompt: a turn whose answer the gateway has read may still be ``running`` on record
    for a moment (its row is written after the answer), and must not be taken for the one asked about.
    """
    with anyio.fail_after(timeout):
        while True:
            listed = await cli_json(env, "tasks", "list", "--status", status)
            for task in listed["tasks"]:
                if prompt in (task["prompt"] or ""):
                    return dict(task)
            await anyio.sleep(0.05)


CGROUPS_HERE = cgroups.detect("auto")
"""Whether the proxies the tests start run their trees in cgroups here, and under which base."""


def install_cgroups(state_dir: Path) -> list[Path]:
    """The cgroups the proxies of this state dir's install made that are still there (cgroup mode)."""
    if not CGROUPS_HERE.base or not (state_dir / DB_NAME).exists():
        return []
    try:
        db = StateDB(state_dir, create=False, read_only=True)
    except (StateError, sqlite3.Error):
        return []
    try:
        install = db.install_id
    finally:
        db.close()
    return sorted(Path(CGROUPS_HERE.base).glob(f"{cgroups.PREFIX}{install}.*")) if install else []
