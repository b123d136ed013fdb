"""The examples run as shipped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
