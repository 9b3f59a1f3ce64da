"""``peftplug export`` records the base model as it was loaded (``peftplug_base.json``), and ``load_adapter``
defaults to it: an nf4 + bfloat16 adapter reloads as the trained model with no ``quantization=``/``dtype=``.

Before, the folder held only PEFT's files, and ``load_adapter(name, folder)`` loaded an unquantized float32 base (on
the tiny Llama's nf4 + bf16 fit below, logits ~0.02 off the trained model's). Also here: a folder without the
record (``save_pretrained``, or an export from before it) keeps the old defaults; a given value that differs from
the record warns naming both; a damaged or foreign record is a one-line error naming the file; PEFT's own
``PeftModel.from_pretrained`` loads the folder as before.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings

import lightning  # noqa: F401  (imported before capsys swaps stderr: Lightning's log handler binds to it)
import pytest
import torch
from peft import LoraConfig, PeftModel
from test_adapter_loading_dtype import _compute_dtypes, fit_nf4_bf16

from peftplug import load_adapter
from peftplug.adapter_export import BASE_RECORD, BASE_RECORD_FORMAT, read_base_record
from peftplug.checkpoints import load_checkpoint_module
from peftplug.cli import main
from peftplug.errors import CheckpointError
from peftplug.lightning import PeftModule
from peftplug.loading import load_model

pytest.importorskip("bitsandbytes")

X = torch.randint(4, 90, (2, 10), generator=torch.Generator().manual_seed(0))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=X).logits


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """An nf4 + bf16 fit exported with `peftplug export` (umask 022): (checkpoint, adapter folder, trained logits)."""
    root = tmp_path_factory.mktemp("base_record")
    ckpt = fit_nf4_bf16(root)
    umask = os.umask(0o022)
    try:
        assert main(["export", "--ckpt_path", str(ckpt), "--output", str(root / "adapter")]) == 0
    finally:
        os.umask(umask)
    return ckpt, root / "adapter", _logits(load_checkpoint_module(ckpt).model)


def _record_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if BASE_RECORD in str(w.message)]


def test_export_writes_the_record_beside_peft_files(trained):
    _, folder, _ = trained
    record = json.loads((folder / BASE_RECORD).read_text())
    assert record == {"format": BASE_RECORD_FORMAT, "model": "tiny:llama", "quantization": "nf4",
                      "dtype": "bfloat16"}
    assert read_base_record(folder) == record
    # Written through the staging folder like the rest: the umask's mode, not mkstemp's 0600, and no temp files.
    assert (folder / BASE_RECORD).stat().st_mode & 0o777 == (folder / "adapter_config.json").stat().st_mode & 0o777
    assert (folder / BASE_RECORD).stat().st_mode & 0o777 == 0o644
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]


def test_load_adapter_without_arguments_is_the_trained_model(trained):
    _, folder, reference = trained
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reloaded = load_adapter("tiny:llama", folder)
        # Given explicitly and equal to the record: the same model, no warning either.
        explicit = load_adapter("tiny:llama", folder, quantization="nf4", dtype="bfloat16")
    assert _record_warnings(caught) == []
    assert _compute_dtypes(reloaded) == {torch.bfloat16}
    assert torch.equal(_logits(reloaded), reference)  # bit-identical
    assert torch.equal(_logits(explicit), reference)


def test_a_value_other_than_the_record_warns_naming_both(trained):
    _, folder, reference = trained
    with pytest.warns(UserWarning, match=r"with dtype='bfloat16' \(its peftplug_base\.json\); loading it with "
                                         r"dtype='float32' as asked") as caught:
        float32 = load_adapter("tiny:llama", folder, dtype="float32")
    assert len(_record_warnings(caught)) == 1
    # The asked dtype wins, the recorded quantization still applies: nf4 with float32 compute, another model.
    assert _compute_dtypes(float32) == {torch.float32}
    assert (float32(input_ids=X).logits - reference).abs().max() > 1e-3
    with pytest.warns(UserWarning, match=r"quantization='nf4' .*loading it with quantization='none' as asked"):
        unquantized = load_adapter("tiny:llama", folder, quantization="none")
    assert _compute_dtypes(unquantized) == set()
    assert unquantized.base_model.model.model.embed_tokens.weight.dtype == torch.bfloat16  # the recorded dtype


def test_a_folder_without_the_record_keeps_the_old_defaults(trained, tmp_path):
    _, folder, reference = trained
    old = shutil.copytree(folder, tmp_path / "old")
    (old / BASE_RECORD).unlink()  # what an export wrote before the record (and what save_pretrained writes)
    assert read_base_record(old) is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        default = load_adapter("tiny:llama", old)
        explicit = load_adapter("tiny:llama", old, quantization="nf4", dtype="bfloat16")
    assert _record_warnings(caught) == []
    assert _compute_dtypes(default) == set()  # quantization none, dtype float32: as before
    assert {p.dtype for p in default.parameters()} == {torch.float32}
    assert torch.equal(_logits(default), _logits(load_adapter("tiny:llama", old, quantization="none",
                                                               dtype="float32")))
    assert not torch.allclose(_logits(default), reference, atol=1e-3)
    assert torch.equal(_logits(explicit), reference)


@pytest.mark.parametrize(("content", "problem"), [
    ("{not json", r" is not valid JSON \(Expecting property name.*; expected peftplug's record of the adapter's"),
    ("[1, 2]", r" holds a JSON list, not an object"),
    ('{"model": "tiny:llama", "quantization": "nf4", "dtype": "bfloat16"}',
     r" has no 'format'; this peftplug reads 'peftplug-base/1'"),
    ('{"format": "someone-else/3"}', r" has format 'someone-else/3'; this peftplug reads 'peftplug-base/1'"),
    ('{"format": "peftplug-base/1", "model": "", "quantization": "nf4", "dtype": "bfloat16"}',
     r": 'model' must be a non-empty model name; got ''"),
    ('{"format": "peftplug-base/1", "model": "tiny:llama", "quantization": "nf5", "dtype": "bfloat16"}',
     r": 'quantization' must be one of none, nf4, fp4, int8; got 'nf5'"),
    ('{"format": "peftplug-base/1", "model": "tiny:llama", "quantization": "nf4"}',
     r": 'dtype' must be one of float32, bfloat16, float16; got None"),
])
def test_a_damaged_or_foreign_record_is_a_one_line_error_naming_the_file(trained, tmp_path, content, problem):
    _, folder, _ = trained
    damaged = shutil.copytree(folder, tmp_path / "damaged")
    (damaged / BASE_RECORD).write_text(content)
    with pytest.raises(CheckpointError, match="^" + re.escape(repr(str(damaged / BASE_RECORD))) + problem) as err:
        load_adapter("tiny:llama", damaged)
    assert "\n" not in str(err.value)


def test_peft_from_pretrained_loads_the_folder_as_before(trained):
    _, folder, reference = trained
    base = load_model("tiny:llama", quantization="nf4", dtype="bfloat16")
    model = PeftModel.from_pretrained(base, str(folder))
    assert type(model.peft_config["default"]).__name__ == "OFTv2Config"
    assert torch.equal(_logits(model), reference)


def test_as_lora_export_records_the_base_and_merge_writes_none(trained, tmp_path):
    ckpt, _, _ = trained
    assert main(["export", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "lora"), "--as_lora",
                 "--rank", "full"]) == 0
    assert read_base_record(tmp_path / "lora")["quantization"] == "nf4"
    lora = load_adapter("tiny:llama", tmp_path / "lora")  # the QOFT update holds on this same nf4 + bf16 base
    assert _compute_dtypes(lora) == {torch.bfloat16}
    assert main(["export", "--ckpt_path", str(ckpt), "--output", str(tmp_path / "merged"), "--merge"]) == 0
    assert not (tmp_path / "merged" / BASE_RECORD).exists()  # a full model folder, not an adapter


def test_a_module_around_a_built_model_writes_no_record(tmp_path):
    # How a model object was loaded (quantized or cast by its owner) is unknown: no record beats a wrong one.
    module = PeftModule(model=load_model("tiny:llama"), peft=LoraConfig(r=2, target_modules=["q_proj"]))
    out = module.export(tmp_path / "adapter")
    assert (out / "adapter_config.json").is_file() and not (out / BASE_RECORD).exists()
