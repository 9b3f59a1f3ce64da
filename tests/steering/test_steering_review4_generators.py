"""Fourth review, generators: EasyEdit2 row options given with text pairs, tokenized rows, and ``blocks_path``.

Each test compares against a reference computed here (hand-written CAA from ``output_hidden_states``) or checks
the one-line refusal of an option that used to be ignored silently.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import steering

PAIRS = [("I love it, great", "I hate it, awful"), ("A sunny day", "A rainy day")]
ROWS = [
    {"question": "How was the film?", "matching": "Wonderful, I loved it.", "not_matching": "Dull, I hated it."},
    {"question": "Describe the meal.", "matching": "Delicious and warm", "not_matching": "Cold and bland"},
]


@pytest.mark.parametrize("option", [{"multiple_choice": True}, {"use_chat_template": True},
                                    {"system_prompt": "Be positive."}])
def test_row_options_with_text_pairs_are_refused(tiny_model, tokenizer, option):
    """They only format EasyEdit2 rows: with (positive, negative) pairs they were ignored, so multiple_choice=True
    silently gave the answer-mean vector instead of one read at position -2."""
    name = next(iter(option))
    with pytest.raises(ValueError, match=name):
        steering.train_steering_vector(tiny_model("llama"), tokenizer, PAIRS, layers=[1], progress=False, **option)
    tokenized = steering.caa_rows(tokenizer, ROWS)
    with pytest.raises(ValueError, match=name):
        steering.train_steering_vector(tiny_model("llama"), tokenizer, tokenized, layers=[1], progress=False,
                                       **option)


def test_multiple_choice_is_refused_for_vector_prompt_rows(tiny_model, tokenizer):
    rows = [{"input": "Tell a story.", "output": "It was sunny.", "prompt": "Be happy."}]
    with pytest.raises(ValueError, match="multiple_choice"):
        steering.train_steering_vector(tiny_model("llama"), tokenizer, rows, method="vector_prompt", layers=[1],
                                       multiple_choice=True, progress=False)


@pytest.mark.parametrize("multiple_choice", [False, True])
def test_tokenized_rows_give_the_rows_vector(tiny_model, tokenizer, multiple_choice):
    """``caa_rows(...)`` passed to train_steering_vector raised TypeError (not iterable), though its vector_prompt
    branch was written for them; the vector must be that of the rows themselves."""
    expected = steering.train_steering_vector(tiny_model("llama", num_hidden_layers=3), tokenizer, ROWS, layers=[1],
                                              multiple_choice=multiple_choice, progress=False)
    tokenized = steering.caa_rows(tokenizer, ROWS, multiple_choice=multiple_choice)
    got = steering.train_steering_vector(tiny_model("llama", num_hidden_layers=3), tokenizer, tokenized, layers=[1],
                                         progress=False)
    torch.testing.assert_close(got.base_model.get_vectors()[1], expected.base_model.get_vectors()[1])
    assert got.base_model.peft_config["default"].read_position == tokenized.read


def test_multiple_choice_rows_record_where_they_were_read(tiny_model, tokenizer, tmp_path):
    """read='answer' on multiple-choice rows reads position -2 (their answer); the config said 'answer', so the
    export went to caa_vector/ instead of EasyEdit2's caa_vector_multiple_choice/."""
    pm = steering.train_steering_vector(tiny_model("llama"), tokenizer, ROWS, layers=[1], multiple_choice=True,
                                        read="answer", progress=False)
    assert pm.base_model.peft_config["default"].read_position == "second_to_last"
    assert steering.export_easyedit(pm, tmp_path, dataset="d")[0].parent.name == "caa_vector_multiple_choice"


def _model_with_heads():
    """A decoder the family registry does not know whose shallowest n-entry ModuleList is not its block stack
    (Medusa-style heads): the case ``SteeringConfig.blocks_path`` is for."""
    from transformers import BertConfig, BertLMHeadModel

    from peftplug.tiny import CHAR_VOCAB_SIZE

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = BertConfig(vocab_size=CHAR_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                            num_attention_heads=4, is_decoder=True, pad_token_id=0)
        model = BertLMHeadModel(config).eval()
        model.heads = nn.ModuleList([nn.Linear(64, 64) for _ in range(3)])
    return model


def test_vectors_are_read_from_the_blocks_path_they_steer(tokenizer):
    """blocks_path was honoured by the adapter but not by the extraction, which read whichever list the heuristic
    found (here the heads, never called: a KeyError; on another model, silently another block stack)."""
    model = _model_with_heads()
    layer = 1
    diffs = []
    for pos, neg in PAIRS:
        h = [model(**tokenizer(t, return_tensors="pt"), output_hidden_states=True).hidden_states[layer + 1][0, -1]
             for t in (pos, neg)]
        diffs.append(h[0] - h[1])
    d = torch.stack(diffs).detach()
    u = torch.linalg.svd(torch.cat([d / 2, -d / 2]).double(), full_matrices=False)[2][0].float()
    u = u if (d @ u).mean() > 0 else -u  # repeng's pca_center, scaled by the mean projected difference
    expected = {"caa": d.mean(0), "pca_center": u * (d @ u).mean()}
    for method, want in expected.items():
        pm = steering.train_steering_vector(_model_with_heads(), tokenizer, PAIRS, method=method, layers=[layer],
                                            read="last", progress=False, blocks_path="bert.encoder.layer",
                                            task_type=None)
        torch.testing.assert_close(pm.base_model.get_vectors()[layer], want, rtol=1e-4, atol=1e-5)
        assert type(pm.base_model.steering_layers()[layer].base_layer).__name__ == "BertLayer"
