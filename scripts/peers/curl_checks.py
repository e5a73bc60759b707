"""remote-curl-http2: curl (libcurl over nghttp2) as a streamable HTTP client of ``serve`` over HTTP/2.

``serve`` speaks cleartext HTTP/2 with its own server (``acp_proxy/remote/h2server.py``); the
SDKs' HTTP clients speak HTTP/1.1 (hypercorn's), so this is the check of that server against an
HTTP/2 implementation of someone else's: curl ``--http2-prior-knowledge``, one process a request as
a shell script would. ``initialize`` (its answer the POST's body, the connection id a header), the
connection's event stream, ``session/new`` (answered there), the session's event stream, a prompt
of the echo agent (answered there, a cursor on each event), the session's stream opened again with
``Last-Event-ID`` of its first event (the rest replayed, with the same cursors), a cursor that is
none of the stream's (409), ``DELETE``, and ``serve`` stopped by SIGTERM with nothing left running.
Each exchange must be HTTP/2 (curl's ``%{http_version}``).
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

from .harness import Peers
from .remote_checks import serving_echo
from .report import CheckFailed

TIMEOUT = 30.0
OPENED = 1.0
"""Seconds given curl to open an event stream before what it is to carry is sent."""


class Curl:
    def __init__(self, url: str, token: str, log: Path) -> None:
        self.url = url
        self.token = token
        self.log = log

    def run(self, *args: str, timeout: float = TIMEOUT) -> tuple[str, str, str]:
        """curl's status line (code, HTTP version), headers and body of one request."""
        argv = ["curl", "-sS", "--http2-prior-knowledge", "-H", f"authorization: Bearer {self.token}"]
        argv += ["-D", "-", "-w", "\n%{http_code} %{http_version}", "--max-time", f"{timeout:g}", *args, self.url]
        done = subprocess.run(argv, capture_output=True, timeout=timeout + 10)
        with open(self.log, "ab") as log:
            log.write(b"$ " + " ".join(argv).replace(self.token, "TOKEN").encode() + b"\n" + done.stderr)
        out = done.stdout.decode("utf-8", "replace")
        head, _, rest = out.partition("\r\n\r\n")
        body, _, status = rest.rpartition("\n")
        if done.returncode not in (0, 28):  # 28: --max-time, how an event stream read for a while ends
            raise CheckFailed(f"curl exited {done.returncode}: {done.stderr.decode(errors='replace')[-300:]}")
        return status.strip(), head, body

    def post(self, body: object, *headers: str) -> tuple[str, str, str]:
        extra = [arg for header in ("content-type: application/json", *headers) for arg in ("-H", header)]
        return self.run(*extra, "--data-binary", json.dumps(body))

    def events(self, seconds: float, *headers: str) -> tuple[str, list[tuple[str | None, object]]]:
        """Read an event stream for ``seconds``: its status and its events (cursor, message)."""
        extra = [arg for header in ("accept: text/event-stream", *headers) for arg in ("-H", header)]
        status, _, body = self.run("-N", *extra, timeout=seconds)
        found: list[tuple[str | None, object]] = []
        for block in body.split("\n\n"):
            cursor = next((line[4:] for line in block.split("\n") if line.startswith("id: ")), None)
            data = [line[6:] for line in block.split("\n") if line.startswith("data: ")]
            if data:
                found.append((cursor, json.loads("\n".join(data))))
        return status, found


def remote_curl_http2(peers: Peers, name: str) -> str:
    if shutil.which("curl") is None:
        raise CheckFailed("curl is not installed")
    version = subprocess.run(["curl", "--version"], capture_output=True, text=True, timeout=10).stdout
    if "nghttp2" not in version:
        raise CheckFailed("this curl has no HTTP/2 (nghttp2)")
    with serving_echo(peers, name) as served:
        found = exchange(Curl(served.url, served.token, served.client_log))
    return f"{found}; serve stopped by SIGTERM in {served.seconds:.1f}s, nothing left running ({version.split()[1]})"


def exchange(curl: Curl) -> str:
    initialize = {"protocolVersion": 1, "clientCapabilities": {}}
    status, head, body = curl.post({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": initialize})
    match = re.search(r"(?im)^acp-connection-id: *(\S+)", head)
    if status != "200 2" or match is None or "result" not in json.loads(body):
        raise CheckFailed(f"initialize: {status}, {head!r}, {body[:200]!r}")
    connection = f"acp-connection-id: {match.group(1)}"
    statuses = [status]

    def posted(message: object, *headers: str) -> None:
        status, _, body = curl.post(message, connection, *headers)
        statuses.append(status)
        if status != "202 2":
            raise CheckFailed(f"POST {json.dumps(message)[:120]}: {status} {body[:200]!r}")

    with Reading(curl, 4.0, connection) as connection_events:
        posted({"jsonrpc": "2.0", "id": 2, "method": "session/new", "params": {"cwd": "/tmp", "mcpServers": []}})
    status, events = connection_events.result()
    answer = next((m for _, m in events if isinstance(m, dict) and m.get("id") == 2), None)
    if status != "200 2" or not isinstance(answer, dict) or "sessionId" not in answer.get("result", {}):
        raise CheckFailed(f"session/new on the connection's stream: {status}, {events[:3]}")
    session_id = answer["result"]["sessionId"]
    session = f"acp-session-id: {session_id}"
    prompt = {"sessionId": session_id, "prompt": [{"type": "text", "text": "hello over HTTP/2"}]}
    with Reading(curl, 4.0, connection, session) as session_events:
        posted({"jsonrpc": "2.0", "id": 3, "method": "session/prompt", "params": prompt}, session)
    status, events = session_events.result()
    ended = [m for _, m in events if isinstance(m, dict) and m.get("id") == 3]
    if status != "200 2" or not ended or ended[0].get("result", {}).get("stopReason") != "end_turn":
        raise CheckFailed(f"the prompt's answer on the session's stream: {status}, {events}")
    if len(events) < 2 or any(cursor is None for cursor, _ in events):
        raise CheckFailed(f"the session's events, each with a cursor: {events}")
    status, replayed = curl.events(3.0, connection, session, f"last-event-id: {events[0][0]}")
    if status != "200 2" or replayed != events[1:]:
        raise CheckFailed(f"Last-Event-ID {events[0][0]}: {status}, replayed {replayed}, expected {events[1:]}")
    refused, _, _ = curl.run(
        "-H", connection, "-H", session, "-H", "last-event-id: none-1", "-H", "accept: text/event-stream"
    )
    if refused != "409 2":
        raise CheckFailed(f"an unknown Last-Event-ID: {refused}, not 409")
    deleted, _, _ = curl.run("-X", "DELETE", "-H", connection)
    if deleted != "202 2":
        raise CheckFailed(f"DELETE: {deleted}")
    return (
        f"every exchange HTTP/2 ({len(statuses) + 5} requests): initialize 200 with its connection id, "
        f"session/new answered on the connection's stream, the prompt's {len(events)} events on the session's "
        f"(a cursor each, end_turn), {len(replayed)} replayed after the first's cursor with the same cursors, "
        f"409 for a cursor of no stream, DELETE 202"
    )


class Reading:
    """An event stream read by curl in a thread for ``seconds`` while the block sends what it answers."""

    def __init__(self, curl: Curl, seconds: float, *headers: str) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1)
        self._future = self._pool.submit(curl.events, seconds, *headers)
        # A session's messages go to the connection's stream while the session has had none: its stream is
        # opened (curl started, its request sent) before the prompt. Nothing here tells when that is done.
        time.sleep(OPENED)

    def __enter__(self) -> Reading:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=False)

    def result(self) -> tuple[str, list[tuple[str | None, object]]]:
        return self._future.result(timeout=TIMEOUT)
