"""``benchmarks/gpu/multi_gpu.py`` (issue #6): the CPU rehearsal runs every phase's logic.

``--smoke`` runs the script in a subprocess on CPU (gloo instead of nccl, a tiny Qwen3, two CPU
engines standing in for GPUs 1 and 2) and its JSON is checked: every phase present, the
``nccl`` push reached every engine with the trainer's checksum, ``checkpoint_engine`` skipped
because it needs CUDA, and the targeted recovery reached ``active`` through a push to the failed
group only while no request reached that group. The checkpoint-engine aggregation (GPU-only at
run time) is checked on synthetic rank reports; the deadline and the refusal without two GPUs
are checked without engines. On a host with 2+ GPUs the ``env`` phase runs for real (``gpu``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from engine_helpers import repo_env

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu" / "multi_gpu.py"
PHASES = ["env", "nccl", "checkpoint_engine", "targeted_recovery"]


def run_script(out: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=repo_env(),
    )


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("multi-gpu") / "smoke.json"
    done = run_script(out, "--smoke")
    assert out.exists(), done.stderr[-4000:]
    doc: dict[str, Any] = json.loads(out.read_text())
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:], doc["errors"])
    return doc


def test_smoke_runs_every_phase_and_writes_one_json(smoke: dict[str, Any]) -> None:
    assert list(smoke["phases"]) == PHASES
    assert smoke["ok"] is True and smoke["errors"] == [] and smoke["running"] is None
    assert [s["phase"] for s in smoke["skipped"]] == ["checkpoint_engine"]
    env = smoke["phases"]["env"]
    assert env["nccl_nvls_enable"]["value"] == "0"
    assert set(env["rdma"]) >= {"sys_class_infiniband", "ibv_devices", "present"}
    assert isinstance(env["mooncake"]["importable"], bool)


def test_smoke_nccl_push_reaches_every_engine_with_the_trainers_checksum(
    smoke: dict[str, Any],
) -> None:
    nccl = smoke["phases"]["nccl"]
    assert nccl["backend"] == "gloo" and nccl["ok"] is True
    targets = nccl["targets"]
    assert len(targets) == 2
    assert nccl["raw"]["shared"]["seconds"] > 0 and nccl["raw"]["pairs"]["seconds"] > 0
    assert nccl["raw"]["receiver_exit_codes"] == [0, 0]
    for row in nccl["transport"]:
        assert "error" not in row, row
        assert sorted(row["per_target"]) == sorted(targets)
        assert row["buckets"] > 1 and row["ratio_vs_raw_shared"] > 0
    check = nccl["checksum"]
    assert check["equal"] is True
    assert sorted(check["engines"]) == sorted(targets)
    assert all(e["engine_model"] == check["want"] for e in check["engines"].values())
    assert smoke["summary"]["nccl_checksums_equal"] is True


def test_smoke_records_checkpoint_engine_as_needing_cuda(smoke: dict[str, Any]) -> None:
    ce = smoke["phases"]["checkpoint_engine"]
    assert ce["status"] == "skipped" and ce["reason"].startswith("needs CUDA")


def test_smoke_targeted_recovery_reaches_active_and_spares_the_failed_group(
    smoke: dict[str, Any],
) -> None:
    rec = smoke["phases"]["targeted_recovery"]
    assert rec["ok"] is True, rec
    assert rec["reached_active"] is True and rec["status"] == "active"
    assert rec["strategy"] == "targeted_push"
    assert rec["kill_to_active_s"] > 0
    assert [t["target"] for t in rec["victim_transitions"]][-1] == "active"
    # no request reached the failed group while it was not active
    assert rec["no_request_to_failed_group"] is True
    assert rec["victim_dispatch_states"] == ["active"]
    assert rec["dispatches_to_victim_while_not_active"] == 0
    assert rec["victim_served_while_not_active"] == 0
    # the other group kept serving, and the re-sync went to the failed group only
    assert rec["served_by_others_meanwhile"] > 0
    assert rec["subset_push_only_victim"] is True
    assert all(rec["checksums_after"].values())
    assert rec["initial_sync"]["ok"] is True


def test_a_passed_deadline_skips_and_lists_every_phase(tmp_path: Path) -> None:
    out = tmp_path / "late.json"
    done = run_script(out, "--smoke", "--deadline-s", "0", timeout=120)
    doc = json.loads(out.read_text())
    assert done.returncode == 1  # nothing ran: not ok
    assert [s["phase"] for s in doc["skipped"]] == PHASES
    assert all(doc["phases"][p]["status"] == "skipped" for p in PHASES)


def test_without_two_gpus_the_full_run_refuses(tmp_path: Path) -> None:
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this host has 2+ GPUs: the full run would start")
    out = tmp_path / "refused.json"
    done = run_script(out, timeout=120)
    assert done.returncode == 2
    doc = json.loads(out.read_text())
    assert "needs 2+ CUDA GPUs" in doc["refused"] and doc["ok"] is False


@pytest.fixture(scope="module")
def script_module() -> ModuleType:
    """The script imported as a module (its import-time NCCL_NVLS_ENABLE is undone)."""
    before = os.environ.get("NCCL_NVLS_ENABLE")
    spec = importlib.util.spec_from_file_location("multi_gpu_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve annotations through it
    try:
        spec.loader.exec_module(module)
    finally:
        if before is None:
            os.environ.pop("NCCL_NVLS_ENABLE", None)
        else:
            os.environ["NCCL_NVLS_ENABLE"] = before
    return module


def _rank(rank: int, digests: dict[str, str], reg: list[float], upd: list[float]) -> dict[str, Any]:
    rounds = [
        {"register_s": r, "update_s": u, "ok": True, "results": {"gpu0": {"ok": True}}}
        for r, u in zip(reg, upd, strict=True)
    ]
    return {"rank": rank, "bytes": 8_000_000_000, "digests": digests, "rounds": rounds}


def test_checkpoint_engine_reports_fold_into_one_record(script_module: ModuleType) -> None:
    from rollsafe.checksum import model_digest

    ranks = {
        0: _rank(0, {"a": "1", "b": "2"}, [9.0, 2.0, 2.2], [5.0, 1.0, 1.1]),
        1: _rank(1, {"c": "3"}, [8.0, 2.5, 2.0], [4.0, 0.9, 1.3]),
    }
    agg = script_module.ce_aggregate(ranks, 2, 3)
    assert agg["want"] == model_digest({"a": "1", "b": "2", "c": "3"})
    assert [r["warm_up"] for r in agg["rounds"]] == [True, False, False]
    assert agg["rounds"][1]["register_s_max"] == 2.5 and agg["rounds"][2]["update_s_max"] == 1.3
    assert agg["register_s_median"] == 2.35 and agg["update_s_median"] == 1.15
    assert agg["update_gb_s"] == round(8.0 / 1.15, 3)
    assert agg["rounds_ok"] is True and "missing_ranks" not in agg
    # a rank that never reported, or shares that miss a key: no verdict of success
    partial = script_module.ce_aggregate({0: ranks[0]}, 2, 3)
    assert partial["missing_ranks"] == [1] and partial["rounds_ok"] is False
    assert partial["want"] is None
    # the subset update's new version: its digest over every rank's share, like the first
    assert agg["want_new"] is None  # no rank pushed a new version
    ranks[0]["digests_new"], ranks[1]["digests_new"] = {"a": "4", "b": "5"}, {"c": "6"}
    again = script_module.ce_aggregate(ranks, 2, 3)
    assert again["want_new"] == model_digest({"a": "4", "b": "5", "c": "6"})
    assert again["want"] == agg["want"]


def test_checkpoint_engine_ranks_share_out_sglangs_parameters(script_module: ModuleType) -> None:
    """The checkpoint-engine ranks' expected digests: SGLang's own (fused) parameters dealt
    over the ranks, every one once, folding into what a one-rank engine's checker reports."""
    from rollsafe.checksum import model_digest
    from rollsafe.fleet.weights_check import sglang_model_digest

    cfg, shapes = script_module.model_config("smoke")
    weights = script_module.build_weights(shapes, torch.device("cpu"), seed=3)
    shares = [script_module.engine_share(cfg, list(weights), r, 2) for r in range(2)]
    n_keys = len(script_module.engine_share(cfg, [n for n, _ in shapes], 0, 1))
    assert not set(shares[0]) & set(shares[1]) and len(shares[0]) + len(shares[1]) == n_keys
    names = {n for share in shares for n in share}
    assert any(n.endswith("self_attn.qkv_proj.weight") for n in names)
    hf_parts = (".q_proj.weight", ".k_proj.weight", ".gate_proj.weight", ".mlp.up_proj.weight")
    assert not any(n.endswith(hf_parts) for n in names)
    digests: dict[str, str] = {}
    for share in shares:
        digests.update(script_module.share_digests(weights, cfg, share))
    assert len(digests) == n_keys
    assert model_digest(digests) == sglang_model_digest(weights, cfg)


def test_checkpoint_engine_p2p_protocol_choice(script_module: ModuleType) -> None:
    choose = script_module.ce_p2p_choice
    assert choose("auto", ["mlx5_0"], True) == ("rdma", None)
    assert choose("auto", [], True) == ("tcp", None)  # the lent H200s: no RDMA, .mc carried
    assert choose("tcp", ["mlx5_0"], True) == ("tcp", None)
    protocol, why = choose("rdma", [], True)
    assert protocol is None and "no RDMA devices" in why
    protocol, why = choose("auto", ["mlx5_0"], False)
    assert protocol is None and "mooncake is not importable" in why
    assert choose("off", ["mlx5_0"], True) == (None, "--ce-p2p-protocol off")


def test_checkpoint_engine_p2p_report_compares_with_the_broadcast(
    script_module: ModuleType,
) -> None:
    report = script_module.ce_p2p_report
    subset = {
        "mode": "p2p",
        "ok": True,
        "seconds": 16.0,
        "served_meanwhile": 40,
        "failed_meanwhile": 0,
    }
    got = report(subset, 8_000_000_000, 0.8)
    assert got["run"] and got["ok"] and got["seconds"] == 16.0
    assert got["gb_s"] == 0.5 and got["broadcast_gb_s"] == 10.0
    assert got["p2p_over_broadcast_time"] == 20.0 and got["served_on_gpu0_meanwhile"] == 40
    refused = report({"mode": "refused", "error": "P2P unavailable"}, 8_000_000_000, 0.8)
    assert refused == {"run": False, "mode": "refused", "error": "P2P unavailable"}
    assert report(None, 0, None)["run"] is False


@pytest.mark.gpu
def test_env_phase_on_a_multi_gpu_host(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2+ CUDA GPUs")
    out = tmp_path / "env.json"
    done = run_script(out, "--phases", "env", timeout=120)
    doc = json.loads(out.read_text())
    assert done.returncode == 0, done.stderr[-3000:]
    env = doc["phases"]["env"]
    assert env["nccl_nvls_enable"]["value"] == "0"
    assert env["gpu_count"] == torch.cuda.device_count() and env["ok"] is True
