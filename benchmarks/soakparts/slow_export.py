"""The soak's slow export: the real :class:`~rollsafe.hf.HFExporter` whose writer can be held.

This machine offers no way to slow one filesystem down for real (no device-mapper ``delay``
target in its kernel, no FUSE library installed, cgroup v1 ``blkio`` does not throttle buffered
writes), so a slow export is *emulated* one level up, as ``tests/test_chaos_exports.py`` does:
:class:`SlowExporter` is the real exporter, and once :meth:`SlowExporter.slow_next` is armed the
writer thread of the next export, its shards already written to the hidden temp dir, waits
``delay_s`` before reading them back (or less, when the fleet abandons the export meanwhile).
Everything else is the real export: the lifecycle, the late-export judgement at the next sync,
the abandonment, the cleanup of the temp dir.

:func:`slow_exports` makes :class:`RolloutFleet.start` build a :class:`SlowExporter`
(``rollsafe.hf.HFExporter`` is looked up when the control plane is built).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import rollsafe.hf
from rollsafe.hf import HFExporter
from rollsafe.hf.layout import ShardPlan
from rollsafe.hf.snapshot import HostArena
from rollsafe.hf.writer import FileRecord

__all__ = ["SlowExporter", "slow_exports"]


class SlowExporter(HFExporter):
    """The real exporter; :meth:`slow_next` holds the writer of the next export ``delay_s``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slow_lock = threading.Lock()
        self._armed: float | None = None  # the next export's delay (s)
        self._delays: dict[int, float] = {}  # version -> its delay, once its writer took it
        #: versions whose writer was held, and for how long (s)
        self.held: dict[int, float] = {}

    def slow_next(self, delay_s: float) -> None:
        """The next export's writer waits ``delay_s`` before reading its shards back."""
        with self._slow_lock:
            self._armed = delay_s

    def disarm(self) -> None:
        with self._slow_lock:
            self._armed = None

    def start_hf_export(self, named_tensors: Any, version: int, **kwargs: Any) -> Any:
        with self._slow_lock:
            if self._armed is not None:
                self._delays[version] = self._armed
                self._armed = None
        return super().start_hf_export(named_tensors, version, **kwargs)

    def _read_back(  # type: ignore[override]
        self, tmp: Path, plan: ShardPlan, arena: HostArena, handle: Any
    ) -> FileRecord:
        with self._slow_lock:
            delay = self._delays.pop(handle.version, None)
        if delay is not None:
            t0 = time.monotonic()
            deadline = t0 + delay
            while time.monotonic() < deadline and handle.lifecycle.state != "abandoned":
                time.sleep(0.1)
            self.held[handle.version] = round(time.monotonic() - t0, 2)
        return HFExporter._read_back(tmp, plan, arena, handle)


@contextlib.contextmanager
def slow_exports() -> Iterator[None]:
    """While inside: a fleet that starts builds a :class:`SlowExporter`."""
    saved = rollsafe.hf.HFExporter
    rollsafe.hf.HFExporter = SlowExporter  # type: ignore[misc]
    try:
        yield
    finally:
        rollsafe.hf.HFExporter = saved  # type: ignore[misc]
