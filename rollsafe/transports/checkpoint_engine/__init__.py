"""The ``checkpoint_engine`` transport: MoonshotAI checkpoint-engine's ``ParameterServer``.

* :mod:`.transport`: :class:`CheckpointEngineTransport`, one per trainer rank (register pinned
  host shards, update engines by broadcast or P2P over RDMA or TCP);
* its plain-Python parts, one module per concern: :mod:`.sharding` (key and file shares, the HF
  index, key coverage), :mod:`.environment` (environment scoping, P2P variables),
  :mod:`.experts` (expert-parallel gather), :mod:`.agreement` (store address and rank status
  agreed over the trainer group), :mod:`.planning` (broadcast or P2P, results per target),
  :mod:`.availability` (package, accelerator, Mooncake) and :mod:`.errors`;
* :mod:`.fleet`: :class:`CheckpointEngineFleetTransport`, the transport a
  :class:`~rollsafe.fleet.RolloutFleet` builds for ``FleetConfig(transport="checkpoint_engine")``
  (fleet-rank targets, several groups per GPU, broadcast syncs, P2P targeted pushes) and
  :func:`fleet_fallback_reasons` (when a fleet must use ``nccl`` instead).

``checkpoint_engine`` itself is imported only when a transport is constructed.
"""

from rollsafe.transports.checkpoint_engine.agreement import (
    agree_store_address,
    gather_rank_status,
)
from rollsafe.transports.checkpoint_engine.availability import (
    INSTALL_HINT,
    checkpoint_engine_unavailable_reasons,
    mooncake_available,
)
from rollsafe.transports.checkpoint_engine.environment import (
    DEFAULT_TCP_SLICE_BYTES,
    TCP_PLACEHOLDER_DEVICE,
    TCP_SLICE_VARIABLE,
    P2PProtocol,
    p2p_environment,
    scoped_env,
)
from rollsafe.transports.checkpoint_engine.environment import (
    hidden_modules as hidden_modules,
)
from rollsafe.transports.checkpoint_engine.errors import (
    CheckpointEngineUnavailable,
    ExpertGatherError,
    KeyCoverageError,
    P2PUnavailable,
    ProcessGroupError,
)
from rollsafe.transports.checkpoint_engine.experts import (
    ExpertGather,
    expert_signatures,
    gather_expert_shards,
)
from rollsafe.transports.checkpoint_engine.fleet import (
    FALLBACK_TRANSPORT,
    CheckpointEngineFleetTransport,
    PushRecord,
    fleet_fallback_reasons,
    split_waves,
)
from rollsafe.transports.checkpoint_engine.planning import (
    LocalResults,
    UpdatePlan,
    merge_rank_results,
    plan_update,
    socket_paths_for,
)
from rollsafe.transports.checkpoint_engine.sharding import (
    KeyCoverage,
    assign_files,
    check_key_coverage,
    partition_keys,
    read_hf_index,
)
from rollsafe.transports.checkpoint_engine.transport import (
    DEFAULT_BUCKET,
    DEFAULT_MEM_FRACTION,
    CheckpointEngineTransport,
)

__all__ = [
    "DEFAULT_BUCKET",
    "DEFAULT_MEM_FRACTION",
    "DEFAULT_TCP_SLICE_BYTES",
    "FALLBACK_TRANSPORT",
    "INSTALL_HINT",
    "TCP_PLACEHOLDER_DEVICE",
    "TCP_SLICE_VARIABLE",
    "CheckpointEngineFleetTransport",
    "CheckpointEngineTransport",
    "CheckpointEngineUnavailable",
    "ExpertGather",
    "ExpertGatherError",
    "KeyCoverage",
    "KeyCoverageError",
    "LocalResults",
    "P2PProtocol",
    "P2PUnavailable",
    "ProcessGroupError",
    "PushRecord",
    "UpdatePlan",
    "agree_store_address",
    "assign_files",
    "check_key_coverage",
    "checkpoint_engine_unavailable_reasons",
    "expert_signatures",
    "fleet_fallback_reasons",
    "gather_expert_shards",
    "gather_rank_status",
    "merge_rank_results",
    "mooncake_available",
    "p2p_environment",
    "partition_keys",
    "plan_update",
    "read_hf_index",
    "scoped_env",
    "socket_paths_for",
    "split_waves",
]
