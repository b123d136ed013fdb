"""Named errors of the reference engine and the HTTP status each one maps to."""

from __future__ import annotations

from rollsafe.errors import RollsafeError

__all__ = [
    "BadRequest",
    "EngineBusy",
    "EngineError",
    "EngineUnavailable",
    "LimitExceeded",
    "RankFailure",
    "RequestTimeout",
    "StartupError",
    "Unsupported",
    "WeightUpdateError",
]


class EngineError(RollsafeError):
    """Base class; ``status`` is the HTTP status the server answers with."""

    status = 500


class BadRequest(EngineError):
    """The request is malformed (bad JSON, unknown key, wrong type); nothing was changed."""

    status = 400


class LimitExceeded(BadRequest):
    """A request asks for more than a configured limit allows (names the limit and its flag);
    nothing of it was queued."""


class WeightUpdateError(BadRequest):
    """A weight update was refused before touching live weights (names the key/path/rank)."""


class Unsupported(BadRequest):
    """The request is valid but this engine/device cannot do it (e.g. CUDA IPC on CPU)."""


class RequestTimeout(EngineError):
    """The client did not send its request body within ``--body-timeout`` seconds."""

    status = 408


class EngineUnavailable(EngineError):
    """The engine cannot serve right now (weights released, shutting down, hung)."""

    status = 503


class EngineBusy(EngineUnavailable):
    """The engine is at its ``--max-concurrent-requests`` limit; the request was not queued
    (retry later or elsewhere). The engine itself is healthy."""


class EnginePaused(EngineUnavailable):
    """vLLM 0.33.0: generation is paused in ``abort`` or ``wait`` mode; new requests get a 503
    (``engine_paused``, retry after ``/resume``) instead of queueing."""


class RankFailure(EngineUnavailable):
    """A rank process died or a collective among the ranks failed; the engine is unhealthy."""


class StartupError(EngineError):
    """The engine cannot start as configured (bad device, rank layout or tokenizer)."""
