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


# Two ways a package is imported at start without an import statement at module level
# (issue 38: vLLM 0.26's llguidance/xgrammar and prometheus-fastapi-instrumentator).
LAZY_AND_START = {
    "app/__init__.py": "",
    "app/utils.py": "class LazyLoader:\n    pass\n",
    # a LazyLoader bound in the `else` of `if TYPE_CHECKING`, read by a class-body annotation
    "app/grammar.py": (
        "from dataclasses import dataclass\n"
        "from typing import TYPE_CHECKING\n"
        "from app.utils import LazyLoader\n"
        "if TYPE_CHECKING:\n"
        "    import xgrammar as xgr\n"
        "else:\n"
        "    xgr = LazyLoader('xgr', globals(), 'xgrammar')\n"
        "    guide = LazyLoader('guide', globals(), 'llguidance')\n"
        "    oc = LazyLoader('oc', globals(), 'outlines_core')\n"
        "    lm = LazyLoader('lm', globals(), 'lmformatenforcer')\n"
        "@dataclass\n"
        "class Grammar:\n"
        "    matcher: xgr.GrammarMatcher\n"
        "def compile(x: guide.Matcher) -> None:\n"  # a def's annotation runs at def time
        "    oc.compile(x)\n"  # a function body: lazy
        "def helper() -> None:\n"
        "    lm.build()\n"
    ),
    # the same read with deferred annotations does not import
    "app/deferred.py": (
        "from __future__ import annotations\n"
        "from app.utils import LazyLoader\n"
        "tvm = LazyLoader('tvm', globals(), 'tvm_ffi')\n"
        "class Holder:\n"
        "    value: tvm.Object\n"
    ),
    "app/server.py": (
        "from app import grammar, deferred\n"
        "def build_app(args):\n"
        "    from app.routes import register_routes\n"
        "    register_routes(args)\n"
        "    if args.dev:\n"
        "        from app.dev import attach\n"
        "        attach(args)\n"
        "    def later():\n"
        "        import never_at_start\n"
        "    return later\n"
    ),
    # a package re-exporting a registration function whose body imports the metrics module
    "app/routes/__init__.py": "from app.routes.impl import register_routes\n",
    "app/routes/impl.py": (
        "def register_routes(app):\n"
        "    from app.routes import metrics\n"
        "    metrics.attach(app)\n"
        "    import blake3\n"
    ),
    "app/routes/metrics.py": (
        "from prometheus_fastapi_instrumentator import Instrumentator\n"
        "def attach(app):\n"
        "    import orjson\n"
    ),
    "app/dev.py": "def attach(app):\n    import ray\n",
}


def _wheel(tmp_path: Path, files: dict[str, str]) -> Path:
    wheel = tmp_path / "app-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return wheel


def test_a_lazy_loader_read_where_the_module_or_class_body_runs_is_a_hard_import(
    tmp_path: Path,
) -> None:
    tool = _tool()
    report = tool.analyse(_wheel(tmp_path, LAZY_AND_START), "app", ["app.server"])
    ext = report["external"]
    status = {name: tool.status_of(kinds) for name, kinds in ext.items()}
    assert status["xgrammar"] == "HARD"
    assert ext["xgrammar"]["path_hard"] == ["app.grammar:13 (LazyLoader xgr.GrammarMatcher)"]
    assert status["llguidance"] == "HARD"  # a def's parameter annotation
    assert status["outlines_core"] == "path:lazy"  # read only inside a function body
    assert status["lmformatenforcer"] == "path:lazy"
    assert status["tvm_ffi"] == "path:lazy"  # `from __future__ import annotations`


def test_imports_in_start_functions_and_their_callees_are_hard(tmp_path: Path) -> None:
    tool = _tool()
    wheel = _wheel(tmp_path, LAZY_AND_START)
    plain = tool.analyse(wheel, "app", ["app.server"])
    plain_status = {name: tool.status_of(kinds) for name, kinds in plain["external"].items()}
    # without the start function, everything behind build_app looks lazy or off the path
    assert plain_status["prometheus_fastapi_instrumentator"] == "off-path"
    assert plain_status["blake3"] == "off-path"

    report = tool.analyse(wheel, "app", ["app.server"], ["app.server:build_app"])
    ext = report["external"]
    status = {name: tool.status_of(kinds) for name, kinds in ext.items()}
    # build_app -> register_routes (re-exported by app.routes) -> imports app.routes.metrics
    assert status["prometheus_fastapi_instrumentator"] == "HARD"
    assert status["blake3"] == "HARD"  # register_routes' own function-level import
    site = ext["blake3"]["path_hard"][0]
    assert site.startswith("app.routes.impl:4 ")
    assert "app.server:build_app -> app.routes.impl:register_routes" in site
    # metrics.attach is called through a module attribute: followed too
    assert status["orjson"] == "HARD"
    # a callee under `if args.dev:` (in a module imported under it) runs conditionally; a
    # nested def stays lazy
    assert status["ray"] == "maybe:conditional,lazy"
    assert status["never_at_start"] == "path:lazy"


def test_an_unknown_start_function_is_refused(tmp_path: Path) -> None:
    tool = _tool()
    wheel = _wheel(tmp_path, LAZY_AND_START)
    try:
        tool.analyse(wheel, "app", ["app.server"], ["app.server:no_such"])
    except SystemExit as exc:
        assert "app.server:no_such" in str(exc)
    else:
        raise AssertionError("an unknown start function was accepted")
