"""Trainer integrations: a trainer framework's rollout path wired to a :class:`RolloutFleet`.

One module per framework, each importing that framework (install it yourself, or the matching
extra):

=====================  ==========================================  ===========================
module                 framework                                   extra
=====================  ==========================================  ===========================
``integrations.trl``   TRL's ``GRPOTrainer`` (1.16.x)              ``rollsafe[trl]``
=====================  ==========================================  ===========================

How verl, slime and XTuner trainers wire the same three calls (generate, sync, the engines'
launch): ``docs/integrations.md``. Importing this package imports no framework.
"""

from __future__ import annotations

__all__: list[str] = []
