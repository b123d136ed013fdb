"""The one unpickler a weight payload goes through on the receiving side, safe by construction.

Owns what a payload may make the engine do, at three levels:

1. **Opcodes.** :func:`scan` walks the whole pickle before anything runs and admits only data
   opcodes, ``GLOBAL``/``STACK_GLOBAL``, ``REDUCE``, ``NEWOBJ``, ``BUILD`` and the memo; never
   ``NEWOBJ_EX`` (keyword arguments into a constructor), ``INST``/``OBJ``, extensions,
   persistent ids or out-of-band buffers. The stream size and opcode count are bounded.
2. **Globals.** ``find_class`` hands out no torch callable. Torch's rebuild functions are
   replaced by rollsafe's own (:func:`_rebuild_tensor`, :func:`_rebuild_cuda_tensor`, ...) that
   validate every argument (types, dtypes, sizes, strides, offsets within the storage, CUDA
   handle lengths, the device) before building anything; class globals (``torch.Tensor``,
   ``torch.UntypedStorage``...) are inert markers those functions accept, so no constructor is
   reachable with a payload's arguments. Shared memory is mapped only through
   :func:`rollsafe.wire.shm.open_segment` (rollsafe's namespace, read-only, exact size).
3. **Results.** Storages are opaque holders, and tensors come out *sealed* (a subclass whose
   ``__setstate__`` refuses), so a ``BUILD`` aimed at them cannot re-point them; :func:`loads`
   unseals them before returning.

``extra`` maps further ``(module, name)`` globals to harmless classes (the bucket format's
metadata class). Anything else raises :class:`UnsafePayload` naming it.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import re
from collections.abc import Mapping
from typing import Any

import torch

from rollsafe.errors import RollsafeError
from rollsafe.wire.dtypes import WIRE_DTYPES
from rollsafe.wire.shm import open_segment

__all__ = ["MAX_OPCODES", "MAX_PAYLOAD_BYTES", "UnsafePayload", "loads", "scan"]

MAX_PAYLOAD_BYTES = 64 << 20  # a payload names memory, it does not carry it
MAX_OPCODES = 4_000_000
_MAX_DIMS = 16
_ALLOWED_OPS = frozenset(
    {
        "PROTO",
        "FRAME",
        "STOP",
        "MARK",
        "EMPTY_DICT",
        "EMPTY_LIST",
        "EMPTY_TUPLE",
        "TUPLE",
        "TUPLE1",
        "TUPLE2",
        "TUPLE3",
        "SETITEM",
        "SETITEMS",
        "APPEND",
        "APPENDS",
        "BINUNICODE",
        "SHORT_BINUNICODE",
        "BINUNICODE8",
        "BINBYTES",
        "SHORT_BINBYTES",
        "BINBYTES8",
        "BININT",
        "BININT1",
        "BININT2",
        "LONG1",
        "NONE",
        "NEWTRUE",
        "NEWFALSE",
        "BINFLOAT",
        "GLOBAL",
        "STACK_GLOBAL",
        "REDUCE",
        "NEWOBJ",
        "BUILD",
        "MEMOIZE",
        "BINPUT",
        "LONG_BINPUT",
        "BINGET",
        "LONG_BINGET",
    }
)


class UnsafePayload(RollsafeError, ValueError):
    """A weight payload tries something a weight payload never needs; the message names it."""


class _Marker:
    """An inert stand-in for a class global: accepted by the rebuild functions, not callable."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


_TENSOR = _Marker("torch.Tensor")
_UNTYPED = _Marker("torch.UntypedStorage")
_TYPED = _Marker("torch.TypedStorage")


class _Sealed(torch.Tensor):
    """A tensor still inside the unpickler: ``BUILD`` cannot re-point it."""

    def __setstate__(self, state: Any) -> None:
        raise UnsafePayload("a payload may not set a tensor's state")


class _Storage:
    """An opaque holder of a storage the rebuild functions built (``dtype`` once typed)."""

    __slots__ = ("dtype", "untyped")

    def __init__(self, untyped: Any, dtype: torch.dtype | None = None) -> None:
        self.untyped = untyped
        self.dtype = dtype


#: the dtypes a payload may name (those a weight may travel as)
_DTYPES = WIRE_DTYPES
_ALLOWED_DTYPES = frozenset(_DTYPES.values())


def _int(value: Any, what: str, *, low: int = 0, high: int = 1 << 62) -> int:
    if type(value) is not int or not low <= value <= high:
        raise UnsafePayload(f"{what} must be an int in [{low}, {high}], got {value!r:.60}")
    return value


def _dims(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or len(value) > _MAX_DIMS:
        raise UnsafePayload(f"{what} must be a tuple of at most {_MAX_DIMS} ints")
    return tuple(_int(v, what) for v in value)


def _dtype(value: Any) -> torch.dtype:
    if value not in _ALLOWED_DTYPES:
        raise UnsafePayload(f"dtype {value!r:.40} is not allowed in a weight payload")
    return value  # type: ignore[no-any-return]


def _check_extent(
    size: tuple[int, ...], stride: tuple[int, ...], offset: int, capacity: int, what: str
) -> None:
    """The tensor's elements all lie inside ``capacity`` elements of its storage."""
    if len(size) != len(stride):
        raise UnsafePayload(f"{what}: size {size} and stride {stride} differ in length")
    if any(s == 0 for s in size):
        if offset > capacity:
            raise UnsafePayload(f"{what}: offset {offset} past the storage ({capacity})")
        return
    last = offset + sum((s - 1) * st for s, st in zip(size, stride, strict=True))
    if last >= capacity:
        raise UnsafePayload(
            f"{what}: size {list(size)}, stride {list(stride)} at offset {offset} reach element "
            f"{last} of a storage of {capacity}"
        )


# ------------------------------------------------------------------ rebuild functions (ours)
def _rebuild_storage_filename(
    cls: Any, manager: Any, handle: Any, size: Any, dtype: Any = None
) -> _Storage:
    if cls is not _UNTYPED and cls is not _TYPED:
        raise UnsafePayload(f"rebuild_storage_filename: storage class {cls!r:.40}")
    if not isinstance(manager, (bytes, bytearray)):
        raise UnsafePayload("rebuild_storage_filename: manager handle must be bytes")
    try:
        storage = open_segment(handle, size)  # rollsafe's namespace, read-only, exact size
    except ValueError as exc:
        raise UnsafePayload(str(exc)) from None
    return _Storage(storage, None if dtype is None else _dtype(dtype))


def _rebuild_storage_empty(cls: Any) -> _Storage:
    if cls is not _UNTYPED:
        raise UnsafePayload(f"rebuild_storage_empty: storage class {cls!r:.40}")
    storage_cls: Any = torch.UntypedStorage
    return _Storage(storage_cls(0))


def _rebuild_typed_storage(storage: Any, dtype: Any) -> _Storage:
    if not isinstance(storage, _Storage) or storage.dtype is not None:
        raise UnsafePayload("rebuild_typed_storage: expects an untyped storage")
    return _Storage(storage.untyped, _dtype(dtype))


def _rebuild_tensor(cls: Any, storage: Any, metadata: Any) -> _Sealed:
    if cls is not _TENSOR:
        raise UnsafePayload(f"rebuild_tensor: tensor class {cls!r:.40}")
    if not isinstance(storage, _Storage) or storage.dtype is None:
        raise UnsafePayload("rebuild_tensor: expects a typed storage")
    if not isinstance(metadata, tuple) or len(metadata) != 4:
        raise UnsafePayload("rebuild_tensor: metadata must be (offset, size, stride, grad)")
    offset, size, stride, requires_grad = metadata
    if requires_grad is not False:
        raise UnsafePayload("rebuild_tensor: a weight payload carries no autograd state")
    offset = _int(offset, "rebuild_tensor offset")
    size_t, stride_t = _dims(size, "rebuild_tensor size"), _dims(stride, "rebuild_tensor stride")
    dtype = storage.dtype
    capacity = storage.untyped.nbytes() // dtype.itemsize
    _check_extent(size_t, stride_t, offset, capacity, "rebuild_tensor")
    out = torch.empty(0, dtype=dtype).set_(storage.untyped, offset, size_t, stride_t)
    return out.as_subclass(_Sealed)


#: cudaIpcMemHandle_t is 64 bytes; torch's shareable handles add a type byte and, for
#: expandable segments, more: a bound on the form, not an exact size
_MAX_CUDA_HANDLE_BYTES = 4096
#: torch's process-wide shared-memory names (``/torch_<pid>_<random>_<counter>``)
_REF_COUNTER = re.compile(rb"^/torch_[0-9]{1,10}_[0-9]{1,20}_[0-9]{1,20}$")
_REF_COUNTER_ENTRIES = 10_000  # torch's CUDA_IPC_REF_COUNTER_FILE_SIZE


def _rebuild_cuda_tensor(
    tensor_cls: Any,
    tensor_size: Any,
    tensor_stride: Any,
    tensor_offset: Any,
    storage_cls: Any,
    tensor_dtype: Any,
    storage_device: Any,
    storage_handle: Any,
    storage_size_bytes: Any,
    storage_offset_bytes: Any,
    requires_grad: Any,
    ref_counter_handle: Any,
    ref_counter_offset: Any,
    event_handle: Any,
    event_sync_required: Any,
) -> _Sealed:
    # torch pickles ``type(tensor._typed_storage())``: TypedStorage (UntypedStorage accepted too)
    real_storage_cls = {_TYPED: torch.storage.TypedStorage, _UNTYPED: torch.UntypedStorage}
    if tensor_cls is not _TENSOR or storage_cls not in real_storage_cls:
        raise UnsafePayload("rebuild_cuda_tensor: unexpected tensor or storage class")
    if requires_grad is not False:
        raise UnsafePayload("rebuild_cuda_tensor: a weight payload carries no autograd state")
    dtype = _dtype(tensor_dtype)
    size = _dims(tensor_size, "rebuild_cuda_tensor size")
    stride = _dims(tensor_stride, "rebuild_cuda_tensor stride")
    offset = _int(tensor_offset, "rebuild_cuda_tensor offset")
    nbytes = _int(storage_size_bytes, "rebuild_cuda_tensor storage size", low=1)
    _int(storage_offset_bytes, "rebuild_cuda_tensor storage offset")
    _check_extent(size, stride, offset, nbytes // dtype.itemsize, "rebuild_cuda_tensor")
    if not torch.cuda.is_available():
        raise UnsafePayload("a CUDA IPC payload reached an engine without CUDA")
    _int(storage_device, "rebuild_cuda_tensor device", high=torch.cuda.device_count() - 1)
    # the handles' contents are CUDA's to check when they are opened; their form is ours
    for value, what in ((storage_handle, "memory"), (event_handle, "event")):
        if what == "event" and value is None:
            continue
        if not isinstance(value, bytes) or not 0 < len(value) <= _MAX_CUDA_HANDLE_BYTES:
            raise UnsafePayload(f"rebuild_cuda_tensor: bad CUDA IPC {what} handle")
    if not isinstance(ref_counter_handle, bytes) or not _REF_COUNTER.match(ref_counter_handle):
        raise UnsafePayload("rebuild_cuda_tensor: bad reference-counter handle")
    _int(ref_counter_offset, "rebuild_cuda_tensor ref offset", high=_REF_COUNTER_ENTRIES - 1)
    if type(event_sync_required) is not bool:
        raise UnsafePayload("rebuild_cuda_tensor: event_sync_required must be a bool")
    from torch.multiprocessing import reductions

    rebuild: Any = reductions.rebuild_cuda_tensor
    out: torch.Tensor = rebuild(
        torch.Tensor,
        torch.Size(size),
        stride,
        offset,
        real_storage_cls[storage_cls],
        dtype,
        storage_device,
        storage_handle,
        nbytes,
        storage_offset_bytes,
        False,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    )
    return out.as_subclass(_Sealed)


_REDUCTIONS = "torch.multiprocessing.reductions"
_GLOBALS: dict[tuple[str, str], Any] = {
    (_REDUCTIONS, "rebuild_tensor"): _rebuild_tensor,
    (_REDUCTIONS, "rebuild_typed_storage"): _rebuild_typed_storage,
    (_REDUCTIONS, "rebuild_storage_filename"): _rebuild_storage_filename,
    (_REDUCTIONS, "rebuild_storage_empty"): _rebuild_storage_empty,
    (_REDUCTIONS, "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
    ("torch", "Tensor"): _TENSOR,
    ("torch", "UntypedStorage"): _UNTYPED,
    ("torch.storage", "UntypedStorage"): _UNTYPED,
    ("torch.storage", "TypedStorage"): _TYPED,
    ("torch", "Size"): torch.Size,
}


def scan(raw: bytes) -> None:
    """Refuse a pickle stream with any opcode outside the allow-list, or too big."""
    if len(raw) > MAX_PAYLOAD_BYTES:
        raise UnsafePayload(f"payload of {len(raw)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    count = 0
    try:
        for op, _, pos in pickletools.genops(raw):
            if op.name not in _ALLOWED_OPS:
                raise UnsafePayload(f"opcode {op.name} at byte {pos} is not allowed in a payload")
            count += 1
            if count > MAX_OPCODES:
                raise UnsafePayload(f"payload has more than {MAX_OPCODES} opcodes")
    except UnsafePayload:
        raise
    except Exception as exc:  # a truncated or malformed stream
        raise UnsafePayload(f"payload is not a well-formed pickle: {exc}") from None


class _Unpickler(pickle.Unpickler):
    def __init__(self, raw: bytes, extra: Mapping[tuple[str, str], Any]) -> None:
        super().__init__(io.BytesIO(raw))
        self._extra = extra

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        found = _GLOBALS.get((module, name), self._extra.get((module, name)))
        if found is None:
            raise UnsafePayload(
                f"payload references {module}.{name}, which is not allowed in a weight payload"
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePayload("persistent ids are not allowed in a weight payload")


def _unseal(obj: Any, depth: int = 0) -> Any:
    """Turn sealed tensors back into plain ones inside the decoded containers."""
    if depth > 8:
        raise UnsafePayload("payload nests containers too deeply")
    if isinstance(obj, _Sealed):
        return obj.as_subclass(torch.Tensor)
    if isinstance(obj, dict):
        return {k: _unseal(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unseal(v, depth + 1) for v in obj]
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
        return tuple(_unseal(v, depth + 1) for v in obj)
    if isinstance(obj, (_Storage, _Marker)):
        raise UnsafePayload(f"payload leaves a bare {type(obj).__name__.lstrip('_').lower()}")
    return obj


def loads(
    raw: bytes, *, extra: Mapping[tuple[str, str], Any] | None = None, scanned: bool = False
) -> Any:
    """Decode ``raw`` safely (see the module docstring); ``scanned``: :func:`scan` ran already.

    Raises :class:`UnsafePayload` for anything a weight payload never needs; other malformed
    streams raise what :class:`pickle.Unpickler` raises (callers map both to a 400)."""
    if not scanned:
        scan(raw)
    obj = _Unpickler(raw, extra or {}).load()
    return _unseal(obj)
