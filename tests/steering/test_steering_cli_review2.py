"""``peftplug steering`` as a command-line user meets it: output paths, atomic writes, flag errors, converters.

Every run uses ``tiny:llama`` (2 blocks, hidden 64, built offline). References are computed here: vectors through
the API, generations with ``PeftModel.generate``, metrics by hand, the GGUF through ``gguf.GGUFReader``.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from peft import PeftModel

import steering
from peftplug.errors import ConfigError, DataError
from steering.cli import load_model_and_tokenizer, main

PAIRS = [("Lily was very happy.", "Lily was very sad."), ("Tom smiled and laughed.", "Tom cried and cried.")]


def _write_pairs(path, rows=None):
    rows = rows if rows is not None else [{"positive": p, "negative": n} for p, n in PAIRS]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _extract(tmp_path, out, *flags):
    pairs = _write_pairs(tmp_path / "pairs.jsonl")
    assert main(["extract", "--model", "tiny:llama", "--pairs", str(pairs), "--out", str(out), "--quiet",
                 *flags]) == 0
    return out


def _vectors(folder):
    model, _ = load_model_and_tokenizer("tiny:llama")
    return PeftModel.from_pretrained(model, folder).base_model.get_vectors()


def _generate(capsys, *args):
    capsys.readouterr()
    assert main(["generate", "--model", "tiny:llama", "--prompt", "hi", "--prompt", "hello there",
                 "--max-new-tokens", "6", *args]) == 0
    return capsys.readouterr().out.splitlines()


def _listing(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# ------------------------------------------------------------------------------------------ EasyEdit2 round trip
def test_export_easyedit_replaces_an_earlier_export_so_no_stale_layer_is_imported(tmp_path):
    wide = _extract(tmp_path, tmp_path / "wide", "--layers", "0", "1")
    narrow = _extract(tmp_path, tmp_path / "narrow", "--layers", "1", "--multiplier", "2")
    ee = tmp_path / "ee"
    for adapter in (wide, narrow):
        assert main(["export-easyedit", "--model", "tiny:llama", "--adapter", str(adapter), "--out", str(ee)]) == 0
    # Before: layer_0.pt of the first export stayed, and the import steered layer 0 with the other adapter's vector.
    assert sorted(p.name for p in ee.iterdir()) == ["layer_1.pt"]
    assert main(["import-easyedit", "--model", "tiny:llama", "--folder", str(ee), "--out", str(tmp_path / "back")]) == 0
    back, want = _vectors(tmp_path / "back"), _vectors(narrow)
    assert list(back) == [1] and torch.equal(back[1], want[1])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left behind


def test_export_easyedit_failing_midway_leaves_the_earlier_folder(tmp_path, monkeypatch):
    folder = tmp_path / "ee"
    steering.export_easyedit({0: torch.ones(64), 1: 2 * torch.ones(64)}, folder)
    before = _listing(folder)
    real_save, calls = torch.save, []

    def save_then_fail(obj, path, *args, **kwargs):  # the disk fills up while the second layer is written
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_then_fail)
    with pytest.raises(OSError, match="No space left"):
        steering.export_easyedit({0: 5 * torch.ones(64), 1: 6 * torch.ones(64)}, folder)
    monkeypatch.undo()
    assert _listing(folder) == before  # before: layer_0.pt already held the new vector, layer_1.pt the old one
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_export_easyedit_refuses_a_folder_of_other_files(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match=r"holds other files than EasyEdit2 layer files \(notes\.txt\)") as info:
        steering.export_easyedit({1: torch.ones(64)}, tmp_path / "mine")
    assert "\n" not in str(info.value) and (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_cli_easyedit_round_trip_gives_identical_vectors_and_generations(tmp_path, capsys):
    adapter = _extract(tmp_path, tmp_path / "a", "--layers", "0", "1", "--multiplier", "3",
                       "--positions", "from_last_prompt")
    ee = tmp_path / "vectors"
    assert main(["export-easyedit", "--model", "tiny:llama", "--adapter", str(adapter), "--dataset", "happy",
                 "--out", str(ee)]) == 0
    assert main(["import-easyedit", "--model", "tiny:llama", "--folder", str(ee / "happy"), "--multiplier", "3",
                 "--steer-from-end-position", "--out", str(tmp_path / "b")]) == 0
    original, back = _vectors(adapter), _vectors(tmp_path / "b")
    assert list(back) == [0, 1] and all(torch.equal(back[k], original[k]) for k in original)
    steered = _generate(capsys, "--adapter", str(adapter))
    assert _generate(capsys, "--adapter", str(tmp_path / "b")) == steered
    assert _generate(capsys) != steered  # the vectors do steer


# ------------------------------------------------------------------------------------------ GGUF
def test_cli_export_gguf_is_a_llama_cpp_control_vector(tmp_path):
    gguf = pytest.importorskip("gguf")
    from steering.io import import_gguf

    adapter = _extract(tmp_path, tmp_path / "a", "--layers", "1", "--multiplier", "-2.5")
    out = tmp_path / "sub" / "cv.gguf"  # its folder is created
    assert main(["export-gguf", "--model", "tiny:llama", "--adapter", str(adapter), "--out", str(out)]) == 0
    reader = gguf.GGUFReader(str(out))
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "controlvector"
    # llama.cpp's loader: tensors named direction.<L> (L >= 1, block L's output), 1-D F32 of n_embd entries.
    assert [t.name for t in reader.tensors] == ["direction.1"]
    tensor = reader.tensors[0]
    assert tensor.tensor_type == gguf.GGMLQuantizationType.F32 and [int(n) for n in tensor.shape] == [64]
    want = -2.5 * _vectors(adapter)[1]
    torch.testing.assert_close(torch.from_numpy(tensor.data.copy()), want, rtol=0, atol=0)
    assert torch.equal(import_gguf(out)[1], torch.from_numpy(tensor.data.copy()))
    with pytest.raises(ConfigError, match=r"steers layer 0 .*llama\.cpp refuses a control vector with direction\.0"):
        main(["export-gguf", "--model", "tiny:llama", "--adapter",
              str(_extract(tmp_path, tmp_path / "z", "--layers", "0", "1")), "--out", str(tmp_path / "z.gguf")])
    assert not (tmp_path / "z.gguf").exists()


def test_import_gguf_errors_are_one_line(tmp_path):
    pytest.importorskip("gguf")
    from peftplug.errors import CheckpointError, MissingFileError
    from steering.io import import_gguf

    with pytest.raises(MissingFileError, match="does not exist or is not a file"):
        import_gguf(tmp_path / "none.gguf")
    (tmp_path / "text.gguf").write_text("not a gguf")
    with pytest.raises(CheckpointError, match=r"text\.gguf is not a readable GGUF file"):  # before: ValueError
        import_gguf(tmp_path / "text.gguf")


def test_exports_refuse_an_operator_the_target_cannot_apply(tiny_model, tmp_path):
    pytest.importorskip("gguf")
    pm = steering.steering_adapter(tiny_model("llama"), {1: torch.ones(64)}, operator="ablate")
    with pytest.raises(ConfigError, match=r"operator='ablate', but EasyEdit2 only adds vectors"):
        steering.export_easyedit(pm, tmp_path / "ee")
    with pytest.raises(ConfigError, match=r"operator='ablate', but llama\.cpp only adds vectors"):
        steering.export_gguf(pm, tmp_path / "cv.gguf")
    assert not (tmp_path / "ee").exists() and not (tmp_path / "cv.gguf").exists()


def test_exports_warn_where_a_setting_is_lost(tiny_model, tmp_path):
    pytest.importorskip("gguf")
    pm = steering.steering_adapter(tiny_model("llama"), {1: torch.ones(64)}, layer_multipliers={1: 0.5},
                                   positions="generated")
    with pytest.warns(UserWarning, match=r"layer_multipliers \{1: 0\.5\}, which the raw vectors do not carry"):
        steering.export_easyedit(pm, tmp_path / "ee")
    with pytest.warns(UserWarning, match=r"positions='generated', which llama\.cpp cannot express"):
        steering.export_gguf(pm, tmp_path / "cv.gguf")


# ------------------------------------------------------------------------------------------ adapter folders
def test_extract_failing_midway_leaves_no_half_written_adapter(tmp_path, monkeypatch):
    import peft.peft_model

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(peft.peft_model, "safe_save_file", fail)
    with pytest.raises(OSError, match="No space left"):
        _extract(tmp_path, tmp_path / "new", "--layers", "1")
    assert not (tmp_path / "new").exists()  # before: the folder was there, without weights
    monkeypatch.undo()
    earlier = _extract(tmp_path, tmp_path / "old", "--layers", "1")
    before = _listing(earlier)
    monkeypatch.setattr(peft.peft_model, "safe_save_file", fail)
    with pytest.raises(OSError):
        _extract(tmp_path, earlier, "--layers", "0")
    assert _listing(earlier) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_extract_onto_an_earlier_adapter_replaces_it(tmp_path):
    out = _extract(tmp_path, tmp_path / "a", "--layers", "0", "1")
    _extract(tmp_path, out, "--layers", "1", "--multiplier", "2")
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["layers"], config["multiplier"]) == ([1], 2.0)


def _out_cases(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    (tmp_path / "prompts.txt").write_text("hi\n")
    pairs = str(_write_pairs(tmp_path / "pairs.jsonl"))
    extract = ["extract", "--pairs", pairs, "--layers", "1"]
    return [
        (extract + ["--out", "{file}"], r"--out .*file: is a file"),
        (extract + ["--out", "{file}/sub"], r"--out .*file/sub: .*file is a file, not a folder"),
        (extract + ["--out", "{other}"], r"--out .*other: holds files but no adapter_config\.json"),
        (["import-easyedit", "--folder", "{other}", "--out", "{file}"], r"--out .*file: is a file"),
        (["import-easyedit", "--folder", "{other}", "--out", "{other}"], r"holds files but no adapter_config"),
        (["export-gguf", "--adapter", "{other}", "--out", "{other}"], r"--out .*other: is a folder"),
        (["export-easyedit", "--adapter", "{other}", "--out", "{file}"], r"--out .*file: is a file"),
        (["evaluate", "--prompts", "{prompts}", "--raw-prompts", "--out", "{other}"], r"--out .*other: is a folder"),
    ]


@pytest.mark.parametrize("case", range(8))
def test_output_path_errors_are_one_line_before_the_model_loads(tmp_path, case):
    args, message = _out_cases(tmp_path)[case]
    paths = {"file": tmp_path / "file", "other": tmp_path / "other", "prompts": tmp_path / "prompts.txt"}
    # An unknown model: were the path checked only after loading, the error would be about the model.
    argv = [a.format(**paths) for a in args] + ["--model", "tiny:no_such_family"]
    with pytest.raises(ConfigError, match=message) as info:
        main(argv)
    assert "\n" not in str(info.value)
    assert (tmp_path / "other" / "notes.txt").read_text() == "keep me" and (tmp_path / "file").read_text() == "x"


# ------------------------------------------------------------------------------------------ flags and input files
@pytest.mark.parametrize(("args", "error", "message"), [
    (["generate", "--prompt", "hi", "--temperature", "-1"], ConfigError, r"--temperature must be a finite number >= 0"),
    (["generate", "--prompt", "hi", "--temperature", "nan"], ConfigError, r"--temperature must be a finite number"),
    (["evaluate", "--prompts", "{prompts}", "--raw-prompts", "--temperature", "-0.5"], ConfigError,
     r"--temperature must be a finite number >= 0, got -0\.5"),
    (["extract", "--pairs", "{pairs}", "--layers", "-1", "--out", "{out}"], ConfigError,
     r"--layers must be block indices >= 0"),
    (["extract", "--pairs", "{pairs}", "--layers", "1", "--batch-size", "0", "--out", "{out}"], ConfigError,
     r"--batch-size must be >= 1, got 0"),
    (["extract", "--pairs", "{pairs}", "--layers", "1", "--method", "trainable", "--lr", "-1", "--out", "{out}"],
     ConfigError, r"--lr must be a finite number > 0"),
    (["extract", "--pairs", "{binary}", "--layers", "1", "--out", "{out}"], DataError, r"binary\.jsonl: not UTF-8"),
    (["extract", "--pairs", "{folder}", "--layers", "1", "--out", "{out}"], ConfigError, r"is a folder; expected a"),
])
def test_flag_and_file_errors_are_one_line_before_the_model_loads(tmp_path, args, error, message):
    (tmp_path / "prompts.txt").write_text("hi\n")
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe{}\n")
    (tmp_path / "folder").mkdir()
    paths = {"prompts": tmp_path / "prompts.txt", "pairs": _write_pairs(tmp_path / "pairs.jsonl"),
             "binary": tmp_path / "binary.jsonl", "folder": tmp_path / "folder", "out": tmp_path / "out"}
    with pytest.raises(error, match=message) as info:
        main([a.format(**paths) for a in args] + ["--model", "tiny:no_such_family"])
    assert "\n" not in str(info.value) and not (tmp_path / "out").exists()


@pytest.mark.parametrize("answers", [3, [], [""], ["4", 4]])
def test_questions_need_non_empty_answers(tmp_path, answers):
    # Before: a non-list crashed with a TypeError; an empty list never matched, and an empty answer matched almost
    # any reply (any punctuation or space not followed by a word character), so it counted as kept.
    (tmp_path / "prompts.txt").write_text("hi\n")
    (tmp_path / "q.jsonl").write_text(json.dumps({"question": "2+2?", "answers": answers}) + "\n")
    with pytest.raises(DataError, match=r"q\.jsonl: entry 1: 'answers' must be a non-empty string or a non-empty"):
        main(["evaluate", "--model", "tiny:llama", "--prompts", str(tmp_path / "prompts.txt"), "--raw-prompts",
              "--questions", str(tmp_path / "q.jsonl"), "--max-new-tokens", "2"])


def test_scorer_without_a_trained_head_is_refused(tiny_model, tokenizer, tmp_path):
    # A causal LM folder loads as a sequence classifier with a freshly initialised head: its scores are noise.
    tiny_model("llama").save_pretrained(tmp_path / "lm")
    tokenizer.save_pretrained(tmp_path / "lm")
    (tmp_path / "prompts.txt").write_text("hi\n")
    with pytest.raises(ConfigError, match=r"--scorer .*lm: not a trained sequence classifier \(weights score\.weight"):
        main(["evaluate", "--model", "tiny:llama", "--prompts", str(tmp_path / "prompts.txt"), "--raw-prompts",
              "--scorer", str(tmp_path / "lm"), "--max-new-tokens", "2"])


# ------------------------------------------------------------------------------------------ evaluate, by hand
def _entropy(text, n):
    words = re.findall(r"\w+|[^\w\s]", text)
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return -sum(grams.count(g) / len(grams) * math.log2(grams.count(g) / len(grams)) for g in set(grams))


def test_cli_evaluate_metrics_equal_a_hand_computation(tiny_model, tokenizer, tmp_path, capsys):
    adapter = _extract(tmp_path, tmp_path / "a", "--layers", "0", "1")
    clf = tiny_model("llama", task="seq_cls", num_labels=2)
    clf.config.pad_token_id = tokenizer.pad_token_id
    clf.save_pretrained(tmp_path / "clf")
    tokenizer.save_pretrained(tmp_path / "clf")
    prompts = ["hello there", "hi"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    # No reply of the tiny model contains "zebra": instruction_kept is 0 / 0, written as JSON null, not NaN.
    (tmp_path / "q.jsonl").write_text(json.dumps({"question": "ab", "answers": ["zebra"]}) + "\n")
    capsys.readouterr()
    assert main(["evaluate", "--model", "tiny:llama", "--adapter", f"{adapter}:3", "--prompts",
                 str(tmp_path / "prompts.txt"), "--raw-prompts", "--scorer", str(tmp_path / "clf"), "--questions",
                 str(tmp_path / "q.jsonl"), "--max-new-tokens", "6", "--out", str(tmp_path / "eval.json")]) == 0

    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))

    printed = strict(capsys.readouterr().out.splitlines()[0])
    result = strict((tmp_path / "eval.json").read_text())
    assert printed["instruction_kept"] is None and result["instruction_kept"] is None

    model, tok = load_model_and_tokenizer("tiny:llama")
    pm = PeftModel.from_pretrained(model, adapter)
    pm.base_model.set_multiplier(3.0)
    texts, nll, ppl = [], 0.0, []
    for prompt in prompts:
        ids = tok([prompt], return_tensors="pt")["input_ids"]
        new = pm.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)[0]
        new = new[ids.shape[1]:].tolist()
        new = new[:next((i for i, t in enumerate(new) if t in (tok.eos_token_id, tok.pad_token_id)), len(new))]
        texts.append(tok.decode(new, skip_special_tokens=True))
        with pm.disable_adapter(), torch.no_grad():
            logp = torch.log_softmax(pm(torch.tensor([ids[0].tolist() + new])).logits[0].float(), -1)
        s = -sum(float(logp[ids.shape[1] - 1 + i, t]) for i, t in enumerate(new))
        nll, ppl = nll + s, [*ppl, math.exp(s / len(new))]
    assert result["generations"] == texts
    assert result["perplexity"] == pytest.approx(sum(ppl) / 2, rel=1e-5)
    assert result["total_perplexity"] == pytest.approx(math.exp(nll / 12), rel=1e-5)
    assert result["fluency"] == pytest.approx(sum((2 / 3 * _entropy(t, 2) + 4 / 3 * _entropy(t, 3)) / 2
                                                  for t in texts) / 2)
    for n in (1, 2, 3):
        want = [len({tuple(t.split()[i:i + n]) for i in range(len(t.split()) - n + 1)}) / len(t.split()) for t in texts]
        assert result[f"distinct_{n}"] == pytest.approx(sum(want) / 2)
    from transformers import AutoModelForSequenceClassification

    scorer = AutoModelForSequenceClassification.from_pretrained(tmp_path / "clf").eval()
    with torch.no_grad():
        scores = [float(torch.softmax(scorer(**tokenizer([t], return_tensors="pt")).logits, -1)[0, 1]) for t in texts]
    assert result["scores"] == pytest.approx(scores, rel=1e-5)
    assert result["concept_mean"] == pytest.approx(sum(scores) / 2, rel=1e-5)
    assert result["positive_rate"] == sum(s >= 0.5 for s in scores) / 2


# ------------------------------------------------------------------------------------------ generate, inputs
def test_cli_generate_with_several_adapters_equals_the_api(tmp_path, capsys):
    a = _extract(tmp_path, tmp_path / "a", "--layers", "0", "1")
    b = _extract(tmp_path, tmp_path / "b", "--layers", "0", "--method", "pca_diff")
    got = _generate(capsys, "--adapter", f"{a}:4", "--adapter", f"{b}:-2")
    va, vb = _vectors(a), _vectors(b)
    model, tok = load_model_and_tokenizer("tiny:llama")
    pm = steering.steering_adapter(model, {0: 4 * va[0] - 2 * vb[0], 1: 4 * va[1]})  # "add" edits sum
    batch = tok(["hi", "hello there"], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = pm.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    assert got == tok.batch_decode(out, skip_special_tokens=True)


def test_extract_reads_easyedit_vector_prompt_rows(tmp_path, tokenizer):
    rows = [{"input": "Tell me a story.", "output": "Once upon a time."},
            {"input": "Describe the day.", "output": "It was sunny."}]
    pairs = _write_pairs(tmp_path / "vp.jsonl", rows)
    # Before: "expected {'positive': str, 'negative': str}", though the API takes these rows.
    assert main(["extract", "--model", "tiny:llama", "--pairs", str(pairs), "--method", "vector_prompt",
                 "--prompt", "Be cheerful.", "--layers", "1", "--out", str(tmp_path / "vp"), "--quiet"]) == 0
    model, tok = load_model_and_tokenizer("tiny:llama")
    want = steering.train_steering_vector(model, tok, rows, method="vector_prompt", prompt="Be cheerful.",
                                          layers=[1], progress=False).base_model.get_vectors()
    assert torch.equal(_vectors(tmp_path / "vp")[1], want[1])


def test_a_zero_ablation_vector_is_refused_before_training(tiny_model, tokenizer):
    # steering.train_vectors trains in eval mode, so SteeringModel.train's check never ran: losses stayed at log 2 and
    # the vector at zero (and the CLI refused only after all its steps, pointing at set_vectors).
    import peft

    from steering import SteeringConfig, train_vectors

    model = peft.get_peft_model(tiny_model("llama"), SteeringConfig(layers=[1], operator="ablate",
                                                                    task_type="CAUSAL_LM")).eval()
    pairs = [("a b", "a c")] * 2
    with pytest.raises(ValueError, match="operator='ablate' vectors that are zero cannot be trained"):
        train_vectors(model, tokenizer, pairs, "preference", 2, 0.1, 2)
