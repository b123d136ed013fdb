"""Node loss, re-placement and removal of a group, written once (``docs/cluster.md``).

Like :mod:`rollsafe.operations.recover`, every decision here is :mod:`rollsafe.policy`'s and
every step of I/O an effect its executor performs (the fleet's ``RolloutFleet`` /
``RecoveryCoordinator``, and :class:`rollsafe.verify.FleetModel` in ``rollsafe verify``):

1. :func:`node_lost` -- a node died: read the states of the groups placed on it, ask
   :func:`~rollsafe.policy.on_node_lost`, and send every group its event in **one** registry
   step (``node_lost`` -> ``unplaced``; a ``draining`` group is retired): no request is
   dispatched to any of them after that step, and no restart budget is spent;
2. :func:`place` -- re-place an ``unplaced`` group (:func:`~rollsafe.policy.gate_placement`):
   give the old placement back and place anew; no room: it waits (``unplaced``, budget intact);
   room: ``placed`` (-> ``recovering``);
3. :func:`attempt` -- :func:`place`, then recovery's own phases (strategy and lease, restart,
   targeted push: the same generators the recovery of a crash runs), so the group reaches
   ``active`` only through ``pending_weights`` at the fleet's version or from the export of it;
4. :func:`drain` and :func:`finish_removal` -- ``remove_group``: ``drain`` (out of routing),
   wait for its in-flight requests, stop the engine, give the placement back, ``retire``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import rollsafe.policy as policy
from rollsafe.operations.effects import (
    AwaitDrained,
    NoteStep,
    Ok,
    Place,
    ReadRecovery,
    ReadStates,
    ReleasePlacement,
    SendGroup,
    SendGroups,
    Steps,
    StopEngine,
    ask,
    read,
)
from rollsafe.operations.recover import AttemptEnd, push, restart, take_lease

__all__ = [
    "RemovalEnd",
    "attempt",
    "drain",
    "finish_removal",
    "groups_on",
    "node_lost",
    "place",
    "remove",
]


@dataclass(frozen=True)
class RemovalEnd:
    """How a removal ended: ``retired``; ``already`` (retired or being removed before);
    ``refused`` (its machine refused an event: it moved meanwhile); ``draining`` (drained, the
    rest not run yet). ``cut``: in-flight requests still running when it stopped (they
    continue on other groups)."""

    status: Literal["retired", "already", "refused", "draining"]
    reason: str
    cut: int = 0


# ====================================================================== 1. node loss
def groups_on(node: str, placements: Mapping[str, Sequence[str]]) -> tuple[str, ...]:
    """The groups a dead ``node`` takes out: every group holding a slice on it
    (``placements``: each group's nodes, one per slice; a group on one node has one), so a
    group that spans nodes is lost whole when the node under any of its slices is."""
    return tuple(gid for gid, nodes in placements.items() if node in nodes)


def node_lost(groups: tuple[str, ...]) -> Steps[tuple[str, ...]]:
    """A node died with ``groups`` placed on it: all of them leave routing in one step.
    Returns the groups now ``unplaced`` (each to be placed again)."""
    states = yield from read(ReadStates(groups))
    plan = policy.on_node_lost(states)
    events = tuple((g, evs) for g, evs in plan.events if evs)
    sent = yield from ask(SendGroups(events, "on_node_lost"))
    refused: tuple[tuple[str, str], ...] = sent.value if isinstance(sent, Ok) else ()
    refused_ids = {g for g, _ in refused}
    lost = tuple(g for g in plan.lost if g not in refused_ids)
    yield NoteStep("node_lost", not refused, f"unplaced {list(lost)}; refused {list(refused)}")
    return lost


# ====================================================================== 2. placement
def place(group: str) -> Steps[AttemptEnd | None]:
    """Place the ``unplaced`` ``group`` anew: None when it is ``recovering`` now (the
    restart follows), else the end (``unplaced``: no room, it waits; budget intact)."""
    facts = yield from read(ReadRecovery(group))
    gate = policy.gate_placement(facts.state, busy=facts.busy)
    if not gate.place:
        return AttemptEnd("not_needed" if not facts.busy else "failed", gate.reason)
    where = yield from ask(Place(group))
    if not isinstance(where, Ok):
        yield NoteStep("place", False, where.error)
        return AttemptEnd("unplaced", f"no room: {where.error}")
    for event in policy.after_placement(True):
        sent = yield from ask(SendGroup(group, event, "after_placement"))
        if not isinstance(sent, Ok):  # it moved meanwhile (removed): give the placement back
            yield ReleasePlacement(group)
            yield NoteStep("place", False, sent.error)
            return AttemptEnd("failed", f"placed refused: {sent.error}")
    yield NoteStep("place", True, f"on node {where.value}")
    return None


def attempt(group: str, traits: policy.EngineTraits) -> Steps[AttemptEnd]:
    """Place ``group`` and bring it back: recovery's phases after the placement."""
    end = yield from place(group)
    if end is not None:
        return end
    lease = yield from take_lease(group)
    end = yield from restart(group, lease)
    if end is not None:
        return end
    return (yield from push(group, traits))


# ====================================================================== 3. removal
def drain(group: str) -> Steps[RemovalEnd | None]:
    """Take ``group`` out of routing for good: None when it is ``draining`` now."""
    states = yield from read(ReadStates((group,)))
    if not states:
        return RemovalEnd("already", f"{group} is not in the fleet")
    plan = policy.plan_removal(states[0][1])
    if plan.already:
        return RemovalEnd("already", plan.reason)
    for event in plan.events:
        sent = yield from ask(SendGroup(group, event, "plan_removal"))
        if not isinstance(sent, Ok):
            return RemovalEnd("refused", sent.error)
    yield NoteStep("drain", True, plan.reason)
    return None


def finish_removal(group: str) -> Steps[RemovalEnd]:
    """Wait for the drained ``group``'s requests, stop its engine, give its placement back
    and retire it."""
    waited = yield from ask(AwaitDrained(group))
    cut = waited.value if isinstance(waited, Ok) else 0
    stopped = yield from ask(StopEngine(group))
    yield NoteStep(
        "stop", isinstance(stopped, Ok), "" if isinstance(stopped, Ok) else stopped.error
    )
    yield ReleasePlacement(group)
    for event in policy.after_drain():
        sent = yield from ask(SendGroup(group, event, "after_drain"))
        if not isinstance(sent, Ok):
            return RemovalEnd("refused", sent.error, cut)
    return RemovalEnd("retired", f"removed ({cut} request(s) continued elsewhere)", cut)


def remove(group: str) -> Steps[RemovalEnd]:
    """The whole removal: :func:`drain`, then :func:`finish_removal`."""
    end = yield from drain(group)
    if end is not None:
        return end
    return (yield from finish_removal(group))
