"""The state writer: one thread, one connection, one queue, the state database's writes in the order made.

Which kind of write goes through it and why is stated once, in the ``acp_proxy.state`` package's
docstring; here, how the thread applies them (batches, savepoints, a lock held elsewhere, closing).
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, Final, TypeVar

import anyio
import anyio.to_thread
import msgspec

from acp_proxy.state.connection import connect, is_locked

log = logging.getLogger("acp_proxy.state")

T = TypeVar("T")
Statement = Callable[[sqlite3.Connection], Any]
"""A write: SQL run on the writer's connection, inside its transaction; what it returns goes to its caller."""
Done = Callable[[Any, BaseException | None], None]
"""Told, on the writer thread, once a write is committed (its result) or has failed (the error)."""

QUEUE_LIMIT: Final = 4096
"""Writes queued for the writer thread beyond which the gateway reader waits (``StateDB.room``)."""
LINGER: Final = 0.002
"""How long the writer lets writes gather before a transaction that nobody waits for."""
BATCH_LIMIT: Final = 512
"""Writes committed in one transaction at most."""
WRITER_BUSY_WAIT_MS: Final = 100
"""How long one attempt of the writer waits for another process's write lock before trying again."""
CLOSE_TIMEOUT: Final = 5.0
"""How long a proxy that is exiting waits for its queued writes to be applied."""


class _Write(msgspec.Struct, eq=False):
    statement: Statement
    key: Hashable | None = None
    done: Done | None = None


class _Outcome(msgspec.Struct, eq=False):
    """Where the writer thread leaves an awaited write's result for the waiting caller."""

    finished: threading.Event = msgspec.field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None

    def __call__(self, result: Any, error: BaseException | None) -> None:
        self.result, self.error = result, error
        self.finished.set()

    def value(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.result


class WriterClosed(sqlite3.OperationalError):
    """The writer was closed before this write could be applied."""


class StateWriter:
    """One thread, one connection, one queue: the state database's writes in the order they were made.

    ``submit`` never blocks and never drops a write; ``full`` says the queue has reached
    ``limit``, and ``wait_for_room`` waits until it is below it again. A write given a
    ``key`` replaces one still queued under the same key (a task's progress: only the
    latest matters), where that one stood.
    """

    def __init__(self, path: Path, *, limit: int = QUEUE_LIMIT, batch_limit: int = BATCH_LIMIT) -> None:
        self.path = path
        self.limit = limit
        self.batch_limit = batch_limit
        self._queue: deque[_Write] = deque()
        self._keyed: dict[Hashable, _Write] = {}
        self._changed = threading.Condition()
        self._applying = 0
        self._awaited = 0
        """Queued writes someone waits for: the thread does not linger while there are any."""
        self._closing = False
        self._closed = False
        """Closed: a write submitted now would never be applied, so it is refused."""
        self._deadline: float | None = None
        self._conn = connect(path, check_same_thread=False)
        # Short waits for the lock, repeated by ``_apply``: so that closing is bounded by its deadline.
        self._conn.execute(f"PRAGMA busy_timeout = {WRITER_BUSY_WAIT_MS}")
        self._thread = threading.Thread(target=self._apply_forever, name="acp-proxy state writer", daemon=True)
        self._thread.start()
        self.batches = 0
        """Transactions committed (for tests and the benchmark)."""

    @property
    def pending(self) -> int:
        """Writes queued or being applied."""
        return len(self._queue) + self._applying

    @property
    def full(self) -> bool:
        return len(self._queue) >= self.limit

    def submit(self, statement: Statement, *, key: Hashable | None = None, done: Done | None = None) -> None:
        """Queue a write; it is applied after every write submitted before it."""
        write = _Write(statement, key, done)
        with self._changed:
            if self._closed:
                raise WriterClosed("the state writer has stopped")
            queued = self._keyed.get(key) if key is not None else None
            if queued is not None:
                queued.statement, queued.done = statement, done
                return
            if key is not None:
                self._keyed[key] = write
            self._queue.append(write)
            if isinstance(done, _Outcome):
                self._awaited += 1
            self._changed.notify_all()

    def wait(self, statement: Callable[[sqlite3.Connection], T]) -> T:
        """Queue a write and block this thread until it is applied; its result (or its error, raised)."""
        outcome = _Outcome()
        self.submit(statement, done=outcome)
        outcome.finished.wait()
        return outcome.value()  # type: ignore[no-any-return]

    async def run(self, statement: Callable[[sqlite3.Connection], T]) -> T:
        """Queue a write and wait (off the event loop) until it is applied; its result (or its error, raised)."""
        outcome = _Outcome()
        self.submit(statement, done=outcome)
        await anyio.to_thread.run_sync(outcome.finished.wait, abandon_on_cancel=True)
        return outcome.value()  # type: ignore[no-any-return]

    def settle(self) -> None:
        """Block this thread until every write submitted so far is applied (or has failed).

        The failures are theirs to tell (to whoever queued them), not this wait's.
        """
        marker = self._marker()
        if marker is not None:
            marker.finished.wait()

    async def caught_up(self) -> None:
        """``settle``, off the event loop."""
        marker = self._marker()
        if marker is not None:
            await anyio.to_thread.run_sync(marker.finished.wait, abandon_on_cancel=True)

    def _marker(self) -> _Outcome | None:
        """A write of nothing behind those queued, told once they are through; ``None`` if none are."""
        if not self.pending:
            return None
        marker = _Outcome()
        self.submit(_nothing, done=marker)
        return marker

    async def wait_for_room(self) -> None:
        """Wait until the queue is below its limit again."""
        if self.full:
            await anyio.to_thread.run_sync(self._until_room, abandon_on_cancel=True)

    def _until_room(self) -> None:
        with self._changed:
            self._changed.wait_for(lambda: len(self._queue) < self.limit or self._closing)

    def close(self, timeout: float = CLOSE_TIMEOUT) -> int:
        """Apply what is queued, for at most ``timeout`` seconds, then stop; how many writes were left unapplied."""
        with self._changed:
            self._closing = True
            self._deadline = time.monotonic() + timeout
            self._changed.notify_all()
        self._thread.join(timeout)
        with self._changed:
            self._closed = True
            left = list(self._queue)
            self._queue.clear()
            self._keyed.clear()
            self._changed.notify_all()
        if self._thread.is_alive():  # past the deadline, the batch in hand fails at its next attempt
            self._conn.interrupt()
            self._thread.join(1.0 + WRITER_BUSY_WAIT_MS / 1000)
        if left:
            log.error(
                "%d write(s) to the state database %s were not applied before exit (it stayed locked or failing)",
                len(left),
                self.path,
            )
        for write in left:
            if write.done is not None:
                write.done(None, WriterClosed("the proxy exited before this write was applied"))
        if not self._thread.is_alive():
            self._conn.close()
        return len(left)

    # --- the thread ---------------------------------------------------------------------

    def _apply_forever(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                linger = not (self._closing or self._awaited or len(self._queue) >= self.batch_limit)
            if linger:
                # Let the writes of the next moments join this transaction: fewer commits, and
                # fewer times this thread takes the GIL from the event loop. Nobody waits for them.
                time.sleep(LINGER)
            with self._changed:
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), self.batch_limit))]
                for write in batch:
                    if write.key is not None:
                        self._keyed.pop(write.key, None)
                self._applying = len(batch)
                self._awaited -= sum(isinstance(write.done, _Outcome) for write in batch)
                self._changed.notify_all()  # room again for a reader waiting for it
            try:
                outcomes = self._apply(batch)
                for write, (result, error) in zip(batch, outcomes, strict=True):
                    if write.done is not None:
                        try:
                            write.done(result, error)
                        except Exception:
                            log.exception("a state database write's follow-up failed")
            finally:
                with self._changed:
                    self._applying = 0  # after the follow-ups: a wait for the queue waits for them too

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _apply(self, batch: list[_Write]) -> list[tuple[Any, BaseException | None]]:
        """The batch in one transaction, each write in a savepoint (so one failing write costs only itself).

        A locked database (another process's long transaction) is waited for, the batch kept,
        until the writer closes; any other failure of the transaction fails the whole batch.
        """
        waited = False
        while True:
            try:
                outcomes = self._transaction(batch)
            except Exception as exc:
                if self._conn.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        self._conn.execute("ROLLBACK")
                if isinstance(exc, sqlite3.OperationalError) and is_locked(exc) and not self._past_deadline():
                    if not waited:
                        log.warning("the state database %s is locked (%s): its writes wait", self.path, exc)
                        waited = True
                    continue
                log.error(
                    "could not write to the state database %s: %s (%d write(s) not applied)",
                    self.path,
                    exc,
                    len(batch),
                    exc_info=None if isinstance(exc, sqlite3.Error) else exc,
                )
                return [(None, exc)] * len(batch)
            if waited:
                log.info("the state database %s is writable again", self.path)
            self.batches += 1
            return outcomes

    def _transaction(self, batch: list[_Write]) -> list[tuple[Any, BaseException | None]]:
        """Each statement is a trip through the GIL that the event loop may wait on, so a batch is
        run bare first; only if one of its writes fails is it run again, each write in a savepoint."""
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            outcomes: list[tuple[Any, BaseException | None]] = [(write.statement(conn), None) for write in batch]
        except Exception:
            if not conn.in_transaction:
                raise  # SQLite rolled the whole transaction back (a full disk): the batch fails
            conn.execute("ROLLBACK")
            conn.execute("BEGIN IMMEDIATE")
            outcomes = [self._one_write(write) for write in batch]
        conn.execute("COMMIT")
        return outcomes

    def _one_write(self, write: _Write) -> tuple[Any, BaseException | None]:
        conn = self._conn
        conn.execute("SAVEPOINT one_write")
        try:
            result = write.statement(conn)
        except Exception as exc:
            if not conn.in_transaction:
                raise
            conn.execute("ROLLBACK TO one_write")
            conn.execute("RELEASE one_write")
            if isinstance(exc, sqlite3.Error):
                log.error("a write to the state database %s failed: %s", self.path, exc)
            else:
                log.error("a write to the state database %s failed", self.path, exc_info=exc)
            return None, exc
        conn.execute("RELEASE one_write")
        return result, None


def _nothing(conn: sqlite3.Connection) -> None:
    return None
