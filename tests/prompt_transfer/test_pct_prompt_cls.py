"""PCT with prompt-based classification of a causal LM (``task: prompt_cls``), end to end on tiny:llama:
two source prompts through ``train-sources`` (Lightning) -> decomposition -> a PCT target trained through
``PeftModule`` -> export as a plain PEFT ``PROMPT_TUNING`` adapter whose label-word logits equal the PCT model's.
Plus the bad-input rules of issue #16: leakage (target = source), prompts of another model or width, attention
temperature <= 0, empty source lists."""

from __future__ import annotations

import json

import lightning
import peft
import pytest
import torch
import yaml

import prompt_transfer as pt
from peftplug.prompt_cls import PromptClassificationData, prompt_cls_forward
from prompt_transfer import cli as pct_cli

# One-character label words and no space before the answer: the tiny models use a character tokenizer.
SOURCES = {
    "SST-2": {"task": "sst2", "template": "{sentence}={answer}", "label_words": ["n", "p"]},
    "QQP": {"task": "qqp", "template": "{question1}|{question2}?{answer}", "label_words": ["n", "y"]},
}
TARGET = {"task": "rte", "split_seed": 13, "template": "{premise}|{hypothesis}?{answer}", "label_words": ["y", "n"]}
WORDS = ["good", "bad", "fine", "awful", "great", "poor", "nice", "dull"]


def _kshot(root):
    """A tiny k-shot tree in the real layouts: SST-2 and QQP (split 16-42), RTE (split 16-13)."""
    def write(path, header, rows):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join([header] + rows) + "\n")

    sst = [f"{WORDS[i % 8]} film {i}\t{i % 2}" for i in range(8)]
    qqp = [f"{i}\t{i}\t{i + 1}\tIs {WORDS[i % 8]} ok?\tIs {WORDS[(i + 1) % 8]} ok?\t{i % 2}" for i in range(8)]
    rte = [f"{i}\tThe {WORDS[i % 8]} cat sat.\tA cat sat.\t{('entailment', 'not_entailment')[i % 2]}"
           for i in range(8)]
    for name in ("16-42/train.tsv", "16-42/dev.tsv", "test.tsv"):
        write(root / "k-shot" / "SST-2" / name, "sentence\tlabel", sst)
        write(root / "k-shot" / "QQP" / name, "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate", qqp)
    for name in ("16-13/train.tsv", "16-13/dev.tsv", "test.tsv"):
        write(root / "k-shot" / "RTE" / name, "index\tsentence1\tsentence2\tlabel", rte)
    return root


def _recipe(tmp_path, data_dir):
    trainer = {"default_root_dir": str(tmp_path / "logs"), "max_steps": 2, "max_epochs": 1, "accelerator": "cpu",
               "devices": 1, "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
               "enable_model_summary": False, "num_sanity_val_steps": 0, "limit_val_batches": 0}
    return {
        "out_dir": str(tmp_path / "sources"), "seed_everything": 5, "evaluate_after_fit": True, "zero_shot": True,
        "trainer": trainer,
        "model": {"model": "tiny:llama", "task": "prompt_cls",
                  "peft": {"class_path": "peft.PromptTuningConfig",
                           "init_args": {"num_virtual_tokens": 4, "prompt_tuning_init": "RANDOM"}},
                  "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.05}}},
        "sources": [{"name": name, "data": {"class_path": "peftplug.prompt_cls.PromptClassificationData",
                                            "init_args": {**spec, "data_dir": str(data_dir), "max_length": 48,
                                                          "batch_size": 4, "max_test": 6}}}
                    for name, spec in SOURCES.items()],
        "decompose": {"out": str(tmp_path / "decomposition"), "contrastive_steps": 5},
    }


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Runs ``train-sources`` once for the module: two prompt_cls source prompts and their decomposition."""
    tmp_path = tmp_path_factory.mktemp("pct_prompt_cls")
    data_dir = _kshot(tmp_path / "data")
    recipe = tmp_path / "sources.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(tmp_path, data_dir)))
    assert pct_cli.main(["train-sources", "--config", str(recipe)]) == 0
    return tmp_path, data_dir


def _target_data(data_dir):
    return PromptClassificationData(**TARGET, data_dir=str(data_dir), max_length=48, batch_size=4)


def test_prompt_cls_sources_decompose_pct_target_and_plain_export(sources):
    from peftplug.lightning import PeftModule
    from peftplug.loading import load_model

    tmp_path, data_dir = sources
    summary = json.loads((tmp_path / "sources" / "sources.json").read_text())
    assert list(summary["sources"]) == list(SOURCES)
    for name, result in summary["sources"].items():
        assert result["global_step"] == 2 and result["prompt_change"] > 0 and 0 <= result["test_acc"] <= 1
        assert 0 <= result["zero_shot_acc"] <= 1
        cfg = json.loads((tmp_path / "sources" / name / "adapter_config.json").read_text())
        assert cfg["peft_type"] == "PROMPT_TUNING" and cfg["task_type"] == "CAUSAL_LM"
    # zero_shot_acc is the base model's own label-word accuracy on the same test rows (computed here).
    sst = PromptClassificationData(**SOURCES["SST-2"], data_dir=str(data_dir), max_length=48, max_test=6)
    sst.tokenizer = pt_tokenizer()
    sst.setup()
    base = load_model("tiny:llama", "prompt_cls").eval()
    with torch.no_grad():
        hits = [(prompt_cls_forward(base, b).logits.argmax(-1) == b["labels"]).float() for b in sst.test_dataloader()]
    assert summary["sources"]["SST-2"]["zero_shot_acc"] == pytest.approx(torch.cat(hits).mean().item())
    dec = pt.load_decomposition(str(tmp_path / "decomposition"))
    assert dec.source_names == list(SOURCES)
    assert dec.settings["base_model"] == cfg["base_model_name_or_path"]  # recorded for the model check

    # PCT target on held-out RTE through the trainer's LightningModule (label-word loss + auxiliary InfoNCE).
    torch.manual_seed(0)
    module = PeftModule(model="tiny:llama", task="prompt_cls",
                        peft=pt.PCTConfig(decomposition_path=str(tmp_path / "decomposition"), target_task="rte",
                                          attention_temperature=0.05),
                        optimizer=lambda params: torch.optim.AdamW(params, lr=0.5))
    encoder = module.model.prompt_encoder["default"]
    assert pt.attention_weights(module.model) == pytest.approx({"SST-2": 0.5, "QQP": 0.5})  # zero query: uniform
    data = _target_data(data_dir)
    trainer = lightning.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                                limit_val_batches=0, default_root_dir=str(tmp_path / "target"))
    trainer.fit(module, datamodule=data)
    attention = pt.attention_weights(module.model)
    assert attention["SST-2"] != pytest.approx(0.5, abs=1e-4)  # the attention trained
    assert sum(attention.values()) == pytest.approx(1.0, abs=1e-6)
    assert "aux_loss" in trainer.callback_metrics and "pct/attn/QQP" in trainer.callback_metrics

    module.model.eval()
    batch = next(iter(data.test_dataloader()))
    with torch.no_grad():
        live = prompt_cls_forward(module.model, batch).logits
    out = pt.export_prompt_tuning(module.model, str(tmp_path / "exported"))
    assert json.loads((tmp_path / "exported" / "adapter_config.json").read_text())["peft_type"] == "PROMPT_TUNING"
    plain = peft.PeftModel.from_pretrained(load_model("tiny:llama", "prompt_cls"), out).eval()
    assert type(plain.peft_config["default"]) is peft.PromptTuningConfig
    with torch.no_grad():
        exported = prompt_cls_forward(plain, batch).logits
    torch.testing.assert_close(exported, live, atol=1e-5, rtol=1e-5)
    assert encoder.embedding.query.abs().max() > 0


def test_train_prompt_with_the_label_word_loss(sources):
    """The in-process loop (used by the benchmark) trains a PCT target on the label-word loss, one step = one
    AdamW step on the query: the loss it reports is the label-word cross-entropy computed here."""
    from peftplug.loading import load_model

    tmp_path, data_dir = sources
    data = _target_data(data_dir)
    data.tokenizer = pt_tokenizer()
    data.setup()
    batches = list(data.train_dataloader())
    model = peft.get_peft_model(load_model("tiny:llama", "prompt_cls"),
                                pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=str(tmp_path / "decomposition"),
                                             contrastive_weight=0.0))
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(prompt_cls_forward(model, batches[0]).logits, batches[0]["labels"])
    model.train()
    hist = pt.train_prompt(model, batches[:1], steps=2, lr=0.1,
                           loss_fn=lambda m, b: prompt_cls_forward(m, b).loss)
    assert hist["loss"][0] == pytest.approx(ref.item(), rel=1e-5)
    assert hist["attention"][-1] != hist["attention"][0]


def pt_tokenizer():
    from peftplug.loading import load_tokenizer

    return load_tokenizer("tiny:llama")


def test_bad_input_leakage_models_temperature_and_empty_sources(sources, tiny_model):
    tmp_path, _ = sources
    dec_dir = str(tmp_path / "decomposition")
    # Leakage: a target that is one of the sources, by name (case and punctuation do not hide it).
    for target in ("SST-2", "sst2", "Sst_2"):
        with pytest.raises(ValueError, match=r"target_task '.*' is also a source task \('SST-2'"):
            pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=dec_dir, target_task=target)
    pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=dec_dir, target_task="mrpc")  # held out: fine
    # Prompts of another width: the message names both models and both widths.
    narrow = tiny_model("llama", hidden_size=32)
    narrow.name_or_path = "narrow-llama"
    with pytest.raises(ValueError, match=r"come from .*tiny.* \(token_dim \d+\); the target model narrow-llama "
                                         r"has token_dim 32"):
        peft.get_peft_model(narrow, pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=dec_dir))
    # Same width, another model: refused, naming both.
    meta_path = tmp_path / "decomposition" / "decomposition.json"
    meta = json.loads(meta_path.read_text())
    other = tmp_path / "other_dec"
    other.mkdir()
    (other / "decomposition.safetensors").write_bytes((tmp_path / "decomposition" /
                                                       "decomposition.safetensors").read_bytes())
    (other / "decomposition.json").write_text(json.dumps({**meta, "settings": {**meta["settings"],
                                                                               "base_model": "some/other-model"}}))
    same_width = tiny_model("llama")
    same_width.name_or_path = "tiny:llama-2"
    with pytest.raises(ValueError, match="come from some/other-model, the target model is tiny:llama-2"):
        peft.get_peft_model(same_width, pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=str(other)))
    # Source adapters of two models are refused before decomposing.
    adapters = {n: str(tmp_path / "sources" / n) for n in SOURCES}
    assert pt.source_base_model(adapters) == meta["settings"]["base_model"]
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    cfg = json.loads((tmp_path / "sources" / "QQP" / "adapter_config.json").read_text())
    (foreign / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": "gpt2"}))
    with pytest.raises(ValueError, match=r"different models: 'SST-2' from .*, 'QQP' from 'gpt2'"):
        pt.source_base_model({"SST-2": adapters["SST-2"], "QQP": str(foreign)})
    # Temperature <= 0 and empty source lists name the field.
    for value in (0.0, -1.0):
        with pytest.raises(ValueError, match="attention_temperature must be a finite real number > 0"):
            pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=dec_dir, attention_temperature=value)
    with pytest.raises(ValueError, match="source_names is empty"):
        pt.PCTConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, num_sources=1, source_names=[])
    with pytest.raises(ValueError, match="num_sources must be an int >= 1"):
        pt.PCTConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, num_sources=0)
    with pytest.raises(ValueError, match="sources is empty"):
        pt.source_base_model({})
    with pytest.raises(ValueError, match="prompts is empty"):
        pt.decompose({})
