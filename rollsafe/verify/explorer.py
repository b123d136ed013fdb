"""Exhaustive breadth-first exploration of the composed fleet model (``rollsafe verify``).

Starting from a fresh :class:`~rollsafe.verify.model.FleetModel`, every enabled action is tried
from every reached state, up to a depth bound; states are deduplicated by the model's canonical
form (up to group and rank symmetry), and every invariant is checked in every reached state. The
model is restored to a state only after an action that changed it. Breadth-first order makes the
first counterexample found a shortest one, reported as the event trace that leads to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollsafe.verify.model import Action, FleetModel, ModelConfig, Violation

__all__ = ["Counterexample", "ExplorationResult", "explore"]


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
    cpu_seconds: float = 0.0  # process CPU time (wall time also counts other processes' load)
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


def explore(
    config: ModelConfig | None = None,
    depth: int = 8,
    *,
    model_factory: Callable[[ModelConfig], FleetModel] | None = None,
    stop_at_first: bool = True,
    max_states: int | None = None,
    progress: Callable[[int, int, int], None] | None = None,
) -> ExplorationResult:
    """Explore every interleaving of the model's actions up to ``depth``.

    ``model_factory`` builds the model (tests pass one with planted bugs). ``progress`` is called
    after each level with (level, states so far, frontier size).
    """
    cfg = config or ModelConfig()
    model = model_factory(cfg) if model_factory is not None else FleetModel(cfg)
    result = ExplorationResult(config=cfg, depth=depth)
    started = time.perf_counter()
    cpu_started = time.process_time()

    initial = model.snapshot()
    # Deduplicate on the canonical form (group/rank symmetry); keep real snapshots to restore.
    seen: set[Any] = {model.canonical(initial)}
    parents: dict[Any, tuple[Any, Action] | None] = {initial: None}
    bad = model.check()
    if bad:
        result.counterexamples.append(Counterexample((), tuple(bad)))
    frontier = [initial]
    result.frontier_sizes.append(1)
    for level in range(depth):
        if result.counterexamples and stop_at_first:
            break
        next_frontier: list[Any] = []
        for snap in frontier:
            model.restore(snap)
            dirty = False  # restore only after an action that changed the model
            for action in list(model.enabled_actions()):
                if dirty:
                    model.restore(snap)
                changed = model.apply(action)
                result.transitions += 1
                dirty = True
                if not changed:
                    result.refused += 1
                    after = model.snapshot()
                    dirty = after != snap
                    if dirty:
                        result.counterexamples.append(
                            Counterexample(
                                (*_trace(parents, snap), action),
                                (
                                    Violation(
                                        "refused_action_changes_nothing",
                                        f"{action} changed the model",
                                    ),
                                ),
                            )
                        )
                    continue
                after = model.snapshot()
                key = model.canonical(after)
                if key in seen:
                    continue
                seen.add(key)
                parents[after] = (snap, action)
                violations = model.check()
                if violations:
                    result.counterexamples.append(
                        Counterexample(_trace(parents, after), tuple(violations))
                    )
                    if stop_at_first:
                        break
                next_frontier.append(after)
                if max_states is not None and len(seen) >= max_states:
                    result.complete = False
                    break
            if (result.counterexamples and stop_at_first) or not result.complete:
                break
        frontier = next_frontier
        result.frontier_sizes.append(len(frontier))
        if progress is not None:
            progress(level + 1, len(seen), len(frontier))
        if not frontier or not result.complete:
            break
    result.states = len(seen)
    result.seconds = time.perf_counter() - started
    result.cpu_seconds = time.process_time() - cpu_started
    return result


def _trace(parents: dict[Any, tuple[Any, Action] | None], snap: Any) -> tuple[Action, ...]:
    steps: list[Action] = []
    link = parents[snap]
    while link is not None:
        prev, action = link
        steps.append(action)
        link = parents[prev]
    return tuple(reversed(steps))
