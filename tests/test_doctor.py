"""``acp-proxy doctor``: each check as a table of sentences, then the real command on real configs and state dirs.

Every run of the command is a process of its own, started with the tests' marker
(``proc_env``), so that the fixture can assert nothing a test started survives it.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from acp_proxy import __version__, releases
from acp_proxy.config import BackendConfig, CgroupSetting, TasksConfig
from acp_proxy.operator import doctor
from acp_proxy.operator.doctor import Finding, Report, Severity
from acp_proxy.ownership.cgroups import DELEGATE_HINT, Support
from acp_proxy.ownership.leases import all_leases
from acp_proxy.ownership.owner import Platform
from acp_proxy.ownership.reaping import ReapAction
from acp_proxy.state import StateDB
from acp_proxy.state.connection import StateError
from acp_proxy.state.directory import check_private_dir
from acp_proxy.state.migrations import SCHEMA_VERSION
from tests.support import FAKE_ADAPTER, Gateway, cli, run_program, survivors

UID = os.getuid()
ECHO_AGENT = [sys.executable, "-m", "acp_proxy.examples.echo_agent"]
SECRET = "s3cret-value-that-must-never-be-printed"


def severities(findings: list[Finding]) -> list[str]:
    return [finding.severity.value for finding in findings]


def stat_result(mode: int, uid: int = UID) -> os.stat_result:
    return os.stat_result((mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))


# --- backends: the command and cwd, as the wrapper resolves them -----------------------------------


@dataclass
class FakeWhich:
    """``shutil.which`` over a made-up PATH: ``executable`` and ``present`` names, and the PATH asked for."""

    executable: set[str] = field(default_factory=set)
    present: set[str] = field(default_factory=set)
    asked: list[str] = field(default_factory=list)

    def __call__(self, program: str, mode: int, path: str) -> str | None:
        self.asked.append(path)
        names = self.executable if mode & os.X_OK else self.executable | self.present
        return f"/somewhere/bin/{program}" if program in names else None


@dataclass(frozen=True)
class CommandRow:
    sentence: str
    command: tuple[str, ...]
    severity: str
    says: str
    fix: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    environ: dict[str, str] = field(default_factory=lambda: {"PATH": "/usr/bin"})
    cwd: str | None = None


COMMANDS = [
    CommandRow("a program found on PATH is fine", ("codex-acp",), "ok", "found on PATH at /somewhere/bin/codex-acp"),
    CommandRow("a program on no PATH entry is to be installed", ("nope",), "problem", "not found", "install nope"),
    CommandRow("a program on PATH without its x bit", ("plain-file",), "problem", "not executable", "chmod +x"),
    CommandRow(
        "an unset ${VAR} in the program: not looked up",
        ("${AGENT_BIN}",),
        "problem",
        "${AGENT_BIN} is not set",
        "set AGENT_BIN",
        environ={},
    ),
    CommandRow(
        "a relative path with no cwd depends on the gateway's directory",
        ("bin/agent",),
        "warning",
        "relative path",
        "use an absolute path",
    ),
    CommandRow("an absolute path that is not there", ("{tmp}/missing",), "problem", "does not exist", "install it"),
    CommandRow("an absolute path without its x bit", ("{tmp}/plain",), "problem", "not executable", "chmod +x {tmp}/"),
    CommandRow("an absolute path to a directory", ("{tmp}",), "problem", "is a directory", "name the program"),
    CommandRow("an absolute path to an executable", ("{tmp}/agent",), "ok", "is an executable file"),
    CommandRow("a relative path is resolved in the backend's cwd", ("./agent",), "ok", "executable file", cwd="{tmp}"),
]


@pytest.fixture
def files(tmp_path: Path) -> Path:
    (tmp_path / "plain").write_text("#!/bin/sh\n")
    (tmp_path / "plain").chmod(0o644)
    (tmp_path / "agent").write_text("#!/bin/sh\n")
    (tmp_path / "agent").chmod(0o755)
    return tmp_path


@pytest.mark.parametrize("row", COMMANDS, ids=[row.sentence for row in COMMANDS])
def test_a_backends_command_resolves_as_its_wrapper_would_exec_it(row: CommandRow, files: Path) -> None:
    def fill(text: str) -> str:
        return text.replace("{tmp}", str(files))

    backend = BackendConfig(
        name="b", command=tuple(map(fill, row.command)), env=row.env, cwd=fill(row.cwd) if row.cwd else None
    )
    which = FakeWhich(executable={"codex-acp"}, present={"plain-file"})
    findings = doctor.check_backend(backend, row.environ, which)
    *_, last = findings
    assert (last.severity.value, last.check) == (row.severity, "backends"), findings
    assert row.says in last.message
    if row.fix is not None:
        assert last.fix is not None
        assert fill(row.fix) in last.fix


def test_the_backends_own_path_is_searched_when_its_env_sets_one() -> None:
    which = FakeWhich(executable={"agent"})
    backend = BackendConfig(name="b", command=("agent",), env={"PATH": "${HOME}/bin:/opt/bin"})
    [found] = doctor.check_backend(backend, {"PATH": "/usr/bin", "HOME": "/home/me"}, which)
    assert which.asked == ["/home/me/bin:/opt/bin"]
    assert found.severity is Severity.OK
    assert "the backend's PATH" in found.message
    assert "/home/me" not in found.message, "nothing expanded from the environment is shown"
    assert doctor.check_backend(backend, {"PATH": "/usr/bin", "HOME": "/home/me"}, FakeWhich())[0].severity is (
        Severity.PROBLEM
    )


@pytest.mark.parametrize(("program", "severity"), [("agent", "ok"), ("plain", "problem"), ("missing", "problem")])
def test_what_a_command_expands_to_is_never_shown(files: Path, program: str, severity: str) -> None:
    backend = BackendConfig(name="b", command=(f"${{AGENT_HOME}}/{program}",))
    [finding] = doctor.check_backend(backend, {"AGENT_HOME": str(files)}, FakeWhich())
    assert finding.severity.value == severity
    assert str(files) not in finding.message + (finding.fix or "")
    assert "${AGENT_HOME}" in finding.message


@pytest.mark.parametrize(
    ("sentence", "cwd", "severity", "says"),
    [
        ("an existing directory", "{tmp}", "ok", "is a directory"),
        ("a missing directory", "{tmp}/nowhere", "problem", "not a directory"),
        ("a file", "{tmp}/plain", "problem", "not a directory"),
        ("a relative path", "work", "warning", "relative"),
        ("a path starting with ~, which nothing expands", "~/work", "warning", "~ is not expanded"),
    ],
)
def test_a_backends_cwd(files: Path, sentence: str, cwd: str, severity: str, says: str) -> None:
    backend = BackendConfig(name="b", command=("agent",), cwd=cwd.replace("{tmp}", str(files)))
    [finding, _] = doctor.check_backend(backend, {}, FakeWhich(executable={"agent"}))
    assert (finding.severity.value, finding.check) == (severity, "backends"), sentence
    assert says in finding.message


# --- variables: names only ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sentence", "environ", "expected"),
    [
        ("all set: one ok naming them", {"TOKEN": SECRET, "HOST": "h"}, ["ok"]),
        ("one unset: a problem for it", {"TOKEN": SECRET}, ["problem"]),
        ("one empty: a warning for it", {"TOKEN": SECRET, "HOST": ""}, ["warning"]),
        ("both unset: a problem each", {}, ["problem", "problem"]),
    ],
)
def test_every_variable_a_backend_refers_to_is_set(sentence: str, environ: dict[str, str], expected: list[str]) -> None:
    backend = BackendConfig(name="b", command=("agent", "--host=${HOST}"), env={"KEY": "${TOKEN}", "FIXED": "x"})
    findings = doctor.check_variables(backend, environ)
    assert severities(findings) == expected, sentence
    assert all(SECRET not in f.message and SECRET not in (f.fix or "") for f in findings)
    assert all("${HOST}" in f.message or "${TOKEN}" in f.message or "HOST" in f.message for f in findings)


def test_a_backend_referring_to_no_variable_is_fine() -> None:
    assert severities(doctor.check_variables(BackendConfig(name="b", command=("agent",)), {})) == ["ok"]


# --- notify: the notify_command, as the proxy runs it ---------------------------------------------------


@dataclass(frozen=True)
class NotifyRow:
    sentence: str
    command: tuple[str, ...]
    expected: list[tuple[str, str]]
    """(severity, what the message says) per finding."""
    fix: str | None = None
    environ: dict[str, str] = field(default_factory=lambda: {"PATH": "/usr/bin", "CHAT_TOKEN": SECRET})


NOTIFY = [
    NotifyRow(
        "a program found on the proxy's PATH, its variables set",
        ("notify-send", "--token=${CHAT_TOKEN}"),
        [("ok", "'notify-send' found on PATH at /somewhere/bin/notify-send"), ("ok", "set: CHAT_TOKEN")],
    ),
    NotifyRow(
        "a program on no PATH entry is to be installed",
        ("nope",),
        [("problem", "'nope' is not found on PATH"), ("ok", "refers to no ${VAR}")],
        "install nope, or set tasks.notify_command to its absolute path",
    ),
    NotifyRow(
        "a program on PATH without its x bit",
        ("plain-file",),
        [("problem", "not executable"), ("ok", "refers to no ${VAR}")],
        "chmod +x /somewhere/bin/plain-file",
    ),
    NotifyRow(
        "an unset variable: notifications will fail",
        ("notify-send", "${CHAT_TOKEN}"),
        [("ok", "found on PATH"), ("problem", "${CHAT_TOKEN} is not set; notifications will fail without it")],
        "export CHAT_TOKEN in the environment the gateway starts acp-proxy from",
        environ={"PATH": "/usr/bin"},
    ),
    NotifyRow(
        "an empty variable: a warning",
        ("notify-send", "${CHAT_TOKEN}"),
        [("ok", "found on PATH"), ("warning", "${CHAT_TOKEN} is set but empty")],
        "give CHAT_TOKEN its value",
        environ={"PATH": "/usr/bin", "CHAT_TOKEN": ""},
    ),
    NotifyRow(
        "an unset variable in the program: it cannot be looked up",
        ("${HOOKS}/notify",),
        [("problem", "cannot be looked up: ${HOOKS} is not set"), ("problem", "${HOOKS} is not set")],
        "set HOOKS",
    ),
    NotifyRow(
        "a relative path depends on the directory the gateway starts the proxy in",
        ("hooks/notify",),
        [("warning", "relative path"), ("ok", "refers to no ${VAR}")],
        "use an absolute path in tasks.notify_command",
    ),
    NotifyRow(
        "an absolute path that is not there",
        ("{tmp}/missing",),
        [("problem", "does not exist"), ("ok", "refers to no ${VAR}")],
        "install it, or correct tasks.notify_command: {tmp}/missing",
    ),
    NotifyRow(
        "an absolute path to an executable, named through a variable that is never shown",
        ("${HOOKS}/agent",),
        [("ok", "'${HOOKS}/agent' is an executable file"), ("ok", "set: HOOKS")],
        environ={"HOOKS": "{tmp}"},
    ),
]


@pytest.mark.parametrize("row", NOTIFY, ids=[row.sentence for row in NOTIFY])
def test_the_notify_command_resolves_as_the_proxy_would_run_it(row: NotifyRow, files: Path) -> None:
    def fill(text: str) -> str:
        return text.replace("{tmp}", str(files))

    tasks = TasksConfig(notify="done_only", notify_command=tuple(map(fill, row.command)))
    environ = {name: fill(value) for name, value in row.environ.items()}
    which = FakeWhich(executable={"notify-send"}, present={"plain-file"})
    findings = doctor.check_notify(tasks, environ, which)
    assert [(f.severity.value, f.check) for f in findings] == [(severity, "notify") for severity, _ in row.expected]
    for finding, (_, says) in zip(findings, row.expected, strict=True):
        assert says in finding.message, findings
        assert finding.message.startswith("notify_command")
    if row.fix is not None:
        assert any(fill(row.fix) in (f.fix or "") for f in findings), findings
    shown = " ".join(f.message + (f.fix or "") for f in findings)
    assert SECRET not in shown
    if "HOOKS" in environ:
        assert str(files) not in shown, "what a variable expands to is never shown"
    assert set(which.asked) <= {environ.get("PATH", os.defpath)}, "a bare name is looked up on the proxy's PATH"


def test_no_notify_command_nothing_to_check() -> None:
    assert doctor.check_notify(TasksConfig(), {}) == []


# --- private files and directories: the proxy's rules --------------------------------------------------


@pytest.mark.parametrize(
    ("sentence", "mode", "uid", "severity"),
    [
        ("0700 and ours", 0o700, UID, "ok"),
        ("readable by others", 0o755, UID, "warning"),
        ("group-writable: refused", 0o770, UID, "problem"),
        ("world-writable: refused", 0o777, UID, "problem"),
        ("another user's: refused", 0o700, UID + 1, "problem"),
    ],
)
def test_a_private_directory(sentence: str, mode: int, uid: int, severity: str) -> None:
    finding = doctor.check_private("state dir", Path("/s"), stat_result(stat.S_IFDIR | mode, uid), uid=UID, mode=0o700)
    assert finding.severity.value == severity, sentence
    if severity != "ok":
        assert finding.fix is not None
        assert ("chmod 700 /s" if uid == UID else "chown") in finding.fix


@pytest.mark.parametrize("mode", [0o700, 0o750, 0o755, 0o705, 0o720, 0o702, 0o770, 0o777])
def test_doctor_refuses_exactly_the_state_dirs_the_proxy_refuses(tmp_path: Path, mode: int) -> None:
    directory = tmp_path / "state"
    directory.mkdir()
    directory.chmod(mode)
    finding = doctor.check_private("state dir", directory, directory.stat(), uid=UID, mode=0o700)
    try:
        check_private_dir(directory)
        refused = False
    except StateError:
        refused = True
    assert (finding.severity is Severity.PROBLEM) == refused


def test_a_socket_or_wal_file_gone_between_listing_and_checking_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    (state / "control").mkdir(mode=0o700, parents=True)
    state.chmod(0o700)
    for gone in (state / "state.db-wal", state / "control" / "cb668aafef17.sock"):
        write(gone, "")
    listed = doctor._entries

    def listed_then_removed(directory: Path) -> list[os.DirEntry[str]]:
        entries = listed(directory)
        for entry in entries:
            if entry.is_file():
                os.unlink(entry.path)
        return entries

    monkeypatch.setattr(doctor, "_entries", listed_then_removed)
    findings = doctor.check_state_dir(state, "a test", uid=UID)
    assert severities(findings) == ["ok", "ok"], findings
    assert "2 checked" in findings[-1].message, "the state dir and control/; not what went"


@pytest.mark.parametrize(
    ("sentence", "mode", "uid", "severity", "fix"),
    [
        ("ours, 0600", 0o600, UID, "ok", None),
        ("root's, 0644", 0o644, 0, "ok", None),
        ("group-writable", 0o664, UID, "problem", "chmod go-w /c.toml"),
        ("world-writable", 0o646, UID, "problem", "chmod go-w /c.toml"),
        ("someone else's", 0o600, 4242 if UID != 4242 else 4243, "problem", "chown"),
    ],
)
def test_a_config_file_is_trusted_as_the_proxy_trusts_it(
    sentence: str, mode: int, uid: int, severity: str, fix: str | None
) -> None:
    [finding] = doctor.config_file_safety(stat_result(stat.S_IFREG | mode, uid), "/c.toml", uid=UID)
    assert finding.severity.value == severity, sentence
    if fix is not None:
        assert finding.fix is not None
        assert fix in finding.fix


@pytest.mark.parametrize(
    ("sentence", "mode", "uid", "expected"),
    [
        ("ours, 0755", 0o755, UID, []),
        ("writable by others but sticky, as /tmp", 0o1777, 0, []),
        ("writable by its group", 0o775, UID, ["warning"]),
        ("another user's", 0o755, 4242 if UID != 4242 else 4243, ["warning"]),
    ],
)
def test_a_config_directory_others_can_write_is_a_warning(
    sentence: str, mode: int, uid: int, expected: list[str]
) -> None:
    findings = doctor.config_dir_safety(stat_result(stat.S_IFDIR | mode, uid), "/etc/x", uid=UID)
    assert severities(findings) == expected, sentence


# --- database, disk, ownership, leftovers: pure verdicts ------------------------------------------------


def test_a_newer_schema_names_the_release_that_wrote_it_and_this_one() -> None:
    finding = doctor.schema_finding(SCHEMA_VERSION + 1, Path("/s/state.db"), "0.8.0")
    assert finding.message == (
        f"/s/state.db has schema version {SCHEMA_VERSION + 1}, written by acp-proxy 0.8.0; this is "
        f"acp-proxy {__version__}, which understands schema {SCHEMA_VERSION} at most"
    )
    older = doctor.schema_finding(SCHEMA_VERSION - 1, Path("/s/state.db"))
    first = releases.FIRST_WRITERS[SCHEMA_VERSION - 1]
    assert f"(written since acp-proxy {first})" in older.message


@pytest.mark.parametrize(
    ("version", "severity", "says"),
    [
        (SCHEMA_VERSION, "ok", "schema version"),
        (SCHEMA_VERSION - 1, "info", "brings it up"),
        (SCHEMA_VERSION + 1, "problem", f"which understands schema {SCHEMA_VERSION} at most"),
    ],
)
def test_the_schema_version(version: int, severity: str, says: str) -> None:
    finding = doctor.schema_finding(version, Path("/s/state.db"))
    assert (finding.severity.value, says in finding.message) == (severity, True)
    if severity == "problem":
        assert finding.fix is not None
        assert "upgrade acp-proxy" in finding.fix


@pytest.mark.parametrize(
    ("free", "severity"), [(10 * 1024**3, "ok"), (100 * 1024**2, "ok"), (100 * 1024**2 - 1, "warning"), (0, "warning")]
)
def test_free_disk_space(free: int, severity: str) -> None:
    assert doctor.disk_space(free, Path("/s")).severity.value == severity


@pytest.mark.parametrize(
    ("sentence", "platform", "pidfd_error", "wrapper_error", "expected"),
    [
        ("Linux with everything", Platform("procfs", True, True), None, None, ["ok", "ok", "ok", "ok"]),
        ("macOS: degraded", Platform("psutil", False, False), None, None, ["warning", "info", "info", "info"]),
        (
            "pidfd_open refused by the kernel: nothing could be signalled",
            Platform("procfs", True, True),
            "Function not implemented",
            None,
            ["ok", "ok", "problem", "ok"],
        ),
        (
            "the wrapper program missing",
            Platform("procfs", True, True),
            None,
            "the adapter wrapper is missing",
            ["ok", "ok", "ok", "ok", "problem"],
        ),
    ],
)
def test_the_ownership_level(
    sentence: str, platform: Platform, pidfd_error: str | None, wrapper_error: str | None, expected: list[str]
) -> None:
    findings = doctor.ownership_findings(platform, pidfd_error=pidfd_error, wrapper_error=wrapper_error)
    assert severities(findings) == expected, sentence
    assert findings[0].message == platform.describe()


CGROUP_MODE = Support("cgroup", "cgroup2 at /sys/fs/cgroup: /sys/fs/cgroup/app.scope is writable", base="/x")
NOT_DELEGATED = Support("markers", "/sys/fs/cgroup/user.slice is not writable by uid 1000", DELEGATE_HINT)
NOT_LINUX = Support("markers", "no /proc/self/mountinfo or /proc/self/cgroup (not Linux, or no /proc)")


@pytest.mark.parametrize(
    ("sentence", "support", "setting", "severity", "fix"),
    [
        ("cgroups available: ok, and why", CGROUP_MODE, "auto", "ok", None),
        ("cgroups asked for and available: ok", CGROUP_MODE, "required", "ok", None),
        ("not delegated: info, and how to delegate", NOT_DELEGATED, "auto", "info", "Delegate=yes"),
        ('"off" by the config: info, nothing to fix', Support("markers", '"off"'), "off", "info", None),
        ("required and not delegated: the proxy refuses, a problem", NOT_DELEGATED, "required", "problem", "Delegate"),
        ("required where there are none at all: a problem", NOT_LINUX, "required", "problem", '"auto"'),
    ],
)
def test_the_cgroup_mode(
    sentence: str, support: Support, setting: CgroupSetting, severity: str, fix: str | None
) -> None:
    (finding,) = doctor.cgroup_findings(support, setting)
    assert finding.severity.value == severity, sentence
    assert support.reason in finding.message
    assert (finding.fix is None) if fix is None else (fix in (finding.fix or "")), finding


def action(**changes: Any) -> ReapAction:
    fields = {"lease_id": "l1", "instance_id": "i1", "backend": "b", "before": "open", "after": "lost"}
    return ReapAction(**fields | changes)


@pytest.mark.parametrize(
    ("sentence", "actions", "expected"),
    [
        ("no dead proxy left anything", [], ["ok"]),
        ("a lease with processes still running", [action(signalled=[12, 13], after="closed")], ["problem"]),
        ("a lease with nothing running: tidied by the next start", [action()], ["info"]),
        ("a process that cannot be proved the lease's", [action(refused=["pid 9: uid differs"])], ["warning"]),
    ],
)
def test_leftovers_of_dead_proxies(sentence: str, actions: list[ReapAction], expected: list[str]) -> None:
    findings = doctor.leftover_findings(actions)
    assert severities(findings) == expected, sentence
    if expected == ["problem"]:
        assert findings[0].fix is not None
        assert "acp-proxy reap" in findings[0].fix
        assert "12, 13" in findings[0].message


@pytest.mark.parametrize(
    ("sentence", "found", "unusable", "status"),
    [
        ("only ok and info", ["ok", "info"], False, 0),
        ("warnings are allowed", ["ok", "warning"], False, 0),
        ("a problem", ["warning", "problem"], False, 1),
        ("a config that cannot be used", ["problem"], True, 2),
    ],
)
def test_exit_status(sentence: str, found: list[str], unusable: bool, status: int) -> None:
    report = Report([Finding("x", Severity(s), "m") for s in found], config_unusable=unusable)
    assert report.exit_status == status, sentence


# --- the real command -------------------------------------------------------------------------------------


def run_doctor(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    result = run_program(env, "doctor", *args)
    return result.returncode, result.stdout, result.stderr


def run_json(env: dict[str, str], *args: str) -> tuple[int, dict[str, Any]]:
    code, out, err = run_doctor(env, *args, "--json")
    assert err == ""
    return code, json.loads(out)


def of(document: dict[str, Any], check: str, severity: str | None = None) -> list[dict[str, Any]]:
    return [f for f in document["findings"] if f["check"] == check and severity in (None, f["severity"])]


@pytest.fixture
def env(proc_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """The tests' environment, with no config found but the one a test names."""
    (tmp_path / "xdg").mkdir()
    return proc_env | {"XDG_CONFIG_HOME": str(tmp_path / "xdg")}


def write(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def toml_list(argv: list[str]) -> str:
    return json.dumps(argv)


def test_a_good_config_on_a_fresh_host_is_ready(env: dict[str, str], tmp_path: Path) -> None:
    config = write(tmp_path / "good.toml", f"[backends.echo]\ncommand = {toml_list(ECHO_AGENT)}\n")
    code, out, err = run_doctor(env, "--config", str(config))
    assert (code, err) == (0, ""), out
    assert "summary: 0 problems" in out
    assert "ready (exit 0)" in out
    assert "does not exist yet: the first proxy creates it" in out
    code, document = run_json(env, "--config", str(config))
    assert code == document["exitStatus"] == 0
    assert document["config"] == str(config)
    assert document["stateDir"] == env["ACP_PROXY_STATE_DIR"]
    assert set(document["findings"][0]) == {"check", "severity", "message", "fix"}
    assert of(document, "backends", "ok")
    assert not of(document, "notify"), "no notify_command, nothing to check"
    assert not Path(env["ACP_PROXY_STATE_DIR"]).exists(), "doctor never creates the state dir"


def test_no_config_at_all_is_fine_for_acp_proxy_dash_dash_cmd(env: dict[str, str]) -> None:
    code, document = run_json(env)
    assert code == 0
    [found] = of(document, "config")
    assert found["severity"] == "info"
    assert "$ACP_PROXY_CONFIG" in found["message"]


def test_a_broken_config_names_each_problem_and_its_fix(env: dict[str, str], tmp_path: Path) -> None:
    plain = write(tmp_path / "plain-agent", "#!/bin/sh\n", 0o644)
    config = write(
        tmp_path / "broken.toml",
        f"""
[backends.missing]
command = ["no-such-agent-acp-7f3a"]

[backends.plain]
command = ["{plain}"]

[backends.secretive]
command = {toml_list(ECHO_AGENT)}
env = {{ API_KEY = "${{DOCTOR_TEST_TOKEN}}", OTHER = "${{DOCTOR_TEST_UNSET}}" }}
""",
        0o664,
    )
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o777)
    run_env = env | {"DOCTOR_TEST_TOKEN": SECRET}
    run_env.pop("DOCTOR_TEST_UNSET", None)
    code, out, err = run_doctor(run_env, "--config", str(config))
    assert code == 1, out
    assert err == ""
    for says, fix in [
        ("is writable by its group (mode 0664)", f"fix: chmod go-w {config}"),
        ("'no-such-agent-acp-7f3a' is not found on PATH", "fix: install no-such-agent-acp-7f3a"),
        (f"'{plain}' is not executable", f"fix: chmod +x {plain}"),
        ("secretive: ${DOCTOR_TEST_UNSET} is not set", "fix: export DOCTOR_TEST_UNSET"),
        (f"state dir {state} is writable by other users (mode 0777)", f"fix: chmod 700 {state}"),
    ]:
        assert says in out
        assert fix in out.split(says, 1)[1].splitlines()[1], (says, out)
    assert "summary: 5 problems" in out
    code, document = run_json(run_env, "--config", str(config))
    assert code == 1
    assert [f["severity"] for f in of(document, "variables") if "secretive" in f["message"]] == ["problem"]
    assert all(f["fix"] for f in document["findings"] if f["severity"] in ("warning", "problem"))
    for output in (out, json.dumps(document)):
        assert SECRET not in output
    assert oct(state.stat().st_mode & 0o777) == "0o777", "doctor changes nothing"


def notifying_config(tmp_path: Path) -> Path:
    return write(
        tmp_path / "notify.toml",
        f"""
[tasks]
notify = "done_only"
notify_command = ["no-such-notifier-7f3a", "--token=${{DOCTOR_TEST_CHAT}}", "--key=${{DOCTOR_TEST_TOKEN}}"]

[backends.echo]
command = {toml_list(ECHO_AGENT)}
env = {{ API_KEY = "${{DOCTOR_TEST_TOKEN}}" }}
""",
    )


def test_the_notify_command_is_checked_when_there_is_one(env: dict[str, str], tmp_path: Path) -> None:
    config = notifying_config(tmp_path)
    run_env = env | {"DOCTOR_TEST_TOKEN": SECRET}
    run_env.pop("DOCTOR_TEST_CHAT", None)
    code, out, err = run_doctor(run_env, "--config", str(config))
    assert (code, err) == (1, ""), out
    section = out.split("\nnotify\n", 1)[1].split("\nstate\n", 1)[0]
    for says, fix in [
        ("notify_command 'no-such-notifier-7f3a' is not found on PATH", "fix: install no-such-notifier-7f3a"),
        ("notify_command: ${DOCTOR_TEST_CHAT} is not set; notifications will fail", "fix: export DOCTOR_TEST_CHAT"),
    ]:
        assert says in section, out
        assert fix in section.split(says, 1)[1].splitlines()[1], (says, out)
    assert "summary: 2 problems" in out
    assert SECRET not in out


def test_config_check_says_what_an_unset_variable_stops(env: dict[str, str], tmp_path: Path) -> None:
    config = notifying_config(tmp_path)
    run_env = {name: value for name, value in env.items() if not name.startswith("DOCTOR_TEST_")}
    result = run_program(run_env, "config", "check", "--config", str(config))
    assert result.returncode == 0, result.stderr
    notes = [line.strip() for line in result.stdout.splitlines() if "note:" in line]
    assert notes == [
        "note: ${DOCTOR_TEST_CHAT} is not set in this environment; notifications will fail without it",
        "note: ${DOCTOR_TEST_TOKEN} is not set in this environment; the adapter will not start without it",
    ]


@pytest.mark.parametrize(
    ("sentence", "text", "says"),
    [
        ("not TOML", "[backends.x\ncommand = 1", "not valid TOML"),
        ("an unknown key", '[backends.x]\ncommand = ["x"]\ncolour = "red"\n', "backends.x.colour: unknown key"),
        ("a missing command", "[backends.x]\ncwd = '/'\n", "backends.x.command: required key is missing"),
    ],
)
def test_a_config_that_does_not_parse_or_validate_exits_2(
    env: dict[str, str], tmp_path: Path, sentence: str, text: str, says: str
) -> None:
    config = write(tmp_path / "bad.toml", text)
    code, out, _ = run_doctor(env, "--config", str(config))
    assert code == 2, sentence
    assert says in out
    assert "not checked until the config is valid" in out
    assert "ownership" in out, "what does not depend on the config is still checked"
    assert "exit 2" in out.splitlines()[-1]
    code, document = run_json(env, "--config", str(config))
    assert (code, document["exitStatus"], document["stateDir"]) == (2, 2, None)


def test_a_named_config_that_does_not_exist_exits_2(env: dict[str, str], tmp_path: Path) -> None:
    code, out, _ = run_doctor(env, "--config", str(tmp_path / "nowhere.toml"))
    assert code == 2
    assert "does not exist" in out


def make_state(tmp_path: Path) -> Path:
    state = tmp_path / "state"
    StateDB(state).close()
    return state


@pytest.mark.parametrize(
    ("sentence", "damage", "status", "says", "fix"),
    [
        (
            "garbage bytes instead of a database",
            "garbage",
            1,
            "is not a usable state database",
            "move it aside",
        ),
        ("a database from a newer acp-proxy", "newer", 1, "which understands schema", "upgrade acp-proxy"),
        ("a database from an older acp-proxy is migrated by the next proxy", "older", 0, "brings it up", None),
    ],
)
def test_a_state_database_is_examined_without_being_changed(
    env: dict[str, str], tmp_path: Path, sentence: str, damage: str, status: int, says: str, fix: str | None
) -> None:
    state = make_state(tmp_path)
    database = state / "state.db"
    if damage == "garbage":
        database.write_bytes(b"this is not a database" * 100)
    else:
        version = SCHEMA_VERSION + 1 if damage == "newer" else SCHEMA_VERSION - 1
        with sqlite3.connect(database) as conn:
            conn.execute(f"PRAGMA user_version = {version}")
        conn.close()
    before = database.read_bytes()
    code, document = run_json(env)
    assert code == status, (sentence, document)
    [finding] = [f for f in of(document, "database") if says in f["message"]]
    if fix is not None:
        assert fix in finding["fix"]
    assert database.read_bytes() == before, "doctor never migrates or writes the database"


@pytest.mark.anyio
async def test_leftovers_of_a_dead_proxy_are_a_problem_until_reaped(env: dict[str, str], tmp_path: Path) -> None:
    config = write(
        tmp_path / "fast.toml",
        '[shutdown]\nstdin_grace = "300ms"\nterm_grace = "1s"\n'
        f"[backends.fake]\ncommand = {toml_list([sys.executable, str(FAKE_ADAPTER)])}\n",
    )
    args = ["doctor", "--config", str(config), "--json"]
    async with Gateway.start(env, tmp_path, proxy_args=["--config", str(config)], ignore_eof=True) as gw:
        await gw.initialize()
        await gw.prompt(await gw.new_session(), "spawn_tree")
        pids = (await gw.request("_fake/pids"))["result"]
        tree = [pids["adapter"], *pids["children"]]
        code, out, _ = await cli(env, *args)
        alive = json.loads(out)
        assert code == 0, alive
        assert not [f for f in alive["findings"] if f["severity"] in ("warning", "problem")], alive
        gw.signal(signal.SIGSTOP)  # so that it cannot see its wrapper die and clean up after it
        db = StateDB(Path(env["ACP_PROXY_STATE_DIR"]), create=False)
        [lease] = all_leases(db)
        db.close()
        assert lease.wrapper_pid is not None
        os.kill(lease.wrapper_pid, signal.SIGKILL)
        gw.signal(signal.SIGKILL)
        await gw.process.wait()
    code, out, _ = await cli(env, *args)
    dead = json.loads(out)
    assert code == 1, dead
    [left] = of(dead, "leftovers", "problem")
    assert lease.lease_id in left["message"]
    assert left["fix"].startswith("acp-proxy reap")
    assert await survivors(tree, timeout=0.1) == tree, "doctor signals nothing"
    code, _, err = await cli(env, "reap")
    assert code == 0, err
    assert await survivors(tree) == []
    code, out, _ = await cli(env, *args)
    assert code == 0, out
    assert of(json.loads(out), "leftovers", "ok")


def test_a_relative_state_dir_is_examined_from_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    StateDB(Path("st")).close()
    monkeypatch.setenv("ACP_PROXY_STATE_DIR", "st")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("ACP_PROXY_CONFIG", raising=False)
    report = doctor.examine(None)
    assert report.state_dir == Path("st")
    assert [(f.check, f.severity) for f in report.findings if f.check in ("database", "leftovers")] == [
        ("database", Severity.OK),
        ("database", Severity.OK),
        ("database", Severity.OK),
        ("leftovers", Severity.OK),
    ], report.findings
