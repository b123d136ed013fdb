"""Delta updates (``rollsafe.wire.delta``, #28) applied by real reference engines.

A delta travels as ordinary named tensors through the unchanged transports (``nccl`` over gloo,
``ipc`` over shared memory): the test registers ``encode_delta(previous, new).tensors`` and
updates. Engines for the module: a 2-rank SGLang-dialect engine and a 1-rank vLLM-dialect one
(model A); the trainer holds model B and takes RL-like steps (a few per cent of the elements of
every tensor, ``lm_head`` included, one tensor changed whole: the dense fallback). Checks: after
a full version and a delta the engine's checksum equals the trainer's and it decodes like it;
a delta onto another base, a tampered value and a half-broken payload are refused with a 400
naming the error and the key or base, the weights and ``weight_version`` unchanged and the
engine serving (the vLLM dialect not poisoned); on 2 ranks one rank's refusal leaves both
unchanged (all or nothing).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import (
    EngineProcess,
    assert_vllm_digests,
    module_engine,
    tiny_model_dir,  # noqa: F401  (fixture)
    tiny_model_dir_b,  # noqa: F401  (fixture)
)
from transport_helpers import PROMPT, Trainer, assert_serves, engine_greedy, target

from rollsafe.adapters.engines import EngineError, SGLangClient, VLLMClient
from rollsafe.policy import engine_traits
from rollsafe.ports import EngineTarget
from rollsafe.transports import IPCTransport, NCCLTransport, plan_buckets
from rollsafe.wire.bucket import serialize_named_tensors
from rollsafe.wire.delta import DELTA_HEADER_KEY, VAL_SUFFIX, DeltaPayload, encode_delta

SMALL_BUCKET = 64 << 10  # several calls per update for the tiny model (about 0.5 MiB)
DELTA_BUCKET = 4 << 10  # a delta of the tiny model (about 25 KB) in many calls
TIMEOUT = 60.0
VERSIONS = itertools.count(10)


@pytest.fixture(scope="module")
def two(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return module_engine(request, tiny_model_dir, ranks=2)


@pytest.fixture(scope="module")
def vllm(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return module_engine(request, tiny_model_dir, ranks=1, extra_args=["--dialect", "vllm"])


@pytest.fixture
def trainer(tiny_model_dir_b: Path) -> Trainer:  # noqa: F811
    return Trainer(tiny_model_dir_b)


def snapshot(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in trainer.weights().items()}


def rl_step(trainer: Trainer, seed: int, frac: float = 0.02) -> str:
    """Change about ``frac`` of the elements of every parameter in place, and one parameter
    (returned) whole: it must travel dense."""
    gen = torch.Generator().manual_seed(seed)
    params = dict(trainer.model.named_parameters())
    dense = sorted(n for n in params if n.endswith("norm.weight"))[0]
    with torch.no_grad():
        for name, p in params.items():
            flat = p.view(-1)
            if name == dense:
                flat.add_(0.01)
                continue
            k = max(1, int(frac * flat.numel()))
            pick = torch.randperm(flat.numel(), generator=gen)[:k]
            flat[pick] += 0.001 * torch.randn(k, generator=gen)
    return dense


def delta_step(trainer: Trainer, base: int, version: int, seed: int) -> DeltaPayload:
    prev = snapshot(trainer)
    dense = rl_step(trainer, seed)
    payload = encode_delta(prev, trainer.weights(), base_version=base, version=version)
    assert payload.worthwhile and payload.nbytes * 5 < payload.full_nbytes
    assert "lm_head.weight" in payload.header.sparse and payload.header.dense == (dense,)
    return payload


def nccl(world_size: int = 3) -> NCCLTransport:
    return NCCLTransport(world_size, bucket_bytes=SMALL_BUCKET, group_timeout=TIMEOUT)


def sglang_state(eng: EngineProcess) -> dict[str, Any]:
    """Every rank's digests and the served version (what a refusal must leave unchanged)."""
    r = eng.post("/weights_checker", {"action": "checksum"})
    r.raise_for_status()
    ranks = [rank["checksums"] for rank in r.json()["ranks"]]
    return {"ranks": ranks, "version": eng.get("/get_server_info").json()["weight_version"]}


def assert_refused(reason: str, kind: str, *names: str) -> None:
    assert f"{kind}: " in reason, reason
    for name in names:
        assert name in reason, reason


def full_push(tr: Any, eng_target: EngineTarget, trainer: Trainer) -> int:
    version = next(VERSIONS)
    tr.register(trainer.weights(), version)
    report = tr.update([eng_target])
    assert report.ok, report.results
    return version


def test_the_reference_engine_declares_it_applies_deltas_and_real_engines_do_not() -> None:
    assert engine_traits("reference", "sglang").applies_deltas
    assert engine_traits("reference", "vllm").applies_deltas
    assert not engine_traits("sglang").applies_deltas
    assert not engine_traits("vllm").applies_deltas
    assert not engine_traits("lmdeploy").applies_deltas


def test_vllm_through_rollsafes_gloo_plugin_applies_deltas_and_vllm_on_gpu_does_not() -> None:
    from rollsafe.policy import VLLM_GLOO_TRAITS
    from rollsafe.vllm_plugin import BACKEND

    cpu = engine_traits("vllm", "vllm", weight_transfer_backend=BACKEND)
    assert cpu is VLLM_GLOO_TRAITS and cpu.applies_deltas and cpu.delta_base_by_content
    assert not cpu.failed_update_keeps_weights and cpu.update_needs_pause
    gpu = engine_traits("vllm", "vllm", weight_transfer_backend="nccl")
    assert not gpu.applies_deltas and not gpu.delta_base_by_content
    for kind in ("reference", "sglang"):  # the backend names a vLLM plugin only
        assert engine_traits(kind, weight_transfer_backend=BACKEND) is engine_traits(kind)


# ---------------------------------------------------------------------- SGLang dialect, tp=2
def test_nccl_full_then_deltas_on_two_ranks(two: EngineProcess, trainer: Trainer) -> None:
    tr = nccl()
    t = target("two", two, (1, 2))
    v1 = full_push(tr, t, trainer)
    assert_serves(two, trainer, v1)
    base = v1
    for seed in (1, 2):  # two deltas in a row: each onto the one before
        v2 = next(VERSIONS)
        payload = delta_step(trainer, base, v2, seed)
        tr.bucket_bytes = DELTA_BUCKET
        tr.register(payload.tensors, v2)
        tr.bucket_bytes = SMALL_BUCKET
        # per-dtype buckets would put the header's mid-stream; it goes first
        natural = plan_buckets(payload.tensors, DELTA_BUCKET)
        assert DELTA_HEADER_KEY not in natural[0].names
        assert tr.plans[0].names == [DELTA_HEADER_KEY] and len(tr.plans) >= 6
        report = tr.update([t])
        assert report.ok, report.results
        assert_serves(two, trainer, v2)
        base = v2


def test_a_delta_onto_another_base_is_refused_and_nothing_changes(
    two: EngineProcess, trainer: Trainer
) -> None:
    tr = nccl()
    t = target("two", two, (1, 2))
    v1 = full_push(tr, t, trainer)
    before = sglang_state(two)
    stale = v1 - 1  # the sender thinks the engine holds an older version
    payload = delta_step(trainer, stale, next(VERSIONS), seed=3)
    tr.register(payload.tensors, int(payload.header.version))
    report = tr.update([t])
    assert report.failed == ["two"]
    reason = report.results["two"].reason
    assert_refused(reason, "DeltaBaseMismatch", f"v{stale}", f"v{v1}")
    assert sglang_state(two) == before  # weights and weight_version
    ids, served = engine_greedy(two)
    assert served == str(v1) and len(ids) > 0  # serving on, at the old version


def test_a_tampered_value_is_refused_by_the_digest_naming_the_key(
    two: EngineProcess, trainer: Trainer
) -> None:
    tr = nccl()
    t = target("two", two, (1, 2))
    v1 = full_push(tr, t, trainer)
    before = sglang_state(two)
    v2 = next(VERSIONS)
    payload = delta_step(trainer, v1, v2, seed=4)
    key = "model.layers.0.mlp.up_proj.weight"
    tensors = [(n, x.clone() + 1 if n == key + VAL_SUFFIX else x) for n, x in payload.tensors]
    tr.register(tensors, v2)
    report = tr.update([t])
    assert report.failed == ["two"]
    assert_refused(report.results["two"].reason, "DeltaDigestMismatch", repr(key))
    assert sglang_state(two) == before
    assert engine_greedy(two)[1] == str(v1)
    # the engine took nothing of the refused delta: the untampered one applies next
    tr.register(payload.tensors, v2)
    assert tr.update([t]).ok
    assert_serves(two, trainer, v2)


def test_a_delta_missing_a_part_is_refused_naming_the_tensor(
    two: EngineProcess, trainer: Trainer
) -> None:
    tr = nccl()
    t = target("two", two, (1, 2))
    v1 = full_push(tr, t, trainer)
    before = sglang_state(two)
    v2 = next(VERSIONS)
    payload = delta_step(trainer, v1, v2, seed=5)
    key = "model.layers.1.self_attn.q_proj.weight"
    tr.register([(n, x) for n, x in payload.tensors if n != key + VAL_SUFFIX], v2)
    report = tr.update([t])
    assert report.failed == ["two"]
    assert_refused(report.results["two"].reason, "DeltaFormatError", key)
    assert sglang_state(two) == before


def test_ipc_full_then_delta_and_one_rank_refusing_leaves_both_unchanged(
    two: EngineProcess, trainer: Trainer
) -> None:
    tr = IPCTransport(3, bucket_bytes=SMALL_BUCKET)
    t = target("two", two, (1, 2))
    v1 = full_push(tr, t, trainer)
    v2 = next(VERSIONS)
    payload = delta_step(trainer, v1, v2, seed=6)
    tr.bucket_bytes = DELTA_BUCKET
    tr.register(payload.tensors, v2)
    assert tr.plans[0].names == [DELTA_HEADER_KEY] and len(tr.plans) >= 6
    report = tr.update([t])
    assert report.ok, report.results
    assert_serves(two, trainer, v2)

    # one call, one entry per rank: rank 1's delta is tampered, rank 0's is sound
    before = sglang_state(two)
    v3 = next(VERSIONS)
    payload = delta_step(trainer, v2, v3, seed=7)
    key = "lm_head.weight"
    bad = [(n, x.clone() - 1 if n == key + VAL_SUFFIX else x) for n, x in payload.tensors]
    client = SGLangClient(two.url)
    entries = [serialize_named_tensors(payload.tensors), serialize_named_tensors(bad)]
    with pytest.raises(EngineError) as err:
        client.update_weights_from_tensor(entries, weight_version=str(v3))
    assert_refused(str(err.value), "DeltaDigestMismatch", repr(key))
    assert sglang_state(two) == before  # neither rank applied its delta
    assert engine_greedy(two)[1] == str(v2)
    good = [serialize_named_tensors(payload.tensors)] * 2
    client.update_weights_from_tensor(good, weight_version=str(v3))
    assert_serves(two, trainer, v3)


def test_delta_parts_before_their_header_are_refused(two: EngineProcess, trainer: Trainer) -> None:
    tr = nccl()
    t = target("two", two, (1, 2))
    v1 = full_push(tr, t, trainer)
    before = sglang_state(two)
    payload = delta_step(trainer, v1, next(VERSIONS), seed=8)
    client = SGLangClient(two.url)
    headless = [(n, x) for n, x in payload.tensors[1:] if n.endswith(VAL_SUFFIX)][:1]
    with pytest.raises(EngineError) as err:
        client.update_weights_from_tensor([serialize_named_tensors(headless)] * 2)
    assert_refused(str(err.value), "DeltaFormatError", "header")
    assert sglang_state(two) == before


# ---------------------------------------------------------------------- vLLM dialect
def vllm_target(eng: EngineProcess) -> EngineTarget:
    return EngineTarget("v", (1,), VLLMClient(eng.url), tp_size=1)


def assert_serves_vllm(eng: EngineProcess, trainer: Trainer, version: int) -> None:
    got = eng.checksum()
    assert_vllm_digests(got, trainer.weights())  # linear weights: the greedy check below
    assert eng.get("/weight_info").json() == {"weight_version": str(version)}
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    r = eng.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == trainer.greedy(PROMPT, 8)


def test_vllm_dialect_applies_deltas_and_a_refusal_does_not_poison(
    vllm: EngineProcess, trainer: Trainer
) -> None:
    tr = nccl(2)
    t = vllm_target(vllm)
    v1 = full_push(tr, t, trainer)
    assert_serves_vllm(vllm, trainer, v1)
    v2 = next(VERSIONS)
    payload = delta_step(trainer, v1, v2, seed=9)
    tr.bucket_bytes = DELTA_BUCKET
    tr.register(payload.tensors, v2)
    assert tr.plans[0].names == [DELTA_HEADER_KEY] and len(tr.plans) >= 6
    report = tr.update([t])
    assert report.ok, report.results
    assert_serves_vllm(vllm, trainer, v2)

    # onto the wrong base: refused at /finish_weight_update, the engine not poisoned
    before = vllm.checksum()
    payload = delta_step(trainer, v1, next(VERSIONS), seed=10)
    tr.register(payload.tensors, int(payload.header.version))
    report = tr.update([t])
    assert report.failed == ["v"]
    assert_refused(report.results["v"].reason, "DeltaBaseMismatch", f"v{v1}", f"v{v2}")
    assert vllm.checksum() == before
    assert vllm.get("/weight_info").json() == {"weight_version": str(v2)}
    assert vllm.healthy()
    r = vllm.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text  # a poisoned vLLM engine would die on this forward
    assert vllm.healthy()

    # a part announced with the wrong dtype: refused by /update_weights, before it is received
    payload = delta_step(trainer, v2, next(VERSIONS), seed=11)
    key = "model.norm.weight" if "model.norm.weight" in payload.header.sparse else None
    key = key or payload.header.sparse[-1]
    odd = [(n, x.double() if n == key + VAL_SUFFIX else x) for n, x in payload.tensors]
    tr.register(odd, int(payload.header.version))
    report = tr.update([t])
    assert report.failed == ["v"]
    assert_refused(report.results["v"].reason, "DeltaFormatError", key)
    assert vllm.checksum() == before
    assert vllm.get("/weight_info").json() == {"weight_version": str(v2)}
    r = vllm.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert vllm.healthy()
