"""Data-parallel training on CPU: 2 processes (gloo, launched as ``torchrun`` launches them), first-order and
zeroth-order, LoRA, OFTv2 and QOFT (OFTv2 on an NF4 base); the adapter weights must agree across ranks afterwards
(and have changed), although each rank saw different batches."""

from __future__ import annotations

import functools
import json

import lightning as L
import pytest
import torch
from peft import LoraConfig
from test_peftplug_lightning import SPSA

from peftplug.data import CausalLMData
from peftplug.lightning import PeftModule


class SaveRankState(L.Callback):
    """Writes each rank's trainable tensors and the indices of the batches it trained on."""

    def __init__(self, directory):
        self.directory = directory
        self.first_tokens = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.first_tokens.append(batch["input_ids"][:, :6].tolist())

    def on_fit_end(self, trainer, pl_module):
        state = {n: p.detach().clone() for n, p in pl_module.model.named_parameters() if p.requires_grad}
        torch.save({"state": state, "batches": self.first_tokens, "world": trainer.world_size},
                   f"{self.directory}/rank{trainer.global_rank}.pt")


def _adapter(kind: str):
    """(PEFT config, quantization) of the adapters trained under DDP."""
    if kind == "lora":
        return LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False), "none"
    import oftv2

    return oftv2.OFTv2Config(block_size=16, target_modules=["q_proj", "v_proj", "down_proj"]), (
        "nf4" if kind == "qoft" else "none")


def _fit_rank(rank: int, root: str, port: int, order: str, kind: str) -> None:
    """One of two ranks in the environment ``torchrun`` gives it: 3 steps under ``strategy="ddp"``, each rank
    building its own module and data (as each ``peftplug fit`` process of a DDP run does)."""
    import os

    from gloo_ranks import torchrun_env

    os.environ.update(torchrun_env(rank, port))
    if order == "first":
        optimizer = functools.partial(torch.optim.AdamW, lr=1e-2)
    else:
        optimizer = functools.partial(SPSA, lr=0.05, eps=1e-3, seed=7)
    peft_config, quantization = _adapter(kind)
    torch.manual_seed(0)  # LoRA's init draws from the global RNG: the same initial adapter on both ranks
    module = PeftModule("tiny:llama", peft=peft_config, quantization=quantization, optimizer=optimizer)
    initial = {n: p.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad}
    torch.save(initial, f"{root}/initial{rank}.pt")
    data = CausalLMData(train_file=f"{root}/train.jsonl", validation_file=f"{root}/train.jsonl",
                        prompt_column="prompt", response_column="response", batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, default_root_dir=root, callbacks=[SaveRankState(root)])
    trainer.fit(module, datamodule=data)


# Each row costs a pair of forked ranks (tests/gloo_ranks.py), so CI runs QOFT's alone; the rest are slow (make
# test-slow): OFTv2's sync is QOFT's (same adapter layers, an NF4 base under them) and the FSDP2 test's DDP run trains
# OFTv2 too; LoRA's is PEFT's own layer under the same module; zeroth-order DDP under Lightning is
# tests/helene/test_lightning.py's global-batch test.
SLOW = pytest.mark.slow


@pytest.mark.parametrize(("order", "kind"), [pytest.param("first", "lora", marks=SLOW),
                                             pytest.param("zeroth", "lora", marks=SLOW),
                                             pytest.param("first", "oftv2", marks=SLOW), ("first", "qoft")])
def test_ddp_two_processes_keep_adapters_in_sync(tmp_path, zygote, order, kind):
    from gloo_ranks import free_port, run_ranks

    if kind == "qoft":
        pytest.importorskip("bitsandbytes")
    rows = [{"prompt": f"{i:02d} plus {i:02d} is", "response": f" {2 * i}"} for i in range(16)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    run_ranks(zygote, _fit_rank, (str(tmp_path), free_port(), order, kind))

    initial = torch.load(tmp_path / "initial0.pt")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert ranks[0]["world"] == ranks[1]["world"] == 2
    assert ranks[0]["batches"] != ranks[1]["batches"]  # the sampler gave the ranks different data
    for name, value in ranks[0]["state"].items():
        assert torch.equal(value, ranks[1]["state"][name]), f"{order}-order: {name} differs across ranks"
    assert any(not torch.allclose(initial[n], ranks[0]["state"][n]) for n in initial), "nothing trained"
