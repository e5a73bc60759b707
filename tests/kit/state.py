"""Reading and writing a proxy's state database from outside, as the tests and benchmarks check and prepare it."""

from __future__ import annotations

from msgspec.structs import replace

from acp_proxy.ownership.leases import get_lease, spawned
from acp_proxy.state import StateDB


def count_tasks(db: StateDB, since: float | None = None) -> dict[str, int]:
    """How many tasks are in each status (created at or after ``since``, if given)."""
    query, args = "SELECT status, COUNT(*) FROM tasks", []
    if since is not None:
        query += " WHERE created_at >= ?"
        args.append(since)
    return {status: count for status, count in db.conn.execute(query + " GROUP BY status", args)}


def record_spawn(
    db: StateDB,
    lease_id: str,
    *,
    wrapper_pid: int,
    wrapper_start_ticks: int | None,
    adapter_pid: int | None = None,
    adapter_start_ticks: int | None = None,
    pgid: int | None = None,
) -> None:
    """Give a lease the process identities a wrapper would report, as the proxy's own write records them."""
    lease = replace(
        get_lease(db, lease_id),
        wrapper_pid=wrapper_pid,
        wrapper_start_ticks=wrapper_start_ticks,
        adapter_pid=adapter_pid,
        adapter_start_ticks=adapter_start_ticks,
        pgid=pgid,
    )
    db.call(spawned(lease))
