"""OFTv2 on MoE models whose experts are fused 3-D parameters (transformers 5: Mixtral, Qwen2-MoE, Qwen3-MoE).

OFTv2 adapts layers, and the experts are not layers any more. Before oftv2/experts.py a config naming them (the
transformers 4 names ``gate_proj``/``up_proj``/``down_proj`` or ``w1``/``w2``, as dense-model recipes do) adapted
the attention layers only and left every expert frozen without a word, and so did ``"all-linear"``; PEFT's LoRA
converts the same names to ``target_parameters`` and adapts the experts.
"""

from __future__ import annotations

import warnings

import peft
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import oftv2  # noqa: F401
from oftv2 import OFTv2Config
from oftv2.layer import OFTv2Layer

COMMON = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "vocab_size": 128, "max_position_embeddings": 64, "num_key_value_heads": 2}
MOE = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 64},
}
DENSE_RECIPE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model(model_type: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **COMMON, **MOE.get(model_type, {})))


def _adapted(model) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, OFTv2Layer)}


@pytest.mark.parametrize(("model_type", "targets", "refused"), [
    ("qwen3_moe", DENSE_RECIPE, ["down_proj", "gate_proj", "up_proj"]),
    ("mixtral", ["q_proj", "v_proj", "w1", "w2"], ["w1", "w2"]),
    ("mixtral", ["q_proj", "gate_up_proj"], ["gate_up_proj"]),
])
def test_targets_naming_only_fused_experts_are_refused_in_one_line(model_type, targets, refused):
    base = _model(model_type)
    before = [type(m) for m in base.modules()]
    with pytest.raises(ValueError, match=r"name the MoE expert weights") as err:
        peft.get_peft_model(base, OFTv2Config(target_modules=targets, block_size=8))
    message = str(err.value)
    assert "\n" not in message and str(refused) in message and "experts.gate_up_proj" in message
    assert [type(m) for m in base.modules()] == before  # refused before anything was replaced


def test_loading_for_inference_warns_instead_and_adapts_the_layers_that_match():
    config = OFTv2Config(target_modules=DENSE_RECIPE, block_size=8, inference_mode=True)
    with pytest.warns(UserWarning, match=r"leaves the MoE experts of this model frozen"):
        model = peft.get_peft_model(_model("qwen3_moe"), config)
    assert _adapted(model) == {"q_proj", "k_proj", "v_proj", "o_proj"}


@pytest.mark.parametrize(("model_type", "targets", "adapted"), [
    ("qwen3_moe", "all-linear", {"q_proj", "k_proj", "v_proj", "o_proj"}),
    # Qwen2-MoE's shared expert has real gate_proj layers: adapted, and the routed experts are named in the warning.
    ("qwen2_moe", ["q_proj", "gate_proj"], {"q_proj", "gate_proj"}),
])
def test_all_linear_and_partly_matching_names_warn_that_the_experts_stay_frozen(model_type, targets, adapted):
    with pytest.warns(UserWarning, match=r"MoE experts of this model frozen .*experts\.gate_up_proj"):
        model = peft.get_peft_model(_model(model_type), OFTv2Config(target_modules=targets, block_size=8))
    assert _adapted(model) == adapted


def test_dense_models_with_the_same_recipe_stay_quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*MoE experts.*")
        model = peft.get_peft_model(_model("qwen3"), OFTv2Config(target_modules=DENSE_RECIPE, block_size=8))
    assert _adapted(model) == set(DENSE_RECIPE)
