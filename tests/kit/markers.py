"""Live processes whose environment carries a marker: what a test, a soak or a benchmark left running.

Every process a run starts inherits a variable (``ACP_PROXY_TEST_MARKER=<token>``,
a lease's ``ACP_PROXY_LEASE=<install>.<lease>.<random>``), even one that left its
process group, so the environments of ``/proc`` find whatever a run left behind; each process found says which
lease's adapter tree it belongs to, if any (``tests.kit.proctree`` groups them).
Zombies (exited, not yet reaped) do not count. Without ``/proc``, psutil reads the
environments where it can.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import psutil

from acp_proxy.ownership.proctable import TableUnavailable, default_table

PROC = os.path.isdir("/proc/self")
LEASE_VARIABLE = b"ACP_PROXY_LEASE="
_TABLE = default_table()


@dataclass(frozen=True)
class Marked:
    pid: int
    value: str
    """The marker variable's value in the process's environment."""
    argv: tuple[str, ...]
    ticks: int | None
    """Its start time (clock ticks since boot), so that a reused pid is never mistaken for it."""
    lease: str | None = None
    """Its ``ACP_PROXY_LEASE`` value: the adapter tree it belongs to (the wrapper sets it for the tree)."""

    @property
    def command(self) -> str:
        return " ".join(self.argv)

    def __str__(self) -> str:
        return f"pid {self.pid} {self.command[:160]}"


def start_ticks(pid: int) -> int | None:
    """The start time of a live process (not a zombie) in clock ticks, or None if there is none.

    Read through the proxy's own process table (``/proc``, else psutil), so the kit and the
    ownership layer agree on what a process's identity is.
    """
    try:
        info = _TABLE.info(pid)
    except TableUnavailable:
        return None
    return None if info is None or info.zombie else info.start_ticks


def alive(pid: int, ticks: int | None = None) -> bool:
    """Whether ``pid`` runs (and, with ``ticks``, is still the process that started then)."""
    now = start_ticks(pid)
    return now is not None and (ticks is None or now == ticks)


def find(variable: str, value: str, *, prefix: bool = False) -> dict[int, Marked]:
    """Live processes but this one whose ``variable`` is ``value`` (or starts with it, with ``prefix``)."""
    needle = f"{variable}={value}".encode()
    found = {}
    for pid, environ in _environments(needle):
        for entry in environ:
            if entry == needle or (prefix and entry.startswith(needle)):
                lease = next((e[len(LEASE_VARIABLE) :].decode() for e in environ if e.startswith(LEASE_VARIABLE)), None)
                marked = _marked(pid, entry[len(variable) + 1 :].decode(errors="replace"), lease)
                if marked is not None:
                    found[pid] = marked
                break
    return found


def kill(processes: Iterable[Marked]) -> None:
    """SIGKILL each of these that is still the process that was found."""
    for marked in processes:
        if alive(marked.pid, marked.ticks):
            with contextlib.suppress(ProcessLookupError):
                os.kill(marked.pid, signal.SIGKILL)


def _environments(needle: bytes) -> Iterator[tuple[int, list[bytes]]]:
    """(pid, environment entries) of the processes whose environment holds ``needle`` somewhere."""
    me = os.getpid()
    if not PROC:
        for process in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                environ = [f"{k}={v}".encode() for k, v in process.environ().items()]
                if process.pid != me and any(needle in entry for entry in environ):
                    yield process.pid, environ
        return
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                data = fh.read()
        except OSError:
            continue
        if needle in data:
            yield int(name), data.split(b"\0")


def _marked(pid: int, value: str, lease: str | None) -> Marked | None:
    ticks = start_ticks(pid)
    if ticks is None:
        return None
    try:
        if PROC:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                raw = fh.read().rstrip(b"\0")
            argv = tuple(arg.decode(errors="replace") for arg in raw.split(b"\0")) if raw else ()
        else:
            argv = tuple(psutil.Process(pid).cmdline())
    except (OSError, psutil.Error):
        return None
    return Marked(pid, value, argv, ticks, lease)
