"""``tiny:<family>`` models: every family of :data:`peftplug.tiny.FAMILIES` builds and runs through the loader, the
weights are the same in every process (the built folder is named after its content, so a process-dependent init
would leave a new folder per process), and an unknown family names the known ones."""

from __future__ import annotations

import hashlib

import pytest
import torch

from peftplug.errors import ConfigError
from peftplug.loading import load_model, load_tokenizer, resolve_model_path
from peftplug.tiny import FAMILIES, tiny_config, tiny_model

# The task each family is built for (as peftplug.loading builds ``tiny:<family>``).
TASKS = {"bert": "seq_cls", "t5": "seq2seq"}
_DIGEST = ("import hashlib, torch\n"
           "from peftplug.tiny import FAMILIES, tiny_model\n"
           "for family in FAMILIES:\n"
           "    digest = hashlib.sha256()\n"
           "    task = {'bert': 'seq_cls', 't5': 'seq2seq'}.get(family, 'causal_lm')\n"
           "    for name, tensor in sorted(tiny_model(family, task).state_dict().items()):\n"
           "        digest.update(name.encode() + tensor.contiguous().numpy().tobytes())\n"
           "    print(family, digest.hexdigest())\n")


def test_every_family_loads_and_runs():
    for family in FAMILIES:
        task = TASKS.get(family, "causal_lm")
        model = load_model(f"tiny:{family}", task=task, **({"num_labels": 3} if task == "seq_cls" else {})).eval()
        batch = load_tokenizer(f"tiny:{family}")(["hello there", "x"], return_tensors="pt", padding=True)
        batch.pop("token_type_ids", None)
        with torch.inference_mode():
            out = model(**batch, labels=batch["input_ids"]) if task == "seq2seq" else model(**batch)
        assert torch.isfinite(out.logits).all(), family


def test_weights_are_the_same_in_every_process_and_leave_the_global_rng_alone(run_fresh):
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    here = {}
    for family in FAMILIES:
        digest = hashlib.sha256()
        for name, tensor in sorted(tiny_model(family, TASKS.get(family, "causal_lm")).state_dict().items()):
            digest.update(name.encode() + tensor.contiguous().numpy().tobytes())
        here[family] = digest.hexdigest()
    assert torch.equal(torch.rand(3), before)
    # Another process (its own hash seed and RNG state): a child of the fork server (tests/fresh_interpreter.py).
    done = run_fresh(_DIGEST)
    assert dict(line.split() for line in done.stdout.splitlines()) == here
    assert len(set(here.values())) == len(FAMILIES)


@pytest.mark.parametrize("name", ["tiny:mistral", "tiny:", "tiny:Llama"])
def test_an_unknown_family_names_the_known_ones(name):
    with pytest.raises(ConfigError, match="the family must be one of llama, qwen2, gpt2, bert, t5"):
        resolve_model_path(name)
    with pytest.raises(ValueError, match=r"family must be one of \('llama', 'qwen2', 'gpt2', 'bert', 't5'\)"):
        tiny_config(name.split(":")[1])
