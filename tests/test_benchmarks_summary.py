"""benchmarks/README.md is generated from benchmarks/results/ and covers every result file."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _summarize():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("summarize", ROOT / "benchmarks" / "summarize.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_result_file_has_figures() -> None:
    text = _summarize().render()
    assert "(no extractor" not in text and "unreadable" not in text
    for path in (ROOT / "benchmarks" / "results").rglob("*.json"):
        rel = path.relative_to(ROOT / "benchmarks" / "results").as_posix()
        assert f"`{rel}`" in text, f"{rel} is missing from the benchmark table"


def test_committed_table_is_current() -> None:
    committed = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    assert committed == _summarize().render(), "run: python benchmarks/summarize.py"
