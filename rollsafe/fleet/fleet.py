"""RolloutFleet: the one object a trainer embeds.

It owns the engine groups (one :class:`~rollsafe.adapters.engines.EngineLauncher` each), the
:class:`FleetRegistry` and its machines, the :class:`Router`, the :class:`HealthManager`, the
:class:`RecoveryCoordinator`, the :class:`SyncCoordinator`, the weight transport, the
:class:`~rollsafe.hf.HFExporter` and the fleet's :class:`ImmediateRecoveryMode`, all built from
one :class:`FleetConfig`. A malformed config fails at construction with
:class:`FleetConfigError` naming the offending key; nothing is launched before :meth:`start`.

Trainer-side use::

    with RolloutFleet(FleetConfig(model_path=..., export_root=..., groups=[GroupSpec(2)])) as fleet:
        out = fleet.generate([1, 2, 3], sampling_params={"max_new_tokens": 8})
        fleet.sync_weights(dict(model.named_parameters()), version=1)

:meth:`timeline` returns every machine transition (groups, exports, checkpoint registration,
recovery mode) in time order as JSON-friendly dicts; :meth:`snapshot` the current picture;
:meth:`record` writes the run so far (timeline, syncs, recoveries, request rates, its picture)
for ``rollsafe report``. ``metrics=`` / ``metrics_port=`` export Prometheus metrics
(``docs/metrics.md``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import rollsafe.policy as policy
from rollsafe.errors import InvalidArgument
from rollsafe.fleet.elastic import Membership
from rollsafe.fleet.health import HealthManager
from rollsafe.fleet.partial_rollouts import SYNC_PAUSE_MODES, SyncPauseMode, paused_generation
from rollsafe.fleet.recovery import RecoveryCoordinator, RecoveryResult
from rollsafe.fleet.registry import FleetError, FleetRegistry, WorkerGroup
from rollsafe.fleet.request_health import RequestHealth
from rollsafe.fleet.router import RoutedResult, Router
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
    TransportContext,
    TransportSettings,
    check_number,
    topology_fallback,
    topology_refusal,
)
from rollsafe.fleet.sync import SyncCoordinator, SyncReport, default_target
from rollsafe.invariants import ExportPicture, FleetPicture, GroupPicture, MemberPicture
from rollsafe.observe.observer import FleetObserver
from rollsafe.operations.place import RemovalEnd
from rollsafe.statemachines.recovery_mode import ImmediateRecoveryMode

if TYPE_CHECKING:
    import torch
    from prometheus_client import CollectorRegistry

    from rollsafe.adapters.engines import EngineLauncher, EngineSpec
    from rollsafe.adapters.ray import GroupPlacer, NodeWatcher, SharedExportsCheck
    from rollsafe.adapters.ray.exports import ExportMover
    from rollsafe.digest_check import DigestCheck
    from rollsafe.hf import HFExporter
    from rollsafe.observe.metrics import FleetMetrics
    from rollsafe.ports import EngineTarget, LaunchableEngine, WeightTransport
    from rollsafe.statemachines.base import TransitionRecord

__all__ = ["TRANSPORTS", "FleetConfig", "FleetNotStarted", "GroupSpec", "RolloutFleet"]

log = logging.getLogger(__name__)

#: The built-in transports (each a settings class in
#: :data:`~rollsafe.fleet.settings.TRANSPORT_SETTINGS` and a ``FleetConfig`` field of that
#: name); a :class:`TransportSettings` subclass defined elsewhere adds one more.
TRANSPORTS = tuple(TRANSPORT_SETTINGS)
_TRANSPORT_FIELDS = TRANSPORTS


class FleetNotStarted(FleetError, RuntimeError):
    """The fleet was used before :meth:`RolloutFleet.start` (or after :meth:`close`)."""


@dataclass(frozen=True)
class GroupSpec:
    """One worker group: ``ranks`` engine processes serving as one engine (TP/EP group).

    ``fleet_ranks`` pins the group's global ranks (the transport's world positions); by default
    groups get consecutive ranks in config order. ``group_id`` defaults to ``g{index}``.
    ``warm_standby`` overrides :attr:`FleetConfig.warm_standby` for this group (None: inherit).
    """

    ranks: int = 1
    group_id: str | None = None
    fleet_ranks: tuple[int, ...] | None = None
    warm_standby: bool | None = None


#: ``launcher_factory(group_id, spec)`` returns an un-started launcher for the group (an
#: ``EngineLauncher``, or any :class:`~rollsafe.ports.LaunchableEngine`).
LauncherFactory = Callable[[str, "EngineSpec"], "LaunchableEngine"]


@dataclass
class FleetConfig:
    """Everything a :class:`RolloutFleet` is built from.

    ``model_path``: the HF directory the engines start on (the trainer's version
    ``initial_version`` weights). ``template_dir``: non-weight files copied into exports
    (defaults to ``model_path``; must hold ``config.json``). ``export_root``: where
    ``hf-v{version}`` exports go (its parent must exist and be writable). ``engine_options``:
    extra :class:`EngineSpec` fields (``fault_injection``, ``dialect``, ``log_dir``...).
    ``warm_standby``: every group's launcher keeps one idle, already-imported engine process
    that takes the group's next (re)start, so a recovery skips the engine's interpreter start
    and imports (most of a CPU engine's start); it costs one such process per group (a few
    hundred MB of host memory each) and, after every start, one background import.
    ``GroupSpec.warm_standby`` overrides it per group. Needs an engine module that supports
    ``--standby`` (the reference engine does); ``engine_options={"standbys": 2}`` keeps two
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

    model_path: str | os.PathLike[str]
    export_root: str | os.PathLike[str]
    groups: Sequence[GroupSpec] = (GroupSpec(),)
    transport: str | TransportSettings = "ipc"
    template_dir: str | os.PathLike[str] | None = None
    health: HealthSettings = field(default_factory=HealthSettings)
    recovery: RecoverySettings = field(default_factory=RecoverySettings)
    enable_immediate_recovery: bool = False
    rearm_after: int = 2
    initial_version: int = 0
    launcher_factory: LauncherFactory | None = None
    engine_options: Mapping[str, Any] = field(default_factory=dict)
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

    def __post_init__(self) -> None:
        """Keep a ``transport=<settings object>`` in its field, then check every field that
        needs no filesystem (:meth:`validate` adds the paths)."""
        self._take_transport_object()
        self._check()

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

    def validate(self) -> list[_ResolvedGroup]:
        """Check the whole config (again: it is mutable), the paths included; return the groups
        with ids and fleet ranks resolved. :class:`RolloutFleet` calls it."""
        self._check()
        model = Path(self.model_path)
        if not model.is_dir():
            raise FleetConfigError("model_path", f"{model} is not a directory")
        template = Path(self.template_dir) if self.template_dir is not None else model
        key = "template_dir" if self.template_dir is not None else "model_path"
        if not template.is_dir():
            raise FleetConfigError(key, f"{template} is not a directory")
        if not (template / "config.json").is_file():
            raise FleetConfigError(key, f"{template} is not an HF model directory (no config.json)")
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
        return self._resolve_groups()

    def _check(self) -> None:
        """The checks that need no filesystem (the settings objects checked their own fields)."""
        if not isinstance(self.transport, str) or self.transport not in TRANSPORT_SETTINGS:
            raise FleetConfigError(
                "transport",
                f"unknown transport {self.transport!r}; choose one of {tuple(TRANSPORT_SETTINGS)}"
                " (or define a TransportSettings subclass)",
            )
        options = dict(self.engine_options or {})
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
        self.settings_for().check_engines(options)
        if self.placement not in PLACEMENTS:
            raise FleetConfigError(
                "placement", f"must be one of {PLACEMENTS}, got {self.placement!r}"
            )
        check_number("rearm_after", self.rearm_after, integer=True)
        check_number("spare_ranks", self.spare_ranks, integer=True, zero=True)
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
        if "warm_standby" in options:
            raise FleetConfigError(
                "engine_options.warm_standby",
                "set FleetConfig.warm_standby (or GroupSpec.warm_standby per group) instead",
            )
        self._check_topology(self._resolve_groups())

    def _check_topology(self, resolved: list[_ResolvedGroup]) -> None:
        """``placement="ray"``: transports that cannot reach a group where Ray may place it are
        refused naming the group (``topology_refusal``; docs/cluster.md section 6)."""
        if self.placement != "ray":
            return
        ids = [g.group_id for g in resolved]
        refused = topology_refusal(
            self.settings_for().transport, placement=self.placement, ray=self.ray, group_ids=ids
        )
        if refused is not None:
            raise FleetConfigError("transport", refused[1])

    def _resolve_groups(self) -> list[_ResolvedGroup]:
        groups = list(self.groups)
        if not groups:
            raise FleetConfigError("groups", "needs at least one group")
        resolved: list[_ResolvedGroup] = []
        owner: dict[int, str] = {}
        next_rank = 0
        for i, spec in enumerate(groups):
            if not isinstance(spec, GroupSpec):
                raise FleetConfigError(f"groups[{i}]", f"must be a GroupSpec, got {spec!r}")
            check_number(f"groups[{i}].ranks", spec.ranks, integer=True)
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
            resolved.append(_ResolvedGroup(gid, spec.ranks, ranks, standby))
        return resolved


@dataclass(frozen=True)
class _ResolvedGroup:
    group_id: str
    ranks: int
    fleet_ranks: tuple[int, ...]
    warm_standby: bool = False


def _default_launcher(group_id: str, spec: EngineSpec) -> EngineLauncher:
    from rollsafe.adapters.engines import EngineLauncher

    return EngineLauncher(spec)


class RolloutFleet:
    """The rollout-engine fleet of one trainer: launch, route, sync, recover, close.

    Thread-safe for :meth:`generate` (many threads) alongside one :meth:`sync_weights` at a
    time. Use as a context manager: ``__enter__`` starts the fleet, ``__exit__`` closes it.
    """

    def __init__(
        self,
        config: FleetConfig,
        *,
        metrics: CollectorRegistry | bool | None = None,
        metrics_port: int | None = None,
    ) -> None:
        """``metrics``: a ``prometheus_client.CollectorRegistry`` to register the fleet's
        metrics into (``True``: a fresh one, :attr:`metrics` ``.registry``); ``metrics_port``:
        serve them on ``127.0.0.1:PORT/metrics`` from :meth:`start` to :meth:`close` (0 picks a
        free port; :attr:`metrics` ``.url``). Both need the ``[metrics]`` extra
        (prometheus-client): without it they raise ``ImportError``. See ``docs/metrics.md``."""
        self._groups = config.validate()
        self.config = config
        self.registry = FleetRegistry(fleet_version=config.initial_version)
        self.mode = ImmediateRecoveryMode(
            enabled=config.enable_immediate_recovery, rearm_after=config.rearm_after
        )
        self.router = Router(
            self.registry,
            max_attempts=config.router_max_attempts,
            wait_for_routable_s=config.wait_for_routable_s,
            request_timeout_s=config.request_timeout_s,
        )
        self.world_size = sum(g.ranks for g in self._groups) + config.spare_ranks
        self._launchers: dict[str, LaunchableEngine] = {}
        self._factory: LauncherFactory | None = None
        #: the API key of engines that ``placement="ray"`` binds to their node's IP when
        #: ``engine_options`` names none (one per fleet; docs/cluster.md)
        self._fleet_api_key = secrets.token_urlsafe(32)
        #: the Ray placer of ``placement="ray"`` (None until start(), or for "local")
        self.placer: GroupPlacer | None = None
        #: ``placement="ray"``: the fleet's watcher of Ray's nodes (None until start())
        self.node_watcher: NodeWatcher | None = None
        #: the passed check of a ``ray.shared_exports`` export_root (None: not checked)
        self.shared_exports: SharedExportsCheck | None = None
        #: ``ray.shared_exports``: nodes that joined after the start and could not read the
        #: probe (node id -> "path: why"); no group is placed on them
        self.unreadable_nodes: dict[str, str] = {}
        #: the shared check run on a node that joins (``check_shared_exports``; tests wrap it)
        self.shared_check: Callable[..., Any] | None = None
        #: ``placement="ray"`` without shared exports: what moves an export to a recovering
        #: group's node (None otherwise, or until start())
        self.export_mover: ExportMover | None = None
        self._export_machines: dict[int, Any] = {}
        #: node loss, groups added and removed at runtime (docs/cluster.md)
        self.membership = Membership(self)
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        self.exporter: HFExporter | None = None
        self.transport: WeightTransport | None = None
        self.health: HealthManager | None = None
        self.recovery: RecoveryCoordinator | None = None
        self.sync: SyncCoordinator | None = None
        self.started_at: float | None = None
        self.start_seconds: float | None = None
        # request samples, crash marks and failure episodes (rollsafe.observe): for metrics,
        # record() and the timeline picture; a registry listener and the router's error hook
        self.observer = FleetObserver(self.registry)
        self.registry.add_listener(self.observer)
        self.router.on_group_error = self._request_failed
        #: request-failure detection (#17), counted apart from probes; built by start()
        self.request_health: RequestHealth | None = None
        self.metrics: FleetMetrics | None = None
        if (metrics is not None and metrics is not False) or metrics_port is not None:
            from rollsafe.observe.metrics import FleetMetrics

            self.metrics = FleetMetrics(
                self, registry=None if metrics is True else metrics, port=metrics_port
            )

    # ------------------------------------------------------------------ lifecycle
    @property
    def group_ids(self) -> list[str]:
        return [g.group_id for g in self._groups]

    @property
    def started(self) -> bool:
        return self._started and not self._closed

    def launcher(self, group_id: str) -> EngineLauncher:
        """The launcher owning ``group_id``'s engine processes (chaos tests kill ranks here);
        :class:`FleetError` when the group is not run by an ``EngineLauncher`` (use
        :meth:`engine`)."""
        from rollsafe.adapters.engines import EngineLauncher

        engine = self.engine(group_id)
        if not isinstance(engine, EngineLauncher):
            raise FleetError(
                f"group {group_id!r} runs in a {type(engine).__name__}, not an EngineLauncher "
                f"(placement={self.config.placement!r}): use fleet.engine({group_id!r})"
            )
        return engine

    def engine(self, group_id: str) -> LaunchableEngine:
        """The handle of ``group_id``'s engine: an ``EngineLauncher``, a ``RayEngineGroup``
        (``placement="ray"``) or what the ``launcher_factory`` made."""
        self._require_started()
        return self._launchers[group_id]

    @property
    def engine_traits(self) -> policy.EngineTraits:
        """How this fleet's engines fail (:class:`~rollsafe.policy.EngineTraits`): from the
        engine kind and dialect of ``engine_options``."""
        options = self.config.engine_options or {}
        kind = str(options.get("kind", "reference"))
        dialect = options.get("dialect") or ("sglang" if kind == "reference" else kind)
        # vLLM's weight-transfer backend as the launcher picks it (EngineSpec.vllm_backend):
        # rollsafe's gloo plugin on CPU (EngineSpec's default device), vLLM's nccl elsewhere
        from rollsafe.adapters.engines.vllm_cpu import ROLLSAFE_GLOO_BACKEND

        backend = options.get("weight_transfer_backend") or (
            ROLLSAFE_GLOO_BACKEND if str(options.get("device", "cpu")) == "cpu" else "nccl"
        )
        return policy.engine_traits(kind, str(dialect), weight_transfer_backend=str(backend))

    def _spec(self, group: _ResolvedGroup) -> EngineSpec:
        from rollsafe.adapters.engines import EngineSpec

        options = dict(self.config.engine_options)
        options.setdefault("weight_version", str(self.config.initial_version))
        cfg = self.config
        if cfg.placement == "ray" and cfg.ray.bind_node_ip and options.get("api_key") is None:
            # engines on a node's IP are reachable from the network: never without a key
            options["api_key"] = self._fleet_api_key
        return EngineSpec(
            model_path=str(self.config.model_path),
            ranks=group.ranks,
            warm_standby=group.warm_standby,
            **options,
        )

    def start(self) -> RolloutFleet:
        """Launch every group's engine (concurrently), wait until healthy, send ``launched``.

        On any failure everything started so far is stopped and the error propagates.
        """
        with self._lock:
            if self._closed:
                raise FleetNotStarted("a closed RolloutFleet cannot be started again")
            if self._started:
                return self
            self._started = True
        t0 = time.monotonic()
        self.started_at = time.time()
        try:
            self._build_control_plane()
            factory = self.config.launcher_factory or self._default_factory()
            self._factory = factory
            for g in self._groups:
                self._launchers[g.group_id] = factory(g.group_id, self._spec(g))
            with concurrent.futures.ThreadPoolExecutor(len(self._groups)) as pool:
                futures = [pool.submit(launcher.start) for launcher in self._launchers.values()]
                deadline = time.monotonic() + self.config.start_timeout_s
                for fut in futures:
                    fut.result(timeout=max(0.1, deadline - time.monotonic()))
            version = self.registry.fleet_version
            for g in self._groups:
                launcher = self._launchers[g.group_id]
                launcher.client.health(timeout=self.config.health.timeout_s)
                self.registry.add_group(
                    g.group_id,
                    g.fleet_ranks,
                    clients=[launcher.client],
                    restart_budget=self.config.recovery.restart_budget,
                    metadata={"engine_ranks": g.ranks},
                    standby_probe=launcher.standby_status,
                )
                for rank in g.fleet_ranks:
                    self.registry.report_member(
                        g.group_id, rank, healthy=True, weights_version=version
                    )
                recorded = {
                    r: m.healthy for r, m in self.registry.get(g.group_id).machine.members.items()
                }
                for event in policy.launch_events(recorded):
                    self.registry.send(g.group_id, event)
            assert self.health is not None
            self.health.start()
            self._watch_nodes()
            self.observer.start()
            if self.metrics is not None and self.metrics.requested_port is not None:
                self.metrics.serve()
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.monotonic() - t0
        return self

    def _default_factory(self) -> LauncherFactory:
        """``EngineLauncher`` for ``placement="local"``; for ``"ray"``, join Ray (``RAY_ADDRESS``
        or ``ray.address``; a new local Ray otherwise) and place each group in its own
        placement group (:mod:`rollsafe.adapters.ray`)."""
        cfg = self.config
        if cfg.placement != "ray":
            return _default_launcher
        from rollsafe.adapters.ray import GroupPlacer, init_ray, ray_engine_factory
        from rollsafe.adapters.ray.placement import ray_node_id

        settings = cfg.ray
        init_ray(**({"address": settings.address} if settings.address else {}))
        self._prepare_ray_cluster()
        self.placer = GroupPlacer(
            settings.resources_per_rank,
            timeout_s=settings.placement_timeout_s,
            spread=settings.spread,
            name_prefix=f"rollsafe-{os.getpid()}-{id(self):x}",
        )
        self._move_exports()
        factory = ray_engine_factory(
            self.placer,
            start_timeout_s=cfg.start_timeout_s,
            bind_node_ip=settings.bind_node_ip,
        )
        if not settings.trainer_node_groups:
            return factory
        pinned = set(settings.trainer_node_groups)
        trainer_node = str(ray_node_id())

        def pinning(group_id: str, spec: EngineSpec) -> LaunchableEngine:
            group = factory(group_id, spec)
            if group_id in pinned:  # placed on the trainer's node only (docs/cluster.md, 6)
                group.pin_node = trainer_node
            return group

        return pinning

    def _move_exports(self) -> None:
        """``placement="ray"`` without shared exports: a recovery that restarts a group from
        the current export moves it to the group's node first (``ExportMover``: published
        once per version, dropped when the export is no longer ready; docs/cluster.md
        section 5)."""
        cfg = self.config
        access = policy.export_access(placement=cfg.placement, shared=cfg.ray.shared_exports)
        if access is not policy.ExportAccess.MOVED or self.recovery is None:
            return
        from rollsafe.adapters.ray.exports import ExportMover

        exporter = self.exporter
        self.export_mover = ExportMover(
            self._launchers.__getitem__,
            keep=lambda v: exporter is not None and exporter.latest_ready(v) is not None,
            dest_root=cfg.ray.moved_exports_dir,
            fleet=f"{os.getpid()}-{id(self):x}",
        )
        self.recovery.export_mover = self.export_mover

    def _watch_nodes(self) -> None:
        """``placement="ray"``: one ``NodeWatcher`` for the fleet; a dead node's groups go
        through :meth:`node_lost`, a joining node is offered the waiting groups."""
        if self.placer is None:
            return
        from rollsafe.adapters.ray import NodeWatcher

        membership = self.membership

        def on_events(events: list[Any]) -> None:
            for event in events:
                if event.kind == "dead":
                    membership.node_lost(event.node_id, reason="Ray reports the node dead")
            joined = [event.node_id for event in events if event.kind == "joined"]
            if joined and self.config.ray.shared_exports:
                # the check reads a file on the node (up to placement_timeout_s): off the
                # watcher's thread, and before the waiting groups are offered the node
                threading.Thread(
                    target=self.nodes_joined,
                    args=(joined,),
                    name="rollsafe-shared-check",
                    daemon=True,
                ).start()
            elif joined:
                membership.place_waiting(reason="a node joined")

        self.node_watcher = NodeWatcher(on_events, interval_s=self.config.ray.node_watch_interval_s)
        self.node_watcher.start()

    def nodes_joined(self, node_ids: list[str]) -> dict[str, str]:
        """Nodes joined the cluster (the ``NodeWatcher``): with ``ray.shared_exports`` each is
        checked (``check_shared_exports(export_root, nodes=[id])``); one that cannot read the
        probe is recorded (``snapshot()["placement"]["unreadable_nodes"]``, a warning naming
        the node and the path) and no group is placed on it (``GroupPlacer.exclude``). Then
        the waiting groups are offered the room. Returns the nodes found unreadable now."""
        from rollsafe.adapters.ray import SharedExportUnreadable

        check = self.shared_check
        found: dict[str, str] = {}
        if self.config.ray.shared_exports and check is not None:
            for node_id in node_ids:
                try:
                    check(
                        self.config.export_root,
                        nodes=[node_id],
                        timeout_s=self.config.ray.placement_timeout_s,
                    )
                except SharedExportUnreadable as exc:
                    why = exc.failures.get(node_id, str(exc))
                    found[node_id] = f"{exc.path}: {why}"
                except Exception as exc:  # the check itself failed: not known to read it
                    found[node_id] = f"{self.config.export_root}: {type(exc).__name__}: {exc}"
            for node_id, why in found.items():
                log.warning(
                    "Ray node %s joined but cannot read the shared export_root (%s); "
                    "no group is placed on it",
                    node_id,
                    why,
                )
                with self._lock:
                    self.unreadable_nodes[node_id] = why
                if self.placer is not None:
                    self.placer.exclude(node_id, f"cannot read the shared export_root: {why}")
        self.membership.place_waiting(reason="a node joined")
        return found

    def _prepare_ray_cluster(self) -> None:
        """``placement="ray"``, once Ray is joined and before any group is placed: the
        weight-update store on the driver's node IP (unless ``nccl.master_address`` was set),
        and the check of a ``ray.shared_exports`` export_root on every alive node
        (:class:`~rollsafe.adapters.ray.SharedExportUnreadable` fails the start)."""
        from rollsafe.adapters.ray import check_shared_exports, driver_node_ip
        from rollsafe.transports import NCCLTransport

        cfg = self.config
        if cfg.nccl.master_address is None and isinstance(self.transport, NCCLTransport):
            self.transport.master_address = driver_node_ip()
        if cfg.ray.shared_exports:
            if self.shared_check is None:
                self.shared_check = check_shared_exports
            self.shared_exports = check_shared_exports(
                cfg.export_root, timeout_s=cfg.ray.placement_timeout_s
            )
            log.info(
                "export_root %s read back on %d Ray node(s) in %.2f s",
                cfg.export_root,
                len(self.shared_exports.nodes),
                self.shared_exports.seconds,
            )

    def _build_control_plane(self) -> None:
        from rollsafe.hf import HFExporter

        cfg = self.config
        template = cfg.template_dir if cfg.template_dir is not None else cfg.model_path
        self.exporter = HFExporter(cfg.export_root, template_dir=template)
        self.transport_fallback: str | None = None
        context = TransportContext(
            world_size=self.world_size,
            groups=tuple((g.group_id, g.ranks) for g in self._groups),
            engine_options=dict(cfg.engine_options or {}),
            exporter=self.exporter,
        )
        settings = cfg.settings_for()
        reasons = settings.fallback_reasons(context)
        topology = topology_fallback(
            settings.transport,
            placement=cfg.placement,
            ray=cfg.ray,
            group_ids=[g.group_id for g in self._groups],
        )
        if topology is not None:  # checkpoint-engine's placement cannot follow Ray's
            reasons = [*reasons, topology]
        if reasons:
            if settings.fallback is None:
                raise FleetConfigError(
                    "transport",
                    f"{settings.transport!r} cannot serve this fleet: " + "; ".join(reasons),
                )
            self.transport_fallback = "; ".join(reasons)
            log.warning(
                "transport %r falls back to %r: %s",
                settings.transport,
                settings.fallback,
                self.transport_fallback,
            )
            settings = cfg.settings_for(settings.fallback)
        transport = settings.build(context)
        self.transport = transport
        rs = cfg.recovery
        traits = self.engine_traits

        def targets_for(group: WorkerGroup) -> EngineTarget:
            # the engine kind's declared capability decides whether a transport with deltas
            # on may send this group a delta (docs/transports.md, "Deltas")
            return dataclasses.replace(
                default_target(group),
                applies_deltas=traits.applies_deltas,
                delta_base_by_content=traits.delta_base_by_content,
            )

        self.recovery = RecoveryCoordinator(
            self.registry,
            launcher_for=self._launchers.__getitem__,
            exporter=self.exporter,
            transport=transport if rs.targeted_push else None,
            mode=self.mode,
            settings=rs,
            targets_for=targets_for,
            traits_for=lambda _group: traits,
        )
        recovery = self.recovery
        if getattr(transport, "delta_stats", lambda: None)() is not None:
            self.registry.add_listener(_DeltaBaseReset(transport))
        self.health = HealthManager(
            self.registry, settings=cfg.health, on_group_failed=recovery.on_group_failed
        )
        health = self.health
        self.request_health = RequestHealth(
            self.registry,
            failure_threshold=cfg.health.failure_threshold,
            on_group_failed=lambda gid, reason: recovery.submit(gid, reason=reason),
            paused=lambda: health.paused,
        )
        self.router.on_group_ok = self.request_health.ok
        self.sync = SyncCoordinator(
            self.registry,
            transport,
            exporter=self.exporter,
            mode=self.mode,
            on_update_failure=cfg.on_update_failure,
            on_group_failed=lambda gid, reason: recovery.submit(gid, reason=reason),
            targets_for=targets_for,
            traits_for=lambda _group: traits,
        )

    def close(self, timeout: float = 10.0) -> None:
        """Stop health checks, recoveries, the router, the transport and every engine process.

        Idempotent; waits up to ``timeout`` s for an in-flight export to finish first.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.node_watcher is not None:
            with contextlib.suppress(Exception):
                self.node_watcher.stop(timeout=timeout)
        if self.health is not None:
            with contextlib.suppress(Exception):
                self.health.stop(timeout=timeout)
        with contextlib.suppress(Exception):
            self.observer.stop()
        if self.metrics is not None:  # stop serving; a closed fleet leaves the registry
            with contextlib.suppress(Exception):
                self.metrics.unregister()
        if self.recovery is not None:
            with contextlib.suppress(Exception):
                self.recovery.close(timeout=timeout)
        self.router.close()
        handle = self.exporter.in_flight if self.exporter is not None else None
        if handle is not None:
            with contextlib.suppress(Exception):
                handle.wait(timeout)
        if self.transport is not None:
            with contextlib.suppress(Exception):
                self.transport.close()
        for launcher in self._launchers.values():
            try:
                launcher.stop(timeout=5.0)
            except Exception:  # keep stopping the others
                log.exception("stopping an engine failed")

    def __enter__(self) -> RolloutFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _require_started(self) -> None:
        if not self._started or self._closed:
            raise FleetNotStarted("call RolloutFleet.start() first (or use it as a context)")

    # ------------------------------------------------------------------ trainer API
    def generate(
        self,
        input_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        session_id: str | None = None,
        timeout: float | None = None,
    ) -> RoutedResult:
        """One rollout request through the router (only ``active`` groups serve)."""
        self._require_started()
        return self.observer.track(
            lambda: self.router.generate(
                input_ids,
                text=text,
                sampling_params=sampling_params,
                session_id=session_id,
                timeout=timeout,
            )
        )

    def sync_weights(
        self,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        pause_mode: SyncPauseMode | None = None,
    ) -> SyncReport:
        """Push ``version`` to every active and pending group, then export it asynchronously.

        ``pause_mode`` (``"retract"`` or ``"abort"``): pause generation around the push and
        continue the paused requests from their tokens so far on the new weights, their
        segments tagged with each version (:mod:`rollsafe.fleet.partial_rollouts`); None
        (default): :attr:`FleetConfig.pause_mode`, and when that is None too, requests keep
        running while the weights change, except on an engine whose update must run paused
        (:attr:`engine_traits`, vLLM), which is paused with ``"abort"``."""
        self._require_started()
        assert self.sync is not None
        pause_mode = self.sync_pause_mode(pause_mode)
        if pause_mode is None:
            report = self.sync.sync(named_tensors, version)
        else:
            if pause_mode not in SYNC_PAUSE_MODES:
                raise InvalidArgument(
                    "pause_mode", f"pause_mode must be in {SYNC_PAUSE_MODES}, not {pause_mode!r}"
                )
            bracket = paused_generation(self.registry, self.router, pause_mode)
            report = self.sync.sync(named_tensors, version, around_update=bracket)
        self._harvest_exports()
        return report

    def sync_pause_mode(self, requested: SyncPauseMode | None = None) -> SyncPauseMode | None:
        """The pause mode a sync runs with: ``requested``, else :attr:`FleetConfig.pause_mode`,
        else ``"abort"`` for an engine whose update must run paused, else None (no pause)."""
        if requested is not None:
            return requested
        if self.config.pause_mode is not None:
            return self.config.pause_mode
        return "abort" if self.engine_traits.update_needs_pause else None

    def pause(self) -> None:
        """Pause health checks, then generation on every routable group (before offload)."""
        self._require_started()
        assert self.health is not None
        self.health.pause()
        for group in self.registry.routable():
            client = group.client
            if client is not None:
                client.pause_generation()

    def resume(self) -> None:
        """Continue generation on every routable group, then resume health checks."""
        self._require_started()
        assert self.health is not None
        for group in self.registry.routable():
            client = group.client
            if client is not None:
                client.continue_generation()
        self.health.resume()

    # ------------------------------------------------------------------ membership
    def add_group(self, spec: GroupSpec) -> str:
        """Start a group at runtime and return its id; it is routed only once it holds the
        fleet's version (``pending_weights`` until a targeted push or the next sync brings it
        there). Its fleet ranks come from ``FleetConfig.spare_ranks``
        (:meth:`rollsafe.fleet.elastic.Membership.add_group`)."""
        return self.membership.add_group(spec)

    def remove_group(self, group_id: str, *, drain_timeout_s: float = 30.0) -> RemovalEnd:
        """Drain ``group_id``, wait up to ``drain_timeout_s`` for its requests (the rest
        continue elsewhere), stop it, give its placement back and retire it for good."""
        return self.membership.remove_group(group_id, drain_timeout_s=drain_timeout_s)

    def node_lost(self, node_id: str, *, reason: str = "") -> list[str]:
        """Node ``node_id`` died: every group on it leaves routing at once and is placed
        again; returns those groups (``placement="ray"``; the ``NodeWatcher`` calls it)."""
        return self.membership.node_lost(node_id, reason=reason)

    def recoveries(self) -> list[RecoveryResult]:
        return self.recovery.recoveries() if self.recovery is not None else []

    def wait_recoveries(self, timeout: float = 60.0) -> bool:
        """Wait until no recovery is running; return whether that happened in time."""
        deadline = time.monotonic() + timeout
        while self.recovery is not None and self.recovery.running():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def checksums(self, timeout: float = 10.0) -> dict[str, str | None]:
        """Each group's engine model digest from its own weight checker (None if it did not
        answer). Equal model digests say two engines of one kind report the same; against a
        trainer use :meth:`check_weights` (per tensor, in the engine's layout, never "equal"
        without data). ``rollsafe.checksum.weights_checksum(w, algorithm)["model"]`` equals
        an SGLang-dialect engine's; vLLM reports fused parameter names and, on CPU, empty
        digests for linear weights, so its model digest is not a trainer's."""
        out: dict[str, str | None] = {}
        for group in self.registry.groups():
            client = group.client
            try:
                out[group.group_id] = (
                    client.weights_checksum(timeout=timeout).model if client else None
                )
            except Exception:
                out[group.group_id] = None
        return out

    def check_weights(
        self, weights: Mapping[str, torch.Tensor], timeout: float = 10.0
    ) -> dict[str, DigestCheck | None]:
        """Each group's engine checked against the trainer's HF-named ``weights``, tensor by
        tensor in the engine's own layout (:mod:`rollsafe.fleet.weights_check`); None where
        the engine did not answer. A verdict is ``"equal"`` only when every tensor carried data
        and matched: vLLM on CPU reports no data for its linear weights (``"unverified"``,
        those tensors ``no_data``); check those with :mod:`rollsafe.probe`."""
        from rollsafe.fleet.weights_check import check_engine, read_config

        cfg = self.config
        config = read_config(cfg.template_dir if cfg.template_dir is not None else cfg.model_path)
        out: dict[str, DigestCheck | None] = {}
        for group in self.registry.groups():
            client = group.client
            try:
                out[group.group_id] = (
                    check_engine(client, weights, config, timeout=timeout) if client else None
                )
            except Exception:
                out[group.group_id] = None
        return out

    def _request_failed(self, group_id: str, exc: BaseException | None = None) -> None:
        """The router's error hook: the observer's episodes, then request health."""
        self.observer.request_failed(group_id, exc)
        if self.request_health is not None:
            self.request_health.failed(group_id, exc)

    # ------------------------------------------------------------------ inspection
    def _harvest_exports(self) -> None:
        if self.exporter is None:
            return
        if self.export_mover is not None:  # a retired export's published parcel is dropped
            with contextlib.suppress(Exception):
                self.export_mover.prune()
        with contextlib.suppress(Exception):
            for record in self.exporter.exports():
                self._export_machines.setdefault(record.version, record.lifecycle)
        with contextlib.suppress(Exception):
            handle = self.exporter.handle()
            self._export_machines.setdefault(handle.version, handle.lifecycle)

    def export_states(self) -> dict[int, str]:
        """Every export this fleet started, by version, and its lifecycle state."""
        self._harvest_exports()
        return {v: str(m.state) for v, m in sorted(self._export_machines.items())}

    def timeline(self) -> list[dict[str, Any]]:
        """Every machine transition (groups, exports, registration, mode), oldest first."""
        self._harvest_exports()
        rows: list[dict[str, Any]] = []

        def add(kind: str, subject: str, records: Iterable[TransitionRecord]) -> None:
            for rec in records:
                row = rec.as_dict()
                row["kind"] = kind
                row["subject"] = subject
                rows.append(row)

        for group in self.registry.groups():
            add("group", group.group_id, group.machine.history)
        for version, machine in sorted(self._export_machines.items()):
            add("export", f"v{version}", machine.history)
        if self.transport is not None:
            add("registration", self.transport.name, self.transport.registration.history)
        add("mode", "immediate_recovery", self.mode.history)
        rows.sort(key=lambda r: (r["timestamp"], r["kind"], r["seq"]))
        return rows

    def record(
        self,
        path: str | os.PathLike[str],
        *,
        t0: float | None = None,
        marks: Iterable[Mapping[str, Any]] = (),
        svg: bool = True,
    ) -> Path:
        """Write this fleet's run so far into the directory ``path``: ``timeline.jsonl`` (every
        machine transition, sync, recovery, crash mark and request-count sample,
        :mod:`rollsafe.observe.runfile`), ``fleet.json`` (:meth:`snapshot`) and, with ``svg``,
        ``timeline.svg`` (:mod:`rollsafe.observe.timeline_svg`). ``rollsafe report PATH`` reads
        it back. Works during the run and after :meth:`close`; returns ``path``. ``t0``: the
        run's start (wall clock; default :attr:`started_at`); ``marks``: extra points such as
        ``{"kind": "crash", "group": "g1", "timestamp": ...}`` (or use
        ``fleet.observer.mark_crash(group_id)`` when it happens)."""
        from rollsafe.observe.runfile import build_rows, write_run

        out = Path(path)
        rows = build_rows(self, t0=t0, marks=marks)
        write_run(out, rows, fleet_json=self.snapshot())
        if svg:
            from rollsafe.observe.timeline_svg import write_svg

            write_svg(out / "timeline.svg", rows)
        return out

    def picture(self) -> FleetPicture:
        """The fleet as :mod:`rollsafe.invariants` reads it (what the fleet records; the
        engines' ground truth is unknown here). ``check_all(fleet.picture())`` is the demo's
        final invariant check."""
        groups = tuple(
            GroupPicture(
                g.group_id,
                g.state,
                g.is_routable,
                g.machine.restart_budget,
                tuple(
                    MemberPicture(r, m.known, m.healthy, m.weights_version)
                    for r, m in g.machine.members.items()
                ),
            )
            for g in self.registry.groups()
        )
        registration = self.transport.registration if self.transport is not None else None
        exports: tuple[ExportPicture, ...] = ()
        if self.exporter is not None:
            exports = tuple(
                ExportPicture(r.version, r.state, len(r.lifecycle.leases), r.path.exists())
                for r in self.exporter.exports()
            )
        return FleetPicture(
            fleet_version=self.registry.fleet_version,
            groups=groups,
            initial_version=self.config.initial_version,
            registration_state=registration.state if registration is not None else None,
            published=registration.published if registration is not None else None,
            last_published_version=(
                registration.last_published_version if registration is not None else None
            ),
            exports=exports,
            mode_state=self.mode.state,
            rearm_after=self.mode.rearm_after,
            max_version_seen=self.registry.fleet_version,
        )

    def _export_access(self) -> str:
        """``snapshot()["placement"]["exports"]``: ``shared`` (checked at start), ``moved``
        (recoveries move the export to the group's node) or ``local``."""
        if self.shared_exports is not None:
            return "shared"
        return "moved" if self.export_mover is not None else "local"

    def _delta_stats(self) -> dict[str, object] | None:
        """The transport's deltas (bases per group, snapshots held, the last sync's bytes);
        None when its deltas are off or it has none."""
        stats = getattr(self.transport, "delta_stats", None)
        return stats() if callable(stats) else None

    def snapshot(self) -> dict[str, Any]:
        """A JSON-friendly picture of the fleet right now."""
        return {
            "started": self.started,
            "transport": self.config.transport,
            "placement": {
                "exports": self._export_access(),
                "moved": self.export_mover.stats() if self.export_mover is not None else None,
                "unreadable_nodes": dict(self.unreadable_nodes),
                "kind": self.config.placement,
                "nodes": self.placer.nodes() if self.placer is not None else {},
                **self.membership.snapshot(),
                "watcher": self.node_watcher.stats() if self.node_watcher is not None else None,
            },
            "registry": self.registry.snapshot(),
            "dispatch_counts": self.registry.dispatch_counts(),
            "mode": self.mode.state,
            "registration": (
                self.transport.registration.state if self.transport is not None else None
            ),
            "delta": self._delta_stats(),
            "exports": {str(v): s for v, s in self.export_states().items()},
            "recoveries": [r.as_dict() for r in self.recoveries()],
            "router": self.router.stats(),
            "health": self.health.stats() if self.health is not None else None,
            "request_health": (
                self.request_health.stats() if self.request_health is not None else None
            ),
        }


class _DeltaBaseReset:
    """With deltas on: a group that leaves service (failed, lost with its node, draining,
    retired) or starts again (launching) has unknown weights until it confirms a push, so its
    base is forgotten at once and its next push is full (``docs/transports.md``, "Deltas")."""

    STATES = frozenset({"inactive", "unplaced", "draining", "retired", "launching"})

    def __init__(self, transport: WeightTransport) -> None:
        self.transport = transport

    def on_transition(self, group: WorkerGroup, record: object) -> None:
        if getattr(record, "target", None) not in self.STATES:
            return
        forget = getattr(self.transport, "forget", None)
        if callable(forget):
            try:
                forget(group.group_id)
            except Exception:  # a hook must not fail the sender's event
                log.exception("forgetting %s's delta base failed", group.group_id)
