"""The package's version, one constant (``rollsafe.__version__``; written into each export's
manifest). Imports nothing."""

from __future__ import annotations

__all__ = ["VERSION"]

VERSION = "0.1.0"
