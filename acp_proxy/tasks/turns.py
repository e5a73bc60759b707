"""Prompt turns as they run: opening each task, following it, and settling it exactly once.

A turn is opened (its row written) when the proxy routes the gateway's
``session/prompt``, before it is sent or queued, so nothing the turn does can
precede its record. It is settled once, from whatever answers the gateway: the
adapter's answer, the proxy's own (a crash, a close, a shutdown, a queued prompt
cancelled), or the ``turn_timeout`` intent. Progress is written by the watcher,
at most once a second per turn, never by the relay.

Every write goes to the state database's writer thread (``StateDB.write``), so
recording a turn never waits for the database. A database that cannot be written
(a full disk, a damaged table) costs the record, never the turn: the failure comes
back from the writer, is logged, and the turn is written whole once it works.
"""

from __future__ import annotations

import functools
import logging
import sqlite3
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, Final

import anyio
import anyio.to_thread
import msgspec
from msgspec import UNSET, Raw, UnsetType

from acp_proxy.concurrency import Changes, Stopping
from acp_proxy.config import Config
from acp_proxy.logs import ids
from acp_proxy.ownership.leases import prune_ended
from acp_proxy.protocol import jsonrpc
from acp_proxy.protocol.jsonrpc import Message
from acp_proxy.tasks.notify import Notifier
from acp_proxy.tasks.records import TaskRegistry, Titles, prune, sweep_lost
from acp_proxy.tasks.status import (
    TERMINAL,
    TaskStatus,
    answer_json,
    operation_of,
    outcome_of,
    prompt_preview,
    traceparent_of,
)
from acp_proxy.tasks.turn import Limit, Turn, new_task_id
from acp_proxy.timings import Timing, Timings

log = logging.getLogger("acp_proxy.tasks")

FLUSH_INTERVAL: Final = 1.0
"""How often a running turn's progress is written to the database."""
PRUNE_INTERVAL: Final = 3600.0
"""How often a running proxy prunes finished tasks older than ``[tasks] retention``."""
CHECKPOINT_INTERVAL: Final = 1.0
"""How often the state database's WAL is checkpointed, off the event loop."""
ERROR_DETAIL_CHARS: Final = 300


class _PromptResult(msgspec.Struct, gc=False):
    stopReason: str | None = None


_prompt_result_decoder: Final = msgspec.json.Decoder(_PromptResult)


def stop_reason_of(result: Raw | UnsetType) -> str | None:
    if result is UNSET:
        return None
    try:
        return _prompt_result_decoder.decode(result).stopReason
    except (msgspec.DecodeError, RecursionError):
        return None


def error_text(error: jsonrpc.ErrorObject) -> str:
    """An error's message, with what its ``data`` says when that is text (adapters often put the cause there)."""
    detail: object = None
    if error.data is not UNSET:
        try:
            data = msgspec.json.decode(error.data)
        except (msgspec.DecodeError, RecursionError):
            data = None
        detail = data.get("message") if isinstance(data, dict) else data
    if not isinstance(detail, str) or not detail.strip() or detail == error.message:
        return error.message
    detail = " ".join(detail.split())
    if len(detail) > ERROR_DETAIL_CHARS:
        detail = detail[:ERROR_DETAIL_CHARS] + "…"
    return f"{error.message}: {detail}"


def _operation_or_none(params: dict[str, Any]) -> str | None:
    try:
        return operation_of(params)
    except ValueError:  # refused before its turn was opened
        return None


def _answer_of(answer: Message) -> bytes:
    """``{"result": …}`` or ``{"error": …}``: the adapter's answer without its envelope."""
    if answer.error is not UNSET:
        return msgspec.json.encode({"error": answer.error})
    result = answer.result if answer.result is not UNSET else Raw(b"null")
    return b'{"result":' + bytes(result) + b"}"


def turn_ids(turn: Turn) -> dict[str, Any]:
    return ids(session=turn.session_id, task=turn.task_id, lease=turn.lease_id, traceparent=turn.traceparent)


class TurnBook:
    """The tasks of the prompts this proxy serves: opened, followed, settled once, written when it can."""

    def __init__(
        self,
        tasks: TaskRegistry,
        config: Config,
        stopping: Stopping,
        *,
        prune_also: Callable[[float], int] | None = None,
        session_info: Callable[[str, dict[str, str | None]], None] | None = None,
        notifier: Notifier | None = None,
        timings: Timings | None = None,
        titles: Titles | None = None,
    ) -> None:
        self.tasks = tasks
        self.timings = timings
        """Where the turns' durations are counted (``Timing.TURN``, ``Timing.FIRST_UPDATE``), and flushed from."""
        self.config = config
        self.stopping = stopping
        self._prune_also = prune_also
        """Also forget what else ends with the retention (the sessions' tombstones): how many."""
        self._session_info = session_info
        self._titles = titles
        """Sessions' titles, for the notices of tasks swept ``lost`` (``sessions.registry.titles_of``)."""
        """Record on its session what a turn's ``session_info_update``s announced (title, ``updatedAt``)."""
        self.turns: dict[str, Turn] = {}
        """Tasks of this proxy not yet settled, by task id."""
        self.unwritten: dict[str, Turn] = {}
        """Turns whose last database write failed, to be written whole by the watcher."""
        self._retrying: set[str] = set()
        """Unwritten turns whose whole row is being written again."""
        self._outcomes: deque[tuple[Turn, BaseException | None]] = deque()
        """How writes went, as the writer thread tells it: failures, and retries that took."""
        tasks.on_written = self._written
        self.settled_unwritten: list[Turn] = []
        """Turns settled while their answer was being relayed, recorded once it is sent."""
        self.settled = Changes()
        """Notified whenever a turn is settled."""
        self.notifier = notifier
        self._notifying = notifier is not None and notifier.default != "silent"
        """Whether every turn's status changes go to the notifier, not only those of turns with a policy
        of their own: with notifications silent, a turn costs this check and no more."""

    # --- recording, never at the cost of the turn -------------------------------------------

    def _record(self, write: Callable[[Turn], object], turn: Turn) -> None:
        try:
            write(turn)
            if turn.session_info and self._session_info is not None:
                self._session_info(turn.session_id, turn.session_info)
                if self.notifier is not None:
                    self.notifier.note_title(turn.session_id, turn.session_info)
                turn.session_info = {}
        except sqlite3.Error as exc:  # not even queued: the database is closed
            self._failed(turn, exc)
        self.take_outcomes()

    def _written(self, turn: Turn, error: BaseException | None) -> None:
        """How a write of ``turn`` went; called on the writer thread, so it only leaves a note (and logs)."""
        if error is None and turn.task_id in self._retrying:
            # Said as soon as it is true: an operator reading the row may read the log next.
            log.info("task %s: recorded in the state database after all", turn.task_id, extra=turn_ids(turn))
            self._outcomes.append((turn, None))
        elif error is not None:
            self._outcomes.append((turn, error))

    def take_outcomes(self) -> None:
        """Act on what the writer said about earlier writes: failures kept for a retry, retries that took."""
        while self._outcomes:
            turn, error = self._outcomes.popleft()
            if error is not None:
                self._failed(turn, error)
            elif turn.task_id in self._retrying:
                self._retrying.discard(turn.task_id)
                self.unwritten.pop(turn.task_id, None)

    def _failed(self, turn: Turn, exc: BaseException) -> None:
        if turn.task_id in self._retrying:
            self._retrying.discard(turn.task_id)  # still failing: the next round tries again
        elif turn.task_id not in self.unwritten:
            log.error(
                "task %s: could not record it in the state database (retried every %gs): %s",
                turn.task_id,
                FLUSH_INTERVAL,
                exc,
                extra=turn_ids(turn),
            )
        self.unwritten[turn.task_id] = turn

    def retry_unwritten(self) -> None:
        """Turns whose last write failed (a locked or full database): write them whole, once it works."""
        self.take_outcomes()
        for task_id, turn in list(self.unwritten.items()):
            if task_id in self._retrying:
                continue  # already on its way
            self._retrying.add(task_id)
            try:
                self.tasks.write_whole(turn)
            except sqlite3.Error:
                self._retrying.discard(task_id)
                return  # still failing: the next round tries again
            self.take_outcomes()

    def maintain(self) -> None:
        """At startup: unfinished tasks of proxies that are gone become ``lost``; old finished ones are pruned."""
        try:
            told = self.notifier.swept if self.notifier else None
            lost = sweep_lost(self.tasks.db, self.tasks.instance_id, told, self._titles)
        except sqlite3.Error as exc:
            log.error("task sweep skipped: the state database: %s", exc)
        else:
            if lost:
                log.warning("%d task(s) of proxies that ended without recording an outcome marked lost", lost)
        self._prune()

    def _prune(self) -> None:
        """Finished tasks, ended leases and deleted sessions' tombstones older than ``[tasks] retention`` go."""
        retention = self.config.tasks.retention
        try:
            pruned = prune(self.tasks.db, retention)
            leases = prune_ended(self.tasks.db, retention)
            tombstones = self._prune_also(retention) if self._prune_also is not None else 0
        except sqlite3.Error as exc:
            log.error("pruning skipped: the state database: %s", exc)
            return
        if pruned or leases or tombstones:
            log.info(
                "pruned %d task(s), %d lease(s) and %d deleted session(s) that ended more than %gs ago",
                pruned,
                leases,
                tombstones,
                retention,
            )

    # --- opening -------------------------------------------------------------------------

    def open_turn(self, session_id: str, backend: str, msg: Message, lease_id: str | None) -> Turn:
        """A task for the gateway's ``session/prompt``: running under ``lease_id`` (its process's), else queued."""
        params = jsonrpc.decode_object(msg.params) or {}
        turn = Turn(
            task_id=new_task_id(),
            session_id=session_id,
            backend=backend,
            request_id=jsonrpc.encode_json(None if msg.id is UNSET else msg.id).decode(),
            prompt=prompt_preview(params),
            traceparent=traceparent_of(params.get("_meta")),
            operation_id=_operation_or_none(params),
        )
        if lease_id is not None:
            turn.start(lease_id, self.turn_timeout(turn), self.config.turn_idle_timeout(backend))
        else:
            turn.event("queued", "waiting for the session's process")
        self.turns[turn.task_id] = turn
        self._record(self.tasks.create, turn)
        if self._notifying:
            self._status_changed(turn, None)
        log.debug("task %s %s", turn.task_id, turn.status.value, extra=turn_ids(turn))
        return turn

    def start_turn(self, turn: Turn, lease_id: str | None, pid: int, *, resumed: bool) -> None:
        """A queued turn is being sent to the process ``pid`` now."""
        if resumed:
            turn.event("resumed", f"pid {pid}")
        turn.start(lease_id, self.turn_timeout(turn), self.config.turn_idle_timeout(turn.backend))
        self._record(self.tasks.mark_running, turn)
        if turn.notify or self._notifying:
            self._status_changed(turn, TaskStatus.QUEUED)
        log.debug("task %s running", turn.task_id, extra=turn_ids(turn))

    def turn_timeout(self, turn: Turn) -> float:
        """``turn_timeout`` for the turn's backend (``Config.resolved``); 0 means none."""
        return float(self.config.resolved(turn.backend, "turn_timeout"))

    # --- settling ------------------------------------------------------------------------

    def settle(
        self,
        turn: Turn,
        *,
        stop_reason: str | None = None,
        error: tuple[int, str] | None = None,
        ended_by: str | None = None,
        write_later: bool = False,
    ) -> None:
        """The gateway has been (or is being) answered: record how the turn ended. Once only.

        ``ended_by``: why the proxy answered it itself (``outcome_of``). ``write_later``: the
        relay is about to send the answer; it writes the record right after
        (``write_settled``), so the gateway does not wait for the database.
        """
        if turn.status in TERMINAL:
            return
        previous = turn.status
        turn.finish(
            outcome_of(stop_reason=stop_reason, error=error, timed_out=turn.timed_out, ended_by=ended_by, cut=turn.cut)
        )
        if turn.operation_id is not None and turn.answer is None:
            turn.answer = answer_json(stop_reason=stop_reason, error=error)
        if self.timings is not None and turn.started_at is not None and turn.ended_at is not None:
            self.timings.observe(Timing.TURN, turn.backend, turn.ended_at - turn.started_at)
            if turn.first_output_at is not None:
                self.timings.observe(Timing.FIRST_UPDATE, turn.backend, turn.first_output_at - turn.started_at)
        self.turns.pop(turn.task_id, None)
        self.settled.notify()
        if turn.notify or self._notifying:
            self._status_changed(turn, previous)
        if write_later and turn.operation_id is None:  # a retry's proxy may read its row right after this one
            self.settled_unwritten.append(turn)
        else:
            self._record(self.tasks.finish, turn)
            self._log_outcome(turn)

    def _status_changed(self, turn: Turn, previous: TaskStatus | None) -> None:
        if self.notifier is not None:  # a turn has a policy of its own only where there is one
            self.notifier.changed(turn, previous)

    def write_settled(self) -> None:
        """Record the turns settled with ``write_later`` (the relay calls this once their answers are sent)."""
        settled, self.settled_unwritten = self.settled_unwritten, []
        for turn in settled:
            self._record(self.tasks.finish, turn)
            self._log_outcome(turn)

    def _log_outcome(self, turn: Turn) -> None:
        level = logging.INFO if turn.status in (TaskStatus.DONE, TaskStatus.CANCELLED) else logging.WARNING
        detail = turn.stop_reason or turn.error or ""
        detail = "" if detail == turn.status.value else detail
        log.log(
            level,
            "task %s %s%s",
            turn.task_id,
            turn.status.value,
            f": {detail}" if detail else "",
            extra=turn_ids(turn),
        )

    def settle_answer(self, turn: Turn, answer: Message, *, write_later: bool = False) -> None:
        """From the adapter's answer to the prompt, as the gateway gets it."""
        if turn.operation_id is not None and turn.status not in TERMINAL:
            turn.answer = _answer_of(answer)
        if answer.error is not UNSET:
            self.settle(turn, error=(answer.error.code, error_text(answer.error)), write_later=write_later)
        else:
            self.settle(turn, stop_reason=stop_reason_of(answer.result), write_later=write_later)

    def settle_leftovers(self, why: str) -> None:
        """At the very end of a shutdown: anything not settled by then is (it should be nothing)."""
        for turn in list(self.turns.values()):
            log.warning("task %s was still open at exit: recorded cancelled", turn.task_id, extra=turn_ids(turn))
            self.settle(turn, error=(jsonrpc.REQUEST_CANCELLED, why))

    async def until_ended(self, turn: Turn) -> None:
        """Until ``turn`` has ended, however it ends: answered by its adapter, by the proxy (a cancel or
        timeout it cut short, a recycle), or with its process's exit; each settles it here."""
        await self.settled.until(lambda: turn.status in TERMINAL)

    async def wait_settled(self, turn: Turn, timeout: float) -> bool:
        """Wait at most ``timeout`` for ``turn`` to end; whether it has."""
        with anyio.move_on_after(timeout):
            await self.settled.until(lambda: turn.status in TERMINAL)
        return turn.status in TERMINAL

    def by_operation(self, session_id: str, operation_id: str, other_than: Turn | None = None) -> Turn | None:
        """This proxy's turn of the session with that operation id (but ``other_than``), running, queued, or
        ended with its row still being written."""
        turns = (*self.turns.values(), *self.settled_unwritten, *self.unwritten.values())
        return next(
            (t for t in turns if t.operation_id == operation_id and t.session_id == session_id and t is not other_than),
            None,
        )

    def ended_unwritten(self, task_id: str) -> Turn | None:
        """A turn of this proxy that has ended and whose row is still being written."""
        return next((t for t in (*self.settled_unwritten, *self.unwritten.values()) if t.task_id == task_id), None)

    # --- following -----------------------------------------------------------------------

    def note(self, turn: Turn | None, kind: str, detail: str) -> None:
        """An event of a running turn (a permission asked or answered, a cancel requested)."""
        if turn is not None and turn.status is TaskStatus.RUNNING:
            turn.event(kind, detail)

    async def watch(
        self,
        on_deadline: Callable[[Turn, Limit], Coroutine[Any, Any, None]],
        start: Callable[[Callable[[], Coroutine[Any, Any, None]]], None],
    ) -> None:
        """Write progress, retry failed writes, checkpoint, prune; hand turns past ``turn_timeout``, or quiet
        for ``turn_idle_timeout``, to ``on_deadline`` (once per turn).

        ``start`` runs ``on_deadline(turn, limit)`` as background work, so a slow one holds up nothing
        here. A turn waiting for the client's answer to one of its requests is not quiet (``Turn.asking``).
        """
        backends = self.config.backends.values()
        timeouts = [
            self.config.tasks.turn_timeout,
            self.config.tasks.turn_idle_timeout,
            *(b.turn_timeout or 0.0 for b in backends),
            *(b.turn_idle_timeout or 0.0 for b in backends),
        ]
        shortest = min((t for t in timeouts if t > 0), default=FLUSH_INTERVAL * 4)
        interval = max(0.05, min(FLUSH_INTERVAL, shortest / 4))
        checkpointed = pruned = time.monotonic()
        while True:
            await anyio.sleep(interval)
            if self.settled_unwritten:  # normally written by the relay at once; never left behind
                self.write_settled()
            if self.timings is not None:
                self.timings.flush()
            self.flush_progress()
            self.take_outcomes()
            if self.unwritten:
                self.retry_unwritten()
            if time.monotonic() - checkpointed >= CHECKPOINT_INTERVAL:
                await self._checkpoint()
                checkpointed = time.monotonic()
            if time.monotonic() - pruned >= PRUNE_INTERVAL:  # a long-lived proxy prunes too, not only at start
                pruned = time.monotonic()
                # In a worker thread, waiting for the writer (which makes the deletes, after every queued write).
                await anyio.to_thread.run_sync(self._prune)
            if self.stopping.begun:
                continue
            moment = time.monotonic()
            for turn in list(self.turns.values()):
                if turn.timed_out or turn.cut is not None or turn.status is not TaskStatus.RUNNING:
                    continue  # cut once only
                if turn.deadline is not None and moment >= turn.deadline:
                    turn.timed_out = True
                    start(functools.partial(on_deadline, turn, Limit.TURN_TIMEOUT))
                elif turn.idle_limit and not turn.asking and turn.quiet_for(moment) >= turn.idle_limit:
                    turn.timed_out = True
                    turn.cut = f"turn_idle_timeout: nothing heard from the agent for {turn.idle_limit:g}s"
                    start(functools.partial(on_deadline, turn, Limit.TURN_IDLE_TIMEOUT))

    async def _checkpoint(self) -> None:
        """The state database's WAL checkpoint, in a worker thread (see ``StateDB.defer_checkpoints``)."""
        try:
            await anyio.to_thread.run_sync(self.tasks.db.checkpoint)
        except sqlite3.Error as exc:
            log.warning("state database checkpoint failed (retried in %gs): %s", CHECKPOINT_INTERVAL, exc)

    def flush_progress(self) -> None:
        for turn in list(self.turns.values()):
            if turn.dirty and turn.status not in TERMINAL and turn.task_id not in self.unwritten:
                self._record(self.tasks.save_progress, turn)
