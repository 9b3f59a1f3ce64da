"""PeftModule under Lightning's conventions, second review: chat ``predict`` answers the prompts, a zeroth-order run
refuses ``gradient_clip_val``, a loaded module fitted afresh keeps the run's seed, and evaluation metrics of a model
whose own loss is bf16 are the split's fp32 cross-entropy."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig

from helene import ZOSGD
from peftplug.data import CausalLMData, ChatData, TextClassificationData
from peftplug.errors import ConfigError
from peftplug.lightning import PeftModule, model_inputs

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _trainer(tmp_path, **kw) -> L.Trainer:
    defaults = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False,
                "enable_progress_bar": False, "enable_model_summary": False, "default_root_dir": tmp_path,
                "num_sanity_val_steps": 0}
    return L.Trainer(**{**defaults, **kw})


def _write(path, rows) -> str:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def _instructions(tmp_path) -> CausalLMData:
    rows = [{"prompt": f"Q{i}: add {i} and {i}?", "response": f" {2 * i} " * (i + 1)} for i in range(12)]
    return CausalLMData(train_file=_write(tmp_path / "instr.jsonl", rows), prompt_column="prompt",
                        response_column="response", batch_size=4, val_fraction=0.5)


def _adapter(module: PeftModule) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad}


def test_chat_predict_answers_the_prompts_not_the_whole_conversations(tmp_path):
    # predict used input_ids, the right-padded conversations with their answers, and continued after the padding.
    rows = [{"prompt": f"say {i}", "response": f"n{i}"} for i in range(5)]
    path = _write(tmp_path / "chat.jsonl", rows)
    module = PeftModule("tiny:llama", peft=LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False),
                        max_new_tokens=3)
    data = ChatData(train_file=path, validation_file=path, batch_size=3)
    predicted = [text for batch in _trainer(tmp_path).predict(module, datamodule=data) for text in batch]

    module.eval()
    expected = []
    for batch in data.test_dataloader():
        expected += module.generate_texts(batch["gen_input_ids"], batch["gen_attention_mask"], max_new_tokens=3)
    assert len(predicted) == 5
    assert predicted == expected


def test_a_zeroth_order_run_refuses_gradient_clipping(tmp_path):
    # Lightning refuses clipping under manual optimization, but checks before configure_optimizers switches to it:
    # the setting was silently ignored.
    module = PeftModule("tiny:llama", peft=LoraConfig(r=2, target_modules=["q_proj"]),
                        optimizer=lambda p: ZOSGD(p, lr=1e-3))
    before = _adapter(module)
    with pytest.raises(ConfigError, match=r"^trainer\.gradient_clip_val: a zeroth-order optimizer has no gradients"):
        _trainer(tmp_path, max_steps=2, limit_val_batches=0, gradient_clip_val=0.5).fit(
            module, datamodule=_instructions(tmp_path))
    assert all(torch.equal(before[n], p) for n, p in _adapter(module).items())


def test_a_loaded_module_fitted_afresh_follows_the_seed(tmp_path):
    # The checkpoint's RNG state, meant for a resume (fit with ckpt_path), was restored into any later fit of a module
    # from load_from_checkpoint: runs seeded 1 and 2 drew the same dropout masks and trained the same adapter.
    peft = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.5, init_lora_weights=False)
    module = PeftModule("tiny:llama", peft=peft, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    trainer = _trainer(tmp_path, max_steps=1, limit_val_batches=0)
    trainer.fit(module, datamodule=_instructions(tmp_path))
    trainer.save_checkpoint(tmp_path / "run.ckpt")

    adapters = []
    for seed in (1, 2, 1):
        L.seed_everything(seed)
        loaded = PeftModule.load_from_checkpoint(tmp_path / "run.ckpt", weights_only=False)
        _trainer(tmp_path, max_steps=2, limit_val_batches=0).fit(loaded, datamodule=_instructions(tmp_path))
        adapters.append(_adapter(loaded))
    assert all(torch.equal(adapters[0][n], adapters[2][n]) for n in adapters[0])  # the seed decides ...
    assert not all(torch.equal(adapters[0][n], adapters[1][n]) for n in adapters[0])  # ... not the checkpoint


def _fp32_reference(module: PeftModule, data, task: str) -> float:
    """The split's mean cross-entropy from the model's logits in fp32, one example at a time."""
    total, count = 0.0, 0
    module.eval()
    with torch.no_grad():
        for batch in data.val_dataloader():
            logits, labels = module(**model_inputs(batch)).logits.float(), batch["labels"]
            if task == "seq_cls":
                total += float(F.cross_entropy(logits, labels, reduction="sum"))
            else:
                total += float(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"))
            count += int((labels != -100).sum())
    return total / count


@pytest.mark.parametrize("task", ["seq2seq", "seq_cls"])
def test_bf16_evaluation_loss_is_the_fp32_cross_entropy(tmp_path, task):
    # T5's and BERT's own losses are computed in the logits' dtype: with dtype bfloat16 val_loss was the mean of
    # losses rounded to bf16 (0.5 % off on this split, 2 % on val_ppl).
    torch.manual_seed(0)
    if task == "seq2seq":
        module = PeftModule("tiny:t5", task="seq2seq", dtype="bfloat16", peft=LoraConfig(r=2, target_modules=["q"]))

        def data(batch_size):
            rows = [{"prompt": f"Q{i}: add {i} and {i}?", "response": f" {2 * i} " * (i + 1)} for i in range(8)]
            path = _write(tmp_path / "s2s.jsonl", rows)
            return CausalLMData(train_file=path, validation_file=path, prompt_column="prompt",
                                response_column="response", batch_size=batch_size, task="seq2seq")
    else:
        module = PeftModule("tiny:bert", task="seq_cls", num_labels=3, dtype="bfloat16")

        def data(batch_size):
            rows = [{"text": f"film {i} was {'good ' * (i % 4 + 1)}", "label": i % 3} for i in range(10)]
            path = _write(tmp_path / "cls.jsonl", rows)
            return TextClassificationData(train_file=path, validation_file=path, batch_size=batch_size)
    metrics = _trainer(tmp_path).validate(module, datamodule=data(4), verbose=False)[0]

    # The reference runs the same batches: bf16 logits depend on the batch's shape by more than 1e-5 on some CPUs
    # (2e-5 on an AVX2-only one, whose bf16 matmuls take another path than AVX512-BF16's).
    same = data(4)
    same.tokenizer = module.tokenizer
    same.setup("validate")
    assert metrics["val_loss"] == pytest.approx(_fp32_reference(module, same, task), rel=1e-5)


@pytest.mark.parametrize("task", ["seq_cls", "causal_lm"])
def test_prefix_tuning_is_refused_where_peft_cannot_pass_the_prefix(task):
    # transformers 5 renamed past_key_values (cache) on the classifiers' forward, which PEFT 0.21 looks for outside
    # its causal-LM path: the run stopped at the first forward with PEFT's "Model does not support past key values".
    config = {"peft_type": "PREFIX_TUNING", "num_virtual_tokens": 4}
    if task == "causal_lm":  # PEFT passes the prefix there whatever the signature: it trains
        module = PeftModule("tiny:llama", task=task, peft=config)
        ids = torch.randint(3, 50, (2, 6))
        assert torch.isfinite(module(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss)
        return
    with pytest.raises(ConfigError, match="PREFIX_TUNING with task_type SEQ_CLS.*PROMPT_TUNING"):
        PeftModule("tiny:llama", task=task, num_labels=3, peft=config)


def test_multitask_prompt_tuning_is_refused_when_built():
    # Its forward needs task_ids per batch, which no data module carries: PEFT's "task_ids cannot be None" at step 1.
    with pytest.raises(ConfigError, match="MULTITASK_PROMPT_TUNING needs task_ids"):
        PeftModule("tiny:llama", peft={"peft_type": "MULTITASK_PROMPT_TUNING", "num_virtual_tokens": 4, "num_tasks": 2})
