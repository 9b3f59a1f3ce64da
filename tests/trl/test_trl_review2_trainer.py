"""Our four adapter types under TRL's trainers, checked against references computed here (second review):
gradient checkpointing (reentrant or not) trains exactly like no checkpointing, ``Trainer.evaluate`` reports the
hand-computed loss between optimizer steps (the OFTv2 rotation cache and the steering add plan must see each step),
``load_best_model_at_end`` puts the best checkpoint's adapter back, DPO's reference log-probs (``peft_config=``,
``ref_model=None``) are the base model's after training, and NEFTune noises a PCT model's text embeddings."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

trl = pytest.importorskip("trl")

from datasets import Dataset
from peft import PeftModel
from transformers import TrainerCallback
from trl_helpers import preference_rows, prompt_completion_rows

import prompt_transfer as pt
from oftv2 import OFTv2Config
from peftplug.tiny import char_tokenizer, tiny_model
from steering import SteeringConfig

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

KINDS = ["oftv2", "steering", "pct", "qoft"]
IDS = torch.tensor([[5, 9, 14, 20, 33, 41]])


def _nf4():
    pytest.importorskip("bitsandbytes")
    from peftplug.loading import load_model

    return load_model("tiny:llama", "causal_lm", quantization="nf4")


def _case(kind: str, decomposition: str, dropout: float = 0.0):
    """(model factory, config factory) of an adapter type (``dropout``: OFTv2's block dropout)."""
    if kind == "oftv2":
        return tiny_model, lambda: OFTv2Config(target_modules="all-linear", block_size=8, module_dropout=dropout)
    if kind == "steering":
        return tiny_model, lambda: SteeringConfig(layers=[0, 1], task_type="CAUSAL_LM")
    if kind == "pct":
        return tiny_model, lambda: pt.PCTConfig(task_type="CAUSAL_LM", num_virtual_tokens=4,
                                                decomposition_path=decomposition)
    return _nf4, lambda: OFTv2Config(target_modules=["q_proj", "v_proj"], block_size=8)


def _trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        # Prompt learning (PCT) returns the virtual tokens' positions first: keep the real tokens'.
        return model(IDS, attention_mask=torch.ones_like(IDS)).logits[:, -IDS.shape[1]:]


@pytest.mark.parametrize("kind", KINDS)
def test_gradient_checkpointing_trains_exactly_like_without(trl_args, decomposition, kind):
    # TRL calls enable_input_require_grads for reentrant checkpointing; OFTv2's block dropout (oftv2 case) must
    # draw the same blocks when a checkpointed layer is recomputed.
    make_model, make_config = _case(kind, decomposition, dropout=0.2)
    runs = {}
    for reentrant in (None, True, False):
        # (SFTConfig turns checkpointing on by default: the reference run turns it off.)
        extra = {"gradient_checkpointing": False} if reentrant is None else {
            "gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": reentrant}}
        trainer = trl.SFTTrainer(
            model=make_model(), args=trl_args(trl.SFTConfig, **extra), processing_class=char_tokenizer(),
            train_dataset=Dataset.from_list(prompt_completion_rows()), peft_config=make_config(),
        )
        layer = trainer.model.get_base_model().model.layers[-1]
        layer = getattr(layer, "base_layer", layer)  # (a steered block wraps the decoder layer)
        calls = []
        # (transformers checkpoints the layer's forward, inside its hooks: count a submodule's forwards.)
        layer.mlp.register_forward_hook(lambda *_, calls=calls: calls.append(1))
        before = _trainable(trainer.model)
        # (Without early stop, a non-reentrant recompute runs the whole layer again, so the hook sees it.)
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            trainer.train()
        # Checkpointing recomputes the layer in the backward: two forwards per step instead of one.
        assert len(calls) == (2 if reentrant is None else 4)
        runs[reentrant] = _trainable(trainer.model)
        assert all(not torch.equal(before[n], p) for n, p in runs[reentrant].items()), "a parameter did not train"
    for reentrant in (True, False):
        for name, value in runs[None].items():
            assert torch.equal(runs[reentrant][name], value), (reentrant, name)


class _HandLoss(TrainerCallback):
    """At each evaluation: the reported eval loss and the loss computed here from the model's logits."""

    def __init__(self):
        self.trainer = None
        self.pairs = []

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        trainer = self.trainer
        batch = trainer.data_collator(list(trainer.eval_dataset))
        model = trainer.model
        model.train()  # train mode: neither the rotation cache nor the add plan; the tiny Llama has no dropout
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        model.eval()
        labels = batch["labels"]
        logits = logits[:, -labels.shape[1]:]
        hand = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
                               ignore_index=-100)
        self.pairs.append((metrics["eval_loss"], hand.item()))


@pytest.mark.parametrize("kind", KINDS)
def test_evaluate_between_fused_adam_steps_reports_the_hand_computed_loss(trl_args, decomposition, kind):
    make_model, make_config = _case(kind, decomposition)  # (no block dropout: the hand loss runs in train mode)
    rows = prompt_completion_rows()
    callback = _HandLoss()
    trainer = trl.SFTTrainer(
        model=make_model(), processing_class=char_tokenizer(), peft_config=make_config(), callbacks=[callback],
        # Fused AdamW writes the parameters without bumping their version (oftv2.rotation_cache).
        args=trl_args(trl.SFTConfig, max_steps=3, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4,
                      optim="adamw_torch_fused", learning_rate=5e-2),
        train_dataset=Dataset.from_list(rows[:12]), eval_dataset=Dataset.from_list(rows[12:]),
    )
    callback.trainer = trainer
    trainer.train()
    reported = [r for r, _ in callback.pairs]
    assert len(reported) == 3 and len(set(reported)) == 3  # the adapter moved between evaluations
    for reported_loss, hand in callback.pairs:
        assert reported_loss == pytest.approx(hand, abs=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_load_best_model_at_end_restores_the_best_checkpoints_adapter(trl_args, decomposition, kind):
    make_model, make_config = _case(kind, decomposition)
    rows = prompt_completion_rows()
    trainer = trl.SFTTrainer(
        model=make_model(), processing_class=char_tokenizer(), peft_config=make_config(),
        # greater_is_better on the loss: the best checkpoint is the first, not the last state (which would pass
        # even if nothing were reloaded).
        args=trl_args(trl.SFTConfig, max_steps=3, eval_strategy="steps", eval_steps=1, save_strategy="steps",
                      save_steps=1, load_best_model_at_end=True, metric_for_best_model="eval_loss",
                      greater_is_better=True, per_device_eval_batch_size=4, learning_rate=5e-2),
        train_dataset=Dataset.from_list(rows[:12]), eval_dataset=Dataset.from_list(rows[12:]),
    )
    trainer.train()
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-1") and evals[0] == max(evals)
    best = PeftModel.from_pretrained(make_model(), trainer.state.best_model_checkpoint)
    torch.testing.assert_close(_logits(trainer.model), _logits(best), atol=1e-6, rtol=0)
    assert list(trainer.model.peft_config) == ["default"]
    assert trainer.evaluate()["eval_loss"] == pytest.approx(evals[0], abs=1e-6)


def _sequence_logps(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed completion log-probs of the (chosen, rejected) halves of a DPO batch, computed by hand."""
    ids, mask = batch["input_ids"], batch["completion_mask"]
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=batch["attention_mask"]).logits[:, :-1]
    per_token = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    return (per_token * mask[:, 1:]).sum(1).chunk(2)


@pytest.mark.parametrize("precompute", [False, True], ids=["on_the_fly", "precomputed"])
@pytest.mark.parametrize("kind", KINDS)
def test_dpo_reference_logps_are_the_base_models_after_training(trl_args, decomposition, kind, precompute):
    make_model, make_config = _case(kind, decomposition)
    trainer = trl.DPOTrainer(
        model=make_model(), args=trl_args(trl.DPOConfig, precompute_ref_log_probs=precompute, learning_rate=5e-2),
        train_dataset=Dataset.from_list(preference_rows()), processing_class=char_tokenizer(), peft_config=make_config(),
    )
    trainer.train()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    if precompute:
        assert "ref_chosen_logps" in batch
    inputs = {k: v for k, v in batch.items() if k not in ("ref_chosen_logps", "ref_rejected_logps")}
    ref_chosen, ref_rejected = trainer.compute_ref_log_probs(trainer.model, inputs)
    base_chosen, base_rejected = _sequence_logps(make_model(), batch)
    torch.testing.assert_close(ref_chosen, base_chosen, atol=1e-4, rtol=0)
    torch.testing.assert_close(ref_rejected, base_rejected, atol=1e-4, rtol=0)
    if precompute:  # the stored column was computed the same way
        torch.testing.assert_close(torch.as_tensor(batch["ref_chosen_logps"]), base_chosen, atol=1e-4, rtol=0)
    policy_chosen, _ = _sequence_logps(trainer.model, batch)
    assert (policy_chosen - base_chosen).abs().max() > 1e-3  # the adapter trained: the check above is not vacuous


def test_neftune_noises_the_text_embeddings_of_a_pct_model(trl_args, decomposition):
    # PEFT's prompt-learning forward embeds the text through the base model's embedding module, which NEFTune hooks;
    # the soft prompt itself is not noised. The noise changes training and is gone afterwards.
    make_model, make_config = _case("pct", decomposition)
    losses, outputs = {}, {}
    for alpha in (None, 5.0):
        trainer = trl.SFTTrainer(
            model=make_model(), args=trl_args(trl.SFTConfig, neftune_noise_alpha=alpha),
            train_dataset=Dataset.from_list(prompt_completion_rows()), processing_class=char_tokenizer(),
            peft_config=make_config(),
        )
        embedding = trainer.model.get_base_model().get_input_embeddings()
        seen = []
        handle = embedding.register_forward_hook(
            lambda m, i, o, seen=seen: seen.append(getattr(m, "neftune_noise_alpha", None)))
        trainer.train()
        handle.remove()
        assert seen == [alpha, alpha]  # each training step's text embeddings went through the hooked module
        losses[alpha] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        outputs[alpha] = _logits(trainer.model)
        # Deactivated after training: the embedding is deterministic again.
        embedding.train()
        torch.testing.assert_close(embedding(IDS), embedding(IDS), atol=0, rtol=0)
    assert losses[5.0][0] != losses[None][0]  # the first step's loss already saw the noise
    assert not torch.equal(outputs[5.0], outputs[None])
