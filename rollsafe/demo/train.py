"""Train: one optimizer step of the trainer (a Ray actor round trip, or in this process)."""

from __future__ import annotations

from rollsafe.demo.state import DemoRun, StepRecord

__all__ = ["train"]


def train(run: DemoRun, record: StepRecord) -> None:
    """One train step; its loss goes into the step's record."""
    with run.timed(f"train ({run.who} round trip)" if run.actor else "train"):
        record["loss"] = run.trainer.step()
