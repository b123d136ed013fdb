"""Settle: on every way out of a run, everything it started shuts down.

Owns :func:`shutting_down`, the context the run's phases execute in: whether they finish, raise,
or are interrupted by Ctrl-C or SIGTERM (:func:`exit_on_sigterm` turns it into ``SystemExit``),
it stops the rollout load, closes the fleet (its engines), closes the trainer (the actor and the
local Ray: every process of its session gone, by pid), shuts down the ``--nodes`` cluster (every
node it started and their processes: ``DemoRun.stack``), restores the SIGTERM handler, removes
the scratch and Ray directories (nothing the demo started runs any more, so nothing writes
there), and says so when interrupted. What could not be ended or removed is named, with the
processes holding it. A run that failed (a check broke, or a phase raised) keeps its engines'
logs first: :func:`keep_engine_logs` copies them into the report directory.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from rollsafe.demo.state import DemoRun
from rollsafe.demo_trainer import RayTrainer
from rollsafe.processes import processes_using

__all__ = ["ENGINE_LOGS", "exit_on_sigterm", "keep_engine_logs", "shutting_down"]

#: where a failed run's engine logs are kept, in its report directory
ENGINE_LOGS = "engine-logs"


def exit_on_sigterm() -> Callable[[], None]:
    """Turn the first SIGTERM into ``SystemExit(143)`` so the demo's cleanup runs; return undo.

    Only in the main thread (signal handlers cannot be set elsewhere). A second SIGTERM during
    the cleanup gets the previous handler. ``ray.init`` replaces it with its own equivalent
    (``sys.exit(15)``), so with the trainer actor the exit status is 15 (and ``init_ray``
    keeps Ray's C++ failure handler, which would abort the cleanup 3 s later, out of its way).
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, previous)
        raise SystemExit(128 + signum)

    def undo() -> None:
        signal.signal(signal.SIGTERM, previous)

    signal.signal(signal.SIGTERM, handler)
    return undo


@contextmanager
def shutting_down(run: DemoRun) -> Iterator[None]:
    """Run the block, then shut down what it started (also on an error, Ctrl-C or SIGTERM)."""
    restore_sigterm = exit_on_sigterm()
    interrupted = ""
    raised = False
    try:
        yield
    except (KeyboardInterrupt, SystemExit) as exc:
        interrupted = type(exc).__name__
        raise
    except BaseException:
        raised = True
        raise
    finally:
        _shut_down(run, restore_sigterm, interrupted, failed=raised or bool(run.failures))


def keep_engine_logs(work: Path, out: Path) -> Path | None:
    """Copy the engines' logs of a failed run (``work/logs``: every engine's and standby's
    output, the ones on other Ray nodes of a local cluster too) to ``out/engine-logs`` before
    the scratch directory goes; the copy's path, or None when there was nothing to keep or it
    could not be copied (said, not raised: the shutdown goes on)."""
    logs = work / "logs"
    if not logs.is_dir() or not any(logs.iterdir()):
        return None
    kept = out / ENGINE_LOGS
    try:
        shutil.copytree(logs, kept, dirs_exist_ok=True)
    except (OSError, shutil.Error) as exc:
        print(f"note: the engines' logs could not be kept in {kept}: {exc}")
        return None
    return kept


def _shut_down(
    run: DemoRun, restore_sigterm: Callable[[], None], interrupted: str, *, failed: bool
) -> None:
    if run.load_or_none is not None:
        run.load_or_none.close()
    try:
        if run.fleet_or_none is not None:
            with run.timed("close (fleet, engines)"):
                run.fleet_or_none.close()
    finally:
        try:
            if run.trainer_or_none is not None:
                with run.timed("close (trainer actor, Ray)" if run.actor else "close (trainer)"):
                    run.trainer_or_none.close()
        finally:
            with run.timed("close (Ray cluster)") if run.nodes else contextlib.nullcontext():
                run.stack.close()  # --nodes: the local cluster's nodes, RAY_ADDRESS restored
        restore_sigterm()
        trainer = run.trainer_or_none
        if isinstance(trainer, RayTrainer) and trainer.ray_stop and trainer.ray_stop.left:
            left = trainer.ray_stop.describe_left()
            print(f"note: processes of the trainer's Ray outlived SIGKILL: {left}")
        if failed:
            kept = keep_engine_logs(Path(run.work), Path(run.out))
            if kept is not None:
                print(f"the run failed: the engines' logs are kept in {kept}")
        for scratch in (run.work, run.ray_dir):
            if scratch is not None:
                _remove_tree(Path(scratch))
        if interrupted:
            print(
                f"demo interrupted ({interrupted}): engines"
                + (", trainer actor and Ray" if run.actor else " and trainer")
                + (f" and the {run.nodes}-node Ray cluster" if run.nodes else "")
                + " shut down"
            )


def _remove_tree(path: Path) -> None:
    """Remove ``path`` and everything under it; when it cannot be, say what is left and which
    processes hold it (everything the demo started has ended by now: a holder is a leak)."""
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        left = sorted(str(p.relative_to(path)) for p in path.rglob("*"))[:10]
        holders = "; ".join(
            f"{info.describe()} holding {files[:3] or 'no file (its command line names it)'}"
            for info, files in processes_using(path)
        )
        print(
            f"note: could not remove {path} (in it: {left}; held by: {holders or 'no process'});"
            " remove it by hand"
        )
