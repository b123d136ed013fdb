"""rollsafe's SGLang-dialect weight payloads decode with SGLang 0.5.23's own code, and back.

The decoders are the installed upstream files (see ``tests/sglang_decoder.py``): SGLang's
``SafeUnpickler`` and ``FlattenedTensorBucket``, used exactly as SGLang's weight updater uses
them for ``/update_weights_from_tensor`` (``flattened_bucket`` and plain) and for the flattened
``/update_weights_from_distributed`` receive (``FlattenedTensorBucket.empty``).
"""

from __future__ import annotations

import base64
import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest
import torch
from sglang_decoder import load_safe_unpickler, sglang_deserialize, sglang_modules

from rollsafe.errors import BucketFormatError
from rollsafe.wire.bucket import (
    FlattenedTensorMetadata,
    WireBucket,
    _metadata_ops,
    _shared_copy,
    deserialize_payload,
    pack_buckets,
    serialize_bucket,
    serialize_named_tensors,
)


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        ("model.embed_tokens.weight", torch.randn(11, 6, generator=g).to(torch.bfloat16)),
        ("model.layers.0.input_layernorm.weight", torch.randn(5, generator=g)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(6, 6, generator=g).half()),
        ("model.layers.0.mlp.gate", torch.randint(-9, 9, (3, 3), generator=g)),
        ("model.norm.weight", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("lm_head.weight", torch.randn(2, 3, 4, generator=g)),
    ]


def _reconstruct_like_sglang(tb: object, data: dict) -> list[tuple[str, torch.Tensor]]:
    """SGLang's ``_update_weights_from_flattened_bucket``: convert each metadata entry, build the
    bucket, reconstruct the tensors."""
    metas = [
        tb.FlattenedTensorMetadata(  # type: ignore[attr-defined]
            name=m.name,
            shape=m.shape,
            dtype=m.dtype,
            start_idx=m.start_idx,
            end_idx=m.end_idx,
            numel=m.numel,
        )
        for m in data["metadata"]
    ]
    bucket = tb.FlattenedTensorBucket(  # type: ignore[attr-defined]
        flattened_tensor=data["flattened_tensor"], metadata=metas
    )
    return list(bucket.reconstruct_tensors())


def test_flattened_bucket_payload_decodes_with_sglang() -> None:
    named = _named()
    want = dict(named)
    buckets = list(pack_buckets(named, bucket_bytes=200))
    assert len(buckets) > 2  # several buckets, several dtypes
    with sglang_modules() as tb:
        seen: set[str] = set()
        for bucket in buckets:
            data = sglang_deserialize(serialize_bucket(bucket))
            assert set(data) == {"flattened_tensor", "metadata"}
            assert data["flattened_tensor"].dtype == torch.uint8
            assert all(type(m) is tb.FlattenedTensorMetadata for m in data["metadata"])
            for name, tensor in _reconstruct_like_sglang(tb, data):
                assert tensor.dtype == want[name].dtype
                assert torch.equal(tensor, want[name]), name
                seen.add(name)
        assert seen == set(want)


def test_metadata_opcodes_equal_what_pickle_writes_for_sglangs_class() -> None:
    bucket = next(iter(pack_buckets(_named()[:1] + _named()[4:5], bucket_bytes=1 << 20)))
    with sglang_modules() as tb:
        size = bucket.flat.element_size()
        upstream = [
            tb.FlattenedTensorMetadata(
                name=m.name,
                shape=torch.Size(m.shape),
                dtype=bucket.flat.dtype,
                start_idx=m.start * size,
                end_idx=m.end * size,
                numel=m.numel * size,
            )
            for m in bucket.metas
        ]
        buf = io.BytesIO()
        pickler = pickle.Pickler(buf, 3)
        pickler.fast = True
        pickler.dump(upstream)
        assert _metadata_ops(bucket.metas) == buf.getvalue()[2:-1]


def test_big_offsets_use_long_ints_sglang_reads() -> None:
    """Offsets past 2**31 bytes (an 8 GB direct bucket) encode as pickle longs."""
    from rollsafe.wire.bucket import TensorMeta

    start = 3 << 30
    meta = TensorMeta("w", "float32", (4,), start, start + 4)
    raw = b"\x80\x03" + _metadata_ops((meta,)) + b"."
    with sglang_modules():
        (m,) = load_safe_unpickler()(io.BytesIO(raw)).load()
    assert (m.start_idx, m.end_idx, m.numel) == (start * 4, start * 4 + 16, 16)


def test_plain_named_tensor_payload_decodes_with_sglang() -> None:
    named = _named()[:3]
    with sglang_modules():
        decoded = sglang_deserialize(serialize_named_tensors(named))
    assert [n for n, _ in decoded] == [n for n, _ in named]
    for (_, got), (_, want) in zip(decoded, named, strict=True):
        assert torch.equal(got, want)


def test_distributed_flattened_layout_matches_sglang_receive_bucket() -> None:
    """``/update_weights_from_distributed`` with ``flattened_bucket``: SGLang sizes its receive
    buffer with ``FlattenedTensorBucket.empty(names, dtypes, shapes)`` and reconstructs from it;
    the bytes rollsafe broadcasts (the bucket viewed as uint8) must land on the same offsets."""
    with sglang_modules() as tb:
        for bucket in pack_buckets(_named(), bucket_bytes=200):
            names = [m.name for m in bucket.metas]
            dtypes = [m.dtype for m in bucket.metas]  # the request's ``dtypes`` strings
            shapes = [list(m.shape) for m in bucket.metas]
            recv = tb.FlattenedTensorBucket.empty(names, dtypes, shapes, "cpu")
            sent = bucket.flat.view(torch.uint8)
            assert recv.get_flattened_tensor().numel() == sent.numel()
            recv.get_flattened_tensor().copy_(sent)
            for (name, got), (_, want) in zip(
                recv.reconstruct_tensors(), bucket.named_views(), strict=True
            ):
                assert torch.equal(got, want), name


def _sglang_sender_entry(
    named: list[tuple[str, torch.Tensor]], *, rollsafe_shm: bool = True
) -> str:
    """A bucket built with SGLang's ``FlattenedTensorBucket`` and serialized as SGLang does
    (``ForkingPickler``, default protocol, memo). ``rollsafe_shm``: its buffer in rollsafe's
    shared-memory namespace (a CPU engine maps nothing else), else in torch's own segments."""
    torch.multiprocessing.set_sharing_strategy("file_system")
    with sglang_modules() as tb:
        bucket = tb.FlattenedTensorBucket(named_tensors=named)
        flat = bucket.get_flattened_tensor()
        if rollsafe_shm:
            flat = _shared_copy(flat)
            _KEEP.append(flat)
        buf = io.BytesIO()
        ForkingPickler(buf).dump({"flattened_tensor": flat, "metadata": bucket.get_metadata()})
    return base64.b64encode(buf.getvalue()).decode()


_KEEP: list[torch.Tensor] = []  # the payloads only name the memory: keep it for the test run


def test_torch_segments_of_other_processes_are_never_mapped() -> None:
    """The same bucket in torch's own ``/torch_*`` shared memory (any process's) is refused by
    name: the engine maps only rollsafe's namespace, read-only."""
    entry = _sglang_sender_entry([("w", torch.randn(4))], rollsafe_shm=False)
    with pytest.raises(BucketFormatError, match="not a rollsafe segment"):
        deserialize_payload(entry)


def test_reference_decoder_accepts_what_sglangs_own_sender_writes() -> None:
    """A trainer that builds buckets with SGLang's ``FlattenedTensorBucket`` (several dtypes in
    one bucket, every tensor a whole number of 8-byte words) is decoded by the reference engine."""
    named = [
        ("a", torch.randn(4, 6).to(torch.bfloat16)),
        ("b", torch.randn(3, 2)),
        ("c", torch.arange(5, dtype=torch.int64)),
        ("d", torch.randn(8).half()),
    ]
    decoded = deserialize_payload(_sglang_sender_entry(named))
    assert isinstance(decoded, WireBucket)
    assert all(isinstance(m, FlattenedTensorMetadata) for m in decoded.metadata)
    for (name, got), (_, want) in zip(decoded.named_views(), named, strict=True):
        assert got.dtype == want.dtype
        assert torch.equal(got, want), name


def test_misaligned_bucket_fails_in_sglang_and_is_refused_here() -> None:
    """SGLang's own bucket of a 3-byte tensor followed by a float32 one cannot be reconstructed
    by SGLang (``view`` needs an aligned offset): the reference engine refuses it up front."""
    named = [("odd", torch.arange(3, dtype=torch.uint8)), ("f", torch.randn(2))]
    entry = _sglang_sender_entry(named)
    with sglang_modules() as tb:
        data = sglang_deserialize(entry)
        with pytest.raises(RuntimeError, match="divisible"):
            _reconstruct_like_sglang(tb, data)
    with pytest.raises(BucketFormatError, match="not aligned"):
        deserialize_payload(entry)


def test_reference_decoder_refuses_what_sglang_could_not_load() -> None:
    """Misaligned offsets, sizes that disagree with shape and dtype, ranges past the buffer."""
    torch.multiprocessing.set_sharing_strategy("file_system")
    flat = _shared_copy(torch.zeros(64, dtype=torch.uint8))

    def entry(**overrides: object) -> str:
        fields = {
            "name": "w",
            "shape": torch.Size([4]),
            "dtype": torch.float32,
            "start_idx": 0,
            "end_idx": 16,
            "numel": 16,
        }
        fields.update(overrides)
        meta = FlattenedTensorMetadata(**fields)  # type: ignore[arg-type]
        buf = io.BytesIO()
        ForkingPickler(buf, 3).dump({"flattened_tensor": flat, "metadata": [meta]})
        raw = buf.getvalue().replace(
            b"rollsafe.wire.bucket\nFlattenedTensorMetadata",
            b"sglang.srt.weight_sync.tensor_bucket\nFlattenedTensorMetadata",
        )
        return base64.b64encode(raw).decode()

    assert isinstance(deserialize_payload(entry()), WireBucket)
    cases = {
        "not aligned": {"start_idx": 2, "end_idx": 18},
        "do not match shape": {"shape": torch.Size([5])},
        "past the": {"start_idx": 56, "end_idx": 72},
        "must be an int": {"numel": -16},
    }
    for needle, overrides in cases.items():
        with pytest.raises(BucketFormatError, match=needle):
            deserialize_payload(entry(**overrides))


_DECODE_IN_CHILD = """
import hashlib, json, sys
import torch
sys.path.insert(0, sys.argv[1])
from sglang_decoder import load_tensor_bucket, sglang_deserialize
tb = load_tensor_bucket()
out = {}
for entry in json.loads(sys.stdin.read()):
    data = sglang_deserialize(entry)
    metas = [tb.FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype,
             start_idx=m.start_idx, end_idx=m.end_idx, numel=m.numel) for m in data["metadata"]]
    bucket = tb.FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=metas)
    for name, t in bucket.reconstruct_tensors():
        assert t.is_cuda, name
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        out[name] = [str(t.dtype), list(t.shape), hashlib.sha256(raw).hexdigest()]
print(json.dumps(out))
"""


@pytest.mark.gpu
def test_cuda_ipc_bucket_decodes_with_sglang_in_another_process() -> None:
    """The GPU payload (CUDA IPC handles) opened by SGLang's decoder in another process, as an
    SGLang server does: same names, dtypes, shapes and bytes."""
    import hashlib
    import json
    import subprocess
    import sys
    from pathlib import Path

    named = [(n, t.cuda()) for n, t in _named()]
    buckets = list(pack_buckets(named, bucket_bytes=200))
    entries = [serialize_bucket(b) for b in buckets]
    want = {
        n: [
            str(t.dtype),
            list(t.shape),
            hashlib.sha256(
                t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            ).hexdigest(),
        ]
        for n, t in named
    }
    proc = subprocess.run(
        [sys.executable, "-c", _DECODE_IN_CHILD, str(Path(__file__).parent)],
        input=json.dumps(entries),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == want
    del buckets  # the sender keeps the buffers alive until the receiver answered


def test_repeated_metadata_is_taken_from_the_cache_and_still_checked() -> None:
    """A sender's second update reuses the validated metadata; a buffer too small for it is
    still refused, and other metadata is parsed and checked in full."""
    torch.multiprocessing.set_sharing_strategy("file_system")
    bucket = next(iter(pack_buckets(_named()[:2], bucket_bytes=1 << 20)))
    first = deserialize_payload(serialize_bucket(bucket))
    second = deserialize_payload(serialize_bucket(bucket))
    assert isinstance(first, WireBucket) and isinstance(second, WireBucket)
    assert second.metadata is first.metadata  # the cache hit
    for (_, a), (_, b) in zip(second.named_views(), bucket.named_views(), strict=True):
        assert torch.equal(a, b)
    shorter = type(bucket)(bucket.flat[:-1].clone(), bucket.metas)  # same metadata, 1 short
    with pytest.raises(BucketFormatError, match="ends past"):
        deserialize_payload(serialize_bucket(shorter, validate=False))


def test_every_global_of_the_payloads_loads_under_both_sglang_releases() -> None:
    """SGLang 0.5.23's ``SafeUnpickler`` admits an allow-list of globals, 0.5.16's module
    prefixes less a deny-list (both read off the wheels into the contracts). Every global
    rollsafe's payloads reference (flattened and plain, recorded while SGLang 0.5.23's own
    unpickler loads them) is admitted by both."""
    from rollsafe.adapters.engines.contract import load_contract

    recorded: set[tuple[str, str]] = set()
    base = load_safe_unpickler()

    class Recording(base):  # type: ignore[misc, valid-type]
        def find_class(self, module: str, name: str) -> Any:
            recorded.add((module, name))
            return super().find_class(module, name)

    named = _named()
    entries = [serialize_bucket(b) for b in pack_buckets(named, bucket_bytes=200)]
    entries.append(serialize_named_tensors(named[:2]))
    with sglang_modules():
        for entry in entries:
            Recording(io.BytesIO(base64.b64decode(entry))).load()
    assert ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata") in recorded
    for version in ("0.5.16", "0.5.23"):
        contract = load_contract("sglang", version)
        refused = sorted(g for g in recorded if not contract.unpickler_admits(*g))
        assert not refused, (version, refused)
    old = load_contract("sglang", "0.5.16")
    assert not old.unpickler_admits("builtins", "eval")  # its deny-list
    assert not old.unpickler_admits("os", "system")
    assert not load_contract("sglang", "0.5.23").unpickler_admits("builtins", "eval")
