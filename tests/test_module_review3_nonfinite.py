"""A non-finite loss under gradient clipping: the step is skipped, and clipping goes on for the later steps.

:class:`~peftplug.nonfinite_steps.SkipsNonFiniteSteps` drops every gradient of the skipped step; Lightning then
clipped the empty gradient list, and torch's ``clip_grad_value_`` (``gradient_clip_algorithm: value``) raised
``RuntimeError: Expected !nested_tensorlist[0].empty()`` at the first NaN batch.
"""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from peft import LoraConfig

from peftplug.data import CausalLMData
from peftplug.lightning import PeftModule

CLIP = 1e-4


class PoisonFirstStep(PeftModule):
    """NaN loss in the first training forward; records the largest gradient entry after each clipping."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls, self.clipped = 0, []

    def forward(self, **batch):
        out = super().forward(**batch)
        if self.trainer.training:
            if self.calls == 0:
                out.loss = out.loss * float("nan")
            self.calls += 1
        return out

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self.clipped.append(max(float(g.abs().max()) for g in grads) if grads else None)


class Snapshots(L.Callback):
    """The trainable parameters before every training batch."""

    def __init__(self):
        self.params = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.params.append({n: p.detach().clone() for n, p in pl_module.model.named_parameters() if p.requires_grad})


@pytest.mark.parametrize("algorithm", ["value", "norm"])
def test_a_nan_step_under_gradient_clipping_is_skipped_and_later_steps_clipped(tmp_path, algorithm):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"Q{i}: add {i} and {i}?", "response": f" {2 * i}"})
                              for i in range(12)))
    data = CausalLMData(train_file=str(path), prompt_column="prompt", response_column="response", batch_size=4)
    module = PoisonFirstStep("tiny:llama", peft=LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False),
                             optimizer=lambda p: torch.optim.SGD(p, lr=1.0))
    snapshots = Snapshots()
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                        limit_val_batches=0, max_steps=3, gradient_clip_val=CLIP, gradient_clip_algorithm=algorithm,
                        callbacks=[snapshots])
    trainer.fit(module, datamodule=data)

    assert trainer.global_step == 3 and module.nonfinite_steps == 1
    first, second, third = snapshots.params
    assert all(torch.equal(first[n], second[n]) for n in first)  # the NaN step moved nothing
    assert any(not torch.equal(second[n], third[n]) for n in first)  # the next one trained
    assert module.clipped[0] is None  # no gradient to clip at the skipped step
    if algorithm == "value":  # the later steps' gradients were clipped as configured
        assert all(top <= CLIP for top in module.clipped[1:])
    else:
        assert all(top is not None for top in module.clipped[1:])
