"""Multi-process settings that Lightning rejects only with a traceback, and late: refused in one line first.

- ``trainer.devices: -1`` with the cpu accelerator: Lightning's CPU accelerator takes no -1 and raised a
  ``TypeError`` ("`devices` selected with `CPUAccelerator` should be an int > 0.") after the model was loaded, as a
  traceback (the check let it through, and its message even offered "-1 (one per core)").
- ``ModelParallelStrategy`` sizes that do not multiply to the number of processes (``data_parallel_size: 1`` on
  ``devices: 2``): Lightning raised a ``RuntimeError`` inside each launched process, one traceback per rank (about
  80 lines, 40 s after the start here).
"""

from __future__ import annotations

import json

import lightning as L
import pytest
import yaml
from lightning.pytorch.strategies import ModelParallelStrategy

from peftplug.errors import ConfigError
from peftplug.trainer_checks import check_trainer_settings


def _fsdp2(data, tensor=1):
    return ModelParallelStrategy(data_parallel_size=data, tensor_parallel_size=tensor, process_group_backend="gloo",
                                 save_distributed_checkpoint=False)


@pytest.mark.parametrize("devices", [-1, "-1"])
def test_all_devices_on_the_cpu_is_refused_in_one_line(devices):
    with pytest.raises(TypeError, match="should be an int > 0"):  # what Lightning does with it
        L.Trainer(accelerator="cpu", devices=devices, logger=False)
    with pytest.raises(ConfigError, match=r"^trainer.devices: -1 .* cpu accelerator; give a number of processes"):
        check_trainer_settings(accelerator="cpu", devices=devices)


def test_cpu_device_message_offers_only_what_the_cpu_accepts():
    with pytest.raises(ConfigError) as err:
        check_trainer_settings(accelerator="cpu", devices="many")
    assert "-1" not in str(err.value) and ">= 1 or 'auto'" in str(err.value)


@pytest.mark.parametrize(("strategy", "devices", "nodes", "names"), [
    (_fsdp2(1), 2, None, "data_parallel_size 1 and tensor_parallel_size 1"),
    (_fsdp2(2), 2, 2, "data_parallel_size 2 and tensor_parallel_size 1"),
    (_fsdp2(1, 2), 2, 1, "data_parallel_size 1 and tensor_parallel_size 2"),
    (_fsdp2("auto", "auto"), 2, None, "data_parallel_size auto (trainer.num_nodes) and tensor_parallel_size 2"),
    (_fsdp2("auto"), 2, 1, "data_parallel_size 1 and tensor_parallel_size 1"),
])
def test_model_parallel_sizes_must_make_the_number_of_processes(strategy, devices, nodes, names):
    with pytest.raises(ConfigError, match=r"^trainer.strategy: ModelParallelStrategy got ") as err:
        check_trainer_settings(accelerator="cpu", strategy=strategy, devices=devices, num_nodes=nodes)
    assert names in str(err.value) and "tensor_parallel_size: 1" in str(err.value)


@pytest.mark.parametrize(("strategy", "devices", "nodes"), [
    (_fsdp2(2), 2, None), (_fsdp2(2), 2, 1), (_fsdp2(4), 2, 2), (_fsdp2(4), 2, None),  # 2 nodes of 2: possible
    (_fsdp2("auto"), 1, None), (_fsdp2("auto", "auto"), 1, 1), (_fsdp2(1), "auto", None),
    ("ddp", 2, None),
])
def test_fitting_model_parallel_sizes_pass(strategy, devices, nodes):
    check_trainer_settings(accelerator="cpu", strategy=strategy, devices=devices, num_nodes=nodes)


def test_fit_with_mismatched_sizes_stops_before_launching(tmp_path, capsys):
    from peftplug.cli import main

    rows = [{"prompt": f"{i:02d} plus {i:02d} is", "response": f" {2 * i}"} for i in range(8)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    strategy = {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
                "init_args": {"data_parallel_size": 1, "tensor_parallel_size": 1, "process_group_backend": "gloo",
                              "save_distributed_checkpoint": False}}
    recipe = {"trainer": {"default_root_dir": str(tmp_path / "run"), "max_steps": 1, "accelerator": "cpu",
                          "devices": 2, "strategy": strategy, "logger": False, "enable_progress_bar": False},
              "model": {"model": "tiny:llama", "peft": {"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"]}},
              "data": {"class_path": "peftplug.data.CausalLMData",
                       "init_args": {"train_file": str(tmp_path / "train.jsonl"), "prompt_column": "prompt",
                                     "response_column": "response", "batch_size": 2}}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["fit", "--config", str(tmp_path / "r.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("peftplug: error: trainer.strategy: ModelParallelStrategy got data_parallel_size 1"), err
    assert not any("Traceback" in line for line in err)
