"""Pinned upstream engine contracts: load them and check requests against them.

This module owns the *reading* of the committed contract files
(``rollsafe/adapters/engines/contracts/<engine>-<version>.json``), which
``tools/upstream_contract.py`` generates from the released SGLang and vLLM wheels by AST. It
answers one question: would this HTTP request be understood by the pinned upstream release?
It is torch-free and httpx-free so that contract tests of the clients and the reference engine
(which rejects non-conforming requests with a 400 that names the key) can both use it.

:meth:`EngineContract.check_request` reports every violation with the path of the offending key
(``update_info.packed``, ``sampling_params.foo``, ``query.mode``): unknown routes or methods,
unknown body keys, missing required keys, wrong JSON types, values outside a ``Literal``
domain or numeric bounds, and unknown query parameters. Nested backend-specific dicts (vLLM
``init_info`` / ``update_info``) are checked against the schema of the ``backend`` argument
(default ``"nccl"``).

Unknown keys have two readings (``unknown_keys=``), because upstream is lenient about most of
them: the contract records, per route, what the release does with a key its request model does
not declare (``"ignore"``, ``"allow"``, ``"allow_and_log"`` or ``"reject"``: SGLang ignores
unknown top-level keys but rejects unknown ``sampling_params`` keys, vLLM keeps and logs unknown
``/v1/completions`` fields and rejects unknown ``init_info`` / ``update_info`` keys, FastAPI
never reads an undeclared body or query parameter).

- ``"strict"`` (the default; rollsafe's own clients' wire tests): every unknown key is a
  violation, also where upstream would drop it, since a key upstream drops is a key its sender
  believes does something. Such a violation carries ``tolerated`` (what upstream does instead).
- ``"upstream"`` (the reference engine): only what the release itself refuses; keys it drops
  are not violations. Types of known keys are checked in both.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, Literal

from rollsafe.errors import InvalidArgument, RollsafeError

__all__ = [
    "PINNED_VERSIONS",
    "SUPPORTED_VERSIONS",
    "ContractError",
    "ContractViolation",
    "EngineContract",
    "EngineName",
    "UnknownKeyPolicy",
    "UnknownKeys",
    "UnsupportedVersion",
    "contract_version_for",
    "load_contract",
]

EngineName = Literal["sglang", "vllm"]
#: how :meth:`EngineContract.check_request` reads keys a request model does not declare
UnknownKeys = Literal["strict", "upstream"]
#: what a release does with such a key (recorded per route in the contract files)
UnknownKeyPolicy = Literal["ignore", "allow", "allow_and_log", "reject"]
_TOLERATING: frozenset[str] = frozenset({"ignore", "allow", "allow_and_log"})

#: The upstream releases rollsafe is pinned to (one committed contract file each).
PINNED_VERSIONS: dict[str, str] = {"sglang": "0.5.23", "vllm": "0.33.0"}
#: Every release with a committed contract, oldest first; a client speaks each one's dialect
#: (``VLLMClient`` picks it from the server's ``GET /version``).
SUPPORTED_VERSIONS: dict[str, tuple[str, ...]] = {
    "sglang": ("0.5.16", "0.5.23"),
    "vllm": ("0.26.0", "0.32.0", "0.33.0"),
}

#: value types upstream only *annotates* (no runtime check) and that real callers rely on: vLLM's
#: ``/collective_rpc`` hands ``kwargs`` to the worker method unchanged (typed ``dict[str, str]``),
#: and checkpoint-engine's vLLM worker extension takes ``zmq_handles`` as an object. Keys there
#: are still checked; only the value types are not.
ANNOTATION_ONLY: dict[tuple[str, str], tuple[str, ...]] = {
    ("vllm", "/collective_rpc"): ("kwargs.",),
}


def _tolerated(policy: str) -> str | None:
    return policy if policy in _TOLERATING else None


def _is_type_problem(v: ContractViolation) -> bool:
    return v.problem.startswith("expected ")


_MAX_ITEM_REPORTS = 3  # per list: enough to name the problem without flooding a 400 body


@dataclass(frozen=True)
class ContractViolation:
    """One way a request departs from the upstream contract."""

    where: str
    problem: str
    #: an unknown key the release does not refuse: its policy (``"ignore"``, ``"allow"``,
    #: ``"allow_and_log"``); None for what it refuses
    tolerated: str | None = None

    def __str__(self) -> str:
        return f"{self.where}: {self.problem}"


class ContractError(RollsafeError, ValueError):
    """A request violates the pinned upstream contract; the message lists every violation."""

    def __init__(self, violations: list[ContractViolation], context: str = "") -> None:
        self.violations = list(violations)
        head = f"{context}: " if context else ""
        lines = "; ".join(str(v) for v in self.violations)
        super().__init__(f"{head}{len(self.violations)} contract violation(s): {lines}")


class UnsupportedVersion(RollsafeError, ValueError):
    """A server version no committed contract speaks (older than all, or not a version)."""


@dataclass(frozen=True)
class _Field:
    types: frozenset[str]
    required: bool
    enum: tuple[Any, ...] | None
    items: _Field | None
    values: _Field | None
    nested: str | None
    backend_schema: str | None
    minimum: float | None
    maximum: float | None
    repeated: bool


@dataclass(frozen=True)
class _Schema:
    name: str
    fields: Mapping[str, _Field]
    required: tuple[str, ...]
    unknown_keys: str = "reject"


@dataclass(frozen=True)
class _Route:
    path: str
    methods: frozenset[str]
    body_schema: str | None
    body_required: bool
    query: _Schema
    auth: str
    raw: Mapping[str, Any]
    body_unknown_keys: str = "reject"  # a body on a route that declares none


def _field(spec: Mapping[str, Any]) -> _Field:
    enum = spec.get("enum")
    items = spec.get("items")
    values = spec.get("values")
    return _Field(
        types=frozenset(spec.get("type", ["any"])),
        required=bool(spec.get("required", False)),
        enum=tuple(enum) if enum is not None else None,
        items=_field(items) if isinstance(items, Mapping) else None,
        values=_field(values) if isinstance(values, Mapping) else None,
        nested=spec.get("nested"),
        backend_schema=spec.get("backend_schema"),
        minimum=spec.get("minimum"),
        maximum=spec.get("maximum"),
        repeated=bool(spec.get("repeated", False)),
    )


def _schema(
    name: str, fields: Mapping[str, Mapping[str, Any]], unknown_keys: str | None = None
) -> _Schema:
    compiled = {k: _field(v) for k, v in fields.items()}
    required = tuple(sorted(k for k, f in compiled.items() if f.required))
    return _Schema(name, compiled, required, unknown_keys or "reject")


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


def _type_ok(value: Any, types: frozenset[str]) -> bool:
    if "any" in types:
        return True
    t = _json_type(value)
    return t in types or (t == "integer" and "number" in types)


def _short(value: Any) -> str:
    text = json.dumps(value, default=repr) if not isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _types_text(types: frozenset[str]) -> str:
    return " or ".join(sorted(types))


class EngineContract:
    """The committed contract of one upstream engine release, compiled for fast checks."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self.data = data
        self.engine: str = data["engine"]
        self.version: str = data["version"]
        self._schemas: dict[str, _Schema] = {
            name: _schema(name, spec["fields"], spec.get("unknown_keys"))
            for name, spec in data.get("schemas", {}).items()
        }
        self._backends: dict[str, dict[str, _Schema]] = {
            kind: {
                b: _schema(f"{kind}[{b}]", s["fields"], s.get("unknown_keys"))
                for b, s in per.items()
            }
            for kind, per in data.get("backend_schemas", {}).items()
        }
        self._routes: dict[str, _Route] = {}
        for path, spec in data["routes"].items():
            body = spec.get("body")
            policies = spec.get("unknown_keys", {})
            self._routes[path] = _Route(
                path=path,
                methods=frozenset(m.upper() for m in spec["methods"]),
                body_schema=body["schema"] if body else None,
                body_required=bool(body and body.get("required")),
                query=_schema(f"query:{path}", spec.get("query", {}), policies.get("query")),
                auth=spec.get("auth", "normal"),
                raw=spec,
                body_unknown_keys=policies.get("body", "reject"),
            )

    def __repr__(self) -> str:
        return f"EngineContract({self.engine} {self.version}, {len(self._routes)} routes)"

    @property
    def label(self) -> str:
        return f"{self.engine} {self.version}"

    # ---- queries ---------------------------------------------------------------------------

    def routes(self) -> dict[str, frozenset[str]]:
        """Every contracted route and its methods."""
        return {p: r.methods for p, r in self._routes.items()}

    def route(self, path: str) -> Mapping[str, Any]:
        """The raw contract entry of a route (auth, requires, responses, ...)."""
        return self._routes[path].raw

    def body_fields(self, path: str) -> frozenset[str]:
        """Keys the route's JSON body accepts (empty when it takes no body)."""
        name = self._routes[path].body_schema
        return frozenset(self._schemas[name].fields) if name else frozenset()

    def body_default(self, path: str, key: str) -> tuple[bool, Any]:
        """``(True, value)``: the default upstream gives the body key ``key`` of ``path`` when
        it is left out (a constant in the request model); ``(False, None)`` when it has none
        (required, or computed at run time)."""
        name = self._routes[path].body_schema
        if name is None:
            return False, None
        spec = self.data["schemas"][name]["fields"].get(key, {})
        return ("default" in spec), spec.get("default")

    def unknown_key_policy(self, path: str) -> str:
        """What the release does with a top-level body key ``path``'s request model does not
        declare: ``"ignore"``, ``"allow"``, ``"allow_and_log"`` or ``"reject"``."""
        route = self._routes[path]
        if route.body_schema is None:
            return route.body_unknown_keys
        return self._schemas[route.body_schema].unknown_keys

    def backend_fields(self, kind: str, backend: str = "nccl") -> frozenset[str]:
        """Keys of a backend-specific nested dict (vLLM ``init_info`` / ``update_info``)."""
        return frozenset(self._backends[kind][backend].fields)

    def allowed_pickle_globals(self) -> frozenset[tuple[str, str]]:
        """SGLang's ``SafeUnpickler.ALLOWED_GLOBALS`` as ``(module, name)`` pairs (0.5.23;
        0.5.16 allows by module prefix: :meth:`unpickler_admits`)."""
        pairs = self.data.get("pickle_allowed_globals")
        if pairs is None:
            raise ContractError(
                [ContractViolation(self.label, "has no unpickler allow-list of globals")]
            )
        return frozenset((m, n) for m, n in pairs)

    def unpickler_admits(self, module: str, name: str) -> bool:
        """Whether SGLang's ``SafeUnpickler`` of this release loads the global ``module.name``:
        by its allow-list of globals (0.5.23) or by module prefix less a deny-list (0.5.16)."""
        if "pickle_allowed_globals" in self.data:
            return (module, name) in self.allowed_pickle_globals()
        prefixes = self.data.get("pickle_allowed_module_prefixes")
        if prefixes is None:
            raise ContractError([ContractViolation(self.label, "has no unpickler (SGLang only)")])
        denied = {(m, n) for m, n in self.data.get("pickle_denied_globals", [])}
        if (module, name) in denied:
            return False
        return any((module + ".").startswith(prefix) for prefix in prefixes)

    def sampling_keys(self) -> frozenset[str]:
        """SGLang ``sampling_params`` keys, or vLLM ``/v1/completions`` body fields."""
        if "sampling_params" in self.data:
            return frozenset(self.data["sampling_params"]["keys"])
        return frozenset(self.data["completion"]["fields"])

    # ---- checks ----------------------------------------------------------------------------

    def check_request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, Any] | None = None,
        body: Any = None,
        backend: str = "nccl",
        unknown_keys: UnknownKeys = "strict",
    ) -> list[ContractViolation]:
        """Every way ``method path?query`` with JSON ``body`` departs from the contract.

        ``unknown_keys="strict"`` reports every key the release does not declare (rollsafe's
        own clients' wire tests); ``"upstream"`` leaves out those the release tolerates (the
        reference engine): see the module docstring."""
        if unknown_keys not in ("strict", "upstream"):
            raise InvalidArgument(
                "unknown_keys", f"must be 'strict' or 'upstream', got {unknown_keys!r}"
            )
        route = self._routes.get(path)
        if route is None:
            return [ContractViolation(path, f"unknown route for {self.label}")]
        out: list[ContractViolation] = []
        verb = method.upper()
        if verb not in route.methods:
            allowed = ", ".join(sorted(route.methods))
            out.append(
                ContractViolation(f"{verb} {path}", f"method not allowed (allowed: {allowed})")
            )
        self._check_query(route, query or {}, out)
        if route.body_schema is None:
            if body not in (None, {}):
                out.append(
                    ContractViolation(
                        "body",
                        f"{path} takes no JSON body{self._tolerance(route.body_unknown_keys)}",
                        _tolerated(route.body_unknown_keys),
                    )
                )
        elif body is None:
            if route.body_required:
                out.append(ContractViolation("body", "missing JSON body"))
        else:
            self._check_object(self._schemas[route.body_schema], body, "", backend, out)
            loose = ANNOTATION_ONLY.get((self.engine, path), ())
            out = [v for v in out if not (v.where.startswith(loose) and _is_type_problem(v))]
        if unknown_keys == "upstream":
            out = [v for v in out if v.tolerated is None]
        return out

    def _tolerance(self, policy: str) -> str:
        """The part of an unknown-key message that says what the release does instead."""
        if policy == "ignore":
            return f"; {self.label} ignores it"
        if policy in ("allow", "allow_and_log"):
            logged = " and logs it" if policy == "allow_and_log" else ""
            return f"; {self.label} accepts it{logged} (no effect)"
        return ""

    def require_valid(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, Any] | None = None,
        body: Any = None,
        backend: str = "nccl",
        unknown_keys: UnknownKeys = "strict",
    ) -> None:
        """Raise :class:`ContractError` listing every violation; return if there are none."""
        violations = self.check_request(
            method, path, query=query, body=body, backend=backend, unknown_keys=unknown_keys
        )
        if violations:
            raise ContractError(violations, f"{method.upper()} {path} ({self.label})")

    def _check_query(
        self, route: _Route, query: Mapping[str, Any], out: list[ContractViolation]
    ) -> None:
        fields = route.query.fields
        for key, value in query.items():
            spec = fields.get(key)
            where = f"query.{key}"
            if spec is None:
                known = ", ".join(sorted(fields)) or "none"
                policy = route.query.unknown_keys
                out.append(
                    ContractViolation(
                        where,
                        f"unknown query parameter (known: {known}){self._tolerance(policy)}",
                        _tolerated(policy),
                    )
                )
                continue
            values = list(value) if spec.repeated and isinstance(value, (list, tuple)) else [value]
            item_spec = spec.items if spec.repeated and spec.items is not None else spec
            for v in values:
                self._check_query_value(item_spec, v, where, out)
        for key in route.query.required:
            if key not in query:
                out.append(ContractViolation(f"query.{key}", "missing required query parameter"))

    def _check_query_value(
        self, spec: _Field, value: Any, where: str, out: list[ContractViolation]
    ) -> None:
        # Query values travel as text: accept the Python value or its wire spelling.
        parsed: Any = value
        if isinstance(value, str):
            if spec.types & {"integer", "number"}:
                try:
                    parsed = int(value) if "integer" in spec.types else float(value)
                except ValueError:
                    parsed = value
            elif "boolean" in spec.types and value.lower() in {"true", "false", "1", "0"}:
                parsed = value.lower() in {"true", "1"}
        self._check_value(spec, parsed, where, "nccl", out)

    def _check_object(
        self,
        schema: _Schema,
        value: Any,
        prefix: str,
        backend: str,
        out: list[ContractViolation],
    ) -> None:
        where_self = prefix[:-1] if prefix else "body"
        if not isinstance(value, Mapping):
            out.append(
                ContractViolation(where_self, f"expected a JSON object, got {_json_type(value)}")
            )
            return
        for key, item in value.items():
            spec = schema.fields.get(key)
            where = f"{prefix}{key}"
            if spec is None:
                policy = schema.unknown_keys
                out.append(
                    ContractViolation(
                        where,
                        f"unknown key (not in {schema.name} of {self.label})"
                        + self._tolerance(policy),
                        _tolerated(policy),
                    )
                )
                continue
            self._check_value(spec, item, where, backend, out)
        for key in schema.required:
            if key not in value:
                out.append(
                    ContractViolation(f"{prefix}{key}", f"missing required key of {schema.name}")
                )

    def _check_value(
        self, spec: _Field, value: Any, where: str, backend: str, out: list[ContractViolation]
    ) -> None:
        if not _type_ok(value, spec.types):
            out.append(
                ContractViolation(
                    where,
                    f"expected {_types_text(spec.types)}, got {_json_type(value)} {_short(value)}",
                )
            )
            return
        if spec.enum is not None and value not in spec.enum:
            domain = ", ".join(_short(v) for v in spec.enum)
            out.append(ContractViolation(where, f"value {_short(value)} not in [{domain}]"))
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if spec.minimum is not None and value < spec.minimum:
                out.append(ContractViolation(where, f"value {value} below minimum {spec.minimum}"))
            if spec.maximum is not None and value > spec.maximum:
                out.append(ContractViolation(where, f"value {value} above maximum {spec.maximum}"))
        if spec.backend_schema is not None:
            self._check_backend(spec.backend_schema, value, where, backend, out)
            return
        if spec.nested is not None and spec.nested in self._schemas:
            nested = self._schemas[spec.nested]
            if isinstance(value, Mapping):
                self._check_object(nested, value, f"{where}.", backend, out)
            elif isinstance(value, (list, tuple)):
                for i, element in enumerate(value):
                    self._check_object(nested, element, f"{where}[{i}].", backend, out)
            return
        if isinstance(value, (list, tuple)) and spec.items is not None:
            self._check_items(spec.items, value, where, backend, out)
        elif isinstance(value, Mapping) and spec.values is not None:
            bad = 0
            for k, v in value.items():
                before = len(out)
                self._check_value(spec.values, v, f"{where}.{k}", backend, out)
                bad += len(out) > before
                if bad >= _MAX_ITEM_REPORTS:
                    break

    def _check_items(
        self,
        items: _Field,
        value: list[Any] | tuple[Any, ...],
        where: str,
        backend: str,
        out: list[ContractViolation],
    ) -> None:
        bad = 0
        for i, element in enumerate(value):
            before = len(out)
            self._check_value(items, element, f"{where}[{i}]", backend, out)
            bad += len(out) > before
            if bad >= _MAX_ITEM_REPORTS:
                break

    def _check_backend(
        self, kind: str, value: Any, where: str, backend: str, out: list[ContractViolation]
    ) -> None:
        per_backend = self._backends.get(kind, {})
        schema = per_backend.get(backend)
        if schema is None:
            known = ", ".join(sorted(per_backend)) or "none"
            out.append(ContractViolation(where, f"unknown backend {backend!r} (known: {known})"))
            return
        if isinstance(value, (list, tuple)):  # one dict per global worker rank
            for i, element in enumerate(value):
                self._check_object(schema, element, f"{where}[{i}].", backend, out)
        else:
            self._check_object(schema, value, f"{where}.", backend, out)


@cache
def _load(engine: str, version: str) -> EngineContract:
    name = f"{engine}-{version}.json"
    ref = resources.files("rollsafe.adapters.engines").joinpath("contracts").joinpath(name)
    try:
        text = ref.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InvalidArgument(
            "version",
            f"no committed contract {name} for version {version!r} "
            "(regenerate: tools/upstream_contract.py)",
        ) from None
    return EngineContract(json.loads(text))


#: how many leading version numbers name one dialect: vLLM changes its API per minor release
#: (0.32.3 speaks 0.32.0's), SGLang per patch release (0.5.16 and 0.5.23 differ)
RELEASE_DEPTH: dict[str, int] = {"vllm": 2, "sglang": 3}


def _release(version: str, depth: int = 2) -> tuple[int, ...]:
    """The first ``depth`` numbers of a version (``0.32.0``, ``0.33.1.dev3+g1234``,
    ``0.32.0+cpu``, ``0.5.16.post1``)."""
    parts = version.strip().lstrip("v").split("+")[0].split(".")
    try:
        out = [int(parts[0])]
        for part in parts[1:depth]:
            digits = ""
            for ch in part:
                if not ch.isdigit():
                    break
                digits += ch
            out.append(int(digits))
        if len(out) < depth:
            raise ValueError(version)
        return tuple(out)
    except (IndexError, ValueError):
        raise UnsupportedVersion(f"not a release version: {version!r}") from None


def contract_version_for(engine: EngineName, server_version: str) -> str:
    """The committed contract whose dialect a server reporting ``server_version`` speaks: the
    supported release of the same major.minor (vLLM) or major.minor.patch (SGLang,
    :data:`RELEASE_DEPTH`), a newer server the newest contract. A server older than every
    contract, between two of them, or with an unreadable version is :class:`UnsupportedVersion`
    naming them."""
    supported = SUPPORTED_VERSIONS[engine]
    depth = RELEASE_DEPTH[engine]
    wanted = _release(server_version, depth)
    for version in supported:
        if _release(version, depth) == wanted:
            return version
    if wanted > _release(supported[-1], depth):
        return supported[-1]
    if wanted > _release(supported[0], depth):
        raise UnsupportedVersion(
            f"{engine} server version {server_version!r} is no supported release (supported: "
            f"{', '.join(supported)}; one between them has no committed contract)"
        )
    raise UnsupportedVersion(
        f"{engine} server version {server_version!r} is older than every supported release "
        f"({', '.join(supported)})"
    )


def load_contract(engine: EngineName, version: str | None = None) -> EngineContract:
    """The pinned (or the given) release's contract; parsed once per process."""
    if engine not in PINNED_VERSIONS:
        raise InvalidArgument(
            "engine", f"unknown engine {engine!r} (known: {', '.join(PINNED_VERSIONS)})"
        )
    return _load(engine, version or PINNED_VERSIONS[engine])
