"""Engine clients (SGLang and vLLM dialects over HTTP) and the engine-group launcher.

``SGLangClient`` / ``VLLMClient`` implement the :class:`EngineClient` protocol; the
:class:`EngineLauncher` runs one engine group as OS processes described by an
:class:`EngineSpec`. Errors derive from :class:`EngineError`. Needs the ``engine`` extra (httpx);
nothing here imports Ray.
"""

from rollsafe.adapters.engines.client import (
    Dialect,
    EngineClient,
    GenerateResult,
    MemoryTag,
    PauseMode,
    WeightsChecksum,
)
from rollsafe.adapters.engines.errors import (
    MAX_MESSAGE_CHARS,
    EngineError,
    EngineNotSupported,
    EngineOperationFailed,
    EngineRequestError,
    EngineStartError,
    EngineTimeout,
    EngineUnavailable,
    bound_text,
)
from rollsafe.adapters.engines.http import NO_RETRY, HttpTransport, RetryPolicy
from rollsafe.adapters.engines.launcher import (
    ENGINE_KINDS,
    READY_PREFIX,
    EngineKind,
    EngineLauncher,
    EngineSpec,
    EngineStartTimeout,
    pid_alive,
)
from rollsafe.adapters.engines.sglang import SGLangClient
from rollsafe.adapters.engines.vllm import VLLMClient

__all__ = [
    "ENGINE_KINDS",
    "MAX_MESSAGE_CHARS",
    "NO_RETRY",
    "READY_PREFIX",
    "Dialect",
    "EngineClient",
    "EngineError",
    "EngineKind",
    "EngineLauncher",
    "EngineNotSupported",
    "EngineOperationFailed",
    "EngineRequestError",
    "EngineSpec",
    "EngineStartError",
    "EngineStartTimeout",
    "EngineTimeout",
    "EngineUnavailable",
    "GenerateResult",
    "HttpTransport",
    "MemoryTag",
    "PauseMode",
    "RetryPolicy",
    "SGLangClient",
    "VLLMClient",
    "WeightsChecksum",
    "bound_text",
    "make_client",
    "pid_alive",
]


def make_client(
    dialect: Dialect, url: str, *, api_key: str | None = None, timeout: float = 60.0
) -> SGLangClient | VLLMClient:
    """Build the client for ``dialect`` (``"sglang"`` or ``"vllm"``)."""
    if dialect == "sglang":
        return SGLangClient(url, api_key=api_key, timeout=timeout)
    if dialect == "vllm":
        return VLLMClient(url, api_key=api_key, timeout=timeout)
    raise ValueError(f"unknown engine dialect {dialect!r}; expected 'sglang' or 'vllm'")
