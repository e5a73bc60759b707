"""What streamed ``session/update``s say, decoded only when a turn digests them.

The relay hands a turn whole blocks of lines (``Turn.observe``); these decoders read from a block
only what a task records (tool calls, the agent's text), and only when asked.
"""

from __future__ import annotations

from typing import Final

import msgspec
from msgspec import UNSET, Raw, UnsetType

from acp_proxy.protocol.methods import Method


class Update(msgspec.Struct, gc=False):
    sessionUpdate: str = ""
    content: Raw = Raw(b"null")
    """Left undecoded (msgspec takes ``Raw`` only on its own, not in a union)."""
    title: str | UnsetType | None = UNSET
    updatedAt: str | UnsetType | None = UNSET


class UpdateParams(msgspec.Struct, gc=False):
    update: Update | UnsetType | None = UNSET


class UpdateNotification(msgspec.Struct, gc=False):
    method: str | None = None
    params: UpdateParams | UnsetType | None = UNSET


class TextContent(msgspec.Struct, gc=False):
    type: str | None = None
    text: str | None = None


_notification_decoder: Final = msgspec.json.Decoder(UpdateNotification)
_text_decoder: Final = msgspec.json.Decoder(TextContent)


def updates_in(block: bytes) -> list[Update]:
    """The ``session/update`` payloads of a block of notification lines; lines that do not parse are skipped."""
    try:
        messages = _notification_decoder.decode_lines(block)
    except (msgspec.DecodeError, RecursionError):
        messages = []
        for line in block.splitlines():
            try:
                messages.append(_notification_decoder.decode(line))
            except (msgspec.DecodeError, RecursionError):
                continue
    return [
        msg.params.update
        for msg in messages
        if msg.method == Method.UPDATE
        and isinstance(msg.params, UpdateParams)
        and isinstance(msg.params.update, Update)
    ]


def agent_text(update: Update) -> str:
    if update.sessionUpdate != "agent_message_chunk":
        return ""
    try:
        content = _text_decoder.decode(update.content)
    except (msgspec.DecodeError, RecursionError):
        return ""
    return content.text if content.type == "text" and content.text else ""
