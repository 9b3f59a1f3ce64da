"""Input handling: config and multiplier validation, trainable position policies, adding adapters to a PeftModel,
low_cpu_mem_usage loading, dict attention masks (static cache) and the CLI's one-line errors."""

from __future__ import annotations

import json

import peft
import pytest
import torch
import transformers

import steering
from peftplug.errors import ConfigError
from steering import SteeringConfig
from steering.positions import SteeringContext

IDS = torch.tensor([[5, 6, 7, 8, 9]])
PAIRS = [("I feel happy", "I feel sad"), ("a good day", "a bad day"), ("so glad", "so mad")]


def _vec(seed: int, scale: float = 3.0) -> torch.Tensor:
    return scale * torch.randn(64, generator=torch.Generator().manual_seed(seed))


def _logits(model, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS, **kwargs).logits


# ----------------------------------------------------------------------------------------------- config values
@pytest.mark.parametrize(("kwargs", "field"), [
    ({"layer_multipliers": {0: float("nan")}}, r"layer_multipliers\[0\]"),
    ({"layer_multipliers": {0: float("inf")}}, r"layer_multipliers\[0\]"),
    ({"layer_multipliers": {0: "x"}}, r"layer_multipliers\[0\]"),
    ({"layer_multipliers": [2.0]}, r"layer_multipliers must be a dict"),
    ({"multiplier": "strong"}, r"SteeringConfig\.multiplier"),
    ({"multiplier": float("-inf")}, r"SteeringConfig\.multiplier"),
    ({"multiplier": True}, r"SteeringConfig\.multiplier"),
])
def test_bad_multipliers_name_their_field(kwargs, field):
    with pytest.raises(ValueError, match=field) as info:
        SteeringConfig(layers=[0], **kwargs)
    assert "finite" in str(info.value) or "dict" in str(info.value)


def test_numeric_multipliers_of_any_type_are_accepted():
    config = SteeringConfig(layers=[0, 1], multiplier=torch.tensor(2.5), layer_multipliers={"1": -2})
    assert config.multiplier == 2.5 and config.layer_multipliers == {1: -2.0}


def test_rejected_set_multiplier_leaves_the_adapter_unchanged(tiny_model, tmp_path):
    pm = steering.steering_adapter(tiny_model("llama"), {0: torch.ones(64)}, multiplier=2.0)
    before = _logits(pm)
    for bad in (float("nan"), "strong"):
        with pytest.raises(ValueError, match="multiplier"):
            pm.base_model.set_multiplier(bad)
    with pytest.raises(ValueError, match="layer_multipliers"):
        pm.base_model.set_multiplier(1.0, layer_multipliers={0: float("inf")})
    config = pm.base_model.peft_config["default"]
    assert config.multiplier == 2.0 and config.layer_multipliers is None
    assert pm.base_model.steering_layers()[0].steer_multiplier["default"] == 2.0
    assert torch.equal(_logits(pm), before)
    pm.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["multiplier"] == 2.0


# ----------------------------------------------------------------------------------------------- trainable
@pytest.mark.parametrize("positions", ["generated", "from_last_prompt"])
def test_trainable_refuses_positions_a_training_forward_cannot_select(tiny_model, tokenizer, positions):
    with pytest.raises(ValueError, match=rf"positions='{positions}'.*\('all', 'prompt'\)"):
        steering.train_steering_vector(tiny_model("llama"), tokenizer, PAIRS, method="trainable", layers=[0],
                                       positions=positions, steps=2, progress=False)
    pm = peft.get_peft_model(tiny_model("llama"), SteeringConfig(layers=[0], positions=positions,
                                                                  task_type="CAUSAL_LM"))
    with pytest.raises(ValueError, match=rf"positions='{positions}'"):
        steering.train_vectors(pm, tokenizer, PAIRS, steps=2, progress=False)


def test_trainable_with_prompt_positions_trains(tiny_model, tokenizer):
    pm = steering.train_steering_vector(tiny_model("llama"), tokenizer, PAIRS, method="trainable", layers=[0],
                                        positions="prompt", steps=3, lr=0.1, progress=False)
    assert pm.base_model.get_vectors()[0].norm() > 0


# ----------------------------------------------------------------------------------------------- adding adapters
def test_adapter_added_to_a_peft_model_is_the_active_one(tiny_model, tmp_path):
    pm = steering.steering_adapter(tiny_model("llama"), {0: _vec(0)}, adapter_name="first", multiplier=0.0)
    steering.export_easyedit({1: 5 * torch.ones(64)}, tmp_path)
    pm = steering.load_easyedit(pm, tmp_path, multiplier=3.0, adapter_name="ee")
    assert pm.base_model.active_adapters == ["ee"]
    alone = steering.load_easyedit(tiny_model("llama"), tmp_path, multiplier=3.0)
    torch.testing.assert_close(_logits(pm), _logits(alone))
    assert (_logits(pm) - _logits(tiny_model("llama"))).abs().max() > 1e-2


# ----------------------------------------------------------------------------------------------- loading
def test_low_cpu_mem_usage_loads_the_same_adapter(tiny_model, tmp_path):
    pm = steering.steering_adapter(tiny_model("llama"), {0: _vec(0), 1: torch.ones(64)}, multiplier=1.5,
                                   layer_multipliers={1: -2.0}, normalize=True)
    want = _logits(pm)
    pm.save_pretrained(tmp_path)
    loaded = peft.PeftModel.from_pretrained(tiny_model("llama"), tmp_path, low_cpu_mem_usage=True)
    assert torch.equal(_logits(loaded), want)
    other = steering.steering_adapter(tiny_model("llama"), {1: _vec(2)}, adapter_name="x")
    other.load_adapter(tmp_path, adapter_name="y", low_cpu_mem_usage=True)
    other.base_model.set_adapter("y")
    assert torch.equal(_logits(other), want)


# ----------------------------------------------------------------------------------------------- dict masks
def test_a_dict_of_masks_counts_as_no_padding_information():
    context = SteeringContext()
    four_d = torch.zeros(2, 1, 3, 3)
    context.begin_forward(2, 3, 0, {"full_attention": four_d, "sliding_attention": four_d}, torch.device("cpu"))
    assert context.mask("all", torch.float32) is None
    two_d = torch.tensor([[0, 1, 1], [1, 1, 1]])
    context.begin_forward(2, 3, 0, {"full_attention": four_d, "padding": two_d}, torch.device("cpu"))
    assert torch.equal(context.mask("all", torch.float32)[..., 0], two_d.float())


@pytest.mark.parametrize("positions", ["all", "from_last_prompt", "prompt"])
def test_gemma2_static_cache_generates_as_the_dynamic_cache(tokenizer, positions):
    """Gemma-2 (sliding-window + full attention) under a static cache passes the base model a dict of masks."""
    from peftplug.tiny import CHAR_VOCAB_SIZE

    config = transformers.AutoConfig.for_model(
        "gemma2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=CHAR_VOCAB_SIZE, sliding_window=4, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    batch = tokenizer(["Once upon a time", "Hi"], return_tensors="pt", padding=True, padding_side="left")
    pm = steering.steering_adapter(model, {1: _vec(1)}, multiplier=2.0, positions=positions)

    def run(**kwargs):
        out = pm.generate(**batch, max_new_tokens=4, do_sample=False, pad_token_id=0, output_scores=True,
                          return_dict_in_generate=True, **kwargs)
        return out.sequences, torch.stack(out.scores, dim=1)

    static, static_scores = run(cache_implementation="static")
    dynamic, dynamic_scores = run()
    assert torch.equal(static, dynamic)
    torch.testing.assert_close(static_scores, dynamic_scores)
    with pm.disable_adapter():
        _, base_scores = run()
    assert (static_scores - base_scores).abs().max() > 1e-2


# ----------------------------------------------------------------------------------------------- CLI
@pytest.fixture
def adapter_dir(tiny_model, tmp_path):
    path = tmp_path / "happy"
    steering.steering_adapter(tiny_model("llama"), {1: _vec(0)}).save_pretrained(path)
    (tmp_path / "prompts.txt").write_text("hello\nworld\n")
    return path


@pytest.mark.parametrize(("args", "message"), [
    (["generate", "--adapter", "{adapter}:nan", "--prompt", "hi"], r"--adapter .*:nan: .*finite"),
    (["generate", "--adapter", "{adapter}:inf", "--prompt", "hi"], r"--adapter .*:inf: .*finite"),
    (["generate", "--adapter", "{adapter}", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be"),
    (["evaluate", "--adapter", "{adapter}", "--prompts", "{prompts}", "--raw-prompts", "--max-new-tokens", "0"],
     "--max-new-tokens must be"),
    (["evaluate", "--adapter", "{adapter}", "--prompts", "{prompts}", "--raw-prompts", "--batch-size", "0"],
     "--batch-size must be"),
    (["evaluate", "--prompts", "{prompts}", "--raw-prompts", "--scorer", "{empty}"], r"--scorer .*no config\.json"),
    (["evaluate", "--prompts", "{prompts}", "--raw-prompts", "--scorer", "{adapter}"], r"--scorer .*PEFT adapter"),
])
def test_cli_input_errors_are_one_line(adapter_dir, args, message):
    from steering.cli import main

    (adapter_dir.parent / "empty").mkdir()
    paths = {"adapter": adapter_dir, "prompts": adapter_dir.parent / "prompts.txt", "empty": adapter_dir.parent / "empty"}
    argv = [a.format(**paths) for a in args] + ["--model", "tiny:llama"]
    with pytest.raises(ConfigError, match=message) as info:
        main(argv)
    assert "\n" not in str(info.value)


def test_cli_generate_without_prompt_starts_from_bos(capsys):
    from steering.cli import main

    assert main(["generate", "--model", "tiny:llama", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.strip()


# ----------------------------------------------------------------------------------------------- EasyEdit2 inputs
def test_dataset_folder_with_several_method_folders_is_ambiguous(tmp_path):
    from peftplug.errors import CheckpointError

    sta = tmp_path / "sta" / "toxicity"
    for sub in ("sta_vector", "caa_vector", "feature_score"):
        (sta / sub).mkdir(parents=True)
    torch.save(torch.full((8,), 7.0), sta / "sta_vector" / "layer_1_act_and_freq_trim0.65.pt")
    torch.save(torch.ones(8), sta / "caa_vector" / "layer_1.pt")
    torch.save(torch.ones(16), sta / "feature_score" / "layer_1_feature_act.pt")
    with pytest.raises(ConfigError, match=r"several EasyEdit2 vector folders \(caa_vector, feature_score, sta_vector\)"):
        steering.import_easyedit(sta)
    assert torch.equal(steering.import_easyedit(sta / "caa_vector")[1], torch.ones(8))
    mixed = tmp_path / "mixed" / "toxicity"
    (mixed / "caa_vector").mkdir(parents=True)
    (mixed / "lm_steer_vector").mkdir()
    torch.save(torch.ones(8), mixed / "caa_vector" / "layer_1.pt")
    (mixed / "lm_steer_vector" / "lm_steer_vector.pt").write_bytes(b"never unpickled")
    with pytest.raises(ConfigError, match=r"\(caa_vector, lm_steer_vector\)"):
        steering.import_easyedit(mixed)
    with pytest.raises(CheckpointError, match="LM-Steer"):
        steering.import_easyedit(mixed / "lm_steer_vector")


GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{{ '<start_of_turn>' + message['role'] + '\n' + message['content'] | trim"
    " + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")


@pytest.mark.parametrize("name", ["google/gemma-2-2b-it", "google/codegemma-7b-it", "google/gemma-7b-it"])
def test_gemma_system_prompt_is_folded_into_the_user_message(name):
    from peftplug.tiny import char_tokenizer
    from steering.easyedit_data import build_model_input, caa_rows

    tok = char_tokenizer()
    tok.name_or_path, tok.chat_template = name, GEMMA_TEMPLATE
    want = tok.apply_chat_template([{"role": "user", "content": "Be positive. Is it good?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert build_model_input(" Is it good? ", tok, system_prompt="Be positive.", use_chat_template=True) == want
    rows = caa_rows(tok, [{"question": "Is it good?", "matching": "Yes", "not_matching": "No"}],
                    use_chat_template=True, system_prompt="Be positive.")
    assert len(rows) == 1
    # Other models keep a system message.
    tok.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    tok.chat_template = GEMMA_TEMPLATE.replace("{{ raise_exception('System role not supported') }}", "SYS")
    assert "SYS" in build_model_input("Is it good?", tok, system_prompt="Be positive.", use_chat_template=True)
