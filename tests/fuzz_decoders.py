"""Coverage-guided fuzzing of the framing and envelope decoders, with atheris (libFuzzer for Python).

Every input is a byte stream as a peer could send it, and a way of cutting it into reads:

* ``LineReader`` splits it (read by read, under a line limit that is sometimes tiny) into
  exactly what a plain model says: every line up to the limit, in order, each line over it
  counted once and never delivered, an unterminated last line delivered unless blank;
  each batch's ``block`` is its lines with their newlines;
* ``decode_line`` gives each line a ``Message`` and the ``Kind`` ``classify`` gives it, or a
  ``BadLine``; a message re-encodes (``encode``, ``with_id``) to a line of the same kind,
  and a bad line's error answer is JSON-RPC with the right code and an id ``salvage_id``
  may give (an int, a string or null);
* ``decode_block`` over those lines agrees with ``decode_line`` line by line, or declines
  (``None``), and declines whenever some line is unparseable; ``notification_methods`` gives
  a set only when every line is a notification, and then exactly their methods; ``notification_sessions``
  a list only then, and exactly what ``session_of`` gives each;
* the ACP readers of a decoded message (``session_of``, ``target_request``, ``proxy_meta``,
  ``rewrite_session_id``, ``retarget_request``, ``AgentCapabilities.from_initialize``,
  ``annotate_initialize``, ``params_structured``, ``decode_object``, and the ``session/update``
  readers ``session_info_of`` and ``reports_work`` on any line) return their documented types.

Anything else (an exception, a wrong type, a disagreement) is a crash: libFuzzer stops and
saves the input. ``python -m tests.fuzz_decoders --runs N`` runs it and prints a summary;
atheris comes with the ``fuzz`` extra (``pip install -e '.[fuzz]'``; wheels for Linux x86_64).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

SEEDS = [
    b'\x10\x80{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":1}}\n',
    b'\x03\x80{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s","update":{}}}\n'
    b'{"jsonrpc":"2.0","method":"session/update","params":{"sessionId":"s"}}\n',
    b'\x40\x80{"jsonrpc":"2.0","id":"a","result":{"agentCapabilities":{"loadSession":true,'
    b'"sessionCapabilities":{"resume":{}}},"_meta":{"acp-proxy":{}}}}\n',
    b'\x07\x80{"jsonrpc":"2.0","method":"$/cancel_request","params":{"requestId":3,"_meta":{}}}\n',
    b'\x05\x10{"jsonrpc":"2.0","id":1,"error":{"code":-32600,"message":"m","data":[1]}}\nnot json\n\n[1,2\n',
    b'\x01\x80{"jsonrpc":"2.0","id":7,"method":"session/prompt","params":{"sessionId":"x","prompt":[]}}',
]
"""Starting inputs: byte 0 sets the read size, byte 1 the line limit (high bit: no small limit)."""
DICTIONARY = [
    b'"jsonrpc"',
    b'"2.0"',
    b'"id"',
    b'"method"',
    b'"params"',
    b'"result"',
    b'"error"',
    b'"code"',
    b'"message"',
    b'"data"',
    b'"sessionId"',
    b'"requestId"',
    b'"_meta"',
    b'"acp-proxy"',
    b'"agentCapabilities"',
    b'"sessionCapabilities"',
    b'"loadSession"',
    b'"resume"',
    b'"close"',
    b'"fork"',
    b'"session/update"',
    b'"$/cancel_request"',
    b"null",
    b"true",
    b"false",
    rb"\u0000",
    rb"\ud800",
    b"1e400",
    b"18446744073709551616",
    b"}\n{",
    b"\xff",
    b"\xed\xa0\x80",
]
"""libFuzzer dictionary tokens: the words the decoders look for, and bytes they must refuse."""


class Chunks:
    """A byte stream that hands out ``data`` ``size`` bytes at a time, then ends; it never waits."""

    def __init__(self, data: bytes, size: int) -> None:
        self._data = data
        self._size = size
        self._at = 0

    async def receive(self, max_bytes: int = 65536) -> bytes:
        import anyio

        if self._at >= len(self._data):
            raise anyio.EndOfStream
        piece = self._data[self._at : self._at + min(self._size, max_bytes)]
        self._at += len(piece)
        return piece

    async def aclose(self) -> None:
        pass


def check(data: bytes) -> None:
    """One input through every decoder; a disagreement with the documented outcomes raises."""
    if len(data) < 2:
        return
    from acp_proxy.protocol import jsonrpc

    read_size = 1 + data[0] * 3
    limit = jsonrpc.DEFAULT_MAX_LINE_BYTES if data[1] & 0x80 else 1 + data[1]
    stream = data[2:]
    lines = check_framing(stream, read_size, limit)
    for line in lines:
        check_line(line)
    check_block(lines)


def check_framing(stream: bytes, read_size: int, limit: int) -> list[bytes]:
    """``LineReader`` against the plain model of what it must deliver; the lines it delivered."""
    import anyio

    from acp_proxy.protocol import jsonrpc

    reader = jsonrpc.LineReader(Chunks(stream, read_size), limit, read_size)  # type: ignore[arg-type]
    lines: list[bytes] = []
    overlong = 0
    while True:
        try:
            batch = run_now(reader.receive_batch())
        except anyio.EndOfStream:
            break
        assert isinstance(batch, jsonrpc.Batch)
        assert batch.block == b"".join(line + b"\n" for line in batch.lines), batch.block[:100]
        assert batch.count == len(batch.lines)
        overlong += batch.overlong
        lines += batch.lines
    *terminated, tail = stream.split(b"\n")
    expected = [line for line in terminated if len(line) <= limit]
    expected_overlong = len(terminated) - len(expected) + (len(tail) > limit)
    if tail.strip() and len(tail) <= limit:
        expected.append(tail)
    assert lines == expected, (lines[:3], expected[:3])
    assert overlong == expected_overlong, (overlong, expected_overlong)
    return lines


def check_line(line: bytes) -> None:
    import msgspec

    from acp_proxy.protocol import acp, jsonrpc

    salvaged = jsonrpc.salvage_id(line)
    assert salvaged is None or type(salvaged) in (int, str), salvaged
    # The readers of session/update lines on the relay path (titles, background work) take any bytes.
    info = acp.session_info_of(line)
    assert info is None or (isinstance(info[0], str) and set(info[1]) <= {"title", "updatedAt"}), info
    assert isinstance(acp.reports_work(line), bool)
    decoded = jsonrpc.decode_line(line)
    if isinstance(decoded, jsonrpc.BadLine):
        answer = msgspec.json.decode(jsonrpc.bad_line_response(decoded, line))
        assert answer["error"]["code"] == decoded.value, answer
        assert answer["id"] == (salvaged if decoded is jsonrpc.BadLine.INVALID else None), answer
        return
    msg, kind = decoded
    assert isinstance(msg, jsonrpc.Message), msg
    assert jsonrpc.classify(msg) is kind, (msg, kind)
    encoded = [jsonrpc.encode(msg)]
    if kind is not jsonrpc.Kind.NOTIFICATION:  # under another id, as the relays send it on
        encoded += [jsonrpc.with_id(msg, 7), jsonrpc.with_id(msg, "x")]
    for again in encoded:
        redecoded = jsonrpc.decode_line(again[:-1])
        assert isinstance(redecoded, tuple), (again[:200], redecoded)
        assert redecoded[1] is kind, (again[:200], redecoded)
    check_acp(msg)


def check_acp(msg: Any) -> None:
    """The ACP readers over a decoded envelope's params and result: their documented types, never a raise."""
    from msgspec import UNSET, Raw

    from acp_proxy.protocol import acp, jsonrpc

    for raw in (msg.params, msg.result):
        assert isinstance(jsonrpc.params_structured(raw), bool)
        obj = jsonrpc.decode_object(raw)
        assert obj is None or isinstance(obj, dict)
        session = acp.session_of(raw)
        assert session is None or isinstance(session, str), session
        if session is not None:
            assert isinstance(obj, dict), (raw, session)
            assert obj.get("sessionId") == session, (obj, session)
            rewritten = acp.rewrite_session_id(raw, session, "new")
            assert acp.session_of(rewritten) == "new", rewritten
        assert isinstance(acp.proxy_meta(raw), dict)
        names, target = acp.target_request(raw)
        assert isinstance(names, bool), names
        assert target is None or type(target) in (int, str), target
        if names:
            assert acp.target_request(acp.retarget_request(raw, 7)) == (True, 7)
        assert isinstance(acp.AgentCapabilities.from_initialize(raw), acp.AgentCapabilities)
        if isinstance(raw, Raw):
            assert isinstance(acp.annotate_initialize(raw, "fuzz"), Raw)
        else:
            assert raw is UNSET


def check_block(lines: list[bytes]) -> None:
    """The one-call decoders over a block agree with the line-by-line one, or decline."""
    from acp_proxy.protocol import acp, jsonrpc

    if not lines:
        return
    block = b"".join(line + b"\n" for line in lines)
    per_line = [jsonrpc.decode_line(line) for line in lines]
    msgs = jsonrpc.decode_block(block, len(lines))
    if msgs is not None:
        assert len(msgs) == len(lines)
        for msg, decoded in zip(msgs, per_line, strict=True):
            assert decoded is not jsonrpc.BadLine.PARSE, (block[:200], msg)
            if isinstance(decoded, tuple):
                assert msg == decoded[0], (msg, decoded)
            else:
                assert jsonrpc.classify(msg) is None, (msg, decoded)
    methods = jsonrpc.notification_methods(block, len(lines))
    if methods is not None:
        assert all(isinstance(decoded, tuple) and decoded[1] is jsonrpc.Kind.NOTIFICATION for decoded in per_line)
        assert methods == {decoded[0].method for decoded in per_line if isinstance(decoded, tuple)}
    sessions = acp.notification_sessions(block, len(lines))
    if sessions is not None:
        assert all(isinstance(decoded, tuple) and decoded[1] is jsonrpc.Kind.NOTIFICATION for decoded in per_line)
        assert sessions == [acp.session_of(decoded[0].params) for decoded in per_line if isinstance(decoded, tuple)]


def run_now(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that never waits (its stream always has data or has ended) to its end."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise AssertionError("the reader waited, on a stream that never blocks")


def libfuzzer_escaped(token: bytes) -> str:
    """A dictionary token as libFuzzer reads it: printable ASCII as it is, anything else as \\xNN."""
    return "".join(chr(b) if 32 <= b < 127 and b not in b'"\\' else f"\\x{b:02x}" for b in token)


def fuzz(runs: int, seed: int, workdir: Path, timeout: int) -> None:
    """The libFuzzer loop itself (it ends the process)."""
    import atheris

    with atheris.instrument_imports(include=["acp_proxy"]):
        import acp_proxy.protocol.acp
        import acp_proxy.protocol.jsonrpc  # noqa: F401

    corpus = workdir / "corpus"
    corpus.mkdir(exist_ok=True)
    for n, seed_input in enumerate(SEEDS):
        (corpus / f"seed-{n}").write_bytes(seed_input)
    dictionary = workdir / "json.dict"
    dictionary.write_text("".join(f'"{libfuzzer_escaped(token)}"\n' for token in DICTIONARY))
    args = [
        sys.argv[0],
        f"-runs={runs}",
        f"-seed={seed}",
        f"-timeout={timeout}",
        "-max_len=4096",
        "-rss_limit_mb=2048",
        f"-dict={dictionary}",
        f"-artifact_prefix={workdir}/",
        "-print_final_stats=1",
        str(corpus),
    ]
    atheris.Setup(args, check)
    atheris.Fuzz()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz_decoders", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1_000_000, help="executions (default 1000000)")
    parser.add_argument("--seed", type=int, default=1, help="libFuzzer's seed (default 1)")
    parser.add_argument("--timeout", type=int, default=10, help="seconds one input may take before it is a hang")
    parser.add_argument("--workdir", type=Path, default=None, help="where the corpus and any crashing input go")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        import atheris  # noqa: F401
    except ImportError:
        print(
            "tests.fuzz_decoders needs atheris, which is not installed: pip install -e '.[fuzz]' "
            "(atheris has wheels for Linux x86_64; elsewhere it builds with clang and libFuzzer)",
            file=sys.stderr,
        )
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="acp-proxy-fuzz-decoders-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.child:
        fuzz(args.runs, args.seed, workdir, args.timeout)
        return 0  # not reached: libFuzzer exits
    # libFuzzer ends its process when it is done, so it runs in a child and this one reports.
    command = [sys.executable, "-m", "tests.fuzz_decoders", "--child", f"--runs={args.runs}", f"--seed={args.seed}"]
    command += [f"--timeout={args.timeout}", f"--workdir={workdir}"]
    started = time.monotonic()
    # A bound on the whole run: ten times the slowest rate seen, and never less than ten minutes.
    bound = max(600.0, args.runs / 200)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=bound, check=False)
    except subprocess.TimeoutExpired:
        print(f"fuzz decoders: no end within {bound:g} s (a hang); work dir {workdir}", file=sys.stderr)
        return 1
    seconds = time.monotonic() - started
    log = done.stderr
    (workdir / "libfuzzer.log").write_text(log)
    executions = re.findall(r"stat::number_of_executed_units: (\d+)", log)
    coverage = re.findall(r"#\d+\s+\w+\s+cov: (\d+) ft: (\d+) corp: (\d+)", log)
    crashes = sorted(path.name for path in workdir.iterdir() if path.name.startswith(("crash-", "timeout-", "oom-")))
    count = int(executions[-1]) if executions else 0
    print(
        f"fuzz decoders: {count:,} executions in {seconds:.0f} s ({count / seconds:,.0f}/s), seed {args.seed}, "
        f"exit status {done.returncode}"
    )
    if coverage:
        cov, features, corpus = coverage[-1]
        print(f"  coverage: {cov} edges, {features} features, corpus {corpus} inputs")
    print(f"  crashes, hangs and out-of-memory inputs: {len(crashes)} {' '.join(crashes)}")
    if done.returncode != 0 or crashes or count < args.runs:
        print(log[-4000:], file=sys.stderr)
        print(f"work dir kept: {workdir}", file=sys.stderr)
        return 1
    if args.workdir is None:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
