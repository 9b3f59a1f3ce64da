"""Second review of the steering adapter's PEFT conventions: positions against hand-written hooks, adapters added
after the last one was deleted, the CLI with adapters of another PEFT type, EasyEdit2 folders with odd entries."""

from __future__ import annotations

import peft
import pytest
import torch

import steering
from peftplug.errors import ConfigError, MissingFileError
from steering import SteeringConfig

PROMPTS = ["Once upon a time", "Hi", "The cat sat on"]
POLICIES = ("all", "prompt", "generated", "from_last_prompt")
NEW = 5


def _vectors() -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {0: 3 * torch.randn(64, generator=gen), 1: 3 * torch.randn(64, generator=gen)}


def _left_padded(tokenizer):
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        return tokenizer(PROMPTS, return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = side


def _hooked_greedy(model, batch, vectors, multipliers, policy) -> torch.Tensor:
    """Greedy decoding of a plain model, cache-free, with ``h + m v`` added by forward hooks on the blocks at the
    tokens ``policy`` selects, computed here from the padded prompt width ``P``: real tokens only; ``prompt`` =
    columns ``< P``, ``generated`` = ``>= P``, ``from_last_prompt`` = ``>= P - 1`` (left padding puts every row's
    last prompt token in column ``P - 1``)."""
    width = batch["input_ids"].shape[1]
    state = {}

    def hook_for(layer):
        def hook(module, args, out):
            hidden = out[0] if isinstance(out, tuple) else out
            pos = torch.arange(hidden.shape[1])[None, :]
            real = state["mask"].bool()
            sel = {"all": real, "prompt": real & (pos < width), "generated": real & (pos >= width),
                   "from_last_prompt": real & (pos >= width - 1)}[policy]
            hidden = hidden + sel[..., None].to(hidden.dtype) * (multipliers[layer] * vectors[layer])
            return (hidden, *out[1:]) if isinstance(out, tuple) else hidden
        return hook

    handles = [model.model.layers[layer].register_forward_hook(hook_for(layer)) for layer in vectors]
    ids, mask = batch["input_ids"], batch["attention_mask"]
    try:
        with torch.no_grad():
            for _ in range(NEW):
                state["mask"] = mask
                position_ids = (mask.cumsum(-1) - 1).clamp_min(0)  # what generate passes under left padding
                logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
                token = logits[:, -1].argmax(-1, keepdim=True)
                ids, mask = torch.cat([ids, token], 1), torch.cat([mask, torch.ones_like(token)], 1)
    finally:
        for handle in handles:
            handle.remove()
    return ids


@pytest.mark.parametrize("policy", POLICIES)
def test_left_padded_kv_cache_generation_steers_the_tokens_hooks_select(policy, tiny_model, tokenizer):
    batch = _left_padded(tokenizer)
    vectors = _vectors()
    want = _hooked_greedy(tiny_model("llama").eval(), batch, vectors, {0: 1.5, 1: -0.75}, policy)
    pm = steering.steering_adapter(tiny_model("llama").eval(), vectors, multiplier=1.5, layer_multipliers={1: -0.5},
                                   positions=policy)
    got = pm.generate(**batch, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)
    with pm.disable_adapter():
        unsteered = pm.generate(**batch, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert torch.equal(unsteered, _hooked_greedy(tiny_model("llama").eval(), batch, vectors, {0: 0.0, 1: 0.0}, policy))


@pytest.mark.parametrize("policy", ("generated", "prompt"))
def test_adapter_added_after_the_last_was_deleted_keeps_its_positions(policy, tiny_model, tokenizer):
    # delete_adapter of the last adapter removes the position bookkeeping; add_adapter/load_adapter must put it back,
    # or the new adapter steers every token (and reads masks of an earlier forward).
    batch = _left_padded(tokenizer)
    vectors = {1: _vectors()[1]}
    fresh = steering.steering_adapter(tiny_model("llama").eval(), vectors, positions=policy)
    want = fresh.generate(**batch, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    pm = steering.steering_adapter(tiny_model("llama").eval(), {0: torch.ones(64)}, adapter_name="old")
    pm.generate(**batch, max_new_tokens=2, do_sample=False, pad_token_id=0)
    pm.delete_adapter("old")
    pm.add_adapter("new", SteeringConfig(layers=[1], positions=policy))
    pm.set_adapter("new")
    pm.base_model.set_vectors(vectors, "new")
    assert torch.equal(pm.generate(**batch, max_new_tokens=NEW, do_sample=False, pad_token_id=0), want)


def test_load_adapter_after_the_last_was_deleted_keeps_its_positions(tiny_model, tokenizer, tmp_path):
    batch = _left_padded(tokenizer)
    fresh = steering.steering_adapter(tiny_model("llama").eval(), _vectors(), positions="generated")
    want = fresh.generate(**batch, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    fresh.save_pretrained(tmp_path / "adapter")
    pm = steering.steering_adapter(tiny_model("llama").eval(), {0: torch.ones(64)}, adapter_name="old")
    pm.generate(**batch, max_new_tokens=2, do_sample=False, pad_token_id=0)
    pm.delete_adapter("old")
    pm.load_adapter(tmp_path / "adapter", adapter_name="loaded")
    pm.set_adapter("loaded")
    assert torch.equal(pm.generate(**batch, max_new_tokens=NEW, do_sample=False, pad_token_id=0), want)


@pytest.fixture
def lora_dir(tiny_model, tmp_path):
    path = tmp_path / "lora"
    peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(target_modules=["q_proj"], task_type="CAUSAL_LM")
                        ).save_pretrained(path)
    return path


@pytest.mark.parametrize("args", [
    ["generate", "--adapter", "{lora}", "--prompt", "hi", "--max-new-tokens", "2"],
    ["generate", "--adapter", "{lora}:2", "--prompt", "hi", "--max-new-tokens", "2"],
    ["export-easyedit", "--adapter", "{lora}", "--out", "{out}"],
    ["export-gguf", "--adapter", "{lora}", "--out", "{out}/x.gguf"],
])
def test_cli_refuses_an_adapter_of_another_peft_type_in_one_line(args, lora_dir):
    from steering.cli import main

    paths = {"lora": lora_dir, "out": lora_dir.parent / "out"}
    argv = [a.format(**paths) for a in args] + ["--model", "tiny:llama"]
    with pytest.raises(ConfigError, match=r"holds a LORA adapter, not a steering adapter") as info:
        main(argv)
    assert "\n" not in str(info.value)


def test_folder_named_like_a_layer_file_is_not_read_as_one(tmp_path):
    (tmp_path / "only" / "layer_1.pt").mkdir(parents=True)
    with pytest.raises(MissingFileError, match="no layer_"):
        steering.import_easyedit(tmp_path / "only")
    mixed = tmp_path / "mixed"
    (mixed / "layer_2.pt").mkdir(parents=True)
    torch.save(torch.ones(64), mixed / "layer_1.pt")
    vectors = steering.import_easyedit(mixed, hidden_size=64)
    assert list(vectors) == [1] and torch.equal(vectors[1], torch.ones(64))


def _bos_tokenizer():
    """The tiny character tokenizer, made to prepend ``<s>`` as Llama's tokenizers do."""
    from tokenizers import processors

    from peftplug.tiny import char_tokenizer

    tokenizer = char_tokenizer()
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    assert tokenizer("hi")["input_ids"][0] == bos
    return tokenizer


def test_evaluate_with_special_tokens_generates_and_scores_what_generate_sees(tiny_model):
    from steering import evaluate as ev

    tokenizer = _bos_tokenizer()
    pm = steering.steering_adapter(tiny_model("llama").eval(), _vectors(), multiplier=0.5)
    prompts = ["Once upon a time", "Hi"]
    out = ev.generate(pm, tokenizer, prompts, max_new_tokens=NEW, add_special_tokens=True)
    for prompt, prompt_ids, new_ids in zip(prompts, out.prompt_ids, out.new_ids):
        ids = tokenizer([prompt], return_tensors="pt")["input_ids"]
        assert prompt_ids == ids[0].tolist()  # with the BOS
        want = pm.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
        stop = next((i for i, t in enumerate(want.tolist()) if t in (0, tokenizer.eos_token_id)), len(want))
        assert new_ids == want[:stop].tolist()
    result = ev.evaluate_steering(pm, tokenizer, prompts, max_new_tokens=NEW, reference_prompts=prompts,
                                  add_special_tokens=True)
    nll = ev.generation_nll(pm, tokenizer, out.prompt_ids, out.new_ids)
    assert result["total_perplexity"] == pytest.approx(ev.perplexity_summary(nll)["total_perplexity"])


def test_cli_evaluate_raw_prompts_generates_as_the_generate_command(data_dir, tmp_path, capsys):
    # stories260K's tokenizer prepends BOS, which its model was trained with: `evaluate --raw-prompts` must encode
    # the prompts as `generate` does (and EasyEdit2: add_special_tokens=not use_chat_template).
    import json

    from steering.cli import main

    prompts = ["Once upon a time", "Lily was"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    argv = ["--model", f"stories260k:{data_dir}", "--max-new-tokens", "8"]
    assert main(["generate", *argv, *[a for p in prompts for a in ("--prompt", p)]]) == 0
    generated = capsys.readouterr().out.strip().splitlines()
    assert main(["evaluate", *argv, "--prompts", str(tmp_path / "prompts.txt"), "--raw-prompts",
                 "--out", str(tmp_path / "eval.json")]) == 0
    result = json.loads((tmp_path / "eval.json").read_text())
    # Decoded alone, a continuation loses the word-boundary space sentencepiece puts on its first token.
    assert [(p + g).replace(" ", "") for p, g in zip(prompts, result["generations"])] == [
        g.replace(" ", "") for g in generated]
