"""HFExporter end to end on real files: transformers round trip, sharding, input checks, busy,
abandon, retention with leases, adopting a ``save_pretrained`` directory."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from hf_support import gated_writer, hidden_entries, small_tensors
from safetensors.torch import load_file

from rollsafe.hf import (
    INDEX_NAME,
    MANIFEST_NAME,
    DuplicateTensorName,
    EmptyExport,
    ExportAbandoned,
    ExportBusy,
    ExportExists,
    ExportFailed,
    ExportInputError,
    ExportVerificationError,
    HFExporter,
    NotATensor,
    UnsupportedTensor,
    verify_hf_dir,
)
from rollsafe.statemachines import LeaseError

transformers = pytest.importorskip("transformers")


# --------------------------------------------------------------------------- tiny Llama
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    """A seeded tiny Llama (untied embeddings) and its ``save_pretrained`` directory."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    template = tmp_path_factory.mktemp("tiny-llama") / "hf-step-3"
    model.save_pretrained(template)
    return model, template


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([[1, 5, 9, 77, 3, 100, 42, 7]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def _load(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.mark.parametrize("shard_size", [1 << 30, 40_000], ids=["one-shard", "many-shards"])
def test_export_loads_in_transformers_with_equal_logits(
    tiny_llama: tuple[torch.nn.Module, Path], tmp_path: Path, shard_size: int
) -> None:
    model, template = tiny_llama
    state = model.state_dict()
    exporter = HFExporter(tmp_path, template_dir=template, shard_size_bytes=shard_size)
    handle = exporter.start_hf_export(state, 7)
    path = exporter.wait_hf_export(7, timeout=60)
    assert path == tmp_path / "hf-v7" == handle.path
    assert exporter.is_hf_export_done() and handle.lifecycle.state == "ready"
    assert [r.event for r in handle.lifecycle.history] == [
        "snapshot",
        "snapshot_done",
        "shards_written",
        "publish",
    ]

    names = sorted(p.name for p in path.iterdir())
    assert "config.json" in names and "generation_config.json" in names and MANIFEST_NAME in names
    assert "model.safetensors" not in names  # the template's weights are never copied
    assert not hidden_entries(tmp_path)

    index = json.loads((path / INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    n = len(shards)
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert (n == 1) == (shard_size == 1 << 30)
    assert set(index["weight_map"]) == set(state)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in state.values()
    )
    for shard in shards:  # every key is in the shard the index names, with its value
        tensors = load_file(path / shard)
        assert {k for k, f in index["weight_map"].items() if f == shard} == set(tensors)
        for key, value in tensors.items():
            assert torch.equal(value, state[key])

    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert manifest["version"] == 7 and manifest["keys"] == sorted(state)
    assert set(manifest["files"]) == {*shards, INDEX_NAME, "config.json", "generation_config.json"}
    assert verify_hf_dir(path, expected_keys=state).checksums_verified

    assert torch.equal(_logits(_load(path)), _logits(model))


def test_dtypes_non_contiguous_and_scalars_round_trip(tmp_path: Path) -> None:
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    tensors = {
        "transposed": base.t(),  # non-contiguous
        "strided": base[:, ::2],
        "bf16": torch.randn(5, 3).to(torch.bfloat16),
        "fp16": torch.randn(7).half(),
        "int64": torch.arange(10),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "param": torch.nn.Parameter(torch.ones(2, 2)),
    }
    exporter = HFExporter(tmp_path, shard_size_bytes=64)
    handle = exporter.start(tensors, 1)
    base.add_(1000)  # start returned after the snapshot: later changes must not leak in
    path = handle.wait(30)
    loaded: dict[str, torch.Tensor] = {}
    for f in verify_hf_dir(path, expected_keys=tensors).weight_files:
        loaded.update(load_file(path / f))
    base.sub_(1000)
    assert set(loaded) == set(tensors)
    for key, value in tensors.items():
        assert loaded[key].dtype == value.dtype and loaded[key].shape == value.shape, key
        assert torch.equal(loaded[key], value.detach()), key


@pytest.mark.parametrize(
    ("named", "error", "key"),
    [
        (
            [("a", torch.ones(1)), ("b", torch.ones(1)), ("a", torch.zeros(1))],
            DuplicateTensorName,
            "a",
        ),
        ({"a": torch.ones(1), "b": [1.0, 2.0]}, NotATensor, "b"),
        ({}, EmptyExport, None),
        ([], EmptyExport, None),
        ({"m": torch.empty(3, device="meta")}, UnsupportedTensor, "m"),
        ({"c": torch.ones(2, dtype=torch.complex64)}, UnsupportedTensor, "c"),
        ({"s": torch.ones(3).to_sparse()}, UnsupportedTensor, "s"),
    ],
    ids=["duplicate", "not-a-tensor", "empty-dict", "empty-list", "meta", "complex", "sparse"],
)
def test_bad_input_is_refused_before_anything_is_written(
    tmp_path: Path, named: object, error: type[Exception], key: str | None
) -> None:
    exporter = HFExporter(tmp_path)
    with pytest.raises(error) as info:
        exporter.start(named, 1)  # type: ignore[arg-type]
    if key is not None:
        assert repr(key) in str(info.value) and getattr(info.value, "key", None) == key
    assert list(tmp_path.iterdir()) == []
    assert exporter.in_flight is None and exporter.exports() == []
    exporter.start(small_tensors(), 1).wait(30)  # the exporter is still usable


def test_bad_arguments_are_named(tmp_path: Path) -> None:
    with pytest.raises(ExportInputError, match="keep_last"):
        HFExporter(tmp_path, keep_last=0)
    with pytest.raises(ExportInputError, match="template_dir"):
        HFExporter(tmp_path, template_dir=tmp_path / "nope")
    exporter = HFExporter(tmp_path)
    with pytest.raises(ExportInputError, match="version"):
        exporter.start(small_tensors(), -1)
    with pytest.raises(ExportInputError, match="if_busy"):
        exporter.start(small_tensors(), 1, if_busy="later")  # type: ignore[arg-type]
    exporter.start(small_tensors(), 1).wait(30)
    with pytest.raises(ExportExists):
        exporter.start(small_tensors(), 1)


def test_second_start_is_busy_or_waits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exporter = HFExporter(tmp_path)
    with gated_writer(monkeypatch) as gate:
        first = exporter.start(small_tensors(0), 1)
        assert gate.started.wait(10)
        assert not first.done() and not exporter.is_hf_export_done(1)
        with pytest.raises(ExportBusy) as info:
            exporter.start(small_tensors(1), 2)
        assert info.value.in_flight_version == 1 and info.value.requested_version == 2
        assert not (tmp_path / "hf-v2").exists()

        threading.Timer(0.3, gate.release).start()
        second = exporter.start(small_tensors(1), 2, if_busy="wait")
        assert first.done() and first.lifecycle.state == "ready"  # it waited for the first
        assert second.wait(30) == tmp_path / "hf-v2"


def test_abandon_stops_the_writer_and_publishes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exporter = HFExporter(tmp_path, shard_size_bytes=1024)
    with gated_writer(monkeypatch) as gate:
        handle = exporter.start(small_tensors(), 4)
        assert gate.started.wait(10)
        assert exporter.abandon(4, reason="sync 5 started")
        assert handle.lifecycle.state == "abandoned"
        gate.release()
        with pytest.raises(ExportAbandoned, match="sync 5 started") as info:
            handle.wait(30)
    assert info.value.reason == "sync 5 started" and info.value.version == 4
    assert not (tmp_path / "hf-v4").exists() and not hidden_entries(tmp_path)
    assert exporter.latest_ready(4) is None and exporter.in_flight is None
    assert not exporter.abandon(4)  # nothing in flight any more
    exporter.start(small_tensors(), 5).wait(30)  # the exporter is free again


def test_retention_keeps_leased_exports_until_released(tmp_path: Path) -> None:
    exporter = HFExporter(tmp_path, keep_last=1)
    exporter.start(small_tensors(1), 1).wait(30)
    lease = exporter.lease(1, holder="engine-3")
    latest = exporter.latest_ready()
    assert latest is not None and latest.version == 1
    exporter.start(small_tensors(2), 2).wait(30)

    old = {r.version: r for r in exporter.exports()}[1]
    assert old.state == "superseded" and (tmp_path / "hf-v1").is_dir()
    verify_hf_dir(tmp_path / "hf-v1")  # still complete while an engine loads from it
    assert exporter.latest_ready(1) is None  # never offered again
    with pytest.raises(LeaseError):
        exporter.lease(1)

    exporter.release(lease)
    assert old.state == "deleted" and not (tmp_path / "hf-v1").exists()
    assert [r.version for r in exporter.exports()] == [2]
    assert not hidden_entries(tmp_path)


def test_release_through_the_lifecycle_is_cleaned_up_later(tmp_path: Path) -> None:
    exporter = HFExporter(tmp_path, keep_last=2)
    for v in (1, 2):
        exporter.start(small_tensors(v), v).wait(30)
    record = exporter.latest_ready(1)
    assert record is not None
    lease = record.lifecycle.acquire_lease("engine-0")
    exporter.start(small_tensors(3), 3).wait(30)
    assert record.state == "superseded" and record.path.is_dir()
    record.lifecycle.release_lease(lease)
    assert exporter.cleanup() == [tmp_path / "hf-v1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf-v2", "hf-v3"]


def test_adopt_a_save_pretrained_dir(
    tiny_llama: tuple[torch.nn.Module, Path], tmp_path: Path
) -> None:
    model, template = tiny_llama
    exporter = HFExporter(tmp_path / "exports", template_dir=template, keep_last=1)
    record = exporter.adopt(template, 3, expected_keys=model.state_dict())
    assert record.adopted and record.path == template and record.state == "ready"
    assert [r.event for r in record.lifecycle.history] == ["adopt"]
    ready = exporter.latest_ready(3)
    assert ready is not None and ready.path == template
    with pytest.raises(ExportExists):
        exporter.adopt(template, 3)

    exporter.start(model.state_dict(), 4).wait(60)
    assert record.state == "deleted"  # un-listed by retention ...
    assert (template / "model.safetensors").is_file()  # ... but never removed from disk
    assert exporter.latest_ready() is not None and exporter.latest_ready().version == 4  # type: ignore[union-attr]


def test_adopt_refuses_a_broken_dir_and_registers_nothing(
    tiny_llama: tuple[torch.nn.Module, Path], tmp_path: Path
) -> None:
    model, _ = tiny_llama
    broken = tmp_path / "hf-step-9"
    model.save_pretrained(broken)
    (broken / "model.safetensors").write_bytes(b"\x00" * 16)
    exporter = HFExporter(tmp_path / "exports")
    with pytest.raises(ExportVerificationError, match=r"model\.safetensors"):
        exporter.adopt(broken, 9)
    assert exporter.exports() == []


def test_handles_and_trainer_aliases(tmp_path: Path) -> None:
    exporter = HFExporter(tmp_path)
    assert exporter.is_hf_export_done()  # nothing started yet
    handle = exporter.start_hf_export(small_tensors(), 11)
    deadline = time.monotonic() + 30
    while not exporter.is_hf_export_done(11):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert exporter.wait_hf_export() == handle.path == tmp_path / "hf-v11"
    assert handle.stats.tensor_bytes == sum(
        t.numel() * t.element_size() for t in small_tensors().values()
    )
    assert handle.stats.total_s >= handle.stats.blocking_s > 0


def test_a_write_corrupted_on_disk_is_caught_by_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import rollsafe.hf.exporter as exporter_module

    original = exporter_module.write_shard

    def write_then_corrupt(path: Path, *args: object, **kwargs: object) -> int:
        size = original(path, *args, **kwargs)  # type: ignore[arg-type]
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x01  # what a bad disk or a buggy writer would leave behind
        path.write_bytes(bytes(data))
        return size

    monkeypatch.setattr(exporter_module, "write_shard", write_then_corrupt)
    exporter = HFExporter(tmp_path)
    handle = exporter.start(small_tensors(), 1)
    with pytest.raises(ExportFailed, match="differs from the snapshot") as info:
        handle.wait(30)
    assert "model-00001-of-00001.safetensors" in info.value.reason
    assert handle.lifecycle.state == "failed" and handle.lifecycle.failure_reason
    assert list(tmp_path.iterdir()) == []  # temp dir removed, nothing under the final name


def test_a_disk_error_fails_the_export_and_frees_the_exporter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    import rollsafe.hf.exporter as exporter_module

    def no_space(*args: object, **kwargs: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(exporter_module, "write_shard", no_space)
    exporter = HFExporter(tmp_path)
    with pytest.raises(ExportFailed, match="No space left"):
        exporter.start(small_tensors(), 1).wait(30)
    assert list(tmp_path.iterdir()) == [] and exporter.in_flight is None
    monkeypatch.undo()
    assert exporter.start(small_tensors(), 1).wait(30).is_dir()  # the version can be retried


def test_retention_renames_old_exports_away_at_once(tmp_path: Path) -> None:
    exporter = HFExporter(tmp_path, keep_last=1)
    for v in (1, 2, 3):
        exporter.start(small_tensors(v), v).wait(30)
        finals = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
        assert finals == [f"hf-v{v}"]  # the older one left its final name before wait returned
    deadline = time.monotonic() + 10
    while hidden_entries(tmp_path):  # its files are deleted right after the export completes
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert [r.version for r in exporter.exports()] == [3]
