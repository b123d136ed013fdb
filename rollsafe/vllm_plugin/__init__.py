"""rollsafe's vLLM plugin: a weight-transfer backend with a gloo data plane, for vLLM on CPU.

vLLM loads it from rollsafe's entry point (``pyproject.toml``,
``[project.entry-points."vllm.general_plugins"]``: ``rollsafe_gloo =
"rollsafe.vllm_plugin:register"``) in every process it starts: the API server, the engine core
and each worker (``vllm/plugins/__init__.py``, ``load_general_plugins``). :func:`register` adds
the backend :data:`BACKEND` to ``WeightTransferEngineFactory`` by module path, so the engine
module (:mod:`rollsafe.vllm_plugin.gloo_engine`, which imports vLLM and torch) is imported only
in the worker that creates the engine. A server started with ``--weight-transfer-config
'{"backend": "rollsafe_gloo"}'`` then receives what rollsafe's ``NCCLTransport(backend="gloo")``
broadcasts, through vLLM's own ``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights`` and ``/finish_weight_update`` (``docs/transports.md``, "vLLM on CPU").

Importing this package imports nothing (the launcher reads :data:`BACKEND` from it).
"""

from __future__ import annotations

__all__ = ["BACKEND", "ENGINE_CLASS", "ENGINE_MODULE", "register"]

#: The ``--weight-transfer-config`` backend name this plugin registers.
BACKEND = "rollsafe_gloo"
#: Where the engine class lives (imported by vLLM's factory on first use).
ENGINE_MODULE = "rollsafe.vllm_plugin.gloo_engine"
ENGINE_CLASS = "GlooWeightTransferEngine"


def register() -> None:
    """vLLM's ``vllm.general_plugins`` hook: register :data:`BACKEND` (lazily, by module path).

    Idempotent: vLLM loads general plugins once per process, but a process forked from one
    that did inherits the registry, and a second call changes nothing.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    registry = getattr(WeightTransferEngineFactory, "_registry", None)
    if isinstance(registry, dict) and BACKEND in registry:
        return
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, ENGINE_MODULE, ENGINE_CLASS)
    except ValueError as exc:  # registered meanwhile (the registry is not locked)
        if "already registered" not in str(exc):
            raise
