"""Small structured-concurrency pieces every layer shares: change notices, counted background work, shutdown state.

Waits on in-process state use ``Changes`` (an event per round, made only when
someone waits), never a ``sleep()`` loop. Work that may wait (a spawn, a resume)
runs through ``Background``, in the proxy's one task group, counted so a
shutdown can wait for every handler to have answered.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import anyio.abc
import msgspec

log = logging.getLogger("acp_proxy.proxy")


class Changes:
    """Wakes whoever waits for some in-process state to change; costs a branch when nobody waits."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event: anyio.Event | None = None

    def notify(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    def next(self) -> anyio.Event:
        """The event the next ``notify`` sets; take it *before* looking at the state, then wait on it."""
        if self._event is None:
            self._event = anyio.Event()
        return self._event

    async def until(self, ready: Callable[[], bool]) -> None:
        """Return once ``ready()`` holds (checked now and after every change)."""
        while not ready():
            await self.next().wait()


class Stopping(msgspec.Struct):
    """How far the proxy's shutdown has got. Every layer reads it; the gateway connection sets it."""

    begun: bool = False
    """Shutting down: no new idle suspensions or turn timeouts; writes to the gateway get a deadline."""
    refusing: bool = False
    """New work (a spawn, a resume, a queued request) fails fast with ``proxy_shutdown``."""
    reason: str | None = None
    """Why the proxy was told to stop (a signal, the gateway's output closing); ``None`` on gateway EOF."""


class Background:
    """Request handling that may wait, run in the proxy's task group without holding up the gateway.

    A state database error in a handler costs that handler, never the proxy: it is
    logged and the proxy keeps serving.
    """

    def __init__(self, tasks: anyio.abc.TaskGroup, database: object) -> None:
        self._tasks = tasks
        self._database = database
        self._running = 0
        self._changes = Changes()

    def start(self, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        async def handle() -> None:
            try:
                await work()
            except sqlite3.Error as exc:
                state_failed(self._database, exc)
            finally:
                self._running -= 1
                self._changes.notify()

        self._running += 1  # counted from now: a shutdown waits for work not yet begun, too
        self._tasks.start_soon(handle)

    def start_task(self, func: Callable[..., Coroutine[Any, Any, None]], *args: object) -> None:
        """A long-lived task (an adapter's relay), not counted as a request handler."""
        self._tasks.start_soon(func, *args)

    async def wait_idle(self) -> None:
        """Until no handler is running."""
        await self._changes.until(lambda: self._running == 0)


def state_failed(database: object, exc: sqlite3.Error) -> None:
    log.error(
        "the state database %s failed: %s; the proxy keeps serving (acp-proxy status says more)",
        database,
        exc,
    )
