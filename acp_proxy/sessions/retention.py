"""Retiring the sessions nobody closes: those suspended longer than ``[sessions] keep_suspended`` are closed.

Gateways that never send ``session/close`` (a chat bridge whose sessions only ever end by EOF, a
one-shot client) would leave every session suspended for ever, listed and counted. A session
suspended and last active more than ``keep_suspended`` ago is closed as ``session/close`` leaves one:
its row ``closed``, still listed, restored only by the gateway's own ``session/load`` or
``session/resume``; with no process to reap, the adapter's own history is untouched. Every proxy
does it at its start and hourly (with the tasks' pruning, ``TurnBook``); ``acp-proxy sessions
prune`` does it by hand, with an age of the operator's choosing.
"""

from __future__ import annotations

import logging
from collections import Counter

from acp_proxy.journal import Journal, Kind
from acp_proxy.sessions.registry import SessionRecord, SessionRegistry

log = logging.getLogger("acp_proxy.lifecycle")


def retire_suspended(
    registry: SessionRegistry,
    journal: Journal | None,
    older_than: float,
    *,
    dry_run: bool = False,
    by: str = "retention",
) -> list[SessionRecord]:
    """Close the sessions suspended and last active more than ``older_than`` seconds ago (with ``dry_run``, only
    say which); those closed, oldest first. Journaled as closes ``by`` (``retention``, ``operator``)."""
    retired = registry.retire_suspended(older_than, dry_run=dry_run)
    if dry_run or not retired:
        return retired
    for backend, count in Counter(record.backend for record in retired).items():
        if journal is not None:
            journal.record(
                Kind.CLOSED,
                backend=backend,
                label=by,
                count=count,
                detail=f"{count} session(s) suspended for more than {older_than:g}s closed",
            )
    log.info("closed %d session(s) suspended for more than %gs (%s)", len(retired), older_than, by)
    return retired
