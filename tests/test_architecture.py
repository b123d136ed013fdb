"""The layer rule of ``docs/architecture.md``, enforced: no module imports a higher layer or
another unit of its own layer. The diagram in the doc is the single source of the layers."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "rollsafe"


def layers_from_doc(text: str) -> dict[str, int]:
    """``{unit (dotted module prefix): layer}`` from the doc's mermaid block."""
    block = re.search(r"```mermaid\n(.*?)```", text, re.S)
    assert block is not None, f"{DOC} has no mermaid block"
    units: dict[str, int] = {}
    layer: int | None = None
    for line in block.group(1).splitlines():
        if m := re.match(r"\s*subgraph L(\d+)\[", line):
            layer = int(m.group(1))
        elif re.match(r"\s*end\s*$", line):
            layer = None
        elif (m := re.match(r'\s*\w+\["(rollsafe[\w.]*)"\]\s*$', line)) and layer is not None:
            assert m.group(1) not in units, f"{m.group(1)} is drawn twice"
            units[m.group(1)] = layer
    return units


def exceptions_from_doc(text: str) -> set[tuple[str, str]]:
    """(importer module, imported unit) pairs of the doc's "Allowed exceptions" table."""
    section = text.split("Allowed exceptions", 1)[1] if "Allowed exceptions" in text else ""
    table = re.search(r"^(\|.*\n)+", section, re.M)  # the first table after the heading
    rows = table.group(0) if table else ""
    return set(re.findall(r"^\| `(rollsafe[\w.]*)` \| `(rollsafe[\w.]*)` \|", rows, re.M))


def unit_of(module: str, units: dict[str, int]) -> str | None:
    """The longest unit that is ``module`` or a package above it."""
    best = None
    for unit in units:
        if (module == unit or module.startswith(unit + ".")) and (
            best is None or len(unit) > len(best)
        ):
            best = unit
    return best


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: Path, module: str | None = None) -> list[tuple[int, str]]:
    """(line, imported module) of every rollsafe import that runs: module level, in functions
    and classes, relative ones resolved; bodies of ``if TYPE_CHECKING:`` are skipped.
    ``module`` names the file (default: from its path under the repository)."""
    module = module or _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            # ``from rollsafe import diagrams``: the names may be submodules
            found.extend((node.lineno, f"{target}.{a.name}") for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return [(line, m) for line, m in found if m == "rollsafe" or m.startswith("rollsafe.")]


def file_violations(
    path: Path, module: str, units: dict[str, int], allowed: set[tuple[str, str]] = frozenset()
) -> list[str]:
    """Every import of ``path`` (as ``module``) that goes up a layer or sideways, once per
    statement and unit, except the ``allowed`` (importer, unit) pairs."""
    src_unit = unit_of(module, units)
    if src_unit is None:
        return [f"{module}: in no box of {DOC.name}"]
    out: list[str] = []
    seen: set[tuple[int, str]] = set()
    for line, target in imports_of(path, module):
        dst_unit = unit_of(target, units)
        if dst_unit is None or dst_unit == src_unit or (line, dst_unit) in seen:
            continue  # the unit's own modules, or already reported
        seen.add((line, dst_unit))
        if (module, dst_unit) in allowed:
            continue
        if units[dst_unit] >= units[src_unit]:
            out.append(
                f"{module}:{line}: {src_unit} (layer {units[src_unit]}) imports {target} "
                f"({dst_unit}, layer {units[dst_unit]})"
            )
    return out


def violations(units: dict[str, int], allowed: set[tuple[str, str]]) -> list[str]:
    out: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        out.extend(file_violations(path, _module_name(path), units, allowed))
    return out


def test_no_module_imports_upward_or_sideways() -> None:
    text = DOC.read_text()
    units = layers_from_doc(text)
    assert len(units) >= 20 and set(units.values()) == set(range(max(units.values()) + 1))
    allowed = exceptions_from_doc(text)
    assert allowed == {
        ("rollsafe.fleet.fleet", "rollsafe.observe.metrics"),
        ("rollsafe.fleet.fleet", "rollsafe.gateway"),
        ("rollsafe.wire.delta", "rollsafe.checksum"),
    }
    assert violations(units, allowed) == []


def test_every_drawn_unit_exists() -> None:
    for unit in layers_from_doc(DOC.read_text()):
        rel = Path(*unit.split("."))
        assert (ROOT / rel).is_dir() or (ROOT / rel).with_suffix(".py").is_file(), unit


def test_the_check_fails_on_a_back_edge(tmp_path: Path) -> None:
    units = layers_from_doc(DOC.read_text())
    bad = tmp_path / "bad.py"
    # a transport importing the reference engine (same layer, in a function) ...
    bad.write_text("def f():\n    from rollsafe.adapters.reference_engine import collective\n")
    (found,) = file_violations(bad, "rollsafe.transports.bad", units)
    assert "imports rollsafe.adapters.reference_engine" in found
    # ... and the wire importing a transport (upward, relative)
    bad.write_text("from ..transports import nccl\n")
    assert file_violations(bad, "rollsafe.wire.bad", units)
    # ... but not under TYPE_CHECKING, and not inside its own unit
    bad.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import rollsafe.fleet\n"
    )
    assert file_violations(bad, "rollsafe.wire.bad", units) == []
    bad.write_text("from . import shm\nfrom rollsafe.errors import RollsafeError\n")
    assert file_violations(bad, "rollsafe.wire.bad", units) == []


def test_the_layer_diagram_parses_in_mermaid() -> None:
    """Parsed by mermaid's own parser, like every diagram in ``diagrams/`` (test_diagrams)."""
    from test_diagrams import _mermaid

    result = _mermaid(DOC)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ok ") == 1


def test_integrations_sit_above_the_fleet_and_below_the_demo() -> None:
    """A trainer integration embeds a fleet (it may import it); no other rollsafe module imports
    an integration, so importing rollsafe never imports a trainer framework (TRL...)."""
    layers = layers_from_doc(DOC.read_text())
    assert layers["rollsafe.integrations"] > layers["rollsafe.fleet"]
    assert layers["rollsafe.integrations"] < layers["rollsafe.demo"]
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        if module.startswith("rollsafe.integrations"):
            continue
        bad = [m for _, m in imports_of(path) if m.startswith("rollsafe.integrations")]
        assert not bad, f"{module} imports {bad}"


def test_operations_sit_between_the_policy_and_their_executors() -> None:
    """The step sequences (``rollsafe.operations``) are pure: above the policy and the machines,
    below the fleet and the verifier that execute them; they import no executor, adapter or
    transport (and so no torch, no thread, no I/O)."""
    layers = layers_from_doc(DOC.read_text())
    ops = layers["rollsafe.operations"]
    assert layers["rollsafe.policy"] < ops and layers["rollsafe.statemachines"] < ops
    assert ops < layers["rollsafe.verify"] < layers["rollsafe.fleet"]
    forbidden = ("rollsafe.fleet", "rollsafe.verify", "rollsafe.adapters", "rollsafe.transports")
    found = 0
    for path in (PACKAGE / "operations").rglob("*.py"):
        found += 1
        bad = [m for _, m in imports_of(path) if m.startswith(forbidden)]
        assert not bad, f"{_module_name(path)} imports {bad}"
    assert found >= 3
