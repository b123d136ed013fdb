"""Exhaustive breadth-first exploration of the composed fleet model (``rollsafe verify``).

Starting from a fresh :class:`~rollsafe.verify.model.FleetModel`, every enabled action is tried
from every reached state, up to a depth bound; states are deduplicated by the model's canonical
form (up to group and rank symmetry), and every invariant is checked in every reached state. The
model is restored to a state only after an action that changed it. Breadth-first order makes the
first counterexample found a shortest one, reported as the event trace that leads to it.

One algorithm, two executors: a level's states are *expanded* (:func:`_expand`: every action
from one state, the states it reaches that the expander has not seen, their invariants) either in
this process or by ``workers`` fresh (spawned) processes, each with its own model, chunk by
chunk; the expansions are then *merged* here in frontier order, so the states, the parents and the
first counterexample are the same whatever the number of workers.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollsafe.verify.model import Action, FleetModel, ModelConfig, Violation

__all__ = ["Counterexample", "ExplorationResult", "default_workers", "explore"]

# A level is split into chunks of at most this many states for the workers (small enough that
# both cores stay busy to the level's end, large enough that pickling is a small share).
_CHUNK = 128
# Levels smaller than this are expanded here: handing work out costs more than it saves.
_INLINE_BELOW = 64


@dataclass(frozen=True)
class Counterexample:
    """A shortest action trace from the initial state to a state breaking an invariant."""

    trace: tuple[Action, ...]
    violations: tuple[Violation, ...]

    def format(self) -> str:
        steps = "\n".join(f"  {i + 1:>2}. {a}" for i, a in enumerate(self.trace)) or "  (initial)"
        broken = "\n".join(f"  - {v}" for v in self.violations)
        return f"trace ({len(self.trace)} steps):\n{steps}\nviolated:\n{broken}"


@dataclass
class ExplorationResult:
    """What one exploration saw."""

    config: ModelConfig
    depth: int
    states: int = 0
    transitions: int = 0
    refused: int = 0
    frontier_sizes: list[int] = field(default_factory=list)
    seconds: float = 0.0
    # CPU time of this process and its workers (wall time also counts other processes' load)
    cpu_seconds: float = 0.0
    workers: int = 1
    counterexamples: list[Counterexample] = field(default_factory=list)
    complete: bool = True

    @property
    def ok(self) -> bool:
        return not self.counterexamples

    def summary(self) -> str:
        verdict = "no violations" if self.ok else f"{len(self.counterexamples)} violation(s)"
        return (
            f"explored {self.states} states, {self.transitions} transitions"
            f" ({self.refused} refused events) to depth {self.depth}"
            f" with {self.config.groups} groups x {self.config.ranks} ranks"
            f" in {self.seconds:.1f} s: {verdict}"
        )


@dataclass(frozen=True)
class _Reached:
    """One transition of an expansion: a state new to its expander (``after``, its canonical
    ``key`` and the invariants it breaks), or a refused action that changed the model
    (``after`` None, the violation saying so)."""

    action: Action
    after: Any
    key: Any
    violations: tuple[Violation, ...]


@dataclass(frozen=True)
class _Expansion:
    """Every action tried from one state: how many, how many were refused, what they reached."""

    transitions: int
    refused: int
    reached: tuple[_Reached, ...]


def _expand(model: FleetModel, snap: Any, seen: set[Any]) -> _Expansion:
    """Try every enabled action from ``snap``; report what is new to ``seen`` (and add it).

    ``seen`` is the expander's own: a state it skips it has reported before, from an earlier
    state of the frontier's order, so the merge's first occurrence is always among the reports.
    """
    model.restore(snap)
    dirty = False  # restore only after an action that changed the model
    transitions = refused = 0
    reached: list[_Reached] = []
    for action in list(model.enabled_actions()):
        if dirty:
            model.restore(snap)
        changed = model.apply(action)
        transitions += 1
        dirty = True
        if not changed:
            refused += 1
            dirty = model.snapshot() != snap
            if dirty:
                why = Violation("refused_action_changes_nothing", f"{action} changed the model")
                reached.append(_Reached(action, None, None, (why,)))
            continue
        after = model.snapshot()
        key = model.canonical(after)
        if key in seen:
            continue
        seen.add(key)
        reached.append(_Reached(action, after, key, tuple(model.check())))
    return _Expansion(transitions, refused, tuple(reached))


# -- the workers: each holds one model and the states it has reported
_WORKER: tuple[FleetModel, set[Any]] | None = None


def _start_worker(factory: Callable[[ModelConfig], FleetModel], config: ModelConfig) -> None:
    global _WORKER
    _WORKER = (factory(config), set())


def _expand_chunk(chunk: Sequence[Any]) -> list[_Expansion]:
    assert _WORKER is not None, "a worker expands only after _start_worker"
    model, seen = _WORKER
    return [_expand(model, snap, seen) for snap in chunk]


def default_workers() -> int:
    """Worker processes ``rollsafe verify`` uses unless told: the cores this process may run on,
    at most 8 (past that the merge here is the bound)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


def explore(
    config: ModelConfig | None = None,
    depth: int = 8,
    *,
    model_factory: Callable[[ModelConfig], FleetModel] | None = None,
    stop_at_first: bool = True,
    max_states: int | None = None,
    progress: Callable[[int, int, int], None] | None = None,
    workers: int = 1,
) -> ExplorationResult:
    """Explore every interleaving of the model's actions up to ``depth``.

    ``model_factory`` builds the model (tests pass one with planted bugs). ``progress`` is called
    after each level with (level, states so far, frontier size). ``workers`` > 1 expands large
    levels in that many spawned processes, each building its model with ``model_factory``
    (which must then pickle: a class, a module-level function or a ``functools.partial`` of
    them; a patch made in this process after import is not seen there); the result is the same
    as with one.
    """
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    cfg = config or ModelConfig()
    factory: Callable[[ModelConfig], FleetModel] = model_factory or FleetModel
    model = factory(cfg)
    result = ExplorationResult(config=cfg, depth=depth, workers=workers)
    started = time.perf_counter()
    cpu_started = time.process_time()
    children_started = _children_cpu()

    initial = model.snapshot()
    # Deduplicate on the canonical form (group/rank symmetry); keep real snapshots to restore.
    seen: set[Any] = {model.canonical(initial)}
    local: set[Any] = set(seen)  # what the in-process expander has reported
    parents: dict[Any, tuple[Any, Action] | None] = {initial: None}
    bad = model.check()
    if bad:
        result.counterexamples.append(Counterexample((), tuple(bad)))
    frontier = [initial]
    result.frontier_sizes.append(1)
    pool = None
    try:
        for level in range(depth):
            if result.counterexamples and stop_at_first:
                break
            if workers > 1 and len(frontier) >= _INLINE_BELOW and pool is None:
                context = multiprocessing.get_context("spawn")  # safe beside threads
                pool = context.Pool(workers, _start_worker, (factory, cfg))
            expansions: Iterator[_Expansion]
            if pool is not None:
                size = max(1, min(_CHUNK, len(frontier) // (workers * 4)))
                chunks = [frontier[i : i + size] for i in range(0, len(frontier), size)]
                expansions = (e for part in pool.imap(_expand_chunk, chunks) for e in part)
            else:
                expansions = (_expand(model, snap, local) for snap in frontier)
            frontier = _merge(
                frontier, expansions, seen, parents, result, stop_at_first, max_states
            )
            result.frontier_sizes.append(len(frontier))
            if progress is not None:
                progress(level + 1, len(seen), len(frontier))
            if not frontier or not result.complete:
                break
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    result.states = len(seen)
    result.seconds = time.perf_counter() - started
    result.cpu_seconds = time.process_time() - cpu_started + _children_cpu() - children_started
    return result


def _merge(
    frontier: Sequence[Any],
    expansions: Iterator[_Expansion],
    seen: set[Any],
    parents: dict[Any, tuple[Any, Action] | None],
    result: ExplorationResult,
    stop_at_first: bool,
    max_states: int | None,
) -> list[Any]:
    """Take one level's expansions in frontier order; return the next frontier."""
    next_frontier: list[Any] = []
    for snap, expansion in zip(frontier, expansions, strict=False):
        result.transitions += expansion.transitions
        result.refused += expansion.refused
        for step in expansion.reached:
            if step.after is None:  # a refused action changed the model
                trace = (*_trace(parents, snap), step.action)
                result.counterexamples.append(Counterexample(trace, step.violations))
                continue
            if step.key in seen:
                continue
            seen.add(step.key)
            parents[step.after] = (snap, step.action)
            if step.violations:
                trace = _trace(parents, step.after)
                result.counterexamples.append(Counterexample(trace, step.violations))
                if stop_at_first:
                    break
            next_frontier.append(step.after)
            if max_states is not None and len(seen) >= max_states:
                result.complete = False
                break
        if (result.counterexamples and stop_at_first) or not result.complete:
            break
    return next_frontier


def _children_cpu() -> float:
    """CPU seconds of this process's finished children (the workers, once joined)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _trace(parents: dict[Any, tuple[Any, Action] | None], snap: Any) -> tuple[Action, ...]:
    steps: list[Action] = []
    link = parents[snap]
    while link is not None:
        prev, action = link
        steps.append(action)
        link = parents[prev]
    return tuple(reversed(steps))
