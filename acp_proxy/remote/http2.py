"""HTTP/2 (RFC 9113) as ``serve``'s streamable HTTP uses it: the server's side of one connection. No I/O.

Bytes from the client go in (``receive``), events come out; what the server answers is queued as
frames (``respond``, ``send``, ``reset``, ``goaway``) and taken by ``data_to_send``. ``h2server.py``
runs the application over it. ``serve`` used hypercorn's HTTP/2 (h2's state machine): about 1.7 ms
of ``serve``'s CPU for a short turn, a POST and its 202 and a run of events, most of it in the
generality of h2's frame and stream objects. Here a request costs a few slices and its HPACK
decoding (the ``hpack`` library, h2's own), once for headers a client repeats, and an answer's
headers are literals never indexed, written without any encoder state.

What a streamable HTTP server needs and no more: cleartext with prior knowledge (h2c; behind TLS
hypercorn serves), no server push, priorities read and ignored, no extended CONNECT. Flow control
both ways: the client's windows bound what is sent, and a request's body is credited back as the
application takes it, so a connection holds at most ``window`` bytes the application has not read.
Every rule that changes a stream's or the connection's state is in this module.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum
from typing import Final

import hpack

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM: Final = 0x1
ACK: Final = 0x1
END_HEADERS: Final = 0x4
PADDED: Final = 0x8
PRIORITY_FLAG: Final = 0x20

HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE = (
    range(1, 7)
)
DEFAULT_WINDOW: Final = 65_535
DEFAULT_FRAME_SIZE: Final = 16_384
LARGEST_FRAME_SIZE: Final = 2**24 - 1
LARGEST_WINDOW: Final = 2**31 - 1

FRAME_HEAD: Final = struct.Struct(">BHBBL")
"""A frame's 9-byte header: its length (24 bits, as a byte and a short), type, flags and stream id."""

REQUEST_PSEUDO: Final = frozenset({b":method", b":scheme", b":authority", b":path"})
CONNECTION_SPECIFIC: Final = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"}
)
STATIC_STATUS: Final = {200: 8, 204: 9, 206: 10, 304: 11, 400: 12, 404: 13, 500: 14}
"""The statuses HPACK's static table holds whole (RFC 7541 appendix A): one byte each."""
REPEATED_BLOCKS: Final = 16
REPEATED_BLOCK_SIZE: Final = 2048
"""Header blocks kept decoded (``Http2Connection._decode``), the oldest let go first, and the largest kept: a
client's requests' headers, a few kinds of request each (at most 64 KiB a connection)."""


class Code(IntEnum):
    """HTTP/2 error codes (RFC 9113 section 7), in RST_STREAM and GOAWAY."""

    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    COMPRESSION_ERROR = 0x9
    ENHANCE_YOUR_CALM = 0xB


@dataclass(frozen=True, slots=True)
class Request:
    """A request's headers, pseudo-headers first, as the client sent them; ``ended``: it has no body."""

    stream_id: int
    headers: list[tuple[bytes, bytes]]
    ended: bool


@dataclass(frozen=True, slots=True)
class Body:
    """Part of a request's body (``b""`` when only its end came: an empty DATA frame, or trailers)."""

    stream_id: int
    data: bytes
    ended: bool


@dataclass(frozen=True, slots=True)
class Reset:
    """A stream the application was given has gone: the client reset it, or broke the protocol on it (and
    this end reset it)."""

    stream_id: int
    code: int


@dataclass(frozen=True, slots=True)
class Credit:
    """The client opened its flow-control windows: what waited for them may be sent now."""


@dataclass(frozen=True, slots=True)
class Closing:
    """No stream will open any more: the client sent GOAWAY (``error``: it reported one), or broke the
    protocol and this end's GOAWAY is queued (``error``, ``by_client`` false): the connection must go."""

    code: int
    message: str
    by_client: bool

    @property
    def error(self) -> bool:
        return self.code != Code.NO_ERROR


Event = Request | Body | Reset | Credit | Closing
CREDIT: Final = Credit()


class StreamGone(Exception):
    """``respond`` or ``send`` on a stream that is closed or was reset: its client no longer wants it."""


class _ProtocolError(Exception):
    """What the client broke, and the code that tells it so."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code


class _ConnectionError(_ProtocolError):
    """The connection must go (GOAWAY)."""


class _StreamError(_ProtocolError):
    """Only its stream goes (RST_STREAM)."""


class _Stream:
    __slots__ = ("delivered", "receive_window", "receiving", "send_window", "sending", "unacked")

    def __init__(self, send_window: int, receive_window: int) -> None:
        self.delivered = False
        """The application was given its request (a ``Reset`` is then an event for it)."""
        self.receiving = True
        """The client may still send on it (no END_STREAM from it yet)."""
        self.sending = True
        """This end may still send on it (no END_STREAM or RST_STREAM from it yet)."""
        self.send_window = send_window
        self.receive_window = receive_window
        self.unacked = 0
        """Bytes of its body the application took and the client was not yet credited for."""


class Http2Connection:
    """The server's end of one HTTP/2 connection; ``data_to_send`` holds this end's preface from the start.

    ``window``: the receive window of each stream and of the connection (what the client may send before the
    application takes it). ``max_streams``, ``max_header_list``: refused above these (REFUSED_STREAM; a
    connection error for a header block over the size, whose HPACK state could not be kept otherwise).
    """

    def __init__(
        self, *, window: int = 2**20, max_streams: int = 100, max_header_list: int = 2**16, max_frame: int = 2**14
    ) -> None:
        self.window = window
        self.max_streams = max_streams
        self.max_header_list = max_header_list
        self.max_frame = max_frame
        self.streams: dict[int, _Stream] = {}
        self.highest = 0
        """The highest stream id the client opened (GOAWAY names it; a lower unknown one is closed)."""
        self.closing: Closing | None = None
        self._failed = False
        self._said_goaway = False
        """This end found the client breaking the protocol: its GOAWAY is queued, nothing more is read."""
        self._preface = False
        self._settled = False
        """The client's first SETTINGS came (it must follow the preface)."""
        self._buffer = bytearray()
        self._out: list[bytes | bytearray | memoryview] = []
        """Frames queued, as parts: a DATA frame's payload is a view of what the application sent, copied once,
        when ``data_to_send`` joins them."""
        self._decoder = hpack.Decoder()
        self._decoder.max_header_list_size = max_header_list
        self._decoded: dict[bytes, tuple[tuple[bytes, bytes], ...]] = {}
        """Header blocks decoded since HPACK's table last changed, whose decoding left it as it was: by their
        bytes, what they decode to (``_decode``)."""
        self._block: tuple[int, int, bytearray] | None = None
        """A header block whose CONTINUATION frames are still to come: its stream, its HEADERS' flags, its bytes."""
        self._peer_window = DEFAULT_WINDOW
        """What this end may still send on the connection (the client's connection window)."""
        self._peer_initial = DEFAULT_WINDOW
        self._peer_frame = DEFAULT_FRAME_SIZE
        self._receive_window = window
        self._unacked = 0
        settings = [(MAX_CONCURRENT_STREAMS, max_streams), (INITIAL_WINDOW_SIZE, window), (ENABLE_PUSH, 0)]
        settings += [(MAX_FRAME_SIZE, max_frame), (MAX_HEADER_LIST_SIZE, max_header_list)]
        self._frame(SETTINGS, 0, 0, b"".join(struct.pack(">HL", key, value) for key, value in settings))
        if window > DEFAULT_WINDOW:
            self._frame(WINDOW_UPDATE, 0, 0, struct.pack(">L", window - DEFAULT_WINDOW))

    # --- what the client sent -------------------------------------------------------------------

    def receive(self, data: bytes) -> list[Event]:
        """The events ``data`` completes, in order; a connection error ends them with ``Closing`` (this end's
        GOAWAY queued) and nothing more is read."""
        events: list[Event] = []
        if self._failed:
            return events
        buffer = self._buffer
        buffer += data
        at = 0
        try:
            if not self._preface:
                if len(buffer) < len(PREFACE):
                    if not PREFACE.startswith(bytes(buffer)):
                        raise _ConnectionError(Code.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                    return events
                if buffer[: len(PREFACE)] != PREFACE:
                    raise _ConnectionError(Code.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                self._preface = True
                at = len(PREFACE)
            end = len(buffer)
            while end - at >= 9:
                high, low, kind, flags, stream_id = FRAME_HEAD.unpack_from(buffer, at)
                length = high << 16 | low
                if length > self.max_frame:
                    message = f"a frame of {length} bytes (at most {self.max_frame})"
                    raise _ConnectionError(Code.FRAME_SIZE_ERROR, message)
                if end - at - 9 < length:
                    break
                payload = bytes(buffer[at + 9 : at + 9 + length])
                at += 9 + length
                self._receive_frame(kind, flags, stream_id & LARGEST_WINDOW, payload, events)
        except _ConnectionError as exc:
            at = len(buffer)
            self._fail(exc.code, str(exc), events)
        del buffer[:at]
        return events

    def _receive_frame(self, kind: int, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if not self._settled and kind != SETTINGS:
            raise _ConnectionError(Code.PROTOCOL_ERROR, "the preface must be followed by SETTINGS")
        if self._block is not None and (kind != CONTINUATION or stream_id != self._block[0]):
            raise _ConnectionError(Code.PROTOCOL_ERROR, "a header block interrupted before its END_HEADERS")
        try:
            if kind == DATA:
                self._data(flags, stream_id, payload, events)
            elif kind == HEADERS:
                self._headers(flags, stream_id, payload, events)
            elif kind == CONTINUATION:
                self._continuation(flags, stream_id, payload, events)
            elif kind == SETTINGS:
                self._settings(flags, stream_id, payload, events)
            elif kind == WINDOW_UPDATE:
                self._window_update(stream_id, payload, events)
            elif kind == PING:
                if stream_id != 0:
                    raise _ConnectionError(Code.PROTOCOL_ERROR, "PING on a stream")
                if len(payload) != 8:
                    raise _ConnectionError(Code.FRAME_SIZE_ERROR, "PING of other than 8 bytes")
                if not flags & ACK:
                    self._frame(PING, ACK, 0, payload)
            elif kind == RST_STREAM:
                self._rst_stream(stream_id, payload, events)
            elif kind == PRIORITY:
                if stream_id == 0:
                    raise _ConnectionError(Code.PROTOCOL_ERROR, "PRIORITY on stream 0")
                if len(payload) != 5:
                    raise _StreamError(Code.FRAME_SIZE_ERROR, "PRIORITY of other than 5 bytes")
            elif kind == GOAWAY:
                if stream_id != 0 or len(payload) < 8:
                    raise _ConnectionError(Code.PROTOCOL_ERROR, "a malformed GOAWAY")
                code = int.from_bytes(payload[4:8], "big")
                if self.closing is None:
                    self.closing = Closing(code, payload[8:].decode("utf-8", "replace"), by_client=True)
                    events.append(self.closing)
            elif kind == PUSH_PROMISE:
                raise _ConnectionError(Code.PROTOCOL_ERROR, "PUSH_PROMISE from a client")
            # Frames of other types are ignored (RFC 9113 section 4.1).
        except _StreamError as exc:
            self._reset_for_error(stream_id, exc.code, events)

    def _data(self, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if stream_id == 0:
            raise _ConnectionError(Code.PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)  # padding included: flow control counts the whole payload
        self._receive_window -= size
        if self._receive_window < 0:
            raise _ConnectionError(Code.FLOW_CONTROL_ERROR, "DATA beyond the connection's window")
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id > self.highest:
                raise _ConnectionError(Code.PROTOCOL_ERROR, "DATA on a stream never opened")
            self._credit(None, size)  # a stream closed (or reset) here: what was in flight is dropped
            return
        data = _unpad(flags, payload)
        if not stream.receiving:
            self._credit(None, size)
            raise _StreamError(Code.STREAM_CLOSED, "DATA after the request's end")
        stream.receive_window -= size
        if stream.receive_window < 0:
            raise _StreamError(Code.FLOW_CONTROL_ERROR, "DATA beyond the stream's window")
        if size > len(data):
            self._credit(stream_id, size - len(data))  # padding: nobody will take it
        ended = bool(flags & END_STREAM)
        if ended:
            self._end_receiving(stream_id, stream)
        events.append(Body(stream_id, data, ended))

    def _headers(self, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if stream_id == 0:
            raise _ConnectionError(Code.PROTOCOL_ERROR, "HEADERS on stream 0")
        fragment = _unpad(flags, payload)
        if flags & PRIORITY_FLAG:
            if len(fragment) < 5:
                raise _ConnectionError(Code.FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            fragment = fragment[5:]
        if flags & END_HEADERS:
            self._header_block(stream_id, flags, fragment, events)
        else:
            self._block = (stream_id, flags, bytearray(fragment))

    def _continuation(self, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if self._block is None:
            raise _ConnectionError(Code.PROTOCOL_ERROR, "CONTINUATION without HEADERS")
        _, first_flags, block = self._block
        block += payload
        if len(block) > self.max_header_list:
            raise _ConnectionError(Code.ENHANCE_YOUR_CALM, f"a header block over {self.max_header_list} bytes")
        if flags & END_HEADERS:
            self._block = None
            self._header_block(stream_id, first_flags, bytes(block), events)

    def _header_block(self, stream_id: int, flags: int, block: bytes, events: list[Event]) -> None:
        """A whole header block: decoded whatever becomes of its stream, since HPACK's table is the connection's."""
        try:
            headers = self._decode(block)
        except hpack.OversizedHeaderListError as exc:
            raise _ConnectionError(Code.ENHANCE_YOUR_CALM, f"a header list too large: {exc}") from None
        except hpack.HPACKError as exc:
            raise _ConnectionError(Code.COMPRESSION_ERROR, f"a header block that does not decode: {exc}") from None
        ended = bool(flags & END_STREAM)
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers: their fields mean nothing here, the body's end does
            if not stream.receiving:
                raise _StreamError(Code.STREAM_CLOSED, "HEADERS after the request's end")
            if not ended:
                raise _StreamError(Code.PROTOCOL_ERROR, "trailers without END_STREAM")
            self._end_receiving(stream_id, stream)
            events.append(Body(stream_id, b"", True))
            return
        if stream_id <= self.highest:
            return  # a stream closed here (or reset): its header block kept HPACK's state, nothing more
        if stream_id % 2 == 0:
            raise _ConnectionError(Code.PROTOCOL_ERROR, "a client opened an even-numbered stream")
        self.highest = stream_id
        if self.closing is not None:
            self._frame(RST_STREAM, 0, stream_id, struct.pack(">L", Code.REFUSED_STREAM))
            return
        if len(self.streams) >= self.max_streams:
            self._frame(RST_STREAM, 0, stream_id, struct.pack(">L", Code.REFUSED_STREAM))
            return
        fields = list(headers)
        problem = malformed(fields)
        if problem is not None:
            self._frame(RST_STREAM, 0, stream_id, struct.pack(">L", Code.PROTOCOL_ERROR))
            return
        stream = self.streams[stream_id] = _Stream(self._peer_initial, self.window)
        stream.delivered = True
        if ended:
            stream.receiving = False
        events.append(Request(stream_id, fields, ended))

    def _decode(self, block: bytes) -> tuple[tuple[bytes, bytes], ...]:
        """What a header block decodes to. A client repeats its requests' headers block for block (literals, or
        references to what its first request indexed), and decoding one was most of a short request's cost:
        a block whose decoding left HPACK's table as it was decodes the same way until the table changes, so
        it is kept until then. The table changes only by an insertion (a new first entry, held here so that
        no other can take its identity) or a size update (its size, or its length)."""
        known = self._decoded.get(block)
        if known is not None:
            return known
        table = self._decoder.header_table
        entries = table.dynamic_entries
        size, length, first = table.maxsize, len(entries), entries[0] if entries else None
        headers = tuple((bytes(name), bytes(value)) for name, value in self._decoder.decode(block, raw=True))
        if table.maxsize != size or len(entries) != length or (entries[0] if entries else None) is not first:
            self._decoded.clear()  # what was kept was decoded with the table as it was
        elif len(block) <= REPEATED_BLOCK_SIZE:
            if len(self._decoded) >= REPEATED_BLOCKS:
                del self._decoded[next(iter(self._decoded))]
            self._decoded[block] = headers
        return headers

    def _settings(self, flags: int, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if stream_id != 0:
            raise _ConnectionError(Code.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise _ConnectionError(Code.FRAME_SIZE_ERROR, "a SETTINGS acknowledgement with a payload")
            return
        if len(payload) % 6:
            raise _ConnectionError(Code.FRAME_SIZE_ERROR, "SETTINGS of other than a multiple of 6 bytes")
        self._settled = True
        credit = False
        for key, value in struct.iter_unpack(">HL", payload):
            if key == INITIAL_WINDOW_SIZE:
                if value > LARGEST_WINDOW:
                    raise _ConnectionError(Code.FLOW_CONTROL_ERROR, "an initial window over 2^31-1")
                delta, self._peer_initial = value - self._peer_initial, value
                for stream in self.streams.values():
                    stream.send_window += delta
                    if stream.send_window > LARGEST_WINDOW:
                        raise _ConnectionError(Code.FLOW_CONTROL_ERROR, "a stream's window over 2^31-1")
                credit = credit or delta > 0
            elif key == MAX_FRAME_SIZE:
                if not DEFAULT_FRAME_SIZE <= value <= LARGEST_FRAME_SIZE:
                    raise _ConnectionError(Code.PROTOCOL_ERROR, f"a maximum frame size of {value}")
                self._peer_frame = value
            elif key == ENABLE_PUSH and value > 1:
                raise _ConnectionError(Code.PROTOCOL_ERROR, f"ENABLE_PUSH {value}")
            # The others bound what the client receives, and this end sends nothing they would limit: no
            # push, no stream of its own, header blocks never indexed (so no dynamic table to size).
        self._frame(SETTINGS, ACK, 0, b"")
        if credit:
            events.append(CREDIT)

    def _window_update(self, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if len(payload) != 4:
            raise _ConnectionError(Code.FRAME_SIZE_ERROR, "WINDOW_UPDATE of other than 4 bytes")
        increment = int.from_bytes(payload, "big") & LARGEST_WINDOW
        if stream_id == 0:
            if increment == 0:
                raise _ConnectionError(Code.PROTOCOL_ERROR, "a connection WINDOW_UPDATE of 0")
            self._peer_window += increment
            if self._peer_window > LARGEST_WINDOW:
                raise _ConnectionError(Code.FLOW_CONTROL_ERROR, "the connection's window over 2^31-1")
        else:
            stream = self.streams.get(stream_id)
            if stream is None:
                if stream_id > self.highest:
                    raise _ConnectionError(Code.PROTOCOL_ERROR, "WINDOW_UPDATE on a stream never opened")
                return
            if increment == 0:
                raise _StreamError(Code.PROTOCOL_ERROR, "a stream WINDOW_UPDATE of 0")
            stream.send_window += increment
            if stream.send_window > LARGEST_WINDOW:
                raise _StreamError(Code.FLOW_CONTROL_ERROR, "a stream's window over 2^31-1")
        if not events or events[-1] is not CREDIT:
            events.append(CREDIT)

    def _rst_stream(self, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if stream_id == 0:
            raise _ConnectionError(Code.PROTOCOL_ERROR, "RST_STREAM on stream 0")
        if len(payload) != 4:
            raise _ConnectionError(Code.FRAME_SIZE_ERROR, "RST_STREAM of other than 4 bytes")
        if stream_id > self.highest:
            raise _ConnectionError(Code.PROTOCOL_ERROR, "RST_STREAM on a stream never opened")
        self._drop(stream_id, int.from_bytes(payload, "big"), events)

    def _reset_for_error(self, stream_id: int, code: Code, events: list[Event]) -> None:
        self._frame(RST_STREAM, 0, stream_id, struct.pack(">L", code))
        self._drop(stream_id, code, events)

    def _drop(self, stream_id: int, code: int, events: list[Event]) -> None:
        """The stream is reset: gone here, and its application told if it was given the request."""
        stream = self.streams.pop(stream_id, None)
        if stream is not None and stream.delivered:
            events.append(Reset(stream_id, code))

    def _end_receiving(self, stream_id: int, stream: _Stream) -> None:
        stream.receiving = False
        if not stream.sending:
            del self.streams[stream_id]

    def _fail(self, code: Code, message: str, events: list[Event]) -> None:
        self._failed = True
        self._frame(GOAWAY, 0, 0, struct.pack(">LL", self.highest, code) + message.encode()[:256])
        self.closing = Closing(code, message, by_client=False)
        events.append(self.closing)

    # --- what this end sends --------------------------------------------------------------------

    def taken(self, stream_id: int, size: int) -> None:
        """The application took ``size`` bytes of a request's body: the client may send as much again."""
        self._credit(stream_id, size)

    def _credit(self, stream_id: int | None, size: int) -> None:
        if not size:
            return
        self._unacked += size
        if self._unacked >= self.window // 4:  # a few large updates, not one per small body
            self._frame(WINDOW_UPDATE, 0, 0, struct.pack(">L", self._unacked))
            self._receive_window += self._unacked
            self._unacked = 0
        stream = self.streams.get(stream_id) if stream_id is not None else None
        if stream is not None and stream.receiving:  # a stream whose body is over needs no more
            stream.unacked += size
            if stream.unacked >= self.window // 4:
                self._frame(WINDOW_UPDATE, 0, stream_id or 0, struct.pack(">L", stream.unacked))
                stream.receive_window += stream.unacked
                stream.unacked = 0

    def respond(self, stream_id: int, status: int, headers: Iterable[tuple[bytes, bytes]], *, end: bool) -> None:
        """The response's headers (``end``: and no body). ``StreamGone`` if the client has reset the stream."""
        stream = self._sendable(stream_id)
        block = bytearray()
        index = STATIC_STATUS.get(status)
        if index is not None:
            block.append(0x80 | index)
        else:
            block.append(0x08)  # a literal not indexed, with the name of static entry 8 (":status")
            _string(block, b"%d" % status)
        lowered = ((name.lower(), value) for name, value in headers)
        literal_fields(block, [(name, value) for name, value in lowered if name not in CONNECTION_SPECIFIC])
        flags = END_STREAM if end else 0
        size = self._peer_frame
        if len(block) <= size:
            self._frame(HEADERS, flags | END_HEADERS, stream_id, block)
        else:
            self._frame(HEADERS, flags, stream_id, block[:size])
            for at in range(size, len(block), size):
                last = at + size >= len(block)
                self._frame(CONTINUATION, END_HEADERS if last else 0, stream_id, block[at : at + size])
        if end:
            self._end_sending(stream_id, stream)

    def send(self, stream_id: int, data: bytes | memoryview, *, end: bool) -> int:
        """Frame as much of ``data`` as the client's windows allow; how many bytes that was. ``end``: the body
        ends with ``data`` (its last frame says so once all of it went). ``StreamGone`` if reset or closed."""
        stream = self._sendable(stream_id)
        size = len(data)
        room = min(self._peer_window, stream.send_window)
        sent = 0
        frame = self._peer_frame
        while sent < size and room > 0:
            count = min(size - sent, room, frame)
            last = end and sent + count == size
            self._frame(DATA, END_STREAM if last else 0, stream_id, data[sent : sent + count])
            sent += count
            room -= count
        self._peer_window -= sent
        stream.send_window -= sent
        if end and sent == size:
            if size == 0:
                self._frame(DATA, END_STREAM, stream_id, b"")
            self._end_sending(stream_id, stream)
        return sent

    def reset(self, stream_id: int, code: Code = Code.CANCEL) -> None:
        """Abandon a stream (RST_STREAM), if it is still open."""
        stream = self.streams.pop(stream_id, None)
        if stream is not None:
            self._frame(RST_STREAM, 0, stream_id, struct.pack(">L", code))

    def goaway(self) -> None:
        """No new stream from now on; those the client opened are served (a second call adds nothing)."""
        if not self._said_goaway and not self._failed:
            self._said_goaway = True
            self._frame(GOAWAY, 0, 0, struct.pack(">LL", self.highest, Code.NO_ERROR))
            if self.closing is None:
                self.closing = Closing(Code.NO_ERROR, "the server is going away", by_client=False)

    def sendable(self, stream_id: int) -> int:
        """How many bytes of DATA the client's windows let this end send on the stream now."""
        stream = self.streams.get(stream_id)
        return min(self._peer_window, stream.send_window) if stream is not None and stream.sending else 0

    @property
    def pending(self) -> bool:
        """Frames are queued for ``data_to_send``."""
        return bool(self._out)

    def data_to_send(self) -> bytes:
        out = b"".join(self._out)
        self._out.clear()
        return out

    def _sendable(self, stream_id: int) -> _Stream:
        stream = self.streams.get(stream_id)
        if stream is None or not stream.sending:
            raise StreamGone(f"stream {stream_id} is closed")
        return stream

    def _end_sending(self, stream_id: int, stream: _Stream) -> None:
        stream.sending = False
        del self.streams[stream_id]
        if stream.receiving:  # answered before the request's end: the client may stop sending it (8.1)
            self._frame(RST_STREAM, 0, stream_id, struct.pack(">L", Code.NO_ERROR))

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes | bytearray | memoryview) -> None:
        length = len(payload)
        self._out += (FRAME_HEAD.pack(length >> 16, length & 0xFFFF, kind, flags, stream_id), payload)


def malformed(headers: list[tuple[bytes, bytes]]) -> str | None:
    """Why a request's header list is malformed (RFC 9113 section 8.3), or ``None``."""
    seen: set[bytes] = set()
    regular = False
    for name, value in headers:
        if name.startswith(b":"):
            if regular:
                return "a pseudo-header after a regular field"
            if name not in REQUEST_PSEUDO or name in seen:
                return f"pseudo-header {name!r} unknown or repeated"
            seen.add(name)
            continue
        regular = True
        if name != name.lower() or not name:
            return f"field name {name!r} not lowercase"
        if name in CONNECTION_SPECIFIC or (name == b"te" and value != b"trailers"):
            return f"connection-specific field {name!r}"
    required = {b":method"} if (b":method", b"CONNECT") in headers else {b":method", b":scheme", b":path"}
    missing = required - seen
    return f"missing {sorted(missing)}" if missing else None


def _unpad(flags: int, payload: bytes) -> bytes:
    if not flags & PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise _ConnectionError(Code.PROTOCOL_ERROR, "padding as long as the frame")
    return payload[1 : len(payload) - payload[0]]


def literal_fields(block: bytearray, fields: Iterable[tuple[bytes, bytes]]) -> None:
    """Add ``fields`` to an HPACK header block as literals not indexed, with literal names (RFC 7541 6.2.2):
    no table state on either side."""
    for name, value in fields:
        block.append(0x00)
        _string(block, name)
        _string(block, value)


def _string(block: bytearray, text: bytes) -> None:
    """An HPACK string literal, not Huffman-coded: its length (a 7-bit prefix integer) and its bytes."""
    size = len(text)
    if size < 0x7F:
        block.append(size)
    else:
        block.append(0x7F)
        size -= 0x7F
        while size >= 0x80:
            block.append(size & 0x7F | 0x80)
            size >>= 7
        block.append(size)
    block += text
