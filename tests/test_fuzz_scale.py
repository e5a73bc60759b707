"""Fuzzing at scale, bounded: a few thousand generated lines both ways, and the decoders under atheris.

``scripts/fuzz --lines N`` and ``python -m tests.fuzz_decoders --runs N`` run the same
things as long as asked, with any seed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import fuzz_decoders, fuzz_scale

LINES = 4_000
SEED = 1
RUNS = 20_000

pytestmark = pytest.mark.slow


@pytest.mark.anyio
async def test_a_bounded_scale_run_answers_every_line(
    proc_env: dict[str, str], tmp_path: Path, anyio_backend: str
) -> None:
    options = fuzz_scale.Options(seed=SEED, lines=LINES, async_backend=anyio_backend)
    report = await fuzz_scale.run(options, tmp_path, proc_env)
    print(report.summary())
    assert report.violations == []
    # The run did what it claims: every kind of line was sent, and was answered or relayed.
    assert report.gateway_lines + report.adapter_lines == LINES
    common = {"good echo", "good list", "unparseable", "wrong envelope", "invalid params", "unanswered", "blank"}
    assert common <= set(report.gateway_kinds)
    assert {-32700, -32600, -32602, -32002} <= set(report.errors_answered)
    assert report.good_served > 0
    assert report.relayed > 0
    assert report.adapter_answers == report.adapter_kinds["good request"] > 0


@pytest.mark.parametrize("seed_input", fuzz_decoders.SEEDS)
def test_the_decoder_checks_pass_on_their_seeds(seed_input: bytes) -> None:
    fuzz_decoders.check(seed_input)


@pytest.mark.parametrize(
    "found",
    [
        b"\x01\x80[1,2\n",  # broken JSON refused for its type first: was -32600, is -32700
        b'\x02\x05{"jsonrpc":"2.0","id":1}\n' + b"x" * 20 + b"\n\n  ",
    ],
)
def test_the_decoder_checks_pass_on_inputs_found_by_fuzzing(found: bytes) -> None:
    fuzz_decoders.check(found)


def test_a_bounded_coverage_guided_run_finds_nothing(proc_env: dict[str, str], tmp_path: Path) -> None:
    pytest.importorskip("atheris")
    command = [sys.executable, "-m", "tests.fuzz_decoders", f"--runs={RUNS}", f"--workdir={tmp_path}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False, env=proc_env)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert f"{RUNS:,} executions" in done.stdout
    assert "inputs: 0" in done.stdout
