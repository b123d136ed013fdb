"""The rollout gateway: the fleet speaks HTTP (OpenAI and SGLang-native), asyncio end to end.

Every RL framework that reaches its engines over HTTP (slime, AReaL, verl's agent loops, SkyRL,
an openai-SDK agent) points its rollout URL at ``RolloutFleet.gateway_url``; requests go only to
``active`` groups, a stream cut by a crash or a sync continues on another group from its last
token, and every token's weights version is reported. ``docs/gateway.md``.

Importing this package imports nothing heavy: :class:`GatewaySettings` and
:class:`ExternalRouter` (an sglang-router / vllm-router whose workers the fleet keeps equal to
its routable set: :mod:`rollsafe.gateway.router_sync`) load on first use, the server with the
fleet (``FleetConfig(gateway=GatewaySettings(...))``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollsafe.lazy import lazy_attributes

if TYPE_CHECKING:
    from rollsafe.gateway.settings import ExternalRouter, GatewaySettings

__all__ = ["ExternalRouter", "GatewaySettings"]

__getattr__, __dir__ = lazy_attributes(
    __name__,
    {"GatewaySettings": "rollsafe.gateway.settings", "ExternalRouter": "rollsafe.gateway.settings"},
    public=__all__,
)
