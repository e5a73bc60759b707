"""install-acpx-*: the install's one pool across proxies.

acpx runs a queue owner, hence a proxy, per named session; three named sessions over one state
dir whose config says ``max_live = 1`` (and a generous acquire_timeout). sessions new x3,
prompts one/two/three/one, then set-mode two/three/one one at a time and all three at once: each
step needs its session's adapter, so another proxy must suspend its session first, and the step
must bring the session back on a new process. Meanwhile a thread samples /proc every 50 ms for
the check's adapter trees and fails the check if two were ever alive at once, and another runs
``acp-proxy status --json`` about every second (at most one slot held; ``watches``). Then the
queue owners are stopped (SIGTERM, as stopping acpx does), nothing may be left, and a fresh
proxy's session/load must replay each session's prompts, whole and apart. acpx drops its
agent's stderr, so the proxies' logs are appended to WORKDIR/logs/<check>-proxies.stderr (the
agent command is ``sh -c 'exec acp-proxy ... 2>>LOG'``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tests.kit import markers

from .harness import MARKER_VAR, PROMPT_TIMEOUT, Peers, end
from .probe import SessionProbe
from .report import CheckFailed
from .watches import SlotWatch, TreeWatch
from .wire import (
    FIRST_WORDS,
    OTHER_WORDS,
    SECOND_WORDS,
    THIRD_WORDS,
    checked_words,
    foreign_session_ids,
    json_lines,
    proxy_error,
    session_modes,
)

# The install-* checks: acpx named sessions, each its own queue owner and so its own proxy,
# over one state dir whose pool has one process slot. The queue owners must outlive the
# check's steps (a codex-acp turn takes half a minute offline); they are stopped at the end.
INSTALL_SESSIONS = ("one", "two", "three")
INSTALL_TTL = 600
INSTALL_POOL = 'acquire_timeout = "3m"  # three proxies may queue for the slot at once\n'


def install_acpx(peers: Peers, name: str, adapter: str) -> str:
    """acpx named sessions, each served by its own proxy (acpx's queue owners), one state dir, ``max_live = 1``.

    Every step needs its session's adapter, which only another proxy's eviction makes
    room for; /proc is sampled throughout, and ``acp-proxy status --json``.
    """
    command, env, marker = peers.session_setup(name, adapter, pool=INSTALL_POOL)
    log = peers.logs / f"{name}.stderr"
    proxies_log = peers.logs / f"{name}-proxies.stderr"
    audit_log = peers.logs / f"{name}-audit.stderr"
    for path in (log, proxies_log, audit_log):
        path.unlink(missing_ok=True)
    # acpx drops its agent's stderr (and its queue owner's): each proxy appends its log here.
    agent = ["/bin/sh", "-c", 'exec "$@" 2>>"$0"', str(proxies_log), *command]
    acpx = AcpxSteps(peers, agent, env, log, proxies_log)
    problems: list[str] = []
    status_env = {k: v for k, v in env.items() if k != MARKER_VAR}  # not one of the check's processes
    begun = time.monotonic()
    with TreeWatch(marker) as trees, SlotWatch([*command, "status", "--json"], status_env, peers.ws) as slots:
        try:
            ids = install_steps(peers, acpx, problems)
        except BaseException:
            stop_queue_owners(marker)
            peers.runs.leftovers(marker, wait=20)
            raise
        finally:
            (peers.logs / f"{name}.stdout").write_text(json.dumps(acpx.outputs, indent=1))
        owners = stop_queue_owners(marker)
        # The gateways are gone: each proxy suspends its session and exits, its tree reaped.
        peers.check_leftovers(name, "proxy", marker, wait=30)
        stopped = time.monotonic()
        replays, last_slot = install_audit(peers, command, env, audit_log, ids, slots, problems)
        peers.check_leftovers(name, "proxy", marker, wait=5)
    elapsed = watched = time.monotonic() - begun

    if trees.samples < 10:
        raise CheckFailed(f"the /proc sampler took {trees.samples} samples only")
    if trees.peak > 1:
        problems.append(f"{trees.peak} adapter trees alive at once: {'; '.join(trees.overlaps)}")
    if slots.peak > 1:
        problems.append(f"acp-proxy status --json showed {slots.peak} slots held: {'; '.join(slots.crowded)}")
    if slots.samples == 0:
        problems.append(f"acp-proxy status --json never answered: {'; '.join(slots.failures)}")
    if trees.peak_proxies < len(ids):
        problems.append(f"at most {trees.peak_proxies} proxies ran at once: acpx did not keep one per session alive")
    if len(owners) < len(ids):
        problems.append(f"{len(owners)} acpx queue owners were running at the end, not {len(ids)}")
    words = {"one": [FIRST_WORDS, SECOND_WORDS], "two": [OTHER_WORDS], "three": [THIRD_WORDS]}
    for session, wanted in words.items():
        got = checked_words(replays.get(session) or [])
        if got != wanted:
            problems.append(f"session/load of {session} replayed {got}, expected {wanted}")
    if last_slot != ids["three"]:
        problems.append(f"after loading three, status --json showed the slot held by {last_slot!r}")
    text = proxies_log.read_text(errors="replace")
    across = len(re.findall(r"session \S+ suspended \([^)]*for another proxy\)", text))
    asked = text.count("pool: asking proxy")
    within = len(re.findall(r"session \S+ suspended \((?![^)]*for another proxy)", text))
    afresh = {s: len(re.findall(rf"session {re.escape(sid)} started afresh", text)) for s, sid in ids.items()}
    if any(count > 1 for count in afresh.values()):
        problems.append(f"sessions started afresh more than once (history lost after a turn): {afresh}")
    audit_text = audit_log.read_text(errors="replace")
    audit_evictions = len(re.findall(r"session \S+ suspended \(", audit_text))
    holders = sorted(session for session, sid in ids.items() if sid in slots.holders)
    peers.report.note(
        name,
        f"{len(acpx.steps)} acpx commands in {stopped - begun:.0f}s: "
        + ", ".join(f"{label} {seconds:.1f}s" for label, seconds in acpx.steps),
    )
    if problems:
        raise CheckFailed("; ".join(problems))
    period = watched / trees.samples * 1000
    return (
        f"3 acpx sessions, up to {trees.peak_proxies} proxies at once on one state dir, max_live = 1: "
        f"peak live adapter trees {trees.peak} ({trees.samples} /proc samples, one per {period:.0f} ms, "
        f"slowest {trees.slowest * 1000:.0f} ms; {len(trees.seen)} trees in all, {trees.handovers} passes "
        f"caught a handover); status --json slots at most {slots.peak} ({slots.samples} samples; held for "
        f"{', '.join(holders)}); {across} evictions across proxies ({asked} asked), {within} within a proxy, "
        f"{audit_evictions} in the audit proxy; every step brought its session back on a new process, and "
        "session/load through a fresh proxy replayed each conversation whole and apart; nothing left running; "
        f"{elapsed:.0f}s"
    )


def install_steps(peers: Peers, acpx: AcpxSteps, problems: list[str]) -> dict[str, str]:
    """sessions new, interleaved prompts, then set-mode one at a time and all at once; the acpx ids."""
    ids: dict[str, str] = {}
    for session in INSTALL_SESSIONS:
        rc, _ = acpx.run(f"new {session}", "sessions", "new", "--name", session)
        if rc != 0:
            raise CheckFailed(f"acpx sessions new --name {session} exited {rc} (see {acpx.log})")
        ids[session] = peers.acpx_session_id(acpx.agent, session, acpx.env, acpx.log)
    acpx.ids = ids
    options = ("--format", "json", "--approve-all", "--ttl", str(INSTALL_TTL), "--timeout", f"{PROMPT_TIMEOUT:.0f}")
    # Each prompt reaches the queue owner of its session (started by the first), whose proxy
    # must take the install's one slot from the proxy of the session before it.
    for session, words in (
        ("one", FIRST_WORDS),
        ("two", OTHER_WORDS),
        ("three", THIRD_WORDS),
        ("one", SECOND_WORDS),
    ):
        rc, messages = acpx.run(f"prompt {session}", *options, "prompt", "-s", session, words, restores=session)
        if not any(isinstance(m, dict) and m.get("method") == "session/prompt" for m in messages):
            raise CheckFailed(f"acpx prompt -s {session} exited {rc} before session/prompt (see {acpx.log})")
    current, modes = session_modes([m for out in acpx.outputs for m in out["messages"]])
    other = next((mode for mode in modes if mode != current), None)
    if current is None or other is None:
        raise CheckFailed(f"no mode to set: the sessions offered {modes} (current {current})")
    # set-mode through the running queue owners: the proxy must bring the session back first.
    for session in ("two", "three", "one"):
        rc, _ = acpx.run(f"set-mode {session}", "set-mode", "-s", session, other, restores=session)
        if rc != 0:
            problems.append(f"acpx set-mode -s {session} {other} exited {rc} (see {acpx.log})")
    # All three at once: three proxies queue for the one slot, first come, first served.
    with ThreadPoolExecutor(len(INSTALL_SESSIONS)) as pool:
        futures = {
            session: pool.submit(acpx.run, f"set-mode {session} (together)", "set-mode", "-s", session, current)
            for session in INSTALL_SESSIONS
        }
        results = {session: future.result() for session, future in futures.items()}
    for session, (rc, _) in results.items():
        if rc != 0:
            problems.append(f"acpx set-mode -s {session} {current} (together) exited {rc} (see {acpx.log})")
    problems += acpx.missed
    seen = [m for out in acpx.outputs for m in out["messages"]]
    problems += [f"acpx saw {leak}" for leak in foreign_session_ids(seen, set(ids.values()))]
    after = {session: peers.acpx_session_id(acpx.agent, session, acpx.env, acpx.log) for session in ids}
    if after != ids:
        problems.append(f"acpx's records moved from {ids} to {after}")
    return ids


def install_audit(
    peers: Peers,
    command: list[str],
    env: dict[str, str],
    log: Path,
    ids: dict[str, str],
    slots: SlotWatch,
    problems: list[str],
) -> tuple[dict[str, list[str]], str | None]:
    """A fresh proxy on the state dir: every session listed and loaded, its prompts replayed."""
    gateway, _ = peers.session_gateway(command, env, log)
    replays: dict[str, list[str]] = {}
    try:
        probe = SessionProbe(gateway, peers.ws, problems)
        listed = probe.states()
        missing = [session for session, sid in ids.items() if sid not in listed]
        if missing:
            problems.append(f"after the queue owners stopped, session/list lacked {missing}: {listed}")
        for session, sid in ids.items():
            replays[session] = probe.restore("session/load", sid, session) or []
        held = slots.sample()
        last = next((str(view.get("sessionId")) for view in held), None)
        peers.end_gateway(gateway, "the audit")
    finally:
        end(gateway)
    return replays, last


class AcpxSteps:
    """The acpx commands of an install-* check, each through the proxy; what each printed, and how long it took."""

    def __init__(self, peers: Peers, agent: list[str], env: dict[str, str], log: Path, proxies_log: Path) -> None:
        self.peers = peers
        self.agent = agent
        self.env = env
        self.log = log
        self.proxies_log = proxies_log
        self.ids: dict[str, str] = {}
        self.outputs: list[dict[str, Any]] = []
        self.steps: list[tuple[str, float]] = []
        self.missed: list[str] = []
        """Steps that should have brought their session back on a new process and did not."""

    def run(self, label: str, *args: str, restores: str | None = None) -> tuple[int, list[Any]]:
        """acpx ``args``; with ``restores`` (a session's name), that session must have come back meanwhile."""
        before = self.restores(restores)
        begun = time.monotonic()
        rc, out = self.peers.acpx(self.agent, *args, env=self.env, log=self.log, timeout=PROMPT_TIMEOUT + 60)
        self.steps.append((label, time.monotonic() - begun))
        messages = json_lines(out)
        self.outputs.append({"step": label, "exit": rc, "messages": messages})
        reasons = [proxy_error(m) for m in messages if proxy_error(m)]
        if reasons:
            raise CheckFailed(f"acpx {label} got the proxy's error {reasons[0]} (see {self.log}, {self.proxies_log})")
        if restores is not None and self.restores(restores) <= before:
            self.missed.append(f"acpx {label}: {restores} did not come back on a new process")
        return rc, messages

    def restores(self, session: str | None) -> int:
        """How often the proxies brought ``session`` back on a new process so far."""
        if session is None or session not in self.ids or not self.proxies_log.exists():
            return 0
        pattern = rf"session {re.escape(self.ids[session])} (?:resumed|started afresh) on pid"
        return len(re.findall(pattern, self.proxies_log.read_text(errors="replace")))


def stop_queue_owners(marker: str) -> list[int]:
    """SIGTERM acpx's queue owners of a run (as stopping acpx would); their pids."""
    owners = [m for m in markers.find(MARKER_VAR, marker).values() if "__queue-owner" in m.argv]
    for owner in owners:
        if markers.alive(owner.pid, owner.ticks):
            with contextlib.suppress(ProcessLookupError):
                os.kill(owner.pid, signal.SIGTERM)
    return [owner.pid for owner in owners]
