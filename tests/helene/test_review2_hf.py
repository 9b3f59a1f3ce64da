"""Second review of helene.hf: a step skipped for a non-finite loss holds the LR schedule, as peftplug.lightning
does and as the Trainer does for a step its loss scaler skipped."""

from __future__ import annotations

import pytest
import torch

from helene import ZOSGD

pytest.importorskip("transformers")
pytest.importorskip("lightning")

from tests.helene.test_hf_trainer import _args, _batches, _examples, _model


def test_a_step_skipped_for_a_nonfinite_loss_holds_the_lr_schedule(tiny_model, tmp_path):
    """Linear decay over 4 steps with step 1's loss made non-finite: steps use lr0·(1, ¾, ¾, ½) — the skipped step
    leaves θ and the schedule where they were — and θ equals a hand-run loop over steps 0, 2 and 3 at those
    rates."""
    from helene.hf import ZeroOrderTrainer

    class NanAtStepOne(ZeroOrderTrainer):
        # Fault injection into the real loss: every forward of step 1 returns nan.
        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            return loss * float("nan") if self.state.global_step == 1 else loss

    lr0, steps, batches = 1e-2, 4, _batches(n_batches=4)
    model = _model(tiny_model)
    opt = ZOSGD(list(model.named_parameters()), lr=lr0, eps=1e-3, seed=1)
    seen = []
    step = opt.step
    opt.step = lambda closure: (seen.append(opt.param_groups[0]["lr"]), step(closure))[1]
    trainer = NanAtStepOne(model=model, args=_args(tmp_path, steps, lr_scheduler_type="linear"),
                           train_dataset=_examples(batches), optimizers=(opt, None))
    trainer.train()
    assert opt.skipped_nonfinite == 1 and opt.update_count == 3
    assert seen == pytest.approx([lr0, 0.75 * lr0, 0.75 * lr0, 0.5 * lr0], rel=1e-12, abs=0)

    ref = _model(tiny_model)
    ref_opt = ZOSGD(list(ref.named_parameters()), lr=lr0, eps=1e-3, seed=1)
    for t, lr in enumerate(seen):
        ref_opt.param_groups[0]["lr"] = lr
        batch = batches[t]
        scale = float("nan") if t == 1 else 1.0
        ref_opt.step(lambda batch=batch, scale=scale: ref(**batch).loss.float() * scale)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.detach(), q.detach()), n
