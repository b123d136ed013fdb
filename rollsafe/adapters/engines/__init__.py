"""Engine clients (SGLang and vLLM dialects over HTTP) and the engine-group launcher.

``SGLangClient`` / ``VLLMClient`` implement :class:`rollsafe.ports.EngineClient` (import the
protocol and its data types from :mod:`rollsafe.ports`); ``async_engine(client, AsyncHttp())``
is a client's asyncio companion (:mod:`~rollsafe.adapters.engines.aio`, on the pooled HTTP/1.1
client of :mod:`~rollsafe.adapters.engines.pool`: httptools in a bare asyncio protocol); the
:class:`EngineLauncher` runs one engine group as OS processes described by an
:class:`EngineSpec`. Errors derive from :class:`EngineError`. Needs the ``engine`` extra (httpx);
nothing here imports Ray. The protocol and the errors import without it; the clients and the
launcher load on first use and name the missing extra (``pip install 'rollsafe[engine]'``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollsafe.adapters.engines.errors import (
    EngineAsleep,
    EngineError,
    EngineNotSupported,
    EngineOperationFailed,
    EngineRequestError,
    EngineStartError,
    EngineTimeout,
    EngineUnavailable,
    EventLoopError,
    NoWeightChecker,
)
from rollsafe.errors import InvalidArgument
from rollsafe.lazy import lazy_attributes
from rollsafe.ports import Dialect

if TYPE_CHECKING:
    from rollsafe.adapters.engines.aio import (
        AsyncEngine,
        AsyncHttp,
        AsyncSGLangEngine,
        AsyncVLLMEngine,
        ThreadedEngine,
        async_engine,
    )
    from rollsafe.adapters.engines.http import NO_RETRY, HttpTransport, RetryPolicy
    from rollsafe.adapters.engines.launch.readiness import EngineStartTimeout
    from rollsafe.adapters.engines.launch.spec import ENGINE_KINDS, EngineKind, EngineSpec
    from rollsafe.adapters.engines.launcher import EngineLauncher
    from rollsafe.adapters.engines.sglang import SGLangClient
    from rollsafe.adapters.engines.vllm import VLLMClient

#: names whose modules need httpx (the ``engine`` extra): imported on first use (PEP 562), so
#: the protocol and the errors above stay importable on a plain ``pip install rollsafe``
_LAZY: dict[str, str] = {
    **dict.fromkeys(("NO_RETRY", "HttpTransport", "RetryPolicy"), "rollsafe.adapters.engines.http"),
    **dict.fromkeys(
        ("ENGINE_KINDS", "EngineKind", "EngineSpec"), "rollsafe.adapters.engines.launch.spec"
    ),
    "EngineStartTimeout": "rollsafe.adapters.engines.launch.readiness",
    "EngineLauncher": "rollsafe.adapters.engines.launcher",
    "SGLangClient": "rollsafe.adapters.engines.sglang",
    "VLLMClient": "rollsafe.adapters.engines.vllm",
    **dict.fromkeys(
        (
            "AsyncEngine",
            "AsyncHttp",
            "AsyncSGLangEngine",
            "AsyncVLLMEngine",
            "ThreadedEngine",
            "async_engine",
        ),
        "rollsafe.adapters.engines.aio",
    ),
}


__all__ = [
    "ENGINE_KINDS",
    "NO_RETRY",
    "AsyncEngine",
    "AsyncHttp",
    "AsyncSGLangEngine",
    "AsyncVLLMEngine",
    "EngineAsleep",
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
    "EventLoopError",
    "HttpTransport",
    "NoWeightChecker",
    "RetryPolicy",
    "SGLangClient",
    "ThreadedEngine",
    "VLLMClient",
    "async_engine",
    "make_client",
]


#: top-level modules of the ``engine`` extra the clients and the launcher need
_ENGINE_EXTRA = {
    "httpx": "engine",
    "anyio": "engine",
    "httpcore": "engine",
    "h11": "engine",
    "aiohttp": "engine",
    "httptools": "engine",
    "multidict": "engine",
    "yarl": "engine",
}

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, public=__all__, extras=_ENGINE_EXTRA)


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
    raise InvalidArgument(
        "dialect", f"unknown engine dialect {dialect!r}; expected 'sglang' or 'vllm'"
    )
