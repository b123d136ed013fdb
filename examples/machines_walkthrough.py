"""A worker group's life, driven by hand: launch, crash, immediate recovery from a ready export.

Run: ``.venv/bin/python examples/machines_walkthrough.py``. It prints the audit timeline the
machines recorded. The fleet (``rollsafe.fleet``) sends these same events for you.
"""

from __future__ import annotations

from rollsafe import ExportLifecycle, ImmediateRecoveryMode, WorkerGroupLifecycle
from rollsafe.statemachines import TransitionNotAllowed


def main() -> None:
    version = 1
    group = WorkerGroupLifecycle(ranks=[0, 1], restart_budget=2, group_id="engine-0")
    mode = ImmediateRecoveryMode(enabled=True, rearm_after=2)

    # Launch: both ranks come up with the initial weights.
    for rank in group.ranks:
        group.report_member(rank, healthy=True, weights_version=version)
    group.launched(current_version=version)

    # The async export of version 1 finishes before the next sync: it is offerable.
    export = ExportLifecycle(version)
    export.snapshot()
    export.snapshot_done()
    export.shards_written(ranks_ok=[0])
    export.publish(index_missing_keys=[], checksums_verified=True, renamed=True)

    # Rank 1 is SIGKILLed: the whole group leaves routing at once.
    group.report_member(1, healthy=False)
    group.fail()
    assert not group.is_routable

    # A half-restarted group is never routable: the guard asks all() members.
    group.claim()
    lease = export.acquire_lease(holder=group.group_id)
    group.report_member(0, healthy=True, weights_version=version)
    try:
        group.restarted(current_version=version)
    except TransitionNotAllowed as refused:
        print(f"refused, as it must be: {refused}")

    # Rank 1 loads the ready export too: the group is back, current, routable.
    group.report_member(1, healthy=True, weights_version=version)
    if mode.allows_immediate:
        group.restarted(current_version=version)
    export.release_lease(lease)
    assert group.is_routable

    for record in group.history:
        print(f"{record.seq:>2} {record.event:<15} {record.source:>15} -> {record.target}")


if __name__ == "__main__":
    main()
