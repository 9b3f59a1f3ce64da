"""Source stage and baselines: per-task PEFT prompt tuning, reading source prompts back, SPoT selection."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping

import torch

from prompt_transfer.training import train_prompt


def prompt_tuning_config(task_type: str, num_virtual_tokens: int, init: str = "random", **kwargs):
    """A PEFT ``PromptTuningConfig`` for the source stage and the PT baselines.

    Args:
        task_type: PEFT task type (``"SEQ_CLS"``, ``"CAUSAL_LM"``, ``"SEQ_2_SEQ_LM"``).
        num_virtual_tokens: Prompt length ``l``.
        init: ``"random"`` (PEFT's RANDOM) or ``"vocab"`` (SAMPLE_VOCAB: embeddings of random vocabulary tokens).
        **kwargs: Other ``PromptTuningConfig`` fields (e.g. ``modules_to_save``).
    """
    from peft import PromptTuningConfig, PromptTuningInit

    inits = {"random": PromptTuningInit.RANDOM, "vocab": PromptTuningInit.SAMPLE_VOCAB}
    if init not in inits:
        raise ValueError(f"init must be one of {sorted(inits)}, got {init!r}")
    return PromptTuningConfig(task_type=task_type, num_virtual_tokens=num_virtual_tokens,
                              prompt_tuning_init=inits[init], **kwargs)


def set_prompt(model, prompt: torch.Tensor, adapter_name: str | None = None) -> None:
    """Overwrites a prompt-tuning adapter's prompt (SPoT: initialise the target from a source prompt).

    Args:
        model: A ``PeftModel`` with a ``PROMPT_TUNING`` adapter.
        prompt: ``[l, d]``; repeated for each transformer submodule.
        adapter_name: Adapter (default: the active one).
    """
    weight = model.prompt_encoder[adapter_name or model.active_adapter].embedding.weight
    length = prompt.shape[0]
    if weight.shape[0] % length or weight.shape[1] != prompt.shape[1]:
        raise ValueError(f"prompt of shape {tuple(prompt.shape)} does not fit the adapter's {tuple(weight.shape)}")
    with torch.no_grad():
        weight.copy_(prompt.to(weight).repeat(weight.shape[0] // length, 1))


def train_source_prompts(
    make_model: Callable[[str], torch.nn.Module],
    tasks: Mapping[str, Iterable[Mapping[str, torch.Tensor]]],
    config_factory: Callable[[str], object],
    out_dir: str,
    steps: int,
    lr: float = 3e-2,
    head_lr: float = 1e-3,
    seed: int = 0,
) -> dict[str, str]:
    """Trains one soft prompt per source task (PEFT prompt tuning) and saves each as a PEFT adapter.

    Args:
        make_model: ``task name -> fresh base model`` (e.g. a classifier with that task's number of labels).
        tasks: ``task name -> training batches``.
        config_factory: ``task name -> PromptTuningConfig`` (all with the same ``num_virtual_tokens``).
        out_dir: Adapters go to ``out_dir/<task name>/`` (``adapter_config.json`` + ``adapter_model.safetensors``).
        steps: Optimizer steps per task.
        lr: Prompt learning rate.
        head_lr: Learning rate of trainable heads (``modules_to_save``).
        seed: Seed (per task ``seed + index``) for prompt init and dropout.

    Returns:
        ``task name -> adapter directory``.
    """
    from peft import get_peft_model

    if not tasks:
        raise ValueError("tasks is empty: give at least one source task")
    paths = {}
    for i, (name, batches) in enumerate(tasks.items()):
        torch.manual_seed(seed + i)
        model = get_peft_model(make_model(name), config_factory(name))
        train_prompt(model, batches, steps=steps, lr=lr, head_lr=head_lr)
        path = os.path.join(out_dir, name)
        model.save_pretrained(path)
        paths[name] = path
    return paths


def load_source_prompt(adapter_dir: str) -> torch.Tensor:
    """Reads the prompt ``[l, d]`` of a saved PEFT prompt-tuning (or PCT) adapter.

    Args:
        adapter_dir: Directory with ``adapter_config.json`` and ``adapter_model.safetensors``.

    Raises:
        ValueError: If the adapter is not a prompt-tuning/PCT adapter or its tensor is missing.
    """
    from safetensors.torch import load_file

    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        cfg = json.load(f)
    if cfg.get("peft_type") not in ("PROMPT_TUNING", "PCT"):
        raise ValueError(f"{adapter_dir} holds a {cfg.get('peft_type')!r} adapter, not PROMPT_TUNING/PCT")
    tensors = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    if "prompt_embeddings" not in tensors:
        raise ValueError(f"{adapter_dir}/adapter_model.safetensors has no 'prompt_embeddings' tensor")
    return tensors["prompt_embeddings"][: cfg["num_virtual_tokens"]].float()


def spot_select(target_prompt: torch.Tensor, source_prompts: Mapping[str, torch.Tensor],
                mode: str = "mean_token") -> tuple[str, dict[str, float]]:
    """SPoT retrieval: the source prompt most similar (cosine) to a prompt trained briefly on the target.

    Args:
        target_prompt: The target's task embedding, ``[l, d]`` (a prompt tuned on the target task).
        source_prompts: ``name -> [l, d]``.
        mode: ``"mean_token"`` (cosine of token-averaged prompts, SPoT's default) or ``"flat"`` (cosine of the
            flattened prompts).

    Returns:
        ``(best source name, {name: similarity})``.
    """
    if not source_prompts:
        raise ValueError("source_prompts is empty")
    if mode not in ("mean_token", "flat"):
        raise ValueError(f"mode must be 'mean_token' or 'flat', got {mode!r}")

    def embed(p):
        return p.float().mean(0) if mode == "mean_token" else p.float().flatten()

    t = embed(target_prompt)
    sims = {}
    for name, p in source_prompts.items():
        if p.shape[-1] != target_prompt.shape[-1]:
            raise ValueError(f"source prompt {name!r} has width {p.shape[-1]}, target {target_prompt.shape[-1]}")
        sims[name] = float(torch.nn.functional.cosine_similarity(t, embed(p), dim=0))
    return max(sims, key=sims.get), sims
