"""One executor shape (``rollsafe.operations.executor``), and each effect handled once.

* every executor is an :class:`~rollsafe.operations.executor.Executor`: one table per class,
  built when the class is made (a second handler of one effect in one table is refused);
* across the fleet's side (fleet, registry, transports) each effect has at most one handler,
  and every effect the operations yield has one, but for ``ProbeMembers`` (a health round
  performs every group's probe together under one deadline: that is the stop point);
* the registry's effects are handled only by :class:`~rollsafe.registry.RegistryEffects` and
  the delta base's by :class:`~rollsafe.registry.DeltaLedger`: the verifier's model holds them
  as parts, on a real registry and ledger, and handles none of them itself;
* no class of ``rollsafe/fleet/`` touches another object's private members.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

import rollsafe
import rollsafe.operations.effects as fx
from rollsafe.operations.executor import Executor, handles
from rollsafe.registry import DeltaLedger, RegistryEffects

ROOT = Path(rollsafe.__file__).parent
_OPTIONAL = {"ray", "checkpoint_engine", "prometheus_client", "trl", "vllm"}
#: performed by the health round itself, concurrently for every probed group (the stop point
#: of each probe's sequence), not by a handler
PERFORMED_BY_THE_ROUND = {fx.ProbeMembers}


def executors() -> list[type[Executor]]:
    for info in pkgutil.walk_packages(rollsafe.__path__, prefix="rollsafe."):
        if info.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.split(".")[0] in _OPTIONAL:
                continue
            raise
    found: list[type[Executor]] = []
    todo = list(Executor.__subclasses__())
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return [c for c in found if c.__module__.startswith("rollsafe.")]


def effect_classes() -> list[type[fx.Effect[Any]]]:
    return [
        obj
        for obj in vars(fx).values()
        if isinstance(obj, type) and issubclass(obj, fx.Effect) and obj is not fx.Effect
    ]


def own_handlers(cls: type[Executor]) -> set[type[fx.Effect[Any]]]:
    return {effect for effect, (part, _) in cls.table.items() if part is None}


def test_each_effect_has_one_handler_on_the_fleets_side() -> None:
    fleet_side = [c for c in executors() if not c.__module__.startswith("rollsafe.verify")]
    names = {c.__name__ for c in fleet_side}
    assert {"_SyncRun", "_AttemptExecutor", "_ProbeRun", "Membership"} <= names
    assert {"RegistryEffects", "EngineEffects", "StepLog", "DeltaLedger", "DeltaSender"} <= names
    handled: dict[type[Any], list[str]] = defaultdict(list)
    for cls in fleet_side:
        for effect in own_handlers(cls):
            handled[effect].append(f"{cls.__module__}.{cls.__name__}")
    twice = {e.__name__: where for e, where in handled.items() if len(where) > 1}
    assert twice == {}, f"effects handled more than once: {twice}"
    unhandled = sorted(e.__name__ for e in effect_classes() if e not in handled)
    assert unhandled == sorted(e.__name__ for e in PERFORMED_BY_THE_ROUND)


def test_the_model_uses_the_registrys_and_the_ledgers_own_handlers() -> None:
    from rollsafe.verify import FleetModel

    shared = RegistryEffects.performs() | DeltaLedger.performs()
    assert fx.SendGroup in shared and fx.RecordVersions in shared and fx.SendBase in shared
    assert not own_handlers(FleetModel) & shared
    for effect in shared:
        part, _ = FleetModel.table[effect]
        assert part in ("registry_effects", "ledger"), effect.__name__
    # every other effect the operations yield is the model's own (the I/O's outcomes)
    assert set(FleetModel.table) == set(effect_classes())


def test_a_second_handler_in_one_table_is_refused() -> None:
    with pytest.raises(TypeError, match="SendGroup is handled both"):

        class Twice(Executor):
            parts = {RegistryEffects: "registry_effects"}

            @handles(fx.SendGroup)
            def send(self, effect: fx.SendGroup) -> fx.Outcome[str]:
                return fx.Ok("active")


def test_an_effect_without_a_handler_is_named() -> None:
    class Small(Executor):
        @handles(fx.Pause)
        def pause(self, effect: fx.Pause) -> fx.Outcome[None]:
            return fx.DONE

    assert Small().perform(fx.Pause()) == fx.DONE
    with pytest.raises(fx.OperationError, match="Small cannot perform Resume"):
        Small().perform(fx.Resume())


def private_reaches(source: str) -> list[str]:
    """``obj._name`` where ``obj`` is not ``self`` / ``cls`` (dunders aside)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            if node.attr.startswith("__"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_private_reach_check_catches_one() -> None:
    assert private_reaches("with self.c._lock: pass") == ["line 1: self.c._lock"]
    assert private_reaches("self._lock.acquire()") == []


@pytest.mark.parametrize("module", sorted(p.name for p in (ROOT / "fleet").glob("*.py")))
def test_no_fleet_class_touches_another_objects_private_members(module: str) -> None:
    found = private_reaches((ROOT / "fleet" / module).read_text())
    assert found == [], f"rollsafe/fleet/{module}: {found}"
