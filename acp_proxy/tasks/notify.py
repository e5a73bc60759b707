"""Task notifications: the operator's own command, run when a task's status changes.

A task's effective policy (its own, set with ``acp-proxy tasks notify``, else ``[tasks]
notify``) picks the changes worth telling: ``done_only`` the terminal status, ``waiting`` that
and every request of the agent's that waits for an answer (a permission, an elicitation: an
operator's script can page a phone), ``state_changes`` every status the task takes (its first
one, ``queued`` or ``running``, with no previous status) and every waiting request, ``silent``
none. Each is told by running ``notify_command`` with one JSON object,
one line, on its stdin (``Notice``).

Nothing here is on the relay's path. A status change builds a small ``Notice`` and puts it
in a bounded in-memory queue; when that is full the notice is dropped with a warning rather
than making anyone wait. The commands run in the proxy's task group, at most ``LANES`` at a
time; the notices of one session share a lane, so a task's ``running`` is told before its
``done``. Each command gets ``notify_timeout``, then it and its process group are killed.
Delivery is at most once: a command that fails (an exit status, the timeout, a program that
cannot be started) is logged with its task and counted (``notify_failed``), never retried: the
command is the operator's, and one that has just failed is as likely to fail again while the
queue grows behind it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
from collections.abc import Callable
from typing import Final, Protocol

import anyio
import anyio.to_thread
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from acp_proxy.concurrency import Changes
from acp_proxy.config import MissingVariable, NotifyPolicy, TasksConfig, expand
from acp_proxy.journal import Journal, Kind
from acp_proxy.logs import ids
from acp_proxy.ownership.supervised import ChildProcess
from acp_proxy.ownership.verify import kill_child_group
from acp_proxy.protocol.errors import describe_exit
from acp_proxy.state import now
from acp_proxy.stdio import FdSendStream
from acp_proxy.tasks.records import Swept
from acp_proxy.tasks.status import TERMINAL, TaskStatus
from acp_proxy.tasks.turn import Turn

log = logging.getLogger("acp_proxy.notify")

NOTICE_VERSION: Final = 1
LANES: Final = 4
"""Notification commands running at once, at most."""
LANE_LIMIT: Final = 64
"""Notices waiting per lane; beyond it new ones are dropped."""
TITLE_CHARS: Final = 200
TITLES_KEPT: Final = 1024
"""Sessions whose title a turn announced, remembered at most (older ones are read from the session table)."""
OUTPUT_LIMIT: Final = 4096
"""Bytes of a command's output (stdout and stderr together) kept to log if it fails."""
KILL_WAIT: Final = 2.0
"""How long a killed command has to be gone before it is given up on (logged)."""
SHUTDOWN_GRACE: Final = 2.0
"""How long an exiting proxy lets queued notifications go out before dropping them."""


def wanted(policy: NotifyPolicy, status: TaskStatus) -> bool:
    """Whether a task under ``policy`` is told about taking ``status``."""
    if policy == "state_changes":
        return True
    return policy in ("done_only", "waiting") and status in TERMINAL


def wants_waiting(policy: NotifyPolicy) -> bool:
    """Whether a task under ``policy`` is told when the agent waits for an answer during it."""
    return policy in ("waiting", "state_changes")


class Notice(msgspec.Struct, frozen=True, kw_only=True):
    """What a notification command reads on its stdin (and ``tasks watch --json`` prints)."""

    version: int = NOTICE_VERSION
    event: str = "task"
    """``task``: a task took ``status``. ``session_recycled``: the proxy recycled a session's process
    (over its memory ceiling, hung, or broken): ``taskId`` is ``None``, ``status`` is ``recycled``,
    ``previousStatus`` the reason (``session_max_memory``, ...) and ``reason`` the figures.
    ``request_waiting``: the agent asked something and waits (``status`` ``waiting``, ``reason``
    what it asks, ``request`` the id ``acp-proxy permissions answer`` takes)."""
    taskId: str | None
    sessionId: str
    title: str | None
    backend: str
    status: str
    previousStatus: str | None
    reason: str | None
    """The error if there is one (the agent's, or why the proxy ended the turn itself, such as
    ``cancel_timeout: ...``), else the stop reason."""
    durationSeconds: float | None
    """From the start of the turn to its end; ``None`` until it has ended (or if it never started)."""
    lastText: str
    """The tail of the agent's text, as the task keeps it (``records.SUMMARY_CHARS``)."""
    traceparent: str | None
    instance: str
    """The proxy instance that ran the task."""
    at: float
    """When the task took ``status`` (unix time)."""


class WaitingNotice(Notice, frozen=True, kw_only=True):
    """A ``request_waiting`` notice: a task's fields and the waiting request."""

    request: str
    """As ``acp-proxy permissions`` names it (``acp-proxy permissions answer REQUEST OPTION``)."""


encode_notice: Final = msgspec.json.Encoder().encode


class _Task(Protocol):
    """What a notice is made from: a ``Turn`` in memory, or a ``TaskRecord`` read back."""

    @property
    def task_id(self) -> str: ...
    @property
    def session_id(self) -> str: ...
    @property
    def backend(self) -> str: ...
    @property
    def stop_reason(self) -> str | None: ...
    @property
    def error(self) -> str | None: ...
    @property
    def created_at(self) -> float: ...
    @property
    def started_at(self) -> float | None: ...
    @property
    def ended_at(self) -> float | None: ...
    @property
    def summary(self) -> str: ...
    @property
    def traceparent(self) -> str | None: ...


def notice_of(
    task: _Task, status: TaskStatus, previous: TaskStatus | None, *, title: str | None, instance: str
) -> Notice:
    """The notice that ``task`` took ``status`` (after ``previous``; ``None`` for its first)."""
    started, ended = task.started_at, task.ended_at
    terminal = status in TERMINAL
    # A task shown lost because its proxy is gone has no end on record yet: it is found lost now.
    began = started if status is TaskStatus.RUNNING else None
    at = (ended or now()) if terminal else (began or task.created_at)
    return Notice(
        taskId=task.task_id,
        sessionId=task.session_id,
        title=title[:TITLE_CHARS] if title else title,
        backend=task.backend,
        status=status.value,
        previousStatus=previous.value if previous is not None else None,
        reason=(task.error or task.stop_reason) if terminal else None,
        durationSeconds=round(ended - started, 3) if terminal and started and ended else None,
        lastText=task.summary,
        traceparent=task.traceparent,
        instance=instance,
        at=at,
    )


class Notifier:
    """A proxy's notifications: notices queued as tasks change, commands run from its task group."""

    def __init__(
        self,
        command: tuple[str, ...],
        *,
        default: NotifyPolicy,
        timeout: float,
        instance_id: str,
        journal: Journal | None = None,
        title_of: Callable[[str], str | None] | None = None,
    ) -> None:
        self.command = command
        self.default = default
        """The config's policy, for tasks without one of their own."""
        self.timeout = timeout
        self.instance_id = instance_id
        self.journal = journal
        self.title_of = title_of
        """A session's title as this proxy holds it in memory."""
        self.titles: dict[str, str | None] = {}
        """Titles announced during this proxy's turns, by session: newer than ``title_of``'s."""
        self._lanes: list[tuple[MemoryObjectSendStream[Notice], MemoryObjectReceiveStream[Notice]]] = [
            anyio.create_memory_object_stream[Notice](LANE_LIMIT) for _ in range(LANES)
        ]
        self._pending = 0
        """Notices queued or being delivered."""
        self._changes = Changes()

    @classmethod
    def for_tasks(
        cls,
        config: TasksConfig,
        instance_id: str,
        journal: Journal | None,
        title_of: Callable[[str], str | None] | None = None,
    ) -> Notifier | None:
        """The notifier ``[tasks]`` asks for; ``None`` without a ``notify_command`` (nothing could be told)."""
        if config.notify_command is None:
            return None
        return cls(
            config.notify_command,
            default=config.notify,
            timeout=config.notify_timeout,
            instance_id=instance_id,
            journal=journal,
            title_of=title_of,
        )

    # --- on the event loop: deciding and queueing, never waiting ---------------------------------

    def changed(self, turn: Turn, previous: TaskStatus | None) -> None:
        """``turn`` has just taken its current status (after ``previous``)."""
        if not wanted(turn.notify or self.default, turn.status):
            return
        # Announced during this turn and not recorded yet: the newest there is.
        title = turn.session_info["title"] if "title" in turn.session_info else self._title(turn.session_id)
        self._enqueue(notice_of(turn, turn.status, previous, title=title, instance=self.instance_id))

    def recycled(self, session_id: str, backend: str, reason: str, why: str) -> None:
        """The proxy recycled a session's process (``why``: the figures). Told under any policy but ``silent``."""
        if self.default == "silent":
            return
        notice = Notice(
            event="session_recycled",
            taskId=None,
            sessionId=session_id,
            title=self._title(session_id),
            backend=backend,
            status="recycled",
            previousStatus=reason,
            reason=why,
            durationSeconds=None,
            lastText="",
            traceparent=None,
            instance=self.instance_id,
            at=now(),
        )
        self._enqueue(notice)

    def waiting(self, turn: Turn | None, session_id: str, backend: str, request: str, what: str) -> None:
        """The agent asked ``what`` (request ``request``) and waits for an answer."""
        policy = (turn.notify if turn is not None else None) or self.default
        if not wants_waiting(policy):
            return
        notice = WaitingNotice(
            event="request_waiting",
            taskId=turn.task_id if turn is not None else None,
            sessionId=session_id,
            title=self._title(session_id),
            backend=backend,
            status="waiting",
            previousStatus=turn.status.value if turn is not None else None,
            reason=what,
            durationSeconds=None,
            lastText=turn.summary if turn is not None else "",
            traceparent=turn.traceparent if turn is not None else None,
            instance=self.instance_id,
            at=now(),
            request=request,
        )
        self._enqueue(notice)

    def swept(self, task: Swept) -> None:
        """At startup, a dead proxy's task marked ``lost`` by this one."""
        if wanted(task.notify or self.default, TaskStatus.LOST):
            record = task.record
            notice = notice_of(record, TaskStatus.LOST, task.previous, title=task.title, instance=record.instance_id)
            self._enqueue(notice)

    def note_title(self, session_id: str, changes: dict[str, str | None]) -> None:
        """What a turn's ``session_info_update`` announced, as it is recorded on the session."""
        if "title" in changes:
            self.titles.pop(session_id, None)  # to the end: the least recently titled go first
            self.titles[session_id] = changes["title"]
            if len(self.titles) > TITLES_KEPT:
                del self.titles[next(iter(self.titles))]

    def _title(self, session_id: str) -> str | None:
        if session_id in self.titles:
            return self.titles[session_id]
        return self.title_of(session_id) if self.title_of is not None else None

    def _enqueue(self, notice: Notice) -> None:
        send = self._lanes[hash(notice.sessionId) % LANES][0]
        try:
            send.send_nowait(notice)
        except anyio.WouldBlock:
            self._failed(notice, "dropped", f"{LANE_LIMIT} notifications are already waiting; this one is dropped")
            return
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._failed(notice, "dropped", "the proxy is exiting: notifications have stopped")
            return
        self._pending += 1

    # --- in the proxy's task group: running the commands ------------------------------------------

    async def run(self) -> None:
        """Run the queued notifications until cancelled; the queues are closed then (later notices are dropped)."""
        try:
            async with anyio.create_task_group() as lanes:
                for _send, receive in self._lanes:
                    lanes.start_soon(self._lane, receive)
        finally:
            self.close()

    def close(self) -> None:
        """Close the queues: what is queued is dropped, later notices are dropped as they come (said once each)."""
        for send, receive in self._lanes:
            send.close()
            receive.close()

    async def _lane(self, receive: MemoryObjectReceiveStream[Notice]) -> None:
        async with receive:
            await self._deliver_all(receive)

    async def _deliver_all(self, receive: MemoryObjectReceiveStream[Notice]) -> None:
        async for notice in receive:
            try:
                await self._deliver(notice)
            finally:
                self._pending -= 1
                self._changes.notify()

    async def drain(self, grace: float = SHUTDOWN_GRACE) -> None:
        """At shutdown: queued notifications get ``grace`` to go out; what is left then is dropped, and said."""
        with anyio.move_on_after(grace):
            await self._changes.until(lambda: self._pending == 0)
        if self._pending:
            log.warning("%d task notification(s) dropped: the proxy is exiting", self._pending)

    async def _deliver(self, notice: Notice) -> None:
        try:
            argv = [expand(arg, os.environ) for arg in self.command]
        except MissingVariable as exc:
            self._failed(notice, "spawn", f"notify_command not run: {exc}")
            return
        try:
            # Shielded: a command that was started is ours to end, even if we are being cancelled.
            with anyio.CancelScope(shield=True):
                child, stdin_fd, output = await anyio.to_thread.run_sync(_start, argv)
        except (OSError, ValueError) as exc:
            self._failed(notice, "spawn", f"{argv[0]} could not be started: {getattr(exc, 'strerror', None) or exc}")
            return
        stdin = FdSendStream(stdin_fd, owned=True)
        kept = bytearray()
        try:
            with anyio.move_on_after(self.timeout) as deadline:
                async with anyio.create_task_group() as reading:
                    reading.start_soon(_collect, output, kept)
                    await _send_notice(stdin, encode_notice(notice) + b"\n")
                    await child.wait()
                    reading.cancel_scope.cancel()  # a descendant may hold the output open: the command is done
        finally:
            await stdin.aclose()  # already closed unless cancelled first; never waits
            if child.returncode is None:  # past notify_timeout, or the proxy is exiting
                # Only ``ChildProcess`` reaps it, so it is still our unreaped child: its pid, which is
                # also its group's id, cannot have been reused.
                kill_child_group(child.pid)
                with anyio.CancelScope(shield=True), anyio.move_on_after(KILL_WAIT):
                    await child.wait()
                if child.returncode is None:
                    log.error(
                        "task %s: notify_command pid %d still there %gs after SIGKILL",
                        notice.taskId,
                        child.pid,
                        KILL_WAIT,
                    )
            _read_available(output, kept)
            os.close(output)
        if deadline.cancelled_caught:
            self._failed(notice, "timeout", f"still running after {self.timeout:g}s: killed", kept)
        elif child.returncode:
            self._failed(notice, "exit", f"{argv[0]} ended: {describe_exit(child.returncode)}", kept)
        else:
            log.debug("task %s: told %s", notice.taskId, notice.status, extra=_ids(notice))

    def _failed(self, notice: Notice, why: str, message: str, output: bytes | bytearray = b"") -> None:
        text = " ".join(output.decode(errors="replace").split())
        log.warning(
            "task %s: notification of %s failed: %s%s",
            notice.taskId,
            notice.status,
            message,
            f"; its output: {text}" if text else "",
            extra=_ids(notice),
        )
        if self.journal is not None:
            self.journal.record(Kind.NOTIFY_FAILED, backend=notice.backend, label=why)


def _ids(notice: Notice) -> dict[str, object]:
    return ids(session=notice.sessionId, task=notice.taskId, traceparent=notice.traceparent)


def _start(argv: list[str]) -> tuple[ChildProcess, int, int]:
    """Start ``argv`` in a session of its own (a terminal's signals are not for it): the child, its stdin, its output.

    Its environment is the proxy's. Run in a worker thread: a fork and exec are not the event loop's to wait for.
    """
    stdin_r, stdin_w = os.pipe()
    output_r, output_w = os.pipe()
    try:
        popen = subprocess.Popen(argv, stdin=stdin_r, stdout=output_w, stderr=output_w, start_new_session=True)
    except BaseException:
        os.close(stdin_w)
        os.close(output_r)
        raise
    finally:
        os.close(stdin_r)
        os.close(output_w)
    os.set_blocking(output_r, False)
    return ChildProcess(popen), stdin_w, output_r


async def _send_notice(stdin: FdSendStream, data: bytes) -> None:
    """The notice, then end of input: the command reads one notice."""
    with contextlib.suppress(anyio.BrokenResourceError):  # it did not read it: its exit status says if that is fine
        await stdin.send(data)
    await stdin.aclose()


async def _collect(fd: int, kept: bytearray) -> None:
    """Read ``fd`` until end of file, keeping the first ``OUTPUT_LIMIT`` bytes; the command never blocks on it."""
    while _read_available(fd, kept):
        await anyio.wait_readable(fd)


def _read_available(fd: int, kept: bytearray) -> bool:
    """What can be read from ``fd`` now, into ``kept`` (up to ``OUTPUT_LIMIT``); False at end of file."""
    while True:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not data:
            return False
        kept += data[: max(0, OUTPUT_LIMIT - len(kept))]
