"""TRL's SFTTrainer with our adapters on a tiny Llama: OFTv2 (assistant-only and completion-only loss, save and
reload, tokens added by a chat template), a trainable steering vector, and PCT."""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")

from datasets import Dataset
from peft import PeftModel
from trl_helpers import GENERATION_TEMPLATE, messages_rows, prompt_completion_rows

import oftv2  # noqa: F401
import prompt_transfer as pt
import steering  # noqa: F401
from oftv2 import OFTv2Config
from peftplug.tiny import char_tokenizer, tiny_model
from steering import SteeringConfig


def _chat_tokenizer():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = GENERATION_TEMPLATE
    return tokenizer


def _greedy(model, tokenizer, question: str) -> str:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             pad_token_id=0)
    return tokenizer.decode(out[0, ids.shape[1]:])


def _trained_labels(trainer, tokenizer) -> list[str]:
    """The text of every label-bearing token run of each example (what the loss sees)."""
    texts = []
    for row in trainer.train_dataset:
        labels = trainer.data_collator([row])["labels"][0].tolist()
        texts.append(tokenizer.decode([t for t in labels if t != -100]))
    return texts


def test_assistant_only_loss_trains_on_every_answer_and_reloads(trl_args, tmp_path):
    tokenizer = _chat_tokenizer()
    rows = messages_rows()
    trainer = trl.SFTTrainer(
        model=tiny_model("llama"), args=trl_args(trl.SFTConfig, assistant_only_loss=True, max_steps=4),
        train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
        peft_config=OFTv2Config(target_modules="all-linear", block_size=8),
    )
    # Loss on both assistant turns (answer + end-of-turn token) and nothing else.
    eos = tokenizer.eos_token
    expected = [f"{r['messages'][1]['content']}{eos}{r['messages'][3]['content']}{eos}" for r in rows]
    assert _trained_labels(trainer, tokenizer) == expected
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert before and all("oftv2_Q" in n for n in before)
    trainer.train()
    assert all(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters() if n in before)

    trainer.model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(tiny_model("llama"), tmp_path / "adapter")
    for question in ("add 1 2", "add 3 3"):
        assert _greedy(reloaded, tokenizer, question) == _greedy(trainer.model, tokenizer, question)
    ids = torch.tensor([[5, 9, 14, 20, 33]])
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, trainer.model(ids).logits, atol=1e-6)


def test_assistant_only_loss_needs_generation_markers(trl_args):
    # The tiny tokenizer's ChatML template has no {% generation %} markers, like SmolLM2's: TRL refuses.
    with pytest.raises(ValueError, match="generation"):
        trl.SFTTrainer(
            model=tiny_model("llama"), args=trl_args(trl.SFTConfig, assistant_only_loss=True),
            train_dataset=Dataset.from_list(messages_rows()), processing_class=char_tokenizer(),
            peft_config=OFTv2Config(target_modules="all-linear", block_size=8),
        )


def test_prompt_completion_format_masks_the_prompt_with_any_template(trl_args):
    # The alternative for templates without markers (docs/trl.md): prompt/completion rows, loss on the completion.
    tokenizer = char_tokenizer()
    rows = prompt_completion_rows()
    trainer = trl.SFTTrainer(
        model=tiny_model("llama"), args=trl_args(trl.SFTConfig), train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer, peft_config=OFTv2Config(target_modules="all-linear", block_size=8),
    )
    texts = _trained_labels(trainer, tokenizer)
    # The template's newline after the end-of-turn token belongs to the completion too.
    assert texts == [f"{r['completion'][0]['content']}{tokenizer.eos_token}\n" for r in rows]
    trainer.train()
    assert trainer.state.global_step == 2


@pytest.fixture
def token_adding_template(tmp_path):
    """A tokenizer folder whose chat template uses two added special tokens: TRL's chat_template_path clones it
    into the training tokenizer, resizes the model and marks the new token rows trainable."""
    source = char_tokenizer()
    source.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    source.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    path = tmp_path / "template_source"
    source.save_pretrained(path)
    return str(path)


def test_tokens_added_by_the_chat_template_train_and_reload(trl_args, token_adding_template, tmp_path):
    config = OFTv2Config(target_modules="all-linear", block_size=8)
    trainer = trl.SFTTrainer(
        model=tiny_model("llama"), args=trl_args(trl.SFTConfig, chat_template_path=token_adding_template, max_steps=1),
        train_dataset=Dataset.from_list(prompt_completion_rows()), processing_class=char_tokenizer(),
        peft_config=config,
    )
    # TRL wrote PEFT's LoRA-style fields onto our config; both are honoured.
    assert config.trainable_token_indices and "embed_tokens" in config.trainable_token_indices
    assert config.modules_to_save == ["lm_head"]
    vocab = trainer.model.config.vocab_size
    trainer.train()
    trainer.model.save_pretrained(tmp_path / "adapter")

    base = tiny_model("llama")
    base.resize_token_embeddings(vocab)  # as for LoRA: the base must have the grown vocabulary first
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    new_id = config.trainable_token_indices["embed_tokens"][0]
    ids = torch.tensor([[new_id, 5, 9, new_id + 1, 14]])
    trainer.model.eval()
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, trainer.model(ids).logits, atol=1e-6)


def test_a_trainable_steering_vector_trains_under_sft(trl_args, tmp_path):
    trainer = trl.SFTTrainer(
        model=tiny_model("llama"), args=trl_args(trl.SFTConfig),
        train_dataset=Dataset.from_list(prompt_completion_rows()), processing_class=char_tokenizer(),
        peft_config=SteeringConfig(layers=[1], task_type="CAUSAL_LM"),
    )
    trainable = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert len(trainable) == 1 and "steer_" in next(iter(trainable))
    trainer.train()
    name, before = next(iter(trainable.items()))
    assert not torch.equal(trainer.model.get_parameter(name), before)
    trainer.model.save_pretrained(tmp_path / "vector")
    reloaded = PeftModel.from_pretrained(tiny_model("llama"), tmp_path / "vector")
    ids = torch.tensor([[5, 9, 14, 20, 33]])
    trainer.model.eval()
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, trainer.model(ids).logits, atol=1e-6)


def test_steering_refuses_tokens_added_by_the_chat_template(trl_args, token_adding_template):
    with pytest.raises(ValueError, match="trainable_token_indices must be None"):
        trl.SFTTrainer(
            model=tiny_model("llama"), args=trl_args(trl.SFTConfig, chat_template_path=token_adding_template),
            train_dataset=Dataset.from_list(prompt_completion_rows()), processing_class=char_tokenizer(),
            peft_config=SteeringConfig(layers=[1], task_type="CAUSAL_LM"),
        )


class PCTSFTTrainer(trl.SFTTrainer):
    """SFTTrainer plus PCT's auxiliary contrastive loss (the recipe docs/trl.md gives)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        aux = pt.auxiliary_loss(model)
        if aux is not None:
            loss = loss + aux
        return (loss, outputs) if return_outputs else loss


@pytest.mark.parametrize("trainer_cls", [trl.SFTTrainer, PCTSFTTrainer], ids=["plain", "with_contrastive"])
def test_pct_trains_under_sft(trl_args, decomposition, trainer_cls):
    trainer = trainer_cls(
        model=tiny_model("llama"), args=trl_args(trl.SFTConfig),
        train_dataset=Dataset.from_list(prompt_completion_rows()), processing_class=char_tokenizer(),
        peft_config=pt.PCTConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, decomposition_path=decomposition,
                                 contrastive_weight=0.5),
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert before and all("prompt_encoder" in n for n in before)
    trainer.train()
    changed = [n for n, p in trainer.model.named_parameters() if n in before and not torch.equal(p, before[n])]
    assert changed and torch.isfinite(torch.tensor(trainer.state.log_history[0]["loss"]))


def test_pct_refuses_tokens_added_by_the_chat_template(trl_args, decomposition, token_adding_template):
    with pytest.raises(ValueError, match="trainable_token_indices must be None"):
        trl.SFTTrainer(
            model=tiny_model("llama"), args=trl_args(trl.SFTConfig, chat_template_path=token_adding_template),
            train_dataset=Dataset.from_list(prompt_completion_rows()), processing_class=char_tokenizer(),
            peft_config=pt.PCTConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, decomposition_path=decomposition),
        )
