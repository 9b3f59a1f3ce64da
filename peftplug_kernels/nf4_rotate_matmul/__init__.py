"""y = (x R) deq(W)^T with the rotation in the GEMM prologue and NF4/FP4 dequantized on the fly."""
