"""Chaos soak: a seeded random gateway against real proxies of one install, with faults, then every invariant checked.

Several proxies share one state dir, hence one pool, as they do when acpx or openab start
one agent process per session: a multiplexing proxy driven by several workers, and a few
acpx-style proxies with one or two sessions each, all under one ``[pool] max_live`` (below
the number of sessions) and a cap of one process for the ``beta`` backend. Each proxy is
restarted on the same state dir after each of its ends, as its gateway would relaunch it.
Every worker has sessions of its own over three backends of the fake adapter (``alpha``:
resume and load, modes; ``beta``: load only, modes, chatty; ``gamma``: ignores SIGTERM
and stdin EOF, turns time out after 2 s). Operations: session/new, prompt (streaming,
spawning a tree, escaping with setsid and a double fork), a burst of concurrent prompts
on every session a worker has open, cancel, close, load (of open and of closed sessions:
close is not delete), delete, list, set_mode, a prompt to a closed or deleted session,
a ``state`` prompt that asks the adapter what it knows, and now and then an attach: another
proxy of the install, started for the operation, attaches to a session as an observer
(``session/attach``) around a turn through the session's own proxy, then detaches or leaves.
Sessions of different proxies take each other's slots: the least recently used idle one of
the install is suspended through its proxy's control socket. Faults: an adapter crash mid-turn, an adapter hang
(turn_idle_timeout, else the turn timeout, ends it), the stubborn backend's teardown, grandchild escapes, and
each proxy's end, drawn per lifetime: a clean gateway EOF, a gateway EOF in the middle of
turns, SIGKILL of the proxy (holding slots, as it usually is), or SIGKILL while it waits
for a slot in the install's queue. What a killed proxy left is cleared by whichever proxy of the
install looks first: the next one to start, or a running one (every second, ``reap_interval``).
Decoy processes that look like the proxies' own run
throughout.

The install's cap is checked from ``/proc``, never from what the proxies count: after
every operation and every 20 ms in between, the live adapter processes of the run (and
their whole trees, which hold their slots until they are gone, a killed proxy's orphans
included) must number at most ``max_live``. A count over the cap is read again before it
is reported, so that a process that ended while ``/proc`` was read is not counted with
its successor.

Checked after the run: no process with the run's marker survives, every decoy is alive
(nothing outside the leases was signalled), every request got exactly one answer
(except those in flight when a proxy was SIGKILLed: those are counted), every session
not deleted (a closed one by the gateway's own load) is still resumable with its
history (``session/load`` replays what the adapter reports, its completed turns are
within what the gateway saw, its mode is the last one set), ``session/list`` agrees
(closed sessions listed as closed, deleted ones not at all), the database passes
``PRAGMA integrity_check``, and every task and lease has ended. Each ``state`` prompt
checks turns and mode along the way too, and each attach its answer, its replay, and that the
observer got exactly the updates of the turn its session's gateway got (``Worker.attach``);
a holder ending meanwhile is an outcome (``attach_ended``, ``holder_gone``), counted.

The sequence of operations and faults follows from the seed; the interleaving of the
workers and proxies depends on timing, as it would in production. ``scripts/soak --ops N``
runs it from the shell; ``tests/test_soak.py`` runs a bounded version.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import anyio.abc
import psutil

from acp_proxy.concurrency import Changes
from acp_proxy.ownership import cgroups
from acp_proxy.pool.install import ALL, QUEUE, SLOTS_DIR, InstallSlots
from tests.conformance import ConformanceError, Conversation
from tests.kit import markers, proctree
from tests.kit.gateway import Closed, Gateway
from tests.support import MARKER_VARIABLE, end_run, fake_command, install_cgroups, marked_processes, scratch_run

ANSWER_TIMEOUT = 150.0
"""A request may wait acquire_timeout (45 s) for a slot, then a start and a turn, behind another of its session."""
SESSION_NOT_FOUND = -32002
MODES = ("default", "plan")
BACKENDS: dict[str, dict[str, Any]] = {
    "alpha": {"caps": {"loadSession": True, "sessionCapabilities": {"resume": {}, "close": {}}}, "modes": True},
    "beta": {"caps": {"loadSession": True}, "modes": True, "chatty": True},
    "gamma": {"caps": {"loadSession": True}, "ignore_sigterm": True, "ignore_eof": True},
}
BACKEND_WEIGHTS = {"alpha": 4, "beta": 4, "gamma": 2}
CAPPED_BACKEND = "beta"  # has a max_live of its own: one process of it in the whole install
HANGING_BACKEND = "gamma"  # the one with a turn timeout
STUBBORN_BACKEND = "gamma"  # ignores SIGTERM and stdin EOF
OP_WEIGHTS = {
    "prompt": 20,
    "burst": 3,
    "state": 10,
    "cancel": 7,
    "tree": 4,
    "escape": 3,
    "crash": 4,
    "hang": 2,
    "set_mode": 6,
    "load": 6,
    "list": 5,
    "close": 4,
    "closed_probe": 2,
    "reopen": 2,
    "delete": 1,
    "new": 6,
    "attach": 0.4,
}
DRAWN_TOGETHER = {op: weight for op, weight in OP_WEIGHTS.items() if op != "attach"}
ATTACH_SHARE = OP_WEIGHTS["attach"] / sum(OP_WEIGHTS.values())
"""``attach`` is drawn apart, at its weight's share, from a random stream of its own: the other
operations are drawn from each seed as they were before it was added (``tests/test_soak.py``'s
seed is chosen for its draw)."""
HANDOVER_SHARE = 0.008
"""Share of operations that are a ``handover`` (another proxy of the install takes a session and gives it back),
drawn apart as ``attach`` is, from a stream of its own."""
PRUNE_SHARE = 0.004
"""Share of operations that are a ``prune`` (``acp-proxy sessions prune``: suspended sessions closed), drawn apart."""
PRUNE_OLDER_THAN = "2"
"""Seconds a session must have been suspended and idle for a ``prune`` to close it."""
ON_EOF_BACKEND = "beta"
"""Its ``on_eof = "close"``: a gateway's EOF closes the sessions of it that the proxy served."""
ENDINGS = {"clean": 2, "eof_mid_turn": 2, "sigkill": 3, "sigkill_waiting": 1}
ONE_SESSION_ENDINGS = {"clean": 3, "eof_mid_turn": 1, "sigkill": 2, "sigkill_waiting": 2}
"""acpx-style proxies: a gateway that starts one proxy per session ends it often, cleanly or not."""
SAMPLE_EVERY = 0.02
"""How often the cap is read from /proc between operations."""
LEASE_VARIABLE = "ACP_PROXY_LEASE"
TERMINAL_TASKS = ("done", "failed", "cancelled", "timed_out", "lost")
CHUNK = re.compile(r"chunk (\d+) ")
"""The text of the fake adapter's ``stream N`` chunks."""
ATTACH_NOT_LIVE = -32001
"""``session/attach`` of a session no running proxy holds (``not_live``)."""
ATTACH_WAIT = 60.0
"""How long an observer waits for a turn's updates, or for word that its holder has gone (a holder
ending by gateway EOF first stops its adapters)."""


class ProxyGone(Exception):
    """The proxy ended (or its input was closed) before the request could be answered or sent."""


@dataclasses.dataclass
class Options:
    seed: int
    ops: int
    workers: int = 3
    """Workers of the multiplexing proxy."""
    sessions_per_worker: int = 3
    max_live: int = 2
    async_backend: str = "asyncio"
    proxies: int = 3
    """acpx-style proxies beside the multiplexing one, with one or two sessions each."""


@dataclasses.dataclass
class Tracked:
    """What the gateway knows of one session: the adapter's completed turns lie in [lo, hi]."""

    session_id: str
    backend: str
    lo: int = 0
    hi: int = 0
    modes: set[str | None] = dataclasses.field(default_factory=set)
    closed: bool | None = False  # None: a close was in flight when its proxy ended
    closing: bool = False  # a close, delete or reopen is in flight: its listing may be either way
    deleted: bool = False  # closed for good: never listed, never reopened
    maybe_deleted: bool = False  # a delete was in flight when its proxy ended
    at_eof: bool = False  # its proxy's gateway has left, and the proxy closes it (on_eof = "close"): either way


@dataclasses.dataclass
class Report:
    seed: int
    async_backend: str
    ops: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    faults: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    epochs: int = 0
    sent: int = 0
    answered_once: int = 0
    abandoned: int = 0
    sessions_checked: int = 0
    tasks: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    leases: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    decoys: int = 0
    max_live: int = 0
    proxies: int = 0
    lifetimes: dict[str, int] = dataclasses.field(default_factory=dict)
    """Proxy lifetimes per proxy of the install."""
    peak_adapters: int = 0
    """The most live adapter processes read from /proc at one moment."""
    peak_trees: int = 0
    """The most adapter trees (wrapper, adapter, descendants) alive at one moment."""
    cap_reads: int = 0
    pool: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    """What the proxies' logs say the install's pool did."""
    attach: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    """What the ``attach`` operations saw: observers started, replays checked, turns mirrored, holders gone."""
    handover: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    """What the ``handover`` operations saw: sessions taken by another proxy (idle, busy), given back, refused."""
    retention: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    """Sessions closed by ``sessions prune`` and by a gateway's EOF (``on_eof = "close"``)."""
    seconds: float = 0.0
    violations: list[str] = dataclasses.field(default_factory=list)

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())

    def violation(self, text: str) -> None:
        self.violations.append(text)

    def summary(self) -> str:
        def counts(counter: collections.Counter[str]) -> str:
            return ", ".join(f"{name} {n}" for name, n in sorted(counter.items())) or "none"

        lines = [
            f"soak: seed {self.seed}, {self.async_backend}, {self.total_ops} ops in {self.epochs} proxy lifetimes, "
            f"{self.seconds:.1f} s",
            f"  install     {self.proxies} proxies on one state dir, max_live {self.max_live}; "
            f"lifetimes {counts(collections.Counter(self.lifetimes))}",
            f"  cap         peak {self.peak_adapters} live adapters, {self.peak_trees} adapter trees "
            f"({self.cap_reads} reads of /proc)",
            f"  pool        {counts(self.pool)}",
            f"  ops         {counts(self.ops)}",
            f"  faults      {counts(self.faults)}",
            f"  attach      {counts(self.attach)}",
            f"  handover    {counts(self.handover)}",
            f"  retention   {counts(self.retention)}",
            f"  requests    {self.sent} sent, {self.answered_once} answered exactly once, "
            f"{self.abandoned} in flight at a proxy SIGKILL",
            f"  sessions    {self.sessions_checked} resumed with their history at the end",
            f"  tasks       {counts(self.tasks)}",
            f"  leases      {counts(self.leases)}",
            f"  decoys      {self.decoys} started, all alive and unsignalled at the end"
            if not any("decoy" in v for v in self.violations)
            else f"  decoys      {self.decoys} started, SOME SIGNALLED",
            f"  violations  {len(self.violations)}",
        ]
        lines += [f"    - {v}" for v in self.violations]
        return "\n".join(lines)


# --- one proxy lifetime, seen from the gateway ------------------------------------------------


class Link:
    """One proxy lifetime as the soak's gateway sees it: the kit's client, and what the soak counts of it."""

    def __init__(self, gw: Gateway, report: Report, log: Path, *, conformance: bool = True) -> None:
        assert gw.process is not None
        self.gw = gw
        self.process = gw.process
        self.gone = gw.gone
        self.report = report
        self.log = log
        self.conformance: Conversation | None = Conversation("client") if conformance else None
        """The ACP v1 schema, checked both ways; None for an attached client, which speaks the draft's extension."""
        self.closing = False
        self.ops_done = 0
        self.prompts_in_flight = 0
        self._answers: collections.Counter[int] = collections.Counter()
        self._sent: dict[int, str] = {}
        self.updates: collections.Counter[str] = collections.Counter()
        self.last_update: dict[str, dict[str, Any]] = {}
        self.history_resets: set[str] = set()
        self.touched: set[str] = set()
        """Sessions this lifetime's gateway named in a request (its proxy holds them in memory): those of
        ``ON_EOF_BACKEND`` are closed by its EOF."""
        self.at_eof: Callable[[], None] | None = None
        """Called as the gateway closes its end (its proxy's EOF)."""
        self.recording: dict[str, list[dict[str, Any]]] = {}
        """Every ``session/update`` of these sessions, in the order read (an ``attach`` operation's)."""
        self.timeline: list[dict[str, Any]] | None = None
        """Every message read, in order, when set (an attached client's proxy: few messages)."""
        gw.observers.append(self._observe)
        gw.handler = _answer_agent_request

    @classmethod
    @contextlib.asynccontextmanager
    async def start(
        cls, env: dict[str, str], config: Path, report: Report, log: Path, *, conformance: bool = True
    ) -> AsyncIterator[Link]:
        argv = [sys.executable, "-m", "acp_proxy", "--async-backend", report.async_backend, "--config", str(config)]
        # The proxy's log, kept per lifetime. Leaving waits up to 45 s for the proxy to end after EOF.
        stderr = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            async with Gateway.launch(
                argv, env=env, stderr=stderr, name="the proxy", first_id=1, keep=False, close_timeout=45
            ) as gw:
                yield cls(gw, report, log, conformance=conformance)
        finally:
            os.close(stderr)
        for line in gw.bad_lines[:5]:
            report.violation(f"the proxy wrote a bad line to the gateway: {line[:200]!r}")

    def _observe(self, direction: str, msg: dict[str, Any]) -> None:
        if direction == "out":
            if self.conformance is not None:
                self.conformance.track_request(msg)
            if "method" in msg and isinstance(msg.get("id"), int):
                self._sent[msg["id"]] = msg["method"]
                self.report.sent += 1
                session_id = (msg.get("params") or {}).get("sessionId")
                if isinstance(session_id, str):
                    self.touched.add(session_id)
            return
        if self.timeline is not None:
            self.timeline.append(msg)
        try:
            if self.conformance is not None:
                self.conformance.check(msg)
        except ConformanceError as exc:
            self.report.violation(f"the proxy wrote a bad message to the gateway: {exc}")
        if "method" not in msg:
            request_id = msg.get("id")
            if not isinstance(request_id, int) or request_id not in self._sent:
                self.report.violation(f"an answer to an id never sent: {json.dumps(msg)[:200]}")
                return
            self._answers[request_id] += 1
            if self._answers[request_id] > 1:
                self.report.violation(f"a second answer to {self._sent[request_id]} id {request_id}")
        elif msg["method"] == "session/update" and "id" not in msg:
            session_id, update = msg["params"]["sessionId"], msg["params"]["update"]
            if session_id in self.recording:
                self.recording[session_id].append(msg)
            if update["sessionUpdate"] == "agent_message_chunk":  # what the adapter keeps as history
                self.updates[session_id] += 1
                self.last_update[session_id] = update
            meta = update.get("_meta") or {}
            if (meta.get("acp-proxy") or {}).get("historyReset"):
                self.history_resets.add(session_id)

    async def request(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        """Send a request and wait for its answer; ``ProxyGone`` if the proxy ended first."""
        if self.closing:
            raise ProxyGone
        try:
            return await self.gw.request(method, params, timeout=ANSWER_TIMEOUT)
        except Closed:
            raise ProxyGone from None
        except TimeoutError:
            self.report.violation(f"no answer to {method} within {ANSWER_TIMEOUT:.0f} s")
            self.kill()
            raise ProxyGone from None

    async def notify(self, method: str, params: dict[str, Any]) -> None:
        if self.closing:
            raise ProxyGone
        try:
            await self.gw.notify(method, params)
        except Closed:
            raise ProxyGone from None

    async def close_input(self) -> None:
        if not self.closing and self.at_eof is not None:
            self.at_eof()
        self.closing = True
        await self.gw.close_input()

    def kill(self) -> None:
        self.closing = True
        self.gw.kill()

    def unanswered(self) -> list[str]:
        return [f"{method} id {rid}" for rid, method in self._sent.items() if not self._answers[rid]]

    def answered_once(self) -> int:
        return sum(1 for rid in self._sent if self._answers[rid] == 1)

    async def initialize(self) -> bool:
        """``initialize``; whether it was answered a result."""
        response = await self.request(
            "initialize",
            {
                "protocolVersion": 1,
                "clientCapabilities": {"fs": {"readTextFile": True, "writeTextFile": False}},
                "clientInfo": {"name": "soak-gateway", "version": "1"},
            },
        )
        if _error_reason(response) == "pool_exhausted":
            self.report.pool["pool_exhausted answers"] += 1
        elif "result" not in response:
            self.report.violation(f"initialize failed: {response}")
        return "result" in response


def _answer_agent_request(msg: dict[str, Any]) -> dict[str, Any]:
    if msg["method"] == "session/request_permission":
        return {"result": {"outcome": {"outcome": "selected", "optionId": "allow"}}}
    if msg["method"] == "fs/read_text_file":
        return {"result": {"content": "soak"}}
    return {"error": {"code": -32601, "message": f"Method not found: {msg['method']}"}}


# --- the gateway's operations ----------------------------------------------------------------


def _error_reason(response: dict[str, Any]) -> str | None:
    data = response.get("error", {}).get("data")
    return data.get("reason") if isinstance(data, dict) else None


class Gate:
    """Operations run together; a ``prune`` runs alone, so that no request races the sessions it closes (a
    request and a prune of one session may go either way, which the soak's model of each session cannot follow)."""

    def __init__(self) -> None:
        self.running = 0
        self.exclusive_held = False
        self.changes = Changes()

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        await self.changes.until(lambda: not self.exclusive_held)
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self.changes.notify()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        await self.changes.until(lambda: not self.exclusive_held)
        self.exclusive_held = True
        try:
            await self.changes.until(lambda: self.running == 0)
            yield
        finally:
            self.exclusive_held = False
            self.changes.notify()


class Worker:
    """Runs seeded random operations on sessions only it uses (one operation at a time)."""

    def __init__(
        self,
        index: int,
        options: Options,
        report: Report,
        sessions: list[Tracked],
        *,
        sessions_per_worker: int | None = None,
        cap: InstallCap | None = None,
    ) -> None:
        self.peers: list[Worker] = [self]  # every worker of the run, for session/list checks
        self.rng = random.Random(f"{options.seed}-worker-{index}")
        self.attach_rng = random.Random(f"{options.seed}-attach-{index}")
        """Whether an operation is an ``attach``, and how it goes: a stream of its own (``ATTACH_SHARE``)."""
        self.handover_rng = random.Random(f"{options.seed}-handover-{index}")
        """Whether an operation is a ``handover`` or a ``prune``, and how it goes: streams of their own."""
        self.gate = Gate()
        """Shared by every worker of the run (``run`` sets it)."""
        self.options = options
        self.report = report
        self.sessions = sessions  # this worker's, closed ones included
        self.sessions_per_worker = sessions_per_worker or options.sessions_per_worker
        self.cap = cap
        self.unknown_news = 0  # session/new sent, proxy gone before the answer
        self.install: Install | None = None
        """Where to start another proxy of the install (``attach``); None: no ``attach``."""

    def open_sessions(self) -> list[Tracked]:
        return [s for s in self.sessions if s.closed is False]

    def reopenable(self) -> list[Tracked]:
        """Closed sessions: the gateway's own load brings them back (ACP: close is not delete)."""
        return [s for s in self.sessions if s.closed is True and not s.deleted]

    async def run(self, link: Link, budget: int) -> None:
        for _ in range(budget):
            if link.closing or link.gone.is_set():
                return
            op = self.rng.choices(list(DRAWN_TOGETHER), weights=list(DRAWN_TOGETHER.values()))[0]
            if self.attach_rng.random() < ATTACH_SHARE:
                op = "attach"
            live = self.open_sessions()
            if op == "new" or not live:
                op = "prompt" if len(live) >= self.sessions_per_worker else "new"
            if op == "burst" and len(live) < 2:
                op = "prompt"
            if op == "closed_probe" and not any(s.closed is True for s in self.sessions):
                op = "state"
            if op == "reopen" and not self.reopenable():
                op = "state"
            session = self.rng.choice(live) if live else None
            if op == "hang":
                hangable = [s for s in live if s.backend == HANGING_BACKEND]
                if not hangable:
                    op = "prompt"
                else:
                    session = self.rng.choice(hangable)
            if op == "set_mode" and session is not None and session.backend == HANGING_BACKEND:
                op = "prompt"
            if op == "attach" and self.install is None:
                op = "prompt"
            handing = [s for s in live if s.backend != ON_EOF_BACKEND]
            if self.handover_rng.random() < HANDOVER_SHARE and self.install is not None and handing:
                op, session = "handover", self.handover_rng.choice(handing)
            elif self.handover_rng.random() < PRUNE_SHARE and self.install is not None:
                op = "prune"
            try:
                if op == "prune":
                    await self.prune()
                else:
                    async with self.gate.shared():
                        if session is not None and session.closed is not False:
                            op = "list"  # closed by a prune while this operation waited for it to end
                        await self.perform(link, op, session)
            except ProxyGone:
                return
            finally:
                link.ops_done += 1
                if self.cap is not None:
                    self.cap.check(f"after {op}")
            self.report.ops[op] += 1

    async def perform(self, link: Link, op: str, session: Tracked | None) -> None:
        if op == "new":
            await self.new(link)
            return
        if op == "list":
            await self.list(link)
            return
        if op == "closed_probe":
            await self.closed_probe(link)
            return
        if op == "reopen":
            await self.load(link, self.rng.choice(self.reopenable()))
            return
        assert session is not None
        if op == "prompt":
            await self.turn(link, session, f"stream {self.rng.randint(1, 30)}")
        elif op == "burst":
            await self.burst(link)
        elif op == "tree":
            await self.turn(link, session, "spawn_tree; stream 2")
        elif op == "escape":
            self.report.faults["grandchild escape"] += 1
            await self.turn(link, session, "escape; stream 1")
        elif op == "crash":
            self.report.faults["adapter crash mid-turn"] += 1
            await self.turn(link, session, f"stream {self.rng.randint(1, 5)}; crash 3", crash=True)
        elif op == "hang":
            self.report.faults["adapter hang (turn timeout)"] += 1
            await self.turn(link, session, "stream 1; sleep 60", hang=True)
        elif op == "state":
            await self.state(link, session)
        elif op == "cancel":
            await self.cancel(link, session)
        elif op == "set_mode":
            await self.set_mode(link, session)
        elif op == "load":
            await self.load(link, session)
        elif op == "close":
            await self.close(link, session)
        elif op == "delete":
            await self.delete(link, session)
        elif op == "attach":
            await self.attach(link, session)
        elif op == "handover":
            await self.handover(link, session)

    def unexpected(self, link: Link, what: str, response: dict[str, Any]) -> None:
        if link.closing and _error_reason(response) == "proxy_shutdown":
            return  # in flight when the gateway closed its end: answered, outcome unknown
        if link.closing and (response.get("result") or {}).get("stopReason") == "cancelled":
            return  # in flight when the gateway closed its end, on a backend that closes its sessions at EOF
        if link.closing and _error_reason(response) == "session_closed":
            return  # waiting for its session when the gateway's EOF closed it (on_eof = "close")
        if _error_reason(response) == "pool_exhausted":
            self.report.pool["pool_exhausted answers"] += 1  # waited acquire_timeout for a slot: §5 allows it
            return
        self.report.violation(f"{what}: unexpected answer {json.dumps(response)[:300]}")

    async def new(self, link: Link) -> None:
        backend = self.rng.choices(list(BACKEND_WEIGHTS), weights=list(BACKEND_WEIGHTS.values()))[0]
        params = {"cwd": "/tmp", "mcpServers": [], "_meta": {"acp-proxy": {"backend": backend}}}
        try:
            response = await link.request("session/new", params)
        except ProxyGone:
            self.unknown_news += 1
            raise
        if "result" not in response:
            self.unexpected(link, f"session/new on {backend}", response)
            return
        modes: set[str | None] = {"default"} if BACKENDS[backend].get("modes") else {None}
        tracked = Tracked(response["result"]["sessionId"], backend, modes=modes)
        tracked.at_eof = link.closing and backend == ON_EOF_BACKEND  # answered after the EOF: being closed
        self.sessions.append(tracked)
        link.touched.add(tracked.session_id)

    async def turn(self, link: Link, s: Tracked, text: str, *, crash: bool = False, hang: bool = False) -> bool:
        """A prompt turn; whether it ended as it should (``end_turn``, or the crash or timeout asked for)."""
        s.hi += 1  # from here on the adapter may count the turn
        link.prompts_in_flight += 1
        try:
            response = await link.request("session/prompt", _prompt(s.session_id, text))
        finally:
            link.prompts_in_flight -= 1
        result = response.get("result")
        if crash:
            if "error" in response:
                s.hi -= 1  # the adapter exits before it counts the turn
                return True
            self.unexpected(link, f"a crashing turn on {s.session_id}", response)
            return False
        if hang:
            meta = (result or {}).get("_meta", {}).get("acp-proxy", {})
            if result and result.get("stopReason") == "cancelled" and meta.get("timedOut"):
                return True
            self.unexpected(link, f"a hanging turn on {s.session_id}", response)
            return False
        if result is not None and result.get("stopReason") == "end_turn":
            s.lo += 1
            return True
        self.unexpected(link, f"a turn on {s.session_id}", response)
        return False

    async def burst(self, link: Link) -> None:
        """A turn on every open session at once: more sessions want a process than the install has slots."""
        gone = False

        async def one(s: Tracked, text: str) -> None:
            nonlocal gone
            try:
                await self.turn(link, s, text)
            except ProxyGone:
                gone = True

        async with anyio.create_task_group() as tasks:
            for s in self.open_sessions():
                tasks.start_soon(one, s, f"stream {self.rng.randint(1, 10)}")
        if gone:
            raise ProxyGone

    async def state(self, link: Link, s: Tracked) -> dict[str, Any] | None:
        """Ask the adapter what it knows of the session; check it against what the gateway saw."""
        s.hi += 1
        response = await link.request("session/prompt", _prompt(s.session_id, "state"))
        result = response.get("result")
        if result is None or result.get("stopReason") != "end_turn":
            self.unexpected(link, f"a state turn on {s.session_id}", response)
            return None
        update = link.last_update.get(s.session_id, {})
        try:
            known = json.loads(update["content"]["text"])
        except (KeyError, TypeError, ValueError):
            self.report.violation(f"no state report for {s.session_id}: {update}")
            return None
        if not s.lo <= known["turns"] <= s.hi - 1:
            self.report.violation(
                f"{s.session_id} ({s.backend}): the adapter has {known['turns']} completed turns, "
                f"the gateway saw between {s.lo} and {s.hi - 1}"
            )
        if known["mode"] not in s.modes:
            self.report.violation(
                f"{s.session_id}: mode {known['mode']!r}, expected one of {sorted(map(str, s.modes))}"
            )
        s.lo = s.hi = known["turns"] + 1
        s.modes = {known["mode"]}
        return dict(known)

    async def cancel(self, link: Link, s: Tracked) -> None:
        """A turn that runs until cancelled; cancelled once it has started streaming."""
        s.hi += 1
        before = link.updates[s.session_id]
        link.prompts_in_flight += 1
        answer: list[dict[str, Any]] = []
        try:
            async with anyio.create_task_group() as tasks:

                async def prompt() -> None:
                    with contextlib.suppress(ProxyGone):
                        answer.append(await link.request("session/prompt", _prompt(s.session_id, "wait_cancel")))
                    tasks.cancel_scope.cancel()

                tasks.start_soon(prompt)
                with anyio.move_on_after(ANSWER_TIMEOUT):
                    while link.updates[s.session_id] == before and not link.gone.is_set():
                        await anyio.sleep(0.005)
                await anyio.sleep(self.rng.uniform(0, 0.05))
                with contextlib.suppress(ProxyGone):  # the gateway's end closed: the proxy answers anyway
                    await link.notify("session/cancel", {"sessionId": s.session_id})
                await anyio.sleep_forever()
        finally:
            link.prompts_in_flight -= 1
        if not answer:
            raise ProxyGone
        result = answer[0].get("result")
        if result is not None and result.get("stopReason") == "cancelled":
            if not link.closing:
                s.lo += 1  # it had streamed: the adapter ran it and counts it
            # After the gateway's EOF the proxy ends the turn itself (on_eof, close_timeout) and stops the
            # process: on a busy machine before the adapter has counted it. Counted or not: ``hi`` covers both.
        else:
            self.unexpected(link, f"a cancelled turn on {s.session_id}", answer[0])

    async def set_mode(self, link: Link, s: Tracked) -> None:
        mode = self.rng.choice(MODES)
        s.modes.add(mode)
        response = await link.request("session/set_mode", {"sessionId": s.session_id, "modeId": mode})
        if "result" in response:
            s.modes = {mode}
        else:
            self.unexpected(link, f"set_mode on {s.session_id}", response)

    async def load(self, link: Link, s: Tracked) -> None:
        """session/load replays the whole history: as many updates as the adapter then reports."""
        before = link.updates[s.session_id]
        reopening = s.closed is not False
        s.closing = s.closing or reopening
        try:
            response = await link.request("session/load", {"sessionId": s.session_id, "cwd": "/tmp", "mcpServers": []})
        except ProxyGone:
            if reopening:
                s.closed = None  # the proxy may have reopened it before it ended: either way from now on
            raise
        finally:
            s.closing = s.closing and not reopening
        if (s.deleted or s.maybe_deleted) and _error_reason(response) == "session_deleted":
            s.closed, s.deleted = True, True
            return
        if "result" not in response:
            if reopening:
                s.closed = None  # not reopened, or reopened as the gateway left: either way from now on
            self.unexpected(link, f"session/load of {s.session_id}", response)
            return
        s.closed, s.maybe_deleted = False, False  # open again, if it was closed (or a close was in flight)
        replayed = link.updates[s.session_id] - before
        known = await self.state(link, s)
        if known is not None and known["history"] != replayed:
            self.report.violation(
                f"{s.session_id}: load replayed {replayed} updates, the adapter has {known['history']}"
            )

    async def close(self, link: Link, s: Tracked) -> None:
        s.closing = True
        try:
            response = await link.request("session/close", {"sessionId": s.session_id})
        except ProxyGone:
            s.closed = None
            raise
        finally:
            s.closing = False
        if response.get("result") == {}:
            s.closed = True
        else:
            s.closed = None
            self.unexpected(link, f"session/close of {s.session_id}", response)

    async def delete(self, link: Link, s: Tracked) -> None:
        s.closing = True
        try:
            response = await link.request("session/delete", {"sessionId": s.session_id})
        except ProxyGone:
            s.closed, s.maybe_deleted = None, True
            raise
        finally:
            s.closing = False
        s.closed, s.deleted = True, True  # whatever the answer: a delete is never undone
        if response.get("result") != {}:
            self.unexpected(link, f"session/delete of {s.session_id}", response)

    async def attach(self, link: Link, s: Tracked) -> None:
        """Another proxy of the install (B) attaches to a session this worker's proxy (A) holds, as an observer.

        A turn through A first: from then on A holds the session (live, or suspended by it), and
        that turn's updates are the newest of its transcript. B (started as the soak starts every
        proxy, on the same state dir and config) attaches with history ``full`` (or ``none``); a
        turn runs on A, and B must get exactly the ``session/update`` lines A's gateway got for
        it, in the same order. Then B detaches, or its gateway just leaves, and the session goes
        on: a last turn on A. A may end at any moment (SIGKILL, gateway EOF): B is then told
        (``attach_ended``, ``holder_gone``), every request of B's is answered all the same, and
        nothing is compared for a turn A did not finish.
        """
        assert self.install is not None
        policy = self.attach_rng.choice(("full", "full", "none"))
        first, second = self.attach_rng.randint(1, 10), self.attach_rng.randint(1, 20)
        detach = self.attach_rng.random() < 0.5
        recorded: list[dict[str, Any]] = []
        link.recording[s.session_id] = recorded
        try:
            if not await self.turn(link, s, f"stream {first}"):
                self.report.attach["not attempted: the turn before failed"] += 1
                return
            before = list(recorded)
            self.install.observers += 1
            log = self.install.workdir / f"proxy-observer-{self.install.observers}.log"
            install = self.install
            async with Link.start(install.env, install.config, self.report, log, conformance=False) as observer:
                observer.timeline = []
                self.report.attach["observers started"] += 1
                try:
                    holder_gone = await self._watch(link, observer, s, policy, before, recorded, second, detach)
                except ProxyGone:  # the soak never ends B before the operation does
                    self.report.violation(f"an observer's proxy ended in the middle of its attach; see {log}")
                    holder_gone = link.closing
            code = observer.process.returncode
            if code != 0:
                self.report.violation(f"an observer's proxy exited with status {code}; see {log}")
            if observer.unanswered():
                self.report.violation(f"an observer's proxy never answered: {observer.unanswered()}; see {log}")
            self.report.answered_once += observer.answered_once()
        finally:
            link.recording.pop(s.session_id, None)
        if holder_gone:
            raise ProxyGone
        if link.closing or link.gone.is_set():
            return  # the next request would find A gone; the epoch counts what it had in flight
        # B detached or left: the session goes on through A.
        if await self.turn(link, s, "stream 1"):
            self.report.attach["turns after the observer left"] += 1

    async def _watch(
        self,
        link: Link,
        observer: Link,
        s: Tracked,
        policy: str,
        before: list[dict[str, Any]],
        recorded: list[dict[str, Any]],
        second: int,
        detach: bool,
    ) -> bool:
        """B's part of ``attach``, B's input closed at the end; whether A's turn found A gone."""
        sid = s.session_id

        def ended() -> bool:
            return link.closing or link.gone.is_set()

        def after(answer: dict[str, Any]) -> list[dict[str, Any]]:
            """What B read after ``answer``."""
            assert observer.timeline is not None
            at = next(i for i, m in enumerate(observer.timeline) if m is answer)
            return observer.timeline[at + 1 :]

        def before_answer(answer: dict[str, Any]) -> list[dict[str, Any]]:
            """What B read before ``answer``."""
            assert observer.timeline is not None
            return observer.timeline[: next(i for i, m in enumerate(observer.timeline) if m is answer)]

        def told(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
            """The draft's own updates among ``messages`` (``attach_ended``, ...)."""
            return [m for m in _updates(messages) if "type" in m["params"]["update"]]

        try:
            if not await observer.initialize():
                self.report.attach["not attempted: the observer's initialize failed"] += 1
                return False
            params = {
                "sessionId": sid,
                "role": "observer",
                "historyPolicy": policy,
                "clientInfo": {"name": "soak-observer", "version": "1"},
            }
            answer = await observer.request("session/attach", params)
            if "result" not in answer:
                reason = _error_reason(answer)
                code = answer.get("error", {}).get("code")
                if ended() and (reason == "holder_gone" or (reason == "not_live" and code == ATTACH_NOT_LIVE)):
                    self.report.attach[f"attach answered {reason} (the holder had ended)"] += 1
                else:
                    self.report.violation(f"session/attach of {sid}: unexpected answer {json.dumps(answer)[:300]}")
                return False
            self.report.attach[f"attached ({policy})"] += 1
            mark = len(recorded)
            ended_at_answer = ended()
            self._check_attach_answer(s, policy, answer, observer, before, first_complete=not ended_at_answer)
            attached = True

            turn_gone = False
            completed = False
            try:
                completed = await self.turn(link, s, f"stream {second}")
            except ProxyGone:
                turn_gone = True

            def live() -> list[dict[str, Any]]:
                return [m for m in _updates(after(answer)) if "type" not in m["params"]["update"]]

            if completed and not ended():
                wanted = len(recorded) - mark
                with anyio.move_on_after(ATTACH_WAIT):
                    while len(live()) < wanted and not told(after(answer)) and not ended():
                        await anyio.sleep(0.01)
            if detach and not told(after(answer)):
                response = await observer.request("session/detach", {"sessionId": sid})
                if response.get("result") == {"sessionId": sid, "status": "detached"}:
                    self.report.attach["detached"] += 1
                    attached = False
                elif ended() and _error_reason(response) == "holder_gone":
                    self.report.attach["detach answered holder_gone"] += 1
                elif ended() and "error" in response and told(before_answer(response)):
                    self.report.attach["detach after attach_ended"] += 1  # B had dropped the link already
                else:
                    self.report.violation(f"session/detach of {sid}: unexpected answer {json.dumps(response)[:300]}")
            else:
                self.report.attach["observer left (stdin closed)"] += 1
            drafts = told(after(answer))
            if completed and not ended() and not drafts:
                got, want = live(), recorded[mark:]
                if got == want:
                    self.report.attach["turns mirrored"] += 1
                else:
                    self.report.violation(
                        f"{sid}: an observer got {len(got)} updates of a turn, its holder's gateway {len(want)}: "
                        f"{_difference(got, want)}"
                    )
            if attached and ended():
                # A ended while B was attached: B must be told, whatever it had in flight answered.
                with anyio.move_on_after(ATTACH_WAIT):
                    while not (drafts := told(after(answer))) and not observer.gone.is_set():
                        await anyio.sleep(0.02)
            for draft in drafts:
                update = draft["params"]["update"]
                if (
                    update.get("type") == "attach_ended"
                    and update.get("reason") == "holder_gone"
                    and ended()
                    and draft is drafts[-1]
                ):
                    self.report.attach["holder gone: attach_ended"] += 1
                else:
                    self.report.violation(f"{sid}: an observer got {json.dumps(draft)[:300]}")
            if attached and ended() and not drafts:
                self.report.violation(f"{sid}: its holder ended, the observer was not told in {ATTACH_WAIT:.0f} s")
            return turn_gone
        finally:
            with anyio.CancelScope(shield=True):
                await observer.close_input()

    def _check_attach_answer(
        self,
        s: Tracked,
        policy: str,
        answer: dict[str, Any],
        observer: Link,
        before: list[dict[str, Any]],
        *,
        first_complete: bool,
    ) -> None:
        """The attach answer's shape, and the replay before it.

        What the soak knows of the transcript is little: it is what the holders' gateways saw over
        the session's whole life (it survives proxy restarts), less what a gateway's own
        ``session/load`` replaced, less the newest second of a SIGKILLed holder (written every
        second), less all but the newest 2 MiB. So the replay is held to what holds anyway: only
        this session's updates, each stream turn's chunks in order ("chunk 0 ", "chunk 1 "...: a
        run may be cut short, never reordered or repeated), and last the chunks of the turn this
        holder ran just before (a few hundred bytes, well within the bound). With the holder
        ending while B attached, the replay may be cut short too: then only the first two.
        """
        sid = s.session_id
        result = answer["result"]
        history = result.get("history") if isinstance(result, dict) else None
        shape = (
            isinstance(result, dict)
            and result.get("sessionId") == sid
            and result.get("role") == "observer"
            and isinstance(result.get("connectedClients"), list)
            and (history is None if policy == "none" else isinstance(history, list))
        )
        if not shape:
            self.report.violation(f"session/attach of {sid} ({policy}): answered {json.dumps(answer)[:300]}")
            return
        assert observer.timeline is not None
        at = next(i for i, m in enumerate(observer.timeline) if m is answer)
        replay = _updates(observer.timeline[:at])
        strangers = [m for m in replay if m["params"].get("sessionId") != sid]
        if strangers:
            self.report.violation(f"attach of {sid} replayed updates of another session: {strangers[0]}")
        if policy == "none":
            if replay:
                self.report.violation(f"attach of {sid} with historyPolicy none replayed {len(replay)} updates")
            return
        texts, expected = _chunk_texts(replay), _chunk_texts(before)
        problem = _out_of_order(texts)
        if problem is not None:
            self.report.violation(f"attach of {sid} replayed chunks out of order: {problem}")
        if not first_complete:
            return
        if texts[-len(expected) :] != expected:
            self.report.violation(
                f"attach of {sid}: the replay ends {texts[-len(expected) :]}, the turn before was {expected}"
            )
        prompts = [item for item in history or [] if item.get("type") == "prompt"]
        if not prompts or prompts[-1].get("content") != [{"type": "text", "text": f"stream {len(expected)}"}]:
            self.report.violation(f"attach of {sid}: the last prompt in its history is not the turn before's")
        self.report.attach["replays checked"] += 1

    async def handover(self, link: Link, s: Tracked) -> None:
        """Another proxy of the install (B) asks for a session this worker's proxy (A) serves, and A takes it back.

        A turn through A first (its gateway then knows the session there). B asks with ``session/load``
        (its replay is the adapter's whole history) or with a prompt (a gateway that never loaded it),
        while A is idle or, at times, while a turn runs on A: that turn must end ``end_turn``,
        undisturbed, before B is answered. Once B has it, A's process is gone (never two processes for
        one session), and A's gateway is told ``session_moved``; A's own load brings it back, after
        which B is told so. A may end at any moment (SIGKILL, EOF): what is left is not compared.
        """
        assert self.install is not None
        rng = self.handover_rng
        busy, by_load = rng.random() < 0.4, rng.random() < 0.6
        known = await self.state(link, s)
        if known is None:
            self.report.handover["not attempted: the turn before failed"] += 1
            return
        install = self.install
        install.observers += 1
        log = install.workdir / f"proxy-taker-{install.observers}.log"
        holder_gone = False
        async with Link.start(install.env, install.config, self.report, log) as other:
            try:
                await self._hand_over(link, other, s, known, busy=busy, by_load=by_load, log=log)
            except ProxyGone:  # raised again once B has left: in B's task group it would be wrapped
                holder_gone = True
        code = other.process.returncode
        if code != 0:
            self.report.violation(f"a proxy that took a session over exited with status {code}; see {log}")
        if other.unanswered():
            self.report.violation(f"a proxy that took a session over never answered: {other.unanswered()}; see {log}")
        self.report.answered_once += other.answered_once()
        if holder_gone:
            raise ProxyGone

    async def _hand_over(
        self, link: Link, other: Link, s: Tracked, known: dict[str, Any], *, busy: bool, by_load: bool, log: Path
    ) -> None:
        rng = self.handover_rng
        if not await other.initialize():
            return
        before = other.updates[s.session_id]
        asked: list[dict[str, Any]] = []
        async with anyio.create_task_group() as tasks:
            if busy:
                started = link.updates[s.session_id]
                tasks.start_soon(self._turn_until_gone, link, s, f"stream {rng.randint(10, 30)}")
                with anyio.move_on_after(ANSWER_TIMEOUT):
                    while link.updates[s.session_id] == started and not link.gone.is_set():
                        await anyio.sleep(0.005)
            if by_load:
                load = {"sessionId": s.session_id, "cwd": "/tmp", "mcpServers": []}
                asked.append(await other.request("session/load", load))
            else:
                took = await self.turn(other, s, f"stream {rng.randint(1, 5)}")
                asked.append({"result": {}} if took else {"error": {}})
        if "result" not in asked[0]:
            if by_load:
                self.unexpected(other, f"session/load of {s.session_id} held by another proxy", asked[0])
            return
        self.report.handover["taken while a turn ran" if busy else "taken idle"] += 1
        if markers.alive(int(known["pid"])):
            self.report.violation(f"{s.session_id}: its old process {known['pid']} outlived the handover")
        if by_load:
            replayed = other.updates[s.session_id] - before
            known_there = await self.state(other, s)
            if known_there is not None and known_there["history"] != replayed:
                self.report.violation(
                    f"{s.session_id}: load by another proxy replayed {replayed} updates, "
                    f"the adapter has {known_there['history']}"
                )
        # A's gateway: told the session moved; or, if B's pool suspended it meanwhile (its row free again), served
        # at A as any suspended session is, transparently.
        if await self._moved_or_served(link, s, "moved to another proxy"):
            await self.load(link, s)  # its own load brings it back
        if await self._moved_or_served(other, s, "taken back"):
            self.report.handover["given back"] += 1
        for session_id in other.history_resets:
            self.report.violation(f"{session_id} lost its history in a handover; see {log}")

    async def _moved_or_served(self, link: Link, s: Tracked, what: str) -> bool:
        """A prompt from a gateway whose proxy served the session before another took it: True if it was told
        ``session_moved``; a turn that ran instead (the session free again) is counted as any turn."""
        s.hi += 1
        response = await link.request("session/prompt", _prompt(s.session_id, "stream 1"))
        if _error_reason(response) == "session_moved":
            s.hi -= 1
            return True
        if (response.get("result") or {}).get("stopReason") == "end_turn":
            s.lo += 1
            self.report.handover["served again without a handover (it was free)"] += 1
            return False
        self.unexpected(link, f"a prompt to {s.session_id}, {what}", response)
        return False

    async def _turn_until_gone(self, link: Link, s: Tracked, text: str) -> None:
        with contextlib.suppress(ProxyGone):
            await self.turn(link, s, text)

    async def prune(self) -> None:
        """``acp-proxy sessions prune``, alone (``Gate``): the sessions it reports closed are closed from now on."""
        assert self.install is not None
        install = self.install
        argv = [sys.executable, "-m", "acp_proxy", "sessions", "prune", "--older-than", PRUNE_OLDER_THAN, "--json"]
        async with self.gate.exclusive():  # the sessions it closed are marked so before any other request goes
            done = await anyio.to_thread.run_sync(
                lambda: subprocess.run(argv, env=install.env, capture_output=True, text=True, timeout=60)
            )
            if done.returncode != 0:
                self.report.violation(f"sessions prune exited {done.returncode}: {done.stderr[-300:]}")
                return
            closed = {entry["sessionId"] for entry in json.loads(done.stdout)["closed"]}
            for tracked in (t for w in self.peers for t in w.sessions if t.session_id in closed):
                if tracked.deleted:
                    self.report.violation(f"sessions prune closed deleted session {tracked.session_id}")
                tracked.closed = True
            self.report.retention["closed by prune"] += len(closed)

    async def closed_probe(self, link: Link, s: Tracked | None = None) -> None:
        s = s or self.rng.choice([s for s in self.sessions if s.closed is True])
        response = await link.request("session/prompt", _prompt(s.session_id, "stream 1"))
        if response.get("error", {}).get("code") != SESSION_NOT_FOUND:
            self.unexpected(link, f"a prompt to closed {s.session_id}", response)

    async def list(self, link: Link) -> None:
        await check_list(link, self.report, [s for w in self.peers for s in w.sessions], tolerance=0, strict=False)


async def check_list(link: Link, report: Report, sessions: list[Tracked], tolerance: int, strict: bool) -> None:
    """session/list shows every session, closed ones as closed, and no deleted one (all pages).

    Only sessions whose state did not change while the list was asked for are checked: a list
    served before a close, delete or reopen was answered may show the session either way.
    """
    listed: dict[str, str] = {}
    cursor = None

    def state(s: Tracked) -> tuple[Any, ...]:
        return (s.closed, s.deleted, s.closing, s.maybe_deleted, s.at_eof)

    asked = {s.session_id: state(s) for s in sessions}
    while True:
        params: dict[str, Any] = {} if cursor is None else {"cursor": cursor}
        response = await link.request("session/list", params)
        result = response.get("result")
        if result is None:
            report.violation(f"session/list: {json.dumps(response)[:300]}")
            return
        for entry in result["sessions"]:
            listed[entry["sessionId"]] = entry["_meta"]["acp-proxy"]["state"]
        cursor = result.get("nextCursor")
        if not cursor:
            break
    known = {s.session_id: s for s in sessions}
    for s in sessions:
        if s.closing or s.at_eof or s.closed is None or s.maybe_deleted or asked.get(s.session_id) != state(s):
            continue
        if s.closed is False and listed.get(s.session_id, "closed") == "closed":
            report.violation(f"session/list lacks open session {s.session_id}: {listed.get(s.session_id)}")
        if s.closed is True and not s.deleted and listed.get(s.session_id) != "closed":
            report.violation(f"session/list does not show closed session {s.session_id} as closed")
        if s.deleted and s.session_id in listed:
            report.violation(f"session/list shows deleted session {s.session_id}")
    if strict:
        strangers = [sid for sid in listed if sid not in known]
        if len(strangers) > tolerance:
            report.violation(f"session/list shows {len(strangers)} sessions never created: {strangers[:5]}")


def _updates(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in messages if m.get("method") == "session/update" and "id" not in m]


def _chunk_texts(messages: list[dict[str, Any]]) -> list[str]:
    """The texts of the ``agent_message_chunk`` updates among ``messages``, in order."""
    return [
        str(m["params"]["update"].get("content", {}).get("text"))
        for m in _updates(messages)
        if m["params"]["update"].get("sessionUpdate") == "agent_message_chunk"
    ]


def _out_of_order(texts: list[str]) -> str | None:
    """Where the chunks of stream turns ("chunk 0 ", "chunk 1 "...) do not follow on (a run may stop short,
    and a new one begins at 0); None if they all do. Other texts are not looked at."""
    last: int | None = None
    for index, text in enumerate(texts):
        match = CHUNK.fullmatch(text)
        if match is None:
            continue
        n = int(match[1])
        if last is not None and n not in (last + 1, 0):
            return f"{text!r} after 'chunk {last} ' (chunk {index} of {len(texts)})"
        last = n
    return None


def _difference(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> str:
    for index, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return f"update {index} differs: {json.dumps(a)[:200]} / {json.dumps(b)[:200]}"
    common = min(len(got), len(want))
    longer, which = (got, "observer") if len(got) > len(want) else (want, "holder's gateway")
    return f"the {which} has more, from update {common}: {json.dumps(longer[common])[:200]}"


def _prompt(session_id: str, text: str) -> dict[str, Any]:
    return {"sessionId": session_id, "prompt": [{"type": "text", "text": text}]}


# --- decoys: processes that look like the proxy's but are not in any lease -----------------------


class Decoys:
    """Processes the proxy must never signal, each remembered with its start time."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen[bytes]] = []
        self.identity: dict[int, float] = {}
        self.forged: set[str] = set()
        """Lease markers the decoys carry: no adapter tree of the install's."""

    def start(self, argv: list[str], env: dict[str, str]) -> None:
        if LEASE_VARIABLE in env:
            self.forged.add(env[LEASE_VARIABLE])
        process = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
        self.processes.append(process)
        self.identity[process.pid] = psutil.Process(process.pid).create_time()

    def signalled(self) -> list[str]:
        hurt = []
        for process in self.processes:
            try:
                alive = (
                    process.poll() is None and psutil.Process(process.pid).create_time() == self.identity[process.pid]
                )
            except psutil.NoSuchProcess:
                alive = False
            if not alive:
                hurt.append(f"decoy {process.pid} ({process.args!r:.80}) was signalled: status {process.returncode}")
        return hurt

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()
            if process.stdin is not None:
                process.stdin.close()


def _sleeper() -> list[str]:
    return [sys.executable, "-c", "import time; time.sleep(3600)"]


# --- the install's cap, read from /proc ------------------------------------------------------------


class InstallCap:
    """Counts the run's live adapter processes and trees from ``/proc``: what the cap is about, not
    what the proxies believe.

    A tree is every process carrying one lease marker (its wrapper, its adapter, their
    descendants): it holds its slot until the last of them is gone, even when the proxy that
    started it was killed, so it counts until then. A read is not an instant, so a count over
    the cap is looked at again, and only the trees still alive then (hence alive together) are
    held against the cap (``tests.kit.proctree``).
    """

    def __init__(self, marker: str, max_live: int, report: Report, decoys: Decoys) -> None:
        self.marker = marker
        self.max_live = max_live
        self.report = report
        self.decoys = decoys
        self.available = markers.PROC
        self._lock = threading.Lock()
        self._every = proctree.Every(SAMPLE_EVERY, lambda: self.check("between operations"), "soak-cap")
        self.over = 0
        """Reads over the cap (each a violation; only the first few are described)."""

    def read(self) -> dict[str, list[markers.Marked]]:
        """The run's adapter trees, by lease; the decoys' forged leases left out."""
        trees = proctree.adapter_trees(MARKER_VARIABLE, self.marker)
        return {lease: found for lease, found in trees.items() if lease not in self.decoys.forged}

    def check(self, when: str) -> None:
        if not self.available:
            return
        with self._lock:
            trees = self.read()
            if len(trees) > self.max_live:
                trees = proctree.alive_together(trees)
            adapters = [lease for lease, found in trees.items() if any(map(_is_adapter, found))]
            self.report.cap_reads += 1
            self.report.peak_adapters = max(self.report.peak_adapters, len(adapters))
            self.report.peak_trees = max(self.report.peak_trees, len(trees))
            if len(trees) <= self.max_live:
                return
            self.over += 1
            if self.over <= 5:
                described = "; ".join(f"{lease} {found[0]}" for lease, found in trees.items())
                self.report.violation(
                    f"{when}: {len(trees)} adapter trees alive at once ({len(adapters)} adapters), "
                    f"max_live {self.max_live}: {described}"
                )

    def __enter__(self) -> InstallCap:
        if self.available:
            self._every.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.available:
            self._every.__exit__(kind, exc, tb)
        if self.over > 5:
            self.report.violation(f"{self.over - 5} more reads over the cap")


def _is_adapter(process: markers.Marked) -> bool:
    """The fake adapter itself, not the wrapper that execs it (whose argv names both)."""
    wrapper = any(arg.endswith("adapter_wrapper.py") for arg in process.argv)
    return not wrapper and any(arg.endswith("fake_adapter.py") for arg in process.argv)


# --- the run ---------------------------------------------------------------------------------------


def write_config(workdir: Path, max_live: int) -> Path:
    store = workdir / "store"
    lines = [
        'default_backend = "alpha"',
        "[pool]",
        f"max_live = {max_live}",
        'idle_ttl = "3s"',
        'acquire_timeout = "45s"',
        "[shutdown]",
        'close_timeout = "500ms"',
        'stdin_grace = "300ms"',
        'term_grace = "1s"',
        "[ownership]",
        'reap_interval = "1s"',
    ]
    for name, options in BACKENDS.items():
        lines += [f"[backends.{name}]", f"command = {json.dumps(fake_command(store=str(store), **options))}"]
        if name == HANGING_BACKEND:  # a hung turn is quiet: turn_idle_timeout cuts it before turn_timeout
            lines += ['turn_timeout = "2s"', 'turn_idle_timeout = "1500ms"']
        if name == CAPPED_BACKEND:
            lines.append("max_live = 1")
        if name == ON_EOF_BACKEND:
            lines.append('on_eof = "close"')
    path = workdir / "config.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclasses.dataclass
class Install:
    """How the run starts a proxy of the install: what an ``attach`` operation starts its observer's proxy with."""

    env: dict[str, str]
    config: Path
    workdir: Path
    observers: int = 0
    """Observers' proxies started so far (each logs to ``proxy-observer-N.log``)."""


@dataclasses.dataclass
class Station:
    """One agent command a gateway runs: a proxy, started again on the same state dir after each of its ends."""

    name: str
    workers: list[Worker]
    rng: random.Random
    lifetime_ops: tuple[int, int]
    """How many operations a lifetime of this proxy is drawn to last."""
    endings: dict[str, int]
    lifetimes: int = 0


def _stations(options: Options, report: Report, cap: InstallCap) -> list[Station]:
    """The multiplexing proxy (its workers share it) and the one-session proxies, each with its own seed."""
    stations = [
        Station(
            "multiplexing",
            [Worker(i, options, report, [], cap=cap) for i in range(options.workers)],
            random.Random(f"{options.seed}-epochs"),
            (30, 90),
            ENDINGS,
        )
    ]
    for n in range(options.proxies):
        worker = Worker(options.workers + n, options, report, [], sessions_per_worker=1 + n % 2, cap=cap)
        rng = random.Random(f"{options.seed}-proxy-{n}")
        stations.append(Station(f"one-session-{n + 1}", [worker], rng, (8, 30), ONE_SESSION_ENDINGS))
    return stations


async def run(options: Options, workdir: Path, env: dict[str, str]) -> Report:
    """One soak run in ``workdir`` (state dir from ``env``); the report lists every violation."""
    report = Report(
        seed=options.seed, async_backend=options.async_backend, max_live=options.max_live, proxies=1 + options.proxies
    )
    started = time.monotonic()
    config = write_config(workdir, options.max_live)
    state_dir = Path(env["ACP_PROXY_STATE_DIR"])
    decoys = Decoys()
    cap = InstallCap(env[MARKER_VARIABLE], options.max_live, report, decoys)
    stations = _stations(options, report, cap)
    workers = [worker for station in stations for worker in station.workers]
    install = Install(env, config, workdir)
    gate = Gate()
    for worker in workers:
        worker.peers = workers
        worker.install = install
        worker.gate = gate
    # A process that looks exactly like an adapter of the proxy's (same argv, same test marker), started
    # outside it: command lines and inherited variables prove nothing.
    decoys.start(fake_command(store=str(workdir / "store"), **BACKENDS["alpha"]), env)
    try:
        with cap:
            async with anyio.create_task_group() as tasks:
                for station in stations:
                    tasks.start_soon(_serve, station, options, workdir, env, config, report, decoys)
            report.epochs += 1
            await _final_epoch(workdir, env, config, report, workers)
    finally:
        deadline = time.monotonic() + 10
        ignored = set(decoys.identity)
        while (left := set(marked_processes(env[MARKER_VARIABLE])) - ignored) and time.monotonic() < deadline:
            await anyio.sleep(0.1)
        survivors = [marked for pid, marked in marked_processes(env[MARKER_VARIABLE]).items() if pid in left]
        if survivors:
            report.violation(f"processes survived: {[str(marked) for marked in survivors]}")
        left_cgroups = install_cgroups(state_dir)  # the last proxy reaped the dead ones' and removed its own
        if left_cgroups:
            report.violation(f"cgroups of the install survived: {[str(path) for path in left_cgroups]}")
            for path in left_cgroups:
                cgroups.clear(path, 2.0)
        report.violations += decoys.signalled()
        report.decoys = len(decoys.processes)
        decoys.stop()
        markers.kill(survivors)
    report.pool.update(_pool_log(workdir))
    _check_database(state_dir, report)
    report.seconds = time.monotonic() - started
    return report


async def _serve(
    station: Station,
    options: Options,
    workdir: Path,
    env: dict[str, str],
    config: Path,
    report: Report,
    decoys: Decoys,
) -> None:
    """One proxy of the install, lifetime after lifetime, until the run has done its operations."""
    state_dir = Path(env["ACP_PROXY_STATE_DIR"])
    while report.total_ops < options.ops:
        report.epochs += 1
        station.lifetimes += 1
        report.lifetimes[station.name] = station.lifetimes
        budget = min(options.ops - report.total_ops, station.rng.randint(*station.lifetime_ops))
        ending = station.rng.choices(list(station.endings), weights=list(station.endings.values()))[0]
        at = station.rng.randint(budget // 3, budget)
        log = workdir / f"proxy-{station.name}-{station.lifetimes}.log"
        if not await _epoch(env, config, report, station.workers, budget, ending, at, log):
            return
        if station.lifetimes == 1 and station.name == "multiplexing":
            _start_lease_decoys(decoys, state_dir, env)


def _start_lease_decoys(decoys: Decoys, state_dir: Path, env: dict[str, str]) -> None:
    """Processes carrying this install's lease marker variable, for leases that do not exist."""
    with contextlib.closing(sqlite3.connect(f"file:{state_dir / 'state.db'}?mode=ro", uri=True)) as db:
        install = db.execute("SELECT value FROM meta WHERE key = 'install_id'").fetchone()[0]
        recent = db.execute("SELECT lease_id FROM leases ORDER BY created_at DESC LIMIT 1").fetchone()
    forged = [f"{install}.{uuid.uuid4().hex[:12]}.{uuid.uuid4().hex}"]
    if recent is not None:  # a real lease id with a made-up random part
        forged.append(f"{install}.{recent[0]}.{uuid.uuid4().hex}")
    for value in forged:
        decoys.start(_sleeper(), {**env, LEASE_VARIABLE: value})


async def _epoch(
    env: dict[str, str],
    config: Path,
    report: Report,
    workers: list[Worker],
    budget: int,
    ending: str,
    at: int,
    log: Path,
) -> bool:
    """One proxy lifetime: the workers' operations, then its end as drawn; False if it never served."""
    state_dir = Path(env["ACP_PROXY_STATE_DIR"])
    async with Link.start(env, config, report, log) as link:

        def closed_at_eof() -> list[Tracked]:
            """The sessions its gateway's EOF closes: those of ON_EOF_BACKEND the proxy served (on_eof = "close"),
            a session opened by an answer read after the EOF included."""
            return [
                s for w in workers for s in w.sessions if s.session_id in link.touched and s.backend == ON_EOF_BACKEND
            ]

        def closing() -> None:  # from the EOF on, they are being closed: a list may show them either way
            for s in closed_at_eof():
                s.at_eof = True

        link.at_eof = closing
        try:
            await link.initialize()
        except ProxyGone:
            report.violation(f"a proxy ended before answering initialize; see {log}")
            return False
        share = -(-budget // len(workers))
        worked = anyio.Event()
        async with anyio.create_task_group() as tasks:
            if ending != "clean":
                tasks.start_soon(_end_abruptly, link, report, ending, at, worked, state_dir)
            async with anyio.create_task_group() as work:
                for worker in workers:
                    work.start_soon(worker.run, link, share)
            worked.set()  # the workers finished before the end was due: it still happens
        await link.close_input()
        with anyio.move_on_after(45):
            await link.gone.wait()
            await link.process.wait()
        code = link.process.returncode
        killed = code == -signal.SIGKILL
        if not killed and code != 0:
            report.violation(f"a proxy exited with status {code}; see {log}")
        for s in closed_at_eof():  # every operation of the lifetime has ended: nothing changes them after this
            s.at_eof = False
            if code == 0 and not s.deleted and s.closed is not True:
                s.closed = True
                report.retention["closed at EOF"] += 1
        unanswered = link.unanswered()
        report.answered_once += link.answered_once()
        if killed:
            report.abandoned += len(unanswered)
        elif unanswered:
            report.violation(f"a proxy never answered: {unanswered[:10]}; see {log}")
        for session_id in link.history_resets:
            report.violation(f"{session_id} lost its history (historyReset); see {log}")
    return True


async def _end_abruptly(link: Link, report: Report, ending: str, at: int, worked: anyio.Event, state_dir: Path) -> None:
    while link.ops_done < at and not link.gone.is_set() and not worked.is_set():
        await anyio.sleep(0.01)
    if link.closing or link.gone.is_set():
        return
    if ending == "eof_mid_turn":
        with anyio.move_on_after(3):
            while link.prompts_in_flight == 0 and not worked.is_set():
                await anyio.sleep(0.005)
        report.faults["gateway EOF mid-turn" if link.prompts_in_flight else "gateway EOF"] += 1
        await link.close_input()
        return
    pid = link.process.pid
    if ending == "sigkill_waiting":
        with anyio.move_on_after(5):
            while not _waiting_for_a_slot(state_dir, pid) and not worked.is_set() and not link.closing:
                await anyio.sleep(0.005)
        if link.closing or link.gone.is_set():
            return
        if _waiting_for_a_slot(state_dir, pid):
            report.faults["proxy SIGKILL while waiting for a slot"] += 1
    if _holds_a_slot(state_dir, pid):
        report.faults["proxy SIGKILL holding a slot"] += 1
    report.faults["proxy SIGKILL"] += 1
    link.kill()


def _waiting_for_a_slot(state_dir: Path, pid: int) -> bool:
    """Whether the proxy ``pid`` stands in the install's queue (its tickets are named with its pid)."""
    try:
        names = os.listdir(state_dir / SLOTS_DIR / QUEUE)
    except FileNotFoundError:
        return False
    return any(n.endswith(".ticket") and n.removesuffix(".ticket").rsplit("-", 2)[1] == str(pid) for n in names)


def _holds_a_slot(state_dir: Path, pid: int) -> bool:
    """Whether a slot record of the install names the proxy ``pid`` as its holder."""
    held = InstallSlots(state_dir, "soak").holders(ALL)
    return any(h.record is not None and h.record.pid == pid for h in held)


def _pool_log(workdir: Path) -> collections.Counter[str]:
    """What the proxies' logs say the install's pool did, and whose tracebacks they hold.

    A log holds its adapters' stderr too: an adapter stopped in the middle of a turn may
    print a traceback (or part of one) on its way out.
    """
    found: collections.Counter[str] = collections.Counter()
    for path in workdir.glob("proxy-*.log"):
        traceback: list[str] | None = None
        with path.open(errors="replace") as lines:
            for line in [*lines, "\n"]:
                if traceback is not None:
                    if line.startswith(" "):
                        traceback.append(line)
                        continue
                    frames = "".join(traceback)
                    whose = "adapter"
                    if "/acp_proxy/" in frames:
                        whose = "proxy"
                    elif "adapter_wrapper" in frames:
                        whose = "wrapper"
                    found[f"{whose} tracebacks in the logs"] += 1
                    traceback = None
                if ", for another proxy)" in line:
                    found["suspended for another proxy" if " suspended (" in line else "spare stopped for another"] += 1
                elif "pool: asking proxy" in line:
                    found["asked another proxy to suspend"] += 1
                elif " suspended (least recently used" in line:
                    found["suspended for its own proxy"] += 1
                elif "pool full for backend" in line:
                    found["waits for a slot"] += 1
                elif line.startswith("Traceback"):
                    traceback = []
    return found


async def _final_epoch(workdir: Path, env: dict[str, str], config: Path, report: Report, workers: list[Worker]) -> None:
    """A fresh proxy: every session not deleted comes back with its history; the registry agrees."""
    log = workdir / "proxy-final.log"
    sessions = [s for w in workers for s in w.sessions]
    async with Link.start(env, config, report, log) as link:
        try:
            await _check_every_session(link, report, workers, sessions)
        except ProxyGone:
            report.violation(f"the final proxy ended while sessions were being checked; see {log}")
    if link.process.returncode != 0:
        report.violation(f"the final proxy exited with status {link.process.returncode}; see {log}")
    if link.unanswered():
        report.violation(f"the final proxy never answered: {link.unanswered()[:10]}")
    report.answered_once += link.answered_once()


async def _check_every_session(link: Link, report: Report, workers: list[Worker], sessions: list[Tracked]) -> None:
    await link.initialize()
    checker = Worker(-1, Options(seed=0, ops=0), report, sessions)
    for s in sessions:
        if s.closed is True:
            await checker.closed_probe(link, s)
            if s.deleted:
                continue
        await checker.load(link, s)  # a closed one too: the gateway's own load reopens it, history and all
        if s.closed is False:
            report.sessions_checked += 1
    tolerance = sum(w.unknown_news for w in workers)
    await check_list(link, report, sessions, tolerance=tolerance, strict=True)
    for session_id in link.history_resets:
        report.violation(f"{session_id} lost its history (historyReset) after restarts")


def _check_database(state_dir: Path, report: Report) -> None:
    with contextlib.closing(sqlite3.connect(f"file:{state_dir / 'state.db'}?mode=ro", uri=True)) as db:
        integrity = db.execute("PRAGMA integrity_check").fetchall()
        if integrity != [("ok",)]:
            report.violation(f"integrity_check: {integrity[:5]}")
        report.tasks.update(dict(db.execute("SELECT status, count(*) FROM tasks GROUP BY status").fetchall()))
        report.leases.update(dict(db.execute("SELECT state, count(*) FROM leases GROUP BY state").fetchall()))
        stubborn = db.execute("SELECT count(*) FROM leases WHERE backend = ?", (STUBBORN_BACKEND,)).fetchone()[0]
        report.faults["adapter ignoring SIGTERM and EOF, torn down"] = stubborn
        live = db.execute("SELECT count(*) FROM sessions WHERE state IN ('live', 'resuming')").fetchone()[0]
    unended = {status: n for status, n in report.tasks.items() if status not in TERMINAL_TASKS}
    if unended:
        report.violation(f"tasks not ended after the last proxy stopped: {unended}")
    open_leases = {state: n for state, n in report.leases.items() if state not in ("closed", "lost")}
    if open_leases:
        report.violation(f"leases not ended after the last proxy stopped: {open_leases}")
    if live:
        report.violation(f"{live} sessions still live after the last proxy stopped")


# --- shell -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=2000, help="gateway operations in all (default 2000)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: time-based, printed)")
    parser.add_argument("--workers", type=int, default=3, help="workers of the multiplexing proxy (default 3)")
    parser.add_argument(
        "--proxies", type=int, default=3, help="one-session proxies beside it, on the same install (default 3)"
    )
    parser.add_argument("--max-live", type=int, default=2, help="[pool] max_live of the install (default 2)")
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio", help="the proxy's anyio backend")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (state, logs) for inspection")
    args = parser.parse_args(argv)
    if args.ops < 1 or args.workers < 1 or args.max_live < 1 or args.proxies < 0:
        parser.error("--ops, --workers and --max-live must be positive, --proxies not negative")
    seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    options = Options(
        seed=seed,
        ops=args.ops,
        workers=args.workers,
        max_live=args.max_live,
        async_backend=args.backend,
        proxies=args.proxies,
    )
    workdir, env = scratch_run("acp-proxy-soak-")
    print(f"soak: seed {seed}, {args.ops} ops, work dir {workdir}", file=sys.stderr, flush=True)
    report = anyio.run(run, options, workdir, env, backend=args.backend)
    if args.json:
        print(json.dumps(dataclasses.asdict(report) | {"total_ops": report.total_ops}, indent=2))
    else:
        print(report.summary())
    suspect = bool(report.violations) or report.pool["proxy tracebacks in the logs"] > 0
    end_run(workdir, keep=args.keep or suspect)
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
