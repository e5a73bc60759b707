"""Configuration: every problem reported with its key path; CLI behaviour around configs."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any

import msgspec
import pytest

from acp_proxy import config as configuration
from acp_proxy.config import ConfigError, parse_duration, parse_size, validate
from tests.support import run_program


def problems(doc: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        validate(doc)
    return caught.value.problems


GOOD = {"backends": {"codex": {"command": ["codex-acp"]}}}


def test_defaults_fill_a_minimal_config() -> None:
    config = validate(GOOD)
    assert config.backend().command == ("codex-acp",)
    assert config.pool.max_live == 4
    assert config.shutdown.term_grace == 3.0
    assert config.max_line_bytes == 64 * 1024 * 1024


def test_design_example_is_valid() -> None:
    doc = {
        "default_backend": "claude",
        "pool": {"max_live": 4, "idle_ttl": "15m", "acquire_timeout": "30s", "quiet_after": "2s"},
        "shutdown": {"close_timeout": "1.5s", "stdin_grace": "1s", "term_grace": "3s"},
        "backends": {
            "claude": {
                "command": ["claude-agent-acp"],
                "env": {"ANTHROPIC_API_KEY": "${ANTHROPIC_API_KEY}"},
                "resume": "auto",
                "max_live": 2,
            },
            "codex": {"command": ["codex-acp"]},
        },
    }
    config = validate(doc)
    assert config.backend().name == "claude"
    assert config.pool.idle_ttl == 900.0
    assert config.pool.quiet_after == 2.0
    assert config.shutdown.close_timeout == 1.5
    assert config.backends["claude"].max_live == 2


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        (
            {"backends": {"codex": {"command": ["codex-acp"], "max_live": "two"}}},
            'backends.codex.max_live: expected int >= 1, got "two"',
        ),
        (
            {"backends": {"codex": {"command": ["codex-acp"], "max_live": 0}}},
            "backends.codex.max_live: expected int >= 1, got 0",
        ),
        (
            {"backends": {"codex": {"command": "codex-acp --fast"}}},
            "backends.codex.command: expected an argv list such as "
            '["codex-acp", "--flag"] (no shell is used), got "codex-acp --fast"',
        ),
        (
            {"backends": {"codex": {"command": []}}},
            "backends.codex.command: expected a non-empty list of strings, got []",
        ),
        ({"backends": {"codex": {}}}, "backends.codex.command: required key is missing"),
        ({"backends": {"codex": {"command": ["x"], "comand": 1}}}, "backends.codex.comand: unknown key"),
        (
            {"backends": {"codex": {"command": ["x"], "resume": "maybe"}}},
            'backends.codex.resume: expected one of "auto"',
        ),
        (
            {"backends": {"codex": {"command": ["x"], "env": {"K": 1}}}},
            "backends.codex.env.K: expected a string, got 1",
        ),
        (
            {"backends": {"codex": {"command": ["x"], "env": {"K": "${OOPS"}}}},
            "backends.codex.env.K: unterminated",
        ),
        ({**GOOD, "pool": {"idle_ttl": "soon"}}, 'pool.idle_ttl: expected a duration such as "150ms"'),
        (
            {**GOOD, "pool": {"max_lve": 3}},
            "pool.max_lve: unknown key "
            "(expected one of: acquire_timeout, idle_ttl, max_live, max_memory, min_idle, quiet_after, "
            "resume_timeout, session_kill_memory, session_max_memory, start_timeout)",
        ),
        ({**GOOD, "shutdown": {"term_grace": -1}}, "shutdown.term_grace: expected a duration"),
        ({**GOOD, "pool": 5}, "pool: expected a table, got 5"),
        ({**GOOD, "ownership": {"reap_interval": "often"}}, "ownership.reap_interval: expected a duration"),
        ({**GOOD, "tasks": {"turn_idle_timeout": "quiet"}}, "tasks.turn_idle_timeout: expected a duration"),
        (
            {**GOOD, "pool": {"session_max_memory": "1G", "session_kill_memory": "512M"}},
            "pool.session_kill_memory: 536870912 bytes must be larger than session_max_memory",
        ),
        (
            {"backends": {"codex": {"command": ["x"], "session_max_memory": "2G", "session_kill_memory": "2G"}}},
            "backends.codex.session_kill_memory: 2147483648 bytes must be larger than session_max_memory",
        ),
        (
            {
                "pool": {"session_kill_memory": "1G"},
                "backends": {"codex": {"command": ["x"], "session_max_memory": "2G"}},
            },
            "backends.codex.session_kill_memory: 1073741824 bytes must be larger than session_max_memory, 2147483648",
        ),
        (
            {**GOOD, "ownership": {"reap": "3m"}},
            "ownership.reap: unknown key (expected one of: cgroups, reap_interval)",
        ),
        (
            {**GOOD, "ownership": {"cgroups": "yes"}},
            'ownership.cgroups: expected one of "auto", "off", "required", got "yes"',
        ),
        ({**GOOD, "trace": {"max_size": "huge"}}, 'trace.max_size: expected a size such as "512M"'),
        ({**GOOD, "trace": {"path": "x"}}, "trace.path: unknown key (expected one of: file, max_size)"),
        ({**GOOD, "attach": {"prompts": "maybe"}}, 'attach.prompts: expected one of "queue", "refuse", got "maybe"'),
        ({**GOOD, "attach": {"max_clients": 0}}, "attach.max_clients: expected int >= 1, got 0"),
        ({**GOOD, "attach": {"transcript_max_bytes": "lots"}}, "attach.transcript_max_bytes: expected a size such as"),
        (
            {**GOOD, "attach": {"clients": 3}},
            "attach.clients: unknown key (expected one of: designated, max_clients, permissions, prompts, "
            "transcript_max_bytes)",
        ),
        (
            {**GOOD, "attach": {"permissions": "anyone"}},
            'attach.permissions: expected one of "first", "prompter", "designated", got "anyone"',
        ),
        ({**GOOD, "attach": {"designated": "phone"}}, 'attach.designated: expected a list of names such as ["phone"'),
        (
            {**GOOD, "attach": {"permissions": "designated"}},
            'attach.designated: required when attach.permissions is "designated"',
        ),
        (
            {**GOOD, "default_backend": "claude"},
            'default_backend: "claude" is not a backend (configured: codex)',
        ),
        ({**GOOD, "max_line_bytes": 10}, "max_line_bytes: expected int >= 1024, got 10"),
        ({**GOOD, "sessions": {"keep_suspended": 0}}, "sessions.keep_suspended: expected a duration > 0"),
        ({**GOOD, "sessions": {"keep_suspended": "forever"}}, "sessions.keep_suspended: expected a duration such as"),
        ({**GOOD, "sessions": {"handover_timeout": "soon"}}, "sessions.handover_timeout: expected a duration"),
        (
            {**GOOD, "sessions": {"keep": "1d"}},
            "sessions.keep: unknown key (expected one of: handover_timeout, keep_suspended)",
        ),
        (
            {"backends": {"codex": {"command": ["codex-acp"], "on_eof": "exit"}}},
            'backends.codex.on_eof: expected one of "suspend", "close", got "exit"',
        ),
        ({**GOOD, "colour": "blue"}, "colour: unknown key"),
        ({}, "backends: at least one backend is required"),
    ],
)
def test_each_problem_names_its_key_path(doc: dict[str, Any], expected: str) -> None:
    found = problems(doc)
    assert any(p.startswith(expected) for p in found), found


def test_the_sessions_table_and_on_eof() -> None:
    config = validate(
        {
            "backends": {"codex": {"command": ["codex-acp"], "on_eof": "close"}},
            "sessions": {"keep_suspended": "12h", "handover_timeout": 5},
        }
    )
    assert (config.sessions.keep_suspended, config.sessions.handover_timeout) == (12 * 3600.0, 5.0)
    assert config.backend().on_eof == "close"
    defaults = validate(GOOD)
    assert (defaults.sessions.keep_suspended, defaults.sessions.handover_timeout) == (30 * 86400.0, 60.0)
    assert defaults.backend().on_eof == "suspend"


def test_the_attach_table() -> None:
    config = validate({**GOOD, "attach": {"prompts": "refuse", "max_clients": 3, "transcript_max_bytes": 0}})
    assert (config.attach.prompts, config.attach.max_clients, config.attach.transcript_max_bytes) == ("refuse", 3, 0)
    defaults = validate(GOOD).attach
    assert (defaults.prompts, defaults.max_clients, defaults.transcript_max_bytes) == ("queue", 16, 2 * 1024 * 1024)
    assert validate({**GOOD, "attach": {"transcript_max_bytes": "64K"}}).attach.transcript_max_bytes == 65536


def test_all_problems_are_reported_at_once() -> None:
    found = problems(
        {
            "pool": {"max_live": 0, "idle_ttl": "x"},
            "backends": {"a": {"command": "sh"}, "b": {"command": ["b"], "max_live": "two"}},
        }
    )
    assert [p.split(":")[0] for p in found] == [
        "pool.max_live",
        "pool.idle_ttl",
        "backends.a.command",
        "backends.b.max_live",
    ]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("150ms", 0.15), ("3s", 3.0), ("1.5s", 1.5), ("15m", 900.0), ("4h", 14400.0), (2, 2.0), (0.25, 0.25)],
)
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["3", "3 days", "-1s", "", True, [1]])
def test_bad_durations(text: object) -> None:
    with pytest.raises(Exception, match="expected a duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("512M", 512 * 2**20),
        ("6G", 6 * 2**30),
        ("6GiB", 6 * 2**30),
        ("6gb", 6 * 2**30),
        ("1.5G", int(1.5 * 2**30)),
        ("64k", 64 * 2**10),
        ("1T", 2**40),
        ("100B", 100),
        (4096, 4096),
    ],
)
def test_sizes(text: object, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["0G", "4096", 0, -5, "-1G", "G", "6X", "six gigs", True, 1.5, None])
def test_bad_sizes(text: object) -> None:
    with pytest.raises(Exception, match="a size such as"):
        parse_size(text)


def test_the_periodic_reaping_is_read_and_on_by_default() -> None:
    assert validate(GOOD).ownership.reap_interval == 180.0
    assert validate({**GOOD, "ownership": {"reap_interval": "30s"}}).ownership.reap_interval == 30.0
    assert validate({**GOOD, "ownership": {"reap_interval": 0}}).ownership.reap_interval == 0.0


@pytest.mark.parametrize("setting", ["auto", "off", "required"])
def test_cgroups_are_auto_by_default_and_read_as_written(setting: str) -> None:
    assert validate(GOOD).ownership.cgroups == "auto"
    assert validate({**GOOD, "ownership": {"cgroups": setting}}).ownership.cgroups == setting


def test_memory_budget_and_min_idle_are_read() -> None:
    config = validate(
        {
            "pool": {"max_memory": "6G", "min_idle": "500ms"},
            "backends": {"a": {"command": ["a"], "max_memory": "1G"}, "b": {"command": ["b"]}},
        }
    )
    assert config.pool.max_memory == 6 * 2**30
    assert config.pool.min_idle == 0.5
    assert config.backends["a"].max_memory == 2**30
    assert config.backends["b"].max_memory is None
    assert validate({"backends": {"b": {"command": ["b"]}}}).pool.max_memory is None


def test_session_ceilings_and_the_idle_turn_limit_are_read_per_backend() -> None:
    config = validate(
        {
            "pool": {"session_max_memory": "1G", "session_kill_memory": "2G"},
            "tasks": {"turn_idle_timeout": "5m"},
            "backends": {
                "a": {"command": ["a"], "session_max_memory": "512M", "turn_idle_timeout": "30s"},
                "b": {"command": ["b"], "session_kill_memory": "4G"},
            },
        }
    )
    assert config.session_memory("a") == (512 * 2**20, 2 * 2**30)
    assert config.session_memory("b") == (2**30, 4 * 2**30)
    assert config.turn_idle_timeout("a") == 30.0
    assert config.turn_idle_timeout("b") == 300.0
    plain = validate(GOOD)
    assert plain.session_memory("codex") == (None, None)
    assert plain.turn_idle_timeout("codex") == 0.0


def test_variable_expansion_is_literal_and_shell_free() -> None:
    env = {"KEY": "s3cr3t; rm -rf /", "EMPTY": ""}
    assert configuration.expand("${KEY}", env) == "s3cr3t; rm -rf /"
    assert configuration.expand("a$$b ${EMPTY}$HOME `x` $(y)", env) == "a$b $HOME `x` $(y)"
    with pytest.raises(configuration.MissingVariable, match="UNSET_VAR"):
        configuration.expand("${UNSET_VAR}", env)


def test_backend_choice() -> None:
    config = validate({"default_backend": "b", "backends": {"a": {"command": ["a"]}, "b": {"command": ["b"]}}})
    assert config.backend().name == "b"
    assert config.backend("a").name == "a"
    with pytest.raises(KeyError, match=r"unknown backend 'zzz' \(configured: a, b\)"):
        config.backend("zzz")
    no_default = validate({"backends": {"a": {"command": ["a"]}, "b": {"command": ["b"]}}})
    with pytest.raises(KeyError, match="no default_backend"):
        no_default.backend()


def test_state_dir_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("ACP_PROXY_STATE_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert configuration.state_dir() == tmp_path / "xdg" / "acp-proxy"
    config = validate({**GOOD, "state_dir": str(tmp_path / "from-config")})
    assert configuration.state_dir(config) == tmp_path / "from-config"
    monkeypatch.setenv("ACP_PROXY_STATE_DIR", str(tmp_path / "from-env"))
    assert configuration.state_dir(config) == tmp_path / "from-env"


# --- the CLI -----------------------------------------------------------------------------


def run_cli(
    *args: str, env: dict[str, str], stdin: bytes = b"", cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return run_program(env, *args, stdin=stdin.decode(), cwd=cwd, timeout=30)


@pytest.fixture
def cli_env(proc_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in proc_env.items() if not k.startswith("ACP_PROXY_CONFIG")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "config-home")
    return env


def test_config_check_reports_every_error_and_exits_2(tmp_path: Path, cli_env: dict[str, str]) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(
        textwrap.dedent(
            """
            [pool]
            max_live = 0
            [backends.codex]
            command = ["codex-acp"]
            max_live = "two"
            """
        )
    )
    result = run_cli("config", "check", "--config", str(path), env=cli_env)
    assert result.returncode == 2
    assert "2 problems" in result.stderr
    assert "pool.max_live: expected int >= 1, got 0" in result.stderr
    assert 'backends.codex.max_live: expected int >= 1, got "two"' in result.stderr


def test_config_check_ok_names_backends_and_unset_variables(tmp_path: Path, cli_env: dict[str, str]) -> None:
    path = tmp_path / "good.toml"
    path.write_text('[backends.claude]\ncommand = ["claude-agent-acp"]\nenv = { KEY = "${NOT_SET_ANYWHERE}" }\n')
    result = run_cli("config", "check", "--config", str(path), env=cli_env)
    assert result.returncode == 0, result.stderr
    assert "backend claude (default): claude-agent-acp" in result.stdout
    assert f"state dir: {cli_env['ACP_PROXY_STATE_DIR']}" in result.stdout
    assert "${NOT_SET_ANYWHERE} is not set" in result.stdout


@pytest.mark.parametrize(
    ("content", "message"),
    [("[backends\n", "not valid TOML"), (None, "file not found")],
)
def test_unreadable_configs_exit_2(tmp_path: Path, cli_env: dict[str, str], content: str | None, message: str) -> None:
    path = tmp_path / "c.toml"
    if content is not None:
        path.write_text(content)
    for args in (["config", "check", "--config", str(path)], ["--config", str(path)]):
        result = run_cli(*args, env=cli_env)
        assert result.returncode == 2
        assert message in result.stderr


def test_config_from_environment_and_platform_dir(tmp_path: Path, cli_env: dict[str, str]) -> None:
    platform_file = Path(cli_env["XDG_CONFIG_HOME"]) / "acp-proxy" / "config.toml"
    platform_file.parent.mkdir(parents=True)
    platform_file.write_text('[backends.platform]\ncommand = ["p"]\n')
    assert "backend platform" in run_cli("config", "check", env=cli_env).stdout
    env_file = tmp_path / "env.toml"
    env_file.write_text('[backends.fromenv]\ncommand = ["e"]\n')
    result = run_cli("config", "check", env={**cli_env, "ACP_PROXY_CONFIG": str(env_file)})
    assert "backend fromenv" in result.stdout


def test_serving_without_any_backend_is_a_usage_error(cli_env: dict[str, str]) -> None:
    result = run_cli(env=cli_env)
    assert result.returncode == 2
    assert "acp-proxy -- codex-acp" in result.stderr


def test_unknown_backend_is_a_usage_error(tmp_path: Path, cli_env: dict[str, str]) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[backends.a]\ncommand = ["a"]\n')
    result = run_cli("--config", str(path), "--backend", "zzz", env=cli_env)
    assert result.returncode == 2
    assert "unknown backend 'zzz' (configured: a)" in result.stderr


def test_bad_async_backend_variable_is_a_usage_error(cli_env: dict[str, str]) -> None:
    result = run_cli("--", "true", env={**cli_env, "ACP_PROXY_ASYNC_BACKEND": "curio"})
    assert result.returncode == 2
    assert "ACP_PROXY_ASYNC_BACKEND" in result.stderr


def test_an_adapter_command_with_a_config_replaces_its_backends_only(tmp_path: Path) -> None:
    from acp_proxy.operator.cli import load_config

    path = tmp_path / "c.toml"
    path.write_text(
        'default_backend = "a"\nmax_line_bytes = 4096\n[pool]\nmax_live = 2\n[shutdown]\nterm_grace = "2s"\n'
        '[tasks]\nretention = "1d"\n[ownership]\nreap_interval = "10s"\n[trace]\nfile = "/tmp/t.jsonl"\n'
        'max_size = "1M"\n[backends.a]\ncommand = ["a"]\n'
    )
    from_file = configuration.load(path)
    served = load_config(str(path), ["my-agent", "--flag"])
    assert [b.command for b in served.backends.values()] == [("my-agent", "--flag")]
    assert served.backend().command == ("my-agent", "--flag")
    assert (from_file.trace.file, from_file.trace.max_size) == ("/tmp/t.jsonl", 2**20)
    for section in ("max_line_bytes", "pool", "shutdown", "tasks", "ownership", "trace", "source", "state_dir"):
        assert getattr(served, section) == getattr(from_file, section), section


def test_adhoc_command_is_taken_literally(tmp_path: Path, cli_env: dict[str, str]) -> None:
    """Arguments after -- reach the adapter verbatim: no shell, no option parsing."""
    out = tmp_path / "argv.txt"
    script = "import sys, pathlib; pathlib.Path(sys.argv[1]).write_text(repr(sys.argv[2:]))"
    args = [str(out), "--config", "x y", "$(touch pwned)", "; echo hi", "--"]
    request = b'{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":1}}\n'
    result = run_cli("--", sys.executable, "-c", script, *args, env=cli_env, stdin=request, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert out.read_text() == repr(args[1:])
    assert not (tmp_path / "pwned").exists()
    assert '"reason":"adapter_exited"' in result.stdout


def test_nul_in_argv_or_env_is_a_config_error() -> None:
    found = problems({"backends": {"x": {"command": ["echo\0x"], "env": {"K": "a\0b"}}}})
    assert any(p.startswith("backends.x.command: contains a NUL") for p in found), found
    assert any(p.startswith("backends.x.env.K: contains a NUL") for p in found), found


# --- each key declared once: on its Struct field, with its check and what it overrides ------------

TABLES = [
    ("", configuration.Config),
    *(
        (name, kind)
        for name, kind in typing.get_type_hints(configuration.Config).items()
        if isinstance(kind, type) and issubclass(kind, msgspec.Struct)
    ),  # [pool], [shutdown], [tasks], ...: every table the Config has
    ("backends.NAME", configuration.BackendConfig),
]


def _keys() -> list[str]:
    """Every key of the config file, as the Structs declare them."""
    keys = []
    for section, struct in TABLES:
        for key in configuration._key_checks(struct):
            kind = struct.__annotations__[key]
            if section == "" and kind.endswith("Config"):
                continue  # a table, not a key
            keys.append(f"[{section}] {key}" if section else key)
    return keys


def test_every_key_is_its_structs_field_and_nothing_else_is_a_key() -> None:
    for section, struct in TABLES:
        fields = set(struct.__struct_fields__) - {"name", "source", "backends"}
        assert set(configuration._key_checks(struct)) == fields, section


@pytest.mark.parametrize(("key", "bad"), [(k, v) for k, v in [("idle_ttl", "soon"), ("max_live", 0)]])
def test_a_keys_check_is_the_one_its_field_declares_wherever_it_appears(key: str, bad: object) -> None:
    in_pool = problems({**GOOD, "pool": {key: bad}})
    assert len(in_pool) == 1
    assert in_pool[0].startswith(f"pool.{key}: expected ")


OVERRIDDEN = [
    ("turn_timeout", "tasks", 60.0, 5.0),
    ("turn_idle_timeout", "tasks", 60.0, 5.0),
    ("cancel_timeout", "tasks", 60.0, 5.0),
    ("start_timeout", "pool", 60.0, 5.0),
    ("max_live", "pool", 4, 2),
    ("session_max_memory", "pool", 1 << 30, 1 << 20),
    ("session_kill_memory", "pool", 1 << 31, 1 << 21),
]


@pytest.mark.parametrize(("key", "section", "table_value", "own_value"), OVERRIDDEN)
def test_a_backends_own_value_overrides_its_tables_and_only_for_its_sessions(
    key: str, section: str, table_value: object, own_value: object
) -> None:
    doc = {
        section: {key: table_value},
        "backends": {"own": {"command": ["a"], key: own_value}, "other": {"command": ["b"]}},
    }
    config = validate(doc)
    assert config.resolved("own", key) == own_value
    assert config.resolved(config.backends["own"], key) == own_value
    assert config.resolved("other", key) == table_value
    assert config.resolved("unknown", key) == table_value


def test_exactly_the_keys_that_override_a_table_resolve_and_each_names_a_key_of_it() -> None:
    overriding = {
        key
        for key in configuration.BackendConfig.__struct_fields__
        if any(
            isinstance(m, configuration.Overrides) for m in configuration._metadata(configuration.BackendConfig, key)
        )
    }
    assert overriding == {key for key, *_ in OVERRIDDEN}
    config = validate(GOOD)
    for key in sorted(set(configuration.BackendConfig.__struct_fields__) - overriding):
        with pytest.raises(KeyError, match="overrides nothing"):
            config.resolved("codex", key)


def test_the_configuration_reference_lists_every_key_and_no_other() -> None:
    """docs/configuration.md's table of every key, against the Structs that declare them."""
    text = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    table = text[text.index("| key | type | default | meaning |") :].split("\n\n")[0]
    documented = set()
    for line in table.splitlines()[2:]:
        first, *more = (name.strip("`") for name in line.split("|")[1].strip().split(", "))
        section, _, key = first.rpartition(" ")  # "[pool] max_live, min_idle": both of [pool]
        documented |= {f"{section} {name}" if section else name for name in (key, *more)}
    assert documented == set(_keys())


PROXY_OPTIONS = [
    [],
    ["--async-backend", "trio"],
    ["--backend", "fake", "--log-level", "debug", "--log-format", "json"],
    ["--config", "proxy.toml", "--trace", "trace.jsonl"],
    ["--asy", "trio"],  # an abbreviation, as argparse takes it
]
NOT_PROXY_OPTIONS = [
    ["sessions", "list", "--json"],
    ["serve", "--listen", "8080"],
    ["--config", "proxy.toml", "status"],
]


@pytest.mark.parametrize("options", PROXY_OPTIONS)
def test_a_proxys_options_parse_as_the_whole_parser_parses_them(options: list[str]) -> None:
    """A proxy's start parses its options with the top-level parser alone (no command's parser built):
    what it gets is what the whole parser gives."""
    from acp_proxy.operator import cli

    assert vars(cli.parse_options(list(options))) == vars(cli._parser().parse_args(list(options)))


@pytest.mark.parametrize("options", NOT_PROXY_OPTIONS)
def test_a_command_line_naming_a_command_is_parsed_by_the_whole_parser(options: list[str]) -> None:
    from acp_proxy.operator import cli

    parsed = cli.parse_options(list(options))
    assert parsed.command is not None
    assert vars(parsed) == vars(cli._parser().parse_args(list(options)))


@pytest.mark.parametrize("options", [["--bogus"], ["--log-level", "loud"], ["--help"], ["--async-backend"]])
def test_mistakes_and_help_get_the_whole_parsers_words(options: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Help lists the commands, and a mistake is shown with the program's usage (commands included), exit 2."""
    from acp_proxy.operator import cli

    with pytest.raises(SystemExit) as light:
        cli.parse_options(list(options))
    light_out = capsys.readouterr()
    with pytest.raises(SystemExit) as whole:
        cli._parser().parse_args(list(options))
    assert (light.value.code, light_out) == (whole.value.code, capsys.readouterr())
    assert "COMMAND" in light_out.out + light_out.err
