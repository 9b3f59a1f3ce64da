"""Save/load in PEFT's format, provenance, hidden-size checks, EasyEdit2 and GGUF converters, the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel

import steering
from peftplug.errors import DataError

PAIRS = [("I feel happy today", "I feel sad today"), ("We won the game", "We lost the game")]


def _adapter(tiny_model, tokenizer, **kw):
    return steering.train_steering_vector(tiny_model("llama"), tokenizer, PAIRS, layers=[0, 1], progress=False, **kw)


def test_save_load_round_trip_with_provenance(tiny_model, tokenizer, tmp_path):
    pm = _adapter(tiny_model, tokenizer, multiplier=3.0, positions="from_last_prompt",
                  layer_multipliers={1: 0.5})
    batch = tokenizer(["hello there", "hi"], return_tensors="pt", padding=True)
    expected = pm(**batch).logits
    pm.save_pretrained(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "STEERING"
    expected_config = {
        "layers": [0, 1], "multiplier": 3.0, "operator": "add", "positions": "from_last_prompt", "method": "caa",
        "hidden_size": 64, "model_type": "llama", "hook_point": "block_output", "layer_convention": "block_index",
        "read_position": "answer", "num_pairs": 2,
    }
    for key, value in expected_config.items():
        assert config[key] == value, key
    assert config["layer_multipliers"] == {"1": 0.5}
    loaded = PeftModel.from_pretrained(tiny_model("llama"), tmp_path / "adapter")
    assert torch.equal(loaded(**batch).logits, expected)
    for layer, v in pm.base_model.get_vectors().items():
        assert torch.equal(loaded.base_model.get_vectors()[layer], v)


def test_loading_onto_another_hidden_size_fails_clearly(tiny_model, tokenizer, tmp_path):
    _adapter(tiny_model, tokenizer).save_pretrained(tmp_path / "adapter")
    other = tiny_model("llama", hidden_size=32, intermediate_size=64)
    with pytest.raises(ValueError, match="hidden size 64.*hidden size is 32"):
        PeftModel.from_pretrained(other, tmp_path / "adapter")
    with pytest.raises(ValueError, match="entries, but the model's hidden size is 64"):
        steering.steering_adapter(tiny_model("llama"), {0: torch.ones(32)})


def test_easyedit_round_trip(tiny_model, tokenizer, tmp_path):
    pm = _adapter(tiny_model, tokenizer, multiplier=2.0)
    paths = steering.export_easyedit(pm, tmp_path / "ee")
    assert sorted(p.name for p in paths) == ["layer_0.pt", "layer_1.pt"]
    vectors = steering.import_easyedit(tmp_path / "ee", hidden_size=64)
    for layer, v in pm.base_model.get_vectors().items():
        assert torch.equal(vectors[layer], v)
    rebuilt = steering.steering_adapter(tiny_model("llama"), vectors, multiplier=2.0)
    batch = tokenizer(["abc"], return_tensors="pt")
    assert torch.equal(rebuilt(**batch).logits, pm(**batch).logits)
    torch.save({"not": "a tensor"}, tmp_path / "ee" / "layer_3.pt")
    with pytest.raises(ValueError, match="expected a tensor"):
        steering.import_easyedit(tmp_path / "ee")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no layer_"):
        steering.import_easyedit(tmp_path / "empty")


def test_gguf_round_trip(tiny_model, tokenizer, tmp_path):
    pytest.importorskip("gguf")
    from steering.io import import_gguf

    pm = _adapter(tiny_model, tokenizer, multiplier=2.0)
    path = steering.export_gguf(pm, tmp_path / "cv.gguf")
    vectors = import_gguf(path)
    for layer, v in pm.base_model.get_vectors().items():
        torch.testing.assert_close(vectors[layer], 2.0 * v)


def test_cli_extract_generate_and_convert(tmp_path, capsys):
    from steering.cli import main, read_pairs

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("\n".join(json.dumps({"positive": p, "negative": n}) for p, n in PAIRS) + "\n")
    assert main(["extract", "--model", "tiny:llama", "--pairs", str(pairs), "--layers", "0", "1",
                 "--out", str(tmp_path / "a"), "--quiet"]) == 0
    assert main(["extract", "--model", "tiny:llama", "--pairs", str(pairs), "--layers", "1", "--method",
                 "pca_diff", "--out", str(tmp_path / "b"), "--quiet"]) == 0
    assert (tmp_path / "a" / "adapter_config.json").is_file()
    assert main(["generate", "--model", "tiny:llama", "--adapter", f"{tmp_path / 'a'}:4",
                 "--adapter", f"{tmp_path / 'b'}:-2", "--prompt", "hi", "--prompt", "hello",
                 "--max-new-tokens", "5"]) == 0
    assert main(["export-easyedit", "--model", "tiny:llama", "--adapter", str(tmp_path / "a"),
                 "--out", str(tmp_path / "ee")]) == 0
    assert main(["import-easyedit", "--model", "tiny:llama", "--folder", str(tmp_path / "ee"),
                 "--out", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "wrote steering adapter" in out and out.count("\n") >= 5
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"positive": "x"}\n')
    with pytest.raises(DataError, match="bad.jsonl:1"):
        read_pairs(bad)
