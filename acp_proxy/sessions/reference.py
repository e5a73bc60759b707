"""The session machine as ``docs/architecture.md`` shows it, generated from the code.

Every table here is computed from ``acp_proxy.sessions.lifecycle`` and ``acp_proxy.sessions.machine``
themselves: the transitions from ``STEPS``, what becomes of a request by driving ``advance`` and
``fate_of``, and each phase's, event's and effect's meaning from its docstring in the source.
``tests/test_lifecycle.py`` checks that the document shows what this prints:

    python -m acp_proxy.sessions.reference
"""

from __future__ import annotations

import ast
import enum
import inspect
from types import ModuleType

import msgspec

from acp_proxy.sessions import lifecycle
from acp_proxy.sessions.lifecycle import Event, Phase, markdown_table
from acp_proxy.sessions.machine import (
    Begin,
    Enqueue,
    Finish,
    Queue,
    Request,
    Restoring,
    Run,
    Send,
    Standing,
    Waiting,
    Work,
    advance,
    fate_of,
)

_QUEUE_EVENTS = (Request, Enqueue, Begin, Finish, Restoring)
_EFFECTS = (Send, Queue, Run)


def member_docs(module: ModuleType, enum_type: type[enum.Enum]) -> dict[str, str]:
    """The docstring under each member of ``enum_type`` in ``module``'s source, by member name."""
    tree = ast.parse(inspect.getsource(module))
    found: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == enum_type.__name__:
            for here, after in zip(node.body, node.body[1:], strict=False):
                if (
                    isinstance(here, ast.Assign)
                    and isinstance(here.targets[0], ast.Name)
                    and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant)
                ):
                    found[here.targets[0].id] = " ".join(str(after.value.value).split())
    return found


def _first_line(obj: object) -> str:
    return " ".join((inspect.getdoc(obj) or "").split("\n\n")[0].split())


def _rows(header: str, rows: list[tuple[str, str]]) -> str:
    lines = [f"| `{name}` | {text.replace('``', '`')} |" for name, text in rows]
    return "\n".join([header, "| --- | --- |", *lines])


def phases() -> str:
    docs = member_docs(lifecycle, Phase)
    return _rows("| phase | what it means |", [(phase.value, docs[phase.name]) for phase in Phase])


def events() -> str:
    docs = member_docs(lifecycle, Event)
    rows = [(event.value, docs[event.name]) for event in Event]
    rows += [(kind.__name__, _first_line(kind)) for kind in _QUEUE_EVENTS]
    return _rows("| event | what it is |", rows)


def effects() -> str:
    docs = member_docs(lifecycle, lifecycle.Action)
    rows = [(action.value, docs.get(action.name, _WRITES.get(action.value, ""))) for action in lifecycle.Action]
    rows += [(kind.__name__, _first_line(kind)) for kind in _EFFECTS]
    return _rows("| effect | what the runner does |", rows)


_WRITES = {
    "write_live": "The registry's row says `live`, held by this proxy.",
    "write_suspended": "The row says `suspended`.",
    "write_closed": "The row says `closed`.",
    "write_deleted": "The row is a tombstone (`deleted`).",
}
"""The write actions have no docstring of their own: their names say it; the row's states are the registry's."""


def requests() -> str:
    """What becomes of a request by the phase it finds its session in, computed by driving the machine."""
    header = (
        "| it finds the session | it arrives | its turn comes: a request | a prompt | a prompt after `cancel` |\n"
        "| --- | --- | --- | --- | --- |"
    )
    rows = [header]
    for phase in Phase:
        state = Standing(
            phase,
            process=phase in (Phase.LIVE, Phase.RESUMING, Phase.CLOSING, Phase.DELETING, Phase.RELEASING),
            holder="another" if phase in (Phase.RELEASING, Phase.ELSEWHERE, Phase.TAKING_OVER) else None,
            served=phase in (Phase.LIVE, Phase.RELEASING),
        )
        if phase is Phase.DELETED:
            rows.append(f"| **{phase}** | answered from its row (`session_deleted`) | — | — | — |")
            continue
        arrives = _arrival(state)
        for case, then in _cases(state):
            fates = [
                fate_of(then, Waiting(1, work, epoch), withdrawn=False, refusing=False).value
                for work, epoch in (
                    (Work.REQUEST, then.epoch),
                    (Work.PROMPT, then.epoch),
                    (Work.PROMPT, then.epoch - 1),
                )
            ]
            named = f"**{phase}**" + (f" ({case})" if case else "")
            rows.append(f"| {named} | {arrives} | " + " | ".join(fates) + " |")
    return "\n".join(rows)


def _cases(state: Standing) -> list[tuple[str, Standing]]:
    """The session as a request queued now finds it when its turn comes: as it is, or (a handover) either way
    the handover can go before then."""
    if state.phase is Phase.RELEASING:  # the release runs before it: handed over, or kept past the timeout
        handed, _ = advance(state, Event.QUIET, 0.0)
        kept, _ = advance(state, Event.RELEASE_EXPIRED, 0.0)
        return [("then handed over", handed), ("then kept", kept)]
    served = msgspec.structs.replace(state, served=True)
    if state.phase is Phase.ELSEWHERE:
        return [("served here before", served), ("never served here: taken over", state)]
    if state.phase is Phase.TAKING_OVER:  # the take-over runs before it
        taken, _ = advance(state, Event.RELEASED, 0.0)
        return [
            ("then taken over", taken),
            ("then kept, served here before", advance(served, Event.KEPT, 0.0)[0]),
            ("then kept, never served here", advance(state, Event.KEPT, 0.0)[0]),
        ]
    return [("", state)]


def _arrival(state: Standing) -> str:
    _, done = advance(state, Request(1), 0.0)
    if done == (Send(1),):
        _, behind = advance(msgspec.structs.replace(state, queue=(Waiting(0, Work.FORK, 0),)), Request(1), 0.0)
        return "send (queue, if work waits before it)" if behind == (Queue(1),) else "send"
    return "queue"


def markdown() -> str:
    """The whole generated part of the document's section on the session machine."""
    return "\n\n".join(
        [
            phases(),
            markdown_table(),
            events(),
            effects(),
            requests(),
        ]
    )


if __name__ == "__main__":
    print(markdown())
