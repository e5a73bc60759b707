"""``python -m acp_proxy``, with every wait for a process slot timed. For the load benchmark.

    load_proxy.py ACQUIRES_FILE ACP_PROXY_ARGS...

Runs the proxy's own command line unchanged, except that the pool's
``ProcessPool._acquire_slot`` (the one place a request waits for room to
start a process: suspending the least recently used idle session and waiting for
its process to exit, or waiting for a busy one to become idle) is wrapped: each
call appends ``<seconds waited> <ok|failed>`` as one line to ACQUIRES_FILE. The
write is a few microseconds per process start, on the event loop; nothing else
changes. The pool module is imported before the proxy's start-up instead of
after it, which only moves the import (cold start is not measured here).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Any

from acp_proxy.main import main
from acp_proxy.pool.processes import ProcessPool


def time_acquires(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    acquire = ProcessPool._acquire_slot

    @functools.wraps(acquire)
    async def timed(self: ProcessPool, backend: Any) -> None:
        start = time.monotonic()
        outcome = "failed"
        try:
            await acquire(self, backend)
            outcome = "ok"
        finally:
            os.write(fd, f"{time.monotonic() - start:.6f} {outcome}\n".encode())

    ProcessPool._acquire_slot = timed  # type: ignore[method-assign]


if __name__ == "__main__":
    time_acquires(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
