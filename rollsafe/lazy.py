"""Lazy package attributes (PEP 562): a package names its public objects without importing them.

Owns :func:`lazy_attributes`, which builds a package's ``__getattr__`` and ``__dir__`` from a
``{name: module}`` table: a name is imported on first access and cached in the package. A module
that needs an optional dependency which is missing raises
:class:`~rollsafe.errors.MissingExtra` naming the extra. Imports only the standard library.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rollsafe.errors import MissingExtra

__all__ = ["lazy_attributes"]


def lazy_attributes(
    package: str,
    table: Mapping[str, str],
    *,
    public: Iterable[str] = (),
    extras: Mapping[str, str] | None = None,
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` (its ``__name__``).

    ``table`` maps an attribute to the absolute module that defines it; ``public`` (the
    package's ``__all__``) is added to ``dir()``; ``extras`` maps the top-level name of an
    optional dependency to the extra that installs it (``{"httpx": "engine"}``).
    """
    names = frozenset(public)

    def __getattr__(name: str) -> Any:
        module_name = table.get(name)
        if module_name is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            top = (exc.name or "").split(".")[0]
            if extras and top in extras:
                raise MissingExtra(top, extras[top]) from exc
            raise
        value = getattr(module, name)
        setattr(importlib.import_module(package), name, value)  # later lookups skip this
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(importlib.import_module(package))) | names)

    return __getattr__, __dir__
