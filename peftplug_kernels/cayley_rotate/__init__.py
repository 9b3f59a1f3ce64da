"""Cayley–Neumann rotation fused with the block rotation: the lean torch path of an OFTv2 layer."""
