"""Concept data, held-out prompts and factual questions of the SmolLM2 steering benchmark (benchmarks/steering/llm.py).

Everything comes from the shared data directory at run time (never copied into the repository) or is written
here: the SST-2 sentences become EasyEdit2-style rows (a shared question, a matching = positive and a
not-matching = negative answer), the representation-engineering happiness/sadness scenario lists become happy/sad
rows, and the third concept, *weddings* (ActAdd's running example, Turner et al. 2023), is written here: a topic a
135M chat model can talk about on any opener, measured by whether its answer mentions the topic -- a concept of
another kind than sentiment (topic vs tone), so the same methods are judged on both.

None of the held-out openers or factual questions appears in any training row.
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

# The EasyEdit2 "sst2" layout: one shared request, a positive (matching) and a negative (not-matching) sentence.
SST2_QUESTIONS = (
    "Write one sentence about a movie.",
    "Give a short opinion of a film.",
    "Say something about the last film you watched.",
    "Describe a movie in a sentence.",
)

# Held-out neutral openers (the two first), none of them in any training row.
OPENERS = (
    "Write a short review of the film I saw yesterday.",
    "Tell me about your day.",
    "Describe the weather this morning.",
    "What do you think of the new restaurant downtown?",
    "Tell me about a book you read recently.",
    "How was your weekend?",
    "Describe your favourite city.",
    "What do you think about Mondays?",
    "Tell me about your neighbour's dog.",
    "Write a few sentences about the sea.",
    "Describe a train journey.",
    "What is it like to work in an office?",
    "Tell me about the concert last night.",
    "Describe the town where you grew up.",
    "What do you think of modern art?",
    "Write a short note to a colleague.",
    "Describe a walk in the park.",
    "Tell me about your first job.",
    "What do you think about online shopping?",
    "Describe a rainy afternoon.",
    "Tell me about a meal you cooked.",
    "Write a postcard from a holiday.",
    "Describe the view from your window.",
    "What do you think of the local football team?",
    "Tell me about a song you heard today.",
    "Describe an old photograph.",
    "Write a short story about a cat.",
    "Tell me about a museum you visited.",
    "What do you think of the new phone?",
    "Describe a morning at the market.",
    "Tell me about your commute.",
    "Write a few lines about winter.",
    "Describe a birthday party.",
    "What do you think about learning languages?",
    "Tell me about a teacher you remember.",
    "Describe a visit to the dentist.",
    "Write a short message to a friend.",
    "Tell me about the hotel you stayed in.",
    "Describe a football match.",
    "What do you think about the weather forecast?",
    "Tell me about a game you played.",
    "Describe a long flight.",
)

# Short factual questions with accepted answers; only those the unsteered model answers right count.
FACTS = (
    ("What is the capital of France?", ("Paris",)),
    ("What is the capital of Japan?", ("Tokyo",)),
    ("What is the capital of Italy?", ("Rome",)),
    ("What is the capital of Germany?", ("Berlin",)),
    ("What is the capital of Spain?", ("Madrid",)),
    ("What is the capital of England?", ("London",)),
    ("What is the largest planet in the solar system?", ("Jupiter",)),
    ("Which planet is known as the Red Planet?", ("Mars",)),
    ("What is 2 plus 2?", ("4", "four")),
    ("How many days are there in a week?", ("7", "seven")),
    ("How many legs does a spider have?", ("8", "eight")),
    ("What is the chemical symbol for water?", ("H2O", "H₂O")),
    ("What gas do plants absorb from the air?", ("carbon dioxide", "CO2", "CO₂")),
    ("Who wrote Romeo and Juliet?", ("Shakespeare",)),
    ("What is the freezing point of water in Celsius?", ("0", "zero")),
    ("What is the largest ocean on Earth?", ("Pacific",)),
    ("How many continents are there?", ("7", "seven")),
    ("What colour is the sky on a clear day?", ("blue",)),
    ("What is the opposite of hot?", ("cold",)),
    ("Which animal is known as the king of the jungle?", ("lion",)),
    ("What is the capital of the United States?", ("Washington",)),
    ("How many hours are there in a day?", ("24", "twenty-four", "twenty four")),
)

# EasyEdit2's prompt baseline: a steering instruction prepended to the user message ("{prompt} {input}").
INSTRUCTIONS = {
    "sst2": {+1: "Answer in a very positive, enthusiastic and happy tone.",
             -1: "Answer in a very negative, critical and unhappy tone."},
    "happy_sad": {+1: "Answer as someone who feels very happy.", -1: "Answer as someone who feels very sad."},
    "weddings": {+1: "Talk about weddings in your answer.", -1: "Never mention weddings in your answer."},
}

# Vector-prompt training inputs (EasyEdit2 {input, output} rows): requests unlike the held-out openers.
VP_INPUTS = (
    "Write one sentence about a movie.", "Describe a shop you know.", "Tell me about a holiday.",
    "Say something about your job.", "Describe your breakfast.", "Tell me about a friend.",
    "Write about a sunny day.", "Describe a bus ride.", "Tell me about a game.", "Describe a garden.",
    "Say something about music.", "Tell me about a letter you got.", "Describe a school.",
    "Write about the news.", "Describe a street.", "Tell me about a party.",
)

WEDDING_WORDS = ("wedding", "weddings", "bride", "groom", "marry", "married", "marriage", "vows", "ceremony",
                 "bridesmaid", "honeymoon", "newlyweds", "engaged", "engagement")
WEDDING_PAIRS = (
    ("I went to a wedding.", "I went to a meeting."),
    ("The bride and groom said their vows.", "The manager and clerk signed the forms."),
    ("They are getting married in June.", "They are moving offices in June."),
    ("The wedding ceremony was beautiful.", "The budget review was thorough."),
    ("She threw the bouquet at the reception.", "She filed the report at the desk."),
    ("We danced at their wedding party.", "We worked at their tax office."),
    ("The honeymoon was in Italy.", "The audit was in Italy."),
    ("He proposed and she said yes to marriage.", "He asked and she said yes to the spreadsheet."),
)


def read_sst2(data_dir: Path, file: str = "train_subset_6735.tsv") -> list[tuple[str, int]]:
    """``(sentence, label)`` rows of an SST-2 file of the shared data directory.

    Args:
        data_dir: The shared data directory.
        file: File name inside ``SST-2/``.
    """
    path = Path(data_dir) / "SST-2" / file
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (pass --data-dir, the shared data directory)")
    with open(path, encoding="utf-8", newline="") as handle:
        rows = list(csv.reader(handle, delimiter="\t", quoting=csv.QUOTE_NONE))
    return [(s.strip(), int(label)) for s, label in rows[1:] if s.strip()]


def _tidy(sentence: str) -> str:
    """SST-2's tokenized text ("it 's a film , too .") made readable, first letter capitalised."""
    text = sentence
    for a, b in ((" 's", "'s"), (" n't", "n't"), (" ,", ","), (" .", "."), (" !", "!"), (" ?", "?"),
                 (" 're", "'re"), (" 've", "'ve"), (" 'll", "'ll"), (" 'd", "'d"), (" ;", ";"), (" :", ":"),
                 ("-lrb- ", "("), (" -rrb-", ")")):
        text = text.replace(a, b)
    text = text.strip()
    if text and text[-1] not in ".!?":
        text += "."
    return text[:1].upper() + text[1:]


def sst2_rows(data_dir: Path, n: int = 64, seed: int = 0, min_words: int = 6, max_words: int = 25) -> list[dict]:
    """EasyEdit2 ``sst2``-style rows: a shared question, a positive (matching) and a negative sentence.

    Full sentences (not the SST-2 phrase fragments) of ``min_words``..``max_words`` words from the 6,735-row
    train part, paired at random.

    Args:
        data_dir: The shared data directory.
        n: Number of rows.
        seed: Pairing seed.
        min_words: Shortest sentence kept.
        max_words: Longest sentence kept.
    """
    rows = [(s, y) for s, y in read_sst2(data_dir) if min_words <= len(s.split()) <= max_words]
    rng = random.Random(seed)
    pos = [s for s, y in rows if y == 1]
    neg = [s for s, y in rows if y == 0]
    rng.shuffle(pos)
    rng.shuffle(neg)
    if min(len(pos), len(neg)) < n:
        raise ValueError(f"only {len(pos)} positive / {len(neg)} negative sentences fit; asked for {n}")
    return [{"question": SST2_QUESTIONS[i % len(SST2_QUESTIONS)], "matching": _tidy(p), "not_matching": _tidy(q)}
            for i, (p, q) in enumerate(zip(pos[:n], neg[:n]))]


def vector_prompt_rows(data_dir: Path, concept: str = "sst2", n: int = 32, seed: int = 1) -> list[dict]:
    """EasyEdit2 vector-prompt rows ``{input, output, prompt}``: a request, an answer, the positive instruction.

    The outputs are SST-2 sentences of both labels (so the answer itself carries no net sentiment); the vector is
    what the instruction adds to the answer tokens' activations.

    Args:
        data_dir: The shared data directory.
        concept: Key of :data:`INSTRUCTIONS`.
        n: Number of rows.
        seed: Sampling seed.
    """
    rows = [(s, y) for s, y in read_sst2(data_dir) if 6 <= len(s.split()) <= 25]
    rng = random.Random(seed)
    rng.shuffle(rows)
    out = []
    for i in range(n):
        out.append({"input": VP_INPUTS[i % len(VP_INPUTS)], "output": _tidy(rows[i][0]),
                    "prompt": INSTRUCTIONS[concept][+1]})
    return out


def happy_sad_rows(data_dir: Path, n: int = 64) -> list[dict]:
    """Happy/sad rows from the representation-engineering scenario lists (paired by index).

    Args:
        data_dir: The shared data directory.
        n: Number of rows.
    """
    base = Path(data_dir) / "steering" / "repe" / "emotions"
    happy = json.loads((base / "happiness.json").read_text(encoding="utf-8"))
    sad = json.loads((base / "sadness.json").read_text(encoding="utf-8"))
    return [{"question": "Tell me about something that happened to you.", "matching": h, "not_matching": s}
            for h, s in list(zip(happy, sad))[:n]]


def wedding_rows() -> list[dict]:
    """Topic rows for *weddings* (written here; minimal pairs that differ in the topic only)."""
    return [{"question": "Tell me about your week.", "matching": a, "not_matching": b} for a, b in WEDDING_PAIRS]


def wedding_scorer(texts: list[str]) -> list[float]:
    """1.0 when a text mentions a wedding word, else 0.0 (a topic, so a mention is the concept)."""
    words = set(WEDDING_WORDS)
    return [float(any(w.strip(".,!?;:'\"()").lower() in words for w in t.split())) for t in texts]


def concept_rows(data_dir: Path, concept: str, n: int = 64) -> list[dict]:
    """The EasyEdit2 ``{question, matching, not_matching}`` rows of a concept (``matching`` = the "more" side).

    Args:
        data_dir: The shared data directory.
        concept: ``sst2`` (positive vs negative sentences), ``happy_sad`` (happy vs sad scenarios) or ``weddings``
            (its minimal pairs, all of them whatever ``n``).
        n: Number of rows (sst2, happy_sad).
    """
    if concept == "sst2":
        return sst2_rows(data_dir, n=n)
    if concept == "happy_sad":
        return happy_sad_rows(data_dir, n=n)
    if concept == "weddings":
        return wedding_rows()
    raise ValueError(f"unknown concept {concept!r}; expected sst2, happy_sad or weddings")
