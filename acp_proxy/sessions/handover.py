"""Handing a session between two proxies of one install: the install holds a session, not a process.

At most one proxy of an install serves a session at a time (its holder, as the session's row says).
Another proxy asked for it (the gateway's load or resume there, or a request that needs a process)
takes it over: it asks the holder over its control socket (``Holders.release``); the holder lets it go
once nothing of it runs (the turn under way ends undisturbed), stops its process, writes the row
suspended under the asker and answers; the asker then restores it as any suspended session. A holder
whose turn runs past ``[sessions] handover_timeout`` keeps the session, and the asker answers
``session_busy``.

The session machine decides each step (``Release``, ``Event.QUIET``, ``Event.RELEASE_EXPIRED`` on the
holder's side; ``Event.TAKE_OVER``, ``Event.RELEASED``, ``HeldBy(Event.KEPT)`` on the asker's); this
module carries them out. The release runs from the session's queue, so a restore, close or delete
before it finishes first and requests after it wait for it (and are answered ``session_moved`` once the
session is gone, if this proxy's gateway knew it here).
"""

from __future__ import annotations

import enum
import logging
import time
from typing import Final, Protocol

import anyio

from acp_proxy.config import Config
from acp_proxy.journal import Kind
from acp_proxy.logs import ids
from acp_proxy.pool.processes import ProcessPool
from acp_proxy.pool.tenancy import quiet
from acp_proxy.protocol.errors import ProxyError
from acp_proxy.sessions.lifecycle import Action, Event, Phase
from acp_proxy.sessions.machine import HeldBy, Release, Work
from acp_proxy.sessions.registry import SessionRegistry
from acp_proxy.sessions.table import Moved, Session, SessionTable

log = logging.getLogger("acp_proxy.lifecycle")

STOPPING_POLL: Final = 0.05
"""How often an asker looks whether a holder that is shutting down has let the session go."""


class Answer(enum.StrEnum):
    """What the holder of a session said when asked to release it."""

    RELEASED = "released"
    """It is the asker's now (or the holder did not hold it any more)."""
    KEPT = "kept"
    """A turn ran there past the asker's ``handover_timeout``."""
    UNANSWERED = "unanswered"
    """Its control socket did not answer (gone, or not listening)."""
    STOPPING = "stopping"
    """It is shutting down: its sessions are suspended within its shutdown, then free."""


class Holders(Protocol):
    """The other proxies of the install, as a handover asks them (``operator.operations.InstallPeers``)."""

    async def release(self, instance_id: str, session_id: str, to: str, timeout: float) -> Answer:
        """Ask proxy ``instance_id`` to release ``session_id`` to proxy ``to`` within ``timeout`` seconds."""
        ...


class Handover:
    """Both sides of a handover: releasing a session this proxy holds, taking over one another proxy holds."""

    def __init__(
        self, config: Config, registry: SessionRegistry, table: SessionTable, pool: ProcessPool, holders: Holders | None
    ) -> None:
        self.config = config
        self.registry = registry
        self.table = table
        self.pool = pool
        self.holders = holders

    # --- the holder's side -------------------------------------------------------------------

    async def release(self, session_id: str, to: str, timeout: float) -> bool:
        """Another proxy (``to``) asks for ``session_id``: True once it is that proxy's (or nothing of it is
        held here), False if a turn still ran here after ``timeout`` seconds (it stays here)."""
        session = self.table.get(session_id)
        if session is None:
            return True
        deadline = time.monotonic() + timeout
        done = anyio.Event()
        outcome: list[bool] = []

        async def work() -> None:
            try:
                outcome.append(await self._release(session, to, deadline))
            finally:
                done.set()

        self.table.enqueue(session, Work.RELEASE, work)
        with anyio.move_on_after(timeout + self._stop_budget()):
            await done.wait()
        return bool(outcome and outcome[0])

    async def _release(self, session: Session, to: str, deadline: float) -> bool:
        if time.monotonic() >= deadline:  # what was queued before it ran past the asker's patience
            return False
        if not self.table.accepts(session, Release(to)):
            return session.phase is Phase.ELSEWHERE or session.forgotten.is_set()
        moved = self.table.advance(session, Release(to))
        if session.phase is Phase.RELEASING:
            adapter = session.live_adapter
            if adapter is not None:  # the turn under way (or any request either way) ends undisturbed
                with anyio.move_on_after(deadline - time.monotonic()):
                    await adapter.answered.until(lambda: adapter.gone or quiet(adapter))
                if session.phase is Phase.RELEASING and not adapter.gone and not quiet(adapter):
                    self.table.advance(session, Event.RELEASE_EXPIRED)
                    self._journal(session, "kept", to, None, f"a turn still ran here when proxy {to} gave up")
                    log.info(
                        "session %s: kept: a turn still runs here, past proxy %s's handover_timeout",
                        session.session_id,
                        to,
                        extra=ids(session=session.session_id),
                    )
                    return False
            if session.phase is Phase.RELEASING:  # else its process ended meanwhile (``process_ended``)
                moved = self.table.advance(session, Event.QUIET)
        if session.phase is not Phase.ELSEWHERE:  # closed or deleted meanwhile: the asker reads its row
            return True
        self.handed(session, moved, to)  # nothing left to do if ``process_ended`` did it
        if session.stopping is not None:  # its process must be gone before the asker starts another
            with anyio.move_on_after(self._stop_budget()):
                await session.stopping.wait()
        await self.registry.caught_up()  # the asker claims the row it is told of
        return True

    def handed(self, session: Session, moved: Moved, to: str) -> None:
        """Carry out the effects of a step that handed the session to ``to`` (a release, or its process's end
        while it was being released); what is left is answering the asker (``ANSWER_RELEASED``)."""
        if Action.WRITE_HANDED in moved.effects:
            self.registry.hand_over(session.session_id, to)
        if moved.released is not None:
            self.table.stopping(session, self.pool.processes.stop_in_background(moved.released))
        if Action.JOURNAL in moved.effects:
            self._journal(session, "released", to, None, f"to proxy {to}")
            log.info(
                "session %s: handed over to proxy %s", session.session_id, to, extra=ids(session=session.session_id)
            )

    def _stop_budget(self) -> float:
        """How long a released session's process may take to be gone before the asker is answered anyway (its
        tree is reaped by its lease either way)."""
        return self.config.shutdown.gone_within

    # --- the asker's side --------------------------------------------------------------------

    async def take_over(self, session: Session) -> None:
        """Have the session's holder release it to this proxy: on return it is suspended here, ready to restore.

        Raises ``session_busy`` if its holder's turn ran past ``handover_timeout``, ``session_in_use`` if its
        holder could not be asked and still holds it.
        """
        holder = session.state.holder
        self.table.advance(session, Event.TAKE_OVER)
        timeout = self.config.sessions.handover_timeout
        started = time.monotonic()
        answer = Answer.UNANSWERED
        if holder is not None and self.holders is not None:
            answer = await self.holders.release(holder, session.session_id, self.registry.instance_id, timeout)
        if answer is Answer.STOPPING:  # a proxy shutting down suspends its sessions within its graces
            with anyio.move_on_after(max(0.0, timeout - (time.monotonic() - started))):
                while await self.registry.held_by_another(session.session_id) == holder:
                    await anyio.sleep(STOPPING_POLL)  # another process's shutdown: its row is all there is to watch
        still = None if answer is Answer.RELEASED else await self.registry.held_by_another(session.session_id)
        if still is None:
            self.table.advance(session, Event.RELEASED)
            self.table.refresh(session, await self.registry.current(session.session_id) or session.record)
            self._journal(session, "taken", holder, started, f"from proxy {holder}")
            log.info(
                "session %s: taken over from proxy %s in %.0f ms",
                session.session_id,
                holder,
                (time.monotonic() - started) * 1000,
                extra=ids(session=session.session_id),
            )
            return
        self.table.advance(session, HeldBy(Event.KEPT, still))
        self._journal(session, answer.value, still, started, f"proxy {still} kept it")
        if answer is Answer.KEPT:
            raise ProxyError.session_busy(session.session_id, holder=still, waited=timeout)
        raise ProxyError.session_in_use(session.session_id, still)

    def _journal(self, session: Session, outcome: str, other: str | None, since: float | None, detail: str) -> None:
        seconds = time.monotonic() - since if since is not None else 0.0
        self.pool.journal.record(
            Kind.HANDOVER,
            backend=session.record.backend,
            label=outcome,
            session_id=session.session_id,
            seconds=seconds,
            detail=detail if other is not None else "from no reachable proxy",
        )
