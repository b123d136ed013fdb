"""The reference engine's garbage-collector settings, as the real servers have them.

Owns two things every engine process (rank 0's server and each rank of its own) does:

* :func:`freeze_heap` once the process is ready to serve: a full collection, then
  ``gc.freeze()``, so the start-up heap (torch, transformers, the model: about 200,000 tracked
  objects) is never walked again by a full collection. vLLM 0.32 does this in its engine core
  and API server (``vllm.utils.gc_utils.freeze_gc_heap``), SGLang 0.5.23 after its warm-up
  (``_freeze_gc_after_server_warmup``, every process). Without it a full collection holds the
  GIL for ~130 ms of CPU, which on a loaded machine (a 2-core host at a load of 20 gives a
  process a tenth of a core) is over a second in which the engine answers nothing: no probe,
  no token (docs/reliability.md, stress pass 11);
* :func:`warn_long_pauses`, installed once it serves (after the freeze): a collection longer
  than a bound is logged on stderr with its generation and the objects tracked (SGLang's
  ``--gc-warning-threshold-secs`` warning), so an engine's kept log says when it stood still
  for its collector. Nothing is logged before the ready line (start-up is timed apart).
"""

from __future__ import annotations

import gc
import sys
import time
from typing import Any

__all__ = ["LONG_PAUSE_S", "freeze_heap", "warn_long_pauses"]

#: a collection at least this long is logged (:func:`warn_long_pauses`)
LONG_PAUSE_S = 0.25

_started: dict[int, float] = {}
_installed: list[Any] = []
_quiet: list[bool] = []  # non-empty while freeze_heap collects


def freeze_heap() -> int:
    """Collect every generation, then move every tracked object to the permanent generation
    (see the module); the number of objects frozen. These collections, made on purpose before
    the process serves, are not logged as pauses (:func:`warn_long_pauses`)."""
    _quiet.append(True)
    try:
        gc.collect(0)
        gc.collect(1)
        gc.collect(2)
    finally:
        _quiet.pop()
    gc.freeze()
    return gc.get_freeze_count()


def warn_long_pauses(context: str, threshold_s: float = LONG_PAUSE_S) -> None:
    """Log each collection of this process that lasts ``threshold_s`` or more on stderr, naming
    ``context`` (e.g. ``rank 0``); installed once per process."""
    if _installed:
        return

    def callback(phase: str, info: dict[str, Any]) -> None:
        generation = int(info.get("generation", -1))
        if phase == "start":
            _started[generation] = time.monotonic()
            return
        began = _started.pop(generation, None)
        if began is None or _quiet:
            return
        took = time.monotonic() - began
        if took >= threshold_s:
            counts = gc.get_count()
            print(
                f"rollsafe engine: {context}: a generation-{generation} garbage collection took "
                f"{took:.3f}s (collected {info.get('collected', '?')}, frozen "
                f"{gc.get_freeze_count()}, counts {counts})",
                file=sys.stderr,
                flush=True,
            )

    gc.callbacks.append(callback)
    _installed.append(callback)
