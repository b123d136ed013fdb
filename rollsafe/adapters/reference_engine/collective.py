"""Process groups of the reference engine: its own rank group and trainer weight-update groups.

Owns how groups are built, never through the default ``torch.distributed`` group: every group is
a standalone ``ProcessGroupGloo`` (CPU) or NCCL group over a ``PrefixStore`` so the engine can
join several (its internal tensor-parallel group, one or more trainer groups) and leave them
independently. :func:`open_weight_update_group` is the same call on the trainer (rank 0, store
master) and on every engine rank, matching SGLang's ``init_weights_update_group`` semantics.

The engine's own :class:`RankGroup` is gloo by default, also on CUDA: its traffic is one logits
row per decode step (and ``lm_head`` for checksums), so GPU tensors are copied to the host and
back; this works for several ranks sharing one GPU (NCCL refuses that) and a dead peer fails a
collective at once instead of hanging a GPU stream. ``backend="nccl"`` (one GPU per rank) keeps
the tensors on the device.
"""

from __future__ import annotations

import datetime
import ipaddress
from typing import Any

import torch
import torch.distributed

# torch stubs do not export the store/group classes; they exist at runtime
dist: Any = torch.distributed

__all__ = ["RankGroup", "WeightUpdateGroup", "is_loopback", "open_weight_update_group"]


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _gloo(store: Any, rank: int, world_size: int, timeout_s: float, host: str | None) -> Any:
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    if host is not None and is_loopback(host):
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    else:
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


def open_weight_update_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    connect_timeout_s: float | None = None,
) -> WeightUpdateGroup:
    """Join (rank 0: create) a standalone weight-update process group; blocks until all join.

    Rank 0 hosts the ``TCPStore`` on ``master_address:master_port``. Returns a process-group
    :class:`WeightUpdateGroup`; ``broadcast(tensor, root)`` returns a ``Work`` (``.wait()``).
    ``timeout_s`` bounds every collective of the group; ``connect_timeout_s`` (default
    ``timeout_s``) the store connect and the rendezvous. The store does not always honour it
    (a silent peer holds the connect for minutes): the engine calls this on a thread of its own
    and enforces its deadline itself (``ranks.GroupJoin``).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        master_address,
        int(master_port),
        world_size,
        is_master=(rank == 0),
        timeout=datetime.timedelta(seconds=connect_timeout_s or timeout_s),
        wait_for_workers=False,
    )
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        pg = _gloo(prefixed, rank, world_size, timeout_s, master_address)
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    else:
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    return WeightUpdateGroup(pg, store, group_name, backend)


class WeightUpdateGroup:
    """A weight-update process group plus its store (rank 0 hosts the store's server)."""

    def __init__(self, pg: Any, store: Any, name: str, backend: str = "gloo") -> None:
        self.pg = pg
        self.store = store
        self.name = name
        self.backend = backend
        #: the engine's id of the join that created it (``init_group_cancel`` matches it)
        self.token: str | None = None

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> Any:
        """Start a broadcast from ``root``; returns the ``Work`` (call ``.wait()``)."""
        return self.pg.broadcast(tensor, root)

    def close(self) -> None:
        try:
            self.pg.abort()
        except Exception:
            pass
        self.pg = None
        self.store = None


class RankGroup:
    """The engine's own tensor-parallel group (loopback, bounded timeouts).

    ``connect_timeout_s`` bounds connecting to the store (it already listens when ranks are told
    its port); ``timeout_s`` bounds the rendezvous and every collective.
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
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.device = device or torch.device("cpu")
        if store is None:
            store = dist.TCPStore(
                "127.0.0.1",
                port,
                world_size,
                is_master=False,
                timeout=datetime.timedelta(seconds=connect_timeout_s or timeout_s),
                wait_for_workers=False,
            )
        self.store = store
        prefixed = dist.PrefixStore("rollsafe_engine_tp", self.store)
        if backend == "gloo":
            self.pg = _gloo(prefixed, rank, world_size, timeout_s, "127.0.0.1")
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = datetime.timedelta(seconds=timeout_s)
            self.pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        else:
            raise ValueError(f"rank group backend must be 'gloo' or 'nccl', got {backend!r}")

    @staticmethod
    def master_store(world_size: int, timeout_s: float) -> Any:
        """Rank 0's store on a loopback port the kernel picks (read ``.port``).

        The store binds the port itself, so no other process can take it between choosing and
        listening; tell the other ranks the port only after this returns.
        """
        return dist.TCPStore(
            "127.0.0.1",
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
