"""WebSocket frames (RFC 6455) as ACP uses them: text messages, pings, the close. No I/O.

Both ends of ``/acp`` read and write their data frames here rather than through wsproto (which
still does the handshakes): its general parser and writer cost about 20 µs a frame, which a
streaming turn pays for every update. No extension is ever negotiated, so a frame is a header and
its payload: a client's frames are masked, a server's never are. Binary messages are read and
dropped (ACP is text frames).
"""

from __future__ import annotations

import os
import struct
from collections import deque
from collections.abc import Iterable
from typing import Final

TEXT, BINARY, CONTINUATION, CLOSE, PING, PONG = 0x1, 0x2, 0x0, 0x8, 0x9, 0xA
PROTOCOL_ERROR: Final = 1002
NOT_UTF8: Final = 1007
TOO_BIG: Final = 1009
NO_STATUS: Final = 1005


class ProtocolError(Exception):
    """What the other end sent is not a WebSocket this end may accept: ``code`` is the close code to answer."""

    def __init__(self, message: str, code: int = PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.code = code


def _apply_mask(payload: bytes | bytearray, key: bytes | bytearray) -> bytes:
    """``payload`` masked with ``key``, or unmasked: RFC 6455's XOR with the key repeated is its own inverse."""
    size = len(payload)
    keys = (key * (size // 4 + 1))[:size]
    return (int.from_bytes(payload, "little") ^ int.from_bytes(keys, "little")).to_bytes(size, "little")


class FrameReader:
    """The other end's frames from bytes as they arrive: complete text messages (fragments joined) go to
    ``texts``, pings to ``pings``, its close to ``closed``; ``ProtocolError`` for what it may not send.

    ``masked``: the frames are a client's (each masked; a server reads them). ``max_message``: a message
    longer than this is refused (code 1009) as soon as its length is known, before it is buffered.
    """

    def __init__(self, *, masked: bool = False, max_message: int | None = None) -> None:
        self._masked = masked
        self._max_message = max_message
        self._buffer = bytearray()
        self._fragments: list[bytes] = []
        self._size = 0
        self._message: int | None = None
        """The opcode of the message whose fragments are being joined (``None``: none under way)."""
        self.texts: deque[str] = deque()
        self.pings: list[bytes] = []
        self.closed: tuple[int | None, str] | None = None

    def feed(self, data: bytes) -> None:
        """Parse ``data`` after what came before (nothing is read after a close)."""
        buffer = self._buffer
        buffer += data  # amortized: a frame that comes a byte at a time is not copied again for each
        at, end = 0, len(buffer)
        masked = self._masked
        limit = self._max_message
        texts = self.texts
        try:
            if not masked and self._message is None and self.closed is None:
                at = self._server_texts(buffer, end)
            while end - at >= 2 and self.closed is None:
                first, second = buffer[at], buffer[at + 1]
                if first & 0x70:
                    raise ProtocolError("a reserved bit set: no extension was negotiated")
                if bool(second & 0x80) is not masked:
                    raise ProtocolError("a masked frame from a server" if not masked else "an unmasked client frame")
                length, head = second & 0x7F, at + 2
                if length == 126:
                    if end - at < 4:
                        break
                    length, head = int.from_bytes(buffer[head : head + 2], "big"), head + 2
                elif length == 127:
                    if end - at < 10:
                        break
                    length, head = int.from_bytes(buffer[head : head + 8], "big"), head + 8
                if limit is not None and self._size + length > limit:
                    raise ProtocolError(f"a message over {limit} bytes", TOO_BIG)
                if masked:
                    if end - head < 4:
                        break
                    key, head = buffer[head : head + 4], head + 4
                stop = head + length
                if stop > end:
                    break
                payload: bytes | bytearray = buffer[head:stop]  # the one copy of it
                at = stop
                if masked:
                    payload = _apply_mask(payload, key)
                if first == 0x80 | TEXT and self._message is None:  # a whole message in one frame: nearly all
                    try:
                        texts.append(payload.decode())
                    except UnicodeDecodeError:
                        raise ProtocolError("a text message that is not UTF-8", NOT_UTF8) from None
                else:
                    self._frame(bool(first & 0x80), first & 0x0F, bytes(payload))
        finally:
            del buffer[:at]

    def _server_texts(self, buffer: bytearray, end: int) -> int:
        """The run of whole text messages a server sends, each in one frame, up to ``end``: decoded straight
        from ``buffer`` into ``texts``. Where the first other frame starts (``feed`` reads it and the rest,
        and names what is wrong with one)."""
        at, limit, add = 0, self._max_message, self.texts.append
        with memoryview(buffer) as view:
            while end - at >= 2 and buffer[at] == 0x81:  # FIN and text: a whole message
                length = buffer[at + 1]
                if length < 126:
                    head = at + 2
                elif length == 126 and end - at >= 4:
                    length, head = buffer[at + 2] << 8 | buffer[at + 3], at + 4
                else:
                    break  # a masked frame, a length of 64 bits, or a head not all here
                stop = head + length
                if stop > end or (limit is not None and length > limit):
                    break
                try:
                    add(str(view[head:stop], "utf-8"))
                except UnicodeDecodeError:
                    break
                at = stop
        return at

    def _frame(self, fin: bool, opcode: int, payload: bytes) -> None:
        if opcode >= CLOSE:
            if not fin or len(payload) > 125:
                raise ProtocolError("a fragmented or long control frame")
            if opcode == PING:
                self.pings.append(payload)
            elif opcode == CLOSE:
                code = int.from_bytes(payload[:2], "big") if len(payload) >= 2 else None
                self.closed = (code, payload[2:].decode("utf-8", "replace"))
            elif opcode != PONG:
                raise ProtocolError(f"unknown control opcode {opcode}")
            return
        if opcode == CONTINUATION:
            if self._message is None:
                raise ProtocolError("a continuation frame with no message under way")
        elif opcode in (TEXT, BINARY):
            if self._message is not None:
                raise ProtocolError("a new message before the last one ended")
            self._message = opcode
        else:
            raise ProtocolError(f"unknown opcode {opcode}")
        if self._message == TEXT:
            self._fragments.append(payload)
            self._size += len(payload)
        if fin:
            if self._message == TEXT:  # binary messages are dropped (ACP is text frames)
                joined = self._fragments[0] if len(self._fragments) == 1 else b"".join(self._fragments)
                try:
                    self.texts.append(joined.decode())
                except UnicodeDecodeError:
                    raise ProtocolError("a text message that is not UTF-8", NOT_UTF8) from None
            self._fragments.clear()
            self._size = 0
            self._message = None


_MEDIUM: Final = struct.Struct("!BBH")
_LONG: Final = struct.Struct("!BBQ")


def _header(first: int, size: int, mask_bit: int = 0) -> bytes:
    if size < 126:
        return bytes((first, mask_bit | size))
    if size < 65536:
        return _MEDIUM.pack(first, mask_bit | 126, size)
    return _LONG.pack(first, mask_bit | 127, size)


_SHORT_TEXT_HEADS: Final = tuple(_header(0x80 | TEXT, n) for n in range(126))


def text_frames(lines: Iterable[bytes]) -> bytes:
    """A server's frames: one final text frame for each line (its trailing newline left out), as one block."""
    parts: list[bytes | memoryview] = []
    add = parts.append
    short, medium = _SHORT_TEXT_HEADS, _MEDIUM.pack
    for line in lines:
        payload = memoryview(line)[:-1] if line[-1:] == b"\n" else line
        size = len(payload)
        add(short[size] if size < 126 else medium(0x81, 126, size) if size < 65536 else _header(0x81, size))
        add(payload)
    return b"".join(parts)


def frame(opcode: int, payload: bytes) -> bytes:
    """A server's final frame of ``opcode`` (a binary message, a ping, a pong)."""
    return _header(0x80 | opcode, len(payload)) + payload


def may_send(code: int) -> bool:
    """Whether a close frame may carry ``code`` (RFC 6455 7.4: 1005, 1006 and 1015 only say what happened)."""
    return (1000 <= code <= 1014 and code not in (1004, 1005, 1006)) or 3000 <= code <= 4999


def close_frame(code: int, reason: str = "") -> bytes:
    """A close frame (a server's) with ``code`` and ``reason``, cut to fit a control frame on a character's
    boundary (a close whose reason is not UTF-8 is a protocol error to the other end)."""
    cut = reason.encode()[:123].decode("utf-8", "ignore").encode()
    return frame(CLOSE, code.to_bytes(2, "big") + cut)


def client_frame(opcode: int, payload: bytes, key: bytes | None = None) -> bytes:
    """A client's final frame: masked with ``key`` (four random bytes unless given)."""
    key = os.urandom(4) if key is None else key
    return _header(0x80 | opcode, len(payload), 0x80) + key + _apply_mask(payload, key)
