"""A message trace for debugging a peer: every wire message on both sides, one JSON object per line.

``--trace FILE`` (or ``[trace] file``) makes a proxy append, for each line it reads or writes,
``{"at": <unix time>, "dir": <direction>, "pid": <adapter pid>, "backend": <name>, "message":
<the message>}`` to FILE. Directions: ``gateway>proxy``, ``proxy>gateway``, ``proxy>agent``,
``agent>proxy`` (``pid`` and ``backend`` on the agent's side only). ``acp-proxy trace show FILE``
renders it as an exchange per session.

What a trace must never hold is taken out before it is written: the params of ``authenticate``
(whole), and the value of every ``env`` entry and ``headers`` entry (an MCP server's environment
and HTTP headers, a terminal's environment), as ``"[redacted]"``. A line is decoded only when it
may hold one of these (its bytes name them); any other is written as it came, inside the record.

Bounded: past ``max_bytes`` the trace writes one last record, ``{"at": ..., "truncated": true}``,
and nothing more. Each record is one ``write`` to a file opened for appending (``0600``): a trace
cut short by a crash loses no record but the one being written. When no trace is asked for,
the relay pays one attribute test per block.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final, Literal

import msgspec

from acp_proxy.protocol.methods import Method

Direction = Literal["gateway>proxy", "proxy>gateway", "proxy>agent", "agent>proxy"]
REDACTED: Final = "[redacted]"
DEFAULT_MAX_BYTES: Final = 64 * 1024 * 1024
_SENSITIVE: Final = (f'"{Method.AUTHENTICATE}"'.encode(), b'"env"', b'"headers"')


class Trace:
    """An open trace file (``path``), written until ``max_bytes``."""

    def __init__(self, path: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._written = os.fstat(self._fd).st_size

    def lines(self, direction: Direction, data: bytes, *, pid: int | None = None, backend: str | None = None) -> None:
        """Record each complete line of ``data`` (a block as read or written)."""
        if self._fd is None:
            return
        at = time.time()
        head = f'{{"at": {at:.6f}, "dir": "{direction}"'
        if pid is not None:
            head += f', "pid": {pid}'
        if backend is not None:
            head += f', "backend": {json.dumps(backend)}'
        head_bytes = (head + ', "message": ').encode()
        records = [head_bytes + redacted(line) + b"}\n" for line in data.splitlines() if line.strip()]
        if records:
            self._write(b"".join(records))

    def _write(self, block: bytes) -> None:
        assert self._fd is not None
        if self._written + len(block) > self.max_bytes:
            os.write(self._fd, f'{{"at": {time.time():.6f}, "truncated": true}}\n'.encode())
            self.close()
            return
        try:
            os.write(self._fd, block)
        except OSError:
            self.close()  # a full disk ends the trace, never the relay
            return
        self._written += len(block)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def redacted(line: bytes) -> bytes:
    """``line`` as a trace may hold it: as it came, unless it names a secret's place (then decoded,
    the secrets replaced, encoded again). A line that is not JSON is written as a JSON string."""
    if not any(mark in line for mark in _SENSITIVE):
        try:
            msgspec.json.decode(line)  # it must stay valid JSON inside the record
        except msgspec.DecodeError:
            return msgspec.json.encode(line.decode("utf-8", "replace"))
        return line
    try:
        message = msgspec.json.decode(line)
    except msgspec.DecodeError:
        return msgspec.json.encode(REDACTED)
    return msgspec.json.encode(_scrub(message))


def _scrub(value: Any) -> Any:
    if isinstance(value, dict):
        if value.get("method") == Method.AUTHENTICATE and "params" in value:
            value = {**value, "params": REDACTED}
        return {k: _secret_values(v) if k in ("env", "headers") else _scrub(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub(item) for item in value]
    return value


def _secret_values(value: Any) -> Any:
    """An ``env``/``headers`` list of ``{name, value}`` (or a table of name -> value), values redacted."""
    if isinstance(value, list):
        return [
            {**item, "value": REDACTED} if isinstance(item, dict) and "value" in item else REDACTED for item in value
        ]
    if isinstance(value, dict):
        return dict.fromkeys(value, REDACTED)
    return REDACTED


# --- reading, for ``acp-proxy trace show`` ---------------------------------------------------------


class Record(msgspec.Struct, frozen=True):
    at: float
    dir: str = ""
    message: Any = None
    pid: int | None = None
    backend: str | None = None
    truncated: bool = False


def read(path: Path) -> Iterator[Record | str]:
    """The records of a trace file, in order; a line that is not a record, as the text of a warning."""
    decoder = msgspec.json.Decoder(Record)
    with path.open("rb") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield decoder.decode(line)
            except msgspec.DecodeError as exc:
                yield f"line {number}: not a trace record ({exc})"
