"""The reference engine's collector as the real servers set it (``reference_engine.gc_heap``):
every process freezes its start-up heap once up (vLLM 0.32's ``freeze_gc_heap``, SGLang 0.5.23's
post-warm-up ``freeze_gc``), and a long collection is logged. Found under load: an engine
without it stood still for a full collection of ~200,000 start-up objects, over a second at a
tenth of a core, and its group was failed by its probes (docs/reliability.md, stress pass 11)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import (
    engine_factory,  # noqa: F401  (fixture)
    tiny_model_dir,  # noqa: F401  (fixture)
)

from rollsafe.adapters.reference_engine import gc_heap

REPO = Path(__file__).resolve().parents[1]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in an interpreter of its own (the collector's state is the process's)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


def test_freeze_heap_moves_every_tracked_object_out_of_the_collectors_reach() -> None:
    out = _run(
        """
        import gc
        from rollsafe.adapters.reference_engine.gc_heap import freeze_heap
        keep = [[i] for i in range(50_000)]  # tracked containers, as a loaded model's
        assert gc.get_freeze_count() == 0
        frozen = freeze_heap()
        assert frozen == gc.get_freeze_count() >= 50_000, frozen
        assert sum(len(gc.get_objects(g)) for g in range(3)) < 1_000
        print("ok", frozen)
        """
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ")


def test_a_long_collection_is_logged_with_its_generation_and_context() -> None:
    out = _run(
        """
        import gc
        from rollsafe.adapters.reference_engine.gc_heap import warn_long_pauses
        warn_long_pauses("rank 3", threshold_s=0.0)
        warn_long_pauses("rank 3", threshold_s=0.0)  # once per process
        import os, sys
        keep = [[i] for i in range(20_000)]
        gc.collect(2)
        sys.stderr.flush()
        os._exit(0)  # no collection at the interpreter's exit
        """
    )
    assert out.returncode == 0, out.stderr
    # the bound 0 logs every collection (the allocations' generation-0 ones too); the one full
    # collection once, though installed twice
    full = [ln for ln in out.stderr.splitlines() if "generation-2" in ln]
    assert len(full) == 1, out.stderr
    assert full[0].startswith("rollsafe engine: rank 3: a generation-2 garbage collection took ")


def test_the_freezes_own_collections_are_not_logged() -> None:
    out = _run(
        """
        from rollsafe.adapters.reference_engine.gc_heap import freeze_heap, warn_long_pauses
        warn_long_pauses("rank 0", threshold_s=0.0)
        keep = [[i] for i in range(20_000)]
        freeze_heap()
        import os, sys
        sys.stderr.flush()
        os._exit(0)
        """
    )
    assert out.returncode == 0, out.stderr
    assert "generation-2" not in out.stderr


def test_a_short_collection_is_not_logged() -> None:
    out = _run(
        """
        import gc
        from rollsafe.adapters.reference_engine.gc_heap import warn_long_pauses
        warn_long_pauses("rank 0", threshold_s=60.0)
        gc.collect(2)
        """
    )
    assert out.returncode == 0, out.stderr
    assert "garbage collection" not in out.stderr


def test_the_default_bound_is_below_a_probe_bound() -> None:
    # the log is for pauses a health probe can feel (the demo's bound is 1 s)
    assert 0 < gc_heap.LONG_PAUSE_S < 1.0


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_running_engine_has_frozen_its_start_up_heap(
    tiny_model_dir: Path,  # noqa: F811  (fixture)
    engine_factory: Any,  # noqa: F811  (fixture)
    ranks: int,
) -> None:
    eng = engine_factory(tiny_model_dir, ranks=ranks)
    # torch, transformers and the model: far more than a bare interpreter's ~10,000 objects
    assert eng.ready["gc_frozen"] > 50_000, eng.ready
    answer = eng.post(
        "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    )
    assert answer.status_code == 200, answer.text
