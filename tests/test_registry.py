"""peftplug.registry with a minimal real tuner (tests/minimal_tuner.py): PEFT's whole user API must work."""

from __future__ import annotations

import json

import pytest
import torch
from minimal_tuner import NAME, MinScaleConfig, MinScaleModel, register
from peft import get_peft_model
from peft.utils import PeftType

from peftplug.registry import PLUGIN_PACKAGES, UnregisteredAdapterError, add_peft_type, register_method

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randint(4, 90, (2, 12), generator=g)


def _config(std=0.2, **kw):
    return MinScaleConfig(target_modules=TARGETS, init_std=std, task_type="CAUSAL_LM", **kw)


def test_registration_is_idempotent_and_guarded():
    member = register()
    assert register() is member is PeftType[NAME.upper()]
    assert add_peft_type(NAME.upper()) is member
    assert PeftType(NAME.upper()) is member and member in list(PeftType)

    class OtherConfig(MinScaleConfig):
        pass

    with pytest.raises(KeyError, match="already registered"):
        register_method(NAME, OtherConfig, MinScaleModel, prefix=MinScaleModel.prefix)
    with pytest.raises(ValueError, match="lower case"):
        register_method("MinScale", MinScaleConfig, MinScaleModel)
    with pytest.raises(ValueError, match="upper-case identifier"):
        add_peft_type("not valid")


def test_adapter_math_several_adapters_disable_merge(tiny_model):
    base = tiny_model("llama")
    x = _inputs()
    with torch.no_grad():
        base_logits = base(x).logits.clone()
    torch.manual_seed(1)
    model = get_peft_model(base, _config(), adapter_name="one")
    model.add_adapter("two", _config(std=0.5))
    assert {n.split(".")[-1] for n, p in model.named_parameters() if p.requires_grad} == {"one"}
    model.eval()
    with torch.no_grad():
        out_a = model(x).logits
        model.set_adapter("two")
        out_b = model(x).logits
        with model.disable_adapter():
            out_off = model(x).logits
        model.set_adapter("one")
        again_a = model(x).logits
    assert torch.equal(out_off, base_logits)
    assert not torch.allclose(out_a, base_logits, atol=1e-3)
    assert not torch.allclose(out_a, out_b, atol=1e-3)
    assert torch.equal(again_a, out_a)

    # The layer really computes base(x) * s: check one wrapped projection against its definition.
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    h = torch.randn(3, layer.in_features)
    expected = layer.base_layer(h) * layer.minscale_s["one"]
    torch.testing.assert_close(layer(h), expected)

    merged = model.merge_and_unload()
    assert not any("minscale" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(x).logits, out_a, atol=1e-5, rtol=1e-5)


def test_delete_adapter_and_trainable_count(tiny_model):
    model = get_peft_model(tiny_model("llama"), _config(), adapter_name="one")
    model.add_adapter("two", _config())
    model.delete_adapter("two")
    layer = model.base_model.model.model.layers[1].mlp.down_proj
    assert list(layer.minscale_s) == ["one"]
    trainable, _ = model.get_nb_trainable_parameters()
    # Per layer: q_proj 64 outputs, v_proj 32 (2 kv heads x 16), down_proj 64; two layers.
    assert trainable == 2 * (64 + 32 + 64)


def test_save_and_load_in_fresh_process(tmp_path, tiny_model, run_fresh):
    """save_pretrained -> PeftModel / AutoPeftModelForCausalLM.from_pretrained in a new interpreter: same logits.

    The same fresh process first checks the error users get when loading an adapter whose plugin package was
    not imported (peft_type OFTV2 without `import oftv2`), which needs a process where oftv2 was never imported.
    """
    from transformers import AutoModelForCausalLM

    tiny_model("llama").save_pretrained(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    torch.manual_seed(3)
    model = get_peft_model(base, _config(), adapter_name="default")
    model.add_adapter("second", _config(std=0.4))
    model.eval()
    x = _inputs()
    with torch.no_grad():
        reference = model(x).logits
        model.set_adapter("second")
        reference_second = model(x).logits
        model.set_adapter("default")
    model.save_pretrained(tmp_path / "adapter")
    torch.save({"x": x, "logits": reference, "second": reference_second}, tmp_path / "ref.pt")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["peft_type"] == NAME.upper()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "adapter" / "second" / "adapter_config.json").is_file()

    foreign = tmp_path / "oftv2_adapter"
    foreign.mkdir()
    (foreign / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "OFTV2", "base_model_name_or_path": str(tmp_path / "base"), "task_type": "CAUSAL_LM"}))

    proc = run_fresh(f"""
        import sys
        sys.path.insert(0, "tests")
        import torch
        import peftplug
        from peft import AutoPeftModelForCausalLM, PeftModel
        from transformers import AutoModelForCausalLM
        from peftplug.registry import UnregisteredAdapterError

        assert "oftv2" not in sys.modules
        for load in (lambda: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({str(tmp_path / 'base')!r}),
                                                       {str(foreign)!r}),
                     lambda: AutoPeftModelForCausalLM.from_pretrained({str(foreign)!r})):
            try:
                load()
            except UnregisteredAdapterError as err:
                print("HINT:", err)
            else:
                raise SystemExit("loading an OFTV2 adapter without oftv2 did not fail")

        import minimal_tuner  # registers the tuner, as `import oftv2` would
        ref = torch.load({str(tmp_path / 'ref.pt')!r})
        base = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'base')!r})
        model = PeftModel.from_pretrained(base, {str(tmp_path / 'adapter')!r}).eval()
        model.load_adapter({str(tmp_path / 'adapter' / 'second')!r}, adapter_name="second")
        auto = AutoPeftModelForCausalLM.from_pretrained({str(tmp_path / 'adapter')!r}).eval()
        with torch.no_grad():
            a = model(ref["x"]).logits
            b = auto(ref["x"]).logits
            model.set_adapter("second")
            c = model(ref["x"]).logits
        print("PEFT_EQUAL", torch.equal(a, ref["logits"]))
        print("AUTO_EQUAL", torch.equal(b, ref["logits"]))
        print("SECOND_EQUAL", torch.equal(c, ref["second"]))
    """)
    out = proc.stdout
    hints = [line for line in out.splitlines() if line.startswith("HINT:")]
    assert len(hints) == 2, out
    for hint in hints:
        assert "'OFTV2'" in hint and "import oftv2" in hint, hint
    assert "PEFT_EQUAL True" in out and "AUTO_EQUAL True" in out and "SECOND_EQUAL True" in out, out


def test_unknown_type_message_in_process(tmp_path):
    """A peft_type no plugin provides gets a message that says so (checked through PeftConfig loading)."""
    from peft import PeftConfig

    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "NOPE_NOT_A_METHOD"}))
    with pytest.raises(UnregisteredAdapterError, match="neither PEFT .* nor peftplug knows"):
        PeftConfig.from_pretrained(str(tmp_path))
    assert PLUGIN_PACKAGES["OFTV2"] == "oftv2"


def test_the_one_method_list_matches_what_each_package_registers():
    """Every PEFT type peftplug.registry attributes to a package is registered by importing that package, with a
    config class from it; the CLI's and the checkpoint loader's list is the same object."""
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    import peftplug.cli
    from peftplug.methods import import_method_packages
    from peftplug.registry import METHOD_PACKAGES

    assert peftplug.cli.METHOD_PACKAGES is METHOD_PACKAGES
    assert import_method_packages() == list(METHOD_PACKAGES)
    known = {getattr(k, "value", k): v for k, v in PEFT_TYPE_TO_CONFIG_MAPPING.items()}
    for package, types in METHOD_PACKAGES.items():
        for peft_type in types:
            assert PLUGIN_PACKAGES[peft_type] == package
            assert known[peft_type].__module__.split(".")[0] == package, (peft_type, known[peft_type])
    assert set(PLUGIN_PACKAGES) == {t for types in METHOD_PACKAGES.values() for t in types}


def test_an_older_peft_is_refused_in_one_line():
    from peftplug.registry import SUPPORTED_PEFT, check_peft_version

    check_peft_version(str(SUPPORTED_PEFT[0]))
    check_peft_version("0.21.2")
    check_peft_version("0.22.1")  # newer: tried, a failure later names the version
    check_peft_version("0.21.0rc1")  # a pre-release of the supported minor is let through
    for old in ("0.20.0", "0.16.0"):
        with pytest.raises(ImportError, match=rf"needs PEFT >=0.21.0,<0.22.0; PEFT {old} is installed"):
            check_peft_version(old)
