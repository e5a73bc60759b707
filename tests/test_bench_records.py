"""The load and install benchmarks' readings of what the proxies recorded: slot waits and log lines."""

from __future__ import annotations

import pytest

from benchmarks.pool import Acquire, Eviction, log_figures, parse_acquire


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        # a free slot, taken at once
        ("0.000120 ok - 812.500000", Acquire(0.00012, True, (), 812.5)),
        # a peer suspended its session for it
        (
            "0.250000 ok peer,0.100000,0.120000,1 812.5",
            Acquire(0.25, True, (Eviction(True, 0.1, 0.12, True),), 812.5),
        ),
        # a peer refused (its session was busy again), then this proxy's own spare was stopped
        (
            "0.3 ok peer,0.01,0.02,0;own,0.2,0.2,1 9.0",
            Acquire(0.3, True, (Eviction(True, 0.01, 0.02, False), Eviction(False, 0.2, 0.2, True)), 9.0),
        ),
        # waited out acquire_timeout
        ("30.0 failed - 1.0", Acquire(30.0, False, (), 1.0)),
    ],
)
def test_an_acquire_line_reads_back_as_written(line: str, expected: Acquire) -> None:
    assert parse_acquire(line) == expected


@pytest.mark.parametrize(
    ("evictions", "freed_by"),
    [
        ((), None),
        ((Eviction(True, 0.1, 0.2, False),), None),
        ((Eviction(True, 0.1, 0.2, True), Eviction(False, 0.3, 0.3, False)), Eviction(True, 0.1, 0.2, True)),
        ((Eviction(True, 0.1, 0.2, False), Eviction(True, 0.3, 0.4, True)), Eviction(True, 0.3, 0.4, True)),
    ],
)
def test_the_slot_comes_from_the_last_suspension_granted(
    evictions: tuple[Eviction, ...], freed_by: Eviction | None
) -> None:
    assert Acquire(1.0, True, evictions).suspended == freed_by


def test_the_log_gives_restore_times_and_suspension_reasons() -> None:
    logged = (
        "acp-proxy[1] INFO acp_proxy.sessions: session s1 resumed on pid 10 in 42 ms  session=s1\n"
        "acp-proxy[1] INFO acp_proxy.sessions: session s2 suspended (least recently used of the install): "
        "stopping pid 11  session=s2\n"
        "acp-proxy[1] INFO acp_proxy.sessions: session s3 suspended (idle for 900s): stopping pid 12\n"
        "acp-proxy[1] INFO acp_proxy.sessions: session s1 resumed on pid 13 in 58 ms\n"
    )
    figures = log_figures(logged)
    assert figures["logged_resume_ms"]["n"] == 2
    assert figures["logged_resume_ms"]["max"] == 58.0
    assert figures["suspended_by_reason"] == {"least recently used of the install": 1, "idle for Ns": 1}
