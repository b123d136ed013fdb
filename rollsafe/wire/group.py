"""The weight-update process group a trainer and every engine rank join, one definition.

Owns :func:`open_weight_update_group` (the same call on the trainer -- rank 0, store master --
and on every engine rank, matching SGLang's ``init_weights_update_group`` semantics),
:func:`host_store` (rank 0's store, bound before any peer is told its port) and
:class:`WeightUpdateGroup`. A group is never built through the default ``torch.distributed``
group: it is a standalone ``ProcessGroupGloo`` (CPU) or NCCL group over the store's keys laid
out as SGLang's end lays them (:func:`group_store`), so an engine can join several and leave them
independently. Imports only torch.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed

from rollsafe.errors import InvalidArgument
from rollsafe.net import is_loopback

# torch stubs do not export the store/group classes; they exist at runtime
dist: Any = torch.distributed

__all__ = [
    "WeightUpdateGroup",
    "gloo_group",
    "group_store",
    "host_store",
    "open_weight_update_group",
]


def group_store(store: Any, group_name: str, backend: str) -> Any:
    """The view of ``store`` a weight-update group's ranks exchange their keys under: SGLang's.

    SGLang 0.5.16's ``init_weights_update_group`` builds its end with ``init_custom_process_group``
    (``sglang/srt/utils/common.py``): a ``tcp://`` rendezvous, the store prefixed with the group's
    name, then torch's own new-group helper, which prefixes it again with ``"{name}/"`` and with
    the backend's device (``"cuda/"`` for NCCL, ``"cpu/"`` for gloo, whose first device is the
    CPU). Both ends must read and write the same keys (NCCL's unique id, gloo's addresses): a
    trainer that prefixed the name once met a real SGLang nowhere, each end waiting for a key the
    other wrote elsewhere (SGLang's first GPU run, docs/engines.md, "Weight-update groups").
    rollsafe's ends (trainer, reference engine, the ``rollsafe_gloo`` vLLM plugin) all use this
    one layout."""
    device = "cuda" if backend == "nccl" else "cpu"
    named = dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    return dist.PrefixStore(f"{device}/", named)


def gloo_group(store: Any, rank: int, world_size: int, timeout_s: float, host: str | None) -> Any:
    """A standalone ``ProcessGroupGloo`` over ``store`` (loopback device for a loopback host)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    if host is not None and is_loopback(host):
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    else:
        opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


def host_store(
    master_address: str, master_port: int, world_size: int, *, timeout_s: float = 120.0
) -> Any:
    """Rank 0's ``TCPStore``, listening when this returns: ``master_port`` 0 lets the system pick
    a free port (``store.port`` tells which). Bind the store first, then tell the peers its port:
    a port picked free and bound later can be taken in between by another process (a failed join
    on a busy machine), and a peer told a port someone else holds connects to a stranger's store.
    Raises the store's error (the port is taken) before anyone was told anything."""
    return dist.TCPStore(
        master_address,
        int(master_port),
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


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
    store: Any = None,
) -> WeightUpdateGroup:
    """Join (rank 0: create) a standalone weight-update process group; blocks until all join.

    Rank 0 hosts the ``TCPStore`` on ``master_address:master_port``, or passes the one
    :func:`host_store` bound already (``store``: then ``master_port`` is its port). Returns a
    process-group :class:`WeightUpdateGroup`; ``broadcast(tensor, root)`` returns a ``Work``
    (``.wait()``). ``timeout_s`` bounds every collective of the group; ``connect_timeout_s``
    (default ``timeout_s``) the store connect and the rendezvous. The store does not always
    honour it (a silent peer holds the connect for minutes): the engine calls this on a thread of
    its own and enforces its deadline itself (``ranks.GroupJoin``).
    """
    if not 0 <= rank < world_size:
        raise InvalidArgument("rank", f"rank {rank} is outside world_size {world_size}")
    if store is not None and rank != 0:
        raise InvalidArgument("store", f"only rank 0 hosts the store, not rank {rank}")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(
            master_address,
            int(master_port),
            world_size,
            is_master=(rank == 0),
            timeout=datetime.timedelta(seconds=connect_timeout_s or timeout_s),
            wait_for_workers=False,
        )
    prefixed = group_store(store, group_name, backend)
    if backend == "gloo":
        pg = gloo_group(prefixed, rank, world_size, timeout_s, master_address)
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    else:
        raise InvalidArgument("backend", f"backend must be 'gloo' or 'nccl', got {backend!r}")
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
