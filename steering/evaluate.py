"""Judging steering by its generations, with EasyEdit2's metrics (``steer/evaluate/evaluate.py``).

For one steered setting, :func:`evaluate_steering` generates from held-out prompts (greedy or seeded sampling)
and reports

- **concept score**: a scorer the caller passes in (``texts -> P(concept)`` per text; e.g. a sentiment
  classifier from :func:`classifier_scorer`): the mean probability and the *positive rate* (share >= 0.5), as
  EasyEdit2's ``sentiment`` metric counts a classifier's labels. The generation alone is scored (EasyEdit2 scores
  ``prompt + generation``; here the prompt is a chat template around a neutral request and would only add noise);
- **perplexity** of each generation under the *unsteered* model, conditioned on the *original* prompt: the mean
  of the per-generation perplexities below 10^4 (EasyEdit2's ``ppl``) and the pooled ``exp(total NLL / tokens)``.
  Computed on the generated token ids (EasyEdit2 re-tokenizes ``prompt + text``; same thing without the
  re-tokenization drift);
- **fluency**: EasyEdit2's n-gram entropy, ``mean(2/3 H_2, 4/3 H_3)`` in bits over word n-grams of each text,
  averaged over texts (words by a regex ``\\w+|[^\\w\\s]``, standing in for NLTK's ``word_tokenize``);
- **distinct-1/2/3**: per prompt, unique n-grams of its generations over their total word count
  (whitespace words), averaged over prompts (EasyEdit2's ``distinctness``);
- **instruction following**: short factual questions whose *unsteered* answer is right; the fraction that stays
  right under steering (:func:`instruction_kept`).

``steering`` imports no trainer: the scorer is an argument, however it was trained.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from steering.easyedit_data import apply_chat_template_with_system
from steering.padding import pad_sequences, pad_token_id

Scorer = Callable[[list[str]], Sequence[float]]
_WORD = re.compile(r"\w+|[^\w\s]")


# --------------------------------------------------------------------------------------------- prompts
def chat_prompts(tokenizer, requests: Sequence[str], system_prompt: str | None = None,
                 instruction: str | None = None) -> list[str]:
    """Chat-formatted prompts (generation prompt added) for user requests.

    Args:
        tokenizer: A tokenizer with a chat template.
        requests: The user messages.
        system_prompt: Optional system message (SmolLM2's template adds a default one when none is given); where
            the template refuses a system role (Gemma) it prefixes the user message, as EasyEdit2 does.
        instruction: A steering instruction prepended to each user message as ``f"{instruction} {request}"``:
            EasyEdit2's *prompt* baseline.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("chat_prompts needs a tokenizer with a chat template")
    out = []
    for request in requests:
        content = f"{instruction} {request.strip()}" if instruction else request.strip()
        out.append(apply_chat_template_with_system(tokenizer, [{"role": "user", "content": content}], system_prompt,
                                                   tokenize=False, add_generation_prompt=True))
    return out


@contextlib.contextmanager
def unsteered(model):
    """The model with its adapters disabled (a ``PeftModel``), or as it is (a plain model).

    Args:
        model: A transformers model or a ``PeftModel``.
    """
    disable = getattr(model, "disable_adapter", None)
    with disable() if callable(disable) else contextlib.nullcontext():
        yield model


# --------------------------------------------------------------------------------------------- generation
@dataclass
class Generations:
    """Generated continuations of a list of prompts.

    Args:
        prompts: The prompt texts.
        prompt_ids: Token ids of each prompt (unpadded).
        new_ids: Generated token ids of each prompt, cut before the first end-of-sequence token.
        texts: ``new_ids`` decoded (special tokens skipped).
        seconds: Wall time of the generate calls.
        new_tokens: Tokens generated, padding after an early stop included (what the model computed).
    """

    prompts: list[str]
    prompt_ids: list[list[int]]
    new_ids: list[list[int]]
    texts: list[str]
    seconds: float = 0.0
    new_tokens: int = 0
    extra: dict = field(default_factory=dict)


def _stop_ids(tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    if tokenizer.pad_token_id is not None:
        ids.add(tokenizer.pad_token_id)
    return ids


def generate(
    model, tokenizer, prompts: Sequence[str], max_new_tokens: int = 40, batch_size: int = 20,
    do_sample: bool = False, seed: int = 0, temperature: float = 1.0, top_p: float = 1.0,
    add_special_tokens: bool = False,
) -> Generations:
    """Generates from each prompt (left-padded batches, KV cache), greedy or seeded sampling.

    Args:
        model: A causal LM or a ``PeftModel`` with steering adapters (as it is: active adapters steer).
        tokenizer: Its tokenizer (prompts are left-padded with its pad token, or its EOS token where it has none,
            as Llama-family tokenizers; the tokenizer is not changed).
        prompts: Prompt texts (chat-formatted, encoded without extra special tokens, unless
            ``add_special_tokens``).
        max_new_tokens: Tokens to generate per prompt (fewer when the model ends its answer).
        batch_size: Prompts per ``generate`` call.
        do_sample: Sample instead of greedy decoding.
        seed: Seed of the sampling, reset per batch (``seed + batch index``), so a setting's samples do not
            depend on what ran before it.
        temperature: Sampling temperature.
        top_p: Nucleus sampling mass.
        add_special_tokens: Encode the prompts with the tokenizer's special tokens (e.g. BOS): for raw prompts
            without a chat template, as EasyEdit2 encodes them (``add_special_tokens=not use_chat_template``).
    """
    if not prompts:
        raise ValueError("prompts is empty")
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"max_new_tokens and batch_size must be >= 1, got {max_new_tokens}, {batch_size}")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stops = _stop_ids(tokenizer)
    out = Generations(list(prompts), [], [], [])
    kwargs = {"max_new_tokens": max_new_tokens, "do_sample": do_sample, "pad_token_id": pad_id}
    if do_sample:
        kwargs.update(temperature=temperature, top_p=top_p)
    else:  # silence the sampling defaults of the model's generation config
        kwargs.update(temperature=None, top_p=None, top_k=None)
    ref = next(model.parameters(), None)
    device = ref.device if ref is not None else torch.device("cpu")
    was_training = model.training
    model.eval()
    try:
        for b, lo in enumerate(range(0, len(prompts), batch_size)):
            chunk = list(prompts[lo:lo + batch_size])
            # Padded here, not by the tokenizer: that refuses to pad without a pad token (Llama, GPT-2 tokenizers).
            seqs = tokenizer(chunk, add_special_tokens=add_special_tokens)["input_ids"]
            ids, mask = pad_sequences(seqs, pad_token_id(tokenizer), left=True)
            batch, width = {"input_ids": ids, "attention_mask": mask}, ids.shape[1]
            if do_sample:
                torch.manual_seed(seed + b)
            start = time.perf_counter()
            with torch.inference_mode():
                # Inputs on the model's device; the ids come back to the CPU inside the timed span (a sync on CUDA).
                ids = model.generate(**{k: v.to(device) for k, v in batch.items()}, **kwargs).cpu()
            out.seconds += time.perf_counter() - start
            out.new_tokens += (ids.shape[1] - width) * ids.shape[0]
            for row, mask in zip(ids, batch["attention_mask"]):
                out.prompt_ids.append(row[:width][mask.bool()].tolist())
                new = row[width:].tolist()
                cut = next((i for i, t in enumerate(new) if t in stops), len(new))
                out.new_ids.append(new[:cut])
                out.texts.append(tokenizer.decode(new[:cut], skip_special_tokens=True))
    finally:
        model.train(was_training)
    return out


# --------------------------------------------------------------------------------------------- metrics
def generation_nll(
    model, tokenizer, prompt_ids: Sequence[Sequence[int]], new_ids: Sequence[Sequence[int]], batch_size: int = 20,
) -> list[tuple[float, int]]:
    """Per generation, the summed NLL (nats) of its tokens after its prompt and the token count, unsteered.

    Args:
        model: The model (its adapters are disabled for the computation).
        tokenizer: Its tokenizer (for the padding id).
        prompt_ids: Token ids of the conditioning prompts.
        new_ids: Token ids of the generations (an empty one gives ``(nan, 0)``).
        batch_size: Sequences per forward.
    """
    if len(prompt_ids) != len(new_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(new_ids)} generations")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ref = next(model.parameters())
    out: list[tuple[float, int]] = []
    with unsteered(model), torch.inference_mode():
        for lo in range(0, len(new_ids), batch_size):
            seqs = [list(p) + list(g) for p, g in zip(prompt_ids[lo:lo + batch_size], new_ids[lo:lo + batch_size])]
            ids, mask = pad_sequences(seqs, pad_id)  # right padding: every real token keeps its unpadded position
            logits = model(input_ids=ids.to(ref.device), attention_mask=mask.to(ref.device), use_cache=False).logits
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            token_lp = logp.gather(-1, ids[:, 1:, None].to(ref.device))[..., 0].cpu()
            for i, (p, g) in enumerate(zip(prompt_ids[lo:lo + batch_size], new_ids[lo:lo + batch_size])):
                n = len(g)
                if n == 0 or len(p) == 0:
                    out.append((float("nan"), 0))
                    continue
                # Token t of the sequence is predicted at position t - 1.
                out.append((-float(token_lp[i, len(p) - 1:len(p) - 1 + n].sum()), n))
    return out


def perplexity_summary(nll: Sequence[tuple[float, int]]) -> dict[str, float]:
    """EasyEdit2's two perplexities from :func:`generation_nll`.

    Args:
        nll: ``(summed NLL, token count)`` per generation.

    Returns:
        ``{"perplexity": mean of the per-generation perplexities below 1e4, "total_perplexity":
        exp(total NLL / total tokens)}``.
    """
    ppls = [math.exp(s / n) for s, n in nll if n > 0]
    kept = [p for p in ppls if p < 1e4]
    total_n = sum(n for _, n in nll if n > 0)
    total = math.exp(sum(s for s, n in nll if n > 0) / total_n) if total_n else float("nan")
    return {"perplexity": sum(kept) / len(kept) if kept else float("nan"), "total_perplexity": total}


def ngram_entropy(text: str, ns: Sequence[int] = (2, 3), weights: Sequence[float] = (2 / 3, 4 / 3)) -> float:
    """EasyEdit2's (ROME's) n-gram entropy of one text: the mean over ``n`` of ``weight_n * H_n`` (bits).

    Args:
        text: The text.
        ns: n-gram orders.
        weights: One weight per order.
    """
    words = _WORD.findall(text)
    values = []
    for n, w in zip(ns, weights):
        counts = Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
        total = sum(counts.values())
        h = -sum(c / total * math.log2(c / total) for c in counts.values()) if total else 0.0
        values.append(w * h)
    return sum(values) / len(values)


def distinct_n(groups: Sequence[Sequence[str]]) -> dict[str, float]:
    """EasyEdit2's distinct-1/2/3: per prompt (group of generations), unique n-grams / total words, averaged.

    Args:
        groups: Per prompt, its generations (one each for a single response).
    """
    dist = {1: [], 2: [], 3: []}
    for texts in groups:
        total = 0
        grams = {1: set(), 2: set(), 3: set()}
        for text in texts:
            words = text.split()
            total += len(words)
            for n, seen in grams.items():
                seen.update(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
        for n, values in dist.items():
            values.append(len(grams[n]) / total if total else 0.0)
    return {f"distinct_{n}": sum(v) / len(v) if v else float("nan") for n, v in dist.items()}


def answer_is_right(answer: str, accepted: Sequence[str]) -> bool:
    """Whether any accepted answer occurs in ``answer`` as a whole word or phrase (case-insensitive).

    Args:
        answer: The model's answer.
        accepted: Accepted answers (e.g. ``["Paris"]``, ``["4", "four"]``).
    """
    text = answer.lower()
    return any(re.search(rf"(?<!\w){re.escape(a.lower())}(?!\w)", text) for a in accepted)


def instruction_kept(
    model, tokenizer, prompts: Sequence[str], answers: Sequence[Sequence[str]], baseline: Sequence[bool] | None = None,
    steered_prompts: Sequence[str] | None = None, max_new_tokens: int = 24, batch_size: int = 20,
    add_special_tokens: bool = False,
) -> dict:
    """Instruction following under steering: of the questions answered right *unsteered*, the share still right.

    Args:
        model: The steered model (a ``PeftModel``; unsteered answers come with its adapters disabled).
        tokenizer: Its tokenizer.
        prompts: Chat-formatted factual questions.
        answers: Per question, the accepted answers.
        baseline: Per question, whether the unsteered answer was right (computed when ``None``).
        steered_prompts: The prompts the steered model sees (default ``prompts``; the prompt baseline prepends
            its instruction).
        max_new_tokens: Answer length.
        batch_size: Prompts per generate call.
        add_special_tokens: Encode the prompts with the tokenizer's special tokens (raw, non-chat prompts).

    Returns:
        ``{"kept", "base_correct", "base_accuracy", "steered_accuracy", "baseline", "answers"}``.
    """
    if len(prompts) != len(answers):
        raise ValueError(f"{len(prompts)} questions but {len(answers)} answer lists")
    if baseline is None:
        with unsteered(model):
            base = generate(model, tokenizer, prompts, max_new_tokens, batch_size,
                            add_special_tokens=add_special_tokens)
        baseline = [answer_is_right(t, a) for t, a in zip(base.texts, answers)]
    steered = generate(model, tokenizer, steered_prompts or prompts, max_new_tokens, batch_size,
                       add_special_tokens=add_special_tokens)
    right = [answer_is_right(t, a) for t, a in zip(steered.texts, answers)]
    n_base = sum(baseline)
    kept = sum(r for r, b in zip(right, baseline) if b)
    return {
        "kept": kept / n_base if n_base else float("nan"), "base_correct": n_base,
        "base_accuracy": n_base / len(prompts), "steered_accuracy": sum(right) / len(prompts),
        "baseline": list(baseline), "answers": steered.texts,
    }


def concept_summary(scores: Sequence[float]) -> dict[str, float]:
    """Mean concept probability and positive rate (share of texts scored >= 0.5).

    Args:
        scores: Per text, the scorer's probability of the concept.
    """
    scores = [float(s) for s in scores]
    if not scores:
        return {"concept_mean": float("nan"), "positive_rate": float("nan")}
    return {"concept_mean": sum(scores) / len(scores), "positive_rate": sum(s >= 0.5 for s in scores) / len(scores)}


def evaluate_steering(
    model, tokenizer, prompts: Sequence[str], scorer: Scorer | None = None,
    reference_prompts: Sequence[str] | None = None, questions: Sequence[str] | None = None,
    answers: Sequence[Sequence[str]] | None = None, question_baseline: Sequence[bool] | None = None,
    steered_questions: Sequence[str] | None = None, max_new_tokens: int = 40, batch_size: int = 20,
    do_sample: bool = False, seed: int = 0, temperature: float = 1.0, top_p: float = 1.0,
    add_special_tokens: bool = False,
) -> dict:
    """Generates with ``model`` as it is (steered) and scores the generations with EasyEdit2's metrics.

    Args:
        model: The steered model (a ``PeftModel`` with active steering adapters, or a plain model for the
            unsteered or prompt-baseline rows).
        tokenizer: Its tokenizer.
        prompts: The held-out prompts the model generates from (chat-formatted).
        scorer: ``texts -> P(concept)`` per text (e.g. :func:`classifier_scorer`); skipped when ``None``.
        reference_prompts: The prompts perplexity is conditioned on (default ``prompts``; the prompt baseline
            passes the prompts without its instruction, so perplexities compare across methods).
        questions: Chat-formatted factual questions for :func:`instruction_kept` (optional).
        answers: Their accepted answers.
        question_baseline: Their unsteered correctness, if known (saves generating it again).
        steered_questions: The question prompts the steered model sees (default ``questions``).
        max_new_tokens: Tokens generated per prompt.
        batch_size: Prompts per generate call / sequences per perplexity forward.
        do_sample: Seeded sampling instead of greedy decoding.
        seed: Sampling seed.
        temperature: Sampling temperature.
        top_p: Nucleus mass.
        add_special_tokens: Encode every prompt with the tokenizer's special tokens (raw, non-chat prompts: a BOS
            the model expects; chat templates write their own).

    Returns:
        A JSON-ready dict: the metrics, ``tokens_per_second`` and the ``generations``.
    """
    gens = generate(model, tokenizer, prompts, max_new_tokens, batch_size, do_sample, seed, temperature, top_p,
                    add_special_tokens)
    ref_ids = gens.prompt_ids
    if reference_prompts is not None:
        if len(reference_prompts) != len(prompts):
            raise ValueError(f"{len(reference_prompts)} reference prompts for {len(prompts)} prompts")
        ref_ids = [tokenizer(p, add_special_tokens=add_special_tokens)["input_ids"] for p in reference_prompts]
    result = {"n_prompts": len(prompts), "max_new_tokens": max_new_tokens, "do_sample": do_sample, "seed": seed}
    result.update(perplexity_summary(generation_nll(model, tokenizer, ref_ids, gens.new_ids, batch_size)))
    result["fluency"] = sum(ngram_entropy(t) for t in gens.texts) / len(gens.texts)
    result.update(distinct_n([[t] for t in gens.texts]))
    result["mean_new_tokens"] = sum(len(g) for g in gens.new_ids) / len(gens.new_ids)
    result["tokens_per_second"] = gens.new_tokens / gens.seconds if gens.seconds > 0 else float("nan")
    if scorer is not None:
        scores = [float(s) for s in scorer(list(gens.texts))]
        if len(scores) != len(gens.texts):
            raise ValueError(f"the scorer returned {len(scores)} scores for {len(gens.texts)} texts")
        result.update(concept_summary(scores))
        result["scores"] = scores
    if questions is not None:
        if answers is None:
            raise ValueError("questions need answers (accepted answers per question)")
        check = instruction_kept(model, tokenizer, questions, answers, question_baseline, steered_questions,
                                 batch_size=batch_size, add_special_tokens=add_special_tokens)
        result["instruction_kept"] = check["kept"]
        result["instruction_accuracy"] = check["steered_accuracy"]
        result["instruction_base_accuracy"] = check["base_accuracy"]
        result["instruction_answers"] = check["answers"]
    result["generations"] = gens.texts
    return result


def classifier_scorer(model, tokenizer, positive_label: int = 1, batch_size: int = 32, max_length: int = 128) -> Scorer:
    """A concept scorer from a sequence classifier: ``texts -> softmax(logits)[positive_label]``.

    A multi-label head (``config.problem_type == "multi_label_classification"``, e.g. toxicity classifiers with one
    label per kind of toxicity) and a single-logit head (``num_labels == 1``, a binary classifier trained with a
    sigmoid) score ``sigmoid(logits[positive_label])`` instead: their labels are not exclusive, so a softmax would
    dilute the probability (multi-label) or give 1.0 for every text (one logit).

    Args:
        model: A transformers sequence-classification model (or a path to one, loaded with
            ``AutoModelForSequenceClassification``).
        tokenizer: Its tokenizer (or ``None`` to load it from the path).
        positive_label: Index of the concept's class.
        batch_size: Texts per forward.
        max_length: Truncation length.
    """
    if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = str(model)
        model = AutoModelForSequenceClassification.from_pretrained(path)
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(path)
    model.eval()
    num_labels = getattr(model.config, "num_labels", None)
    if num_labels is not None and not 0 <= positive_label < num_labels:
        raise ValueError(f"positive_label must be in 0..{num_labels - 1}, got {positive_label}")
    independent = num_labels == 1 or getattr(model.config, "problem_type", None) == "multi_label_classification"

    def score(texts: list[str]) -> list[float]:
        out = []
        for lo in range(0, len(texts), batch_size):
            # An empty generation has nothing to classify: give it a space, so it scores as the classifier's prior.
            chunk = [t if t.strip() else " " for t in texts[lo:lo + batch_size]]
            # Right padding whatever the tokenizer's setting: encoder classifiers (BERT) have absolute positions,
            # so left padding would shift every position and change the scores.
            batch = tokenizer(chunk, return_tensors="pt", padding=True, truncation=True, max_length=max_length,
                              padding_side="right")
            ref = next(model.parameters(), None)
            if ref is not None:  # the classifier may sit on a GPU; the tokenizer returns CPU tensors
                batch = {k: v.to(ref.device) for k, v in batch.items()}
            with torch.inference_mode():
                logits = model(**batch).logits.float()
            probs = torch.sigmoid(logits) if independent else torch.softmax(logits, dim=-1)
            out.extend(probs[:, positive_label].cpu().tolist())
        return out

    return score
