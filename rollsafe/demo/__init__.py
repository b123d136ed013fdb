"""``rollsafe demo``: a trainer actor, a rollout fleet, weight syncs, async exports and a SIGKILL.

What the demo does, and what it prints and writes: :mod:`rollsafe.demo.run`, whose
:func:`run_demo` reads as the list of phases below. One module per phase, and a report:

* :mod:`~rollsafe.demo.options` -- the flags (:class:`DemoOptions`, :func:`add_arguments`) and
  the crash's fixed place;
* :mod:`~rollsafe.demo.state` -- :class:`~rollsafe.demo.state.DemoRun`, the state the phases
  hand on (trainer, fleet, load, crash, step records, failures, timings);
* :mod:`~rollsafe.demo.setup` -- directories and banner; tiny model, trainer, fleet;
* :mod:`~rollsafe.demo.rollout` -- the load generator (:class:`RolloutLoad`) and each step's
  rollout phase, where the crash happens;
* :mod:`~rollsafe.demo.train` -- one optimizer step;
* :mod:`~rollsafe.demo.sync` -- the new version to every engine;
* :mod:`~rollsafe.demo.verify` -- the invariants (checksums at the start, after each step and at
  the end, the last export, dispatch, the crashed group's return);
* :mod:`~rollsafe.demo.nodes` -- ``--nodes``: the local Ray cluster, the removal of a worker
  node mid-rollout, its phases and checks;
* :mod:`~rollsafe.demo.settle` -- everything stops on every way out (SIGTERM included);
* :mod:`~rollsafe.demo.progress` -- the live lines; :mod:`~rollsafe.demo.figures` -- recovery
  latency, throughput lost, continuation; :mod:`~rollsafe.demo.report` -- ``--out``'s files, the
  printed report and the exit status.
"""

from rollsafe.demo.options import CRASH_DELAY_S, CRASH_GROUP_INDEX, DemoOptions, add_arguments
from rollsafe.demo.report import mermaid_paths
from rollsafe.demo.rollout import THINK_S, RolloutLoad
from rollsafe.demo.run import main, run_demo

__all__ = [
    "CRASH_DELAY_S",
    "CRASH_GROUP_INDEX",
    "THINK_S",
    "DemoOptions",
    "RolloutLoad",
    "add_arguments",
    "main",
    "mermaid_paths",
    "run_demo",
]
