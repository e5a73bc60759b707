"""Server->client messages of one connection of ``serve``, each to its stream: bounded, and kept for a
client that resumes a stream (``remote.replay``)."""

from __future__ import annotations

import enum
import math
import secrets
from collections import deque
from collections.abc import Callable, Iterable

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from acp_proxy.remote.replay import Replay, ReplayLimits, with_cursor


class _Waited(enum.Enum):
    SENT = "sent"
    ROUTE_AGAIN = "route again"
    GIVEN_UP = "given up"


class Outbox:
    """Server->client messages of one connection, each to its stream, bounded.

    A WebSocket has one stream (``None``). Streamable HTTP has the connection-scoped stream
    (``None``) and one per session; a message for a session that never had a stream of its own goes
    to the connection's, and while its stream is not open a message waits in a backlog (a dropped
    stream's until it is opened again, resumed or not). When ``max_pending``
    messages wait, the proxy's output waits too (and so, through its pipe, does the agent): a
    client that reads slower than the agent writes slows it down. A client that takes nothing for
    ``stall_timeout`` while messages wait (its writer got nothing through to it) is not reading: the
    connection is told (``on_stalled``), and ends, or lets the client's socket go and waits for a
    resume (``patient``).
    """

    def __init__(
        self,
        max_pending: int,
        stall_timeout: float,
        on_stalled: Callable[[], bool | None],
        replay: ReplayLimits | None = None,
    ) -> None:
        self.max_pending = max_pending
        self.stall_timeout = stall_timeout
        self._on_stalled = on_stalled
        self._streams: dict[str | None, tuple[MemoryObjectSendStream[bytes], MemoryObjectReceiveStream[bytes]]] = {}
        self._backlog: deque[tuple[str | None, bytes]] = deque()
        self._changed = anyio.Event()
        self.closed = False
        self.replay_limits = replay
        """Event streams keep what they wrote for a client that resumes them (``remote.replay``); ``None``: not."""
        self._replays: dict[str | None, Replay] = {}
        self._epoch = secrets.token_hex(4)
        self._had_stream: set[str | None] = set()
        """Targets that had a stream of their own: while it is gone (dropped, to be resumed), their messages
        wait for it rather than go to the connection's stream."""
        self._wrote: dict[str | None, float] = {}
        """When each target's writer last got a run through to its client (``wrote``)."""
        self.readers: dict[str | None, anyio.Event] = {}
        """Set when the reader of ``target``'s latest stream has ended (everything it took is recorded)."""
        self.cursor_meta = False
        """Whether each message carries its cursor as ``_meta["acp/cursor"]`` too (the client asked)."""
        self.patient = False
        """While its client is away and may resume: what waits for it waits with no deadline (and, through the
        proxy's pipe, so does the agent)."""

    async def put(self, target: str | None, line: bytes) -> None:
        """Queue ``line`` for ``target``'s stream, waiting while it is full (up to ``stall_timeout``, then the
        connection is told its client is not reading; while ``patient``, for as long as it takes)."""
        deadline = math.inf  # set at the first wait: a line with room to go (nearly every one) reads no clock
        while not self.closed:
            key = self._key(target)
            pair = self._streams.get(key)
            if pair is None:
                if len(self._backlog) < self.max_pending:
                    self._backlog.append((target, line))
                    return
                changed = self._changed
                deadline = self._deadline(deadline)
                with anyio.move_on_at(math.inf if self.patient else deadline):
                    await changed.wait()  # a stream opened (or the connection ended)
                    continue
            else:
                try:
                    pair[0].send_nowait(line)  # no yield while there is room: the stream's reader
                    return  # then finds a run of messages to write at once
                except anyio.WouldBlock:
                    pass
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    continue  # that stream was replaced or its reader left: route again
                waited = await self._send_when_room(pair[0], line, key)
                if waited is not _Waited.ROUTE_AGAIN:
                    return  # sent, or the connection gave its client up (the line goes with it)
                deadline = math.inf  # the stream closed (replaced, or its client's socket let go): wait afresh
                continue
            if not self._on_stalled():
                return  # the connection ends: the line goes with it
            deadline = math.inf  # its client's socket was let go: route again, and wait afresh

    async def _send_when_room(self, stream: MemoryObjectSendStream[bytes], line: bytes, key: str | None) -> _Waited:
        """Send ``line`` once ``stream`` has room. The send is never cancelled for a deadline (one cancelled as
        its line was being taken would leave the line sent and the caller sending it again): a watch beside it
        tells the connection of a stall, once its writer has got nothing through for ``stall_timeout``."""
        outcome = _Waited.SENT

        async def watch(scope: anyio.CancelScope) -> None:
            nonlocal outcome
            deadline = anyio.current_time() + self.stall_timeout
            while True:
                await anyio.sleep_until(deadline)
                wrote = self._wrote.get(key, -math.inf) + self.stall_timeout
                if wrote <= anyio.current_time():
                    break
                deadline = wrote  # its writer got a run through meanwhile: a client reading slowly
            if not self._on_stalled():  # the connection ends
                outcome = _Waited.GIVEN_UP
                scope.cancel()
            # else its client's socket is let go: the stream closes and the send fails (route again)

        async with anyio.create_task_group() as waiting:
            waiting.start_soon(watch, waiting.cancel_scope)
            try:
                await stream.send(line)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                outcome = _Waited.ROUTE_AGAIN
            waiting.cancel_scope.cancel()
        return outcome

    async def put_all(self, items: Iterable[tuple[str | None, bytes]]) -> None:
        """``put`` each of ``items`` (target, line), in order: a run of a proxy's output handed over as one, each
        line with room on its stream taken at once, the rest waiting as ``put`` waits."""
        for target, line in items:
            if not self.closed:
                pair = self._streams.get(self._key(target))
                if pair is not None:
                    try:
                        pair[0].send_nowait(line)
                        continue
                    except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
                        pass  # full, or replaced: ``put`` routes it again, and waits
            await self.put(target, line)

    def _key(self, target: str | None) -> str | None:
        """The stream ``target``'s messages go to: its own, or (a session that never had one) the connection's."""
        return target if target in self._streams or target in self._had_stream else None

    def wrote(self, target: str | None) -> None:
        """``target``'s writer got a run to its client: a client reading slowly (a large replay, a slow link)
        is not one that stopped reading, so no ``put`` waiting for that stream is a stall before
        ``stall_timeout`` has passed since."""
        self._wrote[target] = anyio.current_time()

    def _deadline(self, deadline: float) -> float:
        """``put``'s deadline: ``stall_timeout`` from its first wait."""
        return anyio.current_time() + self.stall_timeout if deadline == math.inf else deadline

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def has_stream(self, target: str | None) -> bool:
        return target in self._streams

    def open(self, target: str | None) -> MemoryObjectReceiveStream[bytes]:
        """A stream for ``target``; one already open for it is replaced (its reader ends, and what it had not
        taken yet goes to the new one)."""
        self.end_stream(target)
        send, receive = anyio.create_memory_object_stream[bytes](self.max_pending)
        self._streams[target] = (send, receive)
        self._had_stream.add(target)
        kept: deque[tuple[str | None, bytes]] = deque()
        for item_target, line in self._backlog:
            if item_target == target or (target is None and item_target not in self._had_stream):
                send.send_nowait(line)  # the backlog is bounded by the same size
            else:
                kept.append((item_target, line))
        self._backlog = kept
        self._notify()
        return receive

    def release(self, target: str | None, stream: MemoryObjectReceiveStream[bytes]) -> None:
        """The reader of ``target``'s stream has gone (its HTTP response ended): what it had not taken
        waits for the next stream, as if never sent."""
        current = self._streams.get(target)
        if current is not None and current[1] is stream:
            current[0].close()
            del self._streams[target]
            self._backlog.extendleft(reversed([(target, line) for line in _untaken(stream)]))
            self._notify()
        stream.close()

    def end_stream(self, target: str | None) -> None:
        """End ``target``'s stream, if open (its reader ends on what it was handed; what it had not taken
        waits for the next stream)."""
        current = self._streams.get(target)
        if current is not None:
            self.release(target, current[1])

    def record(self, target: str | None, lines: list[bytes], now: float) -> tuple[list[str] | None, list[bytes]]:
        """``lines`` are being written to ``target``'s stream at ``now`` (``anyio.current_time``, read once for
        the run): kept for a resume. Their cursors (``None``: nothing is kept), and the lines as written: with
        its cursor in each envelope's ``_meta`` when the client asked for that."""
        if self.replay_limits is None:
            return None, lines
        replay = self._replay(target)
        if not self.cursor_meta:
            return replay.record_run(lines, now), lines
        cursors = replay.next_cursors(len(lines))
        written = [with_cursor(line, cursor) for line, cursor in zip(lines, cursors, strict=True)]
        replay.record_lines(written, now)
        return cursors, written

    def record_events(self, target: str | None, lines: list[bytes], now: float) -> bytes:
        """``lines`` as the server-sent events of ``target``'s stream, written at ``now``: each with its cursor as
        its ``id:`` when the stream keeps what it writes (``record``), ready to write at once."""
        if self.replay_limits is None:
            return b"".join([b"data: %b\n\n" % line for line in lines])
        replay = self._replay(target)
        first = replay.record_lines(lines, now)
        prefix = replay.prefix.encode()
        return b"".join([b"id: %b%d\ndata: %b\n\n" % (prefix, first + n, line) for n, line in enumerate(lines)])

    def _replay(self, target: str | None) -> Replay:
        assert self.replay_limits is not None
        replay = self._replays.get(target)
        if replay is None:
            replay = self._replays[target] = Replay(f"{self._epoch}{len(self._replays)}", self.replay_limits)
        return replay

    def missed(self, target: str | None, cursor: str | None) -> list[tuple[str, bytes]] | None:
        """What ``target``'s stream wrote after ``cursor`` (``None``: from its first message, if all of it is
        still kept); ``None``: it cannot say."""
        replay = self._replays.get(target)
        if replay is None:
            return [] if cursor is None else None
        return replay.after(replay.cursor(0) if cursor is None else cursor, anyio.current_time())

    async def resume(self, target: str | None, cursor: str | None) -> list[tuple[str, bytes]] | None:
        """Take ``target``'s stream over for a client resuming after ``cursor``: what it missed, oldest first
        (``None``: the cursor is not one still kept). The stream it resumes may not have seen its client go:
        it is ended, and its reader let record what it was handed, before the cursor is looked up."""
        self.end_stream(target)
        reading = self.readers.get(target)
        if reading is not None:
            with anyio.move_on_after(self.stall_timeout):
                await reading.wait()
        return self.missed(target, cursor)

    def close(self) -> None:
        self.closed = True
        self._replays.clear()
        for send, _ in self._streams.values():
            send.close()
        self._streams.clear()
        self._backlog.clear()
        self._notify()


def _untaken(stream: MemoryObjectReceiveStream[bytes]) -> list[bytes]:
    """What waits in ``stream`` that its reader has not taken."""
    lines = []
    while True:
        try:
            lines.append(stream.receive_nowait())
        except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
            return lines
