"""``acp-proxy``: serve ACP on stdio (the default), or operate on a config.

    acp-proxy [--config PATH] [--backend NAME]      serve with a TOML config
    acp-proxy [options] -- CMD ARG...                 serve one ad-hoc backend, no config needed
    acp-proxy config check [--config PATH]           validate a config, exit 2 on error
    acp-proxy doctor [--config PATH] [--json]        check a config and this host, each finding with its fix
    acp-proxy status [--json]                        proxies, sessions, leases, processes, turns
    acp-proxy sessions list|show ID [--transcript]|suspend ID|close ID [--json]
    acp-proxy permissions list|answer REQUEST OPTION|answer REQUEST --cancel [--json]
    acp-proxy tasks list [--status S] [--session ID]|show ID [--follow]|cancel ID [--json]
    acp-proxy tasks notify ID POLICY|watch [--session ID] [--since D] [--json]
    acp-proxy leases [--json] [--all]                leases and the process trees they own
    acp-proxy reap [--dry-run] [--json]              reap what dead proxies left running
    acp-proxy metrics [--textfile PATH]              the install's metrics, Prometheus text format
    acp-proxy top [--interval S] [--once] [--json]   a live view of the install; keys act on it
    acp-proxy serve --listen HOST:PORT|--socket PATH  the install's sessions over WebSocket and streamable HTTP
    acp-proxy token create NAME|list|revoke NAME     bearer tokens for serve (shown once, stored hashed)
    acp-proxy connect URL [--token-file PATH]        a stdio gateway's agent command for a remote serve

Everything after the first ``--`` is the adapter's argv, taken literally.
Exit status 2 means bad input (usage, config, an unknown id); the message says what
to fix. Exit status 1 from an acting command means the proxy it needed could not be
reached or did not act; from ``doctor``, that it found a problem with the host or the state.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sqlite3
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from acp_proxy import __version__, logs
from acp_proxy import config as configuration
from acp_proxy.config import Config, ConfigError
from acp_proxy.state import DB_NAME
from acp_proxy.state.connection import StateError
from acp_proxy.state.directory import explain_failure
from acp_proxy.state.migrations import SCHEMA_VERSION

if TYPE_CHECKING:
    from acp_proxy.ownership.owner import Owner
    from acp_proxy.pool.running import WarmStart

Serve = Callable[[Config, "Owner", str | None, "WarmStart | None", str], int]
"""Runs a proxy: config, owner, backend name, the warm adapter, the async backend -> exit status."""

EXIT_USAGE = 2
ASYNC_BACKENDS = ("asyncio", "trio")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")


class UsageError(Exception):
    """Bad input from the command line or a config: printed, then exit 2."""


def parse_options(options: list[str]) -> argparse.Namespace:
    """The command line's options (before ``--``).

    A proxy's own options, naming no command (the stdio relay a gateway starts, ``acp-proxy
    [OPTIONS] -- ADAPTER``), are parsed by the top-level parser alone: building the parser of every
    command is most of the parsing's cost at each proxy's start. Anything else (a command, help, a
    mistake) is parsed by the whole parser, whose usage and messages are the program's.
    """
    if "-h" not in options and "--help" not in options:
        try:
            args, rest = _top_parser(_Quiet, add_help=False).parse_known_args(options)
        except _Misparsed:
            pass  # the whole parser says what is wrong, in its words
        else:
            if not rest:
                args.command = None
                return args
    return _parser().parse_args(options)


class _Misparsed(Exception):
    pass


class _Quiet(argparse.ArgumentParser):
    """A parser that raises on a mistake instead of printing its usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise _Misparsed(message)


def _top_parser(
    kind: type[argparse.ArgumentParser] = argparse.ArgumentParser, *, add_help: bool = True
) -> argparse.ArgumentParser:
    """The program's own options, without its commands."""
    parser = kind(
        prog="acp-proxy",
        description="ACP sidecar: serves ACP on stdio in front of coding-agent adapters.",
        epilog="Run an adapter without a config: acp-proxy -- codex-acp",
        add_help=add_help,
    )
    parser.add_argument(
        "--version", action="version", version=f"acp-proxy {__version__} (state schema {SCHEMA_VERSION})"
    )
    _add_config_option(parser)
    _add_serve_options(parser)
    return parser


def _parser() -> argparse.ArgumentParser:
    parser = _top_parser()
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="serve ACP on stdio (the default), or on the network with --listen/--socket",
        epilog="On the network every client needs a token (acp-proxy token create NAME), except on the unix "
        "socket, which only this user can open. Each connection is served by a stdio proxy of the install.",
    )
    _add_config_option(serve)
    _add_serve_options(serve)
    _add_network_options(serve)
    _add_token_parser(commands)
    _add_connect_parser(commands)
    config_cmd = commands.add_parser("config", help="inspect configuration")
    config_actions = config_cmd.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = config_actions.add_parser("check", help="validate a config file")
    _add_config_option(check)
    leases = commands.add_parser("leases", help="list leases and the process trees they own")
    _add_config_option(leases)
    leases.add_argument("--json", action="store_true", help="machine-readable output")
    leases.add_argument("--all", action="store_true", help="every lease, not only the 50 most recent")
    reap = commands.add_parser("reap", help="reap what dead proxies of this install left running")
    _add_config_option(reap)
    reap.add_argument("--dry-run", action="store_true", help="say what would be done, signal nothing")
    reap.add_argument("--json", action="store_true", help="machine-readable output")
    status = commands.add_parser("status", help="proxies, sessions, leases, live processes and turns")
    _add_config_option(status)
    _add_json(status)
    _add_doctor_parser(commands)
    _add_sessions_parser(commands)
    _add_permissions_parser(commands)
    _add_tasks_parser(commands)
    _add_metrics_parser(commands)
    _add_top_parser(commands)
    return parser


def _add_network_options(serve: argparse.ArgumentParser) -> None:
    net = serve.add_argument_group("network (ACP over WebSocket and streamable HTTP at /acp)")
    net.add_argument(
        "--listen",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="listen on HOST:PORT (a bare PORT: 127.0.0.1); repeatable; "
        "a non-loopback address needs --tls-cert/--tls-key or --no-tls",
    )
    net.add_argument("--socket", metavar="PATH", help="listen on a unix socket only this user can open (mode 600)")
    net.add_argument("--tls-cert", metavar="PATH", help="TLS certificate chain (PEM)")
    net.add_argument("--tls-key", metavar="PATH", help="TLS private key (PEM)")
    net.add_argument(
        "--no-tls",
        action="store_true",
        help="allow a non-loopback --listen without TLS (a TLS-terminating proxy is in front)",
    )
    net.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a browser Origin to accept (e.g. https://app.example); others are refused (403)",
    )
    net.add_argument("--max-connections", type=_positive_int, default=256, metavar="N", help="in all (default 256)")
    net.add_argument(
        "--max-connections-per-token", type=_positive_int, default=64, metavar="N", help="per token (default 64)"
    )
    net.add_argument(
        "--max-pending",
        type=_positive_int,
        default=4096,
        metavar="N",
        help="messages waiting for one client before the agent's output waits too (default 4096)",
    )
    net.add_argument(
        "--stall-timeout",
        type=_duration,
        default=30.0,
        metavar="D",
        help="a client that takes nothing for D while --max-pending messages wait is disconnected (default 30s)",
    )
    net.add_argument(
        "--resume-grace",
        "--idle-timeout",  # its name before WebSockets could resume
        dest="resume_grace",
        type=_duration,
        default=300.0,
        metavar="D",
        help="a connection with no client on it (a dropped WebSocket; streamable HTTP with no open stream and "
        "no request) is kept D for a client that resumes it, its turns running on, then ends (default 5m)",
    )
    net.add_argument(
        "--linger",
        type=_duration,
        default=600.0,
        metavar="D",
        help="a WebSocket that ends with requests in flight: its proxy runs on up to D for them, "
        "then suspends its sessions (default 10m; 0s: at once)",
    )
    net.add_argument(
        "--replay-buffer",
        type=_positive_int,
        default=8000,
        metavar="N",
        help="messages each stream keeps (also at most 16 MiB, and --resume-grace old) for a client that "
        "resumes it: Last-Event-ID, WebSocket stream/resume (default 8000)",
    )


def _add_token_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    token = commands.add_parser("token", help="bearer tokens for acp-proxy serve: create, list, revoke")
    actions = token.add_subparsers(dest="action", metavar="ACTION", required=True)
    create = actions.add_parser("create", help="make a token and print it, once (only its hash is kept)")
    create.add_argument("name", metavar="NAME", help="what the token is for, e.g. laptop or ci")
    create.add_argument(
        "--backend", action="append", default=None, metavar="NAME", help="limit it to this backend (repeatable)"
    )
    create.add_argument(
        "--sees",
        choices=("own", "all"),
        default="own",
        help="own: only the sessions it made (default); all: every session of the install",
    )
    listing = actions.add_parser("list", help="tokens, revoked ones included")
    _add_json(listing)
    revoke = actions.add_parser("revoke", help="revoke a token: its connections end, it gets nothing more")
    revoke.add_argument("name", metavar="NAME")
    for parser in (create, listing, revoke):
        _add_config_option(parser)


def _add_connect_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    connect = commands.add_parser(
        "connect",
        help="bridge stdio to a remote acp-proxy serve (launch it as a gateway's agent command)",
        epilog="The token is read from --token-file, else $ACP_PROXY_TOKEN. A dropped link is re-established "
        "and the gateway's sessions go on under the same ids.",
    )
    connect.add_argument("url", metavar="URL", help="ws://HOST:PORT/acp, wss://HOST:PORT/acp or unix:PATH")
    connect.add_argument("--token-file", metavar="PATH", help="a file holding the token")
    connect.add_argument(
        "--eof-grace",
        type=_duration,
        default=10.0,
        metavar="D",
        help="once the gateway has left, how long its requests in flight may still be answered before its "
        "turns are cancelled (default 10s)",
    )
    connect.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=argparse.SUPPRESS,
        help="stderr log level (default: $ACP_PROXY_LOG_LEVEL or info)",
    )


def _add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _add_doctor_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    doctor = commands.add_parser(
        "doctor",
        help="check a config and this host: commands, variables, state dir, database, leftovers, ownership",
        description="Check a config and this host as acp-proxy needs them; print each finding with its fix.",
        epilog="Exit status: 0 no problem (warnings allowed), 1 a problem with the host, environment or state, "
        "2 bad usage or a config that is missing or does not parse or validate.",
    )
    _add_config_option(doctor)
    _add_json(doctor)


def _doctor(args: argparse.Namespace) -> int:
    from acp_proxy.operator.doctor import doctor_command

    return doctor_command(getattr(args, "config", None), as_json=args.json)


def _add_sessions_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sessions = commands.add_parser("sessions", help="sessions: list, show, suspend, close, prune")
    actions = sessions.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = actions.add_parser("list", help="open sessions, most recently active first")
    listing.add_argument(
        "--state",
        action="append",
        default=[],
        metavar="STATE",
        help="live, resuming, suspended, closed or deleted (repeatable)",
    )
    listing.add_argument("--all", action="store_true", help="closed sessions too (deleted ones only with --state)")
    show = actions.add_parser("show", help="one session: its process, its recent tasks")
    suspend = actions.add_parser("suspend", help="stop an idle session's process; it stays resumable")
    close = actions.add_parser("close", help="end a session's turn and reap its processes; it stays listed, closed")
    prune = actions.add_parser(
        "prune",
        help="close the sessions suspended longer than [sessions] keep_suspended (or --older-than); "
        "they stay listed and loadable",
    )
    prune.add_argument(
        "--older-than",
        type=_duration,
        metavar="D",
        help='suspended and last active longer ago than this ("7d", "12h", seconds); default: keep_suspended',
    )
    prune.add_argument("--dry-run", action="store_true", help="list them, close nothing")
    for parser in (listing, show, suspend, close, prune):
        _add_config_option(parser)
        _add_json(parser)
    for parser in (show, suspend, close):
        parser.add_argument("id", metavar="ID", help="session id (or a unique prefix of 4+ characters)")
    show.add_argument(
        "--transcript", action="store_true", help="what the session's gateway saw, as the proxy keeps it (bounded)"
    )


def _add_permissions_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    permissions = commands.add_parser(
        "permissions", help="the agents' requests waiting for an answer: list, answer (the first answer wins)"
    )
    actions = permissions.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = actions.add_parser("list", help="every waiting request of the install's running proxies")
    answer = actions.add_parser("answer", help="answer a waiting permission request with one of its options")
    answer.add_argument("request", metavar="REQUEST", help="as permissions list names it: <instance>.<n>")
    answer.add_argument("option", metavar="OPTION", nargs="?", help="the optionId to choose")
    answer.add_argument("--cancel", action="store_true", help="answer it cancelled instead of choosing an option")
    for parser in (listing, answer):
        _add_config_option(parser)
        _add_json(parser)


def _add_tasks_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    tasks = commands.add_parser("tasks", help="prompt turns: list, show, cancel, notify, watch")
    actions = tasks.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = actions.add_parser("list", help="tasks, newest first")
    listing.add_argument(
        "--status",
        action="append",
        default=[],
        metavar="S",
        help="queued, running, done, failed, cancelled, timed_out or lost (repeatable, or comma-separated)",
    )
    listing.add_argument("--session", metavar="ID", help="only this session's tasks")
    listing.add_argument("--limit", type=_positive_int, default=50, metavar="N", help="at most N tasks (default 50)")
    show = actions.add_parser("show", help="one task: outcome, progress, recent events")
    show.add_argument("--follow", "-f", action="store_true", help="print events as they happen, until it ends")
    cancel = actions.add_parser("cancel", help="cancel a running or queued turn (session/cancel)")
    cancel.add_argument("--no-wait", action="store_true", help="do not wait for the turn to end")
    notify = actions.add_parser("notify", help="a running or queued task's own notification policy")
    watch = actions.add_parser("watch", help="print task status changes as they happen, until Ctrl-C")
    watch.add_argument("--session", metavar="ID", help="only this session's tasks")
    watch.add_argument(
        "--since",
        type=_duration,
        metavar="D",
        help='first print the tasks whose status changed in the last D ("90s", "15m"), one line each',
    )
    for parser in (listing, show, cancel, notify, watch):
        _add_config_option(parser)
        _add_json(parser)
    for parser in (show, cancel, notify):
        parser.add_argument("id", metavar="ID", help="task id (or a unique prefix of 4+ characters)")
    notify.add_argument(
        "policy",
        metavar="POLICY",
        choices=("done_only", "waiting", "state_changes", "silent", "default"),
        help="done_only, waiting, state_changes, silent, or default (the config's [tasks] notify)",
    )


def _add_metrics_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    metrics = commands.add_parser("metrics", help="the install's metrics in the Prometheus text format")
    _add_config_option(metrics)
    metrics.add_argument(
        "--textfile",
        metavar="PATH",
        help="write them atomically to PATH (node_exporter's textfile collector: a name ending in .prom)",
    )


def _add_top_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    trace = commands.add_parser("trace", help="read a message trace written with --trace")
    trace_actions = trace.add_subparsers(dest="action", metavar="ACTION", required=True)
    trace_show = trace_actions.add_parser("show", help="the trace as an exchange per session")
    trace_show.add_argument("file", metavar="FILE", help="a file written with --trace")
    trace_show.add_argument("--session", metavar="ID", help="only this session (or a prefix of its id)")
    trace_show.add_argument("--json", action="store_true", help="the records grouped per session, as JSON")
    top = commands.add_parser("top", help="a live view of proxies, sessions, turns, the pool and recent events")
    _add_config_option(top)
    top.add_argument("--interval", type=_positive_float, default=1.0, metavar="S", help="seconds between refreshes")
    top.add_argument("--once", action="store_true", help="print one snapshot as a table and exit")
    _add_json(top)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _duration(text: str) -> float:
    """A duration on the command line: ``"15m"`` as in a config, or a bare number of seconds (``30``)."""
    try:
        return configuration.parse_duration(float(text) if text.strip().replace(".", "", 1).isdigit() else text)
    except Exception as exc:  # parse_duration's own message says what it expected
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="PATH",
        default=argparse.SUPPRESS,
        help="TOML config (default: $ACP_PROXY_CONFIG, then the platform config file)",
    )


def _add_serve_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", metavar="NAME", default=argparse.SUPPRESS, help="backend to serve")
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=argparse.SUPPRESS,
        help="stderr log level (default: $ACP_PROXY_LOG_LEVEL or info)",
    )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=argparse.SUPPRESS,
        help="stderr log lines as text or JSON, one event per line (default: $ACP_PROXY_LOG_FORMAT or text)",
    )
    parser.add_argument(
        "--trace",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help="append every wire message, both sides, secrets redacted, to FILE as JSON lines "
        "(default: [trace] file); read it with: acp-proxy trace show FILE",
    )
    parser.add_argument(
        "--async-backend",
        choices=ASYNC_BACKENDS,
        default=argparse.SUPPRESS,
        help="event loop (default: $ACP_PROXY_ASYNC_BACKEND or asyncio)",
    )


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Options before the first ``--``, the adapter's argv after it."""
    args = list(argv)
    if "--" in args:
        cut = args.index("--")
        return args[:cut], args[cut + 1 :]
    return args, []


def _choice_from_env(name: str, choices: Sequence[str], default: str) -> str:
    value = os.environ.get(name, default).lower()
    if value not in choices:
        raise UsageError(f"${name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def load_config(explicit: str | None, command: list[str]) -> Config:
    """The config to serve with: ``-- CMD`` replaces the configured backends."""
    path = configuration.find_config_path(explicit)
    if path is None and not command:
        raise UsageError(
            "no backend to run: pass the adapter command after '--' (acp-proxy -- codex-acp), "
            f"or a config with --config, $ACP_PROXY_CONFIG or {configuration.default_config_path()}"
        )
    if path is None:
        return configuration.adhoc(command)
    loaded = configuration.load(path)
    if not command:
        return loaded

    import msgspec  # loaded with the config already

    adhoc = configuration.adhoc(command)
    # Every section but the backends is the file's (a section added later included).
    return msgspec.structs.replace(loaded, backends=adhoc.backends, default_backend=adhoc.default_backend)


def _serve(args: argparse.Namespace, command: list[str], serve: Serve) -> int:
    level = getattr(args, "log_level", None) or _choice_from_env("ACP_PROXY_LOG_LEVEL", LOG_LEVELS, "info")
    async_backend = getattr(args, "async_backend", None) or _choice_from_env(
        "ACP_PROXY_ASYNC_BACKEND", ASYNC_BACKENDS, "asyncio"
    )
    log_format = getattr(args, "log_format", None) or _choice_from_env("ACP_PROXY_LOG_FORMAT", LOG_FORMATS, "text")
    config = load_config(getattr(args, "config", None), command)
    if getattr(args, "trace", None):
        import msgspec  # loaded with the config already

        config = msgspec.structs.replace(config, trace=msgspec.structs.replace(config.trace, file=args.trace))
    if config.trace.file:
        try:  # asked for and impossible: said now, not found missing after the session
            os.close(os.open(config.trace.file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600))
        except OSError as exc:
            raise UsageError(f"--trace: cannot write {config.trace.file}: {exc.strerror}") from None
    backend = getattr(args, "backend", None)
    try:
        config.backend(backend)
    except KeyError as exc:
        raise UsageError(f"--backend: {exc.args[0]}") from None
    logs.configure(level, log_format)
    from acp_proxy.early_signals import hold_signals_until_serving
    from acp_proxy.ownership.cgroups import CgroupsUnavailable
    from acp_proxy.ownership.owner import Owner
    from acp_proxy.pool.processes import launch_warm

    hold_signals_until_serving()

    state = configuration.state_dir(config)
    try:
        owner = Owner.start(state, grace=config.shutdown.term_grace, cgroups=config.ownership.cgroups)
    except CgroupsUnavailable as exc:
        raise UsageError(str(exc)) from None
    except StateError as exc:
        raise UsageError(f"state: {exc}") from None
    except sqlite3.Error as exc:  # opened, then failed registering or reaping: damaged, full, read-only
        raise UsageError(f"state: {explain_failure(state / DB_NAME, exc)}") from None
    logs.set_instance(owner.instance_id)
    try:
        # Launch the adapter now, before the event loop and the relay are even imported:
        # its start-up then overlaps ours. Nearly every gateway's first request needs it.
        try:
            warm = launch_warm(config, owner, config.backend(backend))
        except Exception:  # the first request starts one instead; a fault of the proxy is worth a trace
            logging.getLogger("acp_proxy.pool").warning("could not launch the adapter ahead", exc_info=True)
            warm = None
        return serve(config, owner, backend, warm, async_backend)
    finally:
        owner.close()


def _token(args: argparse.Namespace) -> int:
    from acp_proxy.remote.tokens import RemoteStore, TokenError
    from acp_proxy.state.directory import ensure_private_dir

    state = _operator_state_dir(args)
    ensure_private_dir(state)
    store = RemoteStore(state)
    try:
        if args.action == "create":
            backends = tuple(args.backend) if args.backend else None
            config = _operator_config(args)
            unknown = [b for b in backends or () if config is None or b not in config.backends]
            if unknown and config is not None:
                raise UsageError(f"--backend: no backend named {unknown[0]!r} in the config")
            token, secret = store.create(args.name, backends=backends, sees=args.sees)
            print(secret)
            limits = f"backends {', '.join(backends)}" if backends else "any backend"
            print(
                f"token {token.name} ({token.token_id}): {limits}, sees {token.sees} sessions; "
                "shown once, only its hash is kept",
                file=sys.stderr,
            )
            return 0
        if args.action == "revoke":
            token = store.revoke(args.name)
            print(f"revoked {token.name} ({token.token_id}); a running serve ends its connections within 5 s")
            return 0
        tokens = store.tokens()
        if args.json:
            import json

            print(json.dumps([_token_view(t) for t in tokens], indent=2))
            return 0
        if not tokens:
            print("no tokens: make one with acp-proxy token create NAME")
        for t in tokens:
            view = _token_view(t)
            print(f"{t.name:<20} {t.token_id}  {view['state']:<8} backends={view['backends'] or 'any'} sees={t.sees}")
        return 0
    except TokenError as exc:
        raise UsageError(str(exc)) from None
    finally:
        store.close()


def _token_view(token: object) -> dict[str, object]:
    from acp_proxy.remote.tokens import Token

    assert isinstance(token, Token)
    return {
        "name": token.name,
        "id": token.token_id,
        "state": "revoked" if token.revoked_at is not None else "live",
        "backends": list(token.backends) if token.backends is not None else None,
        "sees": token.sees,
        "createdAt": token.created_at,
        "revokedAt": token.revoked_at,
    }


def _serve_network(
    args: argparse.Namespace,
    options: list[str],
    command: list[str],
    run: Callable[[Sequence[str]], int],
    preload: Callable[[str], None] | None,
) -> int:
    """``serve --listen/--socket``: each connection gets a stdio proxy with the options given here, ``run``
    in a child of the launcher (``remote/launcher.py``) once ``preload`` has imported it there."""
    level = getattr(args, "log_level", None) or _choice_from_env("ACP_PROXY_LOG_LEVEL", LOG_LEVELS, "info")
    log_format = getattr(args, "log_format", None) or _choice_from_env("ACP_PROXY_LOG_FORMAT", LOG_FORMATS, "text")
    async_backend = getattr(args, "async_backend", None) or _choice_from_env(
        "ACP_PROXY_ASYNC_BACKEND", ASYNC_BACKENDS, "asyncio"
    )
    config = load_config(getattr(args, "config", None), command)
    backend = getattr(args, "backend", None)
    try:
        default = config.backend(backend).name
    except KeyError as exc:
        raise UsageError(f"--backend: {exc.args[0]}") from None
    from acp_proxy.remote import server
    from acp_proxy.remote.hub import Limits
    from acp_proxy.remote.launcher import Launcher
    from acp_proxy.remote.replay import ReplayLimits

    try:
        listen = [server.parse_listen(text) for text in args.listen]
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together")
    exposed = [f"{host}:{port}" for host, port in listen if not server.is_loopback(host)]
    if exposed and not args.tls_cert and not args.no_tls:
        raise UsageError(
            f"--listen {exposed[0]} is not loopback: tokens would cross the network in clear text; "
            "pass --tls-cert and --tls-key, or --no-tls when a TLS-terminating proxy is in front"
        )
    for path in (args.tls_cert, args.tls_key):
        if path and not os.access(path, os.R_OK):
            raise UsageError(f"cannot read {path}")
    state = configuration.state_dir(config)
    from acp_proxy.state.directory import ensure_private_dir

    ensure_private_dir(state)
    shutdown = config.shutdown
    proxy_args = server.proxy_args(_proxy_options(options), command, async_backend)
    serve_options = server.ServeOptions(
        state_dir=state,
        proxy_argv=[sys.executable, "-m", "acp_proxy", *proxy_args],
        listen=listen,
        unix_socket=Path(args.socket).absolute() if args.socket else None,
        tls_cert=Path(args.tls_cert) if args.tls_cert else None,
        tls_key=Path(args.tls_key) if args.tls_key else None,
        allowed_origins=list(args.allow_origin),
        limits=Limits(
            max_connections=args.max_connections,
            max_per_principal=args.max_connections_per_token,
            max_pending=args.max_pending,
            max_message_bytes=config.max_line_bytes,
            resume_grace=args.resume_grace,
            linger=args.linger,
            stall_timeout=args.stall_timeout,
            replay=ReplayLimits(messages=args.replay_buffer, seconds=args.resume_grace),
        ),
        proxy_exit_grace=shutdown.stdin_grace + shutdown.close_timeout + 2 * shutdown.term_grace + 5,
        default_backend=default,
    )
    launcher = None
    if preload is not None and Launcher.available():
        launcher = Launcher.start(run, proxy_args, lambda: preload(async_backend))  # before any thread or socket
    logs.configure(level, log_format)
    gc.enable()
    import anyio

    try:
        return anyio.run(server.serve_network, serve_options, launcher, backend=async_backend)
    except OSError as exc:
        raise UsageError(f"cannot listen: {exc.strerror or exc}") from None
    finally:
        if launcher is not None:
            launcher.close()


def _proxy_options(options: list[str]) -> list[str]:
    """The options of a ``serve`` command line that its connections' stdio proxies take too."""
    taken = {"--config", "--backend", "--log-level", "--log-format", "--trace"}
    kept: list[str] = []
    it = iter(options)
    for option in it:
        name, eq, value = option.partition("=")
        if name in taken:
            value = value if eq else next(it, "")
            if name in ("--config", "--trace"):
                value = str(Path(value).absolute())
            kept += [name, value]
    return kept


def _connect(args: argparse.Namespace) -> int:
    level = getattr(args, "log_level", None) or _choice_from_env("ACP_PROXY_LOG_LEVEL", LOG_LEVELS, "info")
    logs.configure(level, "text")
    token = None
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as exc:
            raise UsageError(f"--token-file: cannot read {args.token_file}: {exc.strerror}") from None
    else:
        token = os.environ.get("ACP_PROXY_TOKEN") or None
    from acp_proxy.remote import bridge

    try:
        target = bridge.Target.parse(args.url, token)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return bridge.run(target, eof_grace=args.eof_grace)


def _config_check(args: argparse.Namespace) -> int:
    from acp_proxy.operator.doctor import unset_consequence

    path = configuration.find_config_path(getattr(args, "config", None))
    if path is None:
        raise UsageError(
            f"no config found: pass --config PATH, set $ACP_PROXY_CONFIG, "
            f"or create {configuration.default_config_path()}"
        )
    try:
        config = configuration.load(path)
    except ConfigError as exc:
        count = len(exc.problems)
        print(f"{path}: {count} problem{'s' if count != 1 else ''}", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return EXIT_USAGE
    print(f"{path}: OK")
    default = config.default_backend or (next(iter(config.backends)) if len(config.backends) == 1 else None)
    for name, backend in sorted(config.backends.items()):
        mark = " (default)" if name == default else ""
        print(f"  backend {name}{mark}: {' '.join(backend.command)}")
    print(f"  state dir: {configuration.state_dir(config)}")
    unset = sorted(v for v in configuration.referenced_variables(config) if v not in os.environ)
    for name in unset:
        print(f"  note: ${{{name}}} is not set in this environment; {unset_consequence(name, config)}")
    return 0


def _operator_config(args: argparse.Namespace) -> Config | None:
    """The config, if one is found, for the state dir and grace periods of operator commands."""
    path = configuration.find_config_path(getattr(args, "config", None))
    return configuration.load(path) if path is not None else None


def _leases(args: argparse.Namespace) -> int:
    from acp_proxy.operator.commands import leases_command

    state = configuration.state_dir(_operator_config(args))
    return leases_command(state, as_json=args.json, show_all=args.all)


def _reap(args: argparse.Namespace) -> int:
    from acp_proxy.operator.commands import reap_command

    config = _operator_config(args)
    grace = config.shutdown.term_grace if config else configuration.ShutdownConfig().term_grace
    return reap_command(configuration.state_dir(config), grace=grace, dry_run=args.dry_run, as_json=args.json)


def _status(args: argparse.Namespace) -> int:
    from acp_proxy.operator import reports

    config = _operator_config(args)
    setting = config.ownership.cgroups if config is not None else "auto"
    return reports.status(configuration.state_dir(config), as_json=args.json, cgroups=setting)


def _sessions(args: argparse.Namespace) -> int:
    from acp_proxy.operator import reports

    if args.action == "prune":
        from acp_proxy.operator.commands import prune_command

        config = _operator_config(args)
        keep = (config.sessions if config is not None else configuration.SessionsConfig()).keep_suspended
        older_than = keep if args.older_than is None else args.older_than
        return prune_command(
            configuration.state_dir(config), older_than=older_than, dry_run=args.dry_run, as_json=args.json
        )
    state = _operator_state_dir(args)
    if args.action == "list":
        return reports.sessions_list(state, states=args.state, show_all=args.all, as_json=args.json)
    if args.action == "show" and args.transcript:
        from acp_proxy.operator.permissions import transcript_show

        return transcript_show(state, args.id, as_json=args.json)
    if args.action == "show":
        return reports.sessions_show(state, args.id, as_json=args.json)
    return reports.sessions_act(state, args.id, action=args.action, as_json=args.json)


def _permissions(args: argparse.Namespace) -> int:
    from acp_proxy.operator import permissions

    state = _operator_state_dir(args)
    if args.action == "list":
        return permissions.permissions_list(state, as_json=args.json)
    if args.cancel == (args.option is not None):
        raise UsageError("permissions answer: give an OPTION, or --cancel")
    return permissions.permissions_answer(state, args.request, None if args.cancel else args.option, as_json=args.json)


def _tasks(args: argparse.Namespace) -> int:
    from acp_proxy.operator import reports

    state = _operator_state_dir(args)
    if args.action == "list":
        statuses = reports.parse_statuses(args.status)
        return reports.tasks_list(
            state, statuses=statuses, session_id=args.session, limit=args.limit, as_json=args.json
        )
    if args.action == "show":
        return reports.tasks_show(state, args.id, follow=args.follow, as_json=args.json)
    if args.action in ("notify", "watch"):
        from acp_proxy.operator import notices

        if args.action == "watch":
            return notices.tasks_watch(state, session_id=args.session, since=args.since, as_json=args.json)
        return notices.tasks_notify(state, args.id, args.policy, as_json=args.json)
    return reports.tasks_cancel(state, args.id, wait=not args.no_wait, as_json=args.json)


def _top(args: argparse.Namespace) -> int:
    from acp_proxy.operator import top

    config = _operator_config(args)
    return top.run(
        configuration.state_dir(config),
        interval=args.interval,
        max_live=config.pool.max_live if config else None,
        max_memory=config.pool.max_memory if config else None,
        once=args.once,
        as_json=args.json,
    )


def _operator_state_dir(args: argparse.Namespace) -> Path:
    return configuration.state_dir(_operator_config(args))


def _metrics(args: argparse.Namespace) -> int:
    from acp_proxy.operator.metrics import metrics_command

    config = _operator_config(args)
    return metrics_command(configuration.state_dir(config), config, textfile=args.textfile)


OPERATOR_COMMANDS = {
    "status": _status,
    "sessions": _sessions,
    "permissions": _permissions,
    "tasks": _tasks,
    "metrics": _metrics,
    "top": _top,
}


def _database_path(args: argparse.Namespace) -> Path | None:
    """The state database a failing command was using, to name it in the message."""
    try:
        return _operator_state_dir(args) / DB_NAME
    except (ConfigError, OSError):
        return None


def _fail(message: str) -> NoReturn:
    print(f"acp-proxy: {message}", file=sys.stderr)
    sys.exit(EXIT_USAGE)


def main(argv: Sequence[str] | None, serve: Serve, preload: Callable[[str], None] | None = None) -> int:
    """Run one command line; ``serve`` runs the proxy itself (the composition root, handed in from above),
    ``preload`` imports what it runs on an event loop (for ``serve --listen``'s launcher)."""
    options, command = split_command(sys.argv[1:] if argv is None else argv)
    args = parse_options(options)
    if args.command not in (None, "serve"):
        gc.enable()  # off while starting (acp_proxy.__main__); a proxy turns it on once it serves
    try:
        if args.command == "config":
            return _config_check(args)
        if args.command == "doctor":
            return _doctor(args)
        if args.command == "leases":
            return _leases(args)
        if args.command == "reap":
            return _reap(args)
        if args.command == "trace":
            from acp_proxy.operator.trace_show import trace_show

            return trace_show(Path(args.file), session=args.session, as_json=args.json)
        if args.command in OPERATOR_COMMANDS:
            return OPERATOR_COMMANDS[args.command](args)
        if args.command == "token":
            return _token(args)
        if args.command == "connect":
            return _connect(args)
        if args.command == "serve" and (args.listen or args.socket):
            return _serve_network(args, options, command, lambda argv: main(argv, serve, preload), preload)
        return _serve(args, command, serve)
    except (ConfigError, UsageError) as exc:
        _fail(str(exc))
    except StateError as exc:
        _fail(f"state: {exc}")
    except PermissionError as exc:
        _fail(f"permission denied: {exc.filename or exc}" + (f" ({exc.strerror})" if exc.filename else ""))
    except KeyboardInterrupt:
        return 130
    except sqlite3.Error as exc:
        path = _database_path(args)
        print(f"acp-proxy: state: {explain_failure(path, exc) if path else exc}", file=sys.stderr)
        return 1 if isinstance(exc, sqlite3.OperationalError) else EXIT_USAGE
    except Exception as exc:
        from acp_proxy.operator.reports import OperatorError

        if not isinstance(exc, OperatorError):
            raise
        print(f"acp-proxy: {exc}", file=sys.stderr)
        return exc.exit_code
