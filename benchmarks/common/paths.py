"""Where things are: the repository, the benchmark pages, a study's committed results, scratch and the data.

Every benchmark builds its paths from here, so that the shared-data default (``PEFTPLUG_DATA_DIR`` honoured, see
:func:`peftplug.datadir.default_data_dir`) and the results convention are written once.
"""

from __future__ import annotations

from pathlib import Path

from peftplug.datadir import default_data_dir

#: The repository root (``benchmarks/`` is run from a checkout: ``python -m benchmarks.<study>.<script>``).
REPO = Path(__file__).resolve().parents[2]
#: The generated pages, one per benchmark (``docs/benchmarks/<page>.md``).
DOCS = REPO / "docs" / "benchmarks"
#: Git-ignored scratch: Lightning logs, checkpoints, caches too large to commit.
SCRATCH = REPO / "runs"


def results_dir(study: str) -> Path:
    """The committed raw results of one study: ``benchmarks/<study>/results/`` (the ONE results convention).

    Args:
        study: The study's package name under ``benchmarks/`` (``oftv2``, ``helene``, ...).
    """
    return REPO / "benchmarks" / study / "results"


def data_dir() -> Path:
    """The shared evaluation data (``$PEFTPLUG_DATA_DIR``, else ``../shared/data`` beside the checkout).

    Read at call time, not import time, so that a test or a shell that sets the variable is honoured.
    """
    return default_data_dir()
