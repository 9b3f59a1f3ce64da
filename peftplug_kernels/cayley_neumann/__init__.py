"""Skew-symmetric triangle vector -> orthogonal (or near-orthogonal) rotation blocks."""
