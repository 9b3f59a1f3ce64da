"""How a generated answer is compared with a reference label: one definition, used by every generation metric.

The rule (documented in docs/cli.md): take the first word of each text, case-folded, with punctuation stripped
from both ends; they match if they are equal, or if one is the other plus a plural ``s`` (so ``"Sports."`` answers
the label ``sport``). An empty generation never matches. Punctuation is every Unicode punctuation or symbol
character (``—``, ``。``, ``$`` ...), except a minus sign or a decimal point right before a number: ``-3`` is not ``3``, ``-.5`` not ``5``; invisible format
characters (zero-width space, soft hyphen, byte-order mark) are stripped from the ends too. Both texts are compared in
Unicode's compatibility form (NFKC), so one text written in two encodings of the same characters (``É`` as one code
point or as ``E`` plus a combining accent, fullwidth ``ｓｐｏｒｔ``) matches.
"""

from __future__ import annotations

import unicodedata

# Minus signs: kept before a number (its value's sign), stripped elsewhere like any punctuation.
_MINUS = "-\u2212\u2012\u2013"


def _is_punctuation(char: str) -> bool:
    """Unicode punctuation (P*) or symbol (S*): ASCII's and also dashes, CJK stops, currency signs; or an invisible
    format character (Cf: zero-width space, soft hyphen, BOM), which would make ``"sport\u200b"`` another word."""
    category = unicodedata.category(char)
    return category[0] in "PS" or category == "Cf"


def _strip_word(word: str) -> str:
    start, end = 0, len(word)
    while start < end and _is_punctuation(word[start]):
        start += 1
    while end > start and _is_punctuation(word[end - 1]):
        end -= 1
    core = word[start:end]
    if not core[:1].isdigit():
        return core
    # ".5" and "-.5" are numbers of their own, not "5": keep a decimal point that opens the word or follows its sign.
    if start > 0 and word[start - 1] == "." and (start == 1 or word[start - 2] in _MINUS):
        start -= 1
        core = "." + core
    # "-3" is an answer of its own, not "3" (a sign is punctuation by category): keep one minus before a number.
    if start > 0 and word[start - 1] in _MINUS:
        core = "-" + core
    return core


def normalize_answer(text: str) -> str:
    """The first word of ``text``, case-folded, punctuation stripped from its ends (``""`` if there is none).

    Args:
        text: A generated answer or a reference label.
    """
    # NFKC: an answer decoded as NFC and a label file saved as NFD (macOS) spell "Économie" with different code
    # points, and casefold alone left them unequal; fullwidth letters and digits become their ASCII forms.
    for word in unicodedata.normalize("NFKC", str(text)).split():
        word = _strip_word(word).casefold()
        if word:
            return word
    return ""


def answer_matches(generated: str, reference: str) -> bool:
    """Whether a generated answer gives the reference label (see the module docstring for the rule).

    Args:
        generated: The model's answer text.
        reference: The expected label text.
    """
    got, want = normalize_answer(generated), normalize_answer(reference)
    if not got or not want:
        return False
    return got == want or got == want + "s" or got + "s" == want
