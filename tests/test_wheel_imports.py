"""``tools/wheel_imports.py``: how a wheel's modules import third-party packages on one path.

A synthetic wheel covers each kind of import the carry locks' exclusions rest on: at module
level (hard), under an ``if`` (conditional, with its test), in a ``try`` that catches
``ImportError`` (guarded), in a function (lazy), under ``if TYPE_CHECKING`` (never), through a
package's own modules (followed only by hard edges for "certain"), and off the path.
"""

from __future__ import annotations

import importlib.util
import sys
import zipfile
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent


def _tool() -> ModuleType:
    name = "wheel_imports_tool"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / "wheel_imports.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


FILES = {
    "pkg/__init__.py": "import numpy\n",
    "pkg/server.py": (
        "from typing import TYPE_CHECKING\n"
        "import fastapi\n"
        "from . import engine\n"
        "from pkg.kernels import maybe\n"
        "if TYPE_CHECKING:\n"
        "    import typeonly\n"
        "try:\n"
        "    import cv2\n"
        "except ImportError:\n"
        "    cv2 = None\n"
        "def handler():\n"
        "    import blake3\n"
        "    import importlib\n"
        "    importlib.import_module('pkg.plugins')\n"
    ),
    "pkg/engine.py": "import zmq\nif has_flashinfer():\n    import flashinfer\n",
    "pkg/kernels/__init__.py": "",
    "pkg/kernels/maybe.py": "if fancy():\n    from pkg import fancy_backend\n",
    "pkg/fancy_backend.py": "import deep_ep\n",
    "pkg/plugins.py": "import ray\n",
    "pkg/offpath.py": "import tilelang\n",
}


def test_imports_are_classified_on_and_off_the_path(tmp_path: Path) -> None:
    tool = _tool()
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, text in FILES.items():
            zf.writestr(name, text)
    report = tool.analyse(wheel, "pkg", ["pkg.server"])
    ext = report["external"]
    status = {name: tool.status_of(kinds) for name, kinds in ext.items()}
    assert status["numpy"] == "HARD"  # the package's __init__ runs first
    assert status["fastapi"] == "HARD" and status["zmq"] == "HARD"  # through `from . import`
    assert status["flashinfer"] == "path:conditional"
    assert "has_flashinfer()" in ext["flashinfer"]["path_conditional"][0]
    assert status["cv2"] == "path:guarded"
    assert status["blake3"] == "path:lazy"
    assert status["deep_ep"] == "maybe:hard"  # a module the path imports only conditionally
    assert status["ray"] == "off-path"  # a lazy import_module of an own module: not followed
    assert status["tilelang"] == "off-path"
    assert "typeonly" not in ext
    assert report["reached_modules"] < report["possibly_reached_modules"]
