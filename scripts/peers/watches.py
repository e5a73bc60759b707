"""Two threads that watch an install-acpx-* check: the adapter trees alive at once, read from
/proc (``tests.kit.proctree``), and the slots ``acp-proxy status --json`` says are held.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.kit import markers, proctree

from .harness import MARKER_VAR
from .wire import short

TREE_SAMPLE_EVERY = 0.05
SLOT_SAMPLE_EVERY = 1.0


class TreeWatch:
    """Samples /proc in a thread: how many adapter trees of one check are alive at once.

    A tree is every live process carrying the check's marker and one lease's marker
    (``tests.kit.proctree``), so a tree counts from its wrapper's exec until its last
    process has ended. When a pass finds more than one tree, only those still alive at a
    second look count, which proves they were all alive at once. Also counted: the check's
    proxies alive at once.
    """

    def __init__(self, marker: str, every: float = TREE_SAMPLE_EVERY) -> None:
        self.marker = marker
        self.samples = 0
        self.peak = 0
        self.overlaps: list[str] = []
        """What was alive each time more than one tree was (at most a few kept)."""
        self.seen: set[str] = set()
        """Every lease marker seen: one per adapter process started."""
        self.peak_proxies = 0
        self.handovers = 0
        """Passes that found two trees, one of which had ended by the second look (a slot handed over)."""
        self._every = proctree.Every(every, self.sample, "tree-watch")

    @property
    def slowest(self) -> float:
        return self._every.slowest

    def __enter__(self) -> TreeWatch:
        self._every.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._every.__exit__(kind, exc, tb)

    def sample(self) -> None:
        found = markers.find(MARKER_VAR, self.marker)
        trees = proctree.group_by_lease(found.values())
        proxies = sum(1 for marked in found.values() if marked.lease is None and is_proxy(marked.argv))
        self.samples += 1
        self.seen.update(trees)
        self.peak_proxies = max(self.peak_proxies, proxies)
        if len(trees) > 1:
            trees = proctree.alive_together(trees)
            self.handovers += len(trees) <= 1
        self.peak = max(self.peak, len(trees))
        if len(trees) > 1 and len(self.overlaps) < 5:
            self.overlaps.append(
                " | ".join(
                    f"lease {lease.split('.')[1]}: " + ", ".join(str(m) for m in members)
                    for lease, members in trees.items()
                )
            )


def is_proxy(argv: tuple[str, ...]) -> bool:
    """A serving acp-proxy (not one of its operator commands, such as ``status``)."""
    return any(Path(arg).name == "acp-proxy" for arg in argv[:2]) and not {"status", "sessions", "leases"} & set(argv)


class SlotWatch:
    """``acp-proxy status --json`` in a thread, about every second: the install's held slots."""

    def __init__(self, command: list[str], env: dict[str, str], cwd: Path, every: float = SLOT_SAMPLE_EVERY) -> None:
        self.command = command
        self.env = env
        self.cwd = cwd
        self.samples = 0
        self.peak = 0
        self.crowded: list[str] = []
        """The slot lists of samples with more than one slot held (at most a few kept)."""
        self.holders: set[str] = set()
        """Every session seen holding a slot."""
        self.failures: list[str] = []
        self._every = proctree.Every(every, self.sample, "slot-watch")

    def __enter__(self) -> SlotWatch:
        self._every.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._every.__exit__(kind, exc, tb)

    def sample(self) -> list[dict[str, Any]]:
        try:
            done = subprocess.run(
                self.command, capture_output=True, env=self.env, cwd=self.cwd, timeout=30, check=False
            )
            slots = json.loads(done.stdout)["slots"]
        except (subprocess.TimeoutExpired, ValueError, KeyError, TypeError) as exc:
            if len(self.failures) < 5:
                self.failures.append(f"{type(exc).__name__}: {exc}")
            return []
        self.samples += 1
        self.peak = max(self.peak, len(slots))
        self.holders.update(str(view["sessionId"]) for view in slots if view.get("sessionId"))
        if len(slots) > 1 and len(self.crowded) < 5:
            self.crowded.append(short(slots, 600))
        return list(slots)
