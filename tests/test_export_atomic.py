"""``peftplug export`` (plain and ``--merge``) writes its folder through ``peftplug.fileio.atomic_directory``: the
folder has the umask's mode (not ``mkdtemp``'s 0700), and an ``--overwrite`` that fails at the last rename leaves
the previous export in place, complete."""

from __future__ import annotations

import os

import lightning  # noqa: F401  (imported before capsys swaps stderr: Lightning's log handler binds to it)
import pytest
from tiny_recipes import one_step_lora_checkpoint

from peftplug.checkpoints import load_checkpoint_module


@pytest.fixture(scope="module")
def module(tmp_path_factory):
    return load_checkpoint_module(str(one_step_lora_checkpoint(tmp_path_factory.mktemp("export_atomic"))))


@pytest.mark.parametrize("merge", [False, True])
def test_export_folder_has_the_umask_mode(module, tmp_path, merge):
    umask = os.umask(0o022)
    try:
        out = module.export(tmp_path / "out", merge=merge)
    finally:
        os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o755


def test_a_failed_overwrite_keeps_the_previous_export(module, tmp_path, monkeypatch):
    out = module.export(tmp_path / "out")
    before = sorted(p.name for p in out.iterdir())
    real = os.replace

    def fail_the_rename_in(src, dst):
        if ".old" not in str(src) and ".old" not in str(dst):
            raise OSError("simulated crash at the rename")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", fail_the_rename_in)
    with pytest.raises(OSError, match="simulated crash"):
        module.export(out, merge=True, overwrite=True)
    monkeypatch.setattr(os, "replace", real)
    assert sorted(p.name for p in out.iterdir()) == before and (out / "adapter_config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging or set-aside folder left
