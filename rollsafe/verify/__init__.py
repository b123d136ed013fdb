"""What proves the fleet right: the real machines and the real policy composed into one model
(:mod:`~rollsafe.verify.model`), explored exhaustively (:mod:`~rollsafe.verify.explorer`) against
the invariants of :mod:`rollsafe.invariants`."""

from rollsafe.verify.explorer import Counterexample, ExplorationResult, default_workers, explore
from rollsafe.verify.model import GROUP_EVENTS, Action, FleetModel, ModelConfig, Violation

__all__ = [
    "GROUP_EVENTS",
    "Action",
    "Counterexample",
    "ExplorationResult",
    "FleetModel",
    "ModelConfig",
    "Violation",
    "default_workers",
    "explore",
]
