"""The ``EngineClient`` protocol (defined in :mod:`rollsafe.ports`) and its error contract.

The method names follow SGLang's HTTP API (``docs/design.md``, "Engine facts");
:class:`~.vllm.VLLMClient` maps the same calls onto vLLM's endpoints. Every call raises a
subclass of
:class:`~rollsafe.adapters.engines.errors.EngineError` on failure:

* :class:`EngineUnavailable` / :class:`EngineTimeout`: the engine could not be reached in time;
* :class:`EngineRequestError`: it answered an HTTP error (``status_code``, bounded ``message``);
* :class:`EngineOperationFailed`: it answered ``{"success": false}`` to a weight/memory call;
* :class:`EngineNotSupported`: the dialect has no such operation.

Idempotent reads (health, checksum, get-by-name) are retried; generate and every
state-changing call are sent once, and resent only when the request provably never reached the
engine (no connection could be opened).
"""

from __future__ import annotations

from rollsafe.adapters.engines.errors import (
    EngineError,
    EngineNotSupported,
    EngineOperationFailed,
    EngineRequestError,
    EngineStartError,
    EngineTimeout,
    EngineUnavailable,
)

# the protocol crosses layers (the fleet holds clients, transports call them): it lives in the
# torch- and httpx-free rollsafe.ports; every name stays importable from here
from rollsafe.ports import (
    Dialect,
    EngineClient,
    GenerateResult,
    MemoryTag,
    PauseMode,
    WeightsChecksum,
)

__all__ = [
    "Dialect",
    "EngineClient",
    "EngineError",
    "EngineNotSupported",
    "EngineOperationFailed",
    "EngineRequestError",
    "EngineStartError",
    "EngineTimeout",
    "EngineUnavailable",
    "GenerateResult",
    "MemoryTag",
    "PauseMode",
    "WeightsChecksum",
]
