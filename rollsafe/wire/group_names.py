"""Which name the two ends of a weight-update group join it under, one definition for both ends.

rollsafe's groups (:mod:`rollsafe.wire.group`) rendezvous over a ``TCPStore`` whose keys are
prefixed with the group's name (a ``PrefixStore``): two processes meet only if they join under
the same name. SGLang's ``/init_weights_update_group`` carries the name (``group_name``; SGLang's
``init_custom_process_group`` prefixes the store with it the same way), so any name works there.

vLLM 0.33.0 has one weight-transfer group per engine and names it nowhere: ``init_info`` has no
name field, and its ``StatelessProcessGroup`` rendezvous keys carry no prefix. A name the
trainer picks cannot reach the engine, so both ends of a vLLM-dialect group use the fixed
:data:`VLLM_WEIGHT_TRANSFER_GROUP` (the reference engine joins under it; the ``nccl``
transport's trainer side joins under it; ``VLLMClient`` refuses any other). A trainer that
joined under a name of its own would wait in the rendezvous until its timeout while the
engine waits under this one.

How the engine's ranks join at all is named here too (:data:`RENDEZVOUS_TORCH`,
:data:`RENDEZVOUS_VLLM`; an engine kind's trait, :attr:`rollsafe.policy.EngineTraits.rendezvous`):
a real vLLM's ``nccl`` backend joins with vLLM's ``StatelessProcessGroup`` + PyNccl, which
knows no group name and no ``torch.distributed`` group (:mod:`rollsafe.wire.vllm_group`).
Imports nothing.
"""

from __future__ import annotations

__all__ = ["RENDEZVOUS_TORCH", "RENDEZVOUS_VLLM", "VLLM_WEIGHT_TRANSFER_GROUP", "join_name"]

#: the engine's ranks join rollsafe's ``torch.distributed`` group over a ``TCPStore`` prefixed
#: with the group's name (SGLang, the reference engine, rollsafe's ``rollsafe_gloo`` vLLM
#: plugin; :mod:`rollsafe.wire.group`)
RENDEZVOUS_TORCH = "torch"
#: the engine's ranks join as a real vLLM's ``nccl`` backend does: vLLM's
#: ``StatelessProcessGroup`` (no prefix) + ``PyNcclCommunicator`` (:mod:`rollsafe.wire.vllm_group`)
RENDEZVOUS_VLLM = "vllm"

#: The name both ends of a vLLM-dialect weight-transfer group join under.
VLLM_WEIGHT_TRANSFER_GROUP = "vllm_weight_transfer"


def join_name(dialect: str, requested: str) -> str:
    """The name to join a group of a ``dialect`` engine under: ``requested`` where the engine
    takes the name from the request (SGLang), the fixed name where it cannot (vLLM)."""
    return VLLM_WEIGHT_TRANSFER_GROUP if dialect == "vllm" else requested
