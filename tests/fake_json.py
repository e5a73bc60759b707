"""``loads`` and ``dumps`` for the fake adapter, on the C accelerator ``_json`` alone.

``import json`` compiles the regular expressions of its pure-Python fallback: 9 ms of a fake
adapter's 30 ms of CPU at start, and the suite starts hundreds of them. Same output as ``json``
for what the fake adapter writes (its separators, ``sort_keys``, ``ensure_ascii``); a malformed
document raises ``ValueError`` (``json.JSONDecodeError`` is one).
"""

from __future__ import annotations

import _json

TYPE_CHECKING = False  # typing: 4 ms more
if TYPE_CHECKING:
    from typing import IO

WHITESPACE = " \t\n\r"


class _Context:
    """What the C scanner reads from ``json.JSONDecoder``: the defaults."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    memo: dict[str, str] = {}

    @staticmethod
    def parse_constant(name: str) -> float:
        return {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}[name]


_scan = _json.make_scanner(_Context())


def loads(text: str | bytes) -> object:
    if isinstance(text, bytes):
        text = text.decode()
    start = len(text) - len(text.lstrip(WHITESPACE))
    try:
        value, end = _scan(text, start)
    except StopIteration as exc:
        raise ValueError(f"Expecting value: char {exc.value}") from None
    if text[end:].strip(WHITESPACE):
        raise ValueError(f"Extra data: char {end}")
    return value


def _refuse(value: object) -> object:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def dumps(
    value: object,
    *,
    sort_keys: bool = False,
    separators: tuple[str, str] = (", ", ": "),
    ensure_ascii: bool = True,
) -> str:
    quote = _json.encode_basestring_ascii if ensure_ascii else _json.encode_basestring
    item, key = separators
    encode = _json.make_encoder({}, _refuse, quote, None, key, item, sort_keys, False, True)
    return "".join(encode(value, 0))


def load(file: IO[str]) -> object:
    return loads(file.read())


def dump(value: object, file: IO[str]) -> None:
    file.write(dumps(value))
