"""CPU measurements behind the kernel dispatch design: dispatcher overhead per call, batched Cayley–Neumann."""
