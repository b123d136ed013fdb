"""The contracts that cross layers: protocols and plain data types, nothing else.

Owns what the fleet, the transports and the engine adapters agree on, so that none of them has
to import another to name it:

* :class:`EngineClient` (with :class:`GenerateResult`, :class:`WeightsChecksum`,
  :data:`Dialect`, :data:`PauseMode`, :data:`MemoryTag`): what the fleet may ask of one engine;
  ``SGLangClient`` and ``VLLMClient`` (:mod:`rollsafe.adapters.engines`) implement it;
* :class:`WeightTransport` (with :class:`EngineTarget`, :class:`TargetResult`,
  :class:`UpdateReport`, :class:`PushSummary`, :data:`NamedTensors`): the two-phase
  transport contract every
  :mod:`rollsafe.transports` transport implements;
* :class:`RestartableEngine` (with :data:`StandbyState`, :data:`StartSource`): what recovery
  needs from one engine group's handle (``EngineLauncher`` has it), and
  :class:`LaunchableEngine`, that plus the first ``start()``: what a fleet's launcher factory
  returns (``EngineLauncher``; ``RayEngineGroup`` for ``FleetConfig(placement="ray")``).

Each protocol declares every capability the fleet uses (a targeted push, a restart from a
path with a weight version, a stop that keeps the warm standby, the standby's status): the
fleet calls them directly and never probes with ``getattr``/``hasattr`` (docs/architecture.md,
"Ports and their capabilities"; ``tests/test_ports_capabilities.py`` checks both).

Imports neither torch nor httpx (nor python-statemachine at run time): importing it is free.
This module is the one import path of these names (``tests/test_import_paths.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from rollsafe.digest_check import DigestCheck, compare_digests, compare_ranks
from rollsafe.errors import InvalidArgument
from rollsafe.wire.group_names import RENDEZVOUS_TORCH, RENDEZVOUS_VLLM

if TYPE_CHECKING:
    import torch

    from rollsafe.statemachines import CheckpointRegistration

__all__ = [
    "DeltaRecordLike",
    "DeltaState",
    "Dialect",
    "EngineClient",
    "EngineTarget",
    "GenerateResult",
    "LaunchableEngine",
    "MemoryTag",
    "NamedTensors",
    "PauseMode",
    "PlaceableEngine",
    "PushSummary",
    "RestartableEngine",
    "StandbyState",
    "StartSource",
    "TargetResult",
    "UpdateReport",
    "WeightTransport",
    "WeightsChecksum",
]

# ------------------------------------------------------------------------------ engine client
Dialect = Literal["sglang", "vllm"]
PauseMode = Literal["abort", "retract", "in_place"]
MemoryTag = Literal["weights", "kv_cache"]


@dataclass(frozen=True)
class GenerateResult:
    """One completion: decoded ``text``, generated ``output_ids`` and the serving weights;
    ``output_logprobs``: each generated token's log-probability as the engine reported it (None
    for a token it gave none for), when the request asked (``return_logprob``), else None."""

    text: str
    output_ids: list[int]
    weight_version: str | None = None
    finish_reason: str | None = None
    meta_info: Mapping[str, Any] = field(default_factory=dict)
    output_logprobs: tuple[float | None, ...] | None = None


@dataclass(frozen=True)
class WeightsChecksum:
    """What an engine's own weight checker reports about the weights it serves.

    ``tensors`` maps parameter names to digests (ranks that agree on a name are merged; a name
    whose digest differs between ranks, a TP shard, appears once per rank as ``"rank<i>:name"``);
    ``model`` is :func:`rollsafe.checksum.model_digest` of them (SGLang's ``per_gpu_checksum``
    when every rank reports the same one, else its ``per_engine_checksum``); ``algorithm`` names
    the digest algorithm (:mod:`rollsafe.checksum`) a trainer must use to compare; ``ranks`` holds
    each rank's own ``{name: digest}``; ``per_engine`` SGLang's ``per_engine_checksum``.

    ``weight_version`` is always ``None`` from SGLang's ``/weights_checker`` and vLLM's
    ``/weight_checker`` (neither reports it): read the version through the dialect's version
    path instead. The field stays for callers that build their own reports.
    """

    weight_version: str | None
    model: str | None
    tensors: Mapping[str, str]
    algorithm: str = "sglang"
    ranks: tuple[Mapping[str, str], ...] = ()
    per_engine: str | None = None

    def same_weights(self, other: WeightsChecksum) -> bool:
        """True when both report the same per-tensor digests (versions may differ).

        Engine against engine of the same kind only: two CPU vLLMs both report empty digests
        for their linear weights, so this can be True with those never compared. Against a
        trainer use :meth:`check`."""
        return dict(self.tensors) == dict(other.tensors)

    def check(self, expected: Mapping[str, str] | Sequence[Mapping[str, str]]) -> DigestCheck:
        """Per-tensor verdicts of these digests against ``expected`` (:mod:`rollsafe.digest_check`).

        ``expected``: one ``{name: digest}`` (compared with the rank-merged :attr:`tensors`) or
        one per TP rank (compared with :attr:`ranks`), in the engine's layout and algorithm:
        for vLLM :func:`rollsafe.engine_layout.vllm_rank_digests`, for SGLang
        :func:`rollsafe.fleet.weights_check.sglang_rank_digests` (both:
        :func:`rollsafe.fleet.weights_check.expected_digests`). The verdict is ``"equal"``
        only when every tensor was compared and equal; an empty-bytes digest from the engine
        (vLLM's CPU linear weights) is ``no_data`` and makes it ``"unverified"``.
        """
        if isinstance(expected, Mapping):
            return compare_digests(self.tensors, expected)
        if len(expected) == 1:
            return compare_digests(self.tensors, expected[0])
        return compare_ranks(self.ranks or (self.tensors,), expected)


@runtime_checkable
class EngineClient(Protocol):
    """A client for one engine (one worker group behind one HTTP endpoint)."""

    @property
    def url(self) -> str: ...

    @property
    def dialect(self) -> Dialect: ...

    # -- liveness and serving -------------------------------------------------------------
    def health(self, *, timeout: float | None = None, retry: bool = True) -> None:
        """Raise unless the engine answers its health endpoint with success.

        Retried (bounded) by default; ``retry=False`` sends exactly one request, which is what a
        health manager with its own failure threshold wants.
        """

    def is_healthy(self, *, timeout: float | None = None) -> bool:
        """``health()`` as a bool: False on any :class:`EngineError`."""

    def generate(
        self,
        input_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> GenerateResult:
        """Generate from token ids or text. Never retried."""

    def pause_generation(self, mode: PauseMode = "abort", *, timeout: float | None = None) -> None:
        """Stop scheduling: ``abort`` in-flight requests, ``retract`` them or keep ``in_place``."""

    def continue_generation(self, *, timeout: float | None = None) -> None:
        """Resume scheduling after :meth:`pause_generation`."""

    def flush_cache(self, *, timeout: float | None = None) -> None:
        """Drop the prefix/KV cache (stale after a weight change)."""

    # -- memory ---------------------------------------------------------------------------
    def release_memory_occupation(
        self, tags: Sequence[MemoryTag] | None = None, *, timeout: float | None = None
    ) -> None:
        """Offload weights and/or KV cache (all when ``tags`` is None)."""

    def resume_memory_occupation(
        self, tags: Sequence[MemoryTag] | None = None, *, timeout: float | None = None
    ) -> None:
        """Onload what :meth:`release_memory_occupation` released."""

    # -- weights --------------------------------------------------------------------------
    def update_weights_from_disk(
        self,
        model_path: str,
        *,
        load_format: str | None = None,
        weight_version: str | None = None,
        abort_all_requests: bool = False,
        timeout: float | None = None,
    ) -> str:
        """Load weights from an HF directory; return the engine's message."""

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
        timeout: float | None = None,
        finite_checked: bool = False,
    ) -> str:
        """Load weights handed over in-process (one serialized payload per TP rank)."""

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        timeout: float | None = None,
    ) -> str:
        """Join a torch.distributed group with the trainer (blocks until all ranks joined)."""

    def destroy_weights_update_group(
        self, group_name: str = "weight_update_group", *, timeout: float | None = None
    ) -> str:
        """Leave the group created by :meth:`init_weights_update_group`."""

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = "weight_update_group",
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
        timeout: float | None = None,
    ) -> str:
        """Receive a broadcast of the named tensors; blocks while the trainer sends."""

    def update_weights_from_ipc(
        self,
        zmq_handles: Mapping[str, str],
        *,
        flush_cache: bool = True,
        weight_version: str | None = None,
        timeout: float | None = None,
    ) -> str:
        """checkpoint-engine's path: load weights announced on per-device ZMQ sockets."""

    def weights_checksum(self, *, timeout: float | None = None) -> WeightsChecksum:
        """Per-tensor digests of the served weights (retried)."""

    def weight_version(self, *, timeout: float | None = None) -> str | None:
        """The weights version the engine names (retried; None: it names none): a spare's
        last check before its promotion."""

    # -- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        """Close the HTTP connection pool (the engine keeps running)."""

    def shutdown(self) -> None:
        """Stop using this engine from this client: closes it for good.

        Neither SGLang nor vLLM serves a shutdown endpoint, so the processes are stopped by
        whoever owns them (:meth:`EngineLauncher.stop`, the Ray ``EngineActor``'s ``stop``).
        """


# ------------------------------------------------------------------------------ weight transport
NamedTensors = Mapping[str, "torch.Tensor"] | Iterable[tuple[str, "torch.Tensor"]]


@dataclass(frozen=True)
class EngineTarget:
    """One engine group a transport pushes to.

    ``ranks`` are the group's ranks in the transport's target rank space (the fleet's global
    engine-rank numbering; for checkpoint-engine, the parameter-server ranks), used for the
    registration guard; ``client`` talks to the group's rank-0 HTTP server; ``tp_size`` is the
    number of engine processes (one serialized entry each for ``/update_weights_from_tensor``);
    ``applies_deltas``: the engine kind applies rollsafe's delta payloads
    (:attr:`rollsafe.policy.EngineTraits.applies_deltas`; a transport with deltas on sends the
    others full pushes); ``delta_base_by_content``: it checks a delta's base by content, not by
    version label (:attr:`rollsafe.policy.EngineTraits.delta_base_by_content`, rollsafe's vLLM
    CPU plugin): the sender writes the base digests into that delta's header and asks the
    engine, when it joins, to keep its base. ``rendezvous``: how the engine's ranks join an
    ``nccl`` weight-update group (:attr:`rollsafe.policy.EngineTraits.rendezvous`): ``"torch"``
    (rollsafe's group) or ``"vllm"`` (a real vLLM's ``nccl`` backend: the trainer joins with
    vLLM's ``StatelessProcessGroup`` + PyNccl, :mod:`rollsafe.wire.vllm_group`).
    """

    name: str
    ranks: tuple[int, ...]
    client: EngineClient
    tp_size: int = 1
    applies_deltas: bool = False
    delta_base_by_content: bool = False
    rendezvous: str = RENDEZVOUS_TORCH

    def __post_init__(self) -> None:
        if not self.ranks:
            raise InvalidArgument("ranks", f"EngineTarget {self.name!r} has no ranks")
        if self.tp_size < 1:
            raise InvalidArgument("tp_size", f"EngineTarget {self.name!r}: tp_size must be >= 1")
        if self.rendezvous not in (RENDEZVOUS_TORCH, RENDEZVOUS_VLLM):
            raise InvalidArgument(
                "rendezvous",
                f"EngineTarget {self.name!r}: rendezvous must be {RENDEZVOUS_TORCH!r} or "
                f"{RENDEZVOUS_VLLM!r}, got {self.rendezvous!r}",
            )


@dataclass(frozen=True)
class TargetResult:
    """Outcome of pushing one version to one target."""

    target: str
    ok: bool
    reason: str = ""
    seconds: float = 0.0
    nbytes: int = 0


@dataclass
class UpdateReport:
    """Per-target outcomes of one ``update``."""

    name: str
    version: int
    results: dict[str, TargetResult] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.results) and all(r.ok for r in self.results.values())

    @property
    def failed(self) -> list[str]:
        return sorted(name for name, r in self.results.items() if not r.ok)

    @property
    def succeeded(self) -> list[str]:
        return sorted(name for name, r in self.results.items() if r.ok)


class PushSummary(Protocol):
    """What a transport recorded about its last push (``WeightTransport.last_push``).

    ``mode``: how it moved the weights (checkpoint-engine: ``broadcast`` or ``p2p``);
    ``ps_ranks``: the transport's own ranks it pushed to (None: all of them); ``targets``: the
    names of the targets that push served. ``CheckpointEngineFleetTransport``'s ``PushRecord``
    has these fields (and more).
    """

    @property
    def mode(self) -> str: ...

    @property
    def ps_ranks(self) -> tuple[int, ...] | None: ...

    @property
    def targets(self) -> tuple[str, ...]: ...


class DeltaRecordLike(Protocol):
    """What one update's deltas were (``rollsafe.transports.delta.DeltaRecord``): the
    ``version`` pushed, a one-line ``summary()`` and a JSON-friendly ``as_dict()``."""

    @property
    def version(self) -> int: ...

    def summary(self) -> str: ...

    def as_dict(self) -> dict[str, Any]: ...


class DeltaState(Protocol):
    """A transport's delta sync, as the fleet reads it (``WeightTransport.deltas``):
    ``stats()`` for the snapshot (bases per target, snapshots held, the last sync's bytes) and
    ``last()``, the last update's :class:`DeltaRecordLike` (None before one)."""

    def stats(self) -> Mapping[str, object]: ...

    def last(self) -> DeltaRecordLike | None: ...


@runtime_checkable
class WeightTransport(Protocol):
    """What the fleet needs from any transport: every member below is declared by every
    :mod:`rollsafe.transports` transport (``StagedTransport`` gives the defaults).

    ``name`` appears in logs and recovery steps; ``registration`` is the registration machine
    the fleet reads the published version from (and its ``state`` for ``rollsafe verify``'s
    final picture); ``deltas`` is the transport's delta sync (None: it pushes whole versions
    only), and ``forget(target)`` drops what it keeps for a target that left service.
    """

    name: str
    registration: CheckpointRegistration

    @property
    def deltas(self) -> DeltaState | None:
        """The transport's delta sync (``docs/transports.md``, "Deltas"); None when its deltas
        are off or it has none."""
        ...

    def forget(self, target_name: str) -> None:
        """``target_name`` left service (failed, restarted, removed): what the transport keeps
        for it (its delta base, a kept weight-update group) is dropped; its next push is full.
        A transport that keeps nothing per target does nothing."""
        ...

    def register(self, weights: NamedTensors, version: int) -> None:
        """Stage ``weights`` as ``version``; raise :class:`RegisterError` (nothing published)."""
        ...

    def update(self, targets: Sequence[EngineTarget]) -> UpdateReport:
        """Push the registered version; one target failing is reported, not raised."""
        ...

    def targeted_update(self, targets: Sequence[EngineTarget]) -> UpdateReport:
        """A recovery's push: the registered version to ``targets`` only, leaving every other
        engine untouched (``update`` may choose a collective that reaches all of them).

        A transport that cannot reach a subset raises a ``TransportError`` (for example
        checkpoint-engine's ``P2PUnavailable``) before anything moves; recovery then defers
        the group to the next sync. Transports that push to each target on its own
        (``StagedTransport``: nccl, ipc, disk) run their ordinary ``update``.
        """
        ...

    def last_push(self) -> PushSummary | None:
        """The transport's record of its last push (its mode and ranks), None when it keeps
        none (``StagedTransport``) or has not pushed yet."""
        ...

    def close(self) -> None:
        """Release staged memory, process groups and sockets."""
        ...


# ------------------------------------------------------------------------------ recovery
#: A warm standby's state (``EngineLauncher.standby_state``): ``none``, ``warming`` (importing)
#: or ``ready``.
StandbyState = Literal["none", "warming", "ready"]
#: Where a start's engine came from (``EngineLauncher.last_start_source``): a warm standby that
#: was ``ready``, one still importing that was ready before any fresh spawn, or a fresh spawn.
StartSource = Literal["ready_standby", "warming_standby", "fresh_spawn"]


@runtime_checkable
class RestartableEngine(Protocol):
    """What recovery needs from one engine group's handle; ``EngineLauncher`` implements it.

    Every member is declared by every handle (recovery calls them all, with keywords):

    * ``stop(timeout=, keep_standby=True)``: the attempt's explicit shutdown step; a warm
      standby must survive it to take the restart that follows;
    * ``restart(model_path=, load_format=, skip_load_weights=, weight_version=, stop_timeout=)``
      stops the group if it runs and starts it again, returning once it is ready:
      ``model_path`` the directory to load (a recovery export), ``skip_load_weights=True`` dummy
      weights (a targeted push follows), ``weight_version`` what the restarted engine reports
      until its next update, ``stop_timeout`` the grace before SIGKILL of what still runs;
    * ``client``: the (possibly new) client of the restarted group;
    * ``standby_state`` / ``last_start_source``: the warm standby's state before a restart and
      where the last start came from, recorded in the recovery's result (None: the handle has
      no warm standby / does not tell);
    * ``standby_status()``: a JSON-friendly view of the warm standby (at least ``state``) for
      the registry's snapshot and metrics; it must not block.
    """

    def restart(
        self,
        *,
        model_path: str | None = None,
        load_format: str | None = None,
        skip_load_weights: bool | None = None,
        weight_version: str | None = None,
        stop_timeout: float = 10.0,
    ) -> object: ...

    def stop(self, *, timeout: float = 10.0, keep_standby: bool = False) -> None: ...

    @property
    def client(self) -> EngineClient: ...

    @property
    def standby_state(self) -> StandbyState | None: ...

    @property
    def last_start_source(self) -> StartSource | None: ...

    def standby_status(self) -> Mapping[str, Any]: ...


@runtime_checkable
class LaunchableEngine(RestartableEngine, Protocol):
    """A :class:`RestartableEngine` the fleet also starts: what ``FleetConfig.launcher_factory``
    returns for each group. ``start()`` returns once the group is ready (its ``client``
    answers); ``EngineLauncher`` (processes on this machine) and
    ``rollsafe.adapters.ray.RayEngineGroup`` (processes in a Ray actor on the node Ray placed
    the group on) implement it."""

    def start(self) -> object: ...


@runtime_checkable
class PlaceableEngine(Protocol):
    """An engine group placed on a node by a scheduler (``RayEngineGroup``): what the node-loss
    and removal operations (``rollsafe.operations.place``) need beyond a restart. ``node_id``
    is the node it holds a placement on (None: none; a group that spans nodes: its head
    slice's); ``node_ids`` every node it holds a slice on, head first (empty: none; a node
    lost under any of them takes the whole group out); ``place_again()`` gives the placement
    back and reserves a new one, returning the new node's id (raises
    ``PlacementUnavailable`` when no node has room); ``release_placement()`` ends the group's
    actor and gives its placement back (its engine is stopped); ``placement_alive(timeout_s=)``
    asks the group's actor (False: it is gone, or did not answer in time: its node is lost)."""

    @property
    def node_id(self) -> str | None: ...

    @property
    def node_ids(self) -> tuple[str, ...]: ...

    def place_again(self) -> str: ...

    def release_placement(self) -> None: ...

    def placement_alive(self, *, timeout_s: float) -> bool: ...
