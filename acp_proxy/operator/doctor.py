"""``acp-proxy doctor``: is this config, and this host, ready for acp-proxy? Each finding with its fix.

The checks are plain functions that return findings, in the order they are shown:

* ``config``: which file was found and where doctor looked (``--config``,
  ``$ACP_PROXY_CONFIG``, the platform file); whether it parses and validates (every problem
  with its key path); whether it is safe to trust (``config.unsafe_ownership``, the rule the
  proxy enforces) and so is its directory.
* ``backends``: each backend's command resolves (on the backend's own ``PATH`` if its ``env``
  sets one, else on ours) to an executable file, and its ``cwd`` is a directory.
* ``variables``: every ``${VAR}`` each backend refers to is set. Names only: no value from the
  environment is ever printed (a backend's command is shown as written in the config).
* ``notify``: only with a ``[tasks] notify_command``: its program resolves as the proxy runs it
  (on our ``PATH``, from the directory the proxy starts in), and every ``${VAR}`` it refers to
  is set, again by name only.
* ``state``: the state dir, its subdirectories, the database and the control sockets belong to
  us and are private (the proxy refuses a dir or database others can write; doctor also warns
  when others can read them: dirs ``0700``, files and sockets ``0600``).
* ``database``: it opens, its schema version, ``PRAGMA quick_check``, that it is writable, and
  the free space on its file system.
* ``leftovers``: what dead proxies left running: the dry run of ``acp-proxy reap``.
* ``ownership``: full or degraded process ownership, and why; ``/proc``, pidfd, subreaper, and
  the wrapper program; whether a proxy started here runs each adapter tree in a cgroup of its
  own (``cgroup`` mode) or relies on markers alone (``markers``), and why.

Each finding is ``ok``, ``info`` (worth knowing, nothing to fix), ``warning`` (works, but
not as well or not safely enough; has a fix) or ``problem`` (acp-proxy will fail or refuse;
has a fix). Exit status: 0 no problem (warnings allowed); 1 a problem with the host, the
environment or the state (a command that does not resolve, an unset variable, unsafe
modes, a damaged or too new database, leftover processes); 2 bad usage, or a config that
is missing (when named) or does not parse or validate.

Decisions where the question is open:

* No config anywhere is ``info``: ``acp-proxy -- CMD`` needs none. The host checks still run,
  on the state dir the proxy would use.
* A config that does not parse or validate: its problems are listed, and only the checks that
  do not depend on it (ownership) run; the others are named as skipped. Exit 2.
* A config file others can write to is a problem (exit 1: the proxy refuses it, and the fix is
  a ``chmod``), but doctor still reads it, so its other problems are found in the same run. A
  config *directory* others can write to is a warning: the proxy does not check it, but whoever
  can write there can replace the file.
* Variables are looked up in doctor's own environment; the gateway that launches acp-proxy may
  have another one, and the fix says so. A variable set to the empty string is a warning.
* A relative command path or ``cwd`` is resolved by the proxy from the directory the gateway
  starts it in, which doctor cannot know: a warning, fixed by an absolute path.
* A missing state dir is ``info`` (the first proxy creates it ``0700``), unless it could not be
  created there (a problem).
* A database with an older schema is ``info``: the next proxy migrates it.
* A dead proxy's lease that is still active with nothing of it running is ``info`` (the next
  proxy, or ``acp-proxy reap``, records it ended); one with processes still running is a
  problem; a process carrying a lease's marker that cannot be proved its own is a warning
  (neither the proxy nor ``reap`` will signal it).
* Degraded ownership is a warning. A kernel that has ``pidfd_open`` in name but refuses it
  (a container's seccomp profile) is a problem: the proxy could signal nothing.
* ``markers`` mode is ``info`` (the guarantees of full ownership hold; the fix says how to get
  cgroups), unless the config says ``cgroups = "required"``: then it is a problem, since the
  proxy refuses to start. Doctor only looks (it creates no cgroup); the proxy's start is the proof.

Doctor never creates the state dir or a database, never migrates or writes one (it is opened
read-only; SQLite may leave an empty ``-wal`` and a ``-shm`` file beside it, which the next
proxy uses as its own), and never signals a process. Like ``reap --dry-run``, it takes a dead
proxy's instance lock for the moment it reads that proxy's leases.
"""

from __future__ import annotations

import enum
import json
import os
import shutil
import sqlite3
import stat
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from acp_proxy import __version__, releases
from acp_proxy import config as configuration
from acp_proxy.config import BackendConfig, CgroupSetting, Config, ConfigError, MissingVariable, TasksConfig
from acp_proxy.operator.reports import EXIT_UNREACHABLE, EXIT_USAGE
from acp_proxy.ownership import cgroups
from acp_proxy.ownership.cgroups import Support
from acp_proxy.ownership.owner import Platform, WrapperMissing, detect_platform, wrapper_path
from acp_proxy.ownership.reaping import ReapAction, reap_dead_instances
from acp_proxy.ownership.verify import process_table
from acp_proxy.state import DB_NAME, StateDB
from acp_proxy.state.connection import StateError
from acp_proxy.state.directory import explain_failure
from acp_proxy.state.migrations import SCHEMA_VERSION, schema_written_by

EXIT_OK: Final = 0
EXIT_PROBLEM: Final = EXIT_UNREACHABLE
"""The operator commands' 1 (there: the proxy needed did not act); here: acp-proxy would fail or refuse."""
LOW_DISK_BYTES: Final = 100 * 1024 * 1024
"""Below this much free space on the state database's file system, a warning."""
CHECKS: Final = ("config", "backends", "variables", "notify", "state", "database", "leftovers", "ownership")
OTHERS: Final = stat.S_IRWXG | stat.S_IRWXO
OTHERS_WRITE: Final = stat.S_IWGRP | stat.S_IWOTH
ELSEWHERE: Final = "or point $ACP_PROXY_STATE_DIR (or state_dir in the config) at a directory of your own"

Which = Callable[[str, int, str], str | None]
"""``shutil.which(program, mode, path)``: the file ``program`` names on ``path`` with ``mode``, if any."""


class Severity(enum.StrEnum):
    OK = "ok"
    INFO = "info"
    WARNING = "warning"
    PROBLEM = "problem"


@dataclass(frozen=True, slots=True)
class Finding:
    check: str
    severity: Severity
    message: str
    fix: str | None = None

    def to_json(self) -> dict[str, str | None]:
        return {"check": self.check, "severity": self.severity.value, "message": self.message, "fix": self.fix}


def ok(check: str, message: str) -> Finding:
    return Finding(check, Severity.OK, message)


def info(check: str, message: str, fix: str | None = None) -> Finding:
    return Finding(check, Severity.INFO, message, fix)


def warning(check: str, message: str, fix: str) -> Finding:
    return Finding(check, Severity.WARNING, message, fix)


def problem(check: str, message: str, fix: str) -> Finding:
    return Finding(check, Severity.PROBLEM, message, fix)


@dataclass(slots=True)
class Report:
    findings: list[Finding] = field(default_factory=list)
    config_path: Path | None = None
    config_unusable: bool = False
    """The config was named but missing, or does not parse or validate: exit 2."""
    state_dir: Path | None = None
    """The state dir checked (``None`` while the config that may name it is unusable)."""

    @property
    def exit_status(self) -> int:
        if self.config_unusable:
            return EXIT_USAGE
        return EXIT_PROBLEM if any(f.severity is Severity.PROBLEM for f in self.findings) else EXIT_OK

    def counts(self) -> dict[str, int]:
        return {s.value: sum(f.severity is s for f in self.findings) for s in Severity}


# --- config ---------------------------------------------------------------------------------


def locate_config(explicit: str | None, environ: Mapping[str, str]) -> tuple[Path | None, str]:
    """The config file ``configuration.find_config_path`` picks, and where it came from (or where it looked)."""
    path = configuration.find_config_path(explicit)
    if explicit:
        return path, "--config"
    if environ.get("ACP_PROXY_CONFIG"):
        return path, "$ACP_PROXY_CONFIG"
    if path is not None:
        return path, "the default location"
    return None, f"looked for --config, $ACP_PROXY_CONFIG and {configuration.default_config_path()}"


@dataclass(slots=True)
class ConfigCheck:
    findings: list[Finding]
    config: Config | None
    unusable: bool


def check_config(path: Path, origin: str, *, uid: int) -> ConfigCheck:
    """Read, trust-check, parse and validate a config file, as ``config.load`` does but reporting
    every step: an unsafe file is reported and still read, so that its other problems show too."""
    import tomllib

    source = os.fspath(path)
    try:
        with open(source, "rb") as fh:
            st = os.fstat(fh.fileno())
            data = fh.read()
    except FileNotFoundError:
        fix = "create it, or name an existing file (acp-proxy -- CMD needs no config)"
        return ConfigCheck([problem("config", f"{source} (from {origin}) does not exist", fix)], None, True)
    except OSError as exc:
        fix = "name the config file, not a directory" if isinstance(exc, IsADirectoryError) else f"chmod 600 {source}"
        return ConfigCheck([problem("config", f"cannot read {source}: {exc.strerror}", fix)], None, True)
    findings = [ok("config", f"{source} (from {origin})")]
    findings += config_file_safety(st, source, uid=uid)
    directory = path.absolute().parent
    findings += config_dir_safety(directory.stat(), str(directory), uid=uid)
    try:
        doc = tomllib.loads(data.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        findings.append(problem("config", f"not valid TOML: {exc}", f"correct {source} at the line and column given"))
        return ConfigCheck(findings, None, True)
    try:
        config = configuration.validate(doc, source)
    except ConfigError as exc:
        findings += [problem("config", text, _validation_fix(text, source)) for text in exc.problems]
        return ConfigCheck(findings, None, True)
    names = ", ".join(sorted(config.backends))
    findings.append(ok("config", f"valid: {len(config.backends)} backend(s): {names}"))
    return ConfigCheck(findings, config, False)


def _validation_fix(text: str, source: str) -> str:
    key, _, what = text.partition(": ")
    if what.startswith("unknown key"):
        return f"remove or rename {key} in {source} (every key: docs/configuration.md#configuration-reference)"
    if what.startswith("required key"):
        return f"add {key} to {source}"
    return f"correct {key} in {source}"


def config_file_safety(st: os.stat_result, source: str, *, uid: int) -> list[Finding]:
    """The proxy's own rule (``config.unsafe_ownership``), with its fix on a line of its own."""
    unsafe = configuration.unsafe_ownership(st, source, uid)
    if unsafe is None:
        return [ok("config", f"owned by {'you' if st.st_uid == uid else 'root'}, writable by no one else")]
    why, _, fix = unsafe.partition("; refusing it: ")
    return [problem("config", f"the config {why}: the proxy refuses it", fix.removeprefix("run: ") or unsafe)]


def config_dir_safety(st: os.stat_result, directory: str, *, uid: int) -> list[Finding]:
    """Whoever can write to the config's directory can replace the config (unless the dir is sticky)."""
    if st.st_uid not in (uid, 0):
        return [
            warning(
                "config",
                f"its directory {directory} belongs to uid {st.st_uid}, who can replace the config",
                "keep the config in a directory of your own",
            )
        ]
    if st.st_mode & OTHERS_WRITE and not st.st_mode & stat.S_ISVTX:
        mode = stat.S_IMODE(st.st_mode)
        return [
            warning(
                "config",
                f"its directory {directory} is writable by others (mode {mode:04o}), who can replace the config",
                f"chmod go-w {directory}",
            )
        ]
    return []


# --- backends, variables, notify ---------------------------------------------------------------


ADAPTER_WILL_NOT_START: Final = "the adapter will not start without it"
NOTIFICATIONS_WILL_FAIL: Final = "notifications will fail without it"


def _which(program: str, mode: int, path: str) -> str | None:
    return shutil.which(program, mode=mode, path=path)


@dataclass(frozen=True, slots=True)
class Command:
    """A program the proxy runs, as the config names it, for ``check_command`` to resolve."""

    check: str
    """The findings' check: ``backends`` or ``notify``."""
    shown: str
    """How findings name it: ``claude: command 'claude-agent-acp'``, the config's text."""
    key: str
    """Where the config sets it, for the fixes: ``backends.claude.command``."""
    template: str
    """The program as the config writes it, ``${VAR}``s and all."""
    path: str | None = None
    """The ``PATH`` the config gives it (a backend's ``env``); without one, the proxy's is searched."""
    searched: str = "PATH"
    """How findings name the ``PATH`` searched."""
    cwd: str | None = None
    """The directory the config starts it in, if it names one."""


def check_backend(backend: BackendConfig, environ: Mapping[str, str], which: Which = _which) -> list[Finding]:
    """The backend's ``cwd`` and command, resolved as its wrapper will (``execvp`` in ``cwd``, on
    the backend's ``PATH``). Nothing expanded from the environment is shown."""
    template = backend.command[0]
    own_path = "PATH" in backend.env
    command = Command(
        "backends",
        f"{backend.name}: command {template!r}",
        f"backends.{backend.name}.command",
        template,
        path=backend.env["PATH"] if own_path else None,
        searched="the backend's PATH (its env)" if own_path else "PATH",
        cwd=backend.cwd,
    )
    return [*_check_cwd(backend), check_command(command, environ, which)]


def check_notify(tasks: TasksConfig, environ: Mapping[str, str], which: Which = _which) -> list[Finding]:
    """``notify_command``, if there is one: its program, resolved as the proxy will run it (on the
    proxy's ``PATH``, in the proxy's directory), and every ``${VAR}`` it refers to, by name."""
    if tasks.notify_command is None:
        return []
    template = tasks.notify_command[0]
    command = Command("notify", f"notify_command {template!r}", "tasks.notify_command", template)
    return [
        check_command(command, environ, which),
        *_check_names("notify", "notify_command", tasks.notify_command, NOTIFICATIONS_WILL_FAIL, environ),
    ]


def check_command(command: Command, environ: Mapping[str, str], which: Which = _which) -> Finding:
    """Where ``command``'s program is found, as ``execvp`` finds it. What comes from expanding
    ``${VAR}``s is never shown: the config's text is, in its place."""
    check, shown, key, template = command.check, command.shown, command.key, command.template
    try:
        program = configuration.expand(template, environ)
        search = (
            configuration.expand(command.path, environ) if command.path is not None else environ.get("PATH", os.defpath)
        )
    except MissingVariable as exc:
        return problem(check, f"{shown} cannot be looked up: ${{{exc.name}}} is not set", f"set {exc.name}")
    where = command.searched
    name = template if "$" in template else program
    hidden = "$" in template or "$" in (command.path or "")
    if "/" not in program:
        found = which(program, os.F_OK | os.X_OK, search)
        if found is not None:
            return ok(check, f"{shown} found on {where}" + ("" if hidden else f" at {found}"))
        present = which(program, os.F_OK, search)
        if present is not None:
            fix = f"chmod +x {name}, found on {where}" if hidden else f"chmod +x {present}"
            return problem(check, f"{shown} is on {where} but not executable", fix)
        return problem(check, f"{shown} is not found on {where}", f"install {name}, or set {key} to its absolute path")
    if not os.path.isabs(program):
        if command.cwd is None or not os.path.isabs(command.cwd):
            return warning(
                check,
                f"{shown} is a relative path: it depends on the directory the gateway starts acp-proxy in",
                f"use an absolute path in {key}",
            )
        program = os.path.join(command.cwd, program)
    return _check_executable(command, program, template if "$" in template else program)


def _check_executable(command: Command, program: str, path: str) -> Finding:
    """``path``: how to name ``program`` in a fix."""
    check, shown, key = command.check, command.shown, command.key
    if not os.path.exists(program):
        return problem(check, f"{shown} does not exist", f"install it, or correct {key}: {path}")
    if os.path.isdir(program):
        return problem(check, f"{shown} is a directory", f"name the program in it: {key}")
    if not os.access(program, os.X_OK):
        return problem(check, f"{shown} is not executable", f"chmod +x {path}")
    return ok(check, f"{shown} is an executable file")


def _check_cwd(backend: BackendConfig) -> list[Finding]:
    cwd = backend.cwd
    if cwd is None:
        return []
    key = f"backends.{backend.name}.cwd"
    if not os.path.isabs(cwd):
        tilde = " (~ is not expanded)" if cwd.startswith("~") else ""
        return [
            warning(
                "backends",
                f"{backend.name}: cwd {cwd!r} is relative{tilde}: it depends on where the gateway starts acp-proxy",
                f"use an absolute path in {key}",
            )
        ]
    if not os.path.isdir(cwd):
        return [problem("backends", f"{backend.name}: cwd {cwd} is not a directory", f"create it, or correct {key}")]
    return [ok("backends", f"{backend.name}: cwd {cwd} is a directory")]


def check_variables(backend: BackendConfig, environ: Mapping[str, str]) -> list[Finding]:
    """Every ``${NAME}`` the backend refers to, by name: unset is a problem, empty a warning."""
    return _check_names("variables", backend.name, _backend_texts(backend), ADAPTER_WILL_NOT_START, environ)


def unset_consequence(name: str, config: Config) -> str:
    """What an unset ``${name}`` that ``config`` refers to stops: a backend's adapter, else its notifications."""
    texts = [text for backend in config.backends.values() for text in _backend_texts(backend)]
    return ADAPTER_WILL_NOT_START if name in configuration.referenced_names(texts) else NOTIFICATIONS_WILL_FAIL


def _backend_texts(backend: BackendConfig) -> tuple[str, ...]:
    return (*backend.command, *backend.env.values())


def _check_names(
    check: str, owner: str, texts: Iterable[str], unset_means: str, environ: Mapping[str, str]
) -> list[Finding]:
    """Every ``${NAME}`` in ``owner``'s ``texts``, by name, never with its value."""
    names = sorted(configuration.referenced_names(texts))
    if not names:
        return [ok(check, f"{owner}: refers to no ${{VAR}}")]
    findings = []
    for name in names:
        if name not in environ:
            findings.append(
                problem(
                    check,
                    f"{owner}: ${{{name}}} is not set; {unset_means}",
                    f"export {name} in the environment the gateway starts acp-proxy from",
                )
            )
        elif not environ[name]:
            findings.append(
                warning(
                    check,
                    f"{owner}: ${{{name}}} is set but empty",
                    f"give {name} its value in the environment the gateway starts acp-proxy from",
                )
            )
    if not findings:
        findings.append(ok(check, f"{owner}: set: " + ", ".join(names)))
    return findings


# --- state dir, database --------------------------------------------------------------------


def check_private(what: str, path: Path, st: os.stat_result, *, uid: int, mode: int) -> Finding:
    """``path`` must be ours and writable by no one else (what the proxy enforces, a problem);
    anything beyond ``mode`` for others is a warning (they can read what it names)."""
    actual = stat.S_IMODE(st.st_mode)
    if st.st_uid != uid:
        return problem(
            "state",
            f"{what} {path} belongs to uid {st.st_uid}, not to you (uid {uid}): the proxy refuses it",
            f"chown {uid} {path}, {ELSEWHERE}",
        )
    if actual & OTHERS_WRITE:
        return problem(
            "state",
            f"{what} {path} is writable by other users (mode {actual:04o}): the proxy refuses it",
            f"chmod {mode:o} {path}",
        )
    if actual & OTHERS & ~mode:
        return warning(
            "state", f"{what} {path} is readable by other users (mode {actual:04o})", f"chmod {mode:o} {path}"
        )
    return ok("state", f"{what} {path} is private (mode {actual:04o})")


def check_state_dir(path: Path, origin: str, *, uid: int) -> list[Finding]:
    """The state dir and what the proxy keeps in it, not descending further than the control sockets."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return [_missing_state_dir(path, origin)]
    except OSError as exc:
        return [problem("state", f"state dir {path}: {exc.strerror}", f"make it readable by you, {ELSEWHERE}")]
    if not stat.S_ISDIR(st.st_mode):
        return [problem("state", f"state dir {path} (from {origin}) is not a directory", f"move it aside, {ELSEWHERE}")]
    kept = [(path, st, "state dir", 0o700)]
    for entry in _entries(path):
        if entry.is_dir(follow_symlinks=False):
            kept += _kept(entry, "directory", 0o700)
        elif entry.name.startswith(DB_NAME):
            kept += _kept(entry, "database file", 0o600)
    for entry in _entries(path / "control"):
        if entry.name.endswith(".sock"):
            kept += _kept(entry, "control socket", 0o600)
    checked = [check_private(what, where, found, uid=uid, mode=mode) for where, found, what, mode in kept]
    unsafe = [finding for finding in checked if finding.severity is not Severity.OK]
    private = ok("state", f"it and what it holds are private (directories 0700, files 0600): {len(kept)} checked")
    return [ok("state", f"state dir {path} (from {origin})"), *(unsafe or [private])]


def _entries(directory: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as it:
            return sorted(it, key=lambda entry: entry.name)
    except OSError:
        return []


def _kept(entry: os.DirEntry[str], what: str, mode: int) -> list[tuple[Path, os.stat_result, str, int]]:
    """``entry`` to check as ``what``; nothing if it is gone since it was listed (a proxy that exits
    removes its control socket, SQLite its ``-wal`` file)."""
    try:
        return [(Path(entry.path), entry.stat(follow_symlinks=False), what, mode)]
    except FileNotFoundError:
        return []


def _missing_state_dir(path: Path, origin: str) -> Finding:
    parent = path.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        return problem(
            "state",
            f"state dir {path} (from {origin}) does not exist, and cannot be created: {parent} is not writable",
            f"mkdir -m 700 -p {path} as a user who may, {ELSEWHERE}",
        )
    return info("state", f"state dir {path} (from {origin}) does not exist yet: the first proxy creates it (mode 0700)")


def disk_space(free_bytes: int, directory: Path, *, minimum: int = LOW_DISK_BYTES) -> Finding:
    mib = free_bytes / (1024 * 1024)
    free = f"{mib / 1024:.1f} GB" if mib >= 1024 else f"{mib:.0f} MB"
    if free_bytes < minimum:
        return warning(
            "database",
            f"only {free} free on the file system of {directory}: the proxy fails when it is full",
            f"free some space there, {ELSEWHERE}",
        )
    return ok("database", f"{free} free on the file system of {directory}")


def schema_finding(version: int, path: Path, written_by: str | None = None) -> Finding:
    """What the database's schema version means for this release; ``written_by``: the release that last migrated it."""
    if version > SCHEMA_VERSION:
        return problem(
            "database",
            releases.newer_schema(path, version, SCHEMA_VERSION, written_by),
            "upgrade acp-proxy (a newer one has used this state dir)",
        )
    if version < SCHEMA_VERSION:
        first = releases.first_writer(version)
        since = f" (written since acp-proxy {first})" if first and version else ""
        upgrade = f"the next proxy brings it up to {SCHEMA_VERSION} (acp-proxy {__version__})"
        return info("database", f"schema version {version}{since}: {upgrade}")
    return ok("database", f"schema version {version}")


def _split_fix(text: str) -> tuple[str, str]:
    """``explain_failure``'s text, ``what; what to do``, as a message and a fix."""
    what, _, fix = text.rpartition("; ")
    return (what, fix.removeprefix("or ").removeprefix("run: ")) if what else (text, "see the message")


@dataclass(slots=True)
class DatabaseCheck:
    findings: list[Finding]
    readable: bool
    """It opened, passed its quick check and has a schema this acp-proxy reads: its leases can be looked at."""


def check_database(state_dir: Path) -> DatabaseCheck:
    """Opens the database read-only (never creating or migrating it) and asks it how it is."""
    path = state_dir / DB_NAME
    if not path.exists():
        missing = info("database", f"no database at {path} yet: the first proxy creates it")
        return DatabaseCheck([missing, *_writable(path)], False)
    findings: list[Finding] = []
    readable = False
    # Not StateDB(read_only=True): it refuses an unsafe state dir and reads the meta table first,
    # and doctor must still report the schema version and damage of such a database.
    try:
        conn = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True, timeout=5)
    except sqlite3.Error as exc:
        message, fix = _split_fix(explain_failure(path, exc))
        return DatabaseCheck([problem("database", message, fix)], False)
    try:
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        findings.append(schema_finding(version, path, schema_written_by(conn)))
        damage = [row[0] for row in conn.execute("PRAGMA quick_check").fetchall()]
        if damage == ["ok"]:
            findings.append(ok("database", f"{path} passes its quick check"))
            readable = 1 <= version <= SCHEMA_VERSION
        else:
            findings.append(
                problem(
                    "database",
                    f"{path} is damaged: {'; '.join(damage[:3])}",
                    f"stop its proxies, then move it aside (mv {path} {path}.broken): the next proxy starts afresh",
                )
            )
    except sqlite3.Error as exc:
        message, fix = _split_fix(explain_failure(path, exc))
        findings.append(problem("database", message, fix))
    finally:
        conn.close()
    findings += _writable(path)
    return DatabaseCheck(findings, readable)


def _writable(path: Path) -> list[Finding]:
    directory = path.parent
    try:
        fs = os.statvfs(directory)
    except OSError as exc:
        return [info("database", f"cannot tell how much space is free for {directory}: {exc.strerror}")]
    if fs.f_flag & os.ST_RDONLY:
        return [
            problem(
                "database",
                f"{directory} is on a read-only file system: the proxy cannot record anything",
                f"mount it read-write, {ELSEWHERE.removeprefix('or ')}",
            )
        ]
    findings = []
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        findings.append(problem("database", f"you may not write {path}", f"chmod 600 {path}"))
    if not os.access(directory, os.W_OK | os.X_OK):
        findings.append(
            problem(
                "database", f"{directory} is not writable (SQLite writes beside the database)", f"chmod 700 {directory}"
            )
        )
    findings.append(disk_space(fs.f_bavail * fs.f_frsize, directory))
    return findings


# --- leftovers ------------------------------------------------------------------------------


def leftover_findings(actions: Iterable[ReapAction]) -> list[Finding]:
    """What ``acp-proxy reap --dry-run`` would do, as findings."""
    findings = []
    for action in actions:
        lease = f"lease {action.lease_id} ({action.backend}) of dead proxy {action.instance_id}"
        if action.signalled:
            pids = ", ".join(map(str, action.signalled))
            findings.append(
                problem(
                    "leftovers", f"{lease}: still running: pid {pids}", "acp-proxy reap (it kills only what it owns)"
                )
            )
        if action.refused:
            findings.append(
                warning(
                    "leftovers",
                    f"{lease}: processes carry its marker but cannot be proved its own: " + "; ".join(action.refused),
                    "look at them yourself (acp-proxy leases --all); acp-proxy will not signal them",
                )
            )
        if not action.signalled and not action.refused:
            findings.append(
                info(
                    "leftovers",
                    f"{lease} is still on record as {action.before}, with nothing of it running",
                    "nothing to do: the next proxy records it ended (or now: acp-proxy reap)",
                )
            )
    return findings or [ok("leftovers", "no dead proxy left anything behind")]


def check_leftovers(state_dir: Path) -> list[Finding]:
    """The dry run of ``acp-proxy reap`` over the database opened read-only."""
    try:
        db = StateDB(state_dir, create=False, read_only=True)
    except StateError as exc:
        return [warning("leftovers", f"not checked: {exc}", "fix the state dir and database first")]
    try:
        actions = reap_dead_instances(db, None, grace=0.0, dry_run=True)
    except (sqlite3.Error, OSError) as exc:
        return [warning("leftovers", f"not checked: cannot read the leases: {exc}", "acp-proxy reap --dry-run")]
    finally:
        db.close()
    return leftover_findings(actions)


# --- ownership ------------------------------------------------------------------------------


def ownership_findings(platform: Platform, *, pidfd_error: str | None, wrapper_error: str | None) -> list[Finding]:
    """Full or degraded ownership and why; ``pidfd_error``: the kernel refused ``pidfd_open`` though it is there."""
    findings = []
    if platform.degraded:
        findings.append(
            warning(
                "ownership",
                platform.describe(),
                "for full ownership run on Linux 5.3 or later with /proc mounted",
            )
        )
    else:
        findings.append(ok("ownership", platform.describe()))
    if platform.table == "procfs":
        findings.append(ok("ownership", "/proc: available"))
    else:
        findings.append(info("ownership", f"/proc: not available; processes are read through {platform.table}"))
    if pidfd_error is not None:
        findings.append(
            problem(
                "ownership",
                f"pidfd: pidfd_open fails ({pidfd_error}): the proxy could signal none of its processes",
                "allow pidfd_open and pidfd_send_signal (a container's seccomp profile), or use Linux 5.3 or later",
            )
        )
    elif platform.pidfd:
        findings.append(ok("ownership", "pidfd: available"))
    else:
        findings.append(info("ownership", "pidfd: not available; signals are checked, then sent by pid"))
    if platform.subreaper:
        findings.append(ok("ownership", "subreaper: available (the wrapper adopts its adapter's orphans)"))
    else:
        findings.append(info("ownership", "subreaper: not available; orphans are found by their marker"))
    if wrapper_error is not None:
        findings.append(problem("ownership", wrapper_error, "reinstall acp-proxy"))
    return findings


def _pidfd_error(platform: Platform) -> str | None:
    if not platform.pidfd:
        return None
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _wrapper_error() -> str | None:
    try:
        wrapper_path()
    except WrapperMissing as exc:
        return str(exc)
    return None


def cgroup_findings(support: Support, setting: CgroupSetting) -> list[Finding]:
    """Which mode a proxy started here gets (``cgroup`` or ``markers``), and why."""
    if support.mode == "cgroup":
        return [ok("ownership", f"cgroups: each adapter tree in a cgroup of its own ({support.reason})")]
    if setting == "required":
        fix = support.remedy or 'set [ownership] cgroups = "auto" to run without them'
        message = f'cgroups: [ownership] cgroups = "required", but {support.reason}: the proxy refuses to start'
        return [problem("ownership", message, fix)]
    message = f"cgroups: not used, trees are owned by subreaper and marker ({support.reason})"
    remedy = support.remedy and f"for exact ownership by cgroup, {support.remedy}"
    return [info("ownership", message, remedy or None)]


def check_ownership(setting: CgroupSetting = "auto") -> list[Finding]:
    platform = detect_platform(process_table())
    findings = ownership_findings(platform, pidfd_error=_pidfd_error(platform), wrapper_error=_wrapper_error())
    return findings + cgroup_findings(cgroups.detect(setting), setting)


# --- the whole examination --------------------------------------------------------------------


def state_dir_origin(config: Config | None, environ: Mapping[str, str]) -> str:
    if environ.get("ACP_PROXY_STATE_DIR"):
        return "$ACP_PROXY_STATE_DIR"
    if config is not None and config.state_dir:
        return "state_dir in the config"
    return "the default location"


def examine(explicit_config: str | None, environ: Mapping[str, str] = os.environ) -> Report:
    """Every check, in the order shown."""
    report = Report()
    uid = os.getuid()
    path, origin = locate_config(explicit_config, environ)
    report.config_path = path
    config: Config | None = None
    if path is None:
        report.findings.append(
            info(
                "config",
                f"no config file ({origin}): acp-proxy -- CMD needs none",
                f"to use one, create {configuration.default_config_path()} or pass --config PATH",
            )
        )
    else:
        checked = check_config(path, origin, uid=uid)
        report.findings += checked.findings
        config, report.config_unusable = checked.config, checked.unusable
    if report.config_unusable:
        report.findings.append(
            info(
                "config",
                "not checked until the config is valid: backends, variables, notify, state, database, leftovers",
            )
        )
        report.findings += check_ownership()
        return report
    if config is not None:
        for backend in sorted(config.backends.values(), key=lambda b: b.name):
            report.findings += check_backend(backend, environ)
        for backend in sorted(config.backends.values(), key=lambda b: b.name):
            report.findings += check_variables(backend, environ)
        report.findings += check_notify(config.tasks, environ)
    state_dir = report.state_dir = configuration.state_dir(config)
    report.findings += check_state_dir(state_dir, state_dir_origin(config, environ), uid=uid)
    safe = not any(f.check == "state" and f.severity is Severity.PROBLEM for f in report.findings)
    if state_dir.is_dir():
        database = check_database(state_dir)
        report.findings += database.findings
        if database.readable and safe:
            report.findings += check_leftovers(state_dir)
        elif database.readable:
            report.findings.append(info("leftovers", "not checked until the state dir is safe"))
    report.findings += check_ownership(config.ownership.cgroups if config is not None else "auto")
    return report


# --- output ---------------------------------------------------------------------------------


def render_text(report: Report) -> str:
    lines = []
    for check in CHECKS:
        findings = [f for f in report.findings if f.check == check]
        if not findings:
            continue
        lines.append(check)
        for finding in findings:
            lines.append(f"  {finding.severity.value:<8} {finding.message}")
            if finding.fix:
                lines.append(f"  {'':<8} fix: {finding.fix}")
    lines.append(summary_line(report))
    return "\n".join(lines) + "\n"


def summary_line(report: Report) -> str:
    counts = report.counts()
    plural = {Severity.PROBLEM: "problems", Severity.WARNING: "warnings"}
    parts = [
        f"{counts[s.value]} {plural.get(s, s.value) if counts[s.value] != 1 else s.value}" for s in reversed(Severity)
    ]
    verdict = {
        EXIT_OK: "ready",
        EXIT_PROBLEM: "not ready: fix the problems above",
        EXIT_USAGE: "the config cannot be used: fix it first",
    }[report.exit_status]
    return f"summary: {', '.join(parts)}; {verdict} (exit {report.exit_status})"


def render_json(report: Report) -> str:
    document = {
        "config": None if report.config_path is None else str(report.config_path),
        "stateDir": None if report.state_dir is None else str(report.state_dir),
        "exitStatus": report.exit_status,
        "counts": report.counts(),
        "findings": [finding.to_json() for finding in report.findings],
    }
    return json.dumps(document, indent=2)


def doctor_command(explicit_config: str | None, *, as_json: bool) -> int:
    report = examine(explicit_config)
    sys.stdout.write(render_json(report) + "\n" if as_json else render_text(report))
    return report.exit_status
