"""Dataset-level evaluation metrics of :class:`peftplug.lightning.PeftModule`: exact sums over a whole split.

A mixin: each validation/test batch adds its loss sum, item count and correct answers to running sums, and the epoch's
end reduces the sums across ranks and divides once, so ``val_loss``, ``val_ppl`` and ``val_acc`` do not depend on the
batch size, the padding or the number of ranks (items labelled -100 count nowhere). The per-item loss is taken in
fp32: a model whose own loss comes out in bf16/fp16 (a T5 or a BERT head with ``dtype: bfloat16``, or under
``precision: bf16-true``, where no autocast upcasts it) is re-scored from its logits in fp32, since its loss rounded to
8 bits of mantissa put ``val_loss`` up to 0.5 % (``val_ppl`` 2 %) off the split's loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from peftplug.answers import answer_matches

# Tasks whose metric is accuracy over class scores: a classification head, or label words (peftplug.prompt_cls).
CLASSIFICATION_TASKS = ("seq_cls", "prompt_cls")
GENERATION_PREFIX = "gen_"


def model_inputs(batch: dict) -> dict:
    """The batch without the generation-evaluation entries (``gen_*``) that data modules may add.

    Args:
        batch: A batch dict.
    """
    return {k: v for k, v in batch.items() if not k.startswith(GENERATION_PREFIX)}


def fp32_mean_loss(task: str, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
    """The mean cross-entropy over the items whose label is not -100, computed in fp32 from ``logits``, as the Hugging
    Face model computes it; ``None`` where the model's loss is not a plain cross-entropy (a regression or
    multi-label head), which is then kept as it is.

    Args:
        task: ``causal_lm``, ``seq2seq`` or ``seq_cls``.
        logits: The model's logits (``[batch, length, vocab]`` or ``[batch, classes]``).
        labels: The batch's labels, unshifted.
    """
    if task == "seq_cls":
        if labels.dim() != 1 or labels.is_floating_point() or logits.dim() != 2 or logits.shape[-1] < 2:
            return None
        return F.cross_entropy(logits.float(), labels, ignore_index=-100)
    if task not in ("causal_lm", "seq2seq") or logits.dim() != 3 or logits.shape[1] < labels.shape[1]:
        return None
    # PEFT's prompt tuning prepends virtual tokens (labelled -100 inside PEFT): the labels align with the last positions.
    logits = logits[:, logits.shape[1] - labels.shape[1]:]
    if task == "causal_lm":  # predicts token t + 1 at position t
        logits, labels = logits[:, :-1], labels[:, 1:]
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


class EvaluationSums:
    """Accumulates validation/test sums per stage and logs the split's metrics at the epoch's end.

    The host is a ``LightningModule`` with ``task``, ``tokenizer`` and ``generate_texts`` (chat answers).
    """

    _sums: dict[str, torch.Tensor]

    def _reset_sums(self, stage: str) -> None:
        """Drops the running sums of ``stage``: an evaluation that stopped with an exception (an out-of-memory
        batch, a Ctrl-C in a notebook) left its partial sums behind, and the next run of that loop added them to its
        own, counting the first batches twice (``val_acc`` 0.35 instead of 0.333 on 12 rows).

        Args:
            stage: ``val`` or ``test``.
        """
        self._sums = {k: v for k, v in getattr(self, "_sums", {}).items() if not k.startswith(stage + "_")}

    def on_validation_epoch_start(self) -> None:
        """Starts the validation sums from zero (see :meth:`_reset_sums`)."""
        self._reset_sums("val")

    def on_test_epoch_start(self) -> None:
        """Starts the test sums from zero (see :meth:`_reset_sums`)."""
        self._reset_sums("test")

    def _counted_loss(self, batch: dict, output: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of per-item losses, number of items): items are examples or predicted tokens; label -100 is none
        (prompt tokens, padding, and the rows that pad an evaluation split to a multiple of the ranks)."""
        labels = batch["labels"][:, 1:] if self.task == "causal_lm" else batch["labels"]  # causal LMs shift by one
        count = (labels != -100).sum()
        loss = output.loss.detach()
        if loss.dtype != torch.float32:
            with torch.no_grad():
                exact = fp32_mean_loss(self.task, output.logits.detach(), batch["labels"])
            loss = loss if exact is None else exact
        # The mean over no items is NaN (and NaN * 0 is NaN): such a batch (all padding) adds 0.
        return torch.where(count > 0, loss.float() * count, 0.0), count

    def _accumulate(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().float()
        self._sums[name] = self._sums.get(name, torch.zeros((), device=value.device)) + value

    def _evaluation_step(self, batch: dict, stage: str) -> None:
        output = self(**model_inputs(batch))
        loss_sum, count = self._counted_loss(batch, output)
        self._accumulate(f"{stage}_loss_sum", loss_sum)
        self._accumulate(f"{stage}_count", count)
        if self.task in CLASSIFICATION_TASKS:
            correct = (output.logits.argmax(-1) == batch["labels"]).sum()
            self._accumulate(f"{stage}_correct", correct)
        elif "gen_input_ids" in batch and self.tokenizer is not None:
            # Chat data (peftplug.chat_data) carries left-padded prompts and reference answers: answer accuracy.
            texts = self.generate_texts(batch["gen_input_ids"], batch["gen_attention_mask"])
            pairs = [(t, a) for t, a in zip(texts, batch["gen_answers"]) if a is not None]  # None: a padding row
            correct = sum(answer_matches(t, a) for t, a in pairs)
            self._accumulate(f"{stage}_gen_correct", torch.tensor(float(correct), device=self.device))
            self._accumulate(f"{stage}_gen_count", torch.tensor(float(len(pairs)), device=self.device))

    def _log_reduced(self, name: str, value: torch.Tensor) -> None:
        """Logs a dataset-level value that every rank already holds (computed from sums reduced across ranks).

        ``sync_dist`` with ``max``: the max of equal values is exact (a mean would divide a sum by the world size,
        off by an ulp), and Lightning no longer warns that an epoch-level value under DDP should be synced.

        Args:
            name: The metric's name.
            value: Its value, equal on every rank.
        """
        self.log(name, value, prog_bar=True, sync_dist=True, reduce_fx="max")

    def _log_epoch_metrics(self, stage: str) -> torch.Tensor | None:
        """Logs exact dataset-level loss and metric (sums reduced across ranks, then divided); returns the loss
        (``None`` when the stage saw no rows)."""
        sums = {k: self.trainer.strategy.reduce(v, reduce_op="sum") for k, v in self._sums.items()
                if k.startswith(stage + "_")}
        self._reset_sums(stage)
        count = sums.get(f"{stage}_count")
        if count is None or count.item() == 0:
            return None
        loss = sums[f"{stage}_loss_sum"] / count
        self._log_reduced(f"{stage}_loss", loss)
        if self.task in CLASSIFICATION_TASKS:
            self._log_reduced(f"{stage}_acc", sums[f"{stage}_correct"] / count)
            return loss
        self._log_reduced(f"{stage}_ppl", torch.exp(loss.clamp(max=80.0)))
        generated = sums.get(f"{stage}_gen_count")
        if generated is not None and generated.item() > 0:
            self._log_reduced(f"{stage}_acc", sums[f"{stage}_gen_correct"] / generated)
        return loss
