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
    assert saved and all(k.endswith(".oftv2_Q.weight") for k in saved)
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
    assert len(state) == n_layers and all(k.endswith("oftv2_Q.weight") for k in state)


def test_modules_to_save_round_trip_and_is_trainable(tiny_model, tokens, tmp_path):
    config = OFTv2Config(target_modules=["q_proj", "v_proj"], block_size=8, modules_to_save=["score"],
                         task_type="SEQ_CLS")
    peft_model = peft.get_peft_model(tiny_model("llama", task="seq_cls", seed=0), config)
    randomize_q(peft_model, std=0.03)
    head = peft_model.base_model.model.score
    with torch.no_grad():
        head.modules_to_save["default"].weight.mul_(-2.0)  # the saved copy must differ from the base head
    peft_model.eval()
    with torch.no_grad():
        expected = peft_model(tokens).logits
    peft_model.save_pretrained(tmp_path)
    assert any("score" in k for k in load_file(tmp_path / "adapter_model.safetensors"))
    loaded = PeftModel.from_pretrained(tiny_model("llama", task="seq_cls", seed=0), tmp_path, is_trainable=True)
    trainable = {n for n, p in loaded.named_parameters() if p.requires_grad}
    assert any("oftv2_Q.default" in n for n in trainable) and any("modules_to_save.default" in n for n in trainable)
    assert all("oftv2_Q" in n or "modules_to_save" in n for n in trainable)
    loaded.eval()
    with torch.no_grad():
        assert torch.allclose(loaded(tokens).logits, expected, atol=1e-6)


def test_exclude_modules_and_layers_to_transform(tiny_model):
    def adapted(**kw):
        model = peft.get_peft_model(tiny_model("llama"), OFTv2Config(block_size=8, **kw))
        return sorted(n.replace("base_model.model.model.", "") for n, m in model.named_modules()
                      if isinstance(m, oftv2.OFTv2Layer))

    names = adapted(target_modules="all-linear", exclude_modules=["down_proj", "q_proj"])
    assert len(names) == 10 and not any(n.endswith(("down_proj", "q_proj")) for n in names)
    assert adapted(target_modules=["q_proj", "v_proj"], layers_to_transform=[1]) == [
        "layers.1.self_attn.q_proj", "layers.1.self_attn.v_proj"]
