"""``peftplug export`` (plain and ``--merge``) writes its folder through ``peftplug.fileio.atomic_directory``: the
folder has the umask's mode (not ``mkdtemp``'s 0700), and an ``--overwrite`` that fails at the last rename leaves
the previous export in place, complete."""

from __future__ import annotations

import os

import lightning  # noqa: F401  (imported before capsys swaps stderr: Lightning's log handler binds to it)
import pytest
from tiny_recipes import causal_recipe

from peftplug.checkpoints import load_checkpoint_module
from peftplug.cli import main


@pytest.fixture(scope="module")
def module(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export_atomic")
    rows = [{"prompt": f"Q{i}", "response": f" {i}"} for i in range(8)]
    recipe = causal_recipe(tmp, rows, peft={"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"]},
                           optimizer=None, trainer={"max_steps": 1, "limit_val_batches": 0}, data={"batch_size": 4})
    assert main(["fit", "--config", str(recipe)]) == 0
    (ckpt,) = (tmp / "runs").rglob("*.ckpt")
    return load_checkpoint_module(str(ckpt))


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
