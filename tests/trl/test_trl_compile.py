"""TRL's SFTTrainer with ``torch_compile=True`` trains an OFTv2 adapter: finite losses equal to the eager run's, and
no graph break of ours.

TRL's own step breaks dynamo's graph (its chunked log-prob head calls ``torch.mm(out=...)`` on a non-contiguous
tile; under gradient checkpointing, Hugging Face ``kernels``' context variable is set inside the checkpoint), so
breaks are counted against PEFT's LoRA on the same model and data: OFTv2 must break exactly where LoRA does.
"""

from __future__ import annotations

import math
from collections import Counter

import peft
import pytest
import torch

trl = pytest.importorskip("trl")

from datasets import Dataset
from trl_helpers import prompt_completion_rows

from oftv2 import OFTv2Config
from peftplug.tiny import char_tokenizer, tiny_model


def _train(trl_args, peft_config, compile_: bool) -> tuple[list[float], Counter]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    extra = {"torch_compile": True, "torch_compile_backend": "aot_eager"} if compile_ else {}
    trainer = trl.SFTTrainer(
        model=tiny_model("llama", num_hidden_layers=1), args=trl_args(trl.SFTConfig, max_steps=3, **extra),
        train_dataset=Dataset.from_list(prompt_completion_rows()), processing_class=char_tokenizer(),
        peft_config=peft_config,
    )
    trainer.train()
    assert all(p.abs().max() > 0 for p in trainer.model.parameters() if p.requires_grad)
    if compile_:
        assert counters["stats"]["unique_graphs"] >= 1, "SFTTrainer did not compile the model"
    breaks = Counter(counters["graph_break"])
    torch._dynamo.reset()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], breaks


def test_sft_torch_compile_trains_oftv2_like_eager_breaking_only_where_lora_does(trl_args):
    oft = OFTv2Config(target_modules="all-linear", block_size=8)
    eager, _ = _train(trl_args, oft, compile_=False)
    losses, breaks = _train(trl_args, oft, compile_=True)
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert losses == pytest.approx(eager, abs=2e-4)  # logged rounded to 4 decimals
    _, lora_breaks = _train(trl_args, peft.LoraConfig(target_modules="all-linear", r=4), compile_=True)
    assert breaks == lora_breaks
