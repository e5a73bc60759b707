"""Session visibility: who sees which ``session/list`` rows, and reading the requester from ``_meta``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from msgspec.structs import replace

from acp_proxy.sessions.visibility import (
    VISIBILITIES,
    Requester,
    SessionRow,
    Visibility,
    can_see_session_row,
    parse_requester,
    visible_rows,
    with_lineage,
)

ME = Requester(session_key="me", agent_id="main")

WORLD = {
    row.session_id: row
    for row in [
        SessionRow("mine", session_key="me", agent_id="main"),
        SessionRow("sibling", session_key="sib", agent_id="main", owner_session_key="stranger"),
        SessionRow("foreign", session_key="far", agent_id="coder", owner_session_key="stranger"),
        SessionRow("helper", session_key="help", agent_id="coder", spawned_by="me"),
        SessionRow("grandchild", session_key="gc", agent_id="coder", parent_session_key="help"),
        SessionRow("agentless", session_key="anon"),
        SessionRow("keyless", agent_id="main"),
    ]
}
"""``me`` (agent ``main``) spawned ``helper`` (agent ``coder``), which has a child of its own."""


@dataclass(frozen=True)
class Case:
    sentence: str
    visibility: Visibility
    row: str
    visible: bool
    a2a: bool = False
    sandboxed: bool = False
    requester: Requester = ME


CASES = [
    Case("self: sees its own session", "self", row="mine", visible=True),
    Case("self: does not see a same-agent session owned by someone else", "self", row="sibling", visible=False),
    Case("self: does not see a session it spawned", "self", row="helper", visible=False),
    Case("self with a2a: does not see another agent's session", "self", row="foreign", visible=False, a2a=True),
    Case("tree: sees its own session", "tree", row="mine", visible=True),
    Case("tree: sees another agent's session that it spawned", "tree", row="helper", visible=True),
    Case("tree: sees a grandchild spawned by its child", "tree", row="grandchild", visible=True),
    Case("tree: does not see a same-agent session owned by someone else", "tree", row="sibling", visible=False),
    Case("tree with a2a: does not see another agent's session", "tree", row="foreign", visible=False, a2a=True),
    Case("agent: sees its own session", "agent", row="mine", visible=True),
    Case("agent: sees a same-agent session owned by someone else", "agent", row="sibling", visible=True),
    Case("agent: sees another agent's session that it spawned", "agent", row="helper", visible=True),
    Case("agent: sees another agent's grandchild of its own", "agent", row="grandchild", visible=True),
    Case("agent: does not see another agent's session", "agent", row="foreign", visible=False),
    Case("agent with a2a: still does not see another agent's session", "agent", row="foreign", visible=False, a2a=True),
    Case("agent: does not see a session with no agent id", "agent", row="agentless", visible=False),
    Case("all: sees a same-agent session owned by someone else", "all", row="sibling", visible=True),
    Case("all without a2a: does not see another agent's session", "all", row="foreign", visible=False),
    Case("all without a2a: still sees another agent's session that it spawned", "all", row="helper", visible=True),
    Case("all without a2a: still sees another agent's grandchild of its own", "all", row="grandchild", visible=True),
    Case("all without a2a: does not see a session with no agent id", "all", row="agentless", visible=False),
    Case("all with a2a: sees another agent's session", "all", row="foreign", visible=True, a2a=True),
    Case("all with a2a: sees a session with no agent id", "all", row="agentless", visible=True, a2a=True),
    Case(
        "sandboxed, all with a2a: does not see another agent's session",
        "all",
        row="foreign",
        visible=False,
        a2a=True,
        sandboxed=True,
    ),
    Case(
        "sandboxed, all: does not see a same-agent session owned by someone else",
        "all",
        row="sibling",
        visible=False,
        sandboxed=True,
    ),
    Case(
        "sandboxed, agent: does not see a same-agent session owned by someone else",
        "agent",
        row="sibling",
        visible=False,
        sandboxed=True,
    ),
    Case("sandboxed, all: still sees a grandchild of its own", "all", row="grandchild", visible=True, sandboxed=True),
    Case("sandboxed, self: stays self, not widened to tree", "self", row="helper", visible=False, sandboxed=True),
    Case(
        "a requester with no session key, self: does not see a session with no key either",
        "self",
        row="keyless",
        visible=False,
        requester=Requester(agent_id="main"),
    ),
    Case(
        "a requester with no session key, agent: still sees its agent's sessions",
        "agent",
        row="sibling",
        visible=True,
        requester=Requester(agent_id="main"),
    ),
    Case(
        "a requester with no agent id, agent: does not see a session with no agent id",
        "agent",
        row="agentless",
        visible=False,
        requester=Requester(session_key="me"),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[case.sentence for case in CASES])
def test_visibility(case: Case) -> None:
    assert case.row in WORLD
    requester = replace(case.requester, visibility=case.visibility, a2a=case.a2a, sandboxed=case.sandboxed)
    seen = {row.session_id for row in visible_rows(WORLD.values(), requester)}
    assert (case.row in seen) is case.visible


def lineages(rows: list[SessionRow]) -> dict[str, frozenset[str]]:
    return {row.session_id: row.lineage for row in with_lineage(rows)}


def test_lineage_follows_owner_spawner_and_parent_in_turn() -> None:
    rows = [
        SessionRow("a", session_key="a", owner_session_key="me"),
        SessionRow("b", session_key="b", spawned_by="a"),
        SessionRow("c", session_key="c", parent_session_key="b"),
        SessionRow("d", session_key="d", owner_session_key="c"),
        SessionRow("x", session_key="x", owner_session_key="y"),
    ]
    assert lineages(rows) == {
        "a": {"me"},
        "b": {"a", "me"},
        "c": {"b", "a", "me"},
        "d": {"c", "b", "a", "me"},
        "x": {"y"},
    }


def test_a_key_held_by_two_rows_leads_through_both() -> None:
    rows = [
        SessionRow("k1", session_key="k", owner_session_key="p"),
        SessionRow("k2", session_key="k", spawned_by="q"),
        SessionRow("child", session_key="c", owner_session_key="k"),
    ]
    assert lineages(rows)["child"] == {"k", "p", "q"}


def test_ownership_cycles_terminate() -> None:
    rows = [
        SessionRow("a", session_key="a", owner_session_key="b"),
        SessionRow("b", session_key="b", spawned_by="a"),
        SessionRow("c", session_key="c", parent_session_key="c"),
    ]
    assert lineages(rows) == {"a": {"a", "b"}, "b": {"a", "b"}, "c": {"c"}}


def test_the_requester_needs_no_row_of_its_own() -> None:
    rows = [
        SessionRow("child", session_key="child", spawned_by="me"),
        SessionRow("grandchild", session_key="gc", owner_session_key="child"),
    ]
    assert visible_rows(rows, replace(ME, visibility="tree")) == with_lineage(rows)


keys = st.one_of(st.none(), st.sampled_from(["a", "b", "c", "d"]))
agents = st.one_of(st.none(), st.sampled_from(["main", "coder"]))
row_sets = st.lists(
    st.builds(
        SessionRow,
        session_id=st.just("s"),
        session_key=keys,
        owner_session_key=keys,
        spawned_by=keys,
        parent_session_key=keys,
        agent_id=agents,
    ),
    max_size=6,
)
requesters = st.builds(
    Requester,
    session_key=keys,
    agent_id=agents,
    visibility=st.sampled_from(VISIBILITIES),
    a2a=st.booleans(),
    sandboxed=st.booleans(),
)


@given(rows=row_sets, requester=requesters, a2a=st.booleans())
def test_each_level_sees_everything_a_narrower_one_does(
    rows: list[SessionRow], requester: Requester, a2a: bool
) -> None:
    for row in with_lineage(rows):
        sees = {level: can_see_session_row(row, requester, level, a2a) for level in VISIBILITIES}
        assert sees["self"] <= sees["tree"] <= sees["agent"] <= sees["all"]


@given(rows=row_sets, requester=requesters, a2a=st.booleans())
def test_a_sandboxed_requester_sees_at_most_its_tree(rows: list[SessionRow], requester: Requester, a2a: bool) -> None:
    sandboxed = replace(requester, sandboxed=True)
    free = replace(requester, sandboxed=False)
    for row in with_lineage(rows):
        for level in VISIBILITIES:
            clamped: Visibility = "self" if level == "self" else "tree"
            assert can_see_session_row(row, sandboxed, level, a2a) == can_see_session_row(row, free, clamped, a2a)


@given(rows=row_sets, requester=requesters)
def test_a2a_only_ever_widens(rows: list[SessionRow], requester: Requester) -> None:
    for row in with_lineage(rows):
        for level in VISIBILITIES:
            assert can_see_session_row(row, requester, level, False) <= can_see_session_row(row, requester, level, True)


@given(rows=row_sets)
def test_lineage_is_closed_under_the_relations_it_reaches(rows: list[SessionRow]) -> None:
    named = {key for row in rows for key in row.relations()}
    computed = with_lineage(rows)
    for row in computed:
        assert row.relations() <= row.lineage <= named
        for ancestor in computed:
            if ancestor.session_key in row.lineage:
                assert ancestor.lineage <= row.lineage


def requester_meta(**fields: Any) -> dict[str, Any]:
    return {"acp-proxy": {"requester": fields}}


def test_parse_requester_reads_every_field_and_ignores_unknown_ones() -> None:
    meta = requester_meta(
        sessionKey="agent:main:1", agentId="main", visibility="tree", a2a=True, sandboxed=True, channel="slack"
    )
    assert parse_requester(meta) == Requester("agent:main:1", "main", "tree", a2a=True, sandboxed=True)


def test_a_requester_that_states_no_visibility_sees_only_itself() -> None:
    assert parse_requester(requester_meta(sessionKey="k")) == Requester("k", None, "self", a2a=False, sandboxed=False)
    assert parse_requester(requester_meta(sessionKey="k", visibility=None, a2a=None)) == Requester("k")


@pytest.mark.parametrize(
    "meta",
    [None, "text", [], {}, {"acp-proxy": None}, {"acp-proxy": {}}, {"acp-proxy": {"requester": None}}],
    ids=repr,
)
def test_no_requester(meta: object) -> None:
    assert parse_requester(meta) is None


@pytest.mark.parametrize(
    ("meta", "expected"),
    [
        ({"acp-proxy": 5}, '_meta["acp-proxy"]: expected an object, got 5'),
        ({"acp-proxy": {"requester": "me"}}, '_meta["acp-proxy"].requester: expected an object, got "me"'),
        (requester_meta(sessionKey=5), '_meta["acp-proxy"].requester.sessionKey: expected a non-empty string, got 5'),
        (requester_meta(sessionKey=""), '_meta["acp-proxy"].requester.sessionKey: expected a non-empty string, got ""'),
        (
            requester_meta(agentId=["main"]),
            '_meta["acp-proxy"].requester.agentId: expected a non-empty string, got ["main"]',
        ),
        (
            requester_meta(visibility="x"),
            '_meta["acp-proxy"].requester.visibility: expected one of self, tree, agent, all, got "x"',
        ),
        (
            requester_meta(visibility="ALL"),
            '_meta["acp-proxy"].requester.visibility: expected one of self, tree, agent, all, got "ALL"',
        ),
        (requester_meta(a2a="yes"), '_meta["acp-proxy"].requester.a2a: expected a boolean, got "yes"'),
        (requester_meta(sandboxed=1), '_meta["acp-proxy"].requester.sandboxed: expected a boolean, got 1'),
    ],
)
def test_each_bad_field_is_named(meta: object, expected: str) -> None:
    with pytest.raises(ValueError, match="expected") as caught:
        parse_requester(meta)
    assert str(caught.value) == expected
