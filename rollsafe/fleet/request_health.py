"""Request health: groups that fail requests leave routing, even when they pass health probes.

Owns the request side of failure detection (the :class:`~rollsafe.fleet.health.HealthManager` owns
the probe side; the two are counted and reported separately):

* the router reports every request that failed retryably on a group (:meth:`failed`: a
  connection drop, a timeout, a 5xx, a stream cut short) and every request a group served
  (:meth:`ok`, which resets that group's count);
* ``failure_threshold`` consecutive failed requests on one incarnation of a group (its
  ``generation``) send it ``fail``, exactly as probe failures do, and hand it to
  ``on_group_failed(group_id, reason)`` (the recovery coordinator);
* failures are not counted while ``health.paused`` says so (the health manager's pause around a
  weight sync), nor for a group that is not ``active``;
* :meth:`stats`: the consecutive counts per group and the groups failed by requests.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import rollsafe.policy as policy
from rollsafe.errors import InvalidArgument
from rollsafe.registry import FleetRegistry
from rollsafe.statemachines.base import TransitionRefused
from rollsafe.text import bound_text

__all__ = ["RequestHealth"]

log = logging.getLogger(__name__)


class _Pausable(Protocol):
    @property
    def paused(self) -> bool: ...


class RequestHealth:
    """Consecutive request failures per group; see the module."""

    def __init__(
        self,
        registry: FleetRegistry,
        *,
        failure_threshold: int = 3,
        on_group_failed: Callable[[str, str], object] | None = None,
        health: _Pausable | None = None,
    ) -> None:
        if failure_threshold < 1:
            raise InvalidArgument(
                "failure_threshold", f"failure_threshold must be >= 1, got {failure_threshold}"
            )
        self.registry = registry
        self.failure_threshold = failure_threshold
        self.on_group_failed = on_group_failed
        #: the health checks whose pause this counting follows (a sync's push)
        self.health = health
        self._lock = threading.Lock()
        self._counts: dict[str, tuple[int, int]] = {}  # group -> (generation, consecutive)
        self._failed_total: dict[str, int] = {}
        self._groups_failed: list[dict[str, Any]] = []

    def failed(self, group_id: str, exc: BaseException | None = None) -> None:
        """A request failed retryably on ``group_id`` (the router's error hook)."""
        if self.health is not None and self.health.paused:
            return
        if group_id not in self.registry:
            return
        group = self.registry.get(group_id)
        if group.state != "active":
            return
        generation = group.generation
        reason = f"{type(exc).__name__}: {exc}" if exc is not None else "request failed"
        with self._lock:
            self._failed_total[group_id] = self._failed_total.get(group_id, 0) + 1
            gen, n = self._counts.get(group_id, (generation, 0))
            n = n + 1 if gen == generation else 1
            events = policy.judge_request_failures(n, self.failure_threshold)
            if not events:
                self._counts[group_id] = (generation, n)
                return
            self._counts.pop(group_id, None)
        message = bound_text(f"{n} consecutive failed request(s): {reason}", 512)
        try:
            for event in events:
                self.registry.send(
                    group_id, event, decided_by="judge_request_failures", reason=message
                )
        except TransitionRefused as exc2:  # it moved meanwhile (a probe failed it first...)
            log.info("request health: could not fail group %s: %s", group_id, exc2)
            return
        with self._lock:
            self._groups_failed.append(
                {"group": group_id, "failures": n, "reason": message, "timestamp": time.time()}
            )
        log.warning("request health: group %s %s; taken out of routing", group_id, message)
        if self.on_group_failed is not None:
            try:
                self.on_group_failed(group_id, message)
            except Exception:
                log.exception("request health: on_group_failed raised")

    def ok(self, group_id: str) -> None:
        """A request succeeded on ``group_id``: its consecutive count restarts."""
        if group_id in self._counts:
            with self._lock:
                self._counts.pop(group_id, None)

    def failure_counts(self) -> dict[str, int]:
        """Consecutive failed requests per group (non-zero only)."""
        with self._lock:
            return {g: n for g, (_, n) in self._counts.items() if n}

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "failure_threshold": self.failure_threshold,
                "failure_counts": {g: n for g, (_, n) in self._counts.items() if n},
                "failed_requests": dict(self._failed_total),
                "groups_failed": [dict(r) for r in self._groups_failed],
            }
