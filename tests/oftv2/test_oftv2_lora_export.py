"""OFTv2 -> LoRA export: full rank reproduces the adapter, the error falls with the rank, ranks clip per layer,
Embedding / Conv2d / biased layers, PEFT OFT adapters via interop, plain-PEFT loading in a fresh process (vLLM's
config constraints), atomic writing and the refusals."""

from __future__ import annotations

import itertools
import json
import re

import peft
import pytest
import torch
from oftv2_helpers import MixedLayers, randomize_q
from peft import PeftModel
from safetensors.torch import load_file

import oftv2
from oftv2 import OFTv2Config, export_lora, lora_applied, lora_from_oftv2, measure_lora_export


def _oftv2_llama(tiny_model, std=0.02, **cfg):
    model = peft.get_peft_model(tiny_model("llama"), OFTv2Config(target_modules="all-linear", block_size=8, **cfg))
    randomize_q(model, std=std)
    return model.eval()


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


def test_full_rank_reproduces_the_adapter_through_peft_lora(tiny_model, tokens, tmp_path):
    model = _oftv2_llama(tiny_model)
    expected = _logits(model, tokens)
    export = export_lora(model, tmp_path / "lora", rank="full")
    assert max(export.dropped.values()) < 1e-6
    lora = PeftModel.from_pretrained(tiny_model("llama"), tmp_path / "lora").eval()
    assert lora.peft_config["default"].peft_type == peft.PeftType.LORA
    assert (_logits(lora, tokens) - expected).abs().max() < 1e-5
    assert (_logits(lora, tokens) - _logits(tiny_model("llama"), tokens)).abs().max() > 1e-3  # it does something


def test_error_falls_with_the_rank_and_vanishes_at_full(tiny_model, tokens):
    model = _oftv2_llama(tiny_model, std=0.05)
    rows = measure_lora_export(model, [{"input_ids": tokens}], [1, 2, 4, 8, 16, 32, "full"])
    means = [r["mean_abs_logit_error"] for r in rows]
    dropped = [r["max_dropped"] for r in rows]
    assert all(a > b for a, b in itertools.pairwise(means)), means
    assert all(a >= b for a, b in itertools.pairwise(dropped)), dropped
    assert rows[-1]["max_abs_logit_error"] < 1e-5 and rows[-1]["top1_agreement"] == 1.0
    sizes = [r["num_parameters"] for r in rows]
    assert sizes == sorted(sizes) and rows[0]["num_bytes"] == 4 * sizes[0]
    # OFT's update is full rank: at rank 1 the logits are visibly off.
    assert rows[0]["max_abs_logit_error"] > 100 * rows[-1]["max_abs_logit_error"]


def test_the_measurement_restores_the_base_weights(tiny_model, tokens):
    model = _oftv2_llama(tiny_model)
    before = {n: p.clone() for n, p in model.named_parameters() if "base_layer" in n}
    export = lora_from_oftv2(model, rank=4)
    with lora_applied(model, export):
        pass
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)


def test_rank_is_clipped_per_layer_and_patterns_keep_scaling_one(tiny_model, tokens, tmp_path):
    model = _oftv2_llama(tiny_model)
    export = export_lora(model, tmp_path / "lora", rank=48)
    # Tiny Llama: q/o 64 x 64, k/v 32 x 64 (2 kv heads), MLP 128 x 64 / 64 x 128: k/v clip to 32.
    assert {p: k for p, k in export.ranks.items() if k != 48} == {
        p: 32 for p in export.ranks if p.endswith(("k_proj", "v_proj"))
    }
    config = export.config
    assert config.r == config.lora_alpha == 48 and config.rank_pattern == config.alpha_pattern
    assert set(config.rank_pattern) == {p for p in export.ranks if p.endswith(("k_proj", "v_proj"))}
    lora = PeftModel.from_pretrained(tiny_model("llama"), tmp_path / "lora").eval()
    with lora_applied(model, export):
        patched = _logits(model, tokens)
    assert (_logits(lora, tokens) - patched).abs().max() < 1e-5
    # Above every layer's full rank: no error, r = the largest full rank (64), never an error.
    big = lora_from_oftv2(model, rank=1000)
    assert big.ranks == big.full_ranks and big.config.r == 64


def test_embedding_conv_and_biases_round_trip(tmp_path):
    model = peft.get_peft_model(MixedLayers(), OFTv2Config(target_modules=["embed", "conv", "proj"], block_size=4))
    randomize_q(model, std=0.1)
    ids = torch.tensor([[1, 4, 2, 9, 0]])
    with torch.no_grad():
        expected = model(ids)
    export = export_lora(model, tmp_path / "lora", rank="full")
    saved = load_file(tmp_path / "lora" / "adapter_model.safetensors")
    assert saved["base_model.model.embed.lora_embedding_A"].shape == (8, 10)
    assert saved["base_model.model.embed.lora_embedding_B"].shape == (8, 8)
    assert saved["base_model.model.conv.lora_A.weight"].shape == (8, 8, 3, 3)
    assert saved["base_model.model.conv.lora_B.weight"].shape == (8, 8, 1, 1)
    assert not any("bias" in k for k in saved) and export.config.bias == "none"
    lora = PeftModel.from_pretrained(MixedLayers(), tmp_path / "lora").eval()
    with torch.no_grad():
        assert (lora(ids) - expected).abs().max() < 1e-5
        # OFT leaves biases alone: the merged OFTv2 model has the base biases.
        merged = model.merge_and_unload()
    base = MixedLayers()
    assert torch.equal(merged.conv.bias, base.conv.bias) and torch.equal(merged.proj.bias, base.proj.bias)


def test_a_peft_oft_adapter_exports_via_interop(tiny_model, tokens, tmp_path):
    oft = peft.get_peft_model(tiny_model("llama"), peft.OFTConfig(
        target_modules=["q_proj", "v_proj", "down_proj"], oft_block_size=8, r=0, use_cayley_neumann=False,
    ))
    with torch.no_grad():
        for name, param in oft.named_parameters():
            if "oft_R" in name:
                param.normal_(0, 0.03)
    oft.eval()
    expected = _logits(oft, tokens)
    oft.save_pretrained(tmp_path / "oft")
    loaded = oftv2.load_oft_family_adapter(tiny_model("llama"), tmp_path / "oft")
    export_lora(loaded, tmp_path / "lora", rank="full")
    lora = PeftModel.from_pretrained(tiny_model("llama"), tmp_path / "lora").eval()
    assert (_logits(lora, tokens) - expected).abs().max() < 1e-5


def test_loads_with_plain_peft_in_a_fresh_process_and_meets_vllm_constraints(tiny_model, tokens, tmp_path, run_fresh):
    model = _oftv2_llama(tiny_model)
    tiny_model("llama").save_pretrained(tmp_path / "base")
    export_lora(model, tmp_path / "lora", rank=16)
    with lora_applied(model, lora_from_oftv2(model, rank=16)):
        torch.save({"tokens": tokens, "logits": _logits(model, tokens)}, tmp_path / "expected.pt")
    raw = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    # vLLM's PEFTHelper: r, lora_alpha and target_modules required; modules_to_save must be None; no DoRA.
    assert raw["peft_type"] == "LORA" and raw["r"] == 16 and raw["lora_alpha"] == 16 and raw["target_modules"]
    assert raw["modules_to_save"] is None and raw["use_dora"] is False and raw["bias"] == "none"
    out = run_fresh(f"""
        import sys, torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({str(tmp_path / "base")!r}),
                                          {str(tmp_path / "lora")!r}).eval()
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        with torch.no_grad():
            err = (model(expected["tokens"]).logits - expected["logits"]).abs().max().item()
        ours = sorted(m for m in sys.modules if m.split(".")[0] in ("oftv2", "peftplug", "peftplug_kernels"))
        print("ERR", err, "OURS", ours)
    """)
    line = next(x for x in out.stdout.splitlines() if x.startswith("ERR"))
    assert float(line.split()[1]) < 1e-5 and line.endswith("OURS []")


def test_base_weight_provider_is_used(tiny_model):
    model = _oftv2_llama(tiny_model)
    plain = lora_from_oftv2(model, rank="full")
    seen = []

    def doubled(path, layer):
        seen.append(path)
        return 2 * layer._get_base_weight()

    scaled = lora_from_oftv2(model, rank="full", base_weight=doubled)
    assert sorted(seen) == sorted(plain.ranks)
    key = next(k for k in plain.tensors if k.endswith("q_proj.lora_A.weight"))
    key_b = key.replace("lora_A", "lora_B")
    assert torch.allclose(scaled.tensors[key_b] @ scaled.tensors[key], 2 * plain.tensors[key_b] @ plain.tensors[key],
                          atol=1e-6)


def test_output_folder_is_written_atomically_and_never_overwritten(tiny_model, tmp_path, monkeypatch):
    model = _oftv2_llama(tiny_model)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="out_dir"):
        export_lora(model, taken, rank=4)
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    export_lora(model, empty, rank=4)
    assert sorted(p.name for p in empty.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]

    import oftv2.lora_export as module

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(module, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        export_lora(model, tmp_path / "failed", rank=4)
    assert not (tmp_path / "failed").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("rank", [0, -1, 2.5, "half", True])
def test_bad_rank_names_the_field(tiny_model, rank):
    with pytest.raises(ValueError, match="`rank`"):
        lora_from_oftv2(_oftv2_llama(tiny_model), rank=rank)


@pytest.mark.parametrize("cfg, match", [({"bias": "all"}, "bias"), ({"modules_to_save": ["lm_head"]},
                                                                       "modules_to_save")])
def test_unservable_adapters_are_refused(tiny_model, cfg, match):
    with pytest.raises(ValueError, match=match):
        lora_from_oftv2(_oftv2_llama(tiny_model, **cfg), rank=4)


def test_a_merged_adapter_is_refused(tiny_model):
    model = _oftv2_llama(tiny_model)
    model.base_model.merge_adapter()
    with pytest.raises(ValueError, match="unmerge"):
        lora_from_oftv2(model, rank=4)


def _convs(**second):
    """Two 3 × 3 convs; the second with the settings under test."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.Conv2d(4, 6, 3, **second))


@pytest.mark.parametrize("second, setting", [
    ({"padding": 1, "groups": 2}, "groups=2"),
    ({"padding": 2, "dilation": 2}, "dilation=(2, 2)"),
    ({"padding": 1, "padding_mode": "reflect"}, "padding_mode='reflect'"),
    ({"padding": 1, "padding_mode": "circular"}, "padding_mode='circular'"),
    ({"padding": 1, "padding_mode": "replicate"}, "padding_mode='replicate'"),
])
def test_convs_peft_lora_cannot_apply_unmerged_are_refused(tmp_path, second, setting):
    # PEFT's LoRA Conv2d builds lora_A with the base's kernel, stride and padding only (dense, undilated,
    # zero-padded): such a folder would crash or compute something else unmerged, as a server applies it.
    model = peft.get_peft_model(_convs(**second), OFTv2Config(target_modules=["0", "1"], block_size=6))
    with pytest.raises(ValueError, match=re.escape(f"Conv2d layer '1' with {setting}")):
        export_lora(model, tmp_path / "lora", rank="full")
    assert not (tmp_path / "lora").exists()


def test_strided_zero_padded_conv_still_exports_exactly(tmp_path):
    model = peft.get_peft_model(_convs(padding=1, stride=2), OFTv2Config(target_modules=["0", "1"], block_size=6))
    randomize_q(model, std=0.1)
    x = torch.randn(2, 4, 9, 9, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
    export_lora(model, tmp_path / "lora", rank="full")
    lora = PeftModel.from_pretrained(_convs(padding=1, stride=2), tmp_path / "lora").eval()
    with torch.no_grad():
        torch.testing.assert_close(lora(x), expected, rtol=1e-5, atol=1e-5)
