"""Checkpoints of sharded runs that peftplug cannot read are named as such.

Under Lightning's ``ModelParallelStrategy`` (FSDP2) the default ``save_distributed_checkpoint: true`` writes every
checkpoint as a ``torch.distributed.checkpoint`` folder named ``*.ckpt`` (``.metadata``, one ``__<rank>_0.distcp``
per rank, ``meta.pt``), which ``peftplug fit --ckpt_path``, ``export`` and ``generate`` do not read. ``--ckpt_path
last`` used to answer "found no checkpoint" next to such a folder (or silently resume an older file); it now names
the folder and the setting to change, in one line. The layout below is the one a real 2-process run wrote.
"""

from __future__ import annotations

import os

import pytest

from peftplug.errors import ConfigError
from peftplug.resume import find_last_checkpoint


def _distributed_checkpoint(folder):
    folder.mkdir(parents=True)
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"):
        (folder / name).write_bytes(b"x")
    return folder


def test_last_names_a_distributed_checkpoint_folder_instead_of_finding_nothing(tmp_path):
    _distributed_checkpoint(tmp_path / "checkpoints" / "epoch=0-step=2.ckpt")
    with pytest.raises(ConfigError) as err:
        find_last_checkpoint(tmp_path)
    message = str(err.value)
    assert "\n" not in message
    assert "epoch=0-step=2.ckpt" in message and "save_distributed_checkpoint: false" in message


def test_last_does_not_skip_a_newer_distributed_folder_for_an_older_file(tmp_path):
    old = tmp_path / "version_0" / "last.ckpt"
    old.parent.mkdir()
    old.write_bytes(b"x")
    os.utime(old, ns=(1_000_000_000, 1_000_000_000))
    _distributed_checkpoint(tmp_path / "version_1" / "last.ckpt")
    with pytest.raises(ConfigError, match="distributed checkpoint folder"):
        find_last_checkpoint(tmp_path)


def test_last_takes_a_file_newer_than_a_distributed_folder(tmp_path):
    folder = _distributed_checkpoint(tmp_path / "version_0" / "last.ckpt")
    os.utime(folder, ns=(1_000_000_000, 1_000_000_000))
    new = tmp_path / "version_1" / "last.ckpt"
    new.parent.mkdir()
    new.write_bytes(b"x")
    assert find_last_checkpoint(tmp_path) == new
