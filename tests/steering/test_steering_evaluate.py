"""steering.evaluate: EasyEdit2's metrics against hand computations, generation, perplexity under the unsteered
model, the instruction check, and the ``peftplug steering evaluate`` command."""

from __future__ import annotations

import json
import math

import pytest
import torch

import steering
from steering import evaluate as ev


def test_ngram_entropy_and_distinct_match_hand_computation():
    text = "the cat sat . the cat ran"
    words = ["the", "cat", "sat", ".", "the", "cat", "ran"]
    bigrams = [tuple(words[i:i + 2]) for i in range(6)]  # ("the","cat") twice, 4 others once
    h2 = -(2 / 6 * math.log2(2 / 6) + 4 * (1 / 6) * math.log2(1 / 6))
    h3 = math.log2(5)  # 5 distinct trigrams, once each
    assert len(set(bigrams)) == 5
    assert ev.ngram_entropy(text) == pytest.approx((2 / 3 * h2 + 4 / 3 * h3) / 2)
    assert ev.ngram_entropy("hello") == 0.0
    # distinct-n over whitespace words, divided by the word count (EasyEdit2), averaged over prompts.
    got = ev.distinct_n([["a b a b"], ["x y", "x z"]])
    assert got["distinct_1"] == pytest.approx((2 / 4 + 3 / 4) / 2)
    assert got["distinct_2"] == pytest.approx((2 / 4 + 2 / 4) / 2)
    assert got["distinct_3"] == pytest.approx((2 / 4 + 0 / 4) / 2)


def test_answer_matching_and_summaries():
    assert ev.answer_is_right("The capital of France is Paris.", ["paris"])
    assert not ev.answer_is_right("Parisian food", ["Paris"])
    assert ev.answer_is_right("It is 4.", ["four", "4"])
    assert ev.concept_summary([0.9, 0.2, 0.5, 0.1]) == {"concept_mean": pytest.approx(0.425), "positive_rate": 0.5}
    summary = ev.perplexity_summary([(2.0, 2), (math.log(1e5) * 3, 3), (float("nan"), 0)])
    assert summary["perplexity"] == pytest.approx(math.e)  # the 1e5 one is dropped, as in EasyEdit2
    assert summary["total_perplexity"] == pytest.approx(math.exp((2.0 + math.log(1e5) * 3) / 5))


def test_generation_is_batch_independent_and_nll_matches_the_loss(tiny_model, tokenizer):
    model = tiny_model("llama")
    tokenizer.pad_token = "<pad>"
    prompts = ev.chat_prompts(tokenizer, ["hi", "tell me a story about a cat"])
    assert prompts[0].endswith("<|im_start|>assistant\n")
    batched = ev.generate(model, tokenizer, prompts, max_new_tokens=6, batch_size=2)
    for i, p in enumerate(prompts):
        single = ev.generate(model, tokenizer, [p], max_new_tokens=6, batch_size=1)
        assert single.new_ids[0] == batched.new_ids[i]
    assert batched.new_tokens == 12 and batched.seconds > 0
    nll = ev.generation_nll(model, tokenizer, batched.prompt_ids, batched.new_ids)
    for (total, n), p_ids, g_ids in zip(nll, batched.prompt_ids, batched.new_ids):
        ids = torch.tensor([p_ids + g_ids])
        labels = ids.clone()
        labels[0, :len(p_ids)] = -100
        with torch.no_grad():
            loss = model(input_ids=ids, labels=labels).loss  # mean NLL over the generated tokens
        assert n == len(g_ids) and total / n == pytest.approx(float(loss), rel=1e-4)


def test_evaluate_steering_reports_metrics_with_unsteered_perplexity(tiny_model, tokenizer):
    model = tiny_model("llama")
    prompts = ev.chat_prompts(tokenizer, ["good day", "a film", "the weather"])
    base = ev.generate(model, tokenizer, prompts, max_new_tokens=8)
    pm = steering.steering_adapter(model, {1: torch.randn(64, generator=torch.Generator().manual_seed(0)) * 4})
    scorer = lambda texts: [t.count("e") / max(len(t), 1) for t in texts]
    # The unsteered answers' first characters are "right"; steering changes some of them.
    questions = prompts
    answers = [[t.split()[0]] if t.split() else ["\x00"] for t in base.texts]
    result = ev.evaluate_steering(pm, tokenizer, prompts, scorer, questions=questions, answers=answers,
                                  max_new_tokens=8)
    steered = ev.generate(pm, tokenizer, prompts, max_new_tokens=8)
    assert result["generations"] == steered.texts and steered.texts != base.texts
    with pm.disable_adapter():  # get_peft_model wrapped `model`'s blocks in place: disable them for the reference
        expected = ev.perplexity_summary(ev.generation_nll(model, tokenizer, steered.prompt_ids, steered.new_ids))
    assert result["perplexity"] == pytest.approx(expected["perplexity"])
    assert result["concept_mean"] == pytest.approx(sum(scorer(steered.texts)) / 3)
    assert result["instruction_base_accuracy"] == pytest.approx(sum(bool(t.split()) for t in base.texts) / 3)
    assert 0 <= result["instruction_kept"] <= 1
    for key in ("fluency", "distinct_1", "distinct_2", "distinct_3", "tokens_per_second", "total_perplexity"):
        assert math.isfinite(result[key]), key
    pm.base_model.set_multiplier(0.0)
    same = ev.evaluate_steering(pm, tokenizer, prompts, questions=questions, answers=answers, max_new_tokens=8)
    assert same["generations"] == base.texts and same["instruction_kept"] == 1.0
    json.dumps(result)  # JSON-ready


def test_prompt_baseline_conditions_perplexity_on_the_original_prompt(tiny_model, tokenizer):
    model = tiny_model("llama")
    plain = ev.chat_prompts(tokenizer, ["a film"])
    instructed = ev.chat_prompts(tokenizer, ["a film"], instruction="Be positive.")
    assert "Be positive. a film" in instructed[0]
    result = ev.evaluate_steering(model, tokenizer, instructed, reference_prompts=plain, max_new_tokens=6)
    gen = ev.generate(model, tokenizer, instructed, max_new_tokens=6)
    ref_ids = [tokenizer(plain[0], add_special_tokens=False)["input_ids"]]
    expected = ev.perplexity_summary(ev.generation_nll(model, tokenizer, ref_ids, gen.new_ids))
    assert result["perplexity"] == pytest.approx(expected["perplexity"])
    with pytest.raises(ValueError, match="reference prompts"):
        ev.evaluate_steering(model, tokenizer, instructed, reference_prompts=plain * 2, max_new_tokens=2)


def test_classifier_scorer(tiny_model, tokenizer):
    clf = tiny_model("bert", task="seq_cls", num_labels=2)
    score = ev.classifier_scorer(clf, tokenizer, positive_label=1)
    side, tokenizer.padding_side = tokenizer.padding_side, "left"  # as a generation tokenizer is set up
    try:
        got = score(["great film", "", "awful"])
    finally:
        tokenizer.padding_side = side
    with torch.no_grad():
        probs = torch.softmax(clf(**tokenizer(["awful"], return_tensors="pt")).logits, -1)[0, 1]
    assert len(got) == 3 and got[2] == pytest.approx(float(probs), rel=1e-5)
    with pytest.raises(ValueError, match="positive_label must be in 0..1"):
        ev.classifier_scorer(clf, tokenizer, positive_label=2)


def test_cli_evaluate(tiny_model, tokenizer, tmp_path, capsys):
    from peftplug.errors import DataError, MissingFileError
    from steering.cli import main

    pairs = tmp_path / "rows.jsonl"
    pairs.write_text("\n".join(json.dumps(r) for r in (
        {"question": "How was it?", "matching": "Great fun", "not_matching": "Awful bore"},
        {"question": "And the food?", "matching": "Tasty", "not_matching": "Bland"})) + "\n")
    assert main(["extract", "--model", "tiny:llama", "--pairs", str(pairs), "--layers", "1", "--use-chat-template",
                 "--out", str(tmp_path / "a"), "--quiet"]) == 0
    clf = tiny_model("bert", task="seq_cls", num_labels=2)
    clf.save_pretrained(tmp_path / "clf")
    tokenizer.save_pretrained(tmp_path / "clf")
    (tmp_path / "prompts.txt").write_text("Tell me about your day.\nWrite a review.\n")
    (tmp_path / "facts.jsonl").write_text(json.dumps({"question": "2+2?", "answers": ["4", "four"]}) + "\n")
    out = tmp_path / "eval.json"
    args = ["evaluate", "--model", "tiny:llama", "--adapter", f"{tmp_path / 'a'}:2", "--prompts",
            str(tmp_path / "prompts.txt"), "--scorer", str(tmp_path / "clf"), "--questions",
            str(tmp_path / "facts.jsonl"), "--max-new-tokens", "5", "--out", str(out)]
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert len(result["generations"]) == 2 and len(result["scores"]) == 2 and "perplexity" in result
    assert result["requests"] == ["Tell me about your day.", "Write a review."]
    assert "positive_rate" in capsys.readouterr().out
    assert main(args[:-2] + ["--instruction", "Be upbeat."]) == 0  # the prompt baseline
    with pytest.raises(MissingFileError, match="prompts file"):
        main(["evaluate", "--model", "tiny:llama", "--prompts", str(tmp_path / "none.txt")])
    (tmp_path / "bad.jsonl").write_text('{"q": 1}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: expected an object with question, answers"):
        main(["evaluate", "--model", "tiny:llama", "--prompts", str(tmp_path / "prompts.txt"), "--questions",
              str(tmp_path / "bad.jsonl")])
    with pytest.raises(MissingFileError, match="--scorer"):
        main(["evaluate", "--model", "tiny:llama", "--prompts", str(tmp_path / "prompts.txt"), "--scorer",
              str(tmp_path / "nope")])
