"""PCT as a PEFT adapter: construction on every family, the fused prompt, training, save/load, errors."""

import shutil

import peft
import pytest
import torch

import prompt_transfer as pt
from peftplug.errors import MissingFileError

FAMILIES = [("llama", "causal_lm", "CAUSAL_LM"), ("qwen2", "causal_lm", "CAUSAL_LM"),
            ("gpt2", "causal_lm", "CAUSAL_LM"), ("bert", "seq_cls", "SEQ_CLS"), ("t5", "seq2seq", "SEQ_2_SEQ_LM")]
L, D, K = 4, 64, 3


@pytest.fixture
def dec_dir(tmp_path):
    g = torch.Generator().manual_seed(0)
    prompts = {f"src{i}": torch.randn(L, D, generator=g) * 0.5 for i in range(K)}
    dec = pt.decompose(prompts, contrastive_steps=30)
    path = tmp_path / "dec"
    pt.save_decomposition(dec, str(path))
    return str(path), dec


def _batch(tokenizer, task):
    enc = tokenizer(["hello world", "abc def"], return_tensors="pt", padding=True)
    batch = dict(enc)
    if task == "seq_cls":
        batch["labels"] = torch.tensor([0, 1])
    else:
        batch["labels"] = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    return batch


@pytest.mark.parametrize("family, task, task_type", FAMILIES)
def test_prompt_equals_reference_and_trains_only_attention(family, task, task_type, tiny_model, tokenizer, dec_dir):
    path, dec = dec_dir
    model = peft.get_peft_model(tiny_model(family, task), pt.PCTConfig(task_type=task_type, decomposition_path=path))
    enc = model.prompt_encoder["default"]
    assert model.peft_config["default"].peft_type == pt.PEFT_TYPE
    # Uniform attention at init: P_t = P_0 + mean_k S_k (= mean source prompt at full rank).
    torch.testing.assert_close(enc.embedding.fused(), dec.p0 + dec.specific.mean(0), atol=1e-6, rtol=0)
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    if task == "seq_cls":  # PEFT adds the classifier head as modules_to_save for SEQ_CLS
        trainable = {n: c for n, c in trainable.items() if "prompt_encoder" in n}
    assert sum(trainable.values()) == D + K * D + L * D, trainable
    batch = _batch(tokenizer, task)
    hist = pt.train_prompt(model, [batch], steps=3, lr=0.05)
    attn = hist["attention"][-1]
    assert list(attn) == ["src0", "src1", "src2"]
    assert sum(attn.values()) == pytest.approx(1.0, abs=1e-6)
    assert all(h != hist["attention"][0] for h in hist["attention"][1:]) or family == "t5"
    assert all(a > 0 for a in hist["aux"])
    assert sum(pt.pct_metrics(model)[f"pct/attn/src{i}"] for i in range(K)) == pytest.approx(1.0, abs=1e-6)
    # The live forward is the base model run on [prompt; input embeddings] (reference computed here).
    model.eval()
    with torch.no_grad():
        out = model(**{k: v for k, v in batch.items() if k != "labels"}, labels=batch["labels"])
        base = model.get_base_model()
        prompt = enc.embedding.fused().unsqueeze(0).expand(2, -1, -1)
        embeds = torch.cat([prompt, base.get_input_embeddings()(batch["input_ids"])], dim=1)
        mask = torch.cat([torch.ones(2, L, dtype=torch.long), batch["attention_mask"]], dim=1)
        if task == "causal_lm" or task == "seq_cls":
            ref = base(inputs_embeds=embeds, attention_mask=mask).logits
        else:
            ref = base(inputs_embeds=embeds, attention_mask=mask, labels=batch["labels"]).logits
    torch.testing.assert_close(out.logits, ref, atol=1e-5, rtol=1e-5)


def test_gradients_reach_only_query_keys_residual(tiny_model, tokenizer, dec_dir):
    path, _ = dec_dir
    model = peft.get_peft_model(tiny_model("llama"), pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=path))
    model.train()
    loss = model(**_batch(tokenizer, "causal_lm")).loss + pt.auxiliary_loss(model)
    loss.backward()
    # key_offsets get a zero gradient at the very first step (the query starts at zero), but they are in the graph.
    with_grad = sorted(n for n, p in model.named_parameters() if p.grad is not None)
    assert model.prompt_encoder["default"].embedding.query.grad.abs().sum() > 0
    assert with_grad == ["prompt_encoder.default.embedding.key_offsets", "prompt_encoder.default.embedding.query",
                         "prompt_encoder.default.embedding.residual"]


def test_ablations_mean_fusion_and_frozen_residual(tiny_model, tokenizer, dec_dir):
    path, _dec = dec_dir
    mean = peft.get_peft_model(tiny_model("llama"), pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=path,
                                                                  fusion="mean"))
    assert [n for n, p in mean.named_parameters() if p.requires_grad] == ["prompt_encoder.default.embedding.residual"]
    hist = pt.train_prompt(mean, [_batch(tokenizer, "causal_lm")], steps=2, lr=0.05)
    assert hist["attention"][-1] == pytest.approx({f"src{i}": 1 / K for i in range(K)})
    frozen = peft.get_peft_model(tiny_model("llama"), pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=path,
                                                                    trainable_residual=False, contrastive_weight=0))
    names = sorted(n for n, p in frozen.named_parameters() if p.requires_grad)
    assert names == ["prompt_encoder.default.embedding.key_offsets", "prompt_encoder.default.embedding.query"]
    assert pt.auxiliary_loss(frozen).item() == 0.0


@pytest.mark.parametrize("family, task, task_type", [FAMILIES[0], FAMILIES[3], FAMILIES[4]])
def test_save_load_roundtrip_without_decomposition_dir(family, task, task_type, tiny_model, tokenizer, dec_dir,
                                                       tmp_path):
    path, _ = dec_dir
    model = peft.get_peft_model(tiny_model(family, task), pt.PCTConfig(task_type=task_type, decomposition_path=path))
    batch = _batch(tokenizer, task)
    pt.train_prompt(model, [batch], steps=2, lr=0.05)
    with torch.no_grad():
        ref = model(**batch).logits
    model.save_pretrained(str(tmp_path / "adapter"))
    shutil.rmtree(path)  # the saved adapter must carry P_0 and S_k itself
    for resume in (False, True):
        if resume:  # PEFT refuses is_trainable=True for prompt learning; PCT has its own resume path
            loaded = pt.load_pct_for_training(tiny_model(family, task), str(tmp_path / "adapter"))
        else:
            loaded = peft.PeftModel.from_pretrained(tiny_model(family, task), str(tmp_path / "adapter"))
        assert isinstance(loaded.peft_config["default"], pt.PCTConfig)
        loaded.eval()
        with torch.no_grad():
            torch.testing.assert_close(loaded(**batch).logits, ref, atol=1e-6, rtol=1e-6)
        assert pt.attention_weights(loaded) == pytest.approx(pt.attention_weights(model), abs=1e-7)
    # Resume: the trainable load keeps training.
    assert loaded.prompt_encoder["default"].embedding.query.requires_grad
    pt.train_prompt(loaded, [batch], steps=1, lr=0.05)


def test_config_errors(tiny_model, dec_dir, tmp_path):
    path, _ = dec_dir
    with pytest.raises(ValueError, match="num_virtual_tokens=7 does not match"):
        pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=path, num_virtual_tokens=7)
    with pytest.raises(ValueError, match="num_sources=5 does not match"):
        pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=path, num_sources=5)
    with pytest.raises(ValueError, match="needs decomposition_path"):
        pt.PCTConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    with pytest.raises(ValueError, match="needs decomposition_path"):
        pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=str(tmp_path / "nowhere"))
    for field, value in [("attention_temperature", 0.0), ("contrastive_temperature", -1.0),
                         ("contrastive_weight", -0.1), ("fusion", "max")]:
        with pytest.raises(ValueError, match=field):
            pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=path, **{field: value})
    with pytest.raises(ValueError, match="nothing to train"):
        pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=path, fusion="mean", trainable_residual=False)
    # Source prompts from a model of another width: caught when the adapter is built.
    with pytest.raises(ValueError, match="token_dim 64"):
        peft.get_peft_model(tiny_model("llama", hidden_size=32),
                            pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=path))


def test_pct_state_is_required_when_decomposition_missing(tiny_model, tokenizer, tmp_path):
    cfg = pt.PCTConfig(task_type="CAUSAL_LM", num_virtual_tokens=L, num_sources=2)
    model = peft.get_peft_model(tiny_model("llama"), cfg)
    with pytest.raises(MissingFileError, match="decomposition_path is not set and no saved PCT state was loaded"):
        model(**_batch(tokenizer, "causal_lm"))


def test_a_state_dict_with_the_sources_makes_the_prompt_usable(tiny_model, tokenizer, tmp_path):
    # torch's load_state_dict (a Lightning checkpoint, load_from_checkpoint, export --ckpt_path) brings P_0 and S_k
    # as PEFT's loader does; once the decomposition folder was gone, such a restore failed at the first forward.
    path = tmp_path / "dec"
    trained = peft.get_peft_model(tiny_model("llama"), pt.PCTConfig(task_type="CAUSAL_LM", num_virtual_tokens=L,
                                                                     num_sources=2))
    with torch.no_grad():
        trained.prompt_encoder["default"].embedding.set_sources(torch.randn(L, 64), torch.randn(2, L, 64))
    fresh = peft.get_peft_model(tiny_model("llama"), pt.PCTConfig(task_type="CAUSAL_LM", num_virtual_tokens=L,
                                                                   num_sources=2, decomposition_path=str(path)))
    fresh.load_state_dict(trained.state_dict())
    batch = _batch(tokenizer, "causal_lm")
    with torch.no_grad():
        torch.testing.assert_close(fresh(**batch).logits, trained(**batch).logits)
