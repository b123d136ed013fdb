"""The ``ipc`` transport against real reference engines (shared memory on CPU, CUDA IPC on GPU).

Two engines serve the whole module (one with 1 rank, one with 2 ranks), both started from
model A; the trainer holds model B and changes it between versions. After every update each
engine's ``/weights_checker`` checksum equals the trainer's and its greedy output equals
``transformers`` greedy on the trainer model. The crash test starts its own engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import (
    EngineProcess,
    engine_factory,  # noqa: F401  (fixture)
    module_engine,
    sglang_digests,
    tiny_model_dir,  # noqa: F401  (fixture)
    tiny_model_dir_b,  # noqa: F401  (fixture)
)
from transport_helpers import KillingClient, Trainer, assert_serves, target, transport_threads

from rollsafe.adapters.engines import SGLangClient
from rollsafe.checksum import weights_checksum
from rollsafe.transports import (
    BucketStream,
    IPCTransport,
    NonFiniteWeights,
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


# ---------------------------------------------------------------------- the finite check
class RecordingClient:
    """Forwards to ``client``; records the ``finite_checked`` flag of every tensor update."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.flags: list[bool] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def update_weights_from_tensor(self, *args: Any, **kwargs: Any) -> Any:
        self.flags.append(bool(kwargs.get("finite_checked", False)))
        return self._client.update_weights_from_tensor(*args, **kwargs)


def _own_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    """A private copy of the trainer's weights (the test writes into it)."""
    return {n: t.clone() for n, t in trainer.weights().items()}


def _poison(t: torch.Tensor, at: int, value: float = float("nan")) -> None:
    t.view(-1)[at] = value  # bumps the tensor's version counter


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many tensors each finite check of the ipc transport read (one entry per pass)."""
    import rollsafe.transports.ipc as ipc_module

    seen: list[int] = []
    real = ipc_module.non_finite_index

    def counted(tensors: Any) -> Any:
        seen.append(len(tensors))
        return real(tensors)

    monkeypatch.setattr(ipc_module, "non_finite_index", counted)
    return seen


def test_non_finite_version_is_refused_at_register_naming_the_weight(
    one: EngineProcess, trainer: Trainer, checks: list[int]
) -> None:
    tr = IPCTransport(1, bucket_bytes=SMALL_BUCKET)
    good = _own_weights(trainer)
    tr.register(good, 30)
    assert checks == [len(good)]  # one pass over the version at register
    client = RecordingClient(SGLangClient(one.url))
    assert tr.update([target("one", one, (0,), client)]).ok
    assert checks == [len(good)]  # the first update used that verdict: no second pass
    assert client.flags and all(client.flags)  # every call told the engine
    before = one.checksum()
    assert before["weight_version"] == "30"
    for value in (float("nan"), float("inf"), float("-inf")):
        bad = _own_weights(trainer)
        _poison(bad["model.norm.weight"], 3, value)
        with pytest.raises(NonFiniteWeights) as info:
            tr.register(bad, 31)
        assert info.value.key == "model.norm.weight"
        assert "'model.norm.weight' of v31 holds non-finite values" in str(info.value)
        assert isinstance(info.value, RegisterError)
        assert tr.registration.published is None and tr.registration.state == "failed"
        with pytest.raises(TransportError, match="nothing is registered"):
            tr.update([target("one", one, (0,))])
        assert one.checksum() == before  # nothing of v31 reached the engine


def test_cached_finite_verdict_never_lets_a_changed_buffer_through(
    one: EngineProcess, trainer: Trainer, checks: list[int]
) -> None:
    """The verdict is per registration (version id + storage identity); every register checks,
    only the first update of a registration reuses it, a re-push checks again."""
    tr = IPCTransport(1, bucket_bytes=SMALL_BUCKET)
    w = _own_weights(trainer)
    name = "model.layers.0.mlp.down_proj.weight"
    n = len(w)
    tr.register(w, 50)
    assert tr.update([target("one", one, (0,))]).ok
    assert checks == [n]
    good = one.checksum()

    # 1. a tracked in-place write after register: refused as stale, nothing sent
    _poison(w[name], 0)
    with pytest.raises(StaleRegistration, match=repr(name)):
        tr.update([target("one", one, (0,))])
    # 2. the same version id over the same storage again: checked again, never a cache hit
    with pytest.raises(NonFiniteWeights) as info:
        tr.register(w, 50)
    assert info.value.key == name and checks == [n, n]
    assert one.checksum() == good

    # 3. a write the staleness check cannot see (through .data, at an unsampled element)
    w[name].view(-1)[0] = 0.0
    tr.register(w, 51)
    assert tr.update([target("one", one, (0,))]).ok  # the first update: the register verdict
    assert checks == [n, n, n]
    v51 = one.checksum()
    assert v51["weight_version"] == "51"
    w[name].data.view(-1)[1] = float("nan")  # no version bump; element 1 is not fingerprinted
    client = RecordingClient(SGLangClient(one.url))
    with pytest.raises(NonFiniteWeights, match=repr(name)):
        tr.update([target("one", one, (0,), client)])  # a re-push of v51 checks again
    assert checks == [n, n, n, n] and client.flags == []  # refused before any engine call
    assert one.checksum() == v51  # the engine still holds the finite v51
    assert tr.registration.state == "registered"  # v51 stays published; nothing was begun

    # 4. fixed in place the same way: the re-push checks again and goes through, told
    w[name].data.view(-1)[1] = 0.0
    assert tr.update([target("one", one, (0,), client)]).ok
    assert checks == [n, n, n, n, n] and client.flags and all(client.flags)


def test_without_the_sender_check_the_engine_refuses_all_or_nothing(
    one: EngineProcess, trainer: Trainer, checks: list[int]
) -> None:
    tr = IPCTransport(1, check_finite=False)  # one call: the engine refuses it whole
    good = _own_weights(trainer)
    tr.register(good, 60)
    client = RecordingClient(SGLangClient(one.url))
    assert tr.update([target("one", one, (0,), client)]).ok
    assert checks == [] and client.flags and not any(client.flags)  # the engine checks itself
    before = one.checksum()
    bad = _own_weights(trainer)
    _poison(bad["lm_head.weight"], 5, float("inf"))
    tr.register(bad, 61)  # not checked here
    report = tr.update([target("one", one, (0,))])
    assert report.failed == ["one"]
    reason = report.results["one"].reason
    assert "'lm_head.weight'" in reason and "non-finite" in reason
    assert one.checksum() == before  # the engine refused the call and kept v60


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
    assert got["model"] == sglang_digests(weights, 1, got["algorithm"])["model"]
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
    assert got["model"] == sglang_digests(weights, 1, got["algorithm"])["model"]
    assert got["weight_version"] == "12"
