"""Built models (``tiny:*``, ``stories260k``) go into the cache, one folder per content, reused by every process:
a process that uses one leaves no ``/tmp/peftplug-*`` folder behind."""

from __future__ import annotations

import os

SCRIPT = """
import os
os.environ.update(TMPDIR={tmp!r}, PEFTPLUG_CACHE={cache!r})
from peftplug.loading import resolve_model_path
print(resolve_model_path('tiny:llama')); print(resolve_model_path('tiny:bert'))
"""


def test_processes_reuse_one_folder_and_leave_no_temporary_one(tmp_path, run_fresh):
    tmp, cache = tmp_path / "tmp", tmp_path / "cache"
    tmp.mkdir()
    first, second = (run_fresh(SCRIPT.format(tmp=str(tmp), cache=str(cache))).stdout.split() for _ in range(2))
    assert first == second and len(set(first)) == 2
    assert all(path.startswith(str(cache / "built")) for path in first)
    assert list(tmp.iterdir()) == []
    assert sorted(p.name for p in (cache / "built").iterdir()) == sorted(os.path.basename(p) for p in first)
    # The folders have the mode of any new folder under the umask, not mkdtemp's 0700: a cache may be shared.
    umask = os.umask(0)
    os.umask(umask)
    assert all(os.stat(p).st_mode & 0o777 == 0o777 & ~umask for p in first)
    # And their files that of any new file (safetensors writes model.safetensors 0600).
    files = [f for p in first for f in sorted(os.scandir(p), key=lambda e: e.name) if f.is_file()]
    assert files and all(os.stat(f.path).st_mode & 0o777 == 0o666 & ~umask for f in files), \
        {f.name: oct(os.stat(f.path).st_mode & 0o777) for f in files}
