"""Load benchmark: 200 concurrent sessions over ``max_live = 8``, streaming turns, one gateway.

Every adapter is ``benchmarks/load_agent.py``: it resumes any session id at once and
answers each prompt with ``UPDATES`` streamed ``session/update`` lines (180 B), then
the answer, whose ``_meta`` says which process served the turn, which request opened
the session there and how many turns it had served: so every turn is classified
*resumed* (the first turn after its session was brought back on a new process) or
*live* (its session already had a process) from what the adapter saw, the same way
in every run.

The workload, identical in every run: ``SESSIONS`` sessions, each driven by its own
client thread. All of them send ``session/new`` at once; then each runs ``bursts``
bursts of ``BURST_TURNS`` back-to-back prompts, with a seeded random pause of up to
``THINK_MAX`` s before each burst. With 8 processes for 200 sessions the first turn of
a burst normally finds its session suspended; the next ones normally find it live
(unless the pool took its process between two turns, which happens: an idle session
is fair game).

Runs, side by side on one machine:

* ``proxy (asyncio)`` / ``proxy (trio)``: one client connection to one
  ``acp-proxy`` with ``[pool] max_live = 8`` (other settings at their defaults),
  run by ``benchmarks/load_proxy.py``, which times every wait for a process slot;
* ``direct, 8 at a time``: the same work without the proxy. The client runs the
  agents itself under the same rule: a turn for a session without a process stops
  the least recently used idle agent (closes its stdin and waits for it to exit,
  as the proxy does before the slot counts as free), spawns the agent (plain
  ``Popen``), ``initialize``, ``session/resume``, then prompts. No wrapper, lease,
  state database or task record. This is the comparison for the ratios;
* ``direct, all 200 live``: no cap at all, one agent per session for the whole run;
  no turn ever resumes. What the cap saves in memory, and what resuming costs.

Reported per run: turns/s and ``session/update`` messages/s over the turn phase;
p50/p99 latency (prompt sent -> answer read) of resumed and of live turns; waits
for a process slot (p50/p99/max: through the proxy from ``load_proxy.py``, direct
from the client's own pool); peak live adapter processes (sampled every
``SAMPLE_INTERVAL`` s from ``/proc``, and exactly from the agents' own records of
when each started and exited; the lease rows are no tight bound, a lease being
closed only after the proxy's sweep, which lags under load); peak
RSS of the proxy (``VmHWM``) and the peak sampled sum of the RSS of the whole
tree (proxy, wrappers, adapters; direct: the agents); requests lost (every request
must get exactly one answer). More than ``max_live`` live adapters (in a
capped run), a lost or duplicated answer, or a turn that did not stream all its
updates make the run fail.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import itertools
import json
import os
import random
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import (
    BENCH_MARKER,
    ROOT,
    BenchError,
    Report,
    attempt,
    child_environment,
    cpu_seconds,
    fmt,
    leftovers,
    percentile,
    proc_status_kb,
    progress,
    proxy_mode,
    table,
)
from tests.kit.gateway import Closed, SyncGateway
from tests.kit.proctree import Descendants

LOAD_AGENT = ROOT / "benchmarks" / "load_agent.py"
LOAD_PROXY = ROOT / "benchmarks" / "load_proxy.py"
BACKEND = "load"

SESSIONS = 200
MAX_LIVE = 8
UPDATES = 20
BURST_TURNS = 3
BURSTS = 3
QUICK_BURSTS = 1
THINK_MAX = 0.05
SEED = 20_251_123

TURN_TIMEOUT = 120.0
CLOSE_TIMEOUT = 60.0
SAMPLE_INTERVAL = 0.1

DIRECT_POOL = "direct-pool"
DIRECT_ALL = "direct-all"
RESTORES = ("session/resume", "session/load")

INITIALIZE_PARAMS = {
    "protocolVersion": 1,
    "clientCapabilities": {"fs": {"readTextFile": False, "writeTextFile": False}, "terminal": False},
    "clientInfo": {"name": "acp-proxy-bench", "version": "1"},
}
SESSION_PARAMS = {"cwd": str(ROOT), "mcpServers": []}


def mode_label(mode: str) -> str:
    if mode.startswith("proxy-"):
        return f"proxy ({mode.removeprefix('proxy-')})"
    return {DIRECT_POOL: f"direct, {MAX_LIVE} at a time", DIRECT_ALL: f"direct, all {SESSIONS} live"}[mode]


def agent_argv() -> list[str]:
    return [sys.executable, str(LOAD_AGENT)]


def prompt_params(session_id: str) -> dict[str, Any]:
    return {
        "sessionId": session_id,
        "prompt": [{"type": "text", "text": "go on"}],
        "_meta": {"bench": {"updates": UPDATES}},
    }


@dataclass
class Turn:
    """One prompt's outcome as the client saw it."""

    seconds: float
    resumed: bool = False
    error: str | None = None


@dataclass
class Tally:
    """Every request sent and every answer read, by id: what "requests lost" is computed from."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    sent: set[Any] = field(default_factory=set)
    answers: collections.Counter[Any] = field(default_factory=collections.Counter)

    def lost(self) -> dict[str, int]:
        with self.lock:
            return {
                "sent": len(self.sent),
                "lost": sum(1 for i in self.sent if self.answers[i] == 0),
                "duplicated": sum(1 for i in self.sent if self.answers[i] > 1),
                "stray": sum(n for i, n in self.answers.items() if i not in self.sent),
            }


def check_turn(result: Any, updates: int) -> tuple[bool, str | None]:
    """(resumed, error) for a prompt's result and the updates streamed before it."""
    if not isinstance(result, dict) or result.get("stopReason") != "end_turn":
        return False, f"the prompt answered {str(result)[:200]}"
    report = (result.get("_meta") or {}).get("bench") or {}
    if updates != UPDATES:
        return False, f"{updates} updates streamed instead of {UPDATES}"
    return report.get("openedBy") in RESTORES and report.get("turn") == 0, None


def error_reason(msg: dict[str, Any]) -> str:
    error = msg.get("error") or {}
    data = error.get("data")
    reason = data.get("reason") if isinstance(data, dict) else None
    return f"error {error.get('code')}" + (f" ({reason})" if reason else "")


# --- through the proxy -------------------------------------------------------------------------


class ProxyClient:
    """One gateway connection to a proxy, shared by every session's thread (the kit's client, reading in a thread).

    An observer keeps the tally (ids sent, answers per id), each session's streamed
    updates and anything else the proxy says (which it must not), and hands each answer
    to the thread waiting for it. (The kit's own ``answer`` looks up its request after
    sending it: with a reader thread, an answer that arrives before the sending thread
    asks for it is taken for one to a request nobody waits for.)
    """

    def __init__(self, argv: list[str], env: dict[str, str], who: str) -> None:
        self.who = who
        self.tally = Tally()
        self._updates: collections.Counter[str] = collections.Counter()
        self.unexpected: list[str] = []
        self._ids = itertools.count(1)
        self._answered = threading.Condition()
        self._answers: dict[Any, dict[str, Any] | None] = {}
        """Requests sent and not yet taken by their caller: ``None`` until answered."""
        self.conn = SyncGateway.launch(argv, env=env, cwd=ROOT, name=who, keep=False, reader_thread=True)
        self.process = self.conn.process
        self.conn.observers.append(self._observe)

    def _observe(self, direction: str, msg: dict[str, Any]) -> None:
        if direction == "out":
            with self.tally.lock:
                self.tally.sent.add(msg["id"])
        elif "method" not in msg and "id" in msg:
            with self.tally.lock:
                self.tally.answers[msg["id"]] += 1
            with self._answered:
                if msg["id"] in self._answers:
                    self._answers[msg["id"]] = msg
                    self._answered.notify_all()
        elif msg.get("method") == "session/update" and "id" not in msg:
            self._updates[str((msg.get("params") or {}).get("sessionId"))] += 1
        else:
            self.unexpected.append(str(msg)[:200])

    def call(self, method: str, params: object, timeout: float = TURN_TIMEOUT) -> dict[str, Any] | None:
        """The answer to a request, or None if none came within ``timeout``."""
        request_id = next(self._ids)
        deadline = time.monotonic() + timeout
        with self._answered:
            self._answers[request_id] = None
        try:
            self.conn.send_request(method, params, request_id=request_id)
            with self._answered:
                while (answer := self._answers[request_id]) is None:
                    if self.conn.output_closed:
                        raise BenchError(f"{self.who}: its output closed before answering {method}")
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return None
                    self._answered.wait(min(remaining, 1.0))
                return answer
        except Closed as exc:
            raise BenchError(str(exc)) from None
        finally:
            with self._answered:
                self._answers.pop(request_id, None)

    def new_session(self) -> str:
        answer = self.call("session/new", SESSION_PARAMS)
        session_id = ((answer or {}).get("result") or {}).get("sessionId")
        if not isinstance(session_id, str):
            raise BenchError(f"{self.who}: session/new answered {str(answer)[:300]}")
        return session_id

    def open_session(self, _index: int) -> str:
        return self.new_session()

    def prompt_session(self, _index: int, session_id: str) -> Turn:
        return self.prompt(session_id)

    def prompt(self, session_id: str) -> Turn:
        self._updates[session_id] = 0
        start = time.perf_counter()
        answer = self.call("session/prompt", prompt_params(session_id))
        seconds = time.perf_counter() - start
        if answer is None:
            return Turn(seconds, error=f"no answer within {TURN_TIMEOUT:.0f} s")
        if "result" not in answer:
            return Turn(seconds, error=error_reason(answer))
        resumed, error = check_turn(answer["result"], self._updates[session_id])
        return Turn(seconds, resumed, error)

    def close(self) -> int | None:
        status = self.conn.close(CLOSE_TIMEOUT)
        if status == -signal.SIGKILL:
            raise BenchError(f"{self.who}: still running {CLOSE_TIMEOUT:.0f} s after stdin closed")
        self.unexpected += [repr(line[:200]) for line in self.conn.bad_lines]
        return status

    def kill(self) -> None:
        self.conn.kill()

    def stderr_text(self) -> str:
        return self.conn.stderr.decode("utf-8", "replace")


# --- without the proxy: the client's own pool ------------------------------------------------


class Agent:
    """One agent process the client runs itself (the kit's client), used by one thread at a time."""

    ids = itertools.count()

    def __init__(self, env: dict[str, str], tally: Tally) -> None:
        self.tally = tally
        self.index = next(Agent.ids)
        self.conn = SyncGateway.launch(agent_argv(), env=env, stderr=subprocess.DEVNULL, name="agent")
        self.conn.name = f"agent {self.conn.pid}"

    def call(self, method: str, params: object) -> tuple[dict[str, Any], int]:
        """The answer to a request and the number of updates streamed before it."""
        request_id = self.conn.send_request(method, params)
        key = (self.index, request_id)
        with self.tally.lock:
            self.tally.sent.add(key)
        answer = self.conn.answer(request_id, TURN_TIMEOUT)
        with self.tally.lock:
            self.tally.answers[key] += 1
        updates = len(self.conn.take_updates())
        if self.conn.stashed():
            raise BenchError(f"{self.conn.name}: unexpected {str(self.conn.stashed()[0])[:200]}")
        return answer, updates

    def stop(self) -> None:
        """Close its stdin and wait for it to exit, as the proxy stops an evicted adapter."""
        self.conn.close(CLOSE_TIMEOUT)


class DirectPool:
    """At most ``cap`` agents; a session without one takes a free slot or the LRU idle agent's."""

    def __init__(self, cap: int, env: dict[str, str], tally: Tally) -> None:
        self.cap = cap
        self.env = env
        self.tally = tally
        self.cond = threading.Condition()
        self.live: collections.OrderedDict[str, Agent] = collections.OrderedDict()  # LRU first
        self.busy: set[str] = set()
        self.starting = 0
        self.stopping = 0
        self.peak = 0
        self.waits: list[float] = []
        self.eviction_waits: list[float] = []
        """The waits in which this pool stopped an agent to make room (from the request to the slot had)."""
        self.start_costs: list[float] = []
        """Each start, from the slot had to the session opened or restored on the new agent (as the proxy's
        pool learns its start cost)."""

    def _count(self) -> None:
        self.peak = max(self.peak, len(self.live) + self.starting + self.stopping)

    def _slot(self) -> None:
        """Reserve room for one more agent (the caller holds ``cond``), stopping the LRU idle one if needed."""
        start = time.perf_counter()
        stopped = False
        while len(self.live) + self.starting + self.stopping >= self.cap:
            idle = next((s for s in self.live if s not in self.busy), None)
            if idle is None:
                self.cond.wait()
                continue
            agent = self.live.pop(idle)
            stopped = True
            self.stopping += 1
            self.cond.release()
            try:
                agent.stop()
            finally:
                self.cond.acquire()
                self.stopping -= 1
                self.cond.notify_all()
        self.starting += 1
        self._count()
        self.waits.append(time.perf_counter() - start)
        if stopped:
            self.eviction_waits.append(self.waits[-1])

    def _spawn(self, session_id: str | None) -> tuple[Agent, str]:
        """Outside the lock: a new agent, initialized, with the session restored (or a new one)."""
        start = time.perf_counter()
        agent = Agent(self.env, self.tally)
        try:
            agent.call("initialize", INITIALIZE_PARAMS)
            if session_id is None:
                answer, _ = agent.call("session/new", SESSION_PARAMS)
                session_id = str(answer["result"]["sessionId"])
            else:
                agent.call("session/resume", {**SESSION_PARAMS, "sessionId": session_id})
        except BaseException:
            agent.stop()
            with self.cond:
                self.starting -= 1
                self.cond.notify_all()
            raise
        with self.cond:
            self.start_costs.append(time.perf_counter() - start)
            self.starting -= 1
            self.live[session_id] = agent
            self.busy.add(session_id)
            self._count()
        return agent, session_id

    def acquire(self, session_id: str | None) -> tuple[Agent, str]:
        with self.cond:
            if session_id is not None and session_id in self.live:
                self.live.move_to_end(session_id)
                self.busy.add(session_id)
                return self.live[session_id], session_id
            self._slot()
        return self._spawn(session_id)

    def release(self, session_id: str) -> None:
        with self.cond:
            self.busy.discard(session_id)
            if session_id in self.live:
                self.live.move_to_end(session_id)
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            agents, self.live = list(self.live.values()), collections.OrderedDict()
        for agent in agents:
            agent.stop()


class DirectClient:
    def __init__(self, cap: int, env: dict[str, str]) -> None:
        self.tally = Tally()
        self.pool = DirectPool(cap, env, self.tally)

    def new_session(self) -> str:
        _, session_id = self.pool.acquire(None)
        self.pool.release(session_id)
        return session_id

    def open_session(self, _index: int) -> str:
        return self.new_session()

    def prompt_session(self, _index: int, session_id: str) -> Turn:
        return self.prompt(session_id)

    def prompt(self, session_id: str) -> Turn:
        start = time.perf_counter()
        agent, _ = self.pool.acquire(session_id)
        try:
            answer, updates = agent.call("session/prompt", prompt_params(session_id))
        finally:
            self.pool.release(session_id)
        seconds = time.perf_counter() - start
        if "result" not in answer:
            return Turn(seconds, error=error_reason(answer))
        resumed, error = check_turn(answer["result"], updates)
        return Turn(seconds, resumed, error)


def peak_lifetimes(path: Path) -> tuple[int, int]:
    """(the most agents alive at once, agents that never recorded their end) from ``load_agent.py``'s records."""
    starts: dict[str, float] = {}
    ends: dict[str, float] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        event, pid, moment = line.split()
        (starts if event == "start" else ends)[pid] = float(moment)
    events = [(moment, 1) for moment in starts.values()]
    events += [(ends.get(pid, float("inf")), -1) for pid in starts]
    alive = peak = 0
    for _, delta in sorted(events):  # at the same instant an end sorts before a start
        alive += delta
        peak = max(peak, alive)
    return peak, sum(1 for pid in starts if pid not in ends)


# --- one run ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Eviction:
    """One suspension an acquire asked for (``load_proxy.py``): times in seconds since the acquire began."""

    peer: bool
    """Asked of another proxy of the install (through its control socket), not done in this one."""
    asked: float
    answered: float
    ok: bool
    """The session was suspended (else its holder refused: it was no longer idle)."""


@dataclass(frozen=True)
class Acquire:
    """One wait for a process slot in a proxy, from ``load_proxy.py``'s record."""

    seconds: float
    ok: bool
    evictions: tuple[Eviction, ...] = ()
    began: float = 0.0
    """``CLOCK_MONOTONIC`` when it began (the same clock in every process of the host)."""

    @property
    def suspended(self) -> Eviction | None:
        """The suspension that freed the slot this acquire got (the last one granted), if any."""
        return next((e for e in reversed(self.evictions) if e.ok), None)


def parse_acquire(line: str) -> Acquire:
    """``<seconds> <ok|failed> <-|where,asked,answered,ok;...> <began>`` (see ``load_proxy.py``)."""
    seconds, outcome, asked_for, began = line.split()
    evictions = []
    for part in asked_for.split(";") if asked_for != "-" else []:
        where, asked, answered, ok = part.split(",")
        evictions.append(Eviction(where == "peer", float(asked), float(answered), ok == "1"))
    return Acquire(float(seconds), outcome == "ok", tuple(evictions), float(began))


def read_acquires(path: Path) -> list[Acquire]:
    return [parse_acquire(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def acquire_figures(acquires: list[Acquire]) -> dict[str, Any]:
    """How the proxy's waits for a slot went: how many suspended something (here, in a peer), how many were refused."""
    return {
        "acquires": len(acquires),
        "acquires_failed": sum(1 for a in acquires if not a.ok),
        "acquires_suspending_own": sum(1 for a in acquires if a.suspended is not None and not a.suspended.peer),
        "acquires_suspending_peer": sum(1 for a in acquires if a.suspended is not None and a.suspended.peer),
        "evictions_refused": sum(1 for a in acquires for e in a.evictions if not e.ok),
    }


def eviction_figures(acquires: list[Acquire], *, peer: bool) -> dict[str, Any]:
    """The slot waits that got their slot by a suspension (another proxy's if ``peer``, else their own proxy's),
    in ms: in all, and split into *plan* (up to the granted ask), *ask* (the ask itself) and *free* (from
    the yes to the slot held: the suspended session's tree ending)."""
    evicting = [(a, e) for a in acquires if a.ok and (e := a.suspended) is not None and e.peer == peer]
    return {
        "eviction_ms": stats(sorted(a.seconds * 1000 for a, _ in evicting)),
        "plan_ms": stats(sorted(e.asked * 1000 for _, e in evicting)),
        "ask_ms": stats(sorted((e.answered - e.asked) * 1000 for _, e in evicting)),
        "free_ms": stats(sorted((a.seconds - e.answered) * 1000 for a, e in evicting)),
    }


def window_figures(acquire_files: list[Path]) -> dict[str, Any]:
    """From ``load_proxy.py``'s ``.windows`` files: the start costs the pools learned, the protections granted (ms)."""
    found: dict[str, list[float]] = {"start": [], "protect": []}
    woken = timed_out = plans = 0
    planning = 0.0
    for path in (Path(f"{acquires}.windows") for acquires in acquire_files):
        for line in path.read_text().splitlines() if path.exists() else []:
            kind, *values = line.split()
            if kind == "wakeups":
                woken, timed_out = woken + int(values[0]), timed_out + int(values[1])
            elif kind == "plans":
                plans, planning = plans + int(values[0]), planning + float(values[1])
            else:
                found[kind].append(float(values[0]) * 1000)
    return {
        "start_cost_ms": stats(sorted(found["start"])),
        "protection_ms": stats(sorted(found["protect"])),
        "waiter_wakeups": {"woken": woken, "timed_out": timed_out},
        "install_reads": {"count": plans, "seconds": planning},
    }


RESUMED_LINE = re.compile(r"session \S+ resumed on pid \d+ in (\d+) ms")
SUSPENDED_LINE = re.compile(r"session \S+ suspended \((.*?)\): stopping pid")


def log_figures(logged: str) -> dict[str, Any]:
    """From a proxy's log: how long each restore took inside the proxy, and why sessions were suspended."""
    resumes = sorted(float(ms) for ms in RESUMED_LINE.findall(logged))
    reasons = collections.Counter(re.sub(r"[\d.]+s", "Ns", why) for why in SUSPENDED_LINE.findall(logged))
    return {
        "log_lines": logged.count("\n"),
        "pool_full_log_lines": logged.count(" pool full for backend "),
        "logged_resume_ms": stats(resumes),
        "suspended_by_reason": dict(reasons),
    }


def stats(values: list[float]) -> dict[str, float | None]:
    """n, p50, p99, max and mean of already sorted values."""
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None, "mean": None}
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "max": values[-1],
        "mean": statistics.fmean(values),
    }


def drive(
    sessions: int,
    open_session: Callable[[int], str],
    prompt: Callable[[int, str], Turn],
    bursts: int,
    who: str,
    think_max: float = THINK_MAX,
    on_turns: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """All sessions at once: open, then bursts of turns; what each turn and each opening took.

    ``open_session(i)`` opens session ``i`` (its id), ``prompt(i, id)`` runs one turn of it;
    each session has a thread of its own. ``on_turns`` is called once every session is open,
    before the first turn.
    """
    created: list[float] = []
    turns: list[Turn] = []
    failures: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(sessions + 1, action=on_turns)

    def session(index: int) -> None:
        rng = random.Random(SEED * 1000 + index)
        session_id = None
        try:
            start = time.perf_counter()
            session_id = open_session(index)
            with lock:
                created.append(time.perf_counter() - start)
        except BenchError as exc:
            with lock:
                failures.append(f"session/new: {exc}")
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait()
        if session_id is None:
            return
        for _ in range(bursts):
            time.sleep(rng.uniform(0, think_max))
            for _ in range(BURST_TURNS):
                try:
                    turn = prompt(index, session_id)
                except BenchError as exc:
                    turn = Turn(0.0, error=str(exc))
                with lock:
                    turns.append(turn)

    threads = [threading.Thread(target=session, args=(i,), daemon=True) for i in range(sessions)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    barrier.wait()
    creation_s = time.perf_counter() - start
    progress(f"{who}: {len(created)} sessions opened in {creation_s:.1f} s; turns ...")
    turns_began = time.monotonic()
    turns_start = time.perf_counter()
    for thread in threads:
        thread.join()
    turns_s = time.perf_counter() - turns_start
    return {
        "created": created,
        "creation_s": creation_s,
        "turns": turns,
        "turns_s": turns_s,
        "turns_window": (turns_began, time.monotonic()),
        "failures": failures,
    }


def summarize(
    mode: str, driven: dict[str, Any], waits: list[float], extra: dict[str, Any], sessions: int = SESSIONS
) -> dict[str, Any]:
    turns: list[Turn] = driven["turns"]
    ok = [t for t in turns if t.error is None]
    resumed = sorted(t.seconds * 1000 for t in ok if t.resumed)
    live = sorted(t.seconds * 1000 for t in ok if not t.resumed)
    created = sorted(s * 1000 for s in driven["created"])
    waits_ms = sorted(w * 1000 for w in waits)
    errors = collections.Counter(t.error for t in turns if t.error is not None)

    return {
        "mode": mode,
        "sessions": sessions,
        "turns": len(turns),
        "turns_ok": len(ok),
        "updates": len(ok) * UPDATES,
        "creation_s": driven["creation_s"],
        "session_new_ms": stats(created),
        "turns_s": driven["turns_s"],
        "turns_per_s": len(ok) / driven["turns_s"],
        "resumes_per_s": len(resumed) / driven["turns_s"],
        "updates_per_s": len(ok) * UPDATES / driven["turns_s"],
        "resumed_ms": stats(resumed),
        "live_ms": stats(live),
        "acquire_ms": stats(waits_ms),
        "turn_errors": dict(errors),
        "session_new_failures": driven["failures"],
        **extra,
    }


def pool_settings(args: argparse.Namespace) -> str:
    """The ``[pool]`` lines a run's options add to the proxies' config (``--min-idle``)."""
    min_idle = getattr(args, "min_idle", None)
    return "" if min_idle is None else f"min_idle = {min_idle}\n"


def proxy_run(backend: str, env: dict[str, str], workdir: Path, bursts: int, pool: str = "") -> dict[str, Any]:
    mode = proxy_mode(backend)
    who = mode_label(mode)
    lifetimes = workdir / f"lifetimes-{mode}.txt"
    env = {**env, "LOAD_AGENT_LIFETIMES": str(lifetimes)}
    state = workdir / f"state-{backend}"
    config = workdir / f"load-{backend}.toml"
    config.write_text(
        f"[pool]\nmax_live = {MAX_LIVE}\n{pool}[backends.{BACKEND}]\ncommand = {json.dumps(agent_argv())}\n",
    )
    acquires = workdir / f"acquires-{backend}.txt"
    argv = [sys.executable, str(LOAD_PROXY), str(acquires), "--async-backend", backend, "--config", str(config)]
    client = ProxyClient(argv, {**env, "ACP_PROXY_STATE_DIR": str(state)}, who)
    try:
        answer = client.call("initialize", INITIALIZE_PARAMS, timeout=30)
        if answer is None or "result" not in answer:
            raise BenchError(f"{who}: initialize answered {str(answer)[:300]}")
        cpu_at_turns: list[float | None] = []
        with Descendants(client.process.pid, depth=2, count_root=True, seconds=SAMPLE_INTERVAL) as sampler:
            driven = drive(
                SESSIONS,
                client.open_session,
                client.prompt_session,
                bursts,
                f"load: {who}",
                on_turns=lambda: cpu_at_turns.append(cpu_seconds(client.process.pid)),
            )
            sampler.sample()
        cpu_after = cpu_seconds(client.process.pid)
        proxy_hwm = proc_status_kb(client.process.pid, "VmHWM")
        status = client.close()
    except BaseException:
        client.kill()
        raise
    finally:
        client.conn.close(0)  # after a kill: reaps it and keeps its log
        logged = client.stderr_text()
    recorded = read_acquires(acquires)
    if status != 0:
        raise BenchError(f"{who}: the proxy exited with status {status}: {logged[-500:]}")
    row = summarize(
        mode,
        driven,
        [a.seconds for a in recorded if a.ok],
        {
            "requests": client.tally.lost(),
            "unexpected_lines": len(client.unexpected),
            "peak_adapters_sampled": sampler.peak_adapters,
            **lifetime_figures(lifetimes),
            "samples": sampler.samples,
            "proxy_peak_rss_mb": None if proxy_hwm is None else proxy_hwm / 1024,
            "proxy_cpu_s": cpu_spent(cpu_at_turns, cpu_after),
            "tree_peak_rss_mb": sampler.peak_rss / (1 << 20),
            **acquire_figures(recorded),
            **eviction_figures(recorded, peer=False),
            **window_figures([acquires]),
            **log_figures(logged),
        },
    )
    return row


def cpu_spent(before: list[float | None], after: float | None) -> float | None:
    """CPU seconds between the reading taken when the turns began (if any) and ``after``."""
    first = before[0] if before else None
    return None if first is None or after is None else after - first


def lifetime_figures(path: Path) -> dict[str, int]:
    peak, unended = peak_lifetimes(path)
    return {"peak_adapters_exact": peak, "agents_without_end": unended}


def direct_run(mode: str, env: dict[str, str], workdir: Path, bursts: int) -> dict[str, Any]:
    who = mode_label(mode)
    lifetimes = workdir / f"lifetimes-{mode}.txt"
    env = {**env, "LOAD_AGENT_LIFETIMES": str(lifetimes)}
    client = DirectClient(MAX_LIVE if mode == DIRECT_POOL else SESSIONS, env)
    try:
        with Descendants(os.getpid(), depth=1, count_root=False, seconds=SAMPLE_INTERVAL) as sampler:
            driven = drive(SESSIONS, client.open_session, client.prompt_session, bursts, f"load: {who}")
            sampler.sample()
    finally:
        client.pool.close()
    return summarize(
        mode,
        driven,
        client.pool.waits,
        {
            "requests": client.tally.lost(),
            "unexpected_lines": 0,
            "peak_adapters_sampled": sampler.peak_adapters,
            "peak_adapters_counted": client.pool.peak,
            "eviction_wait_ms": stats(sorted(w * 1000 for w in client.pool.eviction_waits)),
            "start_cost_ms": stats(sorted(w * 1000 for w in client.pool.start_costs)),
            **lifetime_figures(lifetimes),
            "samples": sampler.samples,
            "proxy_peak_rss_mb": None,
            "tree_peak_rss_mb": sampler.peak_rss / (1 << 20),
        },
    )


def check_row(report: Report, row: dict[str, Any], *, who: str | None = None, cap: int | None = None) -> None:
    """What makes a run fail: lost or duplicated answers, a short stream, more processes than the cap."""
    who = who or f"load {mode_label(row['mode'])}"
    requests = row["requests"]
    if requests["lost"] or requests["duplicated"] or requests["stray"] or row["unexpected_lines"]:
        report.errors.append(f"{who}: requests {requests}, unexpected lines {row['unexpected_lines']}")
    short = {e: n for e, n in row["turn_errors"].items() if "updates streamed" in e}
    if short:
        report.errors.append(f"{who}: turns with a short stream: {short}")
    if row["session_new_failures"]:
        report.errors.append(f"{who}: session/new failed: {row['session_new_failures'][:3]}")
    if cap is None:
        cap = MAX_LIVE if row["mode"] != DIRECT_ALL else SESSIONS
    peak = max(row["peak_adapters_sampled"], row["peak_adapters_exact"])
    row["over_cap"] = peak > cap
    if row["over_cap"]:
        report.errors.append(f"{who}: {peak} live adapters at once, the cap is {cap}")


def measure_load(report: Report, args: argparse.Namespace) -> dict[str, Any]:
    bursts = QUICK_BURSTS if args.quick else BURSTS
    token = secrets.token_hex(8)
    env = {**child_environment(), BENCH_MARKER: token}
    env.pop("ACP_PROXY_CONFIG", None)
    results: dict[str, Any] = {
        "sessions": SESSIONS,
        "max_live": MAX_LIVE,
        "updates_per_turn": UPDATES,
        "bursts": bursts,
        "burst_turns": BURST_TURNS,
        "think_max_s": THINK_MAX,
        "seed": SEED,
        "pool_settings": pool_settings(args),
        "rows": [],
    }
    with tempfile.TemporaryDirectory(prefix="acp-proxy-bench-load-") as name:
        workdir = Path(name)
        runs: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            (DIRECT_POOL, lambda: direct_run(DIRECT_POOL, env, workdir, bursts))
        ]
        for backend in args.backends:
            proxied = functools.partial(proxy_run, backend, env, workdir, bursts, pool_settings(args))
            runs.append((proxy_mode(backend), proxied))
        runs.append((DIRECT_ALL, lambda: direct_run(DIRECT_ALL, env, workdir, bursts)))
        for mode, run in runs:
            progress(f"load: {mode_label(mode)}, {SESSIONS} sessions x {bursts * BURST_TURNS} turns ...")
            row = attempt(report, f"load {mode_label(mode)}", run)
            if row is not None:
                check_row(report, row)
                results["rows"].append(row)
    base = next((r for r in results["rows"] if r["mode"] == DIRECT_POOL), None)
    for row in results["rows"]:
        row["vs_direct_pool_throughput"] = row["turns_per_s"] / base["turns_per_s"] if base else None
        for kind in ("resumed_ms", "live_ms"):
            ours, theirs = row[kind]["p50"], base[kind]["p50"] if base else None
            row[f"added_{kind}_p50"] = ours - theirs if ours is not None and theirs is not None else None
    left = leftovers(token)
    results["left_running"] = left
    if left:
        report.errors.append(f"load: processes outlived the benchmark (killed now): {left}")
    return results


# --- reporting -------------------------------------------------------------------------------


def render(results: dict[str, Any]) -> list[str]:
    rows = results.get("rows") or []
    if not rows:
        return []
    turns = results["bursts"] * results["burst_turns"]
    out = [
        f"## Load: {results['sessions']} concurrent sessions over `max_live = {results['max_live']}`, "
        f"{turns} streaming turns each ({results['updates_per_turn']} updates of 180 B), one client",
        "",
        f"Each session is a client thread: `session/new` all at once, then {results['bursts']} burst(s) of "
        f"{results['burst_turns']} back-to-back prompts after a random pause of up to "
        f"{results['think_max_s'] * 1000:.0f} ms (seed {results['seed']}). A turn is *resumed* when it was the "
        "first on a process that had just restored its session, else *live* (the agent says which). "
        f"Direct, {results['max_live']} at a time: the client itself runs the agents under the same cap and "
        "LRU rule (stop the least recently used idle agent and wait for its exit, spawn, `initialize`, "
        "`session/resume`): the same work without the proxy, and the base of the ratios. "
        f"Direct, all {results['sessions']} live: no cap, nothing ever resumes. Slot waits through the "
        "proxy: every call of the pool's acquire (including `session/new`), timed in the proxy; direct: the "
        "client pool's own. Peak live adapters: sampled from /proc every "
        f"{SAMPLE_INTERVAL * 1000:.0f} ms / exact (from each agent's own record of its start and exit). "
        "Tree RSS: the peak sampled sum over proxy, wrappers and adapters "
        "(direct: the agents).",
        "",
    ]
    if results.get("pool_settings"):
        out += [f"The proxies ran with these `[pool]` settings too: `{results['pool_settings'].strip()}`.", ""]
    table_rows = []
    for row in rows:
        is_proxy = row["mode"].startswith("proxy-")
        exact = row["peak_adapters_exact"]
        errors = sum(row["turn_errors"].values())
        table_rows.append(
            [
                mode_label(row["mode"]),
                f"{row['turns_ok']:,}/{row['turns']:,}",
                fmt(row["turns_s"], 1),
                fmt(row["turns_per_s"], 0),
                fmt(row["resumes_per_s"], 1),
                fmt(row["updates_per_s"], 0),
                fmt(row["vs_direct_pool_throughput"], 2, "x") if row["mode"] != DIRECT_POOL else "",
                f"{fmt(row['resumed_ms']['p50'], 1)} ({fmt(row['resumed_ms']['p99'], 1)}), n={row['resumed_ms']['n']}",
                f"{fmt(row['live_ms']['p50'], 1)} ({fmt(row['live_ms']['p99'], 1)}), n={row['live_ms']['n']}",
                f"{fmt(row['acquire_ms']['p50'], 1)} / {fmt(row['acquire_ms']['p99'], 1)} / "
                f"{fmt(row['acquire_ms']['max'], 1)}, n={row['acquire_ms']['n']}",
                f"{row['peak_adapters_sampled']} / {exact}" + (" **OVER**" if row["over_cap"] else ""),
                fmt(row["proxy_peak_rss_mb"], 1) if is_proxy else "",
                fmt(row["tree_peak_rss_mb"], 0),
                str(row["requests"]["lost"] + row["requests"]["duplicated"]),
                str(errors) + (f" {row['turn_errors']}" if errors else ""),
            ]
        )
    header = [
        "run by",
        "turns ok",
        "turn phase s",
        "turns/s",
        "resumes/s",
        "updates/s",
        "throughput vs direct 8",
        "resumed turn p50 (p99) ms",
        "live turn p50 (p99) ms",
        "slot wait p50 / p99 / max ms",
        "peak live adapters sampled / exact",
        "proxy peak RSS MB",
        "tree peak RSS MB",
        "requests lost",
        "turn errors",
    ]
    out += table(header, table_rows)
    out += [""]
    for row in rows:
        created = row["session_new_ms"]
        line = (
            f"* {mode_label(row['mode'])}: {row['sessions']} `session/new` at once took {row['creation_s']:.1f} s "
            f"(each p50 {fmt(created['p50'], 0)} ms, p99 {fmt(created['p99'], 0)} ms)"
        )
        if row["mode"] != DIRECT_POOL and row.get("added_resumed_ms_p50") is not None:
            line += f"; resumed p50 {row['added_resumed_ms_p50']:+.1f} ms vs direct 8"
        if row.get("added_live_ms_p50") is not None and row["mode"] != DIRECT_POOL:
            line += f", live p50 {row['added_live_ms_p50']:+.1f} ms"
        requests = row["requests"]
        line += f"; {requests['sent']:,} requests, {requests['lost']} lost, {requests['duplicated']} answered twice"
        if row["mode"] == DIRECT_POOL and row.get("start_cost_ms"):
            line += f"; a start (spawn, `initialize`, restore) took p50 {fmt(row['start_cost_ms']['p50'], 0)} ms"
        if "log_lines" in row:
            line += (
                f"; the proxy logged {row['log_lines']:,} lines ({row['pool_full_log_lines']:,} 'pool full'), "
                f"{row['acquires_failed']} slot waits failed; {row['acquires_suspending_own']} slot waits "
                f"suspended a session ({row['evictions_refused']} refusals); a restore inside the proxy took "
                f"p50 {fmt(row['logged_resume_ms']['p50'], 0)} ms (n={row['logged_resume_ms']['n']}); "
                f"suspended: {row['suspended_by_reason'] or 'none'}; a slot wait that suspended a session took "
                f"p50 {fmt(row['eviction_ms']['p50'], 0)} ms, of which plan / ask / free p50 "
                f"{' / '.join(fmt(row[part]['p50'], 1) for part in ('plan_ms', 'ask_ms', 'free_ms'))} ms; "
                f"the proxy used {fmt(row['proxy_cpu_s'], 1)} s of CPU in the turn phase; waiters for a slot woke "
                f"{row['waiter_wakeups']['woken']:,} times on a change and {row['waiter_wakeups']['timed_out']:,} "
                "times on a timeout (the whole run) and read the install's slots "
                f"{row['install_reads']['count']:,} times ({row['install_reads']['seconds']:.1f} s); "
                f"start cost learned p50 {fmt(row['start_cost_ms']['p50'], 0)} ms (p99 "
                f"{fmt(row['start_cost_ms']['p99'], 0)}), protection granted p50 "
                f"{fmt(row['protection_ms']['p50'], 0)} ms (p99 {fmt(row['protection_ms']['p99'], 0)})"
            )
        out.append(line + ".")
    left = results.get("left_running", [])
    out += [
        "",
        "Processes carrying this run's marker left running at the end of the load benchmark: "
        + (", ".join(map(str, left)) + " (killed)" if left else "none"),
        "",
    ]
    return out
