"""Receiving side of weight updates: turns each transport's payload into named tensors.

Owns the sources a rank can stage weights from, each validated before anything is staged:

* :func:`read_checkpoint_dir` -- an HF directory (``save_pretrained`` output or a rollsafe HF
  export: ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` + index);
* :func:`decode_tensor_entry` -- one rank's ``serialized_named_tensors`` entry (shared memory
  or CUDA IPC via :mod:`rollsafe.wire.bucket`), as views of the sender's memory;
  :class:`SharedMappings` keeps the last few shared-memory buckets mapped so a sender that
  reuses its buffers is not re-mapped (and page-faulted) on every call;
* :func:`receive_broadcast` -- tensors broadcast by rank 0 of a weight-update group, one flat
  buffer (``flattened_bucket``) or one broadcast per tensor, received into a
  :class:`ReceiveBuffers` buffer kept between calls;
* :func:`receive_from_ipc` -- checkpoint-engine's ZMQ/CUDA-IPC worker protocol (CUDA only).
"""

from __future__ import annotations

import collections
import contextlib
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from rollsafe.adapters.reference_engine.errors import Unsupported, WeightUpdateError
from rollsafe.adapters.reference_engine.model import ParamSpec
from rollsafe.adapters.reference_engine.paths import check_dir, show_path
from rollsafe.adapters.reference_engine.profiling import profile_line
from rollsafe.errors import BucketFormatError
from rollsafe.wire.bucket import WireBucket, deserialize_payload
from rollsafe.wire.bucket import packed_chunks as wire_chunks
from rollsafe.wire.hf_index import INDEX_FILE, SINGLE_FILE, HFIndexError, weight_files

__all__ = [
    "ReceiveBuffers",
    "SharedMappings",
    "UpdateMeta",
    "check_model_path",
    "decode_tensor_entry",
    "packed_chunks",
    "packed_layout",
    "parse_update_meta",
    "read_checkpoint_dir",
    "receive_broadcast",
    "receive_from_ipc",
]

UpdateMeta = list[tuple[str, tuple[int, ...], torch.dtype]]


def check_model_path(model_path: object) -> Path:
    """``model_path`` of a disk update as a :class:`Path`; :class:`WeightUpdateError` if unusable.

    Cheap (no file is opened); the HTTP handlers call it before queueing the update, so a bad
    path answers 400 at once and never reaches the ranks.
    """
    return check_dir(model_path, what="model_path")


def _weight_files(path: Path) -> list[Path]:
    try:
        return _find_weight_files(check_model_path(path))
    except OSError as exc:
        raise WeightUpdateError(
            f"model_path {show_path(path)} cannot be read: {exc.strerror or exc}"
        ) from exc


def _find_weight_files(path: Path) -> list[Path]:
    try:
        files = weight_files(path, shown=f"{show_path(path)}/{INDEX_FILE}")
    except HFIndexError as exc:
        raise WeightUpdateError(str(exc)) from exc
    if files is None:
        raise WeightUpdateError(
            f"model_path {show_path(path)} has neither {SINGLE_FILE} nor {INDEX_FILE}"
        )
    return files


def read_checkpoint_dir(
    model_path: str | Path, specs: dict[str, ParamSpec]
) -> dict[str, torch.Tensor]:
    """Read and validate every weight of an HF directory against ``specs``.

    Floating tensors are cast to the model's dtype (as ``from_pretrained`` does); names must
    cover the model exactly and shapes must match. Raises :class:`WeightUpdateError`.
    """
    from safetensors import safe_open

    path = Path(model_path)
    files = _weight_files(path)
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for name in sf.keys():  # noqa: SIM118 - safe_open has no __iter__
                    if name in out:
                        raise WeightUpdateError(f"{f.name}: tensor {name!r} appears in two shards")
                    spec = specs.get(name)
                    if spec is None:
                        if name.endswith("rotary_emb.inv_freq"):
                            continue
                        raise WeightUpdateError(f"{f.name}: unknown parameter {name!r}")
                    t = sf.get_tensor(name)
                    if tuple(t.shape) != spec.shape:
                        raise WeightUpdateError(
                            f"{f.name}: parameter {name!r}: shape {list(t.shape)} does not match "
                            f"the model's {list(spec.shape)}"
                        )
                    if t.dtype != spec.dtype:
                        if not (t.dtype.is_floating_point and spec.dtype.is_floating_point):
                            raise WeightUpdateError(
                                f"{f.name}: parameter {name!r}: dtype {t.dtype} cannot be cast "
                                f"to {spec.dtype}"
                            )
                        t = t.to(spec.dtype)
                    out[name] = t
        except WeightUpdateError:
            raise
        except Exception as exc:
            raise WeightUpdateError(f"{f}: cannot read safetensors ({exc})") from exc
    missing = sorted(set(specs) - set(out))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightUpdateError(f"{path}: missing parameter {missing[0]!r}{more}")
    return out


class SharedMappings:
    """Keeps the CPU shared-memory storages of the last ``keep`` flattened buckets mapped.

    torch maps a ``file_system`` shared-memory payload afresh unless a live storage of the same
    handle exists (its cache holds weak references), and a fresh mapping page-faults on every
    page it reads. The ipc transport reuses two shared buffers for all its buckets, so keeping
    the last two mapped makes every later call read already-mapped pages. Only flattened buckets
    on CPU are kept: a plain named-tensor payload usually shares the trainer's own tensors, and
    CUDA IPC memory held here could not be freed by the trainer. Cost: a bucket the sender has
    freed stays allocated until it leaves this window or :meth:`clear` runs (memory release).
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._storages: collections.OrderedDict[int, torch.UntypedStorage] = (
            collections.OrderedDict()
        )

    def hold(self, flat: torch.Tensor) -> None:
        if self.keep <= 0 or flat.device.type != "cpu":
            return
        storage = flat.untyped_storage()  # a read-only mapping of the sender's segment
        key = storage.data_ptr()
        self._storages.pop(key, None)
        self._storages[key] = storage
        while len(self._storages) > self.keep:
            self._storages.popitem(last=False)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self._storages.values())

    def clear(self) -> None:
        self._storages.clear()


def decode_tensor_entry(
    entry: Any, *, rank: int, mappings: SharedMappings | None = None
) -> list[tuple[str, torch.Tensor]]:
    """Decode one rank's serialized entry into ``(name, tensor view)`` pairs.

    The views alias the sender's memory, which the sender keeps unchanged until this request is
    answered. ``mappings`` keeps a flattened bucket's shared memory mapped for later calls.
    """
    t0 = time.perf_counter()
    try:
        payload = deserialize_payload(entry)
    except BucketFormatError as exc:
        raise WeightUpdateError(f"serialized_named_tensors[{rank}]: {exc}") from exc
    profile_line("decode.unpickle_open", rank, time.perf_counter() - t0)
    if isinstance(payload, WireBucket):
        if mappings is not None:
            mappings.hold(payload.flat)
        t0 = time.perf_counter()
        views = payload.named_views()
        profile_line("decode.views", rank, time.perf_counter() - t0)
        return views
    return payload


class ReceiveBuffers:
    """Receive buffers kept between distributed updates, so a call neither allocates nor
    page-faults fresh memory: up to ``slots`` per (device, dtype), each grown to the largest call
    it took.

    A buffer holds one call's data until that call's commit has copied it out. On CUDA the
    engine answers an intermediate nccl call once its copies are queued (see
    :meth:`RankRuntime.op_commit`), so :meth:`mark_read` records the event those copies end at
    and :meth:`get` hands out a slot whose event has completed; with every slot still being read
    it waits for the oldest one, on ``stream`` when given (a GPU-side wait) or on the host. That
    is what lets call ``i + 1`` be received while call ``i`` is copied into the weights: two
    slots of one bucket each at most. A single-bucket update reuses one slot (its commit
    waits). ``pin`` allocates CPU buffers in pinned memory (a CUDA engine receiving over gloo
    copies them to the device). :meth:`clear` frees them (memory release, last weight-update
    group destroyed).
    """

    def __init__(self, *, pin: bool = False, slots: int = 2) -> None:
        self.pin = pin
        self.slots = max(1, slots)
        self._bufs: dict[tuple[str, torch.dtype], list[_Slot]] = {}
        self._handed: list[_Slot] = []  # slots given to the call being staged
        self._seq = 0

    def get(
        self,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        stream: Any = None,
    ) -> torch.Tensor:
        """A 1-D buffer of exactly ``numel`` elements (a prefix of a kept buffer) that nothing
        reads any more, or that ``stream`` has been made to wait for."""
        key = (str(device), dtype)
        slots = self._bufs.setdefault(key, [])
        slot = next((s for s in slots if s.free() and s.fits(numel)), None)
        slot = slot or next((s for s in slots if s.free()), None)
        if slot is None and len(slots) < self.slots:
            slot = _Slot()
            slots.append(slot)
        if slot is None:  # every slot is still being copied out of: wait for the oldest
            slot = min(slots, key=lambda s: s.seq)
            event = slot.event
            if event is not None:
                if stream is not None:
                    stream.wait_event(event)
                else:
                    event.synchronize()
            slot.event = None
        if not slot.fits(numel):
            slot.buf = None  # free the smaller buffer before allocating the larger one
            pin = self.pin and device.type == "cpu"
            slot.buf = torch.empty(numel, dtype=dtype, device=device, pin_memory=pin)
            if stream is not None and device.type == "cuda":
                # fresh memory may come from blocks earlier default-stream kernels used
                stream.wait_stream(torch.cuda.current_stream(device))
        self._handed.append(slot)
        assert slot.buf is not None
        return slot.buf[:numel]

    def mark_read(self, event: Any) -> None:
        """The call staged from the buffers handed out since the last mark is committed; its
        copies out of them end at ``event`` (a CUDA event, or ``None``: already done)."""
        self._seq += 1
        for slot in self._handed:
            slot.event, slot.seq = event, self._seq
        self._handed.clear()

    def drop(self, dtype: torch.dtype, device: torch.device) -> None:
        self._bufs.pop((str(device), dtype), None)
        self._handed.clear()

    @property
    def nbytes(self) -> int:
        return sum(
            s.buf.numel() * s.buf.element_size()
            for slots in self._bufs.values()
            for s in slots
            if s.buf is not None
        )

    @property
    def buffers(self) -> int:
        """How many buffers are allocated (all devices and dtypes)."""
        return sum(1 for slots in self._bufs.values() for s in slots if s.buf is not None)

    def clear(self) -> None:
        self._bufs.clear()
        self._handed.clear()


class _Slot:
    """One kept receive buffer and the event its last reader (a commit's copies) ends at."""

    __slots__ = ("buf", "event", "seq")

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.event: Any = None
        self.seq = 0

    def free(self) -> bool:
        if self.event is not None and self.event.query():
            self.event = None
        return self.event is None

    def fits(self, numel: int) -> bool:
        return self.buf is not None and self.buf.numel() >= numel


def parse_update_meta(
    names: Any, dtypes: Any, shapes: Any, *, dtype_key: str = "dtypes"
) -> UpdateMeta:
    """Check the parallel ``names`` / ``dtypes`` / ``shapes`` lists of a distributed update."""
    from rollsafe.wire.dtypes import dtype_from_name

    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise WeightUpdateError("'names' must be a list of strings")
    if not isinstance(dtypes, list) or len(dtypes) != len(names):
        raise WeightUpdateError(f"'{dtype_key}' must be a list as long as 'names' ({len(names)})")
    if not isinstance(shapes, list) or len(shapes) != len(names):
        raise WeightUpdateError(f"'shapes' must be a list as long as 'names' ({len(names)})")
    if not names:
        raise WeightUpdateError("'names' is empty")
    out: UpdateMeta = []
    for name, dt, shape in zip(names, dtypes, shapes, strict=False):
        try:
            dtype = dtype_from_name(dt)
        except BucketFormatError as exc:
            raise WeightUpdateError(f"parameter {name!r}: {exc}") from exc
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise WeightUpdateError(f"parameter {name!r}: shape {shape!r} is not a list of ints")
        out.append((name, tuple(shape), dtype))
    return out


def packed_chunks(meta: UpdateMeta, chunk_bytes: int | None) -> list[list[int]]:
    """Indices of ``meta`` per broadcast of a packed call: one chunk when ``chunk_bytes`` is
    None (SGLang), else vLLM's packed rule (:func:`rollsafe.wire.bucket.packed_chunks`)."""
    sizes = [math.prod(shape) * torch.empty((), dtype=dt).element_size() for _, shape, dt in meta]
    return [list(range(a, b)) for a, b in wire_chunks(sizes, chunk_bytes)]


def packed_layout(meta: UpdateMeta, chunk_bytes: int | None) -> list[tuple[int, int]]:
    """``(byte start, byte size)`` of each chunk of a packed call in one receive buffer.

    Tensors lie back to back at byte offsets in ``meta`` order (any dtypes), as SGLang's
    ``FlattenedTensorBucket.empty`` and vLLM's ``unpack_tensor`` expect; each offset within its
    chunk must be aligned to the tensor's element size (both upstreams refuse or fail on an
    unaligned one: :class:`WeightUpdateError` naming the tensor). Chunks start 64-byte aligned.
    """
    out: list[tuple[int, int]] = []
    offset = 0
    for chunk in packed_chunks(meta, chunk_bytes):
        start = -(-offset // 64) * 64
        within = 0
        for i in chunk:
            name, shape, dtype = meta[i]
            item = torch.empty((), dtype=dtype).element_size()
            if within % item:
                raise WeightUpdateError(
                    f"packed tensor {name!r} would start at byte {within} of its chunk, not "
                    f"aligned to its {dtype} elements (upstream refuses unaligned tensors)"
                )
            within += math.prod(shape) * item
        out.append((start, within))
        offset = start + within
    return out


def receive_broadcast(
    pg: Any,
    meta: UpdateMeta,
    *,
    flattened: bool,
    device: torch.device,
    buffers: ReceiveBuffers | None = None,
    stream: Any = None,
    chunk_bytes: int | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """Receive tensors broadcast from rank 0 of ``pg`` (already validated ``meta``).

    ``flattened`` (SGLang's ``flattened_bucket``): one broadcast of a ``uint8`` buffer holding the
    tensors' bytes back to back in ``meta`` order, as SGLang's ``FlattenedTensorBucket.empty``
    lays it out (posted before the views are built); with ``chunk_bytes`` (vLLM's packed
    transfer) one such broadcast per chunk of :func:`packed_chunks`. Otherwise one broadcast per
    tensor, each landing in one flat buffer per dtype. Buffers come from ``buffers`` when given
    (else are freshly allocated); every tensor is returned as a view, in ``meta`` order.
    A failed broadcast drops the buffers it may have been writing (they are never reused
    half-written by a transfer still running).

    ``stream`` (CUDA, nccl): the broadcasts are posted from it instead of the current stream,
    and the current stream then waits for them. Work queued on the current stream (the previous
    call's copies into the weights) therefore does not hold up this receive, while everything
    queued after it (the copies of this call, generation) still sees the received data.
    """
    chunk_starts: list[tuple[int, int]] = []  # (byte start, byte size) of each chunk
    if flattened:
        chunk_starts = packed_layout(meta, chunk_bytes)
        last_start, last_size = chunk_starts[-1]
        totals: dict[torch.dtype, int] = {torch.uint8: last_start + last_size}
    else:
        totals = {}
        for _, shape, dtype in meta:
            totals[dtype] = totals.get(dtype, 0) + math.prod(shape)
    if buffers is None and stream is not None:
        stream.wait_stream(torch.cuda.current_stream(device))  # see ReceiveBuffers.get
    flats = {
        dt: (
            buffers.get(n, dt, device, stream=stream)
            if buffers is not None
            else torch.empty(n, dtype=dt, device=device)
        )
        for dt, n in totals.items()
    }

    def views() -> list[tuple[str, torch.Tensor]]:
        out: list[tuple[str, torch.Tensor]] = []
        if flattened:
            raw = flats[torch.uint8]
            chunks = packed_chunks(meta, chunk_bytes)
            for chunk, (start, _) in zip(chunks, chunk_starts, strict=True):
                for i in chunk:
                    name, shape, dtype = meta[i]
                    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                    out.append((name, raw[start : start + n].view(dtype).view(shape)))
                    start += n
            return out
        pos = dict.fromkeys(totals, 0)
        for name, shape, dtype in meta:
            n = math.prod(shape)
            out.append((name, flats[dtype][pos[dtype] : pos[dtype] + n].view(shape)))
            pos[dtype] += n
        return out

    side = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    try:
        if flattened:
            (flat,) = flats.values()
            with side:
                works = [pg.broadcast(flat[a : a + n], 0) for a, n in chunk_starts]
            out = views()  # built while the data moves
        else:
            out = views()
            # the sender issues its broadcasts back to back; post every receive before waiting
            # (in order: a process group runs its collectives in issue order)
            with side:
                works = [pg.broadcast(t, 0) for _, t in out]
        for work in works:
            work.wait()  # on CUDA: the current stream waits for the receive
    except BaseException:
        if buffers is not None:
            for dt in flats:
                buffers.drop(dt, device)
        raise
    return out


def receive_from_ipc(
    zmq_handles: Any,
    *,
    device: torch.device,
    stage: Callable[[Sequence[tuple[str, torch.Tensor]]], None],
) -> None:
    """Receive weights through checkpoint-engine's worker protocol (CUDA only).

    ``zmq_handles`` maps a device UUID to a ZMQ socket path, as checkpoint-engine's
    ``ParameterServer.update`` sends it. The tensors handed over are views into the sender's
    buffers, which it refills for the next bucket of the same request, so ``stage`` must copy
    them (once, into private buffers) before returning.
    """
    if device.type != "cuda":
        raise Unsupported(
            "update_weights_from_ipc needs CUDA: checkpoint-engine hands weights over as CUDA IPC "
            "buffers, and this engine runs on CPU"
        )
    try:
        import zmq
        from checkpoint_engine.worker import update_weights_from_ipc
    except ImportError as exc:
        raise Unsupported(f"update_weights_from_ipc needs checkpoint-engine: {exc}") from exc
    if not isinstance(zmq_handles, dict):
        raise WeightUpdateError("'zmq_handles' must be an object {device_uuid: socket path}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    handle = zmq_handles.get(uuid) or zmq_handles.get(f"GPU-{uuid}")
    if handle is None:
        raise WeightUpdateError(f"zmq_handles has no entry for this rank's device {uuid!r}")
    update_weights_from_ipc(
        zmq.Context.instance(),
        handle,
        device_id=index,
        run=lambda weights: stage(list(weights)),
        post_hook=None,
    )
