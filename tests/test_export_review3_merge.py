"""Third review of ``peftplug export --merge``: adapters that cannot be merged are refused in one line, atomically.

- A prompt-learning adapter (prompt tuning; PCT and prefix tuning alike) is a learned prompt, not a weight update:
  ``--merge`` ended in ``AttributeError: 'LlamaForCausalLM' object has no attribute 'merge_and_unload'`` (a
  traceback from inside PEFT).
- A steering vector with ``positions="prompt"`` is no constant shift: the tuner's own refusal (a ``ValueError``)
  ended in a traceback too.

Both are now ``peftplug: error: --merge: ...`` with nothing written and an earlier export kept. The same
checkpoints export without ``--merge`` to folders that ``PeftModel.from_pretrained`` loads onto a fresh base with
the trained module's logits.
"""

from __future__ import annotations

import lightning  # noqa: F401  (imported before capsys swaps stderr: Lightning's log handler binds to it)
import pytest
import torch
from peft import PeftModel
from tiny_recipes import causal_recipe

import steering  # noqa: F401  (registers STEERING for PeftModel.from_pretrained)
from peftplug.checkpoints import load_checkpoint_module
from peftplug.cli import main
from peftplug.loading import load_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ROWS = [{"prompt": f"Q{i}: add {i}", "response": f" {2 * i}"} for i in range(8)]
X = torch.randint(4, 90, (2, 10), generator=torch.Generator().manual_seed(0))
UNMERGEABLE = {
    "prompt_tuning": ({"peft_type": "PROMPT_TUNING", "num_virtual_tokens": 4},
                      r"--merge: a PROMPT_TUNING adapter is a learned prompt"),
    "steering_prompt": ({"peft_type": "STEERING", "layers": [0, 1], "positions": "prompt"},
                        r"--merge: adapter 'default' uses operator='add', positions='prompt'"),
}


@pytest.fixture(scope="module", params=sorted(UNMERGEABLE))
def checkpoint(request, tmp_path_factory):
    """(kind, a one-step ``peftplug fit`` checkpoint of that adapter on the tiny Llama)."""
    root = tmp_path_factory.mktemp(request.param)
    recipe = causal_recipe(root, ROWS, peft=UNMERGEABLE[request.param][0],
                           trainer={"max_steps": 1, "limit_val_batches": 0})
    assert main(["fit", "--config", str(recipe)]) == 0
    (path,) = (root / "runs").rglob("*.ckpt")
    return request.param, path


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("peftplug: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


def test_merge_of_an_unmergeable_adapter_is_one_line_and_writes_nothing(checkpoint, tmp_path, capsys):
    kind, ckpt = checkpoint
    capsys.readouterr()
    assert main(["export", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "merged"), "--merge"]) == 2
    assert UNMERGEABLE[kind][1] in _one_error_line(capsys).replace("\\", "")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no folder, no staging folder left behind


def test_a_refused_merge_keeps_an_earlier_export(checkpoint, tmp_path, capsys):
    _, ckpt = checkpoint
    out = tmp_path / "out"
    assert main(["export", "--ckpt_path", str(ckpt), "--output", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert main(["export", "--ckpt_path", str(ckpt), "--output", str(out), "--merge", "--overwrite"]) == 2
    _one_error_line(capsys)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_the_adapter_export_reloads_with_plain_peft_as_trained(checkpoint, tmp_path):
    _, ckpt = checkpoint
    with torch.no_grad():
        trained = load_checkpoint_module(ckpt).model.eval()(input_ids=X).logits
    assert main(["export", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "out")]) == 0
    reloaded = PeftModel.from_pretrained(load_model("tiny:llama"), str(tmp_path / "out")).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=X).logits, trained, rtol=0, atol=0)
        # It changes the model (prompt tuning's logits also cover its virtual tokens, which come first).
        base = load_model("tiny:llama").eval()(input_ids=X).logits
        assert (base - trained[:, -X.shape[1]:]).abs().max() > 1e-6
