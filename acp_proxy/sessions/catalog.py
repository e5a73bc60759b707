"""``session/list``: the registry's rows (suspended and closed sessions included), filtered by who asks,
with the titles the backends' own lists report (``sessions.listing`` decides what to take of them); and the
unstable ``session/status``, from the same rows."""

from __future__ import annotations

from typing import Any, Final

import anyio
import msgspec
from msgspec import UNSET

from acp_proxy.config import Config
from acp_proxy.pool.adapter import Adapter
from acp_proxy.pool.processes import ProcessPool
from acp_proxy.protocol import jsonrpc
from acp_proxy.protocol.errors import ProxyError
from acp_proxy.protocol.jsonrpc import Message
from acp_proxy.protocol.methods import Method
from acp_proxy.sessions.decisions import session_status, status_needs_row, visibility_row
from acp_proxy.sessions.listing import session_info, title_changes, titles_listed
from acp_proxy.sessions.machine import Standing
from acp_proxy.sessions.registry import LIST_PAGE_SIZE, SessionRecord, SessionRegistry, decode_cursor, encode_cursor
from acp_proxy.sessions.restore import GatewayPort
from acp_proxy.sessions.visibility import parse_requester, visible_rows

LIST_TIMEOUT: Final = 2.0
"""How long ``session/list`` waits for the backends' own lists (their titles) before answering without them."""
LISTED_PAGES: Final = 10
"""Pages of a backend's own list read at most, per working directory."""


class SessionCatalog:
    """Answers ``session/list`` and ``session/status`` for the gateway."""

    def __init__(self, config: Config, registry: SessionRegistry, pool: ProcessPool, gateway: GatewayPort) -> None:
        self.config = config
        self.registry = registry
        self.pool = pool
        self.gateway = gateway

    async def list_sessions(self, msg: Message) -> None:
        """``session/list`` from the registry: suspended sessions included, filtered by who asks."""
        params = jsonrpc.decode_object(msg.params) or {}
        try:
            requester = parse_requester(params.get("_meta"))
            cursor = params.get("cursor")
            after = decode_cursor(cursor) if isinstance(cursor, str) else None
        except ValueError as exc:
            await self.gateway.fail(msg.id, ProxyError.invalid_params(str(exc)))
            return
        cwd = params.get("cwd") if isinstance(params.get("cwd"), str) else None
        await self.registry.caught_up()  # the list shows what this proxy has just written
        if requester is None:  # the page and one more row (is there a next page?), not every row
            records = self.registry.page(cwd=cwd, cursor=after, limit=LIST_PAGE_SIZE + 1)
        else:  # who may see a session follows its lineage, which only the whole set shows
            records = self.registry.page(cwd=cwd, limit=None)
            visible = {row.session_id for row in visible_rows([visibility_row(r) for r in records], requester)}
            records = [r for r in records if r.session_id in visible]
            if after is not None:
                records = [r for r in records if (r.created_at, r.session_id) > (after.created_at, after.session_id)]
        page = await self._with_adapter_titles(records[:LIST_PAGE_SIZE])
        result: dict[str, Any] = {"sessions": [session_info(r) for r in page]}
        if len(records) > len(page):
            result["nextCursor"] = encode_cursor(page[-1])
        await self.gateway.answer(msg.id, result)

    async def status(self, msg: Message, session_id: str, standing: Standing | None) -> None:
        """``session/status`` (unstable ACP): ``open`` or ``saved`` from this proxy's view of the session
        (``standing``) and the install's row, ``-32002`` for one it does not know. Nothing is started,
        restored, attached or touched: a routing layer may ask as often as it likes."""
        row = None
        if status_needs_row(standing):
            await self.registry.caught_up()
            row = await self.registry.state_of(session_id)
        status = session_status(standing, row)
        if status is None:
            await self.gateway.fail(msg.id, ProxyError.unknown_session(session_id))
        else:
            await self.gateway.answer(msg.id, {"status": status})

    async def _with_adapter_titles(self, page: list[SessionRecord]) -> list[SessionRecord]:
        """``page`` with the titles the backends' own lists report (kept in the registry too).

        One live process of each backend on the page that serves ``session/list`` is asked, once per
        working directory, within ``LIST_TIMEOUT``; a backend that fails or is slow is left out.
        """
        listed: dict[str, dict[str, dict[str, str]]] = {}

        async def ask(adapter: Adapter, cwd: str) -> None:
            cursor: object = None
            for _ in range(LISTED_PAGES):
                params: dict[str, Any] = {"cwd": cwd} if cursor is None else {"cwd": cwd, "cursor": cursor}
                try:
                    answer = await self.pool.call_answer(adapter, Method.LIST, params)
                except ProxyError:
                    return
                result = jsonrpc.decode_object(answer.result) if answer.error is UNSET else None
                if result is None:
                    return
                sessions = result.get("sessions")
                listed.setdefault(adapter.backend.name, {}).update(titles_listed(sessions or ()))
                cursor = result.get("nextCursor")
                if not isinstance(cursor, str) or not cursor:
                    return

        with anyio.move_on_after(LIST_TIMEOUT):
            async with anyio.create_task_group() as group:
                for backend, cwd in sorted({(record.backend, record.cwd) for record in page}):
                    adapter = self._lister(backend)
                    if adapter is not None:
                        group.start_soon(ask, adapter, cwd)
        merged = []
        for record in page:
            changes = title_changes(record, listed.get(record.backend, {}))
            if changes:
                self.registry.record_title(record.session_id, changes)
                record = msgspec.structs.replace(
                    record,
                    title=changes.get("title", record.title),
                    title_updated_at=changes.get("updatedAt", record.title_updated_at),
                )
            merged.append(record)
        return merged

    def _lister(self, backend_name: str) -> Adapter | None:
        """A live process of the backend that serves ``session/list``, if this proxy has one."""
        backend = self.config.backends.get(backend_name)
        if backend is None:
            return None
        return next((adapter for adapter in self.pool.processes.serving(backend) if adapter.capabilities.list), None)
