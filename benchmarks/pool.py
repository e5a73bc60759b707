"""The pool under load: many sessions over a cap on live processes, run directly and through proxies.

Every adapter is ``benchmarks/load_agent.py``: it resumes any session id at once and
answers each prompt with ``UPDATES`` streamed ``session/update`` lines (180 B), then
the answer, whose ``_meta`` says which process served the turn, which request opened
the session there and how many turns it had served: so every turn is classified
*resumed* (the first turn after its session was brought back on a new process) or
*live* (its session already had a process) from what the adapter saw, the same way
in every run.

A ``Workload`` (``benchmarks/load.py``: 200 sessions in one proxy; ``benchmarks/install.py``:
20 proxies of one session each, one install) is run the same way every time: each
session is driven by its own client thread; all open at once, then each runs
``bursts`` bursts of ``BURST_TURNS`` back-to-back prompts, with a seeded random pause
of up to ``THINK_MAX`` s before each burst.

* through the proxies: each run by ``benchmarks/load_proxy.py``, which times every
  wait for a process slot, with ``[pool] max_live`` set (other settings at their
  defaults), all of one state dir;
* ``direct, N at a time``: the same work without the proxy. The client runs the
  agents itself under the same rule: a turn for a session without a process stops
  the least recently used idle agent (closes its stdin and waits for it to exit,
  as the proxy does before the slot counts as free), spawns the agent (plain
  ``Popen``), ``initialize``, ``session/resume``, then prompts. No wrapper, lease,
  state database or task record. The base of the ratios;
* ``direct, all live``: no cap at all, one agent per session for the whole run.

Every run yields ``summarize``'s figures: turns/s, resumes/s and updates/s over the
turn phase; p50/p99 of resumed and live turns (prompt sent -> answer read); the
waits for a process slot; peak live adapter processes, sampled every
``SAMPLE_INTERVAL`` s by ``tests.kit.proctree.Descendants`` and exactly from the agents' own records of
when each started and exited; the peak sampled RSS of the whole tree; requests lost
(every request must get exactly one answer). More than the cap of live adapters, a
lost or duplicated answer, or a turn that did not stream all its updates make the
run fail.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import itertools
import json
import os
import random
import re
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import (
    INITIALIZE_PARAMS,
    ROOT,
    BenchError,
    busy_share,
    cpu_seconds,
    machine_jiffies,
    percentile,
    proc_status_kb,
    run_cpu_seconds,
    script_argv,
)
from benchmarks.harness import (
    Case,
    Column,
    Report,
    Row,
    Section,
    Target,
    fmt,
    is_proxy,
    isolated,
    left_running,
    mode_label,
    progress,
    proxy_mode,
    ratio,
    render_table,
    run_each,
    with_baseline,
)
from tests.kit.gateway import Closed, SyncGateway
from tests.kit.proctree import Descendants

BACKEND = "load"

UPDATES = 20
BURST_TURNS = 3
THINK_MAX = 0.05
SEED = 20_251_123

TURN_TIMEOUT = 120.0
CLOSE_TIMEOUT = 60.0
OPEN_TIMEOUT = 60.0
SAMPLE_INTERVAL = 0.1

DIRECT_POOL = "direct-pool"
DIRECT_ALL = "direct-all"
RESTORES = ("session/resume", "session/load")

SESSION_PARAMS = {"cwd": str(ROOT), "mcpServers": []}


def agent_argv() -> list[str]:
    return script_argv("load_agent.py")


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


# --- sampling the process tree -----------------------------------------------------------------


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
        "eviction_ms": stats_ms(a.seconds for a, _ in evicting),
        "plan_ms": stats_ms(e.asked for _, e in evicting),
        "ask_ms": stats_ms(e.answered - e.asked for _, e in evicting),
        "free_ms": stats_ms(a.seconds - e.answered for a, e in evicting),
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


def stats_ms(seconds: Iterable[float]) -> dict[str, float | None]:
    """``stats`` of durations in seconds, in milliseconds."""
    return stats(sorted(s * 1000 for s in seconds))


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
    jiffies = machine_jiffies()
    for thread in threads:
        thread.join()
    turns_s = time.perf_counter() - turns_start
    return {
        "machine_busy": busy_share(jiffies, machine_jiffies()),
        "created": created,
        "creation_s": creation_s,
        "turns": turns,
        "turns_s": turns_s,
        "turns_window": (turns_began, time.monotonic()),
        "failures": failures,
    }


def summarize(
    mode: str, driven: dict[str, Any], waits: list[float], extra: dict[str, Any], sessions: int
) -> dict[str, Any]:
    turns: list[Turn] = driven["turns"]
    ok = [t for t in turns if t.error is None]
    resumed = [t.seconds for t in ok if t.resumed]
    errors = collections.Counter(t.error for t in turns if t.error is not None)

    return {
        "mode": mode,
        "sessions": sessions,
        "turns": len(turns),
        "turns_ok": len(ok),
        "updates": len(ok) * UPDATES,
        "creation_s": driven["creation_s"],
        "session_new_ms": stats_ms(driven["created"]),
        "turns_s": driven["turns_s"],
        "turns_per_s": len(ok) / driven["turns_s"],
        "resumes_per_s": len(resumed) / driven["turns_s"],
        "updates_per_s": len(ok) * UPDATES / driven["turns_s"],
        "resumed_ms": stats_ms(resumed),
        "live_ms": stats_ms(t.seconds for t in ok if not t.resumed),
        "acquire_ms": stats_ms(waits),
        "turn_errors": dict(errors),
        "session_new_failures": driven["failures"],
        "machine_busy": driven["machine_busy"],
        **extra,
    }


def pool_settings(args: argparse.Namespace) -> str:
    """The ``[pool]`` lines a run's options add to the proxies' config (``--min-idle``)."""
    min_idle = getattr(args, "min_idle", None)
    return "" if min_idle is None else f"min_idle = {min_idle}\n"


# --- a workload, directly and through the proxies -------------------------------------------

PROXIES = "proxies"
"""In ``Workload.modes``: the runs through the proxy, one per event loop measured."""


@dataclass(frozen=True)
class Workload:
    """One pool benchmark: ``sessions`` over ``max_live`` processes, served by ``proxies`` proxies of one install
    (1: one proxy for all; ``sessions``: one each, as acpx runs them).

    ``modes``: the runs in order. ``through``: how a proxy's row is named. ``turn_phase_waits``: count only the
    slot waits that began once every session was open (else every one, ``session/new``'s included).
    ``compared``: the turn latencies (``resumed_ms``, ``live_ms``) whose p50 is also given against the direct pool.
    ``proxy_figures`` (from each proxy's CPU seconds in the turn phase and its ``VmRSS`` and ``VmHWM`` in MB at
    the end) and ``direct_figures`` (from the ``stats_ms`` of the direct pool's stopping waits and starts) add the
    workload's own figures to a row.
    """

    name: str
    sessions: int
    max_live: int
    bursts: int
    quick_bursts: int
    proxies: int
    through: str
    modes: tuple[str, ...]
    turn_phase_waits: bool
    proxy_figures: Callable[[list[float], dict[str, list[float]]], Row]
    direct_figures: Callable[[dict[str, float | None], dict[str, float | None]], Row]
    compared: tuple[str, ...] = ()
    recorded: Row = field(default_factory=dict)
    """What the results record beside the rows, beyond what every workload records."""

    def label(self, mode: str) -> str:
        if is_proxy(mode):
            return mode_label(mode, through=self.through)
        if mode == DIRECT_POOL:
            return f"direct, {self.max_live} at a time"
        return f"direct, all {self.sessions} live"

    def cap(self, mode: str) -> int:
        return self.sessions if mode == DIRECT_ALL else self.max_live


class Fleet:
    """A workload's proxies, all of one install, each with a client connection of its own."""

    def __init__(self, workload: Workload, backend: str, env: dict[str, str], workdir: Path, pool: str) -> None:
        self.workload = workload
        self.who = workload.label(proxy_mode(backend))
        config = workdir / f"{workload.name}-{backend}.toml"
        backend_table = f"[backends.{BACKEND}]\ncommand = {json.dumps(agent_argv())}\n"
        config.write_text(f"[pool]\nmax_live = {workload.max_live}\n{pool}{backend_table}")
        self.acquire_files = [workdir / f"acquires-{backend}-{i}.txt" for i in range(workload.proxies)]
        env = {**env, "ACP_PROXY_STATE_DIR": str(workdir / f"state-{backend}")}
        self.clients: list[ProxyClient] = []
        try:
            for i, acquires in enumerate(self.acquire_files):
                argv = script_argv("load_proxy.py", str(acquires), "--async-backend", backend)
                who = self.who if workload.proxies == 1 else f"{self.who} #{i}"
                self.clients.append(ProxyClient([*argv, "--config", str(config)], env, who))
        except BaseException:
            self.kill()
            raise

    def client(self, index: int) -> ProxyClient:
        """The connection session ``index`` is served on."""
        return self.clients[index % len(self.clients)]

    def initialize(self, client: ProxyClient) -> None:
        answer = client.call("initialize", INITIALIZE_PARAMS, timeout=OPEN_TIMEOUT)
        if answer is None or "result" not in answer:
            raise BenchError(f"{client.who}: initialize answered {str(answer)[:300]}")

    def open_session(self, index: int) -> str:
        """A proxy of one session is initialized as its session opens (acpx starts one per session)."""
        client = self.client(index)
        if len(self.clients) == self.workload.sessions:
            self.initialize(client)
        return client.new_session()

    def prompt(self, index: int, session_id: str) -> Turn:
        return self.client(index).prompt(session_id)

    def cpu_seconds(self) -> list[float | None]:
        """Each proxy's CPU time so far (user + system)."""
        return [cpu_seconds(client.process.pid) for client in self.clients]

    def memory(self) -> dict[str, list[float]]:
        """Each proxy's ``VmRSS`` now and ``VmHWM``, in MB (the ones that could be read)."""
        found: dict[str, list[float]] = {"VmRSS": [], "VmHWM": []}
        for client in self.clients:
            for name, values in found.items():
                kb = proc_status_kb(client.process.pid, name)
                if kb is not None:
                    values.append(kb / 1024)
        return found

    def close(self) -> list[int | None]:
        """End every proxy (stdin EOF to all first: they suspend and exit side by side); their exit statuses."""
        for client in self.clients:
            client.conn.close_input()
        return [client.close() for client in self.clients]

    def kill(self) -> None:
        for client in self.clients:
            client.kill()

    def logs(self) -> str:
        return "".join(client.stderr_text() for client in self.clients)


def in_window(acquires: list[Acquire], window: tuple[float, float]) -> list[Acquire]:
    return [a for a in acquires if window[0] <= a.began <= window[1]]


def spread(values: list[float]) -> dict[str, float | None]:
    ordered = sorted(values)
    return {
        "n": len(ordered),
        "p50": percentile(ordered, 50) if ordered else None,
        "max": ordered[-1] if ordered else None,
        "mean": statistics.fmean(ordered) if ordered else None,
    }


def lifetime_figures(path: Path) -> dict[str, int]:
    peak, unended = peak_lifetimes(path)
    return {"peak_adapters_exact": peak, "agents_without_end": unended}


def proxy_run(workload: Workload, backend: str, env: dict[str, str], workdir: Path, bursts: int, pool: str) -> Row:
    mode = proxy_mode(backend)
    who = workload.label(mode)
    lifetimes = workdir / f"lifetimes-{mode}.txt"
    cpu_before = run_cpu_seconds()
    fleet = Fleet(workload, backend, {**env, "LOAD_AGENT_LIFETIMES": str(lifetimes)}, workdir, pool)
    cpu_at_turns: list[list[float | None]] = []
    try:
        if len(fleet.clients) < workload.sessions:
            for client in fleet.clients:
                fleet.initialize(client)
        with Descendants(os.getpid(), depth=3, count_root=False, seconds=SAMPLE_INTERVAL) as sampler:
            driven = drive(
                workload.sessions,
                fleet.open_session,
                fleet.prompt,
                bursts,
                f"{workload.name}: {who}",
                on_turns=lambda: cpu_at_turns.append(fleet.cpu_seconds()),
            )
            sampler.sample()
        began = cpu_at_turns[0] if cpu_at_turns else [None] * len(fleet.clients)
        cpu_turns = [
            after - before
            for before, after in zip(began, fleet.cpu_seconds(), strict=True)
            if before is not None and after is not None
        ]
        memory = fleet.memory()
        statuses = fleet.close()
    except BaseException:
        fleet.kill()
        raise
    finally:
        for client in fleet.clients:
            client.conn.close(0)  # after a kill: reaps it and keeps its log
        logged = fleet.logs()
    failed = [(i, status) for i, status in enumerate(statuses) if status != 0]
    if failed:
        raise BenchError(f"{who}: proxies exited with a failure (index, status): {failed}: {logged[-500:]}")
    recorded = [a for path in fleet.acquire_files for a in read_acquires(path)]
    if workload.turn_phase_waits:
        recorded = in_window(recorded, driven["turns_window"])
    tally: collections.Counter[str] = collections.Counter()
    for client in fleet.clients:
        tally.update(client.tally.lost())
    return summarize(
        mode,
        driven,
        [a.seconds for a in recorded if a.ok],
        {
            "requests": dict(tally),
            "unexpected_lines": sum(len(client.unexpected) for client in fleet.clients),
            "peak_adapters_sampled": sampler.peak_adapters,
            **lifetime_figures(lifetimes),
            "samples": sampler.samples,
            "tree_peak_rss_mb": sampler.peak_rss / (1 << 20),
            "all_cpu_s": run_cpu_seconds() - cpu_before,
            **workload.proxy_figures(cpu_turns, memory),
            **acquire_figures(recorded),
            **eviction_figures(recorded, peer=workload.proxies > 1),
            **window_figures(fleet.acquire_files),
            **log_figures(logged),
        },
        sessions=workload.sessions,
    )


def direct_run(workload: Workload, mode: str, env: dict[str, str], workdir: Path, bursts: int) -> Row:
    lifetimes = workdir / f"lifetimes-{mode}.txt"
    cpu_before = run_cpu_seconds()
    client = DirectClient(workload.cap(mode), {**env, "LOAD_AGENT_LIFETIMES": str(lifetimes)})
    lock = threading.Lock()
    turns_began: dict[str, int] = {}

    def prompt(_: int, session_id: str) -> Turn:
        with lock:  # the waits of the turn phase start after the last opening's
            turns_began.setdefault("waits", len(client.pool.waits))
            turns_began.setdefault("evictions", len(client.pool.eviction_waits))
            turns_began.setdefault("starts", len(client.pool.start_costs))
        return client.prompt(session_id)

    def open_session(_: int) -> str:
        return client.new_session()

    try:
        with Descendants(os.getpid(), depth=1, count_root=False, seconds=SAMPLE_INTERVAL) as sampler:
            who = f"{workload.name}: {workload.label(mode)}"
            driven = drive(workload.sessions, open_session, prompt, bursts, who)
            sampler.sample()
    finally:
        client.pool.close()

    def waits(kind: str, values: list[float]) -> list[float]:
        return values[turns_began.get(kind, 0) :] if workload.turn_phase_waits else values

    return summarize(
        mode,
        driven,
        waits("waits", client.pool.waits),
        {
            "requests": client.tally.lost(),
            "unexpected_lines": 0,
            "peak_adapters_sampled": sampler.peak_adapters,
            "peak_adapters_counted": client.pool.peak,
            **lifetime_figures(lifetimes),
            "samples": sampler.samples,
            "tree_peak_rss_mb": sampler.peak_rss / (1 << 20),
            "all_cpu_s": run_cpu_seconds() - cpu_before,
            **workload.direct_figures(
                stats_ms(waits("evictions", client.pool.eviction_waits)),
                stats_ms(waits("starts", client.pool.start_costs)),
            ),
        },
        sessions=workload.sessions,
    )


def check_row(report: Report, workload: Workload, row: Row) -> None:
    """What makes a run fail: lost or duplicated answers, a short stream, more processes than the cap."""
    who = f"{workload.name} {workload.label(row['mode'])}"
    requests = row["requests"]
    if requests["lost"] or requests["duplicated"] or requests["stray"] or row["unexpected_lines"]:
        report.errors.append(f"{who}: requests {requests}, unexpected lines {row['unexpected_lines']}")
    short = {e: n for e, n in row["turn_errors"].items() if "updates streamed" in e}
    if short:
        report.errors.append(f"{who}: turns with a short stream: {short}")
    if row["session_new_failures"]:
        report.errors.append(f"{who}: session/new failed: {row['session_new_failures'][:3]}")
    cap = workload.cap(row["mode"])
    peak = max(row["peak_adapters_sampled"], row["peak_adapters_exact"])
    row["over_cap"] = peak > cap
    if row["over_cap"]:
        report.errors.append(f"{who}: {peak} live adapters at once, the cap is {cap}")


def measure(report: Report, args: argparse.Namespace, workload: Workload) -> Row:
    """Every run of ``workload``, side by side on this machine; its results, rows in ``rows``."""
    bursts = workload.quick_bursts if args.quick else workload.bursts
    if args.smoke:  # twice the cap, so that sessions still wait for slots and are suspended and resumed
        sessions = 2 * workload.max_live
        workload = dataclasses.replace(workload, sessions=sessions, proxies=min(workload.proxies, sessions))
        bursts = 1
    pool = pool_settings(args)
    results: Row = {
        "sessions": workload.sessions,
        "max_live": workload.max_live,
        "updates_per_turn": UPDATES,
        "bursts": bursts,
        "burst_turns": BURST_TURNS,
        "think_max_s": THINK_MAX,
        **workload.recorded,
        "pool_settings": pool,
        "rows": [],
    }
    with isolated(report, workload.name, results) as run:
        cases = []
        for mode in workload.modes:
            if mode == PROXIES:
                for backend in args.backends:
                    work = functools.partial(proxy_run, workload, backend, run.env, run.workdir, bursts, pool)
                    cases.append(Case(proxy_mode(backend), workload.label(proxy_mode(backend)), work))
            else:
                work = functools.partial(direct_run, workload, mode, run.env, run.workdir, bursts)
                cases.append(Case(mode, workload.label(mode), work))
        turns = f", {workload.sessions} sessions x {bursts * BURST_TURNS} turns"
        for _, row in run_each(report, workload.name, cases, turns):
            check_row(report, workload, row)
            results["rows"].append(row)
    rows = results["rows"]
    base = next((row for row in rows if row["mode"] == DIRECT_POOL), None)
    with_baseline(rows, base, {"vs_direct_pool_throughput": ("turns_per_s", ratio)}, base_too=True)
    for row in rows:
        for kind in workload.compared:
            ours, theirs = row[kind]["p50"], base[kind]["p50"] if base else None
            row[f"added_{kind}_p50"] = ours - theirs if ours is not None and theirs is not None else None
    return results


# --- the cells every pool table shows -----------------------------------------------------


def peak_adapters(row: Row) -> str:
    return f"{row['peak_adapters_sampled']} / {row['peak_adapters_exact']}" + (" **OVER**" if row["over_cap"] else "")


def turn_errors(row: Row) -> str:
    errors = sum(row["turn_errors"].values())
    return str(errors) + (f" {row['turn_errors']}" if errors else "")


def requests_lost(row: Row) -> str:
    return str(row["requests"]["lost"] + row["requests"]["duplicated"])


def machine_busy(row: Row) -> str:
    busy = row["machine_busy"]
    return f"{100 * busy:.0f} %" if busy is not None else "n/a"


def cpu_per_turn(row: Row) -> str:
    return f"{row['all_cpu_s']:.1f} ({row['all_cpu_s'] / max(1, row['turns_ok']) * 1000:.1f})"


OUTCOME_COLUMNS = (
    Column("CPU s of the whole run, client included (ms per turn)", cpu_per_turn),
    Column("machine busy in the turn phase", machine_busy),
    Column("tree peak RSS MB", lambda row: fmt(row["tree_peak_rss_mb"], 0)),
    Column("requests lost", requests_lost),
    Column("turn errors", turn_errors),
)
"""The last columns of every pool table: the CPU the run used in all its processes, the client's included
(sessions opened, turns, teardown),
how busy the machine was while the turns ran, the tree's memory, and whether every request and turn came
through."""


def render(
    workload: Workload,
    results: Row,
    heading: Callable[[Row], list[str]],
    columns: Sequence[Column],
    summary: Callable[[Row], str],
) -> list[str]:
    """A pool benchmark's section: its heading, the options it ran with, a table row and a summary line per run."""
    rows = results.get("rows") or []
    if not rows:
        return []
    out = heading(results)
    if results.get("pool_settings"):
        out += [f"The proxies ran with these `[pool]` settings too: `{results['pool_settings'].strip()}`.", ""]
    out += render_table(columns, rows)
    out += [summary(row) + "." for row in rows]
    return [*out, "", *left_running(results, f" of the {workload.name} benchmark")]


def section(
    workload: Workload,
    heading: Callable[[Row], list[str]],
    columns: Sequence[Column],
    summary: Callable[[Row], str],
) -> Section:
    """A pool benchmark's section: ``--only`` calls it by the workload's name, which is also the ``Report`` field
    its results go to (``load``, ``install``); they are rendered as ``render`` says."""

    def measure_workload(report: Report, args: argparse.Namespace) -> None:
        setattr(report, workload.name, measure(report, args, workload))

    def render_workload(report: Report) -> list[str]:
        return render(workload, getattr(report, workload.name), heading, columns, summary)

    def targets(report: Report) -> list[Target]:
        """The proxies' turns/s at least the client-side pool's, in this run."""
        rows = getattr(report, workload.name).get("rows", [])
        name = f"{workload.name}: turns/s, {{}} x the client-side pool"
        return [
            Target(name.format(workload.label(row["mode"])), value, 1.0, "x", at_least=True)
            for row in rows
            if is_proxy(row["mode"]) and (value := row.get("vs_direct_pool_throughput")) is not None
        ]

    return Section((workload.name,), measure_workload, render_workload, targets)
