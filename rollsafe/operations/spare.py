"""A spare takes over from a serving group that left routing, written once
(``docs/recovery.md``, "Spare groups").

:func:`cover` is the sequence, top-down; its decisions are :mod:`rollsafe.policy`'s and every
step of I/O is an effect its executor performs (:class:`rollsafe.fleet.spares.SparePool` on the
real fleet, :class:`rollsafe.verify.FleetModel` in ``rollsafe verify``):

1. take the **transport's lock**: no sync or targeted push moves the fleet's version or a
   spare's weights until the switch is done (a spare promoted during an update would serve
   weights that are changing, and the update would not credit it);
2. **read** the group and the spares, **plan** (:func:`~rollsafe.policy.plan_cover`): only a
   serving group out of routing is covered, by a spare in ``standby`` recorded healthy and at
   the fleet's version, spares on another node first;
3. for each candidate, the **last version check**: its engines name the weights they serve
   (:class:`~rollsafe.operations.effects.CheckVersion`), judged by
   :func:`~rollsafe.policy.judge_spare`; one that names other weights than recorded is failed
   and handed to recovery, one that does not answer is passed over;
4. the **switch**, all or nothing in one registry step: the spare is promoted
   (``standby`` -> ``active``: routable from this step on, the machine's guards asking every
   member healthy and at the current version once more) and the covered group enlisted as a
   spare (its recovery, already under way, ends in ``standby``: the pool refills);
5. release the lock.

The recovery of the covered group is not part of this sequence: it runs on the recovery pool
as for any failure (:mod:`rollsafe.operations.recover`), before, during or after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import rollsafe.policy as policy
from rollsafe.operations.effects import (
    CheckVersion,
    HandOff,
    LockTransport,
    NoteStep,
    Ok,
    ReadSpares,
    SendGroup,
    SendGroups,
    Steps,
    UnlockTransport,
    ask,
    read,
)

__all__ = ["CoverEnd", "cover"]


@dataclass(frozen=True)
class CoverEnd:
    """How a cover ended: ``promoted`` (``spare`` serves in place of the group) or
    ``uncovered`` (no spare was ready, passed its check, or the switch was refused: the group
    or the spare moved meanwhile), and why."""

    status: Literal["promoted", "uncovered"]
    reason: str
    spare: str | None = None


def cover(group: str) -> Steps[CoverEnd]:
    """The steps of covering serving group ``group`` with a spare."""
    yield LockTransport()
    end = yield from _cover_locked(group)
    yield UnlockTransport()
    yield NoteStep("cover", end.status == "promoted", end.reason)
    return end


def _cover_locked(group: str) -> Steps[CoverEnd]:
    seen = yield from read(ReadSpares(group))
    plan = policy.plan_cover(seen.group, seen.spares, seen.fleet_version)
    if not plan.candidates:
        return CoverEnd("uncovered", f"{group} not covered: {plan.reason}")
    passed: list[str] = []
    for spare in plan.candidates:
        answer = yield from ask(CheckVersion(spare))
        reported = answer.value if isinstance(answer, Ok) else None
        verdict = policy.judge_spare(reported, seen.fleet_version)
        if not verdict.promote:
            passed.append(f"{spare}: {verdict.reason}")
            for event in verdict.events:
                sent = yield from ask(SendGroup(spare, event, "judge_spare"))
                if isinstance(sent, Ok):
                    yield HandOff(spare)
            continue
        refused = yield from ask(SendGroups(plan.swap(spare), "plan_cover", all_or_nothing=True))
        if not isinstance(refused, Ok) or refused.value:
            why = refused.error if not isinstance(refused, Ok) else refused.value[0][1]
            return CoverEnd("uncovered", f"{group} not covered: the switch was refused ({why})")
        return CoverEnd("promoted", f"{spare} serves in place of {group} ({verdict.reason})", spare)
    return CoverEnd("uncovered", f"{group} not covered: " + "; ".join(passed))
