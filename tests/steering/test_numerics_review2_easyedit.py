"""Second numerics review: EasyEdit2's system-prompt rule, TIES with negative weights, the concept scorer's
probabilities and batched generation with a tokenizer that has no pad token, each against a reference computed
here."""

from __future__ import annotations

import pytest
import torch

import steering
from steering import evaluate as ev
from steering.easyedit_data import build_model_input, caa_rows
from steering.merge import merge_vectors

# A template that refuses a system role (Gemma-1/2) and one that accepts it and merges it into the first user turn
# (Gemma-3). EasyEdit2 (steer/utils/templates.py, safe_apply_chat_template) tries the system role and folds it into
# the user message as f"{system} {user}" only when the template raises; the model's name plays no part.
REFUSING = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
MERGING = (
    "{% if messages[0]['role'] == 'system' %}{% set p = messages[0]['content'] + '\n\n' %}{% set ms = messages[1:] %}"
    "{% else %}{% set p = '' %}{% set ms = messages %}{% endif %}{% for m in ms %}<start_of_turn>{{ m['role'] }}\n"
    "{{ (p if loop.first else '') + m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def _easyedit_build(tokenizer, user, system):
    """EasyEdit2's build_model_input with use_chat_template=True, written out."""
    kw = {"tokenize": False, "add_generation_prompt": True}
    try:
        return tokenizer.apply_chat_template([{"role": "system", "content": system},
                                              {"role": "user", "content": user.strip()}], **kw)
    except Exception:  # noqa: BLE001 - the template refused the system role
        return tokenizer.apply_chat_template([{"role": "user", "content": f"{system} {user.strip()}"}], **kw)


@pytest.mark.parametrize(("name", "template", "want"), [
    ("/checkpoints/my-finetune", REFUSING, "<start_of_turn>user\nBe kind. Is it good?<end_of_turn>\n"),
    ("google/gemma-3-1b-it", MERGING, "<start_of_turn>user\nBe kind.\n\nIs it good?<end_of_turn>\n"),
])
def test_system_prompt_follows_the_template_not_the_model_name(name, template, want, tiny_model):
    from peftplug.tiny import char_tokenizer

    tok = char_tokenizer()
    tok.name_or_path, tok.chat_template = name, template
    ref = _easyedit_build(tok, " Is it good? ", "Be kind.")
    assert ref == want + "<start_of_turn>model\n"
    assert build_model_input(" Is it good? ", tok, "Be kind.", use_chat_template=True) == ref
    rows = [{"question": "Is it good?", "matching": "Yes", "not_matching": "No"}]
    pairs = caa_rows(tok, rows, use_chat_template=True, system_prompt="Be kind.")
    assert pairs.texts == [(ref + " Yes", ref + " No")]
    assert pairs.pos_start == [len(tok(ref, add_special_tokens=False)["input_ids"])]
    # The prompt baseline's chat prompts follow the same rule.
    assert ev.chat_prompts(tok, ["Is it good?"], system_prompt="Be kind.") == [ref]


def test_ties_with_a_negative_weight_merges_the_negated_vector():
    a = torch.tensor([1.0, 1.0, -1.0, 0.5, 2.0])
    b = torch.tensor([-2.0, 0.5, -3.0, 0.5, -1.0])
    # Contributions a and -b; per entry the sign of their sum is elected and the agreeing ones are averaged.
    contrib = torch.stack([a, -b])
    sign = torch.where(contrib.sum(0) >= 0, 1.0, -1.0)
    agree = contrib.sign() == sign
    want = (contrib * agree).sum(0) / agree.sum(0).clamp(min=1)
    torch.testing.assert_close(want, torch.tensor([1.5, 1.0, 3.0, 0.5, 1.5]))
    for kind in ("ties", "dare_ties"):
        torch.testing.assert_close(merge_vectors([a, b], [1.0, -1.0], kind, density=1.0), want)
        torch.testing.assert_close(merge_vectors([a, b], [2.0, -0.5], kind, density=1.0),
                                   merge_vectors([a, -b], [2.0, 0.5], kind, density=1.0))


def test_weighted_adapter_ties_subtracting_an_adapter(tiny_model):
    torch.manual_seed(0)
    a, b = torch.randn(64), torch.randn(64)
    pm = steering.steering_adapter(tiny_model("llama"), {1: a}, multiplier=2.0, adapter_name="x")
    pm = steering.steering_adapter(pm, {1: b}, adapter_name="y")
    pm.base_model.add_weighted_adapter(["x", "y"], [1.0, -1.0], "mix", combination_type="ties")
    contrib = torch.stack([2.0 * a, -b])
    sign = torch.where(contrib.sum(0) >= 0, 1.0, -1.0)
    agree = contrib.sign() == sign
    want = (contrib * agree).sum(0) / agree.sum(0).clamp(min=1)
    torch.testing.assert_close(pm.base_model.get_vectors("mix")[1], want)


def _logits(clf, tok, texts):
    with torch.no_grad():
        return torch.cat([clf(**tok([t], return_tensors="pt")).logits.float() for t in texts])


def test_classifier_scorer_probabilities_match_the_head(tiny_model, tokenizer):
    texts = ["good", "a bad movie", "x"]
    two = tiny_model("llama", task="seq_cls", num_labels=2)
    torch.testing.assert_close(torch.tensor(ev.classifier_scorer(two, tokenizer, positive_label=1)(texts)),
                               torch.softmax(_logits(two, tokenizer, texts), -1)[:, 1], rtol=1e-5, atol=1e-6)
    # One logit: a binary classifier's logit (a softmax over one class is 1.0 for every text).
    one = tiny_model("llama", task="seq_cls", num_labels=1)
    torch.testing.assert_close(torch.tensor(ev.classifier_scorer(one, tokenizer, positive_label=0)(texts)),
                               torch.sigmoid(_logits(one, tokenizer, texts))[:, 0], rtol=1e-5, atol=1e-6)
    # Multi-label (e.g. kinds of toxicity): labels are not exclusive, each is its own sigmoid.
    multi = tiny_model("llama", task="seq_cls", num_labels=3, problem_type="multi_label_classification")
    torch.testing.assert_close(torch.tensor(ev.classifier_scorer(multi, tokenizer, positive_label=2)(texts)),
                               torch.sigmoid(_logits(multi, tokenizer, texts))[:, 2], rtol=1e-5, atol=1e-6)


def test_generate_without_a_pad_token_equals_one_by_one(tiny_model):
    from peftplug.tiny import char_tokenizer

    tok = char_tokenizer()
    tok.pad_token = None  # as Llama's and GPT-2's tokenizers ship
    model = tiny_model("llama")
    prompts = ["Once", "A much longer prompt"]
    got = ev.generate(model, tok, prompts, max_new_tokens=5, batch_size=2)
    assert tok.pad_token is None and tok.padding_side == "right"
    for prompt, ids, new in zip(prompts, got.prompt_ids, got.new_ids):
        ref_prompt = tok(prompt, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([ref_prompt]), max_new_tokens=5, do_sample=False,
                                 pad_token_id=tok.eos_token_id)[0, len(ref_prompt):].tolist()
        cut = next((i for i, t in enumerate(out) if t == tok.eos_token_id), len(out))
        assert ids == ref_prompt
        assert new == out[:cut]
