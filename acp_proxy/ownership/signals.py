"""Signals to an adapter's process group, sent only while ownership is provable.

An adapter is spawned as the leader of its own session and process group, so
its group id equals its pid, and it carries a random marker in its environment
that every descendant inherits. A group id cannot be given to a new process
while any member of the group is alive, so the group is provably ours while

* its leader is alive: on Linux a pidfd opened right after spawn refers to that
  exact process (a recycled pid can never look alive); elsewhere the pid's
  creation time recorded at spawn must still match; or
* some member of the group still carries our marker and our uid.

Without either proof nothing is sent. A descendant that left the group
(``setsid``) is out of reach here; the lease sweep of the ownership layer
handles those.
"""

from __future__ import annotations

import os
import select
import signal
import sys
from collections.abc import Callable, Iterator

import psutil


def _proc_group_members(pgid: int) -> Iterator[int]:
    """Pids in process group ``pgid``, read from /proc (Linux)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        # Fields after the parenthesised command: state ppid pgrp ...
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            yield int(name)


def _proc_has_marker(pid: int, marker: bytes) -> bool:
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            return False
        with open(f"/proc/{pid}/environ", "rb") as fh:
            return marker in fh.read().split(b"\0")
    except OSError:
        return False


def _psutil_group_members(pgid: int) -> Iterator[int]:
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                yield proc.pid
        except (OSError, psutil.Error):
            continue


def _psutil_has_marker(pid: int, marker: bytes) -> bool:
    key, _, value = marker.decode().partition("=")
    try:
        proc = psutil.Process(pid)
        return proc.uids().real == os.getuid() and proc.environ().get(key) == value
    except psutil.Error:
        return False


if sys.platform == "linux":
    _group_members, _has_marker = _proc_group_members, _proc_has_marker
else:
    _group_members, _has_marker = _psutil_group_members, _psutil_has_marker


class OwnedGroup:
    """The process group of an adapter we spawned with ``start_new_session=True``."""

    def __init__(self, pid: int, marker: str) -> None:
        self.pgid = pid
        self._marker = marker.encode()
        self._pidfd: int | None = None
        self._created: float | None = None
        self._leader_alive: Callable[[], bool] = self._leader_probe()

    def _leader_probe(self) -> Callable[[], bool]:
        if hasattr(os, "pidfd_open"):
            try:
                self._pidfd = os.pidfd_open(self.pgid)
            except OSError:
                return lambda: False  # already reaped
            return self._alive_by_pidfd
        try:
            self._created = psutil.Process(self.pgid).create_time()
        except psutil.Error:
            return lambda: False
        return self._alive_by_create_time

    def _alive_by_pidfd(self) -> bool:
        assert self._pidfd is not None
        readable, _, _ = select.select([self._pidfd], [], [], 0)
        return not readable  # a pidfd polls readable once its process has exited

    def _alive_by_create_time(self) -> bool:
        try:
            proc = psutil.Process(self.pgid)
            return proc.create_time() == self._created and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def marked_members(self) -> list[int]:
        """Live members of the group that carry our marker (the leader included)."""
        return [pid for pid in _group_members(self.pgid) if _has_marker(pid, self._marker)]

    def provably_ours(self) -> bool:
        return self._leader_alive() or bool(self.marked_members())

    def signal(self, sig: signal.Signals) -> bool:
        """Send ``sig`` to the whole group if it is provably ours; report whether it was sent."""
        if not self.provably_ours():
            return False
        try:
            os.killpg(self.pgid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        self._leader_alive = lambda: False
