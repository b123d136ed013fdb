"""Delta weight sync, the sender's half: what each target of one update receives.

Owns :class:`DeltaSettings` (how a tensor transport uses deltas), :class:`DeltaSender` (the
base snapshots, the encodings, and the executor of one push) and the records an update leaves
(:class:`TargetSync`, :class:`DeltaRecord`). ``docs/transports.md``, "Deltas", and
``docs/design.md``, "Delta sync", say why it is built this way.

The order of one update's steps is :func:`rollsafe.operations.push.push`'s, written once
(``rollsafe verify`` executes the same sequence on its model); :meth:`DeltaSender.push`
performs its effects: the ledger's machines (a part), the snapshots, the encoder, and the
transport's own push of a staged payload. One update of version N, when deltas are on:

1. each target is planned by :func:`rollsafe.policy.plan_push` through the transport's
   :class:`~rollsafe.registry.delta_ledger.DeltaLedger` (one ``DeltaBase`` machine per
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import rollsafe.operations.effects as fx
from rollsafe.errors import InvalidArgument, RollsafeError
from rollsafe.operations import push as push_op
from rollsafe.operations.effects import drive
from rollsafe.operations.executor import Executor, handles
from rollsafe.registry import DeltaLedger
from rollsafe.text import bound_text

if TYPE_CHECKING:
    import torch

    from rollsafe.ports import EngineTarget, TargetResult
    from rollsafe.wire.delta import DeltaPayload

__all__ = [
    "DELTA_REFUSALS",
    "DeltaRecord",
    "DeltaSender",
    "DeltaSettings",
    "SendStaged",
    "StagingFailed",
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


class DeltaSender(Executor):
    """Base snapshots, encodings and the executor of one push for one transport (thread-safe;
    the transport's own lock serializes updates). The ledger's machines are a part."""

    parts = {DeltaLedger: "ledger"}

    def __init__(self, settings: DeltaSettings) -> None:
        self.settings = settings
        self.ledger = DeltaLedger()
        self._snapshots: dict[int, list[tuple[str, torch.Tensor]]] = {}
        self._lock = threading.Lock()
        self.records: deque[DeltaRecord] = deque(maxlen=64)
        self._run: _PushRun | None = None

    # ------------------------------------------------------------------ snapshots
    @property
    def held(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(sorted(self._snapshots))

    def snapshot_nbytes(self) -> int:
        with self._lock:
            return sum(t.numel() * t.element_size() for s in self._snapshots.values() for _, t in s)

    def _evict(self) -> None:
        """Drop the snapshots no target's base names (and the oldest above ``max_bases``),
        but never the version a push in flight is sending: a target's reset during the push
        (a group failing while the sync updates the others) must not drop the base its other
        targets are about to confirm."""
        referenced = set(self.ledger.bases().values())
        run = self._run
        if run is not None:
            referenced.add(run.version)
        with self._lock:
            for v in [v for v in self._snapshots if v not in referenced]:
                del self._snapshots[v]
            while len(self._snapshots) > self.settings.max_bases:
                del self._snapshots[min(self._snapshots)]

    # ------------------------------------------------------------------ one push
    def push(
        self,
        targets: Sequence[EngineTarget],
        version: int,
        items: Sequence[tuple[str, torch.Tensor]],
        send: SendStaged,
        *,
        force_full: bool = False,
    ) -> dict[str, TargetResult]:
        """Push ``version`` (``items``) to ``targets``: :func:`rollsafe.operations.push.push`,
        each payload handed to ``send(targets, base, tensors)`` (the transport stages it and
        pushes it in one update). ``force_full``: a recovery's push (the targets restarted:
        their bases are forgotten first, every push full). Returns each target's result and
        keeps the update's :class:`DeltaRecord`."""
        from rollsafe.ports import TargetResult

        run = self._run = _PushRun({t.name: t for t in targets}, version, list(items), send)
        try:
            steps = push_op.push(
                version, tuple(run.targets), force_full=force_full, fresh=force_full
            )
            outcome = drive(steps, self.perform)
        finally:
            self._run = None
        results = {
            name: TargetResult(name, got.ok, got.reason, got.seconds, got.nbytes)
            for name, got in outcome.delivered.items()
        }
        full_nbytes = sum(t.numel() * t.element_size() for _, t in run.items)
        rows = [
            TargetSync(
                target=name,
                kind="delta" if outcome.kinds.get(name) == "delta" else "full",
                base=outcome.bases.get(name),
                reason=outcome.reasons.get(name, "") if outcome.kinds.get(name) != "delta" else "",
                nbytes=got.nbytes,
                ok=got.ok,
                refused=outcome.refusals.get(name, ""),
            )
            for name, got in outcome.delivered.items()
        ]
        self._evict()
        self.records.append(
            DeltaRecord(
                version=version,
                targets=tuple(sorted(rows, key=lambda r: r.target)),
                full_nbytes=full_nbytes,
                changed_fraction=run.changed_fraction,
                encode_s=run.encode_s,
                payload_nbytes={b: p.nbytes for b, p in run.payloads.items()},
            )
        )
        return results

    def _current(self) -> _PushRun:
        run = self._run
        assert run is not None, "a push effect outside DeltaSender.push"
        return run

    @handles(fx.ReadBase)
    def read_base(self, effect: fx.ReadBase) -> fx.Outcome[fx.BaseFacts]:
        target = self._current().targets[effect.target]
        return fx.Ok(
            fx.BaseFacts(
                self.ledger.base(effect.target),
                frozenset(self.held),
                self.settings.enabled,
                target.applies_deltas,
            )
        )

    @handles(fx.KeepSnapshot)
    def keep(self, effect: fx.KeepSnapshot) -> fx.Outcome[None]:
        """Copy the version being pushed as a possible base (one copy per version)."""
        import torch

        with self._lock:
            if effect.version in self._snapshots:
                return fx.DONE
        with torch.no_grad():
            copy = [(n, t.detach().clone()) for n, t in self._current().items]
        with self._lock:
            self._snapshots[effect.version] = copy
        return fx.DONE

    @handles(fx.EncodeDelta)
    def encode(self, effect: fx.EncodeDelta) -> fx.Outcome[fx.Encoded]:
        """One encoding per base (with the touched base tensors' digests when a target checks
        its base by content)."""
        from rollsafe.wire.delta import DENSE_FRACTION, encode_delta

        run = self._current()
        with self._lock:
            base_items = self._snapshots[effect.base]
        try:
            payload = encode_delta(
                base_items,
                run.items,
                base_version=effect.base,
                version=effect.version,
                dense_fraction=self.settings.dense_fraction or DENSE_FRACTION,
                base_digests=any(run.targets[t].delta_base_by_content for t in effect.targets),
            )
        except Exception as exc:  # e.g. the version's names or shapes differ from the base's
            why = bound_text(f"{type(exc).__name__}: {exc}", 512)
            log.warning("delta from v%d not encoded: %s; sending full", effect.base, why)
            return fx.Failed(why)
        run.encode_s += payload.encode_s
        if run.changed_fraction is None and payload.total_elements:
            run.changed_fraction = payload.changed_elements / payload.total_elements
        if payload.worthwhile:
            run.payloads[effect.base] = payload
        return fx.Ok(fx.Encoded(payload.nbytes, payload.full_nbytes, payload.worthwhile))

    @handles(fx.PushTargets)
    def push_targets(self, effect: fx.PushTargets) -> fx.Outcome[Mapping[str, fx.Delivered]]:
        """The transport stages the payload (a base's delta, or the version itself) and pushes
        it to the targets in one update; an update that raised fails every target, and a
        delta that could not even be staged counts as refused (nothing was sent)."""
        run = self._current()
        group = [run.targets[name] for name in effect.targets]
        base = effect.base
        tensors = run.items if base is None else run.payloads[base].tensors
        try:
            results = run.send(group, base, tensors)
        except StagingFailed as exc:
            why = bound_text(f"staging the delta from v{base} failed: {exc}", 512)
            log.warning("delta: %s", why)
            return fx.Ok({t.name: fx.Delivered(False, why, refused=True) for t in group})
        except Exception as exc:  # a collective set-up failure: every target failed
            why = bound_text(f"{type(exc).__name__}: {exc}", 2048)
            return fx.Ok({t.name: fx.Delivered(False, why) for t in group})
        delivered: dict[str, fx.Delivered] = {}
        for t in group:
            res = results.get(t.name)
            if res is None:
                delivered[t.name] = fx.Delivered(False, "the update raised before this target")
                continue
            refused = base is not None and not res.ok and is_delta_refusal(res.reason)
            delivered[t.name] = fx.Delivered(res.ok, res.reason, refused, res.nbytes, res.seconds)
        return fx.Ok(delivered)

    # ------------------------------------------------------------------ the rest
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


class StagingFailed(RollsafeError, RuntimeError):
    """Raised by a transport's ``send`` when a delta payload could not be staged (nothing was
    pushed): the push treats it as a refusal and sends those targets full."""


#: ``send(targets, base, tensors)``: stage ``tensors`` (the delta from ``base``, or the version
#: itself when ``base`` is None) and push them to ``targets`` in one update; the results by
#: target name (raise :class:`StagingFailed` when the payload could not be staged)
SendStaged = Callable[
    [list["EngineTarget"], "int | None", "Sequence[tuple[str, torch.Tensor]]"],
    "Mapping[str, TargetResult]",
]


class _PushRun:
    """One push's working set: the targets by name, the version and its tensors, the
    transport's ``send``, and what the encodings cost."""

    def __init__(
        self,
        targets: dict[str, EngineTarget],
        version: int,
        items: list[tuple[str, torch.Tensor]],
        send: SendStaged,
    ) -> None:
        self.targets = targets
        self.version = version
        self.items = items
        self.send = send
        self.payloads: dict[int, DeltaPayload] = {}
        self.encode_s = 0.0
        self.changed_fraction: float | None = None
