"""The ``disk`` transport: engines load a verified HF export while the transport holds a lease.

One 1-rank engine serves the module (started from model A); the trainer holds model B and exports
it with an :class:`~rollsafe.hf.HFExporter`. Checks: export-and-wait, adopting an existing ready
export, adopting a directory from a root, refusing an unverified directory, the lease held
exactly while the engine loads (so retention cannot delete the directory under it) and
released on failure too.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import (
    EngineProcess,
    module_engine,
    tiny_model_dir,  # noqa: F401  (fixture)
    tiny_model_dir_b,  # noqa: F401  (fixture)
)
from transport_helpers import Trainer, assert_serves, target

from rollsafe.adapters.engines import SGLangClient
from rollsafe.hf import HFExporter
from rollsafe.transports import DiskTransport, RegisterError, TransportError


@pytest.fixture(scope="module")
def one(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return module_engine(request, tiny_model_dir, ranks=1)


@pytest.fixture(scope="module")
def trainer(tiny_model_dir_b: Path) -> Trainer:  # noqa: F811
    return Trainer(tiny_model_dir_b)


@pytest.fixture
def exporter(tmp_path: Path, tiny_model_dir_b: Path) -> HFExporter:  # noqa: F811
    return HFExporter(tmp_path / "exports", template_dir=tiny_model_dir_b, keep_last=1)


class LeaseProbe:
    """Forwards to an engine client; records the leases held while the engine loads."""

    def __init__(self, client: Any, transport: DiskTransport, during: Any = None) -> None:
        self._client = client
        self._transport = transport
        self._during = during
        self.leases_during: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def update_weights_from_disk(self, model_path: str, **kw: Any) -> str:
        lifecycle = self._transport.lifecycle
        assert lifecycle is not None
        self.leases_during.append(len(lifecycle.leases))
        if self._during is not None:
            self._during(model_path)
        return str(self._client.update_weights_from_disk(model_path, **kw))


def test_export_and_wait_then_adopt(
    one: EngineProcess, trainer: Trainer, exporter: HFExporter
) -> None:
    tr = DiskTransport(exporter)
    tr.register(trainer.weights(), 1)
    assert not tr.adopted and tr.path == exporter.root / "hf-v1"
    probe = LeaseProbe(SGLangClient(one.url), tr)
    report = tr.update([target("one", one, (0,), probe)])
    assert report.ok, report.results
    assert probe.leases_during == [1]
    assert tr.lifecycle is not None and tr.lifecycle.leases == ()
    assert_serves(one, trainer, 1)

    # another transport on the same exporter adopts the ready export: nothing is written again
    again = DiskTransport(exporter)
    again.register(trainer.weights(), 1)
    assert again.adopted and again.path == tr.path


def test_lease_keeps_a_superseded_export_until_the_engine_loaded(
    one: EngineProcess, trainer: Trainer, exporter: HFExporter
) -> None:
    tr = DiskTransport(exporter)
    tr.register(trainer.weights(), 1)
    v1 = tr.path
    assert v1 is not None

    def newer_export_while_loading(path: str) -> None:
        exporter.start(trainer.weights(), 2).wait(60)  # keep_last=1: v1 is superseded now
        assert Path(path).is_dir()  # ...but leased, so not deleted

    probe = LeaseProbe(SGLangClient(one.url), tr, during=newer_export_while_loading)
    report = tr.update([target("one", one, (0,), probe)])
    assert report.ok, report.results
    assert not v1.exists()  # released in finally: retention deleted it
    assert_serves(one, trainer, 1)


def test_lease_released_when_the_load_fails(trainer: Trainer, exporter: HFExporter) -> None:
    tr = DiskTransport(exporter)
    tr.register(trainer.weights(), 1)
    dead = SGLangClient("http://127.0.0.1:9", timeout=2.0)
    report = tr.update([target("dead", None, (0,), dead)])
    assert report.failed == ["dead"]
    assert "target 'dead'" in report.results["dead"].reason
    assert tr.lifecycle is not None and tr.lifecycle.leases == ()


def test_root_adopts_verified_dirs_and_refuses_others(
    one: EngineProcess, trainer: Trainer, exporter: HFExporter, tmp_path: Path
) -> None:
    exporter.start(trainer.weights(), 3).wait(60)
    root = tmp_path / "shared"
    shutil.copytree(exporter.root / "hf-v3", root / "hf-v3")
    tr = DiskTransport(root)
    tr.register(trainer.weights(), 3)
    assert tr.adopted
    assert tr.update([target("one", one, (0,))]).ok
    assert_serves(one, trainer, 3)

    # a corrupted copy does not verify: refused, nothing published, update refuses
    shutil.copytree(root / "hf-v3", root / "hf-v4")
    shard = next((root / "hf-v4").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    bad = DiskTransport(root)
    with pytest.raises(RegisterError, match="not a verified export"):
        bad.register(trainer.weights(), 4)
    assert bad.registration.published is None
    with pytest.raises(TransportError, match="nothing is registered"):
        bad.update([target("one", one, (0,))])
    # a version whose manifest says otherwise is refused too
    shutil.copytree(root / "hf-v3", root / "hf-v5")
    with pytest.raises(RegisterError, match="holds version 3"):
        DiskTransport(root).register(trainer.weights(), 5)
    assert one.checksum()["weight_version"] == "3"
    # a verified directory whose shard is replaced after register is not loaded (re-verified
    # before every push): the engine keeps what it serves
    before = one.checksum()
    shard = next((root / "hf-v3").glob("*.safetensors"))
    replaced = bytearray(shard.read_bytes())
    replaced[-1] ^= 0xFF
    shard.unlink()
    shard.write_bytes(bytes(replaced))  # same size, new file
    report = tr.update([target("one", one, (0,))])
    assert not report.ok
    assert "changed since it was verified" in (report.results["one"].reason or "")
    assert one.checksum() == before


def test_key_mismatch_and_failed_export_publish_nothing(
    trainer: Trainer, exporter: HFExporter
) -> None:
    exporter.start(trainer.weights(), 6).wait(60)
    tr = DiskTransport(exporter)
    more = {**trainer.weights(), "model.extra.weight": torch.zeros(2)}
    with pytest.raises(RegisterError, match="not published"):
        tr.register(more, 6)  # the ready v6 export lacks a registered key
    assert tr.registration.published is None
    bad = {**trainer.weights(), "model.extra.weight": torch.zeros(2, dtype=torch.complex64)}
    with pytest.raises(RegisterError):
        tr.register(bad, 7)  # the exporter refuses the input: nothing exported or published
    assert tr.registration.published is None
    assert not (exporter.root / "hf-v7").exists()
