"""benchmarks/prompt_transfer/llm.py without a model: settings refused by name (leakage, empty lists,
temperature), the shipped SmolLM2 recipes parse, and the doc section is regenerated from whatever runs are cached
(pending ones listed, the verdict computed from the cached accuracies, the MiniLM part of the page kept)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import yaml

from benchmarks.common.pages import markers, read_section
from benchmarks.prompt_transfer.llm import parse_args, sources_recipe
from benchmarks.prompt_transfer.llm_cache import METHODS, SECTION, slug, target_folder, variant_name
from benchmarks.prompt_transfer.llm_report import render, write_report
from prompt_transfer.source import source_run_config, validate_sources_recipe

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "prompt_transfer"


def patch_target_data(monkeypatch, data_dir) -> None:
    """Makes the benchmark's targets read ``data_dir``'s k-shot RTE layout with one-character label words (the
    char tokenizer of tiny:llama)."""
    from benchmarks.prompt_transfer import llm as bench
    from peftplug.prompt_cls import PromptClassificationData
    from tests.prompt_transfer.test_pct_prompt_cls import TARGET

    def data(self, target, seed):
        dm = PromptClassificationData(**TARGET, data_dir=str(data_dir), max_length=48, batch_size=4)
        dm.tokenizer = self.tokenizer
        dm.setup()
        return dm

    monkeypatch.setattr(bench.Targets, "data", data)


@pytest.mark.parametrize("argv, match", [
    (["--targets", "rte,SST-2"], r"--targets: 'SST-2' is also a source task"),
    (["--sources", "mnli,rte"], r"--targets: 'rte' is also a source task"),
    (["--sources", ""], "--sources is empty"),
    (["--temperature", "0"], r"--temperature \(attention temperature\) must be > 0"),
    (["--methods", "PCT,ATTEMPT"], r"--methods: unknown \['ATTEMPT'\]"),
])
def test_bad_settings_are_refused_by_name(argv, match):
    with pytest.raises(ValueError, match=match):
        parse_args(argv)


def test_shipped_smollm2_recipes_parse(tmp_path):
    from peftplug.cli import _cli_classes, import_method_packages

    recipe = validate_sources_recipe(yaml.safe_load((RECIPES / "smollm2_sources.yaml").read_text()), check_files=False)
    assert [s["name"] for s in recipe["sources"]] == ["mnli", "qnli", "qqp", "sst2"]
    import_method_packages()

    class ParseOnly(_cli_classes()):
        def instantiate_classes(self):
            pass

    for k in range(len(recipe["sources"])):
        path = tmp_path / f"source{k}.yaml"
        path.write_text(yaml.safe_dump(source_run_config(recipe, k, str(tmp_path))))
        parsed = ParseOnly(args=["--config", str(path)], run=False).config
        assert parsed["data"]["init_args"]["task"] == recipe["sources"][k]["name"]
    target = ParseOnly(args=["--config", str(RECIPES / "smollm2_target_rte_pct.yaml")], run=False).config
    assert target["model"]["peft"]["init_args"]["target_task"] == "rte"
    # The benchmark narrows the same recipe to one source and its own cache.
    args = parse_args(["--work", str(tmp_path / "w"), "--source-steps", "7"])
    narrowed = sources_recipe(args, ["qqp"])
    assert [s["name"] for s in narrowed["sources"]] == ["qqp"] and narrowed["trainer"]["max_steps"] == 7
    assert narrowed["out_dir"] == str(tmp_path / "w" / "sources") and "decompose" not in narrowed


def _cache(work: Path, accs: dict, targets, seeds):
    def put(path, obj):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(obj))

    for name in ("mnli", "qnli", "qqp", "sst2"):
        put(work / "sources" / f"{name}.json", {"test_acc": 0.6, "zero_shot_acc": 0.4, "cpu_s": 10})
    for t in targets:
        for i, seed in enumerate(seeds):
            put(work / "zero_shot" / f"{t}-{seed}.json", {"acc": 0.5, "n": 10})
            for m, acc in accs.items():
                put(work / "targets" / t / str(seed) / f"{slug(m)}.json",
                    {"acc": acc + 0.02 * i, "attention": {"mnli": 0.7, "sst2": 0.3} if "PCT" in m else {},
                     "trainable": 11520, "base_params": 134515008, "cpu_s": 100, "spot_source": "mnli"})


def test_report_from_partial_and_complete_caches(tmp_path):
    work = tmp_path / "work"
    args = parse_args(["--work", str(work), "--out", str(tmp_path / "page.md")])
    # Partial: two methods on two targets only -> pending cells, pending list, no verdict.
    _cache(work, {"PT": 0.55, "PCT": 0.6}, ["rte", "mrpc"], [13, 42])
    text = render(args)
    assert text.startswith("## SmolLM2-135M-Instruct")
    assert "| SPoT | pending | pending | pending | pending |" in text
    assert "cola seed 13 PT" in text and "**Verdict pending**" in text
    _cache(work, {"SPoT": 0.52}, ["cola"], [13])  # one seed of one method: its check says so
    assert "- cola: zero-shot 50.0; SPoT +2.0 (1/2 seeds) points vs zero-shot; best SPoT." in render(args)
    # Complete: PCT > SPoT > PT by 5 points with a seed std of 1.4 points -> goal met, numbers computed here.
    _cache(work, {"PT": 0.50, "SPoT": 0.55, "PCT": 0.60, "PCT w/o contrastive": 0.58, "PCT w/o attention": 0.57},
           args.target_list, args.seed_list)
    text = render(args)
    pooled = statistics.stdev([0.50, 0.52])
    assert f"pooled seed std {100 * pooled:.1f} points" in text and "**Goal met**" in text
    assert "| PCT | 61.0 ± 1.4 | 61.0 ± 1.4 | 61.0 ± 1.4 | 61.0 ± 1.4 |" in text
    assert "| rte | 0.700 | 0.300 |" in text and "0.0086%" in text and "Not finished" not in text
    # Checks: every source beats zero-shot here; zero-shot 50.0 vs PCT's 61.0 mean on each target.
    assert "Source prompts above zero-shot on their own task: mnli, qnli, qqp, sst2." in text
    assert "- rte: zero-shot 50.0; PT +1.0, SPoT +6.0, PCT +11.0" in text and "best PCT." in text
    assert "- PCT attention: one source holds ≥ 0.95 of the weight in 0 of 8 runs (argmax sources: mnli)." in text
    # Equal methods -> goal not met.
    _cache(work, dict.fromkeys(METHODS, 0.5), args.target_list, args.seed_list)
    (work / "sources" / "qqp.json").write_text(json.dumps({"test_acc": 0.5, "zero_shot_acc": 0.55, "cpu_s": 1}))
    text = render(args)
    assert "**Goal not met**" in text
    assert "not above it: qqp (such a prompt has nothing to transfer)" in text
    # The page: the MiniLM part stays, the section is replaced in place, not duplicated.
    page = tmp_path / "page.md"
    page.write_text("# PCT prompt transfer benchmark\n\nMiniLM table\n")
    write_report(args)
    write_report(args)
    body = page.read_text()
    begin, _ = markers(SECTION)
    assert body.startswith("# PCT prompt transfer benchmark\n\nMiniLM table\n") and body.count(begin) == 1
    assert read_section(body, SECTION) == render(args)


def test_sensitivity_runs_are_cached_apart_and_reported_next_to_the_main_ones(tmp_path):
    work = tmp_path / "work"
    args = parse_args(["--work", str(work)])
    _cache(work, dict.fromkeys(METHODS, 0.5), args.target_list, args.seed_list)
    assert variant_name(args, "PCT") == "" and "Sensitivity checks" not in render(args)
    check = parse_args(["--work", str(work), "--lr", "0.003", "--temperature", "1"])
    assert variant_name(check, "PCT") == "lr0.003_tau1"
    assert target_folder(check, "rte", 13, "PCT") == str(work / "targets" / "rte" / "13" / "lr0.003_tau1")
    # A setting a method ignores keeps its main folder: PT at another temperature is the main PT run, not a rerun.
    assert variant_name(check, "PT") == variant_name(check, "PCT w/o attention") == "lr0.003"
    assert variant_name(parse_args(["--temperature", "1"]), "PT") == ""
    # One seed of PT and two of PCT at the check's settings: the main table is untouched, the check has its rows.
    cost = {"trainable": 11520, "base_params": 134515008, "cpu_s": 100}
    for seed, acc in ((13, 0.60), (42, 0.64)):
        folder = Path(target_folder(check, "rte", seed, "PCT"))
        folder.mkdir(parents=True)
        (folder / "pct.json").write_text(json.dumps({"acc": acc, "attention": {"mnli": 0.6, "sst2": 0.4}, **cost}))
    Path(target_folder(check, "rte", 13, "PT")).mkdir()
    (Path(target_folder(check, "rte", 13, "PT")) / "pt.json").write_text(json.dumps({"acc": 0.7, "attention": {}, **cost}))
    text = render(args)
    assert "| PCT | 51.0 ± 1.4 | 51.0 ± 1.4 | 51.0 ± 1.4 | 51.0 ± 1.4 |" in text  # _cache: 0.50 and 0.52
    assert "| lr0.003_tau1 | PCT | rte | 62.0 ± 2.8 | 51.0 ± 1.4 | 50.0 ± 0.0 | 0.60 / 0.60 |" in text
    assert "| lr0.003 | PT | rte | 70.0 (1/2 seeds) | 51.0 ± 1.4 | 50.0 ± 0.0 | — |" in text
    # Rendered at the check's settings, the default runs are the other settings.
    assert "| defaults | PCT | rte | 51.0 ± 1.4 | 62.0 ± 2.8 |" in render(check)


def test_target_stage_runs_caches_and_resumes_on_tiny_llama(tmp_path, monkeypatch):
    """run_targets on tiny:llama (1 step per method): one JSON per method, SPoT retrieves a source from PT's cached
    prompt, PCT records its attention, and a second call retrains nothing (the cache is the resume point)."""
    import os

    import torch

    import prompt_transfer as pt
    from benchmarks.prompt_transfer import llm as bench
    from peftplug.loading import load_model
    from tests.prompt_transfer.test_pct_prompt_cls import _kshot

    data_dir = _kshot(tmp_path / "data")
    width = load_model("tiny:llama", "prompt_cls").config.hidden_size
    prompts = {"sst2": torch.randn(4, width), "qqp": torch.randn(4, width)}
    work = tmp_path / "work"
    for sub, weight in (("decomposition", 0.1), ("decomposition_plain", 0.0)):
        pt.save_decomposition(pt.decompose(prompts, contrastive_weight=weight, contrastive_steps=3), str(work / sub))

    patch_target_data(monkeypatch, data_dir)
    args = bench.parse_args(["--model", "tiny:llama", "--work", str(work), "--sources", "sst2,qqp", "--targets",
                             "rte", "--seeds", "13", "--steps", "1"])
    bench.run_targets(args, prompts)
    folder = work / "targets" / "rte" / "13"
    results = {m: json.loads((folder / f"{slug(m)}.json").read_text()) for m in METHODS}
    assert all(0 <= r["acc"] <= 1 and r["steps"] == 1 for r in results.values())
    assert results["SPoT"]["spot_source"] in prompts
    assert set(results["PCT"]["attention"]) == set(prompts) and results["PT"]["attention"] == {}
    assert results["PT"]["trainable"] == 4 * width  # one prompt
    assert results["PCT"]["trainable"] == (1 + 2 + 4) * width  # query + 2 key offsets + residual
    stamps = {p: os.stat(p).st_mtime_ns for p in folder.iterdir() if p.is_file()}
    bench.run_targets(args, prompts)
    assert {p: os.stat(p).st_mtime_ns for p in folder.iterdir() if p.is_file()} == stamps  # resumed: nothing retrained
    check = bench.parse_args(["--model", "tiny:llama", "--work", str(work), "--sources", "sst2,qqp", "--targets",
                              "rte", "--seeds", "13", "--steps", "1", "--methods", "PT,SPoT", "--lr", "0.1"])
    bench.run_targets(check, prompts)
    assert {p: os.stat(p).st_mtime_ns for p in folder.iterdir() if p.is_file()} == stamps  # the main runs untouched
    checked = json.loads((folder / "lr0.1" / "pt.json").read_text())
    assert checked["settings"] == {"lr": 0.1} and results["PCT"]["settings"]["temperature"] == 0.1
    assert (folder / "lr0.1" / "pt_prompt.safetensors").is_file()  # SPoT's task embedding at the check's lr
    # PT ignores the temperature: at another one its main run is the cached run, nothing is trained again.
    bench.run_targets(bench.parse_args(["--model", "tiny:llama", "--work", str(work), "--sources", "sst2,qqp",
                                        "--targets", "rte", "--seeds", "13", "--steps", "1", "--methods", "PT",
                                        "--temperature", "2"]), prompts)
    assert {p: os.stat(p).st_mtime_ns for p in folder.iterdir() if p.is_file()} == stamps
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == ["lr0.1"]
    text = render(args)
    assert "| lr0.1 | PT | rte |" in text
    assert "rte seed 13" not in text and "source sst2" in text  # targets done; the (uncached) sources pending
    assert f"| PCT | {100 * results['PCT']['acc']:.1f} |" in text
