"""Validate ACP messages against the official schema, per method.

Validating against the schema's top-level union is weak (any params match some
type), so each message is checked against the definition its method selects:
``x-method`` names the method and ``x-side`` who handles it. A ``Conversation``
follows one connection in one direction and remembers which method each
outstanding request id belongs to, so responses are checked as that method's
result. Extension methods (``_``-prefixed) and unknown methods get the envelope
check only: their shape is theirs to define.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema

SCHEMA = json.loads((Path(__file__).parent / "data" / "acp-schema" / "schema.json").read_text())
DEFS: dict[str, Any] = SCHEMA["$defs"]


def _index() -> dict[tuple[str, str, str], str]:
    """(side that handles it, method, request|response|notification) -> definition name."""
    index = {}
    for name, definition in DEFS.items():
        method, side = definition.get("x-method"), definition.get("x-side")
        if method is None:
            continue
        for suffix, part in (
            ("Request", "request"),
            ("Response", "response"),
            ("Notification", "notification"),
        ):
            if name.endswith(suffix):
                index[(side, method, part)] = name
    return index


INDEX = _index()
_validators: dict[str, jsonschema.Draft202012Validator] = {}
_valid: dict[tuple[str, str], None] = {}
"""Values found valid, by definition and canonical JSON: a test's messages repeat (every ``initialize``,
every chunk of the same text), and validating one costs far more than writing it out."""
VALID_KEPT = 50_000


def validate_def(name: str, value: Any) -> None:
    key = (name, json.dumps(value, sort_keys=True, separators=(",", ":")))
    if key in _valid:
        return
    validator = _validators.get(name)
    if validator is None:
        validator = jsonschema.Draft202012Validator({"$defs": DEFS, "$ref": f"#/$defs/{name}"})
        _validators[name] = validator
    validator.validate(value)
    if len(_valid) >= VALID_KEPT:
        _valid.clear()
    _valid[key] = None


class ConformanceError(AssertionError):
    pass


class Conversation:
    """Messages travelling one way to one peer: ``to="client"`` (the gateway) or ``to="agent"``.

    ``track_request`` tells it about requests travelling the other way, whose answers
    it will see.
    """

    def __init__(self, to: str) -> None:
        assert to in ("client", "agent")
        self.to = to
        self.handled_here = to
        self.handled_there = "agent" if to == "client" else "client"
        self.outstanding: dict[Any, str] = {}
        self.checked = 0

    def track_request(self, msg: dict[str, Any]) -> None:
        request_id = msg.get("id", ())
        if "method" in msg and (request_id is None or type(request_id) in (int, str)):
            self.outstanding[_key(request_id)] = msg["method"]

    def check(self, msg: Any) -> None:
        try:
            self._check(msg)
        except jsonschema.ValidationError as exc:
            raise ConformanceError(f"{exc.message} in message to {self.to}: {json.dumps(msg)[:400]}") from None
        self.checked += 1

    def _check(self, msg: Any) -> None:
        if not isinstance(msg, dict) or msg.get("jsonrpc") != "2.0":
            raise ConformanceError(f"not a JSON-RPC 2.0 object: {msg!r}")
        extra = set(msg) - {"jsonrpc", "id", "method", "params", "result", "error"}
        if extra:
            raise ConformanceError(f"unexpected members {sorted(extra)} in {msg!r}")
        if "method" in msg:
            if "result" in msg or "error" in msg:
                raise ConformanceError(f"request with a result or error: {msg!r}")
            if "id" in msg:
                validate_def("RequestId", msg["id"])
            method = msg["method"]
            part = "request" if "id" in msg else "notification"
            side = "protocol" if method.startswith("$/") else self.handled_here
            name = INDEX.get((side, method, part))
            if name is None and not method.startswith("_"):
                known = {m for (_, m, _) in INDEX}
                if method in known:
                    raise ConformanceError(f"{method} sent as a {part} to the {self.to}: {msg!r}")
            if name is not None:
                validate_def(name, msg.get("params"))
            return
        if "id" not in msg or ("result" in msg) == ("error" in msg):
            raise ConformanceError(f"response needs an id and exactly one of result/error: {msg!r}")
        validate_def("RequestId", msg["id"])
        method = self.outstanding.pop(_key(msg["id"]), None)
        if "error" in msg:
            validate_def("Error", msg["error"])
            return
        if method is None:
            raise ConformanceError(f"answer to an id that was never asked: {msg!r}")
        name = INDEX.get((self.handled_there, method, "response"))
        if name is not None:
            validate_def(name, msg["result"])


def _key(request_id: Any) -> tuple[str, Any]:
    return (type(request_id).__name__, request_id)
