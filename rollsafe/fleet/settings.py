"""The fleet components' settings: the one place their defaults live, validated on construction.

Owns :class:`HealthSettings` (the :class:`~rollsafe.fleet.health.HealthManager`'s probing) and
:class:`RecoverySettings` (the :class:`~rollsafe.fleet.recovery.RecoveryCoordinator`'s pool,
deadlines and retries, plus the fleet-level restart budget and targeted-push switch). Each
component takes its settings object (``settings=``); the ``HealthManager``'s keyword arguments
(``interval_s=``...) override the object's fields, the ``RecoveryCoordinator`` has none that
mirror a field (``rc.settings`` holds them). A bad value raises :class:`FleetConfigError` naming
the field (``health.interval_s``) when the settings object is built, before anything starts.

A fleet transport is one class: a frozen :class:`TransportSettings` subclass that names its
``transport``, validates its fields in ``__post_init__``, may refuse engine options it cannot
serve (:meth:`~TransportSettings.check_engines`), may name a ``fallback`` transport and say when
to use it (:meth:`~TransportSettings.fallback_reasons`), and builds the transport from a
:class:`TransportContext` (:meth:`~TransportSettings.build`). Defining the subclass registers it
by name in :data:`TRANSPORT_SETTINGS`; ``FleetConfig(transport=MySettings(...))`` selects it.
The built-in four (:class:`IpcSettings`, :class:`NcclSettings`,
:class:`CheckpointEngineSettings`, :class:`DiskSettings`) are also held by the
:class:`~rollsafe.fleet.FleetConfig` fields of the same name
(``FleetConfig(nccl=NcclSettings(backend="nccl"))``). Every error names its key as
``<transport>.<field>`` (``nccl.backend``, ``checkpoint_engine.p2p``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from rollsafe.errors import InvalidArgument, InvalidArgumentType
from rollsafe.registry import FleetError
from rollsafe.transports.delta import DeltaSettings

if TYPE_CHECKING:
    from rollsafe.adapters.engines import EngineSpec
    from rollsafe.ports import WeightTransport

__all__ = [
    "CE_P2P_PROTOCOLS",
    "TRANSPORT_SETTINGS",
    "CheckpointEngineSettings",
    "DiskSettings",
    "FleetConfigError",
    "HealthSettings",
    "IpcSettings",
    "NcclSettings",
    "RaySettings",
    "RecoverySettings",
    "TransportContext",
    "TransportSettings",
    "topology_fallback",
    "topology_refusal",
    "with_overrides",
]

S = TypeVar("S")
log = logging.getLogger(__name__)


class FleetConfigError(FleetError, InvalidArgument):
    """A fleet setting is malformed; ``key`` names it (e.g. ``groups[1].ranks``)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(key, f"fleet config {key!r}: {message}")


def check_number(
    key: str, value: object, *, integer: bool = False, zero: bool = False, alias: str = ""
) -> None:
    """Raise :class:`FleetConfigError` unless ``value`` is a positive number (``zero``: or 0)."""
    also = f" ({alias})" if alias else ""
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type:
        kind = "n int" if integer else " number"
        raise FleetConfigError(key, f"must be a{kind}, got {value!r}{also}")
    assert isinstance(value, (int, float))
    if value < 0 or (value == 0 and not zero):
        raise FleetConfigError(key, f"must be {'>= 0' if zero else '> 0'}, got {value!r}{also}")


@dataclass(frozen=True)
class HealthSettings:
    """How the health manager probes: every ``interval_s`` (or at once on a wake), each probe
    bounded by ``timeout_s``; ``failure_threshold`` consecutive failures of a rank fail its
    group. No pool to size: each sync probe runs on a daemon thread of its own and a group
    whose probe hangs is not probed again, so at most one probe thread per group is alive."""

    interval_s: float = 0.5
    timeout_s: float = 2.0
    failure_threshold: int = 2

    def __post_init__(self) -> None:
        check_number("health.interval_s", self.interval_s, alias="interval_s=")
        check_number("health.timeout_s", self.timeout_s, alias="timeout_s=")
        check_number(
            "health.failure_threshold",
            self.failure_threshold,
            integer=True,
            alias="failure_threshold=",
        )


@dataclass(frozen=True)
class RecoverySettings:
    """How recoveries run: ``max_workers`` at once, each bounded by ``timeout_s``; skipped when
    ``remaining_work_s()`` says the rollout ends within ``expected_recovery_s``; a failed
    attempt is retried (``retry``) after ``retry_delay_s`` while the group's ``restart_budget``
    lasts. ``health_timeout_s`` bounds each health check of a restarted engine,
    ``stop_timeout_s`` the polite stop of a failed one. ``targeted_push=False`` gives the
    recovery no transport: without immediate recovery a restarted group then waits in
    ``pending_weights`` for the next sync (the deferred baseline)."""

    max_workers: int = 2
    timeout_s: float = 120.0
    restart_budget: int = 3
    targeted_push: bool = True
    expected_recovery_s: float = 10.0
    retry_delay_s: float = 0.5
    remaining_work_s: Callable[[], float | None] | None = None
    retry: bool = True
    health_timeout_s: float = 5.0
    stop_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        check_number("recovery.max_workers", self.max_workers, integer=True, alias="max_workers=")
        check_number("recovery.timeout_s", self.timeout_s, alias="recovery_timeout_s=")
        check_number("recovery.restart_budget", self.restart_budget, integer=True, zero=True)
        check_number(
            "recovery.expected_recovery_s",
            self.expected_recovery_s,
            zero=True,
            alias="expected_recovery_s=",
        )
        check_number(
            "recovery.retry_delay_s", self.retry_delay_s, zero=True, alias="retry_delay_s="
        )
        check_number("recovery.health_timeout_s", self.health_timeout_s, alias="health_timeout_s=")
        check_number(
            "recovery.stop_timeout_s", self.stop_timeout_s, zero=True, alias="stop_timeout_s="
        )
        for name in ("targeted_push", "retry"):
            if not isinstance(getattr(self, name), bool):
                raise FleetConfigError(
                    f"recovery.{name}", f"must be a bool, got {getattr(self, name)!r}"
                )
        if self.remaining_work_s is not None and not callable(self.remaining_work_s):
            raise FleetConfigError(
                "recovery.remaining_work_s",
                f"must be a callable or None, got {self.remaining_work_s!r}",
            )


#: The values of :attr:`FleetConfig.placement <rollsafe.fleet.FleetConfig>`.
PLACEMENTS = ("local", "ray")


@dataclass(frozen=True)
class RaySettings:
    """How ``FleetConfig(placement="ray")`` places groups (``docs/cluster.md``).

    ``resources_per_rank``: the Ray resources one engine rank reserves (one bundle per rank,
    a group's bundles packed on one node: ``{"CPU": 1.0}``, ``{"GPU": 1.0, "CPU": 2.0}``, a
    custom resource that marks rollout nodes...); ``placement_timeout_s``: how long a group's
    placement may wait for room; ``spread``: hint each group at the node holding the fewest of
    the fleet's groups; ``address``: the cluster to join (None: ``RAY_ADDRESS``, else a new
    local Ray; an already initialised Ray is used as it is); ``bind_node_ip``: engines listen
    on their node's IP so the trainer's node reaches them (False: the engine's ``host``,
    loopback by default, which only a one-machine cluster reaches); ``shared_exports``:
    declare ``export_root`` the same directory on every node (shared storage), checked at
    start by reading a probe file back on every alive node (within ``placement_timeout_s``;
    a node that cannot fails the start naming it); needed by ``transport="disk"``;
    ``node_watch_interval_s``: the period of the fleet's ``NodeWatcher`` (one ``ray.nodes()``
    call per round for the whole fleet): a node Ray reports dead takes its groups out of
    routing at once and has them placed again; a node that joins takes waiting groups;
    ``moved_exports_dir``: without ``shared_exports``, a recovery that restarts a group from
    the current export first moves it to the group's node (Ray's object store, checked against
    its manifest there): the directory on each node the copies go under (None: the node's
    temporary directory), in ``rollsafe-moved/<fleet>/<node id>``; ``trainer_node_groups``:
    the ids of groups placed on the trainer's (the driver's) node only, never elsewhere (a
    placement Ray offers on another node is given back; none there: the group waits): such a
    group reaches the trainer's memory and path, so ``transport="ipc"`` (or ``"disk"``
    without ``shared_exports``) is allowed when every group is one
    (:func:`topology_refusal`)."""

    resources_per_rank: Mapping[str, float] = field(default_factory=lambda: {"CPU": 1.0})
    placement_timeout_s: float = 60.0
    spread: bool = True
    address: str | None = None
    bind_node_ip: bool = True
    shared_exports: bool = False
    node_watch_interval_s: float = 1.0
    moved_exports_dir: str | None = None
    trainer_node_groups: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.resources_per_rank, Mapping) or not self.resources_per_rank:
            raise FleetConfigError(
                "ray.resources_per_rank",
                f"must be a non-empty mapping of Ray resources, got {self.resources_per_rank!r}",
            )
        for name, amount in self.resources_per_rank.items():
            check_number(f"ray.resources_per_rank[{name!r}]", amount, zero=True)
        if not any(v > 0 for v in self.resources_per_rank.values()):
            raise FleetConfigError(
                "ray.resources_per_rank", "needs one resource > 0 (Ray refuses empty bundles)"
            )
        check_number("ray.placement_timeout_s", self.placement_timeout_s)
        check_number("ray.node_watch_interval_s", self.node_watch_interval_s)
        for name in ("spread", "bind_node_ip", "shared_exports"):
            if not isinstance(getattr(self, name), bool):
                raise FleetConfigError(
                    f"ray.{name}", f"must be a bool, got {getattr(self, name)!r}"
                )
        if self.address is not None and (not isinstance(self.address, str) or not self.address):
            raise FleetConfigError("ray.address", f"must be None or a string, got {self.address!r}")
        pinned = self.trainer_node_groups
        if not isinstance(pinned, (tuple, list)) or not all(
            isinstance(g, str) and g for g in pinned
        ):
            raise FleetConfigError(
                "ray.trainer_node_groups", f"must be a tuple of group ids, got {pinned!r}"
            )
        moved = self.moved_exports_dir
        if moved is not None and (not isinstance(moved, str) or not os.path.isabs(moved)):
            raise FleetConfigError(
                "ray.moved_exports_dir", f"must be None or an absolute path, got {moved!r}"
            )


def topology_refusal(
    transport: str, *, placement: str, ray: RaySettings, group_ids: Sequence[str]
) -> tuple[str, str] | None:
    """Why ``transport`` cannot reach a group of this topology, as ``(group id, reason)``;
    None when it can (``docs/cluster.md`` section 6). ``ipc`` hands CUDA / shared-memory
    handles: only groups on the trainer's node (``ray.trainer_node_groups``) can open them;
    ``disk`` makes engines read ``export_root`` at the trainer's path: groups on the trainer's
    node, or any group when ``ray.shared_exports`` declares it shared. ``nccl`` reaches every
    node; checkpoint-engine falls back instead (:func:`topology_fallback`)."""
    if placement != "ray" or transport not in ("ipc", "disk"):
        return None
    if transport == "disk" and ray.shared_exports:
        return None
    for gid in group_ids:
        if gid in ray.trainer_node_groups:
            continue
        where = (
            "placed by Ray on any node with room (not in ray.trainer_node_groups), not "
            "necessarily the trainer's node"
        )
        if transport == "ipc":
            return gid, (
                f"'ipc' reaches engines on the trainer's node only; group {gid!r} is {where}: "
                "pin it with ray=RaySettings(trainer_node_groups=(...)) or use 'nccl'"
            )
        return gid, (
            f"'disk' makes every engine read export_root at the trainer's path; group {gid!r} "
            f"is {where}: declare export_root shared on every node "
            "(ray=RaySettings(shared_exports=True), checked at start), pin the group "
            "(ray.trainer_node_groups), or use 'nccl'"
        )
    return None


def topology_fallback(
    transport: str, *, placement: str, ray: RaySettings, group_ids: Sequence[str]
) -> str | None:
    """Why checkpoint-engine cannot serve this topology (None: it can). Its parameter server
    runs in the trainer's process and hands each engine rank its GPU buffers (colocated: CUDA
    IPC), so its ranks follow the groups' Ray placement only when every group is on the
    trainer's node (``ray.trainer_node_groups``); otherwise the fleet falls back to ``nccl``
    with this reason."""
    if placement != "ray" or transport != "checkpoint_engine":
        return None
    away = [g for g in group_ids if g not in ray.trainer_node_groups]
    if not away:
        return None
    return (
        f"checkpoint-engine's parameter server reaches engines colocated with the trainer "
        f"only; with placement='ray' groups {away} may be placed on other nodes (not in "
        "ray.trainer_node_groups)"
    )


#: where engines reach the trainer's weight-update store when nothing else is known
#: (``NcclSettings.master_address`` None, ``placement="local"``)
DEFAULT_MASTER_ADDRESS = "127.0.0.1"

#: transport name -> its settings class (filled by defining a :class:`TransportSettings`
#: subclass); the fleet builds one of these transports by name (``FleetConfig.transport``).
TRANSPORT_SETTINGS: dict[str, type[TransportSettings]] = {}
#: The values of :attr:`CheckpointEngineSettings.p2p_protocol`.
CE_P2P_PROTOCOLS = ("rdma", "tcp")


@dataclass(frozen=True)
class TransportContext:
    """What a transport's builder knows of the fleet it serves: the transport's ``world_size``
    (every engine rank of every group), the ``groups`` as ``(group_id, engine ranks)`` in
    config order (``FleetConfig.groups[i]`` is ``groups[i]``), the ``engine`` template
    (:class:`~rollsafe.adapters.engines.EngineSpec`: ``kind``, ``dialect``, ``device``...) and
    the fleet's ``exporter``."""

    world_size: int
    groups: tuple[tuple[str, int], ...] = ()
    #: the fleet's engine template (None: not known, a transport built outside a fleet)
    engine: EngineSpec | None = None
    #: the fleet's :class:`~rollsafe.hf.HFExporter` (``disk`` loads its exports)
    exporter: Any = None


def check_delta(key: str, value: object) -> None:
    """Raise :class:`FleetConfigError` unless ``value`` is a bool or a :class:`DeltaSettings`."""
    if not isinstance(value, bool | DeltaSettings):
        raise FleetConfigError(key, f"must be True, False or a DeltaSettings(...), got {value!r}")


def delta_settings(value: bool | DeltaSettings) -> DeltaSettings | None:
    """What a transport is built with: None for False (full pushes only), the defaults for
    True."""
    if value is True:
        return DeltaSettings()
    return value or None


@dataclass(frozen=True)
class TransportSettings:
    """Base of one fleet transport, the only class a new transport needs.

    A subclass sets ``transport`` (its name; defining the class registers it in
    :data:`TRANSPORT_SETTINGS`), adds frozen fields with defaults, validates them in
    ``__post_init__`` (raising :class:`FleetConfigError` naming the field) and implements
    :meth:`build`. Optional: :meth:`check_engines` (refuse engine options at config time),
    ``fallback`` with :meth:`fallback_reasons` (build another transport, with one warning, when
    this one cannot serve the fleet). Select it with ``FleetConfig(transport=MySettings(...))``.
    """

    transport: ClassVar[str] = ""
    #: The transport built instead when :meth:`fallback_reasons` objects (None: never).
    fallback: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.transport:
            return
        known = TRANSPORT_SETTINGS.get(cls.transport)
        if known is not None and (known.__module__, known.__qualname__) != (
            cls.__module__,
            cls.__qualname__,
        ):
            raise InvalidArgumentType(
                "transport",
                f"transport {cls.transport!r} is already registered by "
                f"{known.__module__}.{known.__qualname__}; pick another name",
            )
        TRANSPORT_SETTINGS[cls.transport] = cls

    def key(self, name: str) -> str:
        """The key errors name for field ``name``: ``<transport>.<name>`` (``nccl.backend``)."""
        return f"{self.transport}.{name}"

    def check_engines(self, engine: EngineSpec) -> None:
        """Raise :class:`FleetConfigError` if this transport can never serve engines started
        from ``engine`` (checked when the config is built). The base accepts every engine."""

    def fallback_reasons(self, context: TransportContext) -> list[str]:
        """Why the fleet must build ``fallback`` instead (empty: build this one; checked at
        :meth:`~rollsafe.fleet.RolloutFleet.start`). The base never falls back."""
        return []

    def build(self, context: TransportContext) -> WeightTransport:
        """The transport a :class:`~rollsafe.fleet.RolloutFleet` syncs through (one per fleet,
        built at start, closed with the fleet)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement build()")


@dataclass(frozen=True)
class IpcSettings(TransportSettings):
    """``transport="ipc"`` (CUDA IPC / shared-memory handles to colocated engines).
    ``check_finite`` (default True): the transport refuses a version holding NaN or inf
    (:class:`~rollsafe.transports.NonFiniteWeights`, nothing pushed), checking it once per
    version, and the engines skip their own pass; False leaves the check to each engine, every
    push (``docs/transports.md``, "The finite check"). Refuses vLLM-dialect engines (vLLM 0.33.0
    serves no ``/update_weights_from_tensor``)."""

    transport: ClassVar[str] = "ipc"
    check_finite: bool = True
    delta: bool | DeltaSettings = False

    def __post_init__(self) -> None:
        if not isinstance(self.check_finite, bool):
            raise FleetConfigError(
                self.key("check_finite"), f"must be a bool, got {self.check_finite!r}"
            )
        check_delta(self.key("delta"), self.delta)

    def check_engines(self, engine: EngineSpec) -> None:
        if engine.dialect == "vllm":
            raise FleetConfigError(
                "transport",
                "'ipc' pushes through /update_weights_from_tensor, which vLLM 0.33.0 does not "
                "serve; use transport='nccl' (vLLM's native weight transfer) with a vLLM engine",
            )

    def build(self, context: TransportContext) -> WeightTransport:
        from rollsafe.transports import IPCTransport

        return IPCTransport(
            context.world_size, check_finite=self.check_finite, delta=delta_settings(self.delta)
        )


@dataclass(frozen=True)
class NcclSettings(TransportSettings):
    """``transport="nccl"`` (also the fallback of ``checkpoint_engine``): ``backend`` ``"gloo"``
    (the default: moves host memory, works with engines anywhere), ``"nccl"`` (trainer weights
    and engines on GPUs) or None (picks by the weights' device); ``bucket_bytes`` (None:
    :data:`~rollsafe.transports.DEFAULT_NCCL_BUCKET_BYTES`); ``group_timeout_s`` bounds the
    process-group setup and each collective; ``master_address``: where the engines reach the
    trainer's store (None: ``127.0.0.1`` with ``placement="local"``, the driver's Ray node IP
    with ``placement="ray"``; a value given is kept). ``check_finite``: refuse a version
    holding NaN or inf at register (:class:`~rollsafe.transports.NonFiniteWeights`, nothing
    pushed: neither vLLM nor its rollsafe plugin checks), one pass over its bytes per version."""

    transport: ClassVar[str] = "nccl"
    backend: str | None = "gloo"
    bucket_bytes: int | None = None
    group_timeout_s: float = 120.0
    master_address: str | None = None
    delta: bool | DeltaSettings = False
    check_finite: bool = True

    def __post_init__(self) -> None:
        check_delta(self.key("delta"), self.delta)
        if not isinstance(self.check_finite, bool):
            raise FleetConfigError(
                self.key("check_finite"), f"must be a bool, got {self.check_finite!r}"
            )
        if self.backend not in ("gloo", "nccl", None):
            raise FleetConfigError(
                self.key("backend"), f"must be 'gloo', 'nccl' or None, got {self.backend!r}"
            )
        address = self.master_address
        if address is not None and (not isinstance(address, str) or not address.strip()):
            raise FleetConfigError(
                self.key("master_address"),
                f"must be None or a host name / IP address, got {address!r}",
            )
        if self.bucket_bytes is not None:
            check_number(self.key("bucket_bytes"), self.bucket_bytes, integer=True)
        check_number(self.key("group_timeout_s"), self.group_timeout_s)

    def build(self, context: TransportContext) -> WeightTransport:
        from rollsafe.transports import DEFAULT_NCCL_BUCKET_BYTES, NCCLTransport

        return NCCLTransport(
            context.world_size,
            master_address=self.master_address or DEFAULT_MASTER_ADDRESS,
            backend=self.backend,
            bucket_bytes=self.bucket_bytes or DEFAULT_NCCL_BUCKET_BYTES,
            group_timeout=self.group_timeout_s,
            delta=delta_settings(self.delta),
            check_finite=self.check_finite,
        )


@dataclass(frozen=True)
class DiskSettings(TransportSettings):
    """``transport="disk"``: every engine loads the synced version from the fleet's own verified
    HF export (SGLang ``/update_weights_from_disk``, vLLM ``reload_weights``), read under a
    lease. The sync writes the export first (or adopts a ready one) and waits up to
    ``export_timeout_s`` for it; each engine may take ``request_timeout_s`` to load. Engines
    must see ``export_root`` at the trainer's path (one machine, or shared storage).

    No delta mode: the full export is written every version anyway (recoveries restart from
    it), so a delta file beside it would add bytes, not save them, and the real engines' disk
    loaders (SGLang ``/update_weights_from_disk``, vLLM ``reload_weights``) read whole
    checkpoints only (``docs/transports.md``, "Deltas")."""

    transport: ClassVar[str] = "disk"
    export_timeout_s: float = 600.0
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        check_number(self.key("export_timeout_s"), self.export_timeout_s)
        check_number(self.key("request_timeout_s"), self.request_timeout_s)

    def build(self, context: TransportContext) -> WeightTransport:
        from rollsafe.transports import DiskTransport

        if context.exporter is None:
            raise FleetConfigError("transport", "'disk' needs the fleet's exporter")
        return DiskTransport(
            context.exporter,
            world_size=context.world_size,
            export_timeout=self.export_timeout_s,
            request_timeout=self.request_timeout_s,
        )


@dataclass(frozen=True)
class CheckpointEngineSettings(TransportSettings):
    """``transport="checkpoint_engine"`` (``docs/transports.md``): ``bucket_bytes`` caps the
    update's buckets (None: checkpoint-engine's 8 GiB; an update holds about 3 caps of extra GPU
    memory); ``p2p`` turns P2P on (needs Mooncake, ``checkpoint-engine[p2p]``) over
    ``p2p_protocol`` ``"rdma"`` (needs ``rdma_devices``) or ``"tcp"`` (no RDMA devices;
    ``rdma_devices`` then only names the placeholder device). ``tcp_slice_bytes``: Mooncake's
    TCP slice for P2P over TCP (``MC_TCP_SLICE_SIZE``; default 16 MiB, measured on an H200:
    8 GB in 4.5 s against 33-34 s at Mooncake's 64 KiB while an engine serves; a value set in
    the environment always wins; None: Mooncake's 64 KiB). Falls back to ``nccl`` (one
    warning naming the reason) with vLLM engines, engines off the trainer's GPU or no CUDA.
    Timeouts: ``request_timeout_s``
    (each engine's ``/update_weights_from_ipc``), ``socket_timeout_s`` (the parameter server's
    ZMQ sockets, so a vanished engine fails the update instead of hanging it; None waits
    forever), ``transfer_timeout_s`` (Mooncake's per-batch ``MC_TRANSFER_TIMEOUT``; None: its
    30 s)."""

    transport: ClassVar[str] = "checkpoint_engine"
    fallback: ClassVar[str | None] = "nccl"
    bucket_bytes: int | None = None
    p2p: bool = False
    p2p_protocol: str = "rdma"
    rdma_devices: tuple[str, ...] | None = None
    request_timeout_s: float = 600.0
    socket_timeout_s: float | None = 300.0
    transfer_timeout_s: float | None = None
    #: ``MC_TCP_SLICE_SIZE`` for P2P over TCP (the transport's ``DEFAULT_TCP_SLICE_BYTES``)
    tcp_slice_bytes: int | None = 16 << 20

    def __post_init__(self) -> None:
        if self.bucket_bytes is not None:
            check_number(self.key("bucket_bytes"), self.bucket_bytes, integer=True)
        if self.tcp_slice_bytes is not None:
            check_number(self.key("tcp_slice_bytes"), self.tcp_slice_bytes, integer=True)
        if not isinstance(self.p2p, bool):
            raise FleetConfigError(self.key("p2p"), f"must be a bool, got {self.p2p!r}")
        if self.p2p_protocol not in CE_P2P_PROTOCOLS:
            raise FleetConfigError(
                self.key("p2p_protocol"),
                f"must be one of {CE_P2P_PROTOCOLS}, got {self.p2p_protocol!r}",
            )
        devices = self.rdma_devices
        if devices is not None:
            if (
                isinstance(devices, (str, bytes))
                or not isinstance(devices, Sequence)
                or not devices
                or not all(isinstance(d, str) and d for d in devices)
            ):
                raise FleetConfigError(
                    self.key("rdma_devices"),
                    f"must be a non-empty list of device names, got {devices!r}",
                )
            object.__setattr__(self, "rdma_devices", tuple(devices))
        if self.p2p and self.p2p_protocol == "rdma" and devices is None:
            raise FleetConfigError(
                self.key("rdma_devices"),
                "P2P over RDMA needs the RDMA device names (e.g. ['mlx5_0']); without RDMA "
                "devices use p2p_protocol='tcp'",
            )
        check_number(self.key("request_timeout_s"), self.request_timeout_s)
        for name in ("socket_timeout_s", "transfer_timeout_s"):
            if getattr(self, name) is not None:
                check_number(self.key(name), getattr(self, name))

    def fallback_reasons(self, context: TransportContext) -> list[str]:
        from rollsafe.transports.checkpoint_engine import fleet_fallback_reasons

        engine = context.engine
        if engine is None:  # no fleet's engines to judge: the reference engine's defaults
            return fleet_fallback_reasons()
        return fleet_fallback_reasons(
            kind=engine.kind, dialect=str(engine.dialect), device=engine.device
        )

    def build(self, context: TransportContext) -> WeightTransport:
        """The fleet's checkpoint-engine transport (its parameter server is this process)."""
        from rollsafe.transports.checkpoint_engine import (
            CheckpointEngineFleetTransport,
            ProcessGroupError,
        )

        ce = CheckpointEngineFleetTransport(
            context.world_size,
            max_bucket_bytes=self.bucket_bytes,
            p2p_protocol=self.p2p_protocol if self.p2p else None,
            rdma_devices=self.rdma_devices if self.p2p and self.rdma_devices else None,
            request_timeout_s=self.request_timeout_s,
            socket_timeout_s=self.socket_timeout_s,
            transfer_timeout_s=self.transfer_timeout_s,
            tcp_slice_bytes=self.tcp_slice_bytes,
        )
        if ce.world_size != 1:
            ce.close()
            raise ProcessGroupError(
                f"transport 'checkpoint_engine': the default process group has {ce.world_size} "
                "ranks; a RolloutFleet drives the parameter server from this one process, so "
                "the trainer's group must have one rank (with several trainer ranks, run "
                "CheckpointEngineTransport on every rank yourself)"
            )
        for i, (group_id, ranks) in enumerate(context.groups):
            if ranks > ce.world_size:
                ce.close()
                raise FleetConfigError(
                    f"groups[{i}].ranks",
                    f"group {group_id!r} has {ranks} engine ranks but checkpoint-engine "
                    f"feeds one engine rank per trainer GPU ({ce.world_size} here)",
                )
        if self.p2p and not ce.p2p_available:
            log.warning(
                "transport 'checkpoint_engine': P2P (%s) is unavailable (%s); a recovery's "
                "targeted push is refused and the restarted group waits for the next sync",
                self.p2p_protocol,
                ce.p2p_reason,
            )
        return ce


def with_overrides(settings: S, overrides: Mapping[str, Any]) -> S:
    """``settings`` with the given fields replaced (None values ignored), validated again."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if not given:
        return settings
    return dataclasses.replace(settings, **given)  # type: ignore[type-var]
