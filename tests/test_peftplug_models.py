"""The one model loader (peftplug.loading) knows stories260K: `peftplug fit` and `peftplug steering` load the same
real llama2.c model by the same name, with the reference tokenizer, and bad names fail in one line."""

from __future__ import annotations

import json

import lightning  # noqa: F401  (imported before capsys swaps stderr: Lightning's log handler binds to it)
import pytest
import torch
import yaml

from peftplug.errors import ConfigError, MissingFileError
from peftplug.loading import load_model, load_tokenizer, resolve_model_path, stories260k_data_dir


def test_stories260k_names_resolve_to_a_data_directory(tmp_path, monkeypatch):
    from peftplug.datadir import DATA_DIR_ENV

    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert stories260k_data_dir("stories260k") == str(tmp_path)
    assert stories260k_data_dir("Stories260K") == str(tmp_path)  # as the data folder spells it
    assert stories260k_data_dir(f"stories260k:{tmp_path / 'x'}") == str((tmp_path / "x").resolve())
    assert stories260k_data_dir("tiny:llama") is None and stories260k_data_dir("stories260kx") is None
    with pytest.raises(ConfigError, match="stories260k:<data dir>"):
        stories260k_data_dir("stories260k:")
    with pytest.raises(MissingFileError, match=r"model 'stories260k': no stories260K.bin under"):
        resolve_model_path("stories260k")  # the (empty) data directory of $PEFTPLUG_DATA_DIR
    with pytest.raises(MissingFileError, match="no stories260K.bin"):
        load_tokenizer("stories260k")


def test_the_loader_gives_the_reference_stories260k(data_dir):
    """load_model/load_tokenizer by name equal steering.stories260k's direct reader: weights, tokenizer, story."""
    from steering.stories260k import load_stories260k

    reference, ref_tokenizer = load_stories260k(data_dir)
    name = f"stories260k:{data_dir}"
    model, tokenizer = load_model(name).eval(), load_tokenizer(name)
    assert resolve_model_path(name) == resolve_model_path(name)  # converted once per process
    ref_state = reference.state_dict()
    assert model.state_dict().keys() == ref_state.keys()
    assert all(torch.equal(v, ref_state[k]) for k, v in model.state_dict().items())
    text = "Once upon a time, there was a little girl"
    assert tokenizer(text)["input_ids"] == ref_tokenizer(text)["input_ids"]
    out = model.generate(torch.tensor([[1]]), max_new_tokens=20, do_sample=False)
    assert tokenizer.decode(out[0], skip_special_tokens=True).startswith("Once upon a time, there was a little girl")
    classifier = load_model(name, task="seq_cls", num_labels=3, pad_token_id=tokenizer.pad_token_id)
    assert classifier.score.out_features == 3  # a fresh head on the same body


def test_peftplug_fit_trains_on_stories260k(data_dir, tmp_path):
    """`peftplug fit` with --model.model stories260k:<dir>: LoRA on the real model, a few steps, a checkpoint."""
    from peftplug.checkpoints import read_checkpoint
    from peftplug.cli import main

    rows = [{"text": "Once upon a time, there was a little dog named Max. Max liked to run."} for _ in range(8)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    recipe = {
        "seed_everything": 0,
        "trainer": {"max_steps": 3, "accelerator": "cpu", "devices": 1, "default_root_dir": str(tmp_path / "runs"),
                    "enable_progress_bar": False, "num_sanity_val_steps": 0, "limit_val_batches": 1,
                    "enable_model_summary": False, "logger": False},
        "model": {"model": f"stories260k:{data_dir}",
                  "peft": {"peft_type": "LORA", "r": 2, "target_modules": ["q_proj", "v_proj"]},
                  "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01}}},
        "data": {"class_path": "peftplug.data.CausalLMData",
                 "init_args": {"train_file": str(tmp_path / "train.jsonl"), "batch_size": 4, "max_length": 32}},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["fit", "--config", str(tmp_path / "recipe.yaml")]) == 0
    checkpoint = read_checkpoint(next((tmp_path / "runs").rglob("*.ckpt")))
    assert checkpoint["hyper_parameters"]["model"] == f"stories260k:{data_dir}"
    lora = [k for k in checkpoint["state_dict"] if "lora_A" in k]
    assert len(lora) == 2 * 5  # q_proj and v_proj of its 5 layers


def test_the_steering_cli_loads_through_the_same_loader(data_dir):
    """`peftplug steering` has no name parser of its own: its loader is peftplug.loading's, left-padding."""
    import steering.cli

    model, tokenizer = steering.cli.load_model_and_tokenizer(f"stories260k:{data_dir}")
    assert tokenizer.padding_side == "left" and not model.training
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 5
