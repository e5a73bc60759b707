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
relay. One ``StateWriter`` thread (``StateDB.start_writer``, called by ``serve.py``
once the start-up sweeps are done; drained by ``GatewayConnection._shutdown``), with
a connection of its own and one queue, applies them in the order they were made,
whatever table they touch. What is queued when the thread comes round (up to
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
* **made at once**, before the writer starts and after it is drained: the instance
  rows (start, end) and startup reaping, when nothing is relayed. Without a writer
  (the CLI, the tests of the layers, start-up) every write is made at once on the
  caller's thread, as one transaction.

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
shutdown the queue is applied within ``CLOSE_TIMEOUT``; what is left is logged. The
WAL checkpoint (an fsync) is run from a worker thread on a connection of its own
(``defer_checkpoints``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Any, Final, TypeVar

import anyio
import anyio.to_thread
import msgspec

from acp_proxy import __version__, releases

log = logging.getLogger("acp_proxy.state")

T = TypeVar("T")
Statement = Callable[[sqlite3.Connection], Any]
"""A write: SQL run on the writer's connection, inside its transaction; what it returns goes to its caller."""
Done = Callable[[Any, BaseException | None], None]
"""Told, on the writer thread, once a write is committed (its result) or has failed (the error)."""

DB_NAME: Final = "state.db"
BUSY_TIMEOUT_MS: Final = 10_000
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
DEFERRED_AUTOCHECKPOINT_PAGES: Final = 10_000
"""A backstop: with checkpoints deferred, a commit still checkpoints past this many WAL pages."""

MIGRATIONS: Final[tuple[str, ...]] = (
    # 1: install identity, proxy instances, leases
    """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE instances (
        instance_id TEXT PRIMARY KEY,
        pid INTEGER NOT NULL,
        boot_id TEXT NOT NULL,
        uid INTEGER NOT NULL,
        started_at REAL NOT NULL,
        ended_at REAL,
        end_reason TEXT
    );
    CREATE TABLE leases (
        lease_id TEXT PRIMARY KEY,
        install_id TEXT NOT NULL,
        instance_id TEXT NOT NULL,
        session_key TEXT,
        backend TEXT NOT NULL,
        marker TEXT NOT NULL,
        argv TEXT NOT NULL,
        command_hash TEXT NOT NULL,
        boot_id TEXT NOT NULL,
        uid INTEGER NOT NULL,
        wrapper_pid INTEGER,
        wrapper_start_ticks INTEGER,
        adapter_pid INTEGER,
        adapter_start_ticks INTEGER,
        pgid INTEGER,
        state TEXT NOT NULL CHECK (
            state IN ('starting', 'open', 'closing', 'closed', 'lost', 'unverifiable')
        ),
        reason TEXT,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE INDEX leases_by_instance ON leases (instance_id, state);
    CREATE INDEX leases_by_state ON leases (state);
    """,
    # 2: the session registry (stable ids, what it takes to resume, ownership metadata)
    """
    CREATE TABLE sessions (
        session_id TEXT PRIMARY KEY,
        adapter_session_id TEXT NOT NULL,
        backend TEXT NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('live', 'suspended', 'resuming', 'closed')),
        instance_id TEXT,
        lease_id TEXT,
        cwd TEXT NOT NULL,
        mcp_servers TEXT NOT NULL,
        additional_directories TEXT,
        settings TEXT NOT NULL,
        auth_method TEXT,
        session_key TEXT,
        owner_session_key TEXT,
        spawned_by TEXT,
        parent_session_key TEXT,
        agent_id TEXT,
        history_resets INTEGER NOT NULL DEFAULT 0,
        created_at REAL NOT NULL,
        last_active_at REAL NOT NULL,
        closed_at REAL
    );
    CREATE INDEX sessions_by_state ON sessions (state, backend);
    CREATE INDEX sessions_by_instance ON sessions (instance_id, state);
    """,
    # 3: prompt turns as tasks
    """
    CREATE TABLE tasks (
        task_id TEXT PRIMARY KEY,
        session_id TEXT NOT NULL,
        backend TEXT NOT NULL,
        instance_id TEXT NOT NULL,
        lease_id TEXT,
        request_id TEXT,
        status TEXT NOT NULL CHECK (
            status IN ('queued', 'running', 'done', 'failed', 'cancelled', 'timed_out', 'lost')
        ),
        stop_reason TEXT,
        error TEXT,
        traceparent TEXT,
        prompt TEXT NOT NULL DEFAULT '',
        created_at REAL NOT NULL,
        started_at REAL,
        first_output_at REAL,
        ended_at REAL,
        progress_summary TEXT NOT NULL DEFAULT '',
        update_count INTEGER NOT NULL DEFAULT 0,
        tool_calls INTEGER NOT NULL DEFAULT 0,
        recent_events TEXT NOT NULL DEFAULT '[]',
        events_dropped INTEGER NOT NULL DEFAULT 0,
        updated_at REAL NOT NULL
    );
    CREATE INDEX tasks_by_status ON tasks (status, instance_id);
    CREATE INDEX tasks_by_session ON tasks (session_id, created_at);
    CREATE INDEX tasks_by_created ON tasks (created_at);
    CREATE INDEX tasks_by_end ON tasks (ended_at);
    """,
    # 4: sessions as ACP v1 defines them: closed is restorable, deleted is a tombstone; titles; forks.
    # Before, "closed" meant gone for good (a session/delete the adapter took was recorded so too):
    # those rows become tombstones, so that nothing the gateway deleted comes back into its list.
    """
    CREATE TABLE sessions_v4 (
        session_id TEXT PRIMARY KEY,
        adapter_session_id TEXT NOT NULL,
        backend TEXT NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('live', 'suspended', 'resuming', 'closed', 'deleted')),
        instance_id TEXT,
        lease_id TEXT,
        cwd TEXT NOT NULL,
        mcp_servers TEXT NOT NULL,
        additional_directories TEXT,
        settings TEXT NOT NULL,
        auth_method TEXT,
        session_key TEXT,
        owner_session_key TEXT,
        spawned_by TEXT,
        parent_session_key TEXT,
        agent_id TEXT,
        history_resets INTEGER NOT NULL DEFAULT 0,
        created_at REAL NOT NULL,
        last_active_at REAL NOT NULL,
        closed_at REAL,
        title TEXT,
        title_updated_at TEXT,
        parent_session_id TEXT,
        deleted_at REAL
    );
    INSERT INTO sessions_v4 (session_id, adapter_session_id, backend, state, instance_id, lease_id, cwd,
        mcp_servers, additional_directories, settings, auth_method, session_key, owner_session_key, spawned_by,
        parent_session_key, agent_id, history_resets, created_at, last_active_at, closed_at)
    SELECT session_id, adapter_session_id, backend, state, instance_id, lease_id, cwd, mcp_servers,
        additional_directories, settings, auth_method, session_key, owner_session_key, spawned_by,
        parent_session_key, agent_id, history_resets, created_at, last_active_at, closed_at FROM sessions;
    DROP TABLE sessions;
    ALTER TABLE sessions_v4 RENAME TO sessions;
    UPDATE sessions SET state = 'deleted', deleted_at = COALESCE(closed_at, last_active_at), mcp_servers = '[]',
        settings = '[]' WHERE state = 'closed';
    CREATE INDEX sessions_by_state ON sessions (state, backend);
    CREATE INDEX sessions_by_instance ON sessions (instance_id, state);
    CREATE INDEX sessions_by_deleted ON sessions (deleted_at) WHERE state = 'deleted';
    """,
    # 5: the install's journal (recent events, counters since the install was created: acp_proxy.journal),
    # and a task's own notification policy (NULL: the config's [tasks] notify).
    """
    CREATE TABLE events (
        event_id INTEGER PRIMARY KEY AUTOINCREMENT,
        at REAL NOT NULL,
        instance_id TEXT,
        kind TEXT NOT NULL,
        backend TEXT NOT NULL DEFAULT '',
        label TEXT NOT NULL DEFAULT '',
        session_id TEXT,
        detail TEXT NOT NULL DEFAULT ''
    );
    CREATE TABLE counters (
        name TEXT NOT NULL,
        backend TEXT NOT NULL DEFAULT '',
        label TEXT NOT NULL DEFAULT '',
        count INTEGER NOT NULL DEFAULT 0,
        seconds REAL NOT NULL DEFAULT 0,
        PRIMARY KEY (name, backend, label)
    ) WITHOUT ROWID;
    ALTER TABLE tasks ADD COLUMN notify TEXT;
    """,
    # 6: what the install has learned about each backend (acp_proxy.pool.learned): the restore method
    # that worked and those refused as unsupported, the largest tree it has had.
    """
    CREATE TABLE backend_facts (
        backend TEXT NOT NULL,
        fact TEXT NOT NULL,
        value TEXT NOT NULL,
        updated_at REAL NOT NULL,
        PRIMARY KEY (backend, fact)
    ) WITHOUT ROWID;
    """,
)
SCHEMA_VERSION: Final = len(MIGRATIONS)


class StateError(Exception):
    """The state dir or database cannot be used; the message says what to do."""


ELSEWHERE: Final = "or point $ACP_PROXY_STATE_DIR (or state_dir in the config) at a directory of your own"


def ensure_private_dir(path: Path) -> None:
    """Create ``path`` (0700) if missing; refuse one that others could write to."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise StateError(f"cannot create {path}: {exc.strerror}; create it yourself (mode 700), {ELSEWHERE}") from None
    check_private_dir(path)


def check_private_dir(path: Path) -> None:
    """Refuse a directory of another user's, or one that others could write to: its contents decide what we signal."""
    info = path.stat()
    if info.st_uid != os.getuid():
        raise StateError(
            f"{path} belongs to uid {info.st_uid}, not to you (uid {os.getuid()}); refusing to use it: {ELSEWHERE}"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise StateError(f"{path} is writable by other users; run: chmod 700 {path}")


def explain_failure(path: Path, exc: sqlite3.Error) -> str:
    """What went wrong with the state database at ``path``, and what to do about it, for people."""
    directory = path.parent
    if not isinstance(exc, sqlite3.OperationalError):
        return f"{path} is not a usable state database ({exc}); move it aside to start afresh (mv {path} {path}.broken)"
    if "full" in str(exc):
        return f"cannot write {path}: {exc}; free some space on the disk holding {directory}"
    for target in (path, directory):
        try:
            info = target.stat()
        except OSError:
            continue
        if info.st_uid != os.getuid():
            return f"cannot use {path} ({exc}): {target} belongs to uid {info.st_uid}, not to you; {ELSEWHERE}"
    beside = "(SQLite writes beside the database)"
    if _read_only_mount(directory):
        return (
            f"cannot use {path} ({exc}): the state dir {directory} is on a read-only file system {beside}; "
            f"mount it read-write, {ELSEWHERE.removeprefix('or ')}"
        )
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        return f"cannot use {path} ({exc}): you may not read and write it; run: chmod 600 {path}"
    if not os.access(directory, os.W_OK | os.X_OK):
        return (
            f"cannot use {path} ({exc}): the state dir {directory} is not writable {beside}; "
            f"run: chmod 700 {directory}, {ELSEWHERE}"
        )
    return f"cannot use {path}: {exc}"


def _read_only_mount(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def connect(path: Path, *, check_same_thread: bool = True) -> sqlite3.Connection:
    """A connection with the settings every connection of the proxy uses (autocommit, busy timeout)."""
    conn = sqlite3.connect(
        path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=check_same_thread
    )
    conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    conn.execute("PRAGMA synchronous = NORMAL")
    return conn


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

    async def caught_up(self) -> None:
        """Wait until every write submitted so far is applied (or has failed)."""
        if self.pending:
            await self.run(_nothing)

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
            finally:
                with self._changed:
                    self._applying = 0
            for write, (result, error) in zip(batch, outcomes, strict=True):
                if write.done is not None:
                    try:
                        write.done(result, error)
                    except Exception:
                        log.exception("a state database write's follow-up failed")

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
                if isinstance(exc, sqlite3.OperationalError) and _is_locked(exc) and not self._past_deadline():
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


class StateDB:
    """A connection to the state database, with the install's identity.

    Its write methods are how each kind of write is made; which kind a write is, and why,
    is stated once in this module's docstring.
    """

    def __init__(self, state_dir: Path, *, create: bool = True, read_only: bool = False) -> None:
        """Open (``create``: and make) the install's database and bring its schema up to date.

        ``read_only``: open an existing database as it is, for inspection (``acp-proxy doctor``):
        never created, migrated or written, whatever its schema version, which the caller reads.
        """
        self.state_dir = state_dir
        self.path = state_dir / DB_NAME
        self._checkpointer: sqlite3.Connection | None = None
        self.writer: StateWriter | None = None
        """The thread that makes this proxy's writes, once ``start_writer`` is called; else they are made inline."""
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
            _retry_while_locked(lambda: self.conn.execute("PRAGMA journal_mode = WAL"))
            self.conn.execute("PRAGMA synchronous = NORMAL")
            self._migrate()
            self.install_id = self._install_id()
        except sqlite3.OperationalError as exc:
            self.conn.close()
            if _is_locked(exc):
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
        self.stop_writer()
        self.conn.close()
        if self._checkpointer is not None:
            self._checkpointer.close()

    # --- writes, made by the writer thread when there is one -------------------------------

    def start_writer(self, *, limit: int = QUEUE_LIMIT) -> StateWriter:
        """From now on writes go through one thread of their own, off the caller's (the event loop's)."""
        if self.writer is None:
            self.writer = StateWriter(self.path, limit=limit)
        return self.writer

    def stop_writer(self, timeout: float = CLOSE_TIMEOUT) -> int:
        """Apply what is queued (at most ``timeout`` seconds) and make later writes inline; how many were left."""
        writer, self.writer = self.writer, None
        return writer.close(timeout) if writer is not None else 0

    async def drain_writer(self, timeout: float = CLOSE_TIMEOUT) -> int:
        """``stop_writer`` without blocking the event loop: later writes are made inline, on the loop."""
        writer, self.writer = self.writer, None
        if writer is None:
            return 0
        return await anyio.to_thread.run_sync(writer.close, timeout)

    def write(self, statement: Statement, *, key: Hashable | None = None, done: Done | None = None) -> object:
        """A write nobody waits for: queued for the writer (``key``: replaces a queued one of that key).

        Without a writer it is made now: its result is returned (and given to ``done``), and
        a failure is raised instead.
        """
        if self.writer is not None:
            self.writer.submit(statement, key=key, done=done)
            return None
        with self.transaction() as conn:
            result = statement(conn)
        if done is not None:
            done(result, None)
        return result

    def call(self, statement: Callable[[sqlite3.Connection], T]) -> T:
        """A write whose result the caller needs, made after every queued one; blocks the calling thread."""
        if self.writer is not None:
            return self.writer.wait(statement)
        with self.transaction() as conn:
            return statement(conn)

    async def run(self, statement: Callable[[sqlite3.Connection], T]) -> T:
        """A write whose result the caller needs, made after every queued one; awaited off the event loop."""
        if self.writer is not None:
            return await self.writer.run(statement)
        with self.transaction() as conn:
            return statement(conn)

    async def caught_up(self) -> None:
        """Wait until this proxy's queued writes are applied, so that a read sees them."""
        if self.writer is not None:
            await self.writer.caught_up()

    async def room(self) -> None:
        """Wait while the writer's queue is full (the backpressure on whoever makes the writes)."""
        if self.writer is not None:
            await self.writer.wait_for_room()

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


def schema_written_by(conn: sqlite3.Connection) -> str | None:
    """The release that last migrated the database, if it recorded itself (releases since 0.7.0 do)."""
    try:
        row = conn.execute("SELECT value FROM meta WHERE key = ?", (releases.WRITTEN_BY_KEY,)).fetchone()
    except sqlite3.Error:  # no meta table: a database no migration has finished
        return None
    return str(row[0]) if row else None


def now() -> float:
    return time.time()


def _is_locked(exc: sqlite3.OperationalError) -> bool:
    text = str(exc)
    return "locked" in text or "busy" in text


def _retry_while_locked(action: Callable[[], object], timeout: float = BUSY_TIMEOUT_MS / 1000) -> None:
    deadline = time.monotonic() + timeout
    delay = 0.002
    while True:
        try:
            action()
            return
        except sqlite3.OperationalError as exc:
            if not _is_locked(exc) or time.monotonic() >= deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
