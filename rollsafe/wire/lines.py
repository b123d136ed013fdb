"""The start-up lines an engine process prints on stdout, one definition for both ends.

The reference engine prints ``READY_PREFIX + json`` once it serves (a warm standby prints
``STANDBY_PREFIX + json`` once its imports are done); the launcher reads them. Each prefix
includes the separating space. Imports only the standard library.
"""

from __future__ import annotations

__all__ = ["READY_PREFIX", "STANDBY_PREFIX"]

#: Start of the line an engine prints once it serves: ``ROLLSAFE_READY {json}``.
READY_PREFIX = "ROLLSAFE_READY "
#: Start of the line a warm standby (``--standby``) prints once its imports are done.
STANDBY_PREFIX = "ROLLSAFE_STANDBY "
