"""Second review of model loading: folders that need their own code, mistyped model names, and a tokenizer with
more ids than the model has embeddings -- one-line errors at load time instead of a prompt or a traceback later."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from peftplug.errors import ConfigError, MissingFileError
from peftplug.loading import load_model, load_tokenizer, resolve_model_path
from peftplug.model_checks import check_tokenizer_fits
from peftplug.tiny import char_tokenizer, tiny_model


def _remote_code_folder(tmp_path):
    """A saved tiny Llama whose config names an architecture only its own Python file implements."""
    folder = tmp_path / "custom"
    shutil.copytree(resolve_model_path("tiny:llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="mymodel", architectures=["MyModel"],
                  auto_map={"AutoConfig": "modeling_my.MyConfig", "AutoModelForCausalLM": "modeling_my.MyModel"})
    (folder / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "code-ran"
    (folder / "modeling_my.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    return folder, marker


def test_a_folder_that_needs_its_own_code_is_refused_in_one_line_without_running_it(tmp_path):
    # transformers' default would ask "Do you wish to run the custom code? [y/N]" on the terminal (up to 15 s)
    # and run the folder's code on "y"; without a terminal it raised a multi-line ValueError.
    folder, marker = _remote_code_folder(tmp_path)
    with pytest.raises(ConfigError, match=r"needs Python code of its own .*trust_remote_code=False") as caught:
        load_model(str(folder))
    assert "\n" not in str(caught.value)
    assert not marker.exists()
    # Its tokenizer files are ordinary ones: they still load, without asking.
    assert load_tokenizer(str(folder))("ab")["input_ids"] == char_tokenizer()("ab")["input_ids"]


@pytest.mark.parametrize(("name", "meant"), [("smollm2-135m-instrct", "smollm2-135m-instruct"),
                                              ("tiny-llama", "tiny:llama"), ("tiny:lama", None),
                                              ("Stories260K-", "stories260k")])
def test_a_mistyped_name_names_the_close_ones(name, meant):
    if meant is None:  # a wrong tiny family already lists the families
        with pytest.raises(ConfigError, match="llama, qwen2"):
            resolve_model_path(name)
        return
    with pytest.raises(MissingFileError, match=rf"; did you mean '{meant}'\?$"):
        resolve_model_path(name)


def test_a_mistyped_folder_names_the_folder_beside_it(tmp_path):
    shutil.copytree(resolve_model_path("tiny:llama"), tmp_path / "my-llama")
    with pytest.raises(MissingFileError, match=rf"did you mean '{tmp_path}/my-llama'\?$"):
        load_model(str(tmp_path / "my-lama"))
    with pytest.raises(MissingFileError) as caught:  # nothing close: no guess
        load_model(str(tmp_path / "unrelated"))
    assert "did you mean" not in str(caught.value)


def test_a_tokenizer_with_more_ids_than_embeddings_is_refused(tmp_path):
    small = tmp_path / "vocab50"
    tiny_model("llama", vocab_size=50).save_pretrained(small)
    model, tokenizer = load_model(str(small)), load_tokenizer("tiny:llama")  # 101 ids for 50 embedding rows
    ids = tokenizer(["hello world"], return_tensors="pt").input_ids
    with pytest.raises(IndexError):  # what training would meet at its first batch
        model(input_ids=ids)
    with pytest.raises(ConfigError, match=r"^model\.tokenizer: the tokenizer has 101 tokens but the model .*vocab50' "
                                          r"has embeddings for 50 \(ids 50\.\.100"):
        check_tokenizer_fits(model, tokenizer, "model.tokenizer")
    # The model's own tokenizer, and one smaller than the embedding table (tables are often padded), fit.
    check_tokenizer_fits(load_model("tiny:llama"), tokenizer)
    wide = tmp_path / "vocab128"
    tiny_model("llama", vocab_size=128).save_pretrained(wide)
    wide_model = load_model(str(wide))
    check_tokenizer_fits(wide_model, tokenizer)
    with torch.no_grad():
        assert wide_model(input_ids=ids).logits.shape == (1, ids.shape[1], 128)


def test_a_data_tokenizer_with_more_ids_than_the_models_embeddings_is_refused():
    # The same check for data.tokenizer, which the data module loads itself (the IndexError came at the first batch).
    import lightning as L

    from peftplug.data import CausalLMData
    from peftplug.errors import ConfigError
    from peftplug.lightning import PeftModule
    from peftplug.tiny import tiny_model

    module = PeftModule(tiny_model("llama", vocab_size=50))  # a built model: no tokenizer of its own
    data = CausalLMData(train_file="unused.jsonl", tokenizer="tiny:llama")
    trainer = L.Trainer(logger=False, enable_checkpointing=False)
    trainer.strategy.connect(module)
    data.trainer = trainer
    with pytest.raises(ConfigError, match="data.tokenizer: the tokenizer has"):
        data.resolve_tokenizer()


def test_an_adapter_on_the_embedding_does_not_hide_its_size():
    # The PEFT layer wrapping embed_tokens has no num_embeddings: the check looked at it and passed.
    import peft

    from peftplug.errors import ConfigError
    from peftplug.loading import load_tokenizer
    from peftplug.model_checks import check_tokenizer_fits
    from peftplug.tiny import tiny_model

    model = peft.get_peft_model(tiny_model("llama", vocab_size=50), peft.LoraConfig(target_modules=["embed_tokens"], r=2))
    with pytest.raises(ConfigError, match="has embeddings for 50"):
        check_tokenizer_fits(model, load_tokenizer("tiny:llama"), "data.tokenizer")
