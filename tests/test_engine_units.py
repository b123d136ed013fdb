"""Unit tests: the flattened-bucket wire format, the weight checksum, and the reference engine's
path checks, tokenizer loading and rank start-up options (no engine process)."""

from __future__ import annotations

import base64
import os
import pickle
from pathlib import Path

import pytest
import torch

from rollsafe.checksum import tensor_digest, weights_checksum
from rollsafe.transports.bucket import (
    BucketFormatError,
    FlatBucket,
    TensorMeta,
    deserialize_payload,
    pack_buckets,
    serialize_bucket,
    serialize_named_tensors,
    unpack_bucket,
)


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(4, 8, generator=g)),
        ("b", torch.randn(16, generator=g).to(torch.bfloat16)),
        ("c", torch.randn(3, 3, generator=g)),
        ("d", torch.arange(6, dtype=torch.int64).view(2, 3)),
        ("e", torch.randn(100, generator=g)),
    ]


def test_pack_unpack_roundtrip_respects_dtype_and_size() -> None:
    named = _named()
    buckets = list(pack_buckets(named, bucket_bytes=200))
    for b in buckets:
        b.validate()
        assert len({m.dtype for m in b.metas}) == 1
        assert b.nbytes <= 200 or len(b.metas) == 1
    got = {n: t for b in buckets for n, t in unpack_bucket(b).items()}
    assert list(got) != []
    for name, t in named:
        assert torch.equal(got[name], t) and got[name].dtype == t.dtype


def test_serialize_roundtrip_shared_memory() -> None:
    named = _named()
    for b in pack_buckets(named, bucket_bytes=1 << 20):
        payload = deserialize_payload(serialize_bucket(b))
        assert isinstance(payload, FlatBucket)
        for (n1, t1), (n2, t2) in zip(payload.named_views(), b.named_views(), strict=True):
            assert n1 == n2 and torch.equal(t1, t2)
    plain = deserialize_payload(serialize_named_tensors(named[:2]))
    assert isinstance(plain, list) and [n for n, _ in plain] == ["a", "b"]


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("echo pwned > /tmp/rollsafe-pwned",))


def test_restricted_unpickler_refuses_arbitrary_globals() -> None:
    evil = base64.b64encode(pickle.dumps({"flattened_tensor": _Evil(), "metadata": []})).decode()
    with pytest.raises(BucketFormatError, match="not allowed"):
        deserialize_payload(evil)
    with pytest.raises(BucketFormatError, match="base64"):
        deserialize_payload("not base64 !!!")


def test_bucket_metadata_mismatch_is_named() -> None:
    flat = torch.zeros(6)
    bad = FlatBucket(flat, (TensorMeta("w", "float32", (2, 2), 0, 4),))
    with pytest.raises(BucketFormatError, match="covers 4 elements"):
        bad.validate()
    bad2 = FlatBucket(flat, (TensorMeta("w", "bfloat16", (2, 3), 0, 6),))
    with pytest.raises(BucketFormatError, match="'w'"):
        bad2.validate()


def test_checksum_is_canonical() -> None:
    t = torch.arange(12, dtype=torch.float32).view(3, 4)
    assert tensor_digest(t) == tensor_digest(t.clone())
    assert tensor_digest(t.t()) == tensor_digest(t.t().contiguous())
    assert tensor_digest(t) != tensor_digest(t.view(4, 3))  # shape is part of the digest
    assert tensor_digest(t) != tensor_digest(t.to(torch.float64))  # so is dtype
    a = weights_checksum({"x": t, "y": t + 1})
    b = weights_checksum([("y", t + 1), ("x", t)])
    assert a == b and set(a["tensors"]) == {"x", "y"}
    assert weights_checksum({"x": t, "y": t})["model"] != a["model"]
    with pytest.raises(ValueError, match="'x' appears twice"):
        weights_checksum([("x", t), ("x", t)])


# ---- start-up and path checks of the reference engine (no engine process) -------------------
def test_check_dir_turns_os_errors_into_named_400s(tmp_path: Path) -> None:
    from rollsafe.adapters.reference_engine.errors import WeightUpdateError
    from rollsafe.adapters.reference_engine.weights import check_model_path, read_checkpoint_dir

    assert check_model_path(str(tmp_path)) == tmp_path
    long_path = "/" + "a" * 5000
    with pytest.raises(WeightUpdateError, match="File name too long") as info:
        check_model_path(long_path)
    assert "'/aaaa" in str(info.value) and "(5001 characters)" in str(info.value)
    assert len(str(info.value)) < 400  # the path is named, not dumped
    with pytest.raises(WeightUpdateError, match="File name too long"):
        read_checkpoint_dir(str(tmp_path / ("c" * 300)), {})
    with pytest.raises(WeightUpdateError, match="is not a directory"):
        check_model_path(str(tmp_path / "nul\0byte"))
    with pytest.raises(WeightUpdateError, match="non-empty path"):
        check_model_path(123)
    assert WeightUpdateError.status == 400


def test_check_dir_permission_denied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rollsafe.adapters.reference_engine.errors import WeightUpdateError
    from rollsafe.adapters.reference_engine.weights import check_model_path

    def denied(self: Path) -> bool:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "is_dir", denied)
    with pytest.raises(WeightUpdateError, match="Permission denied") as info:
        check_model_path(str(tmp_path))
    assert str(tmp_path) in str(info.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory")
def test_check_dir_unreadable_directory(tmp_path: Path) -> None:
    from rollsafe.adapters.reference_engine.errors import WeightUpdateError
    from rollsafe.adapters.reference_engine.weights import check_model_path

    locked = tmp_path / "locked"
    (locked / "inner").mkdir(parents=True)
    locked.chmod(0)
    try:
        with pytest.raises(WeightUpdateError, match="Permission denied"):
            check_model_path(str(locked / "inner"))
    finally:
        locked.chmod(0o700)


def test_text_codec_errors_name_the_path(tmp_path: Path) -> None:
    from rollsafe.adapters.reference_engine.codec import TextCodec
    from rollsafe.adapters.reference_engine.errors import BadRequest, StartupError

    assert TextCodec(tmp_path).tokenizer is None  # optional in the model directory
    with pytest.raises(BadRequest, match="--tokenizer-path"):
        TextCodec(tmp_path).encode("hello")
    with pytest.raises(StartupError, match=r"has no tokenizer\.json"):
        TextCodec(tmp_path, required=True)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(StartupError, match="cannot be loaded as a tokenizer") as info:
        TextCodec(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(info.value)


def test_rank_start_options() -> None:
    from rollsafe.adapters.reference_engine.bootstrap import (
        START_FAULT_ENV,
        RankOptions,
        fork_is_safe,
        start_fault,
    )

    assert RankOptions("m").planned_start_method() == "fork"
    assert RankOptions("m", device="cuda").planned_start_method() == "spawn"
    assert RankOptions("m", start_method="spawn").planned_start_method() == "spawn"
    assert not fork_is_safe(RankOptions("m", device="cuda"))  # CUDA state never crosses a fork
    assert RankOptions("m", world_size=2, threads=3).torch_threads() == 3
    assert RankOptions("m", world_size=64).torch_threads() == 1
    env = {"ROLLSAFE_FAULT_INJECTION": "1", START_FAULT_ENV: "1:2.5, 2:fail"}
    assert start_fault(1, env) == "2.5" and start_fault(2, env) == "fail"
    assert start_fault(0, env) is None
    assert start_fault(1, {START_FAULT_ENV: "1:fail"}) is None  # needs fault injection on


def test_rank_setup_refuses_nccl_on_a_shared_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollsafe.adapters.reference_engine.bootstrap import RankOptions
    from rollsafe.adapters.reference_engine.errors import StartupError
    from rollsafe.adapters.reference_engine.ranks import check_rank_setup, rank_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    shared = RankOptions("m", device="cuda", world_size=2, rank_backend="nccl")
    assert rank_devices(shared) == ["cuda:0", "cuda:0"]
    with pytest.raises(StartupError, match="NCCL refuses two ranks on one device"):
        check_rank_setup(shared)
    check_rank_setup(RankOptions("m", device="cuda", world_size=2))  # gloo: fine
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_rank_setup(shared)  # one GPU per rank
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(StartupError, match=r"torch\.cuda\.is_available"):
        check_rank_setup(RankOptions("m", device="cuda"))
