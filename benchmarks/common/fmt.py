"""Number formatting of the benchmark pages: one rule for missing and non-finite values."""

from __future__ import annotations

import math


def fmt(value, spec: str = ".3f", none: str = "—", nan: str = "nan") -> str:
    """``format(value, spec)``, with ``none`` for a missing value and ``nan`` for a NaN.

    Args:
        value: A number or ``None``.
        spec: Format specification (``".3f"``, ``"d"``, ``",.0f"``, ...).
        none: Text for ``None``.
        nan: Text for a float NaN.
    """
    if value is None:
        return none
    if isinstance(value, float) and math.isnan(value):
        return nan
    return format(value, spec)
