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
