"""A ``model.tokenizer`` that does not resolve is named as that setting: the loader's message said "model 'abc' not
found", which sent a user with a correct ``model`` looking at the wrong line of the recipe."""

from __future__ import annotations

import pytest

from peftplug.errors import MissingFileError
from peftplug.lightning import PeftModule


def test_an_unknown_tokenizer_names_its_setting(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(MissingFileError, match=r"^model\.tokenizer: model 'no-such-tokenizer' not found"):
        PeftModule("tiny:llama", tokenizer="no-such-tokenizer")


def test_an_unknown_model_is_still_named_model(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(MissingFileError, match=r"^model 'no-such-model' not found"):
        PeftModule("no-such-model")
