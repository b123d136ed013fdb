"""Update planning: broadcast or P2P, which sockets each engine gets, and whose result is whose.

Owns :func:`plan_update` (:class:`UpdatePlan`: broadcast when the targets cover every rank, P2P
for a subset only when Mooncake is usable), :func:`socket_paths_for` and
:func:`merge_rank_results` (per-rank outcomes mapped back to targets).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from rollsafe.ports import EngineTarget, TargetResult
from rollsafe.text import bound_text
from rollsafe.transports.base import TransportError
from rollsafe.transports.checkpoint_engine.errors import P2PUnavailable


@dataclass(frozen=True)
class UpdatePlan:
    """How one update runs: ``broadcast`` to every rank, or ``p2p`` to ``ranks`` only."""

    mode: Literal["broadcast", "p2p"]
    ranks: tuple[int, ...] | None

    @property
    def ps_ranks(self) -> list[int] | None:
        """The ``ranks=`` argument of ``ParameterServer.update`` (None means broadcast)."""
        return None if self.ranks is None else list(self.ranks)


def plan_update(
    target_ranks: Sequence[Sequence[int]],
    world_size: int,
    *,
    p2p_available: bool,
    p2p_reason: str = "mooncake is not installed",
    force_p2p: bool = False,
) -> UpdatePlan:
    """Broadcast when the targets cover every rank; P2P for a subset if usable; else refuse.

    With ``force_p2p`` the plan is P2P to the targets' ranks even when they cover every rank (a
    world of one included): a targeted push exercises P2P, never a broadcast. Targets are
    assumed valid (the registration machine's guard checks them first). Raises
    :class:`P2PUnavailable` when P2P is needed and unusable: never a silent broadcast.
    """
    union = sorted({int(r) for group in target_ranks for r in group})
    bad = [r for r in union if not 0 <= r < world_size]
    if bad:
        raise TransportError(f"checkpoint_engine: target ranks {bad} out of range(0, {world_size})")
    if union == list(range(world_size)) and not force_p2p:
        return UpdatePlan("broadcast", None)
    if not p2p_available:
        raise P2PUnavailable(union, world_size, p2p_reason)
    return UpdatePlan("p2p", tuple(union))


def socket_paths_for(socket_paths: Sequence[Sequence[str]], ranks: Iterable[int]) -> dict[str, str]:
    """``{device uuid: zmq socket path}`` of ``ranks``, from the list ``req_func`` receives.

    checkpoint-engine calls ``req_func(socket_paths)`` with one ``(device_uuid, "ipc://...")``
    pair per parameter-server rank, in rank order; an engine's workers each pick their device's
    entry, so a target gets exactly the entries of its ranks.
    """
    out: dict[str, str] = {}
    for r in ranks:
        if not 0 <= r < len(socket_paths):
            raise TransportError(
                f"checkpoint_engine: rank {r} has no socket path ({len(socket_paths)} ranks known)"
            )
        uuid, path = socket_paths[r]
        out[str(uuid)] = str(path)
    return out


LocalResults = dict[str, tuple[bool, str, float]]


def merge_rank_results(
    gathered: Sequence[tuple[Mapping[str, tuple[bool, str, float]], str | None]],
    targets: Sequence[EngineTarget],
    *,
    nbytes: int = 0,
) -> dict[str, TargetResult]:
    """Map what every rank saw into one result per target.

    ``gathered[rank]`` is ``(results this rank posted, error of its ParameterServer.update or
    None)``; a target's own result comes from its lowest rank (the one that posted it). A failed
    collective fails every target (the broadcast is all or nothing; an engine may hold a partial
    update), keeping the target's own reason first when it has one.
    """
    errors = {r: e for r, (_, e) in enumerate(gathered) if e}
    collective = (
        "ParameterServer.update failed on rank(s) "
        + ", ".join(f"{r}: {e}" for r, e in sorted(errors.items()))
        if errors
        else ""
    )
    out: dict[str, TargetResult] = {}
    for t in targets:
        poster = min(t.ranks)
        own = gathered[poster][0].get(t.name) if poster < len(gathered) else None
        if own is None:
            reason = "the engine was never asked to load (update aborted before its request)"
            if collective:
                reason += f"; {collective}"
            out[t.name] = TargetResult(t.name, False, bound_text(reason))
            continue
        ok, reason, seconds = own
        if collective:
            reason = f"{reason}; {collective}" if reason else collective
            ok = False
        out[t.name] = TargetResult(t.name, ok, bound_text(reason), seconds, nbytes if ok else 0)
    return out
