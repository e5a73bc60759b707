"""A check's verdict, and the lines the report prints: PASS or FAIL per check, NOTE for what the peers did."""

from __future__ import annotations


class CheckFailed(Exception):
    """A check's verdict: the message says what differed or broke."""


class Report:
    def __init__(self) -> None:
        self.failed: list[str] = []
        self.passed: list[str] = []

    def result(self, name: str, ok: bool, detail: str) -> None:
        (self.passed if ok else self.failed).append(name)
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)

    @staticmethod
    def note(name: str, detail: str) -> None:
        print(f"NOTE  {name}: {detail}", flush=True)
