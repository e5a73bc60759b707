"""``scripts/bench --smoke``: every benchmark runs, so that a broken one fails CI. Its figures are not judged here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common import ROOT
from benchmarks.run import MEASUREMENTS

pytestmark = [pytest.mark.slow, pytest.mark.long]


def test_every_benchmark_runs_and_leaves_nothing_running(proc_env: dict[str, str], tmp_path: Path) -> None:
    output = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--smoke", "--output", str(output)],  # scripts/bench, in this venv
        cwd=ROOT,
        env=proc_env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(output.read_text())
    assert report["errors"] == [], report["errors"]
    for name in MEASUREMENTS:
        assert report.get(name.replace("-", "_")), f"{name}: nothing measured"
    left = {
        key: value["left_running"]
        for key, value in report.items()
        if isinstance(value, dict) and "left_running" in value
    }
    assert left, "no section said what it left running"
    assert not any(left.values()), left
    assert "## Targets" in done.stdout
