"""Each fleet operation written once, as a pure step sequence (``docs/design.md``, "Operations").

An operation is a generator: it yields :mod:`~rollsafe.operations.effects` (register, update,
send an event, start an export, ...), receives each one's outcome (:class:`Ok`,
:class:`Failed`, :class:`TimedOut`) and returns its result; between steps it asks
:mod:`rollsafe.policy`. It does no I/O, starts no thread and reads no clock. Two executors run
the same sequence: the fleet's coordinators perform each effect with real I/O, and
``rollsafe verify`` performs it on the model's machines and ground truth, choosing the outcomes.
What the verifier explores is then what the fleet runs, by construction.

| Module | Owns |
|---|---|
| :mod:`~rollsafe.operations.effects` | the effects and outcomes, as frozen data |
| :mod:`~rollsafe.operations.sync` | one weight sync of version N |
| :mod:`~rollsafe.operations.recover` | one recovery attempt on an ``inactive`` group |
| :mod:`~rollsafe.operations.probe` | one health probe of one group |
| :mod:`~rollsafe.operations.place` | a node's loss, a group's re-placement, a group's removal |

Executors look a sequence up on its module at call time (``sync_op.sync(...)`` after
``from rollsafe.operations import sync as sync_op``), so patching it changes the fleet and the
verifier alike (as with :mod:`rollsafe.policy`).
"""

from __future__ import annotations

from rollsafe.operations.effects import Effect, Failed, Ok, Outcome, TimedOut, drive

__all__ = ["Effect", "Failed", "Ok", "Outcome", "TimedOut", "drive"]
