"""What ``session/list`` shows of a session: the registry's row, and what the adapter lists of it.

The proxy serves ``session/list`` from its registry (suspended and closed sessions included, and
every backend's). A title is the adapter's: the registry keeps the one it announced with
``session_info_update``. Some adapters never announce one and only show it in their own
``session/list`` (qwen-code titles a session with its first prompt); where a live process of the
backend serves ``session/list``, ``titles_listed`` reads what it reports for the sessions on the
page, and ``title_changes`` says what the registry should take from it, so the title outlives the
process. Pure: rows and lists in, dicts out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

import msgspec

from acp_proxy.sessions.registry import SessionRecord


def updated_at(record: SessionRecord) -> str:
    """``updatedAt`` for ``session/list``: the later of the adapter's own (if it announced one) and
    the proxy's last sight of activity."""
    ours = datetime.fromtimestamp(record.last_active_at, UTC)
    theirs = record.title_updated_at
    if theirs is not None:
        try:
            announced = datetime.fromisoformat(theirs)
        except ValueError:
            announced = None
        if announced is not None and announced.tzinfo is not None and announced >= ours:
            return theirs
    return ours.isoformat().replace("+00:00", "Z")


def session_info(record: SessionRecord) -> dict[str, Any]:
    """A ``SessionInfo`` for ``session/list``."""
    info: dict[str, Any] = {"sessionId": record.session_id, "cwd": record.cwd}
    if record.additional_directories is not None:
        info["additionalDirectories"] = msgspec.json.decode(record.additional_directories)
    if record.title is not None:
        info["title"] = record.title
    info["updatedAt"] = updated_at(record)
    ours: dict[str, Any] = {"state": record.state.value, "backend": record.backend}
    if record.parent_session_id is not None:
        ours["parentSessionId"] = record.parent_session_id
    info["_meta"] = {"acp-proxy": ours}
    return info


def titles_listed(listed: Iterable[object]) -> dict[str, dict[str, str]]:
    """The adapter's ``sessions`` of a ``session/list`` answer: its session id -> title and updatedAt."""
    found: dict[str, dict[str, str]] = {}
    for info in listed:
        if not isinstance(info, dict) or not isinstance(info.get("sessionId"), str):
            continue
        entry = {key: info[key] for key in ("title", "updatedAt") if isinstance(info.get(key), str) and info[key]}
        if entry:
            found[info["sessionId"]] = entry
    return found


def title_changes(record: SessionRecord, listed: Mapping[str, Mapping[str, str]]) -> dict[str, str | None]:
    """What the registry should take from the adapter's own list for ``record`` (``record_title``'s changes).

    The adapter's title wins where it has one: it is the adapter's own word, newer than any the proxy
    kept. Its ``updatedAt`` is taken with it, or alone where it is later than the one kept.
    """
    theirs = listed.get(record.adapter_session_id)
    if theirs is None:
        return {}
    changes: dict[str, str | None] = {}
    title, stamp = theirs.get("title"), theirs.get("updatedAt")
    if title is not None and title != record.title:
        changes["title"] = title
    if stamp is not None and stamp != record.title_updated_at and (changes or _later(stamp, record.title_updated_at)):
        changes["updatedAt"] = stamp
    return changes


def _later(stamp: str, than: str | None) -> bool:
    if than is None:
        return True
    try:
        return datetime.fromisoformat(stamp) > datetime.fromisoformat(than)
    except (ValueError, TypeError):  # unparseable, or one naive and one aware
        return False
