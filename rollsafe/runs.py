"""Runs of neighbouring items merged into one, one definition.

Owns :func:`merge_runs`. The stream deltas an engine client read together
(:func:`rollsafe.adapters.engines.streaming.coalesce_deltas`) and the token chunks of a whole
answer (:func:`rollsafe.gateway.output.merged`) are merged this way, each with its own rule of
which neighbours belong to one run and of how a run becomes one item. Imports nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

__all__ = ["merge_runs"]

T = TypeVar("T")


def merge_runs(
    items: Sequence[T], joins: Callable[[T, T], bool], merge: Callable[[Sequence[T]], T]
) -> list[T]:
    """``items`` in order, each longest run of neighbours in which ``joins(previous, next)``
    holds replaced by ``merge(run)``; a run of one is kept as it is."""
    out: list[T] = []
    run: list[T] = []
    for item in items:
        if run and not joins(run[-1], item):
            out.append(run[0] if len(run) == 1 else merge(run))
            run = []
        run.append(item)
    if run:
        out.append(run[0] if len(run) == 1 else merge(run))
    return out
