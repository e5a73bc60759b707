"""What the kernel says about a process: identity facts for ownership checks, and who is whose child.

Two implementations, chosen once per platform:

* ``ProcFS`` reads ``/proc`` (Linux). Start time is field 22 of ``/proc/PID/stat``
  in clock ticks since boot; the boot id comes from the kernel. The root is a
  parameter so tests can present a table that is missing or unreadable.
* ``PsutilTable`` is the degraded path for systems without ``/proc`` (macOS):
  start time is psutil's creation time in hundredths of a second, and there is
  no boot id (a stand-in derived from the boot time is used).

A method returns ``None`` only when the process is certainly gone. When the
table itself cannot be read, it raises ``TableUnavailable``: callers must then
treat ownership as unprovable, never as absent.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple, Protocol


class TableUnavailable(Exception):
    """The process table could not be read; ownership can be neither proved nor disproved."""


class ProcessInfo(NamedTuple):
    pid: int
    ppid: int
    pgid: int
    state: str
    start_ticks: int
    uid: int

    @property
    def zombie(self) -> bool:
        return self.state in ("Z", "X", "zombie", "dead")  # /proc letters, psutil names


class ProcessTable(Protocol):
    name: str
    has_pidfd: bool

    def boot_id(self) -> str: ...

    def info(self, pid: int) -> ProcessInfo | None: ...

    def environ_has(self, pid: int, marker: str) -> bool | None:
        """Whether the process environment holds ``marker`` exactly; ``None`` if unreadable."""
        ...

    def pids(self) -> Iterator[int]: ...

    def parents(self) -> dict[int, int]:
        """Every live process's parent pid (pid -> ppid), in one pass: the way to find a tree's
        descendants, including those that left its process group. A process that vanishes or
        cannot be read meanwhile is left out."""
        ...

    def lease_marker(self, pid: int) -> str | None:
        """The process's ``ACP_PROXY_LEASE=...`` environment entry, if it has a readable one."""
        ...


MARKER_PREFIX = b"ACP_PROXY_LEASE="


class ProcFS:
    name = "procfs"

    def __init__(self, root: str | Path = "/proc") -> None:
        self.root = Path(root)
        self.has_pidfd = hasattr(os, "pidfd_open") and str(root) == "/proc"

    def boot_id(self) -> str:
        try:
            return (self.root / "sys/kernel/random/boot_id").read_text().strip()
        except OSError as exc:
            raise TableUnavailable(f"cannot read the boot id: {exc.strerror}") from None

    def info(self, pid: int) -> ProcessInfo | None:
        try:
            raw = (self.root / str(pid) / "stat").read_bytes()
            uid = (self.root / str(pid)).stat().st_uid
        except (FileNotFoundError, ProcessLookupError):
            if not self.root.is_dir():
                raise TableUnavailable(f"{self.root} is not available") from None
            return None
        except OSError as exc:
            raise TableUnavailable(f"cannot read {self.root}/{pid}/stat: {exc.strerror}") from None
        # The command (field 2) may contain spaces and parentheses: split after the last ')'.
        fields = raw[raw.rfind(b")") + 2 :].split()
        try:
            return ProcessInfo(
                pid=pid,
                state=fields[0].decode(),
                ppid=int(fields[1]),
                pgid=int(fields[2]),
                start_ticks=int(fields[19]),
                uid=uid,
            )
        except (IndexError, ValueError):
            raise TableUnavailable(f"unexpected format in {self.root}/{pid}/stat") from None

    def environ_has(self, pid: int, marker: str) -> bool | None:
        try:
            data = (self.root / str(pid) / "environ").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            return False
        except OSError:
            return None
        return marker.encode() in data.split(b"\0")

    def lease_marker(self, pid: int) -> str | None:
        try:
            data = (self.root / str(pid) / "environ").read_bytes()
        except OSError:
            return None
        start = data.find(MARKER_PREFIX)
        if start < 0 or (start > 0 and data[start - 1] != 0):
            return None
        end = data.find(b"\0", start)
        return data[start : end if end >= 0 else len(data)].decode(errors="replace")

    def pids(self) -> Iterator[int]:
        try:
            names = os.listdir(self.root)
        except OSError as exc:
            raise TableUnavailable(f"cannot list {self.root}: {exc.strerror}") from None
        return (int(name) for name in names if name.isdigit())

    def parents(self) -> dict[int, int]:
        # Only the stat file, read with bare os calls: this runs every few seconds (the memory
        # budget), and ``info``'s pathlib reads and stat() would triple its cost.
        parents, root = {}, str(self.root)
        for pid in self.pids():
            try:
                fd = os.open(f"{root}/{pid}/stat", os.O_RDONLY)
                try:
                    raw = os.read(fd, 1024)
                finally:
                    os.close(fd)
                parents[pid] = int(raw[raw.rfind(b")") + 2 :].split(maxsplit=2)[1])
            except (OSError, IndexError, ValueError):
                continue
        return parents


class PsutilTable:
    """psutil is imported on first use: the Linux path never needs it."""

    name = "psutil"
    has_pidfd = False

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil

    def boot_id(self) -> str:
        return f"boot-time-{int(self._psutil.boot_time())}"

    def info(self, pid: int) -> ProcessInfo | None:
        try:
            proc = self._psutil.Process(pid)
            with proc.oneshot():
                return ProcessInfo(
                    pid=pid,
                    ppid=proc.ppid(),
                    pgid=os.getpgid(pid),
                    state=proc.status(),
                    start_ticks=round(proc.create_time() * 100),
                    uid=proc.uids().real,
                )
        except (self._psutil.NoSuchProcess, ProcessLookupError):
            return None
        except (self._psutil.Error, OSError) as exc:
            raise TableUnavailable(f"cannot inspect pid {pid}: {exc}") from None

    def environ_has(self, pid: int, marker: str) -> bool | None:
        key, _, value = marker.partition("=")
        try:
            return self._psutil.Process(pid).environ().get(key) == value
        except self._psutil.NoSuchProcess:
            return False
        except self._psutil.Error:
            return None

    def pids(self) -> Iterator[int]:
        return iter(self._psutil.pids())

    def parents(self) -> dict[int, int]:
        found = self._psutil.process_iter(["ppid"])  # skips the vanished; an unreadable ppid is None
        return {proc.pid: proc.info["ppid"] for proc in found if proc.info["ppid"] is not None}

    def lease_marker(self, pid: int) -> str | None:
        key = MARKER_PREFIX.decode()
        try:
            value = self._psutil.Process(pid).environ().get(key[:-1])
        except self._psutil.Error:
            return None
        return None if value is None else key + value


def default_table() -> ProcessTable:
    if sys.platform == "linux" and os.path.isdir("/proc/self"):
        return ProcFS()
    return PsutilTable()
