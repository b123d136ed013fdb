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

import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

# the contract types cross layers (the fleet holds them, every transport implements them): they
# live in the torch- and httpx-free rollsafe.ports (their one import path)
from rollsafe.errors import RollsafeError
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

__all__ = [
    "NonFiniteWeights",
    "RegisterError",
    "StagedTransport",
    "TransportError",
    "named_tensor_list",
]

_MAX_REASON = 2048


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
    """A weight of the version holds NaN or inf (the sender's finite check, ``ipc``): nothing
    of it is registered or pushed. ``key`` names the first such weight."""

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

    def __init__(
        self,
        world_size: int,
        *,
        allow_missing_prefixes: Iterable[str] = ("mtp.",),
        max_parallel_targets: int = 8,
    ) -> None:
        self.registration = CheckpointRegistration(
            world_size, allow_missing_prefixes=allow_missing_prefixes
        )
        self.max_parallel_targets = max_parallel_targets
        self.version: int | None = None
        self.keys: tuple[str, ...] = ()
        self._watched: list[_Watched] = []

    # ------------------------------------------------------------------ register
    def register(self, weights: NamedTensors, version: int, *, name: str | None = None) -> None:
        items = named_tensor_list(weights)
        ckpt = name or f"{self.name}-v{version}"
        reg = self.registration
        reg.begin_register(name=ckpt, version=version)
        try:
            ranks_ok, registered = self._stage(items, version)
        except Exception as exc:
            reg.register_failed(reason=_bounded(f"{type(exc).__name__}: {exc}"))
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
        self._watched = [_watch(n, t) for n, t in items] if self.reads_by_reference else []

    def _stage(
        self, items: list[tuple[str, torch.Tensor]], version: int
    ) -> tuple[Sequence[int], Sequence[str]]:
        """Stage the tensors; return (ranks that succeeded, keys actually registered)."""
        raise NotImplementedError

    def _unstage(self) -> None:
        """Drop whatever a refused register staged (default: nothing)."""

    # ------------------------------------------------------------------ update
    def update(self, targets: Sequence[EngineTarget]) -> UpdateReport:
        reg = self.registration
        published = check_update_targets(self.name, reg, targets)
        for watched in self._watched:
            if watched.moved():
                key = watched.name
                raise StaleRegistration(
                    f"{self.name}: registered weight {key!r} changed in place since "
                    f"v{published[1]} was registered (an optimizer step?); this transport "
                    "reads the registered tensors when it pushes: register the new version first"
                )
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
            reason = _bounded(f"{type(exc).__name__}: {exc}")
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
        its own and so never reaches an engine outside ``targets``."""
        return self.update(targets)

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
                _bounded(f"{type(exc).__name__}: {exc}"),
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
        self.version, self.keys = None, ()
        self._watched = []

    def __enter__(self) -> StagedTransport:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


#: elements of each registered tensor whose bytes make its fingerprint (``StagedTransport``)
FINGERPRINT_ELEMENTS = 16


@dataclass(frozen=True)
class _Watched:
    """One registered tensor a by-reference transport reads again at ``update``: its version
    counter (None for inference tensors) and its fingerprint at ``register``."""

    name: str
    tensor: torch.Tensor
    version: int | None
    fingerprint: torch.Tensor | None

    def moved(self) -> bool:
        if self.version is not None and _version_of(self.tensor) != self.version:
            return True
        if self.fingerprint is None:
            return False
        now = _fingerprint(self.tensor)
        if now is None or now.shape != self.fingerprint.shape:
            return True
        return not bool((now == self.fingerprint).all())


def _watch(name: str, t: torch.Tensor) -> _Watched:
    return _Watched(name, t, _version_of(t), _fingerprint(t))


def _fingerprint(t: torch.Tensor) -> torch.Tensor | None:
    """The raw bytes of up to :data:`FINGERPRINT_ELEMENTS` elements spread evenly over ``t``
    (bytes, so NaNs compare equal to themselves); None for a tensor with no data to read."""
    import torch  # the transports that watch tensors already run with torch loaded

    n = t.numel()
    if n == 0 or t.is_meta:
        return None
    with torch.no_grad():
        t = t.detach()
        if t.dim() == 0:
            t = t.reshape(1)
        index = torch.linspace(0, n - 1, min(n, FINGERPRINT_ELEMENTS), device=t.device)
        where = torch.unravel_index(index.round().long(), t.shape)  # no copy of ``t``
        return t[where].contiguous().view(torch.uint8).clone()


def _version_of(t: torch.Tensor) -> int | None:
    """The tensor's in-place version counter (None for inference tensors, which keep none)."""
    try:
        return int(t._version)
    except RuntimeError:
        return None


def _bounded(text: str) -> str:
    return bound_text(text, _MAX_REASON)
