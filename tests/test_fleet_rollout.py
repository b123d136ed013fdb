"""RolloutFleet: config errors named at construction; start/generate/sync/close on real engines."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from engine_helpers import pid_alive, sglang_digests, tiny_model_dir  # noqa: F401  (fixture)

from rollsafe.fleet import (
    FleetConfig,
    FleetConfigError,
    FleetNotStarted,
    GroupSpec,
    NcclSettings,
    RolloutFleet,
)


def config(model: Path, tmp_path: Path, **kw: object) -> FleetConfig:
    args: dict[str, object] = {"model_path": model, "export_root": tmp_path / "exports"}
    args.update(kw)
    return FleetConfig(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        ({"transport": "carrier-pigeon"}, "transport"),
        (
            {"groups": [GroupSpec(2, fleet_ranks=(0, 1)), GroupSpec(1, fleet_ranks=(1,))]},
            "groups[1].fleet_ranks",
        ),
        ({"groups": [GroupSpec(1, "a"), GroupSpec(1, "a")]}, "groups[1].group_id"),
        ({"groups": [GroupSpec(0)]}, "groups[0].ranks"),
        ({"groups": []}, "groups"),
        ({"health": None}, "health"),
        ({"on_update_failure": "retry"}, "on_update_failure"),
    ],
)
def test_malformed_config_names_the_key(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    kw: dict[str, object],
    key: str,
) -> None:
    with pytest.raises(FleetConfigError) as info:
        RolloutFleet(config(tiny_model_dir, tmp_path, **kw))
    assert info.value.key == key and key in str(info.value)


def test_settings_validate_when_built_and_name_the_field() -> None:
    from rollsafe.fleet import HealthSettings, RecoverySettings

    with pytest.raises(FleetConfigError) as info:
        HealthSettings(interval_s=0)
    assert info.value.key == "health.interval_s" and "health.interval_s" in str(info.value)
    with pytest.raises(FleetConfigError, match="recovery_timeout_s") as rinfo:
        RecoverySettings(timeout_s=-1)
    assert rinfo.value.key == "recovery.timeout_s"


def test_transport_settings_are_typed_and_the_flat_keywords_fold_into_them(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    import dataclasses

    from rollsafe.fleet import TRANSPORTS, CheckpointEngineSettings, TransportSettings
    from rollsafe.fleet.settings import TRANSPORT_SETTINGS

    # each built-in transport: one settings class that builds it, and a FleetConfig field
    assert (
        set(TRANSPORTS) == {"ipc", "nccl", "checkpoint_engine", "disk"} <= set(TRANSPORT_SETTINGS)
    )
    fields = {f.name: f for f in dataclasses.fields(FleetConfig)}
    for name in TRANSPORTS:
        cls = TRANSPORT_SETTINGS[name]
        assert fields[name].default_factory is cls
        assert cls.build is not TransportSettings.build, name
    typed = config(
        tiny_model_dir,
        tmp_path,
        nccl=NcclSettings(backend="nccl", group_timeout_s=30.0),
        checkpoint_engine=CheckpointEngineSettings(
            p2p=True, p2p_protocol="tcp", rdma_devices=["mlx5_0"]
        ),
    )
    assert typed.checkpoint_engine.rdma_devices == ("mlx5_0",)
    # the flat keywords of earlier releases are gone: the settings classes are the one way
    for flat in ("nccl_backend", "ce_p2p"):
        with pytest.raises(TypeError, match=flat):
            config(tiny_model_dir, tmp_path, **{flat: True})
    # dataclasses.replace (benchmarks use it) keeps the settings; a new settings object wins
    assert dataclasses.replace(typed, warm_standby=True).nccl == typed.nccl
    assert dataclasses.replace(typed, nccl=NcclSettings()).nccl == NcclSettings()
    for bad, key in (({"backend": "mpi"}, "backend"), ({"bucket_bytes": 0}, "bucket_bytes")):
        with pytest.raises(FleetConfigError) as info:
            NcclSettings(**bad)  # type: ignore[arg-type]
        assert info.value.key == f"nccl.{key}" and f"nccl.{key}" in str(info.value)
    with pytest.raises(FleetConfigError) as info:
        NcclSettings(group_timeout_s=0)
    assert info.value.key == "nccl.group_timeout_s"
    # on_update_failure is a FleetConfig field, passed to the sync coordinator
    assert config(tiny_model_dir, tmp_path, on_update_failure="stale").on_update_failure == "stale"
    with pytest.raises(FleetConfigError) as info:
        config(tiny_model_dir, tmp_path, checkpoint_engine={"p2p": True})
    assert info.value.key == "checkpoint_engine"


def test_components_take_their_defaults_from_the_settings() -> None:
    from rollsafe.fleet import HealthSettings, RecoverySettings
    from rollsafe.fleet.health import HealthManager
    from rollsafe.fleet.recovery import RecoveryCoordinator
    from rollsafe.registry import FleetRegistry

    reg = FleetRegistry()
    hm = HealthManager(reg)
    assert (hm.interval_s, hm.timeout_s, hm.failure_threshold) == (
        HealthSettings.interval_s,
        HealthSettings.timeout_s,
        HealthSettings.failure_threshold,
    )
    hm2 = HealthManager(reg, settings=HealthSettings(interval_s=3.0), failure_threshold=5)
    assert (hm2.interval_s, hm2.failure_threshold) == (3.0, 5)  # a keyword overrides a field
    rc = RecoveryCoordinator(reg, launcher_for=lambda gid: None)  # type: ignore[arg-type,return-value]
    try:
        assert rc.settings == RecoverySettings()
    finally:
        rc.close()


def test_bad_paths_are_named(tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    with pytest.raises(FleetConfigError, match="export_root") as info:
        RolloutFleet(config(tiny_model_dir, tmp_path, export_root=tmp_path / "no" / "exports"))
    assert info.value.key == "export_root"
    (tmp_path / "not-hf").mkdir()
    with pytest.raises(FleetConfigError, match=r"config\.json") as info:
        RolloutFleet(config(tiny_model_dir, tmp_path, template_dir=tmp_path / "not-hf"))
    assert info.value.key == "template_dir"
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(FleetConfigError, match="not writable"):
            RolloutFleet(config(tiny_model_dir, tmp_path, export_root=ro / "exports"))


def test_unstarted_fleet_refuses_requests(tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    fleet = RolloutFleet(config(tiny_model_dir, tmp_path))
    with pytest.raises(FleetNotStarted):
        fleet.generate([1, 2, 3])
    fleet.close()


def test_start_generate_sync_timeline_and_close(tiny_model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    cfg = config(
        tiny_model_dir,
        tmp_path,
        groups=[GroupSpec(1), GroupSpec(2)],
        enable_immediate_recovery=True,
    )
    with RolloutFleet(cfg) as fleet:
        pids = [p for gid in fleet.group_ids for p in fleet.launcher(gid).rank_pids]
        assert len(pids) == 3 and all(pid_alive(p) for p in pids)
        assert [g.state for g in fleet.registry.groups()] == ["active", "active"]
        # SGLang's default temperature is 1.0: an unseeded sample from the tiny random model
        # ends at its EOS within 4 tokens in about 1 % of requests (0.3 % at the first token),
        # so the length is asked for, not left to luck
        sample = {"max_new_tokens": 4, "ignore_eos": True}
        out = fleet.generate([1, 2, 3], sampling_params=sample)
        assert out.group_id in ("g0", "g1") and len(out.output_ids) == 4, out
        assert out.result.finish_reason == "length", out
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        weights = {n: p.detach() for n, p in model.named_parameters()}
        report = fleet.sync_weights(weights, 1)
        assert report.ok and report.updated == ["g0", "g1"], report
        # each group's SGLang checker: its own parameters, g1's two ranks their shards
        want = {"g0": sglang_digests(weights)["model"], "g1": sglang_digests(weights, 2)["model"]}
        assert fleet.checksums() == want
        assert fleet.exporter is not None
        fleet.exporter.wait_hf_export(1, timeout=60)
        fleet.pause()
        fleet.resume()
        assert fleet.generate([4, 5], sampling_params={"max_new_tokens": 2}).weight_version == "1"
        rows = fleet.timeline()
        kinds = {r["kind"] for r in rows}
        assert {"group", "export", "registration"} <= kinds
        times = [r["timestamp"] for r in rows]
        assert times == sorted(times)
        snap = fleet.snapshot()
        # the start checkpoint (model_path, the export of v0) and v1, both kept (keep_last 2)
        assert snap["exports"] == {"0": "ready", "1": "ready"}
        assert snap["registry"]["fleet_version"] == 1
        assert set(fleet.registry.dispatch_counts()["g0"]) <= {"active"}
    assert not any(pid_alive(p) for p in pids)  # the context manager reaped every rank
    with pytest.raises(FleetNotStarted):
        fleet.generate([1])


def test_nccl_fleet_takes_its_backend_and_bucket_size(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    from transformers import AutoModelForCausalLM

    from rollsafe.transports import NCCLTransport

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    cfg = config(
        tiny_model_dir,
        tmp_path,
        transport=NcclSettings(backend=None, bucket_bytes=64 << 10),
    )
    with RolloutFleet(cfg) as fleet:
        tr = fleet.transport
        assert isinstance(tr, NCCLTransport)
        assert tr.backend is None and tr.bucket_bytes == 64 << 10
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02)
        weights = {n: p.detach() for n, p in model.named_parameters()}
        report = fleet.sync_weights(weights, 1)
        assert report.ok, report
        assert tr.resolved_backend() == "gloo"  # None: chosen by the weights' device (CPU)
        assert len(tr.plans) > 1  # the small buckets were used
        assert fleet.checksums() == {"g0": sglang_digests(weights)["model"]}


def test_disk_fleet_loads_each_version_from_its_own_export(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    from transformers import AutoModelForCausalLM

    from rollsafe.fleet import DiskSettings
    from rollsafe.transports import DiskTransport

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    cfg = config(
        tiny_model_dir,
        tmp_path,
        groups=[GroupSpec(1), GroupSpec(1)],
        transport=DiskSettings(export_timeout_s=60.0),
    )
    assert cfg.transport == "disk" and cfg.disk.export_timeout_s == 60.0
    with RolloutFleet(cfg) as fleet:
        assert isinstance(fleet.transport, DiskTransport)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.03)
        weights = {n: p.detach() for n, p in model.named_parameters()}
        report = fleet.sync_weights(weights, 1)
        assert report.ok and report.updated == ["g0", "g1"], report
        # the sync wrote the export once, loaded both groups from it, and did not export again
        assert report.export_started and report.export_error is None
        assert fleet.exporter is not None and fleet.exporter.latest_ready(1) is not None
        want = sglang_digests(weights)["model"]
        assert fleet.checksums() == {"g0": want, "g1": want}
    with pytest.raises(FleetConfigError) as info:
        DiskSettings(request_timeout_s=0)
    assert info.value.key == "disk.request_timeout_s"
