"""Compiles every launch configuration of the Triton kernels for Hopper (sm_90) on a machine without a GPU.

Triton's bundled ``ptxas`` needs no device, so this catches what the CPU interpreter cannot: shared memory over
the 227 KB an H100/H200 block may use, register spills (per-thread stack bytes > 0), configurations that take minutes to
compile. It prints one row per configuration (shared KB, registers, spilled stack bytes, compile seconds) and exits 1
if any configuration fails or exceeds shared memory.

    python -m benchmarks.kernels.compile_check [--out docs/benchmarks/kernels_sm90.md]   # compile, print (, write)
    python -m benchmarks.kernels.compile_check --report                                  # page from the results

With ``--out`` the rows are kept as ``benchmarks/kernels/results/compile_check.json`` (for the docs page; a JSON
beside any other ``--out``) and the page is rendered from that file.

The configurations mirror what the wrappers in ``peftplug_kernels/*/triton.py`` launch on CUDA; when a wrapper's tiles
change, change them here too.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common.pages import outputs, render_results, write_json, write_page
from benchmarks.common.paths import DOCS, results_dir
from benchmarks.common.provenance import provenance
from benchmarks.kernels.sm90_compile import compile_sm90

PAGE = DOCS / "kernels_sm90.md"
RESULTS = results_dir("kernels") / "compile_check.json"
H200_MULTIPROCESSORS = 132
SM90_SHARED_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KB)



def _configs():
    """``(label, kernel, pointer/scalar types by argument, constexprs, options)`` for each launch we make."""
    from peftplug_kernels.block_rotate import triton as rotate
    from peftplug_kernels.cayley_neumann import triton as cn
    from peftplug_kernels.nf4_dequantize import triton as dequant

    for dtype in ("bf16", "fp16", "fp32"):
        half = dtype != "fp32"
        precision = "tf32" if half else "ieee"
        if half:  # the fused NF4 kernels take half-precision activations only (fp32 layers run unfused)
            yield from _w4a16_configs(dtype)
        for nested in (True, False):
            types = {"w_ptr": "*u8", "absmax_ptr": "*u8" if nested else "*fp32", "code_ptr": "*fp32",
                     "absmax2_ptr": "*fp32", "code2_ptr": "*fp32", "offset": "fp32", "out_ptr": f"*{dtype}"}
            rows, options = dequant.launch(4096 * 4096, 64)
            yield (f"nf4_dequantize {dtype} nested={nested}", dequant._dequantize_4bit_kernel, types,
                   {"QBLOCK": 64, "QBLOCK2": 256 if nested else 1, "NESTED": nested, "ROWS": rows}, options)
        for tile in (16, 32, 64):
            block_t = rotate.token_tile(4096, tile, itemsize=2 if half else 4)
            warps = {"num_warps": 4 if block_t * tile <= 4096 else 8}
            yield (f"block_rotate mm {dtype} tile {tile} × {block_t} tokens", rotate._block_mm_kernel,
                   {"a_ptr": f"*{dtype}", "m_ptr": "*fp32", "c_ptr": f"*{dtype}"},
                   {"BLOCK_T": block_t, "BLOCK_K": tile, "BLOCK_N": tile, "PRECISION": precision}, warps)
            yield (f"block_rotate atb {dtype} tile {tile}", rotate._block_atb_kernel,
                   {"a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "out_ptr": "*fp32"},
                   {"BLOCK_M": tile, "BLOCK_N": tile, "BLOCK_T": 64, "PRECISION": precision}, {})
            bwd_t = rotate.token_tile(4096, tile, rotate.GPU_SLAB // 2, 2 if half else 4)
            yield (f"block_rotate bwd (dX + dR) {dtype} b≤{tile} × {bwd_t} tokens", rotate._block_bwd_kernel,
                   {"x_ptr": f"*{dtype}", "g_ptr": f"*{dtype}", "m_ptr": "*fp32", "dx_ptr": f"*{dtype}",
                    "dr_ptr": "*fp32"},
                   {"HAS_DX": True, "HAS_DR": True, "BLOCK_T": bwd_t, "BB": tile, "PRECISION": precision},
                   {"num_warps": 8})
    for bb in (16, 32, 64):
        for name, kernel, types in (("forward", cn._cn_forward_kernel, {"q_ptr": "*fp32", "r_ptr": "*fp32"}),
                                    ("backward", cn._cn_backward_kernel,
                                     {"q_ptr": "*fp32", "g_ptr": "*fp32", "dq_ptr": "*fp32"})):
            yield (f"cayley_neumann {name} b≤{bb}", kernel, types, {"TERMS": 5, "LAST_COEFF": 2.0, "BB": bb},
                   {"num_warps": cn.gpu_num_warps(bb, backward=name == "backward")})


def _w4a16_configs(dtype: str):
    """The W4A16 kernels' candidates (what the GPU sweep times) at 16 / 4096 tokens of a 4096 × 4096 weight."""
    from peftplug_kernels.nf4_rotate_matmul import w4a16

    n = k = 4096
    common = {"w_ptr": "*u8", "code_ptr": "*fp32", "absmax2_ptr": "*fp32", "code2_ptr": "*fp32", "offset": "fp32"}
    regimes = (("decode", 16, w4a16.DECODE_CANDIDATES, True), ("gemm", 4096, w4a16.GEMM_CANDIDATES, False))
    for regime, tokens, candidates, in_prologue in regimes:
        for index, cfg in enumerate(candidates):
            cfg = w4a16.resolve(cfg, tokens, k // cfg.block_k, -(-n // cfg.block_n), 2 * H200_MULTIPROCESSORS)
            rotate = in_prologue and not cfg.prerotate
            for nested in (True, False) if index == 0 else (True,):
                types = {**common, "x_ptr": f"*{dtype}", "r_ptr": "*fp32", "absmax_ptr": "*u8" if nested else "*fp32",
                         "bias_ptr": f"*{dtype}", "y_ptr": "*fp32" if cfg.split > 1 else f"*{dtype}"}
                const = {"QBLOCK": 64 if cfg.block_k <= 64 else 128, "QBLOCK2": 256 if nested else 1,
                         "NESTED": nested, "ROTATE": rotate, "RB": 32, "HAS_BIAS": True, "SPLIT_K": cfg.split,
                         "FP32_DOT": False, "BLOCK_T": cfg.block_t, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
                         "GROUP_T": 8}
                label = (f"w4a16 forward {regime} {dtype} {cfg.block_t}×{cfg.block_n}×{cfg.block_k} split {cfg.split} "
                         f"{cfg.num_warps}w/{cfg.num_stages}s nested={nested} rotate={rotate}")
                yield (label, w4a16._forward_kernel, types, const,
                       {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    for cfg in w4a16.GRAD_CANDIDATES:
        cfg = w4a16.resolve(cfg, 16, -(-n // cfg.block_n), k // cfg.block_k, 2 * H200_MULTIPROCESSORS)
        types = {**common, "g_ptr": f"*{dtype}", "absmax_ptr": "*u8", "out_ptr": "*fp32" if cfg.split > 1 else f"*{dtype}"}
        const = {"QBLOCK": 64, "QBLOCK2": 256, "NESTED": True, "SPLIT_N": cfg.split, "FP32_DOT": False,
                 "BLOCK_T": cfg.block_t, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k}
        label = (f"w4a16 dX' {dtype} {cfg.block_t}×{cfg.block_n}×{cfg.block_k} split {cfg.split} "
                 f"{cfg.num_warps}w/{cfg.num_stages}s nested=True")
        yield label, w4a16._grad_input_kernel, types, const, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def _resources(cubin: bytes) -> dict[str, int]:
    """Registers, local (spill) and static shared bytes of a cubin, read with Triton's bundled cuobjdump."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        text = subprocess.run([str(tool), "--dump-resource-usage", str(path)], capture_output=True, text=True,
                              check=True).stdout
    match = re.search(r"REG:(\d+)\s+STACK:(\d+)", text)
    if match is None:
        raise RuntimeError(f"unexpected cuobjdump output: {text[:200]!r}")
    # Spilled registers live on the per-thread stack (cuobjdump's LOCAL stays 0 for them).
    return {"regs": int(match.group(1)), "stack": int(match.group(2))}


def render(record: dict) -> str:
    """The page of a compile check's rows.

    Args:
        record: ``{"triton": version, "rows": [[label, shared KB, registers, stack, compile s, status], ...]}``.
    """
    table = ["| kernel configuration | shared KB | registers | stack (spill) bytes | compile s | status |",
             "|---|---|---|---|---|---|"] + [f"| {' | '.join(r)} |" for r in record["rows"]]
    header = (f"# Triton kernels compiled for sm_90 (no GPU needed)\n\nGenerated by "
              f"`python -m benchmarks.kernels.compile_check` with Triton {record['triton']}: every launch "
              f"configuration of `peftplug_kernels/*/triton.py`, compiled by Triton's bundled ptxas for Hopper. "
              f"Registers are per thread (255 max); stack bytes > 0 are registers spilled to local memory.\n\n")
    ptx = record.get("ptx")
    if not ptx:
        return header + "\n".join(table) + "\n"
    lines = ["", "## The fused W4A16 NF4 forward's main loop in PTX (`python -m benchmarks.kernels.ptx_check`)", "",
             "| loop of | tensor-core instructions | ld.global | cp.async | scalar global reads | selp |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {label} | {' '.join(f'`{k}`' for k in prof['tensor_core'])} | {prof['ld_global']} | "
              f"{prof['cp_async']} | {prof['scalar_reads']} | {prof['selects']} |"
              for label, prof in ptx["profiles"].items()]
    lines += [""] + [f"- {'ok' if ok else '**FAIL**'}: {claim} ({why})" for claim, (ok, why) in ptx["claims"].items()]
    return header + "\n".join(table) + "\n" + "\n".join(lines) + "\n"


def report(results: Path = RESULTS, page: Path = PAGE) -> bool:
    """Renders the page from a committed result file. Returns whether
    there was one (:func:`benchmarks.common.pages.render_results`).

    Args:
        results: The JSON :func:`main` wrote.
        page: The Markdown page.
    """

    def render_page(record) -> None:
        write_page(page, render(record))

    return render_results(results, render_page)


def main(argv=None) -> int:
    """Compiles every configuration and prints a row each (``--out``: keeps them and writes the page).

    Args:
        argv: Command-line arguments.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this markdown file")
    parser.add_argument("--report", action="store_true", help="render the page from the committed results; exit")
    args = parser.parse_args(argv)
    if args.report:
        if not report():
            raise SystemExit(f"no result file at {RESULTS}: run with --out {PAGE} first")
        return 0
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    import triton

    # A private cache: compile seconds are real (not cache hits) and the user's cache is left alone.
    cache = tempfile.TemporaryDirectory()
    os.environ["TRITON_CACHE_DIR"] = cache.name
    rows, failures = [], 0
    for label, kernel, types, const, options in _configs():
        started = time.perf_counter()
        try:
            compiled = compile_sm90(kernel, types, const, options)
            shared = int(compiled.metadata.shared)
            res = _resources(compiled.asm["cubin"])
            ok = shared <= SM90_SHARED_LIMIT
            row = (label, f"{shared / 1024:.0f}", str(res["regs"]), str(res["stack"]),
                   f"{time.perf_counter() - started:.1f}", "ok" if ok else "shared memory over 227 KB")
        except Exception as err:  # noqa: BLE001  (report every configuration, then fail)
            ok = False
            row = (label, "-", "-", "-", f"{time.perf_counter() - started:.1f}", f"{type(err).__name__}: {err}"[:120])
        failures += not ok
        rows.append(row)
        print(" | ".join(row), flush=True)
    from benchmarks.kernels.ptx_check import findings

    ptx = findings()
    failures += sum(not ok for ok, _ in ptx["claims"].values())
    for claim, (ok, why) in ptx["claims"].items():
        print(f"{'ok' if ok else 'FAIL'}: {claim} ({why})")
    if args.out:
        page, results = outputs(args.out, PAGE, RESULTS)
        write_json(results, {"triton": triton.__version__, "rows": [list(r) for r in rows], "ptx": ptx,
                             "provenance": provenance(("peftplug_kernels", "benchmarks/kernels"))})
        report(results, page)
    cache.cleanup()
    print(f"{sum(r[-1] == 'ok' for r in rows)}/{len(rows)} configurations compile within sm_90 limits")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
