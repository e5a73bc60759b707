"""Samples of the live process trees: the adapter trees of a run, or the tree under one process.

Two ways to find a tree, for the two kinds of run that ask:

* By lease (``adapter_trees``): every live process carrying a run's marker and one lease's
  ``ACP_PROXY_LEASE``, which the wrapper, the adapter and all their descendants inherit, even
  those that left the process group. A tree so counts from its wrapper's exec until its last
  process has ended, which is what the install's cap is about (the soak, the peer checks).
* By parentage (``Descendants``): the live processes under one pid, by depth, with their
  memory: what a benchmark starts under its proxy or under itself.

A read of ``/proc`` is not one instant: a tree that ended while it was read can be counted beside
the one that took its slot. ``alive_together`` looks at each tree found again and keeps only those
with a process still alive: each of those was seen alive in the read and still is, so all were
alive at once, at the moment the read ended. ``Every`` runs a sampler in a thread; a sampler
that fails fails the run, which must not pass on samples it never took.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType

import psutil

from tests.kit import markers


def adapter_trees(variable: str, value: str) -> dict[str, list[markers.Marked]]:
    """The live processes whose ``variable`` is ``value`` and that carry a lease, by lease."""
    return group_by_lease(markers.find(variable, value).values())


def group_by_lease(processes: Iterable[markers.Marked]) -> dict[str, list[markers.Marked]]:
    trees: dict[str, list[markers.Marked]] = {}
    for process in processes:
        if process.lease is not None:
            trees.setdefault(process.lease, []).append(process)
    return trees


def alive_together(trees: Mapping[str, list[markers.Marked]]) -> dict[str, list[markers.Marked]]:
    """The trees that still have a process alive that was found in them (the others ended meanwhile)."""
    return {lease: found for lease, found in trees.items() if any(markers.alive(m.pid, m.ticks) for m in found)}


class Every:
    """Calls ``sample`` every ``seconds`` in a thread of its own, from ``with`` until its end.

    Keeps the slowest call. An exception in ``sample`` stops the sampling and is raised again
    when the block ends (if nothing else is being raised then).
    """

    def __init__(self, seconds: float, sample: Callable[[], object], name: str) -> None:
        self.seconds = seconds
        self._sample = sample
        self.slowest = 0.0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def __enter__(self) -> Every:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None = None,
        exc: BaseException | None = None,
        tb: TracebackType | None = None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        if self.error is not None and exc is None:
            raise SamplerFailed(f"the {self._thread.name} sampler failed: {self.error!r}") from self.error

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.seconds):
                begun = time.monotonic()
                self._sample()
                self.slowest = max(self.slowest, time.monotonic() - begun)
        except Exception as exc:
            self.error = exc


class SamplerFailed(Exception):
    """A sampler's thread raised: the run's figures would rest on samples it never took."""


class Descendants:
    """Every ``seconds``, the live adapters (``depth`` levels under ``root``) and the RSS of its tree; peaks kept.

    ``depth``: 1 for a client's own agents, 2 under a proxy (proxy -> wrapper -> adapter).
    ``count_root``: add the root's own RSS (a proxy's, not a benchmark client's). Zombies
    are neither counted nor measured.
    """

    def __init__(self, root: int, depth: int, *, count_root: bool, seconds: float) -> None:
        self.root, self.depth, self.count_root = root, depth, count_root
        self.peak_adapters = 0
        self.peak_rss = 0
        self.samples = 0
        self._every = Every(seconds, self.sample, "descendants")

    def __enter__(self) -> Descendants:
        self._every.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._every.__exit__(kind, exc, tb)

    def sample(self) -> None:
        try:
            root = psutil.Process(self.root)
            tree = root.children(recursive=True)
            rss = root.memory_info().rss if self.count_root else 0
        except psutil.Error:
            return
        level = {self.root: 0}
        at_depth = 0
        for process in tree:  # psutil lists parents before their children
            with contextlib.suppress(psutil.Error):
                level[process.pid] = level.get(process.ppid(), 0) + 1
                if process.status() == psutil.STATUS_ZOMBIE:
                    continue
                rss += process.memory_info().rss
                at_depth += level[process.pid] == self.depth
        self.peak_adapters = max(self.peak_adapters, at_depth)
        self.peak_rss = max(self.peak_rss, rss)
        self.samples += 1
