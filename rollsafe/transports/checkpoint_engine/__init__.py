"""The ``checkpoint_engine`` transport: MoonshotAI checkpoint-engine's ``ParameterServer``.

* :mod:`.transport`: :class:`CheckpointEngineTransport`, one per trainer rank (register pinned
  host shards, update engines by broadcast or P2P over RDMA or TCP), and its plain-Python parts
  (key sharding, HF index reading, key coverage, update planning, environment scoping);
* :mod:`.fleet`: :class:`CheckpointEngineFleetTransport`, the transport a
  :class:`~rollsafe.fleet.RolloutFleet` builds for ``FleetConfig(transport="checkpoint_engine")``
  (fleet-rank targets, several groups per GPU, broadcast syncs, P2P targeted pushes) and
  :func:`fleet_fallback_reasons` (when a fleet must use ``nccl`` instead).

``checkpoint_engine`` itself is imported only when a transport is constructed.
"""

from rollsafe.transports.checkpoint_engine.fleet import (
    FALLBACK_TRANSPORT,
    CheckpointEngineFleetTransport,
    PushRecord,
    fleet_fallback_reasons,
    split_waves,
)
from rollsafe.transports.checkpoint_engine.transport import (
    DEFAULT_BUCKET,
    DEFAULT_MEM_FRACTION,
    INSTALL_HINT,
    TCP_PLACEHOLDER_DEVICE,
    CheckpointEngineTransport,
    CheckpointEngineUnavailable,
    ExpertGather,
    ExpertGatherError,
    KeyCoverage,
    KeyCoverageError,
    LocalResults,
    P2PProtocol,
    P2PUnavailable,
    ProcessGroupError,
    UpdatePlan,
    agree_store_address,
    assign_files,
    check_key_coverage,
    checkpoint_engine_unavailable_reasons,
    expert_signatures,
    gather_expert_shards,
    gather_rank_status,
    merge_rank_results,
    mooncake_available,
    p2p_environment,
    partition_keys,
    plan_update,
    read_hf_index,
    scoped_env,
    socket_paths_for,
)
from rollsafe.transports.checkpoint_engine.transport import (
    _hidden_modules as _hidden_modules,
)
from rollsafe.wire.hf_index import INDEX_FILE, SINGLE_FILE, HFIndex

__all__ = [
    "DEFAULT_BUCKET",
    "DEFAULT_MEM_FRACTION",
    "FALLBACK_TRANSPORT",
    "INDEX_FILE",
    "INSTALL_HINT",
    "SINGLE_FILE",
    "TCP_PLACEHOLDER_DEVICE",
    "CheckpointEngineFleetTransport",
    "CheckpointEngineTransport",
    "CheckpointEngineUnavailable",
    "ExpertGather",
    "ExpertGatherError",
    "HFIndex",
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
