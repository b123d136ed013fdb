"""What proves the machines right: the composed fleet model and its exhaustive explorer."""

from rollsafe.verify.explorer import Counterexample, ExplorationResult, explore
from rollsafe.verify.model import GROUP_EVENTS, Action, FleetModel, ModelConfig, Violation

__all__ = [
    "GROUP_EVENTS",
    "Action",
    "Counterexample",
    "ExplorationResult",
    "FleetModel",
    "ModelConfig",
    "Violation",
    "explore",
]
