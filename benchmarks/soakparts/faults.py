"""The soak's injectors: each fault kind of :mod:`schedule` put into the running rig.

:class:`Injector` owns how each kind is produced and what it left to undo:

Each kind, and how it is produced (real unless said):

* ``sigkill_rank``: ``SIGKILL`` of one engine rank's process (the reference engine's rank by its
  pid from the Ray actor; the real vLLM's server process);
* ``sigstop``: ``SIGSTOP`` of the engine's whole process tree (server, ranks, their children);
  ``SIGCONT`` after ``cont_after_s`` if the same processes still exist, or never;
* ``update_failed``: the next sync's update of the group names a tensor the model lacks (the
  engine fails the update part-way, as ``tests/test_real_vllm_fleet.py`` does);
* ``update_poisoned``: the trainer's next version holds a NaN (a diverged step), synced to both
  fleets;
* ``kill_during_sync``: ``SIGKILL`` of the group's server process 50 ms after its weight
  update's first call went out;
* ``node_replace``: the Ray node holding the group removed (``allow_graceful=False``: its raylet
  and every process on it die), a new node added ``add_after_s`` later;
* ``export_disk_full``: the fleet's export filesystem (a ``tmpfs`` of a fixed size) filled but
  64 KiB for the next ``syncs`` syncs;
* ``export_slow``: *emulated*, the next export's writer held ``delay_s`` (:mod:`slow_export`:
  no way to slow one filesystem down here);
* ``port_blackhole``: every TCP packet to or from the engine's port dropped (iptables, else
  tc on ``lo``: :mod:`blackhole`) for ``seconds``, or until the engine's server exits (the fleet
  replaced it: its port may then be anyone's);
* ``trainer_exception``: the trainer raises in the middle of a sync: while the transport reads
  its tensors (``register``), or in a colocated hook (``offload_trainer``, ``onload_engines``,
  ``onload_trainer``).

Faults that act through a sync are *armed* here and fired by the soak's next sync
(:meth:`Injector.sync_weights` hands the sync its weights; the hooks and the target wrapper are
installed once, at start, and do nothing unless armed). :meth:`Injector.not_injectable` lists
the kinds this machine cannot produce, with why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import urlparse

import torch
from blackhole import Blackhole, available
from schedule import GROUPS, Fault

from rollsafe.processes import ProcessInfo, descendants, process_info, same_process_alive

__all__ = ["Injector", "TrainerException"]

#: delay between a weight update's first call and the SIGKILL of ``kill_during_sync`` (s)
KILL_AFTER_S = 0.05


class TrainerException(RuntimeError):
    """What the soak's trainer raises in the middle of a sync (``trainer_exception``)."""


class _RaisingWeights(Mapping[str, torch.Tensor]):
    """The trainer's tensors, read by the transport's register; raises after half of them (a
    trainer whose parameter gather fails part-way)."""

    def __init__(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._weights = weights
        self._names = list(weights)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._weights[name]

    def __len__(self) -> int:
        return len(self._names)

    def __iter__(self) -> Iterator[str]:
        for i, name in enumerate(self._names):
            if i == len(self._names) // 2:
                raise TrainerException(f"soak: the trainer failed gathering {name!r}")
            yield name


class _FaultyClient:
    """Forwards to a group's real client; its weight update either names a tensor the model
    lacks (``fail``: the engine fails the update) or SIGKILLs the engine shortly after the
    update's first call went out (``kill``)."""

    def __init__(self, client: Any, how: str, kill: Callable[[], None]) -> None:
        self._client = client
        self._how = how
        self._kill = kill
        self._fired = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def update_weights_from_distributed(
        self, names: Sequence[str], *args: Any, **kwargs: Any
    ) -> Any:
        if self._how == "fail":
            bad = list(names)
            bad[-1] = "model.layers.0.no_such_module.weight"
            return self._client.update_weights_from_distributed(bad, *args, **kwargs)
        if not self._fired:
            self._fired = True
            threading.Timer(KILL_AFTER_S, self._kill).start()
        return self._client.update_weights_from_distributed(names, *args, **kwargs)


@dataclasses.dataclass
class Injected:
    """One single fault as it went in: what was done, when, and what is left to undo."""

    fault: Fault
    at: float  # monotonic
    detail: str = ""
    fleets: tuple[str, ...] = ()
    skipped: str | None = None


class Injector:
    """Puts faults into the rig (see the module); ``say`` prints a progress line."""

    def __init__(self, rig: Any, say: Callable[[str], None]) -> None:
        self.rig = rig
        self.say = say
        self._blackhole_problem = available()
        self.blackhole = Blackhole() if self._blackhole_problem is None else None
        self._lock = threading.Lock()
        #: fleet -> group -> "fail" / "kill": the next sync's update of that group
        self._update_armed: dict[str, dict[str, str]] = {f: {} for f in rig.fleets}
        #: fleet -> the point where the trainer raises during the next sync
        self._trainer_armed: dict[str, str] = {}
        self._poison_armed: int | None = None
        #: fleet -> (filler path, syncs left)
        self._full: dict[str, tuple[Any, int]] = {}
        #: processes stopped and not (yet) continued, by pid (for SIGCONT at the end)
        self._stopped: dict[int, ProcessInfo] = {}
        self._timers: list[threading.Timer] = []
        #: steps that must run on the main thread (Ray's Cluster.add_node sets signal handlers),
        #: (due, what, fn), run by :meth:`run_due`
        self._main: list[tuple[float, str, Callable[[], None]]] = []
        self.removed_nodes = 0
        self.added_nodes = 0
        for name, fleet in rig.fleets.items():
            self._install(name, fleet)

    # ------------------------------------------------------------------ what cannot be done
    def not_injectable(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self._blackhole_problem is not None:
            out["port_blackhole"] = self._blackhole_problem
        if not self.rig.mounts.fillable:
            out["export_disk_full"] = (
                f"no size-limited filesystem could be mounted ({self.rig.mounts.why_not})"
            )
        return out

    # ------------------------------------------------------------------ hooks, installed once
    def _install(self, name: str, fleet: Any) -> None:
        sync = fleet.sync
        default_targets = sync.targets_for

        def targets_for(group: Any) -> Any:
            target = default_targets(group)
            with self._lock:
                how = self._update_armed[name].get(group.group_id)
            if how is None:
                return target
            kill = self._killer(name, group.group_id)
            return dataclasses.replace(target, client=_FaultyClient(target.client, how, kill))

        sync.targets_for = targets_for
        for point in ("offload_trainer", "onload_engines", "onload_trainer"):
            setattr(sync, point, self._hook(name, point))

    def _hook(self, fleet: str, point: str) -> Callable[[], None]:
        def hook() -> None:
            with self._lock:
                armed = self._trainer_armed.get(fleet) == point
            if armed:
                raise TrainerException(f"soak: the trainer raised in {point}")

        return hook

    def _killer(self, fleet: str, group: str) -> Callable[[], None]:
        def kill() -> None:
            pid = self._server_pid(fleet, group)
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

        return kill

    # ------------------------------------------------------------------ the sync's side
    def sync_weights(
        self, fleet: str, weights: Mapping[str, torch.Tensor]
    ) -> Mapping[str, torch.Tensor]:
        """The weights the next sync of ``fleet`` passes: raising ones when the trainer is
        armed to fail in ``register``."""
        with self._lock:
            point = self._trainer_armed.get(fleet)
        return _RaisingWeights(weights) if point == "register" else weights

    def take_poison(self) -> int | None:
        """The poisoned tensor's index when an ``update_poisoned`` is armed (disarms it)."""
        with self._lock:
            index, self._poison_armed = self._poison_armed, None
        return index

    def armed_for_sync(self) -> bool:
        with self._lock:
            return (
                self._poison_armed is not None
                or bool(self._trainer_armed)
                or any(self._update_armed.values())
            )

    def after_sync(self, fleet: str) -> list[str]:
        """A sync of ``fleet`` ended: its armed faults are spent; a filled filesystem is freed
        after its last sync. Returns what was undone (for the progress line)."""
        done: list[str] = []
        with self._lock:
            self._trainer_armed.pop(fleet, None)
            self._update_armed[fleet].clear()
            full = self._full.get(fleet)
            if full is not None:
                filler, left = full
                if left <= 1:
                    del self._full[fleet]
                    with contextlib.suppress(OSError):
                        filler.unlink()
                    done.append(f"export filesystem of {fleet} freed")
                else:
                    self._full[fleet] = (filler, left - 1)
        return done

    # ------------------------------------------------------------------ injecting
    def inject(self, fault: Fault) -> Injected:
        """Put one single fault in (a ``double``'s parts are injected one by one by the soak,
        at the same moment, from two threads). Never raises: a fault that could not go in says
        why in ``skipped``."""
        at = time.monotonic()
        try:
            detail, fleets = getattr(self, f"_{fault.kind}")(fault)
            return Injected(fault, at, detail, fleets)
        except Exception as exc:
            return Injected(fault, at, skipped=f"{type(exc).__name__}: {exc}"[:300])

    def _fleet(self, group: str | None) -> Any:
        assert group is not None
        return self.rig.fleets[GROUPS[group][0]]

    def _server_pid(self, fleet: str, group: str) -> int | None:
        engine = self.rig.fleets[fleet].engine(group)
        pid = engine.ready_info.get("pid")
        return int(pid) if pid else None

    def _tree(self, fleet: str, group: str) -> list[int]:
        engine = self.rig.fleets[fleet].engine(group)
        root = self._server_pid(fleet, group)
        pids = [p for p in [root, *engine.rank_pids] if p]
        out: list[int] = []
        for pid in pids:
            for p in [pid, *(d.pid for d in descendants(pid))]:
                if p not in out:
                    out.append(p)
        return out

    def _sigkill_rank(self, fault: Fault) -> tuple[str, tuple[str, ...]]:
        group = fault.group
        assert group is not None
        fleet, _ = GROUPS[group]
        engine = self.rig.fleets[fleet].engine(group)
        rank = int(fault.params.get("rank", 0))
        ranks = engine.rank_pids
        if ranks:
            pid = ranks[rank % len(ranks)]
        else:  # the real vLLM: one server process, rank 0
            pid = self._server_pid(fleet, group)
            rank = 0
        if pid is None:
            raise RuntimeError(f"{group} has no process to kill")
        os.kill(pid, signal.SIGKILL)
        return f"SIGKILL rank {rank} (pid {pid})", (fleet,)

    def _sigstop(self, fault: Fault) -> tuple[str, tuple[str, ...]]:
        group = fault.group
        assert group is not None
        fleet, _ = GROUPS[group]
        pids = self._tree(fleet, group)
        if not pids:
            raise RuntimeError(f"{group} has no process to stop")
        starts = {p: info for p in pids if (info := process_info(p)) is not None}
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        with self._lock:
            self._stopped.update(starts)
        after = fault.params.get("cont_after_s")
        if after is not None:
            self._later(float(after), lambda: self._cont(starts))
        how = f"SIGCONT after {after}s" if after is not None else "never continued"
        return f"SIGSTOP of {len(pids)} process(es) {pids}, {how}", (fleet,)

    def _cont(self, starts: Mapping[int, ProcessInfo]) -> None:
        for pid, info in starts.items():
            if same_process_alive(info):  # the same process, not a reused pid
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        with self._lock:
            for pid in starts:
                self._stopped.pop(pid, None)
        self.say(f"SIGCONT of {sorted(starts)}")

    def _update_failed(self, fault: Fault) -> tuple[str, tuple[str, ...]]:
        return self._arm_update(fault, "fail")

    def _kill_during_sync(self, fault: Fault) -> tuple[str, tuple[str, ...]]:
        return self._arm_update(fault, "kill")

    def _arm_update(self, fault: Fault, how: str) -> tuple[str, tuple[str, ...]]:
        group = fault.group
        assert group is not None
        fleet, _ = GROUPS[group]
        with self._lock:
            self._update_armed[fleet][group] = how
        what = "fails (a tensor it lacks)" if how == "fail" else "SIGKILLed while it runs"
        return f"armed: {group}'s next weight update {what}", (fleet,)

    def _update_poisoned(self, fault: Fault) -> tuple[str, tuple[str, ...]]:
        with self._lock:
            self._poison_armed = int(fault.params.get("tensor", 0))
        return "armed: the trainer's next version holds a NaN", tuple(self.rig.fleets)

    def _trainer_exception(self, fault: Fault) -> tuple[str, tuple[str, ...]]:
        fleets = (fault.fleet,) if fault.fleet else tuple(self.rig.fleets)
        where = str(fault.params.get("where", "onload_engines"))
        with self._lock:
            for f in fleets:
                self._trainer_armed[f] = where
        return f"armed: the trainer raises in {where} of the next sync", fleets

    def _export_disk_full(self, fault: Fault) -> tuple[str, tuple[str, ...]]:
        fleet = fault.fleet
        assert fleet is not None
        mounts = self.rig.mounts
        if not mounts.fillable:
            raise RuntimeError(self.not_injectable()["export_disk_full"])
        syncs = int(fault.params.get("syncs", 1))
        with self._lock:
            if fleet in self._full:
                raise RuntimeError(f"{fleet}'s export filesystem is already full")
        filler = mounts.fill(fleet)
        with self._lock:
            self._full[fleet] = (filler, syncs)
        import shutil

        free = shutil.disk_usage(mounts.paths[fleet]).free
        return f"export filesystem full ({free} bytes free) for {syncs} sync(s)", (fleet,)

    def _export_slow(self, fault: Fault) -> tuple[str, tuple[str, ...]]:
        fleet = fault.fleet
        assert fleet is not None
        delay = float(fault.params.get("delay_s", 40))
        self.rig.fleets[fleet].exporter.slow_next(delay)
        return f"armed: the next export's writer held {delay:.0f}s (emulated)", (fleet,)

    def _port_blackhole(self, fault: Fault) -> tuple[str, tuple[str, ...]]:
        group = fault.group
        assert group is not None
        if self.blackhole is None:
            raise RuntimeError(self._blackhole_problem or "no black hole here")
        fleet, _ = GROUPS[group]
        port = urlparse(self.rig.fleets[fleet].engine(group).url).port
        if port is None:
            raise RuntimeError(f"{group}'s URL names no port")
        seconds = float(fault.params.get("seconds", 10))
        server = self._server_pid(fleet, group)
        blackhole = self.blackhole

        def owner_exited(why: str) -> None:
            self.say(f"black hole of port {port} ({group}) lifted early: {why}")

        blackhole.block(port, owner=server, on_owner_exit=owner_exited)

        def lift() -> None:
            if blackhole.unblock(port):
                self.say(f"black hole of port {port} ({group}) lifted")

        self._later(seconds, lift)
        return f"port {port} black-holed for {seconds:.0f}s ({blackhole.how})", (fleet,)

    def _node_replace(self, fault: Fault) -> tuple[str, tuple[str, ...]]:
        from rig import ENGINE_RESOURCE, total_ranks

        group = fault.group
        assert group is not None
        fleet, _ = GROUPS[group]
        cluster = self.rig.cluster
        node_id = self._fleet(group).engine(group).node_id
        nodes = {n.node_id: n for n in cluster.worker_nodes}
        if node_id not in nodes:  # the group holds no placement now: take any worker
            if not nodes:
                raise RuntimeError("no worker node to remove")
            node_id = sorted(nodes)[0]
        name = self.rig.name_node(node_id)
        on_it = [
            g
            for f in self.rig.fleets.values()
            for g in f.group_ids
            if getattr(f.engine(g), "node_id", None) == node_id
        ]
        cluster.remove_node(nodes[node_id], allow_graceful=False)
        self.removed_nodes += 1
        after = float(fault.params.get("add_after_s", 0))

        def add() -> None:
            node = cluster.add_node(num_cpus=1, resources={ENGINE_RESOURCE: total_ranks()})
            self.added_nodes += 1
            self.say(f"node {self.rig.name_node(node.node_id)} added")

        with self._lock:
            self._main.append((time.monotonic() + after, "add a node", add))
        fleets = tuple(sorted({GROUPS[g][0] for g in on_it if g in GROUPS} | {fleet}))
        return f"node {name} removed (groups {on_it}); a node joins in {after:.0f}s", fleets

    # ------------------------------------------------------------------ the rest
    def _later(self, seconds: float, fn: Callable[[], None]) -> None:
        def run() -> None:
            try:
                fn()
            except Exception as exc:
                self.say(f"deferred fault step failed: {type(exc).__name__}: {exc}")

        timer = threading.Timer(seconds, run)
        timer.daemon = True
        with self._lock:
            self._timers = [t for t in self._timers if t.is_alive()]
            self._timers.append(timer)
        timer.start()

    def run_due(self) -> None:
        """Run the main thread's deferred steps that are due."""
        now = time.monotonic()
        with self._lock:
            due = [m for m in self._main if m[0] <= now]
            self._main = [m for m in self._main if m not in due]
        for _, what, fn in due:
            try:
                fn()
            except Exception as exc:
                self.say(f"deferred fault step ({what}) failed: {type(exc).__name__}: {exc}")

    def pending(self) -> int:
        """Deferred steps still to run (a SIGCONT, a black hole's end, a node to add)."""
        with self._lock:
            return sum(1 for t in self._timers if t.is_alive()) + len(self._main)

    def close(self) -> dict[str, Any]:
        """Undo what is left: run the pending timers now (a node still to add is not), SIGCONT
        the processes still stopped
        (so that they can end), lift the black holes, free the filled filesystems."""
        with self._lock:
            self._main.clear()  # a node still to add: the cluster stops next
            timers = list(self._timers)
        for timer in timers:
            if timer.is_alive():
                timer.cancel()
                with contextlib.suppress(Exception):
                    timer.function()
        with self._lock:
            stopped = dict(self._stopped)
            fulls = list(self._full.values())
            self._full.clear()
        if stopped:
            self._cont(stopped)
        for filler, _ in fulls:
            with contextlib.suppress(OSError):
                filler.unlink()
        if self.blackhole is not None:
            self.blackhole.close()
        return {"continued_at_close": sorted(stopped)}
