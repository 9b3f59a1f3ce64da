"""Generators: CAA against a hand computation, PCA variants, vector-prompt, trained vectors, input validation."""

from __future__ import annotations

import pytest
import torch

import steering
from steering.generators import collate_pairs, extract_activations, steering_loss

PAIRS = [
    ("The answer is yes, great", "The answer is no, awful"),
    ("I feel happy today", "I feel sad today"),
    ("We won the game", "We lost the game"),
]


def _block_outputs(model, tokenizer, text, layer):
    """Hand computation: block ``layer``'s output = transformers' hidden_states[layer + 1] (not the last)."""
    ids = tokenizer([text], return_tensors="pt")
    with torch.no_grad():
        out = model(**ids, output_hidden_states=True)
    return out.hidden_states[layer + 1][0], ids["input_ids"][0].tolist()


@pytest.mark.parametrize("family", ("llama", "gpt2"))
def test_caa_vector_equals_hand_computed_mean_difference(family, tiny_model, tokenizer):
    model = tiny_model(family, num_hidden_layers=3) if family == "llama" else tiny_model(family, n_layer=3)
    layer = 1
    diffs_last, diffs_answer = [], []
    for pos, neg in PAIRS:
        hp, ip = _block_outputs(model, tokenizer, pos, layer)
        hn, in_ = _block_outputs(model, tokenizer, neg, layer)
        diffs_last.append(hp[-1] - hn[-1])
        start = next(i for i, (a, b) in enumerate(zip(ip, in_)) if a != b)
        diffs_answer.append(hp[start:].mean(0) - hn[start:].mean(0))
    for read, diffs in (("last", diffs_last), ("answer", diffs_answer)):
        vec = steering.caa_vectors(model, tokenizer, PAIRS, [layer], read=read, batch_size=2, progress=False)[layer]
        torch.testing.assert_close(vec, torch.stack(diffs).mean(0), rtol=1e-4, atol=1e-5)
    pm = steering.train_steering_vector(model, tokenizer, PAIRS, method="caa", layers=[layer], read="last",
                                        progress=False)
    torch.testing.assert_close(pm.base_model.get_vectors()[layer], torch.stack(diffs_last).mean(0), rtol=1e-4,
                               atol=1e-5)
    cfg = pm.base_model.peft_config["default"]
    assert (cfg.method, cfg.read_position, cfg.num_pairs, cfg.hidden_size, cfg.model_type) == (
        "caa", "last", 3, 64, family)


def test_extraction_is_batch_size_independent_and_ignores_active_adapters(tiny_model, tokenizer):
    model = tiny_model("llama")
    texts = [p for p, _ in PAIRS] + ["x", "a much longer text than the others here"]
    a = extract_activations(model, tokenizer, texts, [0, 1], read="mean", batch_size=1, progress=False)
    b = extract_activations(model, tokenizer, texts, [0, 1], read="mean", batch_size=4, progress=False)
    for layer in (0, 1):
        torch.testing.assert_close(a[layer], b[layer], rtol=1e-4, atol=1e-5)
    pm = steering.steering_adapter(model, {0: torch.ones(64) * 5})
    c = extract_activations(pm, tokenizer, texts, [0, 1], read="mean", batch_size=4, progress=False)
    torch.testing.assert_close(a[1], c[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ("pca_diff", "pca_center"))
def test_pca_vectors_point_from_negative_to_positive(method, tiny_model, tokenizer):
    model = tiny_model("llama")
    vec = steering.pca_vectors(model, tokenizer, PAIRS, [1], mode=method.split("_")[1], progress=False)[1]
    pos = extract_activations(model, tokenizer, [p for p, _ in PAIRS], [1], progress=False)[1]
    neg = extract_activations(model, tokenizer, [n for _, n in PAIRS], [1], progress=False)[1]
    assert float(((pos - neg) @ vec).mean()) > 0
    unit = vec / vec.norm()
    torch.testing.assert_close(vec.norm(), ((pos - neg) @ unit).mean(), rtol=1e-4, atol=1e-6)
    diff = (pos - neg).double()
    if method == "pca_diff":  # repeng: PCA (centred) of the differences
        diff = diff - diff.mean(dim=0)
    _, _, vh = torch.linalg.svd(diff)  # pca_center: top right-singular vector of the uncentred differences
    assert abs(float(vh[0].float() @ unit)) > 0.999


def test_vector_prompt_is_caa_of_prompted_vs_plain(tiny_model, tokenizer):
    model = tiny_model("llama")
    texts = ["the dog", "a day at sea"]
    vp = steering.vector_prompt_vectors(model, tokenizer, texts, "Be happy.", [0], progress=False)[0]
    ref = steering.caa_vectors(model, tokenizer, [("Be happy. " + t, t) for t in texts], [0], read="last",
                               progress=False)[0]
    torch.testing.assert_close(vp, ref)
    pm = steering.train_steering_vector(model, tokenizer, [(t, t) for t in texts], method="vector_prompt",
                                        layers=[0], prompt="Be happy.", progress=False)
    torch.testing.assert_close(pm.base_model.get_vectors()[0], vp)


@pytest.mark.parametrize("objective", ("preference", "lm"))
def test_trainable_vector_lowers_its_loss(objective, tiny_model, tokenizer):
    pm = steering.train_steering_vector(tiny_model("llama"), tokenizer, PAIRS, method="trainable", layers=[0, 1],
                                        objective=objective, steps=25, lr=0.1, progress=False)
    batch = collate_pairs(tokenizer, PAIRS)
    trained = float(steering_loss(pm, batch, objective))
    vectors = pm.base_model.get_vectors()
    assert all(v.norm() > 0 for v in vectors.values())
    pm.base_model.set_multiplier(0.0)
    untrained = float(steering_loss(pm, batch, objective))
    assert trained < untrained - 0.05, (trained, untrained)


def test_empty_and_malformed_pairs_are_rejected(tiny_model, tokenizer):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="pairs is empty"):
        steering.train_steering_vector(model, tokenizer, [], layers=[0])
    with pytest.raises(ValueError, match="pairs\\[0\\]"):
        steering.caa_vectors(model, tokenizer, [("only one",)], [0])
    with pytest.raises(ValueError, match="non-empty strings"):
        steering.caa_vectors(model, tokenizer, [("a", "")], [0])
    with pytest.raises(ValueError, match="method"):
        steering.train_steering_vector(model, tokenizer, PAIRS, method="sae", layers=[0])
    with pytest.raises(ValueError, match="layers"):
        steering.train_steering_vector(model, tokenizer, PAIRS, layers=[7])
    with pytest.raises(ValueError, match="prompt"):
        steering.train_steering_vector(model, tokenizer, PAIRS, method="vector_prompt", layers=[0])


def test_vector_trains_through_the_lightning_module(tiny_model, tokenizer):
    """The vector is a plain PEFT parameter: peftplug's LightningModule trains it with the LM loss."""
    lightning = pytest.importorskip("lightning")
    from peftplug.lightning import PeftModule

    module = PeftModule(tiny_model("llama"), peft={"peft_type": "STEERING", "layers": [0, 1]},
                        optimizer=lambda params: torch.optim.Adam(params, lr=0.05))
    texts = ["I feel happy today", "We won the game"] * 4
    ids = [torch.tensor(tokenizer(t)["input_ids"]) for t in texts]
    batches = [{"input_ids": i[None], "attention_mask": torch.ones_like(i)[None], "labels": i[None]} for i in ids]
    with torch.no_grad():
        before = sum(float(module.model(**b).loss) for b in batches)
    trainer = lightning.Trainer(max_steps=8, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, accelerator="cpu")
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    module.model.eval()
    with torch.no_grad():
        after = sum(float(module.model(**b).loss) for b in batches)
    vectors = module.model.base_model.get_vectors()
    assert all(v.norm() > 0 for v in vectors.values()) and after < before
