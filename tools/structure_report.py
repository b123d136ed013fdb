#!/usr/bin/env python3
"""How the package is put together, in numbers (issue #34's before/after figures).

Static part (reads the source, runs nothing of it):

* ``import_cycles``: circles in the module import graph of ``rollsafe`` (module- and
  function-level imports, relative ones included; imports under ``if TYPE_CHECKING:`` never run
  and are left out), each as its modules;
* ``handlers_per_effect``: for every effect class of ``rollsafe.operations.effects``, the places
  in ``rollsafe/`` that handle it (a handler-table key ``fx.Name:``, an ``isinstance(effect,
  fx.Name)`` test, or a ``@handles(fx.Name)`` declaration), split into the fleet's side and the
  verifier's;
* ``executors``: the classes that perform effects (they hold such handlers);
* ``rolloutfleet``: ``RolloutFleet``'s lines and public names (methods, properties, attributes
  it sets on ``self``);
* ``type_ignores``: ``# type: ignore`` comments, in ``rollsafe/`` and in ``rollsafe/operations/``.

Dynamic part (``--trace``): a real fleet of two reference-engine groups (a tiny model, ``ipc``
on the CPU) syncs once, then one group's engine is SIGKILLed and recovered; every ``rollsafe``
module whose code ran in the driver process (any thread) during the sync and during the
recovery is counted.

Usage: ``python tools/structure_report.py [--trace] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "rollsafe"


# ============================================================================ the import graph
def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Line numbers inside ``if TYPE_CHECKING:`` blocks."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                for child in node.body:
                    for sub in ast.walk(child):
                        if hasattr(sub, "lineno"):
                            lines.add(sub.lineno)
    return lines


def imports_of(name: str, path: Path, known: set[str], *, typing: bool = False) -> set[str]:
    """The ``rollsafe`` modules ``name`` imports (``typing``: those under TYPE_CHECKING too)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = set() if typing else _type_checking_lines(tree)
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()

    def add(target: str) -> None:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)

    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("rollsafe"):
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name if is_pkg else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            if not mod.startswith("rollsafe"):
                continue
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                add(sub if sub in known else mod)
    return out


def import_cycles(*, typing: bool = False) -> list[list[str]]:
    """Strongly connected modules of the import graph (``typing``: TYPE_CHECKING imports too)."""
    mods = modules()
    known = set(mods)
    graph = {m: imports_of(m, p, known, typing=typing) for m, p in mods.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


# ============================================================================ effects and handlers
def effect_names() -> list[str]:
    tree = ast.parse((PACKAGE / "operations" / "effects.py").read_text())
    names = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            bases = {ast.unparse(b).split("[")[0] for b in node.bases}
            if "Effect" in bases:
                names.append(node.name)
    return names


def _effect_ref(node: ast.AST, effects: set[str]) -> str | None:
    """``fx.Name`` / ``effects.Name`` / ``Name`` naming an effect class."""
    if isinstance(node, ast.Attribute) and node.attr in effects:
        return node.attr
    if isinstance(node, ast.Name) and node.id in effects:
        return node.id
    return None


def handlers() -> tuple[dict[str, dict[str, list[str]]], list[str]]:
    """Effect -> side (fleet / verify / operations ...) -> ``module:Class`` places."""
    effects = set(effect_names())
    table: dict[str, dict[str, list[str]]] = {e: defaultdict(list) for e in effects}
    executors: set[str] = set()
    for mod, path in modules().items():
        if mod == "rollsafe.operations.effects":
            continue
        tree = ast.parse(path.read_text())
        side = [*mod.split("."), "root"][1]
        for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
            owner = cls.name
            for top in cls.body:
                for node in ast.walk(top):
                    hits: list[str] = []
                    if isinstance(node, ast.Dict):
                        hits += [
                            h for k in node.keys if k is not None and (h := _effect_ref(k, effects))
                        ]
                    elif (
                        isinstance(node, ast.Call)
                        and isinstance(node.func, ast.Name)
                        and node.func.id == "isinstance"
                        and len(node.args) == 2
                        and isinstance(node.args[0], ast.Name)
                        and node.args[0].id == "effect"
                    ):
                        ref = _effect_ref(node.args[1], effects)
                        hits += [ref] if ref else []
                    elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("handles"):
                        hits += [h for a in node.args if (h := _effect_ref(a, effects))]
                    for hit in hits:
                        place = f"{mod}:{owner}"
                        if place not in table[hit][side]:
                            table[hit][side].append(place)
                        executors.add(place)
    return {e: dict(v) for e, v in sorted(table.items())}, sorted(executors)


def executor_tables() -> dict[str, Any] | None:
    """From the code itself, where it has executors (``rollsafe.operations.executor``): each
    executor class, and each effect's handlers (the class that handles it, not the ones that
    hold that class as a part). None for a tree from before the executor shape."""
    import importlib
    import pkgutil

    try:
        from rollsafe.operations.executor import Executor
    except ImportError:
        return None
    import rollsafe

    for info in pkgutil.walk_packages(rollsafe.__path__, prefix="rollsafe."):
        if not info.name.endswith("__main__"):
            try:
                importlib.import_module(info.name)
            except ImportError:
                continue
    classes: list[type] = []
    todo = list(Executor.__subclasses__())
    while todo:
        cls = todo.pop()
        classes.append(cls)
        todo.extend(cls.__subclasses__())
    handled: dict[str, list[str]] = defaultdict(list)
    for cls in classes:
        for effect, (part, _) in cls.table.items():
            if part is None:
                handled[effect.__name__].append(f"{cls.__module__}:{cls.__name__}")
    return {
        "executors": sorted(f"{c.__module__}:{c.__name__}" for c in classes),
        "handlers": {e: sorted(v) for e, v in sorted(handled.items())},
    }


# ============================================================================ RolloutFleet
def rolloutfleet() -> dict[str, Any]:
    for path in (PACKAGE / "fleet").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == "RolloutFleet":
                methods = [
                    n.name
                    for n in node.body
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and not n.name.startswith("_")
                ]
                attrs: set[str] = set()
                for sub in ast.walk(node):
                    targets = []
                    if isinstance(sub, ast.Assign):
                        targets = sub.targets
                    elif isinstance(sub, ast.AnnAssign):
                        targets = [sub.target]
                    for t in targets:
                        if (
                            isinstance(t, ast.Attribute)
                            and isinstance(t.value, ast.Name)
                            and t.value.id == "self"
                            and not t.attr.startswith("_")
                        ):
                            attrs.add(t.attr)
                attrs -= set(methods)
                return {
                    "module": module_name(path),
                    "lines": (node.end_lineno or node.lineno) - node.lineno + 1,
                    "public_methods": len(methods),
                    "public_attributes": len(attrs),
                    "methods": sorted(methods),
                    "attributes": sorted(attrs),
                }
    return {}


def type_ignores() -> dict[str, int]:
    total = ops = 0
    for path in PACKAGE.rglob("*.py"):
        n = path.read_text().count("type: ignore")
        total += n
        if "operations" in path.parts:
            ops += n
    return {"rollsafe": total, "rollsafe/operations": ops}


# ============================================================================ the trace
def trace_modules() -> dict[str, Any]:
    """Modules whose code ran in the driver during one sync and during one recovery."""
    import tempfile
    import threading
    import time

    from rollsafe.adapters.reference_engine.tiny_model import make_tiny_model
    from rollsafe.fleet import FleetConfig, GroupSpec, RolloutFleet

    seen: set[str] = set()

    def profiler(frame: Any, event: str, _arg: Any) -> None:
        if event == "call":
            mod = frame.f_globals.get("__name__", "")
            if mod.startswith("rollsafe"):
                seen.add(mod)

    def traced(fn: Any) -> set[str]:
        seen.clear()
        threading.setprofile(profiler)
        sys.setprofile(profiler)
        try:
            fn()
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
        return set(seen)

    with tempfile.TemporaryDirectory(prefix="rollsafe-structure-") as tmp:
        model = Path(tmp) / "model"
        make_tiny_model(model)
        config = FleetConfig(
            model_path=model,
            export_root=Path(tmp) / "exports",
            groups=[GroupSpec(1), GroupSpec(1)],
            transport="nccl",
            enable_immediate_recovery=True,
        )
        from safetensors.torch import load_file

        weights = {}
        for f in sorted(model.glob("*.safetensors")):
            weights.update(load_file(str(f)))
        with RolloutFleet(config) as fleet:
            new = {k: v + 0.01 for k, v in weights.items()}

            def sync() -> None:
                fleet.sync_weights(new, version=1)
                assert fleet.exporter is not None
                fleet.exporter.wait_hf_export(1, timeout=60)

            sync_mods = traced(sync)
            launcher = fleet.launcher("g1")

            def recover() -> None:
                launcher.kill_rank(0)
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    recs = fleet.recoveries()
                    if recs and recs[-1].status in ("active", "failed", "retired"):
                        return
                    time.sleep(0.05)
                raise RuntimeError("no recovery within 120 s")

            rec_mods = traced(recover)
    return {
        "sync_modules": len(sync_mods),
        "recovery_modules": len(rec_mods),
        "sync": sorted(sync_mods),
        "recovery": sorted(rec_mods),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", action="store_true", help="also run a real fleet and trace")
    parser.add_argument("--json", type=Path, help="write the full report here")
    args = parser.parse_args()
    table, executors = handlers()
    report: dict[str, Any] = {
        "import_cycles": import_cycles(),
        "import_cycles_with_typing": import_cycles(typing=True),
        "handlers_per_effect": table,
        "executors": executors,
        "rolloutfleet": rolloutfleet(),
        "type_ignores": type_ignores(),
        "executor_tables": executor_tables(),
    }
    if args.trace:
        report["trace"] = trace_modules()
    for key, what in (
        ("import_cycles", "import cycles (imports that run)"),
        ("import_cycles_with_typing", "import cycles counting TYPE_CHECKING imports"),
    ):
        cycles = report[key]
        print(f"{what}: {len(cycles)}")
        for c in cycles:
            print(f"  {len(c)}: {', '.join(c)}")
    print(f"executors (classes handling effects): {len(executors)}")
    for e in executors:
        print(f"  {e}")
    for label, keep in (("fleet side", lambda k: k != "verify"), ("fleet and verifier", bool)):
        multi = {
            e: [p for k, v in s.items() if keep(k) for p in v]
            for e, s in table.items()
            if sum(len(v) for k, v in s.items() if keep(k)) > 1
        }
        print(f"effects handled in more than one place ({label}): {len(multi)} of {len(table)}")
        for e, places in multi.items():
            print(f"  {e}: {len(places)}: {', '.join(places)}")
    tables = report["executor_tables"]
    if tables is not None:
        fleet_side = {
            e: [w for w in where if not w.startswith("rollsafe.verify")]
            for e, where in tables["handlers"].items()
        }
        twice = {e: w for e, w in fleet_side.items() if len(w) > 1}
        print(f"executor tables (from the code): {len(tables['executors'])} executor classes")
        print(f"  effects with more than one fleet-side handler: {len(twice)} {twice or ''}")
        verify_only = sorted(
            e for e, where in tables["handlers"].items() if all("verify" not in w for w in where)
        )
        print(f"  effects the verifier performs with the fleet's own handler: {verify_only}")
    rf = report["rolloutfleet"]
    print(
        f"RolloutFleet: {rf.get('lines')} lines, {rf.get('public_methods')} public methods, "
        f"{rf.get('public_attributes')} public attributes ({rf.get('module')})"
    )
    ti = report["type_ignores"]
    print(
        f"type: ignore: {ti['rollsafe']} in rollsafe/, {ti['rollsafe/operations']} in operations/"
    )
    if args.trace:
        tr = report["trace"]
        print(
            f"modules run in the driver: sync {tr['sync_modules']}, "
            f"recovery {tr['recovery_modules']}"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
