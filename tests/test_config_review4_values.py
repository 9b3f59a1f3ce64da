"""Values of the right type that no run can use, found by fuzzing the shipped recipes one field at a time: each is one
line ``peftplug: error: <field>: ...`` naming the field and what it accepts, before anything trains.

Before, they were a ``TypeError`` traceback from torch (``r: 1.5``, ``num_virtual_tokens: .nan``), a run that trained
with NaN updates or trained nothing, silently (``lora_alpha: .inf``, ``lr: .inf``, ``weight_decay: .inf``,
``start_factor: .nan``, ``lora_alpha: 0``, ``lora_dropout: -1``, ``prompt_tuning_init: sample_vocab``), or a
message that named the wrong field (Helene's ``lam: .nan`` was reported as ``seed``)."""

from __future__ import annotations

import json
import math

import lightning  # noqa: F401  (imported before capsys swaps stderr: Lightning's log handler binds to it)
import pytest
import yaml
from jsonargparse import Namespace

from peftplug.cli import main
from peftplug.config_errors import config_field
from peftplug.errors import ConfigError
from peftplug.loading import build_peft_config

LORA = {"class_path": "peft.LoraConfig", "init_args": {"r": 2, "target_modules": ["q_proj"]}}
LORA_DICT = {"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"]}
PROMPT = {"class_path": "peft.PromptTuningConfig", "init_args": {"num_virtual_tokens": 2}}
ADAMW = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01}}
NAN, INF = float("nan"), float("inf")


def _recipe(tmp_path, peft, optimizer=ADAMW, lr_scheduler=None):
    rows = [{"prompt": f"Q{i}", "response": f" {i}"} for i in range(8)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    model = {"model": "tiny:llama", "peft": peft, "optimizer": optimizer}
    if lr_scheduler is not None:
        model["lr_scheduler"] = lr_scheduler
    recipe = {
        "trainer": {"max_steps": 1, "accelerator": "cpu", "devices": 1, "default_root_dir": str(tmp_path / "runs"),
                    "enable_progress_bar": False, "num_sanity_val_steps": 0, "limit_val_batches": 0,
                    "logger": False, "enable_checkpointing": False, "enable_model_summary": False},
        "model": model,
        "data": {"class_path": "peftplug.data.CausalLMData",
                 "init_args": {"train_file": str(tmp_path / "train.jsonl"), "prompt_column": "prompt",
                               "response_column": "response", "batch_size": 4}},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))  # nan/inf are written as YAML's .nan/.inf
    return path


def _with(base, **values):
    """A copy of a ``model.peft`` spec with ``values`` set (under init_args in the class_path form)."""
    spec = json.loads(json.dumps(base))
    spec.get("init_args", spec).update(values)
    return spec


def _error_line(capsys):
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("peftplug: error: ")]
    assert len(lines) == 1, err
    return lines[0].removeprefix("peftplug: error: ")


DROPOUT = "model.peft.init_args.lora_dropout: lora_dropout must be a finite real number in [0, 1] (a probability), got"
PEFT_CASES = [
    # torch's TypeError from nn.Linear(64, 1.5) / torch.empty before
    (_with(LORA, r=1.5), "model.peft.init_args.r: r must be an int, got 1.5"),
    (_with(LORA_DICT, r=NAN), "model.peft.r: r must be a finite number, got nan"),
    (_with(PROMPT, num_virtual_tokens=1.5), "model.peft.init_args.num_virtual_tokens: num_virtual_tokens must be an int"),
    # accepted silently before: NaN outputs, no dropout, an adapter scaled to 0, a random prompt init, no prompt
    (_with(LORA_DICT, lora_alpha=INF), "model.peft.lora_alpha: lora_alpha must be a finite number, got inf"),
    (_with(LORA, lora_alpha=NAN), "model.peft.init_args.lora_alpha: lora_alpha must be a finite number, got nan"),
    (_with(LORA_DICT, lora_alpha=0), "model.peft.lora_alpha: lora_alpha must not be 0"),
    (_with(LORA, lora_dropout=-1), f"{DROPOUT} -1"),
    (_with(LORA, lora_dropout=1.5), f"{DROPOUT} 1.5"),
    (_with(PROMPT, prompt_tuning_init="sample_vocab"),
     ("model.peft.init_args.prompt_tuning_init: prompt_tuning_init must be one of 'TEXT', 'SAMPLE_VOCAB', 'RANDOM', "
      "got 'sample_vocab'; did you mean 'SAMPLE_VOCAB'?")),
    (_with(PROMPT, num_virtual_tokens=0),
     "model.peft.init_args.num_virtual_tokens: num_virtual_tokens must be an int >= 1 (the soft prompt's length), got 0"),
]


@pytest.mark.parametrize("extra", [[], ["--print_config"]], ids=["fit", "print_config"])
@pytest.mark.parametrize("peft, expected", PEFT_CASES, ids=[c[1].split(":")[0] + ":" + c[1].split("got ")[-1][:12]
                                                            for c in PEFT_CASES])
def test_an_unusable_peft_value_is_one_line_naming_the_field(tmp_path, capsys, monkeypatch, peft, expected, extra):
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--config", str(_recipe(tmp_path, peft)), *extra]) == 2
    assert _error_line(capsys).startswith(expected)
    assert not list(tmp_path.rglob("*.ckpt"))


TORCH_CASES = [
    # torch checks `0.0 <= lr` and `0.0 <= weight_decay`: inf passed, and the first step made the adapter NaN
    ({"class_path": "torch.optim.AdamW", "init_args": {"lr": INF}}, None,
     "model.optimizer.init_args.lr: lr must be a finite number, got inf"),
    ({"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01, "weight_decay": INF}}, None,
     "model.optimizer.init_args.weight_decay: weight_decay must be a finite number, got inf"),
    # torch's own message, when it has one, says the range: named by torch's words for the argument
    ({"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.01, "betas": [0.9, NAN]}}, None,
     "model.optimizer.init_args.betas: Invalid beta parameter at index 1: nan"),
    # NaN fails neither of LinearLR's / OneCycleLR's range comparisons: the learning rate became NaN
    (ADAMW, {"class_path": "torch.optim.lr_scheduler.LinearLR", "init_args": {"start_factor": NAN, "total_iters": 1}},
     "model.lr_scheduler.init_args.start_factor: start_factor must be a finite number, got nan"),
    (ADAMW, {"class_path": "torch.optim.lr_scheduler.OneCycleLR",
             "init_args": {"max_lr": 0.01, "total_steps": 1, "pct_start": NAN}},
     "model.lr_scheduler.init_args.pct_start: pct_start must be a finite number, got nan"),
]


@pytest.mark.parametrize("optimizer, lr_scheduler, expected", TORCH_CASES,
                         ids=[c[2].split(":")[0] for c in TORCH_CASES])
def test_a_non_finite_optimizer_or_scheduler_argument_is_one_line(tmp_path, capsys, monkeypatch, optimizer,
                                                                   lr_scheduler, expected):
    monkeypatch.chdir(tmp_path)
    recipe = _recipe(tmp_path, LORA, optimizer=optimizer, lr_scheduler=lr_scheduler)
    assert main(["fit", "--config", str(recipe)]) == 2
    assert _error_line(capsys) == expected


def test_torch_messages_name_the_argument_they_are_about(tmp_path, capsys, monkeypatch):
    """torch's "Starting multiplicative factor expected to be ..." names no identifier: the field was only
    ``model.lr_scheduler``."""
    monkeypatch.chdir(tmp_path)
    scheduler = {"class_path": "torch.optim.lr_scheduler.LinearLR", "init_args": {"start_factor": 1.5}}
    assert main(["fit", "--config", str(_recipe(tmp_path, LORA, lr_scheduler=scheduler))]) == 2
    assert _error_line(capsys).startswith("model.lr_scheduler.init_args.start_factor: Starting multiplicative factor")


def test_an_error_inside_the_model_names_the_key_of_a_dict_peft(tmp_path, capsys, monkeypatch):
    """PEFT's own check, raised while the model is built: the dict form's keys were no leaves of the config, so the
    field was only ``model``."""
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--config", str(_recipe(tmp_path, _with(LORA_DICT, r=0)))]) == 2
    assert _error_line(capsys).startswith("model.peft.r: `r` should be a positive integer")


def _helene_config(lam):
    return Namespace(model=Namespace(model="tiny:bert", optimizer=Namespace(
        class_path="helene.Helene", init_args=Namespace(lr=0.001, lam=lam, weight_decay=0.0, seed=0))))


def test_the_value_after_got_is_matched_before_a_range_bound():
    """Helene's message names the value as "got nan" and its range as ">= 0": the range's 0 matched ``seed: 0``."""
    message = ("lam (clipping floor λ) of layer 'base.layer.0.query.weight' must be a finite real number >= 0, "
               "got nan")
    assert config_field(_helene_config(NAN), message, "model") == "model.optimizer.init_args.lam"
    message = "Invalid learning rate: nan"
    config = Namespace(model=Namespace(optimizer=Namespace(class_path="torch.optim.AdamW",
                                                           init_args=Namespace(lr=NAN, weight_decay=0.0))))
    assert config_field(config, message, "model") == "model.optimizer.init_args.lr"


def test_a_suggested_setting_does_not_steal_the_field():
    """A message about ``block_size=7`` that suggests ``exclude_modules`` still names block_size."""
    config = Namespace(model=Namespace(peft=Namespace(class_path="oftv2.OFTv2Config", init_args=Namespace(
        block_size=7, exclude_modules=None, module_dropout=0.0))))
    message = "block_size=7 does not divide the input width 64 of layer 'q'; (or exclude the layer via exclude_modules)"
    assert config_field(config, message, "model") == "model.peft.init_args.block_size"


@pytest.mark.parametrize("spec", [
    {"peft_type": "LORA", "r": 4, "lora_alpha": 0.5, "lora_dropout": 1.0, "target_modules": ["q_proj"]},
    {"peft_type": "LORA", "r": 4, "lora_alpha": -8, "lora_dropout": 0, "target_modules": ["q_proj"]},
    {"peft_type": "PROMPT_TUNING", "num_virtual_tokens": 1, "prompt_tuning_init": "RANDOM"},
    {"class_path": "peft.PromptTuningConfig", "init_args": {"num_virtual_tokens": 3, "prompt_tuning_init": "TEXT",
                                                             "prompt_tuning_init_text": "hi", "tokenizer_name_or_path": "x"}},
])
def test_values_peft_can_use_are_still_accepted(spec):
    config = build_peft_config(json.loads(json.dumps(spec)), "causal_lm")
    values = spec.get("init_args", spec)
    for key, value in values.items():
        if key not in ("peft_type", "target_modules"):
            got = getattr(config, key)
            assert got == value or str(getattr(got, "value", got)) == value, key


def test_the_python_api_refuses_the_same_values():
    with pytest.raises(ConfigError, match=r"^model\.peft\.lora_alpha: lora_alpha must be a finite number, got inf$"):
        build_peft_config({"peft_type": "LORA", "r": 4, "lora_alpha": math.inf}, "causal_lm")
    with pytest.raises(ConfigError, match=r"^model\.peft\.lora_dropout: lora_dropout must be a finite real number"):
        build_peft_config({"peft_type": "LORA", "r": 4, "lora_dropout": -0.1}, "causal_lm")


def test_a_pct_decomposition_path_that_holds_no_decomposition_is_one_line(tmp_path, capsys, monkeypatch):
    """A folder without decomposition.json (the sources' run folder, say) was a FileNotFoundError traceback from
    load_decomposition when the adapter was built; a saved adapter being loaded (inference_mode) still builds."""
    import prompt_transfer as pt

    folder = tmp_path / "runs_pct"
    folder.mkdir()
    with pytest.raises(ValueError, match="decomposition_path .* is a folder without decomposition.json"):
        pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=str(folder), num_sources=2, num_virtual_tokens=4)
    saved = pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=str(folder), num_sources=2, num_virtual_tokens=4,
                         inference_mode=True)
    assert saved.num_sources == 2
    monkeypatch.chdir(tmp_path)
    peft = {"class_path": "prompt_transfer.PCTConfig",
            "init_args": {"decomposition_path": str(folder), "num_sources": 2, "num_virtual_tokens": 4}}
    assert main(["fit", "--config", str(_recipe(tmp_path, peft))]) == 2
    assert _error_line(capsys).startswith("model.peft.init_args.decomposition_path: decomposition_path ")


@pytest.mark.parametrize("trainer, seed, expected", [
    ({"val_check_interval": 0}, None, "trainer.val_check_interval must be an int >= 1"),
    ({"val_check_interval": -0.5}, None, "trainer.val_check_interval must be an int >= 1"),
    ({"check_val_every_n_epoch": 0}, None, "trainer.check_val_every_n_epoch must be an int >= 1"),
    ({"val_check_interval": {"a": 1}}, None, "trainer.val_check_interval: a duration dict takes the keys"),
    ({"max_time": {"hour": 1}}, None, "trainer.max_time: a duration dict takes the keys"),
    ({}, -1, "seed_everything must be true/false or an int in [0, 2**32 - 1]; got -1"),
])
def test_trainer_values_lightning_fails_on_with_a_traceback_are_refused(trainer, seed, expected):
    """Lightning's answers were a ZeroDivisionError in the loop (interval 0, every 0 epochs), timedelta's TypeError
    (a dict key it does not take) and numpy's ValueError (a negative seed). Here the check itself; the CLI's
    below."""
    from peftplug.trainer_checks import check_trainer_values

    with pytest.raises(ConfigError, match="^" + expected.replace("[", r"\[").replace("*", r"\*")):
        check_trainer_values(Namespace(**trainer), seed)


@pytest.mark.parametrize("trainer, seed", [
    ({"val_check_interval": 0.25, "check_val_every_n_epoch": None}, True),
    ({"val_check_interval": 100, "check_val_every_n_epoch": 2}, 0),
    ({"val_check_interval": {"minutes": 30}, "max_time": "00:12:00:00"}, 2**32 - 1),
    ({"max_time": {"hours": 1}}, None),
])
def test_trainer_values_lightning_takes_are_accepted(trainer, seed):
    from peftplug.trainer_checks import check_trainer_values

    check_trainer_values(Namespace(**trainer), seed)


@pytest.mark.parametrize("flags, expected", [
    (["--trainer.val_check_interval", "0"], "trainer.val_check_interval must be an int >= 1"),
    (["--seed_everything", "-1"], "seed_everything must be true/false or an int in [0, 2**32 - 1]; got -1"),
])
def test_the_cli_refuses_them_before_anything_is_built(tmp_path, capsys, monkeypatch, flags, expected):
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--config", str(_recipe(tmp_path, LORA)), *flags]) == 2
    assert _error_line(capsys).startswith(expected)
    assert not (tmp_path / "runs").exists()
