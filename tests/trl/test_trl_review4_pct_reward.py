"""A PCT reward model under TRL's ``RewardTrainer`` (fourth review): the reward of each row must be the one the row
gets alone.

PEFT's prompt-learning forward hands the base model ``inputs_embeds`` (the soft prompt first), so transformers'
``...ForSequenceClassification`` cannot find the pad tokens and pools every row at the last position
(``"will not detect padding tokens in inputs_embeds"``): for each right-padded row (``RewardTrainer``'s collator pads
right) the reward was read at a padding position, and the model trained on those rewards. peftplug's Lightning path
re-pooled at the last attended token (a per-call hook of its own), any other trainer did not; a PCT
``SEQ_CLS`` model now pools there itself (``peftplug.registry``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

trl = pytest.importorskip("trl")

from datasets import Dataset

import prompt_transfer as pt
from peftplug.tiny import char_tokenizer, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _classifier():
    model = tiny_model("llama", task="seq_cls", num_labels=1)
    model.config.pad_token_id = 0  # the char tokenizer's <pad>
    return model


def _rows() -> list[dict]:
    # Answers of different lengths: every batch holds right-padded rows.
    return [{"chosen": [{"role": "user", "content": f"add {i} {j}"}, {"role": "assistant", "content": str(i + j)}],
             "rejected": [{"role": "user", "content": f"add {i} {j}"},
                          {"role": "assistant", "content": f"{i * j + 7} or so"}]}
            for i in range(4) for j in range(4)]


def _alone(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's reward computed on that row alone, without padding."""
    rewards = []
    for row, row_mask in zip(ids, mask, strict=True):
        real = row[row_mask.bool()][None]
        rewards.append(model(input_ids=real, attention_mask=torch.ones_like(real)).logits[0])
    return torch.stack(rewards)


def test_pct_reward_model_scores_each_padded_row_as_alone(trl_args, decomposition):
    trainer = trl.RewardTrainer(
        model=_classifier(), args=trl_args(trl.RewardConfig, learning_rate=5e-2),
        train_dataset=Dataset.from_list(_rows()), processing_class=char_tokenizer(),
        peft_config=pt.PCTConfig(task_type="SEQ_CLS", num_virtual_tokens=4, decomposition_path=decomposition),
    )
    trainer.train()  # the adapter and the score head moved: the check below is not at the init
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert bool((mask[:, -1] == 0).any()), "no right-padded row in the batch"
    model = trainer.model.eval()  # the tiny Llama has no dropout
    with torch.no_grad():
        batched = model(input_ids=ids, attention_mask=mask).logits
        alone = _alone(model, ids, mask)
        torch.testing.assert_close(batched, alone, atol=1e-5, rtol=0)
        # The loss RewardTrainer optimises is that of the rows' own rewards.
        model.train()
        loss = trainer.compute_loss(model, dict(batch))
        chosen, rejected = alone.squeeze(-1).chunk(2)
        torch.testing.assert_close(loss, -F.logsigmoid(chosen - rejected).mean(), atol=1e-5, rtol=0)


def test_a_pct_classifier_outside_any_trainer_scores_padded_rows_as_alone(decomposition):
    # The pooling belongs to the model, not to one trainer: a plain forward of a right-padded batch (transformers'
    # Trainer, a user's loop) gets each row's own score too.
    import peft

    config = pt.PCTConfig(task_type="SEQ_CLS", num_virtual_tokens=4, decomposition_path=decomposition)
    model = peft.get_peft_model(_classifier(), config).eval()
    ids = torch.tensor([[5, 9, 14, 20, 33, 41], [5, 9, 14, 20, 0, 0], [7, 8, 0, 0, 0, 0]])
    mask = (ids != 0).long()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, _alone(model, ids, mask),
                                   atol=1e-5, rtol=0)
