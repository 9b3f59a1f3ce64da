"""Second review of the answer rule (:mod:`peftplug.answers`): a minus sign before a number is part of the answer
(``-3`` is not ``3``), and Unicode punctuation (dashes, CJK full stops) is stripped like ASCII punctuation."""

from __future__ import annotations

import pytest

from peftplug.answers import answer_matches, normalize_answer


@pytest.mark.parametrize(("generated", "reference", "expected"), [
    ("-3", "3", False),
    ("3", "-3", False),
    ("-3.", "-3", True),
    ("(\u22123)", "-3", True),  # the Unicode minus sign, in parentheses
    ("+3", "3", True),
    ("$5", "5", True),
    ("Tech\u2014", "tech", True),  # an em dash after the word
    ("tech\u3002", "tech", True),  # a CJK full stop
    ("\u00abSport\u00bb", "sport", True),
    ("Sports.", "sport", True),  # the documented rule still holds
    ("The answer is business.", "business", False),
    ("--", "-", False),
])
def test_answers_on_realistic_outputs(generated, reference, expected):
    assert answer_matches(generated, reference) is expected


def test_a_minus_is_kept_only_before_a_number():
    assert normalize_answer("-abc") == "abc"
    assert normalize_answer("  \u2013 42 apples") == "42"  # a lone dash is not a word
    assert normalize_answer("**-42**") == "-42"
