"""The schema checks used by the relay tests catch what they are meant to catch."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conformance import ConformanceError, Conversation

UPDATE = {
    "sessionId": "s",
    "update": {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": "x"}},
}


def to_client_after(request: dict[str, Any]) -> Conversation:
    conversation = Conversation("client")
    conversation.track_request(request)
    return conversation


@pytest.mark.parametrize(
    "msg",
    [
        {"jsonrpc": "2.0", "method": "session/update", "params": UPDATE},
        {"jsonrpc": "2.0", "method": "_vendor/thing", "params": {"anything": [1]}},
        {
            "jsonrpc": "2.0",
            "id": 0,
            "method": "fs/read_text_file",
            "params": {"sessionId": "s", "path": "/a"},
        },
        {"jsonrpc": "2.0", "method": "$/cancel_request", "params": {"requestId": 3}},
        {"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": "Parse error"}},
    ],
)
def test_valid_messages_to_the_client_pass(msg: dict[str, Any]) -> None:
    Conversation("client").check(msg)


@pytest.mark.parametrize(
    "msg",
    [
        {"jsonrpc": "2.0", "method": "session/update", "params": {"sessionId": "s"}},
        {
            "jsonrpc": "2.0",
            "method": "session/update",
            "params": {**UPDATE, "update": {"sessionUpdate": "nope"}},
        },
        {"jsonrpc": "1.0", "method": "_x"},
        {"jsonrpc": "2.0", "id": 1, "method": "fs/read_text_file", "params": {"path": "/a"}},
        {"jsonrpc": "2.0", "method": "session/prompt", "params": {}},
        {"jsonrpc": "2.0", "id": 1.5, "result": {}},
        {"jsonrpc": "2.0", "id": 1, "error": {"message": "no code"}},
        {"jsonrpc": "2.0", "id": 99, "result": {}},
        {"jsonrpc": "2.0", "id": 1, "result": {}, "extra": 1},
    ],
)
def test_invalid_messages_to_the_client_fail(msg: dict[str, Any]) -> None:
    with pytest.raises(ConformanceError):
        Conversation("client").check(msg)


def test_responses_are_checked_against_their_request_method() -> None:
    prompt = {"jsonrpc": "2.0", "id": 0, "method": "session/prompt", "params": {}}
    to_client_after(prompt).check({"jsonrpc": "2.0", "id": 0, "result": {"stopReason": "end_turn"}})
    with pytest.raises(ConformanceError):
        to_client_after(prompt).check({"jsonrpc": "2.0", "id": 0, "result": {"stopReason": "bored"}})
    with pytest.raises(ConformanceError):
        # id 0 and id "0" are different requests
        to_client_after(prompt).check({"jsonrpc": "2.0", "id": "0", "result": {"stopReason": "end_turn"}})


def test_messages_to_the_agent_use_agent_side_definitions() -> None:
    to_agent = Conversation("agent")
    to_agent.check({"jsonrpc": "2.0", "id": 1, "method": "session/new", "params": {"cwd": "/", "mcpServers": []}})
    to_agent.check({"jsonrpc": "2.0", "method": "session/cancel", "params": {"sessionId": "s"}})
    with pytest.raises(ConformanceError):
        to_agent.check({"jsonrpc": "2.0", "id": 2, "method": "session/new", "params": {"mcpServers": []}})
    to_agent.track_request({"jsonrpc": "2.0", "id": 5, "method": "session/request_permission"})
    with pytest.raises(ConformanceError):
        to_agent.check({"jsonrpc": "2.0", "id": 5, "result": {"outcome": {"outcome": "maybe"}}})
