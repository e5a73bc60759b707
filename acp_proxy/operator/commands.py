"""Operator commands over the state database: ``acp-proxy leases``, ``acp-proxy reap``, ``sessions prune``.

They read the database directly, so they work with no proxy running. Human
output is a plain table; ``--json`` is for scripts. Nothing here is imported by
the relay.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import psutil

from acp_proxy.config import referenced_names
from acp_proxy.journal import Journal
from acp_proxy.ownership import instances
from acp_proxy.ownership.leases import ACTIVE_STATES, Lease, all_leases
from acp_proxy.ownership.owner import detect_platform
from acp_proxy.ownership.reaping import marked_pids, reap_dead_instances
from acp_proxy.ownership.verify import Verdict, check_claim, process_table
from acp_proxy.sessions.registry import SessionRegistry
from acp_proxy.sessions.retention import retire_suspended
from acp_proxy.state import StateDB
from acp_proxy.state.connection import StateError


def open_existing(state_dir: Path) -> StateDB | None:
    """The state database if one exists; ``None`` when no proxy has used this state dir yet."""
    if not (state_dir / "state.db").exists():
        return None
    return StateDB(state_dir, create=False)


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def expanded_values(lease: Lease, pids: list[int]) -> dict[str, str]:
    """``{value: "${NAME}"}`` for each ``${NAME}`` in the lease's argv, as the proxy expanded it.

    The live command lines of a lease's tree carry the values (often secrets) that were
    expanded into the adapter's argv; the lease records only the template. The values are
    read from the tree's environment, which is the one the proxy expanded them from.
    """
    names = referenced_names(lease.argv)
    for pid in pids if names else []:
        try:
            environ = psutil.Process(pid).environ()
        except psutil.Error:
            continue
        return {environ[name]: f"${{{name}}}" for name in names if environ.get(name)}
    return {}


def redact(command: str, values: dict[str, str]) -> str:
    for value in sorted(values, key=len, reverse=True):
        command = command.replace(value, values[value])
    return command


def owned_tree(lease: Lease) -> list[dict[str, Any]]:
    """Live processes carrying the lease's marker and proved ours, with what an operator needs.

    Command lines are shown with ``${NAME}`` in place of what the config expanded into them.
    """
    table = process_table()
    pids = [
        pid
        for pid in marked_pids(lease, table)
        if check_claim(lease.descendant_claim(pid), table).verdict is Verdict.OURS
    ]
    hidden = expanded_values(lease, pids)
    tree = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            with proc.oneshot():
                rss = proc.memory_info().rss
                command = " ".join(proc.cmdline()) or proc.name()
        except psutil.Error:
            continue
        tree.append({"pid": pid, "pgid": os.getpgid(pid), "rssBytes": rss, "command": redact(command, hidden)})
    return sorted(tree, key=lambda entry: entry["pid"])


def lease_view(db: StateDB, lease: Lease, alive: dict[str, bool]) -> dict[str, Any]:
    if lease.instance_id not in alive:
        alive[lease.instance_id] = instances.instance_alive(db, lease.instance_id)
    view: dict[str, Any] = {
        "lease": lease.lease_id,
        "state": lease.state.value,
        "backend": lease.backend,
        "session": lease.session_key,
        "instance": lease.instance_id,
        "instanceAlive": alive[lease.instance_id],
        "wrapperPid": lease.wrapper_pid,
        "adapterPid": lease.adapter_pid,
        "pgid": lease.pgid,
        "argv": list(lease.argv),
        "commandHash": lease.command_hash,
        "createdAt": lease.created_at,
        "updatedAt": lease.updated_at,
        "reason": lease.reason,
        "processes": [],
    }
    if lease.state in ACTIVE_STATES:
        claim = lease.wrapper_claim()
        verdict = check_claim(claim).verdict if claim else None
        if verdict is Verdict.UNVERIFIABLE:
            view["reason"] = check_claim(claim).reason if claim else None
        view["processes"] = owned_tree(lease)
    return view


def leases_command(state_dir: Path, *, as_json: bool, show_all: bool) -> int:
    platform = detect_platform(process_table())
    db = open_existing(state_dir)
    views: list[dict[str, Any]] = []
    if db is not None:
        alive: dict[str, bool] = {}
        try:
            rows = all_leases(db, limit=10_000 if show_all else 50)
            views = [lease_view(db, lease, alive) for lease in rows]
        finally:
            db.close()
    if as_json:
        print(json.dumps({"stateDir": str(state_dir), "ownership": platform.describe(), "leases": views}, indent=2))
        return 0
    print(f"state dir: {state_dir}")
    print(f"ownership: {platform.describe()}")
    if not views:
        print("no leases" + ("" if db is not None else " (no proxy has used this state dir yet)"))
        return 0
    now = time.time()
    header = f"{'LEASE':<13} {'STATE':<12} {'BACKEND':<12} {'INSTANCE':<20} {'WRAPPER':>8} {'ADAPTER':>8} {'AGE':>5}"
    print(header)
    for view in views:
        instance = f"{view['instance']} ({'alive' if view['instanceAlive'] else 'dead'})"
        print(
            f"{view['lease']:<13} {view['state']:<12} {view['backend'][:12]:<12} {instance:<20} "
            f"{view['wrapperPid'] or '-':>8} {view['adapterPid'] or '-':>8} {_age(now - view['createdAt']):>5}"
        )
        if view["reason"]:
            print(f"    {view['reason']}")
        for proc in view["processes"]:
            print(
                f"    pid {proc['pid']:<7} pgid {proc['pgid']:<7} rss {proc['rssBytes'] / 1e6:7.1f} MB  "
                f"{proc['command'][:80]}"
            )
    return 0


def reap_command(state_dir: Path, *, grace: float, dry_run: bool, as_json: bool) -> int:
    db = open_existing(state_dir)
    actions = []
    if db is not None:
        try:
            actions = reap_dead_instances(db, None, grace=grace, dry_run=dry_run)
        finally:
            db.close()
    if as_json:
        print(json.dumps({"dryRun": dry_run, "actions": [a.to_json() for a in actions]}, indent=2))
        return 0
    if not actions:
        print("nothing to reap: no dead proxy left an active lease")
        return 0
    prefix, verb = ("[dry run] ", "would kill") if dry_run else ("", "killed")
    for action in actions:
        kills = f"; {verb} {action.signalled}" if action.signalled else ""
        print(
            f"{prefix}lease {action.lease_id} ({action.backend}, dead instance {action.instance_id}): "
            f"{action.before} -> {action.after} ({action.reason}){kills}"
        )
        for refusal in action.refused:
            print(f"    left alone: {refusal}")
    return 0


def prune_command(state_dir: Path, *, older_than: float, dry_run: bool, as_json: bool) -> int:
    """``sessions prune``: close the sessions suspended longer than ``older_than`` seconds (as ``keep_suspended``)."""
    db = open_existing(state_dir)
    retired = []
    if db is not None:
        try:
            journal = None if dry_run else Journal(db, None)
            registry = SessionRegistry(db, None)  # type: ignore[arg-type]  # it writes nothing of its own instance
            retired = retire_suspended(registry, journal, older_than, dry_run=dry_run, by="operator")
            db.stop_writer()  # the journal's write applied before the database is closed
        finally:
            db.close()
    if as_json:
        closed = [{"sessionId": r.session_id, "backend": r.backend, "lastActiveAt": r.last_active_at} for r in retired]
        print(json.dumps({"dryRun": dry_run, "olderThanSeconds": older_than, "closed": closed}, indent=2))
        return 0
    if not retired:
        print(f"nothing to prune: no session suspended for more than {_age(older_than)}")
        return 0
    verb = "[dry run] would close" if dry_run else "closed"
    for record in retired:
        idle = _age(max(0.0, time.time() - record.last_active_at))
        print(f"{verb} {record.session_id} ({record.backend}, last active {idle} ago)")
    print(f"{len(retired)} session(s) {'would be ' if dry_run else ''}closed; session/load brings one back")
    return 0


__all__ = ["StateError", "leases_command", "prune_command", "reap_command"]
