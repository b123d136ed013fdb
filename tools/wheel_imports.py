#!/usr/bin/env python3
"""What a wheel imports on one code path: the evidence behind a minimal carry lock.

Reads a package's sources out of its wheel **by AST** (nothing is imported, nothing needs a
GPU) and follows the imports from a list of entry modules (the modules a server loads to serve
one model: its CLI, HTTP app, engine, worker, model class, attention backend...):

* an import at module level (outside ``if TYPE_CHECKING``) is **hard**: it runs when the module
  is imported; the closure follows hard edges between the package's own modules;
* one under a module-level ``if`` is **conditional** (the condition is reported: ``if
  has_deep_ep():`` imports only where that package is installed); the closure follows it;
* one inside a ``try`` whose handlers catch ``ImportError`` / ``ModuleNotFoundError`` (or
  ``Exception``) is **guarded**: a missing package is survived;
* one inside a function or method is **lazy**: it runs only when that code runs.

For every third-party top-level module it reports how the reached modules import it (hard,
guarded, lazy) and, for modules *not* reached, where else the package imports it. A
distribution may be left out of a carry when no reached module imports it hard: what the
``--json`` report lists for it is the justification (and a lazy or guarded use on the path is
named, so the run that needs it can be checked). Dynamic imports (``importlib.import_module``
with a literal) are followed like lazy ones.

Usage::

    python tools/wheel_imports.py WHEEL --package vllm --entry vllm.entrypoints.cli.main \
        --entry vllm.model_executor.models.llama [--json out.json]
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ImportSite", "PackageImports", "analyse", "main"]

_IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


@dataclass(frozen=True)
class ImportSite:
    """One import statement: the importing module, the imported name, and how it runs."""

    module: str
    target: str  # dotted name imported (``vllm.config``, ``fastapi``)
    kind: str  # "hard", "conditional", "guarded" or "lazy"
    line: int
    condition: str = ""  # the enclosing ``if`` test of a conditional import


@dataclass
class PackageImports:
    """Every import of one package's modules, read from its wheel."""

    package: str
    modules: dict[str, str] = field(default_factory=dict)  # dotted name -> path in the wheel
    sites: dict[str, list[ImportSite]] = field(default_factory=dict)  # by importing module

    def resolve(self, name: str) -> str | None:
        """The package module a dotted name denotes (the longest existing prefix)."""
        parts = name.split(".")
        while parts:
            candidate = ".".join(parts)
            if candidate in self.modules:
                return candidate
            parts.pop()
        return None

    def parents(self, module: str) -> list[str]:
        """The packages whose ``__init__`` runs before ``module`` (``a``, ``a.b`` of ``a.b.c``)."""
        parts = module.split(".")
        return [".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i])]


def _is_type_checking(test: ast.expr) -> bool:
    text = ast.unparse(test)
    return text in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _guards(handlers: Iterable[ast.ExceptHandler]) -> bool:
    for h in handlers:
        if h.type is None:
            return True
        names = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
        for n in names:
            if isinstance(n, (ast.Name, ast.Attribute)) and ast.unparse(n).split(".")[-1] in (
                _IMPORT_ERRORS
            ):
                return True
    return False


def _imports_of(module: str, tree: ast.Module, is_package: bool) -> list[tuple[str, str, int, str]]:
    """``(target, kind, line, condition)`` for every import in ``tree``."""
    out: list[tuple[str, str, int, str]] = []
    condition = [""]

    def absolute(node: ast.ImportFrom) -> list[str]:
        base = node.module or ""
        if node.level:
            parts = module.split(".")
            keep = len(parts) - node.level + (1 if is_package else 0)
            prefix = ".".join(parts[:keep])
            base = f"{prefix}.{base}" if base else prefix
        # ``from a import b`` may import the submodule a.b: record both candidates
        return [base] + [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]

    def visit(stmts: list[ast.stmt], kind: str) -> None:
        for node in stmts:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    out.append((alias.name, kind, node.lineno, condition[0]))
            elif isinstance(node, ast.ImportFrom):
                for target in absolute(node):
                    out.append((target, kind, node.lineno, condition[0]))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(node.body, "lazy")
            elif isinstance(node, ast.ClassDef):
                visit(node.body, kind)
            elif isinstance(node, ast.If):
                if _is_type_checking(node.test):
                    continue
                inner = "conditional" if kind == "hard" else kind
                saved = condition[0]
                if kind == "hard":
                    condition[0] = ast.unparse(node.test)[:80]
                visit(node.body, inner)
                if kind == "hard":
                    condition[0] = f"not ({condition[0]})"
                visit(node.orelse, inner)
                condition[0] = saved
            elif isinstance(node, ast.Try):
                guarded = "guarded" if kind == "hard" and _guards(node.handlers) else kind
                visit(node.body, guarded)
                visit(node.orelse, kind)
                visit(node.finalbody, kind)
                for h in node.handlers:
                    visit(h.body, kind)
            elif isinstance(node, (ast.With, ast.AsyncWith, ast.For, ast.AsyncFor, ast.While)):
                visit(node.body, kind)
                visit(getattr(node, "orelse", []), kind)
            # dynamic imports with a literal name
            for sub in ast.walk(node) if not isinstance(node, (ast.Import, ast.ImportFrom)) else []:
                if (
                    isinstance(sub, ast.Call)
                    and ast.unparse(sub.func) in ("importlib.import_module", "import_module")
                    and sub.args
                    and isinstance(sub.args[0], ast.Constant)
                    and isinstance(sub.args[0].value, str)
                    and not sub.args[0].value.startswith(".")
                ):
                    out.append((sub.args[0].value, "lazy", sub.lineno, ""))

    visit(tree.body, "hard")
    return out


def read_wheel(wheel: Path, package: str) -> PackageImports:
    """Every module of ``package`` in ``wheel`` and every import it makes."""
    result = PackageImports(package)
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.startswith(f"{package}/") and n.endswith(".py")]
        for name in names:
            dotted = name[:-3].replace("/", ".")
            is_package = dotted.endswith(".__init__")
            if is_package:
                dotted = dotted[: -len(".__init__")]
            result.modules[dotted] = name
        for name in names:
            dotted = name[:-3].replace("/", ".")
            is_package = dotted.endswith(".__init__")
            if is_package:
                dotted = dotted[: -len(".__init__")]
            try:
                tree = ast.parse(zf.read(name), filename=name)
            except SyntaxError:
                continue
            sites = []
            seen: set[tuple[str, str]] = set()
            for target, kind, line, cond in _imports_of(dotted, tree, is_package):
                if (target, kind) in seen:
                    continue
                seen.add((target, kind))
                sites.append(ImportSite(dotted, target, kind, line, cond))
            result.sites[dotted] = sites
    return result


def closure(
    imports: PackageImports, entries: Iterable[str], kinds: frozenset[str] = frozenset({"hard"})
) -> set[str]:
    """The package's modules that importing ``entries`` runs, following the package's own
    imports of the given ``kinds`` (``{"hard"}``: certainly run; with ``"conditional"`` and
    ``"guarded"``: possibly run)."""
    todo = []
    for entry in entries:
        resolved = imports.resolve(entry)
        if resolved is None:
            raise SystemExit(f"entry module {entry} is not in the wheel")
        todo.append(resolved)
    seen: set[str] = set()
    while todo:
        module = todo.pop()
        for m in [*imports.parents(module), module]:
            if m in seen or m not in imports.modules:
                continue
            seen.add(m)
            for site in imports.sites.get(m, []):
                internal = site.target == imports.package or site.target.startswith(
                    imports.package + "."
                )
                if site.kind not in kinds or not internal:
                    continue
                target = imports.resolve(site.target)
                if target is not None and target not in seen:
                    todo.append(target)
    return seen


def analyse(wheel: Path, package: str, entries: list[str]) -> dict[str, object]:
    """The report: reached modules and, per third-party top-level module, its import sites on
    the path (hard / guarded / lazy) and off it."""
    imports = read_wheel(wheel, package)
    certain = closure(imports, entries)
    possible = closure(imports, entries, frozenset({"hard", "conditional", "guarded"}))
    external: dict[str, dict[str, list[str]]] = {}
    for module, sites in imports.sites.items():
        for site in sites:
            top = site.target.split(".")[0]
            if not top or top == package or top in sys.stdlib_module_names or top == "__future__":
                continue
            if module in certain:
                where = "path"
            elif module in possible:
                where = "maybe"  # a module the path imports only under a condition or a try
            else:
                where = "elsewhere"
            key = f"{where}_{site.kind}"
            note = f" (if {site.condition})" if site.condition else ""
            external.setdefault(top, {}).setdefault(key, []).append(f"{module}:{site.line}{note}")
    for entry in external.values():
        for key in entry:
            entry[key] = sorted(set(entry[key]))
    return {
        "package": package,
        "wheel": wheel.name,
        "entries": entries,
        "reached_modules": len(certain),
        "possibly_reached_modules": len(possible),
        "external": dict(sorted(external.items())),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheel", type=Path)
    ap.add_argument("--package", required=True)
    ap.add_argument("--entry", action="append", required=True, help="entry module (repeat)")
    ap.add_argument("--json", type=Path, help="write the full report here")
    args = ap.parse_args(argv)
    report = analyse(args.wheel, args.package, args.entry)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    external = report["external"]
    assert isinstance(external, dict)
    print(
        f"{report['reached_modules']} modules of {args.package} certainly and "
        f"{report['possibly_reached_modules']} possibly reached from {len(args.entry)} entries"
    )
    for top, kinds in external.items():
        print(f"  {top:34s} {status_of(kinds)}")
    return 0


def status_of(kinds: dict[str, list[str]]) -> str:
    """``HARD`` (a certainly run module imports it at module level) or what else uses it."""
    if "path_hard" in kinds:
        return "HARD"
    on_path = sorted(k[5:] for k in kinds if k.startswith("path_"))
    maybe = sorted(k[6:] for k in kinds if k.startswith("maybe_"))
    parts = ([f"path:{','.join(on_path)}"] if on_path else []) + (
        [f"maybe:{','.join(maybe)}"] if maybe else []
    )
    return " ".join(parts) or "off-path"


if __name__ == "__main__":
    sys.exit(main())
