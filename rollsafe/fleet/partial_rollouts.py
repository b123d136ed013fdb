"""Partial rollouts: a weight sync that pauses generation, pushes, and continues the requests.

Owns :func:`paused_generation`, the bracket :meth:`RolloutFleet.sync_weights` puts around a
sync when given ``pause_mode``:

=============  ===============================================================================
``retract``    every routable group is paused with ``pause_generation("retract")``: SGLang (and
               the reference engine) keep the requests, free their KV cache and, after
               ``continue_generation``, re-prefill prompt + tokens so far on the new weights;
               the open streams simply carry on, each event naming the version serving it, so
               the result's segments split where the version changed (``version_change``).
               vLLM 0.33.0 maps it to ``/pause?mode=wait``, which lets requests finish first.
``abort``      groups are paused with ``pause_generation("abort")``: the engines end in-flight
               requests with ``finish_reason`` ``abort`` and the router continues each one from
               its tokens so far (:mod:`rollsafe.fleet.continuation`); the router holds those
               continuations until the new weights are in, so they run on them. Works for both
               dialects.
=============  ===============================================================================

On the way out (also when the sync failed) the groups paused are continued and held
continuations released.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Literal

from rollsafe.errors import InvalidArgument
from rollsafe.fleet.router import Router
from rollsafe.registry import FleetRegistry

__all__ = ["SYNC_PAUSE_MODES", "SyncPauseMode", "paused_generation"]

log = logging.getLogger(__name__)

SyncPauseMode = Literal["retract", "abort"]
SYNC_PAUSE_MODES: tuple[str, ...] = ("retract", "abort")


@contextlib.contextmanager
def paused_generation(
    registry: FleetRegistry, router: Router, mode: SyncPauseMode, *, timeout: float | None = None
) -> Iterator[list[str]]:
    """Pause generation on every routable group in ``mode`` for the body (see the module);
    yields the ids of the groups paused."""
    if mode not in SYNC_PAUSE_MODES:
        raise InvalidArgument(
            "pause_mode", f"pause_mode must be one of {list(SYNC_PAUSE_MODES)}, got {mode!r}"
        )
    paused: list[str] = []
    if mode == "abort":
        router.hold()
    try:
        for group in registry.routable():
            client = group.client
            if client is None:
                continue
            try:
                client.pause_generation(mode, timeout=timeout)
                paused.append(group.group_id)
            except Exception as exc:  # a dead engine: health and recovery deal with it
                log.warning("pause_generation(%s) on %s failed: %s", mode, group.group_id, exc)
        yield paused
    finally:
        for gid in paused:
            client = registry.get(gid).client if gid in registry else None
            if client is None:
                continue
            try:
                client.continue_generation(timeout=timeout)
            except Exception as exc:
                log.warning("continue_generation on %s failed: %s", gid, exc)
        router.release()
