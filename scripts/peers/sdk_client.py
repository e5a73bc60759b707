"""An ACP client on the Python SDK (acp.spawn_agent_process).

usage: sdk_client.py TRANSCRIPT STDERR_LOG -- AGENT_CMD ARG...

initialize, session/new (with _meta), a full prompt turn (answering the agent's
permission request and extension call), a client extension request and
notification, an unknown method, and a cancelled turn. Prints a JSON summary;
wire messages are appended to TRANSCRIPT.
"""

import asyncio
import json
import os
import sys
import time
from typing import Any, BinaryIO

from acp import PROTOCOL_VERSION, RequestError, spawn_agent_process, text_block
from acp.schema import AllowedOutcome, ClientCapabilities, Implementation, RequestPermissionResponse

BIG_WORD = "x" * (2 * 1024 * 1024)  # a 2 MiB line, far over any pipe buffer


class PeerClient:
    def __init__(self) -> None:
        self.updates: list[str] = []
        self.permission_requests = 0
        self.ext_notifications: list[str] = []
        self.first_chunk = asyncio.Event()

    async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
        kind = getattr(update, "session_update", type(update).__name__)
        if kind == "agent_message_chunk":
            self.first_chunk.set()
        self.updates.append(kind)

    async def request_permission(self, session_id: str, tool_call: Any, options: Any, **kwargs: Any) -> Any:
        self.permission_requests += 1
        return RequestPermissionResponse(outcome=AllowedOutcome(outcome="selected", option_id="allow"))

    async def ext_method(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        return {"pong": params}

    async def ext_notification(self, method: str, params: dict[str, Any]) -> None:
        self.ext_notifications.append(method)


def dump(model: Any) -> Any:
    return model.model_dump(by_alias=True, exclude_none=True)


async def run(transcript: str, err: BinaryIO, command: list[str]) -> dict[str, Any]:
    """The client's turns against the agent ``command``, whose stderr goes to ``err``; the summary."""

    def record(event: Any) -> None:
        with open(transcript, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"dir": event.direction.value, "msg": event.message}) + "\n")

    client = PeerClient()
    summary: dict[str, Any] = {}
    async with spawn_agent_process(
        client,
        command[0],
        *command[1:],
        env=dict(os.environ),
        transport_kwargs={"stderr": err, "shutdown_timeout": 5.0},
        observers=[record],
    ) as (conn, process):
        init = await conn.initialize(
            protocol_version=PROTOCOL_VERSION,
            client_capabilities=ClientCapabilities(),
            client_info=Implementation(name="sdk-peer-client", version="1.0.0"),
        )
        summary["initialize"] = dump(init)
        session = await conn.new_session(cwd="/", mcp_servers=[], gateway={"trace": "t-1"})
        summary["session"] = dump(session)
        sid = session.session_id
        turn = await conn.prompt(session_id=sid, prompt=[text_block(f"stream these words {BIG_WORD} please")])
        summary["turn"] = dump(turn)
        summary["updates"] = list(client.updates)
        summary["permission_requests"] = client.permission_requests
        payload = {"nested": {"list": [1, 2.5, None, "\u00fc\u20ac"]}}
        summary["ext_echo"] = await conn.ext_method("peers/echo", payload)
        await conn.ext_notification("peers/note", {"hello": "agent"})
        try:
            await conn._conn.send_request("session/does_not_exist", {"sessionId": sid})
            summary["unknown_method"] = "answered"
        except RequestError as exc:
            summary["unknown_method"] = {"code": exc.code}
        client.first_chunk.clear()
        waiting = asyncio.ensure_future(conn.prompt(session_id=sid, prompt=[text_block("wait for cancel")]))
        await asyncio.wait_for(client.first_chunk.wait(), timeout=15)
        await conn.cancel(session_id=sid)
        summary["cancelled_turn"] = dump(await asyncio.wait_for(waiting, timeout=15))
        summary["ext_notifications"] = client.ext_notifications
        closing = time.monotonic()
    # Leaving the block closed the agent's stdin and waited for it to exit
    # (SIGTERM after shutdown_timeout): the exit status says which happened.
    summary["exit_status"] = process.returncode
    summary["exit_seconds"] = round(time.monotonic() - closing, 2)
    return summary


def main() -> int:
    transcript, stderr_log, sep, *command = sys.argv[1:]
    if sep != "--" or not command:
        raise SystemExit(__doc__)
    with open(stderr_log, "ab") as err:
        summary = asyncio.run(asyncio.wait_for(run(transcript, err, command), timeout=90))
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
