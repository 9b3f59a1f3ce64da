"""``peftplug export --as-lora --rank R`` end to end: ``peftplug fit`` trains OFTv2 (and QOFT on an nf4 base) on a
conversational ``messages`` file, the export writes a standard PEFT LoRA folder, and that folder — loaded with
plain ``peft`` in a fresh process that never imports peftplug — gives the OFTv2 adapter's logits at rank ``full``.
(The refusals are rows of tests/test_cli_errors.py.)"""

from __future__ import annotations

import json

import lightning  # noqa: F401  (imported before capsys swaps stderr: Lightning's log handler binds to it)
import pytest
import torch
import yaml

from peftplug.checkpoints import load_checkpoint_module
from peftplug.cli import main
from peftplug.tiny import tiny_model

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _rows() -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"add {i} {j}"}, {"role": "assistant", "content": str(i + j)},
                          {"role": "user", "content": "twice?"}, {"role": "assistant", "content": str(2 * (i + j))}]}
            for i in range(4) for j in range(4)]


def _fit(root, quantization: str = "none"):
    """A 3-step OFTv2 `peftplug fit` on a messages file; returns the checkpoint and the printed lines."""
    (root / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in _rows()))
    recipe = {
        "seed_everything": 0,
        "trainer": {"max_steps": 3, "accelerator": "cpu", "devices": 1, "default_root_dir": str(root / "runs"),
                    "enable_progress_bar": False, "num_sanity_val_steps": 0, "enable_model_summary": False,
                    "logger": False},
        "model": {"model": "tiny:llama", "quantization": quantization, "max_new_tokens": 4,
                  "peft": {"class_path": "oftv2.OFTv2Config",
                           "init_args": {"block_size": 8, "target_modules": TARGETS}},
                  "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.05}}},
        "data": {"class_path": "peftplug.data.ChatData",
                 "init_args": {"train_file": str(root / "chat.jsonl"), "batch_size": 4, "val_fraction": 0.25}},
    }
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["fit", "--config", str(root / "recipe.yaml"), "--evaluate_after_fit", "true"]) == 0
    return next((root / "runs").rglob("*.ckpt"))


IDS = [[5, 9, 14, 20, 33, 41, 60], [70, 12, 8, 3, 55, 44, 21]]


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(torch.tensor(IDS)).logits


def test_export_as_lora_loads_with_plain_peft_and_matches_at_full_rank(tmp_path, capsys, run_fresh):
    ckpt = _fit(tmp_path)
    out = capsys.readouterr().out
    assert "held-out accuracy: " in out  # the messages file's last answers are the generation references

    assert main(["export", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "lora"), "--as-lora",
                 "--rank", "full"]) == 0
    assert f"wrote LoRA adapter (rank full) to {tmp_path / 'lora'}" in capsys.readouterr().out
    config = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    # vLLM's documented constraints: r, lora_alpha, target_modules present; no modules_to_save; DoRA off.
    assert config["peft_type"] == "LORA" and config["r"] == 64 and config["lora_alpha"] == 64
    assert config["modules_to_save"] is None and config["use_dora"] is False and config["bias"] == "none"
    assert {m.rsplit(".", 1)[-1] for m in config["target_modules"]} == set(TARGETS)

    module = load_checkpoint_module(ckpt)
    oft = _logits(module.model)
    with module.model.disable_adapter():
        base = _logits(module.model)
    assert not torch.allclose(oft, base, atol=1e-3)  # the adapter trained
    base_dir = tmp_path / "base"
    tiny_model("llama").save_pretrained(base_dir)  # what tiny:llama is built from
    torch.testing.assert_close(_logits(tiny_model("llama")), base)

    run_fresh(f"""
        import sys, torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({str(base_dir)!r}), {str(tmp_path / 'lora')!r})
        assert not any(m.split(".")[0] in ("peftplug", "oftv2") for m in sys.modules), "peftplug was imported"
        with torch.no_grad():
            torch.save(model.eval()(torch.tensor({IDS})).logits, {str(tmp_path / 'lora_logits.pt')!r})
    """)
    lora = torch.load(tmp_path / "lora_logits.pt")
    torch.testing.assert_close(lora, oft, atol=1e-4, rtol=1e-4)

    # A small rank is clipped per layer and approximates; an earlier export may be replaced with --overwrite.
    assert main(["export", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "lora"), "--as-lora",
                 "--rank", "4", "--overwrite"]) == 0
    small = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    assert small["r"] == 4 and small["lora_alpha"] == 4 and small["rank_pattern"] == {}
    assert (tmp_path / "lora" / "tokenizer_config.json").is_file()


def test_export_as_lora_of_a_qoft_checkpoint_matches_on_the_same_nf4_base(tmp_path):
    pytest.importorskip("bitsandbytes")
    from peft import PeftModel

    from peftplug.loading import load_model

    ckpt = _fit(tmp_path, quantization="nf4")
    assert main(["export", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "lora"), "--as-lora",
                 "--rank", "full"]) == 0
    qoft = load_checkpoint_module(ckpt)
    assert type(qoft.model.base_model.model.model.layers[0].self_attn.q_proj).__module__ == "oftv2.bnb"
    expected = _logits(qoft.model)
    # Plain PEFT LoRA on a fresh nf4 base (peftplug's loader keeps bitsandbytes' exact 4-bit layout on every CPU).
    lora = PeftModel.from_pretrained(load_model("tiny:llama", "causal_lm", quantization="nf4"), tmp_path / "lora")
    assert "Linear4bit" in type(lora.base_model.model.model.layers[0].self_attn.q_proj).__name__
    torch.testing.assert_close(_logits(lora), expected, atol=1e-4, rtol=1e-4)
