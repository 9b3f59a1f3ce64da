"""Compiles one Triton kernel for Hopper (sm_90) without a GPU: what ``compile_check`` and ``ptx_check`` share.

Triton's bundled ``ptxas`` needs no device. The argument types and divisibility hints mirror what Triton's JIT gives
a real launch at LLM shapes, so the compiled code (vector loads included) matches what the GPU would run.
"""

from __future__ import annotations

INT_ARGS = ("T", "N", "K", "B", "R", "n", "n_tiles", "n_tiles_n", "k_per_split", "n_per_split", "tokens_per_chunk")
# Arguments Triton's JIT marks divisible by 16 at a real launch (16-byte aligned tensors, widths and strides that
# are multiples of 16 at LLM shapes): marking them here makes the compiled code match, vector loads included.
DIVISIBLE = ("K", "N", "k_per_split", "n_per_split", "tokens_per_chunk")


def attributes(kernel, const: dict) -> dict:
    """``tt.divisibility`` hints as Triton's JIT gives them at a real launch (pointers, strides, :data:`DIVISIBLE`).

    Args:
        kernel: The ``@triton.jit`` function.
        const: Its constexpr arguments (not hinted).
    """
    return {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
            if name not in const and (name.endswith("_ptr") or name.startswith("stride") or name in DIVISIBLE)}


def compile_sm90(kernel, types: dict, const: dict, options: dict):
    """Compiles one configuration for sm_90 (no GPU needed) and returns Triton's compiled kernel.

    Args:
        kernel: The ``@triton.jit`` function.
        types: Pointer/scalar types by argument name.
        const: Constexpr arguments.
        options: ``num_warps``, ``num_stages``, ...
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(kernel, _signature(kernel, types, const), constexprs=const, attrs=attributes(kernel, const))
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def _signature(kernel, types: dict, const: dict) -> dict:
    sig = {}
    for name in kernel.arg_names:
        if name in const:
            sig[name] = "constexpr"
        elif name in types:
            sig[name] = types[name]
        elif name in INT_ARGS or name.startswith("stride"):
            sig[name] = "i32"
        else:
            raise KeyError(f"{kernel.__name__}: no type for argument {name!r}")
    return sig
