"""A gateway's end of an ACP connection: JSON-RPC 2.0, one JSON object per line.

``Gateway`` (async, on anyio: asyncio or trio) and ``SyncGateway`` (blocking, for
scripts and benchmarks) share all but the I/O: an id counter, a map of the
requests waiting for their answers, and the dispatch of every line read:

* an answer goes to the request waiting for it;
* an agent->client request (``session/request_permission``, ``fs/*``) goes to
  ``handler``, and what it returns is sent back as the answer (``None``: the
  request is stashed, for the caller to answer);
* everything else (notifications, answers nobody waits for) is *stashed*, in
  order, for ``expect``, ``stashed`` and ``updates``.

Both launch a command (the proxy, or an adapter directly) or wrap given pipes or
streams, put a timeout on every wait, and close cleanly: stdin EOF, wait for the
exit, SIGKILL after the timeout. ``observers`` see every message both ways
(``"in"`` or ``"out"``, the message) before it is dispatched or written.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import select
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from typing import IO, Any, Literal, Self, TypedDict, Unpack

import anyio
import anyio.abc
import msgspec

from acp_proxy.protocol.methods import Method
from tests.kit import forked as forking

Message = dict[str, Any]
Handler = Callable[[Message], Message | None]
"""Answers an agent->client request: ``{"result": ...}`` or ``{"error": ...}``, or ``None`` to stash it."""
Observer = Callable[[str, Message], None]
"""Sees each message: ``("in", msg)`` as it is read, ``("out", msg)`` before it is written."""
Stderr = int | IO[Any] | Literal["capture"] | None
"""The child's stderr: ``"capture"`` (kept, see ``stderr``), or what ``subprocess`` takes."""

AUTO: Any = object()
"""The default request id: the next of the connection's counter."""
TIMEOUT = 10.0
READ_SIZE = 1 << 16
UPDATE = Method.UPDATE


class GatewayError(Exception):
    """What the kit raises, beside ``TimeoutError`` when a wait runs out."""


class Closed(GatewayError):
    """The peer closed its output, or its input was closed, before the answer or the write."""


class RpcError(GatewayError):
    """An error answer, from ``call``."""

    def __init__(self, method: str, error: Any) -> None:
        super().__init__(f"{method} failed: {json.dumps(error)[:300]}")
        self.error = error
        self.code = error.get("code") if isinstance(error, dict) else None


def request_message(request_id: Any, method: str, params: Any = None) -> Message:
    msg: Message = {"jsonrpc": "2.0", "id": request_id, "method": method}
    if params is not None:
        msg["params"] = params
    return msg


def notification(method: str, params: Any = None) -> Message:
    msg: Message = {"jsonrpc": "2.0", "method": method}
    if params is not None:
        msg["params"] = params
    return msg


def encode(msg: Message) -> bytes:
    try:
        return msgspec.json.encode(msg) + b"\n"
    except (TypeError, UnicodeEncodeError):  # what only the json module writes (lone surrogates, ...)
        return json.dumps(msg).encode() + b"\n"


def decode(line: bytes) -> Message | None:
    """A line's JSON object, or None if it holds anything else."""
    try:
        msg = msgspec.json.decode(line)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        try:
            msg = json.loads(line)
        except (ValueError, RecursionError):
            return None
    return msg if isinstance(msg, dict) else None


def same_id(a: Any, b: Any) -> bool:
    """JSON-RPC ids are equal only with their types: 1, 1.0, "1" and true are four ids."""
    return type(a) is type(b) and a == b


def _key(request_id: Any) -> tuple[type, Any]:
    return type(request_id), request_id


def is_answer_to(request_id: Any) -> Callable[[Message], bool]:
    return lambda m: "method" not in m and same_id(m.get("id"), request_id)


class _Slot:
    """Where the answer to one request is put, and what wakes its waiter (if it does not read itself)."""

    __slots__ = ("answer", "event")

    def __init__(self, event: anyio.Event | threading.Event | None) -> None:
        self.answer: Message | None = None
        self.event = event


class Options(TypedDict, total=False):
    """What either face is made with beside its pipes (``_Connection``'s arguments, and their defaults there)."""

    stderr_file: IO[bytes] | None
    name: str
    handler: Handler | None
    observers: Iterable[Observer]
    first_id: int
    keep: bool


class _Connection:
    """Ids, waiting requests, dispatch and the stash: everything but reading and writing."""

    def __init__(
        self,
        *,
        stderr_file: IO[bytes] | None = None,
        name: str = "the agent",
        handler: Handler | None = None,
        observers: Iterable[Observer] = (),
        first_id: int = 0,
        keep: bool = True,
    ) -> None:
        self.name = name
        self.handler = handler
        self.observers = list(observers)
        self.keep = keep
        """Keep what is read: ``received`` (everything) and the stash; off, both stay empty."""
        self.received: list[Message] = []
        self.bad_lines: list[bytes] = []
        """Lines read that were not a JSON object."""
        self.input_closed = False
        self.output_closed = False
        self._next_id = first_id
        self._pending: dict[tuple[type, Any], _Slot] = {}
        """Requests sent and not answered yet, by id: the reader fills in an answer and drops the entry."""
        self._sent: dict[tuple[type, Any], _Slot] = {}
        """The synchronous face's requests whose ``answer`` has not been asked for yet: a reader thread
        may deliver an answer before its sender asks for it."""
        self._stash: collections.deque[Message] = collections.deque()
        self._lock = threading.RLock()  # the stash, for a face that reads in a thread of its own
        self._buf = b""
        self._stderr_file = stderr_file
        self._stderr_kept: bytes | None = None

    # --- ids and lines ---------------------------------------------------------------------

    def new_id(self) -> int:
        request_id = self._next_id
        self._next_id += 1
        return request_id

    def request_bytes(self, method: str, params: Any = None) -> tuple[int, bytes]:
        """A fresh id and the request's line, for a caller that reads the answer itself."""
        request_id = self.new_id()
        return request_id, encode(request_message(request_id, method, params))

    def _lines(self, chunk: bytes) -> list[bytes]:
        """The complete lines read so far; a partial last line waits for the next chunk."""
        *lines, self._buf = (self._buf + chunk if self._buf else chunk).split(b"\n")
        return lines

    def _dispatch(self, line: bytes) -> bytes | None:
        """Route one line read; the reply to write if the handler answered an agent request."""
        msg = decode(line)
        if msg is None:
            self.bad_lines.append(line)
            return None
        if self.keep:
            self.received.append(msg)
        for observe in self.observers:
            observe("in", msg)
        if "method" not in msg:
            try:
                slot = self._pending.pop(_key(msg.get("id")), None)
            except TypeError:  # an unhashable id: no request of ours
                slot = None
            if slot is not None:
                slot.answer = msg
                if slot.event is not None:
                    slot.event.set()
                return None
        elif "id" in msg and self.handler is not None:
            answer = self.handler(msg)
            if answer is not None:
                return encode({"jsonrpc": "2.0", "id": msg["id"], **answer})
        if self.keep:
            with self._lock:
                self._stash.append(msg)
                self._stashed()
        return None

    def _stashed(self) -> None:
        """A message was stashed (a face whose ``expect`` sleeps wakes it here)."""

    def _observe_out(self, data: bytes) -> None:
        for line in data.splitlines():
            msg = decode(line)
            if msg is not None:
                for observe in self.observers:
                    observe("out", msg)

    def _wake_all(self) -> None:
        for slot in self._pending.values():
            if slot.event is not None:
                slot.event.set()

    # --- the stash ---------------------------------------------------------------------------

    def stashed(self, method: str | None = None) -> list[Message]:
        """What was read and not claimed, oldest first (only ``method``'s, if given)."""
        with self._lock:
            return [m for m in self._stash if method is None or m.get("method") == method]

    def updates(self, session_id: str | None = None) -> list[Message]:
        """The stashed ``session/update`` notifications (of one session, if given)."""
        with self._lock:
            return [m for m in self._stash if _is_update(m, session_id)]

    def take_updates(self, session_id: str | None = None) -> list[Message]:
        """``updates``, taken out of the stash."""
        with self._lock:
            taken = self.updates(session_id)
            if taken:
                self._stash = collections.deque(m for m in self._stash if not _is_update(m, session_id))
            return taken

    def clear_stash(self) -> None:
        with self._lock:
            self._stash.clear()

    def _take(self, predicate: Callable[[Message], bool]) -> Message | None:
        with self._lock:
            for msg in self._stash:
                if predicate(msg):
                    self._stash.remove(msg)
                    return msg
            return None

    # --- the child's stderr and status ---------------------------------------------------------

    @property
    def stderr(self) -> bytes:
        """What the child wrote to stderr, when launched with ``stderr="capture"``."""
        if self._stderr_kept is not None:
            return self._stderr_kept
        if self._stderr_file is None:
            return b""
        fd = self._stderr_file.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0)  # the child's offset is shared: never move it

    def stderr_tail(self, lines: int = 3) -> str:
        """The last meaningful lines of ``stderr`` (a traceback's frame art dropped), joined."""
        text = self.stderr[-20_000:].decode("utf-8", "replace")
        kept = [line.strip(" |+") for line in text.splitlines()]
        return " / ".join([line for line in kept if line.strip("-^~ ")][-lines:])

    def _keep_stderr(self) -> None:
        if self._stderr_file is not None and self._stderr_kept is None:
            self._stderr_kept = self.stderr
            self._stderr_file.close()

    def _exit_statuses(self) -> list[int | None]:
        return []

    def describe(self) -> str:
        """`` (exit status 1): last stderr lines``, to end an error message with."""
        statuses = ", ".join("running" if code is None else f"exit status {code}" for code in self._exit_statuses())
        tail = self.stderr_tail() if self._stderr_file is not None else ""
        return (f" ({statuses})" if statuses else "") + (f": {tail}" if tail else "")

    def _closed(self, when: str = "") -> Closed:
        return Closed(f"{self.name} closed its output{' ' + when if when else ''}{self.describe()}")


def _is_update(msg: Message, session_id: str | None) -> bool:
    if msg.get("method") != UPDATE:
        return False
    return session_id is None or (msg.get("params") or {}).get("sessionId") == session_id


@contextlib.contextmanager
def _child_options(
    env: dict[str, str] | None, cwd: str | os.PathLike[str] | None, stderr: Stderr, start_new_session: bool
) -> Iterator[tuple[dict[str, Any], IO[bytes] | None]]:
    """How to start a child on two pipes, and the file that captures its stderr: closed with the connection, or
    on the way out of this block if the child could not be started in it."""
    log = tempfile.TemporaryFile() if stderr == "capture" else None  # noqa: SIM115
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": stderr if log is None else log}
    try:
        yield {**pipes, "env": env, "cwd": cwd, "start_new_session": start_new_session}, log
    except BaseException:
        if log is not None:
            log.close()
        raise


def _pipes(process: Any) -> tuple[Any, Any]:
    """A child's stdin and stdout."""
    assert process.stdin is not None
    assert process.stdout is not None
    return process.stdin, process.stdout


def _kill(pid: int, sig: int) -> None:
    # os.kill, not Popen.send_signal: that polls first and could reap the child behind the back of
    # an event loop's child watcher. An unreaped child's pid is still its own.
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


# --- async ------------------------------------------------------------------------------------


class Gateway(_Connection):
    """The async face: a reader task dispatches; requests wait on their own events."""

    def __init__(
        self,
        send: anyio.abc.ByteSendStream,
        receive: anyio.abc.ByteReceiveStream,
        *,
        process: anyio.abc.Process | None = None,
        **options: Unpack[Options],
    ) -> None:
        super().__init__(**options)
        self.process = process
        self._send_stream, self._receive_stream = send, receive
        self._send_lock = anyio.Lock()
        self._changed = anyio.Event()
        self.gone = anyio.Event()
        """Set once the peer's output has ended (or reading stopped)."""
        self._paused = False

    @classmethod
    @contextlib.asynccontextmanager
    async def launch(
        cls,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        stderr: Stderr = "capture",
        start_new_session: bool = False,
        close_timeout: float = 15.0,
        forked: bool = False,
        **options: Any,
    ) -> AsyncIterator[Self]:
        """Run ``argv`` and talk to it; on the way out, ``close(close_timeout)`` and reap it.

        ``forked``: a proxy (``argv`` is ``python -m acp_proxy ...``) is forked from the fork server
        (``tests/kit/forked.py``), where it is on, rather than exec'd.
        """
        with _child_options(env, cwd, stderr, start_new_session) as (child, log):
            if forked and forking.can_fork(argv, env):
                process: Any = await forking.spawn(
                    list(argv[3:]), env=env, cwd=cwd, stderr=log, start_new_session=start_new_session
                )
            else:
                process = await anyio.open_process(list(argv), **child)
        gateway = cls(*_pipes(process), process=process, stderr_file=log, **options)
        try:
            async with gateway._serving(close_timeout):
                yield gateway
        finally:
            with anyio.CancelScope(shield=True):
                gateway.kill()
                await process.aclose()  # waits, and closes the pipes
            gateway._keep_stderr()

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(
        cls,
        send: anyio.abc.ByteSendStream,
        receive: anyio.abc.ByteReceiveStream,
        *,
        close_timeout: float = 15.0,
        **options: Any,
    ) -> AsyncIterator[Self]:
        """Talk over given streams; on the way out, close ``send`` and wait for the end of ``receive``."""
        gateway = cls(send, receive, **options)
        async with gateway._serving(close_timeout):
            yield gateway

    @contextlib.asynccontextmanager
    async def _serving(self, close_timeout: float) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(self._read)
            try:
                yield
            finally:
                with anyio.CancelScope(shield=True):
                    await self.close(close_timeout)
                tasks.cancel_scope.cancel()

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def _exit_statuses(self) -> list[int | None]:
        return [] if self.process is None else [self.process.returncode]

    # --- reading ---------------------------------------------------------------------------

    async def _read(self) -> None:
        try:
            async for chunk in self._receive_stream:
                if self._paused:
                    await anyio.sleep_forever()
                for line in self._lines(chunk):
                    reply = self._dispatch(line)
                    if reply is not None:
                        with contextlib.suppress(Closed):
                            await self._write(reply)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        finally:
            self.output_closed = True
            self.gone.set()
            self._wake_all()
            self._changed.set()

    def _stashed(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def pause_reading(self) -> None:
        """Stop reading the peer's output, as a stuck gateway would."""
        self._paused = True

    # --- writing ---------------------------------------------------------------------------

    async def _write(self, data: bytes, msg: Message | None = None) -> None:
        async with self._send_lock:
            if self.input_closed or self.output_closed:
                raise Closed(f"{self.name}: {'its input is closed' if self.input_closed else 'it has gone'}")
            if msg is not None:
                for observe in self.observers:
                    observe("out", msg)
            elif self.observers:
                self._observe_out(data)
            try:
                await self._send_stream.send(data)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                raise Closed(f"{self.name}: cannot write: {exc!r}{self.describe()}") from None

    async def send(self, msg: Message) -> None:
        """Write one message as it is (``observers`` see it first)."""
        await self._write(encode(msg), msg)

    async def send_raw(self, data: bytes) -> None:
        """Write bytes as they are; ``observers`` see the JSON objects among their lines."""
        await self._write(data)

    async def notify(self, method: str, params: Any = None) -> None:
        await self.send(notification(method, params))

    async def cancel_request(self, request_id: Any) -> None:
        """``$/cancel_request``: withdraw a request sent earlier."""
        await self.notify(Method.CANCEL_REQUEST, {"requestId": request_id})

    # --- waiting -----------------------------------------------------------------------------

    async def request(
        self, method: str, params: Any = None, *, request_id: Any = AUTO, timeout: float = TIMEOUT
    ) -> Message:
        """Send a request and return its answer (a result or an error)."""
        request_id = self.new_id() if request_id is AUTO else request_id
        answered = anyio.Event()
        slot = self._pending[_key(request_id)] = _Slot(answered)
        try:
            await self.send(request_message(request_id, method, params))
            with anyio.move_on_after(timeout):
                await answered.wait()
        finally:
            self._pending.pop(_key(request_id), None)
        if slot.answer is not None:
            return slot.answer
        if self.output_closed:
            raise self._closed(f"before answering {method}")
        raise TimeoutError(f"{self.name}: no answer to {method} within {timeout:g} s")

    async def call(self, method: str, params: Any = None, *, timeout: float = TIMEOUT) -> Any:
        """A request's result; an error answer raises ``RpcError``."""
        answer = await self.request(method, params, timeout=timeout)
        if "result" not in answer:
            raise RpcError(method, answer.get("error"))
        return answer["result"]

    async def expect(self, predicate: Callable[[Message], bool], timeout: float = TIMEOUT) -> Message:
        """The first stashed message, or the first to come, that matches ``predicate``; taken from the stash."""
        with anyio.move_on_after(timeout):
            while (msg := self._take(predicate)) is None:
                if self.output_closed:
                    raise self._closed("while a message was still expected")
                await self._changed.wait()
            return msg
        raise TimeoutError(f"{self.name}: nothing expected arrived within {timeout:g} s")

    async def response_to(self, request_id: Any, timeout: float = TIMEOUT) -> Message:
        """The answer to a request sent with ``send``."""
        return await self.expect(is_answer_to(request_id), timeout)

    # --- the end -------------------------------------------------------------------------------

    async def close_input(self) -> None:
        """EOF on the peer's input (what a gateway's exit looks like to it)."""
        async with self._send_lock:
            if not self.input_closed:
                self.input_closed = True
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    await self._send_stream.aclose()

    async def close(self, timeout: float = 15.0) -> int | None:
        """EOF, then wait for the end of its output and its exit; SIGKILL after ``timeout``. Its exit status."""
        await self.close_input()
        with anyio.move_on_after(timeout):
            if self.process is not None:
                await self.process.wait()
            if not self._paused:
                await self.gone.wait()
        if self.process is None:
            return None
        if self.process.returncode is None:
            self.kill()
        return await self.process.wait()

    def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            _kill(self.process.pid, signal.SIGKILL)

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.returncode is None:
            _kill(self.process.pid, sig)

    # --- common sequences --------------------------------------------------------------------

    async def initialize(self, params: Message | None = None, *, request_id: Any = AUTO) -> Message:
        return await self.request(Method.INITIALIZE, params or INITIALIZE, request_id=request_id)

    async def new_session(self, cwd: str = "/tmp", **params: Any) -> str:
        response = await self.request(Method.NEW, {"cwd": cwd, "mcpServers": [], **params})
        if "result" not in response:
            raise RpcError(Method.NEW, response.get("error"))
        return str(response["result"]["sessionId"])

    async def prompt(self, session_id: str, text: str, timeout: float = 20.0) -> Message:
        return await self.request(Method.PROMPT, prompt_params(session_id, text), timeout=timeout)


INITIALIZE: Message = {
    "protocolVersion": 1,
    "clientCapabilities": {"fs": {"readTextFile": True, "writeTextFile": True}, "terminal": True},
    "clientInfo": {"name": "acp-proxy-kit", "version": "1"},
}


def prompt_params(session_id: str, text: str) -> Message:
    return {"sessionId": session_id, "prompt": [{"type": "text", "text": text}]}


# --- blocking ----------------------------------------------------------------------------------


class SyncGateway(_Connection):
    """The blocking face: the waiting caller reads and dispatches itself.

    With ``reader_thread=True`` a thread does the reading instead, for many threads
    sharing one connection. ``read_chunk``, ``read_line`` and ``take_buffered`` read
    bytes as they are, for callers that count or decode lines themselves.
    """

    def __init__(
        self,
        write: IO[bytes],
        read: IO[bytes],
        *,
        processes: Sequence[subprocess.Popen[bytes]] = (),
        read_size: int = READ_SIZE,
        reader_thread: bool = False,
        **options: Unpack[Options],
    ) -> None:
        super().__init__(**options)
        self.processes = list(processes)
        self.read_size = read_size
        self._write_file, self._read_file = write, read
        self._write_fd, self._read_fd = write.fileno(), read.fileno()
        self._write_lock = threading.Lock()  # ids and whole lines, whichever thread writes
        self._changed = threading.Condition(self._lock)
        self._reader: threading.Thread | None = None
        if reader_thread:
            self._reader = threading.Thread(target=self._read_forever, daemon=True)
            self._reader.start()

    @classmethod
    def launch(
        cls,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        stderr: Stderr = "capture",
        start_new_session: bool = False,
        **options: Any,
    ) -> Self:
        with _child_options(env, cwd, stderr, start_new_session) as (child, log):
            process = subprocess.Popen(list(argv), bufsize=0, **child)
        return cls(*_pipes(process), processes=[process], stderr_file=log, **options)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is not None:
            self.kill()
        self.close()

    @property
    def process(self) -> subprocess.Popen[bytes]:
        """The first (usually the only) process behind the connection."""
        return self.processes[0]

    @property
    def pid(self) -> int:
        return self.process.pid

    def _exit_statuses(self) -> list[int | None]:
        return [process.poll() for process in self.processes]

    # --- bytes -------------------------------------------------------------------------------

    def send_raw(self, data: bytes) -> None:
        """Write bytes as they are; ``observers`` see the JSON objects among their lines."""
        with self._write_lock:
            if self.observers:
                self._observe_out(data)
            self._write(data)

    def _write(self, data: bytes) -> None:
        if self.input_closed:
            raise Closed(f"{self.name}: its input is closed")
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._write_fd, view) :]
        except OSError as exc:
            raise Closed(f"{self.name}: cannot write: {exc}{self.describe()}") from None

    def read_chunk(self, timeout: float | None = None) -> bytes:
        """Up to ``read_size`` bytes as they come (bytes already buffered are not included)."""
        if timeout is not None and not select.select([self._read_fd], [], [], max(0.0, timeout))[0]:
            raise TimeoutError(f"{self.name}: nothing read within {timeout:g} s{self.describe()}")
        chunk = os.read(self._read_fd, self.read_size)
        if not chunk:
            self.output_closed = True
            raise self._closed()
        return chunk

    def read_line(self, timeout: float | None = None) -> bytes:
        """The next line as it is, without its newline; not dispatched."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (cut := self._buf.find(b"\n")) < 0:
            self._buf += self.read_chunk(None if deadline is None else deadline - time.monotonic())
        line, self._buf = self._buf[:cut], self._buf[cut + 1 :]
        return line

    def take_buffered(self) -> bytes:
        """Bytes read but not yet taken apart into lines."""
        data, self._buf = self._buf, b""
        return data

    # --- messages ------------------------------------------------------------------------------

    def send(self, msg: Message) -> None:
        data = encode(msg)
        with self._write_lock:
            for observe in self.observers:
                observe("out", msg)
            self._write(data)

    def notify(self, method: str, params: Any = None) -> None:
        self.send(notification(method, params))

    def cancel_request(self, request_id: Any) -> None:
        self.notify(Method.CANCEL_REQUEST, {"requestId": request_id})

    def send_request(self, method: str, params: Any = None, *, request_id: Any = AUTO) -> Any:
        """Send a request whose answer ``answer`` waits for; its id."""
        msg: Message = {}
        with self._write_lock:
            request_id = self.new_id() if request_id is AUTO else request_id
            slot = _Slot(threading.Event() if self._reader is not None else None)
            self._pending[_key(request_id)] = self._sent[_key(request_id)] = slot
            msg = request_message(request_id, method, params)
            for observe in self.observers:
                observe("out", msg)
            try:
                self._write(encode(msg))
            except Closed:
                self._pending.pop(_key(request_id), None)
                self._sent.pop(_key(request_id), None)
                raise
        return request_id

    def answer(self, request_id: Any, timeout: float = TIMEOUT) -> Message:
        """The answer to a request sent with ``send_request``."""
        slot = self._sent.pop(_key(request_id), None)
        if slot is None:
            raise KeyError(f"no request {request_id!r} is waiting")
        deadline = time.monotonic() + timeout
        try:
            while slot.answer is None:
                remaining = deadline - time.monotonic()
                if self._reader is None:
                    self._read_some(remaining)
                elif self.output_closed:
                    raise self._closed(f"before answering request {request_id!r}")
                elif remaining <= 0 or not (isinstance(slot.event, threading.Event) and slot.event.wait(remaining)):
                    raise TimeoutError
        except TimeoutError:
            raise TimeoutError(f"{self.name}: no answer to request {request_id!r} within {timeout:g} s") from None
        finally:
            self._pending.pop(_key(request_id), None)
        return slot.answer

    def request(self, method: str, params: Any = None, *, request_id: Any = AUTO, timeout: float = TIMEOUT) -> Message:
        return self.answer(self.send_request(method, params, request_id=request_id), timeout)

    def call(self, method: str, params: Any = None, *, timeout: float = TIMEOUT) -> Any:
        """A request's result; an error answer raises ``RpcError``."""
        answer = self.request(method, params, timeout=timeout)
        if "result" not in answer:
            raise RpcError(method, answer.get("error"))
        return answer["result"]

    def expect(self, predicate: Callable[[Message], bool], timeout: float = TIMEOUT) -> Message:
        """The first stashed message, or the first to come, that matches ``predicate``; taken from the stash."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while (msg := self._take(predicate)) is None:
                remaining = deadline - time.monotonic()
                if self.output_closed:
                    raise self._closed("while a message was still expected")
                if self._reader is None:
                    self._read_some(remaining)
                elif remaining <= 0 or not self._changed.wait(remaining):
                    raise TimeoutError(f"{self.name}: nothing expected arrived within {timeout:g} s")
        return msg

    def response_to(self, request_id: Any, timeout: float = TIMEOUT) -> Message:
        """The answer to a request sent with ``send``."""
        return self.expect(is_answer_to(request_id), timeout)

    def drain(self, quiet: float, limit: float) -> None:
        """Read and dispatch until nothing comes for ``quiet`` seconds, the output ends, or ``limit`` passes."""
        deadline = time.monotonic() + limit
        with contextlib.suppress(TimeoutError, Closed):
            while (remaining := deadline - time.monotonic()) > 0:
                self._read_some(min(quiet, remaining))

    def _read_some(self, timeout: float | None) -> None:
        """Read one chunk and dispatch its lines."""
        lines = self._lines(self.read_chunk(timeout))
        with self._lock:  # slots and the stash change together, whichever thread waits
            replies = [reply for line in lines if (reply := self._dispatch(line)) is not None]
        for reply in replies:
            with contextlib.suppress(Closed):
                self.send_raw(reply)

    def _read_forever(self) -> None:
        try:
            while True:
                self._read_some(None)
        except Closed:
            pass
        finally:
            self.output_closed = True
            self._wake_all()
            with self._changed:
                self._changed.notify_all()

    def _stashed(self) -> None:
        if self._reader is not None:
            self._changed.notify_all()  # the stash's lock is held

    # --- the end -------------------------------------------------------------------------------

    def close_input(self) -> None:
        with self._write_lock:
            if not self.input_closed:
                self.input_closed = True
                with contextlib.suppress(OSError):
                    self._write_file.close()

    def wait(self, timeout: float) -> bool:
        """Wait for every process to exit (woken by its pidfd); whether they all did within ``timeout``."""
        deadline = time.monotonic() + timeout
        for process in self.processes:
            if process.poll() is not None:
                continue
            try:
                pidfd = os.pidfd_open(process.pid)
            except OSError:  # gone already, or no pidfd: Popen's own polling wait
                try:
                    process.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    return False
                continue
            try:
                if not select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                    return False
            finally:
                os.close(pidfd)
            process.wait()
        return True

    def close(self, timeout: float = 15.0) -> int | None:
        """EOF, wait for every process to exit (SIGKILL after ``timeout``), close the pipes; the first one's status."""
        self.close_input()
        if not self.wait(timeout):
            self.kill()
            for process in self.processes:
                process.wait()
        if self._reader is not None:
            self._reader.join(5)
        with contextlib.suppress(OSError):
            self._read_file.close()
        self._keep_stderr()
        return self.processes[0].returncode if self.processes else None

    def kill(self) -> None:
        for process in self.processes:
            if process.returncode is None:
                _kill(process.pid, signal.SIGKILL)

    def signal(self, sig: int) -> None:
        for process in self.processes[:1]:
            if process.returncode is None:
                _kill(process.pid, sig)

    # --- common sequences --------------------------------------------------------------------

    def initialize(self, params: Message | None = None, *, timeout: float = TIMEOUT) -> Any:
        return self.call(Method.INITIALIZE, params or INITIALIZE, timeout=timeout)

    def new_session(self, cwd: str = "/tmp", *, timeout: float = TIMEOUT, **params: Any) -> str:
        result = self.call(Method.NEW, {"cwd": cwd, "mcpServers": [], **params}, timeout=timeout)
        session_id = result.get("sessionId") if isinstance(result, dict) else None
        if not isinstance(session_id, str):
            raise GatewayError(f"{self.name}: session/new returned {str(result)[:300]}")
        return session_id

    def prompt(self, session_id: str, text: str, timeout: float = 20.0) -> Message:
        return self.request(Method.PROMPT, prompt_params(session_id, text), timeout=timeout)
