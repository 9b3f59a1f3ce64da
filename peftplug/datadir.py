"""Where the real evaluation data lives: the one default every script, recipe and CLI uses.

A leaf module (it imports nothing else of peftplug), so method packages and benchmarks may use it. The data are
LM-BFF's k-shot splits, GLUE/SuperGLUE test files, the steering datasets and the stories260K model, kept beside a
checkout of this repository in ``../shared/data`` (never committed here). ``PEFTPLUG_DATA_DIR`` overrides it.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Environment variable naming the data folder; it wins over every default.
DATA_DIR_ENV = "PEFTPLUG_DATA_DIR"
#: The repository checkout this module belongs to (meaningful for editable installs and ``python -m`` runs).
REPO_ROOT = Path(__file__).resolve().parents[1]


def default_data_dir() -> Path:
    """The data folder: ``$PEFTPLUG_DATA_DIR`` if set, else ``shared/data`` beside the repository checkout.

    Returns:
        The folder's path (not checked for existence: callers say what is missing, and where to get it).
    """
    override = os.environ.get(DATA_DIR_ENV)
    if override:
        return Path(override).expanduser()
    return REPO_ROOT.parent / "shared" / "data"
