"""Weight transports: move a trainer's weights into engines (ipc, nccl, checkpoint_engine, disk).

Every transport is two-phase (``register(weights, version)`` then ``update(targets)`` returning a
per-target :class:`rollsafe.ports.UpdateReport`; the contract is
:class:`rollsafe.ports.WeightTransport`) and drives a
:class:`~rollsafe.statemachines.CheckpointRegistration` through :class:`StagedTransport`:

* :class:`IPCTransport` -- colocated engines; shared memory on CPU, CUDA IPC handles on GPU
  (``/update_weights_from_tensor``, flattened buckets, double-buffered);
* :class:`NCCLTransport` -- disaggregated engines; one broadcast group per target per update
  (``/init_weights_update_group`` + ``/update_weights_from_distributed``; nccl on GPU, gloo on
  CPU), so a dead engine fails only its own target and a subset re-sync touches nobody else;
* :class:`CheckpointEngineTransport` -- MoonshotAI checkpoint-engine's ``ParameterServer``
  (broadcast, or P2P over RDMA or TCP to a subset); :class:`CheckpointEngineFleetTransport` is
  what a fleet builds from it (broadcast syncs, P2P targeted pushes of a recovery);
* :class:`DiskTransport` -- engines load a verified HF export (``/update_weights_from_disk``)
  while the transport holds a lease on it.

``ipc`` and ``nccl`` push deltas when built with ``delta=DeltaSettings()``
(:mod:`rollsafe.transports.delta`): only the elements that changed since each target's
confirmed base version.

Importing this package is light: every name below is imported on first use (PEP 562), so
code that only decodes a bucket (:mod:`rollsafe.wire`) never loads the transports. The
transports themselves import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollsafe.lazy import lazy_attributes

if TYPE_CHECKING:
    from rollsafe.transports.base import (
        NonFiniteWeights,
        RegisterError,
        StagedTransport,
        StaleRegistration,
        TransportError,
        named_tensor_list,
    )
    from rollsafe.transports.checkpoint_engine import (
        CheckpointEngineFleetTransport,
        CheckpointEngineTransport,
        P2PUnavailable,
    )
    from rollsafe.transports.delta import DeltaRecord, DeltaSettings, TargetSync
    from rollsafe.transports.disk import DiskTransport
    from rollsafe.transports.ipc import DEFAULT_IPC_BUCKET_BYTES, IPCTransport
    from rollsafe.transports.nccl import DEFAULT_NCCL_BUCKET_BYTES, NCCLTransport
    from rollsafe.transports.pipeline import BucketPlan, BucketStream, plan_buckets

#: public name -> module that defines it (imported on first attribute access)
_LAZY: dict[str, str] = {
    **dict.fromkeys(
        (
            "NonFiniteWeights",
            "RegisterError",
            "StagedTransport",
            "StaleRegistration",
            "TransportError",
            "named_tensor_list",
        ),
        "rollsafe.transports.base",
    ),
    **dict.fromkeys(
        ("CheckpointEngineFleetTransport", "CheckpointEngineTransport", "P2PUnavailable"),
        "rollsafe.transports.checkpoint_engine",
    ),
    **dict.fromkeys(("DeltaRecord", "DeltaSettings", "TargetSync"), "rollsafe.transports.delta"),
    "DiskTransport": "rollsafe.transports.disk",
    "DEFAULT_IPC_BUCKET_BYTES": "rollsafe.transports.ipc",
    "IPCTransport": "rollsafe.transports.ipc",
    "DEFAULT_NCCL_BUCKET_BYTES": "rollsafe.transports.nccl",
    "NCCLTransport": "rollsafe.transports.nccl",
    **dict.fromkeys(("BucketPlan", "BucketStream", "plan_buckets"), "rollsafe.transports.pipeline"),
}


__all__ = [
    "DEFAULT_IPC_BUCKET_BYTES",
    "DEFAULT_NCCL_BUCKET_BYTES",
    "BucketPlan",
    "BucketStream",
    "CheckpointEngineFleetTransport",
    "CheckpointEngineTransport",
    "DeltaRecord",
    "DeltaSettings",
    "DiskTransport",
    "IPCTransport",
    "NCCLTransport",
    "NonFiniteWeights",
    "P2PUnavailable",
    "RegisterError",
    "StagedTransport",
    "StaleRegistration",
    "TargetSync",
    "TransportError",
    "named_tensor_list",
    "plan_buckets",
]

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, public=__all__)
