"""Which sessions a ``session/list`` requester may see.

The gateway says who is asking in ``_meta["acp-proxy"].requester``; each session
row carries the ownership metadata it was created with. The levels nest, so a
wider level never hides what a narrower one shows:

* ``self``  — the requester's own session;
* ``tree``  — plus every session it owns or spawned, transitively;
* ``agent`` — plus every session of the requester's agent;
* ``all``   — plus every other agent's sessions, when agent-to-agent (a2a) is on.

A sandboxed requester is held to ``tree`` at most. Everything here is a pure
function over plain data; the registry reads the rows and the caller pages them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Final, Literal, assert_never, get_args

import msgspec

Visibility = Literal["self", "tree", "agent", "all"]
VISIBILITIES: Final[tuple[Visibility, ...]] = get_args(Visibility)


class SessionRow(msgspec.Struct, frozen=True):
    """A registry row as visibility sees it: its own key, the keys it names, and its agent."""

    session_id: str
    session_key: str | None = None
    owner_session_key: str | None = None
    spawned_by: str | None = None
    parent_session_key: str | None = None
    agent_id: str | None = None
    lineage: frozenset[str] = frozenset()
    """Every session key this row descends from, transitively; filled in by :func:`with_lineage`."""

    def relations(self) -> frozenset[str]:
        """The session keys this row names directly as its owner, spawner or parent."""
        return frozenset(k for k in (self.owner_session_key, self.spawned_by, self.parent_session_key) if k is not None)


class Requester(msgspec.Struct, frozen=True):
    session_key: str | None = None
    agent_id: str | None = None
    visibility: Visibility = "self"
    """``self`` when the gateway does not say: a requester that states no scope gets the narrowest one."""
    a2a: bool = False
    sandboxed: bool = False


def with_lineage(rows: Iterable[SessionRow]) -> list[SessionRow]:
    """``rows`` with ``lineage`` computed from the relations among them.

    A key no row carries still counts (the requester's own session need not be in
    the registry); it just leads no further. Pass the whole registry, not one page
    of it, or a grandchild loses the link through a child on another page.
    """
    rows = list(rows)
    relations_of_key: dict[str, set[str]] = {}
    for row in rows:
        if row.session_key is not None:
            relations_of_key.setdefault(row.session_key, set()).update(row.relations())
    return [msgspec.structs.replace(row, lineage=_ancestors(row.relations(), relations_of_key)) for row in rows]


def _ancestors(start: frozenset[str], relations_of_key: Mapping[str, set[str]]) -> frozenset[str]:
    seen = set(start)
    pending = list(start)
    while pending:
        for key in relations_of_key.get(pending.pop(), ()):
            if key not in seen:  # ownership metadata comes from gateways and may loop
                seen.add(key)
                pending.append(key)
    return frozenset(seen)


def can_see_session_row(row: SessionRow, requester: Requester, visibility: Visibility, a2a_policy: bool) -> bool:
    """Whether ``requester`` may see ``row`` at ``visibility``; ``row.lineage`` must be filled in."""
    if requester.sandboxed and visibility in ("agent", "all"):
        visibility = "tree"
    key = requester.session_key
    own = key is not None and row.session_key == key
    in_tree = own or (key is not None and key in row.lineage)
    same_agent = requester.agent_id is not None and row.agent_id == requester.agent_id
    match visibility:
        case "self":
            return own
        case "tree":
            return in_tree
        case "agent":
            return in_tree or same_agent
        case "all":
            return in_tree or same_agent or a2a_policy
        case _:
            assert_never(visibility)


def visible_rows(rows: Iterable[SessionRow], requester: Requester) -> list[SessionRow]:
    """The rows ``requester`` may see at its stated visibility and a2a, in their given order."""
    return [
        row for row in with_lineage(rows) if can_see_session_row(row, requester, requester.visibility, requester.a2a)
    ]


_REQUESTER_PATH: Final = '_meta["acp-proxy"].requester'


def parse_requester(meta: object) -> Requester | None:
    """The requester named in a request's decoded ``_meta``, or ``None`` when it names none.

    ``null`` counts as absent, at every level; unknown keys are ignored so that a
    newer gateway can add some. A value of the wrong type raises ``ValueError``
    naming its path, e.g. ``_meta["acp-proxy"].requester.a2a: expected a boolean, got "yes"``.
    """
    if not isinstance(meta, Mapping):
        return None
    ours = _object_at('_meta["acp-proxy"]', meta.get("acp-proxy"))
    if ours is None:
        return None
    fields = _object_at(_REQUESTER_PATH, ours.get("requester"))
    if fields is None:
        return None
    return Requester(
        session_key=_optional_key(fields, "sessionKey"),
        agent_id=_optional_key(fields, "agentId"),
        visibility=_visibility(fields.get("visibility")),
        a2a=_flag(fields, "a2a"),
        sandboxed=_flag(fields, "sandboxed"),
    )


def _object_at(path: str, value: object) -> Mapping[str, object] | None:
    if value is None or isinstance(value, Mapping):
        return value
    raise _invalid(path, "an object", value)


def _optional_key(fields: Mapping[str, object], name: str) -> str | None:
    value = fields.get(name)
    # An empty key would match every row stored with an empty key.
    if value is None or (isinstance(value, str) and value):
        return value
    raise _invalid(f"{_REQUESTER_PATH}.{name}", "a non-empty string", value)


def _visibility(value: object) -> Visibility:
    if value is None:
        return "self"
    for known in VISIBILITIES:
        if value == known:
            return known
    raise _invalid(f"{_REQUESTER_PATH}.visibility", f"one of {', '.join(VISIBILITIES)}", value)


def _flag(fields: Mapping[str, object], name: str) -> bool:
    value = fields.get(name)
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    raise _invalid(f"{_REQUESTER_PATH}.{name}", "a boolean", value)


def _invalid(path: str, expected: str, value: object) -> ValueError:
    try:
        shown = json.dumps(value)
    except (TypeError, ValueError):
        shown = repr(value)
    return ValueError(f"{path}: expected {expected}, got {shown}")
