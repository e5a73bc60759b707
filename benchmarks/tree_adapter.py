"""A tiny adapter with a process tree, for the ownership benchmarks. Standard library only.

    python tree_adapter.py cooperative|stubborn

It forks a child, which forks a grandchild; both sleep. Once the tree is up it
prints one line, ``{"pid": P, "child": C, "grandchild": G}``, and then:

* ``cooperative``: reads stdin to EOF and exits (status 0), leaving the two
  sleepers behind, as an adapter that forgets its helpers would;
* ``stubborn``: ignores SIGTERM (the whole tree inherits that) and stdin EOF,
  and sleeps until it is killed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def sleep_forever() -> None:
    while True:
        time.sleep(3600)


def fork_sleeper(report: int) -> int:
    """Fork the child; it forks the grandchild, reports the grandchild's pid on ``report``, sleeps."""
    pid = os.fork()
    if pid:
        return pid
    grandchild = os.fork()
    if grandchild == 0:
        os.close(report)
        sleep_forever()
    os.write(report, f"{grandchild}\n".encode())
    os.close(report)
    sleep_forever()
    return 0  # not reached


def main() -> None:
    mode = sys.argv[1]
    if mode not in ("cooperative", "stubborn"):
        sys.exit(f"tree_adapter: unknown mode {mode!r}")
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    report_r, report_w = os.pipe()
    child = fork_sleeper(report_w)
    os.close(report_w)
    grandchild = int(os.read(report_r, 64))
    os.close(report_r)
    ready = {"pid": os.getpid(), "child": child, "grandchild": grandchild}
    os.write(sys.stdout.fileno(), json.dumps(ready).encode() + b"\n")
    while os.read(sys.stdin.fileno(), 65536):
        pass
    if mode == "stubborn":
        sleep_forever()


if __name__ == "__main__":
    main()
