"""`peftplug pct` as a user meets it: one-line refusals before any work, and outputs that never replace an adapter.

Second review of the PCT command line (train-sources, decompose, export)."""

import json
import re

import peft
import pytest
import torch
import yaml

import prompt_transfer as pt
from prompt_transfer import cli as pct_cli


def _tsv(path, rows=4):
    path.write_text("sentence\tlabel\n" + "".join(f"good film {i}\t{i % 2}\n" for i in range(rows)))
    return str(path)


def _recipe(tmp_path):
    """A valid two-source recipe on a tiny BERT (never trained here: every case is refused before training)."""
    files = {split: _tsv(tmp_path / f"{split}.tsv") for split in ("train", "dev", "test")}
    data = {"class_path": "peftplug.data.TextClassificationData",
            "init_args": {"train_file": files["train"], "validation_file": files["dev"], "test_file": files["test"],
                          "text_column": "sentence", "label_column": "label", "max_length": 16, "batch_size": 2}}
    return {
        "out_dir": str(tmp_path / "sources"),
        "trainer": {"default_root_dir": str(tmp_path / "logs"), "max_steps": 1, "accelerator": "cpu",
                    "logger": False, "enable_checkpointing": False},
        "model": {"model": "tiny:bert", "task": "seq_cls", "num_labels": 2,
                  "peft": {"class_path": "peft.PromptTuningConfig", "init_args": {"num_virtual_tokens": 2}}},
        "sources": [{"name": "alpha", "data": data}, {"name": "beta", "data": data}],
        "decompose": {"out": str(tmp_path / "dec"), "contrastive_steps": 2},
    }


def _run_cli(argv, capsys):
    """Runs `peftplug pct ...` in-process; returns (exit status, stderr). A usage error exits through argparse, an
    input error found later returns from the error boundary: both are status 2 and one line."""
    try:
        code = pct_cli.main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("field", ["out_dir", "decompose.out"])
def test_train_sources_refuses_an_output_under_a_file_before_training(tmp_path, capsys, field):
    # Before: the first source's export (out_dir) or the decomposition after the last source (decompose.out) ended
    # the run with a NotADirectoryError traceback, after every source before it had trained.
    recipe = _recipe(tmp_path)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    if field == "out_dir":
        recipe["out_dir"] = str(blocker / "sources")
    else:
        recipe["decompose"]["out"] = str(blocker / "dec")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code, err = _run_cli(["train-sources", "--config", str(path)], capsys)
    assert code == 2
    assert f"error: {field} " in err and "is a file, not a folder" in err
    assert "Traceback" not in err
    assert not (tmp_path / "logs").exists() and not (tmp_path / "sources").exists()  # nothing trained
    with pytest.raises(ValueError, match=f"{field} .*is a file, not a folder"):  # the Python API refuses it too
        pct_cli.train_sources(recipe)
    assert not (tmp_path / "logs").exists()


def test_train_sources_out_dir_flag_under_a_file_is_refused(tmp_path, capsys):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(_recipe(tmp_path)))
    (tmp_path / "a_file").write_text("x")
    code, err = _run_cli(["train-sources", "--config", str(path), "--out_dir", str(tmp_path / "a_file" / "o")],
                         capsys)
    assert code == 2 and "error: out_dir " in err and "is a file, not a folder" in err
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("content, match", [
    (b"out_dir: x\nsources: [a\n", r"--config '.*bad.yaml' is not valid YAML at line 3, column 1 \(expected"),
    (b"\xff\xfe\x00", r"--config '.*bad.yaml' is not a text file \(byte 0xff at offset 0\)"),
])
def test_train_sources_reports_an_unreadable_recipe_in_one_line(tmp_path, capsys, content, match):
    # Before: invalid YAML ended in a yaml.ScannerError traceback; a binary file in a bare "'utf-8' codec can't
    # decode byte 0xff" that named neither the flag nor the file.
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    code, err = _run_cli(["train-sources", "--config", str(path)], capsys)
    assert code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("peftplug pct: error: ")
    assert re.search(match, last), last


def test_train_sources_names_a_peftplug_fit_recipe(tmp_path, capsys):
    # The mirror of `peftplug fit`'s refusal of a multi-source recipe; before: "recipe: unknown key(s) ['data']".
    recipe = _recipe(tmp_path)
    fit_recipe = {"trainer": recipe["trainer"], "model": recipe["model"], "data": recipe["sources"][0]["data"]}
    path = tmp_path / "target.yaml"
    path.write_text(yaml.safe_dump(fit_recipe))
    code, err = _run_cli(["train-sources", "--config", str(path)], capsys)
    assert code == 2
    assert "is a `peftplug fit` recipe (it has `data:`, no `sources:`)" in err and f"peftplug fit --config {path}" in err


def _prompt_adapter(tiny_model, path, seed):
    model = peft.get_peft_model(tiny_model("bert", "seq_cls"), pt.prompt_tuning_config("SEQ_CLS", 3))
    with torch.no_grad():
        model.prompt_encoder["default"].embedding.weight.normal_(generator=torch.Generator().manual_seed(seed))
    model.save_pretrained(str(path))
    return str(path)


@pytest.mark.parametrize("names", [["a", ""], ["", "b"], ["a", "  "]])
def test_decompose_refuses_an_empty_source_name(tiny_model, tmp_path, capsys, names):
    # Before: the decomposition was written with source_names ["a", ""], and the target stage refused it later
    # (PCTConfig: "source_names must be a list of non-empty task names").
    adapters = [_prompt_adapter(tiny_model, tmp_path / n, i) for i, n in enumerate(("s1", "s2"))]
    code, err = _run_cli(["decompose", *adapters, "--names", *names, "--out", str(tmp_path / "dec")], capsys)
    assert code == 2 and "--names: source" in err and "has an empty name" in err
    assert not (tmp_path / "dec").exists()
    with pytest.raises(ValueError, match="every source name must be a non-empty string, got ''"):
        pt.decompose({"a": torch.randn(3, 64), "": torch.randn(3, 64)})
    with pytest.raises(ValueError, match="every source name must be a non-empty string, got 0"):
        pt.decompose({0: torch.randn(3, 64), 1: torch.randn(3, 64)})


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_export_never_overwrites_another_adapter(tiny_model, tmp_path, capsys):
    # Before: exporting into a source prompt's folder (a typo away from the target's) replaced that source prompt
    # with the target's, silently; only PCT adapters were refused.
    sources = [_prompt_adapter(tiny_model, tmp_path / n, i) for i, n in enumerate(("s1", "s2"))]
    pt.save_decomposition(pt.decompose({"s1": pt.load_source_prompt(sources[0]),
                                        "s2": pt.load_source_prompt(sources[1])}, contrastive_steps=2),
                          str(tmp_path / "dec"))
    model = peft.get_peft_model(tiny_model("bert", "seq_cls"),
                                pt.PCTConfig(task_type="SEQ_CLS", decomposition_path=str(tmp_path / "dec")))
    with torch.no_grad():
        model.prompt_encoder["default"].embedding.query.normal_(generator=torch.Generator().manual_seed(3))
    model.save_pretrained(str(tmp_path / "pct"))
    lora = peft.get_peft_model(tiny_model("bert", "seq_cls"), peft.LoraConfig(target_modules=["query"]))
    lora.save_pretrained(str(tmp_path / "lora"))
    for victim, kind in ((tmp_path / "s1", "PROMPT_TUNING"), (tmp_path / "lora", "LORA")):
        before = _files(victim)
        code, err = _run_cli(["export", str(tmp_path / "pct"), str(victim)], capsys)
        assert code == 2 and f"holds a {kind} adapter that is not an earlier PCT export" in err
        with pytest.raises(ValueError, match="not an earlier PCT export"):
            pt.export_prompt_tuning(model, str(victim))
        assert _files(victim) == before and not (victim / "pct_state").exists()

    # An earlier export is what an export updates: that stays allowed, and the result is this adapter's prompt.
    out = tmp_path / "export"
    pt.export_prompt_tuning(model, str(out), keep_pct_state=False)
    with torch.no_grad():
        model.prompt_encoder["default"].embedding.query.mul_(-1)
    model.save_pretrained(str(tmp_path / "pct2"))
    assert pct_cli.main(["export", str(tmp_path / "pct2"), str(out)]) == 0
    capsys.readouterr()
    expected = model.prompt_encoder["default"].embedding.weight.detach()
    plain = peft.PeftModel.from_pretrained(tiny_model("bert", "seq_cls"), str(out))
    torch.testing.assert_close(plain.prompt_encoder["default"].embedding.weight.detach(), expected)
    assert json.loads((out / "pct_state" / "adapter_config.json").read_text())["peft_type"] == "PCT"
