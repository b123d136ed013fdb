"""Engine clients (SGLang and vLLM dialects over HTTP) and the engine-group launcher.

``SGLangClient`` / ``VLLMClient`` implement the :class:`EngineClient` protocol; the
:class:`EngineLauncher` runs one engine group as OS processes described by an
:class:`EngineSpec`. Errors derive from :class:`EngineError`. Needs the ``engine`` extra (httpx);
nothing here imports Ray. The protocol and the errors import without it; the clients and the
launcher load on first use and name the missing extra (``pip install 'rollsafe[engine]'``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
from rollsafe.errors import MissingExtra

if TYPE_CHECKING:
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

#: names whose modules need httpx (the ``engine`` extra): imported on first use (PEP 562), so
#: the protocol and the errors above stay importable on a plain ``pip install rollsafe``
_LAZY: dict[str, str] = {
    **dict.fromkeys(("NO_RETRY", "HttpTransport", "RetryPolicy"), "http"),
    **dict.fromkeys(
        (
            "ENGINE_KINDS",
            "READY_PREFIX",
            "EngineKind",
            "EngineLauncher",
            "EngineSpec",
            "EngineStartTimeout",
            "pid_alive",
        ),
        "launcher",
    ),
    "SGLangClient": "sglang",
    "VLLMClient": "vllm",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        loaded = importlib.import_module(f"{__name__}.{module}")
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] in _ENGINE_EXTRA:
            raise MissingExtra(exc.name, "engine") from exc
        raise
    value = getattr(loaded, name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


#: top-level modules of the ``engine`` extra this package needs
_ENGINE_EXTRA = frozenset({"httpx", "anyio", "httpcore", "h11"})

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
        sglang: type[SGLangClient] = __getattr__("SGLangClient")
        return sglang(url, api_key=api_key, timeout=timeout)
    if dialect == "vllm":
        vllm: type[VLLMClient] = __getattr__("VLLMClient")
        return vllm(url, api_key=api_key, timeout=timeout)
    raise ValueError(f"unknown engine dialect {dialect!r}; expected 'sglang' or 'vllm'")
