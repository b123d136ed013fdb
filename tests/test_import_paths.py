"""One import path per public name (docs/architecture.md, "Import paths").

A public name is one a module lists in ``__all__``. It may be listed by the module that defines
it and by the packages above that module (``rollsafe.fleet`` lists ``RolloutFleet`` from
``rollsafe.fleet.fleet``: the documented path), nowhere else: no alias modules, no sibling or
cross-layer re-exports.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

import rollsafe

#: modules whose imports need an optional dependency this environment may lack
_OPTIONAL = {"ray", "checkpoint_engine", "prometheus_client", "trl", "vllm"}


def _listings() -> dict[tuple[str, int], tuple[Any, list[str]]]:
    names = [rollsafe.__name__] + [
        info.name
        for info in pkgutil.walk_packages(rollsafe.__path__, prefix="rollsafe.")
        if not info.name.endswith("__main__")
    ]
    found: dict[tuple[str, int], tuple[Any, list[str]]] = {}
    for name in names:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.split(".")[0] in _OPTIONAL:
                continue
            raise
        for public in getattr(module, "__all__", ()):
            obj = getattr(module, public)
            found.setdefault((public, id(obj)), (obj, []))[1].append(name)
    return found


def _off_path() -> dict[str, list[str]]:
    """Public name -> the modules that list it although they neither define it nor contain
    (as a package) the module that does."""
    off: dict[str, list[str]] = {}
    for (public, _), (obj, modules) in _listings().items():
        if len(modules) < 2:
            continue
        home = getattr(obj, "__module__", None)
        if not (isinstance(home, str) and home in modules):
            home = max(modules, key=lambda m: m.count("."))  # a constant: the deepest lister
        extra = [m for m in modules if m != home and not home.startswith(m + ".")]
        if extra:
            off[public] = sorted(extra)
    return off


def test_every_public_name_has_one_import_path() -> None:
    off = _off_path()
    assert not off, f"public names listed off their one import path: {off}"


def test_the_removed_alias_modules_are_gone() -> None:
    for gone in (
        "rollsafe.transports.bucket",
        "rollsafe.hf.safejson",
        "rollsafe.adapters.engines.client",
    ):
        try:
            importlib.import_module(gone)
        except ModuleNotFoundError:
            continue
        raise AssertionError(f"{gone} is importable again (an alias of another module)")
