"""Sync: the trainer's new version to every serving engine.

Owns :func:`sync`: fetch the weights from the trainer (through the object store for the actor)
and push them with :meth:`~rollsafe.fleet.fleet.RolloutFleet.sync_weights` over ``--transport``
(the fleet also exports the version asynchronously). A failed or raising sync is an invariant
break: it is recorded and the run goes on.
"""

from __future__ import annotations

from rollsafe.demo.state import DemoRun, StepRecord

__all__ = ["sync"]


def sync(run: DemoRun, record: StepRecord) -> None:
    """Fetch version ``record["step"]`` and sync it; the report goes into the step's record."""
    step = record["step"]
    run.weights = None  # the trainer stepped: what it held before is no longer its weights
    try:
        with run.timed("fetch weights (object store)" if run.actor else "weights snapshot"):
            weights = run.weights = run.trainer.weights()
        with run.timed("sync"):
            report = run.fleet.sync_weights(weights, step)
        record["sync"] = report.as_dict()
        if not report.ok:
            run.failures.append(f"step {step}: sync failed: {report.error}")
    except Exception as exc:  # a failed step is an invariant break, keep reporting
        run.failures.append(f"step {step}: sync raised {type(exc).__name__}: {exc}")
        record["sync"] = {"ok": False, "error": str(exc)}
