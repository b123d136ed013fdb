"""One health probe of one group, written once (``docs/design.md``, "Operations").

:func:`probe` is the sequence, top-down; its one decision is
:func:`rollsafe.policy.judge_probe`'s and every step of I/O is an effect its executor performs
(:class:`rollsafe.fleet.health.HealthManager`, which runs one per probed group in each round, and
:class:`rollsafe.verify.FleetModel` in ``rollsafe verify``, whose ``probe`` and
``probe_timeout`` actions choose the probe's outcome):

1. **probe** the members (:class:`~rollsafe.operations.effects.ProbeMembers`): the ranks found
   unhealthy, or a failure or time-out, which counts as a failure of every rank;
2. under the health checker's lock (a ``pause()`` waits for it): **read** the group's counts
   and recorded health; nothing is applied while checks are paused, and an answer about a
   group that moved meanwhile (failed, restarted, removed) only forgets its counts;
3. **judge** (:func:`~rollsafe.policy.judge_probe`): report healthy ranks healthy, ranks at the
   threshold unhealthy, store the new counts;
4. outside the lock: send the decided ``fail`` (refused: the group moved meanwhile, nothing
   more) and **hand the group over** as the policy says (queued for recovery, never run here).

The sequence returns a :class:`ProbeEnd`.
"""

from __future__ import annotations

from dataclasses import dataclass

import rollsafe.policy as policy
from rollsafe.operations.effects import (
    GroupFailed,
    LockHealth,
    Ok,
    ProbeMembers,
    ReadProbeFacts,
    ReportRank,
    SendGroup,
    SetFailureCounts,
    Steps,
    UnlockHealth,
    ask,
    read,
)

__all__ = ["ProbeEnd", "probe"]


@dataclass(frozen=True)
class ProbeEnd:
    """What one probe did: ``applied`` its answer (False: checks were paused, or the group
    moved while it was probed), ``failed`` the group (``fail`` sent)."""

    applied: bool = False
    failed: bool = False


def probe(group: str, threshold: int) -> Steps[ProbeEnd]:
    """The steps of one probe of ``group``; ``threshold`` consecutive failures of a rank fail
    the group."""
    answer = yield from ask(ProbeMembers(group))

    yield LockHealth()
    facts = yield from read(ReadProbeFacts(group))
    if facts is None:  # paused or stopped since the probe began: nothing is applied
        yield UnlockHealth()
        return ProbeEnd()
    if facts.moved:  # an answer about an incarnation that no longer exists
        yield SetFailureCounts(group, {})
        yield UnlockHealth()
        return ProbeEnd()
    if isinstance(answer, Ok):
        unhealthy, reason = answer.value.unhealthy, answer.value.error
    else:  # raised, still stuck or timed out: every rank failed
        unhealthy, reason = facts.ranks, answer.error
    verdict = policy.judge_probe(
        facts.ranks, unhealthy, facts.counts, facts.recorded_healthy, threshold
    )
    for rank in verdict.report_healthy:
        yield ReportRank(group, rank, True)
    for rank in verdict.report_unhealthy:
        yield ReportRank(group, rank, False)
    yield SetFailureCounts(group, verdict.counts)
    yield UnlockHealth()
    if not verdict.events:
        return ProbeEnd(applied=True)

    why = reason or "unhealthy"
    for event in verdict.events:
        sent = yield from ask(SendGroup(group, event, "judge_probe", reason=why))
        if not isinstance(sent, Ok):  # it moved meanwhile (someone else failed it first...)
            return ProbeEnd(applied=True)
    yield GroupFailed(group, verdict.report_unhealthy, threshold, why, verdict.handoff)
    return ProbeEnd(applied=True, failed=True)
