"""The fleet components' settings: the one place their defaults live, validated on construction.

Owns :class:`HealthSettings` (the :class:`~rollsafe.fleet.HealthManager`'s probing) and
:class:`RecoverySettings` (the :class:`~rollsafe.fleet.RecoveryCoordinator`'s pool, deadlines and
retries, plus the fleet-level restart budget and targeted-push switch). Each component takes its
settings object; its public keyword arguments (``interval_s=``, ``recovery_timeout_s=``...)
still work and override the object's fields. A bad value raises :class:`FleetConfigError` naming
the field (``health.interval_s``) when the settings object is built, before anything starts.

Each fleet transport has one typed, frozen settings class here (:class:`IpcSettings`,
:class:`NcclSettings`, :class:`CheckpointEngineSettings`), registered by its ``transport`` name
in :data:`TRANSPORT_SETTINGS` and held by the :class:`~rollsafe.fleet.FleetConfig` field of the
same name (``FleetConfig(nccl=NcclSettings(backend="nccl"))``). Their errors name the old flat
``FleetConfig`` keyword (``nccl_backend``, ``ce_p2p``...), which still works: ``FleetConfig``
folds it into the settings object (``field_prefix`` + field name).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from rollsafe.fleet.registry import FleetError

__all__ = [
    "CE_P2P_PROTOCOLS",
    "TRANSPORT_SETTINGS",
    "CheckpointEngineSettings",
    "FleetConfigError",
    "HealthSettings",
    "IpcSettings",
    "NcclSettings",
    "RecoverySettings",
    "TransportSettings",
    "with_overrides",
]

S = TypeVar("S")


class FleetConfigError(FleetError, ValueError):
    """A fleet setting is malformed; ``key`` names it (e.g. ``groups[1].ranks``)."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"fleet config {key!r}: {message}")


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
    group. ``max_workers`` is validated but caps nothing: each sync probe runs on a daemon
    thread of its own and a group whose probe hangs is not probed again, so at most one probe
    thread per group is alive."""

    interval_s: float = 0.5
    timeout_s: float = 2.0
    failure_threshold: int = 2
    max_workers: int = 64

    def __post_init__(self) -> None:
        check_number("health.interval_s", self.interval_s, alias="interval_s=")
        check_number("health.timeout_s", self.timeout_s, alias="timeout_s=")
        check_number(
            "health.failure_threshold",
            self.failure_threshold,
            integer=True,
            alias="failure_threshold=",
        )
        check_number("health.max_workers", self.max_workers, integer=True, alias="max_workers=")


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
        check_number("recovery.max_workers", self.max_workers, integer=True,
                      alias="max_workers=")  # fmt: skip
        check_number("recovery.timeout_s", self.timeout_s, alias="recovery_timeout_s=")
        check_number("recovery.restart_budget", self.restart_budget, integer=True, zero=True)
        check_number("recovery.expected_recovery_s", self.expected_recovery_s, zero=True,
                     alias="expected_recovery_s=")  # fmt: skip
        check_number("recovery.retry_delay_s", self.retry_delay_s, zero=True,
                     alias="retry_delay_s=")  # fmt: skip
        check_number("recovery.health_timeout_s", self.health_timeout_s,
                     alias="health_timeout_s=")  # fmt: skip
        check_number("recovery.stop_timeout_s", self.stop_timeout_s, zero=True,
                     alias="stop_timeout_s=")  # fmt: skip
        for name in ("targeted_push", "retry"):
            if not isinstance(getattr(self, name), bool):
                raise FleetConfigError(f"recovery.{name}", f"must be a bool, got "
                                       f"{getattr(self, name)!r}")  # fmt: skip
        if self.remaining_work_s is not None and not callable(self.remaining_work_s):
            raise FleetConfigError(
                "recovery.remaining_work_s",
                f"must be a callable or None, got {self.remaining_work_s!r}",
            )


#: transport name -> its settings class (filled by :class:`TransportSettings` subclasses); the
#: fleet builds one of these transports by name (``FleetConfig.transport``).
TRANSPORT_SETTINGS: dict[str, type[TransportSettings]] = {}
#: The values of :attr:`CheckpointEngineSettings.p2p_protocol`.
CE_P2P_PROTOCOLS = ("rdma", "tcp")


@dataclass(frozen=True)
class TransportSettings:
    """Base of one fleet transport's settings: a subclass names its ``transport`` and the
    ``field_prefix`` of its flat ``FleetConfig`` keywords, validates in ``__post_init__`` and is
    registered in :data:`TRANSPORT_SETTINGS`. Adding a fleet transport: one such class, a
    ``FleetConfig`` field named after its ``transport`` (the settings object users pass) and
    its builder in ``rollsafe.fleet.fleet._TRANSPORT_BUILDERS`` (a test checks the three
    agree)."""

    transport: ClassVar[str] = ""
    field_prefix: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.transport:
            TRANSPORT_SETTINGS[cls.transport] = cls

    def key(self, name: str) -> str:
        """The flat ``FleetConfig`` key of field ``name`` (what errors name)."""
        return self.field_prefix + name


@dataclass(frozen=True)
class IpcSettings(TransportSettings):
    """``transport="ipc"`` (CUDA IPC / shared-memory handles to colocated engines): nothing to
    set."""

    transport: ClassVar[str] = "ipc"


@dataclass(frozen=True)
class NcclSettings(TransportSettings):
    """``transport="nccl"`` (also the fallback of ``checkpoint_engine``): ``backend`` ``"gloo"``
    (the default: moves host memory, works with engines anywhere), ``"nccl"`` (trainer weights
    and engines on GPUs) or None (picks by the weights' device); ``bucket_bytes`` (None:
    :data:`~rollsafe.transports.DEFAULT_NCCL_BUCKET_BYTES`); ``group_timeout_s`` bounds the
    process-group setup and each collective. Flat keys: ``nccl_backend``, ``nccl_bucket_bytes``,
    ``nccl_group_timeout_s``."""

    transport: ClassVar[str] = "nccl"
    field_prefix: ClassVar[str] = "nccl_"
    backend: str | None = "gloo"
    bucket_bytes: int | None = None
    group_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl", None):
            raise FleetConfigError(
                self.key("backend"), f"must be 'gloo', 'nccl' or None, got {self.backend!r}"
            )
        if self.bucket_bytes is not None:
            check_number(self.key("bucket_bytes"), self.bucket_bytes, integer=True)
        check_number(self.key("group_timeout_s"), self.group_timeout_s)


@dataclass(frozen=True)
class CheckpointEngineSettings(TransportSettings):
    """``transport="checkpoint_engine"`` (``docs/transports.md``): ``bucket_bytes`` caps the
    update's buckets (None: checkpoint-engine's 8 GiB; an update holds about 3 caps of extra GPU
    memory); ``p2p`` turns P2P on (needs Mooncake, ``checkpoint-engine[p2p]``) over
    ``p2p_protocol`` ``"rdma"`` (needs ``rdma_devices``) or ``"tcp"`` (no RDMA devices;
    ``rdma_devices`` then only names the placeholder device). Timeouts: ``request_timeout_s``
    (each engine's ``/update_weights_from_ipc``), ``socket_timeout_s`` (the parameter server's
    ZMQ sockets, so a vanished engine fails the update instead of hanging it; None waits
    forever), ``transfer_timeout_s`` (Mooncake's per-batch ``MC_TRANSFER_TIMEOUT``; None: its
    30 s). Flat keys: ``ce_`` + the field name."""

    transport: ClassVar[str] = "checkpoint_engine"
    field_prefix: ClassVar[str] = "ce_"
    bucket_bytes: int | None = None
    p2p: bool = False
    p2p_protocol: str = "rdma"
    rdma_devices: tuple[str, ...] | None = None
    request_timeout_s: float = 600.0
    socket_timeout_s: float | None = 300.0
    transfer_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.bucket_bytes is not None:
            check_number(self.key("bucket_bytes"), self.bucket_bytes, integer=True)
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
                "devices use ce_p2p_protocol='tcp'",
            )
        check_number(self.key("request_timeout_s"), self.request_timeout_s)
        for name in ("socket_timeout_s", "transfer_timeout_s"):
            if getattr(self, name) is not None:
                check_number(self.key(name), getattr(self, name))


def with_overrides(settings: S, overrides: Mapping[str, Any]) -> S:
    """``settings`` with the given fields replaced (None values ignored), validated again."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if not given:
        return settings
    return dataclasses.replace(settings, **given)  # type: ignore[type-var]
