"""The ``nccl`` transport (gloo on CPU) against real reference engines.

Two engines serve the whole module (1 rank and 2 ranks, from model A); the trainer holds model
B. Checks: both engines updated (checksum and greedy output equal the trainer's); a subset
re-sync updates only the named engine; an engine SIGKILLed during a broadcast fails only its
own target (groups are per target) with every thread finishing; an engine that refuses a bucket
is reported at once, not after the group timeout; a failed register publishes nothing; only
the call that carries the version waits for the engine's copies.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
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
    wait_for,
)
from transport_helpers import KillingClient, Trainer, assert_serves, target, transport_threads

from rollsafe.adapters.engines import SGLangClient
from rollsafe.transports import NCCLTransport, NonFiniteWeights, RegisterError, TransportError
from rollsafe.transports.contiguous import flatten_parameters

SMALL_BUCKET = 96 << 10
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def one(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return module_engine(request, tiny_model_dir, ranks=1)


@pytest.fixture(scope="module")
def two(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return module_engine(request, tiny_model_dir, ranks=2)


@pytest.fixture(scope="module")
def trainer(tiny_model_dir_b: Path) -> Trainer:  # noqa: F811
    return Trainer(tiny_model_dir_b)


def transport(world_size: int = 3) -> NCCLTransport:
    return NCCLTransport(world_size, bucket_bytes=SMALL_BUCKET, group_timeout=TIMEOUT)


def no_groups_left(eng: EngineProcess) -> bool:
    """The engine kept no weight-update group (a destroy of a made-up name says so)."""
    r = eng.post("/destroy_weights_update_group", {"group_name": "rollsafe-probe"})
    return r.status_code == 400 and "no weight update group" in r.text


def test_update_one_and_two_rank_engines_then_subset(
    one: EngineProcess, two: EngineProcess, trainer: Trainer
) -> None:
    tr = transport()
    assert tr.resolved_backend() == "gloo"
    tr.register(trainer.weights(), 1)
    report = tr.update([target("one", one, (0,)), target("two", two, (1, 2))])
    assert report.ok, report.results
    assert_serves(one, trainer, 1)
    assert_serves(two, trainer, 1)

    # subset re-sync: only "two" gets version 2; "one" keeps version 1 untouched
    one_before = one.checksum()
    trainer.perturb(seed=3)
    tr.register(trainer.weights(), 2)
    report = tr.update([target("two", two, (1, 2))])
    assert report.ok and list(report.results) == ["two"], report.results
    assert_serves(two, trainer, 2)
    assert one.checksum() == one_before
    assert tr.registration.failed_targets == []
    assert transport_threads() == []


def test_engine_killed_during_broadcast_fails_only_its_target(
    engine_factory,  # noqa: F811
    one: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
    trainer: Trainer,
) -> None:
    doomed = engine_factory(tiny_model_dir, ranks=1)
    trainer.perturb(seed=5)
    tr = transport(2)
    tr.register(trainer.weights(), 5)
    assert len(tr.plans) >= 3
    # SIGKILL as bucket 2's call starts, while the trainer broadcasts it (no delay: with kept
    # groups a tiny update can finish within any delay, and the kill would land after it)
    killer = KillingClient(
        target("d", doomed, (1,)).client,
        doomed,
        "update_weights_from_distributed",
        n=2,
    )
    t0 = time.monotonic()
    report = tr.update([target("one", one, (0,)), target("doomed", doomed, (1,), killer)])
    elapsed = time.monotonic() - t0
    assert killer.killed.is_set()
    assert report.succeeded == ["one"] and report.failed == ["doomed"], report.results
    reason = report.results["doomed"].reason
    assert "target 'doomed'" in reason and "bucket" in reason
    assert elapsed < TIMEOUT / 2  # a dead peer is detected, not waited out
    assert tr.registration.state == "registered" and tr.registration.failed_targets == [1]
    assert_serves(one, trainer, 5)
    assert list(tr.kept_groups) == ["one"]  # the failed target's group was torn down
    tr.close_groups([target("one", one, (0,))])
    assert no_groups_left(one) and tr.kept_groups == {}
    assert wait_for(lambda: transport_threads() == [], 10)


def test_big_tensors_travel_unpacked_and_flat_buffers_as_slices(
    one: EngineProcess,
    two: EngineProcess,
    tiny_model_dir_b: Path,  # noqa: F811
) -> None:
    trainer = Trainer(tiny_model_dir_b)
    trainer.perturb(seed=11)
    # tensors of >= 16 KiB go one broadcast each (no packing copy); the rest is packed
    tr = NCCLTransport(
        3, bucket_bytes=SMALL_BUCKET, group_timeout=TIMEOUT, unpacked_min_bytes=16 << 10
    )
    weights = trainer.weights()
    tr.register(weights, 11)
    unpacked = [p for p in tr.plans if p.unpacked]
    packed = [p for p in tr.plans if not p.unpacked]
    assert unpacked and packed
    assert all(
        weights[n].numel() * weights[n].element_size() >= 16 << 10
        for p in unpacked
        for n in p.names
    )
    assert sorted(n for p in tr.plans for n in p.names) == sorted(weights)
    report = tr.update([target("one", one, (0,)), target("two", two, (1, 2))])
    assert report.ok, report.results
    assert_serves(one, trainer, 11)
    assert_serves(two, trainer, 11)

    # the same weights back to back in one buffer: direct slices, nothing packed or unpacked
    flatten_parameters(trainer.model)
    trainer.perturb(seed=12)
    tr.register(trainer.weights(), 12)
    assert not any(p.unpacked for p in tr.plans)
    assert tr._direct and all(d is not None for d in tr._direct)
    assert tr.update([target("one", one, (0,)), target("two", two, (1, 2))]).ok
    assert_serves(one, trainer, 12)
    assert_serves(two, trainer, 12)
    tr.close_groups([target("one", one, (0,)), target("two", two, (1, 2))])
    assert no_groups_left(one) and no_groups_left(two) and transport_threads() == []


def test_engine_killed_during_unpacked_broadcasts_fails_only_its_target(
    engine_factory,  # noqa: F811
    one: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
    tiny_model_dir_b: Path,  # noqa: F811
) -> None:
    trainer = Trainer(tiny_model_dir_b)
    trainer.perturb(seed=13)
    doomed = engine_factory(tiny_model_dir, ranks=1)
    tr = NCCLTransport(
        2, bucket_bytes=SMALL_BUCKET, group_timeout=TIMEOUT, unpacked_min_bytes=16 << 10
    )
    tr.register(trainer.weights(), 13)
    first_unpacked = next(i for i, p in enumerate(tr.plans) if p.unpacked)
    assert any(p.unpacked for p in tr.plans[first_unpacked + 1 :])  # more follow
    killer = KillingClient(  # killed as the first call of unpacked broadcasts starts
        target("d", doomed, (1,)).client,
        doomed,
        "update_weights_from_distributed",
        n=first_unpacked + 1,
    )
    t0 = time.monotonic()
    report = tr.update([target("one", one, (0,)), target("doomed", doomed, (1,), killer)])
    assert killer.killed.is_set()
    assert report.succeeded == ["one"] and report.failed == ["doomed"], report.results
    assert time.monotonic() - t0 < TIMEOUT / 2
    assert_serves(one, trainer, 13)
    assert wait_for(lambda: transport_threads() == [], 10)


def test_groups_are_kept_between_updates_and_re_formed_when_lost(
    one: EngineProcess, trainer: Trainer
) -> None:
    tr = transport(1)
    tr.register(trainer.weights(), 30)
    assert tr.update([target("one", one, (0,))]).ok
    kept = tr.kept_groups["one"]
    trainer.perturb(seed=31)
    tr.register(trainer.weights(), 31)
    assert tr.update([target("one", one, (0,))]).ok
    assert tr.kept_groups == {"one": kept}  # the same group served the second update
    assert_serves(one, trainer, 31)
    # the engine lost the group (as after a restart on the same address): the first bucket is
    # refused, nothing was applied, and the transport re-forms the group once, transparently
    r = one.post("/destroy_weights_update_group", {"group_name": kept})
    assert r.status_code == 200, r.text
    trainer.perturb(seed=32)
    tr.register(trainer.weights(), 32)
    report = tr.update([target("one", one, (0,))])
    assert report.ok, report.results
    assert tr.kept_groups["one"] != kept
    assert_serves(one, trainer, 32)
    tr.close_groups([target("one", one, (0,))])
    assert no_groups_left(one)
    tr.close()
    assert wait_for(lambda: transport_threads() == [], 30)


def test_per_update_groups_when_not_kept(one: EngineProcess, trainer: Trainer) -> None:
    tr = NCCLTransport(1, bucket_bytes=SMALL_BUCKET, group_timeout=TIMEOUT, keep_groups=False)
    trainer.perturb(seed=33)
    tr.register(trainer.weights(), 33)
    assert tr.update([target("one", one, (0,))]).ok
    assert tr.kept_groups == {} and no_groups_left(one)
    assert_serves(one, trainer, 33)


def test_a_target_whose_group_cannot_form_does_not_hold_up_the_others(
    engine_factory,  # noqa: F811
    one: EngineProcess,
    tiny_model_dir: Path,  # noqa: F811
    trainer: Trainer,
) -> None:
    dead = engine_factory(tiny_model_dir, ranks=1)
    os.killpg(dead.proc.pid, signal.SIGKILL)
    dead.proc.wait(10)
    trainer.perturb(seed=14)
    # a short group timeout: the trainer's join of the dead target's group gives up soon
    tr = NCCLTransport(2, bucket_bytes=SMALL_BUCKET, group_timeout=5.0)
    tr.register(trainer.weights(), 14)
    assert len(tr.plans) > 2  # more buckets than pack buffers: a stuck consumer would block
    report = tr.update([target("one", one, (0,)), target("dead", dead, (1,))])
    # were "one" held up by the dead target's consumer slot, its buckets would not be packed
    # within the group timeout and it would fail too
    assert report.succeeded == ["one"] and report.failed == ["dead"], report.results
    assert "weight-update group" in report.results["dead"].reason
    assert_serves(one, trainer, 14)
    # the trainer's abandoned join of the dead target's group ends at its group_timeout
    assert wait_for(lambda: transport_threads() == [], 20)


class _InitRecorder:
    """Forwards to ``client``; records each ``init_weights_update_group`` call. ``hold``: the
    call waits on it (up to 30 s) and then fails, never reaching the engine."""

    def __init__(self, client: Any, hold: threading.Event | None = None) -> None:
        self._client = client
        self._hold = hold
        self.inits: list[tuple[Any, ...]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def init_weights_update_group(self, *args: Any, **kwargs: Any) -> Any:
        self.inits.append(args)
        if self._hold is not None:
            self._hold.wait(30)
            raise RuntimeError("held init released")
        return self._client.init_weights_update_group(*args, **kwargs)


def test_a_store_port_already_taken_fails_the_target_before_its_engine_is_told(
    one: EngineProcess, trainer: Trainer
) -> None:
    """The trainer's store listens before the engine hears its port: a port another process
    holds is named at once and the engine is never sent it (under load a port picked free was
    taken before the store bound it, and the join failed with an empty message)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        tr = NCCLTransport(1, bucket_bytes=SMALL_BUCKET, group_timeout=TIMEOUT, master_port=port)
        trainer.perturb(seed=41)
        tr.register(trainer.weights(), 41)
        recorder = _InitRecorder(SGLangClient(one.url))
        report = tr.update([target("one", None, (0,), client=recorder)])
    assert report.failed == ["one"], report.results
    reason = report.results["one"].reason
    assert f"could not listen on 127.0.0.1:{port}" in reason and "EADDRINUSE" in reason, reason
    assert recorder.inits == [] and no_groups_left(one) and one.healthy()
    # with the system's choice of port the same engine takes the version
    tr = transport(1)
    tr.register(trainer.weights(), 42)
    assert tr.update([target("one", one, (0,))]).ok
    assert_serves(one, trainer, 42)


def test_the_trainers_join_failing_while_the_engine_joins_is_named(
    one: EngineProcess, trainer: Trainer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer's side of the group fails while the engine's init call still runs: the
    failure names the trainer's error (the engine's pending call no longer hides it)."""
    import rollsafe.transports.nccl as nccl_module

    def broken_join(**kwargs: Any) -> Any:
        raise RuntimeError(f"trainer side refused on port {kwargs['master_port']}")

    monkeypatch.setattr(nccl_module, "open_weight_update_group", broken_join)
    hold = threading.Event()
    recorder = _InitRecorder(SGLangClient(one.url), hold)
    tr = transport(1)
    tr.register(trainer.weights(), 43)
    try:
        report = tr.update([target("one", None, (0,), client=recorder)])
    finally:
        hold.set()
    assert report.failed == ["one"], report.results
    reason = report.results["one"].reason
    assert "failed: RuntimeError: trainer side refused on port" in reason, reason
    assert len(recorder.inits) == 1 and one.healthy()


def test_refused_bucket_is_reported_at_once(one: EngineProcess, trainer: Trainer) -> None:
    weights = trainer.weights()
    weights["model.not_in_engine"] = torch.zeros(8)  # the engine refuses the bucket holding it
    tr = transport(1)
    tr.register(weights, 8)
    t0 = time.monotonic()
    report = tr.update([target("one", one, (0,))])
    assert time.monotonic() - t0 < TIMEOUT / 2
    assert report.failed == ["one"]
    assert "model.not_in_engine" in report.results["one"].reason
    assert one.healthy() and no_groups_left(one)
    # the engine still takes a correct update afterwards
    tr.register(trainer.weights(), 9)
    assert tr.update([target("one", one, (0,))]).ok
    assert_serves(one, trainer, 9)


def test_failed_register_publishes_nothing_and_update_refuses(
    one: EngineProcess, trainer: Trainer
) -> None:
    before = one.checksum()
    tr = NCCLTransport(1, backend="nccl")  # nccl needs CUDA buckets; these are CPU tensors
    with pytest.raises(RegisterError, match="nccl"):
        tr.register(trainer.weights(), 10)
    assert tr.registration.published is None
    with pytest.raises(TransportError, match="nothing is registered"):
        tr.update([target("one", one, (0,))])
    with pytest.raises(RegisterError, match=r"duplicate weight name 'lm_head\.weight'"):
        tr.register([*trainer.weights().items(), ("lm_head.weight", torch.zeros(1))], 10)
    assert tr.registration.published is None
    assert one.checksum() == before


def test_non_finite_version_is_refused_at_register_naming_the_weight(
    one: EngineProcess, trainer: Trainer
) -> None:
    """A version holding NaN or inf is refused before anything moves (the real vLLM would load
    it: found by the soak's poisoned update); ``check_finite=False`` leaves it to the engines."""
    tr = NCCLTransport(1, bucket_bytes=SMALL_BUCKET, group_timeout=TIMEOUT)
    good = {n: t.clone() for n, t in trainer.weights().items()}
    tr.register(good, 40)
    assert tr.update([target("one", one, (0,))]).ok
    before = one.checksum()
    for value in (float("nan"), float("inf")):
        bad = {n: t.clone() for n, t in good.items()}
        bad["model.norm.weight"].view(-1)[3] = value
        with pytest.raises(NonFiniteWeights) as info:
            tr.register(bad, 41)
        assert info.value.key == "model.norm.weight" and "v41" in str(info.value)
        assert tr.registration.published is None and tr.registration.state == "failed"
        with pytest.raises(TransportError, match="nothing is registered"):
            tr.update([target("one", one, (0,))])
        assert one.checksum() == before  # nothing of v41 reached the engine
    unchecked = NCCLTransport(1, bucket_bytes=SMALL_BUCKET, check_finite=False)
    unchecked.register(bad, 42)  # registered: the engine's own check is what is left
    assert unchecked.registration.state == "registered"
    tr.close()
    unchecked.close()


@pytest.mark.gpu
def test_nccl_trainer_and_engine_processes_on_gpus(
    engine_factory,  # noqa: F811
    tiny_model_dir: Path,  # noqa: F811
    trainer: Trainer,
) -> None:
    """NCCL refuses two ranks of one communicator on the same GPU ("Duplicate GPU detected"),
    so the engine runs on GPU 1 when there is one; with a single GPU the same transport runs over
    gloo with CUDA tensors on both sides."""
    gpus = torch.cuda.device_count()
    env = {"CUDA_VISIBLE_DEVICES": "1"} if gpus > 1 else None
    eng = engine_factory(tiny_model_dir, ranks=1, extra_args=["--device", "cuda"], env=env)
    weights = {n: t.to("cuda:0") for n, t in trainer.weights().items()}
    tr = NCCLTransport(1, backend="nccl" if gpus > 1 else "gloo", bucket_bytes=SMALL_BUCKET)
    tr.register(weights, 12)
    report = tr.update([target("gpu", eng, (0,))])
    assert report.ok, report.results
    got = eng.checksum()
    assert got["model"] == sglang_digests(weights, 1, got["algorithm"])["model"]
    assert got["weight_version"] == "12"


def test_only_the_versioned_call_of_an_update_waits_for_its_copies(
    engine_factory: Any,  # noqa: F811
    tiny_model_dir: Path,  # noqa: F811
    trainer: Trainer,
) -> None:
    """The engine answers a bucket that carries no version once its copies are queued (the next
    bucket's receive overlaps them on a GPU); the last bucket, with the version, waits for its
    copies. The engine's profile lines show which commits waited."""
    eng = engine_factory(tiny_model_dir, env={"ROLLSAFE_ENGINE_PROFILE": "1"})
    tr = transport(1)
    tr.register(trainer.weights(), 1)
    calls = len(tr.plans)
    assert calls >= 3
    start = len(eng.stderr())  # the start-up load's commit printed its lines before this
    report = tr.update([target("p", eng, (0,))])
    assert report.ok, report.results
    assert_serves(eng, trainer, 1)

    def count(op: str) -> int:
        return sum(1 for line in eng.stderr()[start:].splitlines() if f"op={op} " in line)

    assert count("stage_distributed") == calls and count("commit.copy_launch") == calls
    assert count("commit.sync") == 1  # only the call with the version
    tr.close_groups([target("p", eng, (0,))])
    tr.close()
