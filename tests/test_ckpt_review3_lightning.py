"""Checkpoints through the Lightning module and the CLI: fit refuses to resume from a weights-only checkpoint in one
line; a PCT checkpoint keeps its fixed source tensors (P_0, S_k), so a rewritten decomposition folder does not change
it; a module built from a dict with PEFT's enums writes a checkpoint that torch's weights_only loading accepts."""

from __future__ import annotations

import shutil

import lightning
import torch
from tiny_recipes import causal_recipe

from peftplug.cli import cli, main

ROWS = [{"prompt": f"Q{i}: add {i} and {i}?", "response": f" {2 * i}"} for i in range(12)]


def test_fit_from_a_weights_only_checkpoint_is_one_line(tmp_path, capsys):
    weights_only = ('--trainer.callbacks=[{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", '
                    '"init_args": {"save_weights_only": true}}]')
    recipe = causal_recipe(tmp_path, ROWS, peft={"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"]},
                           trainer={"max_steps": 2, "limit_val_batches": 0}, data={"val_fraction": 0.1})
    assert main(["fit", "--config", str(recipe), weights_only]) == 0
    (ckpt,) = (tmp_path / "runs").rglob("*.ckpt")
    capsys.readouterr()
    assert main(["fit", "--config", str(recipe), "--ckpt_path", str(ckpt), "--trainer.max_steps", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("peftplug: error: --ckpt_path ") and "cannot resume fit" in err[-1], err[-5:]


def test_a_pct_checkpoint_keeps_its_sources_when_the_decomposition_folder_is_rewritten(tmp_path):
    import prompt_transfer as pt
    from peftplug.checkpoints import load_checkpoint_module

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    folder = tmp_path / "decomposition"

    def decompose():
        sources = {"a": torch.randn(4, 64, generator=g), "b": torch.randn(4, 64, generator=g)}
        pt.save_decomposition(pt.decompose(sources, contrastive_steps=5), str(folder))

    decompose()
    recipe = causal_recipe(tmp_path, ROWS, peft={"peft_type": "PCT", "decomposition_path": str(folder)},
                           trainer={"max_steps": 2, "limit_val_batches": 0}, data={"val_fraction": 0.1})
    done = cli(["fit", "--config", str(recipe)])
    (ckpt,) = (tmp_path / "runs").rglob("*.ckpt")
    x = torch.randint(4, 90, (2, 8), generator=g)
    done.model.model.eval()
    with torch.no_grad():
        want = done.model.model(input_ids=x).logits
    shutil.rmtree(folder)
    decompose()  # the source stage run again: same shapes, other prompts
    loaded = load_checkpoint_module(ckpt)
    loaded.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(input_ids=x).logits, want, rtol=0, atol=0)


def test_a_python_built_module_with_peft_enums_resumes_under_a_plain_trainer(tmp_path):
    import json

    from peft import PeftType, TaskType

    from peftplug.data import CausalLMData
    from peftplug.lightning import PeftModule

    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS))

    def fit(max_steps, ckpt_path=None):
        module = PeftModule("tiny:llama", peft={"peft_type": PeftType.LORA, "task_type": TaskType.CAUSAL_LM,
                                                "r": 2, "target_modules": ["q_proj"]})
        data = CausalLMData(train_file=str(tmp_path / "t.jsonl"), prompt_column="prompt",
                            response_column="response", batch_size=4, tokenizer="tiny:llama")
        trainer = lightning.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, limit_val_batches=0,
                                    default_root_dir=str(tmp_path), enable_progress_bar=False)
        trainer.fit(module, data, ckpt_path=ckpt_path)  # Lightning loads with torch's default weights_only=True
        return trainer

    fit(2)
    (ckpt,) = tmp_path.rglob("*.ckpt")
    assert fit(3, str(ckpt)).global_step == 3
