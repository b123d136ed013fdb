"""Named errors of the reference engine and the HTTP status each one maps to."""

from __future__ import annotations

__all__ = [
    "BadRequest",
    "EngineError",
    "EngineUnavailable",
    "RankFailure",
    "StartupError",
    "Unsupported",
    "WeightUpdateError",
]


class EngineError(Exception):
    """Base class; ``status`` is the HTTP status the server answers with."""

    status = 500


class BadRequest(EngineError):
    """The request is malformed (bad JSON, unknown key, wrong type); nothing was changed."""

    status = 400


class WeightUpdateError(BadRequest):
    """A weight update was refused before touching live weights (names the key/path/rank)."""


class Unsupported(BadRequest):
    """The request is valid but this engine/device cannot do it (e.g. CUDA IPC on CPU)."""


class EngineUnavailable(EngineError):
    """The engine cannot serve right now (weights released, shutting down, hung)."""

    status = 503


class RankFailure(EngineUnavailable):
    """A rank process died or a collective among the ranks failed; the engine is unhealthy."""


class StartupError(EngineError):
    """The engine cannot start as configured (bad device, rank layout or tokenizer)."""
