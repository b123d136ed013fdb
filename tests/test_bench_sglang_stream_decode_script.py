"""``benchmarks/bench_sglang_stream_decode.py --smoke`` runs, holds its checks and writes its
result (the committed figures come from its full run: benchmarks/README.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_smoke_run_holds_its_checks_and_writes_its_result(tmp_path: Path) -> None:
    out = tmp_path / "decode.json"
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_sglang_stream_decode.py"),
            "--smoke",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=str(ROOT),
    )
    assert run.returncode == 0, run.stdout + run.stderr
    doc = json.loads(out.read_text())
    assert doc["failed_checks"] == [] and all(doc["checks"].values())
    assert set(doc["results"]) == {"plain", "logprobs"}
    assert all(
        row["whole_us_per_token_p50"] > 0 and row["incremental_us_per_token_p50"] > 0
        for by_n in doc["results"].values()
        for row in by_n.values()
    )
