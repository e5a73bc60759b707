"""What ``acp-proxy status`` and ``metrics`` know of the running ``serve`` processes of an install.

Each ``serve`` keeps ``serve/<pid>.json`` in the state dir up to date (its addresses, its
connections, what it refused); a file whose process is gone, or is another process now, is
not reported.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

import anyio

from acp_proxy.ownership.verify import process_table
from acp_proxy.remote.hub import Hub


class StatusFile:
    """``serve/<pid>.json`` in the state dir: what ``acp-proxy status`` shows of this server."""

    def __init__(self, state_dir: Path, hub: Hub, addresses: Sequence[str]) -> None:
        self.path = state_dir / "serve" / f"{os.getpid()}.json"
        self.hub = hub
        self.addresses = list(addresses)
        self.started_at = time.time()
        self.start_ticks = _start_ticks(os.getpid())
        self._changed = anyio.Event()

    def changed(self) -> None:
        self._changed.set()

    async def keep(self) -> None:
        self.path.parent.mkdir(mode=0o700, exist_ok=True)
        while True:
            self._write()
            await self._changed.wait()
            self._changed = anyio.Event()
            await anyio.sleep(0.5)  # a burst of connections is one write

    def _write(self) -> None:
        hub = self.hub
        state = {
            "pid": os.getpid(),
            "startTicks": self.start_ticks,
            "startedAt": self.started_at,
            "addresses": self.addresses,
            "connections": [c.describe() for c in hub.connections.values()],
            "refused": hub.refused,
            "slowReaders": hub.slow_readers,
            "failedAuth": hub.failed_auth,
        }
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(state))
        os.replace(temporary, self.path)

    def remove(self) -> None:
        with suppress(OSError):
            self.path.unlink()


def _start_ticks(pid: int) -> int | None:
    """When ``pid`` started, as the ownership checks read it: with the pid, it names one process."""
    info = process_table().info(pid) if pid > 0 else None
    return info.start_ticks if info is not None and not info.zombie else None


def running_servers(state_dir: Path) -> list[dict[str, Any]]:
    """The live ``serve`` processes of the install, as they last described themselves."""
    found = []
    for path in sorted((state_dir / "serve").glob("*.json")):
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _start_ticks(int(state.get("pid", 0))) != state.get("startTicks"):
            continue  # gone, or its pid is another process's now
        found.append(state)
    return found
