"""Reads the PTX of the fused W4A16 NF4 forward compiled for sm_90 (no GPU needed) and checks its main loop.

Two claims of the design (docs/kernels.md, "The NF4 forward from its FLOP/byte table") are visible in the PTX:

1. **Both dots of the main loop run on tensor cores**: the rotation of the x tile (tf32) and the main product
   (bf16/fp16) are ``mma.sync`` or ``wgmma.mma_async`` instructions inside the loop.
2. **No global load sits in the per-element NF4 decode**: the code table is loaded once, before the loop. A
   per-element lookup (the first kernel's ``code[nibble]`` gather) compiles to scalar reads of global memory
   in the loop: 4-byte ``cp.async`` copies or ``ld.global``, one per decoded element. The check counts the
   loop's scalar global reads (``ld.global`` and ``cp.async`` of ≤ 4 bytes) at K steps of 64 and 128. It wants
   fewer than a quarter of the weight elements each thread decodes, where a per-element gather gives at least
   one each. As a control it runs the same count on a decode that gathers per element (``gather_control.py``,
   what the first, retired fused kernel did), which must fail it.
   What remains in the new kernel are per-row scale reads; packed weights, x and R arrive as 8–16-byte
   ``cp.async`` vectors.

    python -m benchmarks.kernels.ptx_check        # prints the findings; exit 1 if a claim fails

:func:`findings` is also called by ``compile_check --out``, which records it on the sm_90 page.
"""

from __future__ import annotations

import re
import sys
from collections import Counter


def _loop(ptx: str) -> str:
    """The body of the kernel's main loop (from LLVM's loop-header comment to the loop's exit block)."""
    start = ptx.find("Inner Loop Header")
    end = ptx.find("._crit_edge", start)
    if start < 0 or end < 0:
        raise RuntimeError("no loop found in the PTX")
    return ptx[start:end]


def loop_profile(ptx: str) -> dict:
    """Counts in the main loop: tensor-core instruction kinds, ``ld.global``, ``cp.async`` and ``selp``.

    Args:
        ptx: PTX text of one compiled kernel.
    """
    body = _loop(ptx)
    return {
        "tensor_core": sorted(Counter(re.findall(r"(?:wgmma\.mma_async\.sync|mma\.sync)\.aligned\.\S+", body))),
        "ld_global": len(re.findall(r"\bld\.global", body)),
        "scalar_reads": len(re.findall(r"\bld\.global(?![\w.:]*\.v[24]\.)", body)) + len(re.findall(
            r"cp\.async\.c[ag]\.shared\.global(?:\.\w+)*\s*\[[^\]]*\],\s*\[[^\]]*\],\s*0x[1-4]\b", body)),
        "cp_async": len(re.findall(r"\bcp\.async\.c[ag]", body)),
        "selects": len(re.findall(r"\bselp\.", body)),
    }


def _control_profile(dtype: str) -> dict:
    """Loop profile of the control (``gather_control.py``: ``code[nibble]`` gathered per element), 16 × 64 tiles,
    K step 32 (what the first fused kernel ran at b = 32)."""
    from benchmarks.kernels.gather_control import gather_decode_kernel
    from benchmarks.kernels.sm90_compile import compile_sm90

    types = {"x_ptr": f"*{dtype}", "w_ptr": "*u8", "code_ptr": "*fp32", "y_ptr": f"*{dtype}"}
    const = {"BLOCK_T": 16, "BLOCK_N": 64, "BLOCK_K": 32}
    compiled = compile_sm90(gather_decode_kernel, types, const, {"num_warps": 4, "num_stages": 4})
    return loop_profile(compiled.asm["ptx"])


def findings(dtype: str = "bf16") -> dict:
    """Compiles the default decode tiles at K steps of 64 and 128 and the GEMM tiles; checks both claims.

    Args:
        dtype: Activation dtype (``"bf16"`` or ``"fp16"``).

    Returns:
        ``{"profiles": {label: counts}, "claims": {claim: (ok, why)}}``.
    """
    from benchmarks.kernels.sm90_compile import compile_sm90
    from peftplug_kernels.nf4_rotate_matmul import w4a16

    types = {"x_ptr": f"*{dtype}", "r_ptr": "*fp32", "w_ptr": "*u8", "absmax_ptr": "*u8", "code_ptr": "*fp32",
             "absmax2_ptr": "*fp32", "code2_ptr": "*fp32", "offset": "fp32", "bias_ptr": f"*{dtype}",
             "y_ptr": f"*{dtype}"}
    profiles = {}
    variants = (("decode K step 64", (16, 64, 64), 4, 3), ("decode K step 128", (16, 64, 128), 4, 3),
                ("gemm 128×128×64", (128, 128, 64), 8, 3))
    for label, tiles, warps, stages in variants:
        block_t, block_n, block_k = tiles
        const = {"QBLOCK": 128, "QBLOCK2": 256, "NESTED": True, "ROTATE": True, "RB": 32, "HAS_BIAS": True,
                 "SPLIT_K": 1, "FP32_DOT": False, "BLOCK_T": block_t, "BLOCK_N": block_n, "BLOCK_K": block_k,
                 "GROUP_T": 8}
        compiled = compile_sm90(w4a16._forward_kernel, types, const, {"num_warps": warps, "num_stages": stages})
        profiles[label] = loop_profile(compiled.asm["ptx"])
    half = "bf16" if dtype == "bf16" else "f16"
    claims = {}
    for label, prof in profiles.items():
        kinds = " ".join(prof["tensor_core"])
        ok = "tf32" in kinds and half in kinds
        claims[f"{label}: both dots on tensor cores"] = (ok, kinds or "no tensor-core instruction in the loop")
    threads = 4 * 32
    checks = []
    for label, block_k in (("decode K step 64", 64), ("decode K step 128", 128)):
        prof, per_thread = profiles[label], 64 * block_k // threads
        checks.append((4 * prof["scalar_reads"] < per_thread,
                       f"{label}: {prof['scalar_reads']} scalar global reads per K step for {per_thread} elements"))
    claims["no global load in the per-element decode"] = (all(ok for ok, _ in checks), "; ".join(w for _, w in checks))
    control = _control_profile(dtype)
    per_thread = 32 * 64 // threads
    claims["control: a per-element code-table gather fails the same count"] = (
        4 * control["scalar_reads"] >= per_thread,
        f"{control['scalar_reads']} scalar global reads per K step for {per_thread} elements")
    profiles["gather decode (control) 16×64, K step 32"] = control
    return {"profiles": profiles, "claims": claims}


def main() -> int:
    """Prints the loop profiles and the two claims; exit 1 if one fails."""
    result = findings()
    for label, prof in result["profiles"].items():
        print(f"{label}: {prof}")
    failed = 0
    for claim, (ok, why) in result["claims"].items():
        print(f"{'ok  ' if ok else 'FAIL'} {claim}: {why}")
        failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
