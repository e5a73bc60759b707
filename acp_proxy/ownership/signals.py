"""Signals to an adapter's process group, sent only while ownership is provable.

An adapter is spawned as the leader of its own session and process group, so its
group id equals its pid. While the leader is alive that id cannot be handed to
another process, which pins the group to ours. Liveness is proved per platform:

* Linux: a pidfd opened right after spawn. It refers to that exact process, so a
  recycled pid can never make it look alive.
* elsewhere: the pid's creation time, recorded at spawn, must still match.

Once the leader is gone the group is no longer pinned and nothing is sent; a
leftover descendant is then the business of the lease sweep, not of a bare
``killpg`` on a number that may already mean someone else.
"""

from __future__ import annotations

import os
import select
import signal
from collections.abc import Callable

import psutil


class OwnedGroup:
    """The process group led by a child we spawned with ``start_new_session=True``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._pidfd: int | None = None
        self._created: float | None = None
        self._alive: Callable[[], bool] = self._probe_factory()

    def _probe_factory(self) -> Callable[[], bool]:
        if hasattr(os, "pidfd_open"):
            try:
                self._pidfd = os.pidfd_open(self.pid)
            except OSError:
                return lambda: False  # already reaped: nothing is provably ours
            return self._alive_by_pidfd
        try:
            self._created = psutil.Process(self.pid).create_time()
        except psutil.Error:
            return lambda: False
        return self._alive_by_create_time

    def _alive_by_pidfd(self) -> bool:
        assert self._pidfd is not None
        readable, _, _ = select.select([self._pidfd], [], [], 0)
        return not readable  # a pidfd polls readable once its process has exited

    def _alive_by_create_time(self) -> bool:
        try:
            proc = psutil.Process(self.pid)
            return proc.create_time() == self._created and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def leader_alive(self) -> bool:
        return self._alive()

    def signal(self, sig: signal.Signals) -> bool:
        """Send ``sig`` to the whole group if its leader is provably ours; report whether sent."""
        if not self._alive():
            return False
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        self._alive = lambda: False
