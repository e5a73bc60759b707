"""Security, checked on real processes: private files, peer uids, no shell, no leaked secret, no trusted marker.

What ``tests/test_control.py``, ``test_config.py``, ``test_state.py`` and
``test_operator.py`` already prove on their own is not repeated here: this file
checks the same rules on a running proxy, and the ones nothing else covers
(configs others could change, state dirs of other users, copied lease markers).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from acp_proxy import config as configuration
from acp_proxy.config import ConfigError
from acp_proxy.operator import control
from acp_proxy.ownership.leases import Lease, LeaseState, all_leases
from acp_proxy.ownership.proctable import ProcFS
from acp_proxy.state import StateDB
from acp_proxy.state.connection import StateError
from tests.support import Gateway, fake_command, pid_alive, run_program

IS_ROOT = os.geteuid() == 0
NOBODY = 65534
NEEDS_ROOT_FOR_OTHER_OWNER = "needs root to create a file or directory owned by another user"


def cli(env: dict[str, str], *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return run_program(env, *args, stdin=stdin)


async def acli(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    result = await anyio.to_thread.run_sync(lambda: run_program(env, *args))
    return result.returncode, result.stdout, result.stderr


def leases_of(env: dict[str, str]) -> list[Lease]:
    db = StateDB(Path(env["ACP_PROXY_STATE_DIR"]), create=False)
    try:
        return all_leases(db)
    finally:
        db.close()


def tree_of(root: Path) -> list[Path]:
    return [root, *root.rglob("*")]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@contextlib.contextmanager
def umask(value: int) -> Iterator[None]:
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


# --- private files on a running proxy ------------------------------------------------------------


@pytest.mark.anyio
async def test_a_running_proxy_keeps_every_state_file_private_even_under_umask_0(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    state = Path(proc_env["ACP_PROXY_STATE_DIR"])
    with umask(0):  # inherited by the proxy: its modes must not depend on the caller's umask
        gateway = Gateway.start(proc_env, tmp_path)
        gw = await gateway.__aenter__()
    try:
        await gw.initialize()
        session = await gw.new_session()
        assert (await gw.prompt(session, "stream 2"))["result"]["stopReason"] == "end_turn"
        expected = {
            state: 0o700,
            state / "state.db": 0o600,
            state / "state.db-wal": 0o600,
            state / "state.db-shm": 0o600,
            state / "control": 0o700,
            state / "instances": 0o700,
            state / "leases": 0o700,
        }
        [sock] = (state / "control").glob("*.sock")
        [lock] = (state / "instances").glob("*.lock")
        expected |= {sock: 0o600, lock: 0o600}
        assert {path: mode(path) for path in expected} == expected
        everything = tree_of(state)
        assert [p for p in everything if mode(p) & 0o077] == [], "nothing is open to group or others"
        assert {p.stat().st_uid for p in everything} == {os.getuid()}
    finally:
        await gateway.__aexit__(None, None, None)


@pytest.mark.anyio
@pytest.mark.skipif(not IS_ROOT, reason="needs root to connect as another uid")
async def test_a_running_proxys_control_socket_refuses_another_uid_even_when_the_files_let_it_in(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    reachable = Path(tempfile.mkdtemp(prefix="acp-proxy-security-"))
    os.chmod(reachable, 0o755)
    try:
        env = {**proc_env, "ACP_PROXY_STATE_DIR": str(reachable / "state")}
        async with Gateway.start(env, tmp_path) as gw:
            await gw.initialize()
            session = await gw.new_session()
            [sock] = (reachable / "state" / "control").glob("*.sock")
            for directory in (sock.parent.parent, sock.parent):
                directory.chmod(0o711)  # only SO_PEERCRED stands in the way now
            sock.chmod(0o666)
            script = textwrap.dedent(
                """
                import json, os, socket, sys
                os.setgroups([]); os.setgid(65534); os.setuid(65534)
                s = socket.socket(socket.AF_UNIX); s.settimeout(5); s.connect(sys.argv[1])
                request = {"id": 1, "command": "close_session", "args": {"sessionId": sys.argv[2]}}
                try:  # a refused peer is told why unasked, and may be disconnected before this is sent
                    s.sendall(json.dumps(request).encode() + b"\\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass
                print(s.makefile().readline())
                """
            )
            result = await anyio.run_process([sys.executable, "-c", script, str(sock), session], check=False)
            assert result.returncode == 0, result.stderr
            answer = json.loads(result.stdout)
            assert (answer["ok"], answer["error"]["code"]) == (False, "forbidden")
            assert f"peer uid {NOBODY}" in answer["error"]["message"]
            assert (await gw.prompt(session, "stream 1"))["result"]["stopReason"] == "end_turn", "nothing was closed"
            code, out, err = await acli(env, "status", "--json")
            assert code == 0, err
            assert json.loads(out)["instances"][0]["proxy"]["pool"]["live"] == 1, "its own user still gets in"
        assert b"refused a connection" in gw.stderr
    finally:
        shutil.rmtree(reachable, ignore_errors=True)


# --- no shell, anywhere ------------------------------------------------------------------------------


def read_nul_list(path: str) -> list[str]:
    with open(path, "rb") as fh:
        return [item.decode() for item in fh.read().split(b"\0")[:-1]]


@pytest.mark.anyio
async def test_configured_argv_and_expanded_values_reach_the_adapter_literally(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """Shell syntax in argv, and in the values ``${VAR}`` brings in, is passed on as text; nothing runs."""
    canary = tmp_path / "ran"
    payload = f"$(touch {canary}-dollar) `touch {canary}-tick` ; touch {canary}-semi"
    literal_args = [
        f"a; touch {canary}-1",
        f"b | touch {canary}-2",
        f"c && touch {canary}-3",
        f"$(touch {canary}-4)",
        f"`touch {canary}-5`",
        "'single' \"double\" \\back",
        f"{tmp_path}/*",
        "~/x $HOME $${HOME}",
        f"line\ntouch {canary}-6",
        "$$literal",
        "--from-env=${ACP_PROXY_TEST_PAYLOAD}",
    ]
    command = [*fake_command(), *literal_args]
    config = tmp_path / "shell.toml"
    config.write_text(
        f"[backends.fake]\ncommand = {json.dumps(command)}\n"
        'env = { PAYLOAD = "${ACP_PROXY_TEST_PAYLOAD}", RAW = "$(id) `id` ${HOME}x $$" }\n'
    )
    env = {**proc_env, "ACP_PROXY_TEST_PAYLOAD": payload}
    async with Gateway.start(env, tmp_path, [], proxy_args=["--config", str(config)]) as gw:
        await gw.initialize()
        await gw.new_session()
        adapter = (await gw.request("_fake/pids"))["result"]["adapter"]
        argv = read_nul_list(f"/proc/{adapter}/cmdline")
        environ = dict(item.split("=", 1) for item in read_nul_list(f"/proc/{adapter}/environ"))
    expected = [a.replace("$$", "$") for a in literal_args[:-1]] + [f"--from-env={payload}"]
    assert expected[6].endswith("/*"), "the glob was not expanded"
    assert argv == [*fake_command(), *expected]
    assert environ["PAYLOAD"] == payload
    assert environ["RAW"] == f"$(id) `id` {os.environ['HOME']}x $"
    assert [p.name for p in tree_of(tmp_path) if p.name.startswith("ran")] == [], "a shell ran something"


# --- secrets ------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_secret_from_the_environment_is_in_no_file_log_answer_or_report_while_the_proxy_runs(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """Mid-turn (the WAL holds the newest rows), with text logs at debug: every place an operator looks."""
    canary = "canary-93e1b7f04c"
    env = {**proc_env, "ACP_PROXY_TEST_TOKEN": canary, "ACP_PROXY_LOG_LEVEL": "debug"}
    command = [*fake_command(), "--token=${ACP_PROXY_TEST_TOKEN}"]
    config = tmp_path / "secret.toml"
    config.write_text(
        f"[backends.fake]\ncommand = {json.dumps(command)}\n"
        'env = { FAKE_TOKEN = "${ACP_PROXY_TEST_TOKEN}", OTHER = "x-${ACP_PROXY_TEST_TOKEN}-y" }\n'
    )
    state = Path(env["ACP_PROXY_STATE_DIR"])
    outputs: dict[str, str] = {}
    async with Gateway.start(env, tmp_path, [], proxy_args=["--config", str(config)]) as gw:
        await gw.initialize()
        session = await gw.new_session()
        adapter = (await gw.request("_fake/pids"))["result"]["adapter"]
        assert f"FAKE_TOKEN={canary}" in read_nul_list(f"/proc/{adapter}/environ"), "the secret did reach the adapter"
        assert (await gw.prompt(session, "stream 2"))["result"]["stopReason"] == "end_turn"
        request_id = gw.new_id()
        prompt = {"sessionId": session, "prompt": [{"type": "text", "text": "wait_cancel"}]}
        await gw.send({"jsonrpc": "2.0", "id": request_id, "method": "session/prompt", "params": prompt})
        await gw.expect(lambda m: m.get("method") == "session/update")
        assert (state / "state.db-wal").exists()
        files = {str(p): p.read_bytes() for p in tree_of(state) if p.is_file()}
        [sock] = (state / "control").glob("*.sock")
        outputs["control status"] = json.dumps(await anyio.to_thread.run_sync(control.request, sock, "status", None))

        async def collect(*args: str) -> None:
            code, out, err = await acli(env, *args)
            assert code == 0, (args, err)
            outputs[" ".join(args)] = out + err

        async with anyio.create_task_group() as tasks:
            for args in [
                ("status", "--json"),
                ("status",),
                ("leases", "--json"),
                ("sessions", "show", session, "--json"),
            ]:
                tasks.start_soon(collect, *args)
        await gw.notify("session/cancel", {"sessionId": session})
        await gw.response_to(request_id)
    outputs["proxy log"] = gw.stderr.decode()
    outputs["to the gateway"] = json.dumps(gw.received)
    assert [where for where, text in outputs.items() if canary in text] == []
    assert [path for path, data in files.items() if canary.encode() in data] == []
    assert "--token=${ACP_PROXY_TEST_TOKEN}" in outputs["leases --json"], "the template is shown, not its value"


# --- configs others could change ---------------------------------------------------------------------


def fake_stat(uid: int, file_mode: int) -> os.stat_result:
    return os.stat_result((stat.S_IFREG | file_mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))


ME = 1000
OWNERSHIP = [
    # (owner, mode, refused because)
    (ME, 0o600, None),
    (ME, 0o644, None),
    (ME, 0o640, None),
    (ME, 0o444, None),
    (0, 0o644, None),  # a config root installed for everyone
    (ME, 0o620, "chmod go-w"),
    (ME, 0o602, "chmod go-w"),
    (ME, 0o666, "writable by anyone"),
    (0, 0o666, "writable by anyone"),
    (ME, 0o664, "writable by its group"),
    (1001, 0o600, "belongs to uid 1001"),
    (1001, 0o644, "chown 1000"),
]


@pytest.mark.parametrize(("owner", "file_mode", "refused"), OWNERSHIP)
def test_who_may_own_and_write_a_config(owner: int, file_mode: int, refused: str | None) -> None:
    problem = configuration.unsafe_ownership(fake_stat(owner, file_mode), "/etc/x.toml", uid=ME)
    if refused is None:
        assert problem is None
    else:
        assert problem is not None
        assert refused in problem


@pytest.mark.parametrize("file_mode", [0o664, 0o646, 0o666])
def test_a_config_others_can_write_is_refused(tmp_path: Path, file_mode: int) -> None:
    config = tmp_path / "loose.toml"
    config.write_text('[backends.a]\ncommand = ["a"]\n')
    config.chmod(file_mode)
    with pytest.raises(ConfigError, match=f"chmod go-w {config}"):
        configuration.load(config)
    config.chmod(file_mode & ~0o022)
    assert configuration.load(config).backend().command == ("a",)


def test_every_command_refuses_a_config_others_can_write_with_exit_2(proc_env: dict[str, str], tmp_path: Path) -> None:
    config = tmp_path / "loose.toml"
    config.write_text(f"[backends.fake]\ncommand = {json.dumps(fake_command())}\n")
    config.chmod(0o664)
    for args in (["config", "check"], [], ["status"], ["reap"]):
        result = cli(proc_env, *args, "--config", str(config))
        assert result.returncode == 2, (args, result.stderr)
        assert f"chmod go-w {config}" in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr
        assert result.stdout == ""
    assert not Path(proc_env["ACP_PROXY_STATE_DIR"]).exists(), "no proxy started with the refused config"


def test_a_config_symlink_is_judged_by_the_file_it_names(tmp_path: Path) -> None:
    target = tmp_path / "real.toml"
    target.write_text('[backends.a]\ncommand = ["a"]\n')
    target.chmod(0o666)
    link = tmp_path / "link.toml"
    link.symlink_to(target)
    with pytest.raises(ConfigError, match="writable by anyone"):
        configuration.load(link)


@pytest.mark.skipif(not IS_ROOT, reason=NEEDS_ROOT_FOR_OTHER_OWNER)
def test_a_config_of_another_user_is_refused(proc_env: dict[str, str], tmp_path: Path) -> None:
    config = tmp_path / "theirs.toml"
    config.write_text(f"[backends.fake]\ncommand = {json.dumps(fake_command())}\n")
    config.chmod(0o644)
    os.chown(config, NOBODY, NOBODY)
    for args in (["config", "check"], []):
        result = cli(proc_env, *args, "--config", str(config))
        assert result.returncode == 2, result.stderr
        assert f"belongs to uid {NOBODY}" in result.stderr
        assert f"chown {os.getuid()} {config}" in result.stderr
    os.chown(config, 0, 0)
    assert cli(proc_env, "config", "check", "--config", str(config)).returncode == 0


# --- state dirs of other users -------------------------------------------------------------------------


@pytest.mark.skipif(not IS_ROOT, reason="needs root to create a directory owned by another user")
def test_a_state_dir_of_another_user_is_refused_by_the_proxy_and_the_cli(proc_env: dict[str, str]) -> None:
    state = Path(proc_env["ACP_PROXY_STATE_DIR"])
    StateDB(state).close()
    before = (state / "state.db").read_bytes()
    os.chown(state, NOBODY, NOBODY)
    with pytest.raises(StateError, match=f"belongs to uid {NOBODY}"):
        StateDB(state, create=False)
    request = '{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":1}}\n'
    for args in (["--", *fake_command()], ["status"], ["reap"], ["leases"]):
        result = cli(proc_env, *args, stdin=request)
        assert result.returncode == 2, (args, result.stderr)
        assert result.stderr.startswith(f"acp-proxy: state: {state} belongs to uid {NOBODY}"), result.stderr
        assert "ACP_PROXY_STATE_DIR" in result.stderr
        assert result.stdout == ""
    assert (state / "state.db").read_bytes() == before


# --- a copied lease marker proves nothing ---------------------------------------------------------------

SLOT = "ACP_PROXY_TEST_SLOT"
IMPOSTOR = textwrap.dedent(
    """
    # Started before the lease existed; told its marker later, it writes it over its own
    # environment (what /proc/PID/environ shows), then waits to be signalled, or not.
    import ctypes, os, sys, time
    marker = sys.stdin.readline().strip().encode() + b"\\0"
    with open("/proc/self/stat", "rb") as fh:
        env_start = int(fh.read().rsplit(b")", 1)[1].split()[50 - 3])
    with open("/proc/self/environ", "rb") as fh:
        offset = fh.read().index(b"SLOT=")
    assert len(marker) <= len("SLOT=") + len(os.environ["SLOT"]) + 1
    ctypes.memmove(env_start + offset, marker, len(marker))
    print("carrying it", flush=True)
    time.sleep(600)
    """
).replace("SLOT", SLOT)


def start_impostor(env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", IMPOSTOR],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**env, SLOT: "x" * 120},
    )


def give_marker(impostor: subprocess.Popen[str], lease: Lease) -> None:
    assert impostor.stdin is not None
    assert impostor.stdout is not None
    impostor.stdin.write(lease.marker + "\n")
    impostor.stdin.flush()
    assert impostor.stdout.readline().strip() == "carrying it"
    assert lease.marker in read_nul_list(f"/proc/{impostor.pid}/environ")


def start_ticks(pid: int) -> int:
    info = ProcFS().info(pid)
    assert info is not None
    return info.start_ticks


def start_as_nobody(env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "600"], env=env, user=NOBODY, group=NOBODY, extra_groups=[])


FAST = '[shutdown]\nstdin_grace = "300ms"\nterm_grace = "1s"\n[backends.fake]\ncommand = ["unused"]\n'


@pytest.mark.anyio
@pytest.mark.parametrize("ending", ["close", "reap", "startup"])
async def test_a_process_carrying_a_copied_marker_but_started_before_the_lease_is_never_signalled(
    proc_env: dict[str, str], tmp_path: Path, ending: str
) -> None:
    config = tmp_path / "fast.toml"
    config.write_text(FAST)
    args = ["--config", str(config)]
    impostor = start_impostor(proc_env)
    await anyio.sleep(0.05)  # a clock tick (10 ms) or more: it starts strictly before the lease's wrapper
    try:
        async with Gateway.start(proc_env, tmp_path, proxy_args=args) as gw:
            await gw.initialize()
            session = await gw.new_session()
            await gw.prompt(session, "spawn_tree")
            pids = (await gw.request("_fake/pids"))["result"]
            tree = [pids["adapter"], *pids["children"]]
            [lease] = [x for x in leases_of(proc_env) if x.state is LeaseState.OPEN]
            give_marker(impostor, lease)
            assert lease.wrapper_start_ticks is not None
            assert start_ticks(impostor.pid) < lease.wrapper_start_ticks
            if ending == "close":
                assert (await gw.request("session/close", {"sessionId": session}))["result"] == {}
            else:
                gw.signal(9)
                await gw.process.wait()
        if ending == "reap":
            code, out, err = await acli(proc_env, "reap", "--json", *args)
            assert code == 0, err
            [action] = json.loads(out)["actions"]
            assert str(impostor.pid) in " ".join(action["refused"])
        elif ending == "startup":
            async with Gateway.start(proc_env, tmp_path, proxy_args=args) as successor:
                await successor.initialize()
        with anyio.move_on_after(8):
            while any(pid_alive(p) for p in tree):
                await anyio.sleep(0.02)
        assert [p for p in tree if pid_alive(p)] == [], "the lease's own tree is gone"
        assert impostor.poll() is None, "the impostor was signalled"
        ended = {x.lease_id: x for x in leases_of(proc_env)}[lease.lease_id]
        assert ended.state is not LeaseState.OPEN
        assert ended.state is not LeaseState.CLOSED or ending != "close", "a survivor carrying the marker is reported"
    finally:
        impostor.kill()
        impostor.wait()


@pytest.mark.anyio
@pytest.mark.skipif(not IS_ROOT, reason="needs root to start a process as another user")
async def test_a_process_of_another_user_carrying_the_exact_marker_is_never_signalled(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    config = tmp_path / "fast.toml"
    config.write_text(FAST)
    async with Gateway.start(proc_env, tmp_path, proxy_args=["--config", str(config)]) as gw:
        await gw.initialize()
        session = await gw.new_session()
        [lease] = [x for x in leases_of(proc_env) if x.state is LeaseState.OPEN]
        stranger = start_as_nobody({**proc_env, lease.marker_key: lease.marker_value})
        try:
            assert lease.wrapper_start_ticks is not None
            assert start_ticks(stranger.pid) >= lease.wrapper_start_ticks, "only its uid tells it apart"
            assert (await gw.request("session/close", {"sessionId": session}))["result"] == {}
            assert await gw.close() == 0
            assert stranger.poll() is None, "another user's process was signalled"
        finally:
            stranger.kill()
            stranger.wait()
