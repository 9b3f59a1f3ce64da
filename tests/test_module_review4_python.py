"""PeftModule driven from Python, fourth review: a PeftModel given with ``peft=``, one PeftConfig object reused,
PEFT enums inside a ``class_path`` spec, optimizer/scheduler objects instead of callables, schedulers passed as a class
or a partial without their length, and non-finite micro-batches under gradient accumulation."""

from __future__ import annotations

import functools
import json

import lightning as L
import pytest
import torch
from peft import LoraConfig, PeftModel, TaskType, get_peft_model
from test_nonfinite_steps import PoisonedCalls, warmup

from peftplug.data import CausalLMData
from peftplug.errors import ConfigError
from peftplug.lightning import PeftModule
from peftplug.loading import load_model
from peftplug.schedules import CosineAnnealingLR

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _trainer(tmp_path, **kw) -> L.Trainer:
    defaults = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False,
                "enable_progress_bar": False, "enable_model_summary": False, "default_root_dir": tmp_path,
                "num_sanity_val_steps": 0, "limit_val_batches": 0}
    return L.Trainer(**{**defaults, **kw})


@pytest.fixture
def data(tmp_path) -> CausalLMData:
    path = tmp_path / "instr.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"Q{i}: add {i} and {i}?", "response": f" {2 * i}"})
                              for i in range(12)))
    return CausalLMData(train_file=str(path), prompt_column="prompt", response_column="response", batch_size=4)


def _adapter(module: PeftModule) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad}


def test_a_peft_model_given_with_another_adapter_is_refused(tmp_path):
    # get_peft_model wrapped the PeftModel in a second one: save_pretrained wrote the inner adapter's tensors under
    # `base_model.model.base_model.model...` names, which PeftModel.from_pretrained skips: the reloaded model's
    # logits differed from the trained module's by 0.69, without an error.
    inner = get_peft_model(load_model("tiny:llama", "causal_lm", "none", "float32"),
                           LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    with pytest.raises(ConfigError, match=r"^peft: model is a PeftModel already \(adapter 'default'\).*peft=None"):
        PeftModule(inner, peft=LoraConfig(r=2, target_modules=["v_proj"]))

    # Its own adapter trains and saves as PEFT's: the folder reloads to the same model.
    module = PeftModule(inner)
    assert module.model is inner
    module.eval()
    ids = torch.randint(3, 50, (1, 6))
    with torch.no_grad():
        expected = module.model(input_ids=ids).logits
    module.model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(load_model("tiny:llama", "causal_lm", "none", "float32"),
                                         tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, expected)


def test_one_peft_config_object_serves_modules_of_different_tasks():
    # The module set task_type on the caller's object: the second module, of another task, was refused with
    # "peft.task_type 'SEQ_CLS' does not fit model.task 'causal_lm'", a field the caller never set.
    config = LoraConfig(r=2, target_modules=["q_proj"])
    PeftModule("tiny:llama", task="seq_cls", num_labels=2, peft=config)
    assert config.task_type is None
    module = PeftModule("tiny:llama", task="causal_lm", peft=config)
    assert module.model.peft_config["default"].task_type == "CAUSAL_LM"
    config.r = 16  # an edit of the caller's object after the build no longer changes the module's adapter config
    assert module.model.peft_config["default"].r == 2
    assert module.hparams["peft"]["r"] == 2


def test_peft_enums_inside_a_class_path_spec_leave_the_checkpoint_loadable(tmp_path, data):
    # hparams kept TaskType.CAUSAL_LM inside init_args: load_from_checkpoint and fit(ckpt_path=...), which load with
    # torch's weights_only=True, failed with UnpicklingError.
    spec = {"class_path": "peft.LoraConfig",
            "init_args": {"r": 2, "target_modules": ["q_proj"], "task_type": TaskType.CAUSAL_LM}}
    module = PeftModule("tiny:llama", peft=spec, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    trainer = _trainer(tmp_path, max_steps=1)
    trainer.fit(module, datamodule=data)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    assert module.hparams["peft"]["init_args"]["task_type"] == "CAUSAL_LM"

    loaded = PeftModule.load_from_checkpoint(tmp_path / "run.ckpt")
    trained, restored = _adapter(module), _adapter(loaded)
    assert trained.keys() == restored.keys() and all(torch.equal(trained[n], restored[n]) for n in trained)
    resumed = _trainer(tmp_path, max_steps=2)
    resumed.fit(PeftModule("tiny:llama", peft=spec), datamodule=data, ckpt_path=tmp_path / "run.ckpt")
    assert resumed.global_step == 2


@pytest.mark.parametrize("field, value, got", [
    ("optimizer", {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-3}}, "a dict"),
    ("optimizer", torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]), "a built AdamW"),
    ("lr_scheduler", {"class_path": "torch.optim.lr_scheduler.StepLR", "init_args": {"step_size": 1}}, "a dict"),
])
def test_an_optimizer_or_scheduler_that_is_not_a_callable_is_refused_when_built(field, value, got):
    # It failed at fit's configure_optimizers with "TypeError: 'dict' object is not callable".
    with pytest.raises(ConfigError, match=rf"^model\.{field} must be a callable that builds it .*; got {got}"):
        PeftModule("tiny:llama", **{field: value})


@pytest.mark.parametrize("factory, length", [
    (CosineAnnealingLR, "T_max"),
    (functools.partial(CosineAnnealingLR, eta_min=1e-6), "T_max"),
    (functools.partial(torch.optim.lr_scheduler.OneCycleLR, max_lr=1e-4), "total_steps"),
], ids=["cosine_class", "cosine_partial", "one_cycle_partial"])
def test_a_schedule_given_without_its_length_follows_the_run(tmp_path, data, factory, length):
    # Python callers pass the class, or a partial leaving the length out: our CosineAnnealingLR said "null means
    # the run's length, which only a training run knows" during the training run, OneCycleLR raised torch's
    # "You must define either total_steps OR (epochs AND steps_per_epoch)".
    module = PeftModule("tiny:llama", peft=LoraConfig(r=2, target_modules=["q_proj"]), lr_scheduler=factory)
    trainer = _trainer(tmp_path, max_steps=3)
    trainer.fit(module, datamodule=data)
    scheduler = module.lr_schedulers()
    assert getattr(scheduler, length) == 3
    # The learning rate the run ended at is the one of the schedule written out with the run's length.
    reference_optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-4)
    reference = factory(reference_optimizer, **{length: 3})
    for _ in range(3):
        reference_optimizer.step()
        reference.step()
    assert scheduler.get_last_lr() == pytest.approx(reference.get_last_lr())


def test_two_nonfinite_micro_batches_of_one_step_count_as_one_skipped_step(tmp_path, data):
    # accumulate_grad_batches 2 over 3 batches: step 1 = batches 0 and 1 (both NaN), step 2 = batch 2. One step was
    # skipped (the warmup stepped once), but nonfinite_steps said 2: it counted micro-batches.
    module = PoisonedCalls("tiny:llama", peft=LoraConfig(r=4, target_modules=["q_proj"]), poisoned={0, 1},
                           optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), lr_scheduler=warmup)
    trainer = _trainer(tmp_path, max_steps=2, accumulate_grad_batches=2)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 2 and trainer.lr_scheduler_configs[0].scheduler.last_epoch == 1
    assert module.nonfinite_steps == 1
    assert float(trainer.callback_metrics["nonfinite_steps"]) == 1.0
