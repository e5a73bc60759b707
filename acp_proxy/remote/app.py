"""The ``/acp`` endpoint as an ASGI application: WebSocket and streamable HTTP over one hub.

Authentication runs before anything else on every request: an ``Authorization: Bearer``
token, or, on the unix socket (which only the server's user can open), the server's own
user. A browser's ``Origin`` is refused unless listed. Every failure is logged and counted,
and the answer to it is delayed, more for a client that keeps failing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from contextlib import suppress
from typing import Any, Final

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream
from msgspec import UNSET

from acp_proxy.protocol import jsonrpc
from acp_proxy.protocol.acp import session_of
from acp_proxy.protocol.jsonrpc import BadLine, RequestId
from acp_proxy.remote.access import FailedAttempts, bearer_token, origin_allowed
from acp_proxy.remote.hub import Connection, Ended, Hub, Refusal, Resumed
from acp_proxy.remote.replay import CLOSE, RESUME, RESUME_FAILED, TURN_STATE_META
from acp_proxy.remote.routing import Body, Head, Refused, Route, route
from acp_proxy.remote.tokens import Principal, RemoteStore
from acp_proxy.remote.wsserver import LINES

log = logging.getLogger("acp_proxy.serve")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Write = Callable[[list[bytes]], Awaitable[None]]
"""Writes messages (JSON lines) to a WebSocket, a text frame each."""

CONNECTION_HEADER: Final = b"acp-connection-id"
SESSION_HEADER: Final = b"acp-session-id"
RUN_LIMIT: Final = 1024
"""The most messages a WebSocket write carries at once."""
STREAM_KEEPALIVE: Final = 15.0
"""Seconds between comment lines on an idle event stream: intermediaries keep it open, and a
client that has gone is found by the failed write."""


class AcpApp:
    """ASGI: ``/acp`` for WebSocket and streamable HTTP clients of ``hub``."""

    def __init__(self, hub: Hub, store: RemoteStore, *, allowed_origins: Iterable[str], unix_socket: bool) -> None:
        self.hub = hub
        self.store = store
        self.allowed_origins = tuple(allowed_origins)
        self.unix_socket = unix_socket
        self.failed = FailedAttempts()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        headers = _headers(scope)
        head = Head(
            method=scope.get("method", "GET") if scope["type"] == "http" else "GET",
            path=scope.get("path", ""),
            upgrade="websocket" if scope["type"] == "websocket" else headers.get("upgrade"),
            accept=headers.get("accept"),
            content_type=headers.get("content-type"),
            connection_id=headers.get(CONNECTION_HEADER.decode()),
            session_id=headers.get(SESSION_HEADER.decode()),
            last_event_id=headers.get("last-event-id"),
        )
        websocket = scope["type"] == "websocket"
        if websocket:
            await receive()  # websocket.connect
        respond = _ws_refusal(send) if websocket else _http_refusal(send)
        if not origin_allowed(headers.get("origin"), self.allowed_origins):
            log.warning("refused a request from origin %r (not in --allow-origin)", headers.get("origin"))
            await respond(403, "origin not allowed")
            return
        principal = await self._authenticate(scope, headers)
        if principal is None:
            await respond(401, "authentication required: Authorization: Bearer <token>")
            return
        if websocket:
            decided = route(head)
            if decided is not Route.WEBSOCKET:
                await respond(decided.status if isinstance(decided, Refused) else 400, "not a WebSocket endpoint")
                return
            write = _batched(send) if LINES in scope.get("extensions", {}) else _one_by_one(send)
            await self._websocket(principal, _peer(scope), receive, send, write)
            return
        await self._http(head, principal, _peer(scope), receive, send)

    async def _authenticate(self, scope: Scope, headers: dict[str, str]) -> Principal | None:
        if scope.get("client") is None and self.unix_socket:
            return Principal.local_user(os.getuid())  # the socket is the server user's alone (0600)
        secret = bearer_token(headers.get("authorization"))
        token = self.store.verify(secret) if secret is not None else None
        if token is not None:
            return Principal.of_token(token)
        peer = _peer(scope)
        client = scope.get("client")
        delay = self.failed.delay(str(client[0]) if client else peer)  # by host: a new port is no new client
        self.hub.failed_auth += 1
        self.hub.on_change()
        log.warning(
            "failed authentication from %s (%s); answered in %.2fs", peer, "bad token" if secret else "no token", delay
        )
        await anyio.sleep(delay)
        return None

    # --- WebSocket ---------------------------------------------------------------------------

    async def _websocket(self, principal: Principal, peer: str, receive: Receive, send: Send, write: Write) -> None:
        opened = self.hub.open(principal, "websocket", peer)
        if isinstance(opened, Refusal):
            await _ws_refusal(send)(opened.status, opened.message)
            return
        await send({"type": "websocket.accept", "headers": [(CONNECTION_HEADER, opened.id.encode())]})
        event = await receive()
        if event["type"] == "websocket.disconnect":
            opened.end(Ended.GONE)
            return
        first: str | None = event.get("text")
        connection, opening = opened, []
        resume = _request_of(first, RESUME) if first is not None else None
        if resume is not None:
            request_id, params = resume
            resumed = await self.hub.resume(principal, params.get("connectionId"), params.get("cursor"))
            if isinstance(resumed, Resumed):
                self.hub.withdraw(opened)
                connection = resumed.connection
                ack = {"connectionId": connection.id, "replayed": len(resumed.missed)}
                ack["_meta"] = {TURN_STATE_META: connection.turns.every()}
                if request_id is not None:
                    opening.append(jsonrpc.result_response(request_id, ack))
                opening += [line for _, line in resumed.missed]
            else:  # this socket goes on as the new connection it was opened as
                log.info("%s: stream/resume refused: %s", principal.label, resumed.message)
                failed = {"reason": resumed.reason, "message": resumed.message, "connectionId": opened.id}
                opening.append(jsonrpc.notification(RESUME_FAILED, failed))
                if request_id is not None:
                    reason = {"reason": resumed.reason}
                    error = jsonrpc.error_response(request_id, jsonrpc.INVALID_PARAMS, resumed.message, reason)
                    opening.append(error)
            first = None
        await self._socket(connection, first, opening, receive, send, write)

    async def _socket(
        self,
        connection: Connection,
        first: str | None,
        opening: list[bytes],
        receive: Receive,
        send: Send,
        write: Write,
    ) -> None:
        """Carry ``connection`` over this socket (``opening`` written first) until one side ends: the client's
        drop leaves it waiting for a resume; the connection's end, or another socket's resume, closes this one."""
        outbox = connection.outbox
        stream = outbox.open(None)
        outbox.readers[None] = written = anyio.Event()
        connection.stall = stall = anyio.Event()
        connection.reattach()
        async with anyio.create_task_group() as tasks:

            async def let_go_when_stalled() -> None:
                """A client that stopped reading, of a connection that waits for a resume: its socket goes."""
                await stall.wait()
                outbox.end_stream(None)  # the writer ends on what it was handed, kept for a resume
                with anyio.move_on_after(1):
                    await written.wait()
                # Waiting for a resume from now on, whether or not the writer ever comes back from its write to a
                # dead socket (hypercorn shields that write on trio): it is cut, where it can be.
                connection.detach()
                tasks.cancel_scope.cancel()

            async def send_frames() -> None:
                try:
                    for at in range(0, len(opening), RUN_LIMIT):  # a replay a run at a time: a slow reader
                        await write(opening[at : at + RUN_LIMIT])  # is seen to read (``Outbox.wrote``)
                        outbox.wrote(None)
                    ended = False
                    while not ended:
                        try:
                            line = await stream.receive()
                        except (anyio.EndOfStream, anyio.ClosedResourceError):
                            break
                        run, ended = _run_from(line, stream)
                        if outbox.cursor_meta:  # a client that can resume: kept for it, written or not
                            _, run = outbox.record(None, run, anyio.current_time())
                        await write(run)
                        outbox.wrote(None)
                except Exception:  # any failed write: the client has gone
                    pass
                finally:
                    written.set()
                tasks.cancel_scope.cancel()  # the connection ended, another socket took it, or a write failed

            tasks.start_soon(send_frames)
            tasks.start_soon(let_go_when_stalled)
            if first is not None:
                await connection.from_client(first.encode())
            while True:
                event = await receive()
                if event["type"] == "websocket.disconnect":
                    break
                text = event.get("text")
                if text is None:
                    continue  # binary frames are ignored, as the RFD says
                if _request_of(text, CLOSE) is not None:
                    connection.end(Ended.DELETED)  # its writer ends, and closes the socket
                    continue
                await connection.from_client(text.encode())
            # Ended by closing its stream, never by cancelling its writer (a message handed to a cancelled
            # receiver is lost): it ends on what it was handed, kept for a resume; the rest waits.
            outbox.release(None, stream)
            with anyio.move_on_after(STREAM_KEEPALIVE):
                await written.wait()
            tasks.cancel_scope.cancel()
        outbox.release(None, stream)
        if connection.ended is None and not outbox.has_stream(None):
            connection.detach()  # its client dropped, or stopped reading: the connection waits for a resume
            if stall.is_set():
                with anyio.move_on_after(1), suppress(Exception):
                    await send({"type": "websocket.close", "code": 1008, "reason": "not reading: resume to go on"})
            return
        ended = connection.ended
        code, reason = (ended.code, ended.reason) if ended is not None else (1000, "resumed on another socket")
        with anyio.move_on_after(1), suppress(Exception):
            await send({"type": "websocket.close", "code": code, "reason": reason})

    # --- streamable HTTP ---------------------------------------------------------------------

    async def _http(self, head: Head, principal: Principal, peer: str, receive: Receive, send: Send) -> None:
        body: Body | None = None
        raw = b""
        if head.method == "POST":
            read = await _read_body(receive, self.hub.limits.max_message_bytes)
            if read is None:
                await _plain(send, 413, f"body over {self.hub.limits.max_message_bytes} bytes")
                return
            raw = read.strip()
            body = _body_of(raw)
        decided = route(head, body)
        if isinstance(decided, Refused):
            await _plain(send, decided.status, decided.message)
            return
        if decided is Route.INITIALIZE:
            await self._initialize(principal, peer, raw, send)
            return
        assert head.connection_id is not None
        connection = self.hub.find(head.connection_id, principal)
        if connection is None:
            await _plain(send, 404, "unknown Acp-Connection-Id")
            return
        if decided is Route.DELETE:
            connection.end(Ended.DELETED)
            await _plain(send, 202, "")
            return
        if decided is Route.STREAM:
            await self._stream(connection, head, principal, receive, send)
            return
        decoded = jsonrpc.decode_line(raw)
        if isinstance(decoded, BadLine):
            await _json(send, 400, jsonrpc.bad_line_response(decoded, raw))
            return
        await connection.from_client(raw, head.session_id)
        await _plain(send, 202, "")

    async def _initialize(self, principal: Principal, peer: str, raw: bytes, send: Send) -> None:
        decoded = jsonrpc.decode_line(raw)
        if isinstance(decoded, BadLine) or decoded[0].id is None:
            await _json(send, 400, jsonrpc.bad_line_response(BadLine.INVALID, raw))
            return
        opened = self.hub.open(principal, "http", peer)
        if isinstance(opened, Refusal):
            await _plain(send, opened.status, opened.message)
            return
        answer = await opened.initialize(raw, decoded[0])
        if answer is None:
            opened.end(Ended.PROXY_EXITED)
            await _plain(send, 502, "the connection's proxy did not answer initialize")
            return
        await _json(send, 200, answer, [(CONNECTION_HEADER, opened.id.encode())])

    async def _stream(
        self, connection: Connection, head: Head, principal: Principal, receive: Receive, send: Send
    ) -> None:
        session_id = head.session_id
        if session_id is not None and not self.hub.may_see(principal, session_id):
            # 409, not the RFD's 404: the TypeScript SDK opens a session's stream before its session/load, and
            # takes any failure but 409 there as the end of the whole connection, its other sessions with it.
            # 409 fails that session alone (its load is answered -32002 on the connection's stream).
            await _plain(send, 409, "unknown Acp-Session-Id: not a session of this token")
            return
        outbox = connection.outbox
        missed: list[tuple[str, bytes]] = []
        if head.last_event_id is not None:
            found = await outbox.resume(session_id, head.last_event_id)
            if found is None:
                message = f"Last-Event-ID {head.last_event_id!r} is not a cursor of this stream that is still kept"
                await _plain(send, 409, message)
                return
            missed = found
        stream = outbox.open(session_id)  # what comes from now on follows what was missed
        outbox.readers[session_id] = reader_done = anyio.Event()
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-store")]
        try:  # from here its stream is let go however this ends: a client gone mid-replay included
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            # A first line at once: the status and headers go out with it (not held for the first event),
            # so a client that waits for them before it sends its next request is not kept waiting.
            await send({"type": "http.response.body", "body": b": open\n\n", "more_body": True})
            for at in range(0, len(missed), RUN_LIMIT):  # a replay a run at a time, as the live stream
                chunk: list[bytes] = []
                for cursor, line in missed[at : at + RUN_LIMIT]:
                    _event(chunk, cursor, line)
                await send({"type": "http.response.body", "body": b"".join(chunk), "more_body": True})
                outbox.wrote(session_id)
            async with anyio.create_task_group() as tasks:

                async def until_gone() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    # Ended by closing its stream, never by cancelling its reader: a message handed to a
                    # reader cancelled while it waits is lost (anyio's memory streams). It ends on what it
                    # was handed (written or not, kept for a resume); what it had not taken waits.
                    outbox.release(session_id, stream)

                tasks.start_soon(until_gone)
                await _events(
                    stream,
                    send,
                    lambda lines, now: outbox.record_events(session_id, lines, now),
                    lambda: outbox.wrote(session_id),
                )
                tasks.cancel_scope.cancel()
        finally:
            outbox.release(session_id, stream)
            reader_done.set()
        with anyio.move_on_after(1), suppress(Exception):
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def _batched(send: Send) -> Write:
    """A run of messages as one ASGI event of the ``acp.websocket.lines`` extension: one write (``wsserver``)."""
    return lambda lines: send({"type": LINES, "lines": lines})


def _one_by_one(send: Send) -> Write:
    """A run of messages as an ASGI event each (a server without the extension: hypercorn, behind TLS)."""

    async def write(lines: list[bytes]) -> None:
        for line in lines:
            await send({"type": "websocket.send", "text": line.rstrip(b"\n").decode()})

    return write


def _request_of(text: str, method: str) -> tuple[RequestId | None, dict[str, Any]] | None:
    """The id (``None`` for a notification) and params of a frame calling ``method`` (one the server answers
    itself: ``stream/resume``, ``stream/close``); ``None`` for any other frame, read no further than a search."""
    if method not in text:
        return None
    decoded = jsonrpc.decode_line(text.encode())
    if isinstance(decoded, BadLine) or decoded[0].method != method:
        return None
    msg = decoded[0]
    return (msg.id if msg.id is not UNSET else None), jsonrpc.decode_object(msg.params) or {}


def _event(chunk: list[bytes], cursor: str | None, line: bytes) -> None:
    """Add one message to ``chunk`` as a server-sent event, with its cursor as the event's id (the line is
    copied once, when the chunk is joined)."""
    if cursor is not None:
        chunk += (b"id: ", cursor.encode(), b"\n")
    chunk += (b"data: ", line, b"\n\n")


def _run_from(line: bytes, stream: MemoryObjectReceiveStream[bytes]) -> tuple[list[bytes], bool]:
    """``line`` and what else already waits in ``stream`` (up to ``RUN_LIMIT``), to be written at once: one
    wake-up and one write a run. Whether the stream has ended after them."""
    run = [line]
    while len(run) < RUN_LIMIT:
        try:
            run.append(stream.receive_nowait())
        except anyio.WouldBlock:
            break
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            return run, True
    return run, False


async def _events(
    stream: MemoryObjectReceiveStream[bytes],
    send: Send,
    record: Callable[[list[bytes], float], bytes],
    wrote: Callable[[], None],
) -> None:
    """Each message as one server-sent event (``record`` keeps a run for a resume and makes its events, each
    with its cursor), and a comment line when nothing was written for ``STREAM_KEEPALIVE``; until the stream
    is closed or a write fails (the client has gone: what was written is kept for a resume all the same)."""
    lock = anyio.Lock()
    written = anyio.current_time()

    async def keepalive() -> None:
        nonlocal written
        while True:
            await anyio.sleep(written + STREAM_KEEPALIVE - anyio.current_time())
            if anyio.current_time() - written >= STREAM_KEEPALIVE:
                async with lock:
                    await send({"type": "http.response.body", "body": b": keepalive\n\n", "more_body": True})
                    written = anyio.current_time()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(keepalive)
        ended = False
        while not ended:
            try:
                line = await stream.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                break
            run, ended = _run_from(line, stream)
            events = record(run, anyio.current_time())  # one reading of the clock for the run
            async with lock:
                try:
                    await send({"type": "http.response.body", "body": events, "more_body": True})
                except Exception:  # any failed write: the client has gone
                    break
                written = anyio.current_time()
                wrote()
        tasks.cancel_scope.cancel()


def _body_of(raw: bytes) -> Body:
    if raw.startswith(b"["):
        return Body(batch=True)
    decoded = jsonrpc.decode_line(raw)
    if isinstance(decoded, BadLine):
        return Body()
    msg, _ = decoded
    return Body(method=msg.method if isinstance(msg.method, str) else None, session_id=session_of(msg.params))


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    parts: list[bytes] = []
    size = 0
    while True:
        event = await receive()
        if event["type"] == "http.disconnect":
            return b"".join(parts)
        chunk = event.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
        if not event.get("more_body", False):
            return b"".join(parts)


def _headers(scope: Scope) -> dict[str, str]:
    return {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope.get("headers", [])}


def _peer(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "unix socket"


def _plain_headers(status: int) -> list[tuple[bytes, bytes]]:
    headers = [(b"content-type", b"text/plain; charset=utf-8")]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="acp-proxy"'))
    return headers


async def _plain(send: Send, status: int, message: str) -> None:
    body = (message + "\n").encode() if message else b""
    await send({"type": "http.response.start", "status": status, "headers": _plain_headers(status)})
    await send({"type": "http.response.body", "body": body})


async def _json(send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", b"application/json"), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body.rstrip(b"\n")})


def _http_refusal(send: Send) -> Callable[[int, str], Awaitable[None]]:
    return lambda status, message: _plain(send, status, message)


def _ws_refusal(send: Send) -> Callable[[int, str], Awaitable[None]]:
    async def refuse(status: int, message: str) -> None:
        await send({"type": "websocket.http.response.start", "status": status, "headers": _plain_headers(status)})
        await send({"type": "websocket.http.response.body", "body": (message + "\n").encode()})

    return refuse


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        event = await receive()
        if event["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif event["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
