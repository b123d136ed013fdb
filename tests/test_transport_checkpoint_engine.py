"""The ``checkpoint_engine`` transport: its CPU-testable core, and on CUDA the real thing.

On CPU: the transport refuses to start (really, nothing mocked); HF-index sharding on a real
safetensors directory; expert-parallel gather, rank-status and store-address agreement over a real
2-process gloo group; key coverage (function and the registration machine's guard, separately, and
that they agree); broadcast/P2P planning with ``P2PUnavailable`` when Mooncake is absent; result
mapping; scoped environment restore. On CUDA (``gpu`` marker): a world-size-1 NCCL group, a
reference engine on cuda and a real ``ParameterServer`` push through ``/update_weights_from_ipc``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from engine_helpers import (
    engine_factory,  # noqa: F401  (fixture)
    free_port,
    repo_env,
    tiny_model_dir,  # noqa: F401  (fixture)
    tiny_model_dir_b,  # noqa: F401  (fixture)
)
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from rollsafe.ports import EngineTarget
from rollsafe.statemachines import CheckpointRegistration, TransitionNotAllowed
from rollsafe.transports.base import RegisterError, TransportError
from rollsafe.transports.checkpoint_engine import (
    CheckpointEngineTransport,
    CheckpointEngineUnavailable,
    ExpertGather,
    ExpertGatherError,
    P2PUnavailable,
    agree_store_address,
    assign_files,
    check_key_coverage,
    checkpoint_engine_unavailable_reasons,
    gather_expert_shards,
    gather_rank_status,
    hidden_modules,
    merge_rank_results,
    mooncake_available,
    partition_keys,
    plan_update,
    read_hf_index,
    scoped_env,
    socket_paths_for,
)

REPO = Path(__file__).resolve().parents[1]
HAS_CE = __import__("importlib").util.find_spec("checkpoint_engine") is not None


# ------------------------------------------------------------------------------ availability
@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")
def test_construction_refuses_on_a_host_without_an_accelerator() -> None:
    with pytest.raises(CheckpointEngineUnavailable) as info:
        CheckpointEngineTransport()
    err = info.value
    assert isinstance(err, TransportError)
    assert "checkpoint-engine needs CUDA or Ascend: torch.cuda.is_available() is False" in str(err)
    assert "torch.cuda.is_available() is False" in " ".join(err.reasons)
    if not HAS_CE:
        assert "checkpoint_engine is not installed: pip install 'rollsafe[ce]'" in err.reasons
    assert err.reasons == tuple(checkpoint_engine_unavailable_reasons())


def test_importing_rollsafe_does_not_import_checkpoint_engine() -> None:
    code = (
        "import sys, rollsafe, rollsafe.transports, rollsafe.transports.checkpoint_engine\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('checkpoint_engine', 'zmq', "
        "'mooncake')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)


# ------------------------------------------------------------------------------ sharding
def _write_hf_dir(path: Path, shards: dict[str, dict[str, torch.Tensor]]) -> dict[str, str]:
    path.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for fname, tensors in shards.items():
        save_file(tensors, str(path / fname))
        weight_map.update(dict.fromkeys(tensors, fname))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return weight_map


def _four_shards() -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    return {
        "model-00001-of-00004.safetensors": {"model.embed_tokens.weight": t(256, 64)},
        "model-00002-of-00004.safetensors": {
            "model.layers.0.mlp.up_proj.weight": t(128, 64),
            "model.layers.0.input_layernorm.weight": t(64),
        },
        "model-00003-of-00004.safetensors": {"model.layers.1.mlp.up_proj.weight": t(128, 64)},
        "model-00004-of-00004.safetensors": {
            "model.norm.weight": t(64),
            "lm_head.weight": t(8, 64),
        },
    }


def test_files_of_a_real_hf_index_are_sharded_deterministically(tmp_path: Path) -> None:
    weight_map = _write_hf_dir(tmp_path / "hf", _four_shards())
    index = read_hf_index(tmp_path / "hf")
    assert index.weight_map == weight_map
    assert index.keys == sorted(weight_map)
    assert set(index.file_sizes) == set(weight_map.values())
    for world in (1, 2, 3, 4, 6):
        shares = assign_files(index.file_sizes, world)
        assert len(shares) == world
        flat = [f for s in shares for f in s]
        assert sorted(flat) == sorted(index.file_sizes)  # every file exactly once
        # the same answer whatever order the sizes come in
        reordered = dict(sorted(index.file_sizes.items(), reverse=True))
        assert assign_files(reordered, world) == shares
    two = assign_files(index.file_sizes, 2)
    loads = [sum(index.file_sizes[f] for f in share) for share in two]
    assert max(loads) - min(loads) <= max(index.file_sizes.values())  # balanced by bytes
    four = assign_files(index.file_sizes, 4)
    assert all(len(share) == 1 for share in four)  # as many ranks as files: one file each
    # keys follow their files: each key is registered by exactly one rank
    owners = {k: r for r, files in enumerate(two) for k, f in weight_map.items() if f in files}
    assert set(owners) == set(weight_map)


def test_hf_index_errors_name_the_shard(tmp_path: Path) -> None:
    _write_hf_dir(tmp_path / "hf", _four_shards())
    (tmp_path / "hf" / "model-00003-of-00004.safetensors").unlink()
    with pytest.raises(RegisterError, match=r"model-00003-of-00004\.safetensors"):
        read_hf_index(tmp_path / "hf")
    with pytest.raises(RegisterError, match="neither"):
        read_hf_index(tmp_path)
    single = tmp_path / "single"
    single.mkdir()
    save_file({"a": torch.zeros(2), "b": torch.ones(3)}, str(single / "model.safetensors"))
    idx = read_hf_index(single)
    assert idx.weight_map == {"a": "model.safetensors", "b": "model.safetensors"}


@given(
    st.dictionaries(st.text(min_size=1, max_size=12), st.integers(0, 1 << 30), max_size=60),
    st.integers(1, 9),
)
def test_key_partition_is_exact_deterministic_and_balanced(
    sizes: dict[str, int], world: int
) -> None:
    shares = partition_keys(sizes.items(), world)
    assert len(shares) == world
    flat = [k for s in shares for k in s]
    assert sorted(flat) == sorted(sizes)
    assert partition_keys(reversed(list(sizes.items())), world) == shares
    if sizes:
        loads = [sum(max(sizes[k], 1) for k in s) for s in shares]
        assert max(loads) - min(loads) <= max(max(v, 1) for v in sizes.values())


# ------------------------------------------------------------------------------ 2-process gloo
def _gloo_worker(rank: int, world: int, init: str, out_dir: str, case: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        result: dict[str, Any] = {}
        full_w = torch.arange(4 * 3 * 2, dtype=torch.float32).reshape(4, 3, 2)
        full_b = torch.arange(4 * 5, dtype=torch.float32).reshape(4, 5) + 100
        dense = torch.full((3,), float(rank))  # differs per rank: passes through untouched
        if case == "even":
            sl = slice(rank * 2, rank * 2 + 2)
            items = [
                ("dense.norm", dense),
                ("layer.experts.w", full_w[sl]),
                ("layer.experts.b", full_b[sl]),
            ]
            spec = ExpertGather.by_pattern(r"\.experts\.")
            got = dict(gather_expert_shards(items, spec))
            result["w_ok"] = torch.equal(got["layer.experts.w"], full_w)
            result["b_ok"] = torch.equal(got["layer.experts.b"], full_b)
            result["dense_ok"] = torch.equal(got["dense.norm"], dense)
            kept = dict(
                gather_expert_shards(items, spec, keep=lambda n: n.endswith(".b") == (rank == 1))
            )
            result["kept"] = sorted(kept)
            result["status"] = {
                str(k): list(v) for k, v in gather_rank_status(rank == 0, f"r{rank}").items()
            }
            result["addr"] = list(agree_store_address())
        elif case == "uneven":  # rank 0 holds 3 experts, rank 1 holds 1; concatenated along dim 1
            full = torch.arange(2 * 4, dtype=torch.float32).reshape(2, 4)
            sl = slice(0, 3) if rank == 0 else slice(3, 4)
            spec = ExpertGather(lambda n: n.startswith("e."), dim=1)
            got = dict(gather_expert_shards([("e.w", full[:, sl])], spec))
            result["ok"] = torch.equal(got["e.w"], full)
        elif case == "mismatch":
            name = "layer.experts.w" if rank == 0 else "layer.experts.v"
            try:
                gather_expert_shards([(name, full_w[:2])], ExpertGather.by_pattern())
                result["error"] = ""
            except ExpertGatherError as exc:
                result["error"] = str(exc)
        Path(out_dir, f"{case}-{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _run_gloo(tmp_path: Path, case: str, world: int = 2) -> list[dict[str, Any]]:
    from torch.multiprocessing.spawn import start_processes

    init = f"file://{tmp_path / f'store-{case}'}"
    start_processes(  # type: ignore[no-untyped-call]
        _gloo_worker, args=(world, init, str(tmp_path), case), nprocs=world, start_method="spawn"
    )
    return [json.loads((tmp_path / f"{case}-{r}.json").read_text()) for r in range(world)]


def test_expert_gather_status_and_store_address_over_gloo(tmp_path: Path) -> None:
    r0, r1 = _run_gloo(tmp_path, "even")
    for r in (r0, r1):
        assert r["w_ok"] and r["b_ok"] and r["dense_ok"]
        assert r["status"] == {"0": [True, "r0"], "1": [False, "r1"]}
    assert r0["kept"] == ["dense.norm", "layer.experts.w"]  # keep() drops what a rank won't own
    assert r1["kept"] == ["dense.norm", "layer.experts.b"]
    assert r0["addr"] == r1["addr"]  # rank 0 chose, everyone got the same
    assert r0["addr"][1] > 0


def test_expert_gather_uneven_slices_and_mismatch_over_gloo(tmp_path: Path) -> None:
    assert all(r["ok"] for r in _run_gloo(tmp_path, "uneven"))
    errors = [r["error"] for r in _run_gloo(tmp_path, "mismatch")]
    assert all("layer.experts.v" in e and "layer.experts.w" in e for e in errors), errors


# ------------------------------------------------------------------------------ key coverage
def test_key_check_names_missing_extra_and_doubled_keys() -> None:
    expected = ["a.w", "b.w", "mtp.layers.0.w", "c.w"]
    cov = check_key_coverage(expected, ["a.w", "b.w", "c.w"])
    assert cov.ok and cov.allowed_missing == ("mtp.layers.0.w",)
    cov = check_key_coverage(expected, ["a.w", "zzz.extra"])
    assert not cov.ok
    assert cov.missing == ("b.w", "c.w") and cov.extra == ("zzz.extra",)
    text = cov.describe()
    assert "'b.w'" in text and "'c.w'" in text and "'zzz.extra'" in text
    cov = check_key_coverage(["a", "b"], ["a", "b", "a"])
    assert cov.duplicated == ("a",) and "'a'" in cov.describe()
    many = check_key_coverage([f"k{i}" for i in range(500)], [])
    assert len(many.describe()) < 400 and "490 more" in many.describe()
    assert check_key_coverage(["mtp.x"], [], allow_missing_prefixes=()).missing == ("mtp.x",)


def test_registration_guard_refuses_missing_extra_keys_and_absent_ranks() -> None:
    def attempt(ranks: list[int], expected: list[str], got: list[str]) -> CheckpointRegistration:
        m = CheckpointRegistration(2)
        m.begin_register(name="ce-v1", version=1)
        m.register_ok(ranks_ok=ranks, expected_keys=expected, registered_keys=got)
        return m

    assert attempt([0, 1], ["a", "mtp.b"], ["a"]).published == ("ce-v1", 1)
    for ranks, got in (([0, 1], []), ([0, 1], ["a", "mtp.b", "x"]), ([0], ["a", "mtp.b"])):
        with pytest.raises(TransitionNotAllowed):
            attempt(ranks, ["a", "mtp.b"], got)


@given(
    st.sets(st.sampled_from(["a", "b", "mtp.c", "mtp.d", "e"])),
    st.sets(st.sampled_from(["a", "b", "mtp.c", "mtp.d", "e", "x"])),
)
def test_key_check_agrees_with_the_machine_guard(expected: set[str], got: set[str]) -> None:
    m = CheckpointRegistration(1)
    assert check_key_coverage(expected, got).ok == m.key_coverage_exact(
        expected_keys=expected, registered_keys=got
    )


# ------------------------------------------------------------------------------ update planning
def test_broadcast_when_targets_cover_every_rank() -> None:
    plan = plan_update([[2, 3], [0, 1]], 4, p2p_available=False)
    assert plan.mode == "broadcast" and plan.ps_ranks is None


def test_subset_uses_p2p_only_when_available() -> None:
    plan = plan_update([[3], [1]], 4, p2p_available=True)
    assert plan.mode == "p2p" and plan.ps_ranks == [1, 3]


def test_subset_without_mooncake_raises_p2p_unavailable_not_a_broadcast() -> None:
    assert not mooncake_available()  # this host: Mooncake is never installed by default
    with pytest.raises(P2PUnavailable) as info:
        plan_update([[2, 3]], 4, p2p_available=mooncake_available())
    err = info.value
    assert isinstance(err, TransportError)
    assert err.ranks == (2, 3) and err.world_size == 4
    assert "mooncake is not installed" in str(err) and "refusing to broadcast" in str(err)
    with pytest.raises(TransportError, match="out of range"):
        plan_update([[0, 4]], 4, p2p_available=True)


def test_socket_paths_pick_the_targets_ranks() -> None:
    paths = [(f"GPU-{r}", f"ipc://@ce-{r}.sock") for r in range(4)]
    assert socket_paths_for(paths, (2, 3)) == {
        "GPU-2": "ipc://@ce-2.sock",
        "GPU-3": "ipc://@ce-3.sock",
    }
    with pytest.raises(TransportError, match="rank 7"):
        socket_paths_for(paths, (7,))


class _NoClient:
    pass


def _targets() -> list[EngineTarget]:
    return [
        EngineTarget("e0", (0, 1), _NoClient(), 2),  # type: ignore[arg-type]
        EngineTarget("e1", (2, 3), _NoClient(), 2),  # type: ignore[arg-type]
    ]


def test_results_map_from_the_posting_rank() -> None:
    ok = (True, "", 1.5)
    gathered: list[tuple[dict[str, tuple[bool, str, float]], str | None]] = [
        ({"e0": ok}, None),
        ({}, None),
        ({"e1": ok}, None),
        ({}, None),
    ]
    res = merge_rank_results(gathered, _targets(), nbytes=42)
    assert res["e0"].ok and res["e1"].ok and res["e0"].nbytes == 42 and res["e0"].seconds == 1.5


def test_a_failed_collective_fails_every_target_and_keeps_reasons() -> None:
    gathered: list[tuple[dict[str, tuple[bool, str, float]], str | None]] = [
        ({"e0": (False, "HTTP 400: no CUDA", 0.1)}, "RuntimeError: remote errors"),
        ({}, "RuntimeError: remote errors"),
        ({"e1": (True, "", 1.0)}, "RuntimeError: remote errors"),
        ({}, None),
    ]
    res = merge_rank_results(gathered, _targets(), nbytes=42)
    assert not res["e0"].ok and res["e0"].reason.startswith("HTTP 400: no CUDA")
    assert not res["e1"].ok and "rank(s) 0: RuntimeError" in res["e1"].reason
    assert res["e1"].nbytes == 0
    never = merge_rank_results([({}, None)] * 4, _targets())
    assert not never["e0"].ok and "never asked" in never["e0"].reason


# ------------------------------------------------------------------------------ environment
def test_scoped_env_restores_set_and_unset_variables() -> None:
    os.environ["ROLLSAFE_T_SET"] = "old"
    os.environ.pop("ROLLSAFE_T_ABSENT", None)
    with scoped_env({"ROLLSAFE_T_SET": "new", "ROLLSAFE_T_ABSENT": "x"}):
        assert os.environ["ROLLSAFE_T_SET"] == "new" and os.environ["ROLLSAFE_T_ABSENT"] == "x"
    assert os.environ["ROLLSAFE_T_SET"] == "old" and "ROLLSAFE_T_ABSENT" not in os.environ
    with pytest.raises(RuntimeError), scoped_env({"ROLLSAFE_T_SET": None, "RANK": "0"}):
        assert "ROLLSAFE_T_SET" not in os.environ
        raise RuntimeError("boom")
    assert os.environ["ROLLSAFE_T_SET"] == "old"
    del os.environ["ROLLSAFE_T_SET"]


def test_rank_env_is_restored_exactly() -> None:
    before = os.environ.get("RANK")
    with scoped_env({"RANK": "0", "PS_MAX_BUCKET_SIZE_GB": "0.5"}):
        assert os.environ["RANK"] == "0"
    assert os.environ.get("RANK") == before and "PS_MAX_BUCKET_SIZE_GB" not in os.environ


def test_hidden_modules_block_imports_and_restore() -> None:
    import json as json_module

    with hidden_modules(["json", "rollsafe_never_a_module"]):
        with pytest.raises(ImportError):
            __import__("json")
        with pytest.raises(ImportError):
            __import__("rollsafe_never_a_module")
    assert sys.modules["json"] is json_module and "rollsafe_never_a_module" not in sys.modules


# ------------------------------------------------------------------------------ GPU
@pytest.fixture
def nccl_world_of_one() -> Any:
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", 0),
    )
    yield dist
    dist.destroy_process_group()


def _load_dir(path: Path, device: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update({k: v.to(device) for k, v in load_file(str(f)).items()})
    return out


@pytest.mark.gpu
def test_gpu_broadcast_into_a_reference_engine_matches_checksums(
    nccl_world_of_one: Any,
    tiny_model_dir: Path,  # noqa: F811
    tiny_model_dir_b: Path,  # noqa: F811
    engine_factory: Callable[..., Any],  # noqa: F811
) -> None:
    from engine_helpers import sglang_digests

    from rollsafe.adapters.engines.sglang import SGLangClient

    eng = engine_factory(tiny_model_dir, extra_args=["--device", "cuda"])
    client = SGLangClient(eng.url, timeout=120.0)
    env_before = {
        k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "PS_MAX_BUCKET_SIZE_GB")
    }
    tr = CheckpointEngineTransport(socket_timeout_s=120.0, max_bucket_bytes=1 << 20)
    try:
        assert tr.world_size == 1 and not tr.p2p_available
        target = EngineTarget("e0", (0,), client)
        weights_b = _load_dir(tiny_model_dir_b, "cuda")
        tr.register(weights_b, 2)
        report = tr.update([target])
        assert report.ok, report.results
        got = client.weights_checksum()  # sglang-gpu: the engine's weights are on cuda
        assert got.tensors == sglang_digests(weights_b, 1, got.algorithm)["tensors"]
        # the weight checker reports no version: read it where the engine publishes it
        info = httpx.get(f"{client.url}/get_server_info", timeout=30).json()
        assert info["weight_version"] == "2"
        # from an HF directory: back to model A
        tr.register_from_dir(tiny_model_dir, 3)
        report = tr.update([target])
        assert report.ok, report.results
        weights_a = _load_dir(tiny_model_dir, "cpu")
        got = client.weights_checksum()
        assert got.tensors == sglang_digests(weights_a, 1, got.algorithm)["tensors"]
        # a missing key outside the allow-list refuses before anything changes
        partial = dict(weights_b)
        partial.pop(sorted(partial)[0])
        with pytest.raises(RegisterError, match=repr(sorted(weights_b)[0])):
            tr.register(partial, 4, expected_keys=weights_b)
        assert tr.registration.published == ("checkpoint_engine-v3", 3)
    finally:
        tr.close()
        client.close()
    assert {k: os.environ.get(k) for k in env_before} == env_before


@pytest.mark.gpu
def test_gpu_an_engine_that_refuses_fails_the_update_instead_of_hanging(
    nccl_world_of_one: Any,
    tiny_model_dir: Path,  # noqa: F811
    engine_factory: Callable[..., Any],  # noqa: F811
) -> None:
    from rollsafe.adapters.engines.sglang import SGLangClient

    eng = engine_factory(tiny_model_dir)  # on CPU: /update_weights_from_ipc answers 400
    client = SGLangClient(eng.url, timeout=60.0)
    tr = CheckpointEngineTransport(socket_timeout_s=60.0, stand_in_timeout_s=10.0)
    try:
        tr.register(_load_dir(tiny_model_dir, "cuda"), 1)
        report = tr.update([EngineTarget("cpu-engine", (0,), client)])
        assert report.failed == ["cpu-engine"]
        assert (
            "400" in report.results["cpu-engine"].reason
            or "CUDA" in report.results["cpu-engine"].reason
        )
        assert tr.registration.failed_targets == [0]
        assert tr.registration.published is not None  # still registered: retry is possible
    finally:
        tr.close()
        client.close()


@pytest.mark.gpu
def test_gpu_p2p_over_tcp_pushes_ranks_in_a_world_of_one(
    nccl_world_of_one: Any,
    tiny_model_dir: Path,  # noqa: F811
    tiny_model_dir_b: Path,  # noqa: F811
    engine_factory: Callable[..., Any],  # noqa: F811
) -> None:
    """P2P without RDMA (Mooncake's TCP transport): needs Mooncake carried (``.mc/env.sh``)."""
    if not mooncake_available():
        pytest.skip("mooncake is not importable here (carry .mc: benchmarks/gpu/README.md)")
    from engine_helpers import sglang_digests

    from rollsafe.adapters.engines.sglang import SGLangClient

    eng = engine_factory(tiny_model_dir, extra_args=["--device", "cuda"])
    client = SGLangClient(eng.url, timeout=120.0)
    before = {k: os.environ.get(k) for k in ("MC_FORCE_TCP", "PS_P2P_STORE_RDMA_DEVICES", "RANK")}
    tr = CheckpointEngineTransport(
        socket_timeout_s=120.0, max_bucket_bytes=1 << 20, p2p_protocol="tcp"
    )
    try:
        assert tr.p2p_available, tr.p2p_reason
        weights_b = _load_dir(tiny_model_dir_b, "cuda")
        tr.register(weights_b, 2)
        report = tr.update([EngineTarget("e0", (0,), client)], p2p=True)
        assert report.ok, report.results
        assert tr.last_plan is not None and tr.last_plan.mode == "p2p"
        assert tr.last_plan.ps_ranks == [0]
        got = client.weights_checksum()
        assert got.tensors == sglang_digests(weights_b, 1, got.algorithm)["tensors"]
    finally:
        tr.close()
        client.close()
    assert {k: os.environ.get(k) for k in before} == before


# ------------------------------------------------------------------------------ GPU harness
def test_gpu_benchmark_smoke_mode_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "smoke.json"
    script = REPO / "benchmarks" / "gpu" / "bench_checkpoint_engine_gpu.py"
    subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(out), "--bucket-gib", "2,0.5"],
        check=True,
        cwd=REPO,
        timeout=300,
        env=repo_env(),
    )
    doc = json.loads(out.read_text())
    assert doc["shapes"] == {
        "tensors": 398,
        "bytes_bf16": 8044936192,
        "largest": "model.embed_tokens.weight",
    }
    smoke = doc["phases"]["smoke"]
    assert smoke["one_layer_tensors"] == 13 and smoke["config_model_type"] == "qwen3"
    assert smoke["bucket_caps_gib"] == [2.0, 0.5] and not doc["errors"]
