"""rollsafe's rollout gateway as a process of its own, in front of engines already running, for
``benchmarks/bench_gateway.py`` (its CPU and memory are measured like the routers').

``python benchmarks/gateway/gateway_front.py --upstream URL [--upstream URL ...] --dialect
sglang|vllm --model-path DIR [--profile PATH]`` prints ``GATEWAY_READY {"url": ..., "pid": ...}``
once it serves. What it builds is what ``RolloutFleet`` builds around its engines, minus the
launching and the weights:

* a :class:`~rollsafe.registry.FleetRegistry` with one group per engine URL (``g0``, ``g1``...),
  each with the real blocking client of its dialect (:class:`SGLangClient` /
  :class:`VLLMClient`), its member reported healthy and the group sent ``launched``
  (:func:`rollsafe.policy.launch_events`, as ``RolloutFleet._register_groups``): ``active``;
* a :class:`~rollsafe.fleet.router.Router` and a :class:`~rollsafe.fleet.dataplane.DataPlane`
  (asyncio routing and continuation over the clients' async companions);
* failure detection as the fleet wires it (``rollsafe/fleet/control_plane.py``): the fleet's
  :class:`~rollsafe.fleet.health.HealthManager` probing every group's ``/health`` (its default
  :class:`~rollsafe.fleet.settings.HealthSettings`: every 0.5 s, 2 s timeout, 2 failures) and
  :class:`~rollsafe.fleet.request_health.RequestHealth` on the router's ``on_group_error`` /
  ``on_group_ok`` (paused with the health manager); a group either fails leaves routing
  (``inactive``). There is no recovery coordinator: a dead engine's group stays out;
* :class:`~rollsafe.gateway.app.Gateway` served on the data plane's event loop thread (uvloop's
  loop: :func:`rollsafe.event_loop.new_event_loop`), as ``RolloutFleet`` serves it.

The tokenizer is the model's at ``--model-path`` (the stub engine has no model: the benchmark
passes a tiny model whose token id 7 decodes, with a long context, since the stub has none).
``--profile PATH``: cProfile on the loop thread from ready to SIGTERM (pstats format; its
timer is the loop thread's CPU time, ``time.thread_time``, so time spent waiting for a core on a
loaded machine is not charged; the profiler's own cost per call still inflates small functions:
read the call counts and the ranking, not the microseconds). ``--stats PATH``: on SIGTERM the
router's, the request health's and the gateway's counters and the groups' states, as JSON.
SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollsafe.adapters.engines import SGLangClient, VLLMClient
from rollsafe.fleet.dataplane import DataPlane
from rollsafe.fleet.health import GroupFailure, HealthManager
from rollsafe.fleet.request_health import RequestHealth
from rollsafe.fleet.router import Router
from rollsafe.fleet.settings import HealthSettings
from rollsafe.gateway.app import Gateway
from rollsafe.gateway.settings import GatewaySettings
from rollsafe.policy import launch_events
from rollsafe.registry import FleetRegistry

if TYPE_CHECKING:
    from rollsafe.observe.metrics import FleetMetrics

READY_PREFIX = "GATEWAY_READY "
log = logging.getLogger("gateway_front")


class BenchFleet:
    """What the gateway needs of a fleet (``rollsafe.gateway.app.GatewayFleet``)."""

    def __init__(self, registry: FleetRegistry, data_plane: DataPlane) -> None:
        self._registry = registry
        self._data_plane = data_plane

    @property
    def data_plane(self) -> DataPlane:
        return self._data_plane

    @property
    def registry(self) -> FleetRegistry:
        return self._registry

    @property
    def metrics(self) -> FleetMetrics | None:
        return None


def build(args: argparse.Namespace) -> tuple[FleetRegistry, Router, HealthManager, RequestHealth]:
    registry = FleetRegistry(fleet_version=1)
    for i, url in enumerate(args.upstream):
        client: Any = (
            SGLangClient(url, timeout=args.request_timeout_s)
            if args.dialect == "sglang"
            else VLLMClient(url, timeout=args.request_timeout_s)
        )
        gid = f"g{i}"
        client.health()
        registry.add_group(gid, [i], clients=[client])
        registry.report_member(gid, i, healthy=True, weights_version=registry.fleet_version)
        members = registry.get(gid).machine.members
        for event in launch_events({r: m.healthy for r, m in members.items()}):
            registry.send(gid, event)
    router = Router(
        registry,
        wait_for_routable_s=args.wait_for_routable_s,
        request_timeout_s=args.request_timeout_s,
    )

    def probe_failed(failure: GroupFailure) -> None:
        log.warning("health: %s", failure)

    def requests_failed(group_id: str, reason: str) -> None:
        log.warning("request health: %s: %s", group_id, reason)

    health = HealthManager(registry, settings=HealthSettings(), on_group_failed=probe_failed)
    request_health = RequestHealth(
        registry,
        failure_threshold=HealthSettings().failure_threshold,
        on_group_failed=requests_failed,
        health=health,
    )
    router.on_group_error = request_health.failed
    router.on_group_ok = request_health.ok
    return registry, router, health, request_health


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", action="append", required=True)
    p.add_argument("--dialect", choices=("sglang", "vllm"), default="sglang")
    p.add_argument("--model-path", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--request-timeout-s", type=float, default=60.0)
    p.add_argument("--wait-for-routable-s", type=float, default=30.0)
    p.add_argument("--no-health-probes", action="store_true", help="request health only")
    p.add_argument("--profile", default=None, help="cProfile the serving loop into this file")
    p.add_argument("--stats", default=None, help="write the counters here on SIGTERM")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    registry, router, health, request_health = build(args)
    plane = DataPlane(router)
    settings = GatewaySettings(
        host="127.0.0.1",
        port=args.port,
        wait_for_routable_s=args.wait_for_routable_s,
        request_timeout_s=args.request_timeout_s,
    )
    gateway = Gateway(BenchFleet(registry, plane), settings, model_path=Path(args.model_path))
    loop_thread = plane.loop_thread
    url = loop_thread.run(gateway.start())
    if not args.no_health_probes:
        health.start()
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile(time.thread_time)  # CPU time of the loop thread

        async def enable() -> None:  # cProfile profiles the thread that enables it
            assert profiler is not None
            profiler.enable()

        loop_thread.run(enable())

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(READY_PREFIX + json.dumps({"url": url, "pid": os.getpid()}), flush=True)
    while not stop.wait(1.0):
        pass
    if profiler is not None:

        async def disable() -> None:
            assert profiler is not None
            profiler.disable()

        loop_thread.run(disable())
        profiler.dump_stats(args.profile)
    stats = {
        "router": router.stats(),
        "request_health": request_health.stats(),
        "states": {g.group_id: g.state for g in registry.groups()},
        "gateway": gateway.counters.as_dict(),
    }
    if args.stats:
        Path(args.stats).write_text(json.dumps(stats, default=str, indent=1) + "\n")
    health.stop(timeout=2.0)
    loop_thread.run(gateway.close(grace_s=0.5))
    plane.close()
    router.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
