"""peftplug.optional: the one cached bitsandbytes check, and the loader asking it."""

from __future__ import annotations

import sys

import pytest
import torch

from peftplug.errors import ConfigError
from peftplug.optional import bitsandbytes_available


@pytest.fixture
def fresh_check():
    bitsandbytes_available.cache_clear()
    yield bitsandbytes_available
    bitsandbytes_available.cache_clear()


def test_the_check_says_whether_bitsandbytes_imports(fresh_check):
    try:
        import bitsandbytes  # noqa: F401
        expected = True
    except Exception:  # noqa: BLE001
        expected = False
    assert fresh_check() is expected
    assert fresh_check.cache_info().hits == 0 and fresh_check() is expected and fresh_check.cache_info().hits == 1


def test_a_blocked_bitsandbytes_reads_as_unavailable_and_the_loader_says_what_to_install(fresh_check, monkeypatch):
    from peftplug.loading import quantization_config

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` now raises ImportError
    assert fresh_check() is False
    with pytest.raises(ConfigError, match="quantization='nf4' needs bitsandbytes: pip install bitsandbytes"):
        quantization_config("nf4", torch.float32, "causal_lm")
    assert quantization_config("none", torch.float32, "causal_lm") is None
