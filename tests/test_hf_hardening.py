"""Exports that must not verify: empty or incomplete saves, symlinked or special files, files
changed after verification, hostile headers/index/manifest/config, bad ``adopt`` arguments.

Every malformed input must come out as an ``ExportVerificationError`` naming the file and the
field (never an ``OverflowError``/``RecursionError``/``TypeError``/``ValueError``/``KeyError``/
``UnicodeError``), and no message may show the host path above the export directory.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_support import small_tensors
from safetensors.torch import save_file

import rollsafe.hf.verify as verify_module
from rollsafe.hf import (
    INDEX_NAME,
    MANIFEST_NAME,
    ExportInputError,
    ExportVerificationError,
    HFExporter,
    VerifiedExport,
    inspect_hf_dir,
    verify_hf_dir,
)
from rollsafe.hf.errors import display_path
from rollsafe.hf.verify import FileIdentity, reverify
from rollsafe.statemachines import LeaseError
from rollsafe.wire.strict_json import BadJSON, json_depth_exceeds, loads_bounded

CONFIG = {"model_type": "llama", "hidden_size": 32, "rope_scaling": {"type": "linear"}}


# --------------------------------------------------------------------------- helpers
def _problems(path: Path, **kw: Any) -> str:
    """The message of the ExportVerificationError that verifying ``path`` must raise."""
    with pytest.raises(ExportVerificationError) as info:
        verify_hf_dir(path, **kw)
    message = str(info.value)
    assert info.value.problems and info.value.path == path
    _assert_no_host_path(message, path)
    return message


def _assert_no_host_path(message: str, path: Path) -> None:
    assert str(path.parent) not in message, message
    assert message.startswith(f"{display_path(path)}: "), message


def _st_bytes(header: Any, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    n = len(raw) if length is None else length
    return n.to_bytes(8, "little") + raw + data


def _single(tmp_path: Path, header: Any, data: bytes = b"", length: int | None = None) -> Path:
    """A directory holding one hand-made ``model.safetensors``."""
    d = tmp_path / "save"
    d.mkdir(exist_ok=True)
    (d / "model.safetensors").write_bytes(_st_bytes(header, data, length))
    return d


def _shards(path: Path) -> list[Path]:
    return sorted(path.glob("model-*.safetensors"))


def _rewrite_json(path: Path, change: Any) -> None:
    obj = json.loads(path.read_text())
    change(obj)
    path.write_text(json.dumps(obj))


@pytest.fixture
def template(tmp_path: Path) -> Path:
    d = tmp_path / "template"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG))
    return d


@pytest.fixture
def export_dir(tmp_path: Path, template: Path) -> Path:
    """A ready three-shard export of :func:`small_tensors` with a config.json."""
    exporter = HFExporter(tmp_path / "exports", template_dir=template, shard_size_bytes=3100)
    path = exporter.start(small_tensors(), 1).wait(30)
    assert len(verify_hf_dir(path).weight_files) == 3
    return path


# ====================================================================== 1. complete exports
def test_an_empty_weight_map_with_no_files_does_not_verify(tmp_path: Path) -> None:
    d = tmp_path / "empty"
    d.mkdir()
    (d / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": {}}))
    message = _problems(d)
    assert INDEX_NAME in message and "'weight_map' is empty" in message


def test_adopt_refuses_an_empty_export_and_registers_nothing(tmp_path: Path) -> None:
    d = tmp_path / "empty"
    d.mkdir()
    (d / INDEX_NAME).write_text(json.dumps({"weight_map": {}}))
    (d / "config.json").write_text(json.dumps(CONFIG))
    exporter = HFExporter(tmp_path / "exports")
    keys: list[str] | None
    for keys in (None, []):
        with pytest.raises(ExportVerificationError, match="'weight_map' is empty"):
            exporter.adopt(d, 1, expected_keys=keys)
    assert exporter.exports() == [] and exporter.latest_ready() is None


def test_a_single_file_with_no_tensors_does_not_verify(tmp_path: Path) -> None:
    d = _single(tmp_path, {"__metadata__": {"format": "pt"}})
    assert "model.safetensors: holds no tensors" in _problems(d)


def test_expected_keys_missing_are_named_up_to_a_limit(export_dir: Path) -> None:
    wanted = set(small_tensors()) | {f"extra.{i}.weight" for i in range(20)}
    message = _problems(export_dir, expected_keys=wanted)
    assert "20 expected key(s) missing" in message and "'extra.0.weight'" in message
    assert "+8 more" in message  # 12 shown


def test_manifest_key_list_is_the_expected_set(export_dir: Path) -> None:
    _rewrite_json(export_dir / MANIFEST_NAME, lambda m: m["keys"].append("lm_head.weight"))
    message = _problems(export_dir)
    assert "manifest key list and index differ" in message and "'lm_head.weight'" in message


def test_exporter_records_what_verified(tmp_path: Path) -> None:
    exporter = HFExporter(tmp_path, shard_size_bytes=3100)
    path = exporter.start(small_tensors(), 1).wait(30)
    record = exporter.latest_ready(1)
    assert record is not None and record.verified is not None
    verified = record.verified
    assert verified.path == path and verified.checksums_verified and verified.dir_id is not None
    names = {f.name for f in verified.files}
    assert {INDEX_NAME, MANIFEST_NAME, *(p.name for p in _shards(path))} <= names
    for ident in verified.files:
        st = os.stat(path / ident.name)
        assert (ident.st_dev, ident.st_ino, ident.size, ident.mtime_ns) == (
            st.st_dev,
            st.st_ino,
            st.st_size,
            st.st_mtime_ns,
        )
        assert not ident.symlink


# ====================================================================== 2. regular files only
def _link_outside(tmp_path: Path, member: Path) -> Path:
    """Move ``member`` out of its directory and leave a symlink to it behind."""
    outside = tmp_path / "elsewhere" / member.name
    outside.parent.mkdir(exist_ok=True)
    shutil.move(member, outside)
    member.symlink_to(outside)
    return outside


@pytest.mark.parametrize("which", ["shard", "index", "manifest", "config"])
def test_symlinked_members_are_refused_unless_allowed(
    tmp_path: Path, export_dir: Path, which: str
) -> None:
    member = {
        "shard": _shards(export_dir)[1],
        "index": export_dir / INDEX_NAME,
        "manifest": export_dir / MANIFEST_NAME,
        "config": export_dir / "config.json",
    }[which]
    outside = _link_outside(tmp_path, member)
    message = _problems(export_dir)
    assert f"{member.name}: is a symlink" in message and "allow_symlinks=True" in message
    assert str(outside) not in message

    verified = verify_hf_dir(export_dir, allow_symlinks=True)
    ident = {f.name: f for f in verified.files}[member.name]
    st = os.stat(outside)
    assert ident.symlink and (ident.st_dev, ident.st_ino, ident.size, ident.mtime_ns) == (
        st.st_dev,
        st.st_ino,
        st.st_size,
        st.st_mtime_ns,
    )
    assert verified.allow_symlinks


def test_a_symlinked_export_directory_is_refused_unless_allowed(
    tmp_path: Path, export_dir: Path
) -> None:
    link = tmp_path / "latest"
    link.symlink_to(export_dir)
    message = _problems(link)
    assert "latest is a symlink" in message
    assert verify_hf_dir(link, allow_symlinks=True).checksums_verified


def test_dangling_symlink_and_symlink_to_a_directory(tmp_path: Path, export_dir: Path) -> None:
    first, second = _shards(export_dir)[:2]
    first.unlink()
    first.symlink_to(tmp_path / "nowhere")
    second.unlink()
    second.symlink_to(tmp_path)
    message = _problems(export_dir, allow_symlinks=True)
    assert f"{first.name}: is a symlink to a missing file" in message
    assert f"{second.name}: is a symlink to something other than a regular file" in message


@pytest.mark.timeout(30)
def test_a_fifo_in_place_of_a_shard_is_refused_without_blocking(export_dir: Path) -> None:
    shard = _shards(export_dir)[0]
    shard.unlink()
    os.mkfifo(shard)
    result: list[str] = []
    thread = threading.Thread(target=lambda: result.append(_problems(export_dir)), daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "verification blocked on a FIFO"
    assert f"{shard.name}: is something other than a regular file" in result[0]


def test_a_directory_in_place_of_the_index_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "save"
    (d / INDEX_NAME).mkdir(parents=True)
    assert f"{INDEX_NAME}: is something other than a regular file" in _problems(d)


# ====================================================================== 3. re-verification
def _exporter_with(tmp_path: Path, template: Path) -> tuple[HFExporter, Path]:
    exporter = HFExporter(tmp_path / "exports", template_dir=template, shard_size_bytes=3100)
    return exporter, exporter.start(small_tensors(), 1).wait(30)


def _assert_unfit(exporter: HFExporter, version: int, *names: str) -> None:
    with pytest.raises(ExportVerificationError) as info:
        exporter.lease(version, holder="recovery:g0")
    message = str(info.value)
    assert all(name in message for name in names), message
    record = {r.version: r for r in exporter.exports()}[version]
    assert not record.lifecycle.leases and record.state == "ready"
    assert exporter.latest_ready(version) is None and exporter.latest_ready() is None
    with pytest.raises(ExportVerificationError, match="failed re-verification earlier"):
        exporter.lease(version)  # still refused, and still no lease left behind
    assert not record.lifecycle.leases


def test_lease_reverifies_a_sound_export(tmp_path: Path, template: Path) -> None:
    exporter, _ = _exporter_with(tmp_path, template)
    lease = exporter.lease(1, holder="recovery:g0")
    exporter.release(lease)
    lease = exporter.lease(1, full=True)
    exporter.release(lease)
    assert exporter.reverify(1, full=True).checksums_verified


def test_a_shard_replaced_by_an_identical_copy_is_not_leased(
    tmp_path: Path, template: Path
) -> None:
    exporter, path = _exporter_with(tmp_path, template)
    shard = _shards(path)[2]
    copy = shard.with_name("copy.tmp")
    shutil.copy2(shard, copy)  # same bytes, same mtime: another file all the same
    os.replace(copy, shard)
    assert verify_hf_dir(path).checksums_verified  # it would verify from scratch ...
    _assert_unfit(exporter, 1, shard.name, "another file")  # ... but it is not what verified


def test_a_shard_modified_in_place_is_not_leased(tmp_path: Path, template: Path) -> None:
    exporter, path = _exporter_with(tmp_path, template)
    shard = _shards(path)[0]
    st = shard.stat()
    with open(shard, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\x01\x02\x03")
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    _assert_unfit(exporter, 1, shard.name, "modified since it verified")


def _flip_last_byte_keeping_mtime(shard: Path) -> None:
    st = shard.stat()
    with open(shard, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_change_with_its_mtime_put_back_is_caught(tmp_path: Path, template: Path) -> None:
    exporter, path = _exporter_with(tmp_path, template)
    shard = _shards(path)[1]
    _flip_last_byte_keeping_mtime(shard)
    _assert_unfit(exporter, 1, shard.name, "inode change time")


def test_full_reverify_catches_what_stat_cannot_see(tmp_path: Path, template: Path) -> None:
    """Content that changed under unchanged metadata (bit rot, a raw device write): only the
    checksums see it."""
    _, path = _exporter_with(tmp_path, template)
    verified = verify_hf_dir(path)
    shard = _shards(path)[1]
    _flip_last_byte_keeping_mtime(shard)
    st = shard.stat()
    files = tuple(
        replace(f, st_ino=st.st_ino, ctime_ns=st.st_ctime_ns) if f.name == shard.name else f
        for f in verified.files
    )
    rotted = replace(verified, files=files)  # what a change invisible to stat looks like
    assert reverify(rotted) is rotted
    with pytest.raises(ExportVerificationError, match=f"{shard.name}: sha256"):
        reverify(rotted, full=True)


def test_truncated_or_deleted_shards_and_a_replaced_directory(
    tmp_path: Path, template: Path
) -> None:
    _, path = _exporter_with(tmp_path, template)
    pristine = tmp_path / "pristine"
    shutil.copytree(path, pristine)
    verified = verify_hf_dir(path)
    first, second = _shards(path)[:2]
    first.write_bytes(first.read_bytes()[:-10])
    second.unlink()
    with pytest.raises(ExportVerificationError) as info:
        reverify(verified)
    message = str(info.value)
    assert f"{first.name}: size" in message and f"{second.name}: missing" in message
    _assert_no_host_path(message, path)

    fresh = tmp_path / "fresh"
    shutil.copytree(pristine, fresh)
    good = verify_hf_dir(fresh)
    shutil.rmtree(fresh)
    shutil.copytree(pristine, fresh)  # inodes may be reused and copytree keeps mtimes ...
    with pytest.raises(ExportVerificationError) as info:
        good.reverify()  # ... but the change times give the new files away
    assert all(p.name in str(info.value) for p in _shards(fresh))


def test_a_retargeted_symlink_is_caught_at_lease_time(tmp_path: Path, template: Path) -> None:
    """An adopted save whose shards are links (allowed): the exporter must stop offering it
    once a link points at another file, even one with the same bytes."""
    _, source = _exporter_with(tmp_path, template)
    save = tmp_path / "cache-snapshot"
    blobs = tmp_path / "blobs"
    save.mkdir()
    blobs.mkdir()
    for member in source.iterdir():
        shutil.copy2(member, blobs / member.name)
        (save / member.name).symlink_to(blobs / member.name)
    exporter = HFExporter(tmp_path / "other")
    with pytest.raises(ExportVerificationError, match="is a symlink"):
        exporter.adopt(save, 1)
    assert exporter.exports() == []
    record = exporter.adopt(save, 1, allow_symlinks=True)
    assert record.verified is not None and all(f.symlink for f in record.verified.files)
    exporter.release(exporter.lease(1))

    shard = _shards(save)[0]
    twin = blobs / "twin.safetensors"
    shutil.copy2(blobs / shard.name, twin)
    shard.unlink()
    shard.symlink_to(twin)
    _assert_unfit(exporter, 1, shard.name, "another symlink target")


def test_record_without_a_verification_result_is_verified_from_scratch(
    tmp_path: Path, template: Path
) -> None:
    from rollsafe.hf.retention import ExportRecord
    from rollsafe.statemachines import ExportLifecycle

    _, path = _exporter_with(tmp_path, template)
    record = ExportRecord(1, path, ExportLifecycle(1))
    assert record.reverify().checksums_verified
    empty = VerifiedExport(path, (), (), 0, False)
    with pytest.raises(ExportVerificationError, match="no file identities"):
        reverify(empty)


def test_superseded_exports_still_raise_lease_error(tmp_path: Path) -> None:
    exporter = HFExporter(tmp_path, keep_last=1)
    exporter.start(small_tensors(1), 1).wait(30)
    lease = exporter.lease(1)
    exporter.start(small_tensors(2), 2).wait(30)
    with pytest.raises(LeaseError):
        exporter.lease(1)
    exporter.release(lease)


# ====================================================================== 4. hostile input
_F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
_DATA = bytes(8)


def _entry(**fields: Any) -> dict[str, Any]:
    return {"a": {**_F32, **fields}}


HOSTILE_HEADERS: dict[str, tuple[bytes, str]] = {
    "not-json": (b"this is not json", "does not parse"),
    "not-utf8": (b'{"a": "\xff\xfe"}', "not UTF-8"),
    "huge-float": (
        b'{"a": {"dtype": "F32", "shape": [1e400], "data_offsets": [0, 8]}}',
        "not finite",
    ),
    "infinity": (
        b'{"a": {"dtype": "F32", "shape": [Infinity], "data_offsets": [0, 8]}}',
        "Infinity",
    ),
    "nan": (b'{"a": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 8]}}', "NaN"),
    "minus-infinity": (b'{"__metadata__": {"x": -Infinity}}', "-Infinity"),
    "deep-list": (b"[" * 100_000 + b"]" * 100_000, "nested deeper than"),
    "deep-object": (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nested deeper than"),
    "long-int": (
        b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b"]}}",
        "digits is too large",
    ),
    "duplicate-key": (
        b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
        b'"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}',
        "duplicate key 'a'",
    ),
    "list": (json.dumps([_F32]).encode(), "not a JSON object"),
    "null": (b"null", "not a JSON object"),
    "metadata-list": (json.dumps({"__metadata__": [1], "a": _F32}).encode(), "'__metadata__'"),
    "metadata-values": (
        json.dumps({"__metadata__": {"k": 1}, "a": _F32}).encode(),
        "'__metadata__'",
    ),
    "entry-not-object": (json.dumps({"a": [0, 8]}).encode(), "not an object"),
    "dtype-int": (json.dumps(_entry(dtype=5)).encode(), "field 'dtype' 5"),
    "dtype-unknown": (json.dumps(_entry(dtype="F33")).encode(), "field 'dtype' 'F33'"),
    "dtype-missing": (
        json.dumps({"a": {"shape": [2], "data_offsets": [0, 8]}}).encode(),
        "field 'dtype' None",
    ),
    "shape-string": (json.dumps(_entry(shape="2")).encode(), "field 'shape'"),
    "shape-float": (json.dumps(_entry(shape=[2.0])).encode(), "field 'shape'"),
    "shape-bool": (json.dumps(_entry(shape=[True, 2])).encode(), "field 'shape'"),
    "shape-negative": (json.dumps(_entry(shape=[-2])).encode(), "field 'shape'"),
    "shape-nested": (json.dumps(_entry(shape=[[2]])).encode(), "field 'shape'"),
    "shape-too-many-dims": (json.dumps(_entry(shape=[1] * 65)).encode(), "field 'shape'"),
    "shape-overflow": (
        json.dumps(_entry(shape=[2**62, 2**62, 2**62])).encode(),
        "needs more bytes",
    ),
    "shape-int64-max": (json.dumps(_entry(shape=[2**63])).encode(), "field 'shape'"),
    "offsets-string": (json.dumps(_entry(data_offsets="0,8")).encode(), "field 'data_offsets'"),
    "offsets-one": (json.dumps(_entry(data_offsets=[0])).encode(), "field 'data_offsets'"),
    "offsets-three": (json.dumps(_entry(data_offsets=[0, 4, 8])).encode(), "field 'data_offsets'"),
    "offsets-bool": (json.dumps(_entry(data_offsets=[False, 8])).encode(), "field 'data_offsets'"),
    "offsets-reversed": (json.dumps(_entry(data_offsets=[8, 0])).encode(), "field 'data_offsets'"),
    "offsets-negative": (json.dumps(_entry(data_offsets=[-8, 0])).encode(), "field 'data_offsets'"),
    "offsets-float": (json.dumps(_entry(data_offsets=[0.0, 8.0])).encode(), "field 'data_offsets'"),
    "offsets-wrong-span": (json.dumps(_entry(data_offsets=[0, 4])).encode(), "need 8"),
    "offsets-beyond-file": (
        json.dumps(_entry(shape=[4], data_offsets=[0, 16])).encode(),
        "needs more bytes",
    ),
    "offsets-overlap": (
        json.dumps(
            {
                "a": _F32,
                "b": {**_F32, "data_offsets": [0, 8]},
                "c": {**_F32, "shape": [0], "data_offsets": [8, 8]},
            }
        ).encode(),
        "overlaps",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_HEADERS))
def test_hostile_safetensors_headers_are_named_errors(tmp_path: Path, case: str) -> None:
    header, expect = HOSTILE_HEADERS[case]
    d = _single(tmp_path, header, _DATA)
    message = _problems(d)
    assert "model.safetensors" in message and expect in message, message


def test_overlap_and_gap_in_data_offsets(tmp_path: Path) -> None:
    a = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    overlap = {"a": a, "b": {**a, "data_offsets": [4, 12]}}
    assert "'b' field 'data_offsets' overlaps 'a'" in _problems(
        _single(tmp_path, overlap, _DATA + bytes(4))
    )
    gap = {"a": a, "b": {**a, "data_offsets": [12, 20]}}
    assert "leaves a gap after 'a'" in _problems(_single(tmp_path, gap, _DATA * 2 + bytes(4)))


@pytest.mark.parametrize(
    "length",
    [0, 2**63, 2**64 - 1, 2**31, 10**8 + 8, None],
    ids=["zero", "2^63", "negative-as-u64", "2^31", "above-cap", "beyond-file"],
)
def test_hostile_header_lengths(tmp_path: Path, length: int | None) -> None:
    raw = json.dumps({"a": _F32}).encode()
    d = _single(tmp_path, raw, _DATA, length=len(raw) + 1000 if length is None else length)
    message = _problems(d)
    assert "model.safetensors: header length" in message


def test_too_short_for_a_header(tmp_path: Path) -> None:
    d = tmp_path / "save"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"\x01\x02")
    assert "too short for a safetensors header" in _problems(d)


def test_bracket_heavy_key_names_still_verify(tmp_path: Path) -> None:
    """The nesting pre-scan must not count brackets inside strings (escaped quotes too)."""
    names = ["[" * 200, '{"\\' + "{" * 100, "]" * 90 + "[" * 90, 'x\\"[[[[' * 30]
    d = tmp_path / "save"
    d.mkdir()
    save_file({n: torch.ones(2) for n in names}, d / "model.safetensors")
    assert set(verify_hf_dir(d, expected_keys=names).keys) == set(names)


# ---------------------------------------------------------------- hostile index
def _index_dir(tmp_path: Path, index: Any) -> Path:
    d = tmp_path / "save"
    d.mkdir(exist_ok=True)
    raw = index if isinstance(index, bytes) else json.dumps(index).encode()
    (d / INDEX_NAME).write_bytes(raw)
    save_file({"a": torch.ones(2)}, d / "model-00001-of-00001.safetensors")
    return d


SHARD = "model-00001-of-00001.safetensors"
HOSTILE_INDEXES: dict[str, tuple[Any, str]] = {
    "not-object": ([1, 2], "is not a JSON object"),
    "weight-map-list": ({"weight_map": [["a", SHARD]]}, "no 'weight_map' mapping"),
    "weight-map-string": ({"weight_map": SHARD}, "no 'weight_map' mapping"),
    "weight-map-missing": ({"metadata": {}}, "no 'weight_map' mapping"),
    "value-int": ({"weight_map": {"a": 5}}, "not file names"),
    "value-null": ({"weight_map": {"a": None}}, "not file names"),
    "value-list": ({"weight_map": {"a": [SHARD]}}, "not file names"),
    "dotdot": ({"weight_map": {"a": "../" + SHARD}}, "outside the directory"),
    "absolute": ({"weight_map": {"a": "/etc/passwd"}}, "outside the directory"),
    "subdir": ({"weight_map": {"a": "sub/" + SHARD}}, "outside the directory"),
    "nul": ({"weight_map": {"a": "x\x00.safetensors"}}, "outside the directory"),
    "dot": ({"weight_map": {"a": ".."}}, "outside the directory"),
    "empty-name": ({"weight_map": {"a": ""}}, "outside the directory"),
    "backslash": ({"weight_map": {"a": "..\\x.safetensors"}}, "outside the directory"),
    "surrogate": (b'{"weight_map": {"a": "\\ud800.safetensors"}}', "lone UTF-16 surrogate"),
    "not-safetensors": ({"weight_map": {"a": "config.json"}}, "not .safetensors"),
    "metadata-list": ({"metadata": [], "weight_map": {"a": SHARD}}, "field 'metadata'"),
    "total-size-string": (
        {"metadata": {"total_size": "8"}, "weight_map": {"a": SHARD}},
        "field 'metadata.total_size'",
    ),
    "total-size-negative": (
        {"metadata": {"total_size": -1}, "weight_map": {"a": SHARD}},
        "field 'metadata.total_size'",
    ),
    "deep": (b'{"weight_map": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested deeper"),
    "nan": (b'{"metadata": {"total_size": NaN}, "weight_map": {}}', "NaN"),
    "huge-number": (b'{"metadata": {"total_size": 1e400}, "weight_map": {}}', "not finite"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_INDEXES))
def test_hostile_indexes_are_named_errors(tmp_path: Path, case: str) -> None:
    index, expect = HOSTILE_INDEXES[case]
    message = _problems(_index_dir(tmp_path, index))
    assert INDEX_NAME in message and expect in message, message


def test_oversized_json_files_are_refused_before_parsing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(verify_module, "MAX_JSON_BYTES", 64)
    d = _index_dir(tmp_path, {"weight_map": {"a": SHARD}, "metadata": {"pad": "x" * 100}})
    assert f"index {INDEX_NAME} is larger than 64 bytes" in _problems(d)


# ---------------------------------------------------------------- hostile manifest
HOSTILE_MANIFESTS: dict[str, tuple[Any, str]] = {
    "not-object": (lambda m: [m], "is not a JSON object"),
    "format": (lambda m: {**m, "format": "other"}, "field 'format'"),
    "version-string": (lambda m: {**m, "version": "1"}, "field 'version' '1'"),
    "version-float": (lambda m: {**m, "version": 1.5}, "field 'version' 1.5"),
    "version-bool": (lambda m: {**m, "version": True}, "field 'version' True"),
    "version-negative": (lambda m: {**m, "version": -1}, "field 'version' -1"),
    "version-huge": (lambda m: {**m, "version": 10**30}, "field 'version'"),
    "files-list": (lambda m: {**m, "files": list(m["files"])}, "no 'files' mapping"),
    "file-name-dotdot": (
        lambda m: {**m, "files": {**m["files"], "../x": m["files"][INDEX_NAME]}},
        "field 'files' entry '../x'",
    ),
    "file-name-absolute": (
        lambda m: {**m, "files": {"/etc/passwd": {"size": 1}}},
        "field 'files' entry '/etc/passwd'",
    ),
    "file-entry-list": (lambda m: _file(m, [1, "x"]), "not an object"),
    "size-negative": (
        lambda m: _file(m, {**m["files"][INDEX_NAME], "size": -1}),
        "field 'size' -1",
    ),
    "size-float": (
        lambda m: _file(m, {**m["files"][INDEX_NAME], "size": 10.0}),
        "field 'size' 10.0",
    ),
    "size-huge": (lambda m: _file(m, {**m["files"][INDEX_NAME], "size": 10**30}), "field 'size'"),
    "size-bool": (
        lambda m: _file(m, {**m["files"][INDEX_NAME], "size": True}),
        "field 'size' True",
    ),
    "sha-int": (lambda m: _file(m, {**m["files"][INDEX_NAME], "sha256": 5}), "field 'sha256' 5"),
    "sha-short": (
        lambda m: _file(m, {**m["files"][INDEX_NAME], "sha256": "abc"}),
        "field 'sha256' 'abc'",
    ),
    "sha-upper": (
        lambda m: _file(m, {**m["files"][INDEX_NAME], "sha256": "A" * 64}),
        "field 'sha256'",
    ),
    "sha-list": (
        lambda m: _file(m, {**m["files"][INDEX_NAME], "sha256": ["0" * 64]}),
        "field 'sha256'",
    ),
    "keys-missing": (lambda m: {k: v for k, v in m.items() if k != "keys"}, "field 'keys'"),
    "keys-ints": (lambda m: {**m, "keys": [1, 2]}, "field 'keys'"),
    "keys-duplicate": (lambda m: {**m, "keys": m["keys"] + m["keys"][:1]}, "lists a key twice"),
}


def _file(manifest: dict[str, Any], info: Any) -> dict[str, Any]:
    return {**manifest, "files": {**manifest["files"], INDEX_NAME: info}}


@pytest.mark.parametrize("case", sorted(HOSTILE_MANIFESTS))
def test_hostile_manifests_are_named_errors(export_dir: Path, case: str) -> None:
    change, expect = HOSTILE_MANIFESTS[case]
    path = export_dir / MANIFEST_NAME
    path.write_text(json.dumps(change(json.loads(path.read_text()))))
    message = _problems(export_dir)
    assert MANIFEST_NAME in message and expect in message, message


@pytest.mark.parametrize(
    "raw",
    [b"[" * 100_000 + b"]" * 100_000, b"1e400", b'{"version": NaN}', b'"x"', b"[]", b"\xff"],
    ids=["deep", "huge-number", "nan", "string", "list", "not-utf8"],
)
def test_hostile_manifest_json(export_dir: Path, raw: bytes) -> None:
    (export_dir / MANIFEST_NAME).write_bytes(raw)
    message = _problems(export_dir)
    assert f"manifest {MANIFEST_NAME}" in message


# ---------------------------------------------------------------- hostile config.json
@pytest.mark.parametrize(
    "raw,expect",
    [
        (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nested deeper"),
        (b"[1, 2]", "not a JSON object"),
        (b'"llama"', "not a JSON object"),
        (b'{"rope_theta": Infinity}', "Infinity"),
        (b'{"rope_theta": 1e999}', "not finite"),
        (b"{", "invalid JSON"),
    ],
    ids=["deep", "list", "string", "infinity", "huge", "truncated"],
)
def test_hostile_config_json(tmp_path: Path, raw: bytes, expect: str) -> None:
    d = tmp_path / "save"
    d.mkdir()
    save_file({"a": torch.ones(2)}, d / "model.safetensors")
    (d / "config.json").write_bytes(raw)
    message = _problems(d)
    assert "config.json" in message and expect in message, message
    with pytest.raises(ExportVerificationError, match=r"config\.json"):
        HFExporter(tmp_path / "exports").adopt(d, 1, expected_keys=["a"])


def test_a_hostile_template_config_fails_the_export(tmp_path: Path) -> None:
    template = tmp_path / "template"
    template.mkdir()
    (template / "config.json").write_bytes(b"[" * 5000 + b"]" * 5000)
    exporter = HFExporter(tmp_path / "exports", template_dir=template)
    handle = exporter.start(small_tensors(), 1)
    with pytest.raises(Exception, match=r"config\.json"):
        handle.wait(30)
    assert handle.lifecycle.state == "failed" and exporter.latest_ready() is None


def test_inspect_rejects_non_string_expected_keys(export_dir: Path) -> None:
    with pytest.raises(ExportInputError, match="expected_keys"):
        inspect_hf_dir(export_dir, expected_keys=[1, 2])  # type: ignore[list-item]
    with pytest.raises(ExportInputError, match="expected_keys"):
        inspect_hf_dir(export_dir, expected_keys="layers.0.weight")


# ---------------------------------------------------------------- the bounded JSON parser
def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


def _random_json(rng: random.Random, depth: int) -> Any:
    alphabet = '[]{}"\\ab,:'
    if depth == 0 or rng.random() < 0.2:
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(8)))
    if rng.random() < 0.5:
        return [_random_json(rng, depth - 1) for _ in range(rng.randrange(4))]
    return {
        "".join(rng.choice(alphabet) for _ in range(rng.randrange(6))): _random_json(rng, depth - 1)
        for _ in range(rng.randrange(4))
    }


def test_depth_prescan_matches_real_nesting() -> None:
    rng = random.Random(12)
    for _ in range(400):
        value = _random_json(rng, rng.randrange(1, 12))
        data = json.dumps(value, ensure_ascii=rng.random() < 0.5).encode()
        real = _depth(value)
        for limit in range(max(0, real - 2), real + 2):
            assert json_depth_exceeds(data, limit) == (real > limit), (data, limit)
        assert loads_bounded(data, max_depth=max(real, 1)) == value


def test_depth_prescan_across_chunk_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    import rollsafe.wire.strict_json as strict_json

    monkeypatch.setattr(strict_json, "_CHUNK", 7)
    value = {"k[": ["]]]", {"x": [[['\\"[[[']]]}], "z": "{{{{"}
    data = json.dumps(value).encode()
    assert not json_depth_exceeds(data, 6) and json_depth_exceeds(data, 5)


@pytest.mark.parametrize(
    "raw",
    [
        b"NaN",
        b"[Infinity]",
        b"-Infinity",
        b"1e400",
        b"-1e400",
        b"1" * 41,
        b'{"a":1,"a":2}',
        b"\xc3\x28",
        b'{"a": 1',
        b"[" * 2000 + b"]" * 2000,
        b"\xef\xbb\xbf{}",
    ],
)
def test_loads_bounded_raises_only_badjson(raw: bytes) -> None:
    with pytest.raises(BadJSON):
        loads_bounded(raw)


# ====================================================================== 5. adopt
@pytest.mark.parametrize("version", [1.5, True, False, -1, "3", None, 2.0])
def test_adopt_validates_its_version_like_start(
    export_dir: Path, tmp_path: Path, version: Any
) -> None:
    exporter = HFExporter(tmp_path / "other")
    with pytest.raises(ExportInputError, match="version must be an int >= 0") as adopt_error:
        exporter.adopt(export_dir, version)
    with pytest.raises(ExportInputError) as start_error:
        exporter.start(small_tensors(), version)
    assert str(adopt_error.value) == str(start_error.value)
    assert exporter.exports() == []


def test_adopt_an_export_with_manifest_and_config(export_dir: Path, tmp_path: Path) -> None:
    exporter = HFExporter(tmp_path / "other")
    record = exporter.adopt(export_dir, 1)  # the manifest says which keys it must hold
    assert record.adopted and record.state == "ready" and record.verified is not None
    assert record.verified.checksums_verified
    exporter.release(exporter.lease(1, full=True))


def test_adopt_refuses_a_version_other_than_the_manifests(export_dir: Path, tmp_path: Path) -> None:
    exporter = HFExporter(tmp_path / "other")
    with pytest.raises(ExportVerificationError, match=f"{MANIFEST_NAME}: field 'version' is 1"):
        exporter.adopt(export_dir, 2)
    assert exporter.exports() == []


def test_adopt_refuses_a_save_without_config_json(export_dir: Path, tmp_path: Path) -> None:
    (export_dir / "config.json").unlink()
    _rewrite_json(export_dir / MANIFEST_NAME, lambda m: m["files"].pop("config.json"))
    assert verify_hf_dir(export_dir).checksums_verified  # a valid export, but not adoptable
    exporter = HFExporter(tmp_path / "other")
    with pytest.raises(ExportVerificationError, match=r"config\.json is missing"):
        exporter.adopt(export_dir, 1)
    assert exporter.exports() == []


def test_adopt_refuses_a_save_without_manifest_unless_keys_are_given(tmp_path: Path) -> None:
    d = tmp_path / "save"
    d.mkdir()
    tensors = small_tensors()
    save_file({k: v.contiguous() for k, v in tensors.items()}, d / "model.safetensors")
    (d / "config.json").write_text(json.dumps(CONFIG))
    exporter = HFExporter(tmp_path / "exports")
    with pytest.raises(ExportVerificationError) as info:
        exporter.adopt(d, 1)
    assert f"{MANIFEST_NAME} is missing" in str(info.value) and "expected_keys" in str(info.value)
    assert str(tmp_path) not in str(info.value)
    with pytest.raises(ExportVerificationError, match="expected key"):
        exporter.adopt(d, 1, expected_keys=[*tensors, "lm_head.weight"])
    assert exporter.exports() == []
    record = exporter.adopt(d, 1, expected_keys=tensors)
    assert record.state == "ready" and not record.verified.checksums_verified  # type: ignore[union-attr]


def test_adopt_refuses_a_non_path(tmp_path: Path) -> None:
    with pytest.raises(ExportInputError, match="path"):
        HFExporter(tmp_path).adopt(123, 1)  # type: ignore[arg-type]


# ====================================================================== 6. no host paths
def test_messages_show_only_the_export_directory_name(tmp_path: Path, export_dir: Path) -> None:
    deep = tmp_path / "secret-host-area" / "nested"
    deep.mkdir(parents=True)
    for case in ("missing", "file", "shard-link"):
        target = deep / f"case-{case}"
        if case == "file":
            target.write_text("x")
        elif case == "shard-link":
            shutil.copytree(export_dir, target)
            shard = _shards(target)[0]
            _link_outside(deep, shard)
        message = _problems(target)
        assert "secret-host-area" not in message and str(deep) not in message, message
        assert message.startswith(f"case-{case}: ")


def test_file_identity_compares_all_fields() -> None:
    a = FileIdentity("x", 1, 2, 3, 4)
    assert a.same_file(FileIdentity("y", 1, 2, 3, 4))
    for changed in (
        FileIdentity("x", 9, 2, 3, 4),
        FileIdentity("x", 1, 9, 3, 4),
        FileIdentity("x", 1, 2, 9, 4),
        FileIdentity("x", 1, 2, 3, 9),
        FileIdentity("x", 1, 2, 3, 4, symlink=True),
    ):
        assert not a.same_file(changed)


def test_an_unfit_export_is_retired_normally(tmp_path: Path) -> None:
    exporter = HFExporter(tmp_path, keep_last=1)
    path = exporter.start(small_tensors(1), 1).wait(30)
    _shards(path)[0].write_bytes(b"\x00")
    with pytest.raises(ExportVerificationError):
        exporter.lease(1)
    assert exporter.latest_ready() is None
    exporter.start(small_tensors(2), 2).wait(30)  # supersedes and deletes the unfit v1
    assert [r.version for r in exporter.exports()] == [2] and not path.exists()
    assert exporter._unfit == {}  # nothing stale left for a later export of version 1
    exporter.release(exporter.lease(2))
