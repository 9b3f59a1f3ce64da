"""Fused ops for orthogonal finetuning, each with a pure-torch reference.

One sub-package per op: ``reference.py`` (pure torch: the CPU path and the test oracle), ``triton.py`` (the
fused kernel) and ``function.py`` (autograd). This package is a leaf: it imports nothing else of peftplug.

The import name is ``peftplug_kernels``, not ``kernels``: the top-level ``kernels`` belongs to Hugging Face's
``kernels`` distribution (hub kernels, which transformers' ``use_kernels`` and bitsandbytes' CPU 4-bit GEMM
import). Two distributions installing the same top-level folder overwrite each other's files, so ours has a
name of its own (docs/kernels.md).
"""
