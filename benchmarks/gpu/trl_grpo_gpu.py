"""TRL GRPO on one GPU through a RolloutFleet synced over NCCL in vLLM's protocol (issue #26).

What runs: TRL 1.16's ``GRPOTrainer`` (as :class:`~rollsafe.integrations.trl.RollsafeGRPOTrainer`,
the wiring of ``examples/trl_grpo.py`` and ``tests/test_integration_trl.py``) trains a random
Llama (``make_tiny_model``, sized by ``--hidden``/``--layers``) on ``cuda:0``; two 1-rank groups
of rollsafe's reference engine in its **vLLM dialect** (``EngineSpec(dialect="vllm",
device="cuda")``) generate on the same GPU; after every optimizer step TRL's sync pushes the
weights with ``transport="nccl"`` over NCCL (backend ``nccl``) through vLLM's weight-transfer
endpoints (``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``, spoken by :class:`~rollsafe.adapters.engines.VLLMClient`). At step
``--crash-at`` one group (the victim, the first routable one) holds one of its generations at 4
tokens (the reference engine's one-shot ``/fault/stall``, armed on the victim alone once that
step's sync is done) and its engine is SIGKILLed once it has sent 3 tokens, so the kill lands
mid-generation however far the reader lags; the cut completion is continued on the other group
and the fleet recovers the victim (immediate recovery from the verified export) while the
other group serves. After every sync and at the end every serving engine's weights are checked
against the trainer's with :meth:`RolloutFleet.check_weights` (tensor by tensor, in the engine's
own layout; verdict ``equal``).

One GPU: NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"): it
compares the host hash and the PCI bus id. The trainer and the engines get distinct
``NCCL_HOSTID`` values, so NCCL sees two hosts and connects them through its socket transport
(``NCCL_SOCKET_IFNAME=lo``): the real NCCL backend, GPU buffers on both sides, the data staged
through host memory by NCCL itself. The JSON records these variables (``env.nccl_env``).

    python3 benchmarks/gpu/trl_grpo_gpu.py --out $OUT/trl_grpo_gpu.json [--steps 4]
    python3 benchmarks/gpu/trl_grpo_gpu.py --smoke --out /tmp/trl_grpo_smoke.json  # CPU

``--smoke`` runs the same code on the CPU (tiny model, engines ``--device cpu``, ``nccl``
transport over gloo, which is what the reference engine's vLLM dialect uses without CUDA): it
checks the script, not the figures. The JSON is written at the end (and on an error, with
``error``); the exit status is non-zero when any check is false.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

#: NCCL settings of this process (the trainer) and of the engines (see the module)
TRAINER_NCCL_ENV = {
    "NCCL_HOSTID": "rollsafe-trl-trainer",
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_IB_DISABLE": "1",
    "NCCL_NVLS_ENABLE": "0",
}
ENGINE_NCCL_ENV = {**TRAINER_NCCL_ENV, "NCCL_HOSTID": "rollsafe-trl-engine"}
PROMPTS = ["The rollout engine", "Hello world", "A weight update", "When an engine crashes"]
KILL_AFTER_TOKENS = 3


def stall(url: str, after_tokens: int) -> None:
    """Arm the reference engine's one-shot stall (``POST /fault/stall``): its next generation to
    reach ``after_tokens`` output tokens makes no more until aborted or the engine dies."""
    import urllib.request

    req = urllib.request.Request(
        f"{url}/fault/stall",
        data=json.dumps({"after_tokens": after_tokens}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        if r.status != 200:
            raise RuntimeError(f"arming the stall on {url} answered {r.status}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="the result JSON")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps (>= 2)")
    p.add_argument("--crash-at", type=int, default=2, help="the step whose generation is cut")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model: checks the script")
    p.add_argument("--hidden", type=int, default=1024, help="GPU model: hidden size")
    p.add_argument("--layers", type=int, default=8, help="GPU model: layers")
    p.add_argument("--completion-length", type=int, default=None, help="max new tokens")
    p.add_argument("--work-dir", type=Path, default=None, help="model, exports, engine logs")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2")
    if not 1 <= args.crash_at < args.steps:
        p.error("--crash-at must be in [1, steps)")
    return args


def versions() -> dict[str, Any]:
    import importlib.metadata as md

    out: dict[str, Any] = {"python": platform.python_version()}
    for name in ("torch", "trl", "transformers", "accelerate", "datasets"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def make_model(work: Path, smoke: bool, hidden: int, layers: int) -> Path:
    from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model

    if smoke:
        return make_tiny_model(work / "model", seed=0)
    heads = max(4, hidden // 64)
    return make_tiny_model(
        work / "model",
        seed=0,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=max(1, heads // 2),
        initializer_range=0.02,
    )


def check_fleet(fleet: Any, weights: dict[str, Any], cuda: bool) -> dict[str, dict[str, Any]]:
    """Per group: its state and, when serving, ``RolloutFleet.check_weights``'s verdict
    (``equal``: verdict ``equal``; on CPU also ``unverified`` with only equal / no-data tensors)."""
    checks = fleet.check_weights(weights, timeout=60.0)
    out: dict[str, dict[str, Any]] = {}
    for group in fleet.registry.groups():
        check = checks.get(group.group_id)
        row: dict[str, Any] = {"state": group.state}
        if group.state == "active":
            row["verdict"] = None if check is None else check.verdict
            row["counts"] = None if check is None else check.counts()
            counts = check.counts() if check is not None else {}
            # on CPU the vLLM layout has no data for linear weights (docs/engines.md): there
            # every tensor with data must be equal and none differ or be missing
            row["equal"] = check is not None and (
                check.equal
                or (not cuda and set(counts) <= {"equal", "no_data"} and counts.get("equal", 0) > 0)
            )
        out[group.group_id] = row
    return out


def run(args: argparse.Namespace, result: dict[str, Any]) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig  # type: ignore[attr-defined]

    from rollsafe.adapters.engines import EngineSpec
    from rollsafe.fleet import FleetConfig, GroupSpec, NcclSettings, RolloutFleet, SyncReport
    from rollsafe.integrations.trl import RollsafeGRPOTrainer

    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke on a CPU machine")
    if cuda:
        os.environ.update(TRAINER_NCCL_ENV)
    env = result["env"]
    env["cuda"] = cuda
    env["gpu"] = torch.cuda.get_device_name(0) if cuda else None
    nccl_version: Any = torch.cuda.nccl.version() if cuda else None  # type: ignore[no-untyped-call]
    env["nccl"] = ".".join(map(str, nccl_version)) if cuda else None
    env["nccl_env"] = {"trainer": TRAINER_NCCL_ENV, "engines": ENGINE_NCCL_ENV} if cuda else None

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="rollsafe-trl-gpu-"))
    (work / "engine-logs").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model_dir = make_model(work, args.smoke, args.hidden, args.layers)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    params = sum(p.numel() for p in model.parameters())
    result["model"] = {
        "kind": "llama (make_tiny_model)",
        "parameters": params,
        "bytes_float32": params * 4,
        "hidden": model.config.hidden_size,
        "layers": model.config.num_hidden_layers,
        "make_s": round(time.perf_counter() - t0, 3),
    }
    # The kill lands mid-generation by construction, not by length: the victim's engine holds
    # one generation at KILL_AFTER_TOKENS + 1 tokens (its one-shot /fault/stall, armed on the
    # victim alone when the crash step's sync is done) until the kill. A loaded machine's reader
    # sees tokens in bursts far behind the engine: a stream 128 tokens long was already whole
    # when the callback saw 3 (stress run, 2026-12-06) and nothing was cut.
    length = args.completion_length or (128 if args.smoke else 48)
    engine_options: dict[str, Any] = {
        "dialect": "vllm",
        "device": "cuda" if cuda else "cpu",
        "log_dir": str(work / "engine-logs"),
        "fault_injection": True,  # the victim's stall (never armed on the survivor)
    }
    if cuda:
        engine_options["env"] = ENGINE_NCCL_ENV
        engine_options["ready_timeout"] = 300.0
    config = FleetConfig(
        model_path=model_dir,
        export_root=work / "exports",
        groups=[GroupSpec(1), GroupSpec(1)],
        transport=NcclSettings(backend="nccl" if cuda else "gloo"),
        enable_immediate_recovery=True,
        engine=EngineSpec(model_path=str(model_dir), **engine_options),
        start_timeout_s=300.0,
        request_timeout_s=120.0,
    )
    result["fleet"] = {
        "groups": 2,
        "transport": "nccl",
        "nccl_backend": config.nccl.backend,
        "engine": "reference engine, vLLM dialect",
        "engine_device": engine_options["device"],
        "max_completion_length": length,
    }

    def snapshot() -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    synced = [snapshot()]
    syncs: list[dict[str, Any]] = []
    killed: dict[str, Any] = {}
    trainer_box: list[Any] = []
    t_start = time.perf_counter()
    with RolloutFleet(config) as fleet:
        result["fleet"]["start_s"] = round(time.perf_counter() - t_start, 3)
        result["initial_check"] = check_fleet(fleet, synced[0], cuda)

        armed: dict[str, str] = {}

        def on_progress(gid: str, tokens: int) -> None:
            step = trainer_box[0].state.global_step if trainer_box else -1
            if (
                step == args.crash_at
                and gid == armed.get("group")
                and tokens >= KILL_AFTER_TOKENS
                and not killed
            ):
                pids = list(fleet.launcher(gid).rank_pids)
                killed.update(group=gid, tokens=tokens, pids=pids, at=time.time())
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)

        def on_sync(report: SyncReport) -> None:
            done = time.time()
            if report.version == args.crash_at and not armed:
                # the crash step's generation comes next: hold one of the victim's generations
                victim = sorted(g.group_id for g in fleet.registry.routable())[0]
                stall(fleet.launcher(victim).url, KILL_AFTER_TOKENS + 1)
                armed["group"] = victim
            synced.append(snapshot())
            t = time.perf_counter()
            checks = check_fleet(fleet, synced[-1], cuda)
            syncs.append(
                {
                    "version": report.version,
                    "sync_s": round(done - report.started_at, 4),
                    "updated": list(report.updated),
                    "failed": list(report.failed),
                    "timings": {k: round(v, 4) for k, v in report.timings.items()},
                    "update_s": {
                        g: round(r.seconds, 4)
                        for g, r in report.update_results.items()
                        if getattr(r, "seconds", None) is not None
                    },
                    "check_s": round(time.perf_counter() - t, 3),
                    "checks": checks,
                }
            )

        grpo = GRPOConfig(
            output_dir=str(work / "grpo"),
            use_cpu=not cuda,
            use_vllm=True,  # no vLLM here: the fleet serves
            bf16=False,  # float32 like the engines: TRL's logprob comparison stays exact
            fp16=False,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            num_generations=4,
            max_completion_length=length,
            max_steps=args.steps,
            logging_steps=1,
            report_to=[],
            learning_rate=1e-3 if cuda else 1e-2,
            save_strategy="no",
            seed=0,
            dataloader_num_workers=0,
        )
        trainer = RollsafeGRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **_: [len(c) / 10.0 for c in completions],
            args=grpo,
            train_dataset=Dataset.from_dict({"prompt": PROMPTS * 8}),
            processing_class=tokenizer,
            fleet=fleet,
            fleet_options={"on_sync": on_sync},
        )
        trainer_box.append(trainer)
        env["trainer_device"] = str(next(model.parameters()).device)
        # streamed as an RL run's long completions are (short ones would be read whole:
        # Router.whole_up_to), so that the kill lands mid-generation
        fleet.router.whole_up_to = 0
        fleet.router.on_progress = on_progress
        t_train = time.perf_counter()
        train_out = trainer.train()
        result["train_s"] = round(time.perf_counter() - t_train, 3)
        fleet.router.on_progress = None
        recovered = fleet.wait_recoveries(timeout=300)
        final = check_fleet(fleet, synced[-1], cuda)
        recoveries = [r.as_dict() for r in fleet.recoveries()]
        generation = trainer.fleet_generation

    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    key = "sampling/sampling_logp_difference/max"
    logp_diff = [h[key] for h in trainer.state.log_history if key in h]
    history = [
        {
            "trainer_step": r.trainer_step,
            "fleet_version": r.fleet_version,
            "completions": len(r.completions),
            "continued": r.continued,
            "stale_tokens": r.stale_tokens,
            "groups": sorted({c.group_id for c in r.completions}),
        }
        for r in generation.history
    ]
    token_versions_ok = all(
        c.token_versions() == [r.trainer_step] * c.num_tokens
        for r in generation.history
        for c in r.completions
    )
    victim = killed.get("group")
    rec = [r for r in recoveries if r["group_id"] == victim]
    active_at = rec[-1]["active_at"] if rec else None
    result.update(
        steps=trainer.state.global_step,
        losses=losses,
        training_loss=train_out.training_loss,
        sampling_logp_difference_max=logp_diff,
        syncs=syncs,
        sync_s=[s["sync_s"] for s in syncs],
        generations=history,
        crash={
            **{k: v for k, v in killed.items()},
            "step": args.crash_at,
            "kill_to_active_s": round(active_at - killed["at"], 3)
            if active_at is not None and killed
            else None,
            "continued_completions": generation.history[args.crash_at].continued
            if len(generation.history) > args.crash_at
            else None,
        },
        recoveries=recoveries,
        final_check=final,
    )
    serving_equal = all(
        all(row["equal"] for row in s["checks"].values() if row["state"] == "active")
        and any(row["state"] == "active" for row in s["checks"].values())
        for s in syncs
    )
    result["checks"] = {
        "initial_weights_equal": all(r.get("equal") for r in result["initial_check"].values()),
        "trained_all_steps": trainer.state.global_step == args.steps,
        "losses_finite": len(losses) == args.steps and all(math.isfinite(x) for x in losses),
        "one_sync_per_step": [s["version"] for s in syncs] == list(range(1, args.steps)),
        "every_sync_ok_and_serving_engines_equal": serving_equal,
        "generation_versions_match_steps": [h["fleet_version"] for h in history]
        == list(range(args.steps)),
        "every_token_from_the_steps_version": token_versions_ok,
        "engine_killed_mid_generation": bool(killed),
        "cut_completion_continued": bool(result["crash"]["continued_completions"]),
        "victim_recovered": recovered
        and bool(rec)
        and rec[-1]["status"] == "active"
        and active_at is not None,
        "final_weights_equal": bool(final) and all(r.get("equal") for r in final.values()),
        "engine_logprobs_match_trainer": len(logp_diff) == args.steps
        and all(d < 0.1 for d in logp_diff),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result: dict[str, Any] = {
        "what": "TRL GRPOTrainer through a RolloutFleet: reference engines (vLLM dialect), "
        "transport nccl, one engine SIGKILLed mid-generation",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "env": versions(),
        "ok": False,
    }
    t0 = time.perf_counter()
    try:
        run(args, result)
    except BaseException as exc:  # recorded, then re-raised as the exit status
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
    result["elapsed_s"] = round(time.perf_counter() - t0, 3)
    checks = result.get("checks", {})
    result["ok"] = "error" not in result and bool(checks) and all(checks.values())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str))
    print(
        json.dumps(
            {
                "ok": result["ok"],
                "checks": checks,
                "sync_s": result.get("sync_s"),
                "crash": result.get("crash"),
                "error": result.get("error"),
            },
            indent=1,
            default=str,
        )
    )
    if "traceback" in result:
        print(result["traceback"], file=sys.stderr)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
