"""Third review of checkpoint files: damaged pickles and a disk that fills up during ``peftplug fit``.

- A checkpoint (or ``adapter_model.bin``) whose ``data.pkl`` is damaged can make torch's weights-only unpickler
  raise ``KeyError`` or ``TypeError``, which ``read_checkpoint`` / ``check_adapter_dir`` let through: a traceback
  ending in ``KeyError: 9`` instead of the one line that names the file.
- A checkpoint write that fails (a full disk; here a real file-size limit, ``RLIMIT_FSIZE``, which makes the write
  fail with ``EFBIG`` as a full disk fails with ``ENOSPC``) was an ``OSError`` traceback from inside Lightning; now
  one line saying the previous checkpoint is unchanged, and no temporary file is left.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import pytest
import torch

from peftplug.checkpoints import check_adapter_dir, read_checkpoint
from peftplug.errors import CheckpointError

REPO_ROOT = Path(__file__).resolve().parents[1]

# A pickle that reads memo entry 9 of an empty memo: what a flipped byte in data.pkl can turn an opcode into.
DAMAGED_PICKLE = b"\x80\x02}q\x00h\x09."


def _damaged_torch_file(path, obj) -> None:
    """Saves ``obj`` with torch.save, then replaces the archive's data.pkl with :data:`DAMAGED_PICKLE`."""
    whole = path.with_suffix(".whole")
    torch.save(obj, whole)
    with zipfile.ZipFile(whole) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as dst:
        for name in src.namelist():
            dst.writestr(name, DAMAGED_PICKLE if name.endswith("data.pkl") else src.read(name))
    whole.unlink()


def test_the_damaged_pickle_is_what_torch_fails_on_with_a_key_error(tmp_path):
    """The test file is valid as a zip and damaged as a pickle: torch's own error is a KeyError."""
    path = tmp_path / "last.ckpt"
    _damaged_torch_file(path, {"state_dict": {}})
    with pytest.raises(KeyError):
        torch.load(path, weights_only=True)


def test_a_checkpoint_with_a_damaged_pickle_is_one_line(tmp_path, capsys):
    path = tmp_path / "last.ckpt"
    _damaged_torch_file(path, {"state_dict": {"w": torch.ones(2)}})
    with pytest.raises(CheckpointError, match=r"is damaged \(its pickled data cannot be read: KeyError 9\)"):
        read_checkpoint(path)
    from peftplug.cli import main

    capsys.readouterr()
    assert main(["export", "--ckpt_path", str(path), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("peftplug: error: checkpoint") and "damaged" in err[0], err


def test_an_adapter_bin_with_a_damaged_pickle_is_one_line(tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    _damaged_torch_file(folder / "adapter_model.bin", {"w": torch.ones(2)})
    with pytest.raises(CheckpointError, match="adapter_model.bin' is truncated or damaged"):
        check_adapter_dir(folder)


# The file-size limit is only ever lowered in a child process: lowered in pytest's own process, it also caps pytest's
# report (stdout redirected to a file larger than the limit, as in CI) and pytest dies with "File too large".
_FULL_DISK_FIT = r"""
import resource, sys
import lightning
sys.path.insert(0, "tests")
from tiny_recipes import causal_recipe
from peftplug.cli import cli
from peftplug.errors import run_command


class FileSizeLimitAfterStep(lightning.Callback):
    # From training step `step` (after the checkpoint of the step before) on, files may not grow past `limit`
    # bytes: the next checkpoint write fails as on a full disk (Python ignores SIGXFSZ, so the write raises).
    def __init__(self, step, limit):
        self.step, self.limit = step, limit

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


root = sys.argv[1]
rows = [{"prompt": f"Q{i}", "response": f" {i}"} for i in range(8)]
recipe = causal_recipe(__import__("pathlib").Path(root), rows,
                       peft={"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"]},
                       trainer={"max_steps": 3, "limit_val_batches": 0}, data={"batch_size": 2})
periodic = ('--trainer.callbacks=[{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", '
            '"init_args": {"every_n_train_steps": 1, "save_last": true}}]')
status = run_command("peftplug", lambda argv: cli(argv, trainer_defaults={
    "callbacks": [FileSizeLimitAfterStep(step=1, limit=4096)]}) and 0, ["fit", "--config", str(recipe), periodic])
sys.exit(status)
"""


def test_a_full_disk_during_a_fit_checkpoint_is_one_line_and_keeps_the_previous_one(tmp_path, zygote):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = zygote().run(_FULL_DISK_FIT, [str(tmp_path)], env, REPO_ROOT, timeout=300)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2, err[-20:]
    assert err[-1].startswith("peftplug: error: cannot write checkpoint ") and "File too large" in err[-1], err[-5:]
    assert not any(line.startswith("Traceback") for line in err)
    # The checkpoints of step 1 are whole and the failed write left no temporary file.
    folder = tmp_path / "runs" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=1.ckpt", "last.ckpt"]
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 1


_LIMITED_WRITE = r"""
import errno, resource, sys, torch
from peftplug.checkpoint_io import AtomicCheckpointIO, CheckpointWriteError
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    AtomicCheckpointIO().save_checkpoint({"w": torch.arange(10_000, dtype=torch.float32)}, sys.argv[1])
except CheckpointWriteError as error:
    assert isinstance(error, OSError) and error.errno == errno.EFBIG, repr(error)
    print(error)
    sys.exit(0)
sys.exit("no CheckpointWriteError")
"""


def test_the_write_error_is_an_os_error_with_its_errno(tmp_path, zygote):
    """For code that catches OSError around a plain Trainer with AtomicCheckpointIO."""
    from peftplug.checkpoint_io import AtomicCheckpointIO

    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"w": torch.ones(3)}, path)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = zygote().run(_LIMITED_WRITE, [str(path)], env, REPO_ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "the previous checkpoint there is unchanged" in done.stdout, done.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(3))

