"""What a fleet is built from: :class:`FleetConfig`, its :class:`GroupSpec` s and their
resolution into :class:`GroupPlan` s (ids and fleet ranks).

A malformed config fails at construction with :class:`~rollsafe.fleet.settings.FleetConfigError`
naming the offending key (``groups[1].ranks``, ``engine.kind``, ``nccl.backend``); the paths are
checked by :meth:`FleetConfig.validate`, which :class:`~rollsafe.fleet.RolloutFleet` calls. The
engine part is one typed :class:`~rollsafe.adapters.engines.EngineSpec` (``engine=``), the
template every group's spec is made from.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import rollsafe.policy as policy
from rollsafe.fleet.partial_rollouts import SYNC_PAUSE_MODES, SyncPauseMode
from rollsafe.fleet.settings import (
    PLACEMENTS,
    TRANSPORT_SETTINGS,
    CheckpointEngineSettings,
    DiskSettings,
    FleetConfigError,
    HealthSettings,
    IpcSettings,
    NcclSettings,
    RaySettings,
    RecoverySettings,
    TransportSettings,
    check_number,
    topology_refusal,
)
from rollsafe.gateway.settings import ExternalRouter, GatewaySettings

if TYPE_CHECKING:
    from rollsafe.adapters.engines import EngineSpec
    from rollsafe.ports import LaunchableEngine

__all__ = [
    "TRANSPORTS",
    "FleetConfig",
    "GroupPlan",
    "GroupSpec",
    "LauncherFactory",
    "check_shape",
    "slice_count",
]

#: The built-in transports (each a settings class in
#: :data:`~rollsafe.fleet.settings.TRANSPORT_SETTINGS` and a ``FleetConfig`` field of that
#: name); a :class:`TransportSettings` subclass defined elsewhere adds one more.
TRANSPORTS = tuple(TRANSPORT_SETTINGS)
_TRANSPORT_FIELDS = TRANSPORTS


@dataclass(frozen=True)
class GroupSpec:
    """One worker group: ``ranks`` engine processes serving as one engine (TP/EP group).

    ``fleet_ranks`` pins the group's global ranks (the transport's world positions); by default
    groups get consecutive ranks in config order. ``group_id`` defaults to ``g{index}``.
    ``warm_standby`` overrides :attr:`FleetConfig.warm_standby` for this group (None: inherit).
    ``ranks_per_node`` spreads the group over nodes (``docs/cluster.md``, "Groups that span
    nodes"): ``ranks // ranks_per_node`` node slices of ``ranks_per_node`` ranks each, every
    slice on its own node, placed all slices or none; ``ranks`` must be a multiple of it.
    None (the default) keeps the whole group on one node.
    """

    ranks: int = 1
    group_id: str | None = None
    fleet_ranks: tuple[int, ...] | None = None
    warm_standby: bool | None = None
    ranks_per_node: int | None = None

    @property
    def slices(self) -> int:
        """How many nodes the group spans (1 without ``ranks_per_node``)."""
        return slice_count(self.ranks, self.ranks_per_node)


def slice_count(ranks: int, ranks_per_node: int | None) -> int:
    """The node slices of a group of ``ranks`` ranks, ``ranks_per_node`` on each node (None:
    one node); assumes the shape was checked (:func:`check_shape`)."""
    return 1 if ranks_per_node is None else max(1, ranks // ranks_per_node)


def check_shape(key: str, ranks: int, ranks_per_node: object) -> None:
    """Refuse a ``ranks_per_node`` that does not cut ``ranks`` into whole node slices:
    :class:`FleetConfigError` naming ``key`` (e.g. ``groups[1].ranks_per_node``)."""
    if ranks_per_node is None:
        return
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int):
        raise FleetConfigError(key, f"must be an int >= 1 or None, got {ranks_per_node!r}")
    if ranks_per_node < 1:
        raise FleetConfigError(key, f"must be >= 1, got {ranks_per_node}")
    if ranks % ranks_per_node:
        raise FleetConfigError(
            key,
            f"{ranks_per_node} does not divide the group's {ranks} ranks (every node slice "
            f"holds the same number of ranks: choose a divisor of {ranks})",
        )


#: ``launcher_factory(group_id, spec)`` returns an un-started launcher for the group (an
#: ``EngineLauncher``, or any :class:`~rollsafe.ports.LaunchableEngine`).
LauncherFactory = Callable[[str, "EngineSpec"], "LaunchableEngine"]


@dataclass
class FleetConfig:
    """Everything a :class:`RolloutFleet` is built from.

    ``model_path``: the HF directory the engines start on (the trainer's version
    ``initial_version`` weights; default: ``engine.model_path``). ``template_dir``: non-weight
    files copied into exports (defaults to ``model_path``; must hold ``config.json``).
    ``export_root`` (required): where ``hf-v{version}`` exports go (its parent must exist and be
    writable). ``engine``: the :class:`~rollsafe.adapters.engines.EngineSpec` every group's
    engine starts from (``kind``, ``dialect``, ``device``, ``log_dir``, ``fault_injection``...;
    default: the reference engine on ``model_path``); the fleet fills in, per group, ``ranks``
    (``GroupSpec.ranks``), ``warm_standby`` and, when unset, ``weight_version``
    (``initial_version``): set those here and the config refuses it, naming the field.
    ``warm_standby``: every group's launcher keeps one idle, already-imported engine process
    that takes the group's next (re)start, so a recovery skips the engine's interpreter start
    and imports (most of a CPU engine's start); it costs one such process per group (a few
    hundred MB of host memory each) and, after every start, one background import.
    ``GroupSpec.warm_standby`` overrides it per group. Needs an engine module that supports
    ``--standby`` (the reference engine does); ``EngineSpec(standbys=2)`` keeps two
    per group, so that a crash right after a recovery still finds one ready. Each group's
    standby state (``none``, ``warming``: still importing, ``ready``) is in
    :meth:`RolloutFleet.snapshot` (``registry.groups.<id>.standby``), the metrics and each
    :class:`RecoveryResult` (``standby_at_restart``, ``restart_source``).
    ``transport``: ``"ipc"``, ``"nccl"``, ``"checkpoint_engine"``, ``"disk"`` (engines load
    each version from the fleet's own verified export: :class:`DiskSettings`), the name of another
    registered :class:`TransportSettings` subclass, or a settings object itself
    (``transport=NcclSettings(backend="nccl")``: stored in its field, or in
    ``transport_settings`` for a transport defined outside rollsafe, and ``transport`` then
    reads back its name). Each built-in one has one typed, frozen settings object, the field
    of the same name: ``nccl=NcclSettings(backend="nccl")``,
    ``checkpoint_engine=CheckpointEngineSettings(p2p=True, p2p_protocol="tcp")`` (the fields and
    their defaults are documented there; both are always present and validated, whatever the
    transport: ``checkpoint_engine`` falls back to ``nccl``); their errors name the key as
    ``<transport>.<field>`` (``checkpoint_engine.p2p_protocol``).

    ``on_update_failure``: what a sync does with a group whose update failed: ``"fail"``
    (default: out of routing, recovered now) or ``"stale"`` (left ``pending_weights`` for the
    next sync), the latter only for an engine that keeps its weights after a failed update
    (:class:`~rollsafe.policy.EngineTraits`: only the reference engine's SGLang dialect; a real
    engine's group is failed and recovered under either setting). ``pause_mode``: how
    :meth:`RolloutFleet.sync_weights` pauses generation around a push when the call does not
    say (``"retract"`` or ``"abort"``, :mod:`rollsafe.fleet.partial_rollouts`); None: no pause,
    except for an engine whose update must run paused (vLLM: a request during an update kills
    it), which is paused with ``"abort"`` (cut requests continue from their last token).

    ``transport="checkpoint_engine"`` (``docs/transports.md``): MoonshotAI checkpoint-engine
    for a colocated trainer (one process, weights on CUDA, a one-rank NCCL default group made
    before :meth:`RolloutFleet.start`) and SGLang-dialect engines on the trainer's GPU
    (1-rank groups; several may share the GPU). Whole-fleet syncs broadcast; a recovery's
    targeted push is P2P to the restarted group's ranks only. With a vLLM engine, engines off
    the trainer's GPU or no CUDA, the fleet builds ``nccl`` instead and logs one warning naming
    the reason (:attr:`RolloutFleet.transport_fallback`).

    ``placement``: where each group's engine processes run: ``"local"`` (default: children of
    this process, :class:`~rollsafe.adapters.engines.EngineLauncher`) or ``"ray"`` (in a Ray
    actor on the node Ray places the group on, one ``STRICT_PACK`` placement group per group,
    groups spread over nodes: :class:`~rollsafe.adapters.ray.RayEngineGroup`, settings in
    ``ray=RaySettings(...)``, ``RAY_ADDRESS`` joins an existing cluster; ``docs/cluster.md``).
    ``transport="ipc"`` is refused with ``placement="ray"`` (it hands CUDA/shared-memory
    handles to engines on the trainer's machine only), ``"disk"`` unless
    ``ray=RaySettings(shared_exports=True)`` (checked on every node at start). A
    ``launcher_factory`` wins over both.
    """

    model_path: str | os.PathLike[str] | None = None
    export_root: str | os.PathLike[str] | None = None
    groups: Sequence[GroupSpec] = (GroupSpec(),)
    transport: str | TransportSettings = "ipc"
    template_dir: str | os.PathLike[str] | None = None
    health: HealthSettings = field(default_factory=HealthSettings)
    recovery: RecoverySettings = field(default_factory=RecoverySettings)
    enable_immediate_recovery: bool = False
    rearm_after: int = 2
    initial_version: int = 0
    launcher_factory: LauncherFactory | None = None
    engine: EngineSpec | None = None
    router_max_attempts: int = 3
    wait_for_routable_s: float = 0.0
    request_timeout_s: float | None = 30.0
    start_timeout_s: float = 180.0
    warm_standby: bool = False
    on_update_failure: policy.UpdateFailurePolicy = "fail"
    pause_mode: SyncPauseMode | None = None
    ipc: IpcSettings = field(default_factory=IpcSettings)
    nccl: NcclSettings = field(default_factory=NcclSettings)
    checkpoint_engine: CheckpointEngineSettings = field(default_factory=CheckpointEngineSettings)
    disk: DiskSettings = field(default_factory=DiskSettings)
    placement: str = "local"
    ray: RaySettings = field(default_factory=RaySettings)
    #: fleet ranks kept free for groups added at runtime (``RolloutFleet.add_group``): the
    #: transports' rank space is the groups' ranks plus these
    spare_ranks: int = 0
    #: settings of transports defined outside rollsafe, by name (a missing one: its defaults)
    transport_settings: Mapping[str, TransportSettings] = field(default_factory=dict)
    #: the rollout gateway (``docs/gateway.md``): OpenAI and SGLang-native HTTP served from this
    #: process at ``RolloutFleet.gateway_url`` (None: no gateway; needs ``rollsafe[gateway]``)
    gateway: GatewaySettings | None = None
    #: routers users keep in front of the engines (sglang-router, vllm-router) whose worker
    #: lists the fleet keeps equal to its routable set (``docs/routers.md``)
    external_routers: Sequence[ExternalRouter] = ()
    #: spare groups started beside ``groups`` (``docs/recovery.md``, "Spare groups"): each is
    #: shaped like the groups (they must all have one size), never routed (``standby``), kept
    #: at the fleet's version by every sync, and promoted to ``active`` at once when a serving
    #: group fails or loses its node; the failed group's recovery refills the pool. Their ids
    #: are ``s0``, ``s1``... (an id names a group, not a role: a promoted ``s0`` serves and a
    #: failed ``g0`` becomes a spare)
    spare_groups: int = 0
    #: where the fleet streams its run as it happens (``stream.jsonl``,
    #: :mod:`rollsafe.observe.stream`; ``docs/reliability.md``, "Replaying a recorded run"):
    #: every machine transition, sync and recovery, whole however long the run (memory keeps
    #: only the last ones of each), replayed by ``rollsafe verify --trace RUN_DIR``. The
    #: directory is made if missing (its parent must exist); a ``stream.jsonl`` in it is
    #: replaced. None: not streamed
    run_dir: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        """Keep a ``transport=<settings object>`` in its field, settle ``model_path`` and
        ``engine``, then check every field that needs no filesystem (:meth:`validate` adds the
        paths)."""
        self._take_transport_object()
        self._settle_engine()
        self._check()

    def _settle_engine(self) -> None:
        """``model_path`` from ``engine.model_path`` when not given; ``engine`` the reference
        engine on ``model_path`` when not given; both given: the same directory."""
        from rollsafe.adapters.engines import EngineSpec

        engine = self.engine
        if engine is not None and not isinstance(engine, EngineSpec):
            raise FleetConfigError("engine", f"must be an EngineSpec, got {engine!r}")
        if self.model_path is None:
            if engine is None:
                raise FleetConfigError("model_path", "is required (or set engine.model_path)")
            self.model_path = engine.model_path
        if engine is None:
            self.engine = EngineSpec(model_path=str(self.model_path))
        elif Path(engine.model_path).resolve() != Path(self.model_path).resolve():
            raise FleetConfigError(
                "engine.model_path",
                f"{engine.model_path!r} differs from model_path {str(self.model_path)!r}: the "
                "engines start on the fleet's model (leave one of them out)",
            )

    @property
    def engine_spec(self) -> EngineSpec:
        """The engine template (``engine``, settled at construction: never None)."""
        assert self.engine is not None
        return self.engine

    @property
    def engine_traits(self) -> policy.EngineTraits:
        """How this fleet's engines fail (:class:`~rollsafe.policy.EngineTraits`): from the
        engine's kind, dialect and (vLLM) weight-transfer backend as the launcher picks it
        (rollsafe's gloo plugin on CPU, vLLM's nccl elsewhere)."""
        engine = self.engine_spec
        return policy.engine_traits(
            engine.kind,
            str(engine.dialect),
            weight_transfer_backend=engine.vllm_backend(),
        )

    def _take_transport_object(self) -> None:
        """``transport=<settings object>``: keep the object where its name reads it from."""
        chosen = self.transport
        if not isinstance(chosen, TransportSettings):
            return
        name = chosen.transport
        if name in _TRANSPORT_FIELDS:
            current = getattr(self, name)
            if current != type(chosen)() and current != chosen:
                raise FleetConfigError(
                    "transport", f"{chosen!r} conflicts with {name}={current!r}; set one of them"
                )
            setattr(self, name, chosen)
        else:
            self.transport_settings = {**dict(self.transport_settings), name: chosen}
        self.transport = name

    def settings_for(self, name: str | None = None) -> TransportSettings:
        """The settings of transport ``name`` (default: the configured one): its field for a
        built-in transport, else ``transport_settings[name]`` or the class's defaults."""
        name = str(self.transport) if name is None else name
        if name in _TRANSPORT_FIELDS:
            settings: TransportSettings = getattr(self, name)
            return settings
        given = dict(self.transport_settings or {}).get(name)
        if given is not None:
            return given
        return TRANSPORT_SETTINGS[name]()

    def validate(self) -> list[GroupPlan]:
        """Check the whole config (again: it is mutable), the paths included; return the groups
        with ids and fleet ranks resolved. :class:`RolloutFleet` calls it."""
        self._check()
        assert self.model_path is not None  # _settle_engine made sure
        model = Path(self.model_path)
        if not model.is_dir():
            raise FleetConfigError("model_path", f"{model} is not a directory")
        template = Path(self.template_dir) if self.template_dir is not None else model
        key = "template_dir" if self.template_dir is not None else "model_path"
        if not template.is_dir():
            raise FleetConfigError(key, f"{template} is not a directory")
        if not (template / "config.json").is_file():
            raise FleetConfigError(key, f"{template} is not an HF model directory (no config.json)")
        assert self.export_root is not None  # _check made sure
        root = Path(self.export_root)
        if root.exists():
            if not root.is_dir():
                raise FleetConfigError("export_root", f"{root} exists and is not a directory")
            if not os.access(root, os.W_OK | os.X_OK):
                raise FleetConfigError("export_root", f"{root} is not writable")
        else:
            parent = root.parent
            if not parent.is_dir():
                raise FleetConfigError("export_root", f"parent directory {parent} does not exist")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise FleetConfigError("export_root", f"parent directory {parent} is not writable")
        if self.run_dir is not None:
            run_dir = Path(self.run_dir)
            if run_dir.exists() and not run_dir.is_dir():
                raise FleetConfigError("run_dir", f"{run_dir} exists and is not a directory")
            where = run_dir if run_dir.exists() else run_dir.parent
            if not where.is_dir():
                raise FleetConfigError("run_dir", f"parent directory {where} does not exist")
            if not os.access(where, os.W_OK | os.X_OK):
                raise FleetConfigError("run_dir", f"{where} is not writable")
        return self._resolve_groups()

    def _check(self) -> None:
        """The checks that need no filesystem (the settings objects checked their own fields)."""
        if not isinstance(self.transport, str) or self.transport not in TRANSPORT_SETTINGS:
            raise FleetConfigError(
                "transport",
                f"unknown transport {self.transport!r}; choose one of {tuple(TRANSPORT_SETTINGS)}"
                " (or define a TransportSettings subclass)",
            )
        if self.export_root is None:
            raise FleetConfigError("export_root", "is required (where the exports are written)")
        if self.run_dir is not None and not isinstance(self.run_dir, (str, os.PathLike)):
            raise FleetConfigError(
                "run_dir", f"must be a path (str or os.PathLike) or None, got {self.run_dir!r}"
            )
        engine = self.engine_spec
        kinds: dict[str, type] = {
            "health": HealthSettings,
            "recovery": RecoverySettings,
            "ray": RaySettings,
        }
        kinds.update((t, TRANSPORT_SETTINGS[t]) for t in _TRANSPORT_FIELDS)
        for name, cls in kinds.items():
            if not isinstance(getattr(self, name), cls):
                raise FleetConfigError(
                    name, f"must be a {cls.__name__}, got {getattr(self, name)!r}"
                )
        if self.gateway is not None and not isinstance(self.gateway, GatewaySettings):
            raise FleetConfigError(
                "gateway",
                f"must be a rollsafe.gateway.GatewaySettings or None, got {self.gateway!r}",
            )
        for i, router in enumerate(self.external_routers):
            if not isinstance(router, ExternalRouter):
                raise FleetConfigError(
                    f"external_routers[{i}]",
                    f"must be an ExternalRouter (rollsafe.gateway), got {router!r}",
                )
        urls = [r.url for r in self.external_routers]
        if len(set(urls)) != len(urls):
            raise FleetConfigError("external_routers", f"names a router twice: {urls}")
        if not isinstance(self.transport_settings, Mapping):
            raise FleetConfigError(
                "transport_settings", f"must be a mapping, got {self.transport_settings!r}"
            )
        for name, given in self.transport_settings.items():
            key = f"transport_settings[{name!r}]"
            if name in _TRANSPORT_FIELDS:
                raise FleetConfigError(key, f"set FleetConfig.{name} instead")
            registered = TRANSPORT_SETTINGS.get(name)
            if registered is None or not isinstance(given, registered):
                want = registered.__name__ if registered else "registered TransportSettings"
                raise FleetConfigError(key, f"must be a {want} object, got {given!r}")
        self.settings_for().check_engines(engine)
        if self.placement not in PLACEMENTS:
            raise FleetConfigError(
                "placement", f"must be one of {PLACEMENTS}, got {self.placement!r}"
            )
        check_number("rearm_after", self.rearm_after, integer=True)
        check_number("spare_ranks", self.spare_ranks, integer=True, zero=True)
        check_number("spare_groups", self.spare_groups, integer=True, zero=True)
        check_number("initial_version", self.initial_version, integer=True, zero=True)
        check_number("router_max_attempts", self.router_max_attempts, integer=True)
        check_number("wait_for_routable_s", self.wait_for_routable_s, zero=True)
        check_number("start_timeout_s", self.start_timeout_s)
        if self.request_timeout_s is not None:
            check_number("request_timeout_s", self.request_timeout_s)
        if not isinstance(self.warm_standby, bool):
            raise FleetConfigError("warm_standby", f"must be a bool, got {self.warm_standby!r}")
        if self.on_update_failure not in ("fail", "stale"):
            raise FleetConfigError(
                "on_update_failure", f"must be 'fail' or 'stale', got {self.on_update_failure!r}"
            )
        if self.pause_mode is not None and self.pause_mode not in SYNC_PAUSE_MODES:
            raise FleetConfigError(
                "pause_mode", f"must be None or one of {SYNC_PAUSE_MODES}, got {self.pause_mode!r}"
            )
        if engine.warm_standby:
            raise FleetConfigError(
                "engine.warm_standby",
                "set FleetConfig.warm_standby (or GroupSpec.warm_standby per group) instead",
            )
        if engine.ranks != 1:
            raise FleetConfigError(
                "engine.ranks", "is set per group: GroupSpec(ranks=...) (leave it at 1 here)"
            )
        if engine.ranks_per_node is not None:
            raise FleetConfigError(
                "engine.ranks_per_node",
                "is set per group: GroupSpec(ranks_per_node=...) (leave it None here)",
            )
        self._check_topology(self._resolve_groups())

    def _check_topology(self, resolved: list[GroupPlan]) -> None:
        """``placement="ray"``: transports that cannot reach a group where Ray may place it are
        refused naming the group (``topology_refusal``; docs/cluster.md section 6)."""
        if self.placement != "ray":
            return
        for plan in resolved:
            if plan.slices > 1 and plan.group_id in self.ray.trainer_node_groups:
                raise FleetConfigError(
                    "ray.trainer_node_groups",
                    f"group {plan.group_id!r} spans {plan.slices} nodes (ranks_per_node="
                    f"{plan.ranks_per_node}): it cannot be placed on the trainer's node only",
                )
        ids = [g.group_id for g in resolved]
        refused = topology_refusal(
            self.settings_for().transport, placement=self.placement, ray=self.ray, group_ids=ids
        )
        if refused is not None:
            raise FleetConfigError("transport", refused[1])

    def _resolve_groups(self) -> list[GroupPlan]:
        groups = list(self.groups)
        if not groups:
            raise FleetConfigError("groups", "needs at least one group")
        resolved: list[GroupPlan] = []
        owner: dict[int, str] = {}
        next_rank = 0
        for i, spec in enumerate(groups):
            if not isinstance(spec, GroupSpec):
                raise FleetConfigError(f"groups[{i}]", f"must be a GroupSpec, got {spec!r}")
            check_number(f"groups[{i}].ranks", spec.ranks, integer=True)
            check_shape(f"groups[{i}].ranks_per_node", spec.ranks, spec.ranks_per_node)
            if spec.warm_standby is not None and not isinstance(spec.warm_standby, bool):
                raise FleetConfigError(
                    f"groups[{i}].warm_standby",
                    f"must be a bool or None, got {spec.warm_standby!r}",
                )
            standby = self.warm_standby if spec.warm_standby is None else spec.warm_standby
            gid = spec.group_id if spec.group_id is not None else f"g{i}"
            if not isinstance(gid, str) or not gid:
                raise FleetConfigError(
                    f"groups[{i}].group_id", f"must be a non-empty string: {gid!r}"
                )
            if any(g.group_id == gid for g in resolved):
                raise FleetConfigError(f"groups[{i}].group_id", f"duplicate group id {gid!r}")
            if spec.fleet_ranks is None:
                ranks = tuple(range(next_rank, next_rank + spec.ranks))
                while any(rk in owner for rk in ranks):  # skip ranks pinned by earlier groups
                    next_rank += 1
                    ranks = tuple(range(next_rank, next_rank + spec.ranks))
            else:
                ranks = tuple(int(rk) for rk in spec.fleet_ranks)
                if len(ranks) != spec.ranks:
                    raise FleetConfigError(
                        f"groups[{i}].fleet_ranks",
                        f"has {len(ranks)} ranks but the group has ranks={spec.ranks}",
                    )
                if len(set(ranks)) != len(ranks) or any(rk < 0 for rk in ranks):
                    raise FleetConfigError(
                        f"groups[{i}].fleet_ranks",
                        f"ranks must be distinct and >= 0: {list(ranks)}",
                    )
            clash = sorted(rk for rk in ranks if rk in owner)
            if clash:
                raise FleetConfigError(
                    f"groups[{i}].fleet_ranks",
                    f"ranks {clash} overlap group {owner[clash[0]]!r}",
                )
            for rk in ranks:
                owner[rk] = gid
            next_rank = max(next_rank, max(ranks) + 1)
            resolved.append(
                GroupPlan(gid, spec.ranks, ranks, standby, ranks_per_node=spec.ranks_per_node)
            )
        return resolved + self._spare_plans(resolved, next_rank, owner)

    def _spare_plans(
        self, serving: list[GroupPlan], next_rank: int, owner: dict[int, str]
    ) -> list[GroupPlan]:
        """The ``spare_groups`` spares: the groups' size, the next free fleet ranks, ids
        ``s0``, ``s1``... (skipping ids the groups took)."""
        if not self.spare_groups:
            return []
        sizes = sorted({p.ranks for p in serving})
        if len(sizes) != 1:
            raise FleetConfigError(
                "spare_groups",
                f"spares take over from any group, so the groups must have one size; their "
                f"ranks are {sizes}",
            )
        shapes = {p.ranks_per_node for p in serving}
        if len(shapes) != 1:
            raise FleetConfigError(
                "spare_groups",
                f"spares take over from any group, so the groups must have one shape; their "
                f"ranks_per_node are {sorted(shapes, key=str)}",
            )
        (per_node,) = shapes
        taken = {p.group_id for p in serving}
        plans: list[GroupPlan] = []
        index = 0
        for _ in range(self.spare_groups):
            while f"s{index}" in taken:
                index += 1
            gid = f"s{index}"
            taken.add(gid)
            ranks = tuple(range(next_rank, next_rank + sizes[0]))
            while any(rk in owner for rk in ranks):
                next_rank += 1
                ranks = tuple(range(next_rank, next_rank + sizes[0]))
            for rk in ranks:
                owner[rk] = gid
            next_rank = max(ranks) + 1
            plans.append(
                GroupPlan(
                    gid, sizes[0], ranks, self.warm_standby, spare=True, ranks_per_node=per_node
                )
            )
        return plans


@dataclass(frozen=True)
class GroupPlan:
    """One group as the fleet runs it: its id, its engine's ranks (processes), its fleet ranks
    (the transport's world positions), whether it keeps a warm standby, whether it starts
    as a spare (``FleetConfig.spare_groups``) and its ranks per node (None: one node;
    :attr:`GroupSpec.ranks_per_node`)."""

    group_id: str
    ranks: int
    fleet_ranks: tuple[int, ...]
    warm_standby: bool = False
    spare: bool = False
    ranks_per_node: int | None = None

    @property
    def slices(self) -> int:
        """How many nodes the group spans."""
        return slice_count(self.ranks, self.ranks_per_node)
