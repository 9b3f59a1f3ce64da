"""A tokenizer with no pad, eos or unk token (a character tokenizer built without special tokens) is refused when it
loads, in one line that says what is missing and how to give it one. It used to load with ``pad_token = None``:
``peftplug fit`` died with ``TypeError: 'NoneType' object cannot be interpreted as an integer`` at the first batch
whose rows differ in length, and ``peftplug generate`` with an ``IndexError`` inside transformers' ``generate``.

The model folders are real: a tiny Llama saved with ``save_pretrained`` next to a ``PreTrainedTokenizerFast`` built
from a ``tokenizers`` object, loaded back through the CLI and the Python API.
"""

from __future__ import annotations

import string
from pathlib import Path

import lightning  # noqa: F401  (imported before capsys swaps stderr: Lightning's log handler binds to it)
import pytest
import yaml
from test_first_hour import _error_line
from tiny_recipes import causal_recipe

from peftplug.cli import main
from peftplug.errors import ConfigError
from peftplug.loading import load_tokenizer
from peftplug.pad_token import ensure_pad_token

NOTHING_TO_PAD = r"has no pad token, and no eos or unk token in its vocabulary to pad with"
LORA = {"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"]}


def _char_tokenizer(specials: tuple[str, ...] = (), **names: str):
    """A character tokenizer whose special tokens are only ``specials`` (``names``: which is pad/eos/unk)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {token: i for i, token in enumerate([*specials, *chars])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=names.get("unk_token")))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=256, **names)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny Llama folders whose tokenizers have no special token at all, only an unk, and only an eos."""
    from peftplug.tiny import tiny_model

    root = tmp_path_factory.mktemp("pad_token")
    tokenizers = {"bare": _char_tokenizer(), "unk": _char_tokenizer(("<unk>",), unk_token="<unk>"),
                  "eos": _char_tokenizer(("</s>",), eos_token="</s>")}
    for name, tokenizer in tokenizers.items():
        tiny_model("llama").save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return {name: str(root / name) for name in tokenizers}


def test_fit_refuses_a_tokenizer_with_nothing_to_pad_with(folders, tmp_path, capsys):
    rows = [{"prompt": f"Q{i}", "response": " x" * (i + 1)} for i in range(8)]  # lengths differ: batches pad
    recipe = causal_recipe(tmp_path, rows, peft=LORA, trainer={"max_steps": 2, "limit_val_batches": 0},
                           data={"batch_size": 4})
    settings = yaml.safe_load(recipe.read_text())
    settings["model"]["model"] = folders["bare"]
    recipe.write_text(yaml.safe_dump(settings))
    line = _error_line(capsys, main(["fit", "--config", str(recipe)]))
    assert NOTHING_TO_PAD in line and repr(folders["bare"]) in line and "pad_token" in line, line
    assert not list(Path(tmp_path, "runs").rglob("*.ckpt"))


def test_the_python_api_refuses_it_when_it_loads(folders, tmp_path):
    from peftplug.data import CausalLMData
    from peftplug.lightning import PeftModule

    with pytest.raises(ConfigError, match=rf"^the tokenizer of '.*bare' {NOTHING_TO_PAD}"):
        PeftModule(folders["bare"], peft=LORA)
    with pytest.raises(ConfigError, match=rf"^model\.tokenizer: the tokenizer of '.*bare' {NOTHING_TO_PAD}"):
        PeftModule("tiny:llama", tokenizer=folders["bare"])
    data = CausalLMData(train_file=str(tmp_path / "unused.jsonl"), tokenizer=folders["bare"])
    with pytest.raises(ConfigError, match=NOTHING_TO_PAD):
        data.resolve_tokenizer()


def test_generate_refuses_it(folders, capsys):
    code = main(["generate", "--model", folders["bare"], "--raw", "--prompt", "abc", "--max_new_tokens", "3"])
    assert NOTHING_TO_PAD in _error_line(capsys, code)


def test_eos_then_unk_stand_in_for_a_missing_pad_token(folders, capsys):
    assert load_tokenizer(folders["eos"]).pad_token == "</s>"
    assert load_tokenizer(folders["unk"]).pad_token == "<unk>"
    # Prompts of different lengths: the batch is left-padded with the stand-in.
    args = ["generate", "--model", folders["unk"], "--raw", "--prompt", "abc", "--prompt", "a longer prompt",
            "--max_new_tokens", "3"]
    capsys.readouterr()
    assert main(args) == 0, capsys.readouterr().err


def test_a_pad_or_eos_token_outside_the_vocabulary_cannot_pad():
    tokenizer = _char_tokenizer()
    tokenizer.eos_token = "</s>"  # named, but not a token of its vocabulary: it has no id to pad with
    with pytest.raises(ConfigError, match=NOTHING_TO_PAD):
        ensure_pad_token(tokenizer, "custom")
    assert tokenizer.pad_token is None
    tokenizer.pad_token = "<pad>"
    with pytest.raises(ConfigError, match=r"^the tokenizer of 'custom' has pad token '<pad>', which is not in its"):
        ensure_pad_token(tokenizer, "custom")


def test_answers_stop_at_the_models_eos_when_the_tokenizer_has_none(folders):
    """An unk-only tokenizer pads with unk and has no eos: generation must still stop at the model's own eos
    (``generation_config.eos_token_id``). ``eos_token_id=[]`` overrode it, and every answer ran to max_new_tokens."""
    import torch

    from peftplug.lightning import PeftModule

    module = PeftModule(folders["unk"], peft=LORA, max_new_tokens=6).eval()
    prompt = module.tokenizer(["hi"], return_tensors="pt")
    with torch.no_grad():
        free = module.model.generate(**prompt, max_new_tokens=1, do_sample=False,
                                     pad_token_id=module.tokenizer.pad_token_id)
    first = int(free[0, -1])  # the token greedy decoding picks first: make it the model's eos
    module.model.generation_config.eos_token_id = None
    unstopped = module.generate_texts(prompt["input_ids"], prompt["attention_mask"])
    module.model.generation_config.eos_token_id = first
    stopped = module.generate_texts(prompt["input_ids"], prompt["attention_mask"])
    assert stopped == [module.tokenizer.decode([first])], (stopped, unstopped)
    assert len(module.tokenizer(unstopped[0])["input_ids"]) == 6, unstopped  # the stop is the eos, not the length


def test_a_tokenizer_object_given_to_a_data_module_gets_the_same_fallback(tmp_path):
    """A tokenizer assigned in Python (``data.tokenizer = tok``) skipped the loader: ``pad_batch`` got pad id None."""
    import json

    from peftplug.data import CausalLMData

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": "Q", "response": " x" * n}) + "\n" for n in (1, 3)))
    # A validation file of its own: the training split keeps both rows, so its one batch is padded (rows end with
    # eos anyway, so only the padded positions tell the stand-in was used).
    rows = {"train_file": str(path), "validation_file": str(path), "prompt_column": "prompt",
            "response_column": "response", "batch_size": 2}
    data = CausalLMData(**rows)
    data.tokenizer = _char_tokenizer(("</s>",), eos_token="</s>")
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    eos = data.tokenizer.convert_tokens_to_ids("</s>")
    padded = batch["attention_mask"] == 0
    assert data.tokenizer.pad_token == "</s>" and bool(padded.any()), batch
    assert bool((batch["input_ids"][padded] == eos).all()), batch
    bare = CausalLMData(**rows)
    bare.tokenizer = _char_tokenizer()
    with pytest.raises(ConfigError, match=rf"^the tokenizer of 'data.tokenizer' {NOTHING_TO_PAD}"):
        bare.setup("fit")


def test_a_tokenizer_object_set_on_the_module_gets_the_same_fallback(tmp_path):
    """A data module without a tokenizer of its own borrows the module's; one assigned in Python (``module.tokenizer =
    tok``, for a model passed as an object) skipped the fallback: ``pad_batch`` got pad id None at the first batch."""
    import json

    import lightning as L

    from peftplug.data import CausalLMData
    from peftplug.lightning import PeftModule
    from peftplug.tiny import tiny_model

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": "Q", "response": " x" * n}) + "\n" for n in (1, 3)))

    def fit(tokenizer) -> PeftModule:
        module = PeftModule(tiny_model("llama"), peft=LORA)
        module.tokenizer = tokenizer
        data = CausalLMData(train_file=str(path), validation_file=str(path), batch_size=2, prompt_column="prompt",
                            response_column="response")  # both rows in one training batch, padded
        L.Trainer(accelerator="cpu", devices=1, max_steps=1, limit_val_batches=0, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False).fit(module, datamodule=data)
        return module

    assert fit(_char_tokenizer(("</s>",), eos_token="</s>")).tokenizer.pad_token == "</s>"
    with pytest.raises(ConfigError, match=rf"^the tokenizer of 'model.tokenizer' {NOTHING_TO_PAD}"):
        fit(_char_tokenizer())
