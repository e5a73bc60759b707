"""``acp-proxy connect URL``: a gateway's agent command that reaches a remote ``serve``.

Lines from the gateway's stdin go to the remote as WebSocket text frames, and frames come
back as lines on stdout; ids and bytes pass unchanged. The bridge asks ``serve`` for a cursor
in every message (``initialize`` with ``_meta["acp/resumable"]``; each cursor is taken off
before the line goes to the gateway). When the link drops it is made again, with back-off,
and the connection resumed (``stream/resume`` after the last cursor the gateway was given):
nothing is lost, and what was in flight is answered as if nothing happened. Where it cannot be
resumed (``serve`` restarted, or gone past its ``--resume-grace``), the gateway's
``initialize`` (and ``authenticate``) is replayed under the bridge's own ids, its answer kept
from the gateway, so the sessions go on under the same ids (the remote proxy restores a
suspended session on its next request); a request in flight then is answered with an error
that says so. One sent while the link is down waits for it, up to ``OUTAGE_LIMIT``.
"""

from __future__ import annotations

import logging
import ssl
import sys
from collections import deque
from typing import Final

import anyio
from msgspec import UNSET

from acp_proxy.protocol import jsonrpc
from acp_proxy.protocol.acp import session_of
from acp_proxy.protocol.jsonrpc import BadLine, Kind, LineReader, Message, RequestId
from acp_proxy.protocol.methods import Method
from acp_proxy.remote.replay import CLOSE, RESUMABLE_META, RESUME, RESUME_FAILED, without_cursor
from acp_proxy.remote.wsclient import Closed, Refused, Target, WebSocket
from acp_proxy.stdio import FdReceiveStream, FdSendStream

__all__ = ["Target", "run"]

log = logging.getLogger("acp_proxy.connect")

LINK_DROPPED: Final = -32603
BACKOFF: Final = (0.2, 0.5, 1.0, 2.0, 4.0, 8.0)
OUTAGE_LIMIT: Final = 30.0
"""How long a request sent while the link is down waits for it before it is answered with an error."""
CANCEL_GRACE: Final = 5.0
"""Then its turns still running are cancelled, and get this long to end before the link is closed."""
MAX_LINE: Final = 64 * 2**20
RESUME_WINDOW: Final = 10.0
"""How long requests in flight at a drop wait for a link to resume on, before they are answered with an error
(at once when ``serve`` refuses the TCP connection: nothing listens, its connections are gone)."""
REPLAY_TIMEOUT: Final = 120.0
"""How long a replayed ``initialize`` may take (an adapter's start, on the server) before the rest is sent anyway."""
BRIDGE_ID: Final = "acp-proxy-connect/"
RESUME_ID: Final = f"{BRIDGE_ID}resume"
"""The id of the bridge's ``stream/resume``: its answer, like a replayed ``initialize``'s, is the bridge's own."""


class Bridge:
    def __init__(self, target: Target, out: FdSendStream, *, eof_grace: float = 10.0) -> None:
        self.target = target
        self.eof_grace = eof_grace
        """After the gateway closes its stdin, how long its requests in flight may still be answered."""
        self.out = out
        self.waiting: deque[bytes] = deque()
        """Gateway lines not yet sent over a link."""
        self.more = anyio.Event()
        self.in_flight: dict[tuple[type, object], RequestId] = {}
        """Gateway requests sent over the current link and not answered yet."""
        self.prompting: dict[tuple[type, object], str] = {}
        """Of those, the turns (``session/prompt``): their sessions."""
        self.asked: set[tuple[type, object]] = set()
        """The remote's requests on the current link that the gateway has not answered."""
        self.replay: dict[str, bytes] = {}
        """``initialize`` and ``authenticate`` as the gateway sent them, to replay on a new link."""
        self.gateway_gone = False
        self.cookies: dict[str, str] = {}
        self.down_since: float | None = None
        self._counter = 0
        self._writing = anyio.Lock()
        self._replaying: str | None = None
        self._replayed = anyio.Event()
        self.connection_id: str | None = None
        """The remote connection, for a resume (``None``: ``serve`` gave no cursors, or it cannot be resumed)."""
        self.cursor: str | None = None
        """The cursor of the last message given to the gateway."""
        self.resumable = False
        """Whether ``serve`` gives cursors (its ``initialize`` answer said ``transport.resumable``)."""
        self._initializing: tuple[type, object] | None = None
        self._resumed: bool | None = None
        self._resume_answered = anyio.Event()

    # --- the gateway's side ------------------------------------------------------------------

    async def read_gateway(self, stdin: FdReceiveStream) -> None:
        reader = LineReader(stdin, MAX_LINE)
        while True:
            try:
                batch = await reader.receive_batch()
            except anyio.EndOfStream:
                break
            for line in batch.lines:
                if not line.strip():
                    continue
                decoded = jsonrpc.decode_line(line)
                if not isinstance(decoded, BadLine):
                    msg, kind = decoded
                    if kind is Kind.REQUEST and msg.method in (Method.INITIALIZE, Method.AUTHENTICATE):
                        self.replay[str(msg.method)] = line
                    if kind is Kind.RESPONSE and msg.id is not None and jsonrpc.id_key(msg.id) not in self.asked:
                        log.info("dropped the gateway's answer to %r: asked on a link that has dropped", msg.id)
                        continue
                self.waiting.append(line)
            self.more.set()
        self.gateway_gone = True
        self.more.set()

    async def to_gateway(self, data: bytes) -> None:
        async with self._writing:
            await self.out.send(data)

    async def fail_in_flight(self, why: str) -> None:
        """Answer every request the link took and will never answer."""
        failed = [
            jsonrpc.error_response(request_id, LINK_DROPPED, why, {"reason": "link_dropped"})
            for request_id in self.in_flight.values()
        ]
        self.in_flight.clear()
        self.prompting.clear()
        self.asked.clear()
        if failed:
            log.warning("answered %d request(s) in flight with an error: %s", len(failed), why)
            await self.to_gateway(b"".join(failed))

    async def fail_waiting(self, why: str, reason: str = "unreachable") -> None:
        """No link for too long, or none to be had: the requests waiting for one are answered with an error."""
        kept: deque[bytes] = deque()
        failed: list[bytes] = []
        for line in self.waiting:
            decoded = jsonrpc.decode_line(line)
            if isinstance(decoded, BadLine) or decoded[1] is not Kind.REQUEST:
                continue
            msg = decoded[0]
            failed.append(jsonrpc.error_response(msg.id, LINK_DROPPED, why, {"reason": reason}))  # type: ignore[arg-type]
        self.waiting = kept
        if failed:
            await self.to_gateway(b"".join(failed))

    # --- the link ----------------------------------------------------------------------------

    async def keep_linked(self) -> int:
        attempt = 0
        linked_before = False
        while not (self.gateway_gone and not self.waiting and not self.in_flight):
            try:
                ws = await WebSocket.connect(self.target, cookies=self.cookies)
            except Refused as exc:
                if exc.status in (401, 403):
                    log.error("%s refused the link: %s", self.target.describe(), exc)
                    await self.fail_waiting(f"the remote acp-proxy refused the link: {exc}", "refused")
                    return 2
                why = str(exc)
            except ssl.SSLCertVerificationError as exc:  # not a passing fault: no retry will change it
                why = f"TLS: {exc.verify_message or exc} (a private CA: point SSL_CERT_FILE at it)"
                log.error("%s: %s", self.target.describe(), why)
                await self.fail_waiting(f"the remote acp-proxy's certificate was refused: {exc}", "refused")
                return 2
            except OSError as exc:
                why = exc.strerror or str(exc)
                if _refused(exc):
                    self.connection_id = None  # nothing listens: that serve, and its connections, are gone
                    await self.fail_in_flight(self.lost(why))
            else:
                attempt = 0
                self.down_since = None
                self.cookies.update(ws.cookies())
                log.info("linked to %s (connection %s)", self.target.describe(), ws.connection_id)
                why = await self._serve_link(ws, replay=linked_before)
                linked_before = True
                if not self.resumable:  # nothing to resume: what was in flight is lost
                    await self.fail_in_flight(self.lost(why))
                if self.gateway_gone and not self.waiting:
                    return 0
            now = anyio.current_time()
            self.down_since = self.down_since if self.down_since is not None else now
            if now - self.down_since > RESUME_WINDOW and self.in_flight:
                self.connection_id = None
                await self.fail_in_flight(self.lost(why))
            if now - self.down_since > OUTAGE_LIMIT:
                await self.fail_waiting(f"the remote acp-proxy at {self.target.describe()} is unreachable: {why}")
            delay = BACKOFF[min(attempt, len(BACKOFF) - 1)]
            attempt += 1
            log.warning("link to %s down (%s): retrying in %.1fs", self.target.describe(), why, delay)
            await anyio.sleep(delay)
        return 0

    @staticmethod
    def lost(why: str) -> str:
        return (
            f"the link to the remote acp-proxy dropped ({why}) while this request was in flight, and could not be "
            "resumed; its session is kept: send it again"
        )

    async def _serve_link(self, ws: WebSocket, *, replay: bool) -> str:
        """Relay both ways until the link drops (the reason) or the gateway has left and been answered."""
        why = "closed"
        resume = self.connection_id if replay and self.resumable else None
        self.connection_id = ws.connection_id
        async with anyio.create_task_group() as tasks:

            async def receive() -> None:
                nonlocal why
                try:
                    while True:
                        text = await ws.receive_text()
                        await self._from_remote(text.encode())
                except Closed as exc:
                    why = exc.reason or "closed"
                tasks.cancel_scope.cancel()

            tasks.start_soon(receive)
            try:
                if resume is not None and await self._resume(ws, resume):
                    replay = False
                elif replay:
                    await self.fail_in_flight(self.lost("a new connection"))
                if replay:
                    await self._replay(ws)
                await self._send_waiting(ws)  # returns once the gateway has left and been answered
                if self.resumable:  # done for good: the connection ends now, not after serve's resume grace
                    await ws.send_text(jsonrpc.notification(CLOSE).rstrip(b"\n").decode())
            except Closed as exc:
                why = exc.reason
            tasks.cancel_scope.cancel()
        await ws.aclose()
        return why

    def _asking_for_cursors(self, msg: Message) -> bytes:
        """The gateway's ``initialize``, asking ``serve`` for a cursor in every message (taken off again
        before each goes to the gateway); its answer says whether ``serve`` gives them."""
        params = jsonrpc.decode_object(msg.params) or {}
        meta = params.get("_meta")
        params["_meta"] = {**(meta if isinstance(meta, dict) else {}), RESUMABLE_META: True}
        assert msg.id is not UNSET
        self._initializing = jsonrpc.id_key(msg.id)
        return jsonrpc.request(msg.id, Method.INITIALIZE, params)

    def _resumability(self, answer: Message, line: bytes) -> bytes:
        """Whether ``serve`` gives cursors, from its ``initialize`` answer (``transport.resumable``), and the
        answer without it: resuming is the bridge's business, not the gateway's (its link is stdio)."""
        result = jsonrpc.decode_object(answer.result) if answer.error is UNSET else None
        transport = result.get("transport") if result is not None else None
        self.resumable = isinstance(transport, dict) and "resumable" in transport
        if not self.resumable or result is None or not isinstance(transport, dict):
            return line
        del transport["resumable"]
        if not transport:
            del result["transport"]
        assert answer.id is not UNSET
        return jsonrpc.result_response(answer.id, result)

    async def _resume(self, ws: WebSocket, connection_id: str) -> bool:
        """Take the remote connection over on this link, after the last cursor the gateway was given (the
        first frame); whether it was. Refused, this link is a new connection of its own."""
        self._resumed = None
        self._resume_answered = anyio.Event()
        params = {"connectionId": connection_id, "cursor": self.cursor}
        await ws.send_text(jsonrpc.request(RESUME_ID, RESUME, params).rstrip(b"\n").decode())
        with anyio.move_on_after(REPLAY_TIMEOUT):
            await self._resume_answered.wait()
        if self._resumed:
            log.info("resumed connection %s after cursor %s: nothing lost", connection_id, self.cursor)
            self.connection_id = connection_id
            return True
        log.warning("connection %s could not be resumed: a new one", connection_id)
        return False

    async def _replay(self, ws: WebSocket) -> None:
        """Initialize the new link as the gateway did the first; its answers never reach the gateway.

        Each is answered before anything else is sent, as a gateway waits for its own: a session
        request racing an ``initialize`` would find an agent that has not said what it can do.
        """
        for method in (Method.INITIALIZE, Method.AUTHENTICATE):
            line = self.replay.get(str(method))
            if line is None:
                continue
            decoded = jsonrpc.decode_line(line)
            assert not isinstance(decoded, BadLine)
            if any(w == line for w in self.waiting):
                continue  # the gateway's own is about to be sent
            self._counter += 1
            replayed = f"{BRIDGE_ID}{self._counter}"
            self._replayed = anyio.Event()
            self._replaying = replayed
            msg = decoded[0]
            msg.id = replayed
            line = self._asking_for_cursors(msg) if method == Method.INITIALIZE else jsonrpc.encode_json(msg)
            await ws.send_text(line.rstrip(b"\n").decode())
            with anyio.move_on_after(REPLAY_TIMEOUT):
                await self._replayed.wait()

    async def _send_waiting(self, ws: WebSocket) -> None:
        gone_at: float | None = None
        cancelled = False
        while True:
            while self.waiting:
                line = self.waiting[0]
                decoded = jsonrpc.decode_line(line)
                if not isinstance(decoded, BadLine) and decoded[1] is Kind.REQUEST:
                    request_id = decoded[0].id
                    assert request_id is not UNSET  # a request has an id
                    self.in_flight[jsonrpc.id_key(request_id)] = request_id
                    if decoded[0].method == Method.PROMPT and (session := session_of(decoded[0].params)):
                        self.prompting[jsonrpc.id_key(request_id)] = session
                if not isinstance(decoded, BadLine) and decoded[1] is Kind.RESPONSE and decoded[0].id is not None:
                    self.asked.discard(jsonrpc.id_key(decoded[0].id))
                if not isinstance(decoded, BadLine) and decoded[0].method == Method.INITIALIZE:
                    line = self._asking_for_cursors(decoded[0])
                await ws.send_text(line.decode("utf-8", "replace"))
                self.waiting.popleft()
            if self.gateway_gone:
                gone_at = gone_at if gone_at is not None else anyio.current_time()
                self.more = anyio.Event()  # set by each answer (``_from_remote``), from before the look at them
                waited = anyio.current_time() - gone_at
                if not self.in_flight or waited >= self.eof_grace + CANCEL_GRACE:
                    return
                if waited >= self.eof_grace and not cancelled:
                    # The server cannot tell a close from a dropped link (its turns would go on):
                    # the turns of a gateway that left are cancelled, as a stdio proxy cancels them.
                    cancelled = True
                    for session in sorted(set(self.prompting.values())):
                        cancel = jsonrpc.notification(Method.CANCEL, {"sessionId": session})
                        await ws.send_text(cancel.rstrip(b"\n").decode())
                with anyio.move_on_at(gone_at + self.eof_grace + (CANCEL_GRACE if cancelled else 0)):
                    await self.more.wait()
                continue
            self.more = anyio.Event()
            if not self.waiting:
                await self.more.wait()

    async def _from_remote(self, line: bytes) -> None:
        cursor, line = without_cursor(line)
        decoded = jsonrpc.decode_line(line)
        if not isinstance(decoded, BadLine):
            msg, kind = decoded
            if kind is Kind.NOTIFICATION and msg.method == RESUME_FAILED:
                self._resumed = False
                self._resume_answered.set()
                return
            if kind is Kind.RESPONSE and msg.id is not None:
                if self._initializing is not None and jsonrpc.id_key(msg.id) == self._initializing:
                    self._initializing = None
                    line = self._resumability(msg, line)
                if msg.id == RESUME_ID:
                    self._resumed = self._resumed is None and msg.error is UNSET
                    self._resume_answered.set()
                    return
                if isinstance(msg.id, str) and msg.id.startswith(BRIDGE_ID):
                    if msg.error is not UNSET:
                        log.warning("replayed request %s failed on the new link: %s", msg.id, msg.error.message)
                    if msg.id == self._replaying:
                        self._replayed.set()
                    return
                self.in_flight.pop(jsonrpc.id_key(msg.id), None)
                self.prompting.pop(jsonrpc.id_key(msg.id), None)
                self.more.set()
            elif kind is Kind.REQUEST and msg.id is not None:
                self.asked.add(jsonrpc.id_key(msg.id))
        await self.to_gateway(line.rstrip(b"\n") + b"\n")
        if cursor is not None:
            self.cursor = cursor  # delivered: a resume starts after it


def _refused(exc: BaseException) -> bool:
    """Whether every address refused the connection (nothing listens: a ``serve`` that has gone)."""
    if isinstance(exc, ConnectionRefusedError):
        return True
    cause = exc.__cause__
    if isinstance(cause, BaseExceptionGroup):
        return all(_refused(inner) for inner in cause.exceptions)
    return cause is not None and _refused(cause)


async def _run(target: Target, eof_grace: float) -> int:
    stdin, stdout = FdReceiveStream(0), FdSendStream(1)
    bridge = Bridge(target, stdout, eof_grace=eof_grace)
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(bridge.read_gateway, stdin)
        status = await bridge.keep_linked()
        tasks.cancel_scope.cancel()
    return status


def run(target: Target, *, eof_grace: float = 10.0) -> int:
    try:
        return anyio.run(_run, target, eof_grace)
    except KeyboardInterrupt:
        return 130
    finally:
        sys.stdout.flush()
