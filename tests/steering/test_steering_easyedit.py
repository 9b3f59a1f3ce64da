"""EasyEdit2 parity on tiny models: its rows and CAA math, its folder layout and file format, bad folders and rows,
and ``output_hidden_states`` reporting the steered residual stream."""

from __future__ import annotations

import pickle
import zipfile

import pytest
import torch

import steering
from peftplug.errors import CheckpointError, ConfigError, DataError, MissingFileError


class Opaque:
    """A pickled object that records being unpickled (it must never be)."""

    unpickled = False

    def __setstate__(self, state):
        Opaque.unpickled = True


ROWS = [
    {"question": "How was the film? ", "matching": "Wonderful, I loved it.", "not_matching": "Dull, I hated it."},
    {"question": "Describe the meal.", "matching": "Delicious and warm", "not_matching": "Cold and bland"},
    {"question": "", "matching": "great", "not_matching": "awful"},
]


def _reference_caa(model, tokenizer, rows, layer, chat: bool, multiple_choice: bool = False):
    """EasyEdit2's CAA written out by hand: one unpadded forward per text, hidden_states[layer + 1]."""
    diffs = []
    for row in rows:
        q = row["question"].strip()
        if chat:
            q = tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        lead = "\nAnswer: " if multiple_choice else " "
        q_len = len(tokenizer(q, add_special_tokens=not chat)["input_ids"])
        acts = []
        for answer in (row["matching"], row["not_matching"]):
            ids = torch.tensor([tokenizer(q + lead + answer, add_special_tokens=not chat)["input_ids"]])
            with torch.no_grad():
                h = model(input_ids=ids, output_hidden_states=True).hidden_states[layer + 1][0]
            acts.append(h[-2] if multiple_choice else h[q_len:].mean(0))
        diffs.append(acts[0] - acts[1])
    return torch.stack(diffs).mean(0)


@pytest.mark.parametrize(("chat", "multiple_choice"), [(False, False), (True, False), (True, True)])
def test_rows_give_easyedit_caa_vector(tiny_model, tokenizer, chat, multiple_choice):
    model = tiny_model("llama", num_hidden_layers=3)
    expected = _reference_caa(model, tokenizer, ROWS, 1, chat, multiple_choice)
    pm = steering.train_steering_vector(model, tokenizer, ROWS, method="caa", layers=[1], progress=False,
                                        use_chat_template=chat, multiple_choice=multiple_choice, batch_size=2)
    torch.testing.assert_close(pm.base_model.get_vectors()[1], expected, rtol=1e-4, atol=1e-5)
    config = pm.base_model.peft_config["default"]
    assert config.read_position == ("second_to_last" if multiple_choice else "answer") and config.num_pairs == 3


def test_rows_work_for_the_other_generators(tiny_model, tokenizer):
    model = tiny_model("llama", num_hidden_layers=2)
    pca = steering.train_steering_vector(model, tokenizer, ROWS, method="pca_center", layers=[0], progress=False)
    caa = steering.caa_vectors(model, tokenizer, steering.caa_rows(tokenizer, ROWS), [0], progress=False)[0]
    assert torch.nn.functional.cosine_similarity(pca.base_model.get_vectors()[0], caa, dim=0) > 0.5
    trained = steering.train_steering_vector(tiny_model("llama", num_hidden_layers=2), tokenizer, ROWS,
                                             method="trainable", layers=[1], steps=3, progress=False)
    assert trained.base_model.get_vectors()[1].norm() > 0
    vp_rows = [{"input": "Tell me about the sea.", "output": "It is vast."}, {"input": "", "output": "Hello there."}]
    # Three blocks, steering block 1: transformers reports the *last* block's output after the final norm.
    vp = steering.train_steering_vector(tiny_model("llama", num_hidden_layers=3), tokenizer, vp_rows,
                                        method="vector_prompt", prompt="Be cheerful.", layers=[1], progress=False)
    # Reference: EasyEdit2's vector prompt, the mean over the output tokens with vs without the prompt.
    diffs = []
    for row in vp_rows:
        pos_q = ("Be cheerful. " + row["input"]).strip()
        neg_q = row["input"].strip()
        acts = []
        for q in (pos_q, neg_q):
            ids = torch.tensor([tokenizer(q + " " + row["output"])["input_ids"]])
            with torch.no_grad(), vp.disable_adapter():
                h = vp(input_ids=ids, output_hidden_states=True).hidden_states[2][0]
            acts.append(h[len(tokenizer(q)["input_ids"]):].mean(0))
        diffs.append(acts[0] - acts[1])
    torch.testing.assert_close(vp.base_model.get_vectors()[1], torch.stack(diffs).mean(0), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ([{"question": "q", "matching": "", "not_matching": "no"}], "'matching' is empty"),
        ([{"question": "q", "matching": "yes", "not_matching": "  "}], "'not_matching' is empty"),
        ([{"question": "q", "matching": "yes"}], "missing field 'not_matching'"),
        ([{"question": "q", "matching": 3, "not_matching": "no"}], "must be a string"),
        ([{"question": "q", "matching": "a", "not_matching": "b"}, ("x", "y")], "row 1 must be a dict"),
    ],
)
def test_bad_rows_are_one_line_errors(tiny_model, tokenizer, rows, match):
    with pytest.raises(DataError, match=match) as err:
        steering.train_steering_vector(tiny_model("llama"), tokenizer, rows, layers=[0], progress=False)
    assert "\n" not in str(err.value)


def test_bad_pairs_and_layers_are_one_line_errors(tiny_model, tokenizer):
    with pytest.raises(ValueError, match="non-empty strings"):
        steering.train_steering_vector(tiny_model("llama"), tokenizer, [("good", "")], layers=[0], progress=False)
    with pytest.raises(ValueError, match=r"the model has 2 blocks \(0..1\)"):
        steering.train_steering_vector(tiny_model("llama"), tokenizer, [("a", "b")], layers=[2], progress=False)


# ------------------------------------------------------------------------------------------------ file layout
def test_export_writes_easyedit_tree_and_files(tiny_model, tokenizer, tmp_path):
    pm = steering.train_steering_vector(tiny_model("llama"), tokenizer, ROWS, layers=[0, 1], multiplier=3.0,
                                        progress=False)
    paths = steering.export_easyedit(pm, tmp_path, dataset="sst2")
    assert [p.relative_to(tmp_path).as_posix() for p in paths] == ["sst2/caa_vector/layer_0.pt",
                                                                   "sst2/caa_vector/layer_1.pt"]
    for layer, path in zip((0, 1), paths):
        obj = torch.load(path, map_location="cpu", weights_only=True)
        # A bare 1-D tensor in the model's dtype, unscaled (EasyEdit2 applies its own multiplier).
        assert type(obj) is torch.Tensor and obj.shape == (64,) and obj.dtype == torch.float32
        assert torch.equal(obj, pm.base_model.get_vectors()[layer])
        with zipfile.ZipFile(path) as archive:  # torch names the archive root after the file, as EasyEdit2's are
            assert archive.namelist()[0].startswith(f"layer_{layer}/")
    assert not list(tmp_path.rglob("*.tmp")) and not [p for p in tmp_path.rglob(".*")]
    half = steering.export_easyedit({3: torch.ones(8)}, tmp_path / "m", dataset="mix", method="merge_vector",
                                    dtype=torch.bfloat16)
    assert half[0].relative_to(tmp_path).as_posix() == "m/mix/merge_vector/layer_3_merged_vector.pt"
    assert torch.load(half[0], weights_only=True).dtype == torch.bfloat16
    mc = steering.train_steering_vector(tiny_model("llama"), tokenizer, ROWS, layers=[1], multiple_choice=True,
                                        progress=False)
    assert steering.export_easyedit(mc, tmp_path, dataset="d")[0].parent.name == "caa_vector_multiple_choice"
    vp = steering.steering_adapter(tiny_model("llama"), {1: torch.ones(64)}, method="vector_prompt")
    assert steering.export_easyedit(vp, tmp_path, dataset="d")[0].parent.name == "vector_prompt_vector"


def test_import_accepts_method_or_dataset_folder(tiny_model, tmp_path):
    vectors = {0: torch.randn(64), 1: torch.randn(64)}
    steering.export_easyedit(vectors, tmp_path, dataset="sst2", method="vector_prompt")
    for folder in (tmp_path / "sst2" / "vector_prompt_vector", tmp_path / "sst2"):
        got = steering.import_easyedit(folder, hidden_size=64)
        assert sorted(got) == [0, 1] and all(torch.equal(got[k], vectors[k]) for k in got)
    steering.export_easyedit(vectors, tmp_path, dataset="sst2", method="caa")
    with pytest.raises(ConfigError, match="several EasyEdit2 vector folders"):
        steering.import_easyedit(tmp_path / "sst2")
    pm = steering.load_easyedit(tiny_model("llama"), tmp_path / "sst2" / "caa_vector", multiplier=2.0,
                                steer_from_end_position=True)
    config = pm.base_model.peft_config["default"]
    assert (config.positions, config.multiplier, config.layers) == ("from_last_prompt", 2.0, [0, 1])


def test_bad_easyedit_folders_are_one_line_errors(tiny_model, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(MissingFileError, match="no layer_.*expected an EasyEdit2 method folder"):
        steering.import_easyedit(tmp_path / "empty")
    with pytest.raises(MissingFileError, match="does not exist"):
        steering.import_easyedit(tmp_path / "nope")
    # An LM-Steer checkpoint: a pickled list that needs weights_only=False; it is named and never unpickled.
    lm = tmp_path / "toxicity" / "lm_steer_vector"
    lm.mkdir(parents=True)
    torch.save([{"hparams": 1}, {"add_vec": torch.zeros(2, 64)}, 3], lm / "lm_steer_vector.pt")
    for folder in (lm, lm.parent):
        with pytest.raises(CheckpointError, match="LM-Steer checkpoint"):
            steering.import_easyedit(folder)
    # A pickled object renamed layer_0.pt: weights_only refuses it, reported on one line.
    for name, write in (("raw", lambda p: p.write_bytes(pickle.dumps(Opaque()))),
                        ("zip", lambda p: torch.save({"v": Opaque()}, p))):
        (tmp_path / name).mkdir()
        write(tmp_path / name / "layer_0.pt")
        with pytest.raises(CheckpointError, match="not a plain tensor file") as err:
            steering.import_easyedit(tmp_path / name)
        assert "\n" not in str(err.value) and not Opaque.unpickled
    wide = tmp_path / "wide"
    steering.export_easyedit({0: torch.ones(32)}, wide)
    with pytest.raises(ConfigError, match="32 entries, expected the model's hidden size 64"):
        steering.load_easyedit(tiny_model("llama"), wide)
    far = tmp_path / "far"
    steering.export_easyedit({7: torch.ones(64)}, far)
    with pytest.raises(ValueError, match=r"layers \[7\] out of range: the model has 2 decoder blocks"):
        steering.load_easyedit(tiny_model("llama"), far)
    multi = tmp_path / "multi"
    multi.mkdir()
    torch.save(torch.ones(3, 64), multi / "layer_0.pt")
    with pytest.raises(CheckpointError, match=r"shape \(3, 64\), expected one vector"):
        steering.import_easyedit(multi)


# --------------------------------------------------------------------------------------- output_hidden_states
@pytest.mark.parametrize("family", ("llama", "gpt2"))
def test_output_hidden_states_report_the_steered_stream(family, tiny_model, tokenizer):
    model = tiny_model(family, num_hidden_layers=3) if family == "llama" else tiny_model(family, n_layer=3)
    batch = tokenizer(["hello there", "hi"], return_tensors="pt", padding=True)
    with torch.no_grad():
        base = model(**batch, output_hidden_states=True).hidden_states  # also installs transformers' hooks first
    v = torch.randn(64)
    pm = steering.steering_adapter(model, {1: v}, multiplier=2.5)
    _, blocks = steering.families.find_blocks(pm)
    received = {}

    def record_input(module, args, kwargs):
        received["h"] = args[0] if args else kwargs["hidden_states"]

    handle = blocks[2].register_forward_pre_hook(record_input, with_kwargs=True)
    with torch.no_grad():
        steered = pm(**batch, output_hidden_states=True).hidden_states
    handle.remove()
    mask = batch["attention_mask"][..., None].float()
    expected = base[2] + 2.5 * v * mask  # padding is never steered
    torch.testing.assert_close(steered[2], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(steered[2], received["h"])  # what block 2 really received
    torch.testing.assert_close(steered[1], base[1])  # blocks before L are untouched
    with torch.no_grad(), pm.disable_adapter():
        torch.testing.assert_close(pm(**batch, output_hidden_states=True).hidden_states[2], base[2])
