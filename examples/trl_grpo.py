"""TRL's GRPOTrainer generating through a RolloutFleet (CPU, reference engines, about a minute).

A usual TRL GRPO script with two changes: the engines are a ``RolloutFleet`` (two reference-
engine groups here; vLLM or SGLang servers in production), and ``GRPOTrainer`` becomes
``RollsafeGRPOTrainer(fleet=...)``. TRL then samples every completion through the fleet, with
the engines' logprobs for its importance-sampling correction, and syncs the weights into every
engine after each optimizer step (version = ``trainer.state.global_step``). No vLLM is imported
here. ``--crash-at STEP`` SIGKILLs one engine while that step's completions are generated: the
cut requests continue on the other group from their last token and training goes on.

    python examples/trl_grpo.py [--steps 4] [--crash-at 2]
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
from pathlib import Path

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig

from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model
from rollsafe.fleet import FleetConfig, GroupSpec, RolloutFleet
from rollsafe.integrations.trl import RollsafeGRPOTrainer


def reward_len(completions: list[str], **_: object) -> list[float]:
    """A toy reward: longer completions score higher."""
    return [len(c) / 10.0 for c in completions]


def main(steps: int = 4, crash_at: int = 2) -> None:
    work = Path(tempfile.mkdtemp(prefix="rollsafe-trl-"))
    model_dir = make_tiny_model(work / "model", seed=0)  # the engines start on these weights
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = Dataset.from_dict({"prompt": ["The rollout engine", "Hello world"] * 16})
    args = GRPOConfig(
        output_dir=str(work / "grpo"),
        use_cpu=True,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=12,
        max_steps=steps,
        logging_steps=1,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
    )
    config = FleetConfig(
        model_path=model_dir,
        export_root=work / "exports",
        groups=[GroupSpec(ranks=1), GroupSpec(ranks=1)],
        enable_immediate_recovery=True,
    )
    with RolloutFleet(config) as fleet:
        trainer = RollsafeGRPOTrainer(
            model=model,
            reward_funcs=reward_len,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            fleet=fleet,
        )
        killed: list[str] = []

        def crash(group_id: str, tokens: int) -> None:  # called as tokens stream in
            if trainer.state.global_step == crash_at and tokens >= 3 and not killed:
                killed.append(group_id)
                for pid in fleet.launcher(group_id).rank_pids:
                    os.kill(pid, signal.SIGKILL)

        # a real run's completions are hundreds of tokens and stream; these 12 would be read
        # whole (Router.whole_up_to), so the crash could not land mid-generation
        fleet.router.whole_up_to = 0
        fleet.router.on_progress = crash if crash_at else None
        trainer.train()
        fleet.router.on_progress = None
        fleet.wait_recoveries(timeout=120)
        for record in trainer.fleet_generation.history:
            versions = sorted({v for c in record.completions for v in c.weights_versions if v})
            print(
                f"step {record.trainer_step}: {len(record.completions)} completions from weights "
                f"v{','.join(versions)}; continued after a crash: {record.continued}; "
                f"tokens from other versions: {record.stale_tokens}"
            )
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        print(f"losses: {[round(x, 4) for x in losses]}")
        if killed:
            print(f"killed {killed[0]} at step {crash_at}; recoveries: {len(fleet.recoveries())}")
        print(f"engine checksums: {fleet.checksums()}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--crash-at", type=int, default=2, help="0: no crash")
    opts = parser.parse_args()
    main(opts.steps, opts.crash_at)
