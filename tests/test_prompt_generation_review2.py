"""Second review of :func:`peftplug.prompt_generation.generate_new_tokens`: against a reference computed here (greedy
argmax of the PEFT model's full, cache-free forward of each unpadded row with the tokens so far), for every
prompt-learning kind PEFT has (prompt tuning, p-tuning, prefix tuning, CARTRIDGE, CPT, multitask prompt tuning) and
PCT, on a rotary (Llama) and an absolute-position (GPT-2) model, in a left-padded batch of rows of different lengths;
also EOS per row, sampling, the cache switched off, several adapters, and the refusal of encoder-decoder models."""

from __future__ import annotations

import warnings

import peft
import pytest
import torch

from peftplug.prompt_generation import generate_new_tokens
from peftplug.tiny import tiny_model

V = 4  # virtual tokens
PROMPTS = [[5, 17, 23, 40, 41, 9, 12, 33], [7, 8], [30, 31, 32, 60, 61]]  # left padding of two rows out of three
STEPS = 6
KINDS = ["prompt_tuning", "p_tuning", "prefix_tuning", "pct", "cartridge", "cpt", "multitask"]


def _config(kind: str, tmp_path, hidden: int):
    if kind == "prompt_tuning":
        return peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=V)
    if kind == "p_tuning":
        return peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=V, encoder_hidden_size=32)
    if kind == "prefix_tuning":
        return peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=V)
    if kind == "cartridge":
        return peft.CartridgeConfig(task_type="CAUSAL_LM", num_virtual_tokens=V)
    if kind == "cpt":
        return peft.CPTConfig(task_type="CAUSAL_LM", cpt_token_ids=[10, 11, 12, 13], cpt_mask=[1] * 4,
                              cpt_tokens_type_mask=[1, 2, 2, 3])
    if kind == "multitask":
        return peft.MultitaskPromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=V, num_tasks=2)
    import prompt_transfer as pt

    g = torch.Generator().manual_seed(0)
    dec = pt.decompose({f"s{i}": torch.randn(V, hidden, generator=g) for i in range(3)}, contrastive_steps=5)
    pt.save_decomposition(dec, str(tmp_path / "dec"))
    return pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=str(tmp_path / "dec"))


def _model(kind: str, tmp_path, family: str = "llama", **overrides):
    """A tiny PEFT model whose adapter is far from its initialisation (a trained-looking one)."""
    # GPT-2 at its default init repeats the last token whatever comes before: no test of positions or prefixes.
    base = tiny_model(family, **({"initializer_range": 0.2} if family == "gpt2" else {}), **overrides)
    with torch.random.fork_rng(devices=[]):  # PEFT initialises some prompt encoders from the global RNG
        torch.manual_seed(0)
        model = peft.get_peft_model(base, _config(kind, tmp_path, base.config.hidden_size))
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            if not p.requires_grad:
                continue
            if kind in ("prefix_tuning", "cartridge"):  # keys and values of N(0, 1) drown the text's: small ones
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            else:
                p.add_(torch.randn(p.shape, generator=g) * 0.5)
    return model.eval()


def _reference(model, ids: list[int], steps: int = STEPS, eos: int | None = None, **forward) -> list[int]:
    """Greedy tokens of the unpadded row: the PEFT model's full forward, no cache, argmax of the last position."""
    out: list[int] = []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps):
            out.append(int(model(input_ids=torch.tensor([ids + out]), use_cache=False, **forward).logits[0, -1].argmax()))
            if out[-1] == eos:
                break
    return out


def _batch(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def _generate(model, prompts, **kwargs) -> list[list[int]]:
    ids, mask = _batch(prompts)
    settings = {"max_new_tokens": STEPS, "do_sample": False, "pad_token_id": 0, "eos_token_id": None, **kwargs}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return generate_new_tokens(model, ids, mask, **settings).tolist()


def _task_ids(kind: str, rows: int) -> dict:
    # Multitask prompt tuning needs a task per row; different ones, so a mix-up of rows would show.
    return {"task_ids": torch.arange(rows) % 2} if kind == "multitask" else {}


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_are_the_cache_free_forwards_of_each_row_alone(kind, family, tmp_path):
    model = _model(kind, tmp_path, family)
    tasks = _task_ids(kind, len(PROMPTS))
    expected = [_reference(model, p, **({"task_ids": tasks["task_ids"][i:i + 1]} if tasks else {}))
                for i, p in enumerate(PROMPTS)]
    with model.disable_adapter():
        base = [_reference(model, p) for p in PROMPTS]
    assert base != expected, "the adapter does not change the answers; the test would not see it dropped"
    assert _generate(model, PROMPTS, **tasks) == expected
    for i, p in enumerate(PROMPTS):  # the padded rows give what each row gives alone
        one = {"task_ids": tasks["task_ids"][i:i + 1]} if tasks else {}
        assert _generate(model, [p], **one) == [expected[i]]


@pytest.mark.parametrize("kind", ["prompt_tuning", "prefix_tuning", "cartridge", "pct"])
@pytest.mark.parametrize("where", ["argument", "checkpoint_config"])
def test_generation_without_the_cache_gives_the_same_tokens(kind, where, tmp_path):
    # use_cache=False, passed or from a checkpoint's config (its generation config inherits it): a prefix's stand-in
    # ids were read as text at every later step.
    model = _model(kind, tmp_path, **({"use_cache": False} if where == "checkpoint_config" else {}))
    assert model.get_base_model().generation_config.use_cache is (where != "checkpoint_config")
    expected = [_reference(model, p) for p in PROMPTS]
    assert _generate(model, PROMPTS, **({"use_cache": False} if where == "argument" else {})) == expected
    assert _generate(model, PROMPTS, use_cache=True) == expected


@pytest.mark.parametrize("kind", ["prompt_tuning", "prefix_tuning", "pct"])
def test_a_row_that_reaches_eos_pads_while_the_others_go_on(kind, tmp_path):
    model = _model(kind, tmp_path)
    steps = 8
    full = [_reference(model, p, steps) for p in PROMPTS]
    # The middle row ends early, at a token some other row never makes (so that row goes on).
    eos = next(t for i, t in enumerate(full[1][1:-2], 1) if t not in full[1][:i] and any(t not in r for r in full))
    cut = [row[:row.index(eos) + 1] if eos in row else row for row in full]
    got = _generate(model, PROMPTS, max_new_tokens=steps, eos_token_id=[eos, 999])
    assert len(got[0]) == max(map(len, cut))
    assert got == [row + [0] * (len(got[0]) - len(row)) for row in cut]
    short = _generate(model, PROMPTS, max_new_tokens=3)
    assert short == [row[:3] for row in full]


@pytest.mark.parametrize("kind", ["prompt_tuning", "prefix_tuning", "pct"])
def test_sampling_is_reproducible_under_a_seed_and_tends_to_greedy_when_cold(kind, tmp_path):
    model = _model(kind, tmp_path)
    runs = {}
    for seed in (3, 3, 4):
        torch.manual_seed(seed)
        runs.setdefault(seed, []).append(_generate(model, PROMPTS, do_sample=True, temperature=1.0, top_k=0))
    assert runs[3][0] == runs[3][1] and runs[3][0] != runs[4][0]
    # Sampling draws from the same logits as greedy decoding: nearly cold, it picks the argmax.
    torch.manual_seed(0)
    assert _generate(model, PROMPTS, do_sample=True, temperature=1e-4) == [_reference(model, p) for p in PROMPTS]


@pytest.mark.parametrize("kind", ["prompt_tuning", "prefix_tuning"])
def test_several_sequences_and_beams_get_a_prefix_each(kind, tmp_path):
    model = _model(kind, tmp_path)
    torch.manual_seed(0)
    assert torch.tensor(_generate(model, PROMPTS, do_sample=True, num_return_sequences=2)).shape == (6, STEPS)
    beams = _generate(model, PROMPTS, num_beams=3)
    assert [b[:1] for b in beams] != [[0]] * 3 and len(beams) == 3


def test_the_active_adapter_decides_and_a_disabled_one_gives_the_base_models_tokens(tmp_path):
    model = _model("prompt_tuning", tmp_path)
    model.add_adapter("other", peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=V + 3))
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for name, p in model.named_parameters():
            if ".other." in name:
                p.add_(torch.randn(p.shape, generator=g))
    answers = {}
    for name in ("default", "other", "default"):
        model.set_adapter(name)
        answers[name] = _generate(model, PROMPTS)
        assert answers[name] == [_reference(model, p) for p in PROMPTS], name
    assert answers["default"] != answers["other"]
    with model.disable_adapter():
        assert _generate(model, PROMPTS) == [_reference(model.get_base_model(), p) for p in PROMPTS]


@pytest.mark.parametrize("adapter", [None, "lora"])
def test_without_a_prompt_learning_adapter_it_is_plain_generate(adapter):
    model = tiny_model("llama")
    if adapter:
        model = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", target_modules="all-linear",
                                                           init_lora_weights=False)).eval()
    ids, mask = _batch(PROMPTS)
    with torch.no_grad():
        plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=False,
                               pad_token_id=0, eos_token_id=None)[:, ids.shape[1]:]
    assert _generate(model, PROMPTS) == plain.tolist() == [_reference(model, p) for p in PROMPTS]


@pytest.mark.parametrize("adapter", [None, "prompt_tuning"])
def test_an_encoder_decoder_model_is_refused(adapter):
    # Its generate returns decoder tokens: slicing the prompt's length off them gave an empty answer, silently.
    model = tiny_model("t5", "seq2seq")
    if adapter:
        model = peft.get_peft_model(model, peft.PromptTuningConfig(task_type="SEQ_2_SEQ_LM", num_virtual_tokens=V))
    with pytest.raises(ValueError, match="needs a decoder-only causal LM; T5ForConditionalGeneration is an "
                                         "encoder-decoder model"):
        _generate(model, PROMPTS)
