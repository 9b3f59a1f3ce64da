"""The cache of built models (``tiny:<family>``, ``stories260k``: ``<cache>/built/<name>-<content hash>``) damaged
from outside -- a file truncated by an interrupted copy of the cache, a file deleted -- is rebuilt by the next
process instead of failing its load with a safetensors deserialization traceback: the folder is named after its
content, which every process builds anyway."""

from __future__ import annotations

import os

import pytest
import torch

from peftplug import loading
from peftplug.loading import load_model, load_tokenizer, resolve_model_path
from peftplug.tiny import tiny_model


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache, and no folder remembered by this process (as in a new process)."""
    monkeypatch.setenv("PEFTPLUG_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "_BUILT_DIRS", {})
    return tmp_path / "cache" / "built"


def _as_a_new_process(monkeypatch) -> None:
    monkeypatch.setattr(loading, "_BUILT_DIRS", {})


def test_a_damaged_built_folder_is_rebuilt_in_place(fresh_cache, monkeypatch):
    folder = resolve_model_path("tiny:llama")
    assert os.path.dirname(folder) == str(fresh_cache)
    weights = os.path.join(folder, "model.safetensors")
    with open(weights, "r+b") as handle:  # cut short, as an interrupted copy leaves it
        handle.truncate(1000)
    os.remove(os.path.join(folder, "tokenizer.json"))
    _as_a_new_process(monkeypatch)

    model = load_model("tiny:llama")
    assert resolve_model_path("tiny:llama") == folder  # the same (content-named) folder, repaired
    expected = tiny_model("llama", seed=0).state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert load_tokenizer("tiny:llama")("ab")["input_ids"] == [14, 15]  # 4 specials, then 0-9, a, b
    assert sorted(p.name for p in fresh_cache.iterdir()) == [os.path.basename(folder)]  # no .tmp or .old left


def test_an_intact_built_folder_is_reused_untouched(fresh_cache, monkeypatch):
    folder = resolve_model_path("tiny:llama")
    stamps = {name: os.stat(os.path.join(folder, name)).st_ino for name in os.listdir(folder)}
    _as_a_new_process(monkeypatch)
    assert resolve_model_path("tiny:llama") == folder
    assert {name: os.stat(os.path.join(folder, name)).st_ino for name in os.listdir(folder)} == stamps
