"""The demo's command line: its flags and the fixed choices of a run.

Owns :class:`DemoOptions` (the parsed flags, typed), :func:`add_arguments` (the flags of
``rollsafe demo``), :func:`options_problem` (flag values the demo refuses, exit status 2) and the
crash's fixed place: which group loses a rank and how far into its step's rollout.
"""

from __future__ import annotations

import argparse

__all__ = [
    "CRASH_DELAY_S",
    "CRASH_GROUP_INDEX",
    "DemoOptions",
    "add_arguments",
    "options_problem",
]

CRASH_GROUP_INDEX = 1  # the 2-rank group
CRASH_DELAY_S = 1.0  # into the crash step's rollout


class DemoOptions(argparse.Namespace):
    steps: int
    groups: int
    transport: str
    crash_at: int
    no_immediate_recovery: bool
    out: str
    rollout_s: float
    workers: int
    trainer: str
    quiet: bool
    warm_standby: bool
    max_new_tokens: int
    no_continuation: bool


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=4, help="training steps (default 4)")
    p.add_argument("--groups", type=int, default=3, help="engine groups, >= 2 (default 3)")
    p.add_argument("--transport", choices=("ipc", "nccl"), default="ipc")
    p.add_argument(
        "--crash-at", type=int, default=2, help="step whose rollout loses a rank (0: no crash)"
    )
    p.add_argument(
        "--no-immediate-recovery", action="store_true", help="deferred baseline for comparison"
    )
    p.add_argument("--out", default="demo-report", help="report directory (default demo-report)")
    p.add_argument("--rollout-s", type=float, default=8.0, help="rollout phase per step (s)")
    p.add_argument("--workers", type=int, default=2, help="rollout client threads")
    p.add_argument(
        "--trainer",
        choices=("actor", "inprocess"),
        default="actor",
        help="actor: a Ray trainer actor on a local Ray (default); inprocess: no Ray",
    )
    p.add_argument("--quiet", action="store_true", help="no live progress lines")
    p.add_argument(
        "--max-new-tokens", type=int, default=8, help="tokens per rollout request (default 8)"
    )
    p.add_argument(
        "--no-continuation",
        action="store_true",
        help="baseline: a request whose group dies starts over (its tokens regenerated) instead "
        "of continuing from its last streamed token",
    )
    p.add_argument(
        "--warm-standby",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep a pre-imported standby engine process per group for fast restarts (default on)",
    )


def options_problem(opts: DemoOptions) -> str | None:
    """Why the demo cannot run with ``opts`` (printed, exit status 2), or ``None``."""
    if opts.groups < 2:
        return "--groups must be >= 2 (one of them is the 2-rank group)"
    if opts.steps < 1:
        return "--steps must be >= 1"
    return None
