"""One pool for the whole install: several proxies of one state dir share the live-process cap.

acpx and openab start one ``acp-proxy`` per session, so these tests run several real
proxies on one state dir (one session each, as they do) with ``max_live`` below the
number of proxies. Live adapters are counted from ``/proc`` throughout, by a sampler
of its own: no count the proxies keep is trusted. The fake adapter keeps its sessions
in a shared store, so an evicted conversation comes back on any process.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from acp_proxy.ownership.leases import all_leases
from acp_proxy.pool.learned import all_peaks
from acp_proxy.pool.memory import ProcMemory
from acp_proxy.sessions.registry import SessionState
from tests.support import (
    GONE_WITHIN,
    MARKER_VARIABLE,
    Gateway,
    adapter_pid,
    cli_json,
    marked_processes,
    pid_alive,
    registry,
    send_prompt,
    state_db,
    state_of,
    wait_for_task,
    write_config,
)

pytestmark = pytest.mark.anyio

SAMPLE_EVERY = 0.01


class LiveAdapters:
    """Samples ``/proc`` for live fake adapters of this test (not their wrappers), keeping the peak, and
    for the memory of the test's adapter trees together (wrappers too: PSS, else RSS), keeping its peak."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.peak = 0
        self.peak_memory = 0
        self.samples = 0
        self._reader = ProcMemory()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> tuple[int, int]:
        """Live fake adapters, and the bytes every adapter tree of the test uses."""
        adapters = memory = 0
        for pid, marked in marked_processes(self.marker).items():
            adapter = any(arg.endswith("fake_adapter.py") for arg in marked.argv)
            wrapper = any(arg.endswith("adapter_wrapper.py") for arg in marked.argv)
            if not (adapter or wrapper):
                continue  # a proxy: not an adapter tree
            adapters += not wrapper
            usage = self._reader.read(pid)
            memory += usage.size if usage is not None else 0
        return adapters, memory

    def _run(self) -> None:
        while not self._stop.is_set():
            adapters, memory = self.sample()
            self.peak = max(self.peak, adapters)
            self.peak_memory = max(self.peak_memory, memory)
            self.samples += 1
            self._stop.wait(SAMPLE_EVERY)

    def __enter__(self) -> LiveAdapters:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def sampling(env: dict[str, str]) -> Iterator[LiveAdapters]:
    with LiveAdapters(env[MARKER_VARIABLE]) as live:
        yield live
    assert live.samples > 0


def install_config(
    tmp_path: Path, pool: dict[str, Any], shutdown: dict[str, str] | None = None, **backend: Any
) -> list[str]:
    backend.setdefault("store", str(tmp_path / "store"))
    config = write_config(tmp_path, pool={"min_idle": "100ms", **pool}, backends={"fake": backend}, shutdown=shutdown)
    return ["--config", str(config)]


@contextlib.asynccontextmanager
async def proxies(env: dict[str, str], tmp_path: Path, count: int, args: list[str]) -> AsyncIterator[list[Gateway]]:
    """``count`` proxies on one state dir, each initialized (as acpx starts one per session)."""
    async with contextlib.AsyncExitStack() as stack:
        gateways = []
        for _ in range(count):
            gw = await stack.enter_async_context(Gateway.start(env, tmp_path, [], proxy_args=args))
            await gw.initialize()
            gateways.append(gw)
        yield gateways


def turn_ok(answer: dict[str, Any]) -> bool:
    return answer.get("result", {}).get("stopReason") == "end_turn"


async def wait_until_gone(pid: int) -> None:
    with anyio.fail_after(10):
        while pid_alive(pid):
            await anyio.sleep(0.02)


async def until_learned(env: dict[str, str], backend: str, size: int) -> None:
    """Until the install has learned that ``backend``'s trees grow to ``size`` bytes or more."""
    db = state_db(env)
    try:
        with anyio.fail_after(10):
            while all_peaks(db.conn).get(backend, 0) < size:
                await anyio.sleep(0.05)
    finally:
        db.close()


async def until_queued(env: dict[str, str], waiters: int) -> None:
    """Until ``waiters`` proxies stand in the install's queue (a ticket is in place only once its lock is held)."""
    queue = Path(env["ACP_PROXY_STATE_DIR"]) / "slots" / "queue"
    with anyio.fail_after(GONE_WITHIN):
        while sum(1 for name in (os.listdir(queue) if queue.exists() else ()) if name.endswith(".ticket")) < waiters:
            await anyio.sleep(0.02)


def reason_of(answer: dict[str, Any]) -> str | None:
    return (answer.get("error", {}).get("data") or {}).get("reason")


async def test_the_cap_holds_across_proxies_and_every_conversation_survives(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """Four proxies, one session each, max_live = 2: never more than 2 adapters, every turn served, history kept."""
    args = install_config(tmp_path, {"max_live": 2, "acquire_timeout": "60s"})
    with sampling(proc_env) as live:
        async with proxies(proc_env, tmp_path, 4, args) as gateways:
            sessions = [await gw.new_session() for gw in gateways]

            async def converse(gw: Gateway, session: str) -> None:
                for _ in range(3):
                    assert turn_ok(await gw.prompt(session, "stream 3")), "a turn failed"

            async with anyio.create_task_group() as tasks:
                for gw, session in zip(gateways, sessions, strict=True):
                    tasks.start_soon(converse, gw, session)
            for gw, session in zip(gateways, sessions, strict=True):
                state = await state_of(gw, session)
                assert state["turns"] == 3  # every turn of its conversation is there, wherever it ran
    assert 1 <= live.peak <= 2, f"{live.peak} adapters were alive at once"


async def test_the_least_recently_used_idle_session_of_the_install_goes_first(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """A third proxy needs a slot: the session idle longest, in another proxy, is suspended; the other stays."""
    args = install_config(tmp_path, {"max_live": 2})
    async with proxies(proc_env, tmp_path, 3, args) as (a, b, c):
        first = await a.new_session()
        second = await b.new_session()
        assert turn_ok(await a.prompt(first, "stream 1"))
        assert turn_ok(await b.prompt(second, "stream 1"))  # now `first` is the least recently used
        first_pid, second_pid = await adapter_pid(a, first), await adapter_pid(b, second)
        await anyio.sleep(0.3)  # both past min_idle
        third = await c.new_session()
        await wait_until_gone(first_pid)
        assert pid_alive(second_pid)
        reg = registry(proc_env)
        assert reg.get(first).state is SessionState.SUSPENDED  # type: ignore[union-attr]
        assert reg.get(second).state is SessionState.LIVE  # type: ignore[union-attr]
        assert reg.get(third).state is SessionState.LIVE  # type: ignore[union-attr]
        state = await state_of(a, first)  # back transparently, on a new process
        assert state["pid"] != first_pid
        assert state["turns"] == 2


async def test_a_busy_session_is_never_taken_and_the_waiter_gets_pool_exhausted(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    args = install_config(tmp_path, {"max_live": 1, "acquire_timeout": "700ms"})
    with sampling(proc_env) as live:
        async with proxies(proc_env, tmp_path, 2, args) as (a, b):
            first = await a.new_session()
            pid = await adapter_pid(a, first)
            turn = await send_prompt(a, first, "sleep 2")
            await anyio.sleep(0.2)
            answer = await b.request("session/new", {"cwd": str(tmp_path), "mcpServers": []})
            assert reason_of(answer) == "pool_exhausted", answer
            assert answer["error"]["data"]["maxLive"] == 1
            assert pid_alive(pid)
            assert turn_ok(await a.response_to(turn))
            second = await b.new_session()  # idle now: it can go
            await wait_until_gone(pid)
            assert registry(proc_env).get(second).state is SessionState.LIVE  # type: ignore[union-attr]
    assert live.peak == 1


async def test_waiters_are_served_first_come_first_served_across_proxies(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    args = install_config(tmp_path, {"max_live": 1, "acquire_timeout": "60s"})
    async with proxies(proc_env, tmp_path, 4, args) as (holder, *waiters):
        session = await holder.new_session()
        turn = await send_prompt(holder, session, "sleep 3")  # busy until the three stand in the queue
        order: list[int] = []

        async def open_session(index: int, gw: Gateway) -> None:
            answer = await gw.request("session/new", {"cwd": str(tmp_path), "mcpServers": []})
            assert "result" in answer, answer
            order.append(index)

        async with anyio.create_task_group() as tasks:
            for index, gw in enumerate(waiters):
                tasks.start_soon(open_session, index, gw)
                await until_queued(proc_env, index + 1)  # arrivals in turn: 0, then 1, then 2
        assert turn_ok(await holder.response_to(turn))
    assert order == [0, 1, 2]


async def test_a_line_of_waiters_drains_without_waiting_out_a_teardown_it_did_not_need(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """Waiters of several proxies that read the same slot records may each be granted the same
    session's suspension; one of them gets its slot. The others plan again as soon as that tree is
    gone, not once the teardown's graces (here 20 s of ``term_grace``) have passed: every session
    opens within ``acquire_timeout``, which is far shorter than those graces."""
    args = install_config(tmp_path, {"max_live": 1, "acquire_timeout": "15s"}, shutdown={"term_grace": "20s"})
    async with proxies(proc_env, tmp_path, 5, args) as (holder, *waiters):
        await holder.new_session()

        async def open_session(gw: Gateway) -> None:
            answer = await gw.request("session/new", {"cwd": str(tmp_path), "mcpServers": []})
            assert "result" in answer, answer

        async with anyio.create_task_group() as tasks:
            for gw in waiters:
                tasks.start_soon(open_session, gw)


async def test_a_proxy_killed_while_holding_a_slot_frees_it_once_its_tree_is_gone(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    args = install_config(tmp_path, {"max_live": 1, "acquire_timeout": "30s"})
    with sampling(proc_env) as live:
        async with proxies(proc_env, tmp_path, 2, args) as (a, b):
            first = await a.new_session()
            pid = await adapter_pid(a, first)
            await send_prompt(a, first, "sleep 30")  # busy: nobody could take it
            a.kill()
            second = await b.new_session()
            assert not pid_alive(pid)  # the slot came free only with the killed proxy's tree gone
            assert turn_ok(await b.prompt(second, "stream 1"))
    assert live.peak == 1


async def test_a_proxy_killed_while_waiting_does_not_hold_up_the_queue(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    args = install_config(tmp_path, {"max_live": 1, "acquire_timeout": "30s"})
    async with proxies(proc_env, tmp_path, 3, args) as (holder, doomed, later):
        session = await holder.new_session()
        turn = await send_prompt(holder, session, "sleep 2")  # busy until the doomed one stands in the queue
        await doomed.send(
            {"jsonrpc": "2.0", "id": 99, "method": "session/new", "params": {"cwd": str(tmp_path), "mcpServers": []}}
        )
        await until_queued(proc_env, 1)  # it stands first in the install's queue
        doomed.kill()
        assert turn_ok(await holder.response_to(turn))
        with anyio.fail_after(15):
            assert "result" in await later.request("session/new", {"cwd": str(tmp_path), "mcpServers": []})


async def test_one_proxy_with_many_sessions_and_others_share_both_caps(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """A proxy multiplexing sessions and a one-session proxy: max_live = 2 overall, and a backend cap of 1."""
    store = str(tmp_path / "store")
    config = write_config(
        tmp_path,
        pool={"max_live": 2, "min_idle": "100ms"},
        backends={"fake": {"store": store}, "capped": {"store": store, "max_live": 1}},
        default_backend="fake",
    )
    args = ["--config", str(config)]
    capped = ["--config", str(config), "--backend", "capped"]
    with sampling(proc_env) as live:
        async with contextlib.AsyncExitStack() as stack:
            many = await stack.enter_async_context(Gateway.start(proc_env, tmp_path, [], proxy_args=args))
            one = await stack.enter_async_context(Gateway.start(proc_env, tmp_path, [], proxy_args=capped))
            other = await stack.enter_async_context(Gateway.start(proc_env, tmp_path, [], proxy_args=capped))
            for gw in (many, one, other):
                await gw.initialize()
            sessions = [await many.new_session() for _ in range(3)]
            lone = await one.new_session()
            for session in sessions:
                assert turn_ok(await many.prompt(session, "stream 1"))
            assert turn_ok(await one.prompt(lone, "stream 1"))
            lone_pid = await adapter_pid(one, lone)
            await anyio.sleep(0.2)
            other_session = await other.new_session()  # backend "capped" allows 1: `lone` goes
            await wait_until_gone(lone_pid)
            assert turn_ok(await other.prompt(other_session, "stream 1"))
            for session in sessions:
                assert (await state_of(many, session))["turns"] == 1
    assert live.peak <= 2


async def test_a_session_active_moments_ago_is_not_taken_while_another_idle_one_exists(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """`first`'s long turn started before `second`'s, but has just ended: `second` is the least recently used."""
    args = install_config(tmp_path, {"max_live": 2, "min_idle": "10s"})
    async with proxies(proc_env, tmp_path, 3, args) as (a, b, c):
        first = await a.new_session()
        second = await b.new_session()
        first_pid, second_pid = await adapter_pid(a, first), await adapter_pid(b, second)
        turn = await send_prompt(a, first, "sleep 1.5")
        await anyio.sleep(0.2)
        assert turn_ok(await b.prompt(second, "stream 1"))
        await anyio.sleep(1)  # `second` has been idle since; nothing opens for a start's time
        assert turn_ok(await a.response_to(turn))
        await c.new_session()
        await wait_until_gone(second_pid)
        assert pid_alive(first_pid)


async def test_status_shows_who_holds_each_slot_of_the_install(proc_env: dict[str, str], tmp_path: Path) -> None:
    args = install_config(tmp_path, {"max_live": 2})
    async with proxies(proc_env, tmp_path, 2, args) as (a, b):
        first = await a.new_session()
        second = await b.new_session()
        await a.prompt(first, "stream 1")
        with anyio.fail_after(10):
            while True:
                report = await cli_json(proc_env, "status", "--json")
                held = {view["sessionId"]: view for view in report["slots"]}
                if set(held) == {first, second}:
                    break
                await anyio.sleep(0.05)
        assert {view["holder"]["instance"] for view in report["slots"]} == {
            entry["instance"] for entry in report["instances"]
        }
        assert all(view["holder"]["alive"] and view["backend"] == "fake" for view in report["slots"])
        assert {view["adapterPid"] for view in report["slots"]} == {
            await adapter_pid(a, first),
            await adapter_pid(b, second),
        }
        assert os.getpid() not in {view["holder"]["pid"] for view in report["slots"]}


# --- the memory budget ---------------------------------------------------------------------------


async def until_state(env: dict[str, str], session: str, state: SessionState, timeout: float = 20) -> None:
    with anyio.fail_after(timeout):
        while (record := registry(env).get(session)) is None or record.state is not state:
            await anyio.sleep(0.05)


async def test_over_the_memory_budget_the_least_recently_used_idle_sessions_are_suspended(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """Adapters holding 150 MB each, a 400 MB budget for the install: two fit, the oldest idle one goes."""
    args = install_config(tmp_path, {"max_live": 10, "max_memory": "400M"}, memory=150)
    async with proxies(proc_env, tmp_path, 3, args) as (a, b, c):
        first = await a.new_session()
        second = await b.new_session()
        assert turn_ok(await a.prompt(first, "stream 1"))
        assert turn_ok(await b.prompt(second, "stream 1"))  # `first` is the least recently used
        await anyio.sleep(2.5)  # both measured, and past min_idle
        third = await c.new_session()
        await until_state(proc_env, first, SessionState.SUSPENDED)
        reg = registry(proc_env)
        assert reg.get(second).state is SessionState.LIVE  # type: ignore[union-attr]
        assert reg.get(third).state is SessionState.LIVE  # type: ignore[union-attr]
        with anyio.fail_after(20):
            while True:  # the figures the proxies measured: the install fits its budget
                slots = (await cli_json(proc_env, "status", "--json"))["slots"]
                if len(slots) == 2 and all(view["memoryBytes"] for view in slots):
                    break
                await anyio.sleep(0.2)
        assert sum(view["memoryBytes"] for view in slots) <= 400 * 2**20
        assert all(view["memoryBytes"] >= 150 * 2**20 for view in slots)
        assert (await state_of(a, first))["turns"] == 1  # back, with its history


async def test_a_busy_session_over_the_memory_budget_is_left_alone(proc_env: dict[str, str], tmp_path: Path) -> None:
    """A 100 MB budget against 150 MB adapters: the busy one serves on; an idle one is suspended."""
    args = install_config(tmp_path, {"max_live": 10, "max_memory": "100M"}, memory=150)
    async with proxies(proc_env, tmp_path, 2, args) as (a, b):
        first = await a.new_session()
        # Busy from here on: idle for a moment (after a turn of its own), it would rightly be suspended.
        turn = await send_prompt(a, first, "sleep 5")
        # Running, not merely sent, before the second start looks.
        await wait_for_task(proc_env, "running", prompt="sleep 5")
        serving = registry(proc_env).get(first)
        assert serving is not None
        [pid] = [lease.adapter_pid for lease in all_leases(state_db(proc_env)) if lease.lease_id == serving.lease_id]
        assert pid is not None
        second = await b.new_session()
        await until_state(proc_env, second, SessionState.SUSPENDED)  # idle, over budget: it goes
        assert pid_alive(pid)
        assert turn_ok(await a.response_to(turn, timeout=15))  # its process served the whole turn


async def test_the_memory_budget_holds_from_the_first_second_while_sessions_are_idle(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """Three one-session proxies, adapters of 80 MB, a budget that fits two: never three trees at once.

    Each proxy launches an adapter as it starts, and each session goes idle after its turn: a
    start counts every live tree of the install, measured there and then, so the third start
    suspends an idle session, and waits for its tree to end, before its own tree exists.
    """
    budget = 230 * 2**20
    args = install_config(tmp_path, {"max_live": 10, "max_memory": "230M"}, memory=80)
    with sampling(proc_env) as live:
        async with proxies(proc_env, tmp_path, 3, args) as gateways:
            sessions = [await gw.new_session() for gw in gateways]
            for _ in range(2):
                for gw, session in zip(gateways, sessions, strict=True):
                    assert turn_ok(await gw.prompt(session, "stream 1"))
            for gw, session in zip(gateways, sessions, strict=True):
                assert (await state_of(gw, session))["turns"] == 2
    assert live.peak == 2, f"{live.peak} adapters were alive at once"
    assert live.peak_memory <= budget, f"the adapter trees used {live.peak_memory / 2**20:.0f} MiB together"


async def test_a_fresh_proxy_counts_a_start_as_large_as_the_install_has_seen_its_backend(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    """Adapters that take their 80 MB a while after they start, a budget that fits one.

    Two fresh proxies start at once, each about to launch an adapter: the second to decide
    measures the first one's tree before it has grown, but counts it as large as the install
    has seen the backend's trees get (learned by a proxy that has exited), and so launches none.
    """
    args = install_config(tmp_path, {"max_live": 10, "max_memory": "150M"}, memory=80, memory_delay=1)
    async with proxies(proc_env, tmp_path, 1, args) as (earlier,):
        session = await earlier.new_session()
        assert turn_ok(await earlier.prompt(session, "stream 1"))
        # Its tree is measured when it answered and every MEMORY_EVERY seconds; a proxy that exits before
        # a measurement after the adapter grew learns nothing of that size. Wait for it (not a sleep):
        # what is under test is what the next proxies do with a peak learned.
        await until_learned(proc_env, "fake", 80 * 2**20)
    with sampling(proc_env) as live:
        async with contextlib.AsyncExitStack() as stack:
            for _ in range(2):  # launched back to back, well within the adapters' memory_delay
                await stack.enter_async_context(Gateway.start(proc_env, tmp_path, [], proxy_args=args))
            await anyio.sleep(2.5)  # past the memory_delay: a second tree would hold its memory by now
    assert live.peak <= 1, f"{live.peak} adapters were alive at once"
    assert live.peak_memory <= 150 * 2**20, f"the adapter trees used {live.peak_memory / 2**20:.0f} MiB together"
