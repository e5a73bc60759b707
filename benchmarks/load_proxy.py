"""``python -m acp_proxy``, with every wait for a process slot timed. For the load and install benchmarks.

    load_proxy.py ACQUIRES_FILE ACP_PROXY_ARGS...

Runs the proxy's own command line unchanged, except that the pool's
``SlotAdmission.acquire`` (the one place a request waits for room to
start a process: suspending the least recently used idle session, here or in
another proxy of the install, and waiting for its process to exit, or waiting for
a busy one to become idle) is wrapped, and so is ``SlotAdmission.evict_anywhere``
(the one place an acquire suspends what the plan chose). Each acquire appends one
line to ACQUIRES_FILE::

    <seconds waited> <ok|failed> <evictions> <began>

``<evictions>`` is ``-`` when the acquire suspended nothing, else one
``<where>,<asked>,<answered>,<ok>`` per eviction it asked for, joined by ``;``:
``where`` is ``peer`` (another proxy, through its control socket) or ``own``;
``asked`` and ``answered`` are seconds since the acquire began; ``ok`` is ``1`` if
the session was suspended, ``0`` if its holder refused. So an acquire's wait splits
into planning (up to the last successful ask), the ask itself, and the slot coming
free (the suspended session's tree ending, until the waiter sees its slot file
unlocked). ``<began>`` is when the acquire began (``CLOCK_MONOTONIC``, the same clock
in every process of the host).

Beside it, ``ACQUIRES_FILE.windows`` gets ``start <seconds>`` for every start the pool
learns its backend's start cost from (slot held -> session bound), and ``protect
<seconds>`` for every protection it grants a session just active
(``Recency.protection``: ``[pool] min_idle``, at most the start cost and twice the
session's gateway turnaround). At exit it
adds ``wakeups <woken> <timed out>``: how often a waiter for a slot woke up
(``SlotAdmission.wait_for_change``), because something changed or because its pause
(the install poll, or a protection ending) ran out, and ``plans <count> <seconds>``: how
often a waiter read the install's slots to plan (``SlotAdmission.install_slots``) and the
time that took in all.

The writes are a few microseconds per process start or turn, on the event loop;
nothing else changes. The pool module is imported before the proxy's start-up
instead of after it, which only moves the import (cold start is not measured here).
"""

from __future__ import annotations

import atexit
import contextvars
import functools
import os
import sys
import time
from typing import Any

from acp_proxy.main import main
from acp_proxy.pool.recency import Recency
from acp_proxy.pool.slots import SlotAdmission

_acquire: contextvars.ContextVar[tuple[float, list[str]] | None] = contextvars.ContextVar("acquire", default=None)
"""The acquire this task is in: when it began, and the evictions it asked for so far."""


def time_acquires(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    acquire = SlotAdmission.acquire
    evict = SlotAdmission.evict_anywhere

    @functools.wraps(acquire)
    async def timed(self: SlotAdmission, backend: Any) -> Any:
        start = time.monotonic()
        evictions: list[str] = []
        token = _acquire.set((start, evictions))
        outcome = "failed"
        try:
            held = await acquire(self, backend)
            outcome = "ok"
            return held
        finally:
            _acquire.reset(token)
            line = f"{time.monotonic() - start:.6f} {outcome} {';'.join(evictions) or '-'} {start:.6f}\n"
            os.write(fd, line.encode())

    @functools.wraps(evict)
    async def timed_evict(self: SlotAdmission, slot: Any, *args: Any) -> bool:
        current = _acquire.get()
        if current is None:  # the memory budget's suspensions: no acquire's
            return await evict(self, slot, *args)
        start, evictions = current
        asked = time.monotonic() - start
        ok = False
        try:
            ok = await evict(self, slot, *args)
            return ok
        finally:
            where = "own" if slot.instance is None else "peer"
            evictions.append(f"{where},{asked:.6f},{time.monotonic() - start:.6f},{int(ok)}")

    windows = os.open(f"{path}.windows", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    protection = Recency.protection
    note_bound = Recency.note_bound

    @functools.wraps(protection)
    def timed_protection(self: Recency, backend: Any, session: str | None = None) -> float:
        seconds = protection(self, backend, session)
        os.write(windows, f"protect {seconds:.6f}\n".encode())
        return seconds

    @functools.wraps(note_bound)
    def timed_note_bound(self: Recency, adapter: Any) -> None:
        started = adapter.usage.started_at
        if started is not None:
            os.write(windows, f"start {time.monotonic() - started:.6f}\n".encode())
        note_bound(self, adapter)

    wait_for_change = SlotAdmission.wait_for_change
    wakeups = {"woken": 0, "timed_out": 0}

    async def counted_wait(changed: Any, timeout: float) -> None:
        await wait_for_change(changed, timeout)
        wakeups["woken" if changed.is_set() else "timed_out"] += 1

    install_slots = SlotAdmission.install_slots
    plans = {"count": 0, "seconds": 0.0}

    @functools.wraps(install_slots)
    def timed_install_slots(self: SlotAdmission, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return install_slots(self, *args, **kwargs)
        finally:
            plans["count"] += 1
            plans["seconds"] += time.perf_counter() - start

    def write_totals() -> None:
        os.write(windows, f"wakeups {wakeups['woken']} {wakeups['timed_out']}\n".encode())
        os.write(windows, f"plans {plans['count']} {plans['seconds']:.6f}\n".encode())

    atexit.register(write_totals)
    SlotAdmission.install_slots = timed_install_slots  # type: ignore[method-assign,assignment]

    SlotAdmission.acquire = timed  # type: ignore[method-assign]
    SlotAdmission.wait_for_change = staticmethod(counted_wait)  # type: ignore[method-assign]
    Recency.protection = timed_protection  # type: ignore[method-assign]
    Recency.note_bound = timed_note_bound  # type: ignore[method-assign]
    SlotAdmission.evict_anywhere = timed_evict  # type: ignore[method-assign,assignment]


if __name__ == "__main__":
    time_acquires(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
