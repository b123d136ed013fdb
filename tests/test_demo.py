"""`rollsafe demo` end to end (small) as a subprocess, and the embedding example."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_small_run_recovers_and_checksums_match(tmp_path: Path) -> None:
    out = tmp_path / "report"
    result = subprocess.run(
        [
            sys.executable, "-m", "rollsafe.cli", "demo", "--steps", "2", "--groups", "2",
            "--crash-at", "2", "--rollout-s", "3", "--workers", "1", "--out", str(out),
        ],
        capture_output=True, text=True, timeout=240, check=False, cwd=str(ROOT),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    for name in ("timeline.jsonl", "paths.md", "summary.json"):
        assert (out / name).is_file(), name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and summary["failures"] == []
    rec = summary["recovery"]
    assert rec["crashed"] and rec["group"] == "g1" and rec["latency_s"] is not None
    assert rec["status"] == "active"
    assert summary["checksums"]["all_matched"]
    assert set(summary["checksums"]["final"].values()) == {"match"}
    assert all(set(c) <= {"active"} for c in summary["dispatch_counts"].values())
    rows = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()]
    g1 = [(r["event"], r["target"]) for r in rows if r["kind"] == "group" and r["subject"] == "g1"]
    assert ("fail", "inactive") in g1 and g1[-1][1] == "active"
    assert "stateDiagram-v2" in (out / "paths.md").read_text()
    assert "recovery:" in result.stdout and "where time went:" in result.stdout


def test_embed_in_trainer_example_runs() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "embed_in_trainer.py"), "--steps", "2"],
        capture_output=True, text=True, timeout=120, check=False, cwd=str(ROOT),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "step 2:" in result.stdout and "engines match trainer: True" in result.stdout
