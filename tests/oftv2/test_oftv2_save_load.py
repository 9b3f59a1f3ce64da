"""Saving and loading OFTv2 adapters: safetensors, several adapters, a fresh process, bad files."""

from __future__ import annotations

import json

import peft
import pytest
import torch
from oftv2_helpers import randomize_q
from peft import PeftModel
from safetensors.torch import load_file

import oftv2
from oftv2 import OFTv2Config


def _trained(tiny_model, **cfg):
    model = tiny_model("llama", seed=0)
    config = OFTv2Config(target_modules="all-linear", block_size=8, **cfg)
    peft_model = peft.get_peft_model(model, config)
    randomize_q(peft_model, std=0.03)
    return peft_model.eval()


def test_round_trip_in_process(tiny_model, tokens, tmp_path):
    peft_model = _trained(tiny_model, orthogonalization="cayley", max_q_norm=0.05)
    peft_model.add_adapter("second", OFTv2Config(target_modules=["q_proj"], r=2))
    with torch.no_grad():
        expected = peft_model(tokens).logits
    peft_model.save_pretrained(tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "adapter_model.safetensors" in files and "second" in files
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert saved and all(k.endswith(".oftv2_Q") for k in saved)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["peft_type"] == "OFTV2"
    loaded = PeftModel.from_pretrained(tiny_model("llama", seed=0), tmp_path)
    loaded.load_adapter(tmp_path / "second", adapter_name="second")
    assert loaded.peft_config["default"].max_q_norm == 0.05
    with torch.no_grad():
        assert torch.allclose(loaded(tokens).logits, expected, atol=1e-6)
    assert set(loaded.peft_config) == {"default", "second"}
    assert not any(p.requires_grad for p in loaded.parameters())  # inference mode by default


def test_fresh_process_round_trip(tiny_model, tokens, tmp_path, run_fresh):
    peft_model = _trained(tiny_model)
    with torch.no_grad():
        expected = peft_model(tokens).logits
    peft_model.save_pretrained(tmp_path / "adapter")
    torch.save({"tokens": tokens, "logits": expected}, tmp_path / "expected.pt")
    proc = run_fresh(f"""
        import torch
        from peft import PeftModel
        from peftplug.tiny import tiny_model
        try:
            PeftModel.from_pretrained(tiny_model("llama", seed=0), {str(tmp_path / "adapter")!r})
        except Exception as err:  # OFTv2 not imported yet: the error must say what to import
            print("HINT:", type(err).__name__, err)
        import oftv2
        ref = torch.load({str(tmp_path / "expected.pt")!r})
        model = PeftModel.from_pretrained(tiny_model("llama", seed=0), {str(tmp_path / "adapter")!r})
        with torch.no_grad():
            diff = (model(ref["tokens"]).logits - ref["logits"]).abs().max().item()
        print("DIFF", diff)
    """)
    lines = proc.stdout.splitlines()
    hint = next(line for line in lines if line.startswith("HINT:"))
    assert "import oftv2" in hint
    diff = float(next(line for line in lines if line.startswith("DIFF")).split()[1])
    assert diff < 1e-6


def test_corrupt_or_mismatched_files_fail_clearly(tiny_model, tmp_path):
    peft_model = _trained(tiny_model)
    peft_model.save_pretrained(tmp_path)
    # Block size in the config no longer matches the saved tensors.
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    cfg["block_size"] = 16
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(RuntimeError, match="size mismatch"):
        PeftModel.from_pretrained(tiny_model("llama", seed=0), tmp_path)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(Exception, match="(?i)header|safetensor|deserializ"):
        PeftModel.from_pretrained(tiny_model("llama", seed=0), tmp_path)


def test_state_dict_holds_only_adapter_tensors(tiny_model):
    peft_model = _trained(tiny_model)
    state = peft.get_peft_model_state_dict(peft_model)
    n_layers = sum(1 for m in peft_model.modules() if isinstance(m, oftv2.OFTv2Layer))
    assert len(state) == n_layers and all(k.endswith("oftv2_Q") for k in state)
