"""JSON-RPC 2.0 over newline-delimited JSON: framing, envelopes, encoding.

Only the envelope is ever decoded. ``params``, ``result`` and ``error.data`` stay
``msgspec.Raw`` so that what the proxy does not need to read it forwards as the
exact bytes it received. The reader hands out *batches* of complete lines, so a
relay can decode a whole read with one call and, when nothing needs rewriting,
write the block it read without splitting or joining it.
"""

from __future__ import annotations

import enum
import operator
from typing import Any, Final, Literal, TypeVar

import anyio
import msgspec
from anyio.abc import ByteReceiveStream, ByteSendStream
from msgspec import UNSET, Raw, UnsetType

DEFAULT_MAX_LINE_BYTES: Final = 64 * 1024 * 1024
READ_SIZE: Final = 128 * 1024
T = TypeVar("T")

PARSE_ERROR: Final = -32700
INVALID_REQUEST: Final = -32600
METHOD_NOT_FOUND: Final = -32601
INVALID_PARAMS: Final = -32602
INTERNAL_ERROR: Final = -32603
REQUEST_CANCELLED: Final = -32800
AUTH_REQUIRED: Final = -32000
RESOURCE_NOT_FOUND: Final = -32002

RequestId = int | str | None
"""A JSON-RPC id. ``0`` and ``""`` are ids like any other; ``None`` is JSON null."""


class ErrorObject(msgspec.Struct, gc=False, omit_defaults=True):
    code: int
    message: str
    data: Raw | UnsetType = UNSET


class Message(msgspec.Struct, gc=False, omit_defaults=True):
    """The envelope of any JSON-RPC message. Absent members are ``UNSET``."""

    jsonrpc: Literal["2.0"] | UnsetType = UNSET
    id: int | str | UnsetType | None = UNSET
    method: str | UnsetType = UNSET
    params: Raw | UnsetType = UNSET
    result: Raw | UnsetType = UNSET
    error: ErrorObject | UnsetType = UNSET


class Kind(enum.Enum):
    REQUEST = "request"
    NOTIFICATION = "notification"
    RESPONSE = "response"


def classify(msg: Message) -> Kind | None:
    """What a decoded envelope is, or ``None`` if it is not valid JSON-RPC 2.0.

    ``jsonrpc`` must be there (the decoder has checked it says ``"2.0"``): without it
    the message is JSON-RPC 1.0, whose notifications look like requests with a null id.
    """
    if msg.jsonrpc is UNSET:
        return None
    if msg.method is not UNSET:
        if msg.result is not UNSET or msg.error is not UNSET:
            return None
        return Kind.NOTIFICATION if msg.id is UNSET else Kind.REQUEST
    if msg.id is UNSET or (msg.result is UNSET) == (msg.error is UNSET):
        return None
    return Kind.RESPONSE


class BadLine(enum.Enum):
    PARSE = PARSE_ERROR
    INVALID = INVALID_REQUEST


_decoder: Final = msgspec.json.Decoder(Message)
_encoder: Final = msgspec.json.Encoder()


class _IdOnly(msgspec.Struct, gc=False):
    id: Any = None


_id_decoder: Final = msgspec.json.Decoder(_IdOnly)


def is_utf8(data: bytes) -> bool:
    """Whether ``data`` is valid UTF-8, as JSON between systems must be (RFC 8259 §8.1).

    msgspec checks the strings it decodes, and raises ``UnicodeDecodeError`` (not a
    ``DecodeError``) for a bad one, but not the bytes it keeps as ``Raw``: so every
    line is checked before it is decoded or forwarded. ASCII, the common case, is one C scan.
    """
    if data.isascii():
        return True
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def decode_line(line: bytes) -> tuple[Message, Kind] | BadLine:
    """Decode one line; a bad line says whether it was not JSON or not JSON-RPC.

    Invalid UTF-8 is a parse error, and so is nesting deeper than the decoder goes
    (msgspec recurses, and raises ``RecursionError``; RFC 8259 §9 lets a parser limit depth).
    """
    if not is_utf8(line):
        return BadLine.PARSE
    try:
        msg = _decoder.decode(line)
    except msgspec.ValidationError:
        return BadLine.INVALID if _is_json(line) else BadLine.PARSE
    except (msgspec.DecodeError, RecursionError):
        return BadLine.PARSE
    kind = classify(msg)
    if kind is None:
        return BadLine.INVALID
    return msg, kind


def _is_json(line: bytes) -> bool:
    """Whether a line the envelope decoder refused is JSON at all.

    That decoder stops at the first member of a wrong type, before it has read the rest:
    ``[1,2`` is "not an object" to it, though it is not JSON (-32700, not -32600). Only
    refused lines get this second read. A value nested too deep to read to its end
    counts as JSON: its envelope is already known to be wrong.
    """
    try:
        msgspec.json.decode(line)
    except msgspec.DecodeError:
        return False
    except RecursionError:
        return True
    return True


def salvage_id(line: bytes) -> RequestId:
    """The id of an invalid request if one can be read, so its error can name it."""
    try:
        raw_id = _id_decoder.decode(line).id
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None
    return raw_id if isinstance(raw_id, int | str) and not isinstance(raw_id, bool) else None


class _PlainNotification(msgspec.Struct, gc=False):
    """Decodes only a notification: an ``id``, ``result`` or ``error`` member fails validation."""

    method: str
    jsonrpc: Literal["2.0"]
    params: Raw | UnsetType = UNSET
    id: UnsetType = UNSET
    result: UnsetType = UNSET
    error: UnsetType = UNSET


_notification_decoder: Final = msgspec.json.Decoder(_PlainNotification)


def _one_object_per_line(block: bytes, line_count: int) -> bool:
    """Every line starts with ``{`` and ends with ``}``: then no value can span two lines.

    (JSON never allows ``}`` to be followed by ``{`` inside a value, and a string
    cannot hold a raw newline.) With that, a decoder that yields exactly
    ``line_count`` values has seen exactly one per line. Three C-speed checks;
    lines with surrounding whitespace just take the line-by-line path.
    """
    return block[:1] == b"{" and block[-2:] == b"}\n" and block.count(b"}\n{") == line_count - 1


def decode_lines(decoder: msgspec.json.Decoder[T], block: bytes, line_count: int) -> list[T] | None:
    """A block of ``line_count`` complete lines decoded with one call, a value of ``decoder``'s type per line.

    ``None`` when the block needs line-by-line handling: a line that is not exactly one JSON object
    (``_one_object_per_line``), bytes that are not UTF-8, or a line the type does not take.
    """
    if not _one_object_per_line(block, line_count) or not is_utf8(block):
        return None
    try:
        values = decoder.decode_lines(block)
    except (msgspec.DecodeError, RecursionError):
        return None
    return values if len(values) == line_count else None


def decode_block(block: bytes, line_count: int) -> list[Message] | None:
    """One envelope per line of a block of ``line_count`` complete lines, with one call; ``None`` when the
    block needs line-by-line handling (``decode_lines``; also a line :func:`decode_line` rejects as unparseable).
    """
    return decode_lines(_decoder, block, line_count)


def notification_methods(block: bytes, line_count: int) -> set[str] | None:
    """The methods of a block in which each line is exactly one notification, else ``None``.

    The streaming hot path: one decode call over the whole block, into a struct
    that only a notification satisfies, and the set of methods built in C.
    """
    msgs = decode_lines(_notification_decoder, block, line_count)
    return None if msgs is None else set(map(_method_of, msgs))


_method_of: Final = operator.attrgetter("method")


def id_key(request_id: object) -> tuple[type, object]:
    """A request id as a dict key: ``1`` and ``"1"`` are different ids (and ``True`` is not ``1``)."""
    return (type(request_id), request_id)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg) + b"\n"


def encode_json(value: object) -> bytes:
    return _encoder.encode(value)


def with_id(msg: Message, new_id: RequestId) -> bytes:
    """Re-encode ``msg`` under another id; params/result/error pass through as they came."""
    return encode(
        Message(
            jsonrpc="2.0",
            id=new_id,
            method=msg.method,
            params=msg.params,
            result=msg.result,
            error=msg.error,
        )
    )


def request(request_id: RequestId, method: str, params: object = UNSET) -> bytes:
    raw = params if isinstance(params, Raw | UnsetType) else Raw(_encoder.encode(params))
    return encode(Message(jsonrpc="2.0", id=request_id, method=method, params=raw))


def notification(method: str, params: object = UNSET) -> bytes:
    raw = params if isinstance(params, Raw | UnsetType) else Raw(_encoder.encode(params))
    return encode(Message(jsonrpc="2.0", method=method, params=raw))


def result_response(request_id: RequestId, result: object) -> bytes:
    raw = result if isinstance(result, Raw) else Raw(_encoder.encode(result))
    return encode(Message(jsonrpc="2.0", id=request_id, result=raw))


def error_response(request_id: RequestId, code: int, message: str, data: object = UNSET) -> bytes:
    raw_data = data if isinstance(data, Raw | UnsetType) else Raw(_encoder.encode(data))
    return encode(
        Message(
            jsonrpc="2.0",
            id=request_id,
            error=ErrorObject(code=code, message=message, data=raw_data),
        )
    )


def bad_line_response(bad: BadLine, line: bytes) -> bytes:
    if bad is BadLine.PARSE:
        return error_response(None, PARSE_ERROR, "Parse error: the line is not valid JSON")
    return error_response(
        salvage_id(line),
        INVALID_REQUEST,
        "Invalid request: not a JSON-RPC 2.0 request, notification or response",
    )


def params_structured(params: Raw | UnsetType) -> bool:
    """JSON-RPC 2.0 §4.2: ``params``, if present, is an object or an array.

    ``null`` is let through as if absent: some peers write it for "no params".
    """
    return params is UNSET or bytes(memoryview(params)[:1]) in (b"{", b"[", b"n")


def decode_object(raw: Raw | UnsetType) -> dict[str, Any] | None:
    """Decode params/result that must be a JSON object; anything else is ``None``."""
    if raw is UNSET:
        return None
    try:
        value = msgspec.json.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


# --- framing -----------------------------------------------------------------


class Batch:
    """Complete lines from one read.

    ``block`` is exactly the bytes of ``lines`` with their newlines, in order, so a
    relay that forwards every line unchanged can send ``block`` as it is; the lines
    are only split out when someone asks for them. ``overlong`` counts lines
    dropped for exceeding the size limit *before* these.
    """

    __slots__ = ("_count", "_lines", "block", "overlong")

    def __init__(self, block: bytes, overlong: int = 0, lines: list[bytes] | None = None) -> None:
        self.block = block
        self.overlong = overlong
        self._lines = lines
        self._count = -1

    @property
    def lines(self) -> list[bytes]:
        if self._lines is None:
            self._lines = self.block.split(b"\n")
            self._lines.pop()
        return self._lines

    @property
    def count(self) -> int:
        """Its lines (counted once: the relay and the turn both ask, and a count reads the whole block)."""
        if self._count < 0:
            self._count = len(self._lines) if self._lines is not None else self.block.count(b"\n")
        return self._count


class LineReader:
    """Splits a byte stream into lines, never holding more than ``max_line_bytes``.

    A line longer than the limit is discarded as it streams past (only the count
    of such lines is reported), so a peer cannot make the proxy buffer without
    bound. At end of stream an unterminated last line is delivered as a line.
    """

    def __init__(
        self,
        stream: ByteReceiveStream,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        read_size: int = READ_SIZE,
    ) -> None:
        self._stream = stream
        self._max = max_line_bytes
        self._read_size = read_size
        self._partial: list[bytes] = []
        self._partial_len = 0
        self._discarding = False
        self._eof = False

    async def receive_batch(self) -> Batch:
        """The next batch of lines; raises ``anyio.EndOfStream`` when none are left."""
        overlong = 0
        while True:
            if self._eof:
                raise anyio.EndOfStream
            try:
                chunk = await self._stream.receive(self._read_size)
            except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
                self._eof = True
                tail = b"".join(self._partial)
                self._partial.clear()
                if tail.strip():
                    return Batch(tail + b"\n", overlong)
                if overlong:
                    return Batch(b"", overlong)
                raise anyio.EndOfStream from None
            batch, overlong = self._feed(chunk, overlong)
            if batch is not None:
                return batch
            if overlong:
                return Batch(b"", overlong)

    def _feed(self, chunk: bytes, overlong: int) -> tuple[Batch | None, int]:
        if self._discarding:
            cut = chunk.find(b"\n")
            if cut < 0:
                return None, overlong
            self._discarding = False
            chunk = chunk[cut + 1 :]
        last_nl = chunk.rfind(b"\n")
        if last_nl < 0:
            self._keep_partial(chunk)
            if self._discarding:
                overlong += 1
            return None, overlong
        if self._partial:
            self._partial.append(chunk[: last_nl + 1])
            block = b"".join(self._partial)
            self._partial.clear()
            self._partial_len = 0
        else:
            block = chunk[: last_nl + 1] if last_nl + 1 < len(chunk) else chunk
        rest = chunk[last_nl + 1 :]
        if rest:
            self._keep_partial(rest)
            if self._discarding:
                overlong += 1
        if len(block) <= self._max:  # no line in it can be over the limit
            return Batch(block, overlong), 0
        lines = block.split(b"\n")
        lines.pop()
        kept = [line for line in lines if len(line) <= self._max]
        if len(kept) != len(lines):
            overlong += len(lines) - len(kept)
            block = b"".join(line + b"\n" for line in kept)
        return Batch(block, overlong, kept), 0

    def _keep_partial(self, piece: bytes) -> None:
        self._partial.append(piece)
        self._partial_len += len(piece)
        if self._partial_len > self._max:
            self._partial.clear()
            self._partial_len = 0
            self._discarding = True


class LineWriter:
    """Writes whole lines to a stream; concurrent writers never interleave.

    A plain flag rather than ``anyio.Lock``: a write to a pipe with room completes
    without yielding, so the common case costs one attribute check, and the
    event loop is only involved when a writer really has to wait.
    """

    def __init__(self, stream: ByteSendStream) -> None:
        self._stream = stream
        self._busy = False
        self._idle: anyio.Event | None = None

    async def send(self, data: bytes) -> None:
        while self._busy:
            if self._idle is None:
                self._idle = anyio.Event()
            await self._idle.wait()
        self._busy = True
        try:
            await self._stream.send(data)
        finally:
            self._busy = False
            if self._idle is not None:
                self._idle.set()
                self._idle = None

    async def aclose(self) -> None:
        await self._stream.aclose()
