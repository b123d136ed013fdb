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
* one inside a function or method is **lazy**: it runs only when that code runs, unless the
  function is a **start function** (``--start module:function``, or the spec's ``[imports]
  start_functions``: what the server calls at every start, such as vLLM's ``build_app``): its
  imports, and those of the package functions it calls (followed through imports and
  re-exports), are hard (conditional under an ``if``, guarded in a ``try``); their nested
  functions stay lazy;
* a **LazyLoader** (``x = LazyLoader("x", globals(), "pkg")``, also in the ``else`` of ``if
  TYPE_CHECKING``) imports ``pkg`` when an attribute of ``x`` is read: a read where the module
  or a class body runs (a class-body or parameter annotation included, unless the module has
  ``from __future__ import annotations``; Python <= 3.13 evaluates them), a decorator or a
  default is as hard as an import there; the binding alone is lazy.

For every third-party top-level module it reports how the reached modules import it (hard,
guarded, lazy) and, for modules *not* reached, where else the package imports it. A
distribution may be left out of a carry when no reached module imports it hard: what the
``--json`` report lists for it is the justification (and a lazy or guarded use on the path is
named, so the run that needs it can be checked). Dynamic imports (``importlib.import_module``
with a literal) are followed like lazy ones.

Usage::

    python tools/wheel_imports.py WHEEL --package vllm --entry vllm.entrypoints.cli.main \
        --entry vllm.model_executor.models.llama [--start MODULE:FUNCTION] [--json out.json]
    python tools/wheel_imports.py WHEEL --spec constraints/gpu/vllm-0.26.0.toml  # its [imports]
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    via: str = ""  # not an import statement: a LazyLoader read, a start function's import


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


def _future_annotations(tree: ast.Module) -> bool:
    """Whether the module defers its annotations (``from __future__ import annotations``)."""
    return any(
        isinstance(node, ast.ImportFrom)
        and node.module == "__future__"
        and any(a.name == "annotations" for a in node.names)
        for node in tree.body
    )


def _lazy_loader_target(value: ast.expr | None, loaders: frozenset[str]) -> str | None:
    """The module a ``LazyLoader("x", globals(), "pkg.mod")`` call binds, else ``None``."""
    if not isinstance(value, ast.Call) or ast.unparse(value.func).split(".")[-1] not in loaders:
        return None
    arg: ast.expr | None = value.args[2] if len(value.args) >= 3 else None
    for kw in value.keywords:
        if kw.arg in ("name", "module_name"):
            arg = kw.value
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    return None


def _evaluated(node: ast.stmt, future: bool) -> list[ast.AST]:
    """The parts of ``node`` that run when the enclosing block runs: a ``def``'s decorators,
    defaults and (unless annotations are deferred) its annotations, never its body; a class's
    decorators, bases and keywords (its body is a block of its own); a compound statement's
    header; a simple statement whole (an ``x: T = v``'s annotation unless deferred)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        out: list[ast.AST] = [*node.decorator_list, *node.args.defaults]
        out += [d for d in node.args.kw_defaults if d is not None]
        if not future:
            a = node.args
            every = [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
            out += [x.annotation for x in every if x is not None and x.annotation is not None]
            out += [node.returns] if node.returns is not None else []
        return out
    if isinstance(node, ast.ClassDef):
        return [*node.decorator_list, *node.bases, *(k.value for k in node.keywords)]
    if isinstance(node, (ast.If, ast.While)):
        return [node.test]
    if isinstance(node, (ast.For, ast.AsyncFor)):
        return [node.iter]
    if isinstance(node, (ast.With, ast.AsyncWith)):
        return [item.context_expr for item in node.items]
    if isinstance(node, (ast.Try, ast.Import, ast.ImportFrom)):
        return []
    if isinstance(node, ast.AnnAssign):
        parts: list[ast.AST] = [] if future else [node.annotation]
        return parts + ([node.value] if node.value is not None else [])
    return [node]


def _walk_now(root: ast.AST) -> Iterable[ast.AST]:
    """``ast.walk`` less what does not run now: lambda bodies, nested ``def`` and class bodies."""
    todo = [root]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.Lambda):
            todo.extend(node.args.defaults)
            continue
        if node is not root and isinstance(
            node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        ):
            continue
        todo.extend(ast.iter_child_nodes(node))


@dataclass(frozen=True)
class _Call:
    """A call that runs when its block runs: the called expression, how it runs."""

    func: str  # the called expression as written (``register_routers``, ``mod.attach``)
    kind: str
    line: int
    condition: str


def _imports_of(
    module: str,
    tree: ast.Module,
    is_package: bool,
    *,
    body: list[ast.stmt] | None = None,
    kind: str = "hard",
    bindings: dict[str, str] | None = None,
    loaders: frozenset[str] = frozenset({"LazyLoader"}),
    calls: list[_Call] | None = None,
) -> list[tuple[str, str, int, str, str]]:
    """``(target, kind, line, condition, via)`` for every import in ``tree`` (or in ``body``, a
    function's statements run as ``kind``). ``bindings`` collects the module's LazyLoader
    names (name -> module); reading an attribute of one where the block runs imports it then.
    ``calls`` collects the calls that run with the block (for start functions)."""
    out: list[tuple[str, str, int, str, str]] = []
    condition = [""]
    future = _future_annotations(tree)
    lazy = bindings if bindings is not None else {}

    def absolute(node: ast.ImportFrom) -> list[str]:
        base = _absolute(module, is_package, node)
        # ``from a import b`` may import the submodule a.b: record both candidates
        return [base] + [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]

    def runs_now(node: ast.stmt, kind: str) -> None:
        """LazyLoader bindings made, LazyLoader attributes read and calls made by ``node``
        itself (not its nested blocks) when it runs as ``kind``."""
        if kind == "lazy":
            return
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            target = _lazy_loader_target(node.value, loaders)
            names = node.targets if isinstance(node, ast.Assign) else [node.target]
            if target is not None:
                for name in names:
                    if isinstance(name, ast.Name):
                        lazy[name.id] = target
                        out.append((target, "lazy", node.lineno, "", "LazyLoader"))
        for part in _evaluated(node, future):
            for sub in _walk_now(part):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id in lazy
                    and isinstance(sub.ctx, ast.Load)
                ):
                    via = f"LazyLoader {sub.value.id}.{sub.attr}"
                    out.append((lazy[sub.value.id], kind, sub.lineno, condition[0], via))
                elif calls is not None and isinstance(sub, ast.Call):
                    calls.append(_Call(ast.unparse(sub.func), kind, sub.lineno, condition[0]))

    def visit(stmts: list[ast.stmt], kind: str) -> None:
        for node in stmts:
            runs_now(node, kind)
            if isinstance(node, ast.Import):
                for alias in node.names:
                    out.append((alias.name, kind, node.lineno, condition[0], ""))
            elif isinstance(node, ast.ImportFrom):
                for target in absolute(node):
                    out.append((target, kind, node.lineno, condition[0], ""))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(node.body, "lazy")
            elif isinstance(node, ast.ClassDef):
                visit(node.body, kind)
            elif isinstance(node, ast.If):
                if _is_type_checking(node.test):
                    # the body never runs; the ``else`` always does (LazyLoader bindings)
                    visit(node.orelse, kind)
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
                    out.append((sub.args[0].value, "lazy", sub.lineno, "", ""))

    visit(tree.body if body is None else body, kind)
    return out


def read_wheel(
    wheel: Path,
    package: str,
    start_functions: Iterable[str] = (),
    loaders: frozenset[str] = frozenset({"LazyLoader"}),
) -> PackageImports:
    """Every module of ``package`` in ``wheel`` and every import it makes; the imports of
    ``start_functions`` (``module:function``, run by the server at every start) and of the
    package functions they call count as made where those functions are defined."""
    result = PackageImports(package)
    trees: dict[str, tuple[ast.Module, bool]] = {}
    bindings: dict[str, dict[str, str]] = {}
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.startswith(f"{package}/") and n.endswith(".py")]
        for name in names:
            dotted = name[:-3].replace("/", ".")
            is_package = dotted.endswith(".__init__")
            if is_package:
                dotted = dotted[: -len(".__init__")]
            result.modules[dotted] = name
            try:
                trees[dotted] = (ast.parse(zf.read(name), filename=name), is_package)
            except SyntaxError:
                continue
    for dotted, (tree, is_package) in trees.items():
        bindings[dotted] = {}
        found = _imports_of(dotted, tree, is_package, bindings=bindings[dotted], loaders=loaders)
        result.sites[dotted] = _dedup(dotted, found)
    for module, found in _start_imports(result, trees, bindings, start_functions, loaders):
        known = result.sites.setdefault(module, [])
        known += _dedup(module, found, {(s.target, s.kind) for s in known})
    return result


def _dedup(
    module: str,
    found: Iterable[tuple[str, str, int, str, str]],
    known: set[tuple[str, str]] | None = None,
) -> list[ImportSite]:
    seen = set(known or ())
    sites = []
    for target, kind, line, cond, via in found:
        if (target, kind) in seen:
            continue
        seen.add((target, kind))
        sites.append(ImportSite(module, target, kind, line, cond, via))
    return sites


#: how surely a start function's call runs (a callee reached two ways keeps the surer)
_RANK = {"hard": 0, "conditional": 1, "guarded": 2}


def _start_imports(
    imports: PackageImports,
    trees: dict[str, tuple[ast.Module, bool]],
    bindings: dict[str, dict[str, str]],
    start_functions: Iterable[str],
    loaders: frozenset[str],
) -> list[tuple[str, list[tuple[str, str, int, str, str]]]]:
    """The imports that the start functions and their package callees run, per module.

    A start function's body runs as ``hard`` (an ``if`` in it: conditional; a ``try`` catching
    ``ImportError``: guarded); a package function it calls (resolved through the module's and
    the function's own imports, re-exports followed two deep) runs as the call does; nested
    functions stay lazy."""
    todo: list[tuple[str, str, str, str]] = []  # module, qualname, kind, chain
    for spec in start_functions:
        module, _, qualname = spec.partition(":")
        if module not in trees or _function(trees[module][0], qualname) is None:
            raise SystemExit(f"start function {spec} is not in the wheel")
        todo.append((module, qualname, "hard", spec))
    done: dict[tuple[str, str], str] = {}
    extra: dict[str, list[tuple[str, str, int, str, str]]] = {}
    while todo:
        module, qualname, kind, chain = todo.pop()
        key = (module, qualname)
        if key in done and _RANK[done[key]] <= _RANK[kind]:
            continue
        done[key] = kind
        tree, is_package = trees[module]
        fn = _function(tree, qualname)
        if fn is None:
            continue
        calls: list[_Call] = []
        found = _imports_of(
            module,
            tree,
            is_package,
            body=fn.body,
            kind=kind,
            bindings=dict(bindings.get(module, {})),
            loaders=loaders,
            calls=calls,
        )
        via = f"at start: {chain}"
        extra.setdefault(module, []).extend(
            (t, k, line, c, f"{v}; {via}" if v else via)
            for t, k, line, c, v in found
            if k != "lazy"
        )
        names = _names(module, tree, is_package, fn)
        for call in calls:
            callee = _resolve_call(imports, trees, names, call.func)
            if callee is not None and call.kind in _RANK:
                todo.append((*callee, call.kind, f"{chain} -> {callee[0]}:{callee[1]}"))
    return sorted(extra.items())


def _function(tree: ast.Module, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The ``def`` of ``qualname`` (``f`` or ``Class.f``) at the top of ``tree``."""
    scope: list[ast.stmt] = tree.body
    parts = qualname.split(".")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        for node in scope:
            if last and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.name == part:
                    return node
            elif not last and isinstance(node, ast.ClassDef) and node.name == part:
                scope = node.body
                break
        else:
            return None
    return None


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    base = node.module or ""
    if node.level:
        parts = module.split(".")
        keep = len(parts) - node.level + (1 if is_package else 0)
        prefix = ".".join(parts[:keep])
        base = f"{prefix}.{base}" if base else prefix
    return base


def _names(
    module: str,
    tree: ast.Module,
    is_package: bool,
    fn: ast.FunctionDef | ast.AsyncFunctionDef | None = None,
) -> dict[str, str]:
    """What the names a function can call denote (dotted): the module's top-level ``def``s and
    imports, then the function's own imports (which shadow them)."""
    out: dict[str, str] = {}
    blocks: list[list[ast.stmt]] = [tree.body] + ([fn.body] if fn is not None else [])
    for block in blocks:
        for node in _flat(block):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and block is tree.body:
                out[node.name] = f"{module}.{node.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    top = alias.name.split(".")[0]
                    out[alias.asname or top] = alias.name if alias.asname else top
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(module, is_package, node)
                for alias in node.names:
                    if alias.name != "*":
                        out[alias.asname or alias.name] = f"{base}.{alias.name}"
    return out


def _flat(block: list[ast.stmt]) -> Iterable[ast.stmt]:
    """The statements of ``block`` and of its ``if`` / ``try`` / ``with`` / loop blocks (not
    of nested ``def`` or class bodies)."""
    for node in block:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With, ast.AsyncWith, ast.For, ast.While)):
            for name in ("body", "orelse", "finalbody"):
                yield from _flat(getattr(node, name, []))
            for h in getattr(node, "handlers", []):
                yield from _flat(h.body)


def _resolve_call(
    imports: PackageImports,
    trees: dict[str, tuple[ast.Module, bool]],
    names: dict[str, str],
    func: str,
    depth: int = 0,
) -> tuple[str, str] | None:
    """The package function ``(module, name)`` a call of ``func`` runs, if it is one."""
    head, _, rest = func.partition(".")
    if head not in names:
        return None
    dotted = names[head] + (f".{rest}" if rest else "")
    if not dotted.startswith(imports.package + ".") or dotted in trees:
        return None  # another package's, or a module (not a function)
    module = imports.resolve(dotted)
    if module is None or module not in trees:
        return None
    name = dotted[len(module) + 1 :]
    if "." in name:
        return None
    tree, is_package = trees[module]
    if _function(tree, name) is not None:
        return module, name
    if depth < 2:  # re-exported: ``from .impl import f`` in a package's __init__
        return _resolve_call(imports, trees, _names(module, tree, is_package), name, depth + 1)
    return None


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


def analyse(
    wheel: Path,
    package: str,
    entries: list[str],
    start_functions: Sequence[str] = (),
    loaders: Sequence[str] = ("LazyLoader",),
) -> dict[str, object]:
    """The report: reached modules and, per third-party top-level module, its import sites on
    the path (hard / guarded / lazy) and off it."""
    imports = read_wheel(wheel, package, start_functions, frozenset(loaders))
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
            note += f" ({site.via})" if site.via else ""
            external.setdefault(top, {}).setdefault(key, []).append(f"{module}:{site.line}{note}")
    for entry in external.values():
        for key in entry:
            entry[key] = sorted(set(entry[key]))
    return {
        "package": package,
        "wheel": wheel.name,
        "entries": entries,
        "start_functions": list(start_functions),
        "reached_modules": len(certain),
        "possibly_reached_modules": len(possible),
        "external": dict(sorted(external.items())),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheel", type=Path)
    ap.add_argument("--package", help="the package (default: the spec's [imports] package)")
    ap.add_argument("--entry", action="append", default=[], help="entry module (repeat)")
    ap.add_argument(
        "--start",
        action="append",
        default=[],
        help="module:function the server calls at every start (repeat); its imports and its "
        "package callees' count as hard",
    )
    ap.add_argument(
        "--spec",
        type=Path,
        help="a carry spec (constraints/gpu/*.toml): its [imports] package, entries, "
        "start_functions and lazy_loaders are used besides the flags",
    )
    ap.add_argument("--json", type=Path, help="write the full report here")
    args = ap.parse_args(argv)
    table: dict[str, Any] = {}
    if args.spec is not None:
        import tomllib

        with args.spec.open("rb") as f:
            table = tomllib.load(f).get("imports", {})
    package = args.package or table.get("package")
    entries = [*table.get("entries", []), *args.entry]
    if not package or not entries:
        ap.error("--package and --entry (or a --spec with an [imports] table) are needed")
    args.package, args.entry = package, entries
    report = analyse(
        args.wheel,
        package,
        entries,
        [*table.get("start_functions", []), *args.start],
        table.get("lazy_loaders", ["LazyLoader"]),
    )
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
