"""A local Ray that this process started, ended as a user expects: a SIGTERM runs the driver's
cleanup to its end, and the shutdown waits for every process of the session, by pid, before the
session's directory is removed.

Two facts about the pinned Ray (2.60) behind "Ray's directory still there after a SIGTERM":

1. **A SIGTERMed driver aborts 3 s later.** The driver's core worker installs absl's failure
   signal handler, whose signals include SIGTERM. On a SIGTERM it prints
   ``*** SIGTERM received at time=... ***``, arms ``alarm(3)`` with a handler that calls
   ``abort()``, then passes the signal on to Python (``ray.init``'s handler raises
   ``SystemExit``). Nothing cancels the alarm: 3 s after the signal the process dies of SIGABRT
   wherever its cleanup is -- on a loaded machine before it removed its files. Measured beside
   two busy loops: the demo SIGTERMed mid-rollout exited with -6 after 3.1-3.3 s in 6 runs of
   6, its Ray directory left in 4. :func:`sigterm_back_to_python` (called by
   :func:`~rollsafe.adapters.ray.init_ray` after ``ray.init``) hands SIGTERM back to the Python
   handler that ``ray.init`` set (re-installing it replaces the C handler); the failure handler
   stays for the signals of a real crash (SIGSEGV, SIGABRT, ...).
2. **``ray.shutdown()`` waits only for what ``ray.init`` spawned, and briefly.** It stops the
   GCS, raylet, dashboard, monitor and log monitor (SIGTERM, 1 s, SIGKILL, 1 s; without
   ``wait_for_processes`` a process still there is not waited for). The raylet's own children
   -- the workers (actors, idle workers) and the dashboard and runtime-env agents -- are not
   in that list: a raylet SIGKILLed after its second orphans them, and they go on writing their
   logs under the session directory until they notice. :func:`stop_local_ray` makes this process
   a child subreaper for the while (Linux ``PR_SET_CHILD_SUBREAPER``: an orphaned worker becomes
   its child, not init's), finds every process of the session -- a descendant of this process
   that names the directory or holds a file under it (a renamed worker still holds its logs),
   and the descendants of those -- before the shutdown and again after it, then ends each by
   pid and start time (SIGTERM, ``grace_s``, SIGKILL), reaps it, and waits until each is gone;
   any that is not (a process in uninterruptible sleep outlives SIGKILL) is returned, with the
   files it holds, for the caller to name. A process of someone else reading the logs (a
   ``tail -f``) is not a descendant: it is left alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rollsafe.processes import (
    ProcessInfo,
    descendants,
    files_under,
    live_processes,
    process_info,
    processes_using,
    same_process_alive,
)

__all__ = ["RayStopReport", "sigterm_back_to_python", "stop_local_ray"]

#: how often the waits look again (s)
POLL_S = 0.05


def sigterm_back_to_python() -> bool:
    """Make SIGTERM reach this process's Python handler directly (the one ``ray.init`` set, or
    whichever was set from Python since), not Ray's C++ failure handler in front of it, whose
    3 s alarm aborts the cleanup that the Python handler starts. Main thread only (signal
    handlers cannot be set elsewhere); a no-op when SIGTERM's handler was not set from Python.
    Returns True when it re-installed the handler."""
    if threading.current_thread() is not threading.main_thread():
        return False
    handler = signal.getsignal(signal.SIGTERM)
    if handler is None:
        return False
    signal.signal(signal.SIGTERM, handler)
    return True


@dataclass
class RayStopReport:
    """What :func:`stop_local_ray` found and ended."""

    #: every process of the session seen before or after the shutdown
    processes: list[ProcessInfo] = field(default_factory=list)
    #: those still running once the shutdown returned (ended here, by pid)
    outlived_shutdown: list[ProcessInfo] = field(default_factory=list)
    #: those SIGKILLed because ``grace_s`` after their SIGTERM they still ran
    killed: list[ProcessInfo] = field(default_factory=list)
    #: those that could not be ended (still running ``kill_wait_s`` after SIGKILL), with the
    #: files each holds under the directory
    left: list[tuple[ProcessInfo, list[str]]] = field(default_factory=list)
    shutdown_s: float = 0.0
    wait_s: float = 0.0

    def describe_left(self) -> str:
        """The processes left, one clause each (empty when none)."""
        return "; ".join(
            f"{info.describe()} holding {files[:3] or 'no file (its command line names it)'}"
            for info, files in self.left
        )


def _key(info: ProcessInfo) -> tuple[int, int]:
    return (info.pid, info.start)


#: Linux prctl options: make orphaned descendants this process's children, and read that flag
_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37


def _subreaper(on: bool | None) -> bool | None:
    """Set this process's child-subreaper flag (``None``: only read it); return the previous
    value, or ``None`` where prctl is not available (not Linux)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        flag = ctypes.c_int(0)
        if libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) != 0:
            return None
        if on is not None and libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
            return None
        return bool(flag.value)
    except (OSError, AttributeError):
        return None


def _session_processes(directory: str, known: dict[tuple[int, int], ProcessInfo]) -> None:
    """Add to ``known`` every live descendant of this process that names ``directory`` or holds
    a file under it, and every live descendant of a process in ``known`` (one that was found
    before it was orphaned is still followed, by pid and start time)."""
    procs = live_processes()
    for info in descendants(os.getpid(), procs):
        if directory in info.command or files_under(info.pid, directory):
            known.setdefault(_key(info), info)
    for info in list(known.values()):
        now = procs.get(info.pid)
        if now is not None and now.start == info.start:
            for child in descendants(info.pid, procs):
                known.setdefault(_key(child), child)


def _reap(info: ProcessInfo) -> None:
    """Collect ``info``'s exit status when it is a zombie child of this process (an orphan this
    subreaper adopted, or one Ray did not wait for)."""
    now = process_info(info.pid)
    if now is not None and (now.start, now.state, now.ppid) == (info.start, "Z", os.getpid()):
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(info.pid, os.WNOHANG)


def _signal(info: ProcessInfo, sig: int) -> None:
    if same_process_alive(info):  # the very process (pid and start time), never a reused pid
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(info.pid, sig)


def _wait(
    directory: str, known: dict[tuple[int, int], ProcessInfo], deadline: float, sig: int
) -> list[ProcessInfo]:
    """Until every process in ``known`` is gone or ``deadline``: look for new processes of the
    session (sent ``sig`` at once), reap those that ended; return those still running."""
    signalled: set[tuple[int, int]] = set(known)
    while True:
        _session_processes(directory, known)
        for key in set(known) - signalled:
            _signal(known[key], sig)
            signalled.add(key)
        for info in known.values():
            _reap(info)
        alive = [info for info in known.values() if same_process_alive(info)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(POLL_S)


def stop_local_ray(
    shutdown: Callable[[], object],
    directory: str | os.PathLike[str],
    *,
    grace_s: float = 5.0,
    kill_wait_s: float = 30.0,
) -> RayStopReport:
    """Call ``shutdown`` (``ray.shutdown``, ``Cluster.shutdown``) of a Ray whose files are under
    ``directory`` (``ray.init(_temp_dir=)``, the cluster's ``RAY_TMPDIR``), then end every
    process of that session that outlived it: SIGTERM, ``grace_s``, SIGKILL, and wait up to
    ``kill_wait_s`` for each to be gone. The session's processes are this process's
    descendants that name ``directory`` in their command line or hold a file under it (a
    renamed worker still holds its logs), and their descendants, looked for before the shutdown
    and again after it (this process is a child subreaper meanwhile, so the orphans stay its
    descendants). Only then may ``directory`` be removed: nothing of the session writes there
    any more. Returns what it found; ``left`` lists what could not be ended."""
    path = os.path.abspath(os.fspath(directory))
    report = RayStopReport()
    known: dict[tuple[int, int], ProcessInfo] = {}
    was_subreaper = _subreaper(True)
    _session_processes(path, known)
    t0 = time.monotonic()
    try:
        shutdown()
    finally:
        report.shutdown_s = time.monotonic() - t0
        t1 = time.monotonic()
        _session_processes(path, known)
        report.outlived_shutdown = [i for i in known.values() if same_process_alive(i)]
        for info in report.outlived_shutdown:
            _signal(info, signal.SIGTERM)
        alive = _wait(path, known, time.monotonic() + grace_s, signal.SIGTERM)
        report.killed = list(alive)
        for info in alive:
            _signal(info, signal.SIGKILL)
        # from here on a process that shows up is SIGKILLed at once
        alive = _wait(path, known, time.monotonic() + kill_wait_s, signal.SIGKILL)
        held = {info.pid: files for info, files in processes_using(path)}
        report.left = [(info, held.get(info.pid, [])) for info in alive]
        report.processes = list(known.values())
        report.wait_s = time.monotonic() - t1
        if was_subreaper is False:
            _subreaper(False)
    return report
