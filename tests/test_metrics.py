"""``acp-proxy metrics``: the install's figures, parsed back with the Prometheus format's own parser.

The families are checked from hand-made figures (pure), then against real proxies:
what a run did (turns, an eviction for a slot, a resume, a crash, a proxy killed
and its tree reaped by the next one) must show in the counters, and the counters
must not go back when the proxies exit.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from acp_proxy import journal
from acp_proxy.operator.metrics import COUNTED, InstallFigures, exposition
from tests.support import adapter_pid, cli, pid_alive, start, state_db

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample: (name, labels) -> value, through the reference parser (which fails on bad syntax)."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum over every sample of ``name`` whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, found), v in samples.items() if n == name and wanted <= found)


# --- the families, from figures -------------------------------------------------------------


def test_figures_become_gauges_and_counters_that_parse() -> None:
    figures = InstallFigures(
        proxies=3,
        sessions={"live": 2, "suspended": 5},
        live_adapters={"codex": 2},
        memory={"codex": 300 * 2**20},
        rss={"codex": 400 * 2**20},
        active_turns={("codex", "running"): 1},
        waiting={"codex": 1},
        leases={"unverifiable": 1, "closed": 9},
        max_live=2,
        max_memory=2**30,
        counters=(
            journal.Counter("turn_ended", "codex", "done", 40, 0.0),
            journal.Counter("turn_ended", "codex", "lost", 1, 0.0),
            journal.Counter("suspended", "codex", "pool", 7, 0.0),
            journal.Counter("pool_wait", "codex", "admitted", 6, 12.5),
            journal.Counter("resumed", "codex", "session/load", 7, 3.0),
            journal.Counter("tree_reaped", "codex", "startup", 2, 0.0),
            journal.Counter("notify_failed", "codex", "timeout", 1, 0.0),
            journal.Counter("from_a_newer_version", "codex", "x", 1, 0.0),
        ),
    )
    samples = parse(exposition(figures).decode())
    assert value(samples, "acp_proxy_proxies") == 3
    assert value(samples, "acp_proxy_sessions", state="live") == 2
    assert value(samples, "acp_proxy_sessions", state="closed") == 0  # every state, even when none
    assert value(samples, "acp_proxy_live_adapters", backend="codex") == 2
    assert value(samples, "acp_proxy_adapter_memory_bytes", backend="codex") == 300 * 2**20
    assert value(samples, "acp_proxy_adapter_rss_bytes", backend="codex") == 400 * 2**20
    assert value(samples, "acp_proxy_turns_active", backend="codex", status="running") == 1
    assert value(samples, "acp_proxy_pool_waiting", backend="codex") == 1
    assert value(samples, "acp_proxy_leases", state="unverifiable") == 1
    assert value(samples, "acp_proxy_pool_max_live") == 2
    assert value(samples, "acp_proxy_pool_max_memory_bytes") == 2**30
    assert value(samples, "acp_proxy_turns_total", backend="codex", status="done") == 40
    assert value(samples, "acp_proxy_turns_total", backend="codex", status="lost") == 1
    assert value(samples, "acp_proxy_evictions_total", backend="codex", reason="pool") == 7
    assert value(samples, "acp_proxy_pool_waits_total", backend="codex", outcome="admitted") == 6
    assert value(samples, "acp_proxy_pool_wait_seconds_total", backend="codex", outcome="admitted") == 12.5
    assert value(samples, "acp_proxy_resumes_total", backend="codex", method="session/load") == 7
    assert value(samples, "acp_proxy_trees_reaped_total", backend="codex", when="startup") == 2
    assert value(samples, "acp_proxy_notify_failures_total", backend="codex", why="timeout") == 1
    assert not any("newer" in str(key) for key in samples)


def test_every_counted_kind_is_a_family_even_before_it_happens() -> None:
    families = {family.name for family in text_string_to_metric_families(exposition(InstallFigures()).decode())}
    for counted in COUNTED.values():
        assert f"acp_proxy_{counted.metric}" in families
    assert "acp_proxy_pool_max_live" not in families  # unknown without a config or a proxy


# --- a real install ---------------------------------------------------------------------------


async def metrics_of(env: dict[str, str], tmp_path: Path, *args: str, settled: bool = True) -> Samples:
    """The install's figures, through ``--textfile`` and stdout alike.

    ``settled``: no proxy runs, so the two reads show the same samples. While one runs, its timings
    reach the install's totals about once a second, so a series may first appear between the two
    reads: then the two must show the same metrics, and the later read every sample of the earlier."""
    out = tmp_path / "metrics" / "acp_proxy.prom"
    out.parent.mkdir(exist_ok=True)
    code, stdout, err = await cli(env, "metrics", "--textfile", str(out), *args)
    assert (code, stdout, err) == (0, "", "")
    assert [p.name for p in out.parent.iterdir()] == ["acp_proxy.prom"], "no temporary file is left beside it"
    code, printed, err = await cli(env, "metrics", *args)
    assert code == 0, err
    written, shown = parse(out.read_text()), parse(printed)
    if settled:
        assert shown.keys() == written.keys()
    else:
        assert family_names(printed) == family_names(out.read_text())
        assert {key for key in written if key[0].endswith(("_total", "_bucket", "_count", "_sum"))} <= shown.keys()
    return written


def family_names(text: str) -> set[str]:
    return {family.name for family in text_string_to_metric_families(text)}


@pytest.mark.anyio
async def test_a_run_shows_in_the_counters_and_they_never_go_back(proc_env: dict[str, str], tmp_path: Path) -> None:
    async with start(proc_env, tmp_path, pool={"max_live": 1, "min_idle": "0s"}) as gw:
        await gw.initialize()
        first = await gw.new_session()
        assert (await gw.prompt(first, "stream 2"))["result"]["stopReason"] == "end_turn"
        assert "result" in await gw.request("session/set_mode", {"sessionId": first, "modeId": "plan"})
        second = await gw.new_session()  # the only slot: the first session is evicted for it
        assert (await gw.prompt(second, "stream 1"))["result"]["stopReason"] == "end_turn"
        assert (await gw.prompt(first, "stream 1"))["result"]["stopReason"] == "end_turn"  # resumed
        pid = await adapter_pid(gw, first)
        crashed = await gw.prompt(first, "crash 3")
        assert "error" in crashed
        with anyio.fail_after(10):
            while pid_alive(pid):
                await anyio.sleep(0.02)
        assert (await gw.prompt(second, "stream 1"))["result"]["stopReason"] == "end_turn"  # live at shutdown
        during = await metrics_of(proc_env, tmp_path, settled=False)
        assert value(during, "acp_proxy_proxies") == 1
        assert value(during, "acp_proxy_pool_max_live") == 1
        sessions = dict(state_db(proc_env).conn.execute("SELECT state, COUNT(*) FROM sessions GROUP BY state"))
        for state, count in sessions.items():
            assert value(during, "acp_proxy_sessions", state=state) == count
        assert total(during, "acp_proxy_live_adapters") <= 1
    backend = "fake_adapter"  # the ad-hoc backend the test's proxy serves, named after its agent (agent_name)
    assert value(during, "acp_proxy_turns_total", backend=backend, status="done") == 5  # the "state" turn too
    assert value(during, "acp_proxy_turns_total", backend=backend, status="failed") == 1
    assert value(during, "acp_proxy_evictions_total", backend=backend, reason="pool") >= 1
    assert total(during, "acp_proxy_resumes_total", backend=backend) >= 1
    methods = {dict(labels)["method"] for name, labels in during if name == "acp_proxy_resumes_total"}
    assert methods <= {"session/resume", "session/load", "session/new"}, "the method that restored it, not a setting's"
    assert value(during, "acp_proxy_adapter_exits_total", backend=backend, how="exited") == 1
    assert total(during, "acp_proxy_adapters_started_total", backend=backend) >= 3
    assert value(during, "acp_proxy_trees_reaped_total", backend=backend, when="stop") >= 1
    assert total(during, "acp_proxy_pool_waits_total") >= 1
    after = await metrics_of(proc_env, tmp_path)
    assert value(after, "acp_proxy_proxies") == 0
    assert total(after, "acp_proxy_live_adapters") == 0
    assert value(after, "acp_proxy_evictions_total", backend="", reason="shutdown") >= 1
    for key, figure in during.items():
        if key[0].endswith(("_total", "_count", "_sum", "_bucket")):
            assert after.get(key, 0.0) >= figure, f"{key} went back from {figure} after the proxy exited"
    # Where the time went: every turn, start, session/new and restore of the run (all added to the
    # install's totals by the proxy's exit at the latest), in buckets that parse and add up.
    assert value(after, "acp_proxy_turn_seconds_count", backend=backend) == 6
    assert value(after, "acp_proxy_first_update_seconds_count", backend=backend) >= 4  # the streaming ones
    assert value(after, "acp_proxy_session_new_seconds_count", backend=backend) == 2
    starts = total(after, "acp_proxy_adapters_started_total", backend=backend)
    assert value(after, "acp_proxy_start_seconds_count", backend=backend) == starts
    restores = {
        dict(labels)["method"]: figure
        for (name, labels), figure in after.items()
        if name == "acp_proxy_restore_seconds_count"
    }
    assert restores
    assert set(restores) <= {"session/resume", "session/load", "session/new"}
    assert sum(restores.values()) == total(after, "acp_proxy_resumes_total", backend=backend)
    assert total(after, "acp_proxy_slot_wait_seconds_count", backend=backend) >= 1
    for name in ("turn", "start", "session_new"):
        buckets = sorted(
            (float(dict(labels)["le"]), figure)
            for (sample, labels), figure in after.items()
            if sample == f"acp_proxy_{name}_seconds_bucket" and dict(labels)["backend"] == backend
        )
        assert [figure for _, figure in buckets] == sorted(figure for _, figure in buckets), "cumulative"
        assert buckets[-1] == (float("inf"), value(after, f"acp_proxy_{name}_seconds_count", backend=backend))
        assert value(after, f"acp_proxy_{name}_seconds_sum", backend=backend) > 0


@pytest.mark.anyio
async def test_a_killed_proxys_tree_is_counted_when_the_next_one_reaps_it(
    proc_env: dict[str, str], tmp_path: Path
) -> None:
    async with start(proc_env, tmp_path) as gw:
        await gw.initialize()
        session = await gw.new_session()
        await adapter_pid(gw, session)
        gw.process.kill()
        await gw.process.wait()
    async with start(proc_env, tmp_path) as gw:
        await gw.initialize()
        samples = await metrics_of(proc_env, tmp_path, settled=False)
    assert value(samples, "acp_proxy_trees_reaped_total", backend="fake_adapter", when="startup") == 1
    events = [e for e in journal.recent_events(state_db(proc_env).conn) if e.kind == "tree_reaped"]
    assert [e.label for e in events] == ["startup"]


@pytest.mark.anyio
async def test_textfile_errors_are_clear_and_no_state_is_no_figures(proc_env: dict[str, str], tmp_path: Path) -> None:
    code, out, err = await cli(proc_env, "metrics", "--textfile", str(tmp_path / "missing" / "dir" / "x.prom"))
    assert code == 2
    assert "--textfile: cannot write" in err
    assert "Traceback" not in err
    empty = {**proc_env, "ACP_PROXY_STATE_DIR": str(tmp_path / "no-state-yet")}
    code, out, err = await cli(empty, "metrics")
    assert code == 0, err
    assert value(parse(out), "acp_proxy_proxies") == 0
    assert not (tmp_path / "no-state-yet").exists(), "reading metrics creates no state"


def test_the_textfile_is_readable_by_the_exporter(tmp_path: Path) -> None:
    from acp_proxy.operator.metrics import metrics_command

    out = tmp_path / "acp_proxy.prom"
    old = os.umask(0o022)
    try:
        assert metrics_command(tmp_path / "state", None, textfile=str(out)) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) & 0o044 == 0o044, "node_exporter runs as another user"
