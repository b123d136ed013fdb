"""The gateway's settings: where it listens, who may call it, how much it takes, and the
external routers kept in step with the fleet.

Owns :class:`GatewaySettings` (``FleetConfig(gateway=GatewaySettings(...))``) and
:class:`ExternalRouter` (``FleetConfig(external_routers=(ExternalRouter(...),))``,
:mod:`rollsafe.gateway.router_sync`); a bad value is a :class:`~rollsafe.errors.InvalidArgument`
naming the key. Imports only :mod:`rollsafe.errors` and the standard library, so the fleet's
configuration can name them without loading the server.
"""

from __future__ import annotations

import math
import urllib.parse
from dataclasses import dataclass, field
from typing import Literal, get_args

from rollsafe.errors import InvalidArgument, InvalidArgumentType

__all__ = ["ROUTER_KINDS", "ExternalRouter", "GatewaySettings", "RouterKind"]

RouterKind = Literal["sglang-router", "vllm-router"]
#: the routers whose worker API :class:`RouterSync` speaks (the releases in ``docs/routers.md``)
ROUTER_KINDS: tuple[str, ...] = get_args(RouterKind)


def _positive(key: str, value: object, *, integer: bool = False, zero: bool = False) -> None:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise InvalidArgument(f"gateway.{key}", f"gateway.{key} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not zero):
        bound = ">= 0" if zero else "> 0"
        raise InvalidArgument(f"gateway.{key}", f"gateway.{key} must be {bound}, got {value!r}")


@dataclass(frozen=True)
class GatewaySettings:
    """The rollout gateway (``docs/gateway.md``), served from the fleet's process at
    ``RolloutFleet.gateway_url`` from ``start()`` to ``close()``.

    =========================  ===================================================================
    ``host``, ``port``         where it listens (``port=0``: a free port, read ``gateway_url``)
    ``api_key``                with it set, every route but ``GET /health`` needs
                               ``Authorization: Bearer <api_key>`` (401 otherwise)
    ``model_name``             the model name ``/v1/models`` lists and answers carry (None: the
                               model directory's name); any name is accepted in requests
    ``wait_for_routable_s``    a request that arrives while no group is routable (all syncing,
                               recovering) waits this long for one, then 503
    ``request_timeout_s``      each wait for an engine event (None: the fleet's)
    ``max_in_flight``          requests served at once; past it 503 with ``Retry-After``
    ``max_body_bytes``         a larger request body is refused (413) before it is read
    ``idle_body_timeout_s``    a client that stops sending mid-body is cut (408)
    ``keepalive_timeout_s``    an idle keep-alive connection is closed
    ``max_n``                  the largest ``n`` (choices per request)
    ``max_sessions``           sessions remembered (least recently used forgotten first)
    ``session_ttl_s``          a session idle this long is forgotten
    ``gc_freeze``              at start, move the objects the process holds then out of the
                               cyclic garbage collector's reach (``gc.freeze()``): its full
                               collections, which a request's allocations trigger now and then,
                               no longer walk a trainer's heap (torch, the tokenizer) in the
                               middle of a request; an object alive at start that later becomes
                               garbage in a reference cycle is then not freed
    =========================  ===================================================================
    """

    host: str = "127.0.0.1"
    port: int = 0
    api_key: str | None = None
    model_name: str | None = None
    wait_for_routable_s: float = 30.0
    request_timeout_s: float | None = None
    max_in_flight: int = 10_000
    max_body_bytes: int = 32 << 20
    idle_body_timeout_s: float = 30.0
    keepalive_timeout_s: float = 75.0
    max_n: int = 16
    max_sessions: int = 100_000
    session_ttl_s: float = 3600.0
    gc_freeze: bool = True

    def __post_init__(self) -> None:
        host = self.host
        if not isinstance(host, str) or not host or any(c.isspace() for c in host):
            raise InvalidArgument(
                "gateway.host", f"gateway.host must be a host name or address, got {host!r}"
            )
        port = self.port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise InvalidArgument("gateway.port", f"gateway.port must be 0..65535, got {port!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise InvalidArgument(
                "gateway.api_key", "gateway.api_key must be a non-empty string or None"
            )
        if self.model_name is not None and (
            not isinstance(self.model_name, str) or not self.model_name
        ):
            raise InvalidArgument(
                "gateway.model_name", "gateway.model_name must be a non-empty string or None"
            )
        _positive("wait_for_routable_s", self.wait_for_routable_s, zero=True)
        if self.request_timeout_s is not None:
            _positive("request_timeout_s", self.request_timeout_s)
        for key in ("max_in_flight", "max_body_bytes", "max_n", "max_sessions"):
            _positive(key, getattr(self, key), integer=True)
        for key in ("idle_body_timeout_s", "keepalive_timeout_s", "session_ttl_s"):
            _positive(key, getattr(self, key))
        if not isinstance(self.gc_freeze, bool):
            raise InvalidArgument(
                "gateway.gc_freeze", f"gateway.gc_freeze must be a bool, got {self.gc_freeze!r}"
            )


def normal_url(url: str) -> str:
    """A worker URL as compared with a router's list (no trailing slash)."""
    return url.strip().rstrip("/")


def _router_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentType(name, f"ExternalRouter.{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise InvalidArgument(name, f"ExternalRouter.{name} must be > 0 and finite, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ExternalRouter:
    """A router users run in front of the engines, to be kept in step with the fleet.

    ``url``: the router's own address (``http://host:port``, optionally with a path prefix;
    the worker routes are appended). ``kind``: ``"sglang-router"`` or ``"vllm-router"``.
    ``api_key``: sent as ``Authorization: Bearer`` on every call (sglang-router's
    ``--control-plane-api-keys`` admin key); never shown in ``repr``.

    Timeouts (seconds): ``timeout_s`` bounds each list / remove call and sglang-router's add;
    ``add_timeout_s`` bounds vllm-router's add, which answers only once the worker is healthy;
    ``confirm_timeout_s`` is how long a sglang-router background job may take to show in (or
    leave) ``GET /workers``. ``reconcile_interval_s``: how often the list is compared with the
    fleet. ``remove_unknown``: whether listed workers that are no URL of the fleet are removed
    (see :mod:`rollsafe.gateway.router_sync`). ``retry_initial_s`` / ``retry_max_s``: the
    backoff of a failed call (doubling). Every field is checked here; a bad one is an
    :class:`~rollsafe.errors.InvalidArgument` naming it.
    """

    url: str
    kind: RouterKind
    api_key: str | None = field(default=None, repr=False)
    timeout_s: float = 5.0
    add_timeout_s: float = 30.0
    confirm_timeout_s: float = 10.0
    reconcile_interval_s: float = 30.0
    remove_unknown: bool = True
    retry_initial_s: float = 0.25
    retry_max_s: float = 10.0

    def __post_init__(self) -> None:
        if not isinstance(self.url, str):
            raise InvalidArgumentType("url", f"ExternalRouter.url must be a str, got {self.url!r}")
        parts = urllib.parse.urlsplit(self.url.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidArgument(
                "url", f"ExternalRouter.url must be http(s)://host[:port], got {self.url!r}"
            )
        try:
            parts.port  # noqa: B018 (raises on a bad port)
        except ValueError as exc:
            raise InvalidArgument("url", f"ExternalRouter.url {self.url!r}: {exc}") from None
        if parts.query or parts.fragment:
            raise InvalidArgument(
                "url", f"ExternalRouter.url must have no query or fragment, got {self.url!r}"
            )
        object.__setattr__(self, "url", normal_url(self.url))
        if self.kind not in ROUTER_KINDS:
            raise InvalidArgument(
                "kind",
                f"ExternalRouter.kind must be one of {list(ROUTER_KINDS)}, got {self.kind!r}",
            )
        if self.api_key is not None and (
            not isinstance(self.api_key, str)
            or not self.api_key
            or any(c.isspace() or not c.isprintable() for c in self.api_key)
        ):
            raise InvalidArgument(
                "api_key",
                "ExternalRouter.api_key must be None or a non-empty string without spaces or "
                "control characters",
            )
        for name in (
            "timeout_s",
            "add_timeout_s",
            "confirm_timeout_s",
            "reconcile_interval_s",
            "retry_initial_s",
            "retry_max_s",
        ):
            object.__setattr__(self, name, _router_number(name, getattr(self, name)))
        if self.retry_max_s < self.retry_initial_s:
            raise InvalidArgument(
                "retry_max_s",
                f"ExternalRouter.retry_max_s ({self.retry_max_s}) must be >= retry_initial_s "
                f"({self.retry_initial_s})",
            )
        if not isinstance(self.remove_unknown, bool):
            raise InvalidArgumentType(
                "remove_unknown",
                f"ExternalRouter.remove_unknown must be a bool, got {self.remove_unknown!r}",
            )

    def backoff_s(self, failures: int) -> float:
        """The wait before the next try after ``failures`` consecutive failures (>= 1)."""
        return min(self.retry_max_s, self.retry_initial_s * 2.0 ** max(0, failures - 1))
