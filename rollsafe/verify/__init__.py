"""What proves the fleet right: the real machines and the real policy composed into one model
(:mod:`~rollsafe.verify.model`), explored exhaustively (:mod:`~rollsafe.verify.explorer`) against
the invariants of :mod:`rollsafe.invariants`, and stepped with a recorded run
(:mod:`~rollsafe.verify.replay`: ``rollsafe verify --trace``)."""

from rollsafe.verify.explorer import Counterexample, ExplorationResult, default_workers, explore
from rollsafe.verify.model import GROUP_EVENTS, Action, FleetModel, ModelConfig, Violation
from rollsafe.verify.replay import Divergence, ReplayResult, TraceError, replay_run

__all__ = [
    "GROUP_EVENTS",
    "Action",
    "Counterexample",
    "Divergence",
    "ExplorationResult",
    "FleetModel",
    "ModelConfig",
    "ReplayResult",
    "TraceError",
    "Violation",
    "default_workers",
    "explore",
    "replay_run",
]
