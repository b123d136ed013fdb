"""Bucket plans and the double-buffered packing pipeline shared by ``ipc`` and ``nccl``.

Owns two things:

* :func:`plan_buckets` -- computed once at ``register``: which registered tensors go into which
  dtype-homogeneous flattened bucket (the same grouping rule as
  :func:`rollsafe.transports.bucket.pack_buckets`: order kept per dtype, a dtype's open bucket
  is flushed when the next tensor would overflow ``bucket_bytes``, a bigger tensor is alone), and
  the :class:`~rollsafe.transports.bucket.TensorMeta` of every slot. Nothing is copied.
* :class:`BucketStream` -- used for one ``update``: a packer thread copies bucket ``i + 1`` into
  one of **two** reusable buffers while the consumers (one per target, each in its own thread)
  push bucket ``i``; a buffer is reused only once every consumer still in the update released
  the bucket it held (i.e. the engine answered). So the extra memory of an update is at most two
  buckets, whatever the number of targets, and each bucket is packed once for all targets.
  A single contiguous tensor that already lives where the bucket must be (the target device,
  and for CPU shared-memory transports already in shared memory) is sent as is (no copy).

CPU buffers for ``ipc`` are allocated directly in shared memory (torch's ``file_system``
strategy), so serializing them names the shared file instead of copying the bytes again. On
CUDA the packer copies on its own stream and synchronizes it before publishing a bucket, so a
consumer never hands over a buffer whose copy is still in flight.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from rollsafe.transports.base import RegisterError, TransportError
from rollsafe.transports.bucket import (
    BucketFormatError,
    FlatBucket,
    TensorMeta,
    dtype_from_name,
    dtype_name,
)

__all__ = [
    "BucketPlan",
    "BucketStream",
    "BufferPool",
    "alloc_buffer",
    "check_tensors",
    "plan_buckets",
]

_ALIGN = 64  # bytes; every dtype view of a buffer starts aligned


@dataclass(frozen=True)
class BucketPlan:
    """One planned bucket: its dtype, the registered items it holds and their metadata."""

    dtype: torch.dtype
    indices: tuple[int, ...]
    metas: tuple[TensorMeta, ...]
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metas]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def check_tensors(
    items: Sequence[tuple[str, torch.Tensor]], *, device: torch.device | None = None
) -> torch.device:
    """Refuse what the wire format cannot carry; return the device the tensors live on.

    Raises :class:`RegisterError` naming the key for an unsupported dtype, a sparse/meta tensor,
    or (when ``device`` is None) tensors spread over several devices.
    """
    first: torch.device | None = None
    for name, t in items:
        try:
            dtype_from_name(dtype_name(t.dtype))
        except BucketFormatError as exc:
            raise RegisterError(
                f"weight {name!r}: dtype {t.dtype} cannot be sent ({exc})"
            ) from None
        if t.layout != torch.strided:
            raise RegisterError(f"weight {name!r}: layout {t.layout} is not supported (dense only)")
        if t.device.type == "meta":
            raise RegisterError(f"weight {name!r} is a meta tensor (it holds no data)")
        if first is None:
            first = t.device
        elif device is None and t.device != first:
            raise RegisterError(
                f"weight {name!r} is on {t.device} but earlier weights are on {first}; "
                "pass device= to gather them"
            )
    assert first is not None
    return device if device is not None else first


def plan_buckets(items: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[BucketPlan]:
    """Group ``items`` into dtype-homogeneous buckets of at most ``bucket_bytes`` (no copies)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    plans: list[BucketPlan] = []
    open_: dict[torch.dtype, list[int]] = {}
    sizes: dict[torch.dtype, int] = {}

    def flush(dtype: torch.dtype) -> None:
        idx = open_.pop(dtype)
        sizes.pop(dtype)
        metas: list[TensorMeta] = []
        pos = 0
        for i in idx:
            name, t = items[i]
            n = t.numel()
            metas.append(TensorMeta(name, dtype_name(dtype), tuple(t.shape), pos, pos + n))
            pos += n
        plans.append(BucketPlan(dtype, tuple(idx), tuple(metas), pos))

    for i, (_, t) in enumerate(items):
        nbytes = t.numel() * t.element_size()
        dt = t.dtype
        if dt in open_ and sizes[dt] + nbytes > bucket_bytes:
            flush(dt)
        open_.setdefault(dt, []).append(i)
        sizes[dt] = sizes.get(dt, 0) + nbytes
    for dt in list(open_):
        flush(dt)
    return plans


def alloc_buffer(nbytes: int, device: torch.device, *, shared: bool) -> torch.Tensor:
    """A 1-D ``uint8`` buffer of ``nbytes`` on ``device``; CPU + ``shared``: in shared memory."""
    nbytes = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
    if device.type == "cpu" and shared:
        set_strategy: Any = torch.multiprocessing.set_sharing_strategy
        set_strategy("file_system")  # what bucket.serialize_bucket uses: the file is re-used
        storage_cls: Any = torch.UntypedStorage
        storage = storage_cls._new_shared(nbytes)
        return torch.empty(0, dtype=torch.uint8).set_(storage)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


class BufferPool:
    """The (at most ``slots``) pack buffers of a transport, optionally kept between updates.

    Keeping them saves re-allocating (and page-faulting) two buckets per update: worth it for
    CPU shared memory; on CUDA the transport drops them after each update so the trainer gets
    that memory back between syncs.
    """

    def __init__(self, device: torch.device, *, shared: bool, slots: int = 2) -> None:
        self.device = device
        self.shared = shared
        self.slots = max(1, slots)
        self._buffers: list[torch.Tensor | None] = [None] * self.slots

    def get(self, slot: int, nbytes: int) -> torch.Tensor:
        """Buffer ``slot`` with room for at least ``nbytes`` (re-allocated if too small)."""
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes:
            self._buffers[slot] = None
            buf = alloc_buffer(nbytes, self.device, shared=self.shared)
            self._buffers[slot] = buf
        return buf

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buffers if b is not None)

    def clear(self) -> None:
        self._buffers = [None] * self.slots


class BucketStream:
    """Packs the planned buckets of one update, at most two ahead, for several consumers.

    Usage (one consumer per target thread)::

        stream = BucketStream(items, plans, device=..., shared=..., consumers=["a", "b"])
        for i in range(len(stream)):
            bucket = stream.get("a", i, timeout=...)   # packed once, shared by every consumer
            ...                                        # hand it to the engine; wait for its answer
            stream.release("a", i)
        stream.leave("a")                              # also on failure: others never wait for "a"
        ...
        stream.close()                                 # after every consumer left

    ``get`` raises :class:`TransportError` if packing failed or timed out.
    """

    def __init__(
        self,
        items: Sequence[tuple[str, torch.Tensor]],
        plans: Sequence[BucketPlan],
        *,
        device: torch.device,
        shared: bool,
        consumers: Sequence[str],
        slots: int = 2,
        pool: BufferPool | None = None,
    ) -> None:
        self._items = items
        self._plans = list(plans)
        self._device = device
        self._shared = shared
        self._slots = max(1, slots)
        if pool is not None and (pool.device != device or pool.shared != shared):
            pool = None
        self._pool = pool or BufferPool(device, shared=shared, slots=self._slots)
        self._cv = threading.Condition()
        self._progress: dict[str, int] = {c: 0 for c in consumers}  # buckets released
        self._ready: dict[int, FlatBucket] = {}
        self._error: BaseException | None = None
        self._closed = False
        # buffers are sized for the largest bucket that is packed (tensors sent as is need none)
        self._cap = max((p.nbytes for p in self._plans if self._direct(p) is None), default=0)
        self._cuda_stream: Any = None
        if device.type == "cuda":
            cuda: Any = torch.cuda
            self._cuda_stream = cuda.Stream(device=device)
        self._packer = threading.Thread(
            target=self._run, name="rollsafe-bucket-packer", daemon=True
        )
        self._packer.start()

    def __len__(self) -> int:
        return len(self._plans)

    # ------------------------------------------------------------------ consumers
    def get(self, consumer: str, index: int, *, timeout: float) -> FlatBucket:
        """Bucket ``index``, once packed; raise :class:`TransportError` on failure or timeout."""
        with self._cv:
            ok = self._cv.wait_for(
                lambda: index in self._ready or self._error is not None or self._closed,
                timeout=timeout,
            )
            if self._error is not None:
                raise TransportError(f"packing bucket {index} failed: {self._error}")
            if not ok or self._closed or index not in self._ready:
                raise TransportError(
                    f"bucket {index} ({self._plans[index].names[0]!r}...) was not packed within "
                    f"{timeout}s for {consumer!r}"
                )
            return self._ready[index]

    def release(self, consumer: str, index: int) -> None:
        """``consumer`` is done with bucket ``index`` (the engine answered)."""
        with self._cv:
            if consumer in self._progress:
                self._progress[consumer] = max(self._progress[consumer], index + 1)
            self._collect()
            self._cv.notify_all()

    def leave(self, consumer: str) -> None:
        """``consumer`` takes no more buckets (finished or failed)."""
        with self._cv:
            self._progress.pop(consumer, None)
            self._collect()
            self._cv.notify_all()

    def close(self) -> None:
        """Stop packing and drop the buffers (waits briefly for the packer thread)."""
        with self._cv:
            self._closed = True
            self._ready.clear()
            self._cv.notify_all()
        self._packer.join(timeout=30)

    # ------------------------------------------------------------------ packer
    def _released_all(self) -> int:
        """Number of leading buckets every remaining consumer released."""
        if not self._progress:
            return len(self._plans)
        return min(self._progress.values())

    def _collect(self) -> None:
        done = self._released_all()
        for i in [i for i in self._ready if i < done]:
            del self._ready[i]

    def _run(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        try:
            for i, plan in enumerate(self._plans):
                need = i - self._slots + 1  # slot i % slots is free once bucket i - slots is
                with self._cv:
                    self._cv.wait_for(
                        lambda need=need: (
                            self._closed  # type: ignore[misc]
                            or not self._progress
                            or self._released_all() >= need
                        )
                    )
                    if self._closed or not self._progress:
                        return
                bucket = self._pack(i, plan)
                with self._cv:
                    if self._closed:
                        return
                    self._ready[i] = bucket
                    self._cv.notify_all()
        except BaseException as exc:  # reported to every consumer by get()
            with self._cv:
                self._error = exc
                self._cv.notify_all()

    def _direct(self, plan: BucketPlan) -> torch.Tensor | None:
        """The source tensor itself when it can travel without a copy."""
        if len(plan.indices) != 1:
            return None
        t = self._items[plan.indices[0]][1].detach()
        if t.device != self._device or not t.is_contiguous():
            return None
        if self._device.type == "cpu" and self._shared and not cast(Any, t).is_shared():
            return None
        return t.reshape(-1)

    def _pack(self, i: int, plan: BucketPlan) -> FlatBucket:
        direct = self._direct(plan)
        if direct is not None:
            return FlatBucket(direct, plan.metas)
        buf = self._pool.get(i % self._slots, self._cap)
        flat = buf[: plan.nbytes].view(plan.dtype)
        if self._cuda_stream is not None:
            # the buffer may have been read by an earlier kernel on the default stream
            self._cuda_stream.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(self._cuda_stream):
                self._copy_into(flat, plan)
            self._cuda_stream.synchronize()
        else:
            self._copy_into(flat, plan)
        return FlatBucket(flat, plan.metas)

    def _copy_into(self, flat: torch.Tensor, plan: BucketPlan) -> None:
        with torch.no_grad():
            for idx, meta in zip(plan.indices, plan.metas, strict=True):
                src = self._items[idx][1].detach()
                dst = flat[meta.start : meta.end].view(meta.shape)
                dst.copy_(src, non_blocking=src.device.type != dst.device.type)
