"""benchmarks/prompt_transfer/llm.py's --device and sharding on tiny:llama (CPU, device passed explicitly): sources
trained by separate ``--only-sources`` invocations into one cache, decomposed by a later ``--stage sources``, then
one (target, seed) run by ``--stage targets`` from that cache; a missing source is one line and exit status 2."""

from __future__ import annotations

import json
import os

import pytest
import torch
import yaml

from benchmarks.prompt_transfer import llm as bench
from tests.benchmarks.test_pct_llm_benchmark import patch_target_data
from tests.prompt_transfer.test_pct_prompt_cls import SOURCES, _kshot, _recipe


def test_device_resolution_and_lightning_arguments(tmp_path):
    assert bench.resolve_device("cpu") == "cpu"
    assert bench.resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="--device: expected cpu, cuda, cuda:N or auto"):
        bench.resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no CUDA device"):
            bench.parse_args(["--device", "cuda"])
    assert bench.lightning_device("cpu") == {"accelerator": "cpu", "devices": 1}
    assert bench.lightning_device("cuda") == {"accelerator": "gpu", "devices": 1}
    assert bench.lightning_device("cuda:1") == {"accelerator": "gpu", "devices": [1]}
    moved = bench.to_device({"ids": torch.ones(2, dtype=torch.long), "task": "rte"}, "meta")
    assert moved["ids"].device.type == "meta" and moved["task"] == "rte"  # tensors move, other fields stay
    args = bench.parse_args(["--device", "cpu", "--work", str(tmp_path)])
    assert args.device == "cpu" and bench.sources_recipe(args, ["qnli"])["trainer"]["accelerator"] == "cpu"
    args.device = "cuda"  # what --device cuda gives on a GPU machine (not resolvable here)
    assert bench.sources_recipe(args, ["qnli"])["trainer"]["accelerator"] == "gpu"
    with pytest.raises(ValueError, match=r"--only-sources: \['rte'\] not in --sources"):
        bench.parse_args(["--stage", "sources", "--only-sources", "rte"])
    with pytest.raises(ValueError, match="--only-sources needs --stage sources"):
        bench.parse_args(["--stage", "targets", "--only-sources", "qnli"])


def test_sharded_sources_then_targets_from_the_cache(tmp_path, monkeypatch):

    data_dir = _kshot(tmp_path / "data")
    recipe = _recipe(tmp_path, data_dir)
    recipe.pop("decompose")
    names = {"SST-2": "sst2", "QQP": "qqp"}
    for source in recipe["sources"]:
        source["name"] = names[source["name"]]
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(recipe))
    monkeypatch.setattr(bench, "RECIPE", str(recipe_file))

    patch_target_data(monkeypatch, data_dir)
    work = tmp_path / "work"
    common = ["--model", "tiny:llama", "--work", str(work), "--out", str(tmp_path / "report.md"), "--data-dir",
              str(data_dir), "--sources", "sst2,qqp", "--targets", "rte", "--seeds", "13", "--device", "cpu",
              "--source-steps", "2", "--steps", "1", "--eval-size", "6", "--max-length", "48", "--batch-size", "4"]
    # Targets before any source: one line naming what is missing, exit status 2, nothing trained.
    assert bench.main([*common, "--stage", "targets"]) == 2
    assert not (work / "targets").exists()
    # Two shard processes (here: two invocations), each one source, no decomposition.
    assert bench.main([*common, "--stage", "sources", "--only-sources", "sst2"]) == 0
    assert (work / "sources" / "sst2.json").is_file() and not (work / "sources" / "qqp.json").exists()
    assert not (work / "decomposition").exists()
    assert bench.main([*common, "--stage", "targets"]) == 2  # qqp still missing
    assert bench.main([*common, "--stage", "sources", "--only-sources", "qqp"]) == 0
    assert bench.main([*common, "--stage", "targets"]) == 2  # trained, not decomposed yet
    stamps = {n: os.stat(work / "sources" / n / "adapter_model.safetensors").st_mtime_ns for n in ("sst2", "qqp")}
    assert bench.main([*common, "--stage", "sources"]) == 0  # everything cached: only decomposes
    assert {n: os.stat(work / "sources" / n / "adapter_model.safetensors").st_mtime_ns
            for n in ("sst2", "qqp")} == stamps
    for name in ("sst2", "qqp"):
        result = json.loads((work / "sources" / f"{name}.json").read_text())
        assert result["device"] == "cpu" and result["global_step"] == 2 and result["steps"] == 2
    # The same cache as one unsharded invocation: identical prompts and accuracies.
    from safetensors.torch import load_file

    whole = tmp_path / "whole"
    assert bench.main([*common, "--work", str(whole), "--stage", "sources"]) == 0
    for name in ("sst2", "qqp"):
        a, b = (load_file(str(w / "sources" / name / "adapter_model.safetensors")) for w in (work, whole))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        ra, rb = (json.loads((w / "sources" / f"{name}.json").read_text()) for w in (work, whole))
        assert {k: ra[k] for k in ("test_acc", "zero_shot_acc", "prompt_change")} == \
            {k: rb[k] for k in ("test_acc", "zero_shot_acc", "prompt_change")}
    meta = json.loads((work / "decomposition" / "decomposition.json").read_text())
    assert sorted(meta["source_names"]) == ["qqp", "sst2"] and len(SOURCES) == 2
    # One (target, seed) shard from the cache.
    assert bench.main([*common, "--stage", "targets"]) == 0
    folder = work / "targets" / "rte" / "13"
    results = {m: json.loads((folder / f"{bench.slug(m)}.json").read_text()) for m in bench.METHODS}
    assert all(r["device"] == "cpu" and r["steps"] == 1 and 0 <= r["acc"] <= 1 for r in results.values())
    assert results["SPoT"]["spot_source"] in ("sst2", "qqp")
    assert set(results["PCT"]["attention"]) == {"sst2", "qqp"}
    assert load_file(str(folder / "pt_prompt.safetensors"))["prompt"].device.type == "cpu"
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]
