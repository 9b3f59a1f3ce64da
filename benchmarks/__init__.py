"""Benchmark studies, one sub-package each (see docs/benchmarks/README.md); shared helpers in :mod:`benchmarks.common`."""
