"""One changed step in an operation: a wrapper that rewrites what a step sequence yields.

``tests/test_operations_{sync,recover,probe}.py`` each change one step of an operation and show
that ``rollsafe verify`` (and the fleet) then behave differently; this is the one driving loop
they share."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any

from rollsafe.operations import effects as fx

#: what a rewrite returns for one yielded effect: the effects to perform in its place (the
#: outcome of the last is sent back to the sequence), or an outcome to answer without
#: performing anything
Rewrite = Callable[[fx.Effect], "Sequence[fx.Effect] | fx.Outcome"]


def rewritten(
    original: Callable[..., Generator[fx.Effect, fx.Outcome, Any]], rewrite: Rewrite
) -> Callable[..., Generator[fx.Effect, fx.Outcome, Any]]:
    """``original`` with every effect it yields passed through ``rewrite``."""

    def changed(*args: Any, **kw: Any) -> Generator[fx.Effect, fx.Outcome, Any]:
        steps = original(*args, **kw)
        outcome: fx.Outcome | None = None
        started = False
        while True:
            try:
                effect = steps.send(outcome) if started else next(steps)
            except StopIteration as stop:
                return stop.value
            started = True
            done = rewrite(effect)
            if isinstance(done, (fx.Ok, fx.Failed, fx.TimedOut)):
                outcome = done
                continue
            for step in done:
                outcome = yield step

    return changed
