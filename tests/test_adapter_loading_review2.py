"""``peftplug.load_adapter`` with an adapter that does not fit the model it is given.

Before: an adapter of another width was torch's multi-line ``RuntimeError`` listing every tensor; a weights file of
another adapter type (or an empty one) loaded with only PEFT's missing-key warning, leaving a freshly initialised
adapter (identity rotations, a random LoRA); a ``PeftModel`` given to add a second adapter was nested in another
``PeftModel``, whose adapter no file held (fresh, with a warning); a 4-bit model built by the caller was neither
protected from bitsandbytes' in-place CPU repacking (logits ~3e-3 off the trained model on AVX512-BF16 CPUs) nor
refused once repacked; and a built model quantized or typed otherwise than the folder's ``peftplug_base.json``
loaded without the warning a model name with other settings gets. References are plain PEFT's.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file, save_file

import oftv2
from peftplug import load_adapter
from peftplug.adapter_export import BASE_RECORD, BASE_RECORD_FORMAT
from peftplug.errors import CheckpointError, ConfigError
from peftplug.loading import load_model

X = torch.randint(4, 90, (2, 10), generator=torch.Generator().manual_seed(0))
ADAPTERS = {
    "lora": lambda: LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    "oftv2": lambda: oftv2.OFTv2Config(target_modules=["q_proj", "v_proj"], block_size=8, init_weights=False),
}


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=X).logits


def _saved(tmp_path, kind: str, base=None, name: str | None = None, seed: int = 0):
    """An adapter with non-identity weights saved from ``base`` (the tiny Llama): (folder, its logits)."""
    torch.manual_seed(seed)
    model = get_peft_model(base if base is not None else load_model("tiny:llama"), ADAPTERS[kind]())
    folder = tmp_path / (name or kind)
    model.save_pretrained(folder)
    return folder, _logits(model)


@pytest.mark.parametrize("kind", sorted(ADAPTERS))
def test_an_adapter_of_another_width_is_a_one_line_error_naming_the_tensor(tmp_path, tiny_model, kind):
    folder, _ = _saved(tmp_path, kind)
    with pytest.raises(RuntimeError, match="size mismatch") as plain:  # what PEFT says: every tensor, many lines
        PeftModel.from_pretrained(tiny_model("llama", hidden_size=128), str(folder))
    assert str(plain.value).count("\n") >= 4
    with pytest.raises(CheckpointError, match=rf"^adapter {str(folder)!r} does not fit this model: "
                                              r"base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.\S+ is "
                                              r"\[\d+, \d+\] in the adapter but \[\d+, \d+\] here \(and \d+ more\); "
                                              r"it was saved from base model 'tiny:llama'") as err:
        load_adapter(tiny_model("llama", hidden_size=128), folder)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("config_of", "weights_of"), [("oftv2", "lora"), ("lora", "oftv2"), ("oftv2", None)])
def test_weights_of_another_adapter_type_or_none_are_refused(tmp_path, config_of, weights_of):
    folder, _ = _saved(tmp_path, config_of, name="folder")
    if weights_of is None:
        save_file({}, folder / "adapter_model.safetensors")
    else:
        other, _ = _saved(tmp_path, weights_of)
        shutil.copy(other / "adapter_model.safetensors", folder / "adapter_model.safetensors")
    # Plain PEFT: a warning, and a model whose adapter is freshly initialised (not what any file holds).
    with pytest.warns(UserWarning, match="Found missing adapter keys"):
        PeftModel.from_pretrained(load_model("tiny:llama"), str(folder))
    with pytest.raises(CheckpointError, match=rf"^adapter {str(folder)!r}: none of the \d+ {config_of.upper()} "
                                              r"tensors this model expects .* is in its weights file \(it holds "
                                              rf"{0 if weights_of is None else ''}") as err:
        load_adapter(load_model("tiny:llama"), folder)
    assert "\n" not in str(err.value)


def test_a_partly_missing_file_still_loads_with_peft_s_warning(tmp_path):
    folder, _ = _saved(tmp_path, "oftv2")
    state = load_file(folder / "adapter_model.safetensors")
    kept = dict(sorted(state.items())[:1])
    save_file(kept, folder / "adapter_model.safetensors")
    # The tensors the file lacks are initialised as the config says (init_weights=False: randomly), so seeded alike.
    base, reference_base = load_model("tiny:llama"), load_model("tiny:llama")
    torch.manual_seed(3)
    with pytest.warns(UserWarning, match="Found missing adapter keys"):
        model = load_adapter(base, folder)
    torch.manual_seed(3)
    with pytest.warns(UserWarning, match="Found missing adapter keys"):
        reference = PeftModel.from_pretrained(reference_base, str(folder))
    assert torch.equal(_logits(model), _logits(reference))


@pytest.mark.parametrize("kind", sorted(ADAPTERS))
def test_a_peft_model_gets_the_adapter_beside_its_own(tmp_path, kind):
    first, first_logits = _saved(tmp_path, kind, name="first")
    second, second_logits = _saved(tmp_path, kind, name="second", seed=1)
    assert not torch.allclose(first_logits, second_logits, atol=1e-4)
    # Plain PEFT's way: PeftModel.load_adapter; the reference for both adapters' tensors.
    reference = PeftModel.from_pretrained(load_model("tiny:llama"), str(first))
    reference.load_adapter(str(second), adapter_name="b")
    model = load_adapter(load_model("tiny:llama"), first)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Found missing adapter keys")
        added = load_adapter(model, second, adapter_name="b")
    assert added is model and list(model.peft_config) == ["default", "b"]
    assert not any(isinstance(m, PeftModel) for m in model.base_model.modules())  # not nested
    for name in ("default", "b"):
        ours, ref = get_peft_model_state_dict(model, adapter_name=name), get_peft_model_state_dict(reference,
                                                                                                  adapter_name=name)
        assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)
    assert model.get_nb_trainable_parameters()[0] == 0  # loaded for inference, as PEFT
    model.set_adapter("b")
    assert torch.equal(_logits(model), second_logits)
    with pytest.raises(ConfigError, match=r"^model already has an adapter named 'b' \(it has 'default', 'b'\)"):
        load_adapter(model, second, adapter_name="b")


def _record(folder, quantization: str, dtype: str) -> None:
    (folder / BASE_RECORD).write_text(json.dumps({"format": BASE_RECORD_FORMAT, "model": "tiny:llama",
                                                  "quantization": quantization, "dtype": dtype}))


def test_a_built_model_other_than_the_record_warns_naming_both(tmp_path):
    folder, _ = _saved(tmp_path, "lora")
    _record(folder, "none", "bfloat16")
    with pytest.warns(UserWarning, match=r"trained on 'tiny:llama' with dtype='bfloat16' \(its peftplug_base\.json\); "
                                         r"the model given has dtype='float32', another model"):
        load_adapter(load_model("tiny:llama"), folder)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*peftplug_base")
        load_adapter(load_model("tiny:llama", dtype="bfloat16"), folder)  # the recorded base: silent


def _bnb_nf4(dtype=torch.float32):
    """The tiny Llama in nf4, built with transformers directly (not peftplug's loader, which protects it)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from peftplug.loading import resolve_model_path

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny:llama"), quantization_config=config,
                                                dtype=torch.float32)


def test_a_built_4bit_model_other_than_the_record_warns(tmp_path):
    pytest.importorskip("bitsandbytes")
    folder, _ = _saved(tmp_path, "lora", base=load_model("tiny:llama", quantization="nf4", dtype="bfloat16"))
    _record(folder, "nf4", "bfloat16")
    with pytest.warns(UserWarning, match=r"with dtype='bfloat16' .*the model given has dtype='float32'"):
        load_adapter(_bnb_nf4(torch.float32), folder)
    with pytest.warns(UserWarning, match=r"with quantization='nf4' .*the model given has quantization='fp4'"):
        load_adapter(load_model("tiny:llama", quantization="fp4", dtype="bfloat16"), folder)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*peftplug_base")
        load_adapter(_bnb_nf4(torch.bfloat16), folder)


def test_a_built_4bit_model_keeps_its_exact_weights_or_is_refused(tmp_path):
    pytest.importorskip("bitsandbytes")
    from peftplug.quantized_layout import RepackedWeightError, repacked_layers

    folder, trained = _saved(tmp_path, "lora", base=load_model("tiny:llama", quantization="nf4"))
    model = load_adapter(_bnb_nf4(), folder)
    assert torch.equal(_logits(model), trained)  # on AVX512-BF16 CPUs unprotected: ~3e-3 off
    assert repacked_layers(model) == []
    base = _bnb_nf4().eval()
    with torch.no_grad():
        base(input_ids=X)  # an eval forward before the adapter: bitsandbytes repacks here on AVX512-BF16 CPUs
    if not repacked_layers(base):
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes never repacks")
    with pytest.raises(RepackedWeightError, match=r"were repacked in place by an earlier eval forward"):
        load_adapter(base, folder)
