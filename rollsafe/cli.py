"""The ``rollsafe`` command line: ``diagrams``, ``verify``, ``bench``, ``demo``, ``report`` and
``inspect``.

Each subcommand is a thin shell over a library function, so everything it does is also callable
from Python.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from rollsafe.policy import ENGINE_TRAITS

__all__ = ["main"]


def _cmd_diagrams(args: argparse.Namespace) -> int:
    from rollsafe import diagrams

    out = Path(args.out)
    readme = None if args.no_readme else Path(args.readme)
    if args.check:
        stale = diagrams.check(out, readme)
        if stale:
            print("stale diagrams (run `rollsafe diagrams` and commit):", file=sys.stderr)
            for item in stale:
                print(f"  {item}", file=sys.stderr)
            return 1
        print(f"diagrams up to date ({len(diagrams.render_all())} files in {out})")
        return 0
    for path in diagrams.write_all(out, readme):
        print(f"wrote {path}")
    return 0


def _verify_trace(run_dir: str) -> int:
    """``rollsafe verify --trace RUN_DIR``: replay a recorded run through the model."""
    from rollsafe.observe.runfile import RunFileError
    from rollsafe.observe.stream import load_recorded
    from rollsafe.verify.replay import TraceError, replay_run

    try:
        run = load_recorded(run_dir)
        result = replay_run(run.rows, partial=run.partial)
    except (RunFileError, TraceError) as exc:
        print(f"rollsafe verify --trace: {exc}", file=sys.stderr)
        return 2
    cfg = result.config
    print(
        f"replaying {run_dir} through the verifier's model: {cfg.groups} groups of "
        f"{list(cfg.rank_counts)} ranks, {cfg.traits.kind} engines, from v{cfg.initial_version},"
        f" deltas {'on' if cfg.deltas else 'off'}, real machines and policy, every invariant of"
        " rollsafe.invariants in every replayed state",
        flush=True,
    )
    print(result.summary())
    if result.divergence is None:
        print("divergences: 0")
        return 0
    print("divergences: 1")
    print(result.divergence.format())
    return 1


def _cmd_verify(args: argparse.Namespace) -> int:
    if args.trace is not None:
        return _verify_trace(args.trace)
    from rollsafe.invariants import INVARIANTS
    from rollsafe.verify import ModelConfig, default_workers, explore

    config = ModelConfig(
        groups=args.groups,
        ranks=args.ranks,
        restart_budget=args.restart_budget,
        rearm_after=args.rearm_after,
        engine=args.engine,
        node_loss=not args.no_node_loss,
        removals=args.removals,
        deltas=not args.no_deltas,
        spares=args.spares,
        slices=args.slices,
    )
    traits = config.traits
    spares = f" + {config.spares} spare(s)" if config.spares else ""
    spares += f" over {config.slices} nodes each" if config.slices > 1 else ""
    print(
        f"exploring the composed fleet model: {config.groups} groups{spares} x {config.ranks}"
        " ranks,"
        f" {traits.kind} engines (a failed update "
        f"{'keeps' if traits.failed_update_keeps_weights else 'loses'} the old weights),"
        f" node loss {'on' if config.node_loss else 'off'}, {config.removals} removal(s),"
        f" deltas {'on' if config.deltas else 'off'},"
        f" depth {args.depth}, real machines and policy"
        f" ({len(INVARIANTS)} invariants of rollsafe.invariants in every state)",
        flush=True,
    )
    workers = args.workers if args.workers is not None else default_workers()
    if workers < 1:
        print(f"--workers must be at least 1, got {workers}")
        return 2

    def progress(level: int, states: int, frontier: int) -> None:
        if not args.quiet:
            print(f"  depth {level}: {states} states, frontier {frontier}", flush=True)

    result = explore(
        config,
        depth=args.depth,
        stop_at_first=not args.all_violations,
        max_states=args.max_states,
        progress=progress,
        workers=workers,
    )
    print(f"states explored: {result.states}")
    print(f"transitions taken: {result.transitions} ({result.refused} refused events)")
    print(
        f"time: {result.seconds:.1f} s ({result.cpu_seconds:.1f} s CPU,"
        f" {result.workers} worker{'s' if result.workers > 1 else ''})"
    )
    if not result.complete:
        print(f"stopped early at --max-states {args.max_states}: exploration incomplete")
    if result.ok:
        print("violations: 0")
        return 0 if result.complete else 3
    print(f"violations: {len(result.counterexamples)}")
    for cex in result.counterexamples[: args.show]:
        print("counterexample (shortest event trace):")
        print(cex.format())
    return 1


def _cmd_bench(args: argparse.Namespace) -> int:
    from rollsafe.bench import transitions

    return transitions.main(["--rounds", str(args.rounds), "--out", args.out])


def _cmd_inspect(args: argparse.Namespace) -> int:
    from rollsafe.diagrams import transitions_of
    from rollsafe.statemachines import MACHINES

    for cls in MACHINES:
        if args.machine and cls.__name__ != args.machine:
            continue
        print(cls.__name__)
        print("  states: " + ", ".join(s.id for s in cls.states))
        for src, dst, event, guards in transitions_of(cls):
            guard = f" [{' and '.join(guards)}]" if guards else ""
            print(f"  {event}: {src} -> {dst}{guard}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from rollsafe.demo import run_demo

    return run_demo(args)  # type: ignore[arg-type]


def _cmd_report(args: argparse.Namespace) -> int:
    from rollsafe.observe.report import run_report

    return run_report(args.path, svg=args.svg, draw=not args.no_svg)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollsafe",
        description="Formal lifecycle machines for an RL trainer's rollout fleet.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("diagrams", help="write (or --check) the mermaid diagrams of the machines")
    p.add_argument("--out", default="diagrams", help="output directory (default: diagrams)")
    p.add_argument("--readme", default="README.md", help="README whose diagram block to update")
    p.add_argument("--no-readme", action="store_true", help="leave the README alone")
    p.add_argument("--check", action="store_true", help="exit 1 naming any stale file")
    p.set_defaults(func=_cmd_diagrams)

    p = sub.add_parser(
        "verify",
        help="exhaustively explore the composed fleet model, or (--trace RUN_DIR) replay a "
        "recorded run through it",
        description="Explore the composed fleet model (the real machines and policy) to --depth "
        "and check every invariant in every state; with --trace RUN_DIR, step the same model "
        "with a recorded run (the run directory a fleet streams to, FleetConfig.run_dir; or "
        "RolloutFleet.record(), the demo's report directory) instead: "
        "every recorded transition must be one the model allows from the state the replay "
        "reached, and every invariant must hold in every replayed state. Exit 0: no violation "
        "or divergence (a record that ends early, a crashed fleet's stream, is replayed up to "
        "there and said to be partial); 1: one (the step, the recorded event and what the "
        "model allowed are printed); 2: an unreadable run, or one knowingly cut (written from "
        "memory after a run longer than memory keeps); 3: --max-states reached.",
    )
    p.add_argument(
        "--trace",
        metavar="RUN_DIR",
        default=None,
        help="replay this recorded run (a directory with stream.jsonl, the whole run as the "
        "fleet streamed it, or timeline.jsonl) through the model instead of exploring; the "
        "other options are ignored",
    )
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--restart-budget", type=int, default=2)
    p.add_argument("--rearm-after", type=int, default=2)
    p.add_argument(
        "--engine",
        choices=sorted({kind for kind, _ in ENGINE_TRAITS}),
        default="vllm",
        help="whose failure semantics to explore (default vllm: a failed update loses the "
        "weights; reference: its SGLang dialect keeps them)",
    )
    p.add_argument(
        "--no-node-loss",
        action="store_true",
        help="leave out node deaths, the watcher's reports and re-placement",
    )
    p.add_argument(
        "--no-deltas",
        action="store_true",
        help="push full weights only: no per-target DeltaBase, no delta planning (issue #28)",
    )
    p.add_argument(
        "--removals", type=int, default=1, help="groups one run may remove (default 1; 0: none)"
    )
    p.add_argument(
        "--spares",
        type=int,
        default=0,
        help="spare groups beside --groups (default 0: none; each is kept in standby at the "
        "fleet's version and promoted when a serving group leaves routing; issue #37)",
    )
    p.add_argument(
        "--slices",
        type=int,
        default=1,
        help="node slices of every group (default 1: one node each; N: groups that span N "
        "nodes, GroupSpec.ranks_per_node, the node under one slice may die alone; issue #37)",
    )
    p.add_argument("--max-states", type=int, default=None, help="stop after this many states")
    p.add_argument("--all-violations", action="store_true", help="keep going after the first")
    p.add_argument("--show", type=int, default=3, help="counterexamples to print")
    p.add_argument("--quiet", action="store_true", help="no per-depth progress")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="processes expanding each depth's states (default: the usable cores, at most 8;"
        " the result is the same with 1)",
    )
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("bench", help="median cost of a guarded transition per machine")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default="benchmarks/results/transitions.json")
    p.set_defaults(func=_cmd_bench)

    from rollsafe.demo import add_arguments as add_demo_arguments

    p = sub.add_parser("demo", help="trainer + rollout fleet + SIGKILL, end to end on CPU")
    add_demo_arguments(p)
    p.set_defaults(func=_cmd_demo)

    from rollsafe.observe.report import add_arguments as add_report_arguments

    p = sub.add_parser(
        "report",
        help="open a recorded run (demo-report/ or RolloutFleet.record()): summary, recovery "
        "breakdown, invariant checks, timeline.svg; exit 2 on a bad file",
    )
    add_report_arguments(p)
    p.set_defaults(func=_cmd_report)

    p = sub.add_parser("inspect", help="print every machine's states, events and guards")
    p.add_argument("machine", nargs="?", help="one machine class name")
    p.set_defaults(func=_cmd_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
