"""``benchmarks/gpu/recovery_gpu.py`` (issue #16): the CPU rehearsal runs every phase's logic.

``--smoke`` runs the script in a subprocess with a tiny Qwen3 and CPU engines: each of the four
crashes (immediate from a warm and from an evicted page cache, targeted push, deferred to the
next sync) must end ``active`` with the strategy it names, equal checksums, no request to the
failed group, and the engine's start-up phases in the breakdown; the page-cache eviction must
be measured (``mincore``), not assumed. The figures are the GPU run's
(``benchmarks/results/gpu/recovery_h200_*.json``), not this test's.
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
SCRIPT = REPO / "benchmarks" / "gpu" / "recovery_gpu.py"
PHASES = ["immediate", "immediate_cold_cache", "targeted", "deferred"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("recovery-gpu") / "smoke.json"
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--smoke",
            "--repeats",
            "2",
            "--checksum-repeats",
            "2",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=repo_env(),
    )
    assert out.exists(), done.stderr[-4000:]
    doc: dict[str, Any] = json.loads(out.read_text())
    assert done.returncode == 0, (done.stdout[-3000:], doc["errors"], doc["checks"])
    return doc


def test_every_phase_ends_active_with_its_strategy(smoke: dict[str, Any]) -> None:
    assert smoke["ok"] is True and smoke["errors"] == [] and smoke["skipped"] == []
    for name in PHASES:
        runs = smoke["phases"][name]["runs"]
        assert len(runs) == 2, name
        expect = {"targeted": "targeted_push", "deferred": "deferred"}.get(name, "immediate")
        for row in runs:
            assert row["strategy"] == expect, name
            assert row["kill_to_active_s"] is not None and row["kill_to_active_s"] > 0, name
            assert row["no_request_to_failed_group"] is True, name
            assert row["checksums"]["equal"] is True, name
            assert row["restart_source"] == "ready_standby", name
        summary = smoke["phases"][name]["summary"]["kill_to_active_s"]
        times = sorted(r["kill_to_active_s"] for r in runs)
        assert summary["n"] == 2 and summary["max"] == round(times[-1], 3)
        assert summary["min"] <= summary["median"] <= summary["p95"] <= summary["max"]


def test_breakdown_has_engine_phases_and_steps(smoke: dict[str, Any]) -> None:
    immediate = smoke["phases"]["immediate"]["runs"][0]
    marks = immediate["engine"]["marks_s"]
    # the restarted engine read the export: its load phases are in order
    assert marks["model_built"] <= marks["weights_read"] <= marks["weights_loaded"]
    assert immediate["engine"]["export_to_device_gb_s"] > 0
    assert immediate["export_bytes"] > 0 and immediate["steps_s"]["restart"] > 0
    targeted = smoke["phases"]["targeted"]["runs"][0]
    assert "weights_read" not in targeted["engine"]["marks_s"]  # restarted on dummy weights
    assert "push" in targeted["steps_s"]
    deferred = smoke["phases"]["deferred"]["runs"][0]
    assert deferred["next_sync"]["ok"] is True
    assert deferred["kill_to_pending_s"] <= deferred["kill_to_active_s"]


def test_cold_cache_phase_measures_the_eviction(smoke: dict[str, Any]) -> None:
    for row in smoke["phases"]["immediate_cold_cache"]["runs"]:
        cache = row["page_cache"]
        assert cache["fadvise"] is True and cache["drop_caches"] is None  # never global in smoke
        assert cache["resident_after"] is not None and cache["resident_after"] < 0.05
        assert row["page_cache_dropped"] is True
    assert smoke["checks"]["immediate_cold_cache_page_cache_dropped"] is True


def test_checksum_phase_compares_trainer_and_engines(smoke: dict[str, Any]) -> None:
    c = smoke["phases"]["checksums"]
    assert c["equal"] is True
    assert set(c["engines"]) == {"serving", "victim"}
    assert len(c["trainer_seconds"]) == 2
