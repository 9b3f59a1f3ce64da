"""How a generated answer is compared with a reference label: one definition, used by every generation metric.

The rule (documented in docs/cli.md): take the first word of each text, case-folded, with punctuation stripped
from both ends; they match if they are equal, or if one is the other plus a plural ``s`` (so ``"Sports."`` answers
the label ``sport``). An empty generation never matches.
"""

from __future__ import annotations

import string

_PUNCTUATION = string.punctuation + "“”‘’«»…"


def normalize_answer(text: str) -> str:
    """The first word of ``text``, case-folded, punctuation stripped from its ends (``""`` if there is none).

    Args:
        text: A generated answer or a reference label.
    """
    for word in str(text).split():
        word = word.strip(_PUNCTUATION).casefold()
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
