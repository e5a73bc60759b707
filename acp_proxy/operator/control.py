"""The control socket: how the operator CLI acts on a running proxy.

Each proxy listens on ``<state dir>/control/<instance id>.sock``: the directory is
``0700`` and the socket ``0600``, and every connection's peer uid is checked with
``SO_PEERCRED`` as well, so only the user the proxy runs as gets in (root
included only when the proxy runs as root). The protocol is JSON lines, one
response per request::

    -> {"id": 1, "command": "cancel_task", "args": {"taskId": "3f2a..."}}
    <- {"id": 1, "ok": true, "result": {...}}
    <- {"id": 1, "ok": false, "error": {"code": "unknown_task", "message": "..."}}

A request is at most ``MAX_REQUEST_BYTES``; a longer one, or one that is not a
JSON object naming a known command, gets an error and (when the framing is lost)
the connection is closed. The server never lets a client hold it: connections are
few (``MAX_CONNECTIONS``) and idle ones are dropped after ``IDLE_TIMEOUT``.

The client half is synchronous (plain ``socket``): the CLI needs no event loop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

from acp_proxy.sockets import SOCKET_DIR, addressable
from acp_proxy.sockets import socket_path as socket_path  # where operators find it

log = logging.getLogger("acp_proxy.control")

MAX_REQUEST_BYTES: Final = 64 * 1024
MAX_RESPONSE_BYTES: Final = 16 * 1024 * 1024
MAX_CONNECTIONS: Final = 16
IDLE_TIMEOUT: Final = 30.0
ACCEPT_BACKOFF: Final = 1.0

Handler = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]
StreamHandler = Callable[[object, dict[str, Any], anyio.abc.SocketStream, BufferedByteReceiveStream], Awaitable[None]]
"""A command that takes the connection over (``attach``): its request's id and args, the connection
and what is buffered of it. It answers the request itself, then speaks its own protocol."""


class ControlError(Exception):
    """A request the proxy refused or could not do: ``code`` for scripts, ``message`` for people."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ControlUnavailable(Exception):
    """No proxy answers on that socket (it has exited, or never listened)."""


# --- peer credentials (one function per platform, chosen once) ------------------------


def _peer_uid_linux(sock: socket.socket) -> int | None:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def _peer_uid_bsd(sock: socket.socket) -> int | None:
    # struct xucred { u_int cr_version; uid_t cr_uid; short cr_ngroups; gid_t cr_groups[16]; }
    local_peercred = getattr(socket, "LOCAL_PEERCRED", 0x001)
    raw = sock.getsockopt(0, local_peercred, struct.calcsize("IIh16I"))
    return int(struct.unpack_from("II", raw)[1])


peer_uid: Callable[[socket.socket], int | None] = _peer_uid_linux if hasattr(socket, "SO_PEERCRED") else _peer_uid_bsd
"""The uid of the process at the other end of a connected Unix socket."""


def bind_private(path: Path) -> socket.socket:
    """A listening Unix socket at ``path``, ``0600`` in a ``0700`` directory; a stale file is replaced."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with addressable(path) as name:
            sock.bind(name)
        os.chmod(path, 0o600)
        sock.listen(MAX_CONNECTIONS)
    except BaseException:
        sock.close()
        raise
    return sock


def remove_stale(state_dir: Path, alive: Callable[[str], bool]) -> int:
    """Remove the sockets of proxies that are gone; the number removed."""
    removed = 0
    directory = state_dir / SOCKET_DIR
    with contextlib.suppress(FileNotFoundError):
        for entry in directory.iterdir():
            if entry.suffix == ".sock" and not alive(entry.stem):
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()
                    removed += 1
    return removed


# --- framing -----------------------------------------------------------------------------


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":"), default=str).encode() + b"\n"


def error_message(request_id: object, code: str, message: str) -> dict[str, Any]:
    return {"id": request_id, "ok": False, "error": {"code": code, "message": message}}


def parse_request(line: bytes) -> tuple[object, str, dict[str, Any]]:
    """``(id, command, args)`` of a request line; ``ControlError`` naming what is wrong otherwise."""
    try:
        request = json.loads(line)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise ControlError("parse_error", "the request is not valid JSON") from None
    if not isinstance(request, dict):
        raise ControlError("invalid_request", "a request is a JSON object with a 'command'")
    request_id = request.get("id")
    command = request.get("command")
    args = request.get("args", {})
    if not isinstance(command, str) or not command:
        raise ControlError("invalid_request", "the request has no 'command' string")
    if not isinstance(args, dict):
        raise ControlError("invalid_request", "'args' must be a JSON object")
    return request_id, command, args


# --- server ------------------------------------------------------------------------------


class ControlServer:
    """Serves the control socket of one proxy; ``handler`` does the commands."""

    def __init__(
        self,
        path: Path,
        handler: Handler,
        *,
        allowed_uid: int | None = None,
        uid_of: Callable[[socket.socket], int | None] = peer_uid,
        streams: dict[str, StreamHandler] | None = None,
    ) -> None:
        self.path = path
        self.handler = handler
        self.streams = streams or {}
        """Commands that take their connection over; such a connection no longer counts in ``MAX_CONNECTIONS``
        (what bounds them is the handler's business) and has no idle timeout."""
        self.allowed_uid = os.getuid() if allowed_uid is None else allowed_uid
        self.uid_of = uid_of
        self.connections = 0

    async def serve(
        self,
        sock: socket.socket | None = None,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen (on ``sock``, else a socket bound now) until cancelled; the socket file is removed on the way out.

        A failing ``accept`` (out of file descriptors) is logged and retried: the
        control socket must never be what takes a proxy down.
        """
        listener = await anyio.abc.SocketListener.from_socket(sock if sock is not None else bind_private(self.path))
        try:
            task_status.started()
            async with anyio.create_task_group() as tasks:
                while True:
                    try:
                        stream = await self._accept(listener)
                    except (OSError, anyio.BrokenResourceError) as exc:
                        reason = exc.__cause__ or exc
                        log.warning("control socket: accept failed (%r); retrying in %gs", reason, ACCEPT_BACKOFF)
                        await anyio.sleep(ACCEPT_BACKOFF)
                        continue
                    tasks.start_soon(self._connection, stream)
        finally:
            with anyio.CancelScope(shield=True):
                await listener.aclose()
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    async def _accept(self, listener: anyio.abc.SocketListener) -> anyio.abc.SocketStream:
        return await listener.accept()

    async def _connection(self, stream: anyio.abc.SocketStream) -> None:
        async with stream:
            refusal = self._refusal(stream)
            if refusal is not None:
                log.warning("control socket: refused a connection (%s)", refusal.message)
                with anyio.move_on_after(1.0), contextlib.suppress(anyio.BrokenResourceError):
                    await stream.send(encode(error_message(None, refusal.code, refusal.message)))
                return
            self.connections += 1
            try:
                await self._requests(stream)
            finally:
                self.connections -= 1

    def _refusal(self, stream: anyio.abc.SocketStream) -> ControlError | None:
        try:
            uid = self.uid_of(stream.extra(anyio.abc.SocketAttribute.raw_socket))
        except OSError as exc:
            return ControlError("forbidden", f"cannot read the peer's credentials: {exc}")
        if uid != self.allowed_uid:
            return ControlError("forbidden", f"peer uid {uid} may not control a proxy of uid {self.allowed_uid}")
        if self.connections >= MAX_CONNECTIONS:
            return ControlError("busy", f"already {MAX_CONNECTIONS} control connections open; try again")
        return None

    async def _requests(self, stream: anyio.abc.SocketStream) -> None:
        reader = BufferedByteReceiveStream(stream)
        while True:
            try:
                with anyio.fail_after(IDLE_TIMEOUT):
                    line = await reader.receive_until(b"\n", MAX_REQUEST_BYTES)
            except anyio.DelimiterNotFound:
                message = f"requests are limited to {MAX_REQUEST_BYTES} bytes"
                if await self._send(stream, error_message(None, "too_large", message)):
                    await self._discard_rest(stream)
                return
            except (anyio.IncompleteRead, anyio.EndOfStream, anyio.BrokenResourceError, TimeoutError):
                return
            if not line.strip():
                continue
            request_id: object = None
            try:
                request_id, command, args = parse_request(line)
                stream_handler = self.streams.get(command)
                if stream_handler is not None:
                    self.connections -= 1
                    try:
                        await stream_handler(request_id, args, stream, reader)
                    finally:
                        self.connections += 1
                    return
                result = await self.handler(command, args)
                response = {"id": request_id, "ok": True, "result": result}
            except ControlError as exc:
                response = error_message(request_id, exc.code, exc.message)
            except Exception as exc:  # a bug in a command must not take the proxy down
                log.exception("control socket: command failed")
                response = error_message(request_id, "internal_error", f"{type(exc).__name__}: {exc}")
            if not await self._send(stream, response):
                return

    async def _discard_rest(self, stream: anyio.abc.SocketStream) -> None:
        """The framing is lost: end our side, then read and drop what the client is still sending.

        Closing with unread input would reset the connection, and the client could lose the
        error it was just sent. Bounded in time and bytes.
        """
        dropped = 0
        with anyio.move_on_after(1.0), contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
            await stream.send_eof()
            while dropped < 16 * MAX_REQUEST_BYTES:
                dropped += len(await stream.receive())

    async def _send(self, stream: anyio.abc.SocketStream, message: dict[str, Any]) -> bool:
        try:
            with anyio.fail_after(IDLE_TIMEOUT):
                await stream.send(encode(message))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, TimeoutError):
            return False
        return True


# --- client -----------------------------------------------------------------------------


def request(path: Path, command: str, args: dict[str, Any] | None = None, *, timeout: float = 10.0) -> dict[str, Any]:
    """Send one command to the proxy listening at ``path`` and return its result.

    ``ControlUnavailable`` if nothing listens there; ``ControlError`` if the proxy
    refused the command (its code and message); ``TimeoutError`` if it did not answer
    within ``timeout`` seconds, all of it: a peer that answers a byte at a time does not
    hold the caller past it.
    """
    deadline = time.monotonic() + timeout
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            with addressable(path) as name:
                sock.connect(name)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise ControlUnavailable(f"no proxy listens on {path} ({exc.strerror})") from None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            # A refused peer is told why at once and disconnected, maybe before this is read:
            # the reason is still waiting to be read below.
            sock.settimeout(_left(deadline))
            sock.sendall(encode({"id": 1, "command": command, "args": args or {}}))
        response = _read_line(sock, deadline)
    except TimeoutError:
        raise TimeoutError(f"the proxy did not answer {command!r} within {timeout:g}s") from None
    finally:
        sock.close()
    try:
        message = json.loads(response)
    except ValueError:
        raise ControlError("bad_response", "the proxy sent an answer that is not JSON") from None
    if not isinstance(message, dict):
        raise ControlError("bad_response", "the proxy sent an answer that is not a JSON object")
    if not message.get("ok"):
        error = message.get("error") or {}
        raise ControlError(str(error.get("code", "error")), str(error.get("message", "the proxy refused")))
    result = message.get("result")
    return result if isinstance(result, dict) else {}


def _left(deadline: float) -> float:
    """The time left until ``deadline``; ``TimeoutError`` once it has passed (a zero timeout would not block)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def _read_line(sock: socket.socket, deadline: float) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        sock.settimeout(_left(deadline))
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            raise ControlUnavailable("the proxy closed the connection without answering")
        chunks.append(chunk)
        size += len(chunk)
        if b"\n" in chunk:
            return b"".join(chunks).split(b"\n", 1)[0]
        if size > MAX_RESPONSE_BYTES:
            raise ControlError("bad_response", "the proxy's answer is too large")
