"""Bucket plans and the double-buffered packing pipeline shared by ``ipc`` and ``nccl``.

Owns two things:

* :func:`plan_buckets` -- computed once at ``register``: which registered tensors go into which
  dtype-homogeneous flattened bucket (the same grouping rule as
  :func:`rollsafe.wire.bucket.pack_buckets`: order kept per dtype, a dtype's open bucket
  is flushed when the next tensor would overflow ``bucket_bytes``, a bigger tensor is alone), and
  the :class:`~rollsafe.wire.bucket.TensorMeta` of every slot. Nothing is copied.
* :class:`BucketStream` -- used for one ``update``: a packer thread copies bucket ``i + 1`` into
  one of **two** reusable buffers while the consumers (one per target, each in its own thread)
  push bucket ``i``; a buffer is reused only once every consumer still in the update released
  the bucket it held (i.e. the engine answered). So the extra memory of an update is at most two
  buckets, whatever the number of targets, and each bucket is packed once for all targets.
  A bucket whose memory already lives where it must be (the target device, and for CPU
  shared-memory transports in shared memory) is sent as is, without a copy: a single
  contiguous tensor, or tensors that lie back to back in one storage (a flat parameter buffer,
  :func:`rollsafe.transports.contiguous.flatten_parameters`), sent as a slice of it.

CPU buffers for ``ipc`` are allocated directly in shared memory (torch's ``file_system``
strategy), so serializing them names the shared file instead of copying the bytes again. On
CUDA the packer copies on its own stream and synchronizes it before publishing a bucket, so a
consumer never hands over a buffer whose copy is still in flight.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rollsafe.concurrency import DaemonCall
from rollsafe.errors import BucketFormatError, InvalidArgument
from rollsafe.transports.base import RegisterError, TransportError
from rollsafe.wire import shm
from rollsafe.wire.bucket import FlatBucket, TensorMeta
from rollsafe.wire.copy import copy_pairs
from rollsafe.wire.dtypes import dtype_from_name, dtype_name
from rollsafe.wire.dtypes import itemsize as _itemsize

__all__ = [
    "BucketPlan",
    "BucketStream",
    "BufferPool",
    "TensorList",
    "alloc_buffer",
    "check_tensors",
    "delta_header_first",
    "direct_view",
    "follows",
    "plan_buckets",
    "split_unpacked",
]

_ALIGN = 64  # bytes; every dtype view of a buffer starts aligned
#: Seconds :meth:`BucketStream.close` waits for the packer thread (a late one just ends).
_CLOSE_WAIT_S = 30.0


@dataclass(frozen=True)
class BucketPlan:
    """One planned bucket: its dtype, the registered items it holds and their metadata."""

    dtype: torch.dtype
    indices: tuple[int, ...]
    metas: tuple[TensorMeta, ...]
    numel: int
    #: the tensors travel one by one, as they are (no flat buffer; see :func:`split_unpacked`)
    unpacked: bool = False

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metas]


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


def follows(prev: torch.Tensor, t: torch.Tensor) -> bool:
    """True if ``t`` starts right where ``prev`` ends in the same storage (both contiguous, same
    dtype and device): the two can travel as one slice of that storage, without a copy."""
    return (
        t.dtype == prev.dtype
        and t.device == prev.device
        and t.is_contiguous()
        and prev.is_contiguous()
        and t.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr()
        and t.storage_offset() == prev.storage_offset() + prev.numel()
    )


def plan_buckets(
    items: Sequence[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    *,
    direct_bucket_bytes: int | None = None,
    sendable: Callable[[torch.Tensor], bool] | None = None,
) -> list[BucketPlan]:
    """Group ``items`` into dtype-homogeneous buckets of at most ``bucket_bytes`` (no copies).

    Tensors that lie back to back in one storage (a trainer that keeps its parameters in one
    flat buffer per dtype, as Megatron does, or after
    :func:`rollsafe.transports.contiguous.flatten_parameters`) form *direct* buckets: a slice
    of that storage, sent without packing. Their cap is ``direct_bucket_bytes`` (default:
    ``bucket_bytes``; pass a larger one where a bigger bucket costs no extra memory, as for
    CUDA IPC). A direct run ends a bucket where the next tensor does not continue it.
    ``sendable`` says whether a tensor's memory can be handed over as is at all (e.g. CPU
    tensors must already be in shared memory for ``ipc``); tensors it refuses are packed.
    """
    if bucket_bytes <= 0:
        raise InvalidArgument("bucket_bytes", f"bucket_bytes must be positive, got {bucket_bytes}")
    if direct_bucket_bytes is not None and direct_bucket_bytes <= 0:
        raise InvalidArgument(
            "direct_bucket_bytes",
            f"direct_bucket_bytes must be positive, got {direct_bucket_bytes}",
        )
    direct_cap = max(bucket_bytes, direct_bucket_bytes or bucket_bytes)
    plans: list[BucketPlan] = []
    open_: dict[torch.dtype, list[int]] = {}
    sizes: dict[torch.dtype, int] = {}
    direct: dict[torch.dtype, bool] = {}  # open bucket is >= 2 tensors back to back

    def flush(dtype: torch.dtype) -> None:
        idx = open_.pop(dtype)
        sizes.pop(dtype)
        direct.pop(dtype, None)
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
        if dt in open_:
            idx = open_[dt]
            prev = items[idx[-1]][1]
            cont = (
                (len(idx) == 1 or direct[dt])
                and follows(prev, t)
                and (sendable is None or sendable(prev))
            )
            if direct[dt] and not cont:
                flush(dt)  # keep the direct run whole; ``t`` starts a new bucket
            elif sizes[dt] + nbytes > (direct_cap if cont else bucket_bytes):
                flush(dt)
            else:
                direct[dt] = cont
        open_.setdefault(dt, []).append(i)
        direct.setdefault(dt, False)
        sizes[dt] = sizes.get(dt, 0) + nbytes
    for dt in list(open_):
        flush(dt)
    return plans


def delta_header_first(
    items: Sequence[tuple[str, torch.Tensor]],
    plans: Sequence[BucketPlan],
    direct: Sequence[torch.Tensor | None],
) -> tuple[list[BucketPlan], list[torch.Tensor | None]]:
    """The plans (and their direct views) with the one holding a delta's header first.

    A delta (:mod:`rollsafe.wire.delta`) is ordinary named tensors, but its receiver must see
    the header (``DELTA_HEADER_KEY``) in the update's first call: a dense tensor of a delta is
    named like the weight itself, so a call of those alone, sent before the header, would be
    taken for a full update's and applied at once. Buckets are per dtype and a dtype's bucket
    that overflows is flushed early, so the header's (``uint8``) bucket is otherwise not always
    first. Anything without a header keeps its order.
    """
    from rollsafe.wire.delta import DELTA_HEADER_KEY

    at = next(
        (k for k, p in enumerate(plans) if any(items[i][0] == DELTA_HEADER_KEY for i in p.indices)),
        0,
    )
    order = [at, *(k for k in range(len(plans)) if k != at)] if plans else []
    return [plans[k] for k in order], [direct[k] for k in order]


def direct_view(
    items: Sequence[tuple[str, torch.Tensor]],
    plan: BucketPlan,
    *,
    device: torch.device,
    shared: bool,
) -> torch.Tensor | None:
    """The plan's memory itself when it can travel without a copy, else ``None``.

    That is one contiguous tensor, or tensors back to back in one storage (returned as a 1-D
    slice of it), already where the bucket must be: on ``device`` and, for CPU shared-memory
    transports (``shared``), in shared memory.
    """
    tensors = [items[i][1].detach() for i in plan.indices]
    first = tensors[0]
    if first.device != device or not first.is_contiguous():
        return None
    if any(not follows(a, b) for a, b in itertools.pairwise(tensors)):
        return None
    if device.type == "cpu" and shared and not shm.in_namespace(first):
        return None
    if len(tensors) == 1:
        return first.reshape(-1)
    return first.new_empty(0).set_(
        first.untyped_storage(), first.storage_offset(), (plan.numel,), (1,)
    )


@dataclass(frozen=True)
class TensorList:
    """An unpacked bucket: the registered tensors themselves, sent one by one, in order."""

    metas: tuple[TensorMeta, ...]
    tensors: tuple[torch.Tensor, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.tensors[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def split_unpacked(
    items: Sequence[tuple[str, torch.Tensor]],
    plans: Sequence[BucketPlan],
    direct: Sequence[torch.Tensor | None],
    *,
    device: torch.device,
    bucket_bytes: int,
    min_bytes: int,
) -> tuple[list[BucketPlan], list[torch.Tensor | None]]:
    """Re-plan the buckets that would be packed so big tensors skip the packing copy.

    For transports that can send a call's tensors one by one (``nccl``: one broadcast per
    tensor, ``load_format`` unset): of every plan that is not direct, the contiguous tensors of
    at least ``min_bytes`` already on ``device`` go into *unpacked* plans (per dtype, at most
    ``bucket_bytes`` each, a bigger tensor alone) and only the rest is packed. Direct plans are
    kept. Returns the new plans and their direct views (``None`` for packed and unpacked ones).
    """
    out_plans: list[BucketPlan] = []
    out_direct: list[torch.Tensor | None] = []
    small: list[int] = []
    big: list[int] = []
    for plan, view in zip(plans, direct, strict=True):
        if view is not None:
            out_plans.append(plan)
            out_direct.append(view)
            continue
        for i in plan.indices:
            t = items[i][1]
            nbytes = t.numel() * t.element_size()
            if nbytes >= min_bytes and t.device == device and t.is_contiguous():
                big.append(i)
            else:
                small.append(i)
    if small:
        sub = plan_buckets([items[i] for i in small], bucket_bytes)
        for plan in sub:
            out_plans.append(
                BucketPlan(
                    plan.dtype, tuple(small[j] for j in plan.indices), plan.metas, plan.numel
                )
            )
            out_direct.append(None)
    if big:
        for plan in plan_buckets([items[i] for i in big], bucket_bytes):
            out_plans.append(
                BucketPlan(
                    plan.dtype,
                    tuple(big[j] for j in plan.indices),
                    plan.metas,
                    plan.numel,
                    unpacked=True,
                )
            )
            out_direct.append(None)
    return out_plans, out_direct


def alloc_buffer(nbytes: int, device: torch.device, *, shared: bool) -> torch.Tensor:
    """A 1-D ``uint8`` buffer of ``nbytes`` on ``device``; CPU + ``shared``: in shared memory."""
    nbytes = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
    if device.type == "cpu" and shared:
        # a segment of rollsafe's shared-memory namespace, the only one an engine maps
        return shm.new_shared_buffer(nbytes)
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
        direct: Sequence[torch.Tensor | None] | None = None,
    ) -> None:
        self._items = items
        self._plans = list(plans)
        # which plans travel as is: computed once (at register, by the transport) when given
        self._direct_views = (
            list(direct)
            if direct is not None
            else [direct_view(items, p, device=device, shared=shared) for p in self._plans]
        )
        if len(self._direct_views) != len(self._plans):
            raise InvalidArgument("direct", "direct must hold one entry per plan")
        self._device = device
        self._shared = shared
        self._slots = max(1, slots)
        if pool is not None and (pool.device != device or pool.shared != shared):
            pool = None
        self._pool = pool or BufferPool(device, shared=shared, slots=self._slots)
        self._cv = threading.Condition()
        self._progress: dict[str, int] = {c: 0 for c in consumers}  # buckets released
        self._ready: dict[int, FlatBucket | TensorList] = {}
        self._error: BaseException | None = None
        self._closed = False
        # buffers are sized for the largest bucket that is packed (tensors sent as is need none)
        self._cap = max(
            (
                p.nbytes
                for p, d in zip(self._plans, self._direct_views, strict=True)
                if d is None and not p.unpacked
            ),
            default=0,
        )
        self._cuda_stream: Any = None
        if device.type == "cuda":
            cuda: Any = torch.cuda
            self._cuda_stream = cuda.Stream(device=device)
        # a daemon thread: a packer stuck in a copy never holds up interpreter exit
        self._packer = DaemonCall.start(self._run, name="rollsafe-bucket-packer")

    def __len__(self) -> int:
        return len(self._plans)

    # ------------------------------------------------------------------ consumers
    def get(self, consumer: str, index: int, *, timeout: float) -> FlatBucket | TensorList:
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
        self._packer.wait(_CLOSE_WAIT_S)

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

    @property
    def direct_buckets(self) -> int:
        """How many of this update's buckets travel without a copy."""
        return sum(1 for d in self._direct_views if d is not None)

    def _pack(self, i: int, plan: BucketPlan) -> FlatBucket | TensorList:
        if plan.unpacked:
            return TensorList(plan.metas, tuple(self._items[j][1] for j in plan.indices))
        direct = self._direct_views[i]
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
        pairs = [
            (flat[meta.start : meta.end].view(meta.shape), self._items[idx][1].detach())
            for idx, meta in zip(plan.indices, plan.metas, strict=True)
        ]
        with torch.no_grad():
            copy_pairs(pairs)
