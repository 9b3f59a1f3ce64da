"""PeftModule: training for each task, adapter-only checkpoints, metrics, non-finite skipping, quantized bases and
the zeroth-order hook (with a real two-point SPSA optimizer defined here)."""

from __future__ import annotations

import functools
import json
import math

import lightning as L
import pytest
import torch
from peft import LoraConfig

from peftplug.data import CausalLMData, TextClassificationData
from peftplug.errors import ConfigError, MissingFileError
from peftplug.lightning import PeftModule


class SPSA(torch.optim.Optimizer):
    """Two-point SPSA (MeZO-style ZO-SGD): g = (L(θ+εz) - L(θ-εz)) / 2ε · z, z ~ N(0, I) from a seed.

    Args:
        params: Parameters.
        lr: Step size.
        eps: Perturbation scale.
        seed: Seed of the private generator that draws one seed per step (z is regenerated, never stored).
        check_deterministic: Evaluate the closure twice at θ+εz and require equal losses (dropout must be off).
    """

    is_zeroth_order = True

    def __init__(self, params, lr=1e-2, eps=1e-3, seed=0, check_deterministic=False):
        super().__init__(params, {"lr": lr, "eps": eps})
        self.generator = torch.Generator().manual_seed(seed)
        self.check_deterministic = check_deterministic
        self.closure_calls = 0
        self.history = []

    def _add_z(self, seed, scale):
        g = torch.Generator().manual_seed(seed)
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(torch.randn(p.shape, generator=g), alpha=scale(group))  # under no_grad: bumps the version

    @torch.no_grad()
    def step(self, closure):
        def call():
            self.closure_calls += 1
            loss = closure()
            assert loss.dtype == torch.float32 and loss.dim() == 0
            return loss

        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=self.generator))
        self._add_z(seed, lambda g: g["eps"])
        plus = call()
        if self.check_deterministic:
            assert torch.equal(call(), plus), "closure is not deterministic: is dropout on?"
        self._add_z(seed, lambda g: -2 * g["eps"])
        minus = call()
        self._add_z(seed, lambda g: g["eps"])
        if not torch.isfinite(plus - minus):
            return plus
        c = float((plus - minus) / (2 * self.param_groups[0]["eps"]))
        self._add_z(seed, lambda g: -g["lr"] * c)
        self.history.append({"seed": seed, "plus": float(plus), "minus": float(minus), "c": c,
                                 "lr": self.param_groups[0]["lr"]})
        return (plus + minus) / 2


def _trainer(tmp_path, **kw):
    defaults = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False,
                    "enable_progress_bar": False, "enable_model_summary": False, "default_root_dir": tmp_path,
                    "num_sanity_val_steps": 0}
    defaults.update(kw)
    return L.Trainer(**defaults)


@pytest.fixture
def instruction_file(tmp_path):
    path = tmp_path / "instr.jsonl"
    rows = [{"prompt": f"Q{i}: add {i} and {i}?", "response": f" {2 * i}"} for i in range(12)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


@pytest.fixture
def cls_file(tmp_path):
    path = tmp_path / "cls.csv"
    lines = ["sentence,topic"] + [f"{'good great fine' if i % 2 else 'bad awful poor'} {i},{'pos' if i % 2 else 'neg'}"
                                  for i in range(24)]
    path.write_text("\n".join(lines))
    return path


def _trainable(module):
    return {n: p.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad}


def test_causal_lm_fit_logs_loss_and_perplexity(tmp_path, instruction_file):
    module = PeftModule("tiny:llama", peft=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
                        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    data = CausalLMData(train_file=str(instruction_file), prompt_column="prompt", response_column="response",
                        batch_size=4, val_fraction=0.25)
    before = _trainable(module)
    trainer = _trainer(tmp_path, max_steps=3, val_check_interval=3)
    trainer.fit(module, datamodule=data)
    metrics = trainer.callback_metrics
    assert trainer.global_step == 3 and module.automatic_optimization
    assert math.isfinite(float(metrics["train_loss"]))
    torch.testing.assert_close(metrics["val_ppl"], torch.exp(metrics["val_loss"]))
    after = _trainable(module)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    assert module.model.training  # first-order training runs with dropout on

    # val_loss is the token-weighted mean over the whole split: recompute it batch by batch.
    module.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in data.val_dataloader():
            out = module(**batch)
            n = int((batch["labels"][:, 1:] != -100).sum())
            total, count = total + float(out.loss) * n, count + n
    assert float(metrics["val_loss"]) == pytest.approx(total / count, rel=1e-5)


def test_classification_checkpoint_is_adapter_only_and_restores(tmp_path, cls_file):
    peft = LoraConfig(r=4, target_modules=["query", "value"], modules_to_save=["classifier"])
    module = PeftModule("tiny:bert", task="seq_cls", num_labels=2, peft=peft,
                        optimizer=lambda p: torch.optim.AdamW(p, lr=5e-3))
    data = TextClassificationData(train_file=str(cls_file), text_column="sentence", label_column="topic",
                                  batch_size=8, val_fraction=0.25, max_length=32)
    ckpt_cb = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer = _trainer(tmp_path, max_steps=4, enable_checkpointing=True, callbacks=[ckpt_cb])
    trainer.fit(module, datamodule=data)
    assert data.label_names == ["neg", "pos"]

    # val_acc equals the accuracy of the module's own predictions on the validation split. Validated again after
    # fit: the last validation of fit may precede the last steps (4 steps do not end an epoch), and whether those
    # steps change a prediction depended on the head's random init, i.e. on the tests that ran before.
    trainer.validate(module, datamodule=data, verbose=False)
    module.eval()
    with torch.no_grad():
        preds = torch.cat([module.predict_step(b, 0) for b in data.val_dataloader()])
    labels = torch.tensor([f["labels"] for f in data.splits["validation"]])
    assert float(trainer.callback_metrics["val_acc"]) == pytest.approx(float((preds == labels).float().mean()))

    checkpoint = torch.load(ckpt_cb.last_model_path, weights_only=False)
    keys = set(checkpoint["state_dict"])
    assert keys == set(module.adapter_state_keys())
    assert any("lora_A" in k for k in keys) and any("classifier" in k and "modules_to_save" in k for k in keys)
    assert not any("word_embeddings" in k for k in keys)
    assert checkpoint["peftplug"]["format"] == "adapter-only/1"

    restored = PeftModule.load_from_checkpoint(ckpt_cb.last_model_path, weights_only=False)
    trained, loaded = _trainable(module), _trainable(restored)
    assert trained.keys() == loaded.keys()
    for name in trained:
        assert torch.equal(trained[name], loaded[name]), name
    restored.eval()
    batch = next(iter(data.val_dataloader()))
    with torch.no_grad():
        assert torch.equal(module(**batch).logits, restored(**batch).logits)

    # A checkpoint of another adapter does not load silently.
    other = PeftModule("tiny:bert", task="seq_cls", num_labels=2,
                       peft=LoraConfig(r=2, target_modules=["query"], modules_to_save=["classifier"]))
    with pytest.raises(ConfigError, match="does not fit"):
        other.on_load_checkpoint(checkpoint)


def test_seq2seq_fit(tmp_path, instruction_file):
    module = PeftModule("tiny:t5", task="seq2seq", peft=LoraConfig(r=4, target_modules=["q", "v"]))
    data = CausalLMData(train_file=str(instruction_file), prompt_column="prompt", response_column="response",
                        batch_size=4, val_fraction=0.25)
    trainer = _trainer(tmp_path, max_steps=2, limit_val_batches=1, val_check_interval=2)
    trainer.fit(module, datamodule=data)
    assert math.isfinite(float(trainer.callback_metrics["val_ppl"]))
    assert data.splits["train"][0]["labels"][-1] == 2  # T5 targets end in EOS


def test_nonfinite_loss_is_skipped(tmp_path, instruction_file):
    class PoisonedOnce(PeftModule):
        poison = True

        def forward(self, **batch):
            out = super().forward(**batch)
            if self.training and self.poison:
                self.poison = False
                out.loss = out.loss * float("nan")
            return out

    module = PoisonedOnce("tiny:llama", peft=LoraConfig(r=4, target_modules=["q_proj"]),
                          optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1))
    data = CausalLMData(train_file=str(instruction_file), prompt_column="prompt", response_column="response",
                        batch_size=4)
    snapshots = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            snapshots.append(_trainable(pl_module))

    before = _trainable(module)
    _trainer(tmp_path, max_steps=2, limit_val_batches=0, callbacks=[Record()]).fit(module, datamodule=data)
    assert module.nonfinite_steps == 1
    for name in before:  # the poisoned first step changed nothing, not even through weight decay
        assert torch.equal(before[name], snapshots[0][name]), name
    assert any(not torch.equal(snapshots[0][n], snapshots[1][n]) for n in before)
    assert all(torch.isfinite(p).all() for p in snapshots[1].values())


def test_zeroth_order_hook_spsa(tmp_path, instruction_file):
    optimizers = []

    def make_spsa(params):
        optimizers.append(SPSA(params, lr=0.05, eps=1e-3, seed=1, check_deterministic=True))
        return optimizers[-1]

    peft = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.5, init_lora_weights=False)
    module = PeftModule("tiny:llama", peft=peft, optimizer=make_spsa,
                        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    data = CausalLMData(train_file=str(instruction_file), prompt_column="prompt", response_column="response",
                        batch_size=16, val_fraction=0.25)  # 9 training rows: one batch, the same every step
    theta0 = _trainable(module)
    trainer = _trainer(tmp_path, max_steps=3, limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    spsa = optimizers[0]
    assert not module.automatic_optimization
    assert trainer.global_step == 3  # steps counted through the LightningOptimizer
    assert spsa.closure_calls == 9  # two points + the determinism check, per step
    assert [h["lr"] for h in spsa.history] == pytest.approx([0.05, 0.025, 0.0125])  # scheduler stepped per step
    assert float(trainer.callback_metrics["train_loss"]) == pytest.approx(
        (spsa.history[-1]["plus"] + spsa.history[-1]["minus"]) / 2)

    # Replay: the closure computed the loss of the batch at θ ± εz, and the update was -lr·c·z.
    trained = _trainable(module)
    module.eval()
    batch = next(iter(data.train_dataloader()))
    named = [(n, p) for n, p in module.model.named_parameters() if p.requires_grad]
    theta = {n: theta0[n].clone() for n, _ in named}
    for record in spsa.history:
        g = torch.Generator().manual_seed(record["seed"])
        z = {n: torch.randn(theta[n].shape, generator=g) for n, _ in named}
        with torch.no_grad():
            for n, p in named:
                p.copy_(theta[n] + 1e-3 * z[n])
            plus = float(module(**batch).loss)
        assert plus == pytest.approx(record["plus"], rel=1e-4)
        theta = {n: theta[n] - record["lr"] * record["c"] * z[n] for n in theta}
    for n in theta:
        torch.testing.assert_close(theta[n], trained[n], atol=1e-5, rtol=1e-5)


def test_quantized_nf4_base_trains(tmp_path, instruction_file):
    import bitsandbytes as bnb

    module = PeftModule("tiny:llama", quantization="nf4", peft=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
                        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    assert isinstance(module.model.base_model.model.model.layers[0].mlp.up_proj, bnb.nn.Linear4bit)
    data = CausalLMData(train_file=str(instruction_file), prompt_column="prompt", response_column="response",
                        batch_size=4)
    before = _trainable(module)
    _trainer(tmp_path, max_steps=2, limit_val_batches=0).fit(module, datamodule=data)
    after = _trainable(module)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    assert all(torch.isfinite(p).all() for p in after.values())


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(MissingFileError, match="not found"):
        PeftModule("/no/such/model/dir")
    with pytest.raises(ConfigError, match="quantization must be one of none, nf4, fp4, int8; got 'nf3'"):
        PeftModule("tiny:llama", quantization="nf3")
    with pytest.raises(ConfigError, match=r"match no module.*q_proj.*v_proj"):
        PeftModule("tiny:llama", peft=LoraConfig(target_modules=["query", "value"]))
    with pytest.raises(ConfigError, match="peft_type 'NOPE' is unknown"):
        PeftModule("tiny:llama", peft={"peft_type": "NOPE"})
    with pytest.raises(ConfigError, match="task must be one of"):
        PeftModule("tiny:llama", task="summarize")


@pytest.mark.parametrize("trainer_kw, message", [
    ({"accumulate_grad_batches": 2}, "trainer.accumulate_grad_batches: a zeroth-order optimizer steps once per batch"),
    # Lightning's GPU 16-mixed plugin (with its GradScaler), built on the CPU: the same plugin code runs.
    ({"plugins": "scaler"}, "trainer.precision: a zeroth-order optimizer takes no gradient scaler"),
])
def test_zeroth_order_refuses_settings_it_cannot_honour(tmp_path, instruction_file, trainer_kw, message):
    from lightning.pytorch.plugins.precision import MixedPrecision

    if trainer_kw.get("plugins") == "scaler":
        trainer_kw = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}
    module = PeftModule("tiny:llama", peft=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
                        optimizer=functools.partial(SPSA, lr=0.05, eps=1e-3, seed=7))
    data = CausalLMData(train_file=str(instruction_file), prompt_column="prompt", response_column="response",
                        batch_size=4, val_fraction=0.25)
    before = _trainable(module)
    with pytest.raises(ConfigError, match=message):
        _trainer(tmp_path, max_steps=2, **trainer_kw).fit(module, datamodule=data)
    assert all(torch.equal(before[n], p.detach()) for n, p in module.model.named_parameters() if n in before)
