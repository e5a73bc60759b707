"""Slots shared by every proxy of an install: the live-process cap across processes.

acpx and openab start one agent process, hence one ``acp-proxy``, per session: a cap
counted inside one proxy caps nothing for them. So every live adapter process holds a
*slot file* of the install (the state dir), locked with ``flock(2)``::

    slots/all/<n>.slot          n < [pool] max_live
    slots/b-<hash>/<n>.slot     n < the backend's own max_live, when it sets one

The proxy takes the lock and its adapter's wrapper inherits it, so the slot is held as
long as either of them lives. It is free again once the proxy has let go *and* the
wrapper has exited, which it does only when its tree is gone: a proxy killed with
SIGKILL frees its slots as its orphaned trees end. The kernel keeps this account;
nothing here judges a PID.

A held slot file also says who holds it (a ``SlotRecord``), rewritten by the holding
proxy when that changes. It is what ``acp-proxy status`` shows, and what another
proxy's plan reads to choose whom to suspend. A record is a hint that may be a moment
stale; the eviction itself is asked of the holding proxy, which checks its own state
and may refuse.

Waiters queue in ``slots/queue/``: the oldest waiter of each proxy and backend keeps a
ticket file named by its arrival time and locked for as long as it waits. The oldest
live ticket of a backend plans first; a ticket whose lock is free belongs to a waiter
that is gone, and is removed by whoever finds it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Final

import msgspec

from acp_proxy.ownership.instances import locked
from acp_proxy.state.directory import ensure_private_dir

log = logging.getLogger("acp_proxy.pool")

SLOTS_DIR: Final = "slots"
ALL: Final = "all"
QUEUE: Final = "queue"
RECORD_BYTES: Final = 4096
"""A record is rewritten in place with one ``pwrite`` of at most this many bytes."""


class SlotRecord(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Who holds a slot, written into its file. Times are ``CLOCK_MONOTONIC`` (one clock per host)."""

    instance: str
    pid: int
    backend: str
    key: str
    """The stable session id, or ``spare:<backend>:<pid>``."""
    session: str | None = None
    adapter_pid: int | None = None
    since: float = 0.0
    """Wall-clock time the slot was taken."""
    last_active: float = 0.0
    recent_until: float = 0.0
    busy: bool = True
    pinned: bool = False
    stopping: bool = False
    memory: int | None = None
    memory_kind: str | None = None
    wrapper_pid: int | None = None
    """The tree's root: a start in another proxy measures the tree from it."""
    command: str | None = None
    """The backend's command hash (``leases.command_hash``): the largest tree is learned per command."""
    starting: bool = False
    """Its adapter has not answered yet (or is not even launched): still loading, it counts as
    at least the largest tree its backend has had."""

    @property
    def launching(self) -> bool:
        """Taken for a start that has no process yet: only its backend is known."""
        return self.adapter_pid is None


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(SlotRecord).decode


class HeldSlot(msgspec.Struct, frozen=True):
    """A slot file some process holds, as read by anyone."""

    scope: str
    """``all`` or the backend's directory."""
    index: int
    record: SlotRecord | None
    """``None`` while its holder has not written it yet (a start in progress), or if unreadable."""


def _backend_dir(backend: str) -> str:
    return "b-" + hashlib.sha256(backend.encode()).hexdigest()[:16]


def _try_lock(path: Path) -> int | None:
    """An open descriptor holding ``path``'s exclusive lock, or ``None`` if someone holds it.

    Close-on-exec: only the wrapper it is explicitly handed to (``pass_fds``) inherits it.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


class Held(msgspec.Struct):
    """The slot files one adapter process holds (the install's, and its backend's if capped)."""

    fds: list[int]
    scope_indexes: list[tuple[str, int]]
    backend: str = ""
    _written: bytes = b""
    _length: int = 0

    @property
    def index(self) -> int:
        """Its number among the install's slot files (``slots/all``)."""
        return next(index for scope, index in self.scope_indexes if scope == ALL)

    @property
    def descriptors(self) -> tuple[int, ...]:
        """To be inherited by the wrapper, which then holds the slot until its tree is gone."""
        return tuple(self.fds)

    def publish(self, record: SlotRecord) -> None:
        """Say who holds the slot (in the install's slot file); unchanged records are not rewritten."""
        if not self.fds:
            return
        data = _encode(record)
        if data == self._written or len(data) > RECORD_BYTES:
            return
        try:
            # Padded with spaces (JSON whitespace) to the longest record written, never cut (an
            # ftruncate costs more than the write): one pwrite, read whole or caught mid-way.
            os.pwrite(self.fds[0], data.ljust(self._length), 0)
        except OSError as exc:  # a full disk: the record is a hint, the lock is what counts
            log.warning("could not write a slot record: %s", exc)
            return
        self._written = data
        self._length = max(self._length, len(data))

    def release(self) -> None:
        """Let go of the slot; it is free once the wrapper holding it too has exited."""
        fds, self.fds = self.fds, []
        if fds and self._written:
            with contextlib.suppress(OSError):
                os.ftruncate(fds[0], 0)  # no record: read before the wrapper has exited, it is "ending"
        for fd in fds:
            os.close(fd)


class Ticket(msgspec.Struct):
    """A waiter's place in the install's queue for one backend."""

    path: Path | None
    fd: int | None
    name: str

    def leave(self) -> None:
        if self.fd is None:
            return
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        os.close(self.fd)
        self.fd = None


class InstallSlots(msgspec.Struct):
    """The slot files of one install (state dir) as this proxy sees them."""

    state_dir: Path
    instance_id: str
    _seq: Iterator[int] = msgspec.field(default_factory=lambda: iter(range(1 << 62)))
    _made: set[str] = msgspec.field(default_factory=set)
    _lead_fd: int | None = None

    @property
    def root(self) -> Path:
        return self.state_dir / SLOTS_DIR

    def _scope(self, scope: str) -> Path:
        path = self.root / scope
        if scope not in self._made:
            ensure_private_dir(self.root)  # each level 0700, whatever the umask
            ensure_private_dir(path)
            self._made.add(scope)
        return path

    # --- holding ---------------------------------------------------------------------------------

    def try_take(self, backend: str, *, global_cap: int, backend_cap: int | None) -> Held | None:
        """A free slot in every scope ``backend`` needs, or ``None`` when one of them is full.

        The backend's slot is taken first, then the install's: every proxy takes them in
        this order and never waits holding one, so none can block another.
        """
        wanted = [(_backend_dir(backend), backend_cap)] if backend_cap is not None else []
        wanted.append((ALL, global_cap))
        taken: list[tuple[int, str, int]] = []
        for scope, cap in wanted:
            got = self._take_one(scope, cap)
            if got is None:
                for fd, _, _ in taken:
                    os.close(fd)
                return None
            taken.append((got[0], scope, got[1]))
        taken.reverse()  # the install's slot first: its file carries the record
        return Held([fd for fd, _, _ in taken], [(scope, index) for _, scope, index in taken], backend)

    def _take_one(self, scope: str, cap: int) -> tuple[int, int] | None:
        directory = self._scope(scope)
        for index in range(cap):
            fd = _try_lock(directory / f"{index}.slot")
            if fd is not None:
                os.ftruncate(fd, 0)  # a record left by a holder that was killed
                return fd, index
        return None

    # --- reading ---------------------------------------------------------------------------------

    def holders(self, scope: str = ALL, *, skip: Collection[int] = ()) -> list[HeldSlot]:
        """Every held slot file of a scope (``all``, or a backend's directory), but
        those numbered in ``skip`` (the caller's own, which it knows better than their files)."""
        directory = self.root / scope
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return []
        held = []
        for name in names:
            if not name.endswith(".slot"):
                continue
            index = int(name.removesuffix(".slot"))
            if index in skip:
                continue
            path = directory / name
            if not locked(path):
                continue
            held.append(HeldSlot(scope, index, _read_record(path)))
        return sorted(held, key=lambda h: h.index)

    def holder(self, index: int) -> HeldSlot | None:
        """The install's slot file ``index`` if someone holds it (this proxy too), else ``None``."""
        path = self.root / ALL / f"{index}.slot"
        if not locked(path):
            return None
        return HeldSlot(ALL, index, _read_record(path))

    def lead(self, role: str) -> bool:
        """Whether this proxy holds the install's ``role`` (taken once free, then kept for life).

        One proxy at a time does install-wide work such as keeping the memory budget; when it
        dies the kernel drops its lock, and the next proxy to ask takes the role over.
        """
        if self._lead_fd is not None:
            return True
        self._lead_fd = _try_lock(self._scope(ALL).parent / f"{role}.lock")
        return self._lead_fd is not None

    # --- the queue -------------------------------------------------------------------------------

    def enqueue(self, backend: str, arrived: float) -> Ticket:
        """A ticket for a waiter that arrived at ``arrived`` (monotonic seconds).

        The file is locked under a temporary name and then renamed, so that no one ever
        sees a ticket before its lock is held (and removes it as abandoned).
        """
        directory = self._scope(QUEUE)
        name = f"{int(arrived * 1e9):020d}-{_backend_dir(backend)}-{os.getpid()}-{next(self._seq)}"
        temporary = directory / f".{name}"
        fd = _try_lock(temporary)
        if fd is None:  # a name of our own: cannot be held by anyone else
            raise OSError(errno.EEXIST, f"queue ticket {temporary} is in use")
        final = directory / f"{name}.ticket"
        os.rename(temporary, final)
        return Ticket(final, fd, name)

    def ahead_of(self, ticket: Ticket, backend: str) -> int:
        """How many live waiters for ``backend`` arrived before this ticket's (gone ones are removed)."""
        ahead = 0
        for path in self._tickets(backend):
            if path.name.removesuffix(".ticket") >= ticket.name:
                break
            if locked(path):
                ahead += 1
                continue
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # its waiter is gone (killed, or it left without tidying up)
        return ahead

    def waiting(self, backend: str) -> bool:
        """Whether any live waiter for ``backend`` is in the queue."""
        return any(locked(path) for path in self._tickets(backend))

    def waiters(self, backend: str) -> int:
        """How many live waiters for ``backend`` are in the queue (each proxy's first in line stands in it)."""
        return sum(1 for path in self._tickets(backend) if locked(path))

    def _tickets(self, backend: str) -> list[Path]:
        """The queue's tickets for ``backend``, oldest first."""
        tag = f"-{_backend_dir(backend)}-"
        directory = self.root / QUEUE
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return []
        return [directory / name for name in sorted(names) if name.endswith(".ticket") and tag in name]


def _read_record(path: Path) -> SlotRecord | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if not data:
        return None
    try:
        return _decode(data)
    except msgspec.DecodeError:
        return None  # caught mid-rewrite: the next read will have it
