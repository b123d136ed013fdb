"""Simulated engines and fleets for the fleet control-plane tests (reusable by later suites).

:class:`SimEngineClient` implements the real :class:`~rollsafe.adapters.engines.EngineClient`
protocol (``isinstance`` holds) without a process: ``generate`` answers at once (or blocks on a
gate, or raises a configured engine error), ``health`` passes, raises or hangs as told. A client
can be bound to a registry group so that every ``generate`` checks, at the moment the engine
would receive the request, that the group is routable; a violation is recorded, never hidden.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rollsafe.adapters.engines import EngineError, EngineNotSupported
from rollsafe.ports import Dialect, GenerateResult, MemoryTag, PauseMode, WeightsChecksum
from rollsafe.registry import FleetRegistry


class SimEngineClient:
    """An in-process stand-in for one engine group's HTTP client."""

    def __init__(self, name: str, *, dialect: Dialect = "sglang") -> None:
        self.name = name
        self._url = f"http://sim-{name}.invalid"
        self._dialect: Dialect = dialect
        self.generate_error: EngineError | None = None
        self.health_error: EngineError | None = None
        self.health_gate: threading.Event | None = None  # health() waits on it when set
        self.generate_gate: threading.Event | None = None  # generate() waits on it when set
        self.generate_calls = 0
        self.health_calls = 0
        self.violations: list[str] = []
        self._registry: FleetRegistry | None = None
        self._group_id: str | None = None
        self._lock = threading.Lock()

    def bind(self, registry: FleetRegistry, group_id: str) -> None:
        """Check routability of ``group_id`` on every generate (records violations)."""
        self._registry, self._group_id = registry, group_id

    # -- protocol ---------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self._url

    @property
    def dialect(self) -> Dialect:
        return self._dialect

    def health(self, *, timeout: float | None = None, retry: bool = True) -> None:
        with self._lock:
            self.health_calls += 1
        gate = self.health_gate
        if gate is not None:
            gate.wait()
        if self.health_error is not None:
            raise self.health_error

    def is_healthy(self, *, timeout: float | None = None) -> bool:
        try:
            self.health(timeout=timeout)
        except EngineError:
            return False
        return True

    def generate(
        self,
        input_ids: Sequence[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> GenerateResult:
        with self._lock:
            self.generate_calls += 1
        if self._registry is not None and self._group_id is not None:
            group = self._registry.get(self._group_id)
            if not group.is_routable:
                self.violations.append(f"{self._group_id} got a request in {group.state}")
        gate = self.generate_gate
        if gate is not None:
            gate.wait()
        if self.generate_error is not None:
            raise self.generate_error
        ids = list(input_ids or [])
        return GenerateResult(text=self.name, output_ids=ids[:1], weight_version="sim")

    def pause_generation(self, mode: PauseMode = "abort", *, timeout: float | None = None) -> None:
        pass

    def continue_generation(self, *, timeout: float | None = None) -> None:
        pass

    def flush_cache(self, *, timeout: float | None = None) -> None:
        pass

    def release_memory_occupation(
        self, tags: Sequence[MemoryTag] | None = None, *, timeout: float | None = None
    ) -> None:
        pass

    def resume_memory_occupation(
        self, tags: Sequence[MemoryTag] | None = None, *, timeout: float | None = None
    ) -> None:
        pass

    def update_weights_from_disk(self, model_path: str, **kw: Any) -> str:
        raise EngineNotSupported("sim", "update_weights_from_disk")

    def update_weights_from_tensor(self, serialized_named_tensors: Sequence[str], **kw: Any) -> str:
        raise EngineNotSupported("sim", "update_weights_from_tensor")

    def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, **kw: Any
    ) -> str:
        raise EngineNotSupported("sim", "init_weights_update_group")

    def destroy_weights_update_group(
        self, group_name: str = "weight_update_group", *, timeout: float | None = None
    ) -> str:
        raise EngineNotSupported("sim", "destroy_weights_update_group")

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        **kw: Any,
    ) -> str:
        raise EngineNotSupported("sim", "update_weights_from_distributed")

    def update_weights_from_ipc(self, zmq_handles: Mapping[str, str], **kw: Any) -> str:
        raise EngineNotSupported("sim", "update_weights_from_ipc")

    def weights_checksum(self, *, timeout: float | None = None) -> WeightsChecksum:
        return WeightsChecksum(weight_version="sim", model=self.name, tensors={})

    def weight_version(self, *, timeout: float | None = None) -> str | None:
        return None  # a simulated engine names no version (a spare's last check refuses it)

    def close(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def make_fleet(
    sizes: Iterable[int] = (1, 1, 1),
    *,
    version: int = 1,
    active: bool = True,
    restart_budget: int = 3,
    bind: bool = True,
) -> tuple[FleetRegistry, dict[str, SimEngineClient]]:
    """A registry with one simulated group per entry of ``sizes`` (its rank count).

    Groups are ``g0``, ``g1``...; ranks are consecutive across groups. With ``active`` every
    member reports healthy at ``version`` and the group is ``launched`` into ``active``.
    """
    reg = FleetRegistry(fleet_version=version)
    clients: dict[str, SimEngineClient] = {}
    next_rank = 0
    for i, size in enumerate(sizes):
        gid = f"g{i}"
        client = SimEngineClient(gid)
        ranks = list(range(next_rank, next_rank + size))
        next_rank += size
        reg.add_group(gid, ranks, clients=[client], restart_budget=restart_budget)
        if bind:
            client.bind(reg, gid)
        clients[gid] = client
        if active:
            bring_up(reg, gid)
    return reg, clients


def bring_up(reg: FleetRegistry, gid: str, event: str = "launched") -> None:
    """Report every member healthy at the fleet version, then send ``event`` (-> active)."""
    group = reg.get(gid)
    for r in group.ranks:
        reg.report_member(gid, r, healthy=True, weights_version=reg.fleet_version)
    reg.send(gid, event)


# -- the request path: a Router's requests go through a DataPlane (one per router per test)
_PLANES: dict[int, Any] = {}


def generate(router: Any, *args: Any, **kwargs: Any) -> Any:
    """``router``'s blocking request, through a :class:`~rollsafe.fleet.dataplane.DataPlane`
    kept for the test (closed by the ``close_planes`` fixture in conftest.py)."""
    from rollsafe.fleet.dataplane import DataPlane

    entry = _PLANES.get(id(router))
    if entry is None or entry[0] is not router:
        entry = _PLANES[id(router)] = (router, DataPlane(router))
    return entry[1].generate(*args, **kwargs)


def close_planes() -> None:
    """Close every data plane :func:`generate` opened (their loop threads stop)."""
    while _PLANES:
        _, (_, plane) = _PLANES.popitem()
        plane.close()
