"""SparePool: spare groups that take over from a serving group the moment it leaves routing.

Owns the fleet's executor of :func:`rollsafe.operations.spare.cover` (``rollsafe verify`` is its
other executor) and what it records (``docs/recovery.md``, "Spare groups"). It listens to the
registry: when a serving group leaves ``active`` for a state a spare may cover (failed, lost
with its node, behind the version: :data:`rollsafe.policy.COVERABLE`), or when a spare becomes
ready (``standby``) while a serving group is still out, it queues a cover on its own thread (a
listener only enqueues). A cover takes the transport's lock (no sync or targeted push moves a
version meanwhile), reads the group and the spares, asks each candidate's engines which weights
they serve (:class:`~rollsafe.operations.effects.CheckVersion`, bounded by
``version_timeout_s``), and switches in one registry step: the spare ``promote``\\ d to
``active`` (routable from that step on: requests waiting for a routable group go to it), the
covered group ``enlist``\\ ed as a spare, so its recovery -- under way on the recovery pool as
for any failure -- ends in ``standby``. A spare whose engine names other weights than recorded
is failed and handed to recovery (``on_group_failed``). Each promotion is kept as a
:class:`Promotion` (:meth:`SparePool.promotions`, the fleet's snapshot, the invariants'
picture).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import rollsafe.operations.effects as fx
import rollsafe.policy as policy
from rollsafe.fleet.steps import StepLog
from rollsafe.fleet.sync import HandOffs, TransportLocking
from rollsafe.invariants import PromotionPicture
from rollsafe.operations import spare as spare_op
from rollsafe.operations.effects import drive
from rollsafe.operations.executor import Executor, handles
from rollsafe.registry import (
    FleetListener,
    FleetRegistry,
    GroupTransition,
    RegistryEffects,
    WorkerGroup,
)
from rollsafe.text import bound_text

__all__ = ["Promotion", "SparePool"]

log = logging.getLogger(__name__)

_KEPT = 256


@dataclass(frozen=True)
class Promotion:
    """One spare promoted in place of a serving group: ``left_at`` the covered group left
    routing (wall clock), ``promoted_at`` the spare became ``active``; ``fleet_version`` then,
    the spare members' ``recorded`` versions and what its engines ``reported`` last."""

    spare: str
    covered: str
    left_at: float | None
    promoted_at: float
    fleet_version: int
    recorded: tuple[int | None, ...]
    reported: tuple[str | None, ...]

    @property
    def switch_s(self) -> float | None:
        """Covered group out of routing -> the spare routable (None: unknown)."""
        return None if self.left_at is None else self.promoted_at - self.left_at

    def picture(self) -> PromotionPicture:
        """As :func:`rollsafe.invariants.promoted_only_at_current_version` reads it."""
        return PromotionPicture(
            self.spare, self.covered, self.fleet_version, self.recorded, None, self.reported
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "spare": self.spare,
            "covered": self.covered,
            "left_at": self.left_at,
            "promoted_at": self.promoted_at,
            "switch_s": self.switch_s,
            "fleet_version": self.fleet_version,
            "recorded": list(self.recorded),
            "reported": list(self.reported),
        }


class SparePool(FleetListener, Executor):
    """Covers a fleet's serving groups with its spares (see the module). ``transport_lock``:
    the lock syncs and targeted pushes hold (the same object); ``on_group_failed(group_id,
    reason)``: where a spare failed by its version check goes (the recovery's
    ``on_update_failed``); ``node_of(group_id)``: the node a group runs on (None: unknown or
    this machine), so that spares on another node are tried first. Thread-safe; :meth:`close`
    stops it."""

    parts = {
        RegistryEffects: "registry_effects",
        StepLog: "log",
        TransportLocking: "locking",
        HandOffs: "hand_offs",
    }

    def __init__(
        self,
        registry: FleetRegistry,
        *,
        transport_lock: threading.RLock,
        on_group_failed: Callable[[str, str], object] | None = None,
        node_of: Callable[[str], str | None] | None = None,
        version_timeout_s: float = 2.0,
        name: str = "rollsafe-spares",
    ) -> None:
        self.registry = registry
        self.node_of = node_of
        self.version_timeout_s = version_timeout_s
        self.name = name
        self.registry_effects = RegistryEffects(registry)
        self.log = StepLog(label="spares: ", keep=_KEPT, log_steps=True)
        self.locking = TransportLocking(transport_lock)
        self.hand_offs = HandOffs(
            on_group_failed, lambda _gid: "its engine serves other weights than recorded"
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._queued: dict[str, float | None] = {}  # group -> when it left routing
        self._promotions: deque[Promotion] = deque(maxlen=_KEPT)
        self._closed = False
        # what the running cover read and heard (one cover at a time: the pool has one thread)
        self._seen: fx.SparesSeen | None = None
        self._reported: dict[str, tuple[str | None, ...]] = {}
        self._left_at: float | None = None

    # ------------------------------------------------------------------ the registry's word
    def on_transition(self, group: WorkerGroup, record: GroupTransition) -> None:
        """A serving group left ``active`` for a coverable state: cover it. A spare became
        ready: cover the serving groups still out of routing. (Only enqueues.)"""
        if record.source == record.target:
            return
        if record.target == "standby":
            for other in self.registry.groups():
                if not other.machine.spare and other.state in policy.COVERABLE:
                    self.submit(other.group_id)
        elif (
            record.source == "active"
            and record.target in policy.COVERABLE
            and not group.machine.spare
        ):
            self.submit(group.group_id, left_at=record.timestamp)

    def submit(self, group_id: str, *, left_at: float | None = None) -> bool:
        """Queue a cover of ``group_id`` (once while one is queued); False when closed."""
        with self._lock:
            if self._closed:
                return False
            if group_id in self._queued:
                return True
            self._queued[group_id] = left_at
            self._pool.submit(self._run, group_id)
        return True

    def _run(self, group_id: str) -> spare_op.CoverEnd | None:
        with self._lock:
            left_at = self._queued.pop(group_id, None)
            if self._closed:
                return None
        self._left_at = left_at
        self._seen, self._reported = None, {}
        self.log.mark()
        try:
            end = drive(spare_op.cover(group_id), self.perform)
        except Exception:  # a bug: logged, never lost on the pool's thread
            log.exception("%s: covering %s failed", self.name, group_id)
            return None
        finally:
            self.locking.release()  # an exception between the lock and its release
        if end.status == "promoted" and end.spare is not None:
            self._promoted(end.spare, group_id)
        return end

    def _promoted(self, spare: str, covered: str) -> None:
        seen = self._seen
        recorded: tuple[int | None, ...] = ()
        if seen is not None:
            recorded = next((s.versions for s in seen.spares if s.group_id == spare), ())
        promotion = Promotion(
            spare,
            covered,
            self._left_at,
            time.time(),
            seen.fleet_version if seen is not None else self.registry.fleet_version,
            recorded,
            self._reported.get(spare, ()),
        )
        with self._lock:
            self._promotions.append(promotion)
        log.warning(
            "%s: %s promoted in place of %s at v%d%s",
            self.name,
            spare,
            covered,
            promotion.fleet_version,
            "" if promotion.switch_s is None else f" ({promotion.switch_s:.3f}s after it left)",
        )

    # ------------------------------------------------------------------ effects
    @handles(fx.ReadSpares)
    def read_spares(self, effect: fx.ReadSpares) -> fx.Outcome[fx.SparesSeen]:
        registry = self.registry
        groups = registry.groups()
        by_id = {g.group_id: g for g in groups}
        seen = fx.SparesSeen(
            self._facts(by_id[effect.group]),
            tuple(self._facts(g) for g in groups if g.machine.spare),
            registry.fleet_version,
        )
        self._seen = seen
        return fx.Ok(seen)

    def _facts(self, group: WorkerGroup) -> policy.SpareFacts:
        machine = group.machine
        members = machine.members.values()
        node = None
        if self.node_of is not None:
            try:
                node = self.node_of(group.group_id)
            except Exception:  # no handle (yet): unknown
                node = None
        return policy.SpareFacts(
            group.group_id,
            machine.state,
            machine.spare,
            len(group.ranks),
            all(m.healthy for m in members),
            tuple(m.weights_version for m in members),
            node,
        )

    @handles(fx.CheckVersion)
    def check_version(self, effect: fx.CheckVersion) -> fx.Outcome[tuple[str | None, ...]]:
        """Every engine endpoint of the group names the weights it serves."""
        group = self.registry.get(effect.group)
        if not group.clients:
            return fx.Failed(f"group {effect.group!r} has no engine client to ask")
        answers: list[str | None] = []
        for client in group.clients:
            try:
                answers.append(client.weight_version(timeout=self.version_timeout_s))
            except Exception as exc:
                self._reported[effect.group] = ()
                return fx.Failed(bound_text(f"{type(exc).__name__}: {exc}", 300))
        self._reported[effect.group] = tuple(answers)
        return fx.Ok(tuple(answers))

    # ------------------------------------------------------------------ inspection
    def promotions(self) -> list[Promotion]:
        """The promotions so far, oldest first (the last 256)."""
        with self._lock:
            return list(self._promotions)

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Wait until no cover is queued or running; True when that happened in time."""
        done = threading.Event()
        with self._lock:
            if self._closed:
                return True
            self._pool.submit(done.set)
        return done.wait(timeout)

    def snapshot(self) -> dict[str, Any]:
        """The spares, the promotions and the last steps (for ``RolloutFleet.snapshot``)."""
        groups = self.registry.groups()
        return {
            "spares": {g.group_id: g.state for g in groups if g.machine.spare},
            "promotions": [p.as_dict() for p in self.promotions()],
            "steps": [s.as_dict() for s in self.log.steps[-16:]],
        }

    def close(self) -> None:
        """Run no more covers (one running ends first)."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
