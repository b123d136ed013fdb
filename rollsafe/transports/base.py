"""The two-phase weight-transport contract and the machine-driving part every transport shares.

``register(weights, version)`` stages a version (checkpoint-engine: pinned host shards; ipc/nccl:
the source tensors, bucketing plan and version); ``update(targets)`` pushes the registered
version to the given engine groups and returns a per-target :class:`UpdateReport`. The two
phases can run at different times (register, offload trainer, onload engines, update).

Registration state is a :class:`~rollsafe.statemachines.CheckpointRegistration` in every
transport: :class:`StagedTransport` sends ``begin_register`` / ``register_ok`` or
``register_failed`` around the subclass's ``_stage``, and ``begin_update`` / ``update_done``
around its ``_push``; a failed register publishes nothing and an update can only target the
published version. Subclasses implement only the data movement.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

# the contract types cross layers (the fleet holds them, every transport implements them): they
# live in the torch- and httpx-free rollsafe.ports (their one import path)
from rollsafe.errors import InvalidArgument, RollsafeError
from rollsafe.ports import (
    EngineTarget,
    NamedTensors,
    PushSummary,
    TargetResult,
    UpdateReport,
)
from rollsafe.statemachines import CheckpointRegistration
from rollsafe.text import bound_text

if TYPE_CHECKING:
    import torch

    from rollsafe.transports.delta import DeltaRecord, DeltaSender, DeltaSettings

__all__ = [
    "NonFiniteWeights",
    "RegisterError",
    "StagedTransport",
    "TransportError",
    "named_tensor_list",
]

log = logging.getLogger(__name__)


class TransportError(RollsafeError, RuntimeError):
    """A transport could not do what was asked (the message names the target/key/rank)."""


class RegisterError(TransportError):
    """Staging a version failed; nothing was published."""


def named_tensor_list(weights: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    """Normalize a mapping or pairs into a list, refusing duplicate names and non-tensors."""
    import torch

    items = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
    seen: set[str] = set()
    for name, tensor in items:
        if not isinstance(name, str) or not name:
            raise RegisterError(f"weight names must be non-empty strings, got {name!r}")
        if name in seen:
            raise RegisterError(f"duplicate weight name {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise RegisterError(f"weight {name!r} is a {type(tensor).__name__}, not a tensor")
        seen.add(name)
    if not items:
        raise RegisterError("no weights to register")
    return items


class NonFiniteWeights(RegisterError):
    """A weight of the version holds NaN or inf (the sender's finite check, ``ipc`` and
    ``nccl``): nothing of it is registered or pushed. ``key`` names the first such weight."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


class StaleRegistration(TransportError):
    """The registered tensors changed in place after ``register`` (e.g. an optimizer step) and
    the transport reads them when it pushes: pushing now would label new weights with the
    registered version. Register the new version first."""


def check_update_targets(
    name: str, reg: CheckpointRegistration, targets: Sequence[EngineTarget]
) -> tuple[str, int]:
    """What every ``update`` checks first: a published (name, version) to push, and targets with
    distinct names. Returns the published pair; raises :class:`TransportError` naming the
    problem (nothing changes)."""
    published = reg.published
    if published is None:
        raise TransportError(f"{name}: nothing is registered (state {reg.state!r}); register first")
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        raise TransportError(f"{name}: duplicate target names {names}")
    return published


class StagedTransport:
    """Base class: drives the CheckpointRegistration machine around ``_stage`` and ``_push``.

    Subclasses set ``name`` and implement :meth:`_stage` (may raise; nothing is published) and
    :meth:`_push` (one target; raise or return to report failure), and may override
    :meth:`_before_push` / :meth:`_after_push` for collective set-up around a whole update.
    ``max_parallel_targets`` bounds concurrent pushes.

    Transports that keep references to the registered tensors instead of copies
    (``reads_by_reference``: ``ipc``, ``nccl``) record, at ``register``, each tensor's in-place
    version counter and a fingerprint: the bytes of :data:`FINGERPRINT_ELEMENTS` elements
    spread evenly over it. ``update`` refuses with :class:`StaleRegistration`, naming the first
    changed tensor, when either moved since (a targeted push after the trainer's next
    optimizer step must not send those weights as the registered version). The counter alone
    misses writes that bypass autograd's bookkeeping: a fused optimizer (``AdamW(fused=True)``,
    TRL's default ``adamw_torch_fused``) and writes through ``.data`` leave it unchanged; such a
    step moves nearly every element, so the fingerprint sees it. A write that touches none of
    the sampled elements (a few embedding rows) is not seen: register a copy for those
    (``snapshot_weights``, docs/transports.md).
    """

    name = "staged"
    reads_by_reference = False
    #: whether the transport moves named tensors it can replace by a delta payload (ipc, nccl)
    supports_delta = False

    def __init__(
        self,
        world_size: int,
        *,
        allow_missing_prefixes: Iterable[str] = ("mtp.",),
        max_parallel_targets: int = 8,
        delta: DeltaSettings | None = None,
    ) -> None:
        self.registration = CheckpointRegistration(
            world_size, allow_missing_prefixes=allow_missing_prefixes
        )
        self.max_parallel_targets = max_parallel_targets
        self.version: int | None = None
        self.keys: tuple[str, ...] = ()
        self._watched: list[_Watched] = []
        self._prints: _Fingerprints | None = None
        self._delta: DeltaSender | None = None
        if delta is not None:
            if not self.supports_delta:
                raise InvalidArgument(
                    "delta",
                    f"{self.name} cannot push deltas (only the tensor transports ipc and nccl "
                    "can); leave delta=None",
                )
            from rollsafe.transports.delta import DeltaSender

            self._delta = DeltaSender(delta)
        # with deltas on: the registered (name, tensor) pairs, and which payload is staged now
        # (None: the registered version itself; an int: the delta from that base)
        self._registered: list[tuple[str, torch.Tensor]] = []
        self._staged_base: int | None = None

    # ------------------------------------------------------------------ register
    def register(self, weights: NamedTensors, version: int, *, name: str | None = None) -> None:
        items = named_tensor_list(weights)
        ckpt = name or f"{self.name}-v{version}"
        reg = self.registration
        reg.begin_register(name=ckpt, version=version)
        try:
            ranks_ok, registered = self._stage(items, version)
        except Exception as exc:
            reg.register_failed(reason=bound_text(f"{type(exc).__name__}: {exc}"))
            self.version, self.keys = None, ()
            if isinstance(exc, RegisterError):
                raise
            raise RegisterError(f"{self.name}: staging v{version} failed: {exc}") from exc
        expected = [n for n, _ in items]
        refused = reg.finish_register(
            ranks_ok=ranks_ok, expected_keys=expected, registered_keys=registered
        )
        if refused is not None:
            self.version, self.keys = None, ()
            self._unstage()
            raise RegisterError(f"{self.name}: v{version} not published: {refused}")
        self.version, self.keys = version, tuple(expected)
        self._registered = items if self._delta is not None else []
        self._staged_base = None
        self._watched = [_watch(n, t) for n, t in items] if self.reads_by_reference else []
        self._prints = _Fingerprints(items) if self.reads_by_reference else None

    def _stage(
        self, items: list[tuple[str, torch.Tensor]], version: int
    ) -> tuple[Sequence[int], Sequence[str]]:
        """Stage the tensors; return (ranks that succeeded, keys actually registered)."""
        raise NotImplementedError

    def _unstage(self) -> None:
        """Drop whatever a refused register staged (default: nothing)."""

    # ------------------------------------------------------------------ update
    def update(self, targets: Sequence[EngineTarget]) -> UpdateReport:
        """Push the registered version to ``targets`` (with deltas on: a delta to each target
        that confirmed a base the sender holds, a full push to the others; see
        :mod:`rollsafe.transports.delta`)."""
        if self._delta is None:
            return self._update(targets)
        return self._delta_update(targets, force_full=False)

    def _check_stale(self, published: tuple[str, int]) -> None:
        key = _first_moved(self._watched, self._prints)
        if key is not None:
            raise StaleRegistration(
                f"{self.name}: registered weight {key!r} changed in place since "
                f"v{published[1]} was registered (an optimizer step?); this transport "
                "reads the registered tensors when it pushes: register the new version first"
            )

    def _update(self, targets: Sequence[EngineTarget]) -> UpdateReport:
        """One push of what is staged now (the registered version, or one delta payload) to
        ``targets``, recorded by the registration machine."""
        reg = self.registration
        published = check_update_targets(self.name, reg, targets)
        self._check_stale(published)
        self._before_begin_update(targets)
        reg.begin_update(targets=[list(t.ranks) for t in targets])
        report = UpdateReport(name=published[0], version=published[1])
        started = time.perf_counter()
        rank_results: dict[int, tuple[bool, str]] = {}
        try:
            self._before_push(targets)
            if len(targets) == 1 or self.max_parallel_targets == 1:
                outcomes = [self._push_one(t) for t in targets]
            else:
                workers = min(self.max_parallel_targets, len(targets))
                with ThreadPoolExecutor(workers, thread_name_prefix=f"{self.name}-push") as pool:
                    outcomes = list(pool.map(self._push_one, targets))
            for result in outcomes:
                report.results[result.target] = result
        except Exception as exc:  # a collective set-up failure fails every target
            reason = bound_text(f"{type(exc).__name__}: {exc}")
            for t in targets:
                report.results.setdefault(t.name, TargetResult(t.name, False, reason))
        finally:
            try:
                self._after_push(targets)
            finally:
                for t in targets:
                    res = report.results[t.name]
                    for rank in t.ranks:
                        rank_results[rank] = (res.ok, res.reason)
                reg.update_done(results=rank_results)
        report.seconds = time.perf_counter() - started
        return report

    def targeted_update(self, targets: Sequence[EngineTarget]) -> UpdateReport:
        """A recovery's push to ``targets`` only: :meth:`update`, which pushes to each target on
        its own and so never reaches an engine outside ``targets``. With deltas on, always a
        full push, and each target's base is forgotten first (a recovered engine's weights are
        known only once it confirms this push)."""
        if self._delta is None:
            return self.update(targets)
        return self._delta_update(targets, force_full=True)

    # ------------------------------------------------------------------ deltas
    def _delta_update(self, targets: Sequence[EngineTarget], *, force_full: bool) -> UpdateReport:
        """The update with deltas on: :func:`rollsafe.operations.push.push`, executed by the
        transport's :class:`~rollsafe.transports.delta.DeltaSender`, each payload staged here
        and pushed by :meth:`_update` (the registration machine records every one)."""
        sender = self._delta
        assert sender is not None
        published = check_update_targets(self.name, self.registration, targets)
        self._check_stale(published)
        version = published[1]
        report = UpdateReport(name=published[0], version=version)
        started = time.perf_counter()

        def send(
            group: list[EngineTarget], base: int | None, tensors: Sequence[tuple[str, torch.Tensor]]
        ) -> dict[str, TargetResult]:
            from rollsafe.transports.delta import StagingFailed

            try:
                self._restage(tensors, version, base)
            except Exception as exc:  # nothing was pushed: the push sends them full
                if base is None:
                    raise
                raise StagingFailed(f"{type(exc).__name__}: {exc}") from exc
            return self._update(group).results

        report.results = sender.push(
            targets, version, self._registered, send, force_full=force_full
        )
        report.seconds = time.perf_counter() - started
        return report

    def _restage(
        self, items: Sequence[tuple[str, torch.Tensor]], version: int, base: int | None
    ) -> None:
        """Stage ``items`` for the next push (a delta payload from ``base``, or the registered
        version when ``base`` is None) without touching the registration machine: the
        published version is the same, only its encoding differs."""
        if base is None and self._staged_base is None:
            return
        self._stage(list(items), version)
        self._staged_base = base

    @property
    def deltas(self) -> DeltaSender | None:
        """The transport's delta sync (its :class:`~rollsafe.transports.delta.DeltaSender`:
        ``stats()``, ``last()``, ``records``); None when deltas are off."""
        return self._delta

    def delta_records(self) -> tuple[DeltaRecord, ...]:
        """The last updates' per-target deltas, oldest first (at most 64; empty: deltas off)."""
        return () if self._delta is None else tuple(self._delta.records)

    def forget(self, target_name: str) -> None:
        """The target left service: its delta base is forgotten (its next push is full)."""
        if self._delta is not None:
            self._delta.reset(target_name)

    def last_push(self) -> PushSummary | None:
        """None: a staged transport keeps no push record (its :class:`UpdateReport` says it all)."""
        return None

    def _push_one(self, target: EngineTarget) -> TargetResult:
        t0 = time.perf_counter()
        try:
            nbytes = self._push(target)
        except Exception as exc:
            return TargetResult(
                target.name,
                False,
                bound_text(f"{type(exc).__name__}: {exc}"),
                time.perf_counter() - t0,
            )
        return TargetResult(target.name, True, "", time.perf_counter() - t0, int(nbytes or 0))

    def _before_begin_update(self, targets: Sequence[EngineTarget]) -> None:
        """Checks of the registered data that refuse the whole update before the machine records
        it (raise; default: none). Runs after the staleness check."""

    def _before_push(self, targets: Sequence[EngineTarget]) -> None:
        """Set-up shared by all targets of one update (e.g. a process group)."""

    def _push(self, target: EngineTarget) -> int:
        """Push the registered version to one target; return the bytes moved."""
        raise NotImplementedError

    def _after_push(self, targets: Sequence[EngineTarget]) -> None:
        """Tear-down after one update, run even when pushes failed."""

    def close(self) -> None:
        """Release staged state. Subclasses extend."""
        if self._delta is not None:
            self._delta = type(self._delta)(self._delta.settings)  # snapshots freed
        self._registered, self._staged_base = [], None
        self.version, self.keys = None, ()
        self._watched = []
        self._prints = None

    def __enter__(self) -> StagedTransport:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


#: elements of each registered tensor whose bytes make its fingerprint (``StagedTransport``)
FINGERPRINT_ELEMENTS = 16


@dataclass(frozen=True)
class _Watched:
    """One registered tensor a by-reference transport reads again at ``update``: its version
    counter (None for inference tensors) at ``register``."""

    name: str
    tensor: torch.Tensor
    version: int | None


def _watch(name: str, t: torch.Tensor) -> _Watched:
    return _Watched(name, t, _version_of(t))


def _first_moved(watched: Sequence[_Watched], prints: _Fingerprints | None) -> str | None:
    """The first registered tensor (in registration order) whose version counter or fingerprint
    moved since ``register``, or None."""
    moved = {
        w.name for w in watched if w.version is not None and _version_of(w.tensor) != w.version
    }
    if prints is not None:
        moved.update(prints.changed())
    return next((w.name for w in watched if w.name in moved), None)


class _Fingerprints:
    """The raw bytes of up to :data:`FINGERPRINT_ELEMENTS` elements spread evenly over each
    registered tensor (bytes, so NaNs compare equal to themselves), taken at ``register`` and
    compared at ``update`` in a few batched kernels: one gather per storage (a flat parameter
    buffer is one storage) and one comparison per device, so an ``update`` of hundreds of
    tensors costs one host sync, not one per tensor."""

    def __init__(self, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        import torch  # the transports that watch tensors already run with torch loaded

        # (device, storage pointer, dtype) -> (1-D view of the storage, [(name, offsets)])
        groups: dict[tuple[Any, int, Any], tuple[torch.Tensor, list[tuple[str, list[int]]]]] = {}
        for name, t in items:
            t = t.detach()
            if t.numel() == 0 or t.is_meta:
                continue
            storage = t.untyped_storage()
            key = (t.device, storage.data_ptr(), t.dtype)
            if key not in groups:
                whole = storage.nbytes() // t.element_size()
                groups[key] = (t.as_strided((whole,), (1,), 0), [])
            groups[key][1].append((name, _sample_offsets(t)))
        self._gathers: list[tuple[torch.Tensor, torch.Tensor, list[tuple[str, int]]]] = []
        for base, members in groups.values():
            flat = [o for _, offsets in members for o in offsets]
            index = torch.tensor(flat, dtype=torch.long, device=base.device)
            self._gathers.append((base, index, [(n, len(o)) for n, o in members]))
        self._taken = self._take()

    def _take(self) -> list[torch.Tensor]:
        import torch

        with torch.no_grad():
            return [base[index].view(torch.uint8) for base, index, _ in self._gathers]

    def changed(self) -> list[str]:
        """Names of the tensors whose sampled bytes differ from ``register``'s."""
        import torch

        now = self._take()
        if not now:
            return []
        by_device: dict[Any, list[int]] = {}
        for i, t in enumerate(now):
            by_device.setdefault(t.device, []).append(i)
        out: list[str] = []
        for idx in by_device.values():
            a = torch.cat([now[i] for i in idx])
            b = torch.cat([self._taken[i] for i in idx])
            if torch.equal(a, b):  # the one host sync of this device
                continue
            for i in idx:
                _, _, members = self._gathers[i]
                itemsize = self._gathers[i][0].element_size()
                same = (now[i] == self._taken[i]).view(-1, itemsize).all(dim=1).cpu().tolist()
                pos = 0
                for name, count in members:
                    if not all(same[pos : pos + count]):
                        out.append(name)
                    pos += count
        return out


def _sample_offsets(t: torch.Tensor) -> list[int]:
    """Storage offsets (in elements) of up to :data:`FINGERPRINT_ELEMENTS` elements of ``t``
    spread evenly over its logical order (the first and the last included)."""
    n = t.numel()
    m = min(n, FINGERPRINT_ELEMENTS)
    linear = [round(k * (n - 1) / (m - 1)) for k in range(m)] if m > 1 else [0]
    shape = [int(x) for x in t.shape]
    stride = [int(x) for x in t.stride()]
    base = int(t.storage_offset())
    out: list[int] = []
    for li in linear:
        off = base
        for size, st in zip(reversed(shape), reversed(stride), strict=True):
            off += (li % size) * st
            li //= size
        out.append(off)
    return out


def _version_of(t: torch.Tensor) -> int | None:
    """The tensor's in-place version counter (None for inference tensors, which keep none)."""
    try:
        return int(t._version)
    except RuntimeError:
        return None
