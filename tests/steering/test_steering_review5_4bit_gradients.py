"""Fifth review: a steering vector on an nf4 base loaded outside peftplug keeps its gradient after an eval forward.

bitsandbytes 0.50 repacks a ``Linear4bit`` in place at its first eval forward without gradients on CPUs with
AVX512-BF16 (``evaluate()``, ``generate``, or ``train_vectors``' own no-grad reference forward), and the repacked
matmul has no autograd: the vector's gradient then missed every path through the later blocks (on the tiny nf4
Llama the gradient of a layer-0 vector changed by 2.5e-4 of 3.7e-2 after one eval forward; no error). The steering
tuner now switches the repacking off when it attaches (``peftplug.quantized_layout.keep_exact_4bit_layout``); a base
repacked before the adapter was attached still steers, and training it is refused. On CPUs without AVX512-BF16
nothing is ever repacked, and the second test skips.
"""

from __future__ import annotations

import pytest
import torch

from peftplug.quantized_layout import RepackedWeightError, repacked_layers
from steering import steering_adapter

IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])


def _vector_grad(model) -> torch.Tensor:
    model.train()
    model.zero_grad()
    model(input_ids=IDS, labels=IDS).loss.backward()
    return dict(model.named_parameters())["base_model.model.model.layers.0.steer_vector.default.weight"].grad.clone()


def test_vector_gradient_is_unchanged_by_an_eval_forward(nf4_base):
    g = torch.Generator().manual_seed(0)
    model = steering_adapter(nf4_base(), {0: torch.randn(64, generator=g)}, multiplier=1.0)
    before = _vector_grad(model)
    assert before.abs().sum() > 0
    model.eval()
    with torch.no_grad():
        model(input_ids=IDS)  # what Trainer.evaluate / generate run
    torch.testing.assert_close(_vector_grad(model), before, atol=0, rtol=0)
    assert repacked_layers(model) == []


def test_a_base_repacked_before_the_adapter_steers_but_refuses_training(nf4_base):
    base = nf4_base()
    base.eval()
    with torch.no_grad():
        plain = base(input_ids=IDS).logits  # e.g. a CAA pass over the base before the vector is attached
    if not repacked_layers(base):
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes never repacks")
    model = steering_adapter(base, {0: torch.zeros(64)}, multiplier=1.0)  # inference on it stays allowed
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=IDS).logits, plain, atol=0, rtol=0)
    with pytest.raises(RepackedWeightError, match="cannot train a steering vector.*reload the model"):
        model.train()
