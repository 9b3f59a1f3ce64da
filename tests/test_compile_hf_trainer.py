"""Hugging Face ``Trainer`` with ``torch_compile=True`` trains an OFTv2 adapter: the loss curve equals the eager
run's, and dynamo compiled the step without a single graph break (counted by dynamo's own counters)."""

from __future__ import annotations

import math

import peft
import pytest
import torch

import oftv2
from peftplug.tiny import tiny_model

pytest.importorskip("transformers")


def _rows(n: int = 6, length: int = 16) -> list[dict]:
    """Equal-length rows: one input shape, so the compiled step never needs a dynamic-shape recompile."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 90, (n, length), generator=gen)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def _train(tmp_path, compile_: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    from transformers import Trainer, TrainingArguments

    model = peft.get_peft_model(tiny_model("llama", seed=0, num_hidden_layers=1),
                                oftv2.OFTv2Config(block_size=8, target_modules="all-linear"))
    extra = {"torch_compile": True, "torch_compile_backend": "aot_eager"} if compile_ else {}
    args = TrainingArguments(
        output_dir=str(tmp_path / ("compiled" if compile_ else "eager")), max_steps=3, per_device_train_batch_size=2,
        learning_rate=1e-2, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
        dataloader_num_workers=0, seed=0, train_sampling_strategy="sequential", **extra)
    trainer = Trainer(model=model, args=args, train_dataset=_rows())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_trainer_torch_compile_trains_oftv2_like_eager(tmp_path):
    from torch._dynamo.utils import counters

    eager_losses, eager_params = _train(tmp_path, compile_=False)
    torch._dynamo.reset()
    counters.clear()
    losses, params = _train(tmp_path, compile_=True)
    assert counters["stats"]["unique_graphs"] >= 1, "the Trainer did not compile the model"
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert all(value.abs().max() > 0 for value in params.values())  # every adapter moved from its zero init
    assert losses == pytest.approx(eager_losses, abs=2e-4)  # the Trainer logs losses rounded to 4 decimals
    for name, value in params.items():
        torch.testing.assert_close(value, eager_params[name], rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()
