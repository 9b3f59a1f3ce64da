"""Hugging Face ``Trainer`` (not TRL's subclasses) with OFTv2, QOFT, steering and PCT adapters, LoRA as the control:
``resume_from_checkpoint=True`` continues bit for bit (adapter weights, Adam moments, scheduler),
``load_best_model_at_end`` puts the best checkpoint's adapter back (not the last one), ``save_model`` and a
``save_only_model`` checkpoint reload with ``PeftModel.from_pretrained`` in a fresh process, gradient checkpointing
(reentrant or not) trains exactly like without, and a steering ``operator="ablate"`` vector that is still zero (zero
gradient: it would never move) is refused when the Trainer puts the model in training mode."""

from __future__ import annotations

import json
import shutil

import peft
import pytest
import torch

pytest.importorskip("transformers")

from transformers import Trainer, TrainerCallback, TrainingArguments

import oftv2
import prompt_transfer as pt
from peftplug.tiny import tiny_model
from steering import SteeringConfig

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

IDS = [[5, 9, 14, 20, 33, 41]]


def _rows(n: int = 8, length: int = 12, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 90, (n, length), generator=gen)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def _decomposition(tmp_path) -> str:
    path = tmp_path / "dec"
    if not path.is_dir():
        gen = torch.Generator().manual_seed(0)
        prompts = {f"src{i}": torch.randn(4, 64, generator=gen) * 0.5 for i in range(3)}
        pt.save_decomposition(pt.decompose(prompts, contrastive_steps=30), str(path))
    return str(path)


def _model(kind: str, tmp_path, dropout: float = 0.0):
    """A fresh ``PeftModel`` of ``kind``; the same weights on every call (LoRA's random init seeded too)."""
    if kind == "qoft":
        pytest.importorskip("bitsandbytes")
        from peftplug.loading import load_model

        return peft.get_peft_model(load_model("tiny:llama", "causal_lm", quantization="nf4"),
                                   oftv2.OFTv2Config(block_size=8, target_modules=["q_proj", "v_proj"]))
    configs = {
        "lora": lambda: peft.LoraConfig(target_modules="all-linear", r=4, init_lora_weights=False),
        "oftv2": lambda: oftv2.OFTv2Config(block_size=8, target_modules="all-linear", module_dropout=dropout),
        "steering": lambda: SteeringConfig(layers=[0, 1], task_type="CAUSAL_LM"),
        "pct": lambda: pt.PCTConfig(task_type="CAUSAL_LM", num_virtual_tokens=4,
                                    decomposition_path=_decomposition(tmp_path)),
    }
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return peft.get_peft_model(tiny_model("llama", seed=0), configs[kind]())


def _args(output_dir, **overrides) -> TrainingArguments:
    return TrainingArguments(**{
        "output_dir": str(output_dir), "max_steps": 4, "per_device_train_batch_size": 2, "learning_rate": 1e-2,
        "use_cpu": True, "report_to": [], "save_strategy": "no", "logging_steps": 1, "disable_tqdm": True,
        "dataloader_num_workers": 0, "seed": 0, **overrides,
    })


def _trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor(IDS)).logits


KINDS = ["lora", "oftv2", "steering", "pct", "qoft"]


@pytest.mark.parametrize("kind", KINDS)
def test_resume_from_checkpoint_true_continues_bit_for_bit(tmp_path, kind):
    full = Trainer(model=_model(kind, tmp_path), train_dataset=_rows(),
                   args=_args(tmp_path / "full", save_strategy="steps", save_steps=2))
    full.train()
    # resume_from_checkpoint=True takes the newest checkpoint of output_dir: give it a folder holding step 2 only.
    shutil.copytree(tmp_path / "full" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    resumed = Trainer(model=_model(kind, tmp_path), train_dataset=_rows(),
                      args=_args(tmp_path / "resumed", save_strategy="steps", save_steps=2))
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4
    expected, got = _trainable(full.model), _trainable(resumed.model)
    assert got.keys() == expected.keys() and expected
    for name, value in got.items():
        assert torch.equal(value, expected[name]), name
    # Adam's moments (a fresh optimizer would have taken other steps 3 and 4) and the schedule were restored.
    want, have = full.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert want.keys() == have.keys() and want
    for index, state in want.items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(have[index][key]), torch.as_tensor(value)), (index, key)
    assert resumed.lr_scheduler.state_dict() == full.lr_scheduler.state_dict()


class _Snapshots(TrainerCallback):
    """The trainable weights after each optimizer step."""

    def __init__(self):
        self.by_step: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.by_step[state.global_step] = _trainable(model)


@pytest.mark.parametrize("kind", KINDS)
def test_load_best_model_at_end_loads_the_best_checkpoint(tmp_path, kind):
    scores = [2.0, 0.0, 1.0]  # the metric of the evaluations after steps 1, 2, 3: step 1 is the best

    def compute_metrics(_):
        return {"score": scores.pop(0) if scores else 0.0}

    snapshots = _Snapshots()
    trainer = Trainer(
        model=_model(kind, tmp_path), train_dataset=_rows(), eval_dataset=_rows(2, seed=1), callbacks=[snapshots],
        compute_metrics=compute_metrics, preprocess_logits_for_metrics=lambda logits, labels: logits[..., :1],
        args=_args(tmp_path / "out", max_steps=3, eval_strategy="steps", eval_steps=1, save_strategy="steps",
                   save_steps=1, load_best_model_at_end=True, metric_for_best_model="score", greater_is_better=True))
    trainer.train()
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-1")
    got = _trainable(trainer.model)
    assert any(not torch.equal(got[n], v) for n, v in snapshots.by_step[3].items()), "the last model was kept"
    for name, value in snapshots.by_step[1].items():
        assert torch.equal(got[name], value), name
    # What evaluates now is the step-1 model too (no rotation cache or add plan left from the step-3 evaluation).
    logged = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    assert trainer.evaluate()["eval_loss"] == pytest.approx(logged[0], abs=1e-6)


@pytest.mark.parametrize("kind", ["oftv2", "steering", "pct"])
def test_saved_adapters_reload_in_a_fresh_process(tmp_path, run_fresh, kind):
    trainer = Trainer(model=_model(kind, tmp_path), train_dataset=_rows(),
                      args=_args(tmp_path / "out", max_steps=2, save_strategy="steps", save_steps=2,
                                 save_only_model=True))
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert not (checkpoint / "optimizer.pt").exists()  # save_only_model: the adapter and the trainer state only
    torch.save(_logits(trainer.model), tmp_path / "reference.pt")
    package = {"oftv2": "oftv2", "steering": "steering", "pct": "prompt_transfer"}[kind]
    proc = run_fresh(f"""
        import json, torch
        import {package}
        from peft import PeftModel
        from peftplug.tiny import tiny_model
        # One thread, as for the reference (conftest's _single_thread): bit-equal needs the same reduction order,
        # and on a 2-core AVX2 CPU two threads put the logits 1.5e-7 off.
        torch.set_num_threads(1)
        reference = torch.load({str(tmp_path / "reference.pt")!r})
        diffs = []
        for folder in ({str(tmp_path / "final")!r}, {str(checkpoint)!r}):
            model = PeftModel.from_pretrained(tiny_model("llama", seed=0), folder).eval()
            with torch.no_grad():
                diffs.append((model(input_ids=torch.tensor({IDS})).logits - reference).abs().max().item())
        print(json.dumps(diffs))
    """)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [0.0, 0.0]


@pytest.mark.parametrize("kind", ["oftv2", "steering", "pct"])
def test_gradient_checkpointing_trains_exactly_like_without(tmp_path, kind):
    # Plain Trainer, unlike TRL's, does not call enable_input_require_grads itself; OFTv2's block dropout must draw
    # the same blocks when a checkpointed layer is recomputed.
    runs = {}
    for reentrant in (None, True, False):
        extra = {} if reentrant is None else {
            "gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": reentrant}}
        model = _model(kind, tmp_path, dropout=0.2)
        before = _trainable(model)
        trainer = Trainer(model=model, train_dataset=_rows(), args=_args(tmp_path / str(reentrant), max_steps=2,
                                                                          **extra))
        trainer.train()
        assert trainer.model.get_base_model().model.gradient_checkpointing is (reentrant is not None)
        runs[reentrant] = _trainable(trainer.model)
        assert all(not torch.equal(before[n], p) for n, p in runs[reentrant].items()), "a parameter did not train"
    for reentrant in (True, False):
        for name, value in runs[None].items():
            assert torch.equal(runs[reentrant][name], value), (reentrant, name)


def test_trainer_refuses_a_zero_ablation_vector(tmp_path):
    model = peft.get_peft_model(tiny_model("llama", seed=0),
                                SteeringConfig(layers=[0, 1], task_type="CAUSAL_LM", operator="ablate"))
    layer = model.base_model.steering_layers()[0]
    hidden = torch.randn(1, 3, layer.hidden_size)
    # Why it is refused: at v = 0 the ablation's gradient is exactly zero, so no optimizer could ever move it.
    with torch.enable_grad():
        layer.steer(hidden).sum().backward()
    assert not layer.steer_vector["default"].grad.any()
    trainer = Trainer(model=model, train_dataset=_rows(), args=_args(tmp_path / "out", max_steps=2))
    with pytest.raises(ValueError, match=r"operator='ablate'.*'default' at layer 0, 'default' at layer 1"):
        trainer.train()


def test_a_set_ablation_vector_trains(tmp_path):
    model = peft.get_peft_model(tiny_model("llama", seed=0),
                                SteeringConfig(layers=[0, 1], task_type="CAUSAL_LM", operator="ablate"))
    gen = torch.Generator().manual_seed(0)
    model.base_model.set_vectors({i: torch.randn(64, generator=gen) for i in (0, 1)})
    before = _trainable(model)
    Trainer(model=model, train_dataset=_rows(), args=_args(tmp_path / "out", max_steps=2)).train()
    assert all(not torch.equal(before[n], p) for n, p in _trainable(model).items())
