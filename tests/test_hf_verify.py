"""verify_hf_dir on real exports and regular saves: every kind of damage is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_support import small_tensors
from safetensors.torch import save_file

from rollsafe.hf import (
    INDEX_NAME,
    MANIFEST_NAME,
    ExportVerificationError,
    HFExporter,
    verify_hf_dir,
)


@pytest.fixture
def export_dir(tmp_path: Path) -> Path:
    """A ready three-shard export of :func:`small_tensors`."""
    exporter = HFExporter(tmp_path / "exports", shard_size_bytes=3100)
    path = exporter.start(small_tensors(), 1).wait(30)
    assert len(verify_hf_dir(path).weight_files) == 3
    return path


def _shards(path: Path) -> list[Path]:
    return sorted(path.glob("model-*.safetensors"))


def _problems(path: Path, **kw: object) -> str:
    with pytest.raises(ExportVerificationError) as info:
        verify_hf_dir(path, **kw)  # type: ignore[arg-type]
    assert info.value.problems and info.value.path == path
    return str(info.value)


def test_a_sound_export_verifies(export_dir: Path) -> None:
    verified = verify_hf_dir(export_dir, expected_keys=small_tensors())
    assert verified.checksums_verified and verified.version == 1
    assert set(verified.keys) == set(small_tensors())


def test_a_flipped_byte_is_a_checksum_mismatch(export_dir: Path) -> None:
    shard = _shards(export_dir)[1]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # inside the tensor data: the header still parses
    shard.write_bytes(bytes(data))
    message = _problems(export_dir)
    assert shard.name in message and "sha256" in message


def test_a_deleted_shard_is_named_with_its_keys(export_dir: Path) -> None:
    shard = _shards(export_dir)[0]
    index = json.loads((export_dir / INDEX_NAME).read_text())
    keys = [k for k, f in index["weight_map"].items() if f == shard.name]
    shard.unlink()
    message = _problems(export_dir)
    assert f"missing file {shard.name}" in message
    assert all(repr(k) in message for k in keys)


def test_index_pointing_at_a_missing_file(export_dir: Path) -> None:
    index_path = export_dir / INDEX_NAME
    index = json.loads(index_path.read_text())
    index["weight_map"]["layers.0.weight"] = "model-00009-of-00009.safetensors"
    index_path.write_text(json.dumps(index))
    message = _problems(export_dir)
    assert "model-00009-of-00009.safetensors" in message and "'layers.0.weight'" in message


def test_dropped_and_added_keys(export_dir: Path) -> None:
    expected = set(small_tensors())
    message = _problems(export_dir, expected_keys=expected | {"lm_head.weight"})
    assert "expected key(s) missing" in message and "'lm_head.weight'" in message
    message = _problems(export_dir, expected_keys=expected - {"layers.3.weight"})
    assert "unexpected key(s)" in message and "'layers.3.weight'" in message
    # missing keys under an allowed prefix (MTP heads) are tolerated and reported
    verified = verify_hf_dir(export_dir, expected_keys=expected | {"mtp.0.proj.weight"})
    assert verified.missing_allowed_keys == ("mtp.0.proj.weight",)


def test_key_dropped_from_the_index(export_dir: Path) -> None:
    index_path = export_dir / INDEX_NAME
    index = json.loads(index_path.read_text())
    shard = index["weight_map"].pop("layers.2.weight")
    index_path.write_text(json.dumps(index))
    message = _problems(export_dir)
    assert shard in message and "'layers.2.weight'" in message  # the file holds an unindexed key


def test_truncated_shard_and_garbage_header(export_dir: Path) -> None:
    first, second = _shards(export_dir)[:2]
    first.write_bytes(first.read_bytes()[:-100])
    second.write_bytes(b"\xff" * 64)
    message = _problems(export_dir)
    assert first.name in message and second.name in message and "size" in message


def test_all_problems_are_listed_at_once(export_dir: Path) -> None:
    for shard in _shards(export_dir):
        shard.unlink()
    with pytest.raises(ExportVerificationError) as info:
        verify_hf_dir(export_dir)
    assert sum("missing" in p for p in info.value.problems) >= 3


def test_manifest_must_list_every_weight_file(export_dir: Path) -> None:
    manifest_path = export_dir / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    dropped = _shards(export_dir)[0].name
    del manifest["files"][dropped]
    manifest_path.write_text(json.dumps(manifest))
    assert dropped in _problems(export_dir)


def test_regular_single_file_save_without_index(tmp_path: Path) -> None:
    tensors = small_tensors()
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp_path / "model.safetensors")
    verified = verify_hf_dir(tmp_path, expected_keys=tensors)
    assert not verified.checksums_verified and verified.weight_files == ("model.safetensors",)
    (tmp_path / "model.safetensors").unlink()
    assert "neither" in _problems(tmp_path)


def test_not_a_directory(tmp_path: Path) -> None:
    assert "not a directory" in _problems(tmp_path / "nope")


def test_safetensors_library_disagreement_is_caught(tmp_path: Path) -> None:
    """A header whose offsets overlap parses by hand but the library refuses it."""
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (tmp_path / "model.safetensors").write_bytes(
        len(raw).to_bytes(8, "little") + raw + torch.zeros(2).numpy().tobytes()
    )
    assert "model.safetensors" in _problems(tmp_path)
