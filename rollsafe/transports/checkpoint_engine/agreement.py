"""Store agreement: what the trainer ranks agree on over their own process group.

Owns :func:`agree_store_address` (the parameter servers' TCPStore address: rank 0's outbound IP
and a free port, broadcast to every rank) and :func:`gather_rank_status` (every rank's ok/error,
so a failure on one rank fails the collective everywhere).
"""

from __future__ import annotations

import socket
from typing import Any

from rollsafe.net import free_port
from rollsafe.text import MAX_MESSAGE_CHARS


def dist_module() -> Any:
    import torch.distributed as dist

    return dist


def gather_rank_status(
    ok: bool, error: str = "", *, group: Any = None
) -> dict[int, tuple[bool, str]]:
    """All-gather ``(ok, error)`` of every rank of ``group`` (None: default): ``{rank: ...}``."""
    dist = dist_module()
    world = dist.get_world_size(group)
    out: list[Any] = [None] * world
    dist.all_gather_object(out, (bool(ok), str(error)[:MAX_MESSAGE_CHARS]), group=group)
    return {r: (bool(o[0]), str(o[1])) for r, o in enumerate(out)}


def agree_store_address(
    master_addr: str | None = None, store_port: int | None = None, *, group: Any = None
) -> tuple[str, int]:
    """The TCPStore address every parameter server connects to, agreed over the trainer group.

    With both given, they are used as is (every rank must pass the same). Otherwise rank 0 picks
    (its outbound IP, or 127.0.0.1 for a single rank; a free port) and broadcasts its choice.
    Nothing is read from ``MASTER_ADDR``/``MASTER_PORT``.
    """
    if master_addr and store_port:
        return master_addr, int(store_port)
    dist = dist_module()
    world = dist.get_world_size(group)
    choice: list[Any] = [None]
    if dist.get_rank(group) == 0:
        addr = master_addr or ("127.0.0.1" if world == 1 else _outbound_ip())
        choice = [(addr, int(store_port) if store_port else free_port(addr))]
    if world > 1:
        dist.broadcast_object_list(
            choice, src=dist.get_global_rank(group, 0) if group else 0, group=group
        )
    addr, port = choice[0]
    return str(addr), int(port)


def _outbound_ip() -> str:
    """The IP of the interface that routes outwards (no packet is sent), else the host's name IP."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())
