"""The state dir's checks: made private (``0700``), refused when others can write it, and what a failure means."""

from __future__ import annotations

import os
import sqlite3
import stat
from pathlib import Path
from typing import Final

from acp_proxy.state.connection import StateError

ELSEWHERE: Final = "or point $ACP_PROXY_STATE_DIR (or state_dir in the config) at a directory of your own"


def ensure_private_dir(path: Path) -> None:
    """Create ``path`` (0700) if missing; refuse one that others could write to."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise StateError(f"cannot create {path}: {exc.strerror}; create it yourself (mode 700), {ELSEWHERE}") from None
    check_private_dir(path)


def check_private_dir(path: Path) -> None:
    """Refuse a directory of another user's, or one that others could write to: its contents decide what we signal."""
    info = path.stat()
    if info.st_uid != os.getuid():
        raise StateError(
            f"{path} belongs to uid {info.st_uid}, not to you (uid {os.getuid()}); refusing to use it: {ELSEWHERE}"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise StateError(f"{path} is writable by other users; run: chmod 700 {path}")


def explain_failure(path: Path, exc: sqlite3.Error) -> str:
    """What went wrong with the state database at ``path``, and what to do about it, for people."""
    directory = path.parent
    if not isinstance(exc, sqlite3.OperationalError):
        return f"{path} is not a usable state database ({exc}); move it aside to start afresh (mv {path} {path}.broken)"
    if "full" in str(exc):
        return f"cannot write {path}: {exc}; free some space on the disk holding {directory}"
    for target in (path, directory):
        try:
            info = target.stat()
        except OSError:
            continue
        if info.st_uid != os.getuid():
            return f"cannot use {path} ({exc}): {target} belongs to uid {info.st_uid}, not to you; {ELSEWHERE}"
    beside = "(SQLite writes beside the database)"
    if _read_only_mount(directory):
        return (
            f"cannot use {path} ({exc}): the state dir {directory} is on a read-only file system {beside}; "
            f"mount it read-write, {ELSEWHERE.removeprefix('or ')}"
        )
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        return f"cannot use {path} ({exc}): you may not read and write it; run: chmod 600 {path}"
    if not os.access(directory, os.W_OK | os.X_OK):
        return (
            f"cannot use {path} ({exc}): the state dir {directory} is not writable {beside}; "
            f"run: chmod 700 {directory}, {ELSEWHERE}"
        )
    return f"cannot use {path}: {exc}"


def _read_only_mount(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False
