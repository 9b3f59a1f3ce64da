"""``peftplug validate``, ``test`` and ``predict`` from a fit checkpoint, second review, for each task (causal_lm
prompt/response, chat messages, seq_cls, prompt_cls) on ``tiny:llama``.

What a user gets: metrics equal to the split's loss and accuracy computed here row by row (5 rows in batches of 2,
so the last batch is partial) with the checkpoint's adapter; ``predict`` prints one JSON line per example in the
split's order (left-padded batches), as each row generated alone, or writes them to ``--predictions_file``; a
recipe's ``trainer.limit_val_batches: 0`` makes ``validate`` one error line instead of an empty run that exits 0; an
nf4 model's adapter-only checkpoint validates to the same reference.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
import yaml

from peftplug.checkpoints import load_checkpoint_module
from peftplug.cli import cli, main
from peftplug.eval_metrics import model_inputs

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TASKS = ("causal_lm", "chat", "seq_cls", "prompt_cls")
TRAINER = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_progress_bar": False,
           "enable_model_summary": False, "num_sanity_val_steps": 0, "max_steps": 1}


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _recipe(root: Path, task: str, model: dict | None = None) -> Path:
    """A one-step LoRA fit recipe of ``task`` whose test split has 5 rows in evaluation batches of 2.

    Args:
        root: The run's folder (created).
        task: One of :data:`TASKS`.
        model: Further ``model`` settings (quantization, ...).
    """
    root.mkdir(parents=True, exist_ok=True)
    spec = {"model": "tiny:llama", "task": "causal_lm" if task == "chat" else task, "max_new_tokens": 3,
            "peft": {"peft_type": "LORA", "r": 2, "target_modules": ["q_proj", "v_proj"]},
            "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.05}}, **(model or {})}
    sizes = {"batch_size": 4, "eval_batch_size": 2}
    if task == "seq_cls":
        spec["num_labels"] = 3
        rows = [{"text": f"item {i} is {'abc'[i % 3]}", "label": ["neg", "neu", "pos"][i % 3]} for i in range(12)]
        data = {"class_path": "peftplug.data.TextClassificationData", "init_args": {
            "train_file": _write(root / "train.jsonl", rows[:7]), "validation_file": _write(root / "val.jsonl", rows[7:]),
            "test_file": _write(root / "test.jsonl", rows[2:7]), **sizes}}
    elif task == "prompt_cls":
        data = {"class_path": "peftplug.data.PromptClassificationData", "init_args": {
            "task": "sst2", "k": 16, "split_seed": 13, "max_test": 5, "template": "{sentence}={answer}",
            "label_words": ["n", "p"], "max_length": 48, **sizes}}
    elif task == "chat":
        rows = [{"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": f"n{i}"}]}
                for i in range(8)]
        data = {"class_path": "peftplug.data.ChatData", "init_args": {
            "train_file": _write(root / "train.jsonl", rows), "validation_file": _write(root / "val.jsonl", rows[:3]),
            "test_file": _write(root / "test.jsonl", rows[3:]), **sizes}}
    else:  # prompts and responses of different lengths: left padding matters for predict
        rows = [{"prompt": f"Q{i}" + " x" * (i % 4), "response": f" {i}" * (1 + i % 3)} for i in range(12)]
        data = {"class_path": "peftplug.data.CausalLMData", "init_args": {
            "train_file": _write(root / "train.jsonl", rows[:7]), "validation_file": _write(root / "val.jsonl", rows[7:10]),
            "test_file": _write(root / "test.jsonl", rows[2:7]), "prompt_column": "prompt",
            "response_column": "response", **sizes}}
    recipe = {"seed_everything": 0, "trainer": {**TRAINER, "default_root_dir": str(root / "runs")}, "model": spec,
              "data": data}
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """``{task: (recipe, checkpoint)}``: each task fitted one step."""
    out = {}
    for task in TASKS:
        recipe = _recipe(tmp_path_factory.mktemp(task), task)
        assert main(["fit", "--config", str(recipe)]) == 0
        (ckpt,) = (recipe.parent / "runs").rglob("*.ckpt")
        out[task] = (recipe, ckpt)
    return out


def _data(recipe: Path, tokenizer) -> object:
    """The recipe's data module, set up with ``tokenizer``."""
    spec = yaml.safe_load(recipe.read_text())["data"]
    module_name, name = spec["class_path"].rsplit(".", 1)
    data = getattr(importlib.import_module(module_name), name)(**spec["init_args"])
    data.tokenizer = tokenizer
    data.setup("test")
    return data


def _reference(recipe: Path, ckpt: Path, split: str) -> dict:
    """The checkpoint's loss, accuracy and predictions over ``split``, one row at a time (no padding at all)."""
    module = load_checkpoint_module(ckpt).eval()
    data = _data(recipe, module.tokenizer)
    classify = module.task in ("seq_cls", "prompt_cls")
    total, count, correct, predictions = 0.0, 0, 0, []
    with torch.no_grad():
        for index, row in enumerate(data.splits[split]):
            batch = data._eval_collate([row]) if hasattr(data, "_eval_collate") else data.collate([row])
            out = module(**model_inputs(batch))
            if classify:
                predicted = int(out.logits.argmax(-1))
                total, count = total + float(out.loss), count + 1
                correct += predicted == int(batch["labels"])
                predictions.append(predicted)
                continue
            tokens = int((batch["labels"][:, 1:] != -100).sum())
            total, count = total + float(out.loss) * tokens, count + tokens
            if "gen_input_ids" in batch:
                predictions += module.generate_texts(batch["gen_input_ids"], batch["gen_attention_mask"])
            else:
                ids = torch.tensor([module.tokenizer(data.prompts[split][index])["input_ids"]])
                predictions += module.generate_texts(ids, torch.ones_like(ids))
    return {"loss": total / count, "acc": correct / count if classify else None, "predictions": predictions}


def _metrics(args: list[str]) -> dict[str, float]:
    done = cli(args)
    return {k: float(v) for k, v in done.trainer.callback_metrics.items()}


@pytest.mark.parametrize("task", TASKS)
def test_test_and_validate_metrics_equal_the_splits_reference_with_the_checkpoints_adapter(runs, task):
    recipe, ckpt = runs[task]
    seen = {}
    for command, split, stage in (("test", "test", "test"), ("validate", "validation", "val")):
        got = _metrics([command, "--config", str(recipe), "--ckpt_path", str(ckpt)])
        want = _reference(recipe, ckpt, split)
        assert got[f"{stage}_loss"] == pytest.approx(want["loss"], rel=1e-5), command
        if want["acc"] is not None:
            assert got[f"{stage}_acc"] == pytest.approx(want["acc"]), command
        seen[command] = got
    if task == "causal_lm":  # the adapter was restored: without the checkpoint the loss is the untrained one's
        untrained = _metrics(["test", "--config", str(recipe)])["test_loss"]
        assert abs(untrained - seen["test"]["test_loss"]) > 1e-3


@pytest.mark.parametrize("task", TASKS)
def test_predict_prints_one_json_line_per_example_in_the_splits_order(runs, task, capsys):
    # Lightning's trainer.predict returned the predictions to LightningCLI, which dropped them: nothing was printed.
    recipe, ckpt = runs[task]
    capsys.readouterr()
    assert main(["predict", "--config", str(recipe), "--ckpt_path", str(ckpt)]) == 0
    lines = capsys.readouterr().out.splitlines()
    records = [json.loads(line) for line in lines]
    want = _reference(recipe, ckpt, "test")["predictions"]
    assert [r["index"] for r in records] == list(range(5))
    assert [r["prediction"] for r in records] == want
    if task == "seq_cls":  # class names, in the data module's order (sorted training labels)
        assert [r["label"] for r in records] == [["neg", "neu", "pos"][p] for p in want]


def test_predictions_file_gets_the_same_lines_atomically_and_a_missing_folder_is_refused_first(runs, tmp_path,
                                                                                                 capsys):
    recipe, ckpt = runs["seq_cls"]
    target = tmp_path / "predictions.jsonl"
    target.write_text("an older file\n")
    capsys.readouterr()
    assert main(["predict", "--config", str(recipe), "--ckpt_path", str(ckpt), "--predictions_file", str(target)]) == 0
    out, err = capsys.readouterr()
    assert out == ""
    assert f"wrote 5 predictions to {target}" in err
    assert main(["predict", "--config", str(recipe), "--ckpt_path", str(ckpt)]) == 0
    assert target.read_text() == capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["predictions.jsonl"]  # no temporary file left beside it

    missing = tmp_path / "nowhere" / "p.jsonl"
    assert main(["predict", "--config", str(recipe), "--predictions_file", str(missing)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("peftplug: error: predictions_file:") and "does not exist" in lines[-1]
    assert not missing.parent.exists()


@pytest.mark.parametrize(("command", "limit"), [("validate", "limit_val_batches"), ("test", "limit_test_batches"),
                                                ("predict", "limit_predict_batches")])
def test_a_loop_limited_to_zero_batches_is_one_error_line_not_a_silent_empty_run(runs, command, limit, capsys):
    # recipes/quickstart.yaml sets limit_val_batches: 0; `peftplug validate` on it ran no batch and exited 0.
    recipe, ckpt = runs["causal_lm"]
    capsys.readouterr()
    assert main([command, "--config", str(recipe), "--ckpt_path", str(ckpt), f"--trainer.{limit}", "0"]) == 2
    out, err = capsys.readouterr()
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"peftplug: error: trainer.{limit} is 0") and f"--trainer.{limit} 1.0" in last
    assert out == ""


def test_validate_of_an_nf4_models_adapter_only_checkpoint_equals_the_reference(tmp_path):
    recipe = _recipe(tmp_path, "causal_lm", model={"quantization": "nf4", "dtype": "bfloat16"})
    assert main(["fit", "--config", str(recipe)]) == 0
    (ckpt,) = (tmp_path / "runs").rglob("*.ckpt")
    saved = torch.load(ckpt, weights_only=False)
    assert set(saved["state_dict"]) == set(saved["peftplug"]["keys"])  # the adapter only, no 4-bit base tensor
    got = _metrics(["validate", "--config", str(recipe), "--ckpt_path", "last"])
    assert got["val_loss"] == pytest.approx(_reference(recipe, ckpt, "validation")["loss"], rel=1e-4)
    untrained = _metrics(["validate", "--config", str(recipe)])
    assert abs(untrained["val_loss"] - got["val_loss"]) > 1e-3
