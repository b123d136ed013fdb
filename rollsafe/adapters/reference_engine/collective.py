"""Process groups of the reference engine: its own rank group (:class:`RankGroup`).

Trainer weight-update groups (:func:`open_weight_update_group`, :class:`WeightUpdateGroup`) are
shared with the trainer's transports and live in :mod:`rollsafe.wire.group`; they are
re-exported here. Every group is a standalone group over a ``PrefixStore``, never the default
``torch.distributed`` group, so the engine can join several and leave them independently.

The engine's own :class:`RankGroup` is gloo by default, also on CUDA: its traffic is one logits
row per decode step (and ``lm_head`` for checksums), so GPU tensors are copied to the host and
back; this works for several ranks sharing one GPU (NCCL refuses that) and a dead peer fails a
collective at once instead of hanging a GPU stream. ``backend="nccl"`` (one GPU per rank) keeps
the tensors on the device.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed

# the weight-update group is shared with the trainer's transports: it lives in rollsafe.wire
from rollsafe.wire.group import (
    gloo_group,
)

# torch stubs do not export the store/group classes; they exist at runtime
dist: Any = torch.distributed

__all__ = ["RankGroup"]


class RankGroup:
    """The engine's own tensor-parallel group (loopback, bounded timeouts).

    ``connect_timeout_s`` bounds connecting to the store (it already listens when ranks are told
    its port); ``timeout_s`` bounds the rendezvous and every collective. ``host``: where rank 0's
    store listens (loopback on one node; the head's address when the ranks span nodes) and
    ``device_host`` the address this rank's gloo device binds (its interface towards the head).
    """

    def __init__(
        self,
        *,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float,
        connect_timeout_s: float | None = None,
        store: Any = None,
        backend: str = "gloo",
        device: torch.device | None = None,
        host: str = "127.0.0.1",
        device_host: str = "127.0.0.1",
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.device = device or torch.device("cpu")
        if store is None:
            store = dist.TCPStore(
                host,
                port,
                world_size,
                is_master=False,
                timeout=datetime.timedelta(seconds=connect_timeout_s or timeout_s),
                wait_for_workers=False,
            )
        self.store = store
        prefixed = dist.PrefixStore("rollsafe_engine_tp", self.store)
        if backend == "gloo":
            self.pg = gloo_group(prefixed, rank, world_size, timeout_s, device_host)
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = datetime.timedelta(seconds=timeout_s)
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        else:
            raise ValueError(f"rank group backend must be 'gloo' or 'nccl', got {backend!r}")

    @staticmethod
    def master_store(world_size: int, timeout_s: float, host: str = "127.0.0.1") -> Any:
        """Rank 0's store on a port of ``host`` (loopback by default) the kernel picks (read
        ``.port``).

        The store binds the port itself, so no other process can take it between choosing and
        listening; tell the other ranks the port only after this returns.
        """
        return dist.TCPStore(
            host,
            0,
            world_size,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )

    def all_gather_rows(
        self, local: torch.Tensor, rows_per_rank: int, total_rows: int
    ) -> torch.Tensor:
        """Concatenate every rank's ``local`` along dim -1 (padded to ``rows_per_rank``).

        With gloo the exchange runs on host copies and the result is on the CPU; with NCCL it
        stays on this rank's GPU.
        """
        if self.world_size == 1:
            return local
        pad = rows_per_rank - local.shape[-1]
        if pad:
            local = torch.nn.functional.pad(local, (0, pad))
        if self.backend == "gloo" and local.device.type != "cpu":
            local = local.cpu()
        local = local.contiguous()
        outs = [torch.empty_like(local) for _ in range(self.world_size)]
        self.pg.allgather([outs], [local]).wait()
        return torch.cat(outs, dim=-1)[..., :total_rows]
