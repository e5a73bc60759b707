"""An adapter process run under a wrapper and a lease, from spawn to verified reaping.

Spawn: write the lease (``starting``) -> in ``cgroup`` mode, make the tree's cgroup
-> start the wrapper in a new session with the adapter's argv, the marker in its
environment, a lifeline pipe, a report pipe (and the cgroup to join before it forks)
-> record the wrapper's identity -> read the adapter's identity from the report ->
``open``.

Stop (``stop``, the order DESIGN.md §4 fixes): close the adapter's stdin, wait
``stdin_grace`` -> SIGTERM the wrapper (it tears the tree down) -> after
``term_grace`` SIGKILL the wrapper (our own unreaped child) -> in ``cgroup`` mode,
``cgroup.kill`` for whatever is left in the tree's cgroup, then remove it ->
verified marker sweep -> ``closed`` only after a clean sweep. Every signal is
verified first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Final

import anyio
import anyio.to_thread
import msgspec
from msgspec.structs import replace

from acp_proxy.journal import Kind
from acp_proxy.ownership import leases
from acp_proxy.ownership.cgroups import Cleared, set_memory_limits
from acp_proxy.ownership.leases import Lease, LeaseState
from acp_proxy.ownership.owner import Owner, WrapperMissing, wrapper_path
from acp_proxy.ownership.reaping import SweepResult, forget_tombstone, prepare_tombstone, sweep
from acp_proxy.ownership.verify import send_verified_signal
from acp_proxy.stdio import FdReceiveStream, FdSendStream, enlarge_pipe

log = logging.getLogger("acp_proxy.ownership")

CHILD_POLL_INTERVAL: Final = 0.05
"""How often to poll for a child's exit where there are no pidfds."""
REPORT_TIMEOUT: Final = 30.0
"""How long the wrapper may take to report the adapter's identity (it is stdlib-only and fast)."""
KILL_WAIT: Final = 2.0


class WrapperReport(msgspec.Struct, frozen=True):
    """What the wrapper says once the adapter is forked (one JSON line on the report pipe)."""

    adapter_pid: int
    pgid: int
    start_ticks: int | None = None
    subreaper: bool = False
    error: str | None = None
    cgroup_error: str | None = None
    """The wrapper could not join the tree's cgroup (it started the adapter anyway)."""


class WrapperFailed(Exception):
    """The adapter could not be started under its wrapper; the message says why."""


def owner_tree_cgroup(owner: Owner, lease: Lease, memory_limit: int | None = None) -> str | None:
    """The cgroup ``lease``'s tree runs in (``cgroup`` mode), made now; ``None`` in ``markers`` mode.

    One that cannot be made fails the start if cgroups are required, else that tree is owned by
    marker only (and said so). With the memory controller and a ``memory_limit`` (the session's
    ``session_kill_memory``), the kernel holds the tree near it too, a little above, so that the
    proxy's own cut (a turn ended with its reason) comes first: ``memory.high`` an eighth above
    (reclaim and throttling: a tree cannot outrun the proxy's measuring by much between two
    rounds) and ``memory.max`` a quarter above (the OOM killer, inside the tree, as a backstop).
    """
    if owner.cgroup is None:
        return None
    try:
        tree = owner.cgroup.create_tree(lease.lease_id)
    except OSError as exc:
        reason = f"cannot create the tree's cgroup {exc.filename}: {exc.strerror}"
        if owner.cgroups_required:
            owner.db.write(leases.moved_to(lease.lease_id, LeaseState.CLOSED, f"spawn failed: {reason}"))
            raise WrapperFailed(reason) from None
        log.warning("lease %s: %s; this tree is owned by marker only", lease.lease_id, reason)
        return None
    if owner.cgroup.memory and memory_limit is not None:
        try:
            set_memory_limits(tree, high=memory_limit + memory_limit // 8, maximum=memory_limit + memory_limit // 4)
        except OSError as exc:
            log.warning("lease %s: cannot set the memory limits of its cgroup: %s", lease.lease_id, exc.strerror)
    return str(tree)


def unsettled(cleared: Cleared, swept: SweepResult) -> str | None:
    """Why a stopped tree cannot be recorded ``closed``, if it cannot: something of it may have survived."""
    if cleared.error:
        return f"its cgroup could not be cleared: {cleared.error}"
    if cleared.remaining:
        return f"processes in its cgroup survived cgroup.kill: {cleared.remaining}"
    if swept.unverifiable:
        return swept.unverifiable
    if swept.remaining:
        return f"processes carrying the marker survived: {swept.remaining}"
    return None


def wrapper_grace(term_grace: float) -> float:
    """The wrapper's own TERM->KILL grace: inside ours, so it finishes before we SIGKILL it."""
    return max(0.0, term_grace - min(0.5, term_grace / 4))


class ChildProcess:
    """A child started with ``subprocess.Popen``, awaited on any anyio backend.

    Started synchronously, so an adapter can be launched before the event loop
    (and the modules it needs) are even loaded. Exit is awaited on a pidfd
    where there is one, else by polling ``waitpid``; only this class reaps it.
    """

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.returncode: int | None = None
        self._pidfd: int | None = None
        if hasattr(os, "pidfd_open"):
            with contextlib.suppress(OSError):
                self._pidfd = os.pidfd_open(self.pid)  # never fails for an unreaped child of ours
        self._waiting = False
        self._changed: anyio.Event | None = None  # created in the event loop, on first wait

    def _try_reap(self) -> None:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return
        if pid:
            self.returncode = self.popen.returncode = os.waitstatus_to_exitcode(status)
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None

    async def wait(self) -> int:
        """The exit status; several tasks may wait at once (one of them watches the pidfd)."""
        if self._changed is None:
            self._changed = anyio.Event()
        while self.returncode is None:
            if self._pidfd is None:
                self._try_reap()
                if self.returncode is None:
                    await anyio.sleep(CHILD_POLL_INTERVAL)
                continue
            if self._waiting:
                assert self._changed is not None
                await self._changed.wait()
                continue
            self._waiting = True
            try:
                await anyio.wait_readable(self._pidfd)
                self._try_reap()
            finally:
                self._waiting = False
                self._changed.set()  # wake the others: reaped, or their turn to watch
                self._changed = anyio.Event()
        return self.returncode


class SupervisedProcess:
    def __init__(
        self,
        owner: Owner,
        lease: Lease,
        process: ChildProcess,
        lifeline: int,
        report: int,
        term_grace: float,
        *,
        stdin: FdSendStream,
        stdout: FdReceiveStream,
        cgroup: str | None = None,
    ) -> None:
        self.owner = owner
        self.lease = lease
        self.process = process
        self.cgroup = cgroup
        """The tree's cgroup directory (``cgroup`` mode), where ``memory.current`` is read if there is one."""
        self.cgroup_joined = cgroup is not None
        """The wrapper joined ``cgroup`` (it says so in its report): the tree is in it."""
        self.stdin = stdin
        self.stdout = stdout
        self.stopping = False
        self._lifeline = lifeline
        self._report: int | None = report
        self._term_grace = term_grace
        self._stop_lock: anyio.Lock | None = None
        self._stopped = False

    @property
    def adapter_pid(self) -> int | None:
        return self.lease.adapter_pid

    async def close_stdout(self) -> None:
        with contextlib.suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            await self.stdout.aclose()

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    @classmethod
    async def start(
        cls,
        owner: Owner,
        *,
        backend: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: str | None,
        term_grace: float,
        session_key: str | None = None,
    ) -> SupervisedProcess:
        """Launch and wait until the adapter is running (``launch`` then ``ready``)."""
        supervised = cls.launch(
            owner, backend=backend, argv=argv, env=env, cwd=cwd, term_grace=term_grace, session_key=session_key
        )
        await supervised.ready()
        return supervised

    @classmethod
    def launch(
        cls,
        owner: Owner,
        *,
        backend: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: str | None,
        term_grace: float,
        session_key: str | None = None,
        recorded_argv: Sequence[str] | None = None,
        hold: Sequence[int] = (),
        memory_limit: int | None = None,
    ) -> SupervisedProcess:
        """Write the lease, then start the wrapper; needs no event loop (see ``ready``).

        ``hold``: descriptors the wrapper keeps open until it exits, i.e. until the tree is
        gone, and its adapter does not get (the locks of the install's slot files).

        ``recorded_argv`` is what the lease keeps and operators are shown (default ``argv``):
        the config's command before ``${VAR}`` expansion, so that no secret from the
        environment is written to the state database or the logs.
        """
        try:
            wrapper = wrapper_path()
        except WrapperMissing as exc:
            raise WrapperFailed(str(exc)) from None
        db = owner.db
        lease = leases.create_lease(
            db,
            instance_id=owner.instance_id,
            boot_id=owner.boot_id,
            backend=backend,
            argv=tuple(argv if recorded_argv is None else recorded_argv),
            session_key=session_key,
        )
        tombstone = prepare_tombstone(db, lease.lease_id)
        cgroup = owner_tree_cgroup(owner, lease, memory_limit)
        lifeline_r, lifeline_w = os.pipe()
        report_r, report_w = os.pipe()
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        enlarge_pipe(stdout_w)
        command = [
            sys.executable,
            "-I",
            "-S",
            str(wrapper),
            "--lifeline",
            str(lifeline_r),
            "--report",
            str(report_w),
            "--grace",
            f"{wrapper_grace(term_grace):.3f}",
            "--tombstone",
            str(tombstone),
            *(["--hold", ",".join(map(str, hold))] if hold else []),
            *(["--cgroup", cgroup] if cgroup else []),
            "--",
            *argv,
        ]
        try:
            popen = subprocess.Popen(
                command,
                stdin=stdin_r,
                stdout=stdout_w,
                stderr=None,
                cwd=cwd,
                env={**env, lease.marker_key: lease.marker_value},
                start_new_session=True,
                pass_fds=(lifeline_r, report_w, *hold),
            )
        except (OSError, ValueError) as exc:  # ValueError: a NUL byte in argv or env
            for fd in (lifeline_w, report_r, stdin_w, stdout_r):
                os.close(fd)
            reason = getattr(exc, "strerror", None) or str(exc)
            if owner.cgroup is not None and cgroup is not None:
                owner.cgroup.clear_tree(lease.lease_id)
            db.write(leases.moved_to(lease.lease_id, LeaseState.CLOSED, f"spawn failed: {reason}"))
            raise WrapperFailed(reason) from None
        finally:
            for fd in (lifeline_r, report_w, stdin_r, stdout_w):
                os.close(fd)  # the wrapper has its copies now
        info = owner.table.info(popen.pid)
        lease = replace(lease, wrapper_pid=popen.pid, wrapper_start_ticks=info.start_ticks if info else None)
        db.call(leases.spawned(lease))  # the wrapper is on record before anyone hears of it
        return cls(
            owner,
            lease,
            ChildProcess(popen),
            lifeline_w,
            report_r,
            term_grace,
            stdin=FdSendStream(stdin_w, owned=True),
            stdout=FdReceiveStream(stdout_r, owned=True),
            cgroup=cgroup,
        )

    async def ready(self) -> None:
        """Wait for the wrapper's report and open the lease; on failure, tear down and raise."""
        if self._report is None:
            return
        report_fd, self._report = self._report, None
        try:
            report = await self._read_report(report_fd)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.stop(stdin_grace=0, term_grace=self._term_grace)
            raise
        failed = report.error or (report.cgroup_error if self.owner.cgroups_required else None)
        if failed:
            with anyio.CancelScope(shield=True):
                await self.stop(stdin_grace=KILL_WAIT, term_grace=self._term_grace)
            raise WrapperFailed(failed)
        if report.cgroup_error:
            log.warning("lease %s: %s; this tree is owned by marker only", self.lease.lease_id, report.cgroup_error)
            self.cgroup_joined = False  # its cgroup is empty: nothing of the tree is read from it
        ticks = report.start_ticks
        if ticks is None:  # no /proc in the wrapper: ask our own process table
            adapter_info = self.owner.table.info(report.adapter_pid)
            ticks = adapter_info.start_ticks if adapter_info else None
        lease = replace(self.lease, adapter_pid=report.adapter_pid, adapter_start_ticks=ticks, pgid=report.pgid)
        record, opened = leases.spawned(lease), leases.moved_to(lease.lease_id, LeaseState.OPEN)
        # Awaited, after whatever this proxy queued, off the event loop: the lease is open (and names
        # the adapter) before the adapter is used, whoever holds the database's lock meanwhile.
        await self.owner.db.run(lambda conn: (record(conn), opened(conn)))
        self.lease = replace(lease, state=LeaseState.OPEN)

    async def _read_report(self, fd: int) -> WrapperReport:
        stream = FdReceiveStream(fd, owned=True)
        data = b""
        try:
            with anyio.fail_after(REPORT_TIMEOUT):
                while not data.endswith(b"\n"):
                    try:
                        data += await stream.receive(4096)
                    except anyio.EndOfStream:
                        break
        finally:
            await stream.aclose()
        if not data:
            raise WrapperFailed(f"the wrapper exited without reporting (status {self.process.returncode})")
        try:
            return msgspec.json.decode(data, type=WrapperReport)
        except msgspec.DecodeError as exc:
            raise WrapperFailed(f"the wrapper sent a malformed report: {exc}") from None

    async def wait_exit(self, timeout: float) -> int | None:
        """The wrapper's exit status (the adapter's), waiting at most ``timeout`` seconds."""
        if self.returncode is None:
            with anyio.move_on_after(timeout):
                await self.process.wait()
        return self.returncode

    async def stop(self, *, stdin_grace: float, term_grace: float) -> int | None:
        """Tear the tree down in the fixed order; idempotent; shielded once begun."""
        if self._stop_lock is None:
            self._stop_lock = anyio.Lock()
        with anyio.CancelScope(shield=True):
            async with self._stop_lock:
                if not self._stopped:
                    self.stopping = True
                    await self._stop(stdin_grace, term_grace)
                    self._stopped = True
        return self.returncode

    def _record(self, state: LeaseState, reason: str | None = None) -> None:
        """Write a teardown step to the lease; a database that fails us must not stop the teardown.

        A lease left ``closing`` by a failed write is finished by the startup reaping of the next proxy,
        which re-verifies everything before it signals anything.
        """
        # Queued: nobody waits for it, and the order of this proxy's writes is kept.
        self.owner.db.write_or_log(
            leases.moved_to(self.lease.lease_id, state, reason),
            log,
            logging.ERROR,
            "lease %s: could not record %s (%s); teardown goes on",
            self.lease.lease_id,
            state,
        )

    async def _stop(self, stdin_grace: float, term_grace: float) -> None:
        db, lease = self.owner.db, self.lease
        self._record(LeaseState.CLOSING)
        if self.cgroup is not None:
            # The wrapper need not leave the tree's cgroup to remove it (which waits for the kernel):
            # we remove it (``_clear_and_sweep``).
            with contextlib.suppress(OSError):
                os.write(self._lifeline, b".")
        await self.stdin.aclose()
        if await self.wait_exit(stdin_grace) is None:
            self._signal_wrapper(signal.SIGTERM, "still running after stdin EOF")
            if await self.wait_exit(term_grace) is None:
                self._signal_wrapper(signal.SIGKILL, "ignored SIGTERM")
                await self.wait_exit(KILL_WAIT)
        os.close(self._lifeline)
        cleared, swept = await anyio.to_thread.run_sync(self._clear_and_sweep)
        journal = self.owner.journal
        for killed, how in ((cleared.killed, "in its cgroup"), (swept.signalled, "by marker")):
            if killed:
                log.warning("lease %s: killed %d leftover process(es) %s", lease.lease_id, len(killed), how)
                journal.record(
                    Kind.LEFTOVERS_KILLED,
                    backend=lease.backend,
                    session_id=lease.session_key,
                    count=len(killed),
                    detail=f"lease {lease.lease_id}: {len(killed)} process(es) outlived the adapter, killed {how}",
                )
        reason = unsettled(cleared, swept)
        if reason is not None:
            log.error("lease %s left unverifiable: %s", lease.lease_id, reason)
            self._record(LeaseState.UNVERIFIABLE, reason)
            detail = f"lease {lease.lease_id}: {reason}"
            journal.record(Kind.UNVERIFIABLE, backend=lease.backend, label="stop", detail=detail)
        else:
            self._record(LeaseState.CLOSED)
            journal.record(Kind.TREE_REAPED, backend=lease.backend, label="stop")
        forget_tombstone(db, lease.lease_id)
        if self._report is not None or not self.lease.adapter_pid:  # never became ready: nobody else will
            await self.close_stdout()
        log.info(
            "lease %s closed: adapter pid %s exited (status %s)", lease.lease_id, lease.adapter_pid, self.returncode
        )

    def _clear_and_sweep(self) -> tuple[Cleared, SweepResult]:
        """``cgroup.kill`` for the tree's cgroup (if it has one), then the marker sweep: in a worker thread."""
        cgroup = self.owner.cgroup
        cleared = Cleared(removed=True)
        if cgroup is not None and self.cgroup is not None:
            cleared = cgroup.clear_tree(self.lease.lease_id)
        return cleared, sweep(self.lease, self.owner.table)

    def _signal_wrapper(self, sig: signal.Signals, why: str) -> None:
        claim = self.lease.wrapper_claim()
        if claim is None:
            return
        outcome = send_verified_signal(claim, sig, self.owner.table)
        log.info(
            "lease %s: wrapper pid %d %s: %s %s",
            self.lease.lease_id,
            claim.pid,
            why,
            sig.name,
            "sent" if outcome.signalled else f"not sent ({outcome.verdict.value}: {outcome.reason})",
        )
