"""Fourth review, EasyEdit2 interchange: STA's ``sta_vector/layer_{L}_{mode}_trim{t}.pt`` files.

EasyEdit2's STA applier loads ``layer_{L}_{mode}_trim{trim}.pt`` (a bare ``[hidden]`` tensor) and adds
``multiplier * vector`` to block ``L``'s output, as CAA does. The import refused the folder ("no layer_{L}.pt
files"), although the error for an STA dataset folder told the user to pass exactly that folder.
"""

from __future__ import annotations

import pytest
import torch

import steering
from peftplug.errors import CheckpointError, ConfigError


def _sta_dataset(root, vector: torch.Tensor, layer: int):
    """The tree EasyEdit2's STA generator writes: sta_vector/, its caa_vector/ side output, feature_score/ cache."""
    dataset = root / "toxicity"
    for sub in ("sta_vector", "caa_vector", "feature_score"):
        (dataset / sub).mkdir(parents=True)
    torch.save(vector, dataset / "sta_vector" / f"layer_{layer}_act_and_freq_trim0.65.pt")
    torch.save(torch.ones(vector.numel()), dataset / "caa_vector" / f"layer_{layer}.pt")
    torch.save(torch.ones(1000), dataset / "feature_score" / f"layer_{layer}_feature_act.pt")  # [d_sae], not a vector
    return dataset


def test_sta_folder_imports_and_steers_block_output_by_m_v(tiny_model, tokenizer, tmp_path):
    layer, m = 1, 3.0
    vector = torch.randn(64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)  # EasyEdit2: model dtype
    dataset = _sta_dataset(tmp_path, vector, layer)
    with pytest.raises(ConfigError, match="sta_vector"):  # three method folders: the user must choose
        steering.import_easyedit(dataset)
    got = steering.import_easyedit(dataset / "sta_vector")
    assert list(got) == [layer] and got[layer].dtype == torch.float32
    torch.testing.assert_close(got[layer], vector.float(), rtol=0, atol=0)

    model = tiny_model("llama", num_hidden_layers=3)
    ids = tokenizer(["A short prompt"], return_tensors="pt")
    with torch.no_grad():
        base = model(**ids, output_hidden_states=True).hidden_states[layer + 1]
    pm = steering.load_easyedit(model, dataset / "sta_vector", multiplier=m)
    with torch.no_grad():
        steered = pm(**ids, output_hidden_states=True).hidden_states[layer + 1]
    torch.testing.assert_close(steered - base, (m * vector.float()).expand_as(base), rtol=1e-5, atol=1e-5)


def test_several_sta_trims_for_one_layer_name_both_files(tmp_path):
    folder = tmp_path / "sta_vector"
    folder.mkdir()
    torch.save(torch.ones(8), folder / "layer_3_act_and_freq_trim0.65.pt")
    torch.save(torch.ones(8), folder / "layer_3_only_act_trim0.5.pt")
    with pytest.raises(CheckpointError, match=r"layer_3_act_and_freq_trim0\.65\.pt.*layer_3_only_act_trim0\.5\.pt"):
        steering.import_easyedit(folder)
