"""The ``checkpoint_engine`` transport core: MoonshotAI checkpoint-engine's ``ParameterServer``.

One :class:`CheckpointEngineTransport` per trainer rank wraps one
``checkpoint_engine.ps.ParameterServer`` (0.4.2) that reuses the trainer's initialized
``torch.distributed`` default process group (NCCL on CUDA, HCCL on Ascend). World size and rank
come from that group, never from ``WORLD_SIZE``/``RANK``. Every method that talks to the
parameter server is collective: every trainer rank calls it with the same arguments.

* ``register(weights, version)``: every rank passes the same named tensors; each registers a
  deterministic, size-balanced share of the keys (:func:`partition_keys`). Expert-parallel
  slices are all-gathered into full tensors first when an :class:`ExpertGather` is configured.
  ``register_from_dir(export_dir, version)`` shards the files of an HF export across ranks
  (:func:`assign_files`). The previous checkpoint is unregistered first (bounded pinned memory);
  ``gather_metas`` then gives the keys actually registered, which the
  :class:`~rollsafe.statemachines.CheckpointRegistration` guard checks (every rank ok, no extra
  key, missing keys only under ``mtp.``); a refusal names the keys (:func:`check_key_coverage`).
* ``update(targets)``: broadcast when the targets cover every parameter-server rank; P2P
  (``ranks=[...]``) for a subset only when Mooncake is usable, otherwise :class:`P2PUnavailable`
  is raised before anything changes, never a silent broadcast to everyone (:func:`plan_update`).
  ``update(targets, p2p=True)`` is a P2P update of the targets' ranks even when they are every
  rank (a world of one included): what a recovery's targeted push asks for.
  Each target's lowest rank posts the ZMQ socket paths of the target's ranks to its engine's
  ``/update_weights_from_ipc`` through the target's :class:`EngineClient`; per-target outcomes are
  all-gathered and mapped back (:func:`merge_rank_results`).

Where ``ParameterServer`` reads the environment (``RANK`` because it treats ``rank=0`` as unset,
``PS_P2P_STORE_RDMA_DEVICES``, ``PS_MAX_BUCKET_SIZE_GB``) the values are set only for the call
(:func:`scoped_env`) and restored afterwards; ``MASTER_ADDR``/``MASTER_PORT`` are never read (the
store address is passed explicitly). P2P comes only from explicit configuration
(``p2p_protocol``, or ``rdma_devices``): without it Mooncake is hidden from the parameter server
so it cannot auto-detect devices. ``p2p_protocol="tcp"`` runs P2P without RDMA through Mooncake's
TCP transport (GPU memory staged through host memory): ``MC_FORCE_TCP=1`` and a placeholder
device in ``PS_P2P_STORE_RDMA_DEVICES`` (``tcp0`` unless set) are set only around the parameter
server's construction, registrations and updates (:meth:`CheckpointEngineTransport.p2p_env`);
``p2p_protocol="rdma"`` clears an ambient ``MC_FORCE_TCP`` there instead. Mooncake that fails to
start leaves P2P off with the reason (:attr:`CheckpointEngineTransport.p2p_reason`).

``checkpoint_engine`` is imported only when a transport is constructed; on a host without CUDA or
Ascend, or without the package, construction raises :class:`CheckpointEngineUnavailable`.
Everything except the parameter-server calls is plain Python and unit-tested on CPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import math
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rollsafe.net import free_port
from rollsafe.statemachines import TransitionNotAllowed
from rollsafe.text import bound_text
from rollsafe.transports.base import (
    EngineTarget,
    NamedTensors,
    RegisterError,
    StagedTransport,
    TargetResult,
    TransportError,
    UpdateReport,
    check_update_targets,
    named_tensor_list,
)
from rollsafe.wire.hf_index import HFIndex, HFIndexError
from rollsafe.wire.hf_index import read_hf_index as _read_hf_index

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_BUCKET",
    "TCP_PLACEHOLDER_DEVICE",
    "CheckpointEngineTransport",
    "CheckpointEngineUnavailable",
    "ExpertGather",
    "ExpertGatherError",
    "HFIndex",
    "KeyCoverage",
    "KeyCoverageError",
    "P2PProtocol",
    "P2PUnavailable",
    "ProcessGroupError",
    "UpdatePlan",
    "agree_store_address",
    "assign_files",
    "check_key_coverage",
    "checkpoint_engine_unavailable_reasons",
    "expert_signatures",
    "gather_expert_shards",
    "gather_rank_status",
    "merge_rank_results",
    "mooncake_available",
    "p2p_environment",
    "partition_keys",
    "plan_update",
    "read_hf_index",
    "scoped_env",
    "socket_paths_for",
]

INSTALL_HINT = "pip install 'rollsafe[ce]'"
_MAX_LISTED = 10
_MAX_REASON = 2048
_GIB = 1 << 30
DEFAULT_BUCKET = 8 * _GIB  # checkpoint-engine 0.4.2's own default cap (PS_MAX_BUCKET_SIZE_GB=8)
DEFAULT_MEM_FRACTION = 0.9  # its default share of free device memory (PS_MEM_FRACTION=0.9)
#: The device name put in ``PS_P2P_STORE_RDMA_DEVICES`` for P2P over TCP when none is set: it
#: only passes checkpoint-engine's device detection (Mooncake's TCP transport uses no device).
TCP_PLACEHOLDER_DEVICE = "tcp0"
#: How P2P moves bytes: Mooncake over RDMA, or over TCP (``MC_FORCE_TCP=1``; no RDMA needed).
P2PProtocol = Literal["rdma", "tcp"]

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------- errors
class CheckpointEngineUnavailable(TransportError):
    """checkpoint-engine cannot run here; ``reasons`` says why (package missing, no accelerator)."""

    def __init__(self, reasons: Sequence[str]) -> None:
        self.reasons: tuple[str, ...] = tuple(reasons)
        super().__init__("checkpoint-engine transport unavailable: " + "; ".join(self.reasons))


class P2PUnavailable(TransportError):
    """A subset of ranks (or a targeted push) needs P2P (Mooncake, over RDMA or TCP) and P2P is
    not usable.

    Raised before any state changes; the fleet decides the fallback (broadcast to every rank at
    the next sync, disk, another transport). ``ranks`` is the subset that was asked for.
    """

    def __init__(self, ranks: Sequence[int], world_size: int, reason: str) -> None:
        self.ranks: tuple[int, ...] = tuple(ranks)
        self.world_size = world_size
        self.reason = reason
        super().__init__(
            f"checkpoint_engine: targets cover ranks {list(self.ranks)} of {world_size}, which "
            f"needs P2P, and P2P is unavailable ({reason}); refusing to broadcast to every rank "
            "instead: choose a fallback explicitly"
        )


class ProcessGroupError(TransportError):
    """The trainer's torch.distributed default group is missing or cannot carry device tensors."""


class KeyCoverageError(RegisterError):
    """Registered keys do not cover the expected ones exactly (message names the keys)."""

    def __init__(self, message: str, coverage: KeyCoverage) -> None:
        self.coverage = coverage
        super().__init__(message)


class ExpertGatherError(RegisterError):
    """Expert-parallel slices disagree across ranks (names, dtypes or shapes; message says)."""


# ---------------------------------------------------------------------------------- availability
def mooncake_available() -> bool:
    """True when Mooncake (checkpoint-engine's optional P2P transfer engine) is installed."""
    try:
        return importlib.util.find_spec("mooncake") is not None
    except (ImportError, ValueError):
        return False


def _accelerator_reason() -> str | None:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard requirement of this transport
        return "checkpoint-engine needs torch: torch is not installed"
    npu = getattr(torch, "npu", None)
    if npu is not None:
        with contextlib.suppress(Exception):
            if npu.is_available():
                return None
    if torch.cuda.is_available():
        return None
    return "checkpoint-engine needs CUDA or Ascend: torch.cuda.is_available() is False"


def checkpoint_engine_unavailable_reasons() -> list[str]:
    """Why checkpoint-engine cannot run in this process (empty when it can).

    Checks the package without importing it unless it is installed (the import itself then has
    to succeed) and the accelerator (CUDA or Ascend; the ``ParameterServer`` constructor raises
    ``TypeError`` on a CPU-only host).
    """
    reasons: list[str] = []
    if importlib.util.find_spec("checkpoint_engine") is None:
        reasons.append(f"checkpoint_engine is not installed: {INSTALL_HINT}")
    else:
        try:
            import checkpoint_engine.ps  # noqa: F401
        except Exception as exc:
            reasons.append(
                f"checkpoint_engine is installed but cannot be imported "
                f"({type(exc).__name__}: {exc}): {INSTALL_HINT}"
            )
    accel = _accelerator_reason()
    if accel is not None:
        reasons.append(accel)
    return reasons


# ---------------------------------------------------------------------------------- environment
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
            raise ValueError("P2P over RDMA needs rdma_devices")
        out["MC_FORCE_TCP"] = None
        out["PS_P2P_STORE_RDMA_DEVICES"] = ",".join(rdma_devices)
    else:
        raise ValueError(f"p2p protocol must be 'rdma' or 'tcp', got {protocol!r}")
    if transfer_timeout_s is not None:
        out["MC_TRANSFER_TIMEOUT"] = str(max(1, math.ceil(transfer_timeout_s)))
    return out


# ---------------------------------------------------------------------------------- sharding
def partition_keys(sizes: Iterable[tuple[str, int]], world_size: int) -> list[list[str]]:
    """Split keys over ``world_size`` ranks, balancing bytes; deterministic for the same input.

    Largest first onto the least-loaded rank (ties: lower rank), keys in each share sorted.
    Every rank computing this from the same (name, nbytes) list gets the same answer.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ordered = sorted(sizes, key=lambda kv: (-int(kv[1]), kv[0]))
    names = [n for n, _ in ordered]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"duplicate keys in partition input: {dup[:_MAX_LISTED]}")
    load = [0] * world_size
    shares: list[list[str]] = [[] for _ in range(world_size)]
    for name, nbytes in ordered:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        shares[rank].append(name)
        load[rank] += max(int(nbytes), 1)
    return [sorted(s) for s in shares]


def assign_files(file_sizes: Mapping[str, int], world_size: int) -> list[list[str]]:
    """Assign shard files to ranks, balancing bytes (same rule as :func:`partition_keys`)."""
    return partition_keys(file_sizes.items(), world_size)


def read_hf_index(export_dir: str | Path) -> HFIndex:
    """Read an HF directory's index (or single file): :func:`rollsafe.wire.hf_index.read_hf_index`,
    its :class:`~rollsafe.wire.hf_index.HFIndexError` raised as :class:`RegisterError`."""
    try:
        return _read_hf_index(export_dir)
    except HFIndexError as exc:
        raise RegisterError(str(exc)) from exc


# ---------------------------------------------------------------------------------- key coverage
def _listed(keys: Collection[str]) -> str:
    ordered = sorted(keys)
    head = ", ".join(repr(k) for k in ordered[:_MAX_LISTED])
    more = len(ordered) - _MAX_LISTED
    return f"[{head}{f', ... {more} more' if more > 0 else ''}]"


@dataclass(frozen=True)
class KeyCoverage:
    """Registered keys against expected ones: what is missing (allowed or not), extra, doubled."""

    missing: tuple[str, ...] = ()
    allowed_missing: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    duplicated: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not (self.missing or self.extra or self.duplicated)

    def describe(self) -> str:
        """One line naming the offending keys (bounded); empty when ``ok``."""
        parts = []
        if self.missing:
            parts.append(f"{len(self.missing)} missing key(s) {_listed(self.missing)}")
        if self.extra:
            parts.append(f"{len(self.extra)} extra key(s) {_listed(self.extra)}")
        if self.duplicated:
            parts.append(
                f"{len(self.duplicated)} key(s) registered by several ranks "
                f"{_listed(self.duplicated)}"
            )
        return "; ".join(parts)


def check_key_coverage(
    expected: Iterable[str],
    registered: Iterable[str],
    allow_missing_prefixes: Sequence[str] = ("mtp.",),
) -> KeyCoverage:
    """Compare keys like the registration guard does, keeping the names for the error message.

    ``registered`` may repeat a key (one entry per rank that registered it): a repeat is
    reported as ``duplicated``. Missing keys under ``allow_missing_prefixes`` are tolerated.
    """
    exp = set(expected)
    seen: set[str] = set()
    dup: set[str] = set()
    for k in registered:
        (dup if k in seen else seen).add(k)
    prefixes = tuple(allow_missing_prefixes)
    gone = exp - seen
    allowed = {k for k in gone if prefixes and k.startswith(prefixes)}
    return KeyCoverage(
        missing=tuple(sorted(gone - allowed)),
        allowed_missing=tuple(sorted(allowed)),
        extra=tuple(sorted(seen - exp)),
        duplicated=tuple(sorted(dup)),
    )


# ---------------------------------------------------------------------------------- collectives
def _dist() -> Any:
    import torch.distributed as dist

    return dist


def gather_rank_status(
    ok: bool, error: str = "", *, group: Any = None
) -> dict[int, tuple[bool, str]]:
    """All-gather ``(ok, error)`` of every rank of ``group`` (None: default): ``{rank: ...}``."""
    dist = _dist()
    world = dist.get_world_size(group)
    out: list[Any] = [None] * world
    dist.all_gather_object(out, (bool(ok), str(error)[:_MAX_REASON]), group=group)
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
    dist = _dist()
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


# ---------------------------------------------------------------------------------- expert gather
@dataclass(frozen=True)
class ExpertGather:
    """How to rebuild full expert tensors from expert-parallel slices before registration.

    ``is_expert(name)`` picks the tensors an EP rank holds only a slice of (fused experts, e.g.
    ``...mlp.experts.w1`` of shape ``[local_experts, ...]``); the slices of the ranks of ``group``
    (a torch.distributed group; None = the default group) are concatenated along ``dim`` in
    group-rank order. Slices may be uneven along ``dim``; every other dimension and the dtype
    must match, and every rank must hold the same expert names.
    """

    is_expert: Callable[[str], bool]
    group: Any = None
    dim: int = 0

    @classmethod
    def by_pattern(
        cls, pattern: str = r"\.experts\.", group: Any = None, dim: int = 0
    ) -> ExpertGather:
        """Experts are the keys matching the regular expression ``pattern``."""
        rx = re.compile(pattern)
        return cls(lambda name: rx.search(name) is not None, group, dim)


def expert_signatures(
    items: Sequence[tuple[str, torch.Tensor]], spec: ExpertGather
) -> dict[str, list[tuple[int, ...]]]:
    """Collective: ``{expert name: [slice shape of each group rank]}``, validated across ranks.

    Raises :class:`ExpertGatherError` naming the key and rank when ranks hold different expert
    names, dtypes, or shapes that differ outside ``dim``.
    """
    dist = _dist()
    local = [
        (n, tuple(int(d) for d in t.shape), str(t.dtype)) for n, t in items if spec.is_expert(n)
    ]
    world = dist.get_world_size(spec.group)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, local, group=spec.group)
    names0 = [n for n, _, _ in every[0]]
    for r, sig in enumerate(every):
        names = [n for n, _, _ in sig]
        if names != names0:
            diff = sorted(set(names) ^ set(names0)) or names
            raise ExpertGatherError(
                f"expert gather: group rank {r} holds expert keys that differ from rank 0's "
                f"(or are in another order): {_listed(diff)}"
            )
    out: dict[str, list[tuple[int, ...]]] = {}
    for i, name in enumerate(names0):
        shapes = [every[r][i][1] for r in range(world)]
        dtypes = {every[r][i][2] for r in range(world)}
        if len(dtypes) != 1:
            raise ExpertGatherError(
                f"expert gather: {name!r} has dtypes {sorted(dtypes)} across ranks"
            )
        s0 = shapes[0]
        d = spec.dim if spec.dim >= 0 else spec.dim + len(s0)
        if not 0 <= d < len(s0):
            raise ExpertGatherError(f"expert gather: {name!r} of shape {s0} has no dim {spec.dim}")
        for r, s in enumerate(shapes):
            if len(s) != len(s0) or any(
                a != b for j, (a, b) in enumerate(zip(s, s0, strict=True)) if j != d
            ):
                raise ExpertGatherError(
                    f"expert gather: {name!r} on group rank {r} has shape {s}, incompatible with "
                    f"rank 0's {s0} outside dim {d}"
                )
        out[name] = shapes
    return out


def _full_shape(shapes: Sequence[tuple[int, ...]], dim: int) -> tuple[int, ...]:
    s0 = list(shapes[0])
    d = dim if dim >= 0 else dim + len(s0)
    s0[d] = sum(s[d] for s in shapes)
    return tuple(s0)


def gather_expert_shards(
    items: Sequence[tuple[str, torch.Tensor]],
    spec: ExpertGather,
    *,
    keep: Callable[[str], bool] | None = None,
    signatures: Mapping[str, Sequence[tuple[int, ...]]] | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """Collective over ``spec.group``: replace each expert slice by the full tensor.

    Every rank takes part in every gather; a rank keeps a gathered tensor only when
    ``keep(name)`` (default: all), so a rank that does not register that key frees it at once.
    Non-expert items pass through unchanged. ``signatures`` (from :func:`expert_signatures`)
    saves the metadata exchange when the caller already has it.
    """
    import torch

    dist = _dist()
    sigs = signatures if signatures is not None else expert_signatures(items, spec)
    world = dist.get_world_size(spec.group)
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in items:
        if name not in sigs:
            out.append((name, t))
            continue
        shapes = sigs[name]
        d = spec.dim if spec.dim >= 0 else spec.dim + t.dim()
        sizes = [s[d] for s in shapes]
        width = max(sizes)
        src = t.contiguous()
        if t.shape[d] != width:  # uneven split: pad to the widest slice, trim after
            padded_shape = list(t.shape)
            padded_shape[d] = width
            src = t.new_zeros(padded_shape)
            src.narrow(d, 0, t.shape[d]).copy_(t)
        parts = [torch.empty_like(src) for _ in range(world)]
        dist.all_gather(parts, src, group=spec.group)
        if keep is None or keep(name):
            full = torch.cat([p.narrow(d, 0, n) for p, n in zip(parts, sizes, strict=True)], dim=d)
            out.append((name, full))
        del parts, src
    return out


# ---------------------------------------------------------------------------------- update planning
@dataclass(frozen=True)
class UpdatePlan:
    """How one update runs: ``broadcast`` to every rank, or ``p2p`` to ``ranks`` only."""

    mode: Literal["broadcast", "p2p"]
    ranks: tuple[int, ...] | None

    @property
    def ps_ranks(self) -> list[int] | None:
        """The ``ranks=`` argument of ``ParameterServer.update`` (None means broadcast)."""
        return None if self.ranks is None else list(self.ranks)


def plan_update(
    target_ranks: Sequence[Sequence[int]],
    world_size: int,
    *,
    p2p_available: bool,
    p2p_reason: str = "mooncake is not installed",
    force_p2p: bool = False,
) -> UpdatePlan:
    """Broadcast when the targets cover every rank; P2P for a subset if usable; else refuse.

    With ``force_p2p`` the plan is P2P to the targets' ranks even when they cover every rank (a
    world of one included): a targeted push exercises P2P, never a broadcast. Targets are
    assumed valid (the registration machine's guard checks them first). Raises
    :class:`P2PUnavailable` when P2P is needed and unusable: never a silent broadcast.
    """
    union = sorted({int(r) for group in target_ranks for r in group})
    bad = [r for r in union if not 0 <= r < world_size]
    if bad:
        raise TransportError(f"checkpoint_engine: target ranks {bad} out of range(0, {world_size})")
    if union == list(range(world_size)) and not force_p2p:
        return UpdatePlan("broadcast", None)
    if not p2p_available:
        raise P2PUnavailable(union, world_size, p2p_reason)
    return UpdatePlan("p2p", tuple(union))


def socket_paths_for(socket_paths: Sequence[Sequence[str]], ranks: Iterable[int]) -> dict[str, str]:
    """``{device uuid: zmq socket path}`` of ``ranks``, from the list ``req_func`` receives.

    checkpoint-engine calls ``req_func(socket_paths)`` with one ``(device_uuid, "ipc://...")``
    pair per parameter-server rank, in rank order; an engine's workers each pick their device's
    entry, so a target gets exactly the entries of its ranks.
    """
    out: dict[str, str] = {}
    for r in ranks:
        if not 0 <= r < len(socket_paths):
            raise TransportError(
                f"checkpoint_engine: rank {r} has no socket path ({len(socket_paths)} ranks known)"
            )
        uuid, path = socket_paths[r]
        out[str(uuid)] = str(path)
    return out


LocalResults = dict[str, tuple[bool, str, float]]


def merge_rank_results(
    gathered: Sequence[tuple[Mapping[str, tuple[bool, str, float]], str | None]],
    targets: Sequence[EngineTarget],
    *,
    nbytes: int = 0,
) -> dict[str, TargetResult]:
    """Map what every rank saw into one result per target.

    ``gathered[rank]`` is ``(results this rank posted, error of its ParameterServer.update or
    None)``; a target's own result comes from its lowest rank (the one that posted it). A failed
    collective fails every target (the broadcast is all or nothing; an engine may hold a partial
    update), keeping the target's own reason first when it has one.
    """
    errors = {r: e for r, (_, e) in enumerate(gathered) if e}
    collective = (
        "ParameterServer.update failed on rank(s) "
        + ", ".join(f"{r}: {e}" for r, e in sorted(errors.items()))
        if errors
        else ""
    )
    out: dict[str, TargetResult] = {}
    for t in targets:
        poster = min(t.ranks)
        own = gathered[poster][0].get(t.name) if poster < len(gathered) else None
        if own is None:
            reason = "the engine was never asked to load (update aborted before its request)"
            if collective:
                reason += f"; {collective}"
            out[t.name] = TargetResult(t.name, False, _bounded(reason))
            continue
        ok, reason, seconds = own
        if collective:
            reason = f"{reason}; {collective}" if reason else collective
            ok = False
        out[t.name] = TargetResult(t.name, ok, _bounded(reason), seconds, nbytes if ok else 0)
    return out


def _bounded(text: str) -> str:
    return bound_text(text, _MAX_REASON)


# ---------------------------------------------------------------------------------- transport
@dataclass
class _Staged:
    """What this rank has registered in its parameter server."""

    name: str
    layout: str
    shared_pool: bool
    nbytes: int = 0
    keys: tuple[str, ...] = field(default_factory=tuple)


class CheckpointEngineTransport(StagedTransport):
    """checkpoint-engine's ``ParameterServer`` behind the two-phase transport contract.

    Construct on every trainer rank after ``torch.distributed.init_process_group`` (NCCL on
    CUDA); every method is collective over the default group. Arguments:

    * ``master_addr`` / ``store_port``: the parameter servers' TCPStore (default: rank 0's
      outbound IP and a free port, agreed over the trainer group; ``MASTER_PORT`` is not used).
    * ``gpu_count``: GPUs per node as the parameter server counts them (its local device is
      ``rank % gpu_count``; default ``torch.cuda.device_count()``); must equal the device the
      trainer uses, else :class:`ProcessGroupError`.
    * ``mem_fraction``: share of free device memory the update may use (default 0.9; the
      ambient ``PS_MEM_FRACTION`` is not read).
    * ``max_bucket_bytes``: the update's bucket size cap (set as ``PS_MAX_BUCKET_SIZE_GB`` for
      the call only; default 8 GiB as upstream, whatever the ambient variable says; never below
      the largest tensor, never above a third of ``mem_fraction`` of free memory). The buffers
      are sized by the cap, not by the checkpoint: extra device memory during an update is about
      3 caps (a double IPC buffer plus one host-to-device buffer), 2 when memory is short.
    * ``use_shared_memory_pool``: reuse one pinned host pool across versions of the same layout.
    * ``rdma_devices``: RDMA device names for Mooncake (``PS_P2P_STORE_RDMA_DEVICES``); given
      alone, P2P over RDMA is on.
    * ``p2p_protocol``: ``"rdma"`` (needs ``rdma_devices``) or ``"tcp"`` (Mooncake's TCP
      transport, no RDMA needed; ``rdma_devices`` then only names the placeholder, default the
      ambient ``PS_P2P_STORE_RDMA_DEVICES`` or ``tcp0``); None: P2P over RDMA when
      ``rdma_devices`` is given, else off. P2P also needs Mooncake (``checkpoint-engine[p2p]``,
      never installed by default); when it is missing or fails to start, P2P stays off and
      :attr:`p2p_reason` says why (a subset update then raises :class:`P2PUnavailable`).
    * ``transfer_timeout_s``: Mooncake's per-batch timeout (``MC_TRANSFER_TIMEOUT``, default 30 s
      upstream; raise it for big buckets over TCP), set only where ``p2p_env`` applies.
    * ``expert_gather``: rebuild full expert tensors from EP slices before registering.
    * ``request_timeout_s``: HTTP timeout of each engine's ``/update_weights_from_ipc``.
    * ``socket_timeout_s``: optional ZMQ send/receive timeout inside the parameter server, so a
      vanished engine fails the update instead of hanging it (None: wait forever, as upstream).
    * ``server_factory``: builds the parameter server from ``ParameterServer``'s keyword
      arguments (default: ``checkpoint_engine.ps.ParameterServer``). With a factory the package,
      accelerator and NCCL-backend checks are the factory's business (tests on CPU pass an
      object standing in for the CUDA-only server; everything else is this class's own logic).
    """

    name = "checkpoint_engine"

    def __init__(
        self,
        *,
        master_addr: str | None = None,
        store_port: int | None = None,
        gpu_count: int | None = None,
        mem_fraction: float | None = None,
        max_bucket_bytes: int | None = None,
        use_shared_memory_pool: bool = False,
        rdma_devices: Sequence[str] | None = None,
        expert_gather: ExpertGather | None = None,
        allow_missing_prefixes: Iterable[str] = ("mtp.",),
        flush_cache: bool = True,
        request_timeout_s: float = 600.0,
        socket_timeout_s: float | None = None,
        stand_in_timeout_s: float = 10.0,
        p2p_protocol: P2PProtocol | None = None,
        transfer_timeout_s: float | None = None,
        server_factory: Callable[..., Any] | None = None,
    ) -> None:
        if server_factory is None:
            reasons = checkpoint_engine_unavailable_reasons()
            if reasons:
                raise CheckpointEngineUnavailable(reasons)
        import torch

        dist = _dist()
        if not (dist.is_available() and dist.is_initialized()):
            raise ProcessGroupError(
                "checkpoint_engine: call torch.distributed.init_process_group first; the "
                "parameter servers reuse the trainer's default group (NCCL)"
            )
        backend = str(dist.get_backend())
        if server_factory is None and "nccl" not in backend and "hccl" not in backend:
            raise ProcessGroupError(
                f"checkpoint_engine: the default process group's backend is {backend!r}; "
                "ParameterServer broadcasts device buffers and needs 'nccl' (or 'hccl'), e.g. "
                "init_process_group('cpu:gloo,cuda:nccl')"
            )
        world_size, rank = int(dist.get_world_size()), int(dist.get_rank())
        if max_bucket_bytes is not None and max_bucket_bytes <= 0:
            raise ValueError(f"max_bucket_bytes must be > 0, got {max_bucket_bytes}")
        if rdma_devices is not None and not list(rdma_devices):
            raise ValueError("rdma_devices, when given, must name at least one device")
        if p2p_protocol not in (None, "rdma", "tcp"):
            raise ValueError(f"p2p_protocol must be 'rdma', 'tcp' or None, got {p2p_protocol!r}")
        if p2p_protocol == "rdma" and rdma_devices is None:
            raise ValueError(
                "p2p_protocol='rdma' needs rdma_devices (RDMA devices come only from explicit "
                "configuration); without RDMA hardware use p2p_protocol='tcp'"
            )
        if transfer_timeout_s is not None and transfer_timeout_s <= 0:
            raise ValueError(f"transfer_timeout_s must be > 0, got {transfer_timeout_s}")
        if torch.cuda.is_available():
            count = gpu_count or torch.cuda.device_count()
            local = rank % count
            current = torch.cuda.current_device()
            if local != current:
                raise ProcessGroupError(
                    f"checkpoint_engine: rank {rank} would use cuda:{local} (rank % gpu_count "
                    f"{count}) but the trainer uses cuda:{current}; pass gpu_count= so that "
                    "rank % gpu_count is the trainer's device"
                )
        super().__init__(world_size, allow_missing_prefixes=allow_missing_prefixes)
        self.rank = rank
        self.world_size = world_size
        self.max_bucket_bytes = max_bucket_bytes
        self.use_shared_memory_pool = use_shared_memory_pool
        self.expert_gather = expert_gather
        self.flush_cache = flush_cache
        self.request_timeout_s = request_timeout_s
        self.stand_in_timeout_s = stand_in_timeout_s
        self.p2p_protocol: P2PProtocol | None = p2p_protocol or (
            "rdma" if rdma_devices is not None else None
        )
        self.p2p_env: dict[str, str | None] = p2p_environment(
            self.p2p_protocol, rdma_devices, transfer_timeout_s
        )
        self.store_address = agree_store_address(master_addr, store_port)

        p2p_wanted = self.p2p_protocol is not None
        kwargs: dict[str, Any] = {
            "rank": rank,
            "world_size": world_size,
            "auto_pg": False,
            "gpu_count": gpu_count,
            "mem_fraction": DEFAULT_MEM_FRACTION if mem_fraction is None else mem_fraction,
            "master_addr": self.store_address[0],
            "master_port": self.store_address[1],
        }
        if server_factory is None:
            from checkpoint_engine.ps import ParameterServer

            server_factory = ParameterServer
        start_error = ""
        with scoped_env({"RANK": str(rank), **self.p2p_env}):
            if p2p_wanted:
                try:
                    self._ps: Any = server_factory(**kwargs)
                except Exception as exc:  # Mooncake refused (no device, engine start failed)
                    start_error = _bounded(f"{type(exc).__name__}: {exc}")
                    log.warning(
                        "checkpoint_engine: the parameter server with P2P (%s) failed to start "
                        "(%s); starting it without P2P", self.p2p_protocol, start_error,
                    )  # fmt: skip
            if not p2p_wanted or start_error:
                with _hidden_modules(("mooncake", "mooncake.engine")):
                    self._ps = server_factory(**kwargs)
        local_p2p = getattr(self._ps, "_p2p_store", None) is not None
        if local_p2p:
            local_reason = ""
        elif not p2p_wanted:
            local_reason = (
                "P2P is not configured (pass p2p_protocol='rdma' with rdma_devices, or "
                "p2p_protocol='tcp')"
            )
        elif start_error:
            local_reason = f"the parameter server failed to start with Mooncake: {start_error}"
        elif not mooncake_available():
            local_reason = "mooncake is not installed (pip install 'checkpoint-engine[p2p]')"
        else:
            local_reason = "the Mooncake transfer engine failed to start (see its log)"
        # every rank takes part in a P2P update: it is usable only where every rank has it
        status = (
            gather_rank_status(local_p2p, local_reason)
            if world_size > 1
            else {rank: (local_p2p, local_reason)}
        )
        missing = {r: why for r, (ok, why) in sorted(status.items()) if not ok}
        self.p2p_available = not missing
        if not missing:
            self.p2p_reason = ""
        elif set(missing) == set(range(world_size)) and len(set(missing.values())) == 1:
            self.p2p_reason = local_reason or next(iter(missing.values()))
        else:
            self.p2p_reason = "; ".join(f"rank {r}: {why}" for r, why in missing.items())
        if socket_timeout_s is not None:
            import zmq

            ms = int(socket_timeout_s * 1000)
            self._ps._zmq_ctx.setsockopt(zmq.RCVTIMEO, ms)
            self._ps._zmq_ctx.setsockopt(zmq.SNDTIMEO, ms)
        self._staged: _Staged | None = None
        self._pool_layout: str | None = None
        self.last_plan: UpdatePlan | None = None

    # ------------------------------------------------------------------ register
    def register(
        self,
        weights: NamedTensors,
        version: int,
        *,
        name: str | None = None,
        expected_keys: Collection[str] | None = None,
    ) -> None:
        """Collective: stage ``weights`` (the same full set on every rank) as ``version``.

        ``expected_keys`` (e.g. the engine model's keys) is checked first, before anything
        changes: a key missing outside the allow-list or an extra key raises
        :class:`KeyCoverageError` naming them and the published checkpoint stays published.
        """
        items = named_tensor_list(weights)
        names = [n for n, _ in items]
        self._precheck(expected_keys, names, "weights")
        self._register_staged(names, version, name, lambda ckpt: self._stage_tensors(items, ckpt))

    def register_from_dir(
        self,
        export_dir: str | Path,
        version: int,
        *,
        name: str | None = None,
        expected_keys: Collection[str] | None = None,
    ) -> None:
        """Collective: stage an HF safetensors export; its files are shared out across ranks.

        Each rank registers the files :func:`assign_files` gives it (read by the parameter
        server; never pinned in place, so files under /dev/shm are not deleted). Keys come from
        the index; ``expected_keys`` is checked against them before anything changes.
        """
        index = read_hf_index(export_dir)
        self._precheck(expected_keys, index.keys, f"{index.path}")
        self._register_staged(
            index.keys, version, name, lambda ckpt: self._stage_files(index, ckpt)
        )

    def _precheck(self, expected: Collection[str] | None, have: Sequence[str], what: str) -> None:
        if expected is None:
            return
        cov = check_key_coverage(expected, have, self.registration.allow_missing_prefixes)
        if not cov.ok:
            raise KeyCoverageError(
                f"{self.name}: {what} do not match the expected keys: {cov.describe()}", cov
            )

    def _register_staged(
        self,
        expected: Sequence[str],
        version: int,
        name: str | None,
        stage: Callable[[str], tuple[Sequence[int], Sequence[str]]],
    ) -> None:
        ckpt = name or f"{self.name}-v{version}"
        reg = self.registration
        reg.begin_register(name=ckpt, version=version)
        try:
            with scoped_env(self.p2p_env):  # Mooncake registers the pinned memory too
                ranks_ok, registered = stage(ckpt)
        except Exception as exc:
            reg.register_failed(reason=_bounded(f"{type(exc).__name__}: {exc}"))
            self.version, self.keys = None, ()
            if isinstance(exc, RegisterError):
                raise
            raise RegisterError(f"{self.name}: staging v{version} failed: {exc}") from exc
        cov = check_key_coverage(expected, registered, reg.allow_missing_prefixes)
        refused: Exception | None = None
        if cov.duplicated:  # the guard sees sets; a key staged twice would be pushed twice
            refused = RegisterError("a key was registered by several ranks")
        else:
            try:
                reg.register_ok(
                    ranks_ok=ranks_ok, expected_keys=expected, registered_keys=registered
                )
            except TransitionNotAllowed as exc:
                refused = exc
        if refused is not None:
            missing_ranks = sorted(set(range(self.world_size)) - set(ranks_ok))
            detail = cov.describe() or (
                f"rank(s) {missing_ranks} did not register" if missing_ranks else str(refused)
            )
            reg.register_failed(reason=_bounded(detail))
            self.version, self.keys = None, ()
            self._unstage()
            raise KeyCoverageError(
                f"{self.name}: v{version} not published: {detail}", cov
            ) from refused
        self.version, self.keys = version, tuple(expected)

    def _release_previous(self, layout: str, shared: bool) -> None:
        """Unregister what this rank staged before (first, to bound pinned memory)."""
        prev = self._staged
        self._staged = None
        if prev is None:
            return
        force = prev.shared_pool and (not shared or layout != self._pool_layout)
        self._ps.unregister_checkpoint(prev.name, force=force)
        if force:
            self._pool_layout = None

    def _finish_stage(self, ckpt: str, ok: bool, error: str) -> tuple[list[int], list[str]]:
        status = gather_rank_status(ok, error)
        failed = {r: e for r, (o, e) in status.items() if not o}
        if failed:
            self._unstage()
            raise RegisterError(
                f"{self.name}: register_checkpoint({ckpt!r}) failed on rank(s) "
                + "; ".join(f"{r}: {e}" for r, e in sorted(failed.items()))
            )
        self._ps.gather_metas(ckpt)
        registered: list[str] = []
        nbytes = 0
        for owner in sorted(self._ps.get_metas()):
            for bucket in self._ps.get_metas()[owner].memory_buffer_metas_list:
                for meta in bucket.metas:
                    registered.append(str(meta.name))
                    nbytes += int(meta.aligned_size)
        if self._staged is not None:
            self._staged.nbytes = nbytes
            self._staged.keys = tuple(registered)
        return sorted(status), registered

    def _register_local(
        self, ckpt: str, layout: str, empty: bool, **kwargs: Any
    ) -> tuple[bool, str]:
        shared = self.use_shared_memory_pool and not empty
        self._release_previous(layout, shared)
        try:
            self._ps.register_checkpoint(
                ckpt, use_shared_memory_pool=shared, use_inplace_pin_memory=False, **kwargs
            )
        except Exception as exc:
            with contextlib.suppress(Exception):  # upstream cleans up too; make sure of it
                self._ps.unregister_checkpoint(ckpt, force=shared)
            if shared:
                self._pool_layout = None
            return False, _bounded(f"{type(exc).__name__}: {exc}")
        self._staged = _Staged(ckpt, layout, shared)
        if shared:
            self._pool_layout = layout
        return True, ""

    def _stage_tensors(
        self, items: list[tuple[str, torch.Tensor]], ckpt: str
    ) -> tuple[list[int], list[str]]:
        sizes = {n: int(t.numel()) * t.element_size() for n, t in items}
        sigs = None
        if self.expert_gather is not None:
            sigs = expert_signatures(items, self.expert_gather)
            by_name = dict(items)
            for n, shapes in sigs.items():
                numel = math.prod(_full_shape(shapes, self.expert_gather.dim))
                sizes[n] = numel * by_name[n].element_size()
        digest = hashlib.sha256(json.dumps(sorted(sizes.items())).encode()).hexdigest()
        agree = gather_rank_status(True, digest)
        differing = sorted(r for r, (_, d) in agree.items() if d != digest)
        if differing:
            raise RegisterError(
                f"{self.name}: ranks {differing} passed different weight names/sizes than rank "
                f"{self.rank}; every rank must pass the same full set"
            )
        owned = set(partition_keys(sizes.items(), self.world_size)[self.rank])
        if self.expert_gather is not None:
            items = gather_expert_shards(
                items, self.expert_gather, keep=owned.__contains__, signatures=sigs
            )
        mine = {n: (t if t.is_contiguous() else t.contiguous()) for n, t in items if n in owned}
        layout = hashlib.sha256(
            json.dumps(sorted((n, list(t.shape), str(t.dtype)) for n, t in mine.items())).encode()
        ).hexdigest()
        ok, err = self._register_local(ckpt, layout, not mine, named_tensors=mine)
        del mine
        return self._finish_stage(ckpt, ok, err)

    def _stage_files(self, index: HFIndex, ckpt: str) -> tuple[list[int], list[str]]:
        share = assign_files(index.file_sizes, self.world_size)[self.rank]
        files = [str(p) for p in index.files_of(share)]
        layout = hashlib.sha256(
            json.dumps([(f, index.file_sizes[f]) for f in share]).encode()
        ).hexdigest()
        ok, err = self._register_local(ckpt, layout, not files, files=files)
        return self._finish_stage(ckpt, ok, err)

    def _unstage(self) -> None:
        prev = self._staged
        self._staged = None
        if prev is not None:
            with contextlib.suppress(Exception), scoped_env(self.p2p_env):
                self._ps.unregister_checkpoint(prev.name, force=prev.shared_pool)
            if prev.shared_pool:
                self._pool_layout = None

    # ------------------------------------------------------------------ update
    def update(self, targets: Sequence[EngineTarget], *, p2p: bool | None = None) -> UpdateReport:
        """Collective: push the registered checkpoint to ``targets`` (same list on every rank).

        ``p2p=None``: broadcast when the targets' ranks are every rank, else P2P. ``p2p=True``:
        P2P (``ranks=[...]``) to the targets' ranks even when they are every rank, as a targeted
        push asks. ``p2p=False``: broadcast only (a subset raises :class:`TransportError`).
        Raises :class:`P2PUnavailable` (nothing changed) when P2P is needed and unusable. One
        target failing fails the collective (reported per target, not raised). The plan used is
        kept in :attr:`last_plan`.
        """
        reg = self.registration
        published = check_update_targets(self.name, reg, targets)
        rank_lists = [list(t.ranks) for t in targets]
        if not reg.targets_valid(targets=rank_lists):
            reg.begin_update(targets=rank_lists)  # refused by the guard: raises, nothing changes
        plan = plan_update(
            rank_lists,
            self.world_size,
            p2p_available=self.p2p_available,
            p2p_reason=self.p2p_reason,
            force_p2p=p2p is True,
        )
        if p2p is False and plan.mode != "broadcast":
            raise TransportError(
                f"{self.name}: a broadcast was asked for but the targets cover ranks "
                f"{list(plan.ranks or ())} of {self.world_size}, not every rank"
            )
        self.last_plan = plan
        reg.begin_update(targets=rank_lists)
        report = UpdateReport(name=published[0], version=published[1])
        started = time.perf_counter()
        try:
            local: LocalResults = {}
            error: str | None = None
            req_func = self._req_func(targets, published[1], local)
            cap = self.max_bucket_bytes if self.max_bucket_bytes is not None else DEFAULT_BUCKET
            env = {**self.p2p_env, "PS_MAX_BUCKET_SIZE_GB": repr(cap / _GIB)}
            try:
                with scoped_env(env):
                    self._ps.update(published[0], req_func, ranks=plan.ps_ranks)
            except Exception as exc:
                error = _bounded(f"{type(exc).__name__}: {exc}")
            dist = _dist()
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, (local, error))
            nbytes = self._staged.nbytes if self._staged else 0
            report.results.update(merge_rank_results(gathered, targets, nbytes=nbytes))
        except Exception as exc:  # the result exchange itself failed: every target failed
            reason = _bounded(f"{type(exc).__name__}: {exc}")
            for t in targets:
                report.results.setdefault(t.name, TargetResult(t.name, False, reason))
        finally:
            per_rank: dict[int, tuple[bool, str]] = {}
            for t in targets:
                res = report.results.get(t.name) or TargetResult(t.name, False, "no result")
                for rank in t.ranks:
                    per_rank[rank] = (res.ok, res.reason)
            reg.update_done(results=per_rank)
        report.seconds = time.perf_counter() - started
        return report

    def _req_func(
        self, targets: Sequence[EngineTarget], version: int, local: LocalResults
    ) -> Callable[[list[tuple[str, str]]], None]:
        """The callback checkpoint-engine runs in a thread on each rank once its socket is bound."""
        mine = [t for t in targets if min(t.ranks) == self.rank]

        def req_func(socket_paths: list[tuple[str, str]]) -> None:
            for t in mine:
                t0 = time.perf_counter()
                handles: dict[str, str] = {}
                try:
                    handles = socket_paths_for(socket_paths, t.ranks)
                    t.client.update_weights_from_ipc(
                        handles,
                        flush_cache=self.flush_cache,
                        weight_version=str(version),
                        timeout=self.request_timeout_s,
                    )
                except Exception as exc:
                    reason = _bounded(f"{type(exc).__name__}: {exc}")
                    local[t.name] = (False, reason, time.perf_counter() - t0)
                    if _engine_never_connected(exc):
                        self._stand_in(handles, reason)
                else:
                    local[t.name] = (True, "", time.perf_counter() - t0)

        return req_func

    def _stand_in(self, handles: Mapping[str, str], reason: str) -> None:
        """Answer the parameter server's first message with an error, in the engine's place.

        When the engine refused the request before any worker connected, the parameter server
        would block forever sending its IPC handle; this answers it (without unpickling) with
        the error, which makes every rank abort the update cleanly, then takes the abort signal.
        """
        import zmq

        ctx = zmq.Context.instance()
        for path in handles.values():
            sock = ctx.socket(zmq.REP)
            try:
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(path)
                ms = int(self.stand_in_timeout_s * 1000)
                if not sock.poll(ms, zmq.POLLIN):
                    continue
                sock.recv()  # the IPC handle: never rebuilt here
                sock.send(f"rollsafe: engine request failed: {reason}".encode())
                if sock.poll(ms, zmq.POLLIN):
                    sock.recv()  # the abort the parameter server sends to every worker
            finally:
                sock.close()

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Unregister what this rank staged (freeing pinned memory) and drop the server."""
        self._unstage()
        self._ps = None
        super().close()


def _engine_never_connected(exc: BaseException) -> bool:
    """True when the engine answered an HTTP error or was unreachable (its workers never joined)."""
    from rollsafe.adapters.engines.errors import (
        EngineNotSupported,
        EngineRequestError,
        EngineTimeout,
        EngineUnavailable,
    )

    if isinstance(exc, EngineTimeout):  # the engine may still be loading: never answer for it
        return False
    return isinstance(exc, (EngineRequestError, EngineUnavailable, EngineNotSupported))
