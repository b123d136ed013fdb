"""The ``rollsafe_gloo`` weight-transfer engine: vLLM's weight-update protocol over a gloo group.

Runs inside vLLM's workers (vLLM's factory imports it on first use, see
:mod:`rollsafe.vllm_plugin`); imports only torch and vLLM. It receives exactly what rollsafe's
``NCCLTransport(backend="gloo")`` sends a vLLM-dialect engine:

* **join** (``/init_weight_transfer_engine`` {init_info}): the ``init_info`` ``VLLMClient``
  sends (``master_address``, ``master_port``, ``rank_offset``, ``world_size``, ``packed``,
  optionally ``packed_buffer_size_bytes`` / ``packed_num_buffers``). The worker joins the
  trainer's standalone gloo group the way rollsafe's own ends do
  (``rollsafe/wire/group.py``): a ``TCPStore`` client of ``master_address:master_port``
  (the trainer, rank 0, hosts it), keys prefixed with :data:`GROUP_NAME` (vLLM's one group has
  no name, so both ends use the fixed one, ``rollsafe/wire/group_names.py``), rank
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
        prefixed = dist.PrefixStore(GROUP_NAME, self.store)
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
        self.group = _GlooGroup(init_info, rank)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

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
        with _no_mtp_completeness_check():
            if self.packed:
                for chunk in _chunks(list(update_info.metas()), self.packed_buffer_size_bytes):
                    buffer = group.receive(torch.empty(sum(m[3] for m in chunk), dtype=torch.uint8))
                    parts = torch.split(buffer, [m[3] for m in chunk])
                    self.model.load_weights(
                        [
                            (name, part.view(dtype).view(shape))
                            for (name, shape, dtype, _), part in zip(chunk, parts, strict=True)
                        ]
                    )
            else:
                for name, shape, dtype, _ in update_info.metas():
                    tensor = group.receive(torch.empty(shape, dtype=dtype))
                    self.model.load_weights([(name, tensor)])

    def shutdown(self) -> None:
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
