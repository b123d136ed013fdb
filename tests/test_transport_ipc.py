"""The ``ipc`` transport against real reference engines (shared memory on CPU, CUDA IPC on GPU).

Two engines serve the whole module (one with 1 rank, one with 2 ranks), both started from
model A; the trainer holds model B and changes it between versions. After every update each
engine's ``/weights_checker`` checksum equals the trainer's and its greedy output equals
``transformers`` greedy on the trainer model. The crash test starts its own engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import (
    EngineProcess,
    engine_factory,  # noqa: F401  (fixture)
    module_engine,
    tiny_model_dir,  # noqa: F401  (fixture)
    tiny_model_dir_b,  # noqa: F401  (fixture)
)
from transport_helpers import KillingClient, Trainer, assert_serves, target, transport_threads

from rollsafe.checksum import weights_checksum
from rollsafe.transports import (
    BucketStream,
    IPCTransport,
    RegisterError,
    StaleRegistration,
    TransportError,
    plan_buckets,
)
from rollsafe.transports.contiguous import flatten_parameters
from rollsafe.transports.pipeline import direct_view
from rollsafe.wire.bucket import deserialize_payload, serialize_bucket

SMALL_BUCKET = 96 << 10  # several buckets for the tiny model (about 0.5 MiB of weights)


@pytest.fixture(scope="module")
def one(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return module_engine(request, tiny_model_dir, ranks=1)


@pytest.fixture(scope="module")
def two(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return module_engine(request, tiny_model_dir, ranks=2)


@pytest.fixture(scope="module")
def trainer(tiny_model_dir_b: Path) -> Trainer:  # noqa: F811
    return Trainer(tiny_model_dir_b)


# ---------------------------------------------------------------------- plan and pipeline
def test_plan_is_dtype_homogeneous_and_bounded() -> None:
    gen = torch.Generator().manual_seed(0)
    items = [
        ("a", torch.randn(100, generator=gen)),
        ("b", torch.randn(10, 10, generator=gen).to(torch.bfloat16)),
        ("c", torch.randn(300, generator=gen)),  # bigger than a bucket: alone
        ("d", torch.randn(20, generator=gen)),
        ("e", torch.randn(5, generator=gen).to(torch.bfloat16)),
    ]
    plans = plan_buckets(items, bucket_bytes=800)
    assert [p.names for p in plans] == [["a"], ["c"], ["b", "e"], ["d"]]
    for p in plans:
        assert len({items[i][1].dtype for i in p.indices}) == 1
        assert p.nbytes <= 800 or len(p.indices) == 1


def test_stream_uses_two_buffers_and_round_trips_non_contiguous() -> None:
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(64, 48, generator=gen)
    items = [(f"w{i}", torch.randn(32, 16, generator=gen)) for i in range(10)]
    items.append(("transposed", base.t()))  # not contiguous: packed by a strided copy
    plans = plan_buckets(items, bucket_bytes=32 * 16 * 4 * 2)
    stream = BucketStream(items, plans, device=torch.device("cpu"), shared=True, consumers=["x"])
    buffers: set[int] = set()
    got: dict[str, torch.Tensor] = {}
    try:
        for i in range(len(stream)):
            bucket = stream.get("x", i, timeout=10)
            buffers.add(bucket.flat.untyped_storage().data_ptr())
            decoded = deserialize_payload(serialize_bucket(bucket))
            assert not isinstance(decoded, list)
            got.update((n, t.clone()) for n, t in decoded.named_views())
            stream.release("x", i)
        stream.leave("x")
    finally:
        stream.close()
    assert len(buffers) <= 2
    assert weights_checksum(got) == weights_checksum(dict(items))


def test_plan_makes_direct_buckets_from_back_to_back_views_only() -> None:
    flat = torch.arange(100, dtype=torch.float32)
    items = [
        ("a", flat[0:10].view(2, 5)),
        ("b", flat[10:40]),
        ("loose", torch.ones(3)),  # a tensor of its own between two runs
        ("c", flat[40:60]),
        ("gap", flat[70:80]),  # not right after "c": the run ends
        ("h", torch.ones(4, dtype=torch.bfloat16)),
    ]
    # packed buckets are capped at 48 bytes; direct runs may be bigger (no copy, no buffer)
    plans = plan_buckets(items, bucket_bytes=48, direct_bucket_bytes=1 << 20)
    assert [p.names for p in plans] == [["a", "b"], ["loose"], ["c"], ["gap"], ["h"]]
    cpu = torch.device("cpu")
    view = direct_view(items, plans[0], device=cpu, shared=False)
    assert view is not None and view.data_ptr() == flat.data_ptr() and view.numel() == 40
    # the same run in CPU shared memory only when the storage is shared
    assert direct_view(items, plans[0], device=cpu, shared=True) is None
    # without a direct cap a run is bounded like any bucket
    assert [p.names for p in plan_buckets(items, bucket_bytes=48)][:2] == [["a"], ["b"]]


def test_flatten_parameters_keeps_values_identity_and_training() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)).double()
    model.register_parameter("f32", torch.nn.Parameter(torch.ones(3)))  # a second dtype
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = list(model.parameters())
    opt = torch.optim.SGD([p for p in params if p.dtype == torch.float64], lr=0.1)
    flats = flatten_parameters(model, shared_memory=True)
    assert {f.dtype: f.numel() for f in flats} == {
        torch.float64: 4 * 8 + 8 + 8 * 2 + 2,
        torch.float32: 3,
    }
    assert all(f.untyped_storage().is_shared() for f in flats)
    assert list(model.parameters()) == params  # the same Parameter objects
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and p.requires_grad
    # back to back in named_parameters() order: one direct bucket per dtype
    plans = plan_buckets(
        list(model.named_parameters()), bucket_bytes=8, direct_bucket_bytes=1 << 20
    )
    assert [len(p.indices) for p in plans] == [1, 4]  # "f32" is registered first
    # a training step writes through the parameters into the flat buffer
    model[0](torch.ones(3, 4, dtype=torch.float64)).sum().backward()
    opt.step()
    w = model[0].weight.detach()
    assert not torch.equal(w, before["0.weight"])
    f64 = next(f for f in flats if f.dtype == torch.float64)
    assert torch.equal(f64[: w.numel()].view(w.shape), w)
    bad = torch.nn.Module()
    bad.w = torch.nn.Parameter(torch.empty(2, device="meta"))
    with pytest.raises(ValueError, match="'w'"):
        flatten_parameters(bad)


# ---------------------------------------------------------------------- real engines
def test_update_one_and_two_rank_engines(
    one: EngineProcess, two: EngineProcess, trainer: Trainer
) -> None:
    tr = IPCTransport(3, bucket_bytes=SMALL_BUCKET)
    tr.register(trainer.weights(), 1)
    assert len(tr.plans) > 2
    report = tr.update([target("one", one, (0,)), target("two", two, (1, 2))])
    assert report.ok, report.results
    assert report.version == 1 and report.results["two"].nbytes > 0
    assert_serves(one, trainer, 1)
    assert_serves(two, trainer, 1)

    # a training step changes the tensors in place: register the next version and push it
    trainer.perturb(seed=2)
    tr.register(trainer.weights(), 2)
    report = tr.update([target("one", one, (0,)), target("two", two, (1, 2))])
    assert report.ok, report.results
    assert_serves(one, trainer, 2)
    assert_serves(two, trainer, 2)
    assert tr.registration.state == "registered" and tr.registration.failed_targets == []
    assert transport_threads() == []


def test_flat_parameters_travel_without_a_copy(
    one: EngineProcess,
    two: EngineProcess,
    tiny_model_dir_b: Path,  # noqa: F811
) -> None:
    flat_trainer = Trainer(tiny_model_dir_b)
    flatten_parameters(flat_trainer.model, shared_memory=True)
    tr = IPCTransport(3, bucket_bytes=SMALL_BUCKET)  # packed buckets would be several
    tr.register(flat_trainer.weights(), 21)
    assert len(tr.plans) == 1 and tr.direct_buckets == 1  # one call, no pack buffer
    report = tr.update([target("one", one, (0,)), target("two", two, (1, 2))])
    assert report.ok, report.results
    assert tr._pool is not None and tr._pool.nbytes == 0  # nothing was packed
    assert_serves(one, flat_trainer, 21)
    assert_serves(two, flat_trainer, 21)
    # a training step writes into the flat buffer; the next version travels the same way
    flat_trainer.perturb(seed=22)
    tr.register(flat_trainer.weights(), 22)
    assert tr.direct_buckets == 1
    assert tr.update([target("one", one, (0,)), target("two", two, (1, 2))]).ok
    assert_serves(one, flat_trainer, 22)
    assert_serves(two, flat_trainer, 22)


@pytest.mark.parametrize("step", ["add_", "fused_adamw"])
def test_weights_changed_in_place_after_register_are_not_pushed(
    one: EngineProcess,
    tiny_model_dir_b: Path,  # noqa: F811
    step: str,
) -> None:
    """An optimizer step between register and update: an in-place ``add_`` bumps the version
    counter; fused AdamW does not (the fingerprint sees it)."""
    model_trainer = Trainer(tiny_model_dir_b)
    tr = IPCTransport(1, bucket_bytes=SMALL_BUCKET)
    tr.register(model_trainer.weights(), 40)  # references to the live parameters
    assert tr.update([target("one", one, (0,))]).ok
    before = one.checksum()
    versions = [t._version for t in model_trainer.weights().values()]
    if step == "add_":
        model_trainer.perturb(seed=41, names=1)  # an optimizer step, before the next register
    else:
        model_trainer.fused_step(seed=41)
        assert [t._version for t in model_trainer.weights().values()] == versions
    changed = next(iter(model_trainer.weights()))
    with pytest.raises(StaleRegistration, match=f"{changed!r} changed in place since v40"):
        tr.update([target("one", one, (0,))])
    assert one.checksum() == before  # nothing was sent
    tr.register(model_trainer.weights(), 41)
    assert tr.update([target("one", one, (0,))]).ok
    assert_serves(one, model_trainer, 41)


def test_failed_register_publishes_nothing_and_update_refuses(
    one: EngineProcess, trainer: Trainer
) -> None:
    before = one.checksum()
    tr = IPCTransport(1)
    weights = trainer.weights()
    weights["model.extra"] = torch.zeros(4, dtype=torch.complex64)  # not carried by the format
    with pytest.raises(RegisterError, match=r"model\.extra"):
        tr.register(weights, 3)
    assert tr.registration.published is None and tr.registration.state == "failed"
    with pytest.raises(TransportError, match="nothing is registered"):
        tr.update([target("one", one, (0,))])
    assert one.checksum() == before


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ("duplicate", "duplicate weight name 'lm_head.weight'"),
        ("not_tensor", "'model.norm.weight' is a list"),
    ],
)
def test_bad_input_is_refused_and_changes_nothing(
    one: EngineProcess, trainer: Trainer, bad: str, needle: str
) -> None:
    tr = IPCTransport(1, bucket_bytes=SMALL_BUCKET)
    tr.register(trainer.weights(), 5)
    published = tr.registration.published
    pairs = list(trainer.weights().items())
    if bad == "duplicate":
        pairs.append(("lm_head.weight", torch.zeros(1)))
    else:
        pairs = [(n, [1.0] if n == "model.norm.weight" else t) for n, t in pairs]  # type: ignore[misc]
    before = one.checksum()
    with pytest.raises(RegisterError) as info:
        tr.register(pairs, 6)
    assert needle in str(info.value)
    assert tr.registration.published == published  # the previous version stays published
    assert one.checksum() == before


def test_engine_killed_mid_update_fails_only_its_target(
    engine_factory,  # noqa: F811
    one: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
    trainer: Trainer,
) -> None:
    doomed = engine_factory(tiny_model_dir, ranks=1)
    trainer.perturb(seed=7)
    tr = IPCTransport(2, bucket_bytes=SMALL_BUCKET)
    tr.register(trainer.weights(), 7)
    killer = KillingClient(target("d", doomed, (1,)).client, doomed, "update_weights_from_tensor")
    report = tr.update([target("one", one, (0,)), target("doomed", doomed, (1,), killer)])
    assert killer.killed.is_set()
    assert report.succeeded == ["one"] and report.failed == ["doomed"]
    reason = report.results["doomed"].reason
    assert "target 'doomed'" in reason and "bucket 2/" in reason
    assert tr.registration.state == "registered"
    assert tr.registration.failed_targets == [1]
    assert_serves(one, trainer, 7)
    assert transport_threads() == []


@pytest.mark.gpu
def test_cuda_ipc_into_cuda_engine(
    engine_factory,  # noqa: F811
    tiny_model_dir: Path,  # noqa: F811
    trainer: Trainer,
) -> None:
    eng = engine_factory(tiny_model_dir, ranks=1, extra_args=["--device", "cuda"])
    weights = {n: t.to("cuda") for n, t in trainer.weights().items()}
    bucket = 64 << 10
    tr = IPCTransport(1, bucket_bytes=bucket)
    tr.register(weights, 11)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    report = tr.update([target("gpu", eng, (0,))])
    assert report.ok, report.results
    assert torch.cuda.max_memory_allocated() - base <= 2 * bucket + (1 << 20)
    got = eng.checksum()
    assert got["model"] == weights_checksum(weights, got["algorithm"])["model"]
    assert got["weight_version"] == "11"


@pytest.mark.gpu
def test_cuda_ipc_flat_parameters_need_no_extra_memory(
    engine_factory,  # noqa: F811
    tiny_model_dir: Path,  # noqa: F811
    tiny_model_dir_b: Path,  # noqa: F811
) -> None:
    eng = engine_factory(tiny_model_dir, ranks=1, extra_args=["--device", "cuda"])
    flat_trainer = Trainer(tiny_model_dir_b)
    flat_trainer.model.to("cuda")
    flatten_parameters(flat_trainer.model)
    weights = flat_trainer.weights()
    tr = IPCTransport(1, bucket_bytes=64 << 10)
    tr.register(weights, 12)
    assert tr.direct_buckets == len(tr.plans) == 1
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    report = tr.update([target("gpu", eng, (0,))])
    assert report.ok, report.results
    assert torch.cuda.max_memory_allocated() - base < (1 << 20)  # no pack buffer
    got = eng.checksum()
    assert got["model"] == weights_checksum(weights, got["algorithm"])["model"]
    assert got["weight_version"] == "12"
