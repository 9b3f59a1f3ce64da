"""What export and decompose do to folders: nothing lost, nothing stale, no two sources under one name."""

import json
import os

import peft
import pytest
import torch

import prompt_transfer as pt
from prompt_transfer.cli import main


def _batch(tokenizer):
    enc = tokenizer(["good movie", "bad film!"], return_tensors="pt", padding=True)
    return {**enc, "labels": enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)}


def _pct_model(tiny_model, tmp_path, adapter_name="default"):
    g = torch.Generator().manual_seed(1)
    dec = pt.decompose({f"s{i}": torch.randn(3, 64, generator=g) for i in range(3)}, contrastive_steps=0)
    pt.save_decomposition(dec, str(tmp_path / "dec"))
    config = pt.PCTConfig(task_type="CAUSAL_LM", decomposition_path=str(tmp_path / "dec"))
    return peft.get_peft_model(tiny_model("llama"), config, adapter_name=adapter_name)


def _logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits


def _snapshot(folder):
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder)) if (folder / name).is_file()}


def test_cli_decompose_keeps_sources_whose_folders_share_a_name(tiny_model, tmp_path, capsys):
    """`decompose runs/src_sst2/adapter runs/src_bbc/adapter ...` without --names: three sources, three names."""
    folders = []
    for i, task in enumerate(("src_sst2", "src_bbc", "src_rte")):
        torch.manual_seed(i)
        model = peft.get_peft_model(tiny_model("llama"), pt.prompt_tuning_config("CAUSAL_LM", 4))
        model.save_pretrained(str(tmp_path / task / "adapter"))
        folders.append(str(tmp_path / task / "adapter"))
    assert main(["decompose", *folders, "--out", str(tmp_path / "dec"), "--contrastive-steps", "0"]) == 0
    dec = pt.load_decomposition(str(tmp_path / "dec"))
    assert dec.source_names == ["src_sst2", "src_bbc", "src_rte"] and dec.num_sources == 3
    for k, folder in enumerate(folders):
        torch.testing.assert_close(dec.reconstruct()[k], pt.load_source_prompt(folder), atol=1e-5, rtol=0)

    # Explicit duplicate names and a folder given twice are refused in one line, before anything is written.
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["decompose", *folders, "--names", "SST-2", "bbc", "SST-2", "--out", str(tmp_path / "dec2")])
    assert exit_info.value.code == 2
    assert "--names: 'SST-2' is given to sources 1 and 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["decompose", folders[0], os.path.join(folders[0], "..", "adapter"), "--out", str(tmp_path / "dec2")])
    assert "is given twice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["decompose", folders[0], folders[0], "--names", "a", "b", "--out", str(tmp_path / "dec2")])
    assert "is given twice" in capsys.readouterr().err
    assert not (tmp_path / "dec2").exists()


def test_default_source_names_are_distinct():
    from prompt_transfer.cli import default_source_names

    assert default_source_names(["/r/a", "/r/b"]) == ["a", "b"]  # unchanged when the folder names differ
    assert default_source_names(["/r/x/adapter", "/r/y/adapter", "/r/z"]) == ["x", "y", "z"]
    # Parent names that clash with another source's name: the whole distinguishing suffix.
    assert default_source_names(["/r/x/adapter", "/r/y/adapter", "/r/q/x"]) == ["x/adapter", "y/adapter", "x"]
    assert default_source_names(["/p/a/b", "/q/a/b"]) == ["p", "q"]
    assert default_source_names(["/a/b", "/x/a/b"]) == ["a", "x"]  # one path a suffix of the other
    with pytest.raises(ValueError, match="cannot be told apart"):
        default_source_names(["/r/a", "/r/a"])


def test_export_into_the_pct_adapter_folder_is_refused(tiny_model, tokenizer, tmp_path):
    model = _pct_model(tiny_model, tmp_path)
    pct = tmp_path / "pct"
    model.save_pretrained(str(pct))
    before = _snapshot(pct)
    with pytest.raises(ValueError, match="is the PCT adapter being exported"):
        pt.export_adapter_dir(str(pct), str(pct))
    with pytest.raises(ValueError, match="holds a PCT adapter"):
        pt.export_prompt_tuning(model, str(pct))
    assert main(["export", str(pct), str(pct) + "/"]) == 2  # another spelling of the same folder
    assert _snapshot(pct) == before and not (pct / "pct_state").exists()
    resumed = pt.load_pct_for_training(tiny_model("llama"), str(pct))  # still the PCT adapter
    torch.testing.assert_close(_logits(resumed, _batch(tokenizer)), _logits(model, _batch(tokenizer)))

    # Re-exporting from an export's own pct_state/ into that export would delete the source first.
    pt.export_adapter_dir(str(pct), str(tmp_path / "exp"))
    state = tmp_path / "exp" / "pct_state"
    kept = _snapshot(state)
    with pytest.raises(ValueError, match="is the PCT state kept in the export directory"):
        pt.export_adapter_dir(str(state), str(tmp_path / "exp"))
    assert _snapshot(state) == kept


def test_export_of_a_named_adapter_resumes(tiny_model, tokenizer, tmp_path):
    model = _pct_model(tiny_model, tmp_path, adapter_name="target")
    batch = _batch(tokenizer)
    pt.train_prompt(model, [batch], steps=2, lr=0.1)
    out = pt.export_prompt_tuning(model, str(tmp_path / "export"))
    state = tmp_path / "export" / "pct_state"
    assert (state / "adapter_config.json").is_file() and not (state / "target").exists()
    assert not [n for n in os.listdir(tmp_path / "export") if n.startswith(".")]  # no staging left behind
    resumed = pt.load_pct_for_training(tiny_model("llama"), out, adapter_name="target")
    torch.testing.assert_close(_logits(resumed, batch), _logits(model, batch), atol=1e-6, rtol=1e-6)

    # Exports written before kept a named adapter where PEFT saves it, pct_state/<name>/: still resumable.
    legacy = tmp_path / "legacy"
    pt.export_prompt_tuning(model, str(legacy), keep_pct_state=False)
    model.save_pretrained(str(legacy / "pct_state"), selected_adapters=["target"])
    assert (legacy / "pct_state" / "target" / "adapter_config.json").is_file()
    resumed = pt.load_pct_for_training(tiny_model("llama"), str(legacy), adapter_name="target")
    torch.testing.assert_close(_logits(resumed, batch), _logits(model, batch), atol=1e-6, rtol=1e-6)


def test_reexport_leaves_only_this_exports_state(tiny_model, tokenizer, tmp_path):
    model = _pct_model(tiny_model, tmp_path)
    batch = _batch(tokenizer)
    out = str(tmp_path / "exp")
    pt.export_prompt_tuning(model, out)  # untrained, with its state
    pt.train_prompt(model, [batch], steps=5, lr=0.1)
    live = _logits(model, batch)
    pt.export_prompt_tuning(model, out, keep_pct_state=False)  # trained, without state: the old one must go
    assert not (tmp_path / "exp" / "pct_state").exists()
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    plain = peft.PeftModel.from_pretrained(tiny_model("llama"), out)
    torch.testing.assert_close(_logits(plain, batch), live, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="keeps no PCT state to resume from"):
        pt.load_pct_for_training(tiny_model("llama"), out)

    # A file-to-file export over an earlier export with state replaces that state with this adapter's.
    pt.export_prompt_tuning(model, out)
    pct = tmp_path / "pct"
    pt.train_prompt(model, [batch], steps=2, lr=0.1)
    model.save_pretrained(str(pct))
    pt.export_adapter_dir(str(pct), out)
    assert _snapshot(tmp_path / "exp" / "pct_state") == _snapshot(pct)
    config = json.loads((tmp_path / "exp" / "pct_state" / "adapter_config.json").read_text())
    assert config["peft_type"] == "PCT"
    resumed = pt.load_pct_for_training(tiny_model("llama"), out)
    torch.testing.assert_close(_logits(resumed, batch), _logits(model, batch), atol=1e-6, rtol=1e-6)
