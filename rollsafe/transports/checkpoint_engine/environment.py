"""Environment scoping: the variables checkpoint-engine reads, set only for one call.

Owns :func:`scoped_env` (set, then restore, under one process-wide lock),
:func:`p2p_environment` (the P2P variables for RDMA or TCP) and hiding Mooncake from the
parameter server when P2P is not configured.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Literal

from rollsafe.errors import InvalidArgument

#: The device name put in ``PS_P2P_STORE_RDMA_DEVICES`` for P2P over TCP when none is set: it
#: only passes checkpoint-engine's device detection (Mooncake's TCP transport uses no device).
TCP_PLACEHOLDER_DEVICE = "tcp0"
#: How P2P moves bytes: Mooncake over RDMA, or over TCP (``MC_FORCE_TCP=1``; no RDMA needed).
P2PProtocol = Literal["rdma", "tcp"]
#: Mooncake's TCP slice (``MC_TCP_SLICE_SIZE``) rollsafe sets for P2P over TCP unless the
#: environment names one. Mooncake's own default is 64 KiB: its TCP transport copies GPU memory
#: one slice per synchronous ``cudaMemcpy`` (about 123,000 for 8 GB), which contend with a
#: serving engine on the same GPU; on an H200, 8 GB moved in 33-34 s at 64 KiB and 4.5 s at
#: 16 MiB (``docs/transports.md``, "P2P over TCP: the slice size").
DEFAULT_TCP_SLICE_BYTES = 16 << 20
#: The variable Mooncake reads, once per process, at its first TCP transfer.
TCP_SLICE_VARIABLE = "MC_TCP_SLICE_SIZE"


_ENV_LOCK = threading.RLock()


@contextlib.contextmanager
def scoped_env(values: Mapping[str, str | None]) -> Iterator[None]:
    """Set (str) or unset (None) environment variables for the block; restore them exactly after.

    A variable that was absent is removed again; one that was set gets its old value back, also
    when the block raises. Serialized by a module lock, since ``os.environ`` is process-wide.
    """
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in values}
        try:
            for k, v in values.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = str(v)
            yield
        finally:
            for k, old in saved.items():
                if old is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = old


@contextlib.contextmanager
def hidden_modules(names: Sequence[str]) -> Iterator[None]:
    """Make ``import NAME`` raise ImportError inside the block (restores ``sys.modules`` after)."""
    missing = object()
    saved = {n: sys.modules.get(n, missing) for n in names}
    try:
        for n in names:
            sys.modules[n] = None  # type: ignore[assignment]
        yield
    finally:
        for n, old in saved.items():
            if old is missing:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = old  # type: ignore[assignment]


def p2p_environment(
    protocol: P2PProtocol | None,
    rdma_devices: Sequence[str] | None = None,
    transfer_timeout_s: float | None = None,
    *,
    tcp_slice_bytes: int | None = DEFAULT_TCP_SLICE_BYTES,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str | None]:
    """The variables to set (str) or clear (None) around the parameter server for ``protocol``.

    ``"tcp"``: ``MC_FORCE_TCP=1`` and ``PS_P2P_STORE_RDMA_DEVICES`` = ``rdma_devices`` joined, else
    the ambient value (``environ``, default ``os.environ``), else :data:`TCP_PLACEHOLDER_DEVICE`.
    ``"rdma"``: the devices, and ``MC_FORCE_TCP`` cleared (an ambient one would silently turn
    RDMA into TCP). None: nothing. ``transfer_timeout_s`` sets ``MC_TRANSFER_TIMEOUT`` (whole
    seconds, at least 1) with either protocol. ``tcp_slice_bytes`` (``"tcp"`` only) sets
    ``MC_TCP_SLICE_SIZE`` unless the environment already names one: a value the user set is
    never overridden; None leaves Mooncake's 64 KiB.
    """
    env = os.environ if environ is None else environ
    out: dict[str, str | None] = {}
    if protocol is None:
        return out
    if protocol == "tcp":
        out["MC_FORCE_TCP"] = "1"
        devices = ",".join(rdma_devices) if rdma_devices else None
        out["PS_P2P_STORE_RDMA_DEVICES"] = (
            devices or env.get("PS_P2P_STORE_RDMA_DEVICES") or TCP_PLACEHOLDER_DEVICE
        )
        if tcp_slice_bytes is not None:
            if isinstance(tcp_slice_bytes, bool) or not isinstance(tcp_slice_bytes, int):
                raise InvalidArgument(
                    "tcp_slice_bytes", f"tcp_slice_bytes must be an int, got {tcp_slice_bytes!r}"
                )
            if tcp_slice_bytes <= 0:
                raise InvalidArgument(
                    "tcp_slice_bytes", f"tcp_slice_bytes must be > 0, got {tcp_slice_bytes}"
                )
            if not env.get(TCP_SLICE_VARIABLE):
                out[TCP_SLICE_VARIABLE] = str(tcp_slice_bytes)
    elif protocol == "rdma":
        if not rdma_devices:
            raise InvalidArgument("rdma_devices", "P2P over RDMA needs rdma_devices")
        out["MC_FORCE_TCP"] = None
        out["PS_P2P_STORE_RDMA_DEVICES"] = ",".join(rdma_devices)
    else:
        raise InvalidArgument(
            "p2p_protocol", f"p2p protocol must be 'rdma' or 'tcp', got {protocol!r}"
        )
    if transfer_timeout_s is not None:
        out["MC_TRANSFER_TIMEOUT"] = str(max(1, math.ceil(transfer_timeout_s)))
    return out
