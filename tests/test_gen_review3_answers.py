"""Third review of the answer rule (:mod:`peftplug.answers`): the same characters in two Unicode encodings match
(an NFD label file against an NFC answer, fullwidth letters), and invisible format characters at a word's ends
(zero-width space, BOM, soft hyphen) do not make it another word."""

from __future__ import annotations

import unicodedata

import pytest

from peftplug.answers import answer_matches, normalize_answer

NFD = unicodedata.normalize("NFD", "Économie")  # "E" + U+0301 COMBINING ACUTE ACCENT, as macOS writes file names


@pytest.mark.parametrize(("generated", "reference", "expected"), [
    ("Économie.", NFD, True),
    (NFD, "économie", True),
    ("\uff33\uff50\uff4f\uff52\uff54", "sport", True),  # fullwidth "Ｓｐｏｒｔ"
    ("\uff11\uff12", "12", True),  # fullwidth digits
    ("\uff0d\uff13", "-3", True),  # fullwidth minus before a fullwidth 3: still negative
    ("\uff13", "-3", False),
    ("sport\u200b", "sport", True),  # zero-width space
    ("\ufeffTech", "tech", True),  # byte-order mark
    ("busi\u00adness", "business", False),  # a soft hyphen inside a word is kept: only the ends are stripped
    ("STRASSE", "Straße", True),  # case folding, as before
    ("Technique", "tech", False),
    ("\u0661\u0662", "12", False),  # Arabic-Indic digits are other characters, not a compatibility form
    ("", "\u200b", False),  # empty generation, and a label of nothing visible: never a match
])
def test_answers_in_other_unicode_forms(generated, reference, expected):
    assert answer_matches(generated, reference) is expected


def test_normalized_words_by_hand():
    assert normalize_answer(NFD + " et finance") == "\u00e9conomie"  # one code point, composed
    assert normalize_answer("\u200b \u00ab\u200bSport\u200b\u00bb") == "sport"
    assert normalize_answer("\u200b") == ""
