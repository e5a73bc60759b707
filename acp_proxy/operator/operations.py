"""What an operator can ask of a running proxy through its control socket.

``acp-proxy status|sessions|tasks`` read the state database and need no proxy;
acting on a session or a turn (cancel, suspend, close) must go through the proxy
that holds it, because only it can tell its adapter and answer its gateway. These
are the commands it serves. Each answers once the act is done (or has clearly
failed), so the CLI can report an outcome rather than an intention:

    status                              who this proxy is, its pool, its sessions and turns
    sessions                            the sessions it holds, with their processes
    cancel_task {taskId, wait?}         session/cancel for the task's session; the task's outcome
    suspend_session {sessionId}         stop an idle session's process; it stays resumable
    close_session {sessionId}           end its turn, reap its tree, forget it (as session/close)
    notify_task {taskId, policy}        a task's own notification policy (null: the config's)

Nothing here signals a process by PID: suspending and closing go through the same
code as the idle TTL and ``session/close``, which stop adapters by their leases.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import anyio
import msgspec
import sniffio

from acp_proxy import __version__
from acp_proxy.concurrency import Stopping
from acp_proxy.config import NOTIFY_POLICIES, Config
from acp_proxy.journal import SuspendReason
from acp_proxy.logs import ids
from acp_proxy.operator.control import (
    ControlError,
    ControlServer,
    ControlUnavailable,
    bind_private,
    remove_stale,
    request,
    socket_path,
)
from acp_proxy.ownership import instances
from acp_proxy.ownership.owner import Owner
from acp_proxy.pool.processes import ProcessPool
from acp_proxy.pool.tenancy import busy
from acp_proxy.relay.sharing import Sharing
from acp_proxy.sessions.handover import Answer
from acp_proxy.sessions.intents import SessionIntents
from acp_proxy.sessions.lifecycle import Phase
from acp_proxy.sessions.table import Session
from acp_proxy.state import StateDB
from acp_proxy.tasks.records import get_task
from acp_proxy.tasks.status import TERMINAL, TaskStatus
from acp_proxy.tasks.turn import Turn
from acp_proxy.tasks.turns import TurnBook

log = logging.getLogger("acp_proxy.operations")

CANCEL_WAIT: Final = 10.0
"""How long ``cancel_task`` waits for the agent to end the turn before answering "still running"."""
PEER_TIMEOUT: Final = 2.0
MAX_HANDOVER_WAIT: Final = 3600.0
"""The longest an asker may have a holder wait for its turn to end (``[sessions] handover_timeout``)."""
RELEASE_MARGIN: Final = 10.0
"""Beyond its ``handover_timeout``, how long a handover's asker waits for the holder's answer: the holder's
process stops (its graces) and its row is written before it answers."""
"""How long another proxy has to answer a request to suspend one of its sessions for us."""


def turn_view(turn: Turn) -> dict[str, Any]:
    return {
        "taskId": turn.task_id,
        "sessionId": turn.session_id,
        "status": turn.status.value,
        "startedAt": turn.started_at,
        "createdAt": turn.created_at,
        "updateCount": turn.update_count,
        "prompt": turn.prompt,
    }


def session_view(session: Session, now_monotonic: float) -> dict[str, Any]:
    adapter = session.live_adapter
    turn = adapter.tenancy.turn if adapter is not None else None
    if session.closed:
        state = "closing"
    elif adapter is not None:
        state = "live"
    elif session.draining or session.phase in (Phase.RESUMING, Phase.REOPENING):
        state = "resuming"  # a request waiting for its session restores it first
    else:
        state = "suspended"
    return {
        "sessionId": session.session_id,
        "backend": session.record.backend,
        "state": state,
        "pid": adapter.pid if adapter is not None else None,
        "lease": adapter.supervised.lease.lease_id if adapter is not None else None,
        "busy": busy(adapter) if adapter is not None else False,
        "idleSeconds": round(now_monotonic - adapter.usage.last_active, 3) if adapter is not None else None,
        "queued": len(session.queue),
        "taskId": turn.task_id if turn is not None and turn.status is TaskStatus.RUNNING else None,
    }


class ServedProxy(msgspec.Struct, frozen=True):
    """The parts of a running proxy its operations read and act through."""

    config: Config
    owner: Owner
    pool: ProcessPool
    turns: TurnBook
    intents: SessionIntents
    stopping: Stopping
    started_at: float
    sharing: Sharing


class Operations:
    """The control socket's commands, served for ``proxy``."""

    def __init__(self, proxy: ServedProxy) -> None:
        self.proxy = proxy
        self.commands: dict[str, Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]] = {
            "status": self.status,
            "sessions": self.sessions,
            "cancel_task": self.cancel_task,
            "suspend_session": self.suspend_session,
            "close_session": self.close_session,
            "evict_slot": self.evict_slot,
            "notify_task": self.notify_task,
            "permissions": self.permissions,
            "answer_permission": self.answer_permission,
            "release_session": self.release_session,
        }

    async def serve(self) -> None:
        """Listen on this proxy's control socket until cancelled; a socket that cannot be made is logged, not fatal."""
        db = self.proxy.owner.db
        path = socket_path(db.state_dir, self.proxy.owner.instance_id)
        try:
            remove_stale(db.state_dir, lambda instance_id: instances.instance_alive(db, instance_id))
            sock = bind_private(path)
        except OSError as exc:
            log.warning("control socket %s not available (%s): operators cannot act on this proxy", path, exc)
            return
        log.info("control socket: %s", path)
        await ControlServer(path, self.handle, streams={"attach": self.proxy.sharing.serve_attachment}).serve(sock)

    async def handle(self, command: str, args: dict[str, Any]) -> dict[str, Any]:
        action = self.commands.get(command)
        if action is None:
            raise ControlError("unknown_command", f"unknown command {command!r} (known: {', '.join(self.commands)})")
        return await action(args)

    # --- reading -------------------------------------------------------------------------

    async def status(self, args: dict[str, Any]) -> dict[str, Any]:
        proxy = self.proxy
        live = proxy.pool.processes.live()
        return {
            "instance": proxy.owner.instance_id,
            "pid": os.getpid(),
            "version": __version__,
            "asyncBackend": sniffio.current_async_library(),
            "startedAt": proxy.started_at,
            "uptimeSeconds": round(time.time() - proxy.started_at, 3),
            "shuttingDown": proxy.stopping.begun,
            "ownership": proxy.owner.cgroups.to_json(),
            "backends": sorted(proxy.config.backends),
            "pool": {
                "live": len(live),
                "maxLive": proxy.config.pool.max_live,
                "maxMemory": proxy.config.pool.max_memory,
                "spares": sum(1 for a in live if a.gateway_session is None),
            },
            "sessions": len(proxy.intents.table),
            "turns": [turn_view(t) for t in proxy.turns.turns.values()],
            "waiting": proxy.sharing.pending(),
            "attachedClients": proxy.sharing.attached,
        }

    async def sessions(self, args: dict[str, Any]) -> dict[str, Any]:
        moment = time.monotonic()
        return {"sessions": [session_view(s, moment) for s in self.proxy.intents.table.values()]}

    async def permissions(self, args: dict[str, Any]) -> dict[str, Any]:
        """The agent's requests waiting for an answer in this proxy's sessions."""
        return {"requests": self.proxy.sharing.pending()}

    # --- acting --------------------------------------------------------------------------

    def _acting(self) -> None:
        if self.proxy.stopping.begun:
            raise ControlError("shutting_down", "this proxy is shutting down; its sessions are being suspended")

    def _session(self, args: dict[str, Any]) -> Session:
        session_id = _text_arg(args, "sessionId")
        session = self.proxy.intents.table.get(session_id)
        if session is None or session.closed:
            raise ControlError("unknown_session", f"this proxy does not hold session {session_id}")
        return session

    async def cancel_task(self, args: dict[str, Any]) -> dict[str, Any]:
        self._acting()
        task_id = _text_arg(args, "taskId")
        wait = args.get("wait", True)
        if not isinstance(wait, bool):
            raise ControlError("invalid_args", "'wait' must be true or false")
        turns = self.proxy.turns
        turn = await self._unsettled_turn(task_id)
        session = self.proxy.intents.table.get(turn.session_id)
        log.info("task %s: cancel requested by an operator", task_id, extra=ids(task=task_id, session=turn.session_id))
        if session is not None:
            await self.proxy.intents.cancel(session, by="an operator", task=turn)
        if wait:
            await turns.wait_settled(turn, CANCEL_WAIT)
        return {"taskId": task_id, "sessionId": turn.session_id, "status": turn.status.value, "waited": wait}

    async def _unsettled_turn(self, task_id: str) -> Turn:
        """A task this proxy is serving; ``task_finished`` if it has ended, else ``unknown_task``."""
        turns = self.proxy.turns
        turn = turns.turns.get(task_id)
        if turn is not None:
            return turn
        ended = turns.ended_unwritten(task_id)
        if ended is not None and ended.status in TERMINAL:  # ended; its row is being written
            raise ControlError("task_finished", f"task {task_id} has already ended ({ended.status.value})")
        await self.proxy.owner.db.caught_up()  # the row as this proxy last wrote it
        record = get_task(self.proxy.owner.db, task_id)
        if record is not None and record.status in TERMINAL:
            raise ControlError("task_finished", f"task {task_id} has already ended ({record.status.value})")
        raise ControlError("unknown_task", f"this proxy is not running task {task_id}")

    async def notify_task(self, args: dict[str, Any]) -> dict[str, Any]:
        """Set a task's own notification policy (``None``: back to the config's), here and on its row."""
        task_id = _text_arg(args, "taskId")
        policy = args.get("policy")
        if policy is not None and policy not in NOTIFY_POLICIES:
            raise ControlError("invalid_args", f"'policy' must be one of {', '.join(NOTIFY_POLICIES)}, or null")
        notifier = self.proxy.turns.notifier
        if policy not in (None, "silent") and notifier is None:
            raise ControlError(
                "invalid_args", "this proxy has no [tasks] notify_command configured: there is nothing to run"
            )
        turn = await self._unsettled_turn(task_id)
        turn.notify = policy
        self.proxy.turns.tasks.record_notify(turn)
        log.info("task %s: notifications %s", task_id, policy or "as configured", extra=ids(task=task_id))
        default = notifier.default if notifier is not None else "silent"
        return {
            "taskId": task_id,
            "sessionId": turn.session_id,
            "status": turn.status.value,
            "policy": policy,
            "effective": policy or default,
        }

    async def answer_permission(self, args: dict[str, Any]) -> dict[str, Any]:
        """Answer a waiting permission request (``optionId``, or ``cancel: true``); the first answer wins."""
        self._acting()
        key = _text_arg(args, "request")
        cancel = args.get("cancel", False)
        if not isinstance(cancel, bool):
            raise ControlError("invalid_args", "'cancel' must be true or false")
        option = None if cancel else _text_arg(args, "optionId")
        who = args.get("by")
        by = f"operator ({who[:80]})" if isinstance(who, str) and who else "operator"
        try:
            return await self.proxy.sharing.answer_by_operator(key, option, by)
        except LookupError as exc:
            raise ControlError("not_waiting", str(exc)) from None
        except ValueError as exc:
            raise ControlError("invalid_args", str(exc)) from None

    async def suspend_session(self, args: dict[str, Any]) -> dict[str, Any]:
        self._acting()
        session = self._session(args)
        adapter = session.live_adapter
        if adapter is None:
            return {"sessionId": session.session_id, "suspended": True, "already": True}
        if not self.proxy.intents.suspend(session.session_id, "an operator asked", SuspendReason.OPERATOR):
            why = (
                "its agent is still working in the background (quiet_after)"
                if adapter.working_in_background and not adapter.turn_in_flight
                else "a turn or request is in flight"
            )
            raise ControlError("busy", f"session {session.session_id} is busy ({why}); cancel it or wait")
        stopping = session.stopping
        if stopping is not None:
            with anyio.move_on_after(self._stop_budget()):
                await stopping.wait()
        await self.proxy.owner.db.caught_up()  # answered once the row says so, as a close is
        return {"sessionId": session.session_id, "suspended": True, "already": False, "pid": adapter.pid}

    async def close_session(self, args: dict[str, Any]) -> dict[str, Any]:
        self._acting()
        session = self._session(args)
        closing = await self.proxy.intents.close(session.session_id, None)
        if closing is None:
            raise ControlError("unknown_session", f"this proxy does not hold session {session.session_id}")
        with anyio.move_on_after(self._stop_budget() + self.proxy.config.shutdown.close_timeout):
            await closing.forgotten.wait()
        done = closing.forgotten.is_set()
        return {"sessionId": closing.session_id, "closed": done}

    async def evict_slot(self, args: dict[str, Any]) -> dict[str, Any]:
        """Another proxy of the install needs a slot and chose this one of ours (the pool's own checks decide)."""
        key = _text_arg(args, "key")
        why = args.get("why") if isinstance(args.get("why"), str) else "another proxy needs a slot"
        # The asker's reason is kept only where it says more than "for another proxy" (its memory budget).
        reason = SuspendReason.MEMORY if args.get("reason") == SuspendReason.MEMORY.value else SuspendReason.PEER
        evicted = self.proxy.pool.processes.evict_for_peer(key, f"{why}, for another proxy", reason)
        return {"key": key, "evicted": evicted}

    async def release_session(self, args: dict[str, Any]) -> dict[str, Any]:
        """Another proxy of the install asks for a session this one holds (a handover): released once nothing of it
        runs here, within the asker's ``timeout``; ``busy`` if a turn still runs then."""
        self._acting()
        session_id = _text_arg(args, "sessionId")
        to = _text_arg(args, "to")
        timeout = args.get("timeout")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 <= timeout <= MAX_HANDOVER_WAIT:
            raise ControlError("invalid_args", f"'timeout' must be a number of seconds from 0 to {MAX_HANDOVER_WAIT:g}")
        if not await self.proxy.intents.release(session_id, to, float(timeout)):
            raise ControlError("turn_running", f"session {session_id} is running a turn here; it stays here")
        self.proxy.sharing.session_ended(session_id, "moved")  # its attached clients attach again, there
        return {"sessionId": session_id, "released": True}

    def _stop_budget(self) -> float:
        return self.proxy.config.shutdown.gone_within


class InstallPeers:
    """The other proxies of this install, reached through their control sockets (the pool's ``Peers``)."""

    def __init__(self, db: StateDB) -> None:
        self.db = db

    def alive(self, instance_id: str) -> bool:
        return instances.instance_alive(self.db, instance_id)

    async def evict(self, instance_id: str, key: str, why: str, reason: SuspendReason) -> bool:
        path = socket_path(self.db.state_dir, instance_id)
        args = {"key": key, "why": why, "reason": reason.value}
        ask = functools.partial(request, path, "evict_slot", args, timeout=PEER_TIMEOUT)
        try:
            result = await anyio.to_thread.run_sync(ask, abandon_on_cancel=True)
        except (ControlUnavailable, ControlError, TimeoutError, OSError) as exc:
            log.info("proxy %s did not suspend %s for us: %s", instance_id, key, exc)
            return False
        return result.get("evicted") is True

    async def release(self, instance_id: str, session_id: str, to: str, timeout: float) -> Answer:
        """Ask proxy ``instance_id`` to hand ``session_id`` over to proxy ``to`` (``Handover.take_over``)."""
        path = socket_path(self.db.state_dir, instance_id)
        args = {"sessionId": session_id, "to": to, "timeout": timeout}
        ask = functools.partial(request, path, "release_session", args, timeout=timeout + RELEASE_MARGIN)
        try:
            result = await anyio.to_thread.run_sync(ask, abandon_on_cancel=True)
        except ControlError as exc:
            if exc.code == "turn_running":
                return Answer.KEPT
            if exc.code == "shutting_down":
                return Answer.STOPPING
            log.info("proxy %s did not release session %s: %s", instance_id, session_id, exc)
            return Answer.UNANSWERED
        except (ControlUnavailable, TimeoutError, OSError) as exc:
            log.info("proxy %s did not answer for session %s: %s", instance_id, session_id, exc)
            return Answer.UNANSWERED
        return Answer.RELEASED if result.get("released") is True else Answer.UNANSWERED


def _text_arg(args: dict[str, Any], name: str) -> str:
    value = args.get(name)
    if not isinstance(value, str) or not value:
        raise ControlError("invalid_args", f"'{name}' must be a non-empty string")
    return value
