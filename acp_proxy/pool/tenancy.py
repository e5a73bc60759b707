"""What one adapter process is to the proxy's sessions, beside its connection.

An ``Adapter`` (``pool.adapter``) is the connection to one process: its pipes, the calls pending
on it, the ids it knows sessions by. What the pool, the sessions and the relay decide about that
process is here: whether a request has claimed it, the turn running on it, whether its updates
are history to drop, whether the proxy answered its turn for it, how many of its requests the
gateway owes an answer, and whether its session is to be recycled. Whether it may be taken for
another session is ``busy``, the one decision made over both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio

from acp_proxy.journal import SuspendReason
from acp_proxy.tasks.status import TaskStatus
from acp_proxy.tasks.turn import Turn

if TYPE_CHECKING:
    from acp_proxy.pool.adapter import Adapter


class Tenancy:
    """The proxy's account of one process's use; the rest of the proxy changes it through these methods."""

    def __init__(self) -> None:
        self.claimed = False
        """Taken for a ``session/new`` or a restore in progress: not a spare, not idle."""
        self.first_answered: anyio.Event | None = None
        """Set once the request it was started for (``initialize``, most often) is answered: until then
        a spare does not know what its agent can do, and a restore on it waits for this."""
        self.swallow_updates = False
        """Drop ``session/update``s (the replay of a load the gateway did not ask for)."""
        self.muted = False
        """The proxy answered its turn for it and is stopping it: of what it writes from now on only
        answers to requests still pending are relayed (its late updates and requests are dropped)."""
        self.upstream_pending = 0
        """Agent->client requests of this process the gateway has not answered yet."""
        self.turn: Turn | None = None
        """The prompt turn running on this process, whose streamed updates are counted against it."""
        self.recycle: tuple[str, SuspendReason] | None = None
        """Why (and the journal's reason) its session is to be recycled as soon as it is idle: its tree
        is over the session's memory ceiling (``sessions.ceilings``)."""
        self.on_turn_start: Callable[[], None] | None = None
        """Called once a turn's prompt is on its way, so that the install's record of this slot says busy."""

    @property
    def running_turn(self) -> Turn | None:
        """The turn running here, while it runs (not one the proxy has already ended)."""
        turn = self.turn
        return turn if turn is not None and turn.status is TaskStatus.RUNNING else None

    def claim(self) -> None:
        """Taken for a request that opens or restores a session on it."""
        self.claimed = True

    def unclaim(self) -> None:
        """The request it was taken for is answered: it serves the session it opened, or is a spare again."""
        self.claimed = False

    def swallow(self, replay: bool) -> None:
        """Drop its ``session/update``s from now on (the replay of a load the gateway did not ask for), or stop."""
        self.swallow_updates = replay

    def mute(self) -> None:
        """The proxy answered its turn for it: see ``muted``."""
        self.muted = True

    def asked_upstream(self) -> None:
        """It sent the gateway a request."""
        self.upstream_pending += 1

    def answered_upstream(self) -> None:
        """The gateway answered one of its requests."""
        self.upstream_pending -= 1

    def upstream_forgotten(self) -> None:
        """Its requests to the gateway are given up (it has exited)."""
        self.upstream_pending = 0

    def recycle_when_idle(self, why: str, reason: SuspendReason) -> None:
        """Its session is to be recycled as soon as nothing of it runs (see ``recycle``)."""
        self.recycle = (why, reason)

    def begin_turn(self, turn: Turn) -> None:
        """``turn``'s prompt is about to be sent: the turn runs here."""
        self.turn = turn

    def turn_sent(self, turn: Turn) -> None:
        """``turn``'s prompt is on its way: if its turn has not ended meanwhile, say so to the install."""
        if self.turn is turn and self.on_turn_start is not None:
            self.on_turn_start()

    def turn_answered(self, turn: Turn) -> None:
        """``turn`` has its answer: it runs here no more."""
        if self.turn is turn:
            self.turn = None


def busy(adapter: Adapter) -> bool:
    """Not to be taken or suspended: claimed, a request of the gateway's or a request to the gateway
    pending, or it reported background work moments ago."""
    tenancy = adapter.tenancy
    return tenancy.claimed or tenancy.upstream_pending > 0 or adapter.turn_in_flight or adapter.working_in_background


def quiet(adapter: Adapter) -> bool:
    """Nothing of its session runs on it: no request of the gateway's in flight (a turn or any other), none of
    the agent's waiting for the gateway, not claimed. What a handover waits for; unlike ``busy``, background
    work reported after a turn (``quiet_after``) does not count."""
    tenancy = adapter.tenancy
    return not tenancy.claimed and tenancy.upstream_pending == 0 and not adapter.turn_in_flight
