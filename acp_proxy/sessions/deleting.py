"""A deleted session deleted on its backend too: ``session/delete`` to the adapter, where it advertises one.

On the session's live process if it has one, else on a spare or a short-lived process of its
backend, within ``resume_timeout``. The proxy's own delete (the tombstone) stands whatever the
backend says: a failure here is logged, never raised.
"""

from __future__ import annotations

import logging

import anyio
from msgspec import UNSET

from acp_proxy.config import Config
from acp_proxy.pool.adapter import Adapter
from acp_proxy.pool.processes import ProcessPool
from acp_proxy.protocol.errors import ProxyError
from acp_proxy.protocol.methods import Method
from acp_proxy.sessions.registry import SessionRecord

log = logging.getLogger("acp_proxy.lifecycle")


class BackendDelete:
    """``session/delete`` on a session's backend, for ``SessionIntents.delete``."""

    def __init__(self, config: Config, pool: ProcessPool) -> None:
        self.config = config
        self.pool = pool

    async def on(self, adapter: Adapter, adapter_session_id: str) -> None:
        """The backend's own ``session/delete``, if it advertises one; a failure is logged, not raised."""
        if not adapter.capabilities.delete:
            return
        try:
            answer = await self.pool.call_answer(adapter, Method.DELETE, {"sessionId": adapter_session_id})
        except ProxyError as exc:
            log.warning("session %s: the backend's session/delete failed: %s", adapter_session_id, exc.message)
            return
        adapter.open_sessions.discard(adapter_session_id)
        if answer.error is not UNSET:
            log.warning("session %s: the backend refused session/delete: %s", adapter_session_id, answer.error.message)

    async def on_a_process_of(self, record: SessionRecord) -> None:
        """Delete a session with no process on its backend: on a spare, else on a short-lived process."""
        backend = self.config.backends.get(record.backend)
        known = self.pool.known_capabilities.get(record.backend)
        if backend is None or (known is not None and not known.delete):
            return
        spare = self.pool.processes.spare(backend)
        try:
            with anyio.fail_after(self.config.pool.resume_timeout):
                adapter = await self.pool.take(backend)
        except (ProxyError, TimeoutError) as exc:
            log.warning(
                "session %s: no %s process to delete it on (%s); deleted here only",
                record.session_id,
                backend.name,
                exc.message if isinstance(exc, ProxyError) else "resume_timeout",
            )
            return
        try:
            await self.on(adapter, record.adapter_session_id)
        finally:
            if adapter is spare:
                adapter.release_to_spare()
            else:
                await self.pool.processes.stop(adapter)
