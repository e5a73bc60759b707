"""Configuration: TOML in, frozen msgspec Structs out, every error with its key path.

Each key is declared once, as a field of its table's Struct whose ``Annotated`` type names the
``Check`` that validates it (a ``Literal`` is checked against its choices), and, for a backend's
key, the table key it ``Overrides``; ``validate`` reads the tables from the Structs, and
``Config.resolved`` is the one place an override resolves. Validation collects *all* problems
in one pass, each as ``path: what was expected, what was found`` (``backends.codex.max_live:
expected int >= 1, got "two"``), so a user fixes a config in one edit rather than one error per
run. The checks are plain functions over plain data; nothing here touches a process or a socket.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import stat
import sys
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import msgspec

from acp_proxy.protocol.jsonrpc import DEFAULT_MAX_LINE_BYTES

ResumeStrategy = Literal["auto", "resume", "load", "new", "never"]
RESUME_STRATEGIES: Final = ("auto", "resume", "load", "new", "never")
NotifyPolicy = Literal["done_only", "waiting", "state_changes", "silent"]
NOTIFY_POLICIES: Final = ("done_only", "waiting", "state_changes", "silent")
CgroupSetting = Literal["auto", "off", "required"]
CGROUP_SETTINGS: Final = ("auto", "off", "required")


class ConfigError(Exception):
    """A config that cannot be used; ``problems`` lists every ``path: message``."""

    def __init__(self, problems: list[str], source: str | None = None) -> None:
        self.problems = problems
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(where + "; ".join(problems))


# --- value checks: each returns the converted value or raises _Invalid --------


class _Invalid(Exception):
    pass


def _show(value: object) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def _expect(what: str, value: object) -> _Invalid:
    return _Invalid(f"expected {what}, got {_show(value)}")


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")
_UNIT_SECONDS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: object) -> float:
    """``"150ms"``, ``"3s"``, ``"15m"``, ``"4h"``, ``"7d"`` or a number of seconds, as seconds."""
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < math.inf:
        return float(value)
    if isinstance(value, str) and (m := _DURATION.match(value)):
        return float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
    raise _expect('a duration such as "150ms", "3s", "15m", "4h", "7d" or seconds >= 0', value)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)\s*$", re.IGNORECASE)
_UNIT_BYTES: Final = {"b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def parse_size(value: object) -> int:
    """``"512M"``, ``"6G"``, ``"6GiB"``, ``"1.5G"`` or a number of bytes, as bytes (units are powers of 1024)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str) and (m := _SIZE.match(value)):
        size = int(float(m.group(1)) * _UNIT_BYTES[m.group(2)[:1].lower()])
        if size > 0:
            return size
    raise _expect('a size such as "512M", "6G" or bytes > 0', value)


def _size_or_zero(value: object) -> int:
    return 0 if value == 0 else parse_size(value)


def _positive_duration(value: object) -> float:
    seconds = parse_duration(value)
    if seconds > 0:
        return seconds
    raise _expect('a duration > 0 such as "500ms" or "10s"', value)


def _int_at_least(minimum: int) -> Callable[[object], int]:
    def check(value: object) -> int:
        if isinstance(value, int) and not isinstance(value, bool) and value >= minimum:
            return value
        raise _expect(f"int >= {minimum}", value)

    return check


def _string(value: object) -> str:
    if isinstance(value, str) and value:
        return value
    raise _expect("a non-empty string", value)


def _one_of(choices: tuple[str, ...]) -> Callable[[object], str]:
    def check(value: object) -> str:
        if value in choices:
            return str(value)
        raise _expect("one of " + ", ".join(f'"{c}"' for c in choices), value)

    return check


_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$\{")


def _check_template(text: str) -> None:
    if "\0" in text:
        raise _Invalid(f"contains a NUL character: {_show(text)}")
    for m in _VAR.finditer(text):
        if m.group(0) == "${":
            raise _Invalid(f"unterminated or invalid ${{...}} in {_show(text)}")


def _templated_string(value: object) -> str:
    if not isinstance(value, str):
        raise _expect("a string", value)
    _check_template(value)
    return value


def _command(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        raise _expect('an argv list such as ["codex-acp", "--flag"] (no shell is used)', value)
    if not (isinstance(value, list) and value and all(isinstance(a, str) for a in value)):
        raise _expect("a non-empty list of strings", value)
    if not value[0]:
        raise _expect("a non-empty program name", value[0])
    for arg in value:
        _check_template(arg)
    return tuple(value)


def _names(value: object) -> tuple[str, ...]:
    if not (isinstance(value, list) and all(isinstance(a, str) and a for a in value)):
        raise _expect('a list of names such as ["phone", "local"]', value)
    return tuple(value)


def _identity(value: object) -> object:
    return value


class Check:
    """How a config key's value is checked and converted: its Struct field says so, once.

    ``Annotated[float, DURATION]`` on a field is the whole declaration of a key: ``validate`` reads
    the fields of each table's Struct for its keys, and each field's ``Check`` for its value; a
    ``Literal`` field is checked against its choices, a Struct field is a table of its own.
    """

    def __init__(self, convert: Callable[[object], Any]) -> None:
        self.convert = convert


DURATION: Final = Check(parse_duration)
POSITIVE_DURATION: Final = Check(_positive_duration)
SIZE: Final = Check(parse_size)
SIZE_OR_ZERO: Final = Check(_size_or_zero)
TEXT: Final = Check(_string)
COMMAND: Final = Check(_command)
NAMES: Final = Check(_names)
AT_LEAST_1: Final = Check(_int_at_least(1))
AT_LEAST_1024: Final = Check(_int_at_least(1024))
NOT_A_KEY: Final = Check(_identity)
"""A field that is not a key of its table (set by ``validate`` itself)."""
TEMPLATES: Final = Check(_identity)
"""A table of strings, each with ``${VAR}``s to expand (``[backends.NAME] env``): checked key by key."""


@functools.cache
def _hints(struct: type[msgspec.Struct]) -> dict[str, Any]:
    """``struct``'s field types, ``Annotated`` kept: evaluated once per Struct (a millisecond or so each)."""
    return typing.get_type_hints(struct, include_extras=True)


def _metadata(struct: type[msgspec.Struct], field: str) -> tuple[object, ...]:
    """What ``Annotated`` says of ``struct``'s ``field`` beside its type (``Check``, ``Overrides``)."""
    hint = _hints(struct)[field]
    return tuple(hint.__metadata__) if typing.get_origin(hint) is Annotated else ()


class Overrides:
    """A backend's key that overrides a key of a table for that backend's sessions (``Config.resolved``)."""

    def __init__(self, section: str, key: str) -> None:
        self.section = section
        self.key = key


class PoolConfig(msgspec.Struct, frozen=True, kw_only=True):
    max_live: Annotated[int, AT_LEAST_1] = 4
    idle_ttl: Annotated[float, DURATION] = 15 * 60.0
    acquire_timeout: Annotated[float, DURATION] = 30.0
    resume_timeout: Annotated[float, DURATION] = 120.0
    """Bound on bringing a suspended session back (spawn, initialize, authenticate, restore)."""
    quiet_after: Annotated[float, DURATION] = 3.0
    """A session whose agent sent work updates after its turn ended is busy until this long
    without one (background shells, sub-agents): the pool and ``idle_ttl`` leave it alone."""
    start_timeout: Annotated[float, DURATION] = 60.0
    """A new process must answer ``initialize`` and the request it was started for within this; 0 = no limit."""
    min_idle: Annotated[float, DURATION] = 2.0
    """A session active this recently (a turn just ended) is not taken for another while one idle
    longer exists; a waiter for a slot waits for it at most this long (and no longer than a start
    of its backend takes)."""
    max_memory: Annotated[int | None, SIZE] = None
    """Bytes all live adapter trees of the install may use together (PSS, else RSS); None: no budget."""
    session_max_memory: Annotated[int | None, SIZE] = None
    """Bytes one session's tree may use: an idle one over it is recycled (suspended, restored on its
    next request), a busy one as soon as its turn ends; None: no ceiling."""
    session_kill_memory: Annotated[int | None, SIZE] = None
    """Bytes past which a session's running turn is ended (cancelled, answered, the tree recycled)."""


class ShutdownConfig(msgspec.Struct, frozen=True, kw_only=True):
    close_timeout: Annotated[float, DURATION] = 1.5
    stdin_grace: Annotated[float, DURATION] = 1.0
    term_grace: Annotated[float, DURATION] = 3.0

    @property
    def gone_within(self) -> float:
        """How long a tree asked to stop may take to be gone (its stdin grace, then SIGTERM's, and a margin):
        what waits for one bounds itself by this."""
        return self.stdin_grace + self.term_grace + 2.0


class OwnershipConfig(msgspec.Struct, frozen=True, kw_only=True):
    reap_interval: Annotated[float, DURATION] = 180.0
    """How often a running proxy reaps what the install's dead proxies left (their trees, their
    unfinished tasks), besides at its start; 0: only at its start."""
    cgroups: CgroupSetting = "auto"
    """Each adapter tree in a cgroup v2 of its own where this process may make them (``auto``), never
    (``off``), or refuse to start without (``required``): ``ownership.cgroups``."""


class TraceConfig(msgspec.Struct, frozen=True, kw_only=True):
    file: Annotated[str | None, TEXT] = None
    """Where a proxy appends every wire message (``acp_proxy.trace``); ``--trace`` overrides it."""
    max_size: Annotated[int, SIZE] = 64 * 1024 * 1024


class TasksConfig(msgspec.Struct, frozen=True, kw_only=True):
    turn_timeout: Annotated[float, DURATION] = 0.0
    """A turn running longer is cancelled (``session/cancel``) and recorded ``timed_out``; 0 = no limit."""
    turn_idle_timeout: Annotated[float, DURATION] = 0.0
    """A turn from which nothing is heard this long (no update, no request to the client; a request
    the client has not answered yet stops the clock) is cut like a ``turn_timeout``; 0 = never."""
    cancel_timeout: Annotated[float, DURATION] = 30.0
    """A turn still running this long after ``session/cancel`` is answered ``cancelled`` by the proxy and
    its process stopped (the session suspended); 0 = wait for the adapter however long it takes."""
    retention: Annotated[float, DURATION] = 7 * 86400.0
    """Finished tasks are kept this long, then pruned."""
    operation_window: Annotated[float, DURATION] = 86400.0
    """A prompt whose operation id its session has seen this recently is answered as that one was, not
    run again (a client's retry after a lost answer); 0 = never (within ``retention`` at most)."""
    notify: NotifyPolicy = "silent"
    """Which status changes run ``notify_command`` (a task's own policy overrides it)."""
    notify_command: Annotated[tuple[str, ...] | None, COMMAND] = None
    """The argv run with one JSON object on its stdin per notification; never a shell."""
    notify_timeout: Annotated[float, POSITIVE_DURATION] = 10.0
    """A notification command running longer is killed."""


PromptPolicy = Literal["queue", "refuse"]
PROMPT_POLICIES: Final[tuple[str, ...]] = ("queue", "refuse")
PermissionPolicy = Literal["first", "prompter", "designated"]
PERMISSION_POLICIES: Final[tuple[str, ...]] = ("first", "prompter", "designated")


class AttachConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Shared sessions: clients attached to a live session (``session/attach``), and its transcript."""

    prompts: PromptPolicy = "queue"
    """A prompt that arrives while another controller's turn runs: queued in arrival order, or refused."""
    permissions: PermissionPolicy = "first"
    """Who is asked an agent's permission request (or elicitation) and may answer it: every controller (the
    first answer wins), the principal whose prompt started the turn, or the ``designated`` ones."""
    designated: Annotated[tuple[str, ...], NAMES] = ()
    """Under ``permissions = "designated"``: the principals asked (tokens' names; ``local`` for this host)."""
    max_clients: Annotated[int, AT_LEAST_1] = 16
    """Attached clients per session, beside the gateway that opened it."""
    transcript_max_bytes: Annotated[int, SIZE_OR_ZERO] = 2 * 1024 * 1024
    """The newest part of each session's transcript that is kept (what a ``full`` attach replays); 0: none."""


class SessionsConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Sessions of the install: handing them between its proxies, and retiring those nobody closes."""

    handover_timeout: Annotated[float, DURATION] = 60.0
    """How long a proxy asked for a session another proxy of the install holds waits for that proxy's running
    turn to end before it answers ``session_busy``."""
    keep_suspended: Annotated[float, POSITIVE_DURATION] = 30 * 86400.0
    """A session suspended (no process, not closed) for longer is closed, as ``session/close`` would; it stays
    listed and loadable."""


EofPolicy = Literal["suspend", "close"]
EOF_POLICIES: Final[tuple[str, ...]] = ("suspend", "close")


class BackendConfig(msgspec.Struct, frozen=True, kw_only=True):
    name: Annotated[str, NOT_A_KEY]
    """The ``NAME`` of ``[backends.NAME]``."""
    command: Annotated[tuple[str, ...], COMMAND]
    env: Annotated[Mapping[str, str], TEMPLATES] = msgspec.field(default_factory=dict)
    cwd: Annotated[str | None, TEXT] = None
    resume: ResumeStrategy = "auto"
    max_live: Annotated[int | None, AT_LEAST_1, Overrides("pool", "max_live")] = None
    """A cap of its own within the install's (``[pool] max_live`` where it sets none)."""
    turn_timeout: Annotated[float | None, DURATION, Overrides("tasks", "turn_timeout")] = None
    cancel_timeout: Annotated[float | None, DURATION, Overrides("tasks", "cancel_timeout")] = None
    start_timeout: Annotated[float | None, DURATION, Overrides("pool", "start_timeout")] = None
    max_memory: Annotated[int | None, SIZE] = None
    """Bytes the live trees of this backend may use together, across the install."""
    turn_idle_timeout: Annotated[float | None, DURATION, Overrides("tasks", "turn_idle_timeout")] = None
    session_max_memory: Annotated[int | None, SIZE, Overrides("pool", "session_max_memory")] = None
    session_kill_memory: Annotated[int | None, SIZE, Overrides("pool", "session_kill_memory")] = None
    on_eof: EofPolicy = "suspend"
    """What the gateway's EOF does to its live sessions: suspended (resumable by the next gateway), or closed."""


class Config(msgspec.Struct, frozen=True, kw_only=True):
    backends: Annotated[Mapping[str, BackendConfig], NOT_A_KEY]
    """``[backends.NAME]``: a table of tables, checked on its own (``validate``)."""
    default_backend: Annotated[str | None, TEXT] = None
    state_dir: Annotated[str | None, TEXT] = None
    max_line_bytes: Annotated[int, AT_LEAST_1024] = DEFAULT_MAX_LINE_BYTES
    pool: PoolConfig = PoolConfig()
    shutdown: ShutdownConfig = ShutdownConfig()
    tasks: TasksConfig = TasksConfig()
    ownership: OwnershipConfig = OwnershipConfig()
    trace: TraceConfig = TraceConfig()
    attach: AttachConfig = AttachConfig()
    sessions: SessionsConfig = SessionsConfig()
    source: Annotated[str | None, NOT_A_KEY] = None

    def backend(self, name: str | None = None) -> BackendConfig:
        """The named backend, else the default one. Raises ``KeyError`` naming the choices."""
        chosen = name or self.default_backend
        if chosen is None and len(self.backends) == 1:
            chosen = next(iter(self.backends))
        if chosen is None or chosen not in self.backends:
            configured = ", ".join(sorted(self.backends)) or "none"
            what = f"unknown backend {chosen!r}" if chosen else "no default_backend set"
            raise KeyError(f"{what} (configured: {configured})")
        return self.backends[chosen]

    def resolved(self, backend: str | BackendConfig | None, key: str) -> Any:
        """A setting for a backend's sessions: the backend's own value of ``key`` where it sets one, else
        the key of ``[pool]`` or ``[tasks]`` it overrides (``Overrides``). The one place overrides resolve."""
        own = self.backends.get(backend) if isinstance(backend, str) else backend
        return resolve(self, own, key)

    def turn_idle_timeout(self, backend: str) -> float:
        """``turn_idle_timeout`` for the named backend (``resolved``); 0 means none."""
        return float(self.resolved(backend, "turn_idle_timeout"))

    def session_memory(self, backend: str) -> tuple[int | None, int | None]:
        """``(session_max_memory, session_kill_memory)`` for the named backend's sessions (``resolved``)."""
        return self.resolved(backend, "session_max_memory"), self.resolved(backend, "session_kill_memory")

    def has_session_ceilings(self) -> bool:
        """Whether any backend's sessions have a memory ceiling (``session_max_memory``, ``session_kill_memory``)."""
        return any(limit is not None for name in self.backends for limit in self.session_memory(name))

    def cancel_timeout(self, backend: str) -> float:
        """``cancel_timeout`` for the named backend (``resolved``); 0 means none."""
        return float(self.resolved(backend, "cancel_timeout"))


@functools.cache
def _overrides() -> dict[str, Overrides]:
    """The keys of a backend that override a table's, read from ``BackendConfig`` once: ``resolve`` runs
    for every turn and every start, and reading a Struct's annotations costs about a millisecond."""
    found = {}
    for key in BackendConfig.__struct_fields__:
        marker = next((m for m in _metadata(BackendConfig, key) if isinstance(m, Overrides)), None)
        if marker is not None:
            found[key] = marker
    return found


def _overridden(key: str) -> Overrides:
    marker = _overrides().get(key)
    if marker is None:
        raise KeyError(f"[backends.NAME] {key} overrides nothing")
    return marker


def resolve(tables: Config | PoolConfig | TasksConfig, own: BackendConfig | None, key: str) -> Any:
    """``own``'s value of ``key`` if set, else the overridden key's value in ``tables`` (a ``Config``, or
    the one table it names itself: a ``PoolConfig`` for ``pool`` keys, a ``TasksConfig`` for ``tasks``'s)."""
    marker = _overridden(key)
    value = getattr(own, key) if own is not None else None
    if value is not None:
        return value
    table = getattr(tables, marker.section) if isinstance(tables, Config) else tables
    return getattr(table, marker.key)


class _Checker:
    """Walks a TOML document, converting known keys and recording every problem."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def fail(self, path: str, message: str) -> None:
        self.problems.append(f"{path}: {message}")

    def table(self, doc: object, path: str, fields: Mapping[str, Callable[[object], Any]]) -> dict[str, Any]:
        if not isinstance(doc, dict):
            self.fail(path, str(_expect("a table", doc)))
            return {}
        out: dict[str, Any] = {}
        for key, value in doc.items():
            key_path = f"{path}.{key}" if path else key
            check = fields.get(key)
            if check is None:
                self.fail(key_path, "unknown key (expected one of: " + ", ".join(sorted(fields)) + ")")
                continue
            try:
                out[key] = check(value)
            except _Invalid as exc:
                self.fail(key_path, str(exc))
        return out


def _key_checks(struct: type[msgspec.Struct]) -> dict[str, Callable[[object], Any]]:
    """The keys of the table ``struct`` is, each with the check its field declares."""
    checks: dict[str, Callable[[object], Any]] = {}
    for name, hint in _hints(struct).items():
        declared = next((m for m in _metadata(struct, name) if isinstance(m, Check)), None)
        if declared is NOT_A_KEY:
            continue
        if declared is not None:
            checks[name] = declared.convert
        elif typing.get_origin(hint) is Literal:
            checks[name] = _one_of(tuple(typing.get_args(hint)))
        elif isinstance(hint, type) and issubclass(hint, msgspec.Struct):
            checks[name] = _identity  # a table of its own, checked by ``_table``
        else:
            raise TypeError(f"{struct.__name__}.{name} declares no Check")
    return checks


def _table(
    checker: _Checker, struct: type[msgspec.Struct], doc: object, path: str, *, apart: tuple[str, ...] = ()
) -> dict[str, Any]:
    """A table's keys, checked as ``struct``'s fields declare, its sub-tables made into their Structs;
    the keys ``apart`` are known but checked by the caller (left out of what is returned)."""
    checks = {**_key_checks(struct), **dict.fromkeys(apart, _identity)}
    fields = checker.table(doc, path, checks)
    for name in apart:
        fields.pop(name, None)
    hints = _hints(struct)
    for name in list(fields):
        kind = hints[name]
        if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
            fields[name] = kind(**_table(checker, kind, fields[name], f"{path}.{name}" if path else name))
    return fields


def _backend(checker: _Checker, name: str, raw: object) -> BackendConfig | None:
    path = f"backends.{name}"
    fields = checker.table(raw, path, _key_checks(BackendConfig))
    if isinstance(raw, dict) and "command" not in raw:
        checker.fail(f"{path}.command", "required key is missing")
    env = fields.pop("env", {})
    if not isinstance(env, dict):
        checker.fail(f"{path}.env", str(_expect("a table of strings", env)))
        env = {}
    checked_env = checker.table(env, f"{path}.env", dict.fromkeys(env, _templated_string))
    return BackendConfig(name=name, env=checked_env, **fields) if "command" in fields else None


def validate(doc: Mapping[str, Any], source: str | None = None) -> Config:
    """Turn a parsed TOML document into a ``Config`` or raise ``ConfigError`` with all problems.

    Each table's keys and their checks are its Struct's fields (``Check``); what remains here
    are the rules that span keys.
    """
    checker = _Checker()
    top = _table(checker, Config, dict(doc), "", apart=("backends",))
    tasks: TasksConfig = top.get("tasks", TasksConfig())
    pool: PoolConfig = top.get("pool", PoolConfig())
    if tasks.notify != "silent" and tasks.notify_command is None:
        checker.fail(
            "tasks.notify_command",
            f'required when tasks.notify is "{tasks.notify}": set notify_command = ["program", "arg", ...] '
            'or notify = "silent"',
        )
    backends: dict[str, BackendConfig] = {}
    raw_backends = doc.get("backends", {})
    if not isinstance(raw_backends, dict):
        checker.fail("backends", str(_expect("a table of backends", raw_backends)))
        raw_backends = {}
    for name, raw in raw_backends.items():
        backend = _backend(checker, name, raw)
        if backend is not None:
            backends[name] = backend
    if not raw_backends and not checker.problems:
        checker.fail("backends", "at least one backend is required, e.g. [backends.codex]")
    for path, own in [("pool", None), *((f"backends.{b.name}", b) for b in backends.values())]:
        soft, hard = resolve(pool, own, "session_max_memory"), resolve(pool, own, "session_kill_memory")
        if soft is not None and hard is not None and hard <= soft:
            checker.fail(
                f"{path}.session_kill_memory",
                f"{hard} bytes must be larger than session_max_memory, {soft} bytes (the hard limit past which "
                "a turn is ended; a backend's limits fall back to [pool]'s)",
            )
    attach: AttachConfig = top.get("attach", AttachConfig())
    if attach.permissions == "designated" and not attach.designated:
        checker.fail(
            "attach.designated",
            'required when attach.permissions is "designated": the principals asked, e.g. designated = ["phone"]',
        )
    default = doc.get("default_backend")
    if default is not None and raw_backends and default not in raw_backends:
        configured = ", ".join(sorted(raw_backends))
        checker.fail("default_backend", f"{_show(default)} is not a backend (configured: {configured})")
    if checker.problems:
        raise ConfigError(checker.problems, source)
    return Config(backends=backends, source=source, **top)


def unsafe_ownership(info: os.stat_result, source: str, uid: int | None = None) -> str | None:
    """Why a config file with this ``stat`` must not be trusted, or ``None`` if it may be.

    A config names the commands the proxy executes: anyone who can change it can run
    programs as us. So it must be ours (or root's) and writable by no one else; the
    check is made on the opened file, so a swapped symlink cannot slip past it.
    """
    uid = os.getuid() if uid is None else uid
    if info.st_uid not in (uid, 0):
        return (
            f"belongs to uid {info.st_uid}, not to you (uid {uid}) or root, and names the commands to run; "
            f"refusing it: use a copy of your own, or run: chown {uid} {source}"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "anyone" if info.st_mode & stat.S_IWOTH else "its group"
        return (
            f"is writable by {who} (mode {stat.S_IMODE(info.st_mode):04o}) and names the commands to run; "
            f"refusing it: run: chmod go-w {source}"
        )
    return None


def load(path: str | os.PathLike[str]) -> Config:
    """Read and validate a TOML config file; one that others could change is refused."""
    import tomllib  # not needed at all for `acp-proxy -- CMD`

    source = os.fspath(path)
    try:
        with open(source, "rb") as fh:
            unsafe = unsafe_ownership(os.fstat(fh.fileno()), source)
            if unsafe is not None:
                raise ConfigError([unsafe], source)
            doc = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(["file not found"], source) from None
    except OSError as exc:
        raise ConfigError([f"cannot read: {exc.strerror}"], source) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError([f"not valid TOML: {exc}"], source) from None
    return validate(doc, source)


def adhoc(command: list[str]) -> Config:
    """The config for ``acp-proxy -- CMD ARG...``: one backend named after the agent (``agent_name``)."""
    name = agent_name(command)
    return Config(backends={name: BackendConfig(name=name, command=tuple(command))})


_INTERPRETER = re.compile(r"^(python|pypy|node|nodejs|bun|deno|ruby|perl|php|bash|sh|zsh)[\d.]*$")
_LAUNCHERS: Final = {"npx": 1, "bunx": 1, "uvx": 1, "pnpx": 1, "pipx": 2, "pnpm": 2, "yarn": 2, "npm": 2, "uv": 2}
"""Programs that run a package by name, and where it stands: ``npx pkg``, ``pipx run pkg``, ``pnpm dlx pkg``."""
_OPTIONS_WITH_A_VALUE: Final = frozenset(
    {"-X", "-W", "-c", "-p", "--package", "--from", "--with", "-r", "--require", "--import", "--loader"}
)
_GENERIC: Final = frozenset({"cli", "main", "index", "__main__", "bin", "dist", "src", "lib", "run", "start", "acp"})
"""Script and directory names that say nothing of the agent: the name is looked for further up."""


def agent_name(command: Sequence[str]) -> str:
    """The name a zero-config backend gets: the agent's, not its interpreter's or launcher's.

    ``python3 x.py`` -> ``x``; ``python -m pkg`` (or ``pkg.acp``, ``pkg.__main__``) -> ``pkg``;
    ``node .../node_modules/@scope/pkg/dist/cli.js`` -> ``pkg``; ``npx @scope/pkg@1.2`` -> ``pkg``;
    ``uvx pkg`` -> ``pkg``; ``env A=1 codex-acp`` -> ``codex-acp``; anything else is its program's
    name. Pure: it reads no file.
    """
    args = list(command)
    while args and (Path(args[0]).name == "env" or ("=" in args[0] and not args[0].startswith("-"))):
        args = args[1:]  # env VAR=value ... CMD
    if not args:
        return "adapter"
    program = _program(args[0])
    if program in _LAUNCHERS:
        rest = _operands(args[1:])
        if len(rest) < _LAUNCHERS[program]:
            return program
        target = rest[_LAUNCHERS[program] - 1]
        is_path = target.startswith(("/", "./", "../")) or target.endswith((".py", ".js", ".mjs", ".ts"))
        return _script(target) if is_path else _package(target)
    if _INTERPRETER.match(program):
        for i, arg in enumerate(args[1:], start=1):
            if arg == "-m" and i + 1 < len(args):
                meaningful = [part for part in args[i + 1].split(".") if part not in _GENERIC]
                return meaningful[-1] if meaningful else args[i + 1]
        rest = _operands(args[1:])
        return _script(rest[0]) if rest else program
    return program


def _program(path: str) -> str:
    name = Path(path.replace("\\", "/")).name
    for suffix in (".exe", ".cmd", ".bat"):
        name = name.removesuffix(suffix)
    return name or "adapter"


def _operands(args: Sequence[str]) -> list[str]:
    """The arguments that are not options (nor an option's value)."""
    operands, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in _OPTIONS_WITH_A_VALUE:
            skip = True
        elif not arg.startswith("-"):
            operands.append(arg)
    return operands


def _package(spec: str) -> str:
    """``@scope/pkg@1.2`` -> ``pkg``; ``pkg==1.0``, ``pkg[extra]`` -> ``pkg``."""
    name = spec.split("/")[-1] if spec.startswith("@") else spec
    return re.split(r"[@=<>~\[ ]", name, maxsplit=1)[0] or spec


def _script(path: str) -> str:
    """A script's agent: its package under ``node_modules``, else its name, else its directory's."""
    parts = Path(path.replace("\\", "/")).parts
    if "node_modules" in parts:
        after = parts[len(parts) - 1 - parts[::-1].index("node_modules") + 1 :]
        if after:
            return after[1] if after[0].startswith("@") and len(after) > 1 else after[0]
    names = [*parts[:-1], Path(parts[-1]).stem] if parts else []
    for name in reversed(names):
        if name and name not in _GENERIC and name not in (".", "..", "/"):
            return name
    return Path(path).stem or "adapter"


# --- locations -----------------------------------------------------------------


def _platform_dir(xdg_var: str, xdg_default: str) -> Path:
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support"
    base = os.environ.get(xdg_var)
    return Path(base) if base and os.path.isabs(base) else Path.home() / xdg_default


def default_config_path() -> Path:
    return _platform_dir("XDG_CONFIG_HOME", ".config") / "acp-proxy" / "config.toml"


def find_config_path(explicit: str | None) -> Path | None:
    """``--config``, else ``$ACP_PROXY_CONFIG``, else the platform file if it exists."""
    if explicit:
        return Path(explicit)
    from_env = os.environ.get("ACP_PROXY_CONFIG")
    if from_env:
        return Path(from_env)
    candidate = default_config_path()
    return candidate if candidate.is_file() else None


def state_dir(config: Config | None = None) -> Path:
    """``$ACP_PROXY_STATE_DIR``, else ``state_dir`` from the config, else the platform dir."""
    from_env = os.environ.get("ACP_PROXY_STATE_DIR")
    if from_env:
        return Path(from_env)
    if config is not None and config.state_dir:
        return Path(os.path.expanduser(config.state_dir))
    return _platform_dir("XDG_STATE_HOME", ".local/state") / "acp-proxy"


# --- ${VAR} expansion (done here, never by a shell) ------------------------------


class MissingVariable(Exception):
    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"environment variable {name} is not set")


def expand(text: str, environ: Mapping[str, str]) -> str:
    """Expand ``${NAME}`` from ``environ``; ``$$`` is a literal ``$``; nothing else is special."""

    def substitute(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        if name is None or name not in environ:
            raise MissingVariable(name or m.group(0))
        return environ[name]

    return _VAR.sub(substitute, text)


def referenced_names(texts: Iterable[str]) -> set[str]:
    """Every ``NAME`` that ``${NAME}`` refers to in ``texts``."""
    return {m.group(1) for text in texts for m in _VAR.finditer(text) if m.group(1)}


def referenced_variables(config: Config) -> set[str]:
    """Every ``${NAME}`` a config refers to, for ``config check`` to report unset ones."""
    names: set[str] = set()
    for backend in config.backends.values():
        names |= referenced_names((*backend.command, *backend.env.values()))
    return names | referenced_names(config.tasks.notify_command or ())
