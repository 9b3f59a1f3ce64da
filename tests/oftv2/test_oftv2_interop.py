"""Parity with PEFT's own OFT on the same weights, and adapter conversion in both directions."""

from __future__ import annotations

import json

import peft
import pytest
import torch
from oftv2_helpers import randomize_q
from peft import OFTConfig, PeftModel, get_peft_model_state_dict

import oftv2  # noqa: F401
from oftv2 import (
    OFTv2Config,
    export_peft_oft_adapter,
    load_peft_oft_adapter,
    oft_config_from_oftv2,
    oftv2_config_from_oft,
    state_dict_from_peft_oft,
)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_oft_model(tiny_model, use_cn, terms=5, block_share=False, seed=0):
    model = tiny_model("llama", seed=seed)
    cfg = OFTConfig(
        target_modules=TARGETS,
        oft_block_size=16,
        r=0,
        use_cayley_neumann=use_cn,
        num_cayley_neumann_terms=terms,
        block_share=block_share,
    )
    oft = peft.get_peft_model(model, cfg)
    randomize_q(oft, std=0.03, seed=1, key="oft_R")
    return oft.eval()


@pytest.mark.parametrize(
    "use_cn, terms, block_share",
    [
        (True, 5, False),
        (True, 2, False),
        (True, 3, True),
        (True, 4, False),
        (True, 7, True),
        (False, 5, False),
    ],
)
def test_parity_with_peft_oft_same_weights(tiny_model, tokens, use_cn, terms, block_share):
    oft = _peft_oft_model(tiny_model, use_cn, terms, block_share)
    with torch.no_grad():
        reference = oft(tokens).logits
    config = oftv2_config_from_oft(oft.peft_config["default"])
    assert config.orthogonalization == (
        "cayley" if not use_cn else "cayley_neumann" if terms == 2 else "peft_cn"
    )
    v2 = peft.get_peft_model(tiny_model("llama", seed=0), config).eval()
    state = state_dict_from_peft_oft(get_peft_model_state_dict(oft), oft.peft_config["default"])
    result = peft.set_peft_model_state_dict(v2, state)
    assert not result.unexpected_keys
    with torch.no_grad():
        ours = v2(tokens).logits
        base = v2.get_base_model()
        with v2.disable_adapter():
            plain = v2(tokens).logits
    assert (reference - plain).abs().max() > 1e-3  # the adapter really changes the output
    assert torch.allclose(ours, reference, atol=1e-5), (ours - reference).abs().max()
    assert base is not None


def test_peft_exact_path_is_transposed_rotation(tiny_model, tokens):
    """Documents the convention: PEFT's exact Cayley equals ours with Q negated, not with the same Q."""
    oft = _peft_oft_model(tiny_model, use_cn=False)
    with torch.no_grad():
        reference = oft(tokens).logits
    config = oftv2_config_from_oft(oft.peft_config["default"])
    v2 = peft.get_peft_model(tiny_model("llama", seed=0), config).eval()
    raw = {k.replace(".oft_R.weight", ".oftv2_Q.weight"): v for k, v in get_peft_model_state_dict(oft).items()}
    peft.set_peft_model_state_dict(v2, raw)  # same Q, no negation: the inverse rotation
    with torch.no_grad():
        assert (v2(tokens).logits - reference).abs().max() > 1e-3


def test_import_saved_peft_oft_adapter(tiny_model, tokens, tmp_path):
    oft = _peft_oft_model(tiny_model, use_cn=True)
    with torch.no_grad():
        reference = oft(tokens).logits
    oft.save_pretrained(tmp_path / "oft")
    v2 = load_peft_oft_adapter(tiny_model("llama", seed=0), tmp_path / "oft")
    assert isinstance(v2.peft_config["default"], OFTv2Config)
    with torch.no_grad():
        assert torch.allclose(v2(tokens).logits, reference, atol=1e-5)


@pytest.mark.parametrize("form", ["peft_cn", "cayley"])
def test_export_loads_in_vanilla_peft(tiny_model, tokens, tmp_path, form):
    v2 = peft.get_peft_model(
        tiny_model("llama", seed=0),
        OFTv2Config(target_modules=TARGETS, block_size=8, orthogonalization=form, neumann_terms=6),
    )
    randomize_q(v2, std=0.03)
    v2.eval()
    with torch.no_grad():
        ours = v2(tokens).logits
    out = export_peft_oft_adapter(v2, tmp_path / "export")
    raw = json.loads((out / "adapter_config.json").read_text())
    assert raw["peft_type"] == "OFT" and raw["oft_block_size"] == 8
    loaded = PeftModel.from_pretrained(tiny_model("llama", seed=0), out).eval()
    assert type(loaded.peft_config["default"]) is OFTConfig
    with torch.no_grad():
        assert torch.allclose(loaded(tokens).logits, ours, atol=1e-5), (
            (loaded(tokens).logits - ours).abs().max()
        )


def test_export_of_taylor_form_warns_with_the_gap(tiny_model, tokens, tmp_path):
    v2 = peft.get_peft_model(tiny_model("llama", seed=0), OFTv2Config(target_modules=TARGETS, block_size=8))
    randomize_q(v2, std=0.01)
    with pytest.warns(UserWarning, match="exact Cayley"):
        out = export_peft_oft_adapter(v2, tmp_path / "export")
    loaded = PeftModel.from_pretrained(tiny_model("llama", seed=0), out).eval()
    with torch.no_grad():
        # Taylor truncation at ||Q|| ~ 0.05 is ~1e-7 in the rotation entries: outputs still agree closely.
        assert torch.allclose(loaded(tokens).logits, v2.eval()(tokens).logits, atol=1e-4)


def test_config_round_trip_and_rejections():
    cfg = OFTv2Config(
        r=4, orthogonalization="peft_cn", neumann_terms=7, bias="oftv2_only", target_modules=["q"]
    )
    back = oftv2_config_from_oft(oft_config_from_oftv2(cfg))
    assert (back.r, back.orthogonalization, back.neumann_terms, back.bias) == (4, "peft_cn", 7, "oftv2_only")
    assert (
        oft_config_from_oftv2(OFTv2Config(orthogonalization="peft_cn", neumann_terms=3)).use_cayley_neumann
        is False
    )
    assert oft_config_from_oftv2(OFTv2Config(neumann_terms=2)).num_cayley_neumann_terms == 2
    with pytest.raises(ValueError, match="no rotation"):
        oftv2_config_from_oft(OFTConfig(target_modules=["q"], num_cayley_neumann_terms=1))
    with pytest.raises(ValueError, match="coft"):
        oftv2_config_from_oft(OFTConfig(target_modules=["q"], coft=True))
    with pytest.raises(ValueError, match="peft_type"):
        oftv2_config_from_oft(peft.LoraConfig(target_modules=["q"]))


def test_load_rejects_foreign_and_corrupt_dirs(tiny_model, tmp_path):
    lora = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(target_modules=["q_proj"]))
    lora.save_pretrained(tmp_path / "lora")
    with pytest.raises(ValueError, match="expected 'OFT'"):
        load_peft_oft_adapter(tiny_model("llama"), tmp_path / "lora")
    oft = _peft_oft_model(tiny_model, use_cn=True)
    oft.save_pretrained(tmp_path / "oft")
    (tmp_path / "oft" / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="safetensors"):
        load_peft_oft_adapter(tiny_model("llama"), tmp_path / "oft")
    with pytest.raises(FileNotFoundError):
        load_peft_oft_adapter(tiny_model("llama"), tmp_path / "missing")


def test_config_overrides_accept_runtime_settings_and_refuse_the_rest(tiny_model, tokens, tmp_path):
    oft = _peft_oft_model(tiny_model, use_cn=True)
    with torch.no_grad():
        reference = oft(tokens).logits
    oft.save_pretrained(tmp_path / "oft")
    v2 = load_peft_oft_adapter(tiny_model("llama", seed=0), tmp_path / "oft",
                               config_overrides={"kernel_impl": "torch", "stack_rotations": True})
    assert (v2.peft_config["default"].kernel_impl, v2.peft_config["default"].stack_rotations) == ("torch", True)
    with torch.no_grad():
        torch.testing.assert_close(v2(tokens).logits, reference, rtol=1e-5, atol=1e-5)
    # A typo was set as a stray attribute and ignored; now it is refused with the accepted keys.
    with pytest.raises(ValueError, match=r"unknown key 'kernel_imp'; accepted keys: kernel_impl, "):
        load_peft_oft_adapter(tiny_model("llama", seed=0), tmp_path / "oft", config_overrides={"kernel_imp": "x"})
    # Fields the saved adapter fixes: named with the reason, not a size mismatch from load_state_dict.
    for key, value, why in [("block_size", 16, "shape"), ("r", 4, "shape"), ("block_share", True, "shape"),
                            ("orthogonalization", "cayley", "converted for the form"),
                            ("target_modules", ["k_proj"], "which layers"), ("inference_mode", False,
                                                                              "is_trainable")]:
        with pytest.raises(ValueError, match=rf"cannot set '{key}' when loading an adapter: .*{why}"):
            load_peft_oft_adapter(tiny_model("llama", seed=0), tmp_path / "oft", config_overrides={key: value})
