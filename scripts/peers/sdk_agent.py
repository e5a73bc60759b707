"""An ACP agent on the Python SDK's Agent API (acp.run_agent); answers offline.

A prompt turn streams a thought, a plan and a tool call, asks the client for
permission, streams the prompt back word by word, calls a client extension
method, sends an extension notification and ends the turn. The prompt
"wait for cancel" streams one chunk and waits for session/cancel.
Wire messages are appended to $PEER_AGENT_TRANSCRIPT if set.
"""

import asyncio
import json
import os
from typing import Any

from acp import (
    PROTOCOL_VERSION,
    InitializeResponse,
    NewSessionResponse,
    PromptResponse,
    RequestError,
    plan_entry,
    run_agent,
    start_tool_call,
    update_agent_message_text,
    update_agent_thought_text,
    update_plan,
    update_tool_call,
)
from acp.schema import AgentCapabilities, Implementation, PermissionOption, ToolCallUpdate

TRANSCRIPT = os.environ.get("PEER_AGENT_TRANSCRIPT")


def record(event: Any) -> None:
    if TRANSCRIPT:
        with open(TRANSCRIPT, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"dir": event.direction.value, "msg": event.message}) + "\n")


class PeerAgent:
    def __init__(self) -> None:
        self.sessions = 0
        self.cancelled: dict[str, asyncio.Event] = {}

    def on_connect(self, conn: Any) -> None:
        self.conn = conn

    async def initialize(
        self, protocol_version: int, client_capabilities: Any = None, client_info: Any = None, **kwargs: Any
    ) -> InitializeResponse:
        response = InitializeResponse(
            protocol_version=min(protocol_version, PROTOCOL_VERSION),
            agent_capabilities=AgentCapabilities(load_session=False),
            agent_info=Implementation(name="sdk-peer-agent", version="1.0.0"),
        )
        # The agent's own _meta must survive the proxy adding its key next to it.
        response.field_meta = {"sdk-peer": {"kept": True}}
        return response

    async def new_session(self, cwd: str, mcp_servers: Any = None, **kwargs: Any) -> NewSessionResponse:
        self.sessions += 1
        session_id = f"sdk-session-{self.sessions}"
        self.cancelled[session_id] = asyncio.Event()
        response = NewSessionResponse(session_id=session_id)
        response.field_meta = {"requestMeta": kwargs or None}  # shows the request's _meta arrived
        return response

    async def cancel(self, session_id: str, **kwargs: Any) -> None:
        self.cancelled.setdefault(session_id, asyncio.Event()).set()

    async def prompt(self, session_id: str, prompt: list[Any], **kwargs: Any) -> PromptResponse:
        text = " ".join(getattr(block, "text", "") or "" for block in prompt)
        cancelled = self.cancelled.setdefault(session_id, asyncio.Event())
        cancelled.clear()
        say = self.conn.session_update
        if text == "wait for cancel":
            await say(session_id, update_agent_message_text("waiting "))
            try:
                await asyncio.wait_for(cancelled.wait(), timeout=15)
            except TimeoutError:
                return PromptResponse(stop_reason="end_turn")
            return PromptResponse(stop_reason="cancelled")
        await say(session_id, update_agent_thought_text("echoing the prompt"))
        await say(session_id, update_plan([plan_entry("echo the prompt", status="in_progress")]))
        await say(session_id, start_tool_call("echo-1", "Echo", kind="other", status="pending"))
        permission = await self.conn.request_permission(
            session_id=session_id,
            tool_call=ToolCallUpdate(tool_call_id="echo-1", title="Echo"),
            options=[
                PermissionOption(option_id="allow", name="Allow", kind="allow_once"),
                PermissionOption(option_id="reject", name="Reject", kind="reject_once"),
            ],
        )
        if getattr(permission.outcome, "option_id", None) != "allow":
            await say(session_id, update_tool_call("echo-1", status="failed"))
            return PromptResponse(stop_reason="refusal")
        await say(session_id, update_tool_call("echo-1", status="completed"))
        for word in text.split():
            await say(session_id, update_agent_message_text(word + " "))
        try:
            pong = await self.conn.ext_method("peers/ping", {"session": session_id})
        except RequestError as exc:  # a client without the extension: method not found
            pong = {"error": exc.code}
        await self.conn.ext_notification("peers/turn_done", {"session": session_id})
        response = PromptResponse(stop_reason="end_turn")
        response.field_meta = {"pong": pong}
        return response

    async def ext_method(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        if method == "peers/echo":
            return {"method": method, "params": params}
        raise RequestError.method_not_found("_" + method)

    async def ext_notification(self, method: str, params: dict[str, Any]) -> None:
        return None


if __name__ == "__main__":
    asyncio.run(run_agent(PeerAgent(), observers=[record]))
