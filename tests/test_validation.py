"""peftplug.validation: the one accepted-type set and message wording of numeric options."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from peftplug.validation import check_int, check_real, python_number


# ------------------------------------------------------------------------------------------------- check_real
@pytest.mark.parametrize("value,expected", [
    (2, 2.0), (-1.5, -1.5), (0, 0.0), (Fraction(1, 4), 0.25), (np.float32(0.5), 0.5), (np.float64(-3.0), -3.0),
    (np.int64(7), 7.0), (np.array(2.5), 2.5), (torch.tensor(2.5), 2.5), (torch.tensor(3), 3.0),
    (torch.tensor(1.5, dtype=torch.bfloat16), 1.5),
])
def test_real_scalars_are_accepted_and_returned_as_python_floats(value, expected):
    out = check_real("x", value)
    assert type(out) is float and out == expected


@pytest.mark.parametrize("value", [
    True, False, np.bool_(True), torch.tensor(True), np.array(True), 1 + 2j, np.complex64(1), torch.tensor(1 + 0j),
    "1.0", b"1", None, [1.0], (1.0,), torch.tensor([1.0]), np.array([1.0]), torch.ones(2, 2), object(),
    math.inf, -math.inf, math.nan, torch.tensor(math.inf), np.float64("nan"), 10**400, Fraction(10**400),
])
def test_everything_else_is_refused_with_the_field_and_value(value):
    with pytest.raises(ValueError, match=r"^speed must be a finite real number, got ") as info:
        check_real("speed", value)
    assert str(info.value).endswith(repr(value))


@pytest.mark.parametrize("kwargs,message", [
    ({"low": 0.0}, ">= 0"),
    ({"low": 0.0, "low_open": True}, "> 0"),
    ({"high": 1.0}, "<= 1"),
    ({"high": 1.0, "high_open": True}, "< 1"),
    ({"low": 0.0, "high": 1.0}, "in [0, 1]"),
    ({"low": 0.0, "high": 1.0, "low_open": True}, "in (0, 1]"),
    ({"low": 0.0, "high": 1.0, "high_open": True}, "in [0, 1)"),
    ({"low": 1e-8, "high": 2, "low_open": True, "high_open": True}, "in (1e-08, 2)"),
])
def test_the_message_states_the_accepted_range(kwargs, message):
    with pytest.raises(ValueError) as info:
        check_real("x", "bad", **kwargs)
    assert str(info.value) == f"x must be a finite real number {message}, got 'bad'"


@pytest.mark.parametrize("value,kwargs,ok", [
    (0.0, {"low": 0.0}, True), (0.0, {"low": 0.0, "low_open": True}, False),
    (1.0, {"high": 1.0}, True), (1.0, {"high": 1.0, "high_open": True}, False),
    (0.5, {"low": 0.0, "high": 1.0, "low_open": True, "high_open": True}, True),
    (torch.tensor(-0.1), {"low": 0.0}, False), (np.float32(1.5), {"high": 1.0}, False),
])
def test_bounds_are_inclusive_unless_open(value, kwargs, ok):
    if ok:
        assert check_real("x", value, **kwargs) == float(value)
    else:
        with pytest.raises(ValueError, match="x must be a finite real number"):
            check_real("x", value, **kwargs)


def test_a_hint_follows_the_range():
    with pytest.raises(ValueError, match=r"^x must be a finite real number > 0 \(a temperature\), got 0$"):
        check_real("x", 0, low=0.0, low_open=True, hint="a temperature")


# -------------------------------------------------------------------------------------------------- check_int
@pytest.mark.parametrize("value", [3, np.int64(3), np.uint8(3), torch.tensor(3), np.array(3)])
def test_integer_scalars_are_accepted_and_returned_as_python_ints(value):
    out = check_int("n", value, low=1)
    assert type(out) is int and out == 3


@pytest.mark.parametrize("value", [3.0, 2.5, np.float64(3.0), torch.tensor(3.0), True, np.bool_(True), "3", None,
                                   torch.tensor([3]), math.nan, 3 + 0j])
def test_non_integers_are_refused_integral_floats_included(value):
    with pytest.raises(ValueError, match=r"^n must be an int >= 1, got "):
        check_int("n", value, low=1)


@pytest.mark.parametrize("kwargs,message", [
    ({}, ""), ({"low": 1}, " >= 1"), ({"high": 4}, " <= 4"), ({"low": 1, "high": 4}, " in [1, 4]"),
    ({"low": 1, "high": 4, "hint": "K = 4"}, " in [1, 4] (K = 4)"),
])
def test_int_messages_state_the_range(kwargs, message):
    with pytest.raises(ValueError) as info:
        check_int("rank", "x", **kwargs)
    assert str(info.value) == f"rank must be an int{message}, got 'x'"


def test_int_bounds_are_inclusive_and_exact_for_large_ints():
    assert check_int("seed", -(2**63), low=-(2**63)) == -(2**63)
    assert check_int("seed", 10**30, low=0) == 10**30
    with pytest.raises(ValueError, match=r"seed must be an int >= -9223372036854775808"):
        check_int("seed", -(2**63) - 1, low=-(2**63))
    for value in (0, 5):
        with pytest.raises(ValueError, match=r"in \[1, 4\]"):
            check_int("rank", value, low=1, high=4)


# --------------------------------------------------------------------------------------------- python_number
def test_python_number_unwraps_tensors_and_numpy_and_keeps_ints_and_floats():
    for value in (0, 3, 0.5, None):
        assert python_number(value) is value
    assert type(python_number(np.float32(0.5))) is float and type(python_number(np.int64(2))) is int
    assert type(python_number(torch.tensor(2))) is int and type(python_number(torch.tensor(0.5))) is float
    assert type(python_number(np.array(0.5))) is float
    json.dumps([python_number(v) for v in (torch.tensor(1.5), np.float32(1.0), np.int64(3))])
