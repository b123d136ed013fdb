"""The start checkpoint: ``model_path`` is the ready export of ``initial_version`` (issue #36).

Unit part: :meth:`HFExporter.adopt_start` verifies the directory once (config, index or single
file, headers, keys; a manifest when there is one, its version included), records it as an
adopted, leasable export, and retention supersedes and deletes it as any export but never
removes the directory; a non-HF ``model_path`` fails the fleet's start with a named error
naming the path; the ``moved`` mode publishes a directory without a manifest and the node's
copy loads.

Fleet part (real reference engines): a group SIGKILLed before the first sync comes back
``active`` at ``initial_version`` through the immediate strategy, its restart loading
``model_path`` under a lease; later syncs retire the start export without touching the
directory; the same with a resume-like ``initial_version=5``; each run replays through the
verifier's model (``rollsafe verify --trace``) with no divergence.
Waits are bounded by deadlines; nothing asserts a duration.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from chaos_support import WAIT_S, assert_fleet_sound, chaos_fleet, wait_for, wait_recovery
from engine_helpers import (
    tiny_model_dir,  # noqa: F401  (fixture)
    tiny_model_dir_b,  # noqa: F401  (fixture)
)
from test_ray_moved_unit import Handle, Store
from transport_helpers import Trainer

import rollsafe.policy as policy
from rollsafe.adapters.ray.exports import ExportMover, publish_export
from rollsafe.errors import InvalidArgument
from rollsafe.fleet import FleetConfig, FleetConfigError, GroupSpec, RolloutFleet
from rollsafe.hf import ExportExists, ExportVerificationError, HFExporter, verify_hf_dir
from rollsafe.hf.layout import MANIFEST_NAME
from rollsafe.observe.runfile import load_run
from rollsafe.statemachines import LeaseError
from rollsafe.verify.replay import replay_run


def digests(directory: Path) -> dict[str, str]:
    """Every file of ``directory`` (recursively) by relative name -> its SHA-256."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8, 8, generator=gen), "b": torch.randn(8, generator=gen)}


# ====================================================================== the exporter
def test_the_start_checkpoint_is_a_ready_leasable_export_verified_once(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    exporter = HFExporter(tmp_path / "exports")
    record = exporter.adopt_start(tiny_model_dir, 0)
    assert record.state == "ready" and record.start and record.adopted
    assert record.path == tiny_model_dir and record.verified is not None
    assert "lm_head.weight" in record.verified.keys
    assert exporter.latest_ready(0) is record
    lease = exporter.lease(0, holder="recovery:g0")  # re-verified (file identities) first
    assert record.lifecycle.leases == (lease,)
    exporter.release(lease)
    with pytest.raises(ExportExists):
        exporter.adopt_start(tiny_model_dir, 0)
    # the policy picks the immediate strategy from it, before any sync
    facts = policy.ExportFacts(record.version, record.state)
    choice = policy.choose_strategy(
        mode_state="enabled", fleet_version=0, export=facts, can_push=False
    )
    assert choice.strategy is policy.Strategy.IMMEDIATE and choice.export_version == 0


def test_retention_retires_the_start_export_like_any_but_never_removes_the_directory(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    before = digests(model)
    exporter = HFExporter(tmp_path / "exports", template_dir=model, keep_last=1)
    start = exporter.adopt_start(model, 0)
    held = exporter.lease(0, holder="recovery:g0")
    exporter.start(tensors(1), 1).wait(WAIT_S)
    # a newer export is ready: the start export is superseded, and kept while leased
    assert start.state == "superseded" and [r.version for r in exporter.exports()] == [0, 1]
    with pytest.raises(LeaseError):
        exporter.lease(0)  # no new lease on a superseded export
    exporter.release(held)  # retention runs: deleted now, i.e. un-listed
    assert start.state == "deleted" and [r.version for r in exporter.exports()] == [1]
    assert exporter.latest_ready(0) is None
    exporter.start(tensors(2), 2).wait(WAIT_S)
    assert not (tmp_path / "exports" / "hf-v1").exists()  # a written export is removed
    assert digests(model) == before  # the user's directory: every file still there, unchanged
    verify_hf_dir(model)


def test_a_directory_that_is_not_an_hf_checkpoint_is_refused_naming_each_problem(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    exporter = HFExporter(tmp_path / "exports")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    with pytest.raises(ExportVerificationError) as info:
        exporter.adopt_start(bare, 0)
    assert any("model.safetensors" in p for p in info.value.problems), info.value.problems
    no_config = shutil.copytree(tiny_model_dir, tmp_path / "no-config")
    (no_config / "config.json").unlink()
    with pytest.raises(ExportVerificationError) as info:
        exporter.adopt_start(no_config, 0)
    assert any("config.json is missing" in p for p in info.value.problems)
    assert exporter.exports() == []  # nothing adopted


def test_a_resumed_export_is_checked_against_its_manifest_and_version(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    exporter = HFExporter(tmp_path / "exports", template_dir=tiny_model_dir)
    path = exporter.start(tensors(5), 5).wait(WAIT_S)  # a previous run's export of v5
    other = HFExporter(tmp_path / "resume")
    with pytest.raises(ExportVerificationError) as info:
        other.adopt_start(path, 3)
    assert "field 'version' is 5" in str(info.value) and "initial_version 3" in str(info.value)
    record = other.adopt_start(path, 5)
    assert record.state == "ready" and record.verified is not None
    assert record.verified.checksums_verified  # every file's SHA-256 against the manifest


def test_a_fleet_whose_model_path_is_not_loadable_fails_its_start_naming_the_path(
    tmp_path: Path,
) -> None:
    model = tmp_path / "not-a-checkpoint"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    fleet = RolloutFleet(
        FleetConfig(model_path=model, export_root=tmp_path / "exports", groups=[GroupSpec(1)])
    )
    with pytest.raises(FleetConfigError) as info:
        fleet.start()
    assert info.value.key == "model_path"
    assert str(model) in str(info.value) and "not a loadable HF checkpoint" in str(info.value)
    assert not fleet.started and fleet.engines.ids == ["g0"]


def test_the_moved_mode_publishes_a_start_checkpoint_without_a_manifest(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    assert not (model / MANIFEST_NAME).exists()
    store = Store()
    with pytest.raises(InvalidArgument, match="version"):
        publish_export(model, put=store.put)  # a regular save needs the export's version
    parcel = publish_export(model, chunk_bytes=1 << 16, put=store.put, version=0)
    assert set(parcel.files) == {p.name for p in model.iterdir() if p.is_file()}
    mover = ExportMover(
        lambda g: Handle(store, "node-b"),
        dest_root=str(tmp_path / "nodes"),
        fleet="f",
        publish=lambda p: publish_export(p, chunk_bytes=1 << 16, put=store.put, version=0),
    )
    copy = mover.pull("g0", 0, str(model))
    assert not copy.reused and copy.nbytes == sum(s for s, _ in parcel.files.values())
    moved = Path(copy.path)
    assert moved != model and moved.parent == tmp_path / "nodes" / "f" / "node-b"
    verify_hf_dir(moved)  # the node's copy is a loadable checkpoint, checked on arrival
    manifest = json.loads((moved / MANIFEST_NAME).read_text())
    assert manifest["version"] == 0 and "lm_head.weight" in manifest["keys"]
    listed = manifest["files"]
    got = digests(model)
    assert {n: v["sha256"] for n, v in listed.items()} == {n: got[n] for n in listed}
    assert mover.pull("g1", 0, str(model)).reused  # one publication, a checked copy reused


# ====================================================================== the fleet
@pytest.mark.parametrize("initial", [0, 5])
def test_a_group_killed_before_the_first_sync_comes_back_from_the_start_checkpoint(
    tiny_model_dir: Path,  # noqa: F811
    tiny_model_dir_b: Path,  # noqa: F811
    tmp_path: Path,
    initial: int,
) -> None:
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    before = digests(model)
    start_weights = Trainer(model).weights()
    fleet, journal = chaos_fleet(
        model, tmp_path, [GroupSpec(1), GroupSpec(1)], initial_version=initial
    )
    try:
        assert fleet.export_states() == {initial: "ready"}  # before any sync
        fleet.launcher("g0").kill_rank(0)
        result = wait_recovery(fleet, "g0")
        assert result.status == "active" and result.strategy == "immediate", result.as_dict()
        assert result.export_version == initial
        # the restart loaded model_path itself, under a lease on the ready start export
        assert [(r.group_id, r.model_path) for r in journal.restarts] == [("g0", str(model))]
        assert journal.restarts[0].export_problems == []
        start = fleet.exporter.latest_ready(initial) if fleet.exporter is not None else None
        assert start is not None and start.start and not start.lifecycle.leases  # released
        g0 = fleet.registry.get("g0").machine
        assert g0.state == "active" and g0.restart_budget == 2
        assert all(m.weights_version == initial for m in g0.members.values())
        assert_fleet_sound(fleet, journal, start_weights)  # g0 serves model_path's weights
        # the trainer's steps: retention retires the start export, the directory stays
        trainer = Trainer(tiny_model_dir_b)
        for version in (initial + 1, initial + 2):
            trainer.perturb(version)
            report = fleet.sync_weights(trainer.weights(), version)
            assert report.ok and sorted(report.updated) == ["g0", "g1"], report
            fleet.exporter.wait_hf_export(version, timeout=WAIT_S)
        assert wait_for(lambda: fleet.export_states().get(initial) == "deleted")
        assert initial not in [r.version for r in fleet.exporter.exports()]
        assert_fleet_sound(fleet, journal, trainer.weights())
        # the run is one of the verifier's model, started with the start checkpoint ready
        replayed = replay_run(load_run(fleet.record(tmp_path / "run", svg=False)).rows)
        assert replayed.ok, replayed.divergence.format() if replayed.divergence else ""
        assert replayed.config.initial_version == initial
        assert replayed.replayed == replayed.transitions
    finally:
        fleet.close()
    assert digests(model) == before  # never removed, never written
