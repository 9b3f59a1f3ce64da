"""Second review: peftplug's load hint must survive a probe for PEFT before PEFT is imported (a fresh interpreter:
what was imported before is the point)."""

from __future__ import annotations


def test_load_hint_survives_a_find_spec_probe_before_peft_is_imported(run_fresh, tmp_path):
    """transformers' ``is_peft_available()`` (which ``from_pretrained`` calls) runs ``find_spec("peft")`` without
    importing it. The hook's finder left ``sys.meta_path`` at that probe and wrapped a spec nobody used, so the
    common script ``import peftplug`` -> load the base model -> ``import peft`` -> ``PeftModel.from_pretrained``
    got PEFT's bare ``KeyError: 'OFTV2'`` instead of the hint."""
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "OFTV2"}')
    out = run_fresh(f"""
        import sys

        import peftplug
        from peftplug.peft_import_hook import _AfterPeftImport
        from transformers.utils import is_peft_available

        print("PROBE", is_peft_available(), "peft" in sys.modules)
        import peft

        print("FINDER_LEFT", not any(isinstance(f, _AfterPeftImport) for f in sys.meta_path))
        try:
            peft.PeftConfig.from_pretrained({str(tmp_path)!r})
        except Exception as err:
            print("RAISED", type(err).__name__, str(err).split(",")[0])
    """, bare=True).stdout
    assert "PROBE True False" in out, out
    assert "FINDER_LEFT True" in out, out
    assert "RAISED UnregisteredAdapterError This adapter has peft_type 'OFTV2'" in out, out
