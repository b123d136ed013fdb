"""Unit tests of the flattened-bucket wire format and the canonical weight checksum."""

from __future__ import annotations

import base64
import os
import pickle

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
