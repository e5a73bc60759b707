"""Termination signals that arrive before the event loop is serving."""

from __future__ import annotations

import signal

EARLY_SIGNALS: list[int] = []
"""Termination signals caught by ``hold_signals_until_serving`` before the event loop ran."""


def hold_signals_until_serving() -> None:
    """Record SIGTERM/SIGINT/SIGHUP until the event loop's receiver takes over.

    Between start-up and the receiver, the default action would kill the proxy
    with its adapter half-launched; recorded instead, they stop it cleanly once
    serving begins. (Handlers, unlike a blocked mask, are reset in children on exec.)
    """
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: EARLY_SIGNALS.append(signum))
