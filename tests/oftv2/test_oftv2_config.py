"""OFTv2Config: defaults, the block_size/r choice, and rejection of every invalid value."""

from __future__ import annotations

import pytest

import oftv2  # noqa: F401  (registers the PEFT type)
from oftv2 import OFTv2Config


def test_defaults_and_peft_type():
    config = OFTv2Config(target_modules=["q_proj"])
    assert config.block_size == 32 and config.r is None
    assert config.orthogonalization == "cayley_neumann" and config.neumann_terms == 5
    assert str(config.peft_type.value) == "OFTV2"
    assert config.target_modules == {"q_proj"}


def test_r_instead_of_block_size():
    config = OFTv2Config(r=4)
    assert config.r == 4 and config.block_size is None


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"block_size": 8, "r": 4}, "block_size"),
        ({"block_size": 1}, "block_size"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": 8.0}, "block_size"),
        ({"block_size": True}, "block_size"),
        ({"r": 0}, "r"),
        ({"r": -2}, "r"),
        ({"r": 2.5}, "r"),
        ({"orthogonalization": "householder"}, "orthogonalization"),
        ({"neumann_terms": 1}, "neumann_terms"),
        ({"neumann_terms": 65}, "neumann_terms"),
        ({"neumann_terms": 3.0}, "neumann_terms"),
        ({"block_share": "yes"}, "block_share"),
        ({"init_weights": 0}, "init_weights"),
        ({"fan_in_fan_out": 1}, "fan_in_fan_out"),
        ({"module_dropout": 1.0}, "module_dropout"),
        ({"module_dropout": -0.1}, "module_dropout"),
        ({"module_dropout": "0.1"}, "module_dropout"),
        ({"max_q_norm": 0.0}, "max_q_norm"),
        ({"max_q_norm": -1.0}, "max_q_norm"),
        ({"max_q_norm": float("inf")}, "max_q_norm"),
        ({"max_q_norm": float("nan")}, "max_q_norm"),
        ({"kernel_impl": "cuda"}, "kernel_impl"),
        ({"kernel_impl": "triton", "orthogonalization": "cayley"}, "kernel_impl"),
        ({"bias": "lora_only"}, "bias"),
        ({"target_modules": 3}, "target_modules"),
        ({"target_modules": ""}, "target_modules"),
        ({"target_modules": ["q_proj", 1]}, "target_modules"),
        ({"exclude_modules": [None]}, "exclude_modules"),
        ({"modules_to_save": "classifier"}, "modules_to_save"),
        ({"layers_to_transform": -1}, "layers_to_transform"),
        ({"layers_to_transform": [0, "1"]}, "layers_to_transform"),
        ({"layers_to_transform": []}, "layers_to_transform"),
        ({"layers_pattern": "layers"}, "layers_pattern"),
        ({"layers_pattern": 5, "layers_to_transform": [0]}, "layers_pattern"),
        ({"trainable_token_indices": [1, -2]}, "trainable_token_indices"),
        ({"trainable_token_indices": 5}, "trainable_token_indices"),
        ({"trainable_token_indices": {"embed_tokens": [1.5]}}, "trainable_token_indices"),
        ({"trainable_token_indices": {"": [1]}}, "trainable_token_indices"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        OFTv2Config(**kwargs)


def test_bound_at_or_above_one_warns_under_neumann():
    with pytest.warns(UserWarning, match="max_q_norm"):
        OFTv2Config(max_q_norm=1.5)
    OFTv2Config(max_q_norm=1.5, orthogonalization="cayley")  # exact Cayley has no convergence condition


def test_round_trip_through_dict():
    config = OFTv2Config(
        r=4, orthogonalization="peft_cn", neumann_terms=7, max_q_norm=0.5, target_modules=["a"]
    )
    again = OFTv2Config(**{k: v for k, v in config.to_dict().items() if k != "peft_type"})
    assert again.to_dict() == config.to_dict()


def test_trainable_token_indices_train_only_those_rows(tiny_model):
    import peft
    import torch

    config = OFTv2Config(target_modules=["q_proj"], block_size=8, trainable_token_indices={"embed_tokens": [5, 7]})
    model = peft.get_peft_model(tiny_model("llama"), config)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("oftv2_Q" in n for n in trainable) and any("trainable_tokens" in n for n in trainable)
    embed = model.get_input_embeddings()
    with torch.no_grad():
        before = embed(torch.arange(10)[None]).clone()
    model(torch.tensor([[5, 7, 9]])).logits.sum().backward()
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0).step()
    with torch.no_grad():
        moved = (embed(torch.arange(10)[None]) - before).abs().amax(-1)[0]
    assert moved[5] > 0 and moved[7] > 0 and moved[[0, 1, 2, 3, 4, 6, 8, 9]].max() == 0
