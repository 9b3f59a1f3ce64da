"""Checks of numeric options: one accepted-type set and one message wording for every package.

A leaf module (it imports nothing of peftplug, only the standard library and torch), so every method package may
use it. The accepted values, for every option that wants a real number or an int:

- Python ``int`` and ``float`` and the other :class:`numbers.Real` types (``fractions.Fraction``, and numpy's
  real scalars such as ``np.float32`` and ``np.int64``, which numpy registers as such);
- 0-dim torch tensors and 0-dim numpy arrays of an integer or floating dtype (a one-element tensor of another
  shape is refused: torch's own number arguments refuse it too);
- never a ``bool`` (``numbers.Integral``, but ``rank: true`` in a recipe is a mistake, not rank 1), a bool or
  complex tensor, a string, ``decimal.Decimal`` or a non-finite value;
- where an int is asked, only integer types: ``3.0`` and float tensors are refused.

A refused value raises ``ValueError("<name> must be <kind> <range>, got <value!r>")``, the kind being "a finite
real number" or "an int", e.g. ``lr must be a finite real number >= 0, got inf``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

__all__ = ["check_int", "check_real", "python_number"]


def _scalar(value: Any, integral: bool) -> int | float | None:
    """The Python number behind an accepted scalar (bounds not checked), or ``None`` for a refused type.

    Args:
        value: The value given.
        integral: Accept integer types only.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, torch.Tensor):
        # A bool tensor is a flag and a complex one has no order: neither is a number an option can take.
        if value.dim() != 0 or value.dtype == torch.bool or value.dtype.is_complex:
            return None
        if integral and value.dtype.is_floating_point:
            return None
        return value.item()
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0 and hasattr(value, "dtype"):
        # A 0-dim numpy array (numpy scalars are numbers.Real already); checked by dtype kind so that this leaf
        # module does not import numpy: i/u integers, f floats (b bool, c complex and the rest refused).
        if value.dtype.kind not in ("iu" if integral else "iuf"):
            return None
        return value.item()
    if isinstance(value, numbers.Integral if integral else numbers.Real):
        return int(value) if integral else value
    return None


def _bound_text(bound: float) -> str:
    return f"{bound:g}" if isinstance(bound, float) else str(bound)


def _range_text(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is None and high is None:
        return ""
    if high is None:
        return f" {'>' if low_open else '>='} {_bound_text(low)}"
    if low is None:
        return f" {'<' if high_open else '<='} {_bound_text(high)}"
    return f" in {'(' if low_open else '['}{_bound_text(low)}, {_bound_text(high)}{')' if high_open else ']'}"


def _refuse(name: str, kind: str, value: Any, range_text: str, hint: str | None) -> ValueError:
    return ValueError(f"{name} must be {kind}{range_text}{f' ({hint})' if hint else ''}, got {value!r}")


def _in_range(number: float, low: float | None, high: float | None, low_open: bool, high_open: bool) -> bool:
    above = low is None or (number > low if low_open else number >= low)
    below = high is None or (number < high if high_open else number <= high)
    return above and below


def check_real(name: str, value: Any, low: float | None = None, high: float | None = None, *,
               low_open: bool = False, high_open: bool = False, hint: str | None = None) -> float:
    """Returns ``value`` as a float, or raises ``ValueError`` unless it is a finite real number in the range.

    Args:
        name: The field's name, as the message shows it (e.g. ``"SteeringConfig.multiplier"``).
        value: The value to check (see the module docstring for the accepted types).
        low: Lower bound (``None``: none).
        high: Upper bound (``None``: none).
        low_open: Whether ``low`` itself is excluded.
        high_open: Whether ``high`` itself is excluded.
        hint: Said after the range in the message, in parentheses (why the range is what it is).

    Returns:
        The value as a Python float.

    Raises:
        ValueError: Naming the field, the accepted range and the value given.
    """
    number = _scalar(value, integral=False)
    if number is not None:
        try:
            number = float(number)  # an int or Fraction beyond float's range is not a finite float either
        except OverflowError:
            number = None
    if number is None or not math.isfinite(number) or not _in_range(number, low, high, low_open, high_open):
        raise _refuse(name, "a finite real number", value, _range_text(low, high, low_open, high_open), hint)
    return number


def check_int(name: str, value: Any, low: int | None = None, high: int | None = None, *,
              hint: str | None = None) -> int:
    """Returns ``value`` as a Python int; raises the ``ValueError`` of :func:`check_real`, worded "an int", unless
    it is an integer in ``[low, high]``.

    Integral floats (``3.0``) are refused like any float: a caller that takes them converts them itself.

    Args:
        name: As for :func:`check_real`.
        value: As for :func:`check_real` (integer types only).
        low: Smallest accepted value (``None``: none).
        high: Largest accepted value (``None``: none).
        hint: As for :func:`check_real`.
    """
    number = _scalar(value, integral=True)
    if number is None or not _in_range(number, low, high, False, False):
        raise _refuse(name, "an int", value, _range_text(low, high, False, False), hint)
    return number


def check_flag(name: str, value: Any) -> bool:
    """Returns ``value`` unless it is not ``True`` or ``False``; then raises ``ValueError("<name> must be True or
    False, got <value!r>")``.

    Options read with ``bool(value)`` took a string such as ``"false"`` or ``"no"`` (a YAML or CLI value quoted by
    mistake) as ``True``, silently.

    Args:
        name: The field's name, as the message shows it.
        value: The value to check.
    """
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")  # noqa: TRY004  (one error type for options)
    return value


def python_number(value: Any) -> Any:
    """The plain Python number behind a checked tensor or numpy value (JSON and YAML can write it); an ``int``
    or ``float`` (and anything else) is returned as it is, so that a value given as ``0`` stays an int.

    Args:
        value: A value that :func:`check_real` or :func:`check_int` accepted, or ``None``.
    """
    if isinstance(value, (int, float)) or value is None:
        return value
    if isinstance(value, torch.Tensor) or (type(value).__module__ == "numpy" and hasattr(value, "item")):
        return value.item()
    return value
