"""Flattened-bucket wire format shared by weight senders and receivers.

Owns both halves of SGLang 0.5.23's ``flattened_bucket`` format, used by
``/update_weights_from_tensor`` (``load_format="flattened_bucket"``), and the packing rules the
flattened ``/update_weights_from_distributed`` shares:

* packing (sender, internal): named tensors are grouped by dtype (order preserved) and
  concatenated into 1-D buffers of at most ``bucket_bytes`` bytes each (a tensor larger than that
  gets a bucket of its own); every tensor is described by a :class:`TensorMeta` (name, dtype,
  shape, element offsets), and a :class:`FlatBucket` yields named views into its buffer;
* the wire (both ends): a bucket travels as SGLang's pickled ``{"flattened_tensor": uint8
  buffer, "metadata": [FlattenedTensorMetadata(name, shape: torch.Size, dtype: torch.dtype,
  start_idx, end_idx, numel), ...]}`` with **byte** offsets, the buffer named by torch's
  multiprocessing reductions (shared memory with the ``file_system`` strategy on CPU, CUDA IPC
  handles on GPU), base64-encoded as SGLang's ``MultiprocessingSerializer`` does. The metadata
  class is written under SGLang's own global name (its unpickler allow-list admits it) without
  importing SGLang; :class:`FlattenedTensorMetadata` is rollsafe's field-for-field stand-in;
* decoding (receiver): a restricted unpickler that only admits torch's tensor/storage rebuild
  functions, dtypes, ``torch.Size`` and SGLang's metadata class (mapped to the stand-in), then
  checks every entry (types, byte ranges inside the buffer, sizes that match shape and dtype,
  aligned offsets) and returns a :class:`WireBucket`.

The sender must keep the buckets it serialized alive until the receiver answered: the payload
only names shared memory, it does not carry the bytes.
"""

from __future__ import annotations

import base64
import binascii
import collections
import functools
import hashlib
import io
import math
import pickle
import struct
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing

from rollsafe.errors import BucketFormatError, InvalidArgument
from rollsafe.wire import shm, unpickle
from rollsafe.wire.dtypes import WIRE_DTYPES, dtype_from_name, dtype_name

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "PAYLOAD_FORMAT",
    "SGLANG_METADATA_GLOBAL",
    "FlatBucket",
    "FlattenedTensorMetadata",
    "TensorMeta",
    "WireBucket",
    "deserialize_payload",
    "pack_buckets",
    "packed_chunks",
    "serialize_bucket",
    "serialize_named_tensors",
    "unpack_bucket",
]

DEFAULT_BUCKET_BYTES = 256 << 20
#: the ``load_format`` of the bucket format (SGLang's name)
PAYLOAD_FORMAT = "flattened_bucket"


@dataclass(frozen=True)
class TensorMeta:
    """Where one named tensor lives inside a flat bucket (offsets count elements)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start

    def __reduce__(self) -> tuple[Any, tuple[str, str, tuple[int, ...], int, int]]:
        # a plain constructor call: unpickling ~400 of these is several times cheaper than the
        # default dataclass reduction (object.__new__ + state), and needs no other global
        return (TensorMeta, (self.name, self.dtype, self.shape, self.start, self.end))


@dataclass
class FlatBucket:
    """A 1-D dtype-homogeneous buffer and the metadata that splits it into named tensors."""

    flat: torch.Tensor
    metas: tuple[TensorMeta, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.flat.dtype

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metas]

    def validate(self) -> None:
        """Check that the metadata tiles the buffer exactly; raise :class:`BucketFormatError`."""
        if self.flat.dim() != 1:
            raise BucketFormatError(
                f"flattened_tensor must be 1-D, got shape {tuple(self.flat.shape)}"
            )
        want = dtype_name(self.flat.dtype)
        pos = 0
        seen: set[str] = set()
        for m in self.metas:
            if not isinstance(m, TensorMeta):
                raise BucketFormatError(f"metadata entry {m!r} is not a TensorMeta")
            if m.name in seen:
                raise BucketFormatError(f"tensor {m.name!r} appears twice in one bucket")
            seen.add(m.name)
            if m.dtype != want:
                raise BucketFormatError(
                    f"tensor {m.name!r}: metadata dtype {m.dtype} but the bucket is {want}"
                )
            if any((not isinstance(d, int)) or d < 0 for d in m.shape):
                raise BucketFormatError(f"tensor {m.name!r}: bad shape {m.shape!r}")
            if m.start != pos or m.numel != math.prod(m.shape):
                raise BucketFormatError(
                    f"tensor {m.name!r}: offsets [{m.start}, {m.end}) do not match shape "
                    f"{list(m.shape)} at position {pos}"
                )
            pos = m.end
        if pos != self.flat.numel():
            raise BucketFormatError(
                f"metadata covers {pos} elements but the flat buffer holds {self.flat.numel()}"
            )

    def named_views(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, view)`` pairs in bucket order; views share the bucket's memory.

        Built with one ``as_strided`` per tensor (contiguous strides): a few times cheaper
        than slicing and reshaping, which counts with the ~400 tensors of a real model. Call
        :meth:`validate` first for metadata that did not come from this process."""
        flat, base = self.flat, self.flat.storage_offset()
        return [
            (m.name, flat.as_strided(m.shape, _contiguous_strides(m.shape), base + m.start))
            for m in self.metas
        ]


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(1, shape[i + 1])
    return tuple(strides)


def pack_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    *,
    device: torch.device | str | None = None,
) -> Iterator[FlatBucket]:
    """Pack ``(name, tensor)`` pairs into dtype-homogeneous flat buckets of <= ``bucket_bytes``.

    Tensors keep their relative order within a dtype; one dtype's open bucket is flushed when
    the next tensor would overflow it. A tensor bigger than ``bucket_bytes`` is alone in its
    bucket. ``device`` moves the buckets (default: the tensors' own device).
    """
    if bucket_bytes <= 0:
        raise InvalidArgument("bucket_bytes", f"bucket_bytes must be positive, got {bucket_bytes}")
    open_: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    sizes: dict[torch.dtype, int] = {}
    seen: set[str] = set()

    def flush(dtype: torch.dtype) -> FlatBucket:
        items = open_.pop(dtype)
        sizes.pop(dtype)
        metas: list[TensorMeta] = []
        parts: list[torch.Tensor] = []
        pos = 0
        for name, t in items:
            n = t.numel()
            metas.append(TensorMeta(name, dtype_name(dtype), tuple(t.shape), pos, pos + n))
            parts.append(t.detach().contiguous().reshape(-1))
            pos += n
        flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        if device is not None:
            flat = flat.to(device)
        return FlatBucket(flat, tuple(metas))

    for name, tensor in named_tensors:
        if name in seen:
            raise BucketFormatError(f"tensor {name!r} given twice")
        seen.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        dt = tensor.dtype
        if dt in open_ and sizes[dt] + nbytes > bucket_bytes:
            yield flush(dt)
        open_.setdefault(dt, []).append((name, tensor))
        sizes[dt] = sizes.get(dt, 0) + nbytes
    for dt in list(open_):
        yield flush(dt)


def packed_chunks(sizes: Sequence[int], chunk_bytes: int | None) -> list[tuple[int, int]]:
    """``[start, end)`` index ranges of the broadcasts of one packed call, by byte ``sizes``.

    ``None``: one chunk (SGLang's flattened ``update_weights_from_distributed``). Otherwise
    vLLM 0.33.0's packed rule, which sender and receiver must share
    (``packed_nccl_broadcast_producer`` / ``_consumer``): tensors join the open chunk until its
    size *exceeds* ``chunk_bytes`` (the init info's ``packed_buffer_size_bytes``), then the next
    tensor opens a new chunk.
    """
    if not sizes:
        return []
    if chunk_bytes is None:
        return [(0, len(sizes))]
    out: list[tuple[int, int]] = []
    start = total = 0
    for i, size in enumerate(sizes):
        total += size
        if total > chunk_bytes:
            out.append((start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes):
        out.append((start, len(sizes)))
    return out


def unpack_bucket(bucket: FlatBucket) -> dict[str, torch.Tensor]:
    """Validate ``bucket`` and return ``{name: view}`` (views into the flat buffer)."""
    bucket.validate()
    return dict(bucket.named_views())


# ---------------------------------------------------------------------------------- wire format
#: Where SGLang 0.5.23 defines its bucket metadata class; its unpickler allow-list names it, so
#: the payload must name it too (rollsafe's own :class:`FlattenedTensorMetadata` stands in for
#: it on both ends: the sender writes that global, the reference engine maps it back).
SGLANG_METADATA_GLOBAL = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
_METADATA_FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")


class FlattenedTensorMetadata:
    """One tensor of a wire bucket, field for field SGLang's ``FlattenedTensorMetadata``.

    Offsets and ``numel`` count **bytes** of the bucket's ``uint8`` buffer (SGLang's
    ``FlattenedTensorBucket`` flattens every tensor with ``view(torch.uint8)``); ``shape`` is a
    ``torch.Size`` and ``dtype`` a ``torch.dtype``. A plain class rather than a dataclass: the
    unpickler builds ~400 of these per update, and a plain instance builds several times faster.
    """

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int

    def __init__(
        self,
        name: str,
        shape: torch.Size,
        dtype: torch.dtype,
        start_idx: int,
        end_idx: int,
        numel: int,
    ) -> None:
        self.name = name
        self.shape = shape
        self.dtype = dtype
        self.start_idx = start_idx
        self.end_idx = end_idx
        self.numel = numel

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k, None)!r}" for k in _METADATA_FIELDS)
        return f"FlattenedTensorMetadata({fields})"


@dataclass
class WireBucket:
    """A decoded ``flattened_bucket`` payload: a 1-D ``uint8`` buffer and its metadata."""

    flat: torch.Tensor
    metadata: tuple[FlattenedTensorMetadata, ...]

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metadata]

    def named_views(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, view)`` pairs, the tensors SGLang's ``reconstruct_tensors`` builds (byte
        slice, ``view(dtype)``, ``view(shape)``); the views share the buffer's memory.

        A bucket of one dtype (what rollsafe sends) is viewed as that dtype once and cut with
        one ``as_strided`` per tensor: a few times cheaper with the ~400 tensors of a model."""
        flat = self.flat
        dtypes = {m.dtype for m in self.metadata}
        if len(dtypes) == 1:
            (dtype,) = dtypes
            size = dtype.itemsize
            if flat.numel() % size == 0 and flat.storage_offset() % size == 0:
                typed = flat.view(dtype)
                base = typed.storage_offset()
                return [
                    (
                        m.name,
                        typed.as_strided(
                            m.shape, _contiguous_strides(tuple(m.shape)), base + m.start_idx // size
                        ),
                    )
                    for m in self.metadata
                ]
        return [
            (m.name, flat[m.start_idx : m.end_idx].view(m.dtype).view(m.shape))
            for m in self.metadata
        ]


def _op_str(text: str) -> bytes:
    raw = text.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(raw)) + raw


def _op_int(value: int) -> bytes:
    if 0 <= value < 256:
        return b"K" + bytes((value,))
    if -(1 << 31) <= value < (1 << 31):
        return b"J" + struct.pack("<i", value)
    raw = pickle.encode_long(value)
    return b"\x8a" + bytes((len(raw),)) + raw


def _op_tuple(items: list[bytes]) -> bytes:
    """A tuple as pickle writes it (``EMPTY_TUPLE``, ``TUPLE1..3``, else ``MARK .. TUPLE``)."""
    if not items:
        return b")"
    if len(items) <= 3:
        return b"".join(items) + b"\x85\x86\x87"[len(items) - 1 : len(items)]
    return b"(" + b"".join(items) + b"t"


_META_CLASS_OP = b"c" + "\n".join(SGLANG_METADATA_GLOBAL).encode() + b"\n"
_SIZE_OP = b"ctorch\nSize\n"
_FIELD_OPS = {f: _op_str(f) for f in _METADATA_FIELDS}


def _metadata_ops(metas: tuple[TensorMeta, ...]) -> bytes:
    """Pickle opcodes of SGLang's metadata list for ``metas`` (element offsets -> bytes).

    Exactly what ``pickle`` writes for a list of SGLang's dataclass instances (class global,
    ``NEWOBJ``, state dict, ``BUILD``), emitted directly so the sender needs no SGLang install.
    """
    out = [b"]("]
    for m in metas:
        dtype = dtype_from_name(m.dtype)
        size = torch.empty((), dtype=dtype).element_size()
        shape = _op_tuple([_op_int(int(d)) for d in m.shape]) + b"\x85R"
        out += [
            _META_CLASS_OP,
            b")\x81}(",
            _FIELD_OPS["name"],
            _op_str(m.name),
            _FIELD_OPS["shape"],
            _SIZE_OP,
            shape,
            _FIELD_OPS["dtype"],
            b"ctorch\n" + dtype_name(dtype).encode() + b"\n",
            _FIELD_OPS["start_idx"],
            _op_int(m.start * size),
            _FIELD_OPS["end_idx"],
            _op_int(m.end * size),
            _FIELD_OPS["numel"],
            _op_int(m.numel * size),
            b"ub",
        ]
    out.append(b"e")
    return b"".join(out)


@functools.lru_cache(maxsize=512)
def _cached_metadata_ops(metas: tuple[TensorMeta, ...]) -> bytes:
    return _metadata_ops(metas)


def _tensor_ops(tensor: torch.Tensor) -> bytes:
    """The pickle body (no header, no STOP) of ``tensor`` under torch's multiprocessing
    reductions: shared memory (``file_system``) on CPU, a CUDA IPC handle on GPU. Written
    without memo opcodes, so it can be embedded in another pickle stream."""
    set_strategy: Any = torch.multiprocessing.set_sharing_strategy
    set_strategy("file_system")
    buf = io.BytesIO()
    pickler = ForkingPickler(buf, _PROTOCOL)
    pickler.fast = True  # no PUT/GET: the body is position-independent
    pickler.dump(tensor)
    raw = buf.getvalue()
    return raw[2:-1]  # strip PROTO n ... STOP


_PROTOCOL = 3  # no framing (protocol 4+), bytes as bytes (protocol 2 pickles them via _codecs)


def _dumps(obj: Any) -> str:
    set_strategy: Any = torch.multiprocessing.set_sharing_strategy
    set_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf, 4).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialize_bucket(bucket: FlatBucket, *, validate: bool = True) -> str:
    """One ``serialized_named_tensors`` entry in SGLang's ``flattened_bucket`` format.

    The base64 of a pickled ``{"flattened_tensor": uint8 buffer, "metadata": [SGLang
    FlattenedTensorMetadata, ...]}``, as SGLang's ``MultiprocessingSerializer`` writes it: the
    buffer is the bucket's memory viewed as bytes (no copy), named by shared memory on CPU
    (``file_system`` sharing strategy, set process-wide by this call) or by a CUDA IPC handle
    on GPU. It decodes with SGLang 0.5.23's ``SafeUnpickler`` and ``FlattenedTensorBucket``
    (proven in ``tests/test_sglang_wire.py``). ``validate=False`` skips the metadata check for
    buckets built from a plan that was checked once already.
    """
    if validate:
        bucket.validate()
    if bucket.flat.device.type == "cpu" and not shm.in_namespace(bucket.flat):
        bucket.flat = _shared_copy(bucket.flat)  # the bucket keeps the segment alive
    flat = bucket.flat.detach()
    raw = b"".join(
        (
            b"\x80" + bytes((_PROTOCOL,)) + b"}(",
            _op_str("flattened_tensor"),
            _tensor_ops(flat.view(torch.uint8)),
            _op_str("metadata"),
            _cached_metadata_ops(bucket.metas),
            b"u.",
        )
    )
    return base64.b64encode(raw).decode("ascii")


def _shared_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` copied into a new segment of rollsafe's shared-memory namespace (same dtype,
    shape and values, contiguous): what a CPU tensor must be to travel to an engine."""
    src = tensor.detach().contiguous()
    buf = shm.new_shared_buffer(max(1, src.numel() * src.element_size()))
    out = buf[: src.numel() * src.element_size()].view(src.dtype).view(src.shape)
    out.copy_(src)
    return out


#: CPU copies made by :func:`serialize_named_tensors` for tensors outside rollsafe's shared
#: memory, kept alive (the payload only names them) for the last few payloads
_KEEP_ALIVE: collections.deque[list[torch.Tensor]] = collections.deque(maxlen=32)


def serialize_named_tensors(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
    """Base64 pickle of a plain ``[(name, tensor), ...]`` list (SGLang's ``load_format`` unset).

    CPU tensors that are not in rollsafe's shared-memory namespace travel as copies in it; the
    copies stay alive for the next 32 payloads (send each payload before making that many
    more)."""
    items: list[tuple[str, torch.Tensor]] = []
    copies: list[torch.Tensor] = []
    for name, tensor in named_tensors:
        t = tensor.detach()
        if t.device.type == "cpu" and not shm.in_namespace(t):
            t = _shared_copy(t)
            copies.append(t)
        items.append((str(name), t))
    if copies:
        _KEEP_ALIVE.append(copies)
    return _dumps(items)


_ALLOWED_DTYPES = frozenset(WIRE_DTYPES.values())


def _checked_dims(name: str, shape: tuple[Any, ...] | list[Any]) -> list[int]:
    if not all(type(d) is int and d >= 0 for d in shape):
        raise BucketFormatError(f"tensor {name!r}: bad shape {shape!r}")
    return list(shape)


def _int_field(i: int, meta: FlattenedTensorMetadata, field: str) -> int:
    value = getattr(meta, field)
    if type(value) is not int or value < 0:
        raise BucketFormatError(f"metadata[{i}] ({meta.name!r}): {field} must be an int >= 0")
    return value


def _check_wire_bucket(flat: Any, metas: Any) -> WireBucket:
    """Validate a decoded ``flattened_bucket`` dict's parts (what SGLang's decoder relies on)."""
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        got = (
            f"{flat.dtype} tensor of shape {tuple(flat.shape)}"
            if isinstance(flat, torch.Tensor)
            else type(flat).__name__
        )
        raise BucketFormatError(f"flattened_tensor must be a 1-D uint8 tensor, got {got}")
    if not isinstance(metas, list):
        raise BucketFormatError(f"metadata must be a list, got {type(metas).__name__}")
    if not metas:
        raise BucketFormatError("metadata is empty (SGLang refuses an empty bucket)")
    size = flat.numel()
    base = flat.storage_offset()
    seen: set[str] = set()
    fields = set(_METADATA_FIELDS)
    allowed = _ALLOWED_DTYPES
    for i, m in enumerate(metas):
        if type(m) is not FlattenedTensorMetadata:
            raise BucketFormatError(f"metadata[{i}] is not a FlattenedTensorMetadata")
        if vars(m).keys() != fields:
            raise BucketFormatError(
                f"metadata[{i}] fields {sorted(vars(m))} != {sorted(_METADATA_FIELDS)}"
            )
        name = m.name
        if type(name) is not str or not name:
            raise BucketFormatError(f"metadata[{i}]: name must be a non-empty string")
        if name in seen:
            raise BucketFormatError(f"tensor {name!r} appears twice in one bucket")
        seen.add(name)
        dtype = m.dtype
        if dtype not in allowed:
            raise BucketFormatError(f"tensor {name!r}: dtype {dtype!r} is not supported")
        shape = m.shape
        if type(shape) is not torch.Size:
            if not isinstance(shape, (tuple, list)):
                raise BucketFormatError(f"tensor {name!r}: bad shape {shape!r}")
            shape = m.shape = torch.Size(_checked_dims(name, shape))
        elif any(d < 0 for d in shape):
            raise BucketFormatError(f"tensor {name!r}: bad shape {shape!r}")
        start = _int_field(i, m, "start_idx")
        end = _int_field(i, m, "end_idx")
        numel = _int_field(i, m, "numel")
        item = dtype.itemsize
        want = math.prod(shape) * item
        if end - start != numel or numel != want:
            raise BucketFormatError(
                f"tensor {name!r}: byte range [{start}, {end}) and numel {numel} do not match "
                f"shape {list(shape)} of {dtype_name(dtype)} ({want} bytes)"
            )
        if end > size:
            raise BucketFormatError(
                f"tensor {name!r}: byte range [{start}, {end}) ends past the {size}-byte buffer"
            )
        if (base + start) % item:
            raise BucketFormatError(
                f"tensor {name!r}: byte offset {start} is not aligned to its "
                f"{dtype_name(dtype)} elements"
            )
    return WireBucket(flat, tuple(metas))


_EXTRA_GLOBALS = {SGLANG_METADATA_GLOBAL: FlattenedTensorMetadata}


def _unpickle(raw: bytes) -> Any:
    """:func:`rollsafe.wire.unpickle.loads`: opcode allow-list, rollsafe's own validating
    rebuild functions, shared memory only from rollsafe's namespace; errors named."""
    try:
        return unpickle.loads(raw, extra=_EXTRA_GLOBALS)
    except unpickle.UnsafePayload as exc:
        raise BucketFormatError(str(exc)) from None
    except BucketFormatError:
        raise
    except Exception as exc:
        raise BucketFormatError(f"serialized entry could not be unpickled: {exc}") from None


_METADATA_KEY_OP = _op_str("metadata")


class _ValidatedMetadata:
    """A metadata list that passed :func:`_check_wire_bucket`, and what a new buffer must
    satisfy for it to hold again: enough bytes, and a start aligned like the one it was checked
    with (8 bytes covers every dtype's element size)."""

    def __init__(self, metadata: tuple[FlattenedTensorMetadata, ...]) -> None:
        self.metadata = metadata
        self.end = max(m.end_idx for m in metadata)

    def bind(self, flat: Any) -> WireBucket:
        if (
            not isinstance(flat, torch.Tensor)
            or flat.dtype != torch.uint8
            or flat.dim() != 1
            or flat.numel() < self.end
            or flat.storage_offset() % 8
        ):
            return _check_wire_bucket(flat, list(self.metadata))  # names the problem
        return WireBucket(flat, self.metadata)


class _LRU:
    def __init__(self, size: int) -> None:
        self.size = size
        self._items: collections.OrderedDict[bytes, _ValidatedMetadata] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes) -> _ValidatedMetadata | None:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
            return item

    def put(self, key: bytes, value: _ValidatedMetadata) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)


_METADATA_CACHE = _LRU(64)


def deserialize_payload(data: str | bytes) -> WireBucket | list[tuple[str, torch.Tensor]]:
    """Decode one ``serialized_named_tensors`` entry with the restricted unpickler.

    Returns a validated :class:`WireBucket` for SGLang's ``flattened_bucket`` format, or a list
    of ``(name, tensor)`` for the plain format. Anything else raises :class:`BucketFormatError`.
    The returned tensors are views of the sender's memory: copy them before the sender frees it.
    """
    if not isinstance(data, (str, bytes)):
        raise BucketFormatError(
            f"serialized entry must be a base64 string, got {type(data).__name__}"
        )
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BucketFormatError(f"serialized entry is not valid base64: {exc}") from exc
    cut = raw.rfind(_METADATA_KEY_OP)
    key = b""
    if cut > 0 and raw.endswith(b"u."):
        # a sender repeats its metadata every update: a metadata part validated before is
        # taken from the cache, and only the buffer part is unpickled (the payload ends
        # ``... "metadata" [entries] SETITEMS STOP``, as serialize_bucket writes it)
        key = hashlib.blake2b(raw[cut:], digest_size=16).digest()
        cached = _METADATA_CACHE.get(key)
        if cached is not None:
            obj = _unpickle(raw[:cut] + _METADATA_KEY_OP + b"]u.")
            if isinstance(obj, dict) and set(obj) == {"flattened_tensor", "metadata"}:
                return cached.bind(obj["flattened_tensor"])
    obj = _unpickle(raw)
    if isinstance(obj, dict):
        extra = sorted(set(obj) - {"flattened_tensor", "metadata"})
        if extra:
            raise BucketFormatError(f"bucket payload has unknown keys {extra}")
        bucket = _check_wire_bucket(obj.get("flattened_tensor"), obj.get("metadata"))
        if key and bucket.flat.storage_offset() % 8 == 0:
            _METADATA_CACHE.put(key, _ValidatedMetadata(bucket.metadata))
        return bucket
    if isinstance(obj, list):
        out: list[tuple[str, torch.Tensor]] = []
        for i, item in enumerate(obj):
            if (
                not isinstance(item, (tuple, list))
                or len(item) != 2
                or not isinstance(item[0], str)
                or not isinstance(item[1], torch.Tensor)
            ):
                raise BucketFormatError(f"named tensor entry {i} is not a (name, tensor) pair")
            out.append((item[0], item[1]))
        return out
    raise BucketFormatError(f"unexpected payload type {type(obj).__name__}")
