"""A PCT model on a small saved decomposition, as several PCT tests build it."""

from __future__ import annotations

from collections.abc import Callable

import peft
import torch

import prompt_transfer as pt


def pct_model_on_saved_decomposition(tiny_model: Callable, path: str, generator: torch.Generator):
    """Decomposes three random 3 × 64 source prompts (drawn from ``generator``), saves them at ``path`` and returns
    a causal-LM PCT model of the tiny Llama on that folder.

    Args:
        tiny_model: ``tiny_model(family)`` (``peftplug.tiny.tiny_model`` or the fixture of that name).
        path: The decomposition folder.
        generator: Draws the source prompts; the caller keeps drawing from it.
    """
    sources = {f"s{i}": torch.randn(3, 64, generator=generator) for i in range(3)}
    pt.save_decomposition(pt.decompose(sources, contrastive_steps=5), path)
    return peft.get_peft_model(tiny_model("llama"), pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=path))
