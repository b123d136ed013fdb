"""Verify: the invariants the demo checks; each break is appended to ``run.failures``.

* :func:`check_start`: the engines start on the trainer's weights;
* :func:`check_step`: after each step's sync, every ``active`` engine serves the trainer's
  weights (its own digest; the trainer actor computes it);
* :func:`check_final`: once the recoveries finished, every group is ``active`` on the trainer's
  weights, the last version's export became ready, and no request was admitted to a
  non-``active`` group;
* :func:`check_recovered`: the crashed group became ``active`` again.

Any failure makes the demo exit with status 1.
"""

from __future__ import annotations

from typing import Any

from rollsafe.demo.state import DemoRun, StepRecord

__all__ = ["check_final", "check_recovered", "check_start", "check_step"]


def check_start(run: DemoRun) -> None:
    """The engines start on the trainer's weights."""
    want = run.trainer.checksum()
    initial = run.fleet.checksums()
    if any(v != want for v in initial.values()):
        run.failures.append(f"step 0: engines do not start on the trainer's weights: {initial}")


def check_step(run: DemoRun, record: StepRecord) -> None:
    """Every ``active`` engine == the trainer after the step's sync; per group in the record
    (``match``, ``MISMATCH`` or ``not serving (<state>)``)."""
    step, fleet = record["step"], run.fleet
    with run.timed(f"verify checksums (engines, {run.who})"):
        want = run.trainer.checksum()
        checks: dict[str, str] = {}
        for gid, got in fleet.checksums().items():
            state = fleet.registry.get(gid).state
            if state != "active":
                checks[gid] = f"not serving ({state})"
            elif got == want:
                checks[gid] = "match"
            else:
                checks[gid] = "MISMATCH"
                run.failures.append(f"step {step}: {gid} serves {got}, trainer has {want}")
        record["checksums"] = checks


def check_final(run: DemoRun) -> None:
    """After the load stopped: wait for the recoveries, then every group back and on the
    trainer's weights, the last export ready (timed together as settle), and no request
    admitted to a non-``active`` group."""
    fleet, steps = run.fleet, run.opts.steps
    with run.timed("settle (recoveries, last export)"):
        fleet.wait_recoveries(timeout=120.0)
        final = fleet.checksums()
        want = run.trainer.checksum()
        for gid, got in final.items():
            state = fleet.registry.get(gid).state
            check = "match" if state == "active" and got == want else f"{state}/{got}"
            run.final_checks[gid] = check
            if check != "match":
                run.failures.append(f"final: {gid} is {state} with checksum {got}, want {want}")
        exporter = fleet.exporter
        if exporter is not None:
            try:
                exporter.wait_hf_export(steps, timeout=60)
            except Exception as exc:
                run.failures.append(f"final export v{steps} did not become ready: {exc}")
    run.dispatch = fleet.registry.dispatch_counts()
    run.bad_dispatch = {g: c for g, c in run.dispatch.items() if set(c) - {"active"}}
    if run.bad_dispatch:
        run.failures.append(f"requests admitted to non-active groups: {run.bad_dispatch}")

    # The named invariants the verifier and the property tests check, on the live fleet
    # (while it is up and before report.collect reads its timeline).
    from rollsafe.invariants import check_all

    run.failures.extend(f"invariant {v}" for v in check_all(fleet.picture()))


def check_recovered(run: DemoRun, recovery: dict[str, Any]) -> None:
    """The crashed group became ``active`` again after the crash (``recovery``: the report's
    recovery figures)."""
    if run.crash is not None and recovery["active_again_at"] is None:
        run.failures.append(f"{run.crash['group']} never became active again after the crash")
