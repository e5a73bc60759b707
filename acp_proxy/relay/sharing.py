"""Shared sessions, the holder's side: the clients attached to this proxy's sessions, fanned out to.

ACP's draft RFD "Multi-Client Session Attach" lets a second client join a live session as a
``controller`` or an ``observer``. The proxy that holds the session (the one its gateway
launched) serves the attached clients through its control socket: each attachment is one
connection there (``serve_attachment``), made by another proxy of the install on behalf of its
own gateway (``relay.attached``), so that an attached client may be anywhere the install is
reachable: a stdio gateway of the same user, or a client of ``acp-proxy serve``.

What an attachment gets, in order: the answer to its attach (with the draft's ``history``), the
transcript's updates when it asked for ``full``, the requests still waiting for an answer when it
is a controller (``full`` or ``pending_only``), then everything the session's gateway is sent
about the session, as it is sent. A request of the agent's (a permission, an elicitation) goes
to the gateway and to every controller, each under its own id; the first valid answer goes to
the agent, and everyone else's copy is withdrawn with ``$/cancel_request``; every attachment is
told who answered (``permission_resolved``). Prompts of several controllers take turns (the
session's ``lane``): in arrival order, each sent once the turn before it has ended, or refused
while one runs (``[attach] prompts = "refuse"``). An observer can do neither.

An attached client that stops reading is detached once ``ATTACHMENT_QUEUE`` messages wait for
it: the session, its gateway and the other clients never wait for one.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import sqlite3
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final

import anyio
import anyio.abc
import msgspec
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from msgspec import UNSET, Raw

from acp_proxy import journal
from acp_proxy.concurrency import Background
from acp_proxy.config import Config
from acp_proxy.journal import Journal
from acp_proxy.protocol import jsonrpc
from acp_proxy.protocol.errors import ProxyError
from acp_proxy.protocol.jsonrpc import BadLine, Kind, Message, RequestId
from acp_proxy.protocol.methods import Method
from acp_proxy.relay.claims import LOCAL, OPERATOR, PRINCIPAL_ENV, Client, Refusal, eligible, refusal
from acp_proxy.relay.upstream import AgentRequests
from acp_proxy.relay.writer import GatewayWriter
from acp_proxy.sessions.intents import SessionIntents
from acp_proxy.sessions.transcript import Entry, EntryKind, Transcripts
from acp_proxy.tasks.notify import Notifier
from acp_proxy.tasks.status import TaskStatus
from acp_proxy.tasks.turn import Turn

log = logging.getLogger("acp_proxy.sharing")

ATTACHMENT_QUEUE: Final = 4096
"""Messages waiting for an attached client; past it the client is detached (``slow_reader``)."""
ATTACHMENTS_MAX: Final = 256
"""Attached clients per proxy, all sessions together."""
CANCELLED: Final = {"stopReason": "cancelled"}
GATEWAY: Final = "the gateway"
"""Who answered or prompted, when it was the session's own gateway."""
ATTACHED_METHODS: Final = frozenset({Method.PROMPT, Method.DETACH, Method.CLAIM_PERMISSION})
"""The requests an attached client sends for the session it is attached to."""


class Role(enum.StrEnum):
    CONTROLLER = "controller"
    OBSERVER = "observer"


class History(enum.StrEnum):
    FULL = "full"
    PENDING_ONLY = "pending_only"
    NONE = "none"


class AttachRequest(msgspec.Struct, frozen=True, kw_only=True):
    """The ``attach`` control command's arguments: the client's ``session/attach`` params, and who it is."""

    sessionId: str
    role: Role = Role.CONTROLLER
    historyPolicy: History = History.FULL
    clientInfo: dict[str, Any] = msgspec.field(default_factory=dict)
    who: str = ""
    """Who the attaching proxy serves (``uid 1000``, a token's name): for the records."""
    principal: str = LOCAL
    """Whose client it is, for ``[attach] permissions``: a token's name, or ``local``."""


def parse_attach(args: dict[str, Any]) -> AttachRequest:
    """``args`` as an ``AttachRequest``; ``ValueError`` saying what is wrong."""
    try:
        return msgspec.convert(args, AttachRequest)
    except msgspec.ValidationError as exc:
        raise ValueError(f"session/attach: {exc}") from None


def client_label(info: dict[str, Any], who: str) -> str:
    """How a client is named in records: its ``clientInfo`` name and who it came as."""
    name = info.get("name")
    text = str(name)[:80] if isinstance(name, str) and name else "a client"
    return f"{text} ({who[:80]})" if who else text


class AttachRefused(Exception):
    """An attach the holder will not take: ``code`` for the attaching proxy, the message for people."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Attachment:
    """One attached client: its role, its outbound queue, its copies of the agent's requests."""

    def __init__(self, number: int, session_id: str, request: AttachRequest) -> None:
        self.number = number
        self.session_id = session_id
        self.role = request.role
        self.info = {
            "name": str(request.clientInfo.get("name") or "unnamed"),
            "version": str(request.clientInfo.get("version") or ""),
            "role": request.role.value,
        }
        self.label = client_label(request.clientInfo, request.who)
        self.client = Client(f"attachment:{number}", request.principal or LOCAL, self.label)
        self.out: MemoryObjectSendStream[bytes]
        self.queue: MemoryObjectReceiveStream[bytes]
        self.out, self.queue = anyio.create_memory_object_stream[bytes](ATTACHMENT_QUEUE)
        self.asks: dict[RequestId, Ask] = {}
        """The agent's requests sent to this client, by the id it got them under."""
        self.prompts: dict[str, RequestId] = {}
        """Its prompts not answered yet: the id each is served under -> its own id."""
        self._next_id = 0
        self.ended: str | None = None
        self.closing: str | None = None
        """Why the attachment ends once its queue is sent (the session was closed or deleted)."""
        self.scope = anyio.CancelScope()

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def put(self, data: bytes) -> None:
        """Queue ``data`` (whole lines) for the client; a client this far behind is detached."""
        if self.ended is not None:
            return
        try:
            self.out.send_nowait(data)
        except anyio.WouldBlock:
            log.warning("session %s: %s stopped reading: detached", self.session_id, self.label)
            self.end("slow_reader")
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            self.end("gone")

    def end(self, why: str) -> None:
        if self.ended is None:
            self.ended = why
            self.scope.cancel()


class Ask(msgspec.Struct, kw_only=True):
    """A request of the agent's to the client, not answered yet: sent to the gateway and the controllers."""

    upstream_id: int
    """The id the gateway got it under (``relay.adapters``)."""
    key: str
    """How operators name it (``acp-proxy permissions``): this proxy's instance and ``upstream_id``."""
    session_id: str
    method: str
    params: Raw
    asked_at: float
    subject: str
    options: list[dict[str, Any]]
    sent: dict[int, tuple[Attachment, RequestId]] = msgspec.field(default_factory=dict)
    """The controllers it was sent to: attachment number -> (attachment, the id it got it under)."""
    prompter: str | None = None
    """The principal whose prompt started the turn it was asked in (``[attach] permissions = "prompter"``)."""
    gateway_asked: bool = True
    """Whether the session's gateway was sent it (``[attach] permissions`` may leave it out)."""
    claimed_by: Client | None = None
    """The client that claimed it: only it answers it, until it disconnects."""

    def view(self) -> dict[str, Any]:
        return {
            "request": self.key,
            "sessionId": self.session_id,
            "method": self.method,
            "subject": self.subject,
            "options": self.options,
            "askedAt": self.asked_at,
            "waitingSeconds": round(time.time() - self.asked_at, 3),
            "sentTo": [GATEWAY] * self.gateway_asked + [attachment.label for attachment, _ in self.sent.values()],
            "claimedBy": self.claimed_by.label if self.claimed_by is not None else None,
        }


class LaneItem(msgspec.Struct, kw_only=True):
    """A prompt waiting for its turn on a shared session."""

    msg: Message
    """The prompt, with the id it is served under (a routed one)."""
    by: Client
    done: anyio.Event = msgspec.field(default_factory=anyio.Event)
    sent: bool = False
    cancelled: bool = False


class Share:
    """A session with clients attached (or prompts of theirs waiting)."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.attachments: dict[int, Attachment] = {}
        self.lane: deque[LaneItem] = deque()
        self.lane_running = False

    def controllers(self) -> list[Attachment]:
        return [a for a in self.attachments.values() if a.role is Role.CONTROLLER and a.ended is None]


def _options(params: dict[str, Any]) -> list[dict[str, Any]]:
    options = params.get("options")
    if not isinstance(options, list):
        return []
    return [
        {"optionId": o.get("optionId"), "name": o.get("name"), "kind": o.get("kind")}
        for o in options
        if isinstance(o, dict) and isinstance(o.get("optionId"), str)
    ]


def _subject(params: dict[str, Any]) -> str:
    tool_call = params.get("toolCall")
    title = tool_call.get("title") if isinstance(tool_call, dict) else None
    if isinstance(title, str):
        return title[:200]
    message = params.get("message")
    return message[:200] if isinstance(message, str) else ""


def valid_permission_answer(result: object, options: list[dict[str, Any]]) -> bool:
    """Whether ``result`` answers a ``session/request_permission`` offering ``options``."""
    if not isinstance(result, dict):
        return False
    outcome = result.get("outcome")
    if not isinstance(outcome, dict):
        return False
    if outcome.get("outcome") == "cancelled":
        return True
    return outcome.get("outcome") == "selected" and any(o["optionId"] == outcome.get("optionId") for o in options)


def update_line(session_id: str, update: dict[str, Any]) -> bytes:
    """A ``session/update`` of the draft's own kinds: ``type`` as the draft writes it, ``sessionUpdate`` as v1 does."""
    kind = update["type"]
    return jsonrpc.notification(Method.UPDATE, {"sessionId": session_id, "update": {"sessionUpdate": kind, **update}})


def _timestamp(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


def history_items(entries: list[Entry], asks: list[Ask], policy: History) -> list[dict[str, Any]]:
    """The attach answer's ``history``: the prompts and the agent's requests, with their status."""
    pending = [
        {
            "type": "permission_request" if ask.method == Method.REQUEST_PERMISSION else "request",
            "method": ask.method,
            "toolCallId": _tool_call_id(ask.params),
            "request": ask.key,
            "status": "pending",
            "timestamp": _timestamp(ask.asked_at),
        }
        for ask in asks
    ]
    if policy is History.PENDING_ONLY:
        return pending
    items: list[dict[str, Any]] = []
    for entry in entries:
        if entry.kind == EntryKind.PROMPT:
            params = jsonrpc.decode_object(entry.message) or {}
            item: dict[str, Any] = {
                "type": "prompt",
                "content": params.get("prompt"),
                "timestamp": _timestamp(entry.at),
            }
            if entry.by is not None:
                item["by"] = entry.by
            items.append(item)
        elif entry.kind == EntryKind.ANSWERED:
            answered = jsonrpc.decode_object(entry.message) or {}
            items.append(
                {
                    "type": "permission_request",
                    "toolCallId": answered.get("toolCallId"),
                    "status": "resolved",
                    "resolvedBy": entry.by,
                    "outcome": answered.get("outcome"),
                    "timestamp": _timestamp(entry.at),
                }
            )
    return items + pending


def _tool_call_id(params: Raw) -> str | None:
    obj = jsonrpc.decode_object(params) or {}
    tool_call = obj.get("toolCall")
    found = tool_call.get("toolCallId") if isinstance(tool_call, dict) else None
    return found if isinstance(found, str) else None


class Sharing:
    """This proxy's shared sessions: their attachments, the agent's requests waiting, the prompt lanes."""

    def __init__(
        self,
        config: Config,
        instance_id: str,
        intents: SessionIntents,
        transcripts: Transcripts,
        writer: GatewayWriter,
        background: Background,
        requests: AgentRequests,
        journal: Journal | None = None,
        notifier: Notifier | None = None,
    ) -> None:
        self.config = config
        self.instance_id = instance_id
        self.transcripts = transcripts
        self.writer = writer
        self.background = background
        self.journal = journal
        self.notifier = notifier
        self.intents = intents
        self.requests = requests
        """The agent's requests waiting upstream: an answer given here is handed back through it."""
        self.shares: dict[str, Share] = {}
        self.asks: dict[int, Ask] = {}
        self.gateway_notices: set[str] = set()
        """Sessions whose gateway attached to them itself: it asked for the draft's updates."""
        self.gateway_prompts: dict[tuple[type, object], tuple[str, str]] = {}
        """The gateway's prompts taking turns on a shared session: its id's key -> (session, the id served under)."""
        self._numbers = 0
        self._routes = 0
        self._route_prefix = f"\x00acp-proxy/{os.urandom(4).hex()}/"
        self._replaying: set[str] = set()
        self._answering: Attachment | None = None
        """The attachment whose answer is being delivered (``settled`` runs within the delivery)."""
        self.gateway_client = Client("gateway", os.environ.get(PRINCIPAL_ENV) or LOCAL, GATEWAY)
        """The session's own gateway, as ``[attach] permissions`` sees it."""
        self.prompters: dict[str, str] = {}
        """Each session's latest prompter (a principal): who a ``prompter`` policy asks."""

    @property
    def attached(self) -> int:
        return sum(len(share.attachments) for share in self.shares.values())

    def shared(self, session_id: str) -> bool:
        """Whether the session has clients attached, or prompts of theirs waiting."""
        share = self.shares.get(session_id)
        return share is not None and (bool(share.attachments) or bool(share.lane))

    # --- what the session's gateway is sent (the relay calls these) ------------------------------

    def saw(self, session_id: str, data: bytes, replaying: bool = False) -> None:
        """Notification lines (one, or a block) sent to the gateway about ``session_id``; ``replaying``:
        the replay of the gateway's ``session/load``, which is the whole history: the transcript
        starts again with it."""
        if replaying:
            if session_id not in self._replaying:
                self._replaying.add(session_id)
                self.transcripts.forget(session_id)
        elif self._replaying:
            self._replaying.discard(session_id)
        self.transcripts.record(session_id, EntryKind.UPDATE, data)
        share = self.shares.get(session_id)
        if share is not None and share.attachments:
            out = data if data.endswith(b"\n") else data + b"\n"
            for attachment in list(share.attachments.values()):
                attachment.put(out)

    def prompted(self, session_id: str, params: Raw, by: Client) -> None:
        self.transcripts.record(session_id, EntryKind.PROMPT, bytes(params), by.label)
        self.prompters[session_id] = by.principal

    def _eligible(self, ask: Ask, client: Client) -> bool:
        attach = self.config.attach
        return eligible(attach.permissions, attach.designated, client, ask.prompter)

    def _refusal(self, ask: Ask, client: Client) -> ProxyError | None:
        attach = self.config.attach
        why = refusal(attach.permissions, attach.designated, client, ask.prompter, ask.claimed_by)
        if why is Refusal.NOT_ELIGIBLE:
            return ProxyError.not_eligible(ask.key, attach.permissions)
        if why is Refusal.CLAIMED:
            assert ask.claimed_by is not None
            return ProxyError.permission_claimed(ask.key, ask.claimed_by.label)
        return None

    def asked(self, session_id: str | None, upstream_id: int, msg: Message, turn: Turn | None) -> bool:
        """The agent asked the client something (``upstream_id``): to every controller ``[attach] permissions``
        asks; whether the gateway is asked too."""
        if session_id is None or msg.method not in (Method.REQUEST_PERMISSION, Method.ELICITATION_CREATE):
            return True
        params = msg.params if isinstance(msg.params, Raw) else Raw(b"{}")
        obj = jsonrpc.decode_object(params) or {}
        ask = Ask(
            upstream_id=upstream_id,
            key=f"{self.instance_id[:8]}.{upstream_id}",
            session_id=session_id,
            method=str(msg.method),
            params=params,
            asked_at=time.time(),
            subject=_subject(obj),
            options=_options(obj),
            prompter=self.prompters.get(session_id),
        )
        ask.gateway_asked = self._eligible(ask, self.gateway_client)
        self.asks[upstream_id] = ask
        self.transcripts.record(session_id, EntryKind.ASKED, jsonrpc.request(ask.key, ask.method, params).rstrip())
        share = self.shares.get(session_id)
        if share is not None:
            for attachment in share.controllers():
                if self._eligible(ask, attachment.client):
                    self._send_ask(attachment, ask)
        if self.notifier is not None:
            backend = turn.backend if turn is not None else ""
            self.notifier.waiting(turn, session_id, backend, ask.key, f"{ask.method}: {ask.subject}")
        return ask.gateway_asked

    def _send_ask(self, attachment: Attachment, ask: Ask) -> None:
        their_id = attachment.new_id()
        ask.sent[attachment.number] = (attachment, their_id)
        attachment.asks[their_id] = ask
        attachment.put(jsonrpc.request(their_id, ask.method, ask.params))

    def settled(self, upstream_id: int, answer: Message, by: str, *, from_gateway: bool) -> None:
        """The agent has its answer to ``upstream_id`` (from ``by``): everyone else's copy is withdrawn."""
        ask = self.asks.pop(upstream_id, None)
        if ask is None:
            return
        if not from_gateway and ask.gateway_asked:
            self.background.start(lambda: self.writer.send(_cancel_request(upstream_id)))
        outcome: object = None
        if answer.error is UNSET:
            outcome = (jsonrpc.decode_object(answer.result) or {}).get("outcome")
        for attachment, their_id in ask.sent.values():
            attachment.asks.pop(their_id, None)
            if attachment is not self._answering:
                attachment.put(_cancel_request(their_id))
        resolved = {"request": ask.key, "toolCallId": _tool_call_id(ask.params), "outcome": outcome}
        self.transcripts.record(ask.session_id, EntryKind.ANSWERED, msgspec.json.encode(resolved), by)
        share = self.shares.get(ask.session_id)
        if (share is not None and share.attachments) or ask.session_id in self.gateway_notices:
            notice = update_line(
                ask.session_id,
                {
                    "type": "permission_resolved",
                    "toolCallId": resolved["toolCallId"],
                    "request": ask.key,
                    "outcome": outcome,
                    "chosenOptionId": outcome.get("optionId") if isinstance(outcome, dict) else None,
                    "resolvedBy": {"name": by},
                },
            )
            self._tell(ask.session_id, notice)
        if not from_gateway and self.journal is not None:
            self.journal.record(
                journal.Kind.ANSWERED_ELSEWHERE,
                backend=self._backend(ask.session_id),
                session_id=ask.session_id,
                label=ask.method,
                detail=f"{ask.subject or ask.method}: answered by {by}",
            )

    def withdrawn(self, upstream_id: int) -> None:
        """The agent no longer waits for ``upstream_id`` (it withdrew it, or it exited)."""
        ask = self.asks.pop(upstream_id, None)
        if ask is None:
            return
        for attachment, their_id in ask.sent.values():
            attachment.asks.pop(their_id, None)
            attachment.put(_cancel_request(their_id))

    # --- answers from elsewhere ----------------------------------------------------------------

    async def answer(self, ask: Ask, answer: Message, client: Client, attachment: Attachment | None = None) -> bool:
        """An answer to ``ask`` from an attached client or an operator: to the agent if it is the first."""
        if self.asks.get(ask.upstream_id) is not ask:
            return False
        self._answering = attachment
        try:
            return await self.hand_back(ask.upstream_id, answer, client, from_gateway=False)
        finally:
            self._answering = None

    async def hand_back(self, upstream_id: int, answer: Message, client: Client, *, from_gateway: bool) -> bool:
        """An answer to the agent's request ``upstream_id``, from ``client``: to the agent, and every other copy
        withdrawn, if it is the first and ``client`` may answer it (the gateway's answers come here too)."""
        ask = self.asks.get(upstream_id)
        refused = self._refusal(ask, client) if ask is not None else None
        if refused is not None:
            log.info("session %s: %s answered %s: dropped (%s)", ask.session_id, client.label, ask.key, refused.reason)  # type: ignore[union-attr]
            return False
        waiting = self.requests.take(upstream_id)
        if waiting is None:
            return False
        self.settled(upstream_id, answer, client.label, from_gateway=from_gateway)
        await self.requests.hand_back(waiting, answer, client.label, from_gateway=from_gateway)
        return True

    def claim(self, session_id: str, params: dict[str, Any], client: Client) -> dict[str, Any]:
        """``session/claim_permission``: ``client`` alone answers the request named (``toolCallId``, or the
        ``request`` key of ``acp-proxy permissions``) until it disconnects; ``ProxyError`` if it may not."""
        named = params.get("toolCallId") or params.get("request")
        ask = next(
            (
                a
                for a in self.asks.values()
                if a.session_id == session_id and named is not None and named in (a.key, _tool_call_id(a.params))
            ),
            None,
        )
        if ask is None:
            raise ProxyError.no_such_request(session_id, repr(named) if named is not None else "(none named)")
        refused = self._refusal(ask, client)
        if refused is not None:
            raise refused
        if ask.claimed_by is None:
            ask.claimed_by = client
            log.info("session %s: %s claimed %s", session_id, client.label, ask.key)
            self._tell_claim(ask, "permission_claimed")
        return {"request": ask.key, "toolCallId": _tool_call_id(ask.params), "claimedBy": {"name": client.label}}

    def _tell_claim(self, ask: Ask, kind: str) -> None:
        claimed = {"name": ask.claimed_by.label} if ask.claimed_by is not None else None
        notice = {"type": kind, "toolCallId": _tool_call_id(ask.params), "request": ask.key, "claimedBy": claimed}
        self._tell(ask.session_id, update_line(ask.session_id, notice))

    def unclaim(self, client: Client) -> None:
        """``client`` disconnected: its claims end, and everyone is told the requests wait for anyone eligible."""
        for ask in self.asks.values():
            if ask.claimed_by is not None and ask.claimed_by.key == client.key:
                ask.claimed_by = None
                log.info("session %s: the claim of %s on %s ended", ask.session_id, client.label, ask.key)
                self._tell_claim(ask, "permission_unclaimed")

    def pending(self) -> list[dict[str, Any]]:
        """The agent's requests waiting for an answer, oldest first (``acp-proxy permissions``, ``top``)."""
        return [ask.view() for ask in sorted(self.asks.values(), key=lambda a: a.asked_at)]

    async def answer_by_operator(self, key: str, option_id: str | None, who: str) -> dict[str, Any]:
        """An operator's answer to a permission request: ``option_id``, or ``None`` to cancel it.

        ``LookupError`` if it waits no more (answered, withdrawn); ``ValueError`` for an answer
        it does not offer."""
        ask = next((a for a in self.asks.values() if a.key == key), None)
        if ask is None:
            raise LookupError(f"request {key} is not waiting (answered already, withdrawn, or never asked here)")
        if ask.method != Method.REQUEST_PERMISSION:
            raise ValueError(f"request {key} is {ask.method}: only a permission request can be answered here")
        if option_id is None:
            outcome: dict[str, Any] = {"outcome": "cancelled"}
        elif any(o["optionId"] == option_id for o in ask.options):
            outcome = {"outcome": "selected", "optionId": option_id}
        else:
            offered = ", ".join(str(o["optionId"]) for o in ask.options)
            raise ValueError(f"request {key} offers no option {option_id!r} (it offers: {offered})")
        operator = Client(OPERATOR, OPERATOR, who)
        refused = self._refusal(ask, operator)
        if refused is not None:
            raise LookupError(refused.message)
        answer = Message(jsonrpc="2.0", id=0, result=Raw(msgspec.json.encode({"outcome": outcome})))
        if not await self.answer(ask, answer, operator):
            raise LookupError(f"request {key} was answered first by someone else")
        return {"request": key, "sessionId": ask.session_id, "outcome": outcome}

    # --- prompts on a shared session --------------------------------------------------------------

    def route(self, deliver: Callable[[bytes], None]) -> str:
        """A fresh id to serve another client's request under; its answer goes to ``deliver``."""
        self._routes += 1
        key = f"{self._route_prefix}{self._routes}"
        self.writer.route(key, deliver)
        return key

    def prompt(self, session_id: str, msg: Message, by: Client, reply: Callable[[bytes], None]) -> str | None:
        """A prompt for a shared session: it waits for the turn before it, or is refused (``[attach] prompts``).

        ``msg`` keeps its sender's id; ``reply`` gets the answer under it. The id it is served
        under, ``None`` if it was refused."""
        share = self.shares.setdefault(session_id, Share(session_id))
        their_id = msg.id
        if self.config.attach.prompts == "refuse" and (share.lane or self._turn_running(session_id)):
            reply(ProxyError.session_busy(session_id).response(their_id))  # type: ignore[arg-type]
            return None
        item = LaneItem(msg=msg, by=by)

        def answered(data: bytes) -> None:
            item.done.set()
            if by is self.gateway_client:
                self.gateway_prompts.pop(jsonrpc.id_key(their_id), None)
            reply(_with_id(data, their_id))  # type: ignore[arg-type]

        routed = self.route(answered)
        if by is self.gateway_client:  # the gateway may withdraw it by its own id ($/cancel_request)
            self.gateway_prompts[jsonrpc.id_key(their_id)] = (session_id, routed)
        item.msg = Message(jsonrpc="2.0", id=routed, method=msg.method, params=msg.params)
        share.lane.append(item)
        if not share.lane_running:
            share.lane_running = True
            self.background.start(lambda: self._run_lane(share))
        return routed

    def _turn_running(self, session_id: str) -> Turn | None:
        """The turn the session's process runs now, if any."""
        session = self.intents.table.get(session_id)
        adapter = session.live_adapter if session is not None else None
        turn = adapter.tenancy.turn if adapter is not None else None
        return turn if turn is not None and turn.status is TaskStatus.RUNNING else None

    async def _run_lane(self, share: Share) -> None:
        try:
            while share.lane:
                item = share.lane[0]
                running = self._turn_running(share.session_id)
                while running is not None:  # woken by its end, however it ends (``TurnBook.until_ended``)
                    await self.intents.turns.until_ended(running)
                    running = self._turn_running(share.session_id)
                if not item.cancelled:
                    item.sent = True
                    self.prompted(share.session_id, item.msg.params, item.by)  # type: ignore[arg-type]
                    await self.intents.forward(item.msg, share.session_id)
                    await item.done.wait()
                share.lane.popleft()
        finally:
            share.lane_running = False
            for item in share.lane:  # the proxy is stopping: what still waits is answered
                if not item.sent and not item.cancelled:
                    item.cancelled = True
                    deliver = self.writer.routed_elsewhere(item.msg.id)
                    if deliver is not None:
                        deliver(ProxyError.proxy_shutdown().response(item.msg.id))  # type: ignore[arg-type]
            self._forget_if_idle(share)

    def cancel_queued(self, session_id: str) -> int:
        """``session/cancel``: the prompts still waiting their turn end ``cancelled``; how many."""
        share = self.shares.get(session_id)
        if share is None:
            return 0
        count = 0
        for item in share.lane:
            if not item.sent and not item.cancelled:
                item.cancelled = True
                deliver = self.writer.routed_elsewhere(item.msg.id)
                if deliver is not None:
                    deliver(jsonrpc.result_response(item.msg.id, CANCELLED))  # type: ignore[arg-type]
                count += 1
        return count

    async def cancel_prompt(self, session_id: str, routed_id: str) -> None:
        """``$/cancel_request`` for one prompt of an attached client's: withdrawn if it waits, else to the adapter."""
        share = self.shares.get(session_id)
        for item in share.lane if share is not None else ():
            if item.msg.id == routed_id and not item.sent and not item.cancelled:
                item.cancelled = True
                deliver = self.writer.routed_elsewhere(routed_id)
                if deliver is not None:
                    deliver(ProxyError.cancelled_request().response(routed_id))
                return
        await self.requests.cancel_routed(routed_id)

    # --- an attachment, served over the control socket ------------------------------------------

    async def serve_attachment(
        self,
        request_id: object,
        args: dict[str, Any],
        stream: anyio.abc.ByteStream,
        reader: BufferedByteReceiveStream,
    ) -> None:
        """The control socket's ``attach`` command: serve one attached client until it detaches or goes."""
        try:
            request = parse_attach(args)
            attachment, share = self._admit(request)
        except (ValueError, LookupError, AttachRefused) as exc:
            if isinstance(exc, AttachRefused):
                code = exc.code
            else:
                code = "unknown_session" if isinstance(exc, LookupError) else "invalid_args"
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await stream.send(_control_error(request_id, code, str(exc)))
            return
        why = "holder_stopping"  # unless the client detaches or goes first
        try:
            try:
                await self.transcripts.read_then(
                    share.session_id, lambda entries: self._begin(attachment, share, request, request_id, entries)
                )
            except sqlite3.Error as exc:  # no history to give: the attachment goes on without it
                log.error("session %s: the transcript could not be read: %s", share.session_id, exc)
                self._begin(attachment, share, request, request_id, [])
            with attachment.scope:
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(self._pump, attachment, stream)
                    why = await self._read(attachment, share, reader)
                    attachment.out.close()  # what is queued still goes (a detach's answer), for a moment
                    tasks.cancel_scope.deadline = anyio.current_time() + 2.0
        finally:
            self._detached(attachment, share, attachment.ended or why)

    def _admit(self, request: AttachRequest) -> tuple[Attachment, Share]:
        session = self.intents.table.get(request.sessionId)
        if session is None or session.closed:
            raise LookupError(f"this proxy does not hold session {request.sessionId}")
        share = self.shares.setdefault(request.sessionId, Share(request.sessionId))
        if len(share.attachments) >= self.config.attach.max_clients:
            limit = self.config.attach.max_clients
            raise AttachRefused("too_many_clients", f"session {request.sessionId} already has {limit} attached clients")
        if self.attached >= ATTACHMENTS_MAX:
            raise AttachRefused("too_many_clients", f"this proxy already serves {ATTACHMENTS_MAX} attached clients")
        self._numbers += 1
        attachment = Attachment(self._numbers, request.sessionId, request)
        share.attachments[attachment.number] = attachment  # counted now; its stream starts in _begin
        attachment.ended = "starting"
        return attachment, share

    def _begin(
        self, attachment: Attachment, share: Share, request: AttachRequest, request_id: object, entries: list[Entry]
    ) -> None:
        """At one instant: the answer, the replay and the pending requests queued, then live messages."""
        attachment.ended = None
        asks = [ask for ask in self.asks.values() if ask.session_id == share.session_id]
        replay = b""
        if request.historyPolicy is History.FULL:
            replay = b"".join(bytes(e.message) + b"\n" for e in entries if e.kind == EntryKind.UPDATE)
        others = [a.info for a in share.attachments.values() if a is not attachment and a.ended is None]
        result = {
            "sessionId": share.session_id,
            "role": attachment.role.value,
            "connectedClients": [{"name": GATEWAY, "role": Role.CONTROLLER.value}, *others],
        }
        if request.historyPolicy is not History.NONE:
            result["history"] = history_items(entries, asks, request.historyPolicy)
        answer = {"id": request_id, "ok": True, "result": {"result": result, "replayLines": replay.count(b"\n")}}
        attachment.put(msgspec.json.encode(answer) + b"\n" + replay)
        if attachment.role is Role.CONTROLLER and request.historyPolicy is not History.NONE:
            for ask in asks:
                if self._eligible(ask, attachment.client):
                    self._send_ask(attachment, ask)
        self.transcripts.record(
            share.session_id, EntryKind.ATTACHED, msgspec.json.encode(attachment.info), attachment.label
        )
        log.info("session %s: %s attached as %s", share.session_id, attachment.label, attachment.role.value)
        if self.journal is not None:
            self.journal.record(
                journal.Kind.ATTACHED,
                backend=self._backend(share.session_id),
                session_id=share.session_id,
                label=attachment.role.value,
                detail=f"{attachment.label} attached as {attachment.role.value} ({request.historyPolicy.value})",
            )

    async def _pump(self, attachment: Attachment, stream: anyio.abc.ByteStream) -> None:
        """The attachment's queue to its connection."""
        try:
            async for data in attachment.queue:
                await stream.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            attachment.end("gone")
            return
        if attachment.closing is not None:  # the session ended: its notice is out, now the attachment
            attachment.end(attachment.closing)

    async def _read(self, attachment: Attachment, share: Share, reader: BufferedByteReceiveStream) -> str:
        """What the attached client sends, until it detaches (``detached``) or goes (``gone``)."""
        while True:
            try:
                line = await reader.receive_until(b"\n", self.config.max_line_bytes)
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, anyio.ClosedResourceError):
                return "gone"
            except anyio.DelimiterNotFound:
                attachment.put(ProxyError.line_too_long(self.config.max_line_bytes).response(None))
                return "gone"
            if not line.strip():
                continue
            decoded = jsonrpc.decode_line(line)
            if isinstance(decoded, BadLine):
                attachment.put(jsonrpc.bad_line_response(decoded, line))
                continue
            msg, kind = decoded
            if kind is Kind.RESPONSE:
                await self._answered_by(attachment, msg)
            elif kind is Kind.NOTIFICATION:
                await self._notified_by(attachment, share, msg)
            elif await self._requested_by(attachment, share, msg):
                return "detached"

    async def _answered_by(self, attachment: Attachment, msg: Message) -> None:
        ask = attachment.asks.get(msg.id) if msg.id is not UNSET else None
        if ask is None:
            log.info(
                "session %s: %s answered a request no longer waiting: dropped", attachment.session_id, attachment.label
            )
            return
        if msg.error is not UNSET:
            log.info(
                "session %s: %s answered %s with an error: the others may still answer",
                ask.session_id,
                attachment.label,
                ask.key,
            )
            return
        if ask.method == Method.REQUEST_PERMISSION and not valid_permission_answer(
            jsonrpc.decode_object(msg.result), ask.options
        ):
            log.warning(
                "session %s: %s sent an answer %s does not offer: dropped", ask.session_id, attachment.label, ask.key
            )
            return
        if not await self.answer(ask, msg, attachment.client, attachment):
            log.info(
                "session %s: %s answered %s after someone else: dropped", ask.session_id, attachment.label, ask.key
            )

    async def _notified_by(self, attachment: Attachment, share: Share, msg: Message) -> None:
        if msg.method == Method.CANCEL:
            if attachment.role is not Role.CONTROLLER:
                log.info(
                    "session %s: %s (an observer) sent session/cancel: dropped", share.session_id, attachment.label
                )
                return
            self.cancel_queued(share.session_id)
            session = self.intents.table.get(share.session_id)
            if session is not None:
                await self.intents.cancel(session, by=attachment.label)
        elif msg.method == Method.CANCEL_REQUEST:
            params = jsonrpc.decode_object(msg.params) or {}
            target = params.get("requestId")
            routed = next((k for k, v in attachment.prompts.items() if v == target), None)
            if routed is not None:
                await self.cancel_prompt(share.session_id, routed)

    async def _requested_by(self, attachment: Attachment, share: Share, msg: Message) -> bool:
        """A request of the attached client's; ``True`` once it has detached."""
        method = str(msg.method)
        their_id = msg.id
        params = jsonrpc.decode_object(msg.params) or {}
        if method in ATTACHED_METHODS and params.get("sessionId") != share.session_id:
            error = ProxyError.invalid_params(f"{method}: this connection is attached to session {share.session_id}")
            attachment.put(error.response(their_id))  # type: ignore[arg-type]
            return False
        if method == Method.DETACH:
            attachment.put(jsonrpc.result_response(their_id, {"sessionId": share.session_id, "status": "detached"}))  # type: ignore[arg-type]
            return True
        if method == Method.CLAIM_PERMISSION and attachment.role is Role.CONTROLLER:
            try:
                claimed = self.claim(share.session_id, params, attachment.client)
            except ProxyError as exc:
                attachment.put(exc.response(their_id))  # type: ignore[arg-type]
                return False
            attachment.put(jsonrpc.result_response(their_id, claimed))  # type: ignore[arg-type]
            return False
        if method not in ATTACHED_METHODS:
            attachment.put(ProxyError.not_attached_method(method).response(their_id))  # type: ignore[arg-type]
            return False
        if attachment.role is not Role.CONTROLLER:
            attachment.put(ProxyError.observer_cannot(method).response(their_id))  # type: ignore[arg-type]
            return False

        def reply(data: bytes) -> None:
            for routed, own in list(attachment.prompts.items()):
                if own == their_id:
                    del attachment.prompts[routed]
            attachment.put(data)

        routed = self.prompt(share.session_id, msg, attachment.client, reply)
        if routed is not None:
            attachment.prompts[routed] = their_id  # type: ignore[assignment]
        if self.journal is not None:
            self.journal.record(
                journal.Kind.ATTACHED_PROMPT,
                backend=self._backend(share.session_id),
                session_id=share.session_id,
                label="prompt",
                detail=f"by {attachment.label}",
            )
        return False

    def _detached(self, attachment: Attachment, share: Share, why: str) -> None:
        attachment.end(why)
        share.attachments.pop(attachment.number, None)
        for their_id, ask in list(attachment.asks.items()):
            ask.sent.pop(attachment.number, None)
            del attachment.asks[their_id]
        self.unclaim(attachment.client)
        attachment.out.close()
        if why == "starting":
            self._forget_if_idle(share)
            return
        self.transcripts.record(
            share.session_id, EntryKind.DETACHED, msgspec.json.encode({"why": why}), attachment.label
        )
        log.info("session %s: %s detached (%s)", share.session_id, attachment.label, why)
        notice = update_line(
            share.session_id,
            {
                "type": "client_disconnected",
                "client": attachment.info,
                "reason": why,
                "timestamp": _timestamp(time.time()),
            },
        )
        self._tell(share.session_id, notice)
        if self.journal is not None:
            self.journal.record(
                journal.Kind.DETACHED,
                backend=self._backend(share.session_id),
                session_id=share.session_id,
                label=why,
                detail=f"{attachment.label} ({why})",
            )
        self._forget_if_idle(share)

    def _backend(self, session_id: str) -> str | None:
        session = self.intents.table.get(session_id)
        return session.record.backend if session is not None else None

    def _tell(self, session_id: str, notice: bytes) -> None:
        """One of the draft's updates: to every attached client, and to the gateway if it asked for them."""
        share = self.shares.get(session_id)
        for attachment in list(share.attachments.values()) if share is not None else ():
            attachment.put(notice)
        if session_id in self.gateway_notices:
            self.background.start(lambda: self.writer.send(notice))

    def gateway_attached(self, session_id: str) -> None:
        """The gateway attached to its own session: from now on it gets the draft's updates too."""
        self.gateway_notices.add(session_id)

    def _forget_if_idle(self, share: Share) -> None:
        if not share.attachments and not share.lane and self.shares.get(share.session_id) is share:
            del self.shares[share.session_id]

    def session_ended(self, session_id: str, why: str) -> None:
        """The session was closed or deleted here, or moved to another proxy: its attached clients are told and
        detached."""
        self.prompters.pop(session_id, None)
        share = self.shares.get(session_id)
        if share is None:
            return
        notice = update_line(session_id, {"type": "attach_ended", "reason": why})
        for attachment in list(share.attachments.values()):
            attachment.put(notice)
            attachment.closing = why
            attachment.out.close()  # the pump sends what is queued, the notice last, then ends it


def _cancel_request(request_id: RequestId) -> bytes:
    return jsonrpc.notification(Method.CANCEL_REQUEST, {"requestId": request_id})


def _with_id(data: bytes, request_id: RequestId) -> bytes:
    decoded = jsonrpc.decode_line(data.rstrip(b"\n"))
    if isinstance(decoded, BadLine):
        return data
    return jsonrpc.with_id(decoded[0], request_id)


def _control_error(request_id: object, code: str, message: str) -> bytes:
    return msgspec.json.encode({"id": request_id, "ok": False, "error": {"code": code, "message": message}}) + b"\n"
