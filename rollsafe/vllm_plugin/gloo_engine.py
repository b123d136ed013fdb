"""The ``rollsafe_gloo`` weight-transfer engine: vLLM's weight-update protocol over a gloo group.

Runs inside vLLM's workers (vLLM's factory imports it on first use, see
:mod:`rollsafe.vllm_plugin`); imports torch, vLLM and rollsafe's delta wire format
(:mod:`rollsafe.wire.delta`: torch, numpy) and its group's key layout (:mod:`rollsafe.wire.group`:
torch). It receives exactly what rollsafe's ``NCCLTransport(backend="gloo")`` sends a
vLLM-dialect engine:

* **join** (``/init_weight_transfer_engine`` {init_info}): the ``init_info`` ``VLLMClient``
  sends (``master_address``, ``master_port``, ``rank_offset``, ``world_size``, ``packed``,
  optionally ``packed_buffer_size_bytes`` / ``packed_num_buffers``). The worker joins the
  trainer's standalone gloo group the way rollsafe's own ends do
  (``rollsafe/wire/group.py``): a ``TCPStore`` client of ``master_address:master_port``
  (the trainer, rank 0, hosts it), keys laid out under :data:`GROUP_NAME` as every rollsafe end
  lays them (``group_store``; vLLM's one group has no name, so both ends use the fixed one,
  ``rollsafe/wire/group_names.py``), rank
  ``rank_offset`` + the worker's global rank (data-parallel index x world size + rank, as
  vLLM's NCCL engine computes it);
* **update** (``/start_weight_update`` -> ``/update_weights`` x N -> ``/finish_weight_update``):
  vLLM's layerwise reload (start: weights to meta, loaders wrapped; finish: processed, e.g. the
  CPU's oneDNN prepacking) around ``model.load_weights``. Each ``/update_weights``
  {names, dtype_names, shapes} receives, packed, uint8 chunks of whole tensors in call order, a
  chunk closed once its size *exceeds* ``packed_buffer_size_bytes`` (vLLM's
  ``packed_nccl_broadcast_consumer`` rule, which ``rollsafe.wire.bucket.packed_chunks``
  produces); unpacked, one broadcast per tensor in its dtype. Every receive buffer is fresh
  (the layerwise reload keeps references to what it was given until the layer is complete).

The engine must be paused while an update is open: a forward pass between start and finish
meets meta tensors and kills vLLM's engine (``docs/engines.md``).

**Deltas** (issue #28; ``docs/transports.md``, "Deltas"): with ``init_info.keep_delta_base``
(off by default; rollsafe's sender sets it for a target whose traits apply deltas,
``EngineTarget.delta_base_by_content``) the engine keeps a host *mirror*: a clone of every
tensor a full push loaded, under the names the trainer sent (one model's worth of host memory,
in the pushed dtypes; a delta apply adds a copy of the touched tensors while it runs). An update
whose first ``/update_weights`` carries :data:`~rollsafe.wire.delta.DELTA_HEADER_KEY` is a
delta (``rollsafe.wire.delta``; the sender sends the header first): its parts are buffered, not
loaded, across calls until every name the header lists arrived; then
:func:`~rollsafe.wire.delta.apply_delta` builds the touched tensors from the mirror, checking
the base by content (vLLM's workers never see ``weight_version``: each touched mirror tensor
must hash to the header's ``base_digests``; after a delta the mirror's version is known too and
the header's ``base_version`` must equal it) and every result against its digest, and the WHOLE
merged mirror is loaded into the open layerwise reload: a layer given only some of its
tensors would be processed with the rest uninitialised (``finalize_layerwise_processing``
materialises a partly loaded layer), while one given none keeps its old tensors. The mirror
takes the result when the update finishes.

A refused delta (no mirror, another base, a malformed payload, a wrong result digest) changes
nothing: the open reload is finalized with nothing loaded (vLLM then puts every layer's own
tensors back, the weights served before, logging "Failed to load weights" per layer), and
``/update_weights`` fails with a ``RuntimeError`` whose message is the
:class:`~rollsafe.wire.delta.DeltaError`'s class name and message (``DeltaBaseMismatch: ...``:
what the sender's ``is_delta_refusal`` reads; it then pushes the version full in the same
update). vLLM 0.32 hands a worker's exception to the caller as ``str(exc)`` only ("Worker failed
with error '...'"), so the class name must be in the message itself. A delta whose receive
fails before it is applied is closed the same way, and the receive's own error raised.
Raising inside ``update_weights`` is where vLLM's worker clears its update flag; the client's
closing ``/finish_weight_update`` is then answered with an error it ignores.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from rollsafe.wire.delta import (
    DELTA_HEADER_KEY,
    DeltaBaseMismatch,
    DeltaError,
    DeltaFormatError,
    DeltaHeader,
    apply_delta,
    read_header,
)
from rollsafe.wire.group import group_store

__all__ = [
    "GROUP_NAME",
    "GlooInitInfo",
    "GlooUpdateInfo",
    "GlooWeightTransferEngine",
]

#: The name both ends join vLLM's one group under (``rollsafe.wire.group_names``).
GROUP_NAME = "vllm_weight_transfer"
#: vLLM's default packed chunk size (``packed_tensor.DEFAULT_PACKED_BUFFER_SIZE_BYTES``).
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30
#: Seconds the join and each broadcast may take (the trainer's default ``group_timeout``).
GROUP_TIMEOUT_S = 120.0

dist: Any = torch.distributed


# vLLM is not installed where rollsafe is type-checked: its base classes are Any there
@dataclass
class GlooInitInfo(WeightTransferInitInfo):  # type: ignore[misc]
    """What ``/init_weight_transfer_engine`` carries (the NCCL backend's TCP-rendezvous fields)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = 2  # accepted for compatibility; gloo receives one chunk at a time
    #: keep a host mirror of what full pushes load, to apply deltas onto (see the module doc)
    keep_delta_base: bool = False

    def __post_init__(self) -> None:
        if not 0 <= int(self.master_port) < 65536:
            raise ValueError(f"init_info.master_port out of range: {self.master_port!r}")
        if int(self.world_size) < 2 or int(self.rank_offset) < 1:
            raise ValueError(
                f"init_info: world_size must be >= 2 and rank_offset >= 1 (the trainer is "
                f"rank 0), got world_size={self.world_size!r}, rank_offset={self.rank_offset!r}"
            )
        if int(self.packed_buffer_size_bytes) <= 0:
            raise ValueError(
                "init_info.packed_buffer_size_bytes must be > 0, got "
                f"{self.packed_buffer_size_bytes!r}"
            )


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]
    """What one ``/update_weights`` carries: parallel lists, one entry per tensor."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"update_info: names/dtype_names/shapes lengths differ: {len(self.names)}/"
                f"{len(self.dtype_names)}/{len(self.shapes)}"
            )
        for name, dtype_name, shape in zip(self.names, self.dtype_names, self.shapes, strict=True):
            if not isinstance(getattr(torch, str(dtype_name), None), torch.dtype):
                raise ValueError(f"update_info: tensor {name!r}: unknown dtype {dtype_name!r}")
            if any(int(d) < 0 for d in shape):
                raise ValueError(f"update_info: tensor {name!r}: negative shape {shape!r}")

    def metas(self) -> Iterator[tuple[str, list[int], torch.dtype, int]]:
        """(name, shape, dtype, bytes) per tensor, in order."""
        for name, dtype_name, shape in zip(self.names, self.dtype_names, self.shapes, strict=True):
            dtype = getattr(torch, dtype_name)
            dims = [int(d) for d in shape]
            yield name, dims, dtype, math.prod(dims) * dtype.itemsize


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _GlooGroup:
    """A standalone ``ProcessGroupGloo`` joined as a client of the trainer's store."""

    def __init__(self, info: GlooInitInfo, rank: int) -> None:
        timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
        self.store = dist.TCPStore(
            info.master_address,
            int(info.master_port),
            int(info.world_size),
            is_master=False,
            timeout=timeout,
            wait_for_workers=False,
        )
        prefixed = group_store(self.store, GROUP_NAME, "gloo")
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        if _is_loopback(info.master_address):
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        else:
            opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        self.pg: Any = dist.ProcessGroupGloo(prefixed, rank, int(info.world_size), opts)

    def receive(self, tensor: torch.Tensor) -> torch.Tensor:
        self.pg.broadcast(tensor, 0).wait()
        return tensor

    def close(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None:
            with contextlib.suppress(Exception):
                pg.abort()
        self.store = None


def _refusal(exc: DeltaError) -> RuntimeError:
    """The error a refused delta leaves ``/update_weights`` with: vLLM passes only ``str()`` of
    a worker's exception on, so the message starts with the refusal's class name
    (``DeltaBaseMismatch: ...``), what the sender's ``is_delta_refusal`` looks for."""
    return RuntimeError(
        f"{type(exc).__name__}: {exc} (rollsafe_gloo: the update was closed with the weights"
        " served before)"
    )


@dataclass
class _Update:
    """One open update (start .. finish)."""

    calls: int = 0
    mode: str | None = None  # "full" or "delta", from the first /update_weights
    full: dict[str, torch.Tensor] | None = None  # clones of what a full push loaded (mirror)
    header: DeltaHeader | None = None
    parts: list[tuple[str, torch.Tensor]] | None = None  # a delta's received tensors
    result: tuple[dict[str, torch.Tensor], str] | None = None  # applied delta: mirror, version


_EngineBase: Any = WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]


class GlooWeightTransferEngine(_EngineBase):  # type: ignore[misc]
    """vLLM weight-transfer engine receiving rollsafe's gloo broadcasts (see the module doc)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: _GlooGroup | None = None
        self.packed = False
        self.packed_buffer_size_bytes = DEFAULT_PACKED_BUFFER_SIZE_BYTES
        self.keep_delta_base = False
        #: what the model holds, as the trainer named it (``keep_delta_base``); None: unknown
        self.mirror: dict[str, torch.Tensor] | None = None
        #: the mirror's version when a delta made it (a full push's version never reaches us)
        self.mirror_version: str | None = None
        self._update: _Update | None = None

    def worker_rank(self) -> int:
        """This worker's rank among all of vLLM's workers (data parallel included)."""
        pc = self.parallel_config
        return int(getattr(pc, "data_parallel_index", 0) or 0) * int(pc.world_size) + int(pc.rank)

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        if self.group is not None:  # a new trainer connection replaces the old one
            self.group.close()
            self.group = None
        rank = int(init_info.rank_offset) + self.worker_rank()
        if rank >= int(init_info.world_size):
            raise ValueError(
                f"init_info: worker rank {rank} (rank_offset {init_info.rank_offset}) is outside "
                f"world_size {init_info.world_size}"
            )
        self.packed = bool(init_info.packed)
        self.packed_buffer_size_bytes = int(init_info.packed_buffer_size_bytes)
        self.keep_delta_base = bool(init_info.keep_delta_base)
        if not self.keep_delta_base:  # nobody will send a delta: free the host copy
            self.mirror = self.mirror_version = None
        self.group = _GlooGroup(init_info, rank)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._update = None
        initialize_layerwise_reload(self.model)
        self._update = _Update()

    def _finalize(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def finish_weight_update(self) -> None:
        update, self._update = self._update, None
        if update is not None and update.mode == "delta" and update.result is None:
            # the last call came and the delta is incomplete: nothing was loaded, so the
            # reload keeps the old weights; this raise leaves vLLM's worker in update mode
            # (only a sender that truncates a delta gets here)
            self._finalize()
            header = update.header
            assert header is not None  # the delta mode is set by its header
            missing = sorted(header.wire_names() - {n for n, _ in update.parts or []})[:1]
            raise _refusal(
                DeltaFormatError(
                    f"the update finished before the delta was complete (missing {missing})",
                    key=missing[0] if missing else None,
                )
            )
        self._finalize()
        if update is None or update.mode is None:
            return
        if update.result is not None:
            self.mirror, self.mirror_version = update.result
        elif update.full is not None:
            self.mirror, self.mirror_version = update.full, None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class ends with torch.accelerator.synchronize(), which fails without one;
        # a gloo receive has completed when wait() returns
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        group = self.group
        if group is None:
            raise RuntimeError(
                "rollsafe_gloo weight transfer not initialized: call "
                "/init_weight_transfer_engine first"
            )
        update = self._update
        if update is None:  # vLLM's worker refuses an update before start; be as strict
            raise RuntimeError("rollsafe_gloo: /update_weights outside an open weight update")
        first = update.calls == 0
        update.calls += 1
        if first:
            update.mode = "delta" if DELTA_HEADER_KEY in update_info.names else "full"
        if update.mode == "delta":
            self._receive_delta(group, update, update_info)
            return
        if DELTA_HEADER_KEY in update_info.names:
            # the header must come first (the sender's delta_header_first): full tensors are
            # loaded already, so this cannot be refused cleanly
            self.mirror = self.mirror_version = None
            raise RuntimeError(
                f"rollsafe_gloo: {DELTA_HEADER_KEY!r} arrived in call {update.calls} of an "
                "update that began as a full push; the model is partly loaded"
            )
        if first:  # the model is changing: the mirror is rebuilt from this push
            self.mirror = self.mirror_version = None
            update.full = {} if self.keep_delta_base else None
        with _no_mtp_completeness_check():
            for batch in self._batches(group, update_info):
                if update.full is not None:
                    update.full.update((n, t.clone()) for n, t in batch)
                self.model.load_weights(batch)

    def _batches(
        self, group: _GlooGroup, update_info: GlooUpdateInfo
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The call's tensors as received: one list per packed chunk, or per tensor."""
        if self.packed:
            for chunk in _chunks(list(update_info.metas()), self.packed_buffer_size_bytes):
                buffer = group.receive(torch.empty(sum(m[3] for m in chunk), dtype=torch.uint8))
                parts = torch.split(buffer, [m[3] for m in chunk])
                yield [
                    (name, part.view(dtype).view(shape))
                    for (name, shape, dtype, _), part in zip(chunk, parts, strict=True)
                ]
        else:
            for name, shape, dtype, _ in update_info.metas():
                yield [(name, group.receive(torch.empty(shape, dtype=dtype)))]

    def _receive_delta(
        self, group: _GlooGroup, update: _Update, update_info: GlooUpdateInfo
    ) -> None:
        """Buffer one call's part of a delta; once complete, apply it onto the mirror and load
        the merged mirror. A refusal closes the reload with nothing loaded, then raises."""
        parts = update.parts if update.parts is not None else []
        update.parts = parts
        try:
            for batch in self._batches(group, update_info):  # the wire first: ends stay paired
                parts.extend(batch)
        except BaseException:
            if update.result is None:  # nothing loaded yet: close the reload on the old weights
                self._update = None
                with contextlib.suppress(Exception):
                    self._finalize()
            raise
        if update.result is not None:
            self._update = None
            self.mirror = self.mirror_version = None
            raise RuntimeError(
                "rollsafe_gloo: tensors arrived after the delta was applied; the model is loaded"
            )
        try:
            if update.header is None:
                update.header = read_header(parts)
                self._check_base(update.header)
            header = update.header
            if not header.wire_names() <= {n for n, _ in parts if n != DELTA_HEADER_KEY}:
                return  # more to come
            assert self.mirror is not None
            touched = apply_delta(self.mirror, parts, current_version=None)
        except DeltaError as exc:
            self._update = None
            self._finalize()
            raise _refusal(exc) from exc
        merged = dict(self.mirror)
        merged.update(touched)
        update.parts = None
        try:
            with _no_mtp_completeness_check():
                self.model.load_weights(list(merged.items()))
        except BaseException:
            self.mirror = self.mirror_version = None  # the model is partly loaded
            raise
        update.result = (merged, header.version)

    def _check_base(self, header: DeltaHeader) -> None:
        """What can be refused as soon as the header arrives: no mirror, another version."""
        if self.mirror is None:
            why = (
                "keeps no base (init_info.keep_delta_base is off)"
                if not self.keep_delta_base
                else "holds no base: no full push was loaded since it kept one"
            )
            raise DeltaBaseMismatch(
                header.base_version,
                "unknown",
                message=f"delta base v{header.base_version} but this engine {why}; "
                "nothing was applied",
            )
        if self.mirror_version is not None and header.base_version != self.mirror_version:
            raise DeltaBaseMismatch(header.base_version, self.mirror_version)

    def shutdown(self) -> None:
        """Leave the trainer's group (the mirror stays: it describes the model, not the
        connection)."""
        if self.group is not None:
            self.group.close()
            self.group = None


def _chunks(
    metas: list[tuple[str, list[int], torch.dtype, int]], limit: int
) -> Iterator[list[tuple[str, list[int], torch.dtype, int]]]:
    """vLLM's packed rule: whole tensors in order, a chunk closed once its size exceeds
    ``limit`` (so one tensor bigger than ``limit`` is a chunk of its own)."""
    chunk: list[tuple[str, list[int], torch.dtype, int]] = []
    size = 0
    for meta in metas:
        chunk.append(meta)
        size += meta[3]
        if size > limit:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


@contextlib.contextmanager
def _no_mtp_completeness_check() -> Iterator[None]:
    """vLLM's MTP completeness check expects a whole checkpoint per load (0.32 has the switch)."""
    try:
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )
    except ImportError:
        yield
        return
    with disable_mtp_completeness_check():
        yield
