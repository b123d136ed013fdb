"""``benchmarks/gpu/real_engine_gpu.py`` (issues 38, 39): the CPU rehearsal of the real-engine runs.

``--smoke`` runs every phase of the GPU script on the CPU with rollsafe's reference engine in
the engine's dialect (vLLM: imitating 0.26.0, the release the GPU run carries; SGLang: its
dialect) and gloo for NCCL: the fleet's start, generate, syncs, the probe against a fresh
server, the checkers, the sleep/wake cycles with the update refused while asleep (vLLM), SIGKILLs
with the cut request continued and the group recovered, a failed update, and (SGLang) the
update-time table. Every check the GPU run reports must hold here; the figures are the GPU
run's, not this test's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import repo_env

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu" / "real_engine_gpu.py"


def smoke(tmp_path: Path, engine: str, *extra: str) -> dict[str, Any]:
    out = tmp_path / f"{engine}.json"
    try:
        done = subprocess.run(
            # --deadline-s: past 730 s the script writes every thread's stack to its stderr,
            # kept in the failure of a run that hangs (one did, once, in a CI run)
            [
                sys.executable,
                str(SCRIPT),
                "--engine",
                engine,
                "--smoke",
                "--out",
                str(out),
                "--deadline-s",
                "700",
                *extra,
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=800,
            env=repo_env(),
        )
    except subprocess.TimeoutExpired as exc:  # a hang: its output says where it stood
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr
        pytest.fail(f"the {engine} smoke ran past 800 s; its stderr's end:\n{(err or '')[-30000:]}")
    assert out.exists(), done.stderr[-4000:]
    doc: dict[str, Any] = json.loads(out.read_text())
    failed = sorted(k for k, ok in doc["checks"].items() if not ok)
    errors = {p: r.get("error") for p, r in doc["phases"].items() if "error" in r}
    assert done.returncode == 0, (failed, errors, doc.get("error"), done.stderr[-3000:])
    return doc


@pytest.mark.timeout(900)
def test_vllm_smoke_every_phase_and_check(tmp_path: Path) -> None:
    doc = smoke(tmp_path, "vllm", "--syncs", "2", "--kills", "1")
    assert doc["ok"] is True
    assert set(doc["phases"]) == {
        "start",
        "generate",
        "sync",
        "probe",
        "checks",
        "sleep",
        "kill",
        "failed",
    }
    assert doc["phases"]["start"]["dialects"] == {"g0": "0.26.0", "g1": "0.26.0"}
    # the reference engine joins rollsafe's group; a real vLLM on the GPU reports "vllm"
    assert doc["phases"]["sync"]["rendezvous"] == "torch"
    assert [c["level"] for c in doc["phases"]["sleep"]["cycles"]] == [1, 2]
    assert all(c["update_while_asleep_refused"] for c in doc["phases"]["sleep"]["cycles"])
    assert set(doc["phases"]["checks"]["checksums"].values()) == {None}  # no checker in 0.26
    assert "sync_ipc" in doc["not_run"]  # said, not silently skipped
    kill = doc["phases"]["kill"]["kills"][0]
    assert kill["continued"] and kill["status"] == "active" and kill["kill_to_active_s"] > 0


@pytest.mark.timeout(900)
def test_sglang_smoke_every_phase_check_and_the_update_time_table(tmp_path: Path) -> None:
    doc = smoke(
        tmp_path, "sglang", "--syncs", "1", "--kills", "1", "--timing", "qwen3-4b", "--updates", "2"
    )
    assert doc["ok"] is True
    assert doc["phases"]["checks"]["verdicts"] == {"g0": "equal", "g1": "equal"}
    rows = doc["phases"]["update_times"]["rows"]
    assert {(r["transport"], r["engine"]) for r in rows} == {("nccl", "real"), ("ipc", "real")}
    assert all(len(r["times_s"]) == 3 and r["median_s"] > 0 for r in rows)
