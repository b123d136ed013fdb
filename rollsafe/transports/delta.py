"""Delta weight sync, the sender's half: what each target of one update receives.

Owns :class:`DeltaSettings` (how a tensor transport uses deltas), :class:`DeltaSender` (the
base snapshots, the per-target plan and its settlement) and the records an update leaves
(:class:`TargetSync`, :class:`DeltaRecord`). ``docs/transports.md``, "Deltas", and
``docs/design.md``, "Delta sync", say why it is built this way.

One update of version N, when deltas are on (:meth:`DeltaSender.plan`):

1. each target is planned by :func:`rollsafe.policy.plan_push` through the transport's
   :class:`~rollsafe.transports.delta_ledger.DeltaLedger` (one ``DeltaBase`` machine per
   target): a delta only from a base the target **confirmed** and whose snapshot the sender
   still holds, and only to an engine kind that applies deltas; anything else is a full push
   with its reason (no base yet, a lagging base, a recovery's forced full, an engine that cannot);
2. targets on the same base share one encoding (:func:`rollsafe.wire.delta.encode_delta`:
   the elements whose raw bits differ, index + value, dense per tensor above its threshold;
   with the touched base tensors' digests when one of them checks its base by content,
   ``EngineTarget.delta_base_by_content``);
   a payload that is not smaller than a full sync sends those targets full (``not smaller``);
3. the transport pushes the full targets and each base's payload as ordinary named tensors;
   an engine that refuses a delta (wrong base, bad digest: it changed nothing) is pushed the
   full version in the same update;
4. :meth:`DeltaSender.settle` sends each target's ``DeltaBase`` its outcome: the base moves to
   N only when the target confirmed N (its engine applied it and checked the result digest);
   a failed or lost push never moves it. Snapshots no target's base names are dropped.

The sender keeps a copy of every version some target's base names (normally one: N-1 until
the targets confirm N, then N): one model's worth of memory on the weights' device, two during
an update. ``DeltaSettings.max_bases`` bounds the copies; a target whose base fell out is
lagging and gets a full push.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from rollsafe.errors import InvalidArgument
from rollsafe.transports.delta_ledger import DeltaLedger

if TYPE_CHECKING:
    import torch

    from rollsafe.ports import EngineTarget, TargetResult
    from rollsafe.wire.delta import DeltaPayload

__all__ = [
    "DELTA_REFUSALS",
    "DeltaRecord",
    "DeltaSender",
    "DeltaSettings",
    "TargetSync",
    "is_delta_refusal",
]

#: The engine's named refusals of a delta (nothing changed): the class names its 400 starts with.
DELTA_REFUSALS = ("DeltaBaseMismatch", "DeltaDigestMismatch", "DeltaFormatError")

SyncKind = Literal["full", "delta"]
log = logging.getLogger(__name__)


def is_delta_refusal(reason: str) -> bool:
    """Whether a failed target's reason is an engine's named refusal of a delta."""
    return any(name in reason for name in DELTA_REFUSALS)


@dataclass(frozen=True)
class DeltaSettings:
    """How a tensor transport (``ipc``, ``nccl``) uses deltas.

    ``enabled``: push deltas to targets that can take them (False: always full, the ledger
    still records the bases). ``dense_fraction``: per tensor, the changed fraction above which
    it travels whole (None: :data:`rollsafe.wire.delta.DENSE_FRACTION`, measured).
    ``max_bases``: base snapshots kept at most (each one model's worth of memory); a target
    whose base is older than every kept one gets a full push.
    """

    enabled: bool = True
    dense_fraction: float | None = None
    max_bases: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise InvalidArgument("delta.enabled", f"must be a bool, got {self.enabled!r}")
        frac = self.dense_fraction
        if frac is not None and (
            isinstance(frac, bool) or not isinstance(frac, int | float) or not 0.0 < frac <= 1.0
        ):
            raise InvalidArgument("delta.dense_fraction", f"must be in (0, 1], got {frac!r}")
        if isinstance(self.max_bases, bool) or not isinstance(self.max_bases, int):
            raise InvalidArgument("delta.max_bases", f"must be an int, got {self.max_bases!r}")
        if self.max_bases < 1:
            raise InvalidArgument("delta.max_bases", f"must be >= 1, got {self.max_bases}")


@dataclass(frozen=True)
class TargetSync:
    """What one target received in one update: ``kind`` ``"full"`` or ``"delta"`` (from
    ``base``), why full (``reason``: empty for a delta), the bytes pushed, and the engine's
    refusal of a delta first tried (then the full push that followed is the target's result)."""

    target: str
    kind: SyncKind
    base: int | None
    reason: str
    nbytes: int
    ok: bool
    refused: str = ""


@dataclass(frozen=True)
class DeltaRecord:
    """One update's deltas: per target what it got, the encodings' cost and size.

    ``full_nbytes``: one full sync's bytes (per target); ``changed_fraction``: elements whose
    bits changed since the base, over all elements (of the first base encoded; None when no
    delta was encoded); ``encode_s``: the sender's encode time, summed over bases.
    """

    version: int
    targets: tuple[TargetSync, ...]
    full_nbytes: int
    changed_fraction: float | None
    encode_s: float
    payload_nbytes: Mapping[int, int] = field(default_factory=dict)

    @property
    def delta_targets(self) -> tuple[str, ...]:
        return tuple(t.target for t in self.targets if t.kind == "delta")

    @property
    def fallbacks(self) -> tuple[TargetSync, ...]:
        """Targets sent full for a reason a delta would not have had: ``not smaller``, a
        refusal, or an engine kind that cannot apply deltas (what
        ``rollsafe_delta_fallbacks_total`` counts; a first push, a forced one and a lagging
        base are not fallbacks)."""
        return tuple(
            t
            for t in self.targets
            if t.kind == "full"
            and (t.refused or "not smaller" in t.reason or "cannot apply" in t.reason)
        )

    @property
    def refusals(self) -> tuple[TargetSync, ...]:
        return tuple(t for t in self.targets if t.refused)

    def nbytes(self, kind: SyncKind) -> int:
        return sum(t.nbytes for t in self.targets if t.kind == kind)

    def summary(self) -> str:
        """One log line: who got a delta, bytes each way, the changed fraction."""
        frac = "-" if self.changed_fraction is None else f"{100 * self.changed_fraction:.3f}%"
        return (
            f"delta to {len(self.delta_targets)}/{len(self.targets)} target(s), "
            f"{self.nbytes('delta')} delta + {self.nbytes('full')} full bytes "
            f"(full sync {self.full_nbytes} per target), changed {frac}, "
            f"encode {self.encode_s * 1e3:.1f} ms, {len(self.fallbacks)} fallback(s), "
            f"{len(self.refusals)} refusal(s)"
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly (the sync report, the demo, metrics)."""
        return {
            "version": self.version,
            "full_nbytes": self.full_nbytes,
            "changed_fraction": self.changed_fraction,
            "encode_s": self.encode_s,
            "payload_nbytes": {str(k): v for k, v in self.payload_nbytes.items()},
            "targets": {
                t.target: {
                    "kind": t.kind,
                    "base": t.base,
                    "reason": t.reason,
                    "nbytes": t.nbytes,
                    "ok": t.ok,
                    "refused": t.refused,
                }
                for t in self.targets
            },
        }


@dataclass
class DeltaPlan:
    """The targets of one update, split: full pushes and, per base version, one payload."""

    version: int
    full: list[EngineTarget]
    deltas: dict[int, tuple[DeltaPayload, list[EngineTarget]]]
    reasons: dict[str, str]
    encode_s: float = 0.0
    changed_fraction: float | None = None


class DeltaSender:
    """Base snapshots, per-target plans and settlement for one transport (thread-safe; the
    transport's own lock serializes updates)."""

    def __init__(self, settings: DeltaSettings) -> None:
        self.settings = settings
        self.ledger = DeltaLedger()
        self._snapshots: dict[int, list[tuple[str, torch.Tensor]]] = {}
        self._lock = threading.Lock()
        self.records: deque[DeltaRecord] = deque(maxlen=64)

    # ------------------------------------------------------------------ snapshots
    @property
    def held(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(sorted(self._snapshots))

    def snapshot_nbytes(self) -> int:
        with self._lock:
            return sum(t.numel() * t.element_size() for s in self._snapshots.values() for _, t in s)

    def keep(self, version: int, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Copy ``items`` (the version being pushed) as a possible base (one copy per version)."""
        import torch

        with self._lock:
            if version in self._snapshots:
                return
        with torch.no_grad():
            copy = [(n, t.detach().clone()) for n, t in items]
        with self._lock:
            self._snapshots[version] = copy

    def _evict(self, keep_also: int | None = None) -> None:
        """Drop the snapshots no target's base names (and the oldest above ``max_bases``)."""
        referenced = set(self.ledger.bases().values())
        if keep_also is not None:
            referenced.add(keep_also)
        with self._lock:
            for v in [v for v in self._snapshots if v not in referenced]:
                del self._snapshots[v]
            while len(self._snapshots) > self.settings.max_bases:
                del self._snapshots[min(self._snapshots)]

    # ------------------------------------------------------------------ plan
    def plan(
        self,
        targets: Sequence[EngineTarget],
        version: int,
        items: Sequence[tuple[str, torch.Tensor]],
        *,
        force_full: bool,
    ) -> DeltaPlan:
        """Plan every target (the ledger's machines move to ``sending_*``) and encode one payload
        per base; a payload not smaller than a full sync sends its targets full."""
        from rollsafe.wire.delta import DENSE_FRACTION, encode_delta

        held = self.held
        plan = DeltaPlan(version, [], {}, {})
        by_base: dict[int, list[EngineTarget]] = {}
        for t in targets:
            p = self.ledger.plan(
                t.name,
                version,
                held,
                delta_enabled=self.settings.enabled,
                engine_applies_deltas=t.applies_deltas,
                force_full=force_full,
            )
            if p.kind == "delta" and p.base is not None:
                by_base.setdefault(p.base, []).append(t)
            else:
                plan.full.append(t)
                plan.reasons[t.name] = p.reason
        frac = self.settings.dense_fraction or DENSE_FRACTION
        for base, group in sorted(by_base.items()):
            with self._lock:
                base_items = self._snapshots[base]
            try:
                payload = encode_delta(
                    base_items,
                    items,
                    base_version=base,
                    version=version,
                    dense_fraction=frac,
                    # an engine that checks its base by content needs the base's digests
                    base_digests=any(t.delta_base_by_content for t in group),
                )
            except Exception as exc:  # e.g. the version's names or shapes differ from the base's
                reason = f"delta from v{base} not encoded: {type(exc).__name__}: {exc}"[:512]
                log.warning("delta: %s; sending %d target(s) full", reason, len(group))
                for t in group:
                    self.ledger.fallback_full(t.name, reason)
                    plan.full.append(t)
                    plan.reasons[t.name] = reason
                continue
            plan.encode_s += payload.encode_s
            if plan.changed_fraction is None and payload.total_elements:
                plan.changed_fraction = payload.changed_elements / payload.total_elements
            if payload.worthwhile:
                plan.deltas[base] = (payload, group)
                continue
            reason = (
                f"delta from v{base} not smaller ({payload.nbytes} >= {payload.full_nbytes} bytes)"
            )
            for t in group:
                self.ledger.fallback_full(t.name, reason)
                plan.full.append(t)
                plan.reasons[t.name] = reason
        return plan

    def refused(self, target: str, version: int) -> None:
        """The engine refused its delta (nothing changed): the ledger records the refusal (the
        base stays) and plans the target's full push of ``version``, in the same update."""
        self.ledger.settle(target, version, ok=False, refused=True)
        self.ledger.plan(
            target,
            version,
            self.held,
            delta_enabled=self.settings.enabled,
            engine_applies_deltas=False,
            force_full=True,
        )

    # ------------------------------------------------------------------ settle
    def settle(
        self,
        plan: DeltaPlan,
        results: Mapping[str, TargetResult],
        sent: Mapping[str, SyncKind],
        refusals: Mapping[str, str],
        full_nbytes: int,
    ) -> DeltaRecord:
        """Each target's outcome to its machine (the base moves only on a confirmed push), drop
        unreferenced snapshots, return the update's record."""
        version = plan.version
        base_of = {t.name: base for base, (_, ts) in plan.deltas.items() for t in ts}
        rows: list[TargetSync] = []
        for name, res in results.items():
            kind = sent.get(name, "full")
            try:
                self.ledger.settle(name, version, ok=res.ok, refused=False)
            except InvalidArgument:
                # the target was reset while its push ran (it failed and left the fleet's
                # routing): the reset wins, its next push is full
                log.info("delta: %s was reset during its push of v%d", name, version)
            rows.append(
                TargetSync(
                    target=name,
                    kind=kind,
                    base=base_of.get(name) if kind == "delta" else None,
                    reason=plan.reasons.get(name, "") if kind == "full" else "",
                    nbytes=res.nbytes,
                    ok=res.ok,
                    refused=refusals.get(name, ""),
                )
            )
        self._evict()
        record = DeltaRecord(
            version=version,
            targets=tuple(sorted(rows, key=lambda r: r.target)),
            full_nbytes=full_nbytes,
            changed_fraction=plan.changed_fraction,
            encode_s=plan.encode_s,
            payload_nbytes={b: p.nbytes for b, (p, _) in plan.deltas.items()},
        )
        self.records.append(record)
        return record

    def reset(self, target: str) -> None:
        """The target restarted (or was added, or recovered): its next push is full."""
        self.ledger.reset(target)
        self._evict()

    def last(self) -> DeltaRecord | None:
        return self.records[-1] if self.records else None

    def stats(self) -> dict[str, object]:
        """For ``snapshot()``: bases per target, snapshots held and their bytes, the last record."""
        last = self.last()
        return {
            "enabled": self.settings.enabled,
            "bases": self.ledger.bases(),
            "held": list(self.held),
            "snapshot_bytes": self.snapshot_nbytes(),
            "last": None
            if last is None
            else {
                "version": last.version,
                "delta": list(last.delta_targets),
                "bytes_delta": last.nbytes("delta"),
                "bytes_full": last.nbytes("full"),
                "changed_fraction": last.changed_fraction,
                "encode_s": round(last.encode_s, 6),
                "fallbacks": len(last.fallbacks),
                "refusals": len(last.refusals),
            },
        }
