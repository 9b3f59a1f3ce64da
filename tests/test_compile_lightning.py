"""PeftModule's ``compile`` option: a tiny Lightning fit compiled whole equals the eager fit; a base that dynamo
cannot trace whole falls back with one warning naming the layer (``compile: true``) or stops with that line as a
ConfigError (``compile: strict``); invalid settings are refused before any model is built."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from oftv2 import OFTv2Config
from peftplug.errors import ConfigError
from peftplug.lightning import PeftModule
from peftplug.tiny import tiny_model

AOT = {"backend": "aot_eager"}  # traces forward and backward as Inductor would get them, without its C++ compile


def _batches(n: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 90, (n, 2, 12), generator=gen)
    return [{"input_ids": b, "labels": b.clone()} for b in ids]


def _fit(model: nn.Module, steps: int = 3, targets: str | list[str] = "all-linear",
         **module_kwargs) -> tuple[PeftModule, list[float]]:
    module = PeftModule(model, peft=OFTv2Config(block_size=8, target_modules=targets),
                        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), **module_kwargs)
    losses = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[Record()])
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(_batches(steps), batch_size=None))
    return module, losses


def _adapter(module: PeftModule) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad}


class GuardedAct(nn.Module):
    """SiLU that clamps only when an activation overflows: a data-dependent Python branch dynamo cannot trace."""

    def forward(self, x):
        if float(x.abs().max()) > 1e4:
            x = x.clamp(-1e4, 1e4)
        return F.silu(x)


def _guarded_llama() -> nn.Module:
    model = tiny_model("llama", num_hidden_layers=1)
    model.model.layers[0].mlp.act_fn = GuardedAct()
    return model


class GuardedLM(nn.Module):
    """A custom (not Hugging Face) one-block language model with :class:`GuardedAct`: a base of a user's own, whose
    ``forward`` sits in the same file as the breaking one (the warning must still name the inner layer).

    The fallback recompiles without ``fullgraph`` and dynamo then traces every frame around the break again; through
    Llama's deep Hugging Face call stack that took ~40 s on a 2-core CI machine, through this model a few.
    """

    def __init__(self, vocab: int = 96, dim: int = 16):
        super().__init__()
        self.config = PretrainedConfig()  # PEFT's causal-LM wrapper reads the base's config
        self.embed = nn.Embedding(vocab, dim)
        self.up_proj, self.act_fn, self.down_proj = nn.Linear(dim, 2 * dim), GuardedAct(), nn.Linear(2 * dim, dim)
        self.lm_head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **_) -> SimpleNamespace:
        hidden = self.embed(input_ids)
        logits = self.lm_head(hidden + self.down_proj(self.act_fn(self.up_proj(hidden))))
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return SimpleNamespace(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, **kwargs) -> dict:
        """What PEFT's causal-LM wrapper takes from a causal LM (never called here)."""
        return {"input_ids": input_ids, **kwargs}


def test_compiled_fit_equals_eager_fit():
    from torch._dynamo.utils import counters

    eager, eager_losses = _fit(tiny_model("llama", num_hidden_layers=1))
    torch._dynamo.reset()
    counters.clear()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        compiled, losses = _fit(tiny_model("llama", num_hidden_layers=1), compile=True, compile_options=AOT)
    assert not [w for w in record if "fullgraph" in str(w.message)]  # no fallback: the model compiles whole
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    for name, value in _adapter(compiled).items():
        torch.testing.assert_close(value, _adapter(eager)[name], rtol=1e-4, atol=1e-6)
    # Compiled in place: parameter names (checkpoints, exports) are unchanged.
    assert sorted(compiled.state_dict()) == sorted(eager.state_dict())
    torch._dynamo.reset()


def test_a_base_that_breaks_the_graph_falls_back_with_one_warning():
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match=r"falling back to fullgraph=False") as record:
        module, losses = _fit(GuardedLM(), steps=1, targets=["up_proj", "down_proj"], compile=True,
                              compile_options=AOT)
    (warning,) = [w for w in record if "fullgraph" in str(w.message)]
    message = str(warning.message)
    assert "\n" not in message
    assert "base_model.model.act_fn (GuardedAct)" in message
    assert "test_compile_lightning.py" in message and "data-dependent" in message
    assert len(losses) == 1 and math.isfinite(losses[0])
    assert all(p.abs().max() > 0 for p in _adapter(module).values())
    torch._dynamo.reset()


def test_strict_stops_with_one_line_naming_the_layer():
    torch._dynamo.reset()
    with pytest.raises(ConfigError, match=r"model.compile: strict: .*layers\.0\.mlp\.act_fn \(GuardedAct\)") as err:
        _fit(_guarded_llama(), steps=1, compile="strict", compile_options=AOT)
    assert "\n" not in str(err.value)
    torch._dynamo.reset()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"compile": "yes"}, r"model.compile must be one of \[False, True, 'strict'\]; got 'yes'"),
    ({"compile": True, "compile_options": {"fullgraph": False}}, r"model.compile_options: unknown key\(s\) \['fullgraph'\]"),
])
def test_invalid_compile_settings(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        PeftModule(nn.Linear(2, 2), **kwargs)
