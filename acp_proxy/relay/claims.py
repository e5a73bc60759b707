"""Who may claim and answer an agent's request to the client (a permission, an elicitation): pure rules.

A request of the agent's is a pending interaction of its session: it waits until someone eligible
answers it, the agent withdraws it, or the agent's process ends, whoever was asked first and whoever
has gone since. ``[attach] permissions`` says who is eligible (names provisional, after the ACP Remote
drafts' pending interactions):

``first``       every controller (the session's gateway, each attached controller): the first answer wins
``prompter``    the clients of the principal whose prompt started the turn (a phone that reconnects is still it)
``designated``  the clients whose principal ``[attach] designated`` names (a token's name; ``local`` for a
                gateway on this host or a client of ``serve``'s unix socket)

An operator (``acp-proxy permissions answer``, ``top``) is eligible under every policy. A client
claims a request (``session/claim_permission``): from then on only it answers it, and the others are
told it is claimed; the claim ends when its client disconnects.
"""

from __future__ import annotations

import enum
from typing import Final

import msgspec

from acp_proxy.config import PermissionPolicy

LOCAL: Final = "local"
"""The principal of a gateway on this host (stdio), or of a client of ``serve``'s unix socket."""
PRINCIPAL_ENV: Final = "ACP_PROXY_PRINCIPAL"
"""Whose client a proxy's gateway is (set by ``serve``: the token's name; else ``local``)."""
OPERATOR: Final = "operator"


class Client(msgspec.Struct, frozen=True):
    """One client of a session, as the rules see it."""

    key: str
    """This connection of it: ``gateway``, ``attachment:N``, or ``operator``; a claim is held by one."""
    principal: str
    """Who it is across connections: a token's name, or ``local``."""
    label: str
    """How it is named to people."""


class Refusal(enum.Enum):
    """Why a client may not claim or answer a request."""

    NOT_ELIGIBLE = "not_eligible"
    CLAIMED = "permission_claimed"


def eligible(policy: PermissionPolicy, designated: tuple[str, ...], client: Client, prompter: str | None) -> bool:
    """Whether ``client`` is asked, and may answer (``prompter``: the principal whose prompt started the turn;
    ``None`` when no prompt did, and then every controller is)."""
    if client.key == OPERATOR or policy == "first":
        return True
    if policy == "prompter":
        return prompter is None or client.principal == prompter
    return client.principal in designated


def refusal(
    policy: PermissionPolicy,
    designated: tuple[str, ...],
    client: Client,
    prompter: str | None,
    claimed_by: Client | None,
) -> Refusal | None:
    """Why ``client`` may not claim or answer a request claimed by ``claimed_by``; ``None``: it may."""
    if not eligible(policy, designated, client, prompter):
        return Refusal.NOT_ELIGIBLE
    if claimed_by is not None and claimed_by.key != client.key:
        return Refusal.CLAIMED
    return None
