"""Checked all the time: the soak's watcher thread, its violations, and each fault's outcome.

:class:`Violations` is where every check reports: the first violation sets ``stop`` (the soak
ends the run there, printing the step and the seed, and exits non-zero); each is kept with the
step it happened at.

:class:`Watcher` runs every :data:`INTERVAL_S` on its own thread, for each fleet:

* ``dispatch``: every request the fleet admitted was admitted while its group was ``active``
  (``registry.dispatch_counts()``, counted under the group's lock at admission);
* ``invariants``: :func:`rollsafe.invariants.check_all` on the fleet's picture (routable iff
  active, active groups whole and at the fleet version, no publish on a failed register, no
  export deleted under a lease, leases held only by recoveries, versions never decrease, ...);
* ``leased_exports``: no export a recovery holds a lease on is deleted, machine or directory
  (it may be superseded meanwhile);
* ``poisoned``: no fleet ever reaches a version the trainer poisoned;
* ``resources``: a :class:`~resources.Sample` each time, bounded after the warm-up
  (:meth:`resources.Resources.check`); Ray's alive actors counted;
* groups that came back to ``active`` are queued for the weight check (taken by the soak's main
  loop between syncs), from :class:`Transitions`: the registry's own transitions, so a recovery
  from a warm standby (under a second) is seen too.

:class:`Outcomes` follows each injected fault until its targets are ``active`` at their fleet's
version again after the fault's window (a black hole's seconds, a SIGSTOP until SIGCONT, an armed
fault's sync): ``time_to_active`` from the injection to the moment they are back, for a fault
that took them out of routing (``left_active``); one whose groups stayed in routing
:data:`LEAVE_GRACE_S` past its window has none. One not back within its deadline is a
violation.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from resources import Resources

__all__ = ["INTERVAL_S", "Outcomes", "Transitions", "Violations", "Watcher"]

INTERVAL_S = 1.0
#: a fault's groups that stayed in routing this long after its window: it took none out
LEAVE_GRACE_S = 30.0


class Transitions:
    """Every group transition of every fleet, as the registry sends them (a registry listener:
    a recovery from a warm standby takes less than a second, too short for a sampler to see the
    group out of routing). Keeps the last time each group left ``active`` and queues the groups
    that entered it."""

    def __init__(self, fleets: dict[str, Any]) -> None:
        self._lock = threading.Lock()
        self.left_at: dict[tuple[str, str], float] = {}  # monotonic
        self.entered: list[tuple[str, str]] = []
        for name, fleet in fleets.items():
            fleet.registry.add_listener(_Listener(self, name))

    def note(self, fleet: str, gid: str, source: str, target: str) -> None:
        with self._lock:
            if source == "active" and target != "active":
                self.left_at[(fleet, gid)] = time.monotonic()
            if target == "active" and source != "active":
                self.entered.append((fleet, gid))

    def left_since(self, fleet: str, gid: str, since: float) -> bool:
        with self._lock:
            return self.left_at.get((fleet, gid), -1.0) >= since

    def take_entered(self) -> list[tuple[str, str]]:
        with self._lock:
            out, self.entered = self.entered, []
        return out


class _Listener:
    def __init__(self, transitions: Transitions, fleet: str) -> None:
        self.transitions, self.fleet = transitions, fleet

    def on_transition(self, group: Any, record: Any) -> None:
        self.transitions.note(self.fleet, record.group_id, record.source, record.target)


@dataclass
class Violations:
    """Every violation with the soak's step at the time; ``stop`` is set by the first."""

    seed: int
    step: Callable[[], str]
    #: record every violation and go on (``--keep-going``, for diagnosis); the exit is still 1
    keep_going: bool = False
    items: list[dict[str, Any]] = field(default_factory=list)
    more: dict[str, int] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    #: violations kept per check (the rest counted in ``more``: a resource bound broken once
    #: is broken every second after it under ``--keep-going``)
    PER_CHECK = 10

    def __call__(self, check: str, message: str) -> None:
        with self._lock:
            same = [v for v in self.items if v["check"] == check]
            if any(v["message"] == message for v in same):
                return
            if len(same) >= self.PER_CHECK:
                self.more[check] = self.more.get(check, 0) + 1
                return
            self.items.append(
                {
                    "check": check,
                    "message": message[:2000],
                    "step": self.step(),
                    "seed": self.seed,
                    "at": time.strftime("%H:%M:%S"),
                }
            )
        print(
            f"[soak VIOLATION] {check}: {message[:2000]} (step {self.step()}, seed {self.seed})",
            flush=True,
        )
        if not self.keep_going:
            self.stop.set()


class Watcher:
    """The checks that run every second (see the module)."""

    def __init__(
        self,
        fleets: dict[str, Any],
        resources: Resources,
        violation: Violations,
        poisoned: Callable[[], set[int]],
        transitions: Transitions | None = None,
    ) -> None:
        self.fleets = fleets
        self.transitions = transitions
        self.resources = resources
        self.violation = violation
        self.poisoned = poisoned
        self.rounds = 0
        self.ray_actors: int | None = None
        self.returned: list[tuple[str, str]] = []  # (fleet, group) back to active since taken
        self._states: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def take_returned(self) -> list[tuple[str, str]]:
        if self.transitions is not None:
            return list(dict.fromkeys(self.transitions.take_entered()))
        with self._lock:
            out, self.returned = self.returned, []
        return out

    def _run(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            try:
                self.check_once()
            except Exception as exc:
                self.violation("watcher", f"the watcher failed: {exc!r}\n{traceback.format_exc()}")

    def check_once(self) -> None:
        from rollsafe.invariants import check_all

        self.rounds += 1
        poisoned = self.poisoned()
        for name, fleet in self.fleets.items():
            for gid, counts in fleet.registry.dispatch_counts().items():
                bad = {s: n for s, n in counts.items() if s != "active"}
                if bad:
                    self.violation("dispatch", f"{name}/{gid} admitted requests while {bad}")
            for v in check_all(fleet.picture()):
                self.violation("invariants", f"{name}: {v}")
            exporter = fleet.exporter
            if exporter is not None:
                for record in exporter.exports():
                    leases = list(record.lifecycle.leases)
                    # a lease is taken on a ready export; a newer one may supersede it meanwhile,
                    # but it is never deleted (machine or directory) while the lease is held
                    if leases and (record.state == "deleted" or not record.path.exists()):
                        self.violation(
                            "leased_exports",
                            f"{name}: export v{record.version} leased by {leases} is "
                            f"{record.state}, on disk: {record.path.exists()}",
                        )
            version = fleet.registry.fleet_version
            if version in poisoned:
                self.violation("poisoned", f"{name} reached the poisoned version v{version}")
            for group in fleet.registry.groups():
                key = (name, group.group_id)
                before = self._states.get(key)
                self._states[key] = group.state
                if group.state == "active" and before is not None and before != "active":
                    with self._lock:
                        self.returned.append(key)
        self.ray_actors = _alive_actors()
        self.resources.sample(self.ray_actors)
        for problem in self.resources.check():
            self.violation("resources", problem)


def _alive_actors() -> int | None:
    """Ray's actors alive now (None when the GCS cannot be asked)."""
    try:
        import ray
        from ray._private import state

        if not ray.is_initialized():
            return None
        return sum(1 for a in state.actors().values() if a.get("State") == "ALIVE")
    except Exception:
        return None


@dataclass
class Outcome:
    index: int
    kind: str
    targets: list[tuple[str, str]]  # (fleet, group)
    injected: float  # monotonic
    window_end: Callable[[], bool]  # True once the fault's own window is over
    deadline_s: float
    detail: str = ""
    window_done_at: float | None = None
    left_active: bool = False
    time_to_active_s: float | None = None
    survived: bool | None = None


class Outcomes:
    """Follows each injected fault to the end of its targets' recovery (see the module)."""

    def __init__(
        self,
        fleets: dict[str, Any],
        violation: Violations,
        transitions: Transitions | None = None,
    ) -> None:
        self.fleets = fleets
        self.violation = violation
        self.transitions = transitions
        self.open: list[Outcome] = []
        self.done: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-outcomes", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def add(self, outcome: Outcome) -> None:
        with self._lock:
            self.open.append(outcome)

    def pending(self) -> int:
        with self._lock:
            return len(self.open)

    def _back(self, fleet: str, gid: str) -> bool:
        registry = self.fleets[fleet].registry
        group = registry.get(gid)
        version = registry.fleet_version
        return group.state == "active" and all(
            m.healthy and m.weights_version == version for m in group.machine.members.values()
        )

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            now = time.monotonic()
            with self._lock:
                still: list[Outcome] = []
                for o in self.open:
                    back = all(self._back(f, g) for f, g in o.targets)
                    if not back or (
                        self.transitions is not None
                        and any(self.transitions.left_since(f, g, o.injected) for f, g in o.targets)
                    ):
                        o.left_active = True
                    if o.window_done_at is None and o.window_end():
                        o.window_done_at = now
                    # a fault that takes its group out is noticed after a while (the health
                    # checks): it is over once the group left and came back, or once it stayed
                    # in routing LEAVE_GRACE_S past the fault's window (no time to active then)
                    over = o.window_done_at is not None and (
                        o.left_active or now - o.window_done_at >= LEAVE_GRACE_S
                    )
                    if back and over:
                        if o.left_active:
                            o.time_to_active_s = round(now - o.injected, 2)
                        o.survived = True
                        self.done.append(o)
                    elif now - o.injected > o.deadline_s:
                        o.survived = False
                        self.done.append(o)
                        self.violation(
                            "recovery",
                            f"fault #{o.index} {o.kind}: {o.targets} not active at their "
                            f"fleet's version {o.deadline_s:.0f}s after it went in",
                        )
                    else:
                        still.append(o)
                self.open = still

    def close_open(self) -> None:
        """The run ended: faults still open did not get back in time (not a violation when the
        run was cut short: recorded as ``survived: None``)."""
        with self._lock:
            self.done.extend(self.open)
            self.open = []
