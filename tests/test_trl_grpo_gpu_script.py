"""``benchmarks/gpu/trl_grpo_gpu.py`` (issue #26): the CPU rehearsal of the GPU GRPO run.

``--smoke`` runs the script in a subprocess on the CPU: TRL's ``GRPOTrainer`` through a
``RolloutFleet`` of two reference-engine groups in the vLLM dialect, ``transport="nccl"`` (gloo
without CUDA), one engine SIGKILLed mid-generation. Every check the GPU run reports must hold
here too, and the JSON must say what ran. The figures are the GPU run's
(``benchmarks/results/trl_grpo_gpu.json``), not this test's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import repo_env

if sys.version_info < (3, 11):  # rollsafe[trl] leaves TRL out there
    pytest.skip("TRL 1.16 needs Python >= 3.11", allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu" / "trl_grpo_gpu.py"
STEPS = 3
CRASH_AT = 1


def run_script(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=repo_env(),
    )


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("trl-grpo-gpu") / "smoke.json"
    done = run_script(
        "--smoke", "--steps", str(STEPS), "--crash-at", str(CRASH_AT), "--out", str(out)
    )
    assert out.exists(), done.stderr[-4000:]
    doc: dict[str, Any] = json.loads(out.read_text())
    failed = sorted(k for k, ok in (doc.get("checks") or {}).items() if not ok)
    assert done.returncode == 0, (failed, doc.get("error"), done.stdout[-2000:])
    return doc


@pytest.mark.timeout(700)
def test_smoke_trains_every_step_and_every_check_holds(smoke: dict[str, Any]) -> None:
    assert smoke["ok"] is True and "error" not in smoke
    checks = smoke["checks"]
    assert len(checks) == 12 and all(checks.values()), checks
    assert smoke["steps"] == STEPS and len(smoke["losses"]) == STEPS
    assert [g["fleet_version"] for g in smoke["generations"]] == list(range(STEPS))
    assert smoke["env"]["cuda"] is False and smoke["env"]["trl"].startswith("1.16.")
    fleet = smoke["fleet"]
    assert fleet["transport"] == "nccl" and fleet["nccl_backend"] == "gloo"
    assert fleet["engine"] == "reference engine, vLLM dialect"


@pytest.mark.timeout(700)
def test_smoke_syncs_after_every_step_and_the_engines_hold_the_trainers_weights(
    smoke: dict[str, Any],
) -> None:
    syncs = smoke["syncs"]
    assert [s["version"] for s in syncs] == list(range(1, STEPS))
    assert len(smoke["sync_s"]) == STEPS - 1 and all(t > 0 for t in smoke["sync_s"])
    for sync in syncs:
        serving = {g: r for g, r in sync["checks"].items() if r["state"] == "active"}
        assert serving and all(r["equal"] for r in serving.values()), sync
        # on CPU the vLLM layout has no data for linear weights: never "differs"/"missing"
        assert all(set(r["counts"]) <= {"equal", "no_data"} for r in serving.values()), sync
    assert {r["state"] for r in smoke["final_check"].values()} == {"active"}
    assert all(r["equal"] for r in smoke["final_check"].values())


@pytest.mark.timeout(700)
def test_smoke_kills_an_engine_mid_generation_and_recovers_it(smoke: dict[str, Any]) -> None:
    crash = smoke["crash"]
    assert crash["step"] == CRASH_AT and crash["group"] in ("g0", "g1")
    assert crash["tokens"] >= 3 and crash["pids"]
    assert crash["continued_completions"] >= 1
    assert crash["kill_to_active_s"] is not None and crash["kill_to_active_s"] > 0
    (rec,) = [r for r in smoke["recoveries"] if r["group_id"] == crash["group"]]
    assert rec["status"] == "active" and rec["fleet_version"] >= CRASH_AT


def test_bad_arguments_are_refused_before_anything_starts(tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    done = run_script("--smoke", "--steps", "1", "--out", str(out), timeout=60)
    assert done.returncode == 2 and "--steps must be >= 2" in done.stderr
    done = run_script("--smoke", "--steps", "3", "--crash-at", "3", "--out", str(out), timeout=60)
    assert done.returncode == 2 and "--crash-at must be in [1, steps)" in done.stderr
    assert not out.exists()
