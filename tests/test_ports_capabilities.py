"""The ports declare every capability the fleet uses, and the fleet never probes for one.

Two halves:

* every shipped :class:`~rollsafe.ports.WeightTransport` and
  :class:`~rollsafe.adapters.engines.EngineLauncher` has every member of its port
  (``runtime_checkable`` ``isinstance`` on real instances, plus each method taking the keyword
  arguments the operations' executors pass);
* no module of ``rollsafe/fleet/`` asks any object what it can do at run time: no
  ``hasattr``, no ``getattr(obj, "<any literal name>")`` (a transport's, launcher's,
  client's or handle's capability is a declared member of its port, called directly), no
  ``inspect.signature`` / ``_accepts`` (an AST check, itself shown to catch a probe).
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import tiny_model_dir  # noqa: F401  (fixture)

from rollsafe.adapters.engines import EngineLauncher, EngineSpec
from rollsafe.ports import EngineClient, RestartableEngine, WeightTransport

FLEET = Path(__file__).resolve().parents[1] / "rollsafe" / "fleet"

#: What the fleet's executors call on each port, with the keywords they pass
#: (``fleet/recovery.py``'s ``_AttemptExecutor``, ``fleet/sync.py``'s ``_SyncRun``,
#: ``fleet/fleet.py``).
ENGINE_CALLS: dict[str, dict[str, Any]] = {
    "restart": {
        "model_path": "/export/hf-v3",
        "load_format": None,
        "skip_load_weights": False,
        "weight_version": "3",
        "stop_timeout": 2.0,
    },
    "stop": {"timeout": 2.0, "keep_standby": True},
    "standby_status": {},
}
ENGINE_PROPERTIES = ("client", "standby_state", "last_start_source")
TRANSPORT_CALLS: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "register": (({}, 1), {}),
    "update": (([],), {}),
    "targeted_update": (([],), {}),
    "last_push": ((), {}),
    "forget": (("g0",), {}),
    "close": ((), {}),
}
TRANSPORT_PROPERTIES = ("deltas",)


def port_members(port: type) -> set[str]:
    """The public members a protocol declares (methods, properties, annotated attributes)."""
    names = {n for n in vars(port) if not n.startswith("_")}
    return names | {n for n in getattr(port, "__annotations__", {}) if not n.startswith("_")}


def test_the_ports_declare_the_capabilities_the_fleet_uses() -> None:
    engine = port_members(RestartableEngine)
    assert set(ENGINE_CALLS) | set(ENGINE_PROPERTIES) == engine
    transport = port_members(WeightTransport)
    assert set(TRANSPORT_CALLS) | set(TRANSPORT_PROPERTIES) | {"name", "registration"} == transport
    restart = inspect.signature(RestartableEngine.restart).parameters
    assert set(ENGINE_CALLS["restart"]) <= set(restart)
    stop = inspect.signature(RestartableEngine.stop).parameters
    assert set(ENGINE_CALLS["stop"]) <= set(stop)


def assert_takes(fn: Any, *args: Any, **kwargs: Any) -> None:
    """``fn`` (unbound: ``self`` is a placeholder) accepts exactly this call."""
    inspect.signature(fn).bind(None, *args, **kwargs)


# ====================================================================== transports
@pytest.fixture
def transports(tmp_path: Path) -> Iterator[list[Any]]:
    """One instance of every shipped transport (checkpoint-engine over a one-rank gloo group;
    its parameter server is built only at a register, so none is made here)."""
    import torch.distributed as dist

    from rollsafe.transports import DiskTransport, IPCTransport, NCCLTransport
    from rollsafe.transports.checkpoint_engine import (
        CheckpointEngineFleetTransport,
        CheckpointEngineTransport,
    )

    made_group = not dist.is_initialized()
    if made_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    made: list[Any] = [NCCLTransport(1), IPCTransport(1), DiskTransport(tmp_path)]
    try:
        inner = CheckpointEngineTransport(server_factory=lambda **kw: object())
        made += [inner, CheckpointEngineFleetTransport(1, transport=inner)]
        yield made
    finally:
        for transport in made:
            transport.close()
        if made_group:
            dist.destroy_process_group()


def test_every_shipped_transport_is_a_weight_transport(transports: list[Any]) -> None:
    kinds = {type(t).__name__ for t in transports}
    assert kinds == {
        "NCCLTransport",
        "IPCTransport",
        "DiskTransport",
        "CheckpointEngineTransport",
        "CheckpointEngineFleetTransport",
    }
    for transport in transports:
        assert isinstance(transport, WeightTransport), type(transport).__name__
        assert isinstance(transport.name, str) and transport.name
        assert transport.registration.state is not None
        assert transport.last_push() is None  # nothing pushed yet
        assert transport.deltas is None  # built without deltas
        transport.forget("g0")  # nothing kept for an unknown target: a no-op, never an error
        for method, (args, kwargs) in TRANSPORT_CALLS.items():
            assert_takes(getattr(type(transport), method), *args, **kwargs)
        for name in TRANSPORT_PROPERTIES:
            assert isinstance(inspect.getattr_static(type(transport), name), property), name


def test_a_targeted_push_reaches_only_its_targets(transports: list[Any]) -> None:
    """``targeted_update`` of a staged transport is its per-target ``update``: nothing is
    registered, so both refuse the same way (before anything moves)."""
    from rollsafe.transports import TransportError

    nccl = transports[0]
    with pytest.raises(TransportError, match="nothing is registered"):
        nccl.targeted_update([])
    with pytest.raises(TransportError, match="nothing is registered"):
        nccl.update([])


# ====================================================================== engines
def test_the_engine_launcher_declares_every_restartable_engine_member() -> None:
    for name in ENGINE_PROPERTIES:
        assert isinstance(inspect.getattr_static(EngineLauncher, name), property), name
    for method, kwargs in ENGINE_CALLS.items():
        assert_takes(getattr(EngineLauncher, method), **kwargs)


def test_a_started_engine_launcher_is_a_restartable_engine(
    tiny_model_dir: Path,  # noqa: F811
) -> None:
    launcher = EngineLauncher(EngineSpec(model_path=str(tiny_model_dir), ranks=1))
    launcher.start()
    try:
        assert isinstance(launcher, RestartableEngine)
        assert isinstance(launcher.client, EngineClient)
        assert launcher.standby_state == "none"  # no warm standby asked for
        assert launcher.last_start_source == "fresh_spawn"
        assert launcher.standby_status()["state"] == "none"
    finally:
        launcher.stop(timeout=5.0)


# ====================================================================== no probing in fleet/
PROBES = {"hasattr", "_accepts"}


def probes(source: str) -> list[str]:
    """Where ``source`` asks an object what it can do: ``hasattr(...)``, ``_accepts(...)``,
    ``inspect.signature(...)`` or ``getattr(obj, "<any literal name>", ...)`` (whether or not
    the name is on a port today: a capability the fleet uses must be declared there)."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        name = (
            fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
        )
        if name in PROBES or name == "signature":
            found.append(f"line {node.lineno}: {name}(...)")
        elif name == "getattr" and len(node.args) >= 2:
            key = node.args[1]
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                found.append(f"line {node.lineno}: getattr(..., {key.value!r})")
    return found


def test_the_probe_check_catches_a_probe() -> None:
    assert probes('stop = getattr(self.handle, "stop", None)') == ["line 1: getattr(..., 'stop')"]
    # a name on no port today is a probe all the same (the last round's delta_stats was one)
    assert probes('stats = getattr(self.transport, "delta_stats", None)') == [
        "line 1: getattr(..., 'delta_stats')"
    ]
    assert probes("if hasattr(transport, 'targeted_update'): pass")
    assert probes("ok = _accepts(handle.restart, 'weight_version')")
    assert probes("ps = inspect.signature(fn).parameters")
    assert probes("value = getattr(settings, field.name)") == []  # a field by name: no probe


@pytest.mark.parametrize("module", sorted(p.name for p in FLEET.glob("*.py")))
def test_the_fleet_calls_ports_without_probing(module: str) -> None:
    found = probes((FLEET / module).read_text())
    assert found == [], f"rollsafe/fleet/{module} probes an object: {found}"


def test_the_ray_engine_group_declares_every_launchable_engine_member() -> None:
    """``FleetConfig(placement="ray")``'s handle has what recovery and the fleet call (no Ray
    needed to check it: nothing here imports Ray)."""
    from rollsafe.adapters.ray import RayEngineGroup
    from rollsafe.ports import LaunchableEngine

    assert RestartableEngine in LaunchableEngine.__mro__
    assert port_members(LaunchableEngine) == {"start"}  # what it adds
    for name in ENGINE_PROPERTIES:
        assert isinstance(inspect.getattr_static(RayEngineGroup, name), property), name
    for method, kwargs in ENGINE_CALLS.items():
        assert_takes(getattr(RayEngineGroup, method), **kwargs)
    assert_takes(RayEngineGroup.start)
    assert_takes(EngineLauncher.start)
