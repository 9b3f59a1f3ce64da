"""HELENE on all-MiniLM-L6-v2 with a classification head: the fast tier (``python -m benchmarks.helene.minilm.bench``)."""
