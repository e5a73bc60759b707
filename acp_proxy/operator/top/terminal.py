"""``acp-proxy top`` on a terminal: the edge where keys are read, snapshots gathered and acts done.

The terminal is in cbreak mode (keys one at a time, ISIG kept: Ctrl-C is SIGINT) and rich
holds the alternate screen; both are put back on the way out, however it is taken. A
refresher thread gathers; each confirmed act runs in a thread of its own through the same
code as ``acp-proxy sessions suspend|close`` and ``tasks cancel``, or (an answer to a waiting
request) as ``answer_permission`` to the control socket of the proxy it waits in; a self-pipe
wakes the loop when a key, a snapshot, an outcome or a resize arrives.

Only the loop's own thread decides when the view ends, and it waits for no other: ``q``,
Ctrl-C, SIGTERM and a hang-up end it at once, whatever a gather or an act is waiting on.
Those threads are daemons that only read or have already sent their act: they are
abandoned, not joined (a gather may wait seconds on a locked database or a stalled proxy).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import sys
import termios
import threading
import time
import tty
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Final, TextIO

from rich.console import Console
from rich.live import Live
from rich.text import Text

from acp_proxy.operator import reports
from acp_proxy.operator.permissions import answer_on
from acp_proxy.operator.top.snapshot import Gatherer, Snapshot, snapshot_json
from acp_proxy.operator.top.view import Pending, ViewState, acted, on_key, print_plain, render

DEFAULT_INTERVAL: Final = 1.0


_SEQUENCES: Final = {
    b"\x1b[A": "up",
    b"\x1bOA": "up",
    b"\x1b[B": "down",
    b"\x1bOB": "down",
    b"\x1b[Z": "backtab",
}
_NAMED: Final = {b"\t": "tab", b"\r": "enter", b"\n": "enter", b"\x1b": "esc"}
_CSI_END: Final = re.compile(rb"[\x40-\x7e]")


def decode_keys(data: bytes) -> tuple[list[str], bytes]:
    """The keys in ``data`` read from a terminal in cbreak mode, and an escape sequence cut short (kept
    for the next read). Unknown sequences are skipped; a lone ESC at the end is the Escape key."""
    keys: list[str] = []
    i = 0
    while i < len(data):
        if data[i] == 0x1B and i + 1 < len(data) and data[i + 1] in b"[O":
            end = _CSI_END.search(data, i + 2)
            if end is None:
                return keys, data[i:]
            sequence = data[i : end.end()]
            if sequence in _SEQUENCES:
                keys.append(_SEQUENCES[sequence])
            i = end.end()
            continue
        byte = data[i : i + 1]
        if byte in _NAMED:
            keys.append(_NAMED[byte])
        elif 0x20 <= data[i] < 0x7F:
            keys.append(byte.decode())
        i += 1
    return keys, b""


class _Wakeup:
    """A self-pipe: threads and signal handlers wake the loop's ``select``.

    A poke may come after the loop has ended (an act still waiting on the agent, a refresher that
    outlived its join): once closed, pokes do nothing, rather than write to a descriptor number
    the process may have given to another file. Re-entrant, for a signal handler's poke on the
    thread that is closing.
    """

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)
        self._lock = threading.RLock()
        self._closed = False

    def poke(self) -> None:
        with self._lock:
            if self._closed:
                return
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(self.write_fd, b".")

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.read_fd, 4096):
                pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self.read_fd)
            os.close(self.write_fd)


class _Refresher:
    """Gathers a snapshot every ``interval`` (or at once when asked) in a thread of its own."""

    def __init__(self, gatherer: Gatherer, interval: float, wakeup: _Wakeup) -> None:
        self.gatherer = gatherer
        self.interval = interval
        self.wakeup = wakeup
        self.latest: Snapshot | None = None
        self._poke = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="acp-proxy top refresh", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def refresh_now(self) -> None:
        self._poke.set()

    def stop(self) -> None:
        """Ask the thread to end after its gather; never wait for it (the gather may be blocked)."""
        self._stopping = True
        self._poke.set()

    def _run(self) -> None:
        try:
            while not self._stopping:
                try:
                    snapshot = self.gatherer.gather()
                except Exception as exc:  # a locked or damaged database: keep showing the last one, say why
                    last = self.latest or Snapshot(str(self.gatherer.state_dir), time.time(), False)
                    snapshot = replace(last, problem=reports.printable(str(exc) or type(exc).__name__))
                self.latest = snapshot
                self.wakeup.poke()
                self._poke.wait(self.interval)
                self._poke.clear()
        finally:
            self.gatherer.close()


def answer_request(state_dir: Path, act: Pending) -> reports.Acted:
    """Answer a waiting request (``act.option``, or deny it) through the proxy it waits in; the first
    answer wins: one already given (by the gateway, an attached client, another operator) is said so."""
    try:
        assert act.instance is not None  # an answer names the proxy its request waits in
        result = answer_on(state_dir, act.instance, act.target, act.option, by=f"top, uid {os.getuid()}")
    except reports.OperatorError as exc:
        return reports.Acted({"request": act.target, "answered": False, "reason": str(exc)}, str(exc), exc.exit_code)
    outcome = result.get("outcome")
    chosen = outcome.get("optionId") if isinstance(outcome, dict) else None
    if isinstance(chosen, str):
        message = f"request {act.target} answered {chosen}"
    elif isinstance(outcome, dict) and outcome.get("outcome") == "cancelled":
        message = f"request {act.target} denied (answered cancelled)"
    else:
        message = f"request {act.target} answered"
    return reports.Acted({"answered": True, **result}, message, 0)


class _Acting:
    """One confirmed act, done in a thread of its own (a cancel may wait for the agent for seconds)."""

    def __init__(self, state_dir: Path, act: Pending, wakeup: _Wakeup) -> None:
        self.outcome: tuple[str, bool] | None = None
        self._thread = threading.Thread(
            target=self._run, args=(state_dir, act, wakeup), name="acp-proxy top act", daemon=True
        )
        self._thread.start()

    def _run(self, state_dir: Path, act: Pending, wakeup: _Wakeup) -> None:
        try:
            if act.action == "answer":
                done = answer_request(state_dir, act)
            elif act.action == "cancel":
                done = reports.cancel_turn(state_dir, act.target, wait=True)
            else:
                done = reports.act_on_session(state_dir, act.target, action=act.action)
            outcome = (done.message, done.exit_code != 0)
        except reports.OperatorError as exc:
            outcome = (str(exc), True)
        except Exception as exc:  # shown, not raised: the view stays up
            outcome = (f"{act.describe()} failed: {exc}", True)
        message, failed = outcome
        self.outcome = (reports.printable(message), failed)  # a refusal may quote the adapter
        wakeup.poke()


@contextlib.contextmanager
def _cbreak(fd: int) -> Iterator[None]:
    """Keys one at a time, not echoed; the tty's modes as they were on the way out, whatever happens."""
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd, termios.TCSANOW)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


@contextlib.contextmanager
def _signals(wakeup: _Wakeup) -> Iterator[None]:
    """A resize wakes the loop; SIGTERM and SIGHUP (the SSH session gone) end it through the cleanup."""

    def resized(signum: int, frame: FrameType | None) -> None:
        wakeup.poke()

    def ended(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    handlers: dict[int, Callable[[int, FrameType | None], None]] = {
        signal.SIGWINCH: resized,
        signal.SIGTERM: ended,
        signal.SIGHUP: ended,
    }
    previous = {signum: signal.signal(signum, handler) for signum, handler in handlers.items()}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def _screen(fd: int, console: Console, wakeup: _Wakeup) -> Iterator[Live]:
    """The terminal taken for the view (signals, cbreak, the alternate screen); put back as it was
    found on the way out, whatever ends the view: ``q``, Ctrl-C, SIGTERM, a hang-up or a bug."""
    with (
        _signals(wakeup),
        _cbreak(fd),
        Live(console=console, screen=True, auto_refresh=False, redirect_stdout=False, redirect_stderr=False) as live,
    ):
        yield live


def _interactive(state_dir: Path, gatherer: Gatherer, interval: float) -> int:
    stdin = sys.stdin.fileno()
    console = Console()
    wakeup = _Wakeup()
    refresher = _Refresher(gatherer, interval, wakeup)
    view = ViewState()
    acting: _Acting | None = None
    pending_bytes = b""
    nothing_yet = Snapshot(str(state_dir), time.time(), False)
    try:
        with _screen(stdin, console, wakeup) as live:
            refresher.start()
            while True:
                snapshot = refresher.latest or nothing_yet
                if acting is not None and acting.outcome is not None:
                    view, acting = acted(view, *acting.outcome), None
                    refresher.refresh_now()
                width, height = console.size
                screen = render(snapshot, view, width, height) if refresher.latest else Text(f"reading {state_dir}…")
                live.update(screen, refresh=True)
                ready, _, _ = select.select([stdin, wakeup.read_fd], [], [])
                if wakeup.read_fd in ready:
                    wakeup.drain()
                if stdin not in ready:
                    continue
                data = os.read(stdin, 1024)
                if not data:  # the terminal is gone
                    return 0
                keys, pending_bytes = decode_keys(pending_bytes + data)
                for key in keys:
                    step = on_key(view, snapshot, key)
                    view = step.view
                    if step.quit:
                        return 0
                    if step.act is not None:
                        acting = _Acting(state_dir, step.act, wakeup)
    except KeyboardInterrupt:
        return 0
    finally:
        refresher.stop()
        wakeup.close()


def run(
    state_dir: Path,
    *,
    interval: float = DEFAULT_INTERVAL,
    max_live: int | None = None,
    max_memory: int | None = None,
    once: bool = False,
    as_json: bool = False,
    out: TextIO | None = None,
) -> int:
    """``acp-proxy top``: the live view on a terminal; one snapshot (a table, or JSON) otherwise."""
    out = out or sys.stdout
    gatherer = Gatherer(state_dir, max_live=max_live, max_memory=max_memory)
    if as_json or once or not (out.isatty() and sys.stdin.isatty()):
        try:
            snapshot = gatherer.gather()
        finally:
            gatherer.close()
        if as_json:
            out.write(json.dumps(snapshot_json(snapshot), indent=2) + "\n")
        else:
            print_plain(snapshot, out)
        return 0
    return _interactive(state_dir, gatherer, interval)
