"""The soak's fault schedule, drawn from one seed (``benchmarks/soak.py --seed S``).

Owns :data:`KINDS` (every fault kind the soak injects), :class:`Fault` (one planned injection:
when, what, on which group, with which parameters) and :func:`draw` (the schedule of a run).
:func:`draw` is a pure function of ``(seed, minutes, smoke)`` and the soak's fixed groups: the
same seed replays the same schedule, printed at the start of every run
(:func:`describe`; ``--schedule-only`` prints it and exits).

The kinds come in rounds: each round is the seed's permutation of every kind, so a run long
enough for one round injects each kind at least once (ten minutes always is: 25 s, then gaps of
30-55 s); ``double`` is two single faults of
different kinds injected at the same moment. ``at_s`` is the earliest moment (seconds after the
soak's first sync) the fault may go in; the soak injects it once its target group is routable
again (a fault never waits more than :data:`MAX_WAIT_S`, then goes in anyway), so the runtime
moments differ from run to run, never the faults.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "GROUPS",
    "KINDS",
    "MAX_WAIT_S",
    "SINGLE_KINDS",
    "SYNC_KINDS",
    "Fault",
    "describe",
    "draw",
]

#: the soak's groups: fleet ``ref`` (reference engine: r0 one rank, r1 two ranks) and fleet
#: ``vllm`` (the real vLLM: v0, v1), each ``group -> (fleet, ranks)``
GROUPS: dict[str, tuple[str, int]] = {
    "r0": ("ref", 1),
    "r1": ("ref", 2),
    "v0": ("vllm", 1),
    "v1": ("vllm", 1),
}
FLEETS = ("ref", "vllm")

#: every single fault kind, in the order the docs list them
SINGLE_KINDS = (
    "sigkill_rank",  # SIGKILL of one engine rank
    "sigstop",  # SIGSTOP of an engine's processes (a hang), then SIGCONT after a while or never
    "update_failed",  # one group's weight update fails part-way (names a tensor it lacks)
    "update_poisoned",  # the trainer's version holds a NaN (a diverged step), pushed to all
    "kill_during_sync",  # SIGKILL of a rank while its weight update runs
    "node_replace",  # the Ray node holding a group removed (no grace), a new node added
    "export_disk_full",  # the fleet's export filesystem full for one or two syncs
    "export_slow",  # an export that takes longer than the next sync's start (late)
    "port_blackhole",  # every packet to or from an engine's port dropped for a while
    "trainer_exception",  # the trainer raises in the middle of a sync
)
#: kinds that act through the next sync (armed, then fired by it)
SYNC_KINDS = ("update_failed", "update_poisoned", "kill_during_sync", "trainer_exception")
#: ``double``: two single faults of different kinds at the same moment
KINDS = (*SINGLE_KINDS, "double")
#: how long a planned fault waits for its target to be routable before it goes in anyway (s)
MAX_WAIT_S = 240.0
#: where a trainer-side exception is raised (the sync's steps, in order)
TRAINER_POINTS = ("register", "offload_trainer", "onload_engines", "onload_trainer")


@dataclass(frozen=True)
class Fault:
    """One planned injection: ``kind`` on ``group`` (``fleet`` for fleet-wide kinds) no earlier
    than ``at_s``; ``params`` (plain JSON values) say how; ``parts`` are the two faults of a
    ``double``."""

    index: int
    kind: str
    at_s: float
    group: str | None = None
    fleet: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    parts: tuple[Fault, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index, "kind": self.kind, "at_s": self.at_s}
        if self.group is not None:
            out["group"] = self.group
        if self.fleet is not None:
            out["fleet"] = self.fleet
        if self.params:
            out["params"] = dict(self.params)
        if self.parts:
            out["parts"] = [p.as_dict() for p in self.parts]
        return out

    def label(self) -> str:
        if self.parts:
            return "double(" + " + ".join(p.label() for p in self.parts) + ")"
        where = self.group or self.fleet or "both fleets"
        params = ", ".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.kind}@{where}" + (f" [{params}]" if params else "")


def _single(rng: random.Random, kind: str, index: int, at_s: float) -> Fault:
    """One fault of ``kind``: its target and parameters drawn from ``rng``."""
    groups = sorted(GROUPS)
    group = rng.choice(groups)
    _, ranks = GROUPS[group]
    if kind == "sigkill_rank":
        return Fault(index, kind, at_s, group=group, params={"rank": rng.randrange(ranks)})
    if kind == "sigstop":
        # short: under the health check's threshold; long: taken out, continued while it
        # recovers; none: never continued (the recovery kills the stopped process)
        how = rng.choice(("short", "long", "none"))
        cont = {"short": round(rng.uniform(1.0, 3.0), 1), "long": round(rng.uniform(40, 70), 1)}
        return Fault(index, kind, at_s, group=group, params={"cont_after_s": cont.get(how)})
    if kind in ("update_failed", "kill_during_sync"):
        return Fault(index, kind, at_s, group=group)
    if kind == "update_poisoned":
        return Fault(index, kind, at_s, params={"tensor": rng.randrange(1 << 16)})
    if kind == "node_replace":
        return Fault(index, kind, at_s, group=group, params={"add_after_s": rng.randint(0, 20)})
    if kind == "export_disk_full":
        return Fault(
            index, kind, at_s, fleet=rng.choice(FLEETS), params={"syncs": rng.randint(1, 2)}
        )
    if kind == "export_slow":
        return Fault(
            index, kind, at_s, fleet=rng.choice(FLEETS), params={"delay_s": rng.randint(35, 70)}
        )
    if kind == "port_blackhole":
        return Fault(index, kind, at_s, group=group, params={"seconds": rng.randint(5, 45)})
    if kind == "trainer_exception":
        target = rng.choice((*FLEETS, None))
        return Fault(index, kind, at_s, fleet=target, params={"where": rng.choice(TRAINER_POINTS)})
    raise ValueError(f"unknown fault kind {kind!r}")


def draw(seed: int, minutes: float, *, smoke: bool = False) -> list[Fault]:
    """The faults of a ``minutes``-long soak with ``seed``: rounds of every kind in the seed's
    order, ``at_s`` spaced by a gap drawn per fault (``smoke``: shorter gaps, for a few-minute
    run); only faults planned before the run's end are kept."""
    rng = random.Random(f"rollsafe-soak/{seed}")
    horizon = minutes * 60.0
    gap = (20.0, 45.0) if smoke else (30.0, 55.0)
    at = 15.0 if smoke else 25.0
    out: list[Fault] = []
    index = 0
    while True:
        order = list(KINDS)
        rng.shuffle(order)
        for kind in order:
            if at >= horizon:
                return out
            if kind == "double":
                a, b = rng.sample(SINGLE_KINDS, 2)
                parts = (_single(rng, a, index, round(at, 1)), _single(rng, b, index, round(at, 1)))
                out.append(Fault(index, "double", round(at, 1), parts=parts))
            else:
                out.append(_single(rng, kind, index, round(at, 1)))
            index += 1
            at += rng.uniform(*gap)


def leaves(faults: Iterable[Fault]) -> list[Fault]:
    """The single faults of ``faults`` (a ``double``'s two parts in its place)."""
    out: list[Fault] = []
    for f in faults:
        out.extend(f.parts or (f,))
    return out


def describe(seed: int, faults: Sequence[Fault]) -> str:
    """The schedule as printed at the start of a run (and by ``--schedule-only``)."""
    lines = [f"soak schedule, seed {seed}: {len(faults)} fault(s)"]
    lines += [f"  #{f.index:<3} t>={f.at_s:7.1f}s  {f.label()}" for f in faults]
    return "\n".join(lines)
