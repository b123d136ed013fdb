"""The blocking part of an export: check the named tensors, then copy them into host memory.

Owns input validation (duplicate names, non-tensors, empty sets, unwritable tensors: a named
error naming the key, raised before anything is allocated or written) and the host snapshot: one
page-aligned arena laid out exactly like the shards' data sections, so the writer later writes
each shard's data straight from it with a few large ``write`` calls and no further copies.

CPU tensors are copied with ``copy_`` (non-contiguous tensors become contiguous in the copy).
CUDA tensors are copied tensor by tensor through a small pinned host staging buffer, so the
extra accelerator memory is at most one tensor (a non-contiguous tensor is made contiguous on
the device one at a time; a whole set is never). The arena is kept by the exporter and reused
by the next export of the same size, which makes later snapshots plain memory copies.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from rollsafe.hf.errors import (
    DuplicateTensorName,
    EmptyExport,
    ExportInputError,
    NotATensor,
    UnsupportedTensor,
)
from rollsafe.hf.layout import ShardPlan, plan_shards

__all__ = [
    "ST_DTYPES",
    "HostArena",
    "NamedTensors",
    "PinnedStaging",
    "snapshot_into",
    "validate_named_tensors",
]

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]

#: torch dtype -> safetensors dtype name.
ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}

#: Size of the pinned staging for device -> host copies (two chunks of half this size).
STAGING_BYTES = 128 << 20
#: Host-to-host copies are cut into memcpy pieces of this size, run on up to this many threads.
_COPY_PIECE = 8 << 20
_COPY_THREADS = 8


def validate_named_tensors(named_tensors: Any) -> list[tuple[str, torch.Tensor]]:
    """Materialize and check ``named_tensors`` (a mapping or ``(name, tensor)`` pairs).

    Raises :class:`EmptyExport`, :class:`DuplicateTensorName`, :class:`NotATensor` or
    :class:`UnsupportedTensor` naming the offending key; allocates and writes nothing.
    """
    if isinstance(named_tensors, (torch.Tensor, str, bytes)):
        raise ExportInputError(
            "named_tensors must be a mapping name -> tensor or an iterable of (name, tensor) "
            f"pairs, got {type(named_tensors).__name__}"
        )
    items: Iterable[Any]
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    seen: dict[str, int] = {}
    out: list[tuple[str, torch.Tensor]] = []
    for i, item in enumerate(items):
        if not isinstance(item, tuple) or len(item) != 2:
            raise ExportInputError(
                f"entry #{i} is not a (name, tensor) pair: {type(item).__name__}"
            )
        name, tensor = item
        if not isinstance(name, str) or not name:
            raise NotATensor(f"entry #{i}: tensor name must be a non-empty str, got {name!r}")
        if name in seen:
            raise DuplicateTensorName(
                f"tensor name {name!r} appears twice (entries #{seen[name]} and #{i})", key=name
            )
        seen[name] = i
        if not isinstance(tensor, torch.Tensor):
            raise NotATensor(
                f"value of {name!r} is a {type(tensor).__name__}, not a torch.Tensor", key=name
            )
        if tensor.is_meta or tensor.layout != torch.strided:
            what = "a meta tensor (no data)" if tensor.is_meta else f"layout {tensor.layout}"
            raise UnsupportedTensor(f"tensor {name!r} is {what}; export needs dense data", key=name)
        if tensor.dtype not in ST_DTYPES:
            raise UnsupportedTensor(
                f"tensor {name!r} has dtype {tensor.dtype}, which safetensors export does not "
                f"support here (supported: {sorted(str(d) for d in ST_DTYPES)})",
                key=name,
            )
        out.append((name, tensor))
    if not out:
        raise EmptyExport("no tensors to export (empty named_tensors)")
    return out


def plan_for(
    tensors: Sequence[tuple[str, torch.Tensor]], shard_size_bytes: int
) -> tuple[list[ShardPlan], int]:
    """The shard plan and arena size for validated tensors."""
    entries = [
        (
            name,
            ST_DTYPES[t.dtype],
            tuple(int(d) for d in t.shape),
            t.numel() * t.element_size(),
            t.element_size(),
        )
        for name, t in tensors
    ]
    return plan_shards(entries, shard_size_bytes)


class HostArena:
    """One page-aligned host buffer holding a whole snapshot (transparent huge pages if offered).

    ``u8`` is a uint8 torch view of it; ``region(offset, n)`` a zero-copy memoryview for writes.
    """

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._buffer: Any
        try:
            mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            advice = getattr(mmap, "MADV_HUGEPAGE", None)
            if advice is not None:
                try:
                    mm.madvise(advice)
                except OSError:
                    pass
            self._buffer = mm
        except (AttributeError, OSError, ValueError):  # no anonymous mmap on this platform
            self._buffer = bytearray(nbytes)
        self.u8 = torch.frombuffer(self._buffer, dtype=torch.uint8)
        self._view = memoryview(self._buffer)

    def region(self, offset: int, nbytes: int) -> memoryview:
        """Zero-copy bytes ``[offset, offset + nbytes)`` of the arena."""
        return self._view[offset : offset + nbytes]


class PinnedStaging:
    """Two pinned host chunks reused for device -> host copies (allocated on first use): the
    device fills one while the host copies the other out."""

    def __init__(self, nbytes: int = STAGING_BYTES) -> None:
        self.nbytes = nbytes
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._buffers is None:
            half = max(1, self.nbytes // 2)
            self._buffers = (
                torch.empty(half, dtype=torch.uint8, pin_memory=True),
                torch.empty(half, dtype=torch.uint8, pin_memory=True),
            )
        return self._buffers


def _host_copy(
    dst_u8: torch.Tensor, src: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Copy a CPU tensor into host bytes ``dst_u8``.

    A contiguous tensor is returned as memcpy jobs of at most ``_COPY_PIECE`` bytes (plain
    memcpy is several times faster than ``Tensor.copy_`` for large blocks, and the pieces run on
    a few threads); a non-contiguous one is copied here with a strided ``copy_``.
    """
    if not src.is_contiguous():
        dst_u8.view(dtype).reshape(shape).copy_(src)
        return []
    dst = dst_u8.numpy()
    flat = src.reshape(-1).view(torch.uint8).numpy()
    return [
        (dst[off : off + _COPY_PIECE], flat[off : off + _COPY_PIECE])
        for off in range(0, flat.size, _COPY_PIECE)
    ]


def _copy_from_cuda(
    dst_u8: torch.Tensor, src: torch.Tensor, staging: PinnedStaging, pool: ThreadPoolExecutor | None
) -> None:
    """Copy one CUDA tensor into host bytes ``dst_u8`` through the two pinned chunks: the
    device fills one chunk while the host copies the other out (on ``pool``'s threads)."""
    if not src.is_contiguous():
        src = src.contiguous()  # one tensor at a time: extra device memory <= this tensor
    flat = src.reshape(-1).view(torch.uint8)
    chunks = staging.get()
    step = chunks[0].numel()
    stream = torch.cuda.current_stream(src.device)
    pending: tuple[Any, torch.Tensor, torch.Tensor] | None = None
    for k, off in enumerate(range(0, flat.numel(), step)):
        n = min(step, flat.numel() - off)
        chunk = chunks[k % 2][:n]  # its previous contents were copied out last iteration
        chunk.copy_(flat[off : off + n], non_blocking=True)
        event = stream.record_event()
        if pending is not None:
            _drain(*pending, pool)
        pending = (event, chunk, dst_u8[off : off + n])
    if pending is not None:
        _drain(*pending, pool)


def _drain(
    event: Any, chunk: torch.Tensor, dst: torch.Tensor, pool: ThreadPoolExecutor | None
) -> None:
    event.synchronize()
    dst_np, src_np = dst.numpy(), chunk.numpy()
    pieces = [
        (dst_np[o : o + _COPY_PIECE], src_np[o : o + _COPY_PIECE])
        for o in range(0, src_np.size, _COPY_PIECE)
    ]
    _run_copies(pieces, pool)


def _run_copies(jobs: list[tuple[np.ndarray, np.ndarray]], pool: ThreadPoolExecutor | None) -> None:
    if pool is None or len(jobs) <= 1:
        for dst, src in jobs:
            np.copyto(dst, src)
    else:
        for _ in pool.map(lambda job: np.copyto(*job), jobs):
            pass


def snapshot_into(
    arena: HostArena,
    plans: Sequence[ShardPlan],
    tensors: Mapping[str, torch.Tensor],
    staging: PinnedStaging | None = None,
) -> int:
    """Copy every planned tensor into its slot of ``arena``; return the bytes copied.

    CUDA tensors go through ``staging`` (a fresh :class:`PinnedStaging` if None), one at a
    time; contiguous CPU tensors are copied as memcpy pieces on up to ``_COPY_THREADS`` threads.
    """
    devices = {t.device for t in tensors.values() if t.device.type == "cuda"}
    for device in devices:  # work queued on other streams must land before we read
        torch.cuda.synchronize(device)
    copied = 0
    jobs: list[tuple[np.ndarray, np.ndarray]] = []
    workers = min(_COPY_THREADS, os.cpu_count() or 1)
    pool = ThreadPoolExecutor(workers, "rollsafe-hf-snapshot") if workers > 1 else None
    try:
        with torch.no_grad():
            for plan in plans:
                for slot in plan.slots:
                    src = tensors[slot.name].detach()
                    offset = plan.arena_offset + slot.begin
                    if slot.nbytes == 0:
                        continue
                    dst_u8 = arena.u8[offset : offset + slot.nbytes]
                    if src.device.type == "cuda":
                        if staging is None:
                            staging = PinnedStaging()
                        _copy_from_cuda(dst_u8, src, staging, pool)
                    elif src.device.type == "cpu":
                        jobs += _host_copy(dst_u8, src, src.dtype, slot.shape)
                    else:  # other accelerators: one tensor at a time through torch
                        dst_u8.view(src.dtype).reshape(slot.shape).copy_(src)
                    copied += slot.nbytes
        _run_copies(jobs, pool)
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    return copied
