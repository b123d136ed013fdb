"""Dtype names on the wire: ``torch.bfloat16`` <-> ``"bfloat16"``, and element sizes.

Owns the dtypes a weight may travel as (:data:`WIRE_DTYPES`); both ends of every transport
name dtypes through these helpers. Imports only torch.
"""

from __future__ import annotations

import torch

from rollsafe.errors import BucketFormatError

__all__ = ["WIRE_DTYPES", "dtype_from_name", "dtype_name", "itemsize"]

#: name -> dtype of every dtype a weight may travel as (those this torch build has)
WIRE_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float32",
        "float16",
        "bfloat16",
        "float64",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "float8_e4m3fn",
        "float8_e5m2",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16``; unknown names raise
    :class:`~rollsafe.errors.BucketFormatError`."""
    key = name.removeprefix("torch.") if isinstance(name, str) else name
    if not isinstance(key, str) or key not in WIRE_DTYPES:
        raise BucketFormatError(f"unknown dtype {name!r}; expected one of {sorted(WIRE_DTYPES)}")
    return WIRE_DTYPES[key]


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()
