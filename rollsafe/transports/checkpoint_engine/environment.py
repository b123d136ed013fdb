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
def _hidden_modules(names: Sequence[str]) -> Iterator[None]:
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
    environ: Mapping[str, str] | None = None,
) -> dict[str, str | None]:
    """The variables to set (str) or clear (None) around the parameter server for ``protocol``.

    ``"tcp"``: ``MC_FORCE_TCP=1`` and ``PS_P2P_STORE_RDMA_DEVICES`` = ``rdma_devices`` joined, else
    the ambient value (``environ``, default ``os.environ``), else :data:`TCP_PLACEHOLDER_DEVICE`.
    ``"rdma"``: the devices, and ``MC_FORCE_TCP`` cleared (an ambient one would silently turn
    RDMA into TCP). None: nothing. ``transfer_timeout_s`` sets ``MC_TRANSFER_TIMEOUT`` (whole
    seconds, at least 1) with either protocol.
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
