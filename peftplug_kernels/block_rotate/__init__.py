"""Block-diagonal rotation of the last dimension of an input: x' = x R, block by block."""
