"""The ``checkpoint_engine`` transport: MoonshotAI checkpoint-engine's ``ParameterServer``.

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
server's construction, registrations and updates (:meth:`CheckpointEngineTransport.p2p_env`),
with ``MC_TCP_SLICE_SIZE`` = ``tcp_slice_bytes`` (16 MiB) unless the environment names one
(Mooncake reads it once per process, at its first TCP transfer, which happens inside that scope);
``p2p_protocol="rdma"`` clears an ambient ``MC_FORCE_TCP`` there instead. Mooncake that fails to
start leaves P2P off with the reason (:attr:`CheckpointEngineTransport.p2p_reason`).

``checkpoint_engine`` is imported only when a transport is constructed; on a host without CUDA or
Ascend, or without the package, construction raises :class:`CheckpointEngineUnavailable`.
Everything except the parameter-server calls is plain Python, in one sibling module per concern
(sharding, environment, experts, agreement, planning), and unit-tested on CPU; this module's
``__all__`` re-exports their names as before the split.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollsafe.errors import InvalidArgument
from rollsafe.ports import EngineTarget, NamedTensors, TargetResult, UpdateReport
from rollsafe.statemachines import TransitionNotAllowed

# the plain-Python parts live in one module per concern; every name stays importable from here
from rollsafe.text import bound_text
from rollsafe.transports.base import (
    RegisterError,
    StagedTransport,
    TransportError,
    check_update_targets,
    named_tensor_list,
)
from rollsafe.transports.checkpoint_engine.agreement import (
    agree_store_address,
    dist_module,
    gather_rank_status,
)
from rollsafe.transports.checkpoint_engine.availability import (
    checkpoint_engine_unavailable_reasons,
    mooncake_available,
)
from rollsafe.transports.checkpoint_engine.environment import (
    DEFAULT_TCP_SLICE_BYTES,
    TCP_PLACEHOLDER_DEVICE,
    P2PProtocol,
    hidden_modules,
    p2p_environment,
    scoped_env,
)
from rollsafe.transports.checkpoint_engine.errors import (
    CheckpointEngineUnavailable,
    ExpertGatherError,
    KeyCoverageError,
    P2PUnavailable,
    ProcessGroupError,
)
from rollsafe.transports.checkpoint_engine.experts import (
    ExpertGather,
    expert_signatures,
    full_shape,
    gather_expert_shards,
)
from rollsafe.transports.checkpoint_engine.planning import (
    LocalResults,
    UpdatePlan,
    merge_rank_results,
    plan_update,
    socket_paths_for,
)
from rollsafe.transports.checkpoint_engine.sharding import (
    KeyCoverage,
    assign_files,
    check_key_coverage,
    partition_keys,
    read_hf_index,
)
from rollsafe.wire.hf_index import HFIndex

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_BUCKET",
    "TCP_PLACEHOLDER_DEVICE",
    "CheckpointEngineTransport",
    "CheckpointEngineUnavailable",
    "ExpertGather",
    "ExpertGatherError",
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

_GIB = 1 << 30
DEFAULT_BUCKET = 8 * _GIB  # checkpoint-engine 0.4.2's own default cap (PS_MAX_BUCKET_SIZE_GB=8)
DEFAULT_MEM_FRACTION = 0.9  # its default share of free device memory (PS_MEM_FRACTION=0.9)

log = logging.getLogger(__name__)


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
    * ``tcp_slice_bytes``: Mooncake's TCP slice (``MC_TCP_SLICE_SIZE``) for P2P over TCP,
      default :data:`DEFAULT_TCP_SLICE_BYTES` (16 MiB; Mooncake's own is 64 KiB), set where
      ``p2p_env`` applies unless the environment already names one (never overridden); None
      leaves Mooncake's default.
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
        tcp_slice_bytes: int | None = DEFAULT_TCP_SLICE_BYTES,
        server_factory: Callable[..., Any] | None = None,
    ) -> None:
        if server_factory is None:
            reasons = checkpoint_engine_unavailable_reasons()
            if reasons:
                raise CheckpointEngineUnavailable(reasons)
        import torch

        dist = dist_module()
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
            raise InvalidArgument(
                "max_bucket_bytes", f"max_bucket_bytes must be > 0, got {max_bucket_bytes}"
            )
        if rdma_devices is not None and not list(rdma_devices):
            raise InvalidArgument(
                "rdma_devices", "rdma_devices, when given, must name at least one device"
            )
        if p2p_protocol not in (None, "rdma", "tcp"):
            raise InvalidArgument(
                "p2p_protocol", f"p2p_protocol must be 'rdma', 'tcp' or None, got {p2p_protocol!r}"
            )
        if p2p_protocol == "rdma" and rdma_devices is None:
            raise InvalidArgument(
                "rdma_devices",
                "p2p_protocol='rdma' needs rdma_devices (RDMA devices come only from explicit "
                "configuration); without RDMA hardware use p2p_protocol='tcp'",
            )
        if transfer_timeout_s is not None and transfer_timeout_s <= 0:
            raise InvalidArgument(
                "transfer_timeout_s", f"transfer_timeout_s must be > 0, got {transfer_timeout_s}"
            )
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
            self.p2p_protocol, rdma_devices, transfer_timeout_s, tcp_slice_bytes=tcp_slice_bytes
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
                    start_error = bound_text(f"{type(exc).__name__}: {exc}")
                    log.warning(
                        "checkpoint_engine: the parameter server with P2P (%s) failed to start "
                        "(%s); starting it without P2P",
                        self.p2p_protocol,
                        start_error,
                    )
            if not p2p_wanted or start_error:
                with hidden_modules(("mooncake", "mooncake.engine")):
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
            reg.register_failed(reason=bound_text(f"{type(exc).__name__}: {exc}"))
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
            reg.register_failed(reason=bound_text(detail))
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
            return False, bound_text(f"{type(exc).__name__}: {exc}")
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
                numel = math.prod(full_shape(shapes, self.expert_gather.dim))
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
                error = bound_text(f"{type(exc).__name__}: {exc}")
            dist = dist_module()
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, (local, error))
            nbytes = self._staged.nbytes if self._staged else 0
            report.results.update(merge_rank_results(gathered, targets, nbytes=nbytes))
        except Exception as exc:  # the result exchange itself failed: every target failed
            reason = bound_text(f"{type(exc).__name__}: {exc}")
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
                    reason = bound_text(f"{type(exc).__name__}: {exc}")
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
