"""Flattened-bucket wire format shared by weight senders and receivers.

Owns both halves of the format used by ``/update_weights_from_tensor`` with
``load_format="flattened_bucket"`` (and by the flattened ``/update_weights_from_distributed``):

* packing: named tensors are grouped by dtype (order preserved) and concatenated into 1-D
  buffers of at most ``bucket_bytes`` bytes each (a tensor larger than that gets a bucket of its
  own); every tensor is described by a :class:`TensorMeta` (name, dtype, shape, element offsets);
* unpacking: a :class:`FlatBucket` yields named views into its flat buffer;
* serialization: a bucket (or a plain list of named tensors) is pickled with torch's
  multiprocessing reductions -- shared memory with the ``file_system`` strategy on CPU, CUDA IPC
  handles on GPU -- and base64-encoded, as SGLang does; the receiver decodes with a restricted
  unpickler that only admits torch's tensor/storage rebuild functions, dtypes and this module's
  :class:`TensorMeta`, so a request cannot run arbitrary code.

The sender must keep the buckets it serialized alive until the receiver answered: the payload
only names shared memory, it does not carry the bytes.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import pickle
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "PAYLOAD_FORMAT",
    "BucketFormatError",
    "FlatBucket",
    "TensorMeta",
    "deserialize_payload",
    "dtype_from_name",
    "dtype_name",
    "pack_buckets",
    "serialize_bucket",
    "serialize_named_tensors",
    "unpack_bucket",
]

DEFAULT_BUCKET_BYTES = 256 << 20
PAYLOAD_FORMAT = "rollsafe.flattened_bucket.v1"

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float32",
        "float16",
        "bfloat16",
        "float64",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "float8_e4m3fn",
        "float8_e5m2",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}


class BucketFormatError(ValueError):
    """A bucket or payload is malformed; the message names the offending tensor or field."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16``; unknown names raise."""
    key = name.removeprefix("torch.") if isinstance(name, str) else name
    if not isinstance(key, str) or key not in _DTYPES:
        raise BucketFormatError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[key]


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
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
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


def unpack_bucket(bucket: FlatBucket) -> dict[str, torch.Tensor]:
    """Validate ``bucket`` and return ``{name: view}`` (views into the flat buffer)."""
    bucket.validate()
    return dict(bucket.named_views())


def _dumps(obj: Any) -> str:
    set_strategy: Any = torch.multiprocessing.set_sharing_strategy
    set_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf, 4).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialize_bucket(bucket: FlatBucket, *, validate: bool = True) -> str:
    """Base64 pickle of ``{"format", "flattened_tensor", "metadata"}`` naming shared memory.

    CPU buffers are moved to shared memory (``file_system`` sharing strategy, set process-wide
    by this call); CUDA buffers travel as CUDA IPC handles. ``validate=False`` skips the
    metadata check for buckets built from a plan that was checked once already.
    """
    if validate:
        bucket.validate()
    return _dumps(
        {"format": PAYLOAD_FORMAT, "flattened_tensor": bucket.flat, "metadata": list(bucket.metas)}
    )


def serialize_named_tensors(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
    """Base64 pickle of a plain ``[(name, tensor), ...]`` list (the non-bucket load format)."""
    return _dumps([(str(n), t.detach()) for n, t in named_tensors])


_ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch.multiprocessing.reductions", "rebuild_tensor"),
        ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
        ("torch.multiprocessing.reductions", "rebuild_typed_storage_child"),
        ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
        ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
        ("torch", "Tensor"),
        ("torch", "Size"),
        ("torch.nn.parameter", "Parameter"),
        ("torch.storage", "UntypedStorage"),
        ("torch.storage", "TypedStorage"),
        ("torch", "UntypedStorage"),
        ("rollsafe.transports.bucket", "TensorMeta"),
    }
)


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise BucketFormatError(
            f"payload references {module}.{name}, which is not allowed in a weight payload"
        )


def deserialize_payload(data: str | bytes) -> FlatBucket | list[tuple[str, torch.Tensor]]:
    """Decode one ``serialized_named_tensors`` entry with the restricted unpickler.

    Returns a validated :class:`FlatBucket` for the flattened-bucket format, or a list of
    ``(name, tensor)`` for the plain format. Anything else raises :class:`BucketFormatError`.
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
    try:
        obj = _RestrictedUnpickler(io.BytesIO(raw)).load()
    except BucketFormatError:
        raise
    except Exception as exc:
        raise BucketFormatError(f"serialized entry could not be unpickled: {exc}") from exc
    if isinstance(obj, dict):
        flat = obj.get("flattened_tensor")
        metas = obj.get("metadata")
        if not isinstance(flat, torch.Tensor) or not isinstance(metas, list):
            raise BucketFormatError(
                "bucket payload needs 'flattened_tensor' (tensor) and 'metadata' (list)"
            )
        bucket = FlatBucket(flat, tuple(metas))
        bucket.validate()
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
