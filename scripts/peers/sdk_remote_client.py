"""An ACP client on the Python SDK's network transports (WebSocket, streamable HTTP), against ``serve``.

usage: sdk_remote_client.py URL TOKEN ws|http CWD

As the SDK documents a client's reconnect: initialize, session/new, two prompts; the connection closed;
a new transport connection, initialize, session/load of an id this token never made (that load alone
fails), session/load of the same id, a third prompt. Prints a JSON
summary: each prompt's stop reason and text, what the load replayed, the transport's own failures.
"""

import asyncio
import json
import sys
from typing import Any

from acp import PROTOCOL_VERSION, connect_to_agent, text_block
from acp.schema import ClientCapabilities, Implementation

PROMPTS = ("first prompt mango", "second prompt kiwi", "third prompt after the reconnect")


class Client:
    def __init__(self) -> None:
        self.texts: list[str] = []
        self.user_texts: list[str] = []

    async def session_update(self, session_id: str, update: Any, **kwargs: Any) -> None:
        kind = getattr(update, "session_update", "")
        text = getattr(getattr(update, "content", None), "text", None)
        if isinstance(text, str):
            (self.texts if kind == "agent_message_chunk" else self.user_texts).append(text)

    async def request_permission(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no permission is asked in this check")


async def transport(url: str, token: str, kind: str) -> Any:
    headers = {"Authorization": f"Bearer {token}"}
    if kind == "ws":
        from acp.ws.client import create_websocket_stream

        return await create_websocket_stream(url.replace("http", "ws", 1), headers=headers)
    from acp.http.client import create_http_stream

    return create_http_stream(url, headers=headers)


async def connection(url: str, token: str, kind: str, client: Client) -> Any:
    conn = connect_to_agent(client, await transport(url, token, kind))
    init = await conn.initialize(
        protocol_version=PROTOCOL_VERSION,
        client_capabilities=ClientCapabilities(),
        client_info=Implementation(name="check-peers-python-sdk", version="1.0.0"),
    )
    return conn, init


async def turn(conn: Any, client: Client, session_id: str, words: str) -> dict[str, Any]:
    client.texts.clear()
    answer = await asyncio.wait_for(conn.prompt(session_id=session_id, prompt=[text_block(words)]), 60)
    return {"stopReason": answer.stop_reason, "text": "".join(client.texts)}


async def main(url: str, token: str, kind: str, cwd: str) -> dict[str, Any]:
    first = Client()
    conn, init = await connection(url, token, kind, first)
    session_id = (await conn.new_session(cwd=cwd, mcp_servers=[])).session_id
    turns = [await turn(conn, first, session_id, words) for words in PROMPTS[:2]]
    await conn.close()
    again = Client()
    conn, _ = await connection(url, token, kind, again)
    try:
        await asyncio.wait_for(conn.load_session(cwd=cwd, session_id="never-made-here", mcp_servers=[]), 60)
        unknown_load = "answered"
    except Exception as exc:  # the SDK's RequestError: that load fails, the connection goes on
        unknown_load = str(getattr(exc, "code", None) or exc)
    await asyncio.wait_for(conn.load_session(cwd=cwd, session_id=session_id, mcp_servers=[]), 60)
    replayed = list(again.user_texts)
    turns.append(await turn(conn, again, session_id, PROMPTS[2]))
    await conn.close()
    capabilities = init.agent_capabilities
    return {
        "sessionId": session_id,
        "loadSession": bool(capabilities and capabilities.load_session),
        "turns": turns,
        "replayed": replayed,
        "unknownLoad": unknown_load,
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(*sys.argv[1:5]))))
