"""``python -m benchmarks.helene.smollm2 COMMAND``: see :mod:`benchmarks.helene.smollm2.cli`."""

from benchmarks.helene.smollm2.cli import main

main()
