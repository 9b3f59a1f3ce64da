"""``python -m prompt_transfer.cli train-sources``: one recipe trains several source prompts in sequence through
peftplug's Lightning trainer and saves each as an ordinary PEFT prompt-tuning adapter."""

import json
from pathlib import Path

import peft
import pytest
import torch
import yaml

import prompt_transfer as pt
from prompt_transfer import cli as pct_cli
from prompt_transfer.source import source_run_config, validate_sources_recipe

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "prompt_transfer" / "minilm_sources.yaml"
WORDS = ["good", "bad", "fine", "awful", "great", "poor", "nice", "dull"]


def _tsv(path, num_labels, rows=8):
    lines = ["sentence\tlabel"] + [f"{WORDS[i % len(WORDS)]} film {i}\t{i % num_labels}" for i in range(rows)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _recipe(tmp_path, sources=(("alpha", 2), ("beta", 3))):
    entries = []
    for name, num_labels in sources:
        files = {split: _tsv(tmp_path / f"{name}_{split}.tsv", num_labels) for split in ("train", "dev", "test")}
        entries.append({
            "name": name,
            "model": {"num_labels": num_labels},
            "data": {"class_path": "peftplug.data.TextClassificationData",
                     "init_args": {"train_file": files["train"], "validation_file": files["dev"],
                                   "test_file": files["test"], "text_column": "sentence", "label_column": "label",
                                   "max_length": 24, "batch_size": 4}},
        })
    return {
        "out_dir": str(tmp_path / "sources"),
        "seed_everything": 3,
        "evaluate_after_fit": True,
        "trainer": {"default_root_dir": str(tmp_path / "logs"), "max_steps": 2, "max_epochs": 1,
                    "accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False,
                    "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0,
                    "limit_val_batches": 0},
        "model": {"model": "tiny:bert", "task": "seq_cls",
                  "peft": {"class_path": "peft.PromptTuningConfig",
                           "init_args": {"num_virtual_tokens": 4, "prompt_tuning_init": "RANDOM"}},
                  "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.05}}},
        "sources": entries,
        "decompose": {"out": str(tmp_path / "decomposition"), "contrastive_steps": 5},
    }


def test_train_sources_saves_one_vanilla_peft_adapter_per_task(tmp_path, tokenizer):
    from peftplug.loading import load_model

    recipe_path = tmp_path / "sources.yml"
    recipe_path.write_text(yaml.safe_dump(_recipe(tmp_path)))
    assert pct_cli.main(["train-sources", "--config", str(recipe_path)]) == 0
    summary = json.loads((tmp_path / "sources" / "sources.json").read_text())
    assert list(summary["sources"]) == ["alpha", "beta"]
    prompts = {}
    for name, num_labels in (("alpha", 2), ("beta", 3)):
        result = summary["sources"][name]
        assert result["global_step"] == 2 and result["prompt_change"] > 0  # it trained
        assert 0.0 <= result["test_acc"] <= 1.0
        adapter = tmp_path / "sources" / name
        cfg = json.loads((adapter / "adapter_config.json").read_text())
        assert cfg["peft_type"] == "PROMPT_TUNING" and cfg["num_virtual_tokens"] == 4
        # Vanilla PEFT loads it; the prompt it holds is the one the decomposition reads.
        model = peft.PeftModel.from_pretrained(load_model("tiny:bert", "seq_cls", num_labels=num_labels), adapter)
        assert type(model.peft_config["default"]) is peft.PromptTuningConfig
        prompts[name] = pt.load_source_prompt(str(adapter))
        torch.testing.assert_close(model.prompt_encoder["default"].embedding.weight[:4].detach(), prompts[name])
        batch = tokenizer(["good film"], return_tensors="pt")
        with torch.no_grad():
            assert model(**batch).logits.shape == (1, num_labels)
    assert not torch.allclose(prompts["alpha"], prompts["beta"])
    # The decomposition of the two saved prompts (full rank by default) reconstructs them.
    dec = pt.load_decomposition(str(tmp_path / "decomposition"))
    assert dec.source_names == ["alpha", "beta"]
    assert summary["decomposition"]["rank"] == 2
    recon = dec.reconstruct()
    scale = max(p.abs().max() for p in prompts.values())
    for k, name in enumerate(dec.source_names):
        assert (recon[k] - prompts[name]).abs().max() < 0.05 * scale


@pytest.mark.parametrize("edit, match", [
    (lambda r: r.update(sources=[]), "sources must be a non-empty list"),
    (lambda r: r["sources"][1].update(name="alpha"), r"sources\[1\].name 'alpha' duplicates sources\[0\]"),
    (lambda r: r["sources"][0]["data"]["init_args"].update(train_file="nope/train.tsv"),
     r"sources\[0\].data.init_args.train_file: file 'nope/train.tsv' does not exist"),
    (lambda r: r["sources"][0].update(name="a/b"), "usable as a directory name"),
    (lambda r: r["sources"][0]["model"].update(peft={}), r"sources\[0\].model.peft cannot be overridden"),
    (lambda r: r["sources"][0].pop("data"), r"sources\[0\].data must be a mapping"),
    (lambda r: r.update(epochs=3), r"unknown key\(s\) \['epochs'\]"),
    (lambda r: r.pop("out_dir"), "out_dir must be a non-empty path"),
    (lambda r: r["decompose"].update(rank=3), r"decompose.rank must be an int in \[1, 2\] \(K = 2, the number"),
    # Every value decompose() refuses is refused here too, before the first source trains.
    (lambda r: r["decompose"].update(rank=1.5), r"decompose.rank must be an int in \[1, 2\] \(K = 2, the number.*1.5"),
    (lambda r: r["decompose"].update(rank="two"), r"decompose.rank must be an int in \[1, 2\] \(K = 2, the number.*'two'"),
    (lambda r: r["decompose"].update(explained_variance=1.5), r"decompose.explained_variance must be a finite real number in \(0, 1\]"),
    (lambda r: r["decompose"].update(contrastive_weight=-1), "decompose.contrastive_weight must be a finite real number >= 0"),
    (lambda r: r["decompose"].update(contrastive_steps=-5), "decompose.contrastive_steps must be an int >= 0"),
    (lambda r: r["decompose"].update(rank=1, explained_variance=0.9),
     "give decompose.rank or decompose.explained_variance, not both"),
])
def test_recipe_errors_name_the_field(tmp_path, edit, match):
    recipe = _recipe(tmp_path)
    edit(recipe)
    with pytest.raises(ValueError, match=match):
        pct_cli.train_sources(recipe)
    assert not (tmp_path / "sources").exists() and not (tmp_path / "logs").exists()  # nothing trained


def test_cli_reports_a_bad_recipe_in_one_line(tmp_path, capsys):
    recipe = _recipe(tmp_path)
    recipe["sources"][1]["name"] = "alpha"
    path = tmp_path / "bad.yml"
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(SystemExit) as exit_info:
        pct_cli.main(["train-sources", "--config", str(path)])
    assert exit_info.value.code == 2
    assert "sources[1].name 'alpha' duplicates sources[0].name" in capsys.readouterr().err
    assert not (tmp_path / "sources").exists()  # nothing trained


def test_shipped_recipe_validates_and_each_source_parses_as_a_peftplug_fit_config(tmp_path):
    """The shipped recipe is a .yml (not a LightningCLI config itself); each source it expands to is parsed by
    peftplug's LightningCLI parser like tests/test_peftplug_recipes.py does for *.yaml, without loading weights."""
    from peftplug.cli import _cli_classes, import_method_packages

    recipe = validate_sources_recipe(yaml.safe_load(RECIPE.read_text()), check_files=False)
    assert RECIPE.read_text().startswith("#")
    assert [s["name"] for s in recipe["sources"]] == ["SST-2", "bbc"]
    import_method_packages()

    class ParseOnly(_cli_classes()):
        def instantiate_classes(self):
            pass

    for k in range(len(recipe["sources"])):
        config = source_run_config(recipe, k, str(tmp_path))
        path = tmp_path / f"source{k}.yaml"
        path.write_text(yaml.safe_dump(config))
        parsed = ParseOnly(args=["--config", str(path)], run=False).config
        assert parsed["seed_everything"] == k
        assert parsed["trainer"]["default_root_dir"].endswith(recipe["sources"][k]["name"])
