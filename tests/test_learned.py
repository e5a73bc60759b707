"""What the install learns about each backend: kept for every proxy of it, forgotten with the command."""

from __future__ import annotations

from pathlib import Path

from acp_proxy.pool.learned import BackendFacts, Learned, all_peaks
from acp_proxy.state import StateDB


def test_facts_are_shared_by_every_proxy_of_the_install(tmp_path: Path) -> None:
    one = Learned(StateDB(tmp_path))
    one.restored_with("qwen", "h1", "session/load")
    one.unsupported("qwen", "h1", "session/resume")
    one.peak("qwen", "h1", 150 << 20)
    one.peak("qwen", "h1", 100 << 20)
    one.db.settle()
    other = Learned(StateDB(tmp_path))
    assert other.facts("qwen", "h1") == BackendFacts("session/load", frozenset({"session/resume"}), 150 << 20)
    assert other.facts("gemini", "h1") == BackendFacts()
    assert all_peaks(other.db.conn) == {"qwen": 150 << 20}


def test_a_new_command_starts_from_nothing(tmp_path: Path) -> None:
    learned = Learned(StateDB(tmp_path))
    learned.restored_with("qwen", "h1", "session/load")
    learned.unsupported("qwen", "h1", "session/resume")
    learned.db.settle()
    assert learned.facts("qwen", "h2") == BackendFacts()
    learned.peak("qwen", "h2", 10)
    learned.db.settle()
    assert learned.facts("qwen", "h2") == BackendFacts(peak_memory=10)
    assert learned.facts("qwen", "h1") == BackendFacts()
