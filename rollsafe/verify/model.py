"""The composed fleet model: the four real machines driven by the real policy functions.

``FleetModel`` holds N worker groups of R ranks (``WorkerGroupLifecycle``), one
``CheckpointRegistration`` over all engine ranks, one ``ExportLifecycle`` per weights version
and one ``ImmediateRecoveryMode``, plus the ground truth the fleet can only observe: whether
each engine rank is alive and which weights it really holds, and whether each export's
directory exists. Every decision is a call to :mod:`rollsafe.policy` (looked up at call time,
so a patched policy function is what the model runs) and every event it sends is the one that
decision named. A sync is not sequenced here at all: :meth:`FleetModel._do_sync` executes the
steps of :func:`rollsafe.operations.sync.sync` (the sequence the fleet's ``SyncCoordinator``
executes too), performing each effect on the machines and the ground truth and answering with
the outcome the action chose. A recovery attempt is not sequenced here either: the ``recover``,
``restart``, ``restart_timeout`` and ``push`` actions execute the phases of
:func:`rollsafe.operations.recover.attempt` (claim and lease, restart, targeted push: the
sequence the fleet's ``RecoveryCoordinator`` executes), and the rest of the fleet may move
between phases as it does between the fleet's threads. A health probe is not sequenced here
either: the ``probe`` and ``probe_timeout`` actions execute :func:`rollsafe.operations.probe.probe`
(the sequence the fleet's ``HealthManager`` executes), the probe answering with the ranks that
are down, or timing out (every rank counts a failure).

With ``ModelConfig(deltas=True)`` (the default) every push to a group goes through a
:class:`~rollsafe.statemachines.DeltaBase` per group, planned by :func:`rollsafe.policy.plan_push`
and settled by :func:`rollsafe.policy.settle_push`, exactly as
:class:`rollsafe.registry.delta_ledger.DeltaLedger` does for a transport (the verifier cannot
import a transport: it is a lower layer): the sender holds the weights of the fleet's current
version only (a target whose base is older lags: full push); a delta reaches an engine whose
ranks all hold its base and is applied on all of them or none (a live rank that holds another
version refuses it, nothing changed, and the sync retries that target with a full push); a
failed push leaves the engines' weights as a failed full push would (a rank that keeps no weights
is poisoned), the others unchanged; every restart, recovery push (forced full) and removal resets
the group's base. The invariants ``delta_only_onto_its_base`` and ``base_never_ahead`` judge it.

What the model chooses nondeterministically are the outcomes of I/O, each an :class:`Action`: a
rank comes up or crashes, a probe answers or times out, a recovery claims a group, a restart
succeeds, fails or times out (a restart from an export then holds its lease until it ends in
the background: ``restart_ends``), a targeted push succeeds or fails, a sync registers on every
rank or not and its update fails on one rank of a group or not, an export finishes on time,
fails or is still running when the next sync begins, retention runs. It also fires stray group
events (a racing or duplicated sender): the guards must refuse the wrong ones, and a refused
event must change nothing.

The model starts as the fleet does: the start checkpoint is the ready export of
``ModelConfig.initial_version``. A sync starts the export of its version as the exporter does
(``snapshot``, ``snapshot_done``); ``export_finish`` is the writer's ``shards_written`` and
``publish``; retention is its own step. ``rollsafe verify --trace``
(:mod:`rollsafe.verify.replay`) steps this same model with a recorded run, through replay-time
arguments no exploration takes (a sync's recorded version and failing groups, one writer step:
``export_step``).

Invariants are :mod:`rollsafe.invariants` on :meth:`FleetModel.picture`.
``snapshot()``/``restore()`` turn the model into a hashable value and back; ``canonical()``
identifies states that differ only by a permutation of groups or of ranks inside a group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from statemachine.exceptions import TransitionNotAllowed

import rollsafe.invariants as invariants
import rollsafe.operations.effects as fx
import rollsafe.policy as policy
from rollsafe.errors import InvalidArgument
from rollsafe.invariants import (
    DeltaPicture,
    ExportPicture,
    FleetPicture,
    GroupPicture,
    LeasePicture,
    MemberPicture,
    PromotionPicture,
    RecoveryPicture,
)
from rollsafe.invariants import InvariantViolation as Violation
from rollsafe.operations import place as place_op
from rollsafe.operations import probe as probe_op
from rollsafe.operations import push as push_op
from rollsafe.operations import recover as recover_op
from rollsafe.operations import spare as spare_op
from rollsafe.operations import sync as sync_op
from rollsafe.operations.effects import DONE, Failed, Ok, Outcome, TimedOut, drive
from rollsafe.operations.executor import Executor, handles
from rollsafe.registry import DeltaLedger, FleetRegistry, RegistryEffects
from rollsafe.statemachines import (
    CheckpointRegistration,
    DeltaBase,
    ExportLease,
    ExportLifecycle,
    GuardedMachine,
    ImmediateRecoveryMode,
    LeaseError,
    MemberFacts,
    WorkerGroupLifecycle,
)
from rollsafe.statemachines.events import (
    AnyEvent,
    ExportEvent,
    GroupEvent,
    event_name,
)

__all__ = ["GROUP_EVENTS", "Action", "FleetModel", "ModelConfig", "Violation"]

#: Stray group events the model may fire at any group (the guards must refuse the wrong ones).
#: ``fail`` comes from probes and updates, ``claim`` / ``retire`` / ``restart_failed`` from the
#: recovery actions (as in the fleet); the guarded events are also fired stray.
GROUP_EVENTS: tuple[str, ...] = (
    GroupEvent.LAUNCHED.value,
    GroupEvent.RESTARTED.value,
    GroupEvent.MARK_STALE.value,
    GroupEvent.WEIGHTS_LOADED.value,
)

POISONED = invariants.POISONED

_KEYS: tuple[str, ...] = ("model.embed_tokens.weight", "lm_head.weight", "mtp.layer.weight")
_REGISTERED = _KEYS[:2]  # the MTP key is legitimately missing (allow-listed)
_RUNNING_EXPORT = ("requested", "snapshotting", "writing", "committing")
_OK = DONE
#: the states the health manager probes (``rollsafe.fleet.health.DEFAULT_PROBE_STATES``)
_PROBED = ("active", "standby", "pending_weights")
#: the push's decisions the model audits (a policy function's declared events)
_DELTA_DECISIONS = frozenset({"plan_push", "settle_push"})


@dataclass(frozen=True)
class ModelConfig:
    """Size of the composed model."""

    groups: int = 2
    ranks: int = 2
    restart_budget: int = 2
    rearm_after: int = 2
    keep_last: int = 1
    failure_threshold: int = 1
    max_version: int | None = None
    #: Also toggle immediate recovery off/on (the property tests do; the exhaustive run leaves
    #: enable/disable to the machine-level tests).
    mode_toggles: bool = False
    #: the engine kind whose failures the model explores (:func:`rollsafe.policy.engine_traits`):
    #: ``"vllm"`` (a failed update leaves unknown weights that ``/health`` does not reveal) or
    #: ``"reference"`` (its SGLang dialect keeps the old weights)
    engine: str = "vllm"
    #: explore node deaths (a node takes every group on it: one group, or all of them), the
    #: watcher's report of them and the re-placement of each group (``docs/cluster.md``)
    node_loss: bool = True
    #: how many groups one run may remove (``remove_group``: drain, stop, retire)
    removals: int = 1
    #: push through per-group :class:`~rollsafe.statemachines.DeltaBase` machines, deltas
    #: where :func:`rollsafe.policy.plan_push` allows them (issue #28); False: every push full,
    #: no base tracked (the model before deltas)
    deltas: bool = True
    #: the version the fleet starts at (``FleetConfig.initial_version``): the engines launch
    #: holding it, and the start checkpoint (``model_path``) is its ready export from the start
    initial_version: int = 0
    #: each group's rank count, when they differ (a recorded fleet's: ``rollsafe verify
    #: --trace``); empty: ``groups`` groups of ``ranks`` ranks
    group_ranks: tuple[int, ...] = ()
    #: the fleet's ``enable_immediate_recovery`` (the mode starts enabled or disabled)
    immediate_recovery: bool = True
    #: a transport can push to one group (``RecoverySettings.targeted_push``)
    targeted_push: bool = True
    #: the node slices of every group (``GroupSpec.ranks_per_node``: a group over ``slices``
    #: nodes, each rank count a multiple of it): the node under one slice may die alone
    #: (``slice_dies``); the watcher's report takes the whole group out, re-placement places
    #: every slice or none; 1 (the default): each group on one node
    slices: int = 1
    #: spare groups besides the ``groups`` serving ones (``FleetConfig.spare_groups``): each
    #: starts as a spare (the groups' size), ``standby`` once launched, promoted in place of a
    #: serving group that left routing (``cover``); 0 (the default) explores no spare and no
    #: ``cover`` action
    spares: int = 0

    def __post_init__(self) -> None:
        if self.groups < 1 or self.ranks < 1:
            raise InvalidArgument("groups", f"need groups >= 1 and ranks >= 1, got {self}")
        if self.group_ranks and (len(self.group_ranks) != self.groups or min(self.group_ranks) < 1):
            raise InvalidArgument(
                "group_ranks",
                f"group_ranks must give {self.groups} rank counts >= 1, got {self.group_ranks}",
            )
        if self.spares < 0:
            raise InvalidArgument("spares", f"spares must be >= 0, got {self.spares}")
        if self.slices < 1 or any(n % self.slices for n in self.rank_counts):
            raise InvalidArgument(
                "slices",
                f"slices must be >= 1 and divide every group's ranks {self.rank_counts}, got "
                f"{self.slices}",
            )
        if self.failure_threshold < 1:
            raise InvalidArgument(
                "failure_threshold", f"failure_threshold must be >= 1, got {self.failure_threshold}"
            )
        if self.removals < 0:
            raise InvalidArgument("removals", f"removals must be >= 0, got {self.removals}")
        if self.initial_version < 0:
            raise InvalidArgument(
                "initial_version", f"initial_version must be >= 0, got {self.initial_version}"
            )
        if policy.engine_traits(self.engine) is policy.UNKNOWN_ENGINE:
            known = sorted({kind for kind, _ in policy.ENGINE_TRAITS})
            raise InvalidArgument("engine", f"engine must be one of {known}, got {self.engine!r}")

    @property
    def total_groups(self) -> int:
        """The serving groups and the spares (the spares last)."""
        return self.groups + self.spares

    @property
    def rank_counts(self) -> tuple[int, ...]:
        """Each group's rank count (the spares last, of the first group's size)."""
        serving = self.group_ranks or (self.ranks,) * self.groups
        return serving + (serving[0],) * self.spares

    def slice_of(self, g: int, r: int) -> int:
        """The node slice rank ``r`` of group ``g`` runs on."""
        return r // (self.rank_counts[g] // self.slices)

    @property
    def traits(self) -> policy.EngineTraits:
        """The explored engine kind's :class:`~rollsafe.policy.EngineTraits`."""
        return policy.engine_traits(self.engine)


@dataclass(frozen=True)
class Action:
    """One thing that can happen to the fleet: a name and its arguments."""

    name: str
    args: tuple[Any, ...] = ()

    def __str__(self) -> str:
        inner = ", ".join(repr(a) for a in self.args)
        return f"{self.name}({inner})"


@dataclass
class _Audit:
    """Facts kept beside the machines, only for the invariants."""

    max_version_seen: int = 0
    late_versions: frozenset[int] = frozenset()
    on_time_since_late: int | None = None
    judged_version: int = 0
    immediate: tuple[RecoveryPicture, ...] = ()
    recovery_threads: tuple[tuple[str, str], ...] = ()
    refused: tuple[str, ...] = ()
    register_complete: bool | None = None
    wrong_base_deltas: tuple[str, ...] = ()
    promotions: tuple[PromotionPicture, ...] = ()
    partial_placements: tuple[str, ...] = ()


def _declared() -> dict[str, frozenset[str]]:
    table: dict[str, set[str]] = {}
    for sender in policy.SENDERS:
        if sender.decided_by is not None:
            table.setdefault(sender.decided_by, set()).update(sender.events)
    return {k: frozenset(v) for k, v in table.items()}


_DECLARED = _declared()


class FleetModel(Executor):
    """The composed fleet model. Machine classes are parameters so tests can plant bugs in
    them; policy bugs are planted by patching :mod:`rollsafe.policy`.

    The model is the verifier's executor of the operations: one table of handlers (the
    I/O's outcomes, chosen by the actions) and, as a part, the registry's own handlers
    (:class:`~rollsafe.registry.RegistryEffects`) on a real
    :class:`~rollsafe.registry.FleetRegistry` holding the model's group machines: an event the
    policy decided is sent, refused and recorded exactly as on the fleet. The model hears
    those sends as the registry's :class:`~rollsafe.registry.SendAudit`."""

    parts = {RegistryEffects: "registry_effects", DeltaLedger: "ledger"}

    def __init__(
        self,
        config: ModelConfig | None = None,
        *,
        group_cls: type[WorkerGroupLifecycle] = WorkerGroupLifecycle,
        export_cls: type[ExportLifecycle] = ExportLifecycle,
        registration_cls: type[CheckpointRegistration] = CheckpointRegistration,
        mode_cls: type[ImmediateRecoveryMode] = ImmediateRecoveryMode,
        delta_cls: type[DeltaBase] = DeltaBase,
    ) -> None:
        self.config = cfg = config or ModelConfig()
        self._group_cls = group_cls
        self._export_cls = export_cls
        self.groups: list[WorkerGroupLifecycle] = [
            self._new_group(g) for g in range(cfg.total_groups)
        ]
        self._group_pool: list[list[WorkerGroupLifecycle]] = [[grp] for grp in self.groups]
        self.registration = registration_cls(world_size=sum(cfg.rank_counts))
        self.mode = mode_cls(enabled=cfg.immediate_recovery, rearm_after=cfg.rearm_after)
        #: the fleet's table: the groups' machines and the fleet version, as the fleet keeps them
        self.registry = FleetRegistry(fleet_version=cfg.initial_version)
        for grp in self.groups:
            self.registry.add_group(grp.group_id, grp.ranks, machine=grp)
        self.registry_effects = RegistryEffects(self.registry, audit=self)
        #: ground truth per group: per rank (alive, weights really held)
        self.truth: list[tuple[tuple[bool, int | None], ...]] = [
            tuple((False, None) for _ in range(n)) for n in cfg.rank_counts
        ]
        self.counts: list[dict[int, int]] = [{} for _ in range(cfg.total_groups)]
        #: ground truth per group: the node under each of its slices is alive
        self.node_up: list[tuple[bool, ...]] = [(True,) * cfg.slices] * cfg.total_groups
        #: groups whose node's death the fleet was told of, not placed again since
        self.node_lost: set[int] = set()
        #: per group, the slices whose node's death the fleet was told of (not placed since)
        self.lost_slices: list[tuple[int, ...]] = [()] * cfg.total_groups
        #: groups whose removal began
        self.removed: set[int] = set()
        #: claims made on each group's restart budget
        self.claims: list[int] = [0] * cfg.total_groups
        self.exports: dict[int, ExportLifecycle] = {}
        # Export machines by version, reused across restores (building one costs ~1 ms).
        self._export_pool: dict[int, list[ExportLifecycle]] = {}
        self.dirs: dict[int, bool] = {}
        # The start checkpoint: ``model_path``, verified at start, is the ready export of the
        # initial version (``HFExporter.adopt_start``), leased and retained like any export.
        start = export_cls(cfg.initial_version)
        start.adopt(verified=True, version=cfg.initial_version)
        self.exports[cfg.initial_version] = start
        self._export_pool[cfg.initial_version] = [start]
        self.dirs[cfg.initial_version] = True
        self.last_export: int | None = None
        self.leases: dict[int, ExportLease] = {}  # group index -> lease
        #: group index -> the lease its timed-out restart holds while it still runs in the
        #: background (None: a dummy restart, no lease); no recovery claims the group meanwhile
        self.late: dict[int, ExportLease | None] = {}
        self.audit = _Audit(
            max_version_seen=cfg.initial_version, judged_version=cfg.initial_version
        )
        self._allowed = {
            cls: _allowed_events_table(cls) for cls in (group_cls, export_cls, registration_cls)
        }
        self._index = {grp.group_id: g for g, grp in enumerate(self.groups)}
        #: the running sync's outcomes: registered everywhere; group -> the rank that fails
        self._choice: tuple[bool | None, dict[int, int]] = (True, {})
        self._restart_choice = "ok"  # the running restart's outcome: ok, failed, timeout
        self._during: int | None = None  # the running sync's ``during`` group, until it reads
        self._hook_failed: str | None = None  # replay: the colocated hook the recorded sync failed
        self._not_smaller = False  # replay: the recorded sync's deltas were not smaller
        self._moved: dict[str, str] = {}  # groups that failed and came back during the update
        self._pulled: bool | None = None  # replay: the running lease's recorded pull, if any
        self._push_ok = True  # the running targeted push's outcome
        self._probe_timed_out = False  # the running probe's outcome: no answer in time
        self._own_acts = 0  # the model's own effects that changed it
        #: the thread the running action stands for: ``health`` while a probe runs
        self._thread = "recovery"
        #: the sender's base per group: a real DeltaLedger (a part: it sends the push's
        #: decided events), one DeltaBase per group
        self.ledger = DeltaLedger(machine_cls=delta_cls)
        self.delta: list[DeltaBase] = (
            [self.ledger.machine_for(f"g{g}") for g in range(cfg.total_groups)]
            if cfg.deltas
            else []
        )
        #: what each spare's engines answered to the running cover's version check (``()``:
        #: no answer)
        self._reported: dict[str, tuple[str | None, ...]] = {}
        #: hears the transitions into an export's final state, which the model takes with
        #: ``restore_state`` (no machine history): ``((kind, subject), event, source, target,
        #: inputs)``
        #: (a replay of a recorded run: ``rollsafe.verify.replay``)
        self.tap: Callable[[tuple[tuple[str, str], str, str, str, dict[str, Any]]], None] | None = (
            None
        )
        self._failing: dict[int, int] = {}  # the running push's failing rank per group
        self._pushed: dict[int, dict[int, bool]] = {}  # the running push's results
        #: the running push's groups lost and back during it: the push went to the engine
        #: each lost and failed there (``_lost_and_back``)
        self._gone: frozenset[int] = frozenset()

    @property
    def version(self) -> int:
        """The fleet's version (the registry's)."""
        return self.registry.fleet_version

    @property
    def _acted(self) -> int:
        """Effects that changed the model so far (an action that took none changed nothing)."""
        return self._own_acts + self.registry_effects.changes

    # -- the registry's sends, heard as its SendAudit
    def decided(self, by: str, events: Sequence[GroupEvent]) -> None:
        self._decided(by, tuple(events))

    def taken(self, group: str, event: GroupEvent) -> None:
        if event is GroupEvent.CLAIM:
            g = self._index[group]
            self.claims[g] += 1
            if self._thread == "health":  # a recovery began inside a probe's sequence
                self.audit.recovery_threads = (*self.audit.recovery_threads, (group, "health"))

    def refused(self, by: str, why: str) -> None:
        self._refuse(f"policy.{by}: {why}")

    def _new_group(self, g: int) -> WorkerGroupLifecycle:
        cfg = self.config
        first = sum(cfg.rank_counts[:g])
        return self._group_cls(
            range(first, first + cfg.rank_counts[g]),
            restart_budget=cfg.restart_budget,
            group_id=f"g{g}",
            spare=g >= cfg.groups,
        )

    def _builder(self, g: int) -> Callable[[], WorkerGroupLifecycle]:
        return lambda: self._new_group(g)

    # ------------------------------------------------------------------ actions
    def actions(self) -> Iterator[Action]:
        """Every action the model may take now (refused ones included)."""
        cfg = self.config
        for g in range(cfg.total_groups):
            for r in range(cfg.rank_counts[g]):
                yield Action("launch", (g, r))
                yield Action("crash", (g, r))
            yield Action("probe", (g,))
            yield Action("probe_timeout", (g,))
            yield Action("recover", (g,))
            yield Action("restart", (g, True))
            yield Action("restart", (g, False))
            yield Action("restart_timeout", (g,))
            yield Action("restart_ends", (g,))
            yield Action("push", (g, True))
            yield Action("push", (g, False))
            for event in GROUP_EVENTS:
                yield Action("stray", (g, event))
            if cfg.node_loss:
                yield Action("place", (g,))
            if cfg.removals:
                yield Action("remove", (g,))
                yield Action("finish_removal", (g,))
            if cfg.spares:
                yield Action("cover", (g,))
        if cfg.node_loss:
            for dying in _node_sets(cfg.total_groups):
                yield Action("node_dies", (dying,))
            if cfg.slices > 1:  # the node under one slice of a group that spans nodes
                for g in range(cfg.total_groups):
                    for s in range(cfg.slices):
                        yield Action("slice_dies", (g, s))
            yield Action("node_lost")
        yield Action("sync", (False, None, "fail"))
        yield Action("sync", (None, None, "fail"))
        yield Action("sync", (True, None, "fail"))
        for g in range(cfg.total_groups):
            yield Action("sync", (True, g, "fail"))
            yield Action("sync", (True, g, "stale"))
            yield Action("sync", (True, None, "fail", None, (), g))
        yield Action("stray_delete")
        yield Action("export_finish")
        yield Action("export_fail")
        yield Action("retention")
        if cfg.mode_toggles:
            yield Action("mode_toggle")

    def enabled_actions(self) -> Iterator[Action]:
        """Actions that can change something now (a cheap pre-filter on states)."""
        for action in self.actions():
            if self._may_change(action):
                yield action

    def apply(self, action: Action) -> bool:
        """Take ``action``. Returns False when nothing happened (nothing changed)."""
        handler: Callable[..., bool] = getattr(self, f"_do_{action.name}")
        try:
            return handler(*action.args)
        except TransitionNotAllowed:
            return False
        finally:
            if self.version > self.audit.max_version_seen:
                self.audit.max_version_seen = self.version

    def _restore_exports(self, exports: tuple[Any, ...], groups: tuple[Any, ...]) -> None:
        self.exports = {}
        self.dirs = {}
        self.leases = {}
        for v, state, _leases, present in exports:
            export = self._pooled_export(v, state)
            for lease in export.leases:
                export.release_lease(lease)
            self.exports[v] = export
            self.dirs[v] = present
        self.late = {}
        for g, row in enumerate(groups):
            lease_version = row[5]
            if lease_version is not None and lease_version in self.exports:
                export = self.exports[lease_version]
                lease = ExportLease(-(g + 1), lease_version, f"g{g}")
                export.restore_lease(lease)
                self.leases[g] = lease
            for late_version in row[6]:  # () not running; (None,) no lease; (v,) holds v
                late_lease = None
                if late_version is not None and late_version in self.exports:
                    late_lease = ExportLease(-(g + 1) - 1000, late_version, f"g{g}")
                    self.exports[late_version].restore_lease(late_lease)
                self.late[g] = late_lease

    def _pooled_export(self, version: int, state: str) -> ExportLifecycle:
        """An export machine of ``version`` in ``state``: a pooled one when possible."""
        return _pooled(
            self._export_pool.setdefault(version, []), state, lambda: self._export_cls(version)
        )

    def _end_export(self, export: ExportLifecycle, event: ExportEvent) -> str | None:
        """:func:`_end_export`, told to :attr:`tap`."""
        source = export.state
        refused = _end_export(export, event)
        if refused is None and self.tap is not None:
            self.tap((("export", f"v{export.version}"), event.value, source, export.state, {}))
        return refused

    # -- sending what the policy decided
    def _decided(self, fn: str, events: tuple[AnyEvent, ...]) -> None:
        extra = {event_name(e) for e in events} - _DECLARED.get(fn, frozenset())
        if extra:
            self._refuse(f"policy.{fn} returned undeclared events {sorted(extra)}")

    def _refuse(self, text: str) -> None:
        self.audit.refused = (*self.audit.refused, text)

    def _send_group(self, g: int, event: GroupEvent, by: str) -> bool:
        """Send a decided event through the registry's handler (a recovery's lease is released
        by the recovery itself: the operation's ``ReleaseLease``, never as a side effect)."""
        return isinstance(self.perform(fx.SendGroup(f"g{g}", event, by)), Ok)

    def _release_lease(self, g: int) -> None:
        self._release(self.leases.pop(g, None))

    def _release(self, lease: ExportLease | None) -> None:
        if lease is not None and lease.version in self.exports:
            export = self.exports[lease.version]
            if any(held.lease_id == lease.lease_id for held in export.leases):
                export.release_lease(lease)

    def _recorded(self, g: int) -> dict[int, bool]:
        return {rank: m.healthy for rank, m in self.groups[g].members.items()}

    # -- engines coming up and going down
    def _do_launch(self, g: int, r: int) -> bool:
        group = self.groups[g]
        alive, _ = self.truth[g][r]
        if group.state != "launching" or alive or not self.node_up[g][self.config.slice_of(g, r)]:
            return False
        start = self.config.initial_version  # every engine launches on the start checkpoint
        self._set_truth(g, r, True, start)
        self.registry.report_member(
            group.group_id, group.ranks[r], healthy=True, weights_version=start
        )
        events = policy.launch_events(self._recorded(g))
        for event in events:
            self._send_group(g, event, "launch_events")
        return True

    def _do_crash(self, g: int, r: int) -> bool:
        alive, _ = self.truth[g][r]
        if not alive or self.groups[g].state == "retired":
            return False
        self._set_truth(g, r, False, None)
        return True

    def _set_truth(self, g: int, r: int, alive: bool, version: int | None) -> None:
        row = list(self.truth[g])
        row[r] = (alive, version)
        self.truth[g] = tuple(row)

    # -- the health manager: the second executor of rollsafe.operations.probe
    def _do_probe(self, g: int) -> bool:
        """A probe of group ``g`` answers: the ranks that are down are unhealthy."""
        return self._probe(g, timed_out=False)

    def _do_probe_timeout(self, g: int) -> bool:
        """A probe of group ``g`` gets no answer in time: every rank counts a failure."""
        return self._probe(g, timed_out=True)

    def _probe(self, g: int, *, timed_out: bool) -> bool:
        if self.groups[g].state not in _PROBED:
            return False
        self._probe_timed_out = timed_out
        before = self._acted
        self._thread = "health"
        try:
            drive(probe_op.probe(f"g{g}", self.config.failure_threshold), self.perform)
        finally:
            self._thread = "recovery"
        return self._acted > before  # False: an answer that changes nothing

    # -- the recovery coordinator: the second executor of rollsafe.operations.recover
    def _do_recover(self, g: int, pulled: bool | None = None) -> bool:
        """Gate, claim and lease: the first phases of :func:`rollsafe.operations.recover.attempt`
        (the model's recoveries are retried by this action being enabled again). ``pulled``
        (replay only): the leased export had to be moved to the group's node, and its pull
        succeeded (True) or failed (False), as the recorded run's ``pull`` step says."""
        if self.groups[g].state != "inactive" or g in self.late:
            return False
        before = self._acted
        gid = f"g{g}"
        end = drive(recover_op.claim(gid), self.perform)
        if end is None:  # claimed
            self._lease_phase(gid, pulled)
        return self._acted > before

    def _lease_phase(self, gid: str, pulled: bool | None) -> None:
        self._pulled = pulled
        try:
            drive(recover_op.take_lease(gid), self.perform)
        finally:
            self._pulled = None

    def _do_restart(self, g: int, ok: bool) -> bool:
        """The restart phase, its restart succeeding or failing."""
        return self._restart_phase(g, "ok" if ok else "failed")

    def _do_restart_timeout(self, g: int) -> bool:
        """The restart phase, its restart timing out: it goes on in the background (holding
        the export's lease, if any) until ``restart_ends``."""
        return self._restart_phase(g, "timeout")

    def _restart_phase(self, g: int, choice: str) -> bool:
        if self.groups[g].state != "recovering":
            return False
        self._restart_choice = choice
        lease = self.leases.get(g)
        leased = fx.Leased(lease.version, _path(lease.version), lease) if lease else None
        drive(recover_op.restart(f"g{g}", leased), self.perform)
        return True

    def _do_restart_ends(self, g: int) -> bool:
        """A timed-out restart ends in the background: the lease it held is released."""
        if g not in self.late:
            return False
        self._release(self.late.pop(g))
        return True

    def _do_push(self, g: int, ok: bool) -> bool:
        """The targeted push phase, the push succeeding or failing on one rank."""
        if self.groups[g].state != "pending_weights":
            return False
        self._push_ok = ok
        before = self._acted
        drive(recover_op.push(f"g{g}", self.config.traits), self.perform)
        return self._acted > before  # False: deferred, nothing pushed

    def _push_to(self, g: int, version: int, failing_rank: int | None) -> dict[int, bool]:
        """Move ``version`` into the live ranks of group ``g`` except ``failing_rank``.

        On an engine that keeps no weights after a failed update, the failing rank is left
        holding :data:`POISONED` weights (its ``/health`` still answers), and a push into a
        poisoned rank fails too: only a restart clears it."""
        rank_ok: dict[int, bool] = {}
        ranks = self.groups[g].ranks
        keeps = self.config.traits.failed_update_keeps_weights
        for r, (alive, held) in enumerate(self.truth[g]):
            loaded = alive and r != failing_rank and held != POISONED
            rank_ok[ranks[r]] = loaded
            if loaded:
                self._set_truth(g, r, True, version)
            elif alive and not keeps:
                self._set_truth(g, r, True, POISONED)
        return rank_ok

    # -- pushes: every group at once (a sync) or one group (a recovery), as a transport does
    def _push(
        self,
        version: int,
        groups: tuple[int, ...],
        failing: dict[int, int],
        *,
        force: bool,
        gone: frozenset[int] = frozenset(),
    ) -> dict[int, dict[int, bool]]:
        """Push ``version`` to ``groups`` as the transport does (``failing``: group -> the rank
        whose push fails; ``gone``: groups lost and back during it, whose push fails): with
        deltas on, the steps of :func:`rollsafe.operations.push.push` on the groups'
        ``DeltaBase`` machines (a real :class:`DeltaLedger`, a part); without, each group full.
        Every payload is one update the registration records (``begin_update`` /
        ``update_done``), as :meth:`rollsafe.transports.base.StagedTransport._update` does:
        one without deltas, one per base's delta and one for the full targets with.
        Returns each group's per-rank result."""
        self._failing, self._gone = failing, gone
        self._pushed = {}
        if not self.config.deltas:
            self._push_targets(fx.PushTargets(tuple(f"g{g}" for g in groups), version, None))
            return self._pushed
        targets = tuple(f"g{g}" for g in groups)
        drive(push_op.push(version, targets, force_full=force, fresh=force), self.perform)
        return self._pushed

    @handles(fx.ReadBase)
    def _read_base(self, effect: fx.ReadBase) -> Outcome[Any]:
        """The sender keeps the weights of the fleet's current version only (a target whose
        base is older lags: full push); the model's engines apply deltas."""
        held = frozenset({self.version})
        return Ok(fx.BaseFacts(self.ledger.base(effect.target), held, True, True))

    @handles(fx.KeepSnapshot)
    def _keep_snapshot(self, _effect: fx.KeepSnapshot) -> Outcome[Any]:
        return _OK

    @handles(fx.EncodeDelta)
    def _encode_delta(self, _effect: fx.EncodeDelta) -> Outcome[Any]:
        if self._not_smaller:  # a replayed sync whose every weight changed
            return Ok(fx.Encoded(2, 2, False))
        return Ok(fx.Encoded(1, 2, True))  # a delta is smaller than the full weights

    @handles(fx.PushTargets)
    def _push_targets(self, effect: fx.PushTargets) -> Outcome[Any]:
        """One payload (the version, or a base's delta) to its targets in one update."""
        reg = self.registration
        groups = [self._index[gid] for gid in effect.targets]
        reg.begin_update(targets=[list(self.groups[g].ranks) for g in groups])
        delivered: dict[str, fx.Delivered] = {}
        per_rank: dict[int, bool] = {}
        for gid, g in zip(effect.targets, groups, strict=True):
            failing = self._failing.get(g)
            refused = False
            if g in self._gone:  # lost mid-push: its base forgotten (DeltaBaseReset), failed
                self._reset_base(g)
                rank_ok = dict.fromkeys(self.groups[g].ranks, False)
            elif effect.base is None:
                rank_ok = self._push_to(g, effect.version, failing)
            else:
                rank_ok, refused = self._apply_delta(g, effect.version, effect.base, failing)
            self._pushed[g] = rank_ok
            per_rank.update(rank_ok)
            ok = all(rank_ok.values())
            delivered[gid] = fx.Delivered(ok, "" if ok else "a rank failed", refused)
        reg.update_done(results=per_rank)
        return Ok(delivered)

    def perform(self, effect: fx.Effect[Any]) -> Outcome[Any]:
        """Every effect through the table; the ledger's sends are audited like the registry's
        (a decided event must be declared by its policy function and taken by its machine);
        a spare's promotion is recorded for ``promoted_only_at_current_version``."""
        if isinstance(effect, fx.SendGroups):
            sent = super().perform(effect)
            if isinstance(sent, Ok) and not sent.value:
                self._audit_promotions(effect)
            return sent
        if not isinstance(effect, fx.SendBase) or effect.decided_by not in _DELTA_DECISIONS:
            return super().perform(effect)
        self._decided(effect.decided_by, (effect.event,))
        outcome = super().perform(effect)
        forgotten = effect.decided_by == "settle_push" and self._index[effect.target] in self._gone
        if not isinstance(outcome, Ok) and not forgotten:
            # (a target whose base was forgotten mid-push refuses its settlement: the sender
            # ignores that, as the fleet's DeltaSender does)
            self._refuse(f"policy.{effect.decided_by}: {outcome.error}")
        return outcome

    def _apply_delta(
        self, g: int, version: int, base: int, failing_rank: int | None
    ) -> tuple[dict[int, bool], bool]:
        """A delta from ``base`` reaches group ``g``: (per-rank result, refused).

        A live rank that holds another version than ``base`` refuses it (the engine's check;
        nothing changes anywhere; the sender should never have sent it: recorded for
        ``delta_only_onto_its_base``). A dead rank or ``failing_rank`` fails the apply on every
        rank (all or nothing); a failing rank of an engine that keeps no weights is poisoned.
        Otherwise every rank moves to ``version``."""
        ranks = self.groups[g].ranks
        truth = self.truth[g]
        failed = dict.fromkeys(ranks, False)
        wrong = [(r, held) for r, (alive, held) in enumerate(truth) if alive and held != base]
        if wrong:
            r, held = wrong[0]
            self.audit.wrong_base_deltas = (
                *self.audit.wrong_base_deltas,
                f"a delta v{base} -> v{version} was sent to g{g}, whose r{ranks[r]} holds "
                f"v{held} (refused by the engine; one that cannot check would apply it)",
            )
            return failed, True
        if failing_rank is not None or not all(alive for alive, _ in truth):
            keeps = self.config.traits.failed_update_keeps_weights
            if failing_rank is not None and truth[failing_rank][0] and not keeps:
                self._set_truth(g, failing_rank, True, POISONED)
            return failed, False
        for r in range(len(truth)):
            self._set_truth(g, r, True, version)
        return dict.fromkeys(ranks, True), False

    def _reset_base(self, g: int) -> None:
        if self.config.deltas and self.delta[g].state != "no_base":
            self.ledger.reset(f"g{g}")

    # -- nodes and removals: the second executor of rollsafe.operations.place
    def _do_node_dies(self, dying: tuple[int, ...]) -> bool:
        """The node holding groups ``dying`` dies (ground truth): every rank on it with it.
        The fleet learns of it from a probe or from the watcher (``node_lost``)."""
        changed = False
        for g in dying:
            for s in range(self.config.slices):
                changed = self._do_slice_dies(g, s) or changed
        return changed

    def _do_slice_dies(self, g: int, s: int) -> bool:
        """The node under slice ``s`` of group ``g`` dies (ground truth): the slice's ranks
        with it; the rest of the group's engine cannot serve without them (the fleet learns of
        it from a probe or from the watcher, ``node_lost``)."""
        if not self.node_up[g][s] or self.groups[g].state == "retired":
            return False
        up = list(self.node_up[g])
        up[s] = False
        self.node_up[g] = tuple(up)
        for r in range(self.config.rank_counts[g]):
            if self.config.slice_of(g, r) == s:
                self._set_truth(g, r, False, None)
        return True

    def _dead_nodes(self) -> dict[str, tuple[int, int]]:
        """The dead nodes the watcher has not reported yet: their names -> (group, slice)."""
        return {
            _node_name(g, s): (g, s)
            for g in range(self.config.total_groups)
            for s, up in enumerate(self.node_up[g])
            if not up and s not in self.lost_slices[g] and self.groups[g].state != "retired"
        }

    def _lost_candidates(self) -> tuple[int, ...]:
        """The groups the unreported dead nodes take out (:func:`~rollsafe.operations.place.
        groups_on`, as the fleet's membership asks it): a group with any slice on one."""
        placements = {
            f"g{g}": tuple(_node_name(g, s) for s in range(self.config.slices))
            for g in range(self.config.total_groups)
            if g not in self.node_lost and self.groups[g].state != "retired"
        }
        found = {gid for node in self._dead_nodes() for gid in place_op.groups_on(node, placements)}
        return tuple(g for g in range(self.config.total_groups) if f"g{g}" in found)

    def _do_node_lost(self) -> bool:
        """The watcher reports every dead node: their groups leave routing in one step."""
        dead = self._dead_nodes()
        lost = self._lost_candidates()
        if not dead:
            return False
        for g, s in dead.values():
            self.lost_slices[g] = tuple(sorted({*self.lost_slices[g], s}))
        if not lost:
            return True
        self.node_lost.update(lost)
        drive(place_op.node_lost(tuple(f"g{g}" for g in lost)), self.perform)
        for g in lost:  # a recovery cut by the node's loss ends: its lease goes back
            if self.groups[g].state != "recovering":
                self._release_lease(g)
        return True

    def _do_place(self, g: int, pulled: bool | None = None) -> bool:
        """A node has room for the ``unplaced`` group ``g``: placement, then the recovery's
        strategy and lease (its restart and push are the ``restart`` and ``push`` actions);
        ``pulled`` as for ``recover``."""
        if self.groups[g].state != "unplaced" or g in self.late:
            return False
        gid = f"g{g}"
        end = drive(place_op.place(gid), self.perform)
        if end is None:
            self._lease_phase(gid, pulled)
        return True

    # -- spares: the second executor of rollsafe.operations.spare
    def _do_cover(self, g: int) -> bool:
        """Serving group ``g`` left routing: a spare ready at the fleet's version takes over
        (promoted, ``g`` enlisted as a spare), after the last check of its engine's version."""
        group = self.groups[g]
        if group.spare or group.state not in policy.COVERABLE:
            return False
        before = self._acted
        self._reported = {}
        drive(spare_op.cover(f"g{g}"), self.perform)
        return self._acted > before

    def _spare_facts(self, g: int) -> policy.SpareFacts:
        grp = self.groups[g]
        members = grp.members.values()
        return policy.SpareFacts(
            grp.group_id,
            grp.state,
            grp.spare,
            len(grp.ranks),
            all(m.healthy for m in members),
            tuple(m.weights_version for m in members),
        )

    @handles(fx.ReadSpares)
    def _read_spares(self, effect: fx.ReadSpares) -> Outcome[Any]:
        g = self._index[effect.group]
        spares = tuple(self._spare_facts(s) for s, grp in enumerate(self.groups) if grp.spare)
        return Ok(fx.SparesSeen(self._spare_facts(g), spares, self.version))

    @handles(fx.CheckVersion)
    def _check_version(self, effect: fx.CheckVersion) -> Outcome[Any]:
        """The spare's engines name the weights they hold (a dead one does not answer; one
        holding unknown weights names none)."""
        g = self._index[effect.group]
        truth = self.truth[g]
        if not all(alive for alive, _ in truth):
            self._reported[effect.group] = ()  # no answer
            return Failed("an engine of the group does not answer")
        answer = tuple(None if v in (None, POISONED) else str(v) for _, v in truth)
        self._reported[effect.group] = answer
        return Ok(answer)

    def _audit_promotions(self, effect: fx.SendGroups) -> None:
        """Record each spare about to be promoted, as it is now (the invariant
        ``promoted_only_at_current_version`` judges it)."""
        promoted = [g for g, evs in effect.events if GroupEvent.PROMOTE in evs]
        covered = [g for g, evs in effect.events if GroupEvent.ENLIST in evs]
        for gid in promoted:
            g = self._index[gid]
            truth = self.truth[g]
            self.audit.promotions = (
                *self.audit.promotions,
                PromotionPicture(
                    gid,
                    covered[0] if covered else "?",
                    self.version,
                    tuple(m.weights_version for m in self.groups[g].members.values()),
                    tuple(v if alive else None for alive, v in truth),
                    self._reported.get(gid),
                ),
            )

    def _do_remove(self, g: int) -> bool:
        """``remove_group(g)`` begins: ``drain``."""
        group = self.groups[g]
        if len(self.removed) >= self.config.removals or group.state in ("draining", "retired"):
            return False
        self.removed.add(g)
        drive(place_op.drain(f"g{g}"), self.perform)
        if group.state != "recovering":
            self._release_lease(g)
        return True

    def _do_finish_removal(self, g: int) -> bool:
        """A drained group's requests ended: stop it, give its placement back, ``retire``."""
        if self.groups[g].state != "draining":
            return False
        drive(place_op.finish_removal(f"g{g}"), self.perform)
        return True

    @handles(fx.Place)
    def _place(self, effect: fx.Place) -> Outcome[Any]:
        g = self._index[effect.group]
        self._own_acts += 1
        # one reservation for every slice, each on a live node, or none (Ray's STRICT_SPREAD)
        self.node_up[g] = (True,) * self.config.slices
        self.node_lost.discard(g)
        self.lost_slices[g] = ()
        self._audit_placement(g)
        return Ok(f"node-of-{effect.group}")

    def _audit_placement(self, g: int) -> None:
        """Record a placement that left a slice on a dead node (``placed_all_slices_or_none``)."""
        placed = sum(self.node_up[g])
        if placed != self.config.slices:
            self.audit.partial_placements = (
                *self.audit.partial_placements,
                f"g{g}: {placed} of {self.config.slices} slices",
            )

    @handles(fx.StopEngine)
    def _stop_engine(self, effect: fx.StopEngine) -> Outcome[Any]:
        """Stopping a group's engine: only a removal's stop changes the model (recovery's
        ``shutdown`` step precedes a restart that sets every rank anyway)."""
        g = self._index[effect.group]
        if self.groups[g].state == "draining":
            for r in range(self.config.rank_counts[g]):
                self._set_truth(g, r, False, None)
            self._reset_base(g)
        return _OK

    # -- the sync coordinator: the second executor of rollsafe.operations.sync
    def _do_sync(
        self,
        registered_everywhere: bool | None,
        failing_group: int | None,
        on_failure: policy.UpdateFailurePolicy = "fail",
        version: int | None = None,
        failing: tuple[tuple[int, int], ...] = (),
        during: int | None = None,
        hook_failed: str | None = None,
        not_smaller: bool = False,
    ) -> bool:
        """A sync of the next version, the steps of :func:`rollsafe.operations.sync.sync`
        performed on the machines and the ground truth. The action's arguments are the outcomes
        it chooses: registered on every rank or not (None: the register raised before it
        began, the trainer's tensors unreadable: the registration untouched, its published
        version still published); the update fails on one rank of
        ``failing_group`` (None: on none); the fleet's ``on_update_failure`` setting; ``during``:
        the ``recovering`` group whose restart ends while the update runs (right after the
        sync read the groups, before the new fleet version: the recovery's thread and the
        sync's interleave there). A replay (``rollsafe verify --trace``) also names the
        recorded ``version`` (default: the next one), ``failing`` ``(group, rank)`` pairs
        (the groups whose update failed) and ``hook_failed``, the colocated hook (``Hook``:
        ``offload_trainer``, ``onload_engines``: a trainer-side exception after the register,
        nothing updated, the fleet stays at its version; ``onload_trainer``: after the update,
        the fleet moved on, no export started) the recorded sync failed in, and
        ``not_smaller``: the recorded sync's deltas were not smaller than the full weights
        (every weight changed: each base's targets fell back to the full push, one update)."""
        cfg = self.config
        new = self.version + 1 if version is None else version
        if new <= self.version or (cfg.max_version is not None and new > cfg.max_version):
            return False
        if self.registration.state not in ("empty", "registered", "failed"):
            return False
        if during is not None and self.groups[during].state != "recovering":
            # a serving group lost and back during the update: a replay names it among the
            # groups whose update failed (the explorer's ``during`` is a recovering group's)
            lost = self.groups[during].state in _PROBED and any(g == during for g, _ in failing)
            if not lost:
                return False
        fails = dict(failing)
        if failing_group is not None:
            fails.setdefault(failing_group, 0)
        self._choice = (registered_everywhere, fails)
        self._during = during
        self._hook_failed = hook_failed
        self._not_smaller = not_smaller
        try:
            drive(sync_op.sync(new, on_failure=on_failure), self.perform)
        finally:
            self._during = None
            self._hook_failed = None
            self._not_smaller = False
            self._moved = {}
        return True

    @handles(fx.Hook)
    def _hook(self, effect: fx.Hook) -> Outcome[Any]:
        """A colocated hook: no state of the model; a replay fails the one the recorded sync
        failed in."""
        if effect.name == self._hook_failed:
            return Failed(f"the recorded run's {effect.name} failed")
        return _OK

    @handles(
        fx.LockTransport,
        fx.UnlockTransport,
        fx.Pause,
        fx.Resume,
        fx.HandOff,  # the model's recovery is its own action (``recover``; a stale group's
        # push alone, ``push_only``, is ``push``, enabled for every ``pending_weights`` group)
        fx.NoteStep,
        fx.GetEngine,
        fx.AwaitHealthy,
        fx.ReleasePlacement,
        fx.LockHealth,
        fx.UnlockHealth,
    )
    def _nothing(self, _effect: Any) -> Outcome[Any]:
        """Steps whose I/O leaves nothing in the model."""
        return _OK

    @handles(fx.PrepareTargets)
    def _prepare_targets(self, _effect: fx.PrepareTargets) -> Outcome[Any]:
        return Ok({})

    @handles(fx.PullExport)
    def _pull_export(self, effect: fx.PullExport) -> Outcome[Any]:
        """A moved export is checked on the node: its copy is the export itself here (a replay
        fails it where the recorded run's pull failed)."""
        if self._pulled is False:
            return Failed("the recorded run's pull failed")
        return Ok(fx.Pulled(str(effect.lease.path), 0))

    @handles(fx.AwaitDrained)
    def _await_drained(self, _effect: fx.AwaitDrained) -> Outcome[Any]:
        return Ok(0)

    @handles(fx.ProbeMembers)
    def _probe_members(self, effect: fx.ProbeMembers) -> Outcome[Any]:
        if self._probe_timed_out:
            return TimedOut()
        g, group = self._group_of(effect.group)
        dead = tuple(group.ranks[r] for r, (alive, _) in enumerate(self.truth[g]) if not alive)
        return Ok(fx.Probed(dead, f"ranks {list(dead)} down" if dead else None))

    @handles(fx.ReadProbeFacts)
    def _read_probe_facts(self, effect: fx.ReadProbeFacts) -> Outcome[Any]:
        g, group = self._group_of(effect.group)
        moved = group.state not in _PROBED
        return Ok(fx.ProbeFacts(group.ranks, self.counts[g], self._recorded(g), moved))

    @handles(fx.SetFailureCounts)
    def _set_failure_counts(self, effect: fx.SetFailureCounts) -> Outcome[Any]:
        g = self._index[effect.group]
        counts = dict(effect.counts)
        if counts != self.counts[g]:
            self._own_acts += 1
            self.counts[g] = counts
        return _OK

    @handles(fx.GroupFailed)
    def _group_failed(self, effect: fx.GroupFailed) -> Outcome[Any]:
        """Hand the failed group over: queued, the ``recover`` action's to take later."""
        return _OK

    def _group_of(self, gid: str) -> tuple[int, WorkerGroupLifecycle]:
        g = self._index[gid]
        return g, self.groups[g]

    @handles(fx.ReadRecovery)
    def _read_recovery(self, effect: fx.ReadRecovery) -> Outcome[Any]:
        g, group = self._group_of(effect.group)
        return Ok(
            fx.RecoveryFacts(
                group.state,
                budget_left=group.restart_budget_left(),
                complete=group.group_complete(),
                remaining_s=None,
                expected_s=0.0,
                busy=g in self.late,
                budget=group.restart_budget,
                initial_budget=self.config.restart_budget,
                can_push=self.config.targeted_push,
                # the actor answers iff its node lives (the fleet asks it on a failure)
                placement_alive=all(self.node_up[g]) if self.config.node_loss else None,
            )
        )

    @handles(fx.ReadStrategy)
    def _read_strategy(self, _effect: fx.ReadStrategy) -> Outcome[Any]:
        export = self.exports.get(self.version)
        facts = (
            policy.ExportFacts(export.version, export.state, len(export.leases))
            if export is not None
            else None
        )
        can_push = self.config.targeted_push
        moved = self._pulled is not None  # replay only: the run moved the export
        return Ok(fx.StrategyFacts(self.mode.state, self.version, facts, can_push, moved))

    @handles(fx.TakeLease)
    def _take_lease(self, effect: fx.TakeLease) -> Outcome[Any]:
        g = self._index[effect.holder.removeprefix("recovery:")]
        chosen = self.exports.get(effect.version)
        state = chosen.state if chosen is not None else "gone"
        self._own_acts += 1
        self.audit.immediate = (
            *self.audit.immediate,
            RecoveryPicture(f"g{g}", effect.version, state, self.version),
        )
        if chosen is None:
            self._refuse(f"policy.choose_strategy chose gone export v{effect.version}")
            return Failed(f"export v{effect.version} is gone")
        try:
            lease = self.leases[g] = chosen.acquire_lease(holder=f"g{g}")
        except LeaseError as exc:
            self._refuse(f"policy.choose_strategy: {exc}")
            return Failed(str(exc))
        return Ok(fx.Leased(lease.version, _path(lease.version), lease))

    @handles(fx.ReleaseLease)
    def _release_lease_effect(self, effect: fx.ReleaseLease) -> Outcome[Any]:
        lease: ExportLease = effect.lease.token
        g = self._index[lease.holder]
        self._own_acts += 1
        if self.leases.get(g) is lease:
            del self.leases[g]
        if effect.once_restart_ends and g in self.late:
            self.late[g] = lease  # released by ``restart_ends``
        else:
            self._release(lease)
        return _OK

    @handles(fx.Restart)
    def _restart(self, effect: fx.Restart) -> Outcome[Any]:
        g, _group = self._group_of(effect.group)
        choice = self._restart_choice
        self._own_acts += 1
        self.counts[g] = {}
        self._reset_base(g)  # a restarted engine's weights are new: its next push is full
        if choice == "ok":
            version = None if effect.dummy else effect.weight_version
            # an actor gone with its node is placed anew, whole (RayEngineGroup)
            self.node_up[g] = (True,) * self.config.slices
            self.lost_slices[g] = ()
            for r in range(self.config.rank_counts[g]):
                self._set_truth(g, r, True, version)
            return _OK
        if choice == "timeout":
            self.late[g] = None  # it still runs: no new claim until ``restart_ends``
            return TimedOut()
        return Failed("restart failed")

    @handles(fx.PushUnderLock)
    def _push_under_lock(self, effect: fx.PushUnderLock) -> Outcome[Any]:
        return Ok(drive(recover_op.push_locked(effect.group, effect.keeps_weights), self.perform))

    @handles(fx.ReadPushFacts)
    def _read_push_facts(self, effect: fx.ReadPushFacts) -> Outcome[Any]:
        _g, group = self._group_of(effect.group)
        return Ok(fx.PushFacts(self.registration.published, self.version, group.state))

    @handles(fx.TargetedPush)
    def _targeted_push(self, effect: fx.TargetedPush) -> Outcome[Any]:
        g, _group = self._group_of(effect.group)
        self._own_acts += 1
        # a recovery's targeted push: the group's base forgotten, then full
        failing = {} if self._push_ok else {g: 0}
        rank_ok = self._push(effect.version, (g,), failing, force=True)[g]
        return Ok(fx.Pushed(rank_ok, "" if all(rank_ok.values()) else "a rank failed"))

    @handles(fx.ObserveExport)
    def _observe_export(self, _effect: fx.ObserveExport) -> Outcome[Any]:
        prev = self.last_export
        if prev is None or self.audit.judged_version >= prev:
            return Ok(None)
        self.audit.judged_version = prev
        export = self.exports.get(prev)
        return Ok(fx.ExportSeen(prev, export.state if export else None, self.mode.state))

    @handles(fx.ExportJudged)
    def _export_judged(self, effect: fx.ExportJudged) -> Outcome[Any]:
        if effect.judgement == "late":
            self.audit.late_versions = self.audit.late_versions | {effect.version}
            self.audit.on_time_since_late = 0
        elif effect.judgement == "on_time" and self.audit.on_time_since_late is not None:
            self.audit.on_time_since_late += 1
        return _OK

    @handles(fx.SendMode)
    def _send_mode(self, effect: fx.SendMode) -> Outcome[Any]:
        self._decided(effect.decided_by, (effect.event,))
        try:
            self.mode.send(effect.event)
        except TransitionNotAllowed as exc:
            self._refuse(f"policy.{effect.decided_by}: {exc}")
            return Failed(str(exc))
        return _OK

    @handles(fx.AbandonExport)
    def _abandon_export(self, effect: fx.AbandonExport) -> Outcome[Any]:
        self._decided("judge_export", (ExportEvent.ABANDON,))
        export = self.exports.get(effect.version)
        if export is None:
            return _OK
        refused = self._end_export(export, ExportEvent.ABANDON)
        if refused is not None:
            self._refuse(f"policy.judge_export: {refused}")
            return Failed(refused)
        return _OK

    @handles(fx.Register)
    def _register(self, effect: fx.Register) -> Outcome[Any]:
        registered_everywhere = self._choice[0]
        if registered_everywhere is None:  # the trainer's gather raised: no register began
            return Failed(f"v{effect.version}: the trainer's tensors could not be read")
        reg = self.registration
        reg.begin_register(name=f"ckpt-v{effect.version}", version=effect.version)
        ranks_ok = list(range(reg.world_size))
        if not registered_everywhere:
            ranks_ok = ranks_ok[:-1]
        self.audit.register_complete = registered_everywhere
        reg.finish_register(ranks_ok=ranks_ok, expected_keys=_KEYS, registered_keys=_REGISTERED)
        return Ok(reg.published)

    @handles(fx.ReadGroups)
    def _read_groups(self, _effect: fx.ReadGroups) -> Outcome[Any]:
        keeps = self.config.traits.failed_update_keeps_weights
        facts = Ok(
            tuple(
                policy.GroupFacts(
                    grp.group_id,
                    grp.state,
                    grp.ranks,
                    tuple(r for r, m in grp.members.items() if not m.healthy),
                    keeps,
                    tuple(grp.members[r].weights_version for r in sorted(grp.members)),
                )
                for grp in self.groups
            )
        )
        if self._during is not None:  # the sync's ``during``: a restart ends after this read
            g, self._during = self._during, None
            if self.groups[g].state in _PROBED:  # lost while the update runs: fails, recovers
                self._lost_and_back(g)
            else:
                self._restart_phase(g, "ok")
        return facts

    def _lost_and_back(self, g: int) -> None:
        """A group the sync has just read as serving stops answering while the update runs
        (its port black-holed, its engine hung): the probes time out until it fails, the
        recovery claims it and restarts it from the ready export of the fleet's version, all
        before the sync's update ends (a replay's ``during`` for a group the run shows failing
        and restarting inside the sync). The sender planned the update's push before the loss:
        the group's delta base is forgotten only when the push reaches it (``_push_targets``)."""
        kept = (
            (self.delta[g].state, self.delta[g].base, self.delta[g].in_flight)
            if (self.config.deltas)
            else None
        )
        for _ in range(self.config.failure_threshold + 1):
            if self.groups[g].state not in _PROBED:
                break
            self._probe(g, timed_out=True)
        if self.groups[g].state == "inactive":
            self._do_recover(g)
        self._restart_phase(g, "ok")
        if kept is not None:  # the base as the planning will read it
            machine = self.delta[g]
            if machine.state != kept[0]:
                machine.restore_state(kept[0])
            machine.restore_base(kept[1], kept[2])
        self._moved[f"g{g}"] = self.groups[g].state  # a new incarnation: never credited

    @handles(fx.Update)
    def _update(self, effect: fx.Update) -> Outcome[Any]:
        fails = self._choice[1]
        reg = self.registration
        if reg.published is None or reg.state != "registered":
            # the transport refuses (``check_update_targets``): every target failed
            why = f"nothing to push: the registration is {reg.state!r}"
            self._refuse(f"policy.proceed_after_register: update refused: {why}")
            return Failed(why)
        groups = tuple(self._index[f.group_id] for f in effect.groups)
        # a group lost and back during the update (``_lost_and_back``): the update went to the
        # engine it lost and failed there; its new engine got nothing
        gone = frozenset(g for g in groups if f"g{g}" in self._moved)
        failing = {g: r for g, r in fails.items() if g in groups and g not in gone}
        pushed = self._push(effect.version, groups, failing, force=False, gone=gone)
        rank_ok = {f"g{g}": pushed[g] for g in groups}
        moved, self._moved = self._moved, {}
        return Ok(fx.UpdateDone(rank_ok, moved))

    @handles(fx.StartExport)
    def _start_export(self, effect: fx.StartExport) -> Outcome[Any]:
        new = effect.version
        export = self._pooled_export(new, "requested")
        for lease in export.leases:
            export.release_lease(lease)
        # the exporter's start() takes the host snapshot before it returns (the only part that
        # blocks the trainer); the writer goes on in the background (``export_finish``)
        export.snapshot()
        export.snapshot_done()
        self.exports[new] = export
        self.dirs[new] = False
        self.last_export = new
        return Ok(True)

    # -- the exporter and retention
    def _do_export_finish(self) -> bool:
        """The writer finishes the export of the fleet's version: shards written, published.
        Retention is its own step (``retention``), as in the exporter: it runs after ``publish``
        under a second hold of the exporter's lock, so a run can be recorded, a lease taken or
        another export finish in between."""
        export = self.exports.get(self.version)
        if export is None or export.state != "writing":
            return False
        for event in (ExportEvent.SHARDS_WRITTEN, ExportEvent.PUBLISH):
            self._export_step(export, event)
        return True

    def _do_export_step(self, version: int, event: str) -> bool:
        """One step of the writer of export ``version`` (``shards_written`` or ``publish``;
        ``export_finish`` is both): what a replay of a recorded run takes when the run's writer
        stopped in between (``rollsafe verify --trace``). Not explored: it reaches no state
        ``export_finish`` and ``export_fail`` do not, but for the export resting in
        ``committing``."""
        export = self.exports.get(version)
        step = ExportEvent(event)
        if export is None or step not in (ExportEvent.SHARDS_WRITTEN, ExportEvent.PUBLISH):
            return False
        self._export_step(export, step)
        return True

    def _export_step(self, export: ExportLifecycle, event: ExportEvent) -> None:
        """Send one writer event with the facts a sound writer reports (its guards decide)."""
        if event is ExportEvent.SHARDS_WRITTEN:
            export.shards_written(ranks_ok=list(range(export.world_size)))
            return
        export.publish(index_missing_keys=[], checksums_verified=True, renamed=True)
        self.dirs[export.version] = True

    def _do_export_fail(self) -> bool:
        export = self.exports.get(self.version)
        if export is None or export.state not in _RUNNING_EXPORT:
            return False
        refused = self._end_export(export, ExportEvent.FAIL)
        return refused is None

    def _do_retention(self) -> bool:
        before = self.snapshot()
        self._retain()
        for version, export in list(self.exports.items()):
            if export.state in ("deleted", "failed", "abandoned") and not export.leases:
                del self.exports[version]
                self.dirs.pop(version, None)
        return self.snapshot() != before

    def _retain(self) -> None:
        facts = [
            policy.ExportFacts(v, e.state, len(e.leases)) for v, e in sorted(self.exports.items())
        ]
        plan = policy.plan_retention(facts, self.config.keep_last)
        decided = (ExportEvent.SUPERSEDE,) * bool(plan.supersede)
        self._decided("plan_retention", decided + (ExportEvent.DELETE,) * bool(plan.delete))
        for version, newer in plan.supersede:
            try:
                self.exports[version].supersede(newer_version=newer)
            except (KeyError, TransitionNotAllowed) as exc:
                self._refuse(f"policy.plan_retention: supersede v{version}: {exc}")
        for version in plan.delete:
            export = self.exports.get(version)
            self.dirs[version] = False  # the directory goes on the policy's word
            if export is None:
                continue
            refused = self._end_export(export, ExportEvent.DELETE)
            if refused is not None:
                self._refuse(f"policy.plan_retention: {refused}")

    def _do_mode_toggle(self) -> bool:
        if self.mode.state == "disabled":
            self.mode.enable()
            self.audit.on_time_since_late = None
        else:
            self.mode.disable()
        return True

    # -- stray events (a duplicated or racing sender)
    def _do_stray(self, g: int, event: str) -> bool:
        group = self.groups[g]
        self.registry.send(group.group_id, GroupEvent(event))
        if group.state != "recovering":
            self._release_lease(g)
        return True

    def _do_stray_delete(self) -> bool:
        """A racing retention sends ``delete`` to every superseded export (the machine's lease
        guard must refuse a leased one)."""
        changed = False
        for version, export in sorted(self.exports.items()):
            if export.state != "superseded":
                continue
            if self._end_export(export, ExportEvent.DELETE) is not None:
                continue
            self.dirs[version] = False
            changed = True
        return changed

    # ------------------------------------------------------------------ pre-filter
    def _may_change(self, action: Action) -> bool:
        """False only where the action certainly changes nothing (it would be refused)."""
        name, args = action.name, action.args
        if name == "stray":
            g, event = args
            group = self.groups[g]
            return event in self._allowed[self._group_cls][group.state]
        if name in ("launch", "crash"):
            g, r = args
            alive: bool = self.truth[g][r][0]
            state = self.groups[g].state
            if name == "launch":
                return state == "launching" and not alive
            return alive and state != "retired"
        if name == "restart_ends":
            return args[0] in self.late
        if name == "node_dies":
            return any(any(self.node_up[g]) and self.groups[g].state != "retired" for g in args[0])
        if name == "slice_dies":
            g, s = args
            return bool(self.node_up[g][s]) and self.groups[g].state != "retired"
        if name == "node_lost":
            return bool(self._dead_nodes())
        if name in ("place", "remove", "finish_removal"):
            g = int(args[0])
            state = str(self.groups[g].state)
            if name == "place":
                return state == "unplaced" and g not in self.late
            if name == "remove":
                room = len(self.removed) < self.config.removals
                return room and state not in ("draining", "retired")
            return state == "draining"
        if name in ("restart", "restart_timeout", "recover", "probe", "probe_timeout", "push"):
            state = self.groups[args[0]].state
            allowed: dict[str, bool] = {
                "restart": state == "recovering",
                "restart_timeout": state == "recovering",
                "recover": state == "inactive" and args[0] not in self.late,
                "probe": state in _PROBED,
                "probe_timeout": state in _PROBED,
                "push": state == "pending_weights",
            }
            return allowed[name]
        if name == "sync":
            failing = args[1]
            # an update failing in a group that is not updated is the same as no failure
            return failing is None or self.groups[failing].state in _PROBED
        if name == "cover":
            group = self.groups[args[0]]
            return (
                not group.spare
                and group.state in policy.COVERABLE
                and any(s.spare and s.state == "standby" for s in self.groups)
            )
        if name == "stray_delete":
            return any(e.state == "superseded" for e in self.exports.values())
        if name in ("export_finish", "export_fail"):
            export = self.exports.get(self.version)
            return export is not None and export.state in _RUNNING_EXPORT
        return True

    # ------------------------------------------------------------------ invariants
    def picture(self) -> FleetPicture:
        """The model as the invariants see it (machines, ground truth, audit)."""
        groups = []
        for g, grp in enumerate(self.groups):
            members = tuple(
                MemberPicture(m.rank, m.known, m.healthy, m.weights_version, alive, held)
                for m, (alive, held) in zip(grp.members.values(), self.truth[g], strict=True)
            )
            groups.append(
                GroupPicture(
                    grp.group_id,
                    grp.state,
                    grp.is_routable,
                    grp.restart_budget,
                    members,
                    node_lost=g in self.node_lost,
                    removed=g in self.removed,
                    initial_budget=self.config.restart_budget,
                    claims=self.claims[g],
                    spare=grp.spare,
                    lost_slices=self.lost_slices[g],
                )
            )
        reg = self.registration
        audit = self.audit
        return FleetPicture(
            fleet_version=self.version,
            groups=tuple(groups),
            initial_version=self.config.initial_version,
            registration_state=reg.state,
            published=reg.published,
            last_published_version=reg.last_published_version,
            last_register_complete=audit.register_complete,
            exports=tuple(
                ExportPicture(v, e.state, len(e.leases), self.dirs.get(v))
                for v, e in sorted(self.exports.items())
            ),
            mode_state=self.mode.state,
            rearm_after=self.mode.rearm_after,
            on_time_since_late=audit.on_time_since_late,
            late_versions=audit.late_versions,
            max_version_seen=audit.max_version_seen,
            immediate_recoveries=audit.immediate,
            recovery_threads=audit.recovery_threads,
            refused_decisions=audit.refused,
            delta_bases=(
                tuple(
                    DeltaPicture(f"g{g}", d.state, d.base, d.in_flight)
                    for g, d in enumerate(self.delta)
                )
                if self.config.deltas
                else None
            ),
            wrong_base_deltas=audit.wrong_base_deltas,
            spare_groups=self.config.spares,
            promotions=audit.promotions,
            partial_placements=audit.partial_placements,
            lease_holders=(
                *(
                    LeasePicture(f"g{g}", lease.version, self.groups[g].state)
                    for g, lease in sorted(self.leases.items())
                ),
                *(
                    LeasePicture(f"g{g}", lease.version, self.groups[g].state, True)
                    for g, lease in sorted(self.late.items())
                    if lease is not None
                ),
            ),
        )

    def check(self) -> list[Violation]:
        """Every invariant of :mod:`rollsafe.invariants` on the current state."""
        return invariants.check_all(self.picture())

    # ------------------------------------------------------------------ snapshot / restore
    def snapshot(self) -> tuple[Any, ...]:
        """The whole model as a hashable value (machines, facts guards read, truth, audit)."""
        groups = tuple(
            (
                grp.state,
                grp.restart_budget,
                tuple((m.known, m.healthy, m.weights_version) for m in grp.members.values()),
                self.truth[g],
                tuple(sorted(self.counts[g].items())),
                self.leases[g].version if g in self.leases else None,
                self._late_row(g),
                (
                    self.node_up[g],
                    g in self.node_lost,
                    g in self.removed,
                    self.claims[g],
                    self.lost_slices[g],
                ),
                self._delta_row(g),
                grp.spare,
            )
            for g, grp in enumerate(self.groups)
        )
        reg = self.registration
        exports = tuple(
            (v, e.state, len(e.leases), self.dirs.get(v)) for v, e in sorted(self.exports.items())
        )
        a = self.audit
        return (
            self.version,
            groups,
            (reg.state, reg.published, reg.pending, reg.last_published_version),
            exports,
            (self.mode.state, self.mode.on_time_streak),
            self.last_export,
            (
                a.max_version_seen,
                a.late_versions,
                a.on_time_since_late,
                a.judged_version,
                a.immediate,
                a.recovery_threads,
                a.refused,
                a.register_complete,
                a.wrong_base_deltas,
                a.promotions,
                a.partial_placements,
            ),
        )

    def _delta_row(self, g: int) -> tuple[Any, ...]:
        """() without deltas; else (state, base, version in flight) of the group's DeltaBase."""
        if not self.config.deltas:
            return ()
        d = self.delta[g]
        return (d.state, *d.facts_token())

    def _late_row(self, g: int) -> tuple[int | None, ...]:
        """() no timed-out restart runs; (None,) one runs with no lease; (v,) holding v."""
        if g not in self.late:
            return ()
        lease = self.late[g]
        return (lease.version if lease is not None else None,)

    def canonical(self, snap: tuple[Any, ...] | None = None) -> tuple[Any, ...]:
        """``snap`` up to symmetry: groups are interchangeable, so are ranks inside a group.

        Group ids in the audit are dropped (they only name a group in messages), the groups'
        rows are sorted, and inside each group the (recorded, true) rank pairs are sorted.
        """
        snap = snap if snap is not None else self.snapshot()
        version, groups, reg_s, exports, mode_s, last, audit_s = snap
        rows = sorted(
            (
                (
                    state,
                    budget,
                    _sorted_ranks(members, truth, self.config.slices),
                    len(counts),
                    *rest,
                )
                for state, budget, members, truth, counts, *rest in groups
            ),
            key=repr,
        )
        immediate = tuple(
            sorted((r.export_version, r.export_state, r.fleet_version) for r in audit_s[4])
        )
        # a promotion that breaks no invariant changes nothing ahead: only the others count
        promotions = sum(1 for p in audit_s[9] if _bad_promotion(p))
        return (
            version,
            tuple(rows),
            reg_s,
            exports,
            mode_s,
            last,
            (
                *audit_s[:4],
                immediate,
                len(audit_s[5]),
                len(audit_s[6]),
                *audit_s[7:9],
                promotions,
                audit_s[10],
            ),
        )

    def restore(self, snap: tuple[Any, ...]) -> None:
        """Put the model back into a state produced by :meth:`snapshot`."""
        version, groups, reg_s, exports, mode_s, last, audit_s = snap
        self.registry.restore_version(version)
        for g, row in enumerate(groups):
            state, budget, members, truth, counts, _lease, _late, place, delta, spare = row
            self.node_up[g], lost, removed, self.claims[g], self.lost_slices[g] = place
            if delta:
                machine = self.delta[g]
                if machine.state != delta[0]:
                    machine.restore_state(delta[0])
                machine.restore_base(delta[1], delta[2])
            (self.node_lost.add if lost else self.node_lost.discard)(g)
            (self.removed.add if removed else self.removed.discard)(g)
            grp = self.groups[g]
            if grp.state != state:
                grp = self.groups[g] = _pooled(
                    self._group_pool[g], state, self._builder(g), revive=True
                )
                self.registry.adopt_machine(grp.group_id, grp)
            grp.restart_budget = budget
            if grp.spare != spare:
                grp.restore_role(spare)
            facts = grp.members
            current = tuple((m.known, m.healthy, m.weights_version) for m in facts.values())
            if current != members:
                grp.restore_members(
                    MemberFacts(rank, known, healthy, ver)
                    for rank, (known, healthy, ver) in zip(grp.ranks, members, strict=True)
                )
            self.truth[g] = truth
            self.counts[g] = dict(counts)
        reg = self.registration
        if reg.state != reg_s[0]:
            reg.restore_state(reg_s[0])
        reg.restore_published(reg_s[1], reg_s[2], reg_s[3])
        now = tuple(
            (v, e.state, len(e.leases), self.dirs.get(v)) for v, e in sorted(self.exports.items())
        )
        held: dict[int, tuple[int | None, tuple[int | None, ...]]] = {
            g: (self.leases[g].version if g in self.leases else None, self._late_row(g))
            for g in {*self.leases, *self.late}
        }
        wanted = {
            g: (row[5], row[6]) for g, row in enumerate(groups) if row[5] is not None or row[6]
        }
        if now != exports or held != wanted:
            self._restore_exports(exports, groups)
        if self.mode.current_state_value != mode_s[0]:
            self.mode.restore_state(mode_s[0])
        self.mode.on_time_streak = mode_s[1]
        self.last_export = last
        self.audit = _Audit(*audit_s)


M = TypeVar("M", bound=GuardedMachine)

_FINAL_STATE_OF = {
    ExportEvent.ABANDON: "abandoned",
    ExportEvent.FAIL: "failed",
    ExportEvent.DELETE: "deleted",
}


def _bad_promotion(promotion: PromotionPicture) -> bool:
    """Whether ``promotion`` breaks ``promoted_only_at_current_version``."""
    picture = FleetPicture(promotion.fleet_version, (), promotions=(promotion,))
    return bool(invariants.promoted_only_at_current_version(picture))


def _node_name(g: int, s: int) -> str:
    """The model's name of the node under slice ``s`` of group ``g``."""
    return f"n{g}.{s}"


def _sorted_ranks(members: Sequence[Any], truth: Sequence[Any], slices: int) -> tuple[Any, ...]:
    """A group's (recorded, true) rank pairs up to symmetry: ranks are interchangeable inside
    one node slice (a slice's node dies with its ranks), not across slices."""
    pairs = list(zip(members, truth, strict=True))
    per = len(pairs) // slices
    return tuple(
        item for s in range(slices) for item in sorted(pairs[s * per : (s + 1) * per], key=repr)
    )


def _node_sets(groups: int) -> tuple[tuple[int, ...], ...]:
    """The sets of groups one node may hold in the model: each group alone on its node, and
    (with more than one group) all of them on one node."""
    alone = tuple((g,) for g in range(groups))
    return alone + ((tuple(range(groups)),) if groups > 1 else ())


def _path(version: int) -> str:
    """The model's name for the directory of the export of ``version``."""
    return f"exports/v{version}"


def _end_export(export: ExportLifecycle, event: ExportEvent) -> str | None:
    """Take an export's transition into a final state; return None, or why it was refused.

    The machine's own guards decide (``can``); the state is then set with ``restore_state``
    rather than by sending the event, because a python-statemachine engine that reached a final
    state can never be restored, and rebuilding a machine costs about a millisecond: this keeps
    the exploration's machines reusable. (These transitions have no actions that matter here.)
    """
    if not export.can(event):
        return f"{export.label} refused {event.value!r} in state {export.state!r}: " + "; ".join(
            export.explain(event)
        )
    export.restore_state(_FINAL_STATE_OF[event])
    return None


def _pooled(pool: list[M], state: str, build: Callable[[], M], *, revive: bool = False) -> M:
    """A machine of ``pool`` put into ``state``: one already there, else a live one restored,
    else (``revive``: the pool's machines are used one at a time, a group's) a terminated one
    revived (:meth:`GuardedMachine.revive`); else a new one (building one costs milliseconds,
    so they are reused; one terminated machine per final state is kept)."""
    for machine in pool:
        if machine.state == state:
            return machine
    for machine in pool:
        if not machine.is_terminated:
            machine.restore_state(state)
            return machine
    if revive and pool:
        machine = pool[0]
        machine.revive(state)
        return machine
    machine = build()
    machine.restore_state(state)
    # keep one terminated machine per final state, and the new live one
    finals = {m.state: m for m in pool if m.is_terminated}
    pool[:] = [*finals.values(), machine]
    return machine


def _allowed_events_table(cls: type[Any]) -> dict[str, frozenset[str]]:
    """state id -> events that have at least one transition out of it."""
    return {
        state.id: frozenset(str(e) for e in state.transitions.unique_events) for state in cls.states
    }
