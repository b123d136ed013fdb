"""Embed a RolloutFleet in a plain PyTorch training loop (CPU, reference engines, < 1 minute).

Each step: roll out through the fleet (only whole, current groups serve), train on the rollouts
with SGD, then ``sync_weights`` pushes the new version to every engine over the transport and
starts its HF export in the background (what an immediate recovery restarts from).

    python examples/embed_in_trainer.py [--steps 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model
from rollsafe.fleet import FleetConfig, GroupSpec, HealthSettings, RolloutFleet
from rollsafe.transports.contiguous import flatten_parameters


def main(steps: int = 3) -> None:
    work = Path(tempfile.mkdtemp(prefix="rollsafe-embed-"))
    model_dir = make_tiny_model(work / "model", seed=0)  # the engines start on these weights
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    # one flat (shared-memory) buffer for all parameters: `ipc` then hands slices of it to the
    # engines without a packing copy (Megatron-style trainers already keep them this way)
    flatten_parameters(model, shared_memory=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    config = FleetConfig(
        model_path=model_dir,
        export_root=work / "exports",
        groups=[GroupSpec(ranks=1), GroupSpec(ranks=2)],  # a 1-rank and a 2-rank (TP) engine
        transport="ipc",
        health=HealthSettings(interval_s=0.5, timeout_s=2.0, failure_threshold=2),
        enable_immediate_recovery=True,
    )
    started = time.monotonic()
    with RolloutFleet(config) as fleet:
        # the engines' start is most of a run's time (seconds here; minutes on a loaded machine)
        print(f"fleet up in {time.monotonic() - started:.1f}s: groups {fleet.group_ids}")
        for step in range(1, steps + 1):
            # 1. rollout: the router sends each request to an active group
            prompts = [[1 + (7 * i + step) % 400 for _ in range(6)] for i in range(8)]
            rollouts = [
                fleet.generate(p, sampling_params={"max_new_tokens": 8}).output_ids for p in prompts
            ]
            # 2. train on prompt + completion (a stand-in for the RL loss)
            # (completions differ in length when one stops at EOS: one sequence at a time)
            seqs = [torch.tensor([p + r]) for p, r in zip(prompts, rollouts, strict=True)]
            loss = torch.stack([model(input_ids=x, labels=x).loss for x in seqs]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            # 3. sync: every engine gets version `step`; its HF export runs in the background
            weights = {n: p.detach() for n, p in model.named_parameters()}
            report = fleet.sync_weights(weights, version=step)
            # each engine's own weight checker, tensor by tensor in its layout (SGLang's fused
            # qkv_proj / gate_up_proj per TP rank), against the weights just synced
            same = all(c is not None and c.equal for c in fleet.check_weights(weights).values())
            print(
                f"step {step}: loss {loss.item():.3f}, synced v{step} to {report.updated}"
                f" in {sum(report.timings.values()):.2f}s, engines match trainer: {same}"
            )
            assert report.ok and same
        print(f"{len(fleet.timeline())} machine transitions; exports {fleet.export_states()}")
        closing = time.monotonic()
    print(f"fleet closed in {time.monotonic() - closing:.1f}s (engines stopped, exports done)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3)
    main(parser.parse_args().steps)
