"""The zero-shot scan's page: one row per task, accuracy against the majority class, counts by label word."""

from benchmarks.helene.smollm2.zero_shot import CANDIDATES, render
from peftplug.prompt_cls import get_task


def _row(task, acc, majority, labels, predicted):
    return {"task": task, "label_words": ["No", "Yes"], "n": sum(labels.values()), "acc": acc,
            "majority": majority, "labels": labels, "predicted": predicted}


def test_render_compares_each_task_with_its_majority_class():
    page = render([_row("mrpc", 0.635, 0.685, {"No": 126, "Yes": 274}, {"No": 94, "Yes": 306}),
                   _row("qnli", 0.5, 0.515, {"No": 206, "Yes": 194}, {"Yes": 400})])
    lines = [line for line in page.splitlines() if line.startswith(("| m", "| q"))]
    assert lines[0] == ("| mrpc | No / Yes | 400 | 0.635 | 0.685 | -0.050 | No 126 / Yes 274 | No 94 / Yes 306 |")
    # A label word never predicted still gets its count (0), so the column shows a collapsed classifier.
    assert lines[1].endswith("| No 206 / Yes 194 | No 0 / Yes 400 |")
    assert "| qnli | No / Yes | 400 | 0.500 | 0.515 | -0.015 |" in lines[1]


def test_every_candidate_is_a_known_task():
    for task in CANDIDATES:
        assert get_task(task).name == task
