"""The checkpoint-engine transport's errors (all :class:`~rollsafe.transports.TransportError`).

Owns the errors and the longest reason text kept in one (:data:`MAX_REASON`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from rollsafe.transports.base import (
    RegisterError,
    TransportError,
)

if TYPE_CHECKING:
    from rollsafe.transports.checkpoint_engine.sharding import KeyCoverage


#: The most characters of one failure reason kept (a reason crosses ranks and lands in reports).


class CheckpointEngineUnavailable(TransportError):
    """checkpoint-engine cannot run here; ``reasons`` says why (package missing, no accelerator)."""

    def __init__(self, reasons: Sequence[str]) -> None:
        self.reasons: tuple[str, ...] = tuple(reasons)
        super().__init__("checkpoint-engine transport unavailable: " + "; ".join(self.reasons))


class P2PUnavailable(TransportError):
    """A subset of ranks (or a targeted push) needs P2P (Mooncake, over RDMA or TCP) and P2P is
    not usable.

    Raised before any state changes; the fleet decides the fallback (broadcast to every rank at
    the next sync, disk, another transport). ``ranks`` is the subset that was asked for.
    """

    def __init__(self, ranks: Sequence[int], world_size: int, reason: str) -> None:
        self.ranks: tuple[int, ...] = tuple(ranks)
        self.world_size = world_size
        self.reason = reason
        super().__init__(
            f"checkpoint_engine: targets cover ranks {list(self.ranks)} of {world_size}, which "
            f"needs P2P, and P2P is unavailable ({reason}); refusing to broadcast to every rank "
            "instead: choose a fallback explicitly"
        )


class ProcessGroupError(TransportError):
    """The trainer's torch.distributed default group is missing or cannot carry device tensors."""


class KeyCoverageError(RegisterError):
    """Registered keys do not cover the expected ones exactly (message names the keys)."""

    def __init__(self, message: str, coverage: KeyCoverage) -> None:
        self.coverage = coverage
        super().__init__(message)


class ExpertGatherError(RegisterError):
    """Expert-parallel slices disagree across ranks (names, dtypes or shapes; message says)."""
