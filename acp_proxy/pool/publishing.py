"""Slot records: what a proxy writes into the install's slot files it holds, and how every proxy reads them.

A held slot file says who holds it (``install.SlotRecord``): the holding proxy rewrites it when
that changes (``ProcessPool.publish_slots``), ``acp-proxy status`` shows it, and another proxy's
plan reads it as a ``plan.Slot``. The same process is described here three ways, each built in
one place: as this proxy's plan sees it (``slot_of_adapter``), as it writes it (``record_of``),
and as another proxy reads it back (``slot_of_record``); a start with no process yet is
``starting_record`` / ``starting_slot``.
"""

from __future__ import annotations

import os
import time
from typing import Final

from acp_proxy.config import BackendConfig
from acp_proxy.pool.adapter import Adapter
from acp_proxy.pool.install import Held, HeldSlot, SlotRecord
from acp_proxy.pool.learned import command_of
from acp_proxy.pool.plan import Slot
from acp_proxy.pool.tenancy import busy

WARM_KEY: Final = "spare:warm"
"""The key of the adapter launched with the proxy, before any request took it."""


def slot_key(adapter: Adapter) -> str:
    """The session it serves, or ``spare:<backend>:<pid>``: unique within its proxy."""
    return adapter.gateway_session or f"spare:{adapter.backend.name}:{adapter.pid}"


def _pinned(adapter: Adapter) -> bool:
    """Never suspended by the pool: a session of a backend whose sessions cannot be resumed."""
    return adapter.backend.resume == "never" and adapter.gateway_session is not None


def slot_of_adapter(adapter: Adapter, *, stopping: bool) -> Slot:
    """One of this proxy's processes as its own plans see it (``stopping``: it is being stopped)."""
    return Slot(
        key=slot_key(adapter),
        backend=adapter.backend.name,
        last_active=adapter.usage.last_active,
        busy=busy(adapter),
        spare=adapter.gateway_session is None,
        pinned=_pinned(adapter),
        recent_until=adapter.usage.recent_until,
        stopping=stopping,
        memory=adapter.usage.memory,
        index=adapter.usage.slot.index if adapter.usage.slot is not None else None,
        root=adapter.supervised.process.pid,
        starting=adapter.usage.starting,
        command=adapter.supervised.lease.command_hash,
    )


def record_of(adapter: Adapter, instance_id: str, *, stopping: bool) -> SlotRecord:
    """What this proxy writes into the slot file ``adapter`` holds."""
    return SlotRecord(
        instance=instance_id,
        pid=os.getpid(),
        backend=adapter.backend.name,
        key=slot_key(adapter),
        session=adapter.gateway_session,
        adapter_pid=adapter.pid,
        since=adapter.usage.slot_since,
        last_active=adapter.usage.last_active,
        recent_until=adapter.usage.recent_until,
        busy=busy(adapter),
        pinned=_pinned(adapter),
        stopping=stopping,
        memory=adapter.usage.memory,
        memory_kind=adapter.usage.memory_kind,
        wrapper_pid=adapter.supervised.process.pid,
        command=adapter.supervised.lease.command_hash,
        starting=adapter.usage.starting,
    )


def starting_slot(index: int, backend: str, moment: float, command: str | None = None) -> Slot:
    """A slot taken for a start that has no process yet (``backend`` empty: not described yet)."""
    return Slot(
        key=f"starting:{index}",
        backend=backend,
        last_active=moment,
        busy=True,
        index=index,
        starting=True,
        command=command,
    )


def slot_of_record(held: HeldSlot, moment: float, *, alive: bool = True) -> Slot:
    """Another proxy's slot as its file describes it (``alive``: whether its holder is).

    A slot whose holder is a proxy that is gone is being freed (its wrapper holds it until the
    tree is gone); one not described yet is a start in progress.
    """
    record = held.record
    if record is None:
        return starting_slot(held.index, "", moment)
    return Slot(
        key=record.key,
        backend=record.backend,
        last_active=record.last_active,
        busy=record.busy,
        spare=record.session is None,
        pinned=record.pinned,
        recent_until=record.recent_until,
        stopping=record.stopping or not alive,
        instance=record.instance,
        memory=record.memory,
        index=held.index,
        root=record.wrapper_pid,
        starting=record.starting,
        command=record.command,
    )


def starting_record(instance_id: str, backend: BackendConfig, held: Held) -> SlotRecord:
    """A slot taken for a start that has no process yet: counted as its backend's largest tree."""
    return SlotRecord(
        instance=instance_id,
        pid=os.getpid(),
        backend=backend.name,
        key=f"starting:{held.index}",
        since=time.time(),
        busy=True,
        command=command_of(backend),
        starting=True,
    )
