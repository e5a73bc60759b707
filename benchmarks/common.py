"""What every benchmark module measures with: paths, the children's environment, what a client sends first,
/proc readings, and the figures made of what was timed (percentiles, rates)."""

from __future__ import annotations

import ctypes
import functools
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import psutil

from tests.kit import markers

ROOT = Path(__file__).resolve().parent.parent
PYCACHE: Path | None = ROOT / "bench-results" / "pycache"
"""Where the processes the benchmarks start keep their bytecode; ``None`` (``--smoke``): beside the sources,
where the tests that run it have compiled them (a fresh prefix would compile the standard library again)."""
STATE = ROOT / "bench-results" / "state"
"""The proxies' state dir where a section does not choose its own: never the user's own."""
BENCH_MARKER = "ACP_PROXY_BENCH"
"""Every process a section starts carries ``ACP_PROXY_BENCH=<token>``; ``leftovers`` finds them."""
INITIALIZE_PARAMS = {
    "protocolVersion": 1,
    "clientCapabilities": {"fs": {"readTextFile": False, "writeTextFile": False}, "terminal": False},
    "clientInfo": {"name": "acp-proxy-bench", "version": "1"},
}
"""What every benchmark's client sends with ``initialize``."""


def script_argv(name: str, *args: str) -> list[str]:
    """The command running the script ``benchmarks/<name>`` (a fake agent, a relay) with this interpreter."""
    return [sys.executable, str(ROOT / "benchmarks" / name), *args]


def proxy_argv(backend: str, *args: str) -> list[str]:
    """The command running the proxy on the event loop ``backend`` (asyncio or trio), with more arguments."""
    return [sys.executable, "-m", "acp_proxy", "--async-backend", backend, *args]


class BenchError(Exception):
    """Something misbehaved (lost or corrupted a message, exited, hung, outlived its run): the run is invalid."""


def child_environment() -> dict[str, str]:
    """Our environment, with bytecode caching on for every spawned interpreter.

    An installed proxy runs from compiled bytecode; with ``PYTHONDONTWRITEBYTECODE``
    set, every start would recompile the project's modules from source and the
    cold start would measure the compiler. The cache lives outside the source tree (``PYCACHE``).
    The proxies keep their state under ``bench-results/`` too, never in the user's state dir.
    """
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if PYCACHE is not None:
        env["PYTHONPYCACHEPREFIX"] = str(PYCACHE)
    env["ACP_PROXY_STATE_DIR"] = str(STATE)
    return env


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process so far, all its threads (``None`` once it is gone).

    Read from the process's CPU-time clock (``clock_getcpuclockid``), to the nanosecond, where the
    C library has it: the clock ticks of ``/proc`` (10 ms) would make the CPU of 200 short turns a
    multiple of 50 us a turn.
    """
    clock = _cpu_clock(pid)
    if clock is not None:
        try:
            return time.clock_gettime(clock)
        except OSError:
            pass  # gone (or never ours to read): as psutil says
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return times.user + times.system


def _cpu_clock(pid: int) -> int | None:
    clock_of = _clock_getcpuclockid()
    if clock_of is None:
        return None
    clock = ctypes.c_int()
    return clock.value if clock_of(pid, ctypes.byref(clock)) == 0 else None


@functools.cache
def _clock_getcpuclockid() -> Callable[..., int] | None:
    """The C library's ``clock_getcpuclockid``, looked up once (``None`` where there is none)."""
    try:
        return ctypes.CDLL(None, use_errno=True).clock_getcpuclockid  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


def run_cpu_seconds() -> float:
    """User + system CPU seconds of this process and of every process it has started and reaped, with
    their reaped descendants (``RUSAGE_CHILDREN``): a difference across a run is the CPU of the whole
    run, the client's own included (a client-side pool's work is in it)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def machine_jiffies() -> tuple[int, int]:
    """The machine's busy and total CPU time so far, in clock ticks summed over its cores (``/proc/stat``)."""
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:9]]  # guest time is in user's already
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields) - idle, sum(fields)


def busy_share(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    """How busy the machine's cores were between two ``machine_jiffies`` (0 to 1)."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else None


def proc_status_kb(pid: int, field_name: str) -> int | None:
    """A ``kB`` field of ``/proc/PID/status`` (``VmHWM`` is the peak RSS)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    index = max(0, min(len(sorted_values) - 1, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]


_SUMMARIES: dict[str, Callable[[list[float]], float]] = {
    "median": statistics.median,
    "mean": statistics.fmean,
    "min": lambda ordered: ordered[0],
    "max": lambda ordered: ordered[-1],
}


def figures(unit: str, values: Iterable[float], *names: str) -> dict[str, float]:
    """The named figures of some samples (at least one), as ``<name>_<unit>``: the columns ``figure_cols`` shows.

    A name is ``pNN`` (the NNth percentile), ``median``, ``mean``, ``min`` or ``max``.
    """
    ordered = sorted(values)
    return {
        f"{name}_{unit}": percentile(ordered, int(name[1:])) if name[0] == "p" else _SUMMARIES[name](ordered)
        for name in names
    }


def ops_row(op: str, label: str, count: int, seconds: float) -> dict[str, Any]:
    """The row of ``count`` operations that took ``seconds`` in all: how many a second, and each one's mean."""
    return {
        "op": op,
        "label": label,
        "ops": count,
        "seconds": seconds,
        "ops_per_s": count / seconds,
        "us_per_op": seconds / count * 1e6,
    }


def leftovers(token: str, wait: float = 5.0) -> list[int]:
    """Processes still carrying this run's marker after up to ``wait`` seconds; they are killed."""
    deadline = time.monotonic() + wait
    while (left := markers.find(BENCH_MARKER, token)) and time.monotonic() < deadline:
        time.sleep(0.05)
    markers.kill(left.values())
    return sorted(left)
