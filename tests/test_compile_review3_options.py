"""Fourth review of ``compile``: ``model.compile_options`` values are checked with the other settings, before any
model is loaded.

Only the keys were checked. A value ``torch.compile`` refuses surfaced when the loaded model was compiled, minutes
into a large model's load, and not as a settings error: ``dynamic: auto`` as a bare ``AssertionError: Expected
enable to be a bool``, a mode typo (``reduce_overhead``) or an unknown backend as a ``RuntimeError`` naming no field,
``mode`` together with ``options`` likewise. Each is now a one-line ConfigError naming the field and what it accepts.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from peftplug.compiling import ModelCompiler
from peftplug.errors import ConfigError
from peftplug.lightning import PeftModule

BAD = [
    ({"dynamic": "auto"}, r"model.compile_options.dynamic must be true .*false .*or null .*got 'auto'"),
    ({"dynamic": 1}, r"model.compile_options.dynamic must be true .*got 1"),
    ({"mode": "reduce_overhead"}, r"model.compile_options.mode must be one of \[.*'reduce-overhead'.*\] or null; got"),
    ({"backend": "inductr"}, r"model.compile_options.backend must be a registered dynamo backend .*got 'inductr'"),
    ({"backend": 3}, r"model.compile_options.backend must be a backend name or a callable; got 3"),
    ({"options": ["max_autotune"]}, r"model.compile_options.options must be a mapping"),
    ({"mode": "max-autotune", "options": {"max_autotune": True}}, r"model.compile_options: give mode or options"),
]


@pytest.mark.parametrize(("options", "match"), BAD)
def test_bad_values_are_one_line_config_errors(options, match):
    with pytest.raises(ConfigError, match=match) as err:
        PeftModule(nn.Linear(2, 2), compile=True, compile_options=options)
    assert "\n" not in str(err.value)


def test_refused_before_the_model_is_loaded(tmp_path):
    # A model path that does not exist: the settings error comes first, as for the other model.* settings.
    with pytest.raises(ConfigError, match=r"model.compile_options.mode"):
        PeftModule(str(tmp_path / "no-such-model"), compile=True, compile_options={"mode": "fast"})


@pytest.mark.parametrize("options", [
    {"backend": "aot_eager", "dynamic": None, "mode": None, "options": None},
    {"mode": "reduce-overhead", "dynamic": True},
    {"backend": "inductor", "options": {"max_autotune": False}, "dynamic": False},
])
def test_valid_values_pass_on_to_torch_compile(options):
    compiler = ModelCompiler(True, options)
    assert compiler.options == options


class Small(nn.Module):
    """A module of this file (dynamo skips torch.nn's own forwards as top frames)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.linear(x))


def test_a_callable_backend_is_accepted_and_used():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model = Small()
    compiler = ModelCompiler(True, {"backend": backend})
    compiler.attach(model)
    x = torch.randn(2, 4)
    torch.testing.assert_close(compiler.call(model, x), torch.tanh(model.linear(x)))
    assert len(graphs) == 1
    torch._dynamo.reset()
