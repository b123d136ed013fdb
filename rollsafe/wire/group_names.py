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
engine waits under this one. Imports nothing.
"""

from __future__ import annotations

__all__ = ["VLLM_WEIGHT_TRANSFER_GROUP", "join_name"]

#: The name both ends of a vLLM-dialect weight-transfer group join under.
VLLM_WEIGHT_TRANSFER_GROUP = "vllm_weight_transfer"


def join_name(dialect: str, requested: str) -> str:
    """The name to join a group of a ``dialect`` engine under: ``requested`` where the engine
    takes the name from the request (SGLang), the fixed name where it cannot (vLLM)."""
    return VLLM_WEIGHT_TRANSFER_GROUP if dialect == "vllm" else requested
