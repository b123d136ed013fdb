"""A fleet transport is one class: a TransportSettings subclass is all a new transport needs.

The classes here are defined inside each test and unregistered afterwards, so the registry of
the other tests keeps its three built-in transports.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from engine_helpers import sglang_digests, tiny_model_dir  # noqa: F401  (fixture)

from rollsafe.adapters.engines import EngineSpec
from rollsafe.fleet import (
    FleetConfig,
    FleetConfigError,
    NcclSettings,
    RolloutFleet,
    TransportContext,
    TransportSettings,
)
from rollsafe.fleet.control_plane import build_transport
from rollsafe.fleet.settings import TRANSPORT_SETTINGS
from rollsafe.hf import HFExporter
from rollsafe.ports import WeightTransport


@pytest.fixture
def registry_guard() -> Iterator[None]:
    """Unregister whatever transport a test defines."""
    before = dict(TRANSPORT_SETTINGS)
    yield
    TRANSPORT_SETTINGS.clear()
    TRANSPORT_SETTINGS.update(before)


def _config(
    model: Path, tmp_path: Path, engine: dict[str, Any] | None = None, **kw: Any
) -> FleetConfig:
    """A fleet config on ``model``; ``engine``: the engine spec's fields."""
    spec = EngineSpec(model_path=str(model), **(engine or {}))
    return FleetConfig(export_root=tmp_path / "exports", engine=spec, **kw)


def test_one_subclass_is_a_working_fleet_transport(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    registry_guard: None,
) -> None:
    """Defining the class registers it; the fleet builds it from the context and syncs."""
    from transformers import AutoModelForCausalLM

    from rollsafe.transports import IPCTransport

    built: list[TransportContext] = []

    @dataclass(frozen=True)
    class RecordedIpcSettings(TransportSettings):
        transport: ClassVar[str] = "recorded_ipc"
        label: str = "run"

        def __post_init__(self) -> None:
            if not self.label:
                raise FleetConfigError(self.key("label"), "must be a non-empty string")

        def build(self, context: TransportContext) -> WeightTransport:
            built.append(context)
            return IPCTransport(context.world_size)

    assert TRANSPORT_SETTINGS["recorded_ipc"] is RecordedIpcSettings
    with pytest.raises(FleetConfigError) as info:
        RecordedIpcSettings(label="")
    assert info.value.key == "recorded_ipc.label"

    cfg = _config(tiny_model_dir, tmp_path, transport=RecordedIpcSettings(label="A"))
    assert cfg.transport == "recorded_ipc"
    assert cfg.settings_for() == RecordedIpcSettings(label="A")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    with RolloutFleet(cfg) as fleet:
        assert isinstance(fleet.transport, IPCTransport) and fleet.transport_fallback is None
        # the context names the fleet's exporter too (the disk transport loads its exports)
        assert built == [TransportContext(1, (("g0", 1),), cfg.engine, fleet.exporter)]
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.03)
        weights = {n: p.detach() for n, p in model.named_parameters()}
        report = fleet.sync_weights(weights, 1)
        assert report.ok and report.updated == ["g0"], report
        assert fleet.checksums() == {"g0": sglang_digests(weights)["model"]}
    # by name: its defaults, or the object given in transport_settings
    assert _config(tiny_model_dir, tmp_path, transport="recorded_ipc").settings_for() == (
        RecordedIpcSettings()
    )
    named = _config(
        tiny_model_dir,
        tmp_path,
        transport="recorded_ipc",
        transport_settings={"recorded_ipc": RecordedIpcSettings(label="B")},
    )
    assert named.settings_for().label == "B"  # type: ignore[attr-defined]


def test_a_name_is_registered_once(registry_guard: None) -> None:
    with pytest.raises(TypeError, match="already registered"):

        @dataclass(frozen=True)
        class Impostor(TransportSettings):
            transport: ClassVar[str] = "nccl"

    assert TRANSPORT_SETTINGS["nccl"] is NcclSettings


def test_check_engines_refuses_at_config_time(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    registry_guard: None,
) -> None:
    @dataclass(frozen=True)
    class SglangOnly(TransportSettings):
        transport: ClassVar[str] = "sglang_only"

        def check_engines(self, engine: EngineSpec) -> None:
            if engine.dialect == "vllm":
                raise FleetConfigError("transport", "serves SGLang engines only")

    _config(tiny_model_dir, tmp_path, transport="sglang_only")
    with pytest.raises(FleetConfigError, match="SGLang engines only"):
        _config(tiny_model_dir, tmp_path, transport="sglang_only", engine={"dialect": "vllm"})
    # the built-in ipc refuses vLLM engines the same way
    with pytest.raises(FleetConfigError, match="update_weights_from_tensor") as info:
        _config(tiny_model_dir, tmp_path, engine={"dialect": "vllm"})
    assert info.value.key == "transport"


def test_fallback_builds_the_named_transport_with_one_warning(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    registry_guard: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from rollsafe.transports import NCCLTransport

    @dataclass(frozen=True)
    class NeedsRdma(TransportSettings):
        transport: ClassVar[str] = "needs_rdma"
        fallback: ClassVar[str | None] = "nccl"

        def fallback_reasons(self, context: TransportContext) -> list[str]:
            return [f"no RDMA device for {len(context.groups)} group(s)"]

        def build(self, context: TransportContext) -> WeightTransport:
            raise AssertionError("never built: it falls back")

    caplog.set_level(logging.WARNING)
    cfg = _config(tiny_model_dir, tmp_path, transport="needs_rdma", nccl=NcclSettings(None))
    exporter = HFExporter(tmp_path / "exports", template_dir=tiny_model_dir)
    # what start() does before launching engines
    transport, fallback = build_transport(cfg, cfg.validate(), 1, exporter)
    try:
        assert isinstance(transport, NCCLTransport) and transport.backend is None
        assert fallback == "no RDMA device for 1 group(s)"
    finally:
        transport.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [
        "transport 'needs_rdma' falls back to 'nccl': no RDMA device for 1 group(s)"
    ]

    @dataclass(frozen=True)
    class NoFallback(TransportSettings):
        transport: ClassVar[str] = "no_fallback"

        def fallback_reasons(self, context: TransportContext) -> list[str]:
            return ["the engines are too far"]

    cfg = _config(tiny_model_dir, tmp_path, transport="no_fallback")
    with pytest.raises(FleetConfigError, match="cannot serve this fleet: the engines are"):
        build_transport(cfg, cfg.validate(), 1, exporter)


@pytest.mark.parametrize(
    ("kw", "key", "text"),
    [
        ({"transport_settings": {"ipc": None}}, "transport_settings['ipc']", "FleetConfig.ipc"),
        (
            {"transport_settings": {"carrier": NcclSettings()}},
            "transport_settings['carrier']",
            "registered TransportSettings",
        ),
        (
            {"transport_settings": {"nccl": NcclSettings()}},
            "transport_settings['nccl']",
            "FleetConfig.nccl",
        ),
        ({"transport_settings": [1]}, "transport_settings", "mapping"),
        ({"transport": 3}, "transport", "unknown transport 3"),
        (
            {"transport": NcclSettings(backend="nccl"), "nccl": NcclSettings(backend=None)},
            "transport",
            "conflicts with nccl=",
        ),
    ],
)
def test_malformed_transport_settings_name_the_key(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
    kw: dict[str, Any],
    key: str,
    text: str,
) -> None:
    with pytest.raises(FleetConfigError) as info:
        _config(tiny_model_dir, tmp_path, **kw)
    assert info.value.key == key and text in str(info.value)


def test_a_builtin_settings_object_as_transport_lands_in_its_field(
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    cfg = _config(tiny_model_dir, tmp_path, transport=NcclSettings(backend=None))
    assert cfg.transport == "nccl" and cfg.nccl == NcclSettings(backend=None)
    assert cfg.settings_for() is cfg.nccl and dict(cfg.transport_settings) == {}


def test_ipc_settings_check_finite_is_a_bool_and_reaches_the_transport() -> None:
    from rollsafe.fleet import FleetConfigError, IpcSettings, TransportContext
    from rollsafe.transports import IPCTransport

    with pytest.raises(FleetConfigError) as info:
        IpcSettings(check_finite="yes")  # type: ignore[arg-type]
    assert info.value.key == "ipc.check_finite"
    for value in (True, False):
        tr = IpcSettings(check_finite=value).build(TransportContext(world_size=2))
        assert isinstance(tr, IPCTransport) and tr.check_finite is value
        tr.close()
    assert IpcSettings().check_finite is True  # the default: the sender checks, once per version
