"""checkpoint-engine behind a :class:`~rollsafe.fleet.RolloutFleet`: broadcast syncs, P2P pushes.

A fleet numbers its engine ranks across groups (``g0`` ranks 0..k-1, ``g1`` the next...), while
checkpoint-engine's ``ParameterServer`` numbers the trainer's ranks, one per GPU: the engine
worker on GPU ``i`` takes its weights from parameter-server rank ``i`` over CUDA IPC. Several
groups may sit on the same GPUs (two engines on one H200), so one parameter-server rank may feed
several groups, one at a time: a ZMQ socket of the parameter server serves one engine per update.

:class:`CheckpointEngineFleetTransport` maps each target to its parameter-server ranks
(``ps_ranks_for``; default: a group's ``i``-th engine rank is on the GPU of trainer rank ``i``),
splits an update into waves of targets on disjoint ranks, and keeps its own
:class:`~rollsafe.statemachines.CheckpointRegistration` in the fleet's rank space (the fleet's
timeline shows which groups each update targeted). Two kinds of update:

* :meth:`~CheckpointEngineFleetTransport.update` (a sync): each wave is a broadcast when it
  covers every parameter-server rank, else P2P when usable, else :class:`P2PUnavailable` before
  anything moves;
* :meth:`~CheckpointEngineFleetTransport.targeted_update` (a recovery's push to a restarted
  group): always P2P, ``ranks=[the group's ranks]``, also when that is every rank (a world of one
  on a one-GPU host); :class:`P2PUnavailable` with the reason when P2P is not usable, never a
  broadcast.

Every wave is recorded in :attr:`~CheckpointEngineFleetTransport.pushes` (:class:`PushRecord`:
mode, ``ranks=`` argument, targets, seconds, bytes).

:func:`fleet_fallback_reasons` says why a fleet cannot use checkpoint-engine at all (a vLLM
engine, weights not on CUDA, engines not beside the trainer's GPU): the fleet then builds
``nccl`` instead and logs one warning naming the reasons.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rollsafe.errors import InvalidArgumentType
from rollsafe.ports import EngineTarget, NamedTensors, TargetResult, UpdateReport
from rollsafe.statemachines import CheckpointRegistration, TransitionNotAllowed
from rollsafe.text import bound_text
from rollsafe.transports.base import (
    RegisterError,
    TransportError,
    check_update_targets,
    named_tensor_list,
)
from rollsafe.transports.checkpoint_engine.planning import UpdatePlan, plan_update
from rollsafe.transports.checkpoint_engine.transport import CheckpointEngineTransport

__all__ = [
    "FALLBACK_TRANSPORT",
    "CheckpointEngineFleetTransport",
    "PushRecord",
    "fleet_fallback_reasons",
    "split_waves",
]

#: What a fleet builds instead of checkpoint-engine when :func:`fleet_fallback_reasons` objects.
FALLBACK_TRANSPORT = "nccl"
_RECORDS_KEPT = 256


def fleet_fallback_reasons(
    *,
    kind: str = "reference",
    dialect: str | None = None,
    device: str = "cpu",
    cuda_available: bool | None = None,
) -> list[str]:
    """Why a fleet whose engines are ``kind`` speaking ``dialect`` (None: the kind's own) on
    ``device`` cannot use checkpoint-engine (empty: it can).

    checkpoint-engine hands CUDA IPC handles of the trainer's GPU buffers to SGLang's
    ``/update_weights_from_ipc``: it needs a colocated trainer whose weights are on CUDA and
    SGLang-dialect engines on the trainer's GPUs. ``cuda_available`` defaults to
    ``torch.cuda.is_available()``.
    """
    reasons: list[str] = []
    dialect = dialect or ("vllm" if kind == "vllm" else "sglang")
    if dialect == "vllm":
        reasons.append(
            f"the engines speak the vLLM dialect (EngineSpec "
            f"{'kind' if kind == 'vllm' else 'dialect'}='vllm'); checkpoint-engine pushes "
            "through SGLang's /update_weights_from_ipc"
        )
    if cuda_available is None:
        import torch

        cuda_available = bool(torch.cuda.is_available())
    if not cuda_available:
        reasons.append(
            "the trainer's weights are on CPU (torch.cuda.is_available() is False); "
            "checkpoint-engine needs a colocated trainer whose weights are on CUDA"
        )
    if kind == "reference" and not device.startswith("cuda"):
        reasons.append(
            f"the engines run on {device!r}, not on the trainer's GPUs (a disaggregated "
            "fleet); checkpoint-engine feeds colocated engines over CUDA IPC"
        )
    return reasons


@dataclass(frozen=True)
class PushRecord:
    """One ``ParameterServer.update`` call of a fleet update (one wave)."""

    mode: Literal["broadcast", "p2p"]
    #: The ``ranks=`` argument checkpoint-engine got (None: broadcast to every rank).
    ps_ranks: tuple[int, ...] | None
    targets: tuple[str, ...]
    #: The targets' ranks in the fleet's numbering.
    fleet_ranks: tuple[tuple[int, ...], ...]
    #: True for :meth:`CheckpointEngineFleetTransport.targeted_update` (a recovery's push).
    targeted: bool
    version: int
    ok: bool
    started_at: float
    seconds: float
    nbytes: int
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "ps_ranks": None if self.ps_ranks is None else list(self.ps_ranks),
            "targets": list(self.targets),
            "fleet_ranks": [list(r) for r in self.fleet_ranks],
            "targeted": self.targeted,
            "version": self.version,
            "ok": self.ok,
            "started_at": self.started_at,
            "seconds": self.seconds,
            "nbytes": self.nbytes,
            "reason": self.reason,
        }


def split_waves(targets: Sequence[EngineTarget]) -> list[list[EngineTarget]]:
    """Group targets into waves whose ranks do not overlap (first fit, order kept)."""
    waves: list[list[EngineTarget]] = []
    used: list[set[int]] = []
    for t in targets:
        ranks = set(t.ranks)
        for i, taken in enumerate(used):
            if not ranks & taken:
                waves[i].append(t)
                taken |= ranks
                break
        else:
            waves.append([t])
            used.append(set(ranks))
    return waves


def _local_ranks(target: EngineTarget) -> tuple[int, ...]:
    """Default placement: a group's ``i``-th engine rank sits on the GPU of trainer rank ``i``."""
    return tuple(range(len(target.ranks)))


class CheckpointEngineFleetTransport:
    """A :class:`CheckpointEngineTransport` seen from a fleet (see the module docstring).

    ``fleet_world_size``: the fleet's engine ranks (its registration machine's world).
    ``transport``: the parameter-server side (default: built from ``options``, the keyword
    arguments of :class:`CheckpointEngineTransport`). ``ps_ranks_for(target)``: the
    parameter-server ranks feeding a target (fleet-numbered ranks in, one per engine rank out).
    Collective like the transport it wraps: in a fleet the trainer has one rank.
    """

    name = "checkpoint_engine"

    def __init__(
        self,
        fleet_world_size: int,
        *,
        transport: CheckpointEngineTransport | None = None,
        ps_ranks_for: Callable[[EngineTarget], Sequence[int]] | None = None,
        **options: Any,
    ) -> None:
        if transport is not None and options:
            raise InvalidArgumentType(
                "transport", f"pass either transport= or its options, not both: {sorted(options)}"
            )
        self.inner = transport if transport is not None else CheckpointEngineTransport(**options)
        self.fleet_world_size = fleet_world_size
        self.registration = CheckpointRegistration(
            fleet_world_size, allow_missing_prefixes=self.inner.registration.allow_missing_prefixes
        )
        self.ps_ranks_for = ps_ranks_for or _local_ranks
        self.pushes: deque[PushRecord] = deque(maxlen=_RECORDS_KEPT)

    # ------------------------------------------------------------------ facts
    @property
    def world_size(self) -> int:
        """Parameter-server ranks (the trainer's world)."""
        return self.inner.world_size

    @property
    def p2p_available(self) -> bool:
        return self.inner.p2p_available

    @property
    def p2p_reason(self) -> str:
        return self.inner.p2p_reason

    @property
    def p2p_protocol(self) -> str | None:
        return self.inner.p2p_protocol

    @property
    def version(self) -> int | None:
        return self.inner.version

    @property
    def keys(self) -> tuple[str, ...]:
        return self.inner.keys

    def ps_ranks(self, target: EngineTarget) -> tuple[int, ...]:
        """The parameter-server ranks feeding ``target`` (validated)."""
        ranks = tuple(int(r) for r in self.ps_ranks_for(target))
        world = self.inner.world_size
        if not ranks or len(set(ranks)) != len(ranks) or any(not 0 <= r < world for r in ranks):
            raise TransportError(
                f"{self.name}: target {target.name!r} (fleet ranks {list(target.ranks)}) maps to "
                f"parameter-server ranks {list(ranks)}; they must be distinct and in "
                f"range(0, {world}): a group needs one trainer GPU per engine rank"
            )
        return ranks

    # ------------------------------------------------------------------ register
    def register(
        self,
        weights: NamedTensors,
        version: int,
        *,
        name: str | None = None,
        expected_keys: Collection[str] | None = None,
    ) -> None:
        """Stage ``weights`` as ``version`` (pinned host copy); nothing is published on failure."""
        items = named_tensor_list(weights)
        self._register(
            version,
            name,
            lambda ckpt: self.inner.register(
                items, version, name=ckpt, expected_keys=expected_keys
            ),
        )

    def register_from_dir(
        self,
        export_dir: str | Path,
        version: int,
        *,
        name: str | None = None,
        expected_keys: Collection[str] | None = None,
    ) -> None:
        """Stage an HF export directory as ``version`` (see the wrapped transport)."""
        self._register(
            version,
            name,
            lambda ckpt: self.inner.register_from_dir(
                export_dir, version, name=ckpt, expected_keys=expected_keys
            ),
        )

    def _register(self, version: int, name: str | None, stage: Callable[[str], None]) -> None:
        ckpt = name or f"{self.name}-v{version}"
        reg = self.registration
        reg.begin_register(name=ckpt, version=version)
        try:
            stage(ckpt)
        except Exception as exc:
            reg.register_failed(reason=bound_text(f"{type(exc).__name__}: {exc}"))
            if isinstance(exc, RegisterError):
                raise
            raise RegisterError(f"{self.name}: staging v{version} failed: {exc}") from exc
        keys = self.inner.keys
        try:
            reg.register_ok(
                ranks_ok=range(self.fleet_world_size), expected_keys=keys, registered_keys=keys
            )
        except TransitionNotAllowed as exc:  # pragma: no cover - the inner guard passed
            reg.register_failed(reason=bound_text(str(exc)))
            raise RegisterError(f"{self.name}: v{version} not published: {exc}") from exc

    # ------------------------------------------------------------------ update
    def update(self, targets: Sequence[EngineTarget]) -> UpdateReport:
        """A sync: broadcast per wave that covers every parameter-server rank, else P2P."""
        return self._update(targets, targeted=False)

    def targeted_update(self, targets: Sequence[EngineTarget]) -> UpdateReport:
        """A recovery's push: P2P (``ranks=[...]``) to the targets' ranks only, never a broadcast.

        Raises :class:`~rollsafe.transports.checkpoint_engine.P2PUnavailable` (nothing changed)
        when P2P is not usable.
        """
        return self._update(targets, targeted=True)

    def plan(
        self, targets: Sequence[EngineTarget], *, targeted: bool = False
    ) -> list[tuple[list[EngineTarget], UpdatePlan]]:
        """The waves of an update and each one's plan; raises before anything moves."""
        mapped = [EngineTarget(t.name, self.ps_ranks(t), t.client, t.tp_size) for t in targets]
        inner = self.inner
        return [
            (
                wave,
                plan_update(
                    [list(t.ranks) for t in wave],
                    inner.world_size,
                    p2p_available=inner.p2p_available,
                    p2p_reason=inner.p2p_reason,
                    force_p2p=targeted,
                ),
            )
            for wave in split_waves(mapped)
        ]

    def _update(self, targets: Sequence[EngineTarget], *, targeted: bool) -> UpdateReport:
        reg = self.registration
        published = check_update_targets(self.name, reg, targets)
        rank_lists = [list(t.ranks) for t in targets]
        if not reg.targets_valid(targets=rank_lists):
            reg.begin_update(targets=rank_lists)  # refused by the guard: raises, nothing changes
        waves = self.plan(targets, targeted=targeted)  # P2PUnavailable before anything moves
        fleet_ranks = {t.name: tuple(t.ranks) for t in targets}
        reg.begin_update(targets=rank_lists)
        report = UpdateReport(name=published[0], version=published[1])
        started = time.perf_counter()
        try:
            for wave, plan in waves:
                t0, at = time.perf_counter(), time.time()
                try:
                    sub = self.inner.update(wave, p2p=plan.mode == "p2p")
                    report.results.update(sub.results)
                except Exception as exc:
                    reason = bound_text(f"{type(exc).__name__}: {exc}")
                    for t in wave:
                        report.results[t.name] = TargetResult(t.name, False, reason)
                results = [report.results[t.name] for t in wave]
                self.pushes.append(
                    PushRecord(
                        mode=plan.mode,
                        ps_ranks=plan.ranks,
                        targets=tuple(t.name for t in wave),
                        fleet_ranks=tuple(fleet_ranks[t.name] for t in wave),
                        targeted=targeted,
                        version=published[1],
                        ok=all(r.ok for r in results),
                        started_at=at,
                        seconds=time.perf_counter() - t0,
                        nbytes=max((r.nbytes for r in results), default=0),
                        reason="; ".join(r.reason for r in results if r.reason)[:512],
                    )
                )
        finally:
            per_rank: dict[int, tuple[bool, str]] = {}
            for t in targets:
                res = report.results.get(t.name)
                if res is None:
                    res = report.results[t.name] = TargetResult(t.name, False, "not pushed")
                for rank in t.ranks:
                    per_rank[rank] = (res.ok, res.reason)
            reg.update_done(results=per_rank)
        report.seconds = time.perf_counter() - started
        return report

    def last_push(self) -> PushRecord | None:
        return self.pushes[-1] if self.pushes else None

    @property
    def deltas(self) -> None:
        """None: checkpoint-engine pushes whole versions (its parameter server keeps no
        per-target base)."""
        return None

    def forget(self, target_name: str) -> None:
        """Nothing is kept per target (the parameter server serves every rank)."""

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> CheckpointEngineFleetTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
