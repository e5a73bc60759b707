"""How every connection to the state database is opened, and what is wrong when one cannot be.

``StateError`` is the one error an unusable state dir or database raises: its message says what
to do (``directory.explain_failure`` words it).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

BUSY_TIMEOUT_MS: Final = 10_000


class StateError(Exception):
    """The state dir or database cannot be used; the message says what to do."""


def connect(path: Path, *, check_same_thread: bool = True) -> sqlite3.Connection:
    """A connection with the settings every connection of the proxy uses (autocommit, busy timeout)."""
    conn = sqlite3.connect(
        path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=check_same_thread
    )
    conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    conn.execute("PRAGMA synchronous = NORMAL")
    return conn


def is_locked(exc: sqlite3.OperationalError) -> bool:
    text = str(exc)
    return "locked" in text or "busy" in text


def retry_while_locked(action: Callable[[], object], timeout: float = BUSY_TIMEOUT_MS / 1000) -> None:
    deadline = time.monotonic() + timeout
    delay = 0.002
    while True:
        try:
            action()
            return
        except sqlite3.OperationalError as exc:
            if not is_locked(exc) or time.monotonic() >= deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
