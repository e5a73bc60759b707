"""The state database: one SQLite file per state dir, shared by every proxy of an install.

WAL mode lets readers (the operator CLI) run beside writers (proxies); a busy
timeout serialises concurrent writers instead of failing them; ``BEGIN
IMMEDIATE`` takes the write lock up front so read-modify-write sequences cannot
interleave. The schema carries a version and is brought up to date by ordered
migrations, each in its own transaction. The state dir is created ``0700`` and
the database ``0600``: it names processes and commands, never secrets.

Writes happen at lifecycle events (spawn, close, reap) and a prompt's milestones
(its task created and settled; its progress at most once a second), never per
streamed message. A serving proxy makes them off its event loop: another proxy of
the install holding the write lock, or a checkpoint's fsync, must not stall the
relay. One ``StateWriter`` thread (``StateDB.writer``, started by the first write;
drained by ``GatewayConnection._shutdown``, stopped by ``StateDB.close``), with a
connection of its own and one queue, applies them in the order they were made,
whatever table they touch; every process that writes (a proxy, the operator's
commands, the tests) writes this one way. What is queued when the thread comes round (up to
``BATCH_LIMIT``) is committed in one transaction; if one write of it fails, the
batch is run again with each write in a savepoint, so the failing one costs only
itself. Each kind of write is made one way:

* **queued, nobody waits** (``StateDB.write``): task rows (create, ``mark_running``,
  progress, finish, the retry of a failed one; a queued progress write of a task is
  replaced by a newer one), a session's activity, title, suspension, close,
  deletion, ``live``, history reset and new row, the journal, what the install
  learns of a backend, a lease's teardown steps (``closing``, ``closed``, ``lost``).
  The relay must not wait; the order of one row's writes is the queue's; a proxy
  that dies before a lease's step lands leaves the lease to the next one's
  startup reaping.
* **queued, then an answer waits for it** (``StateDB.caught_up``): a new session's
  row before the gateway gets the session's id, and a setting (``set_mode``,
  ``set_config_option``, ``set_model``) before the gateway gets its answer
  (``AdapterRelay._relay`` waits for every answer with bookkeeping, ``on_answer``;
  prompts have none). A proxy that crashes after answering must not lose the
  mapping a resume needs, nor a setting a resume re-applies.
* **queued and awaited for its outcome** (``StateDB.run``, off the event loop):
  the compare-and-set claims (``SessionRegistry.mark_resuming``,
  ``claim_orphaned``), ``suspend_all_of_this_instance`` at shutdown, and a lease's
  process identities with its opening (``SupervisedProcess.ready``). The outcome
  decides what the proxy does next, and lands after every earlier write.
* **queued and waited for by a worker thread** (``StateDB.call``): a lease before
  its spawn (``ProcessPool._launch`` runs ``Adapter.launch`` in the thread that
  spawns), so that no process exists before its lease and a lock held elsewhere
  delays that start, not the relay; pruning of tasks, leases and tombstones
  (hourly), so that deletes come after the rows they judge.
* **made at once** on the caller's connection (``StateDB.transaction``), when nothing
  is relayed: the schema's migrations and the install's id, and the instance rows
  (start; end, once the writer has stopped: ``Owner.close``), which the reaping of
  dead proxies reads under the same lock.

A command that reads what it has just written first waits for it (``StateDB.settle``,
blocking; ``caught_up`` on the event loop).

Reads stay on the event loop's connection, which WAL lets read beside any writer.
A read that must see this proxy's own writes first waits until the queue has been
applied (``StateDB.caught_up``; nothing to wait for when it is empty):
``SessionRegistry.current`` (every session lookup that misses memory, restores,
closes, deletes), ``session/list``, the ``session/new``, fork and adoption paths
(their rows are read in an answer's callback, so the wait is before the request is
sent), the control socket's ``cancel_task``.

Bounds and failures. The queue holds ``QUEUE_LIMIT`` writes and never drops one
(a task's create or finish must never be lost): while it is full the gateway reader
stops taking requests (``StateDB.room``), so the queue exceeds the limit only by
what the requests already read add (each prompt at most a create, a start, a
progress and a finish). A write that fails is logged and reported to whoever queued
it (the task book keeps the turn and writes it whole again each second until it
takes). A database locked by another process is waited for, the batch kept in
order, in attempts of ``WRITER_BUSY_WAIT_MS``, so that closing is bounded. On
shutdown the queue is applied within ``CLOSE_TIMEOUT`` (what the exit writes after it, within
what is left of it, or ``LATE_WRITES_GRACE``); what is left is logged. The
WAL checkpoint (an fsync) is run from a worker thread on a connection of its own
(``defer_checkpoints``).

The package: this module is the facade (``StateDB``, through which every write is made one of
the ways above); ``writer`` is the writer thread, ``migrations`` the schema, ``directory`` the
state dir's checks, ``connection`` how a connection is opened and ``StateError``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Final

import anyio
import anyio.to_thread

from acp_proxy import __version__, releases
from acp_proxy.state.connection import BUSY_TIMEOUT_MS, StateError, is_locked, retry_while_locked
from acp_proxy.state.directory import check_private_dir, ensure_private_dir, explain_failure
from acp_proxy.state.migrations import MIGRATIONS, SCHEMA_VERSION, schema_written_by
from acp_proxy.state.writer import CLOSE_TIMEOUT, QUEUE_LIMIT, Done, Statement, StateWriter, T, WriterClosed

DB_NAME: Final = "state.db"
LATE_WRITES_GRACE: Final = 1.0
"""How long the writes an exiting proxy makes after ``drain_writer`` get, whatever is left of its timeout."""
DEFERRED_AUTOCHECKPOINT_PAGES: Final = 10_000
"""A backstop: with checkpoints deferred, a commit still checkpoints past this many WAL pages."""


class StateDB:
    """A connection to the state database, with the install's identity.

    Its write methods are how each kind of write is made; which kind a write is, and why,
    is stated once in this module's docstring.
    """

    def __init__(
        self, state_dir: Path, *, create: bool = True, read_only: bool = False, queue_limit: int = QUEUE_LIMIT
    ) -> None:
        """Open (``create``: and make) the install's database and bring its schema up to date.

        ``read_only``: open an existing database as it is, for inspection (``acp-proxy doctor``):
        never created, migrated or written, whatever its schema version, which the caller reads.
        ``queue_limit``: the writer's ``QUEUE_LIMIT``.
        """
        self.state_dir = state_dir
        self.path = state_dir / DB_NAME
        self.read_only = read_only
        self.queue_limit = queue_limit
        self._checkpointer: sqlite3.Connection | None = None
        self._writer: StateWriter | None = None
        self._writer_started = threading.Lock()
        self._closed = False
        self._stop_by: float | None = None
        """Set by ``drain_writer``: the writes made after it are applied by this moment (or a second)."""
        if create and not read_only:
            ensure_private_dir(state_dir)
        elif not self.path.exists():
            raise StateError(f"no state database at {self.path}")
        else:
            check_private_dir(state_dir)
        if read_only:
            self._open_read_only()
            return
        old_umask = os.umask(0o077)
        try:
            self.conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
        except sqlite3.Error as exc:
            raise StateError(explain_failure(self.path, exc)) from None
        finally:
            os.umask(old_umask)
        self.conn.row_factory = sqlite3.Row
        try:
            self.conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            # Changing the journal mode does not wait on the busy handler: when several
            # proxies create the database at once, the losers are told "locked" at once.
            retry_while_locked(lambda: self.conn.execute("PRAGMA journal_mode = WAL"))
            self.conn.execute("PRAGMA synchronous = NORMAL")
            self._migrate()
            self.install_id = self._install_id()
        except sqlite3.OperationalError as exc:
            self.conn.close()
            if is_locked(exc):
                raise StateError(
                    f"{self.path} stayed locked for {BUSY_TIMEOUT_MS // 1000} s ({exc}); "
                    "another process holds a long write transaction on it"
                ) from None
            raise StateError(explain_failure(self.path, exc)) from None
        except sqlite3.DatabaseError as exc:
            self.conn.close()
            raise StateError(explain_failure(self.path, exc)) from None

    def _open_read_only(self) -> None:
        # SQLite may leave an empty -wal and a -shm file beside the database (mode as the database's):
        # a reader of a WAL database needs them, and the next proxy uses them as its own.
        uri = f"{self.path.absolute().as_uri()}?mode=ro"
        try:
            self.conn = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
        except sqlite3.Error as exc:
            raise StateError(explain_failure(self.path, exc)) from None
        self.conn.row_factory = sqlite3.Row
        try:
            row = self.conn.execute("SELECT value FROM meta WHERE key = 'install_id'").fetchone()
        except sqlite3.Error as exc:
            self.conn.close()
            raise StateError(explain_failure(self.path, exc)) from None
        self.install_id = str(row[0]) if row else ""

    def close(self) -> None:
        """Apply the writes still queued (at most ``CLOSE_TIMEOUT`` seconds), then close; later writes fail."""
        self._closed = True
        self.stop_writer()
        self.conn.close()
        if self._checkpointer is not None:
            self._checkpointer.close()

    # --- writes: every one is made by the writer thread ------------------------------------

    @property
    def writer(self) -> StateWriter:
        """The thread that makes this database's writes, started by the first write (any thread's)."""
        writer = self._writer
        if writer is not None:
            return writer
        with self._writer_started:
            if self.read_only:
                raise sqlite3.OperationalError(f"{self.path} was opened read-only")
            if self._closed:
                raise WriterClosed(f"{self.path} is closed")
            if self._writer is None:
                self._writer = StateWriter(self.path, limit=self.queue_limit)
            return self._writer

    def stop_writer(self, timeout: float = CLOSE_TIMEOUT) -> int:
        """Apply what is queued (at most ``timeout`` seconds) and stop the thread; how many writes were left.

        A later write starts a writer again (until ``close``). After ``drain_writer``, within what
        is left of its timeout (at least ``LATE_WRITES_GRACE``): an exit stays bounded.
        """
        if self._stop_by is not None:
            timeout = min(timeout, max(LATE_WRITES_GRACE, self._stop_by - time.monotonic()))
        with self._writer_started:
            writer, self._writer = self._writer, None
        return writer.close(timeout) if writer is not None else 0

    async def drain_writer(self, timeout: float = CLOSE_TIMEOUT) -> int:
        """``stop_writer`` off the event loop, for a proxy that is exiting: its queued writes applied
        (at most ``timeout`` seconds; what is left is logged); how many were left."""
        self._stop_by = time.monotonic() + timeout
        return await anyio.to_thread.run_sync(self.stop_writer, timeout)

    def write(self, statement: Statement, *, key: Hashable | None = None, done: Done | None = None) -> None:
        """A write nobody waits for: queued for the writer (``key``: replaces a queued one of that key).

        ``done`` is told its result or its failure, from the writer's thread, once it is made.
        """
        self.writer.submit(statement, key=key, done=done)

    def write_or_log(
        self, statement: Statement, logger: logging.Logger, level: int, message: str, *args: object
    ) -> None:
        """A write whose failure goes no further than the log: ``message % (*args, error)`` at ``level``,
        whether it fails now (the database is closed) or later, on the writer's thread."""

        def told(result: object, error: BaseException | None) -> None:
            if error is not None:
                logger.log(level, message, *args, error)

        try:
            self.write(statement, done=told)
        except sqlite3.Error as exc:
            told(None, exc)

    def call(self, statement: Callable[[sqlite3.Connection], T]) -> T:
        """A write whose result the caller needs, made after every queued one; blocks the calling thread."""
        return self.writer.wait(statement)

    async def run(self, statement: Callable[[sqlite3.Connection], T]) -> T:
        """A write whose result the caller needs, made after every queued one; awaited off the event loop."""
        return await self.writer.run(statement)

    def settle(self) -> None:
        """Block this thread until the writes queued so far are applied (a command about to read them)."""
        writer = self._writer
        if writer is not None:
            writer.settle()

    async def caught_up(self) -> None:
        """Wait until this proxy's queued writes are applied, so that a read sees them."""
        writer = self._writer
        if writer is not None:
            await writer.caught_up()

    async def room(self) -> None:
        """Wait while the writer's queue is full (the backpressure on whoever makes the writes)."""
        writer = self._writer
        if writer is not None:
            await writer.wait_for_room()

    def defer_checkpoints(self) -> None:
        """Stop this connection's commits from running WAL checkpoints; ``checkpoint`` does them instead.

        SQLite checkpoints from whichever commit crosses ``wal_autocheckpoint`` pages, and
        a checkpoint (with its fsync) takes milliseconds: a serving proxy's commits run on
        its event loop, so it calls ``checkpoint`` from a worker thread instead. The
        automatic checkpoint is kept, much higher, as a backstop.
        """
        self.conn.execute(f"PRAGMA wal_autocheckpoint = {DEFERRED_AUTOCHECKPOINT_PAGES}")
        self._checkpointer = sqlite3.connect(
            self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False
        )

    def checkpoint(self) -> None:
        """A passive WAL checkpoint on a connection of its own (blocks no reader or writer); any thread."""
        if self._checkpointer is not None:
            self._checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)")

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """A write transaction that holds the database's write lock from its start."""
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.conn
        except BaseException:
            # After some errors (a full disk) SQLite has rolled back already; a ROLLBACK then
            # fails and would hide the error that matters.
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def _migrate(self) -> None:
        # Read first: a database already up to date is opened without its write lock, so that a
        # reader (the operator's commands) is not held up by a proxy that holds it (a long write, or
        # a proxy stopped mid-transaction).
        if self._schema_version(self.conn) == SCHEMA_VERSION:
            return
        with self.transaction() as conn:
            version = self._schema_version(conn)  # again, under the lock: another process may have migrated it
            for number, script in enumerate(MIGRATIONS[version:], start=version + 1):
                for statement in filter(str.strip, script.split(";")):
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {number}")
            conn.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (releases.WRITTEN_BY_KEY, __version__)
            )

    def _schema_version(self, conn: sqlite3.Connection) -> int:
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        if version > SCHEMA_VERSION:
            written_by = schema_written_by(conn)
            raise StateError(
                f"{releases.newer_schema(self.path, version, SCHEMA_VERSION, written_by)}: upgrade acp-proxy"
            )
        return version

    def _install_id(self) -> str:
        row = self.conn.execute("SELECT value FROM meta WHERE key = 'install_id'").fetchone()
        if row is not None:
            return str(row[0])
        with self.transaction() as conn:
            conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('install_id', ?)", (os.urandom(8).hex(),))
            return str(conn.execute("SELECT value FROM meta WHERE key = 'install_id'").fetchone()[0])


def now() -> float:
    return time.time()
