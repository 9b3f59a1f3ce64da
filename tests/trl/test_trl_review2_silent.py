"""Two ways our adapters trained silently wrong under TRL's ``SFTTrainer`` (second review), now refused.

1. A ``SteeringConfig`` whose ``positions`` is ``"generated"`` or ``"from_last_prompt"``: a training forward is one
   teacher-forced pass over whole texts with no prompt length, so every token counts as prompt. ``"generated"``
   then steers no token and ``"from_last_prompt"`` only the last one (whose prediction no label reads): the vector
   gets a zero gradient and stays zero while the run logs losses as usual. ``steering.train_vectors`` refuses these
   policies (``steering.config.TRAINABLE_POSITIONS``); a ``Trainer``/TRL run did not (``SteeringModel.train`` does).
2. A ``PCTConfig`` with ``packing=True``: PEFT's prompt-learning forward drops ``position_ids`` (with a generic
   warning) and prepends the soft prompt once per packed row, so the packed examples attend to each other and only
   the first one sees the prompt. The loss is that of one long sequence, not of the examples (measured below); the
   base model's forward now refuses the packed boundaries TRL passes (``peftplug.registry``).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

trl = pytest.importorskip("trl")

from datasets import Dataset
from trl_helpers import prompt_completion_rows

import prompt_transfer as pt
from peftplug.tiny import char_tokenizer, tiny_model
from steering import SteeringConfig


@pytest.mark.parametrize("positions", ["all", "prompt"])
def test_trainable_steering_positions_get_a_gradient_under_sft(trl_args, positions):
    # The policies steering.train_vectors accepts train under SFTTrainer too (the control of the refusal below).
    trainer = trl.SFTTrainer(
        model=tiny_model("llama"), args=trl_args(trl.SFTConfig), train_dataset=Dataset.from_list(prompt_completion_rows()),
        processing_class=char_tokenizer(),
        peft_config=SteeringConfig(layers=[1], positions=positions, task_type="CAUSAL_LM"),
    )
    trainer.train()
    assert all(h["grad_norm"] > 0 for h in trainer.state.log_history if "loss" in h)
    assert trainer.model.base_model.get_vectors()[1].abs().max() > 0


@pytest.mark.parametrize("positions", ["generated", "from_last_prompt"])
def test_untrainable_steering_positions_are_refused_under_sft(trl_args, positions):
    with pytest.raises(ValueError, match="positions"):
        trainer = trl.SFTTrainer(
            model=tiny_model("llama"), args=trl_args(trl.SFTConfig),
            train_dataset=Dataset.from_list(prompt_completion_rows()), processing_class=char_tokenizer(),
            peft_config=SteeringConfig(layers=[1], positions=positions, task_type="CAUSAL_LM"),
        )
        trainer.train()
        # Without a refusal the run "succeeds": show what it trained (nothing) in the failure message.
        norms = [h["grad_norm"] for h in trainer.state.log_history if "loss" in h]
        vector = trainer.model.base_model.get_vectors()[1]
        pytest.fail(f"trained without a refusal: grad norms {norms}, vector norm {vector.norm().item()}")


def _packed_trainer(trl_args, decomposition):
    return trl.SFTTrainer(
        model=tiny_model("llama"), args=trl_args(trl.SFTConfig, packing=True, max_length=64),
        train_dataset=Dataset.from_list(prompt_completion_rows()), processing_class=char_tokenizer(),
        peft_config=pt.PCTConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, decomposition_path=decomposition),
    )


def test_pct_on_a_packed_row_is_not_the_loss_of_its_examples(trl_args, decomposition):
    # Documents the mechanism behind the refusal below: the packed loss is that of one long sequence with one prompt.
    trainer = _packed_trainer(trl_args, decomposition)
    model = trainer.model.train()  # the tiny Llama has no dropout
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(3)])
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist()
    assert len(starts) == 3  # three examples in one row
    ids, labels = batch["input_ids"], batch["labels"]
    # The refusal of restarting position ids (the PeftModel's own pre-hook) is lifted here to show what it prevents.
    model.__dict__["_peftplug_packing_guard"][1].remove()
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=batch["position_ids"], labels=labels).loss
        as_one_sequence = model(input_ids=ids, labels=labels).loss
        # Each example on its own, with the soft prompt in front of it: the loss packing should reproduce.
        bounds = starts + [ids.shape[1]]
        total, count = torch.zeros(()), 0
        for s, e in itertools.pairwise(bounds):
            logits = model(input_ids=ids[:, s:e]).logits[:, -(e - s):]
            target = labels[:, s + 1:e]
            total += F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), target.reshape(-1),
                                     ignore_index=-100, reduction="sum")
            count += int((target != -100).sum())
    assert torch.equal(packed, as_one_sequence)
    assert abs(packed.item() - (total / count).item()) > 1e-4


def test_pct_refuses_packed_batches(trl_args, decomposition):
    with pytest.raises(ValueError, match="(?i)pack|padding.free"):
        trainer = _packed_trainer(trl_args, decomposition)
        trainer.train()
