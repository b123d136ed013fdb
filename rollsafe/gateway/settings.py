"""The gateway's settings: where it listens, who may call it, and how much it takes.

Owns :class:`GatewaySettings` (``FleetConfig(gateway=GatewaySettings(...))``); a bad value is a
:class:`~rollsafe.errors.InvalidArgument` naming the key as ``gateway.<field>``. Imports only
:mod:`rollsafe.errors`, so the fleet's configuration can name it without loading the server.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollsafe.errors import InvalidArgument

__all__ = ["GatewaySettings"]


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
