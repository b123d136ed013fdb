"""How the engine's rank processes are started, and the start-up protocol they follow.

Owns :class:`RankOptions`, :func:`start_ranks` and the rank side's entry point. Importing torch
and transformers is most of a cold start (seconds of CPU per process), so ranks ``1..N-1`` must
not pay it again after rank 0 did:

* ``fork`` (CPU engines, the default there): rank 0 imports everything first (see
  ``__main__.preload``), then forks; children start with every module already imported. Used
  only while the process has a single thread (checked in ``/proc/self/task``; OpenMP and
  OpenBLAS pools are not fork-safe) and never with CUDA; otherwise ``spawn`` is used;
* ``spawn`` (CUDA, or ``--rank-start-method spawn``): rank 0 starts the children before its own
  heavy imports (this module imports neither torch nor transformers), so every rank imports at
  the same time instead of one after the other.

The protocol over each rank's control pipe, the same for both:

1. the child loads its shard and sends ``("loaded", pid, None)`` (or ``("error", kind, msg)``
   and exits);
2. rank 0, once every rank is loaded, creates the group's ``TCPStore`` on a port the kernel
   picks (bound by the store itself, so it cannot be lost to another process) and sends
   ``("join", {"port": port})``; children connect only after the store listens;
3. every rank joins the rank group (gloo; NCCL with ``--rank-backend nccl``), a rendezvous that
   starts only when all ranks are loaded, so slow imports under load cannot eat the collective
   timeout; the child sends ``("ready", pid, None)``; rank 0 joins on a helper thread while it
   watches the children, so one that fails or dies here fails the start at once;
4. the child serves ``(op, args)`` requests until ``("shutdown", {})`` or pipe EOF.

A start-up fault hook for tests (only with ``ROLLSAFE_FAULT_INJECTION=1``):
``ROLLSAFE_FAULT_RANK_START="RANK:SECONDS"`` delays that rank's start by ``SECONDS``;
``"RANK:fail"`` makes it fail to start.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

__all__ = [
    "START_FAULT_ENV",
    "RankChild",
    "RankOptions",
    "StartupClock",
    "child_entry",
    "die_with_parent",
    "fork_is_safe",
    "spawn_ranks",
    "start_ranks",
    "thread_count",
]

PR_SET_PDEATHSIG = 1
START_FAULT_ENV = "ROLLSAFE_FAULT_RANK_START"


@dataclass(frozen=True)
class RankOptions:
    """Start-up options shared by every rank."""

    model_path: str
    load_format: str = "auto"
    device: str = "cpu"
    dtype: str | None = None
    seed: int = 0
    world_size: int = 1
    collective_timeout_s: float = 30.0
    weight_group_timeout_s: float = 120.0
    threads: int = 0  # torch intra-op threads per rank; 0 = (cpus - 1) // ranks, at least 1
    rank_backend: str = "gloo"  # the engine's own group: "gloo" (host copies) or "nccl"
    start_timeout_s: float = 180.0  # loading + joining the rank group, per start
    start_method: str = "auto"  # "auto" (fork on CPU when safe, else spawn), "fork", "spawn"
    nnodes: int = 1  # nodes the ranks span (``--nnodes``; :mod:`.nodes`)
    node_rank: int = 0  # this node's rank among them (0: the head, which serves HTTP)
    dist_init_host: str = "127.0.0.1"  # the head's address (``--dist-init-addr``'s host)

    @property
    def ranks_per_node(self) -> int:
        """The ranks each node runs (``world_size // nnodes``)."""
        return self.world_size // self.nnodes

    def planned_start_method(self) -> str:
        """``fork`` or ``spawn`` as configured (:func:`start_ranks` may still fall back)."""
        if self.start_method != "auto":
            return self.start_method
        return "fork" if self.device == "cpu" else "spawn"

    def torch_threads(self) -> int:
        if self.threads > 0:
            return self.threads
        # leave a core for rank 0's HTTP loop; oversubscribed OpenMP spinning is very slow
        return max(1, ((os.cpu_count() or 1) - 1) // self.ranks_per_node)


class StartupClock:
    """Seconds since start-up began, per named phase (reported in the ready line)."""

    def __init__(self, t0: float | None = None) -> None:
        self.t0 = time.monotonic() if t0 is None else t0
        self.phases: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        self.phases[phase] = round(time.monotonic() - self.t0, 3)


@dataclass
class RankChild:
    """Rank 0's handle on one spawned rank: the process and rank 0's end of its pipe."""

    rank: int
    proc: Any  # multiprocessing.Process (spawn context)
    conn: Any  # multiprocessing.connection.Connection


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent (thread) dies; exit now if it already did."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:
        pass  # not Linux: the pipe-EOF watchdog still applies
    if os.getppid() != parent_pid:  # parent died before prctl took effect
        os._exit(1)


def start_fault(rank: int, environ: dict[str, str] | None = None) -> str | None:
    """The injected start-up fault of ``rank`` (``"fail"`` or a delay in seconds), if any."""
    env = environ if environ is not None else os.environ
    if env.get("ROLLSAFE_FAULT_INJECTION") != "1":
        return None
    for item in env.get(START_FAULT_ENV, "").split(","):
        target, _, what = item.strip().partition(":")
        if target.strip() == str(rank) and what.strip():
            return what.strip()
    return None


def apply_start_fault(rank: int) -> None:
    """Honour :data:`START_FAULT_ENV` for ``rank`` (tests only; see the module docstring)."""
    fault = start_fault(rank)
    if fault is None:
        return
    if fault == "fail":
        raise RuntimeError(f"injected start-up failure of rank {rank} ({START_FAULT_ENV})")
    time.sleep(float(fault))


def thread_count() -> int | None:
    """Threads of this process (``None`` where ``/proc`` cannot tell)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


#: Native threads a fork may leave behind safely, by ``comm`` name: jemalloc's page-purging
#: thread (started by a library that bundles jemalloc, e.g. on GPU hosts while transformers
#: imports); jemalloc's own ``pthread_atfork`` handlers stop it and hold every allocator lock
#: across the fork, and the child starts without it.
FORK_SAFE_THREADS = frozenset({"jemalloc_bg_thd"})


def other_threads() -> list[str] | None:
    """``comm`` names of this process's threads other than the main one and the
    :data:`FORK_SAFE_THREADS` (``None`` where ``/proc`` cannot tell)."""
    main = str(os.getpid())
    names: list[str] = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tasks:
        if tid == main:
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue  # the thread ended meanwhile
        if name not in FORK_SAFE_THREADS:
            names.append(name)
    return names


def fork_is_safe(opts: RankOptions) -> bool:
    """True when forking now cannot inherit a thread pool or CUDA state (see the docstring)."""
    return opts.device == "cpu" and thread_count() == 1


def start_ranks(opts: RankOptions, method: str = "spawn") -> tuple[list[RankChild], str]:
    """Start this node's ranks after rank 0 (``1..ranks_per_node-1``; all but rank 0 on one
    node) with ``method``; returns them and the method used.

    ``fork`` falls back to ``spawn`` unless :func:`fork_is_safe`. Call it from the main thread:
    ``PR_SET_PDEATHSIG`` fires when the *thread* that started a child exits, so children started
    from a short-lived worker thread would die with it.
    """
    if method == "fork" and not fork_is_safe(opts):
        method = "spawn"
    return spawn_ranks(opts, method), method


def spawn_ranks(opts: RankOptions, method: str = "spawn") -> list[RankChild]:
    """Start the head node's ranks ``1..ranks_per_node-1`` (``1..world_size-1`` on one node)
    with the ``multiprocessing`` start ``method`` as is."""
    ctx: Any = mp.get_context(method)
    children: list[RankChild] = []
    try:
        for r in range(1, opts.ranks_per_node):
            parent_conn, child_conn = ctx.Pipe()
            p = ctx.Process(
                target=child_entry,
                args=(r, opts, child_conn, os.getpid()),
                name=f"rollsafe-engine-rank{r}",
                daemon=True,
            )
            p.start()
            child_conn.close()
            children.append(RankChild(r, p, parent_conn))
    except BaseException:
        for c in children:
            c.proc.kill()
        raise
    return children


def child_entry(rank: int, opts: RankOptions, conn: Any, parent_pid: int) -> None:
    """Entry point of a spawned rank (runs in the child; imports the heavy modules there)."""
    die_with_parent(parent_pid)
    os.environ.setdefault("OMP_NUM_THREADS", str(opts.torch_threads()))  # spawn: before torch
    try:
        from rollsafe.adapters.reference_engine.ranks import child_main
    except BaseException as exc:
        conn.send(("error", "RankFailure", f"rank {rank} failed to start: {exc!r}"))
        os._exit(1)
    child_main(rank, opts, conn)
