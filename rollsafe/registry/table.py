"""FleetRegistry: the fleet's worker groups, their lifecycle machines and their listeners.

Owns four things (the effects that act on them are :mod:`rollsafe.registry.handlers`'):

* the table of worker groups (:class:`WorkerGroup`: id, ranks, engine clients/endpoints, one
  :class:`~rollsafe.statemachines.worker_group.WorkerGroupLifecycle` each), with ranks unique
  across the whole fleet;
* the fleet's current weights version (:attr:`FleetRegistry.fleet_version`), which never
  decreases and is passed to the machines' guards as ``current_version=`` automatically;
* event delivery: :meth:`FleetRegistry.send` feeds a typed event
  (:class:`~rollsafe.statemachines.events.GroupEvent`) to one group's machine under that
  group's lock; an ordinary python-statemachine listener on each machine records the
  transition; the registry then notifies its own listeners (``on_transition``, ``on_group_active``,
  ``on_group_inactive``, ``on_group_pending_weights``, ``on_group_retired``) OUTSIDE every lock,
  in transition order;
* the per-group dispatch gate the router uses (:meth:`WorkerGroup.begin_request`): whether a
  group may take a request is decided under the same lock that transitions take, and every
  dispatch is counted by the state the group was in, so "no request reached a non-routable
  group" is checkable after the fact (:meth:`FleetRegistry.dispatch_counts`).

Listeners must return quickly: they run on the thread that sent the event (a health probe loop,
a router, a recovery worker). A listener that has real work to do should enqueue it.
A listener may call back into the registry (even ``send``); such nested notifications are
delivered after the current listener returns, never recursively and never under a lock.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from rollsafe.errors import InvalidArgument, InvalidArgumentType, RollsafeError
from rollsafe.statemachines.base import TransitionRefused
from rollsafe.statemachines.events import GroupEvent, event_name
from rollsafe.statemachines.worker_group import WorkerGroupLifecycle
from rollsafe.text import bound_text

if TYPE_CHECKING:
    from rollsafe.ports import EngineClient

__all__ = [
    "LISTENER_HOOKS",
    "DuplicateGroup",
    "FleetError",
    "FleetListener",
    "FleetRegistry",
    "FleetVersionRegression",
    "GroupTransition",
    "OverlappingRanks",
    "UnknownGroup",
    "WorkerGroup",
]

log = logging.getLogger(__name__)

_R = TypeVar("_R")

#: Events whose guards read the fleet's current version; :meth:`FleetRegistry.send` passes
#: ``current_version=fleet_version`` to them unless the caller gave one.
VERSIONED_EVENTS = frozenset({"launched", "restarted", "weights_loaded", "mark_stale", "promote"})

#: The hook names a listener may implement (any subset).
LISTENER_HOOKS = (
    "on_transition",
    "on_group_active",
    "on_group_inactive",
    "on_group_pending_weights",
    "on_group_retired",
    "on_refused",
)

#: Transitions kept per group for :meth:`FleetRegistry.snapshot`.
SNAPSHOT_TRANSITIONS = 8


class FleetError(RollsafeError):
    """Base class of the fleet control plane's errors."""


class UnknownGroup(FleetError, KeyError):
    """No group with this id is registered."""

    def __init__(self, group_id: str, known: Iterable[str] = ()) -> None:
        self.group_id = group_id
        names = sorted(known)
        shown = names[:16] + (["..."] if len(names) > 16 else [])
        super().__init__(f"unknown worker group {group_id!r} (registered: {shown})")

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class DuplicateGroup(FleetError, ValueError):
    """A group with this id is already registered."""

    def __init__(self, group_id: str) -> None:
        self.group_id = group_id
        super().__init__(f"worker group {group_id!r} is already registered")


class OverlappingRanks(FleetError, ValueError):
    """A new group claims ranks that already belong to another group."""

    def __init__(self, group_id: str, other_group: str, ranks: Sequence[int]) -> None:
        self.group_id = group_id
        self.other_group = other_group
        self.ranks = tuple(ranks)
        super().__init__(
            f"worker group {group_id!r} claims rank(s) {list(self.ranks)} already owned by "
            f"group {other_group!r}; ranks must be unique across the fleet"
        )


class FleetVersionRegression(FleetError, ValueError):
    """Someone tried to move the fleet's weights version backwards."""

    def __init__(self, current: int, requested: int) -> None:
        self.current = current
        self.requested = requested
        super().__init__(
            f"fleet version can never decrease: it is {current}, refused to set {requested}"
        )


@dataclass(frozen=True)
class GroupTransition:
    """One transition of one group, as seen by the registry (handed to ``on_transition``)."""

    seq: int
    group_id: str
    event: str
    source: str
    target: str
    timestamp: float
    fleet_version: int

    @property
    def left_routing(self) -> bool:
        """The group was routable before and is not any more."""
        return self.source == "active" and self.target != "active"

    def as_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "group": self.group_id,
            "event": self.event,
            "source": self.source,
            "target": self.target,
            "timestamp": self.timestamp,
            "fleet_version": self.fleet_version,
        }


class FleetListener:
    """Convenience base class: override the hooks you need (all default to doing nothing).

    Any object with at least one of :data:`LISTENER_HOOKS` can be registered; subclassing this is
    optional. Hooks run outside every lock, on the thread that sent the event, and must return
    quickly (enqueue real work).
    """

    def on_transition(self, group: WorkerGroup, record: GroupTransition) -> None:
        """Every transition of every group."""

    def on_group_active(self, group: WorkerGroup) -> None:
        """A group entered ``active`` (routable)."""

    def on_group_inactive(self, group: WorkerGroup) -> None:
        """A group entered ``inactive`` (failed, or a restart failed)."""

    def on_group_pending_weights(self, group: WorkerGroup) -> None:
        """A group entered ``pending_weights`` (healthy, but not at the fleet's version)."""

    def on_group_retired(self, group: WorkerGroup) -> None:
        """A group was retired (restart budget spent, or removed)."""

    def on_refused(self, group: WorkerGroup, event: str, error: TransitionRefused) -> None:
        """The registry refused ``event`` for ``group``: its machine's guard (or state) said
        no, ``error`` names why; nothing changed."""


_TARGET_HOOK = {
    "active": "on_group_active",
    "inactive": "on_group_inactive",
    "pending_weights": "on_group_pending_weights",
    "retired": "on_group_retired",
}


@dataclass(eq=False)
class WorkerGroup:
    """One worker group: its ranks, its engine clients and its lifecycle machine.

    ``clients[0]`` is the endpoint requests go to; a multi-endpoint group (several nodes) lists
    the others after it, and the default health probe checks them all. Simulated groups may have
    no clients (health then comes from a probe function).

    Request accounting (``outstanding``, dispatch counts) is guarded by the group's lock, the
    same lock :meth:`FleetRegistry.send` holds while the machine transitions.

    ``standby_probe`` (set by the fleet from the group's launcher) returns the group's warm
    standby status (``EngineLauncher.standby_status()``: ``state`` is ``none``, ``warming`` or
    ``ready``, with its counters); it must not block. Without one the standby is ``none``.
    """

    group_id: str
    ranks: tuple[int, ...]
    machine: WorkerGroupLifecycle
    clients: tuple[EngineClient, ...] = ()
    endpoints: tuple[str, ...] = ()
    metadata: Mapping[str, Any] = field(default_factory=dict)
    standby_probe: Callable[[], Mapping[str, Any]] | None = field(default=None, repr=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    _outstanding: int = field(default=0, repr=False)
    _dispatched: Counter[str] = field(default_factory=Counter, repr=False)
    _served: int = field(default=0, repr=False)
    _failed: int = field(default=0, repr=False)
    _last_error: str | None = field(default=None, repr=False)
    _transitions: deque[GroupTransition] = field(
        default_factory=lambda: deque(maxlen=SNAPSHOT_TRANSITIONS), repr=False
    )
    _generation: int = field(default=0, repr=False)
    _loading: int = field(default=0, repr=False)
    #: the machines the registry taps (a model checker swaps pooled machines in and out)
    _tapped: weakref.WeakSet[WorkerGroupLifecycle] = field(
        default_factory=weakref.WeakSet, repr=False
    )

    @property
    def loading_weights(self) -> bool:
        """True while a weight load to this group, or a check of its weights, is in flight
        (:meth:`loading`): its engines answer health probes late then (SGLang's ``/health``
        queues a generate behind the load or the checker, both run on its scheduler), so the
        health manager neither probes it nor counts its answers."""
        return self._loading > 0

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """Mark a weight load (or a weights check) of this group in flight for the ``with``
        block."""
        with self._lock:
            self._loading += 1
        try:
            yield
        finally:
            with self._lock:
                self._loading -= 1

    @property
    def state(self) -> str:
        """The machine's current state id (``"active"``, ``"inactive"``...)."""
        return self.machine.state

    @property
    def is_routable(self) -> bool:
        """True only in ``active``."""
        return self.machine.is_routable

    @property
    def client(self) -> EngineClient | None:
        """The client requests are sent to (``clients[0]``), or None for a simulated group."""
        return self.clients[0] if self.clients else None

    @property
    def outstanding(self) -> int:
        """Requests dispatched to this group and not finished yet."""
        return self._outstanding

    @property
    def generation(self) -> int:
        """How many transitions this group has taken through the registry (a change counter)."""
        return self._generation

    @property
    def last_error(self) -> str | None:
        """The last request error seen on this group (bounded text)."""
        return self._last_error

    def dispatch_counts(self) -> dict[str, int]:
        """Requests dispatched to this group, keyed by the state it was in at dispatch."""
        with self._lock:
            return dict(self._dispatched)

    def begin_request(self) -> str | None:
        """Admit one request if the group is routable now; return the state, or None.

        The check and the accounting happen under the group's lock, which every transition of
        this group also takes: a request is admitted only while the group is ``active``.
        """
        with self._lock:
            state = self.machine.state
            if state != "active":
                return None
            self._outstanding += 1
            self._dispatched[state] += 1
            return state

    def end_request(self, *, ok: bool, error: str | None = None) -> None:
        """Finish a request admitted by :meth:`begin_request`."""
        with self._lock:
            self._outstanding = max(0, self._outstanding - 1)
            if ok:
                self._served += 1
            else:
                self._failed += 1
                if error is not None:
                    self._last_error = bound_text(error)

    def standby(self) -> dict[str, Any]:
        """The group's warm standby: ``{"state": "none" | "warming" | "ready", ...}`` (the
        probe's view; ``{"state": "none"}`` without a probe or when the probe raised)."""
        probe = self.standby_probe
        if probe is None:
            return {"state": "none"}
        try:
            view = {str(k): _jsonable(v) for k, v in probe().items()}
        except Exception as exc:
            return {"state": "none", "error": bound_text(f"{type(exc).__name__}: {exc}", 200)}
        view.setdefault("state", "none")
        return view

    @property
    def standby_state(self) -> str:
        """``none``, ``warming`` or ``ready`` (see :meth:`standby`)."""
        return str(self.standby()["state"])

    def recent_transitions(self) -> list[GroupTransition]:
        with self._lock:
            return list(self._transitions)

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly view of this group (used by :meth:`FleetRegistry.snapshot`)."""
        standby = self.standby()  # outside the lock: the probe is the launcher's business
        with self._lock:
            machine = self.machine
            members = machine.members
            return {
                "group_id": self.group_id,
                "state": machine.state,
                "routable": machine.is_routable,
                "spare": machine.spare,
                "ranks": list(self.ranks),
                "endpoints": list(self.endpoints),
                "restart_budget": machine.restart_budget,
                "standby": standby,
                "members": {
                    str(rank): {
                        "known": m.known,
                        "healthy": m.healthy,
                        "weights_version": m.weights_version,
                    }
                    for rank, m in members.items()
                },
                "requests": {
                    "outstanding": self._outstanding,
                    "served": self._served,
                    "failed": self._failed,
                    "dispatched_by_state": dict(self._dispatched),
                    "last_error": self._last_error,
                },
                "last_transitions": [t.as_dict() for t in self._transitions],
                "metadata": {str(k): _jsonable(v) for k, v in self.metadata.items()},
            }


class _GroupTap:
    """The ordinary python-statemachine listener the registry attaches to each group machine:
    every transition becomes a :class:`GroupTransition` for the registry's listeners."""

    def __init__(self, registry: FleetRegistry, group: WorkerGroup) -> None:
        self.registry = registry
        self.group = group

    def after_transition(self, event: Any, source: Any, target: Any) -> None:
        self.registry._on_transition(self.group, str(event), str(source.id), str(target.id))


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return bound_text(repr(value), 200)


Notification = tuple[WorkerGroup, GroupTransition]


class FleetRegistry:
    """Thread-safe table of worker groups and the single door to their lifecycle machines.

    Locks: one registry lock for the table, listeners and version (never held while a machine
    transitions or a listener runs), and one lock per group held while its machine transitions
    and while the router admits a request. Listener calls happen after every lock is released.
    """

    def __init__(self, *, fleet_version: int = 0, listeners: Iterable[object] = ()) -> None:
        if fleet_version < 0:
            raise InvalidArgument(
                "fleet_version", f"fleet_version must be >= 0, got {fleet_version}"
            )
        self._lock = threading.RLock()
        self._groups: dict[str, WorkerGroup] = {}
        self._rank_owner: dict[int, str] = {}
        self._version = fleet_version
        #: a seqlock over changes that readers must see whole (:meth:`recording`): odd while
        #: one runs
        self._record_seq = 0
        self._record_lock = threading.Lock()
        self._recorder: int | None = None  # the thread inside a recording
        self._listeners: tuple[object, ...] = ()
        self._seq = 0
        # Ordered, non-recursive listener delivery: notifications queue here; one thread at a
        # time drains the queue (outside every lock), so listeners see transitions in order.
        self._pending: deque[Notification] = deque()
        self._deliver_lock = threading.Lock()
        self._draining = False
        self._local = threading.local()  # the transition the current thread's send took
        self._listener_errors = 0
        for listener in listeners:
            self.add_listener(listener)

    # ------------------------------------------------------------------ listeners
    def add_listener(self, listener: object) -> None:
        """Register ``listener`` (any object with at least one of :data:`LISTENER_HOOKS`)."""
        if not any(callable(getattr(listener, h, None)) for h in LISTENER_HOOKS):
            raise InvalidArgumentType(
                "listener",
                f"{listener!r} is not a fleet listener: it has none of {list(LISTENER_HOOKS)}",
            )
        with self._lock:
            if any(existing is listener for existing in self._listeners):
                return
            self._listeners = (*self._listeners, listener)

    def remove_listener(self, listener: object) -> None:
        """Unregister ``listener`` (no error if it was not registered)."""
        with self._lock:
            self._listeners = tuple(x for x in self._listeners if x is not listener)

    @property
    def listener_errors(self) -> int:
        """How many listener calls raised (each is logged and skipped)."""
        return self._listener_errors

    # ------------------------------------------------------------------ version
    @property
    def fleet_version(self) -> int:
        """The weights version the fleet serves now; never decreases."""
        return self._version

    @fleet_version.setter
    def fleet_version(self, version: int) -> None:
        self.set_fleet_version(version)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """A change that a :meth:`consistent` reader sees whole or not at all (a sync's
        members' versions and the fleet's version): writers take turns; readers never block
        them, they read again."""
        with self._record_lock:
            self._recorder = threading.get_ident()
            self._record_seq += 1
            try:
                yield
            finally:
                self._record_seq += 1
                self._recorder = None

    def consistent(self, read: Callable[[], _R]) -> _R:
        """``read()`` taken while no :meth:`recording` ran (taken again until one was): what
        it returns shows each such change whole or not at all. Called inside a recording by
        its own thread (a listener of the change), it reads at once."""
        if self._recorder == threading.get_ident():
            return read()
        while True:
            seq = self._record_seq
            if seq % 2 == 0:
                out = read()
                if self._record_seq == seq:
                    return out
            time.sleep(0.0005)

    def set_fleet_version(self, version: int) -> int:
        """Move the fleet to ``version`` (equal is a no-op; lower raises, changing nothing)."""
        if isinstance(version, bool) or not isinstance(version, int):
            raise InvalidArgumentType("version", f"fleet version must be an int, got {version!r}")
        with self._lock:
            if version < self._version:
                raise FleetVersionRegression(self._version, version)
            self._version = version
            return version

    # ------------------------------------------------------------------ groups
    def add_group(
        self,
        group_id: str,
        ranks: Iterable[int],
        *,
        clients: Sequence[EngineClient] = (),
        endpoints: Sequence[str] | None = None,
        restart_budget: int = 3,
        metadata: Mapping[str, Any] | None = None,
        machine: WorkerGroupLifecycle | None = None,
        standby_probe: Callable[[], Mapping[str, Any]] | None = None,
        spare: bool = False,
    ) -> WorkerGroup:
        """Register a group in ``launching`` (or with a given ``machine``) and return it.

        Fails loudly and changes nothing on a duplicate id (:class:`DuplicateGroup`), ranks owned
        by another group (:class:`OverlappingRanks`) or repeated/empty ranks (``ValueError``).
        ``endpoints`` default to the clients' URLs. ``standby_probe``: see :class:`WorkerGroup`.
        ``spare``: the group starts as a spare (``standby`` once ready, never routed until
        promoted; ``FleetConfig.spare_groups``); ignored with a given ``machine``.
        """
        if not isinstance(group_id, str) or not group_id:
            raise InvalidArgument(
                "group_id", f"group_id must be a non-empty string, got {group_id!r}"
            )
        rank_list = [int(r) for r in ranks]
        if machine is None:
            machine = WorkerGroupLifecycle(
                rank_list, restart_budget=restart_budget, group_id=group_id, spare=spare
            )
        elif tuple(machine.ranks) != tuple(rank_list):
            raise InvalidArgument(
                "ranks",
                f"group {group_id!r}: machine ranks {list(machine.ranks)} != ranks {rank_list}",
            )
        client_tuple = tuple(clients)
        eps = tuple(endpoints) if endpoints is not None else tuple(c.url for c in client_tuple)
        group = WorkerGroup(
            group_id=group_id,
            ranks=tuple(rank_list),
            machine=machine,
            clients=client_tuple,
            endpoints=eps,
            metadata=dict(metadata or {}),
            standby_probe=standby_probe,
        )
        with self._lock:
            if group_id in self._groups:
                raise DuplicateGroup(group_id)
            clashes: dict[str, list[int]] = {}
            for r in rank_list:
                owner = self._rank_owner.get(r)
                if owner is not None:
                    clashes.setdefault(owner, []).append(r)
            if clashes:
                other, overlap = sorted(clashes.items())[0]
                raise OverlappingRanks(group_id, other, overlap)
            self._groups[group_id] = group
            for r in rank_list:
                self._rank_owner[r] = group_id
        machine.add_listener(_GroupTap(self, group))  # type: ignore[no-untyped-call]
        group._tapped.add(machine)
        return group

    def remove_group(self, group_id: str, *, retire: bool = True) -> WorkerGroup:
        """Unregister a group, retiring it first (listeners see ``retired``); return it.

        Its ranks become free for a new group.
        """
        group = self.get(group_id)
        if retire and group.state != "retired":
            self.send(group_id, GroupEvent.RETIRE)
        with self._lock:
            if self._groups.get(group_id) is group:
                del self._groups[group_id]
                for r in group.ranks:
                    if self._rank_owner.get(r) == group_id:
                        del self._rank_owner[r]
        return group

    def adopt_machine(self, group_id: str, machine: WorkerGroupLifecycle) -> None:
        """Make ``machine`` group ``group_id``'s lifecycle machine (same ranks), its
        transitions recorded like the first one's. For a model checker that restores a state
        from a pool of machines (``rollsafe verify``); a running fleet never swaps machines."""
        group = self.get(group_id)
        if tuple(machine.ranks) != group.ranks:
            raise InvalidArgument(
                "machine",
                f"group {group_id!r}: machine ranks {list(machine.ranks)} != {list(group.ranks)}",
            )
        with group._lock:
            if machine is group.machine:
                return
            if machine not in group._tapped:
                machine.add_listener(_GroupTap(self, group))  # type: ignore[no-untyped-call]
                group._tapped.add(machine)
            group.machine = machine

    def restore_version(self, version: int) -> None:
        """Set the fleet version, also to an older one: a model checker restoring an earlier
        state (``rollsafe verify``). A running fleet moves it only forward
        (:meth:`set_fleet_version`)."""
        with self._lock:
            self._version = version

    def rebind_clients(
        self,
        group_id: str,
        clients: Sequence[EngineClient],
        endpoints: Sequence[str] | None = None,
    ) -> WorkerGroup:
        """Point a group at new engine clients (a restart on port 0 gets a new URL).

        Taken under the group's lock, so a request dispatches to the old or the new client,
        never to a half-updated pair.
        """
        group = self.get(group_id)
        client_tuple = tuple(clients)
        if not client_tuple:
            raise InvalidArgument(
                "clients", f"group {group_id!r}: rebind_clients needs at least one client"
            )
        eps = tuple(endpoints) if endpoints is not None else tuple(c.url for c in client_tuple)
        with group._lock:
            group.clients = client_tuple
            group.endpoints = eps
        return group

    def get(self, group_id: str) -> WorkerGroup:
        """The group ``group_id``; :class:`UnknownGroup` if none."""
        group = self._groups.get(group_id)
        if group is None:
            with self._lock:
                raise UnknownGroup(group_id, list(self._groups))
        return group

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._groups

    def __len__(self) -> int:
        return len(self._groups)

    def groups(self) -> list[WorkerGroup]:
        """Every registered group, in registration order."""
        with self._lock:
            return list(self._groups.values())

    def routable(self) -> list[WorkerGroup]:
        """The groups in ``active`` right now (a point-in-time view; the router re-checks)."""
        return [g for g in self.groups() if g.machine.is_routable]

    def group_of_rank(self, rank: int) -> WorkerGroup:
        """The group owning ``rank``; ``KeyError`` naming the rank if none."""
        with self._lock:
            gid = self._rank_owner.get(rank)
        if gid is None:
            raise KeyError(f"rank {rank} belongs to no registered worker group")
        return self.get(gid)

    # ------------------------------------------------------------------ events
    def send(self, group_id: str, event: GroupEvent, **kwargs: Any) -> GroupTransition:
        """Send ``event`` (a :class:`GroupEvent`) to the group's machine; notify listeners;
        return the transition.

        ``current_version=`` is filled in with :attr:`fleet_version` for the events whose guards
        need it. A refused event raises the machine's
        :class:`~rollsafe.statemachines.base.TransitionRefused` and notifies nobody. The
        transition is recorded by the registry's python-statemachine listener on the machine
        (``after_transition``), so an event sent to the machine directly is seen as well.
        """
        group = self.get(group_id)
        try:
            record = self._send_quietly(group, event, kwargs)
        except TransitionRefused as exc:
            self._deliver()
            self._refused(group, event_name(event), exc)
            raise
        self._deliver()
        return record

    def _send_quietly(
        self, group: WorkerGroup, event: GroupEvent, kwargs: dict[str, Any]
    ) -> GroupTransition:
        """Send under the group's lock; the listeners are told later (``_deliver``)."""
        name = event_name(event)
        if name in VERSIONED_EVENTS and "current_version" not in kwargs:
            kwargs["current_version"] = self._version
        with group._lock:
            self._local.record = None
            group.machine.send(name, **kwargs)
            record: GroupTransition | None = self._local.record
        assert record is not None, "the machine took the event but its listener saw nothing"
        return record

    def send_together(
        self,
        events: Sequence[tuple[str, Sequence[GroupEvent]]],
        *,
        decided_by: str | None = None,
        all_or_nothing: bool = False,
    ) -> list[tuple[str, str]]:
        """Send each listed group its events in one step: every group's lock is held (taken
        in id order) until all are sent, so the router admits no request to any of them in
        between (a node's loss takes all its groups out at once). Returns ``(group id, why)``
        for each event a machine refused (the others are taken); an unknown group is refused.
        ``decided_by``: the policy function that decided them, kept with each transition's
        inputs (a recorded run says who sent what: ``rollsafe verify --trace``).

        ``all_or_nothing`` (one event per group): every machine is asked first, under the
        locks, whether it takes its event; when one would refuse, none is sent and every group
        is reported refused, the refusing one with its machine's reasons (a spare's promotion
        and the enlisting of the group it covers: both or neither).
        """
        if all_or_nothing and any(len(evs) != 1 for _, evs in events):
            raise InvalidArgument(
                "events", "all_or_nothing sends exactly one event per group: " + repr(events)
            )
        inputs = {} if decided_by is None else {"decided_by": decided_by}
        refused: list[tuple[str, str]] = []
        refusals: list[tuple[WorkerGroup, str, TransitionRefused]] = []
        known: dict[str, WorkerGroup] = {}
        for gid, _ in events:
            group = self._groups.get(gid)
            if group is None:
                refused.append((gid, "not in the fleet"))
            else:
                known[gid] = group
        with contextlib.ExitStack() as held:
            for gid in sorted(known):
                held.enter_context(known[gid]._lock)
            if all_or_nothing:
                blocked = refused or self._would_refuse(known, events)
                if blocked:
                    why = "; ".join(f"{g}: {w}" for g, w in blocked)
                    return [(gid, why) for gid, _ in events]
            for gid, evs in events:
                if gid not in known:
                    continue
                for event in evs:
                    try:
                        self._send_quietly(known[gid], event, dict(inputs))
                    except TransitionRefused as refusal:
                        refused.append((gid, str(refusal)))
                        refusals.append((known[gid], event_name(event), refusal))
        self._deliver()
        for group, name, error in refusals:
            self._refused(group, name, error)
        return refused

    def _would_refuse(
        self,
        known: Mapping[str, WorkerGroup],
        events: Sequence[tuple[str, Sequence[GroupEvent]]],
    ) -> list[tuple[str, str]]:
        """``(group id, why)`` of each group whose machine would refuse its one event now."""
        out: list[tuple[str, str]] = []
        for gid, evs in events:
            name = event_name(evs[0])
            kwargs = {"current_version": self._version} if name in VERSIONED_EVENTS else {}
            machine = known[gid].machine
            if not machine.can(name, **kwargs):
                reasons = "; ".join(machine.explain(name, **kwargs)) or "refused"
                out.append(
                    (gid, f"{machine.label} would refuse {name!r} in {machine.state!r}: {reasons}")
                )
        return out

    def _on_transition(self, group: WorkerGroup, event: str, source: str, target: str) -> None:
        """Called by a group machine's listener after each of its transitions."""
        with self._lock:
            self._seq += 1
            seq = self._seq
            version = self._version
        record = GroupTransition(seq, group.group_id, event, source, target, time.time(), version)
        group._transitions.append(record)
        group._generation += 1
        self._local.record = record
        if self._groups.get(group.group_id) is group:
            self._pending.append((group, record))

    def can(self, group_id: str, event: str, **kwargs: Any) -> bool:
        """Whether ``event`` would be taken now (with the fleet version filled in as by send)."""
        group = self.get(group_id)
        if event in VERSIONED_EVENTS and "current_version" not in kwargs:
            kwargs["current_version"] = self._version
        return group.machine.can(event, **kwargs)

    def report_member(
        self, group_id: str, rank: int, *, healthy: bool, weights_version: int | None = None
    ) -> None:
        """Record a probe's or engine's word about one rank (feeds guards; no transition)."""
        self.get(group_id).machine.report_member(
            rank, healthy=healthy, weights_version=weights_version
        )

    def forget_member(self, group_id: str, rank: int) -> None:
        """Mark one rank unknown (its process vanished without a report)."""
        self.get(group_id).machine.forget_member(rank)

    # ------------------------------------------------------------------ inspection
    def dispatch_counts(self) -> dict[str, dict[str, int]]:
        """Requests admitted per group, keyed by the group's state at admission.

        By construction every key is ``"active"``; chaos tests assert exactly that.
        """
        return {g.group_id: g.dispatch_counts() for g in self.groups()}

    def snapshot(self) -> dict[str, Any]:
        """A JSON-friendly view: fleet version, and per group state, members, routable, warm
        standby (``standby.state``: ``none`` / ``warming`` / ``ready``), requests and last
        transitions."""
        groups = self.groups()
        return {
            "fleet_version": self._version,
            "routable": [g.group_id for g in groups if g.is_routable],
            "listener_errors": self._listener_errors,
            "groups": {g.group_id: g.describe() for g in groups},
        }

    # ------------------------------------------------------------------ delivery
    def _deliver(self) -> None:
        while True:
            with self._deliver_lock:
                if self._draining or not self._pending:
                    return
                self._draining = True
            try:
                while True:
                    with self._deliver_lock:
                        if not self._pending:
                            self._draining = False
                            break
                        group, record = self._pending.popleft()
                    self._notify(group, record)
            except BaseException:
                with self._deliver_lock:
                    self._draining = False
                raise

    def _notify(self, group: WorkerGroup, record: GroupTransition) -> None:
        listeners = self._listeners
        if not listeners:
            return
        hook = _TARGET_HOOK.get(record.target) if record.target != record.source else None
        for listener in listeners:
            self._call(listener, "on_transition", group, record)
            if hook is not None:
                self._call(listener, hook, group)

    def _refused(self, group: WorkerGroup, event: str, error: TransitionRefused) -> None:
        """Tell the listeners of a refusal (outside every lock, after the pending
        transitions)."""
        for listener in self._listeners:
            self._call(listener, "on_refused", group, event, error)

    def _call(self, listener: object, hook: str, *args: Any) -> None:
        fn: Callable[..., Any] | None = getattr(listener, hook, None)
        if fn is None:
            return
        try:
            fn(*args)
        except Exception:
            self._listener_errors += 1
            log.exception("fleet listener %r.%s raised; continuing", listener, hook)
