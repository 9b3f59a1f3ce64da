"""A minimal training loop for prompt adapters (source prompts, PCT targets and the baselines).

Scope: single process, plain AdamW, a fixed number of steps over pre-built batches. It exists so the stages
and the benchmark run in-process on CPU; full runs with checkpoints, loggers and recipes go through
``peftplug.lightning`` (whose training step adds the encoder's ``auxiliary_loss()`` and logs its
``training_metrics()``, as this loop does).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Mapping

import torch

logger = logging.getLogger(__name__)


def _encoder(model, adapter_name: str | None = None):
    encoders = getattr(model, "prompt_encoder", None)
    if encoders is None:
        return None
    return encoders[adapter_name or model.active_adapter]


def auxiliary_loss(model, adapter_name: str | None = None) -> torch.Tensor | None:
    """The PCT auxiliary (contrastive) loss of the active adapter, or ``None`` for other adapters.

    Args:
        model: A ``PeftModel``.
        adapter_name: Adapter to read (default: the active one).
    """
    enc = _encoder(model, adapter_name)
    if enc is None or not hasattr(enc, "auxiliary_loss"):
        return None
    return enc.auxiliary_loss()


def attention_weights(model, adapter_name: str | None = None) -> dict[str, float]:
    """The PCT attention over source tasks as ``{source name: weight}`` (empty for other adapters).

    Args:
        model: A ``PeftModel``.
        adapter_name: Adapter to read (default: the active one).
    """
    enc = _encoder(model, adapter_name)
    if enc is None or not hasattr(enc, "attention_weights"):
        return {}
    return {name: float(w) for name, w in zip(enc.source_names, enc.attention_weights())}


def pct_metrics(model, adapter_name: str | None = None) -> dict[str, float]:
    """Scalars worth logging each step: ``pct/attn/<source>`` and ``pct/attn_entropy``.

    Args:
        model: A ``PeftModel``.
        adapter_name: Adapter to read (default: the active one).
    """
    enc = _encoder(model, adapter_name)
    if enc is None or not hasattr(enc, "training_metrics"):
        return {}
    return enc.training_metrics()


def train_prompt(
    model,
    batches: Iterable[Mapping[str, torch.Tensor]],
    steps: int,
    lr: float = 3e-2,
    head_lr: float | None = 1e-3,
    attention_lr: float | None = None,
    weight_decay: float = 0.0,
    log_every: int = 0,
    loss_fn=None,
) -> dict[str, list]:
    """Trains whatever requires grad in ``model`` (the prompt encoder, plus e.g. a classification head).

    Prompt-encoder parameters use ``lr``; any other trainable parameter (PEFT's ``modules_to_save`` head) uses
    ``head_lr``. The PCT auxiliary loss is added to the model loss; attention weights are recorded.

    Args:
        model: A ``PeftModel`` whose forward returns ``.loss`` for the batches.
        batches: Batches (dicts of tensors, incl. ``labels``); cycled until ``steps`` are done.
        steps: Optimizer steps (>= 1).
        lr: Learning rate of the prompt encoder.
        head_lr: Learning rate of the other trainable parameters.
        attention_lr: Learning rate of PCT's attention query and key offsets (default: ``lr``).
        weight_decay: AdamW weight decay.
        log_every: Log loss and attention through ``logging`` every this many steps (0: never).
        loss_fn: ``(model, batch) -> loss`` (default: ``model(**batch).loss``); for prompt-based classification of
            a causal LM pass ``lambda m, b: peftplug.prompt_cls.prompt_cls_forward(m, b).loss``.

    Returns:
        ``{"loss": [...], "aux": [...], "attention": [{source: weight}, ...]}`` per step.

    Raises:
        ValueError: If ``steps < 1`` or nothing is trainable.
        FloatingPointError: On a non-finite loss.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    encoder_ids = {id(p) for p in model.prompt_encoder.parameters()} if hasattr(model, "prompt_encoder") else set()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    attention_names = (".embedding.query", ".embedding.key_offsets")
    attn_params = [p for n, p in named if id(p) in encoder_ids and n.endswith(attention_names)]
    prompt_params = [p for n, p in named if id(p) in encoder_ids and not n.endswith(attention_names)]
    other_params = [p for _, p in named if id(p) not in encoder_ids]
    groups = []
    if attn_params:
        groups.append({"params": attn_params, "lr": attention_lr if attention_lr is not None else lr})
    if prompt_params:
        groups.append({"params": prompt_params, "lr": lr})
    if other_params:
        groups.append({"params": other_params, "lr": head_lr if head_lr is not None else lr})
    if not groups:
        raise ValueError("the model has no trainable parameters")
    opt = torch.optim.AdamW(groups, weight_decay=weight_decay)
    data = list(batches)
    if not data:
        raise ValueError("batches is empty")
    history: dict[str, list] = {"loss": [], "aux": [], "attention": []}
    model.train()
    for step, batch in zip(range(steps), itertools.cycle(data)):
        loss = model(**batch).loss if loss_fn is None else loss_fn(model, batch)
        aux = auxiliary_loss(model)
        total = loss + aux if aux is not None else loss
        if not torch.isfinite(total):
            raise FloatingPointError(f"non-finite loss at step {step}: model {loss.item()}, "
                                     f"auxiliary {None if aux is None else aux.item()}")
        opt.zero_grad(set_to_none=True)
        total.backward()
        opt.step()
        history["loss"].append(loss.item())
        history["aux"].append(0.0 if aux is None else aux.item())
        attn = attention_weights(model)
        history["attention"].append(attn)
        if log_every and (step + 1) % log_every == 0:
            logger.info("step %d loss %.4f aux %.4f attention %s", step + 1, history["loss"][-1],
                        history["aux"][-1], {k: round(v, 3) for k, v in attn.items()})
    model.eval()
    return history
