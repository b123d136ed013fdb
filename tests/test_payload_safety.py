"""Hostile weight payloads: refused by name, nothing crashes, no other memory is touched.

Each payload is hand-written pickle bytes (what a local attacker would send to
``/update_weights_from_tensor``): the decoder (:mod:`rollsafe.wire.unpickle`) must refuse it
with a :class:`BucketFormatError` naming what it tried, and over HTTP the engine answers a 400,
keeps serving, and its weights and version do not change.
"""

from __future__ import annotations

import base64
import os
import struct
from pathlib import Path

import pytest
import torch
from engine_helpers import EngineProcess, module_engine, tiny_model_dir  # noqa: F401

from rollsafe.errors import BucketFormatError
from rollsafe.wire import shm
from rollsafe.wire.bucket import (
    WireBucket,
    deserialize_payload,
    pack_buckets,
    serialize_bucket,
)

R = "torch.multiprocessing.reductions"


def op_str(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def op_bytes(raw: bytes) -> bytes:
    return b"C" + bytes((len(raw),)) + raw


def op_int(v: int) -> bytes:
    return b"J" + struct.pack("<i", v)


def glob(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def storage_ops(handle: bytes, size: int) -> bytes:
    """rebuild_typed_storage(rebuild_storage_filename(UntypedStorage, mgr, handle, size), f32)"""
    return (
        glob(R, "rebuild_typed_storage")
        + glob(R, "rebuild_storage_filename")
        + b"("
        + glob("torch.storage", "UntypedStorage")
        + op_bytes(b"/tmp/mgr.sock")
        + op_bytes(handle)
        + op_int(size)
        + b"tR"
        + glob("torch", "float32")
        + b"\x86R"
    )


def tensor_ops(
    storage: bytes, offset: int, size: tuple[int, ...], stride: tuple[int, ...]
) -> bytes:
    dims = b"(" + b"".join(op_int(d) for d in size) + b"t"
    strides = b"(" + b"".join(op_int(d) for d in stride) + b"t"
    meta = b"(" + op_int(offset) + dims + strides + b"\x89t"
    return glob(R, "rebuild_tensor") + b"(" + glob("torch", "Tensor") + storage + meta + b"tR"


def plain_payload(tensor: bytes) -> str:
    """A plain ``[(name, tensor)]`` payload around ``tensor``'s opcodes."""
    return b64(b"\x80\x03](" + op_str("w") + tensor + b"\x86e.")


@pytest.fixture
def segment() -> tuple[str, int]:
    """A real segment of rollsafe's namespace holding 16 float32 values."""
    buf = shm.new_shared_buffer(64)
    buf.view(torch.float32).copy_(torch.arange(16, dtype=torch.float32))
    name = shm.segment_name(buf)
    assert name is not None
    _KEEP.append(buf)
    return name, 64


_KEEP: list[torch.Tensor] = []


def test_a_well_formed_hand_written_payload_decodes(segment: tuple[str, int]) -> None:
    name, size = segment
    got = deserialize_payload(
        plain_payload(tensor_ops(storage_ops(name.encode(), size), 4, (2, 3), (3, 1)))
    )
    assert isinstance(got, list) and got[0][0] == "w"
    assert type(got[0][1]) is torch.Tensor
    assert got[0][1].tolist() == [[4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]


def test_constructor_keyword_arguments_are_refused(segment: tuple[str, int]) -> None:
    """The SIGSEGV of the issue: NEWOBJ_EX hands keyword arguments (``cdata=``) to an allowed
    constructor. Refused by opcode, before anything runs."""
    raw = (
        b"\x80\x04"
        + glob("torch", "UntypedStorage")
        + b")}"
        + op_str("cdata")
        + op_int(12345)
        + b"s\x92."
    )
    with pytest.raises(BucketFormatError, match="NEWOBJ_EX"):
        deserialize_payload(b64(raw))


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"\x80\x03" + glob("os", "system") + op_str("true") + b"\x85R.", "os.system"),
        (b"\x80\x03" + glob("torch", "UntypedStorage") + op_int(8) + b"\x85R.", "not callable"),
        (b"\x80\x03" + glob("torch", "Tensor") + b")\x81.", "Marker"),
        (b"\x80\x03" + op_str("x") + b"Q.", "BINPERSID"),
        (b"\x80\x03" + b"\x82\x01.", "EXT1"),
        (b"\x80\x03(" + glob("torch", "Tensor") + b"o.", "OBJ"),
        (b"\x80\x03" + op_str("x"), "well-formed"),  # truncated: no STOP
    ],
)
def test_globals_and_opcodes_a_payload_never_needs_are_refused(raw: bytes, needle: str) -> None:
    with pytest.raises(BucketFormatError, match=needle):
        deserialize_payload(b64(raw))


def test_a_tensor_cannot_be_re_pointed_by_build(segment: tuple[str, int]) -> None:
    name, size = segment
    tensor = tensor_ops(storage_ops(name.encode(), size), 0, (16,), (1,))
    state = b"(" + op_int(0) + op_int(0) + op_int(0) + op_int(0) + b"t"  # Tensor.set_(*state)
    with pytest.raises(BucketFormatError, match="state"):
        deserialize_payload(plain_payload(tensor + state + b"b"))


@pytest.mark.parametrize(
    ("offset", "size", "stride"),
    [(0, (17,), (1,)), (15, (2,), (1,)), (0, (4, 4), (5, 1)), (0, (2, 2, 2), (8, 4, 4))],
)
def test_views_outside_the_storage_are_refused(
    segment: tuple[str, int], offset: int, size: tuple[int, ...], stride: tuple[int, ...]
) -> None:
    name, nbytes = segment
    with pytest.raises(BucketFormatError, match="reach element"):
        deserialize_payload(
            plain_payload(tensor_ops(storage_ops(name.encode(), nbytes), offset, size, stride))
        )


def test_other_processes_shared_memory_is_never_mapped_grown_or_unlinked(
    segment: tuple[str, int], tmp_path: Path
) -> None:
    name, size = segment
    torch_seg = torch.zeros(4).share_memory_()  # a live torch segment of this process
    handle = torch_seg.untyped_storage()._share_filename_cpu_()[1]  # type: ignore[attr-defined]
    target = Path("/dev/shm") / handle.decode().lstrip("/")
    assert target.exists()
    link = Path(f"/dev/shm/rollsafe-{'0' * 16}-999999")
    link.symlink_to(target)
    try:
        cases = {
            handle: "not a rollsafe segment",  # another segment, by name
            b"/dev/shm/../etc/passwd": "not a rollsafe segment",
            b"/rollsafe-0000000000000000-424242": "cannot be opened",  # no such segment
            str(link)[len("/dev/shm") :].encode(): "cannot be opened",  # a symlink: O_NOFOLLOW
        }
        for bad, needle in cases.items():
            with pytest.raises(BucketFormatError, match=needle):
                deserialize_payload(plain_payload(tensor_ops(storage_ops(bad, 16), 0, (4,), (1,))))
        before = (Path("/dev/shm") / name.lstrip("/")).stat().st_size
        with pytest.raises(BucketFormatError, match="declares"):  # a bigger size: never grown
            deserialize_payload(
                plain_payload(tensor_ops(storage_ops(name.encode(), size * 4), 0, (4,), (1,)))
            )
        assert (Path("/dev/shm") / name.lstrip("/")).stat().st_size == before
        assert target.exists()  # nothing was unlinked
    finally:
        link.unlink()


def test_a_refused_decode_leaves_no_mapping_or_file_behind(segment: tuple[str, int]) -> None:
    name, size = segment
    before = set(os.listdir("/dev/shm"))
    for _ in range(3):
        with pytest.raises(BucketFormatError):
            deserialize_payload(
                plain_payload(tensor_ops(storage_ops(name.encode(), size), 0, (99,), (1,)))
            )
    assert set(os.listdir("/dev/shm")) <= before


# ------------------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def engine(request: pytest.FixtureRequest, tiny_model_dir: Path) -> EngineProcess:  # noqa: F811
    return module_engine(request, tiny_model_dir)


def test_the_engine_answers_400_and_keeps_serving(
    engine: EngineProcess, segment: tuple[str, int]
) -> None:
    before = engine.checksum()
    name, size = segment
    hostile = [
        b64(
            b"\x80\x04"
            + glob("torch", "UntypedStorage")
            + b")}"
            + op_str("cdata")
            + op_int(12345)
            + b"s\x92."
        ),
        plain_payload(tensor_ops(storage_ops(name.encode(), size), 0, (1 << 20,), (1,))),
        plain_payload(tensor_ops(storage_ops(b"/torch_1_2_3", 16), 0, (4,), (1,))),
    ]
    for entry in hostile:
        body = {"serialized_named_tensors": [entry], "weight_version": "X"}
        r = engine.post("/update_weights_from_tensor", body)
        assert r.status_code == 400, r.text
    assert (
        engine.post(
            "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
        ).status_code
        == 200
    )
    assert engine.checksum() == before  # weights and version unchanged
    # and a real payload still goes through
    bucket = next(iter(pack_buckets([("model.norm.weight", torch.ones(16))], 1 << 20)))
    assert isinstance(deserialize_payload(serialize_bucket(bucket)), WireBucket)


def cuda_payload(storage_module: str, storage_name: str, tensor_cls: tuple[str, str]) -> str:
    """What torch pickles for a CUDA tensor (``rebuild_cuda_tensor`` and its 15 arguments)."""
    args = (
        glob(*tensor_cls)
        + glob("torch", "Size")
        + b"("
        + op_int(4)
        + b"t\x85R"
        + b"("
        + op_int(1)
        + b"t"
        + op_int(0)
        + glob(storage_module, storage_name)
        + glob("torch", "float32")
        + op_int(0)
        + op_bytes(b"\x00" * 65)
        + op_int(16)
        + op_int(0)
        + b"\x89"
        + op_bytes(b"/torch_123_456_7")
        + op_int(3)
        + b"N\x89"
    )
    return plain_payload(glob(R, "rebuild_cuda_tensor") + b"(" + args + b"tR")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path a CPU engine takes")
def test_cuda_payload_classes_as_torch_pickles_them() -> None:
    """torch pickles ``type(tensor._typed_storage())`` (TypedStorage) for a CUDA tensor: the
    class check accepts it (and UntypedStorage); a CPU engine then refuses by name. Any other
    tensor or storage class is refused first."""
    for module, name in (("torch.storage", "TypedStorage"), ("torch.storage", "UntypedStorage")):
        with pytest.raises(BucketFormatError, match="without CUDA"):
            deserialize_payload(cuda_payload(module, name, ("torch", "Tensor")))
    with pytest.raises(BucketFormatError, match="unexpected tensor or storage class"):
        deserialize_payload(cuda_payload("torch.storage", "TypedStorage", ("torch", "Size")))
