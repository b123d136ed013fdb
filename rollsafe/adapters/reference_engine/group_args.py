"""The rendezvous arguments of a weight-update group, checked before anything is touched.

Owns :func:`check_group_args`: ``master_address``, ``master_port``, ``world_size`` and
``rank_offset`` of SGLang's ``/init_weights_update_group`` and of the vLLM dialect's
``/init_weight_transfer_engine`` ``init_info``. A value torch's ``TCPStore`` or process group
could not take (a port outside 1..65535, a bool for an int, a world size past int32, an address
with a space) is a :class:`BadRequest` (400) naming the key, raised before any group is
destroyed or set up, so a refused request changes nothing.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any

from rollsafe.adapters.reference_engine.errors import BadRequest

__all__ = ["GroupArgs", "check_group_args"]

#: a TCP port a client can connect to
PORT_RANGE = (1, 65535)
#: torch's process groups take the world size and ranks as C ``int``
MAX_WORLD_SIZE = 2**31 - 1
#: a DNS name (RFC 1123 labels) or an IPv4 / IPv6 address; at most 253 characters
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"{_LABEL}(\.{_LABEL})*\.?")


@dataclass(frozen=True)
class GroupArgs:
    """Checked rendezvous arguments (the trainer is rank 0 of ``world_size``)."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int


def check_group_args(args: dict[str, Any], engine_ranks: int, *, where: str = "") -> GroupArgs:
    """:class:`GroupArgs` from ``args``, else a :class:`BadRequest` naming the first bad key
    (prefixed with ``where``, e.g. ``"init_info."``). ``engine_ranks`` ranks must fit in the
    world after ``rank_offset``."""
    address = args.get("master_address")
    if not isinstance(address, str) or not _is_host(address):
        raise BadRequest(
            f"key {where}master_address must be a host name or an IP address, got {_shown(address)}"
        )
    port = _int(args, "master_port", where)
    if not PORT_RANGE[0] <= port <= PORT_RANGE[1]:
        raise BadRequest(
            f"key {where}master_port must be a TCP port in {PORT_RANGE[0]}..{PORT_RANGE[1]}, "
            f"got {_bounded(port)}"
        )
    world = _int(args, "world_size", where)
    if not 2 <= world <= MAX_WORLD_SIZE:
        raise BadRequest(
            f"key {where}world_size must be in 2..{MAX_WORLD_SIZE} (the trainer and at least "
            f"one engine rank), got {_bounded(world)}"
        )
    offset = _int(args, "rank_offset", where)
    if offset < 1 or offset + engine_ranks > world:
        raise BadRequest(
            f"key {where}rank_offset {_bounded(offset)} + {engine_ranks} engine ranks does not "
            f"fit in world_size {world} (the trainer is rank 0)"
        )
    return GroupArgs(address, port, world, offset)


def _int(args: dict[str, Any], key: str, where: str) -> int:
    value = args.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"key {where}{key} must be an int, got {_shown(value)}")
    return value


def _is_host(address: str) -> bool:
    if not address or len(address) > 253:
        return False
    try:
        ipaddress.ip_address(address)
        return True
    except ValueError:
        return _HOSTNAME.fullmatch(address) is not None


def _bounded(value: int) -> str:
    """An int for an error message, bounded (a hostile one can have thousands of digits)."""
    return str(value) if abs(value) < 2**128 else f"<an integer of {value.bit_length()} bits>"


def _shown(value: Any) -> str:
    """What a client sent, for an error message: its type, and a bounded repr."""
    text = repr(value)
    text = text if len(text) <= 64 else f"{text[:40]}...{text[-12:]}"
    return f"{type(value).__name__} {text}"
