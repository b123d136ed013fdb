"""``rollsafe demo``: a trainer actor, a rollout fleet, weight syncs, async exports and a SIGKILL.

On one CPU machine with a local Ray (``RAY_ADDRESS`` joins a cluster instead): a Ray trainer
actor (:class:`~rollsafe.demo_trainer.RayTrainer`) trains a tiny Llama (the reference engine's
``make_tiny_model`` config, seed-fixed) with SGD on synthetic token data; a
:class:`~rollsafe.fleet.fleet.RolloutFleet` of ``--groups`` reference-engine groups (the second
has 2 ranks) serves rollouts through the router from background threads during each step's
rollout phase; after each train step the driver fetches the actor's weights through the object
store and syncs them over ``--transport`` (``ipc`` or ``nccl``, gloo on CPU), and every version
is exported asynchronously. During step ``--crash-at``'s rollout rank 1 of the 2-rank group is
SIGKILLed. ``--trainer inprocess`` runs the same trainer in the driver (no Ray).
``--engine vllm`` runs it on real vLLM servers instead (one rank per group, nccl/gloo, the
second group's server SIGKILLed, every step also checked by the behavioural probe).
``--nodes N`` runs it on a local Ray cluster of N nodes (a head for the trainer actor, N - 1
workers for the engine groups, ``FleetConfig(placement="ray")``, reference engines, nccl/gloo)
and instead of the SIGKILL removes the second group's worker node mid-rollout; the report adds
the node loss's phases and checks (:mod:`rollsafe.demo.nodes`).

It prints live progress, then a timeline of every machine transition, the recovery latency
(crash -> ``active`` with current weights), the throughput lost, the per-step weights checksum
check (every serving engine against the trainer actor's own digest) and where the time went,
the trainer actor's round trips included; it writes ``<out>/timeline.jsonl`` (with the syncs,
recoveries, the crash and the request rates: :mod:`rollsafe.observe.runfile`),
``<out>/timeline.svg`` (its picture), ``<out>/fleet.json``, ``<out>/paths.md`` (the paths the
machines actually took, as mermaid ``stateDiagram-v2``) and ``<out>/summary.json``;
``rollsafe report <out>`` reads them back. Exit status 1 if an invariant broke: a request
admitted to a non-``active`` group, an engine serving weights other than the trainer's, a failed
step, or the crashed group never returning. Engines, the trainer actor and the local Ray are shut
down on the way out, also on an error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from rollsafe.demo.figures import analyse
from rollsafe.demo.nodes import figures as node_figures
from rollsafe.demo.options import DemoOptions, add_arguments, options_problem
from rollsafe.demo.progress import print_step
from rollsafe.demo.report import collect, report
from rollsafe.demo.rollout import rollout, start_load
from rollsafe.demo.settle import shutting_down
from rollsafe.demo.setup import begin, start
from rollsafe.demo.sync import sync
from rollsafe.demo.train import train
from rollsafe.demo.verify import check_final, check_recovered, check_start, check_step

__all__ = ["main", "run_demo"]


def run_demo(opts: DemoOptions) -> int:
    """The demo, phase by phase (each phase is a module of :mod:`rollsafe.demo`); the exit
    status: 0, 1 if an invariant broke, 2 for options it refuses."""
    problem = options_problem(opts)
    if problem is not None:
        print(problem)
        return 2
    run = begin(opts)  # setup: report and scratch directories, the clock, the banner
    with shutting_down(run):  # settle: on every way out, everything started here stops
        start(run)  # setup: tiny model, trainer (Ray actor or in-process), fleet
        check_start(run)  # verify: the engines start on the trainer's weights
        start_load(run)  # rollout: the client threads, idle until a rollout
        for step in range(1, opts.steps + 1):
            record = rollout(run, step)  # rollout: requests flow; at --crash-at a rank dies
            train(run, record)  # train: one optimizer step
            sync(run, record)  # sync: the new version to every engine
            check_step(run, record)  # verify: every active engine == the trainer
            run.steps.append(record)
            print_step(run, record)  # progress: the step's line
        run.load.close()  # rollout: the load stops
        check_final(run)  # verify: recoveries done, every group back on current weights
        if run.nodes:
            node_figures(run)  # nodes: the node loss's phases, requests and checks
        collect(run)  # report: the fleet's timeline, snapshot and recoveries, while it is up
    figures = analyse(run)  # figures: recovery latency, throughput lost, continuation
    check_recovered(run, figures.recovery)  # verify: the crashed group came back
    return report(run, figures)  # report: the files, the printout, the exit status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollsafe demo", description=__doc__)
    add_arguments(parser)
    return run_demo(parser.parse_args(argv, namespace=DemoOptions()))
