"""File writes of checkpoints and exports: the mode of atomically written files, and ``peftplug export`` to a place
it cannot write.

- ``peftplug.fileio.atomic_write`` left every file it wrote with ``mkstemp``'s private mode 0600 (an adapter written
  by ``oftv2`` interop, a steering or PCT config): unreadable to another user or a server, and a replaced file lost
  its mode.
- ``peftplug export --output`` under a file, in a read-only folder, or failing mid-write (a full disk) ended in a
  traceback after the model load; now one line (the first two before anything is loaded).
"""

from __future__ import annotations

import errno
import os

import lightning  # noqa: F401  (imported before capsys swaps stderr: Lightning's log handler binds to it)
import pytest
from tiny_recipes import one_step_lora_checkpoint

from peftplug.cli import main
from peftplug.fileio import atomic_directory, atomic_write, atomic_write_text


@pytest.fixture
def umask_022():
    before = os.umask(0o022)
    yield
    os.umask(before)


def test_a_new_file_gets_the_umask_mode_and_a_replaced_one_keeps_its_mode(tmp_path, umask_022):
    new = atomic_write_text(tmp_path / "new.json", "{}")
    assert new.stat().st_mode & 0o777 == 0o644
    kept = tmp_path / "kept.json"
    kept.write_text("old")
    os.chmod(kept, 0o640)
    atomic_write_text(kept, "new")
    assert kept.read_text() == "new" and kept.stat().st_mode & 0o777 == 0o640


def test_a_writer_that_raises_leaves_the_previous_file_and_no_temporary_one(tmp_path):
    path = tmp_path / "adapter_model.safetensors"
    path.write_bytes(b"previous")

    def half_then_crash(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic_write(path, half_then_crash)
    assert path.read_bytes() == b"previous" and [p.name for p in tmp_path.iterdir()] == [path.name]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(one_step_lora_checkpoint(tmp_path_factory.mktemp("export_target")))


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("peftplug: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


def test_export_under_a_file_is_one_line_and_writes_nothing(ckpt, tmp_path, capsys):
    (tmp_path / "notes").write_text("x")
    assert main(["export", "--ckpt_path", ckpt, "--output", str(tmp_path / "notes" / "adapter")]) == 2
    assert "is a file, not a folder (nothing was touched)" in _one_error_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes in a 0555 folder")
def test_export_into_a_read_only_folder_is_one_line(ckpt, tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, 0o555)
    try:
        assert main(["export", "--ckpt_path", ckpt, "--output", str(locked / "adapter")]) == 2
    finally:
        os.chmod(locked, 0o755)
    assert "not writable" in _one_error_line(capsys)
    assert not any(locked.iterdir())


def test_a_write_that_fails_midway_is_one_line_and_keeps_the_earlier_export(ckpt, tmp_path, capsys, monkeypatch):
    out = tmp_path / "adapter"
    assert main(["export", "--ckpt_path", ckpt, "--output", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    from transformers import PreTrainedTokenizerBase

    def disk_full(self, save_directory, *args, **kwargs):  # the tokenizer is written last, after the adapter
        with open(os.path.join(save_directory, "tokenizer.json"), "w") as f:
            f.write("{")  # half-written
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", disk_full)
    capsys.readouterr()
    assert main(["export", "--ckpt_path", ckpt, "--output", str(out), "--overwrite"]) == 2
    line = _one_error_line(capsys)
    assert "the export could not be written: No space left on device" in line and "unchanged" in line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]  # no staging folder left


def test_a_folder_made_by_another_process_meanwhile_is_not_replaced(tmp_path):
    target = tmp_path / "model"
    with pytest.raises(FileExistsError), atomic_directory(target) as staging:
        (staging / "mine.txt").write_text("mine")
        target.mkdir()  # another process (a DDP rank, a second conversion) finished first
        (target / "theirs.txt").write_text("theirs")
    assert sorted(p.name for p in target.iterdir()) == ["theirs.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no staging folder left


def test_an_exports_files_get_the_umask_mode(ckpt, tmp_path, umask_022):
    # safetensors writes adapter_model.safetensors 0600: a server or another user could not load the export.
    out = tmp_path / "adapter"
    assert main(["export", "--ckpt_path", ckpt, "--output", str(out)]) == 0
    paths = [out, *out.rglob("*")]
    assert any(p.name == "adapter_model.safetensors" for p in paths)
    wrong = {str(p): oct(p.stat().st_mode & 0o777) for p in paths
             if p.stat().st_mode & 0o777 != (0o755 if p.is_dir() else 0o644)}
    assert not wrong, wrong
