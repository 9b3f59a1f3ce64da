"""``import peftplug`` does not import PEFT, yet its load hint is in place once PEFT is imported (in one fresh
interpreter: what an import pulls in is the point)."""

from __future__ import annotations


def test_load_hint_installs_when_peft_is_first_imported_after_peftplug(run_fresh, tmp_path):
    config = tmp_path / "adapter_config.json"
    config.write_text('{"peft_type": "NOPE_NOT_A_METHOD"}')
    out = run_fresh(f"""
        import sys
        import warnings

        import peftplug
        from peftplug.peft_import_hook import after_peft_import

        print("PEFT_AFTER_PEFTPLUG", "peft" in sys.modules, "transformers" in sys.modules)
        calls = []
        after_peft_import(lambda: calls.append("second"))  # beside peftplug's own
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import peft
        print("PEFT_IMPORTED", "peft" in sys.modules, calls)
        print("WARNINGS", [str(w.message) for w in caught if "load hint" in str(w.message)])

        from peftplug.registry import UnregisteredAdapterError
        try:
            peft.PeftConfig.from_pretrained({str(tmp_path)!r})
        except UnregisteredAdapterError as err:
            print("HINT", "peftplug knows" in str(err))

        # A callback that fails once PEFT is imported warns; the import itself succeeds.
        for name in [m for m in sys.modules if m == "peft" or m.startswith("peft.")]:
            del sys.modules[name]
        after_peft_import(lambda: 1 / 0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import peft  # noqa: F811
        print("FAILING_CALLBACK", "peft" in sys.modules, [str(w.message) for w in caught if "load hint" in str(w.message)])
    """, bare=True).stdout
    assert "PEFT_AFTER_PEFTPLUG False False" in out, out
    assert "PEFT_IMPORTED True ['second']" in out, out
    assert "WARNINGS []" in out, out
    assert "HINT True" in out, out
    assert "FAILING_CALLBACK True ['peftplug could not install its PEFT load hint: ZeroDivisionError: division by zero']" in out, out


def test_registry_imported_first_installs_the_hint_without_a_warning(run_fresh):
    """``import oftv2`` (any method package) imports ``peftplug.registry`` first, which imports PEFT while itself
    half-initialised: the hook must leave the hint to the registry instead of importing from it."""
    out = run_fresh("""
        import warnings

        warnings.simplefilter("error")
        import peftplug.registry
        from peft.config import PeftConfigMixin

        print("INSTALLED", PeftConfigMixin._peftplug_hint_installed)
    """, bare=True).stdout
    assert "INSTALLED True" in out, out
