"""Scoring prompt-classification batches: the label words' logits at the answer position, their cross-entropy, and
predicted classes (see :mod:`peftplug.data.prompt_templates` for how prompts are built).

    loss = cross_entropy(logits[answer position, label words], label)     accuracy = argmax over the label words

Only the label words' rows of the LM head are computed (:func:`label_word_logits`): the full 49k-row head of
SmolLM2 is ~17% of a forward pass. Prompts are left-padded, so the last position is the answer position of every
row (rotary attention depends on relative positions only; the test suite checks padded against unpadded logits).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from peftplug.errors import DataError


def _is_prompt_learning(model: torch.nn.Module) -> bool:
    """Whether the model's active adapter is a prompt-learning one, and in effect (not in ``disable_adapter()``)."""
    if getattr(model, "_adapters_disabled", False):
        return False
    configs = getattr(model, "peft_config", None)
    name = getattr(model, "active_adapter", None)
    if not isinstance(configs, dict) or not isinstance(name, str) or name not in configs:
        return False
    return bool(getattr(configs[name], "is_prompt_learning", False))


def label_word_logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      word_ids: torch.Tensor) -> torch.Tensor:
    """Logits of the label words at the last position of left-padded prompts: ``[batch, classes]``.

    For a plain causal LM (or one with a weight adapter such as LoRA/OFTv2 inside it) this runs the decoder and
    multiplies the last hidden state by the label words' rows of the LM head only. Where that shortcut would be
    wrong — prompt-learning adapters (their virtual tokens are prepended by the PEFT wrapper), an adapted LM head,
    logit soft-capping or scaling (:data:`_HEAD_TRANSFORMS`) — it falls back to the full model with
    ``logits_to_keep=1`` (full head, last position).
    Under prompt tuning, p-tuning and prefix tuning too, every row sees the positions of its unpadded self (the
    virtual tokens first, the text right after them), so the scores do not depend on the batch it is in.

    Args:
        model: A causal LM, optionally wrapped by PEFT.
        input_ids: Left-padded prompts ``[batch, length]``.
        attention_mask: Their attention mask.
        word_ids: Label-word token ids ``[classes]``.
    """
    word_ids = word_ids.to(input_ids.device)
    wrapped = hasattr(model, "get_base_model")
    lm = model.get_base_model() if wrapped and not _is_prompt_learning(model) else model
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    shortcut = (not (wrapped and lm is model) and isinstance(head, torch.nn.Linear) and decoder is not None
                and decoder is not lm and not hasattr(head, "base_layer") and _plain_head(lm))
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False}
    # Positions counted over real tokens: a left-padded row then sees exactly the positions of its unpadded self
    # (RoPE would only need relative positions; absolute position embeddings need this).
    positions = (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)
    if wrapped and lm is model:
        prompt_learning = _prompt_learning_logits(model, inputs, positions)
        if prompt_learning is not None:
            return prompt_learning.index_select(-1, word_ids)
    else:
        inputs["position_ids"] = positions
    if not shortcut:
        return model(**inputs, logits_to_keep=1).logits[:, -1].index_select(-1, word_ids)
    hidden = decoder(**inputs).last_hidden_state[:, -1]
    bias = None if head.bias is None else head.bias.index_select(0, word_ids)
    return F.linear(hidden, head.weight.index_select(0, word_ids), bias)


#: Settings with which a model's forward changes the LM head's output (Gemma 2/3's soft-capping, Granite's and
#: MiniCPM3's division, Cohere's and HyperCLOVAX's multiplication, Falcon-H1's multiplier): the shortcut would skip
#: that step and the loss would be taken on logits off by a factor, so such a model runs its own forward.
_HEAD_TRANSFORMS = ("final_logit_softcapping", "logits_scaling", "logit_scale", "lm_head_multiplier")


def _plain_head(lm: torch.nn.Module) -> bool:
    """Whether the model's logits are its LM head's output unchanged (none of :data:`_HEAD_TRANSFORMS` in effect).

    Args:
        lm: The causal LM (unwrapped).
    """
    config = lm.config
    configs = [config, *([config.get_text_config()] if hasattr(config, "get_text_config") else [])]
    owners = [*configs, lm, getattr(lm, "model", None)]  # Cohere keeps logit_scale on the model, Falcon-H1 inside
    values = [getattr(o, name, None) for o in owners for name in _HEAD_TRANSFORMS]
    # A tensor-valued scale (a learned one) counts as a transform too: only None or the number 1 is neutral.
    return all(v is None or (isinstance(v, (int, float)) and v == 1) for v in values)


def _prompt_learning_logits(model: torch.nn.Module, inputs: dict, positions: torch.Tensor) -> torch.Tensor | None:
    """Last-position logits under a prompt-learning adapter, each row positioned as if it were unpadded.

    PEFT's wrapper puts the virtual tokens before the left padding: under prompt tuning it drops position ids, so
    the positions count the padding and the text's distance to the virtual tokens (its logits) changed with the
    longest row of the batch. Here the prompt embeddings (``get_prompt``, as the wrapper's forward prepends them:
    prompt tuning, p-tuning, plugin types such as PCT) are prepended by hand and the base model gets position ids
    that skip the padding; prefix tuning takes position ids through the wrapper (PEFT offsets them by the prefix).
    Multitask prompt tuning and CPT return ``None``: the wrapper's forward.

    Args:
        model: A PEFT model whose active adapter is a prompt-learning one.
        inputs: ``input_ids``, ``attention_mask`` (left-padded) and ``use_cache``.
        positions: Each token's position among its row's real tokens.
    """
    config = model.peft_config[model.active_adapter]
    kind = str(getattr(config.peft_type, "value", config.peft_type))
    if kind == "PREFIX_TUNING":
        return model(**inputs, position_ids=positions, logits_to_keep=1).logits[:, -1]
    if kind in ("MULTITASK_PROMPT_TUNING", "CPT"):
        return None  # task ids / CPT's own token handling: only the wrapper's forward knows them
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    embeds = model.word_embeddings(ids)
    prompts = model.get_prompt(batch_size=ids.shape[0]).to(embeds.dtype)
    virtual = prompts.shape[1]
    # Padding masked out sits between the virtual tokens and the text; with these positions that is the same
    # computation as the unpadded row (virtual tokens at 0..n-1, the text from n on).
    positions = torch.cat([torch.arange(virtual, device=ids.device).expand(ids.shape[0], -1), positions + virtual], 1)
    mask = torch.cat([mask.new_ones(ids.shape[0], virtual), mask], 1)
    return model.base_model(inputs_embeds=torch.cat([prompts, embeds], 1), attention_mask=mask, position_ids=positions,
                            use_cache=False, logits_to_keep=1).logits[:, -1]


@dataclass
class PromptClsOutput:
    """What :func:`prompt_cls_forward` returns: the mean loss (``None`` without labels) and the class logits."""

    loss: torch.Tensor | None
    logits: torch.Tensor


def prompt_cls_forward(model: torch.nn.Module, batch: dict) -> PromptClsOutput:
    """Label-word logits and cross-entropy of a prompt-classification batch.

    Args:
        model: A causal LM (optionally PEFT-wrapped).
        batch: ``input_ids`` and ``attention_mask`` (left-padded), ``label_word_ids`` ``[classes]`` (or
            ``[batch, classes]``, identical rows, as a DataLoader may stack it) and optionally ``labels`` (class
            indices).
    """
    if "label_word_ids" not in batch:
        raise DataError("task prompt_cls needs batches with 'label_word_ids' (use PromptClassificationData)")
    words = batch["label_word_ids"]
    if words.dim() == 2:
        words = words[0]
    logits = label_word_logits(model, batch["input_ids"], batch["attention_mask"], words)
    labels = batch.get("labels")
    loss = None if labels is None else F.cross_entropy(logits.float(), labels.to(logits.device))
    return PromptClsOutput(loss=loss, logits=logits)


def predict_labels(model: torch.nn.Module, batches: Iterable[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """The predicted class (argmax over the label words) and the gold class of every example, without gradients.

    Args:
        model: A causal LM (optionally PEFT-wrapped), in the mode the caller wants (eval for a zero-shot score).
        batches: Prompt-classification batches with ``labels`` (see :func:`prompt_cls_forward`).

    Returns:
        ``(predicted, labels)``, two 1-D tensors of class indices on the CPU, in the batches' order. Rows labelled
        -100 are left out: the masked copies a sharded evaluation loader pads its last batches with
        (:class:`peftplug.data.base.RankPaddedRows`), which would otherwise count as examples.
    """
    predicted, labels = [], []
    with torch.no_grad():
        for batch in batches:
            gold = batch["labels"].cpu()
            keep = gold != -100
            predicted.append(prompt_cls_forward(model, batch).logits.argmax(-1).cpu()[keep])
            labels.append(gold[keep])
    return torch.cat(predicted), torch.cat(labels)
