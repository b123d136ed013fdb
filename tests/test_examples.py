"""The examples run as shipped."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_machines_walkthrough_runs() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "machines_walkthrough.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "refused, as it must be" in result.stdout
    assert "recovering -> active" in result.stdout


@pytest.mark.skipif(sys.version_info < (3, 11), reason="TRL 1.16 needs Python >= 3.11")
def test_trl_grpo_example_trains_through_a_crash() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "trl_grpo.py"), "--steps", "3", "--crash-at", "1"],
        capture_output=True,
        text=True,
        timeout=420,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    out = result.stdout
    for step in range(3):
        assert re.search(rf"step {step}: \d+ completions from weights v{step};", out), out
    assert "killed g" in out and "at step 1" in out, out
    assert "tokens from other versions: 0" in out and "losses: [" in out, out
