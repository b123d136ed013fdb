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
from typing import TYPE_CHECKING, Any

# the contract types cross layers (the fleet holds them, every transport implements them): they
# live in the torch- and httpx-free rollsafe.ports; every name stays importable from here
from rollsafe.errors import RollsafeError
from rollsafe.ports import (
    EngineTarget,
    NamedTensors,
    TargetResult,
    UpdateReport,
    WeightTransport,
)
from rollsafe.statemachines import CheckpointRegistration
from rollsafe.text import bound_text

if TYPE_CHECKING:
    import torch

__all__ = [
    "EngineTarget",
    "NamedTensors",
    "RegisterError",
    "StagedTransport",
    "TargetResult",
    "TransportError",
    "UpdateReport",
    "WeightTransport",
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
    (``reads_by_reference``: ``ipc``, ``nccl``) record each tensor's in-place version counter
    at ``register``; ``update`` refuses with :class:`StaleRegistration`, naming the first
    changed tensor, when one moved since (a targeted push after the trainer's next optimizer
    step must not send those weights as the registered version).
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
        self._watched: list[tuple[str, torch.Tensor, int]] = []

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
        self._watched = (
            [(n, t, v) for n, t in items if (v := _version_of(t)) is not None]
            if self.reads_by_reference
            else []
        )

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
        for key, tensor, version in self._watched:
            if _version_of(tensor) != version:
                raise StaleRegistration(
                    f"{self.name}: registered weight {key!r} changed in place since "
                    f"v{published[1]} was registered (an optimizer step?); this transport "
                    "reads the registered tensors when it pushes: register the new version first"
                )
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


def _version_of(t: torch.Tensor) -> int | None:
    """The tensor's in-place version counter (None for inference tensors, which keep none)."""
    try:
        return int(t._version)
    except RuntimeError:
        return None


def _bounded(text: str) -> str:
    return bound_text(text, _MAX_REASON)
