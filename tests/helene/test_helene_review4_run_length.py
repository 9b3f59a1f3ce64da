"""Fourth review: HELENE told a run without a fixed length (Lightning's ``estimated_stepping_batches`` is ``inf``
for ``max_steps: -1`` with ``max_epochs: -1``, a run bounded by ``max_time``) trains with a numeric annealing
horizon and refuses ``anneal_horizon="auto"`` in one line naming the field."""

from __future__ import annotations

import math

import pytest
import torch

from helene import Helene


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def test_an_unbounded_run_with_a_numeric_horizon_steps_as_a_bounded_one():
    model = _model()
    bounded = torch.nn.Linear(4, 2)
    bounded.load_state_dict(model.state_dict())
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    opt = Helene(model.parameters(), lr=1e-2, anneal_horizon=50.0, seed=1)
    opt.set_total_steps(math.inf)
    ref = Helene(bounded.parameters(), lr=1e-2, anneal_horizon=50.0, seed=1)
    ref.set_total_steps(100)
    for _ in range(3):
        opt.step(lambda: torch.nn.functional.mse_loss(model(x), y))
        ref.step(lambda: torch.nn.functional.mse_loss(bounded(x), y))
    assert opt.horizon() == 50.0 and opt.update_count == 3
    for p, q in zip(model.parameters(), bounded.parameters()):
        assert torch.equal(p, q)
    saved = opt.state_dict()
    resumed = Helene(model.parameters(), lr=1e-2, anneal_horizon=50.0, seed=1)
    resumed.load_state_dict(saved)
    assert resumed.total_steps is None


def test_auto_horizon_of_an_unbounded_run_names_the_field():
    model = _model()
    opt = Helene(model.parameters(), anneal_horizon="auto")
    with pytest.raises(ValueError, match=r"^anneal_horizon must be a number of steps > 0 for a run without a fixed "):
        opt.set_total_steps(math.inf)
    assert opt.total_steps is None


@pytest.mark.parametrize("bad", [0, -3, 2.5, -math.inf, math.nan, "10"])
def test_other_run_lengths_are_still_refused(bad):
    model = _model()
    with pytest.raises(ValueError, match="^total_steps must be"):
        Helene(model.parameters(), anneal_horizon=5.0).set_total_steps(bad)


class _StopAfter(__import__("lightning").Callback):
    """Ends a run of unbounded length after ``steps`` optimizer steps (what max_time or a user's callback does)."""

    def __init__(self, steps):
        self.steps = steps

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step >= self.steps:
            trainer.should_stop = True


@pytest.mark.parametrize("horizon", [5.0, "auto"])
def test_peft_module_fits_an_unbounded_run(tiny_model, tmp_path, horizon):
    # PeftModule passed int(estimated_stepping_batches) = int(inf) to set_total_steps: an OverflowError traceback.
    from functools import partial

    import lightning
    from torch.utils.data import DataLoader

    from peftplug.lightning import PeftModule

    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(4, 90, (2, 6), generator=g), "attention_mask": torch.ones(2, 6,
                dtype=torch.long), "labels": torch.randint(0, 2, (2,), generator=g)} for _ in range(2)]
    module = PeftModule(tiny_model("bert", "seq_cls", seed=0, num_labels=2), task="seq_cls",
                        optimizer=partial(Helene, lr=1e-3, eps=1e-3, anneal_horizon=horizon, seed=3))
    trainer = lightning.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                                default_root_dir=str(tmp_path), max_steps=-1, max_epochs=-1,
                                callbacks=[_StopAfter(3)])
    loader = DataLoader(batches, batch_size=None)
    if horizon == "auto":
        with pytest.raises(ValueError, match="^anneal_horizon must be a number of steps > 0 for a run without"):
            trainer.fit(module, train_dataloaders=loader)
        return
    trainer.fit(module, train_dataloaders=loader)
    assert trainer.global_step == 3 and trainer.optimizers[0].total_steps is None
