"""``peftplug.load_adapter(name, path, quantization=..., dtype=...)`` rebuilds the base an adapter was trained on.

On ``nf4``/``fp4`` the ``dtype`` a model loads with is the 4-bit layers' compute dtype, so it is part of the trained
model: an adapter trained with ``quantization="nf4", dtype="bfloat16"`` and reloaded with float32 compute (all
``load_adapter`` could do before it took a ``dtype``) gives logits up to ~0.03 off on the tiny Llama. Reloaded with
the training dtype they are bit-identical. Here the folders come from ``save_pretrained`` (no ``peftplug_base.json``),
so the dtype is given; an export's record and its defaults are tests/test_adapter_base_record.py's. Also here: the
recipe's field names in ``PeftModule``'s loading errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from peft import LoraConfig, get_peft_model

import oftv2
from peftplug import load_adapter
from peftplug.checkpoints import load_checkpoint_module, read_checkpoint
from peftplug.cli import main
from peftplug.errors import ConfigError
from peftplug.lightning import PeftModule
from peftplug.loading import load_model

pytest.importorskip("bitsandbytes")

ADAPTERS = {
    "lora": lambda: LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    "oftv2": lambda: oftv2.OFTv2Config(target_modules=["q_proj", "v_proj"], block_size=8, init_weights=False),
}


def _trained(tmp_path, kind: str, dtype: str):
    """An adapter with non-identity weights on the nf4 tiny Llama loaded with ``dtype``: (folder, input, logits)."""
    torch.manual_seed(0)
    model = get_peft_model(load_model("tiny:llama", quantization="nf4", dtype=dtype), ADAPTERS[kind]()).eval()
    x = torch.randint(4, 90, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=x).logits
    model.save_pretrained(tmp_path / kind)
    return tmp_path / kind, x, logits


def _compute_dtypes(model) -> set[torch.dtype]:
    """The compute dtypes of the model's 4-bit layers."""
    return {m.compute_dtype for m in model.modules() if hasattr(m, "compute_dtype") and hasattr(m, "quant_state")}


@pytest.mark.parametrize("kind", sorted(ADAPTERS))
def test_bf16_compute_adapter_reloads_exactly_with_its_dtype(tmp_path, kind):
    folder, x, reference = _trained(tmp_path, kind, "bfloat16")
    reloaded = load_adapter("tiny:llama", folder, quantization="nf4", dtype="bfloat16").eval()
    assert _compute_dtypes(reloaded) == {torch.bfloat16}
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=x).logits, reference)  # bit-identical, not merely to bf16 rounding
        # A save_pretrained folder has no peftplug_base.json: the default is float32 compute, another model.
        default = load_adapter("tiny:llama", folder, quantization="nf4").eval()
        assert _compute_dtypes(default) == {torch.float32}
        assert not torch.allclose(default(input_ids=x).logits, reference, atol=1e-3)


@pytest.mark.parametrize("kind", sorted(ADAPTERS))
def test_default_dtype_reloads_a_float32_compute_adapter_as_before(tmp_path, kind):
    folder, x, reference = _trained(tmp_path, kind, "float32")
    for reloaded in (load_adapter("tiny:llama", folder, quantization="nf4"),
                     load_adapter("tiny:llama", folder, quantization="nf4", dtype="float32")):
        with torch.no_grad():
            assert torch.equal(reloaded.eval()(input_ids=x).logits, reference)


def test_bad_dtype_and_settings_for_a_built_model_are_one_line_errors(tmp_path):
    folder, _, _ = _trained(tmp_path, "lora", "float32")
    with pytest.raises(ConfigError, match=r"^dtype must be one of float32, bfloat16, float16; got 'bf17'$"):
        load_adapter("tiny:llama", folder, quantization="nf4", dtype="bf17")
    with pytest.raises(ConfigError, match=r"^quantization must be one of none, nf4, fp4, int8; got 'nf5'$"):
        load_adapter("tiny:llama", folder, quantization="nf5")
    # A built model is not cast or quantized: asking for it would silently load another model than asked for.
    base = load_model("tiny:llama")
    with pytest.raises(ConfigError, match=r"apply to a model name only.*dtype='bfloat16'") as err:
        load_adapter(base, folder, dtype="bfloat16")
    assert "\n" not in str(err.value)
    assert load_adapter(base, folder, dtype="float32").peft_config["default"].r == 4  # the defaults are fine


def test_peft_module_loading_errors_name_the_recipe_fields():
    with pytest.raises(ConfigError, match=r"^model\.dtype must be one of float32, bfloat16, float16; got 'bf17'$"):
        PeftModule(model="tiny:llama", dtype="bf17")
    with pytest.raises(ConfigError, match=r"^model\.num_labels must be an integer >= 2 \(classes\) for task seq_cls"):
        PeftModule(model="tiny:bert", task="seq_cls")
    # One label is a regression head for transformers (MSE on float labels), which no data module produces.
    for bad in (1, True, 2.0):
        with pytest.raises(ConfigError, match=rf"^model\.num_labels must be an integer >= 2 .*; got {bad!r}$"):
            PeftModule(model="tiny:bert", task="seq_cls", num_labels=bad)


def fit_nf4_bf16(root: Path) -> Path:
    """A one-step OFTv2 (QOFT) `peftplug fit` of the tiny Llama with ``quantization: nf4``, ``dtype: bfloat16``;
    returns its checkpoint. (Also used by tests/test_adapter_base_record.py.)"""
    rows = [{"prompt": f"What is {i} plus {i}?", "response": f"{2 * i}"} for i in range(8)]
    (root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    recipe = {
        "seed_everything": 0,
        "trainer": {"max_steps": 1, "accelerator": "cpu", "devices": 1, "default_root_dir": str(root / "runs"),
                    "enable_progress_bar": False, "num_sanity_val_steps": 0, "limit_val_batches": 0,
                    "enable_model_summary": False, "logger": False},
        "model": {"model": "tiny:llama", "quantization": "nf4", "dtype": "bfloat16",
                  "peft": {"class_path": "oftv2.OFTv2Config",
                           "init_args": {"block_size": 16, "target_modules": ["q_proj", "v_proj"]}},
                  "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.05}}},
        "data": {"class_path": "peftplug.chat_data.ChatData",
                 "init_args": {"train_file": str(root / "train.jsonl"), "batch_size": 4}},
    }
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["fit", "--config", str(root / "recipe.yaml")]) == 0
    return next((root / "runs").rglob("*.ckpt"))


def test_exported_adapter_of_a_bf16_nf4_fit_reloads_as_its_checkpoint(tmp_path):
    """`peftplug fit` records ``model.dtype`` in the checkpoint (generate and export rebuild from it); PEFT's
    ``adapter_config.json`` of the export holds no dtype (peftplug's ``peftplug_base.json`` beside it does, see
    tests/test_adapter_base_record.py). Given explicitly, ``load_adapter`` matches the checkpoint exactly."""
    ckpt = fit_nf4_bf16(tmp_path)
    assert read_checkpoint(ckpt)["hyper_parameters"]["dtype"] == "bfloat16"
    assert main(["export", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "adapter")]) == 0
    assert "dtype" not in (tmp_path / "adapter" / "adapter_config.json").read_text()
    x = torch.randint(4, 90, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = load_checkpoint_module(ckpt).eval().model(input_ids=x).logits
        reloaded = load_adapter("tiny:llama", tmp_path / "adapter", quantization="nf4", dtype="bfloat16").eval()
        assert torch.equal(reloaded(input_ids=x).logits, reference)
