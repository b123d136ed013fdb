"""``benchmarks/gpu/ce_tcp_slice_sweep.py`` on a host without a GPU: arguments and the JSON.

The sweep itself needs an H200 with Mooncake (``benchmarks/gpu/README.md``); here its argument
checks, its summary of pushes and its ``--smoke`` output run, so the script cannot rot in CI.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sweep() -> ModuleType:
    path = ROOT / "benchmarks" / "gpu" / "ce_tcp_slice_sweep.py"
    spec = importlib.util.spec_from_file_location("ce_tcp_slice_sweep", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_arguments_default_to_the_issue_sizes_and_refuse_bad_ones(sweep: ModuleType) -> None:
    args = sweep.parse_args(["--out", "x.json"])
    assert args.slices == [16 << 20, 1 << 20, 4 << 20, 64 << 20] and args.repeats == 3
    assert args.baseline_kib == 64
    for bad in (["--slices-kib", "0"], ["--slices-kib", ""], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            sweep.parse_args(["--out", "x.json", *bad])


def test_summary_drops_the_warm_up_and_takes_median_and_p95(sweep: ModuleType) -> None:
    runs = [
        {"seconds": s, "ok": True, "start": float(i), "end": float(i) + s}
        for i, s in enumerate([9.0, 4.0, 3.5, 4.5])
    ]
    row = {"slice_bytes": 1 << 20, "bytes": 8_000_000_000, "runs": runs}
    got = sweep.summarize(row, True, None)
    assert got["warmup_s"] == 9.0 and got["seconds_all"] == [4.0, 3.5, 4.5]
    assert got["median_s"] == 4.0 and got["p95_s"] == 4.5 and got["min_s"] == 3.5
    assert got["gb_s"] == 2.0 and got["ok"] and got["slice_kib"] == 1024
    failed = sweep.summarize({**row, "runs": [*runs[:2], {**runs[2], "ok": False}]}, True, None)
    assert not failed["ok"] and failed["seconds_all"] == [4.0, 3.5]
    assert failed["median_s"] == 4.0  # only pushes that succeeded are timed
    assert sweep.pct([1.0, 2.0, 3.0, 4.0, 5.0], 0.95) == 5.0


def test_smoke_writes_the_json_without_a_gpu(sweep: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "slices.json"
    assert sweep.main(["--smoke", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["benchmark"] == "ce_tcp_slice_sweep" and got["smoke"] is True
    assert got["slices"] == [] and got["errors"] == []
    assert got["args"]["slices"] == [16 << 20, 1 << 20, 4 << 20, 64 << 20]
