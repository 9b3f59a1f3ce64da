"""Dequantization of a bitsandbytes 4-bit (NF4/FP4) weight: the fused backward's and the unfused path's W."""
