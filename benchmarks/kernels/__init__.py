"""Benchmarks of the fused Triton ops: GPU timings of the kernels and of a QOFT training step (:mod:`.gpu`, run by
benchmarks/gpu/run_all.sh) and the sm_90 compile check (:mod:`.compile_check`, page docs/benchmarks/kernels_sm90.md)."""
