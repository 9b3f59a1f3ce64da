"""Export to vanilla PEFT prompt tuning, the source stage, and the baselines (SPoT, PT init)."""

import json

import peft
import pytest
import torch

import prompt_transfer as pt


def _batch(tokenizer, task):
    enc = tokenizer(["good movie", "bad film!"], return_tensors="pt", padding=True)
    batch = dict(enc)
    batch["labels"] = (torch.tensor([1, 0]) if task == "seq_cls"
                       else enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100))
    return batch


@pytest.mark.parametrize("family, task, task_type", [("llama", "causal_lm", "CAUSAL_LM"),
                                                     ("bert", "seq_cls", "SEQ_CLS"),
                                                     ("t5", "seq2seq", "SEQ_2_SEQ_LM")])
def test_export_roundtrip_equals_live_adapter(family, task, task_type, tiny_model, tokenizer, tmp_path):
    g = torch.Generator().manual_seed(1)
    dec = pt.decompose({f"s{i}": torch.randn(3, 64, generator=g) for i in range(3)}, contrastive_steps=10)
    pt.save_decomposition(dec, str(tmp_path / "dec"))
    model = peft.get_peft_model(tiny_model(family, task),
                                pt.PCTConfig(task_type=task_type, decomposition_path=str(tmp_path / "dec")))
    batch = _batch(tokenizer, task)
    pt.train_prompt(model, [batch], steps=3, lr=0.1, head_lr=0.05)
    with torch.no_grad():
        live = model(**batch).logits
    out = pt.export_prompt_tuning(model, str(tmp_path / "export"))
    cfg = json.loads((tmp_path / "export" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "PROMPT_TUNING" and cfg["num_virtual_tokens"] == 3
    vanilla = peft.PeftModel.from_pretrained(tiny_model(family, task), out)
    assert type(vanilla.peft_config["default"]) is peft.PromptTuningConfig
    with torch.no_grad():
        torch.testing.assert_close(vanilla(**batch).logits, live, atol=1e-6, rtol=1e-6)
    if task != "seq_cls":  # generation goes through the same prompt path
        gen = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "max_new_tokens": 4,
                   "do_sample": False}
        assert torch.equal(vanilla.generate(**gen), model.generate(**gen))
    # The full PCT state sits beside the export and resumes training.
    resumed = pt.load_pct_for_training(tiny_model(family, task), out)
    with torch.no_grad():
        torch.testing.assert_close(resumed(**batch).logits, live, atol=1e-6, rtol=1e-6)


def test_export_loads_in_plain_peft_without_this_library(tiny_model, tokenizer, tmp_path, run_fresh):
    dec = pt.decompose([torch.randn(4, 64), torch.randn(4, 64)], contrastive_steps=5)
    pt.save_decomposition(dec, str(tmp_path / "dec"))
    model = peft.get_peft_model(tiny_model("llama", seed=3),
                                pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=str(tmp_path / "dec")))
    batch = _batch(tokenizer, "causal_lm")
    pt.train_prompt(model, [batch], steps=2, lr=0.1)
    with torch.no_grad():
        torch.save({"logits": model(**batch).logits, "batch": batch}, tmp_path / "ref.pt")
    pt.export_prompt_tuning(model, str(tmp_path / "export"), keep_pct_state=False)
    proc = run_fresh(f"""
        import sys, torch, peft
        from peftplug.tiny import tiny_model
        ref = torch.load({str(tmp_path / 'ref.pt')!r})
        m = peft.PeftModel.from_pretrained(tiny_model("llama", seed=3), {str(tmp_path / 'export')!r})
        assert "prompt_transfer" not in sys.modules
        with torch.no_grad():
            diff = (m(**ref["batch"]).logits - ref["logits"]).abs().max().item()
        print("DIFF", diff)
    """)
    diff = float(proc.stdout.split("DIFF")[1])
    assert diff < 1e-6


def test_export_rejects_other_adapters(tiny_model, tmp_path):
    model = peft.get_peft_model(tiny_model("llama"), pt.prompt_tuning_config("CAUSAL_LM", 3))
    with pytest.raises(ValueError, match="not PCT"):
        pt.export_prompt_tuning(model, str(tmp_path / "x"))


def test_source_stage_to_pct_pipeline_and_baselines(tiny_model, tokenizer, tmp_path):
    """Source prompts (PEFT prompt tuning, saved as adapters) -> decomposition -> PCT; SPoT init; vocab init."""
    batch = _batch(tokenizer, "seq_cls")
    tasks = {"sent": [batch], "flip": [{**batch, "labels": 1 - batch["labels"]}]}
    paths = pt.train_source_prompts(
        make_model=lambda name: tiny_model("bert", "seq_cls", seed=0),
        tasks=tasks, config_factory=lambda name: pt.prompt_tuning_config("SEQ_CLS", 4, init="vocab"),
        out_dir=str(tmp_path / "sources"), steps=2)
    assert set(paths) == {"sent", "flip"}
    prompts = {name: pt.load_source_prompt(p) for name, p in paths.items()}
    assert all(p.shape == (4, 64) for p in prompts.values())
    # The saved source adapters are ordinary PEFT adapters.
    loaded = peft.PeftModel.from_pretrained(tiny_model("bert", "seq_cls"), paths["sent"])
    torch.testing.assert_close(loaded.prompt_encoder["default"].embedding.weight, prompts["sent"])

    dec = pt.decompose(prompts, contrastive_steps=10)
    pt.save_decomposition(dec, str(tmp_path / "dec"))
    pct = peft.get_peft_model(tiny_model("bert", "seq_cls"),
                              pt.PCTConfig(task_type="SEQ_CLS", decomposition_path=str(tmp_path / "dec")))
    hist = pt.train_prompt(pct, [batch], steps=2)
    assert set(hist["attention"][-1]) == {"sent", "flip"}

    # SPoT: most similar source by cosine, then a plain prompt-tuning adapter initialised from it.
    best, sims = pt.spot_select(prompts["flip"] + 1e-3, prompts)
    assert best == "flip" and sims["flip"] == pytest.approx(1.0, abs=1e-2)
    spot = peft.get_peft_model(tiny_model("bert", "seq_cls"), pt.prompt_tuning_config("SEQ_CLS", 4))
    pt.set_prompt(spot, prompts[best])
    torch.testing.assert_close(spot.prompt_encoder["default"].embedding.weight, prompts["flip"])
    with pytest.raises(ValueError, match="does not fit"):
        pt.set_prompt(spot, torch.zeros(3, 64))
    with pytest.raises(ValueError, match="source_prompts is empty"):
        pt.spot_select(prompts["flip"], {})
    with pytest.raises(ValueError, match="init must be one of"):
        pt.prompt_tuning_config("SEQ_CLS", 4, init="text")
    with pytest.raises(ValueError, match="not PROMPT_TUNING/PCT"):
        lora = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(target_modules=["q_proj"]))
        lora.save_pretrained(str(tmp_path / "lora"))
        pt.load_source_prompt(str(tmp_path / "lora"))


def test_file_export_and_cli_decompose(tiny_model, tokenizer, tmp_path):
    """`python -m prompt_transfer.cli decompose|export` (called in-process): no base model needed."""
    from prompt_transfer.cli import main

    sources = {}
    for i, name in enumerate(("a", "b", "c")):
        m = peft.get_peft_model(tiny_model("llama"), pt.prompt_tuning_config("CAUSAL_LM", 3, init="vocab"))
        with torch.no_grad():
            m.prompt_encoder["default"].embedding.weight.normal_(generator=torch.Generator().manual_seed(i))
        m.save_pretrained(str(tmp_path / name))
        sources[name] = m.prompt_encoder["default"].embedding.weight.detach().clone()
    assert main(["decompose", *(str(tmp_path / n) for n in sources), "--out", str(tmp_path / "dec"),
                 "--contrastive-weight", "0"]) == 0
    dec = pt.load_decomposition(str(tmp_path / "dec"))
    assert dec.source_names == ["a", "b", "c"]
    torch.testing.assert_close(dec.reconstruct(), torch.stack(list(sources.values())), atol=1e-5, rtol=0)

    model = peft.get_peft_model(tiny_model("llama"),
                                pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=str(tmp_path / "dec")))
    batch = _batch(tokenizer, "causal_lm")
    pt.train_prompt(model, [batch], steps=2, lr=0.1)
    with torch.no_grad():
        live = model(**batch).logits
    model.save_pretrained(str(tmp_path / "pct"))
    assert main(["export", str(tmp_path / "pct"), str(tmp_path / "plain")]) == 0
    vanilla = peft.PeftModel.from_pretrained(tiny_model("llama"), str(tmp_path / "plain"))
    with torch.no_grad():
        torch.testing.assert_close(vanilla(**batch).logits, live, atol=1e-6, rtol=1e-6)
    assert (tmp_path / "plain" / "pct_state" / "adapter_config.json").is_file()
    with pytest.raises(ValueError, match="not PCT"):
        pt.export_adapter_dir(str(tmp_path / "a"), str(tmp_path / "nope"))


def test_pct_through_peftplug_lightning_module(tiny_model, tokenizer, tmp_path):
    """The trainer's LightningModule accepts a PCTConfig; its export is a PCT adapter that exports to PT."""
    lightning = pytest.importorskip("peftplug.lightning")
    dec = pt.decompose([torch.randn(4, 64), torch.randn(4, 64)], contrastive_steps=5)
    pt.save_decomposition(dec, str(tmp_path / "dec"))
    module = lightning.PeftModule(model=tiny_model("llama"), task="causal_lm",
                                  peft=pt.PCTConfig(decomposition_path=str(tmp_path / "dec")))
    batch = _batch(tokenizer, "causal_lm")
    assert module.model.peft_config["default"].task_type == "CAUSAL_LM"  # filled in by the trainer
    module(**batch).loss.backward()
    assert module.model.prompt_encoder["default"].embedding.query.grad is not None
    # One real training step: the trainer adds the encoder's auxiliary (contrastive) loss and logs the attention.
    import lightning as L

    encoder = module.model.prompt_encoder["default"]
    aux_before = encoder.auxiliary_loss().item()
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    loader = torch.utils.data.DataLoader([dict(batch)], batch_size=None)  # one pre-built batch
    trainer.fit(module, train_dataloaders=loader)
    metrics = trainer.callback_metrics
    assert aux_before > 0 and metrics["aux_loss"].item() == pytest.approx(aux_before, rel=1e-5)
    attn = [v.item() for k, v in metrics.items() if k.startswith("pct/attn/")]
    assert len(attn) == 2 and sum(attn) == pytest.approx(1.0, abs=1e-5)
    module.model.train()
    module.model.eval()
    with torch.no_grad():
        live = module.model(**batch).logits
    module.model.save_pretrained(str(tmp_path / "pct"))
    # What `peftplug export` puts beside the adapter reaches the export's top level (load_adapter reads it there).
    (tmp_path / "pct" / "peftplug_base.json").write_text('{"marker": 1}')
    pt.export_adapter_dir(str(tmp_path / "pct"), str(tmp_path / "plain"))
    assert (tmp_path / "plain" / "peftplug_base.json").read_text() == '{"marker": 1}'
    vanilla = peft.PeftModel.from_pretrained(tiny_model("llama"), str(tmp_path / "plain"))
    with torch.no_grad():
        torch.testing.assert_close(vanilla(**batch).logits, live, atol=1e-6, rtol=1e-6)


def test_pct_target_recipe_fits_through_the_cli(tmp_path, data_dir, tiny_recipe_args):
    """recipes/prompt_transfer/minilm_target_rte_pct.yaml through `peftplug fit` on a tiny BERT (2 steps)."""
    cli = pytest.importorskip("peftplug.cli")

    dec = pt.decompose({"a": torch.randn(8, 64), "b": torch.randn(8, 64)}, contrastive_steps=5)
    pt.save_decomposition(dec, str(tmp_path / "dec"))
    rte = data_dir / "k-shot" / "RTE"
    run = cli.cli(tiny_recipe_args(
        "prompt_transfer/minilm_target_rte_pct.yaml", tmp_path / "run", 2, "--trainer.max_epochs", "1",
        "--model.peft.init_args.decomposition_path", str(tmp_path / "dec"),
        "--data.init_args.train_file", str(rte / "16-13" / "train.tsv"),
        "--data.init_args.validation_file", str(rte / "16-13" / "dev.tsv"),
        "--data.init_args.test_file", str(rte / "16-13" / "dev.tsv"), "--data.init_args.max_length", "32",
    ))
    assert run.trainer.global_step == 2
    attn = pt.attention_weights(run.model.model)
    assert set(attn) == {"a", "b"} and sum(attn.values()) == pytest.approx(1.0, abs=1e-6)
    assert attn["a"] != pytest.approx(0.5, abs=1e-9)  # the query trained
