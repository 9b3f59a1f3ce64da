"""Loads llama2.c's real pretrained ``stories260K`` model as a ``transformers.LlamaForCausalLM`` + its tokenizer.

The files (``stories260K.bin``, ``tok512.model``) live in the shared data directory, never in this repository;
``FORMAT_NOTES.py`` next to them documents the binary layout this reader follows (llama2.c "version 0"
checkpoint: a 7 x int32 header, then float32 arrays back to back).

One conversion detail matters: llama2.c rotates *interleaved* pairs ``(x[2i], x[2i+1])`` with RoPE, while
transformers' Llama rotates the two *halves* of each head (``x[i]``, ``x[i + d/2]``). Attention scores are
invariant under a common permutation of the query and key features of a head, so permuting the rows of
``wq``/``wk`` per head (even features first, then odd) turns one layout into the other exactly; ``wv``/``wo``
are untouched. Greedy decoding from BOS then reproduces the story documented in llama2.c
(``"Once upon a time, there was a little girl named Lily. ..."``).

Example::

    from steering.stories260k import load_stories260k
    model, tokenizer = load_stories260k()  # the shared data directory; or load_stories260k("path/to/data")

``peftplug.loading`` loads it by the name ``stories260k`` (``peftplug fit``, ``peftplug steering``, ...).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import torch

from peftplug.datadir import default_data_dir

HEADER_FIELDS = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")
MODEL_FILE = "stories260K.bin"
TOKENIZER_FILE = "tok512.model"
BOS_ID, EOS_ID = 1, 2


def _resolve_dir(path: str | os.PathLike | None) -> Path:
    """Accepts the shared data dir (``None``: :func:`peftplug.datadir.default_data_dir`) or its ``stories260K``
    sub-folder."""
    path = default_data_dir() if path is None else Path(path).expanduser()
    if (path / "stories260K" / MODEL_FILE).is_file():
        return path / "stories260K"
    if (path / MODEL_FILE).is_file():
        return path
    raise FileNotFoundError(
        f"no {MODEL_FILE} under {path} (nor under {path / 'stories260K'}); pass the shared data directory"
    )


def read_header(path: str | os.PathLike) -> dict:
    """Reads the 28-byte llama2.c header.

    Args:
        path: Path of a llama2.c legacy checkpoint (``.bin``).

    Returns:
        Dict with the fields of :data:`HEADER_FIELDS` (``vocab_size`` made positive) and ``shared_classifier``
        (a negative stored vocab size means the classifier is a separate matrix at the end of the file).
    """
    with open(path, "rb") as f:
        raw = f.read(28)
    if len(raw) != 28:
        raise ValueError(f"{path} is too short to be a llama2.c checkpoint ({len(raw)} bytes)")
    values = dict(zip(HEADER_FIELDS, struct.unpack("<7i", raw)))
    values["shared_classifier"] = values["vocab_size"] > 0
    values["vocab_size"] = abs(values["vocab_size"])
    return values


def _interleaved_to_half_split(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Permutes the output rows of a q/k projection from llama2.c's interleaved RoPE pairs to HF's halves.

    Args:
        w: ``[n_heads * head_dim, in]`` weight whose rows per head are ordered (re0, im0, re1, im1, ...).
        n_heads: Number of heads the rows are split into.
    """
    out, inp = w.shape
    head_dim = out // n_heads
    return w.view(n_heads, head_dim // 2, 2, inp).transpose(1, 2).reshape(out, inp)


def read_llama2c_state_dict(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """Reads a llama2.c legacy checkpoint into a transformers-Llama state dict.

    Args:
        path: Path of the ``.bin`` checkpoint.

    Returns:
        ``(header, state_dict)``; the state dict uses ``LlamaForCausalLM`` parameter names, with q/k rows
        already permuted to the half-split RoPE layout.

    Raises:
        ValueError: If the file size does not match the header (truncated or a different format).
    """
    h = read_header(path)
    d, hd, n_layers = h["dim"], h["hidden_dim"], h["n_layers"]
    n_heads, n_kv, vocab, seq = h["n_heads"], h["n_kv_heads"], h["vocab_size"], h["seq_len"]
    head_size = d // n_heads
    kv_dim = d * n_kv // n_heads
    shapes = [
        ("tok", (vocab, d)), ("rms_att", (n_layers, d)), ("wq", (n_layers, d, d)), ("wk", (n_layers, kv_dim, d)),
        ("wv", (n_layers, kv_dim, d)), ("wo", (n_layers, d, d)), ("rms_ffn", (n_layers, d)),
        ("w1", (n_layers, hd, d)), ("w2", (n_layers, d, hd)), ("w3", (n_layers, hd, d)), ("rms_final", (d,)),
        ("freq_real", (seq, head_size // 2)), ("freq_imag", (seq, head_size // 2)),
    ]
    if not h["shared_classifier"]:
        shapes.append(("wcls", (vocab, d)))
    n_floats = sum(torch.Size(s).numel() for _, s in shapes)
    expected = 28 + 4 * n_floats
    size = os.path.getsize(path)
    if size != expected:
        raise ValueError(
            f"{path}: {size} bytes, but the header {h} implies {expected}; not a llama2.c legacy checkpoint "
            "(or truncated)"
        )
    with open(path, "rb") as f:
        f.seek(28)
        flat = torch.frombuffer(bytearray(f.read()), dtype=torch.float32)
    arrays, offset = {}, 0
    for name, shape in shapes:
        n = torch.Size(shape).numel()
        arrays[name] = flat[offset:offset + n].view(shape).clone()
        offset += n

    sd = {"model.embed_tokens.weight": arrays["tok"], "model.norm.weight": arrays["rms_final"]}
    sd["lm_head.weight"] = arrays["wcls"] if "wcls" in arrays else arrays["tok"]
    for i in range(n_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = arrays["rms_att"][i]
        sd[p + "post_attention_layernorm.weight"] = arrays["rms_ffn"][i]
        sd[p + "self_attn.q_proj.weight"] = _interleaved_to_half_split(arrays["wq"][i], n_heads)
        sd[p + "self_attn.k_proj.weight"] = _interleaved_to_half_split(arrays["wk"][i], n_kv)
        sd[p + "self_attn.v_proj.weight"] = arrays["wv"][i]
        sd[p + "self_attn.o_proj.weight"] = arrays["wo"][i]
        sd[p + "mlp.gate_proj.weight"] = arrays["w1"][i]
        sd[p + "mlp.down_proj.weight"] = arrays["w2"][i]
        sd[p + "mlp.up_proj.weight"] = arrays["w3"][i]
    return h, sd


def stories260k_model(data_dir: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32):
    """Builds the ``LlamaForCausalLM`` of stories260K (eval mode).

    Args:
        data_dir: The shared data directory (or its ``stories260K`` sub-folder); ``None``: the default one
            (``$PEFTPLUG_DATA_DIR``, else ``../shared/data`` beside the checkout).
        dtype: Parameter dtype.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    path = _resolve_dir(data_dir) / MODEL_FILE
    h, sd = read_llama2c_state_dict(path)
    config = LlamaConfig(
        vocab_size=h["vocab_size"], hidden_size=h["dim"], intermediate_size=h["hidden_dim"],
        num_hidden_layers=h["n_layers"], num_attention_heads=h["n_heads"], num_key_value_heads=h["n_kv_heads"],
        max_position_embeddings=h["seq_len"], rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
        tie_word_embeddings=h["shared_classifier"], bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=0,
        attention_bias=False, mlp_bias=False,
    )
    # 260K parameters: building on CPU with a throw-away init is cheaper than meta-device bookkeeping; the
    # forked RNG keeps the caller's global random state untouched.
    with torch.random.fork_rng(devices=[]):
        model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and h["shared_classifier"])]
    if missing or unexpected:
        raise RuntimeError(f"stories260K conversion mismatch: missing {missing}, unexpected {unexpected}")
    if h["shared_classifier"]:
        model.tie_weights()
    return model.to(dtype).eval()


def stories260k_tokenizer(data_dir: str | os.PathLike | None = None, padding_side: str = "left"):
    """The sentencepiece tokenizer of stories260K (``tok512.model``) as a transformers tokenizer.

    It encodes exactly like ``sentencepiece`` (BOS prepended, no EOS), pads with ``<unk>`` (id 0, the model
    has no pad token; padded positions are masked anyway) and decodes byte-fallback pieces properly.

    Args:
        data_dir: The shared data directory (or its ``stories260K`` sub-folder); ``None``: the default one
            (``$PEFTPLUG_DATA_DIR``, else ``../shared/data`` beside the checkout).
        padding_side: ``"left"`` (what batched generation needs) or ``"right"``.
    """
    from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

    class Stories260KTokenizer(SentencePieceBackend):
        """sentencepiece-backed tokenizer whose decoding handles byte-fallback pieces."""

        def convert_tokens_to_string(self, tokens: list[str]) -> str:
            return self.sp_model.decode_pieces(list(tokens))

    tok = Stories260KTokenizer(
        vocab_file=str(_resolve_dir(data_dir) / TOKENIZER_FILE), bos_token="<s>", eos_token="</s>",
        unk_token="<unk>", pad_token="<unk>", special_tokens_pattern="bos", model_max_length=512,
    )
    tok.padding_side = padding_side
    return tok


def load_stories260k(data_dir: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32,
                     padding_side: str = "left"):
    """Model and tokenizer of stories260K.

    Args:
        data_dir: The shared data directory (or its ``stories260K`` sub-folder); ``None``: the default one
            (``$PEFTPLUG_DATA_DIR``, else ``../shared/data`` beside the checkout).
        dtype: Parameter dtype of the model.
        padding_side: Tokenizer padding side.

    Returns:
        ``(model, tokenizer)``.
    """
    return stories260k_model(data_dir, dtype), stories260k_tokenizer(data_dir, padding_side)
