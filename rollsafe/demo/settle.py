"""Settle: on every way out of a run, everything it started shuts down.

Owns :func:`shutting_down`, the context the run's phases execute in: whether they finish, raise,
or are interrupted by Ctrl-C or SIGTERM (:func:`exit_on_sigterm` turns it into ``SystemExit``),
it stops the rollout load, closes the fleet (its engines), closes the trainer (the actor and the
local Ray), shuts down the ``--nodes`` cluster (every node it started: ``DemoRun.stack``),
restores the SIGTERM handler, removes the scratch and Ray directories, and says so when
interrupted.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from rollsafe.demo.state import DemoRun

__all__ = ["exit_on_sigterm", "shutting_down"]


def exit_on_sigterm() -> Callable[[], None]:
    """Turn the first SIGTERM into ``SystemExit(143)`` so the demo's cleanup runs; return undo.

    Only in the main thread (signal handlers cannot be set elsewhere). A second SIGTERM during
    the cleanup gets the previous handler. ``ray.init`` replaces it with its own equivalent
    (``sys.exit(15)``), so with the trainer actor the exit status is 15.
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
    try:
        yield
    except (KeyboardInterrupt, SystemExit) as exc:
        interrupted = type(exc).__name__
        raise
    finally:
        _shut_down(run, restore_sigterm, interrupted)


def _shut_down(run: DemoRun, restore_sigterm: Callable[[], None], interrupted: str) -> None:
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


def _remove_tree(path: Path, timeout_s: float = 10.0, quiet_s: float = 1.0) -> None:
    """Remove ``path`` and everything under it. A process or thread that was stopped a moment
    ago may still be writing there (a log line, a temp file, a directory made with its
    parents) while or just after the tree is removed, which leaves it behind: remove it again
    until it has stayed gone for ``quiet_s`` or ``timeout_s`` passed, then say so."""
    deadline = time.monotonic() + timeout_s
    gone_since: float | None = None
    while True:
        if path.exists():
            gone_since = None
            shutil.rmtree(path, ignore_errors=True)
        now = time.monotonic()
        if not path.exists():
            gone_since = now if gone_since is None else gone_since
            if now - gone_since >= quiet_s:
                return
        if now >= deadline:
            if path.exists():
                print(f"note: could not remove {path} (still in use); remove it by hand")
            return
        time.sleep(0.1)
