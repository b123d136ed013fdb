"""SGLang 0.5.23's own payload decoders, loaded from the installed wheel for wire tests.

``make test`` installs the pinned ``sglang`` wheel with ``--no-deps``
(``constraints/upstream.txt``).
Importing ``sglang`` itself pulls in its whole runtime (triton, IPython, the frontend language),
none of which the decoders touch, so this helper loads exactly the upstream code the engine runs
on a ``/update_weights_from_tensor`` call, from the installed files, without those imports:

* ``sglang/srt/weight_sync/tensor_bucket.py`` (imports torch only) is loaded as a module under
  its real name, so an unpickler that resolves ``sglang.srt.weight_sync.tensor_bucket`` gets it;
  its parent packages are registered as bare package modules for the duration of a test (an
  import of ``a.b.c`` also imports ``a``, and ``sglang/__init__.py`` is the frontend runtime);
* ``SafeUnpickler`` is the class definition from ``sglang/srt/utils/common.py``, compiled and
  executed by itself (its module imports triton and friends at the top, the class uses only
  ``pickle``).

For the reference engine's stop rules (``tests/test_engine_units.py``) :func:`load_stop_checks`
compiles, the same way, the methods of SGLang's ``Req`` that end a generation
(``update_finish_state`` and the stop-string and stop-token checks it calls, the stream's
``check_match_stop_str_prefix``) with their finish-reason classes from
``managers/schedule_batch.py``, and the detokenizer's ``trim_matched_stop`` from
``managers/detokenizer_manager.py``.

Nothing of SGLang is copied into this repository: the code is read from the installed wheel
(or, on a GPU host whose image lacks it, from the two upstream files carried there and named by
``ROLLSAFE_SGLANG_SRC``: ``benchmarks/gpu/run_device.sh`` extracts them from the wheel).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.machinery
import importlib.util
import io
import os
import pickle
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

SGLANG_VERSION = "0.5.23"
BUCKET_MODULE = "sglang.srt.weight_sync.tensor_bucket"


@functools.cache
def sglang_root() -> Path:
    """The installed ``sglang`` package directory (fails loudly when it is missing)."""
    carried = os.environ.get("ROLLSAFE_SGLANG_SRC")  # a GPU host without the wheel installed
    if carried:
        return Path(carried) / "sglang"
    spec = importlib.machinery.PathFinder.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"sglang=={SGLANG_VERSION} is not installed: `make test` installs it with --no-deps "
            "(constraints/upstream.txt); run `.venv/bin/pip install --no-deps "
            f"sglang=={SGLANG_VERSION}`"
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    from importlib.metadata import version

    installed = version("sglang")
    if installed != SGLANG_VERSION:
        raise RuntimeError(f"sglang {installed} is installed, the wire tests pin {SGLANG_VERSION}")
    return root


_PARENTS = ("sglang", "sglang.srt", "sglang.srt.weight_sync")


def load_tensor_bucket() -> ModuleType:
    """SGLang's ``tensor_bucket`` (``FlattenedTensorBucket``, ``FlattenedTensorMetadata``)."""
    if BUCKET_MODULE in sys.modules:
        return sys.modules[BUCKET_MODULE]
    root = sglang_root()
    for parent in _PARENTS:
        if parent not in sys.modules:
            package = ModuleType(parent)
            package.__path__ = [str(root.parent / parent.replace(".", "/"))]
            sys.modules[parent] = package
    path = root / "srt" / "weight_sync" / "tensor_bucket.py"
    spec = importlib.util.spec_from_file_location(BUCKET_MODULE, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[BUCKET_MODULE] = module
    spec.loader.exec_module(module)
    return module


def _blocked_storage_load(*_args: Any, **_kwargs: Any) -> Any:
    raise RuntimeError("torch.storage._load_from_bytes is not part of a weight payload")


def load_safe_unpickler() -> type[pickle.Unpickler]:
    """SGLang's ``SafeUnpickler`` class, compiled from the installed ``utils/common.py``."""
    source_path = sglang_root() / "srt" / "utils" / "common.py"
    tree = ast.parse(source_path.read_text())
    cls = next(
        node
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name == "SafeUnpickler"
    )
    module = ast.Module(body=[cls], type_ignores=[])
    namespace: dict[str, Any] = {
        "pickle": pickle,
        "_safe_load_torch_storage": _blocked_storage_load,
        "__name__": "sglang.srt.utils.common",
    }
    exec(compile(module, str(source_path), "exec"), namespace)
    unpickler: type[pickle.Unpickler] = namespace["SafeUnpickler"]
    return unpickler


def sglang_deserialize(entry: str) -> Any:
    """What SGLang's ``MultiprocessingSerializer.deserialize`` does with one base64 entry."""
    import base64

    load_tensor_bucket()
    unpickler = load_safe_unpickler()
    return unpickler(io.BytesIO(base64.b64decode(entry, validate=True))).load()


@contextlib.contextmanager
def sglang_modules() -> Iterator[ModuleType]:
    """Load ``tensor_bucket`` for the duration of a test, then forget it again."""
    module = load_tensor_bucket()
    try:
        yield module
    finally:
        for name in (BUCKET_MODULE, *_PARENTS):
            sys.modules.pop(name, None)


#: the ``Req`` methods a decode step goes through to decide whether the generation ended
_REQ_METHODS = (
    "finished",
    "update_finish_state",
    "_check_vocab_boundary_finish",
    "_check_str_based_finish",
    "_check_token_based_finish",
    "_cap_finished_len_at_max_new_tokens",
    "_locate_str_stop_finished_len",
    "_stop_match_tail_len",
    "tail_str",
    "check_match_stop_str_prefix",
    "output_ids_through_stop",
)
_FINISH_CLASSES = (
    "BaseFinishReason",
    "FINISH_MATCHED_TOKEN",
    "FINISH_MATCHED_STR",
    "FINISHED_MATCHED_REGEX",
    "FINISH_LENGTH",
    "FINISH_ABORT",
)


@functools.cache
def load_stop_checks() -> tuple[type, Any]:
    """``(Req, trim_matched_stop)``: a class holding SGLang 0.5.23's own ``Req`` methods listed
    in :data:`_REQ_METHODS` (the caller sets the attributes they read: ``sampling_params``,
    ``tokenizer``, ``eos_token_ids``, ``output_ids``, ``finished_reason``, ``finished_len``,
    ``to_finish``, ``decoded_text``, ``vocab_size``, ``grammar``, ``rid``) and the
    detokenizer's ``trim_matched_stop`` as a function of ``(self, output, finished_reason,
    no_stop_trim)``."""
    import re
    from http import HTTPStatus
    from typing import Optional, Union

    batch_path = sglang_root() / "srt" / "managers" / "schedule_batch.py"
    tree = ast.parse(batch_path.read_text())
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in _FINISH_CLASSES]
    req = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Req")
    methods = [
        n
        for n in req.body
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name in _REQ_METHODS
    ]
    missing = set(_REQ_METHODS) - {m.name for m in methods}
    if missing or len(classes) != len(_FINISH_CLASSES):
        raise RuntimeError(f"{batch_path}: not found: {sorted(missing)} or a finish class")
    stub = ast.ClassDef(
        name="Req", bases=[], keywords=[], body=methods, decorator_list=[], type_params=[]
    )
    namespace: dict[str, Any] = {
        "re": re,
        "HTTPStatus": HTTPStatus,
        "List": list,
        "Dict": dict,
        "Optional": Optional,
        "Union": Union,
        "array": list,
        "logger": __import__("logging").getLogger("sglang.stub"),
        "__name__": "sglang.srt.managers.schedule_batch",
    }
    module = ast.fix_missing_locations(ast.Module(body=[*classes, stub], type_ignores=[]))
    exec(compile(module, str(batch_path), "exec"), namespace)

    detok_path = sglang_root() / "srt" / "managers" / "detokenizer_manager.py"
    detok = ast.parse(detok_path.read_text())
    manager = next(
        n for n in detok.body if isinstance(n, ast.ClassDef) and n.name == "DetokenizerManager"
    )
    trim = next(
        n for n in manager.body if isinstance(n, ast.FunctionDef) and n.name == "trim_matched_stop"
    )
    trim_ns: dict[str, Any] = {"Union": Union, "List": list, "Dict": dict}
    exec(compile(ast.Module(body=[trim], type_ignores=[]), str(detok_path), "exec"), trim_ns)
    return namespace["Req"], trim_ns["trim_matched_stop"]
