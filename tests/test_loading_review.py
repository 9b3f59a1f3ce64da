"""Model names that are not models, and Hub names where the Hub cannot be used: one-line errors at once, and Hub
models already in the Hugging Face cache load from it (as transformers loads them)."""

from __future__ import annotations

import shutil
import time

import huggingface_hub.constants
import pytest
import torch
from peft import LoraConfig, get_peft_model

from peftplug import load_adapter
from peftplug.errors import ConfigError, MissingFileError
from peftplug.loading import hub_offline, load_model, load_tokenizer, resolve_model_path

HUB_ID = "someorg/tiny-llama"
UNRESOLVABLE = "https://peftplug-test.invalid"  # RFC 2606: a .invalid name never resolves


def _hub_cache(tmp_path, monkeypatch):
    """A Hugging Face cache holding the tiny Llama as Hub model HUB_ID (the layout hf_hub_download writes)."""
    cache = tmp_path / "hub"
    repo = cache / "models--someorg--tiny-llama"
    shutil.copytree(resolve_model_path("tiny:llama"), repo / "snapshots" / ("a" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return repo / "snapshots" / ("a" * 40)


def _hub_unreachable(monkeypatch):
    """The Hub switched on but unreachable: no offline flag, no proxy, an endpoint whose host never resolves."""
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy",
                "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", UNRESOLVABLE)


def test_cached_hub_model_loads_offline(tmp_path, monkeypatch):
    _hub_cache(tmp_path, monkeypatch)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    x = torch.randint(4, 90, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = load_model("tiny:llama").eval()(input_ids=x).logits
        model = load_model(HUB_ID).eval()
        assert torch.equal(model(input_ids=x).logits, reference)
    assert model.name_or_path == HUB_ID  # what its adapters record: the Hub id, not the cache folder
    assert load_tokenizer(HUB_ID)("abc")["input_ids"] == load_tokenizer("tiny:llama")("abc")["input_ids"]


def test_unreachable_hub_fails_at_once_and_uses_the_cache(tmp_path, monkeypatch):
    _hub_unreachable(monkeypatch)
    start = time.monotonic()
    with pytest.raises(MissingFileError, match=r"^model 'models/mine' not found: .*not in the Hugging Face cache, "
                                               r"and the Hub cannot be reached \(peftplug-test\.invalid cannot be"):
        resolve_model_path("models/mine")  # a mistyped relative path looks like a Hub id
    assert time.monotonic() - start < 10
    snapshot = _hub_cache(tmp_path, monkeypatch)
    assert resolve_model_path(HUB_ID) == str(snapshot)


@pytest.mark.parametrize("value", ["1", "true", "YES", "on", "0", "false", "FALSE", "no", "off", ""])
def test_offline_flag_reads_like_huggingface_hub(monkeypatch, value):
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", value)
    assert hub_offline() == huggingface_hub.constants._is_true(value or None)


def test_folders_that_hold_no_model_are_named(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for load, what in ((load_model, "model"), (load_tokenizer, "tokenizer")):
        with pytest.raises(MissingFileError, match=rf"the folder {empty} holds no {what} \(none of"):
            load(str(empty))
    tokenizer_only = tmp_path / "tokenizer_only"
    load_tokenizer("tiny:llama").save_pretrained(tokenizer_only)
    with pytest.raises(MissingFileError, match=rf"the folder {tokenizer_only} holds no model \(none of config\.json"):
        load_model(str(tokenizer_only))
    unknown = tmp_path / "unknown"
    shutil.copytree(resolve_model_path("tiny:llama"), unknown)
    (unknown / "config.json").write_text('{"model_type": "no_such_architecture"}')
    with pytest.raises(ConfigError) as err:
        load_model(str(unknown))
    assert f"cannot read the model in {unknown}" in str(err.value) and "\n" not in str(err.value)
    (unknown / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="cannot read the model in .*model_type"):
        load_model(str(unknown))


def test_a_file_is_not_a_model(tmp_path):
    gguf = tmp_path / "model.Q4_1.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(ConfigError, match=r"is a file; a model is a folder .*GGUF file loads only as a packaged "
                                          r"model \(smollm2-135m-instruct\)"):
        load_model(str(gguf))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="is a file; a model is a folder") as err:
        load_tokenizer(str(tmp_path / "config.json"))
    assert "GGUF" not in str(err.value)


def test_adapter_trained_on_nf4_reloads_onto_it(tmp_path):
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    model = get_peft_model(load_model("tiny:llama", quantization="nf4"),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)).eval()
    assert type(model.base_model.model.lm_head) is torch.nn.Linear  # the head is never quantized
    x = torch.randint(4, 90, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(input_ids=x).logits
    model.save_pretrained(tmp_path)
    reloaded = load_adapter("tiny:llama", tmp_path, quantization="nf4").eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=x).logits, reference)
