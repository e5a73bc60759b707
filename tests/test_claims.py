"""Who may claim and answer an agent's request to the client, by ``[attach] permissions``: the rules, in-process.

The same rules with real proxies (a claim, its end, each policy) are in ``tests/test_attach.py``.
"""

from __future__ import annotations

import pytest

from acp_proxy.config import PermissionPolicy
from acp_proxy.relay.claims import OPERATOR, Client, Refusal, eligible, refusal

GATEWAY = Client("gateway", "local", "the gateway")
PHONE = Client("attachment:1", "phone", "phone")
PHONE_AGAIN = Client("attachment:2", "phone", "phone, reconnected")
LAPTOP = Client("attachment:3", "laptop", "laptop")
ADMIN = Client(OPERATOR, OPERATOR, "operator root")

# (policy, designated, the client, the prompter's principal) -> eligible
ELIGIBLE = [
    ("first", (), GATEWAY, "phone", True),
    ("first", (), LAPTOP, None, True),
    ("prompter", (), PHONE, "phone", True),
    ("prompter", (), PHONE_AGAIN, "phone", True),  # the same principal on a new connection
    ("prompter", (), GATEWAY, "phone", False),
    ("prompter", (), LAPTOP, "phone", False),
    ("prompter", (), GATEWAY, "local", True),
    ("prompter", (), LAPTOP, None, True),  # no prompt started the turn: every controller
    ("designated", ("phone",), PHONE, None, True),
    ("designated", ("phone",), GATEWAY, "phone", False),
    ("designated", ("phone", "local"), GATEWAY, "phone", True),
    ("designated", ("phone",), LAPTOP, "laptop", False),  # prompting does not make it designated
    ("designated", ("phone",), ADMIN, None, True),  # an operator, under every policy
    ("prompter", (), ADMIN, "phone", True),
]


@pytest.mark.parametrize(("policy", "designated", "client", "prompter", "expected"), ELIGIBLE)
def test_who_is_asked(
    policy: PermissionPolicy, designated: tuple[str, ...], client: Client, prompter: str | None, expected: bool
) -> None:
    assert eligible(policy, designated, client, prompter) is expected


# (policy, the client, who claimed it) -> why it may not claim or answer
REFUSALS = [
    ("first", PHONE, None, None),
    ("first", PHONE, PHONE, None),  # its own claim
    ("first", GATEWAY, PHONE, Refusal.CLAIMED),
    ("first", PHONE_AGAIN, PHONE, Refusal.CLAIMED),  # a claim is one connection's: it ends with it
    ("first", ADMIN, PHONE, Refusal.CLAIMED),  # an operator does not overrule a claim
    ("designated", LAPTOP, None, Refusal.NOT_ELIGIBLE),
    ("designated", LAPTOP, PHONE, Refusal.NOT_ELIGIBLE),
    ("designated", PHONE, None, None),
]


@pytest.mark.parametrize(("policy", "client", "claimed_by", "expected"), REFUSALS)
def test_what_a_claim_leaves_others(
    policy: PermissionPolicy, client: Client, claimed_by: Client | None, expected: Refusal | None
) -> None:
    assert refusal(policy, ("phone",), client, None, claimed_by) is expected
