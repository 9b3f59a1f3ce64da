"""Third review of ``load_adapter`` on damaged folders: pickled ``adapter_model.bin`` weights are checked too.

``check_adapter_dir`` checked only ``adapter_model.safetensors``. A folder with garbage or a truncated
``adapter_model.bin`` (PEFT writes one with ``safe_serialization=False``) reached ``torch.load`` inside PEFT, which
raised its multi-line ``UnpicklingError`` / ``RuntimeError`` (advising ``weights_only=False``, which would run code
from the file). Now a one-line ``CheckpointError`` names the file; a good ``.bin`` folder still loads exactly.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from peft import LoraConfig, get_peft_model

from peftplug import load_adapter
from peftplug.errors import CheckpointError
from peftplug.tiny import tiny_model

X = torch.randint(4, 90, (2, 10), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def bin_folder(tmp_path):
    """A LoRA adapter saved with pickled weights: (folder, its model's logits)."""
    torch.manual_seed(0)
    model = get_peft_model(tiny_model("llama"), LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    model.save_pretrained(tmp_path / "bin", safe_serialization=False)
    assert (tmp_path / "bin" / "adapter_model.bin").is_file()
    with torch.no_grad():
        return tmp_path / "bin", model.eval()(input_ids=X).logits


def test_a_good_bin_folder_loads_as_saved(bin_folder):
    folder, logits = bin_folder
    with torch.no_grad():
        torch.testing.assert_close(load_adapter(tiny_model("llama"), folder).eval()(input_ids=X).logits, logits,
                                   rtol=0, atol=0)


@pytest.mark.parametrize(("damage", "problem"), [
    (lambda data: b"not a pickle at all", "is not a PyTorch file"),
    (lambda data: data[: len(data) // 2], "is truncated or damaged"),
])
@pytest.mark.parametrize("model", ["tiny:llama", "built"])
def test_a_damaged_bin_is_a_one_line_error_naming_the_file(bin_folder, tmp_path, damage, problem, model):
    folder = tmp_path / "damaged"
    shutil.copytree(bin_folder[0], folder)
    weights = folder / "adapter_model.bin"
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(CheckpointError) as caught:
        load_adapter(tiny_model("llama") if model == "built" else model, folder)
    message = str(caught.value)
    assert message.startswith(f"adapter weights {str(weights)!r} {problem}") and "\n" not in message
    assert "weights_only" not in message  # not torch's advice to unpickle the file fully


def test_a_bin_of_other_objects_is_refused(bin_folder, tmp_path):
    folder = tmp_path / "objects"
    shutil.copytree(bin_folder[0], folder)
    torch.save({"step": 3, "note": "not tensors"}, folder / "adapter_model.bin")
    with pytest.raises(CheckpointError, match=r"hold a dict with values other than tensors"):
        load_adapter("tiny:llama", folder)
