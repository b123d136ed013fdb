"""The tests' replay of a recorded run: ``rollsafe verify --trace RUN_DIR`` (#36).

Every test that runs a fleet end to end (the chaos scenarios, the demo, the real-vLLM tests)
ends by replaying its recorded run through the verifier's model with
:func:`assert_run_replays`: the command exits 0, names no divergence and takes every recorded
transition. What a divergence looks like is ``tests/test_trace_replay.py``'s subject.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from typing import Any

from rollsafe.cli import main
from rollsafe.fleet import RolloutFleet


def assert_run_replays(run_dir: Path) -> str:
    """Replay ``run_dir`` (a ``timeline.jsonl`` written by ``RolloutFleet.record`` or the demo)
    with ``rollsafe verify --trace``: exit 0, ``divergences: 0``, ``replayed N of N``. Returns
    what the command printed."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["verify", "--trace", str(run_dir)])
    said = out.getvalue() + err.getvalue()
    assert code == 0 and "divergences: 0" in said, said
    taken = re.search(r"^replayed (\d+) of (\d+) recorded transitions", said, re.M)
    assert taken is not None and taken.group(1) == taken.group(2) != "0", said
    return said


class FromMemory:
    """``fleet`` as ``rollsafe.observe.runfile.build_rows`` reads it, without its stream: the
    record written from what the fleet keeps in memory (how ``record`` wrote every run before
    runs were streamed, and still writes one without ``FleetConfig.run_dir``)."""

    stream = None

    def __init__(self, fleet: RolloutFleet) -> None:
        self._fleet = fleet

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fleet, name)

    def timeline(self) -> list[dict[str, Any]]:
        return self._fleet.timeline(from_memory=True)
