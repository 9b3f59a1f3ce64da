"""What FSDP2 sharding (peftplug.sharding) refuses, and its units, checked in one process (no process group needed):
prompt-learning adapters, int8 bases and models without a transformer block are refused in one line; OFTv2, LoRA,
steering and 4-bit bases are accepted; the units are each decoder block, then the transformers model."""

from __future__ import annotations

import pytest
from peft import LoraConfig, PromptTuningConfig, get_peft_model

import oftv2
import steering
from peftplug.errors import ConfigError
from peftplug.lightning import PeftModule
from peftplug.loading import load_model
from peftplug.sharding import mixed_precision_policy, shard_units, sharding_refusal
from peftplug.tiny import tiny_model


@pytest.mark.parametrize("config", [
    oftv2.OFTv2Config(block_size=8, target_modules=["q_proj", "v_proj"]),
    LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    steering.SteeringConfig(layers=[1], task_type="CAUSAL_LM"),
], ids=["oftv2", "lora", "steering"])
def test_module_adapters_shard_by_decoder_block_then_root(config):
    model = get_peft_model(tiny_model("llama"), config)
    assert sharding_refusal(model) is None
    units = shard_units(model)
    assert [type(u).__name__ for u in units] == ["LlamaDecoderLayer", "LlamaDecoderLayer", "LlamaForCausalLM"]
    assert units[-1] is model.get_base_model()  # the root: generate() calls the transformers model directly


def test_prompt_learning_is_refused_with_its_reason():
    model = get_peft_model(tiny_model("llama"), PromptTuningConfig(num_virtual_tokens=4, task_type="CAUSAL_LM"))
    reason = sharding_refusal(model)
    assert reason.startswith("prompt-learning adapters (prompt tuning, prefix tuning, P-tuning, PCT) read the base "
                             "model's input embedding outside its forward") and "strategy: ddp" in reason


def test_int8_base_is_refused_and_4bit_is_accepted():
    pytest.importorskip("bitsandbytes")
    int8 = load_model("tiny:llama", "causal_lm", quantization="int8")
    assert "is a Linear8bitLt" in sharding_refusal(int8) and "use quantization nf4/fp4" in sharding_refusal(int8)
    assert sharding_refusal(load_model("tiny:llama", "causal_lm", quantization="nf4")) is None


def test_a_model_without_blocks_is_refused():
    model = tiny_model("llama")
    model._no_split_modules = ["NoSuchBlock"]
    assert "names no transformer block in _no_split_modules (['NoSuchBlock'])" in sharding_refusal(model)


def test_mixed_precision_is_checked_by_name():
    assert mixed_precision_policy("none") is None
    policy = mixed_precision_policy("bfloat16")
    assert str(policy.param_dtype) == "torch.bfloat16" and str(policy.reduce_dtype) == "torch.float32"
    with pytest.raises(ConfigError, match="model.fsdp_mixed_precision must be one of none, bfloat16, float16"):
        mixed_precision_policy("fp8")
    with pytest.raises(ValueError, match="model.fsdp_mixed_precision"):
        PeftModule("tiny:llama", fsdp_mixed_precision="fp8")
