"""A memory ceiling per session: ``session_max_memory`` and ``session_kill_memory``.

An adapter that grows without bound is recycled rather than trusted to give memory back:
its session is suspended (its tree reaped, the session kept) and restored on a fresh process
by its next request, history and settings intact, as after any suspension.

The pool's memory keeper measures this proxy's trees every ``MEMORY_EVERY`` seconds (PSS, else
RSS, ``pool.memory``; a cgroup's working set where the tree's cgroup has the memory controller,
``pool.budget.measure_adapters``) and hands them to ``MemoryCeilings.check``; ``judge`` decides, purely:

* over ``session_max_memory`` and idle: recycled now;
* over it and busy (a turn, a request in flight): recycled as soon as it is idle
  (``Tenancy.recycle``: the relay looks when a turn ends, and the next round again);
* past ``session_kill_memory`` with a turn running: the turn is cut as a ``turn_timeout`` cuts
  it (``session/cancel``, then the proxy's own answer after ``close_timeout``), and the tree is
  recycled once the turn has ended, however it ended. Idle past it: recycled now.

Each recycle is a suspension with its reason (``session_max_memory``, ``session_kill_memory``)
and the figures in the journal (so in metrics, ``top`` and ``status``), and a notice to the
notify command when one is configured.
"""

from __future__ import annotations

import enum
import functools
import logging

from acp_proxy.concurrency import Background
from acp_proxy.config import Config
from acp_proxy.journal import SuspendReason
from acp_proxy.pool.adapter import Adapter
from acp_proxy.pool.processes import ProcessPool
from acp_proxy.sessions.intents import SessionIntents
from acp_proxy.tasks.turn import Limit

log = logging.getLogger("acp_proxy.lifecycle")


class Verdict(enum.StrEnum):
    RECYCLE = "recycle"
    """Idle and over its ceiling: recycle it now."""
    AFTER_TURN = "after_turn"
    """Busy and over its ceiling: recycle it as soon as it is idle."""
    END_TURN = "end_turn"
    """A turn runs and the tree is past the hard limit: cut the turn, then recycle it."""


def judge(memory: int, *, soft: int | None, hard: int | None, busy: bool, turn_running: bool) -> Verdict | None:
    """What a session whose tree measures ``memory`` bytes calls for (``None``: nothing).

    A hard limit is a ceiling too: an idle tree past it is recycled like one over ``soft``.
    """
    past_hard = hard is not None and memory > hard
    if not past_hard and (soft is None or memory <= soft):
        return None
    if not busy:
        return Verdict.RECYCLE
    return Verdict.END_TURN if past_hard and turn_running else Verdict.AFTER_TURN


def mib(size: int) -> str:
    return f"{size / 2**20:.0f} MiB"


class MemoryCeilings:
    """Holds each session's tree to its backend's ceilings (see the module's docstring)."""

    def __init__(self, config: Config, intents: SessionIntents, background: Background) -> None:
        self.config = config
        self.intents = intents
        self.background = background

    async def watch(self, pool: ProcessPool) -> None:
        """After each round of the pool's measurements (``MemoryKeeper.measured``), ``check`` the trees."""
        if not pool.memory.for_ceilings:
            return  # no backend's sessions have a ceiling
        while not pool.stopping.begun:
            await pool.memory.measured.next().wait()
            self.check(pool.processes.live())

    def check(self, adapters: list[Adapter]) -> None:
        """This proxy's processes, just measured: recycle, mark or cut those over their ceilings."""
        for adapter in adapters:
            session_id = adapter.gateway_session
            memory = adapter.usage.memory
            if session_id is None or memory is None or adapter.gone or adapter.tenancy.muted:
                continue  # a spare holds no session; a muted process is being stopped already
            session = self.intents.table.get(session_id)
            if session is None or session.live_adapter is not adapter:
                continue
            soft, hard = self.config.session_memory(adapter.backend.name)
            turn = adapter.tenancy.running_turn
            verdict = judge(memory, soft=soft, hard=hard, busy=not session.idle, turn_running=turn is not None)
            if verdict is None:
                continue
            if hard is not None and memory > hard:
                why = f"its tree uses {mib(memory)}, past session_kill_memory ({mib(hard)})"
                reason = SuspendReason.SESSION_KILL_MEMORY
            else:
                assert soft is not None
                why = f"its tree uses {mib(memory)}, over session_max_memory ({mib(soft)})"
                reason = SuspendReason.SESSION_MAX_MEMORY
            if verdict is Verdict.RECYCLE:
                self.intents.suspend(session_id, why, reason)
                continue
            if adapter.tenancy.recycle is None:
                log.info("session %s: %s; recycled once its turn ends", session_id, why)
            adapter.tenancy.recycle_when_idle(why, reason)
            if verdict is Verdict.END_TURN and turn is not None and turn.cut is None and not turn.timed_out:
                turn.cut = f"session_kill_memory: {why}"
                self.background.start(functools.partial(self.intents.cut_turn, turn, Limit.SESSION_KILL_MEMORY, why))
