"""A number written with a leading decimal point keeps it (and its sign) in the answer rule: ``-.5`` was
normalised to ``5``, so a model answering ``-.5`` scored right against the label ``5`` and ``.5`` against ``5``."""

from __future__ import annotations

import pytest

from peftplug.answers import answer_matches, normalize_answer


@pytest.mark.parametrize(("text", "expected"), [
    ("-.5", "-.5"),
    (".5", ".5"),
    ("\u2212.25.", "-.25"),  # Unicode minus, trailing full stop stripped
    ("(-.5)", "-.5"),
    ("-0.5", "-0.5"),
    ("5.", "5"),
    ("...5", "5"),  # an ellipsis before a number is punctuation, not a decimal point
    ("-3", "-3"),
    ("-sport", "sport"),
])
def test_normalized_numbers(text, expected):
    assert normalize_answer(text) == expected


@pytest.mark.parametrize(("generated", "reference", "expected"), [
    ("-.5", "5", False),
    (".5", "5", False),
    ("-.5", "-.5", True),
    ("The answer: -.5", "-.5", False),  # first word only, as before
])
def test_decimal_answers_match(generated, reference, expected):
    assert answer_matches(generated, reference) is expected
