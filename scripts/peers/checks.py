"""The table of checks, in the order they run: the SDK and echo peers, then each family of checks
over the adapters it applies to, then the matrix over every adapter of the ADAPTERS table."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from . import (
    acpx_checks,
    attach_checks,
    curl_checks,
    install_checks,
    install_session_checks,
    matrix,
    openclaw_checks,
    raw_checks,
    remote_checks,
    sdk_checks,
    sdk_remote_checks,
    session_checks,
)
from .adapters import ADAPTERS, POOL_ADAPTERS
from .harness import Peers
from .report import CheckFailed


@dataclass(frozen=True)
class Check:
    name: str
    body: Callable[[Peers, str], str]
    """Runs the check named ``name``: what it found, or ``CheckFailed`` saying what differed or broke."""

    def run(self, peers: Peers) -> None:
        """One PASS or FAIL line, whatever happens in the check."""
        try:
            detail = self.body(peers, self.name)
        except CheckFailed as exc:
            peers.report.result(self.name, False, str(exc))
        except Exception as exc:  # a broken peer install or a bug here: still one line per check
            peers.report.result(self.name, False, f"{type(exc).__name__}: {exc}")
        else:
            peers.report.result(self.name, True, detail)


class AdapterCheck(Protocol):
    def __call__(self, peers: Peers, name: str, adapter: str) -> str: ...


def each_adapter(family: str, body: AdapterCheck, adapters: Iterable[str]) -> list[Check]:
    """``family-ADAPTER`` for each adapter, each running ``body`` against that adapter."""
    return [Check(f"{family}-{adapter}", partial(body, adapter=adapter)) for adapter in adapters]


CHECKS: tuple[Check, ...] = (
    Check("sdk-prompt-turn", sdk_checks.prompt_turn),
    Check("sdk-prompt-turn-trio", sdk_checks.prompt_turn_on_trio),
    Check("acpx-exec-sdk-agent", acpx_checks.exec_sdk_agent),
    Check("acpx-exec-echo-agent", acpx_checks.exec_echo_agent),
    Check("acpx-sessions-sdk-agent", acpx_checks.persistent_sessions),
    *each_adapter("acpx-exec", acpx_checks.exec_adapter, POOL_ADAPTERS),
    *each_adapter("raw", raw_checks.raw_adapter, POOL_ADAPTERS),
    *each_adapter("sessions", session_checks.sessions_raw, POOL_ADAPTERS),
    *each_adapter("sessions-acpx", session_checks.sessions_acpx, POOL_ADAPTERS),
    *each_adapter("spec", session_checks.spec_raw, POOL_ADAPTERS),
    *each_adapter("install-acpx", install_checks.install_acpx, POOL_ADAPTERS),
    Check("remote-acpx-echo", remote_checks.remote_acpx_echo),
    *each_adapter("remote-acpx", remote_checks.remote_acpx_adapter, POOL_ADAPTERS),
    Check("remote-sdk-python", sdk_remote_checks.remote_sdk_python),
    Check("remote-sdk-typescript", sdk_remote_checks.remote_sdk_typescript),
    Check("remote-curl-http2", curl_checks.remote_curl_http2),
    Check("attach-echo", attach_checks.attach_echo),
    *each_adapter("attach", attach_checks.attach_adapter, POOL_ADAPTERS),
    Check("retention-acpx-echo", install_session_checks.retention_acpx),
    Check("handover-acpx-echo", install_session_checks.handover_acpx),
    Check("fast-agent", install_session_checks.fast_agent),
    Check("openclaw-echo", openclaw_checks.openclaw_echo),
    *each_adapter("matrix", matrix.matrix, ADAPTERS),
)
