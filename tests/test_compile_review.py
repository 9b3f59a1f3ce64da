"""PeftModule's ``compile`` where ``fullgraph=True`` stops for reasons other than a plain graph break.

- Dynamo's recompile limit: under ``fullgraph=True`` dynamo raises ``FailOnRecompileLimitHit`` where it would
  otherwise run the call eagerly, so a fit, test or predict that needs one graph more than
  ``torch._dynamo.config.recompile_limit`` (8: every new grad mode, ``inference_mode``, batch size 1 or input shape
  compiles one) stopped with a traceback. ``compile: true`` now falls back with one warning, ``compile: strict``
  stops with one line. The limit is lowered to 1 and ``dynamic: false`` makes every sequence length a new graph, so
  that two forwards reach it with one trace of the model (``backend="eager"``: the limit is dynamo's, whatever the
  backend).
- An exception the model raises for a bad batch: dynamo stops tracing at it as at a graph break ("Observed
  exception"), so ``compile: true`` warned that the model cannot be traced whole and dropped ``fullgraph`` for the
  rest of the run, and ``compile: strict`` replaced the model's own error with that claim. The model's error is
  what the user sees now, and ``fullgraph`` stays.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from oftv2 import OFTv2Config
from peftplug.compiling import ModelCompiler
from peftplug.errors import ConfigError
from peftplug.lightning import PeftModule
from peftplug.tiny import tiny_model

OPTIONS = {"backend": "eager", "dynamic": False}
LENGTHS = (8, 9)  # two static shapes: one more than the lowered limit


def _limit(value: int):
    from torch._dynamo import config

    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{name: value})


def _module(compile: bool | str) -> PeftModule:
    module = PeftModule(tiny_model("llama", num_hidden_layers=1),
                        peft=OFTv2Config(block_size=8, target_modules=["q_proj", "down_proj"]), compile=compile,
                        compile_options=OPTIONS)
    with torch.no_grad():  # away from OFT's identity start, so that the adapter shapes the loss and gradients
        for param in module.model.parameters():
            if param.requires_grad:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    return module.train()


def _steps(module: PeftModule) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Loss and adapter gradients of one forward and backward per length in :data:`LENGTHS`."""
    gen = torch.Generator().manual_seed(0)
    results = []
    for length in LENGTHS:
        ids = torch.randint(4, 90, (2, length), generator=gen)
        loss = module(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = [p.grad.clone() for p in module.model.parameters() if p.requires_grad]
        module.model.zero_grad(set_to_none=True)
        results.append((loss.detach(), grads))
    return results


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every module here compiles the same PEFT forward: start from an empty cache, so the limit counts this test."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_recompile_limit_falls_back_with_one_warning_and_eager_results():
    eager = _steps(_module(False))
    with _limit(1), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        compiled = _steps(_module(True))
    fallbacks = [str(w.message) for w in record if "fullgraph" in str(w.message)]
    assert len(fallbacks) == 1 and "\n" not in fallbacks[0], fallbacks
    assert "falling back to fullgraph=False" in fallbacks[0] and "recompile limit" in fallbacks[0]
    for (loss, grads), (eager_loss, eager_grads) in zip(compiled, eager, strict=True):
        torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
        for grad, eager_grad in zip(grads, eager_grads, strict=True):
            torch.testing.assert_close(grad, eager_grad, rtol=1e-4, atol=1e-6)


def test_recompile_limit_under_strict_is_one_line():
    module = _module("strict")
    with _limit(1), pytest.raises(ConfigError, match=r"model.compile: strict: .*recompile limit") as err:
        _steps(module)
    assert "\n" not in str(err.value)


def _eager_error(batch: dict) -> str:
    with pytest.raises(Exception) as err:
        _module(False)(**batch)
    return f"{type(err.value).__name__}: {err.value}"


@pytest.mark.parametrize("compile", [True, "strict"])
def test_the_models_own_error_is_raised_and_fullgraph_kept(compile):
    ids = torch.randint(4, 90, (2, 8), generator=torch.Generator().manual_seed(0))
    bad = {"labels": ids}  # no input_ids: the model's own ValueError
    expected = _eager_error(bad)
    assert expected.startswith("ValueError: ")
    module = _module(compile)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with pytest.raises(Exception) as err:
            module(**bad)
        assert f"{type(err.value).__name__}: {err.value}" == expected
        # The next, valid batch still runs whole-graph, and equals eager.
        loss = module(input_ids=ids, labels=ids).loss
    assert not [w for w in record if "fullgraph" in str(w.message)]
    assert module._compiler.fullgraph
    torch.testing.assert_close(loss, _module(False)(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=1e-6)


class RefusesCompile(nn.Module):
    """A layer that raises under ``torch.compile`` only: an exception dynamo observes although eager runs fine."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        if torch.compiler.is_compiling():
            raise RuntimeError("this layer does not compile")
        return self.linear(x)


def test_an_exception_only_raised_under_compile_still_falls_back_naming_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), RefusesCompile())
    x = torch.randn(2, 4)
    expected = model(x)
    compiler = ModelCompiler(True, {"backend": "eager"})
    compiler.attach(model)
    with pytest.warns(UserWarning, match=r"falling back to fullgraph=False") as record:
        outputs = [compiler.call(model, x) for _ in range(2)]
    (message,) = [str(w.message) for w in record if "fullgraph" in str(w.message)]
    assert "layer 1 (RefusesCompile)" in message and "this layer does not compile" in message
    for output in outputs:
        torch.testing.assert_close(output, expected)
    # Dynamo skips these code objects from now on (the fallback ran them eagerly): strict needs a fresh cache.
    torch._dynamo.reset()
    strict = ModelCompiler("strict", {"backend": "eager"})
    strict.attach(nn.Sequential(nn.Linear(4, 4), RefusesCompile()))
    with pytest.raises(ConfigError, match=r"layer 1 \(RefusesCompile\).*this layer does not compile"):
        strict.call(strict.model, x)
