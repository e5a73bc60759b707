"""The program, ``acp-proxy`` and ``python -m acp_proxy``: the CLI, handed the way to run a proxy.

The relay and its event loop are imported only once the CLI has launched the first
adapter, so that the adapter's start-up overlaps ours.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import TYPE_CHECKING

from acp_proxy.operator import cli

if TYPE_CHECKING:
    from acp_proxy.config import Config
    from acp_proxy.ownership.owner import Owner
    from acp_proxy.pool.running import WarmStart


def main(argv: Sequence[str] | None = None) -> int:
    return cli.main(argv, serve=run_proxy, preload=preload_proxy)


def preload_proxy(async_backend: str) -> None:
    """Import what ``run_proxy`` runs on ``async_backend``: for a process that forks proxies (``serve``'s
    launcher), so that its children start with it imported."""
    import importlib

    import acp_proxy.serve  # noqa: F401

    importlib.import_module(f"anyio._backends._{async_backend}")  # what anyio.run loads for it


def run_proxy(config: Config, owner: Owner, backend: str | None, warm: WarmStart | None, async_backend: str) -> int:
    """Serve ACP on stdio with the layers wired by ``acp_proxy.serve``, on ``async_backend``."""
    import anyio

    from acp_proxy.serve import serve_stdio

    gc.enable()  # off while starting (acp_proxy.__main__)
    return anyio.run(serve_stdio, config, owner, backend, warm, backend=async_backend)
