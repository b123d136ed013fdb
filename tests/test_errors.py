"""One error root: every public rollsafe exception derives from ``RollsafeError``, keeping its
built-in base; ``import rollsafe.fleet`` needs no optional extra."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
import subprocess
import sys
import textwrap
from typing import Any

import pytest

import rollsafe
from rollsafe.errors import MissingExtra, RollsafeError

#: modules that need an optional dependency this test environment may lack (``vllm``: the
#: plugin that runs inside vLLM's workers; it raises the built-ins vLLM expects, defines no
#: exception class)
_OPTIONAL = {"ray", "checkpoint_engine", "prometheus_client", "trl", "vllm"}


def _modules() -> list[str]:
    names = [rollsafe.__name__]
    for info in pkgutil.walk_packages(rollsafe.__path__, prefix="rollsafe."):
        if info.name.endswith("__main__"):
            continue
        names.append(info.name)
    return names


def _exception_classes() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for name in _modules():
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.split(".")[0] in _OPTIONAL:
                continue
            raise
        for attr, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__.startswith("rollsafe")
                and not attr.startswith("_")
            ):
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return found


def test_every_public_exception_derives_from_the_root() -> None:
    classes = _exception_classes()
    assert len(classes) >= 55, sorted(classes)
    outside = sorted(n for n, c in classes.items() if not issubclass(c, RollsafeError))
    assert not outside, f"exceptions outside RollsafeError: {outside}"


def test_the_builtin_bases_callers_catch_are_kept() -> None:
    from rollsafe.errors import BucketFormatError
    from rollsafe.fleet import FleetConfigError
    from rollsafe.fleet.recovery import StepTimeout
    from rollsafe.registry import UnknownGroup
    from rollsafe.statemachines import TransitionNotAllowed, TransitionRefused
    from rollsafe.transports import TransportError
    from rollsafe.wire.unpickle import UnsafePayload

    assert issubclass(TransportError, RuntimeError)
    assert issubclass(BucketFormatError, ValueError)
    assert issubclass(UnsafePayload, ValueError)
    assert issubclass(TransitionRefused, TransitionNotAllowed)
    assert issubclass(FleetConfigError, ValueError)
    assert issubclass(UnknownGroup, KeyError)
    assert issubclass(StepTimeout, TimeoutError)
    from rollsafe.adapters.ray import PlacementUnavailable, SharedExportUnreadable
    from rollsafe.adapters.ray.exports import ExportPullRefused

    assert issubclass(ExportPullRefused, RuntimeError)

    assert issubclass(PlacementUnavailable, RuntimeError)
    assert issubclass(SharedExportUnreadable, RuntimeError)
    err = SharedExportUnreadable("n1", "/x/.probe", {"n1": "OSError: gone", "n2": "timeout"})
    assert err.node_id == "n1" and err.path == "/x/.probe" and "n2" in str(err)


def test_the_tree_in_the_docstring_names_every_exception() -> None:
    import rollsafe.errors

    doc = rollsafe.errors.__doc__ or ""
    names = {c.__name__ for c in _exception_classes().values()}
    missing = sorted(n for n in names if not re.search(rf"\b{n}\b", doc))
    assert not missing, f"exceptions missing from the tree in rollsafe/errors.py: {missing}"


_BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
"""


def _run(blocked: set[str], body: str) -> subprocess.CompletedProcess[str]:
    code = _BLOCK.format(blocked=blocked) + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


def test_fleet_imports_without_the_engine_extra_and_names_it_when_needed() -> None:
    r = _run(
        {"httpx", "torch", "aiohttp"},
        """
        import rollsafe.fleet
        from rollsafe.fleet import RolloutFleet, FleetConfig
        from rollsafe.adapters.engines import EngineError
        from rollsafe.ports import EngineClient
        from rollsafe.errors import MissingExtra
        try:
            from rollsafe.adapters.engines import EngineLauncher
        except MissingExtra as exc:
            print("MISSING:", exc)
        assert "torch" not in sys.modules and "httpx" not in sys.modules
        """,
    )
    assert r.returncode == 0, r.stderr
    assert "pip install 'rollsafe[engine]'" in r.stdout


def test_decoding_a_bucket_loads_no_transport_and_no_statemachine() -> None:
    r = _run(
        set(),
        """
        import rollsafe.wire.bucket, rollsafe.wire.hf_index, rollsafe.wire.group
        import rollsafe.adapters.reference_engine.weights
        import rollsafe.adapters.reference_engine.model
        heavy = ("rollsafe.transports", "statemachine")
        bad = sorted(m for m in sys.modules if m.startswith(heavy))
        assert not bad, bad
        """,
    )
    assert r.returncode == 0, r.stderr


def test_missing_extra_is_an_import_error_and_a_rollsafe_error() -> None:
    exc = MissingExtra("httpx", "engine")
    assert isinstance(exc, ImportError) and isinstance(exc, RollsafeError)
    assert exc.name == "httpx"
    with pytest.raises(RollsafeError, match=r"rollsafe\[engine\]"):
        raise exc


def test_no_two_exception_classes_share_a_name() -> None:
    """One class per name: ``except EngineError`` means the same thing wherever it is written."""
    by_name: dict[str, list[str]] = {}
    for qualified, cls in _exception_classes().items():
        by_name.setdefault(cls.__name__, []).append(qualified)
    twice = {n: sorted(q) for n, q in by_name.items() if len(q) > 1}
    assert not twice, f"exception names defined in more than one module: {twice}"


def _bad_argument_calls() -> list[tuple[str, Any]]:
    from rollsafe.adapters.engines import EngineSpec, RetryPolicy, make_client
    from rollsafe.adapters.engines.contract import load_contract
    from rollsafe.checksum import algorithm_for
    from rollsafe.ports import EngineTarget
    from rollsafe.registry import FleetRegistry
    from rollsafe.statemachines import CheckpointRegistration, WorkerGroupLifecycle
    from rollsafe.statemachines.recovery_mode import ImmediateRecoveryMode
    from rollsafe.transports import DiskTransport, IPCTransport, NCCLTransport
    from rollsafe.verify.model import ModelConfig
    from rollsafe.wire.bucket import pack_buckets
    from rollsafe.wire.shm import new_shared_buffer

    return [
        ("bucket_bytes", lambda: NCCLTransport(1, bucket_bytes=0)),
        ("backend", lambda: NCCLTransport(1, backend="mpi")),
        ("bucket_bytes", lambda: IPCTransport(1, bucket_bytes=-1)),
        ("bucket_bytes", lambda: list(pack_buckets([], bucket_bytes=0))),
        ("nbytes", lambda: new_shared_buffer(0)),
        ("dialect", lambda: algorithm_for("trt", "cpu")),
        ("world_size", lambda: CheckpointRegistration(0)),
        ("ranks", lambda: WorkerGroupLifecycle([])),
        ("ranks", lambda: WorkerGroupLifecycle([0, 0])),
        ("restart_budget", lambda: WorkerGroupLifecycle([0], restart_budget=-1)),
        ("rearm_after", lambda: ImmediateRecoveryMode(rearm_after=0)),
        ("EngineSpec.ranks", lambda: EngineSpec(model_path="m", ranks=0)),
        ("EngineSpec.port", lambda: EngineSpec(model_path="m", port=70000)),
        ("RetryPolicy.max_backoff_s", lambda: RetryPolicy(max_backoff_s=-1.0)),
        ("dialect", lambda: make_client("trt", "http://127.0.0.1:1")),  # type: ignore[arg-type]
        ("EngineSpec.max_model_len", lambda: EngineSpec(model_path="m", max_model_len=64)),
        ("EngineSpec.cpu_cores", lambda: EngineSpec(model_path="m", cpu_cores=[0, 0])),
        ("ranks", lambda: EngineTarget("g0", (), client=None)),  # type: ignore[arg-type]
        ("failure_threshold", lambda: ModelConfig(failure_threshold=0)),
        ("engine", lambda: load_contract("trt")),  # type: ignore[arg-type]
        ("listener", lambda: FleetRegistry().add_listener(object())),
        ("version", lambda: FleetRegistry().set_fleet_version("3")),  # type: ignore[arg-type]
        ("exporter_or_root", lambda: DiskTransport(3)),  # type: ignore[arg-type]
    ]


#: refusals of an object of the wrong type: InvalidArgumentType, also a TypeError
_WRONG_TYPE = {"listener", "version", "exporter_or_root"}


@pytest.mark.parametrize("index", range(23))
def test_a_refused_argument_is_a_named_error_carrying_its_key(index: int) -> None:
    """One shape for bad input: :class:`InvalidArgument` (still a ``ValueError``) with ``key``,
    and the message names the key; a refused type is also a ``TypeError``."""
    from rollsafe.errors import InvalidArgument, InvalidArgumentType

    calls = _bad_argument_calls()
    assert len(calls) == 23  # the parametrization covers every row
    key, call = calls[index]
    with pytest.raises(InvalidArgument) as info:
        call()
    assert info.value.key == key and key in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, RollsafeError)
    assert isinstance(info.value, InvalidArgumentType) == (key in _WRONG_TYPE)
    assert isinstance(info.value, TypeError) == (key in _WRONG_TYPE)


def test_the_fleet_config_error_is_an_invalid_argument() -> None:
    from rollsafe.errors import InvalidArgument
    from rollsafe.fleet import FleetConfigError, NcclSettings
    from rollsafe.registry import FleetError

    with pytest.raises(InvalidArgument) as info:
        NcclSettings(bucket_bytes=0)
    assert isinstance(info.value, FleetConfigError) and isinstance(info.value, FleetError)
    assert info.value.key == "nccl.bucket_bytes"


def _sample(annotation: Any) -> Any:
    """A value of the annotated type for an exception's field (its ``__init__`` argument)."""
    text = str(annotation)
    for key, value in (
        ("Mapping", {"k": 1}),
        ("dict", {"k": 1}),
        ("Sequence", ["a", "b"]),
        ("list", ["a", "b"]),
        ("tuple", ("a", "b")),
        ("Iterable", ["a", "b"]),
        ("bool", True),
        ("float", 2.5),
        ("int", 3),
        ("Path", "/p"),
    ):
        if key in text:
            return value
    return "x"


def test_every_exception_survives_pickling_with_its_message_and_fields() -> None:
    """An engine's launcher raises in a Ray actor and Ray pickles the error to the driver: the
    default pickling runs ``__init__`` again with the message alone, which fails for an error
    whose ``__init__`` takes its fields (the soak saw ``UnserializableException`` where a
    vLLM restart's ``EngineStartError`` was raised). Every exception class, built with a value
    of each argument's annotated type, comes back the same class with the same message and
    fields."""
    import pickle

    checked = []
    for name, cls in sorted(_exception_classes().items()):
        params = [
            p
            for p in inspect.signature(cls.__init__).parameters.values()
            if p.name != "self"
            and p.default is inspect.Parameter.empty
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        args = [_sample(p.annotation) for p in params if p.kind != p.KEYWORD_ONLY]
        kwargs = {p.name: _sample(p.annotation) for p in params if p.kind == p.KEYWORD_ONLY}
        try:
            error = cls(*args, **kwargs)
        except Exception:  # an argument our samples cannot stand for
            continue
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is cls, name
        assert str(back) == str(error), name
        assert vars(back) == vars(error), name
        checked.append(name)
    assert len(checked) >= 50, checked
    assert "rollsafe.adapters.engines.errors.EngineStartError" in checked
