"""Several proxies of one install beside a proxy of another, under rounds of SIGKILLs.

Install A runs ``A_PROXIES`` proxies on one state dir; install B runs one on another.
Every session's adapter grows a tree (a child, a grandchild, and a grandchild that
escaped with ``setsid`` + double fork). Decoys run throughout: a plain process with
the test's marker and no lease, and one dressed in the exact lease marker of one of
B's live leases. Each round SIGKILLs a seeded random choice of A's proxies, some
with their wrappers (so that the orphans are left for the reaper), then starts a
new proxy of A for each on the same state dir, which must reap them at startup
and serve the dead proxy's sessions. After every round:

* no process carries the marker of a lease of a dead A instance, and those leases
  are ``closed`` or ``lost``;
* every process carrying A's markers belongs to an open lease of a live A proxy;
* B's adapters and trees are all alive, its leases open, and the decoys alive.

At the end every proxy is closed normally: no lease is left active in either
install, and (``proc_env``) nothing the test started survives. The seed is printed;
``ACP_PROXY_STRESS_SEED=N`` replays a run's choices.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.abc
import pytest

from tests.kit import markers
from tests.support import RESUME_AND_LOAD, Gateway, pid_alive, survivors, write_config

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

A_PROXIES = 5
SESSIONS_PER_PROXY = 2
ROUNDS = 6
LEASE_VARIABLE = "ACP_PROXY_LEASE"
ACTIVE = ("starting", "open", "closing")
ENDED = ("closed", "lost")


def stress_seed() -> int:
    return int(os.environ.get("ACP_PROXY_STRESS_SEED") or random.SystemRandom().randrange(2**32))


# --- reading an install's state and its processes -------------------------------------------


def query(state_dir: Path, sql: str, *args: object) -> list[sqlite3.Row]:
    conn = sqlite3.connect(f"file:{state_dir / 'state.db'}?mode=ro", uri=True, timeout=10)
    conn.row_factory = sqlite3.Row
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def install_id(state_dir: Path) -> str:
    return str(query(state_dir, "SELECT value FROM meta WHERE key = 'install_id'")[0]["value"])


def instance_of(state_dir: Path, proxy_pid: int) -> str:
    rows = query(state_dir, "SELECT instance_id FROM instances WHERE pid = ? ORDER BY started_at DESC", proxy_pid)
    return str(rows[0]["instance_id"])


def lease_states(state_dir: Path, instance_ids: set[str] | None = None) -> dict[str, str]:
    rows = query(state_dir, "SELECT lease_id, instance_id, state FROM leases")
    return {r["lease_id"]: r["state"] for r in rows if instance_ids is None or r["instance_id"] in instance_ids}


def lease_rows(state_dir: Path, instance_id: str) -> list[sqlite3.Row]:
    return query(state_dir, "SELECT * FROM leases WHERE instance_id = ?", instance_id)


def marked_by_install(install: str) -> dict[int, str]:
    """Live processes carrying a lease marker of ``install``: pid -> lease id."""
    found = markers.find(LEASE_VARIABLE, f"{install}.", prefix=True)
    return {pid: marked.value.removeprefix(f"{install}.").split(".")[0] for pid, marked in found.items()}


# --- proxies, each in its own task so that any of them can end at any time -------------------


@dataclass
class Proxy:
    name: str
    state_dir: Path
    gw: Gateway
    stop: anyio.Event
    ended: anyio.Event
    instance_id: str = ""
    sessions: dict[str, list[int]] = field(default_factory=dict)  # session -> adapter pid, then its tree

    def tree(self) -> list[int]:
        return [pid for pids in self.sessions.values() for pid in pids]


async def serve_proxy(
    env: dict[str, str],
    tmp_path: Path,
    config: Path,
    name: str,
    *,
    task_status: anyio.abc.TaskStatus[Proxy] = anyio.TASK_STATUS_IGNORED,
) -> None:
    stop, ended = anyio.Event(), anyio.Event()
    try:
        async with Gateway.start(env, tmp_path, [], proxy_args=["--config", str(config)], record=False) as gw:
            await gw.initialize()
            state_dir = Path(env["ACP_PROXY_STATE_DIR"])
            proxy = Proxy(name, state_dir, gw, stop, ended, instance_of(state_dir, gw.pid))
            task_status.started(proxy)
            await stop.wait()
    finally:
        ended.set()


async def start_proxy(
    tasks: anyio.abc.TaskGroup, env: dict[str, str], tmp_path: Path, config: Path, name: str
) -> Proxy:
    proxy: Proxy = await tasks.start(serve_proxy, env, tmp_path, config, name)
    return proxy


async def start_together(
    tasks: anyio.abc.TaskGroup, env: dict[str, str], tmp_path: Path, config: Path, names: list[str]
) -> list[Proxy]:
    """Start proxies at the same moment (so that they race to reap the same dead instances)."""
    started: dict[str, Proxy] = {}

    async def one(name: str) -> None:
        started[name] = await start_proxy(tasks, env, tmp_path, config, name)

    async with anyio.create_task_group() as starting:
        for name in names:
            starting.start_soon(one, name)
    return [started[name] for name in names]


async def said(gw: Gateway, session: str, text: str) -> list[str]:
    """Run a turn; the texts the adapter said in it."""
    response = await gw.prompt(session, text)
    assert response["result"]["stopReason"] == "end_turn", response
    texts = [
        m["params"]["update"]["content"]["text"]
        for m in gw.stashed("session/update")
        if m["params"]["sessionId"] == session and m["params"]["update"].get("sessionUpdate") == "agent_message_chunk"
    ]
    gw.clear_stash()
    return texts


async def grow_trees(proxy: Proxy, sessions: int, turns: dict[str, int]) -> None:
    """Open ``sessions`` sessions, each with a child, a grandchild and an escaped grandchild."""
    for _ in range(sessions):
        session = await proxy.gw.new_session()
        texts = await said(proxy.gw, session, "spawn_tree; escape; state")
        escaped = json.loads(texts[-2].removeprefix("escaped "))
        state = json.loads(texts[-1])
        assert len(escaped) == 3, texts
        assert all(pid_alive(p) for p in escaped), texts
        proxy.sessions[session] = [state["pid"], *escaped]
        turns[session] = 1


async def kill_proxy(proxy: Proxy, with_wrappers: bool) -> list[int]:
    """SIGKILL a proxy (and, first, its wrappers: its orphans then wait for the reaper); its tree."""
    tree = proxy.tree()
    if with_wrappers:
        proxy.gw.signal(signal.SIGSTOP)  # so that it cannot clean up after its wrappers
        for row in lease_rows(proxy.state_dir, proxy.instance_id):
            if row["state"] == "open" and row["wrapper_pid"] is not None and pid_alive(row["wrapper_pid"]):
                os.kill(row["wrapper_pid"], signal.SIGKILL)
    proxy.gw.signal(signal.SIGKILL)
    await proxy.gw.process.wait()
    proxy.stop.set()
    await proxy.ended.wait()
    return tree


async def close_proxy(proxy: Proxy) -> None:
    proxy.stop.set()
    await proxy.ended.wait()
    assert proxy.gw.process.returncode == 0, proxy.gw.stderr.decode(errors="replace")[-2000:]


# --- the test -----------------------------------------------------------------------------


@dataclass
class Decoy:
    why: str
    process: subprocess.Popen[bytes]


def start_decoy(env: dict[str, str], why: str, extra: dict[str, str] | None = None) -> Decoy:
    argv = [sys.executable, "-c", "import time; time.sleep(600)"]
    return Decoy(why, subprocess.Popen(argv, env={**env, **(extra or {})}))


def check_other_install(b: Proxy, b_leases: dict[str, str], decoys: list[Decoy], context: str) -> None:
    """No signal ever crosses installs: B's trees, B's leases and the decoys are untouched."""
    assert [p for p in b.tree() if not pid_alive(p)] == [], f"{context}: a process of install B was signalled"
    assert lease_states(b.state_dir) == b_leases, f"{context}: install B's leases changed"
    for decoy in decoys:
        assert decoy.process.poll() is None, f"{context}: the decoy ({decoy.why}) was signalled"


async def test_proxies_of_two_installs_under_rounds_of_sigkills(proc_env: dict[str, str], tmp_path: Path) -> None:
    seed = stress_seed()
    print(f"stress seed: {seed} (ACP_PROXY_STRESS_SEED={seed} replays it)")
    rng = random.Random(seed)
    store = str(tmp_path / "store")
    fake = {"store": store, "caps": RESUME_AND_LOAD}
    # Install A's cap holds across its proxies: room for every session of every proxy of A, so that
    # what a proxy's death leaves behind is its whole set of trees, as when each had its own cap.
    config_a = write_config(tmp_path, pool={"max_live": A_PROXIES * SESSIONS_PER_PROXY}, backends={"fake": fake})
    config_b = write_config(tmp_path, pool={"max_live": 2 * SESSIONS_PER_PROXY}, backends={"fake": fake})
    env_a = proc_env
    env_b = {**proc_env, "ACP_PROXY_STATE_DIR": str(tmp_path / "state-b")}
    dir_a, dir_b = Path(env_a["ACP_PROXY_STATE_DIR"]), Path(env_b["ACP_PROXY_STATE_DIR"])
    decoys: list[Decoy] = []
    turns: dict[str, int] = {}  # session -> turns it has completed
    try:
        async with anyio.create_task_group() as tasks:
            b = await start_proxy(tasks, env_b, tmp_path, config_b, "b")
            await grow_trees(b, SESSIONS_PER_PROXY, turns)
            live: list[Proxy] = []
            for n in range(A_PROXIES):
                live.append(await start_proxy(tasks, env_a, tmp_path, config_a, f"a{n}"))
            async with anyio.create_task_group() as growing:
                for proxy in live:
                    growing.start_soon(grow_trees, proxy, SESSIONS_PER_PROXY, turns)
            install_a, install_b = install_id(dir_a), install_id(dir_b)
            assert install_a != install_b
            b_leases = lease_states(dir_b)
            assert sorted(b_leases.values()) == ["open"] * SESSIONS_PER_PROXY
            b_marker = query(dir_b, "SELECT marker FROM leases WHERE state = 'open' LIMIT 1")[0]["marker"]
            decoys.append(start_decoy(proc_env, "the test's marker, no lease"))
            decoys.append(
                start_decoy(proc_env, "a copy of install B's lease marker", {LEASE_VARIABLE: b_marker.split("=", 1)[1]})
            )
            await anyio.sleep(0.2)  # the decoys have exec'd: their environments are what they carry
            assert marked_by_install(install_b)[decoys[1].process.pid] in b_leases

            kills = 0
            left_for_the_reaper = 0
            for round_ in range(1, ROUNDS + 1):
                victims = rng.sample(live, rng.randint(1, 2))
                dead: dict[str, list[int]] = {}
                orphaned: list[int] = []
                for victim in victims:
                    # The first kill leaves orphans for the reaper, the second does not; then chance decides.
                    with_wrappers = rng.random() < 0.5 if kills > 1 else kills == 0
                    tree = await kill_proxy(victim, with_wrappers)
                    live.remove(victim)
                    dead[victim.instance_id] = tree
                    if with_wrappers:
                        orphaned += tree
                    kills += 1
                context = f"seed {seed}, round {round_}, killed {[v.name for v in victims]}"
                check_other_install(b, b_leases, decoys, context)
                # The live proxies of A leave a dead instance alone: reaping is a starting proxy's job.
                left_for_the_reaper += sum(pid_alive(p) for p in orphaned)
                replacements = await start_together(tasks, env_a, tmp_path, config_a, [f"{v.name}'" for v in victims])
                # Startup reaping ran before each replacement answered initialize.
                dead_leases = lease_states(dir_a, set(dead))
                assert dead_leases, context
                assert all(s in ENDED for s in dead_leases.values()), f"{context}: {dead_leases}"
                trees = [p for tree in dead.values() for p in tree]
                assert await survivors(trees) == [], f"{context}: a dead instance's tree survived its reaping"
                marked = marked_by_install(install_a)
                assert not set(marked.values()) & set(dead_leases), f"{context}: dead leases' processes: {marked}"
                live_instances = {p.instance_id for p in live + replacements}
                open_leases = {k for k, s in lease_states(dir_a, live_instances).items() if s == "open"}
                assert set(marked.values()) <= open_leases, f"{context}: unowned A processes {marked}"
                check_other_install(b, b_leases, decoys, context)
                # A new proxy serves the dead proxies' sessions, with their history, then grows its own trees.
                for replacement, victim in zip(replacements, victims, strict=True):
                    session = next(iter(victim.sessions))  # any dead proxy's session will do
                    state = json.loads((await said(replacement.gw, session, "state"))[-1])
                    assert state["turns"] == turns[session], f"{context}: {state}"
                    turns[session] += 1
                    replacement.sessions[session] = [state["pid"]]
                    await grow_trees(replacement, SESSIONS_PER_PROXY - 1, turns)
                live += replacements
            print(f"{kills} proxies SIGKILLed in {ROUNDS} rounds; {left_for_the_reaper} orphans left for the reaper")
            assert left_for_the_reaper > 0, "the wrappers' deaths left nothing: the reaper was not exercised"

            check_other_install(b, b_leases, decoys, f"seed {seed}, before the normal closes")
            for decoy in decoys:  # B's own close sweeps its markers: the dressed decoy would be fair game
                decoy.process.kill()
                decoy.process.wait()
            for proxy in live:
                await close_proxy(proxy)
            await close_proxy(b)
    finally:
        for decoy in decoys:
            if decoy.process.poll() is None:
                decoy.process.kill()
                decoy.process.wait()
    for state_dir in (dir_a, dir_b):
        left = {k: s for k, s in lease_states(state_dir).items() if s not in ENDED}
        assert left == {}, f"seed {seed}: leases left active in {state_dir.name}"
    assert marked_by_install(install_a) == {}
    assert marked_by_install(install_b) == {}
