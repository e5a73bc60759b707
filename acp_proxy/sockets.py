"""Where a proxy's control socket is, and how to name a Unix socket whose path is too long.

Below the operator's control socket (``operator.control``) and the attaching side of a shared
session (``relay.attached``), which both connect to a proxy's socket.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Final

SOCKET_DIR: Final = "control"
_SUN_PATH_MAX: Final = 100
"""``sockaddr_un.sun_path`` holds 104-108 bytes depending on the platform; longer paths go through a dir fd."""


def socket_path(state_dir: Path, instance_id: str) -> Path:
    """The control socket of the proxy ``instance_id``."""
    return state_dir / SOCKET_DIR / f"{instance_id}.sock"


@contextlib.contextmanager
def addressable(path: Path) -> Iterator[str]:
    """A name for ``path`` that fits in ``sun_path``: itself, or ``/proc/self/fd/N/<name>`` on Linux."""
    if len(os.fsencode(path)) <= _SUN_PATH_MAX:
        yield str(path)
        return
    if not sys.platform.startswith("linux"):
        raise OSError(errno.ENAMETOOLONG, f"socket path too long ({len(str(path))} bytes): {path}")
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)
