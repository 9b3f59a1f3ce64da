"""Fourth review of exports on a model with tied embeddings and ``Conv1D`` layers (the tiny GPT-2).

- ``peftplug export --merge`` of an adapter on a tied ``wte`` (LoRA, OFTv2) or ``lm_head`` (LoRA) wrote the update
  into the one tensor both layers share, so the merged model changed the output head too: reloaded, its logits were
  off the trained adapter's by 32.9 (LoRA on ``wte``), 0.27 (OFTv2 on ``wte``) and 1.06 (LoRA on ``lm_head``),
  silently. The export now unties them first; the merged folder reloads with the adapter's logits. Trainable tokens
  (which PEFT applies to both tied layers) stay tied and right.
- ``--as_lora`` of an OFTv2 adapter on ``wte`` and the ``Conv1D`` ``c_attn`` wrote ``fan_in_fan_out: false`` (the
  embedding counted as "not Conv1D"), so plain PEFT warned at every load that it had to correct it.
"""

from __future__ import annotations

import json
import warnings

import lightning  # noqa: F401  (imported before capsys swaps stderr: Lightning's log handler binds to it)
import pytest
import torch
import yaml
from peft import PeftModel, get_peft_model
from tiny_recipes import causal_recipe
from transformers import AutoModelForCausalLM

import oftv2
from peftplug.checkpoints import load_checkpoint_module
from peftplug.cli import main
from peftplug.loading import load_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ROWS = [{"prompt": f"Q{i}: add {i}", "response": f" {2 * i}"} for i in range(8)]
X = torch.randint(4, 90, (2, 10), generator=torch.Generator().manual_seed(0))
ADAPTERS = {
    "lora_wte": {"peft_type": "LORA", "r": 2, "target_modules": ["wte", "c_attn"]},
    "oftv2_wte": {"class_path": "oftv2.OFTv2Config", "init_args": {"block_size": 8, "target_modules": ["wte", "c_attn"]}},
    "lora_head": {"peft_type": "LORA", "r": 2, "target_modules": ["lm_head", "c_attn"]},
    "trainable_tokens": {"peft_type": "LORA", "r": 2, "target_modules": ["c_attn"], "trainable_token_indices": [5, 7]},
}


@pytest.fixture(scope="module", params=sorted(ADAPTERS))
def checkpoint(request, tmp_path_factory):
    """(adapter kind, a one-step ``peftplug fit`` checkpoint of it on ``tiny:gpt2``, whose wte and lm_head are tied)."""
    root = tmp_path_factory.mktemp(request.param)
    recipe = causal_recipe(root, ROWS, peft=ADAPTERS[request.param], trainer={"max_steps": 1, "limit_val_batches": 0},
                           optimizer={"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.05}})
    spec = yaml.safe_load(recipe.read_text())
    spec["model"]["model"] = "tiny:gpt2"
    recipe.write_text(yaml.safe_dump(spec))
    assert main(["fit", "--config", str(recipe)]) == 0
    (path,) = (root / "runs").rglob("*.ckpt")
    return request.param, path


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=X).logits


def test_merge_of_an_adapter_on_a_tied_embedding_reloads_with_the_adapters_logits(checkpoint, tmp_path):
    kind, ckpt = checkpoint
    base = load_model("tiny:gpt2")
    assert base.lm_head.weight is base.transformer.wte.weight  # the case under test: one tensor, two layers
    trained = _logits(load_checkpoint_module(ckpt).model)
    assert (trained - _logits(base)).abs().max() > 1e-3  # the adapter changes the model

    assert main(["export", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "merged"), "--merge"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    torch.testing.assert_close(_logits(merged), trained, rtol=1e-5, atol=1e-5)
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    # Untied only where a tied layer was adapted; trainable tokens change both tied layers alike and stay tied.
    tied = kind == "trainable_tokens"
    assert (merged.lm_head.weight is merged.transformer.wte.weight) is tied
    assert config["tie_word_embeddings"] is tied


def test_as_lora_of_wte_and_conv1d_loads_in_plain_peft_without_a_warning(tmp_path):
    base = load_model("tiny:gpt2")
    model = get_peft_model(base, oftv2.OFTv2Config(block_size=8, target_modules=["wte", "c_attn"]))
    with torch.no_grad():  # a trained adapter: rotations away from the identity
        for param in (p for p in model.parameters() if p.requires_grad):
            param.add_(0.1 * torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())))
    expected = _logits(model)
    oftv2.export_lora(model, tmp_path / "lora", rank="full")
    assert json.loads((tmp_path / "lora" / "adapter_config.json").read_text())["fan_in_fan_out"] is True
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*fan_in_fan_out.*")
        lora = PeftModel.from_pretrained(load_model("tiny:gpt2"), str(tmp_path / "lora"))
    torch.testing.assert_close(_logits(lora), expected, rtol=1e-4, atol=1e-4)
