"""The rollout gateway (issue #35): how clients that are not in the trainer's process reach the
fleet over HTTP, and how routers users already run in front of the engines are kept in step
with the fleet (:mod:`~rollsafe.gateway.router_sync`)."""
