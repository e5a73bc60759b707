"""What service managers do to a whole process tree, done to a gateway's proxy and everything under it.

systemd stops a unit by sending SIGTERM to every process of its cgroup at once
(``KillMode=control-group``), and ``systemctl kill -s KILL`` or the OOM killer ends them
all with SIGKILL; Kubernetes and Docker end a container's processes together too. The
proxy, its wrappers, the adapters, their children and an escaped grandchild all get
the signal at the same moment: nothing may survive, nothing recorded may be lost or
left open, and the next proxy on the same state dir resumes the session with its history.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import anyio
import pytest

from acp_proxy.sessions.registry import SessionState
from acp_proxy.tasks.records import get_task
from tests.support import (
    MARKER_VARIABLE,
    Gateway,
    marked_processes,
    registry,
    send_prompt,
    start,
    state_db,
    state_of,
    wait_for_task,
)

pytestmark = pytest.mark.anyio


def signal_every_marked_process(env: dict[str, str], sig: signal.Signals) -> int:
    """As a cgroup-wide kill does: one signal to every process of the test, all at once."""
    pids = list(marked_processes(env[MARKER_VARIABLE]))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return len(pids)


async def busy_proxy(gw: Gateway) -> tuple[str, int]:
    """A session with two completed turns, a child tree and an escaped grandchild, and a turn in flight."""
    await gw.initialize()
    session = await gw.new_session()
    assert (await gw.prompt(session, "stream 3"))["result"]["stopReason"] == "end_turn"
    assert (await gw.prompt(session, "spawn_tree; escape"))["result"]["stopReason"] == "end_turn"
    request_id = await send_prompt(gw, session, "wait_cancel")
    return session, request_id


async def test_sigterm_to_the_whole_tree_at_once_is_a_clean_stop(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with start(proc_env, tmp_path, forked=False) as gw:  # found by its marker, as a service manager finds it
        session, request_id = await busy_proxy(gw)
        running = await wait_for_task(proc_env, "running", prompt="wait_cancel")
        # The proxy, wrapper, adapter, child, grandchild and the escapee: all at once.
        assert signal_every_marked_process(proc_env, signal.SIGTERM) >= 6
        answer = await gw.response_to(request_id)
        assert "error" in answer or answer["result"]["stopReason"] == "cancelled", answer
        with anyio.fail_after(15):
            assert await gw.process.wait() == 0
        with anyio.fail_after(10):
            while marked_processes(proc_env[MARKER_VARIABLE]):
                await anyio.sleep(0.05)
    db = state_db(proc_env)
    task = get_task(db, running["taskId"])
    assert task is not None
    assert task.status.value in ("cancelled", "failed"), "recorded by the proxy itself, not left for a sweep"
    leases = dict(db.conn.execute("SELECT state, count(*) FROM leases GROUP BY state").fetchall())
    assert set(leases) == {"closed"}, leases
    assert registry(proc_env).get(session).state is SessionState.SUSPENDED  # type: ignore[union-attr]
    async with start(proc_env, tmp_path) as gw:
        await gw.initialize()
        known = await state_of(gw, session)
        assert known["turns"] == 2, "the turn in flight never completed; the two before it are kept"
        assert known["history"] >= 5, "their updates are kept (and what the cut turn streamed)"


async def test_sigkill_to_the_whole_tree_at_once_is_recovered_by_the_next_start(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with start(proc_env, tmp_path, forked=False) as gw:  # found by its marker, as a service manager finds it
        session, _request_id = await busy_proxy(gw)
        running = await wait_for_task(proc_env, "running", prompt="wait_cancel")
        assert signal_every_marked_process(proc_env, signal.SIGKILL) >= 6
        with anyio.fail_after(10):
            assert await gw.process.wait() == -signal.SIGKILL
    killed_leases = [row[0] for row in state_db(proc_env).conn.execute("SELECT lease_id FROM leases")]
    assert killed_leases
    async with start(proc_env, tmp_path) as gw:
        await gw.initialize()
        db = state_db(proc_env)
        task = get_task(db, running["taskId"])
        assert task is not None
        assert task.status.value == "lost"
        query = f"SELECT state FROM leases WHERE lease_id IN ({','.join('?' * len(killed_leases))})"
        states = [row[0] for row in db.conn.execute(query, killed_leases)]
        assert set(states) <= {"closed", "lost"}, "the dead instance's leases are settled by the next start"
        known = await state_of(gw, session)
        assert known["turns"] == 2
        assert known["history"] >= 5
